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

-- idem_stats() accounts for every copy: "queued" now counts every copy
-- handed to the commit ring (those it had no room for too, also counted
-- in "dropped"), and copies the worker skips are counted by reason, so
-- that queued = copied + dropped + rejected + skipped + queue_depth.
-- "queue_age" is how long the oldest copy in the ring has waited.
--
-- A new row type needs a new function, as in 0.3: views over idem_stats()
-- are refused first, and the grants operators made on it are made again,
-- each by the role that made it (a role granted EXECUTE WITH GRANT OPTION
-- keeps the grants it made, so that its own REVOKE still works).
DO $$
DECLARE
    deps text;
BEGIN
    SELECT pg_catalog.string_agg(
               CASE WHEN d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_rewrite'::pg_catalog.regclass
                    THEN (SELECT pg_catalog.format('view %s', r.ev_class::pg_catalog.regclass)
                            FROM pg_catalog.pg_rewrite r WHERE r.oid OPERATOR(pg_catalog.=) d.objid)
                    ELSE pg_catalog.pg_describe_object(d.classid, d.objid, d.objsubid) END,
               ', ')
      INTO deps
      FROM pg_catalog.pg_depend d
     WHERE d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
       AND d.refobjid OPERATOR(pg_catalog.=) '@extschema@.idem_stats()'::pg_catalog.regprocedure
       AND d.deptype OPERATOR(pg_catalog.=) 'n';
    IF deps IS NOT NULL THEN
        RAISE EXCEPTION 'cannot update idem to 0.4: objects depend on idem_stats()'
            USING ERRCODE = 'dependent_objects_still_exist',
                  DETAIL = pg_catalog.format('0.4 re-creates idem_stats() with more columns; these depend on the old one: %s.', deps),
                  HINT = 'Drop them, run ALTER EXTENSION idem UPDATE again, then create them again (over the new idem_stats()).';
    END IF;
END $$;
ALTER FUNCTION @extschema@.idem_stats() RENAME TO idem_stats_0_3;
CREATE FUNCTION @extschema@.idem_stats(
    OUT preloaded boolean,                 -- idem is in shared_preload_libraries
    OUT valkey_connected boolean,          -- the worker holds a Valkey connection
    OUT queued bigint,                     -- copies handed to the commit ring
    OUT copied bigint,                     -- copies written to Valkey (SET answered OK)
    OUT dropped bigint,                    -- copies the ring had no room for
    OUT copy_errors bigint,                -- failed connects and batches; their copies are resent
    OUT rejected bigint,                   -- copies Valkey refused one by one; dropped
    OUT queue_stalls bigint,               -- times a committer held the ring's oldest copy unwritten over 1 s
    OUT queue_depth bigint,                -- copies waiting in the ring now
    OUT last_error text,                   -- the worker's last failure, with its time
    OUT claims_claimed bigint,             -- claim decisions since the server started
    OUT claims_completed bigint,
    OUT claims_failed_permanent bigint,
    OUT claims_busy bigint,
    OUT claims_mismatch bigint,
    OUT valkey_cluster boolean,            -- the worker talks to a Valkey Cluster
    OUT valkey_redirects bigint,           -- MOVED and ASK replies followed
    OUT valkey_map_refreshes bigint,       -- cluster slot maps read
    OUT valkey_node_errors bigint,         -- failed connects/exchanges with a cluster node
    OUT valkey_cluster_retries bigint,     -- CLUSTERDOWN/TRYAGAIN/READONLY answers retried
    OUT valkey_nodes text,                 -- each node: host:port, master or not, errors
    OUT skipped bigint,                    -- copies not written, for one of the reasons below
    OUT skipped_expired bigint,            -- ... their row's retention ended in the ring
    OUT skipped_unjoined bigint,           -- ... (Citus) this node had not joined its cluster's keyspace
    OUT skipped_epoch bigint,              -- ... read or committed under an older history epoch
    OUT queue_age interval,                -- how long the oldest copy in the ring has waited
    OUT outbox_waiting bigint,             -- messages of this database's idem_emit() not published yet
    OUT outbox_age interval,               -- how long the oldest of them has waited
    OUT published bigint,                  -- messages written to their streams (XADD), every database
    OUT publish_errors bigint)             -- failed connects and XADDs of the publishers; their messages wait
RETURNS record
AS 'MODULE_PATHNAME', 'idem_stats'
LANGUAGE C VOLATILE STRICT PARALLEL SAFE;

REVOKE ALL ON FUNCTION @extschema@.idem_stats() FROM PUBLIC;

-- 0.3's grants, again, each by its grantor: the owner's as the owner (the
-- superuser running the update grants as the owner), any other's under
-- SET ROLE to that grantor, once it holds its grant option (granted in an
-- earlier pass).  The initial privileges are then set back to a fresh
-- install's, as in 0.3.
DO $$
DECLARE
    fresh pg_catalog.aclitem[];
    role_was text := pg_catalog.current_setting('role');
    g record;
    made integer;
    waiting integer;
BEGIN
    SELECT p.proacl INTO fresh FROM pg_catalog.pg_proc p
     WHERE p.oid OPERATOR(pg_catalog.=) '@extschema@.idem_stats()'::pg_catalog.regprocedure;
    LOOP
        made := 0;
        waiting := 0;
        FOR g IN
            SELECT e.grantor, e.grantee, e.is_grantable,
                   e.grantor OPERATOR(pg_catalog.=) p.proowner AS by_owner,
                   e.grantor OPERATOR(pg_catalog.=) n.proowner
                   OR EXISTS (SELECT FROM pg_catalog.aclexplode(n.proacl) h
                               WHERE h.grantee OPERATOR(pg_catalog.=) e.grantor
                                 AND h.is_grantable) AS can_grant
              FROM pg_catalog.pg_proc p, pg_catalog.pg_proc n,
                   pg_catalog.aclexplode(COALESCE(p.proacl, pg_catalog.acldefault('f', p.proowner))) e
             WHERE p.oid OPERATOR(pg_catalog.=) '@extschema@.idem_stats_0_3()'::pg_catalog.regprocedure
               AND n.oid OPERATOR(pg_catalog.=) '@extschema@.idem_stats()'::pg_catalog.regprocedure
               AND e.privilege_type OPERATOR(pg_catalog.=) 'EXECUTE'
               AND e.grantee OPERATOR(pg_catalog.<>) p.proowner
               AND NOT EXISTS (SELECT FROM pg_catalog.aclexplode(n.proacl) d
                                WHERE d.grantee OPERATOR(pg_catalog.=) e.grantee
                                  AND (d.grantor OPERATOR(pg_catalog.=) e.grantor
                                       OR (e.grantor OPERATOR(pg_catalog.=) p.proowner
                                           AND d.grantor OPERATOR(pg_catalog.=) n.proowner))
                                  AND d.is_grantable OPERATOR(pg_catalog.>=) e.is_grantable)
        LOOP
            IF NOT (g.by_owner OR g.can_grant) THEN
                waiting := waiting OPERATOR(pg_catalog.+) 1;
                CONTINUE;
            END IF;
            IF NOT g.by_owner THEN
                PERFORM pg_catalog.set_config('role', pg_catalog.pg_get_userbyid(g.grantor), true);
            END IF;
            EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION @extschema@.idem_stats() TO %s%s%s',
                                      CASE WHEN g.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
                                           ELSE pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(g.grantee)) END,
                                      CASE WHEN g.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END,
                                      CASE WHEN g.by_owner THEN ''
                                           ELSE ' GRANTED BY ' OPERATOR(pg_catalog.||)
                                                pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(g.grantor)) END);
            PERFORM pg_catalog.set_config('role', role_was, true);
            made := made OPERATOR(pg_catalog.+) 1;
        END LOOP;
        EXIT WHEN waiting OPERATOR(pg_catalog.=) 0 OR made OPERATOR(pg_catalog.=) 0;
    END LOOP;
    UPDATE pg_catalog.pg_init_privs SET initprivs = fresh
     WHERE objoid OPERATOR(pg_catalog.=) '@extschema@.idem_stats()'::pg_catalog.regprocedure
       AND classoid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
       AND objsubid OPERATOR(pg_catalog.=) 0;
    DELETE FROM pg_catalog.pg_shdepend
     WHERE deptype OPERATOR(pg_catalog.=) 'i'
       AND dbid OPERATOR(pg_catalog.=) (SELECT d.oid FROM pg_catalog.pg_database d
                                         WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())
       AND classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
       AND objid OPERATOR(pg_catalog.=) '@extschema@.idem_stats()'::pg_catalog.regprocedure;
END $$;
DROP FUNCTION @extschema@.idem_stats_0_3();

-- The outbox: a handler's outgoing messages (idem_emit), written in the
-- handler's transaction, so that they commit or vanish with its effect.
-- The publisher of the database sends each to its Valkey stream once its
-- commit is durable (XADD <stream> * id <message_id> body <message>), in
-- seq order, then deletes it.  WAL-logged: a crash, a restore or a
-- promotion keeps what waits.  Nobody but idem writes it.
CREATE TABLE @extschema@.idem_outbox (
    seq        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    stream     text NOT NULL,
    message_id text NOT NULL,
    body       jsonb NOT NULL,
    emitted_at timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp()
);
REVOKE ALL ON TABLE @extschema@.idem_outbox FROM PUBLIC;
SELECT pg_catalog.pg_extension_config_dump('@extschema@.idem_outbox', '');
SELECT pg_catalog.pg_extension_config_dump('@extschema@.idem_outbox_seq_seq', '');

-- Record an outgoing message of the run whose claim this transaction
-- holds (key: which one, when it holds more than one).  Returns the
-- message's id, <the key in hex>-<n>: the n-th message of that run in this
-- transaction, the same when the run runs again.
CREATE FUNCTION @extschema@.idem_emit(stream text, message jsonb, key bytea DEFAULT NULL)
RETURNS text
AS 'MODULE_PATHNAME', 'idem_emit'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

REVOKE ALL ON FUNCTION @extschema@.idem_emit(text, jsonb, bytea) FROM PUBLIC;

-- The same for the tenant ledger's claim of key for tenant_id, named
-- outright.  On Citus idem_install (and this update, on the coordinator)
-- delegates it by tenant_id, as idem_claim: it runs on the worker node
-- that holds the claim, whose own outbox and publisher take the message.
CREATE FUNCTION @extschema@.idem_emit(tenant_id bigint, key bytea, stream text, message jsonb)
RETURNS text
AS 'MODULE_PATHNAME', 'idem_emit_tenant'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

REVOKE ALL ON FUNCTION @extschema@.idem_emit(bigint, bytea, text, jsonb) FROM PUBLIC;

-- The messages of one run, [[stream, message], ...], for the tenant
-- ledger's claim of key for tenant_id, recorded in order as idem_emit
-- records each; their ids.  The runners send a run's messages with it in
-- one statement, which Citus delegates by tenant_id like the rest.
CREATE FUNCTION @extschema@.idem_emit_many(tenant_id bigint, key bytea, messages jsonb)
RETURNS text[]
AS 'MODULE_PATHNAME', 'idem_emit_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

REVOKE ALL ON FUNCTION @extschema@.idem_emit_many(bigint, bytea, jsonb) FROM PUBLIC;
