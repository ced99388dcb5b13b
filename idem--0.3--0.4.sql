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

-- The lease-mode fence that survives purges.  A claim answers its fence:
-- the id of the key's row for this claim, drawn from the ledger's identity
-- sequence and never used again (a takeover gives the row a new id, a row
-- purged and claimed again is a new row).  NULL unless claimed.
ALTER TYPE @extschema@.idem_claim_result ADD ATTRIBUTE fence bigint;

-- Complete or fail a lease-mode claim, fenced by the fence its claim
-- answered: refused (55000) when another claim holds the key now, even
-- after the claim's row was purged and the key claimed again (which the
-- attempt of idem_complete(..., attempt => n) cannot tell).
CREATE FUNCTION @extschema@.idem_complete_fenced(tenant_id bigint, key bytea, fence bigint,
                                                 outcome jsonb,
                                                 retention interval DEFAULT NULL)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_complete_fenced'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.idem_fail_fenced(tenant_id bigint, key bytea, fence bigint,
                                             detail jsonb, retryable boolean,
                                             retention interval DEFAULT NULL)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_fail_fenced'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.idem_platform_complete_fenced(key bytea, fence bigint, outcome jsonb,
                                                          retention interval DEFAULT NULL)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_platform_complete_fenced'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.idem_platform_fail_fenced(key bytea, fence bigint, detail jsonb,
                                                      retryable boolean,
                                                      retention interval DEFAULT NULL)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_platform_fail_fenced'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

REVOKE ALL ON FUNCTION
    @extschema@.idem_complete_fenced(bigint, bytea, bigint, jsonb, interval),
    @extschema@.idem_fail_fenced(bigint, bytea, bigint, jsonb, boolean, interval),
    @extschema@.idem_platform_complete_fenced(bytea, bigint, jsonb, interval),
    @extschema@.idem_platform_fail_fenced(bytea, bigint, jsonb, boolean, interval)
FROM PUBLIC;

-- Start a new history epoch when the calling transaction commits, as a
-- DELETE of ledger rows does: for changes to a ledger that PostgreSQL does
-- not report (pg_surgery's heap_force_kill, a data file put back by hand).
-- Runners stop replaying what Valkey holds for the old history.
CREATE FUNCTION @extschema@.idem_renew_epoch()
RETURNS void
AS 'MODULE_PATHNAME', 'idem_renew_epoch'
LANGUAGE C VOLATILE STRICT PARALLEL UNSAFE;

REVOKE ALL ON FUNCTION @extschema@.idem_renew_epoch() FROM PUBLIC;
