-- idem 0.2 -> 0.3.  A fresh install runs 0.1, 0.1 -> 0.2, then this script.

\echo Use "ALTER EXTENSION idem UPDATE TO '0.3'" to load this file. \quit

-- The Valkey namespace of this database right now:
-- <idem.valkey_prefix><system identifier>.<timeline>.<database oid>:
-- Raises 55000 during recovery (nothing is copied there).
CREATE FUNCTION @extschema@.idem_cache_keyspace()
RETURNS text
AS 'MODULE_PATHNAME', 'idem_cache_keyspace_sql'
LANGUAGE C STABLE STRICT PARALLEL SAFE;

-- The secrets that MAC Valkey values: the current one, then the previous
-- one (still accepted) if any; on each row, the history epoch's owner key
-- in Valkey and the token it holds while this server owns the epoch (NULL
-- until the worker took the epoch over): a client trusts a value only if
-- the owner key, read in the same round trip, still holds that token.
-- Grant EXECUTE to the client's handler role.
CREATE FUNCTION @extschema@.idem_cache_secrets(
    OUT key_id integer, OUT secret bytea, OUT is_current boolean,
    OUT owner_key text, OUT owner_token text)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'idem_cache_secrets'
LANGUAGE C VOLATILE STRICT PARALLEL SAFE ROWS 2;

-- A new current secret (key id + 1); the old current one stays accepted
-- until the next rotation.
CREATE FUNCTION @extschema@.idem_rotate_cache_secret()
RETURNS integer
AS 'MODULE_PATHNAME', 'idem_rotate_cache_secret'
LANGUAGE C VOLATILE STRICT PARALLEL UNSAFE;

REVOKE ALL ON FUNCTION
    @extschema@.idem_cache_keyspace(),
    @extschema@.idem_cache_secrets(),
    @extschema@.idem_rotate_cache_secret()
FROM PUBLIC;

-- The batch API (src/ledger_batch.c): claim or complete many keys in one
-- statement.  Arrays are parallel; ord is the 1-based position of the key.
-- At most max_locks_per_transaction keys per call (each claimed key holds
-- one lock until the transaction ends).
CREATE FUNCTION @extschema@.idem_claim_many(tenant_ids bigint[], keys bytea[],
                                            fingerprints bytea[],
                                            lease interval DEFAULT NULL)
RETURNS TABLE(ord integer, decision text, attempt integer, outcome jsonb,
              expires_at timestamptz)
AS 'MODULE_PATHNAME', 'idem_claim_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 32;

CREATE FUNCTION @extschema@.idem_complete_many(tenant_ids bigint[], keys bytea[],
                                               outcomes jsonb[],
                                               retention interval DEFAULT NULL)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_complete_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.idem_platform_claim_many(keys bytea[], fingerprints bytea[],
                                                     lease interval DEFAULT NULL)
RETURNS TABLE(ord integer, decision text, attempt integer, outcome jsonb,
              expires_at timestamptz)
AS 'MODULE_PATHNAME', 'idem_platform_claim_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 32;

CREATE FUNCTION @extschema@.idem_platform_complete_many(keys bytea[], outcomes jsonb[],
                                                        retention interval DEFAULT NULL)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_platform_complete_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

REVOKE ALL ON FUNCTION
    @extschema@.idem_claim_many(bigint[], bytea[], bytea[], interval),
    @extschema@.idem_complete_many(bigint[], bytea[], jsonb[], interval),
    @extschema@.idem_platform_claim_many(bytea[], bytea[], interval),
    @extschema@.idem_platform_complete_many(bytea[], jsonb[], interval)
FROM PUBLIC;

-- idem_stats() gains "rejected": copies Valkey refused one by one (for
-- example NOPERM for a key the server's ACL refuses), dropped; copy_errors now counts only
-- failures that keep the copies queued (connects, timeouts, replies such as
-- READONLY or LOADING that say the server cannot take writes now).
-- It also gains "queue_stalls" (a committing backend stopped between
-- reserving its copy in the commit queue and writing it: everything behind
-- it waits) and the Valkey Cluster columns.
--
-- A new row type needs a new function (CREATE OR REPLACE cannot change it).
-- Objects that depend on idem_stats() (a view over it) cannot follow it to
-- the new one: the update refuses them first, saying what to do, instead of
-- failing on the DROP below.  The grants operators made on idem_stats() (a
-- monitoring role) are made again on the new function: 0.2 is renamed
-- away, 0.3's is created, 0.2's ACL granted again, then 0.2's is dropped.
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
        RAISE EXCEPTION 'cannot update idem to 0.3: objects depend on idem_stats()'
            USING ERRCODE = 'dependent_objects_still_exist',
                  DETAIL = pg_catalog.format('0.3 re-creates idem_stats() with more columns; these depend on the old one: %s.', deps),
                  HINT = 'Drop them, run ALTER EXTENSION idem UPDATE again, then create them again (over the new idem_stats()).';
    END IF;
END $$;
ALTER FUNCTION @extschema@.idem_stats() RENAME TO idem_stats_0_2;
CREATE FUNCTION @extschema@.idem_stats(
    OUT preloaded boolean,                 -- idem is in shared_preload_libraries
    OUT valkey_connected boolean,          -- the worker holds a Valkey connection
    OUT queued bigint,                     -- copies accepted into the commit queue
    OUT copied bigint,                     -- copies written to Valkey (SET answered OK)
    OUT dropped bigint,                    -- copies refused because the queue was full
    OUT copy_errors bigint,                -- failed connects and batches; their copies are resent
    OUT rejected bigint,                   -- copies Valkey refused one by one; dropped
    OUT queue_stalls bigint,               -- times a committer held the queue's oldest copy unwritten over 1 s
    OUT queue_depth bigint,                -- copies waiting in the queue now
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
    OUT valkey_nodes text)                 -- each node: host:port, master or not, errors
RETURNS record
AS 'MODULE_PATHNAME', 'idem_stats'
LANGUAGE C VOLATILE STRICT PARALLEL SAFE;

REVOKE ALL ON FUNCTION @extschema@.idem_stats() FROM PUBLIC;

-- 0.2's grants, again, each by its grantor (the owner's as the owner, any
-- other's under SET ROLE to that grantor once it holds its grant option, so
-- that a grantor's own REVOKE still works).  A GRANT in an extension script is also recorded as
-- the function's initial privileges, which pg_dump leaves out of a dump: so
-- those are set back to what a fresh install records (the ACL above), and
-- pg_dump still dumps the grants.  (On PostgreSQL 17 and later the initial
-- privileges' roles are also recorded as shared dependencies, kind 'i':
-- none is left for the roles granted here, as after a fresh install.)
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
             WHERE p.oid OPERATOR(pg_catalog.=) '@extschema@.idem_stats_0_2()'::pg_catalog.regprocedure
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
DROP FUNCTION @extschema@.idem_stats_0_2();

-- The registry of the ledgers: idem_install records each ledger here by
-- OID, and the API uses only the recorded tables, never whatever table has
-- a ledger's name.  A configuration table, so pg_dump dumps its rows (as
-- names, which a restore resolves to the restored tables).  Written only by
-- idem_install, which also tells every session to look again.
CREATE TABLE @extschema@.idem_ledgers (
    kind   text PRIMARY KEY CHECK (kind IN ('tenant', 'platform')),
    ledger regclass NOT NULL
);
COMMENT ON TABLE @extschema@.idem_ledgers IS
    'idem: the ledger tables idem_install recorded (do not edit; run idem_install)';
SELECT pg_catalog.pg_extension_config_dump('@extschema@.idem_ledgers', '');
REVOKE ALL ON @extschema@.idem_ledgers FROM PUBLIC;
GRANT SELECT ON @extschema@.idem_ledgers TO PUBLIC;

-- Ledgers that 0.2's idem_install created are recorded as they are, if the
-- extension's owner or the role running the update owns them; any other
-- table waits for idem_install, which checks its owner and shape.
INSERT INTO @extschema@.idem_ledgers (kind, ledger)
SELECT v.kind, c.oid::pg_catalog.regclass
  FROM (VALUES ('tenant', 'idempotency_keys'),
               ('platform', 'platform_idempotency_keys')) AS v(kind, name)
  JOIN pg_catalog.pg_class c
    ON c.relname OPERATOR(pg_catalog.=) v.name
   AND c.relnamespace OPERATOR(pg_catalog.=) '@extschema@'::pg_catalog.regnamespace
 WHERE c.relowner OPERATOR(pg_catalog.=) (SELECT extowner FROM pg_catalog.pg_extension WHERE extname OPERATOR(pg_catalog.=) 'idem')
    OR c.relowner OPERATOR(pg_catalog.=) current_user::pg_catalog.regrole;

-- idem_apply (src/ledger_apply.c): claim, run the caller's SQL function as
-- the effect, and complete or fail the key, in one statement.  The handler
-- is a function (args jsonb) RETURNS jsonb (the outcome); it runs as the
-- caller, who needs EXECUTE on it.  ran tells whether it ran in this call:
-- decision applied, failed_retryable or failed_permanent (an error it
-- raised, recorded); otherwise the claim's answer (completed,
-- failed_permanent, busy, mismatch).
CREATE FUNCTION @extschema@.idem_apply(tenant_id bigint, key bytea, fingerprint bytea,
                                       handler regprocedure, args jsonb,
                                       retention interval DEFAULT NULL)
RETURNS TABLE(decision text, attempt integer, outcome jsonb,
              expires_at timestamptz, ran boolean)
AS 'MODULE_PATHNAME', 'idem_apply'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 1;

CREATE FUNCTION @extschema@.idem_platform_apply(key bytea, fingerprint bytea,
                                                handler regprocedure, args jsonb,
                                                retention interval DEFAULT NULL)
RETURNS TABLE(decision text, attempt integer, outcome jsonb,
              expires_at timestamptz, ran boolean)
AS 'MODULE_PATHNAME', 'idem_platform_apply'
LANGUAGE C VOLATILE PARALLEL UNSAFE ROWS 1;

REVOKE ALL ON FUNCTION
    @extschema@.idem_apply(bigint, bytea, bytea, regprocedure, jsonb, interval),
    @extschema@.idem_platform_apply(bytea, bytea, regprocedure, jsonb, interval)
FROM PUBLIC;

-- The batch API's failures: every key failed with its detail, retryably or
-- permanently as its element of retryable says.
CREATE FUNCTION @extschema@.idem_fail_many(tenant_ids bigint[], keys bytea[],
                                           details jsonb[], retryable boolean[],
                                           retention interval DEFAULT NULL)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_fail_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.idem_platform_fail_many(keys bytea[], details jsonb[],
                                                    retryable boolean[],
                                                    retention interval DEFAULT NULL)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_platform_fail_many'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

REVOKE ALL ON FUNCTION
    @extschema@.idem_fail_many(bigint[], bytea[], jsonb[], boolean[], interval),
    @extschema@.idem_platform_fail_many(bytea[], jsonb[], boolean[], interval)
FROM PUBLIC;

-- On Citus: one purge batch on a shard of the tenant ledger, which
-- idem_purge() runs on every shard from the coordinator, as the extension's
-- owner, once it has checked the caller's privileges on the ledger.  Only
-- expired rows go; unlike a DELETE by hand, it does not start a new cache
-- epoch on the node.
CREATE FUNCTION @extschema@.idem_shard_purge(shard regclass,
                                             terminal_before timestamptz,
                                             processing_before timestamptz,
                                             finished_before timestamptz,
                                             batch integer)
RETURNS bigint
AS 'MODULE_PATHNAME', 'idem_shard_purge'
LANGUAGE C VOLATILE STRICT PARALLEL UNSAFE;

REVOKE ALL ON FUNCTION @extschema@.idem_shard_purge(regclass, timestamptz, timestamptz,
                                                    timestamptz, integer) FROM PUBLIC;

-- On Citus: one Valkey cache for the cluster.  The coordinator's
-- idem_cache_keyspace() asks each worker node for its identity and a
-- one-time key, then sends it the cluster's keyspace and the coordinator's
-- secrets sealed with that key.  Only the coordinator calls these, as the
-- extension's owner.
CREATE FUNCTION @extschema@.idem_cache_node()
RETURNS text
AS 'MODULE_PATHNAME', 'idem_cache_node'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.idem_cache_node_join(keyspace text, identity text, sealed text)
RETURNS boolean
AS 'MODULE_PATHNAME', 'idem_cache_node_join'
LANGUAGE C VOLATILE STRICT PARALLEL UNSAFE;

REVOKE ALL ON FUNCTION @extschema@.idem_cache_node(),
    @extschema@.idem_cache_node_join(text, text, text) FROM PUBLIC;

-- Inside an idem_apply handler, the attempt it runs as (1, then 2 after a
-- retryable failure, ...); NULL elsewhere.  Backend-local: not in parallel
-- workers.
CREATE FUNCTION @extschema@.idem_attempt()
RETURNS integer
AS 'MODULE_PATHNAME', 'idem_attempt'
LANGUAGE C VOLATILE PARALLEL RESTRICTED;

REVOKE ALL ON FUNCTION @extschema@.idem_attempt() FROM PUBLIC;
