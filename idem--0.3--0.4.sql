-- idem 0.3 -> 0.4.  A fresh install runs 0.1, 0.1 -> 0.2, 0.2 -> 0.3, then
-- this script.

\echo Use "ALTER EXTENSION idem UPDATE TO '0.4'" to load this file. \quit

-- One key per message: idem_key() and idem_fingerprint() hash the
-- database's bytes and the clients hash UTF-8, so in a database of another
-- encoding one message would have two keys (and the Valkey copies would
-- carry bytes no client reads).  idem refuses such a database here (a
-- fresh CREATE EXTENSION runs this script, and so does the update from
-- 0.3) and in idem_install().
DO $$
BEGIN
    IF pg_catalog.getdatabaseencoding() OPERATOR(pg_catalog.<>) 'UTF8' THEN
        RAISE EXCEPTION 'idem requires a database with encoding UTF8, not %',
                        pg_catalog.getdatabaseencoding()
            USING ERRCODE = 'feature_not_supported',
                  DETAIL = 'Keys and fingerprints are hashes of UTF-8 text, as every client computes them.',
                  HINT = 'Create the database with ENCODING ''UTF8'' (CREATE DATABASE ... TEMPLATE template0 ENCODING ''UTF8'').';
    END IF;
END $$;
