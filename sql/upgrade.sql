-- 0.1 -> the current version by ALTER EXTENSION gives the same objects as a
-- fresh install; the library serves the older SQL objects meanwhile.
CREATE EXTENSION idem VERSION '0.1';
SELECT extversion FROM pg_extension WHERE extname = 'idem';
CREATE TABLE tenants (id bigint PRIMARY KEY);
INSERT INTO tenants VALUES (1);
SELECT idem_install('tenants');
SELECT decision FROM idem_claim(1, idem_key('u', '1'), idem_fingerprint('{}'));

ALTER EXTENSION idem UPDATE;
SELECT extversion FROM pg_extension WHERE extname = 'idem';
-- The ledger and its rows are untouched by the update, and recorded.
SELECT kind, ledger FROM idem_ledgers ORDER BY kind;
SELECT status, attempt FROM idem_lookup(1, idem_key('u', '1'));

CREATE TEMP TABLE updated AS
SELECT pg_describe_object(classid, objid, objsubid) AS object,
       CASE WHEN classid = 'pg_proc'::regclass
            THEN (SELECT proacl::text FROM pg_proc WHERE oid = objid) END AS acl
  FROM pg_depend
 WHERE refclassid = 'pg_extension'::regclass AND deptype = 'e'
   AND refobjid = (SELECT oid FROM pg_extension WHERE extname = 'idem');

DROP EXTENSION idem;
CREATE EXTENSION idem;
SELECT extversion FROM pg_extension WHERE extname = 'idem';
CREATE TEMP TABLE fresh AS
SELECT pg_describe_object(classid, objid, objsubid) AS object,
       CASE WHEN classid = 'pg_proc'::regclass
            THEN (SELECT proacl::text FROM pg_proc WHERE oid = objid) END AS acl
  FROM pg_depend
 WHERE refclassid = 'pg_extension'::regclass AND deptype = 'e'
   AND refobjid = (SELECT oid FROM pg_extension WHERE extname = 'idem');

SELECT count(*) > 10 AS has_objects FROM fresh;
(SELECT 'only after update' AS side, * FROM updated EXCEPT SELECT 'only after update', * FROM fresh)
UNION ALL
(SELECT 'only in fresh', * FROM fresh EXCEPT SELECT 'only in fresh', * FROM updated);
-- The ledgers survived DROP EXTENSION (they are the application's data),
-- and the fresh install recorded them again: the same role owns them.
SELECT kind, ledger FROM idem_ledgers ORDER BY kind;
SELECT status, attempt FROM idem_lookup(1, idem_key('u', '1'));

-- An operator's grant on idem_stats() survives the update from 0.2, which
-- re-creates the function (its columns changed), and pg_dump still dumps it:
-- the function's initial privileges are those of a fresh install (as those
-- of idem_purge, never re-created).  Grants on other functions are untouched.
DROP EXTENSION idem;
CREATE EXTENSION idem VERSION '0.2';
CREATE ROLE regress_idem_monitor;
GRANT EXECUTE ON FUNCTION idem_stats() TO regress_idem_monitor;
GRANT EXECUTE ON FUNCTION idem_purge(integer) TO regress_idem_monitor WITH GRANT OPTION;
ALTER EXTENSION idem UPDATE;
SELECT extversion FROM pg_extension WHERE extname = 'idem';
SELECT has_function_privilege('regress_idem_monitor', 'idem_stats()', 'EXECUTE') AS stats,
       has_function_privilege('regress_idem_monitor', 'idem_purge(integer)', 'EXECUTE WITH GRANT OPTION') AS purge,
       has_function_privilege('public', 'idem_stats()', 'EXECUTE') AS public_stats;
SELECT (SELECT initprivs FROM pg_init_privs WHERE objoid = 'idem_stats()'::regprocedure)
     = (SELECT initprivs FROM pg_init_privs WHERE objoid = 'idem_purge(integer)'::regprocedure)
       AS initprivs_as_fresh;
-- (PostgreSQL 17+ records the roles of initial privileges as shared
-- dependencies: none is left behind for the role granted again.)
SELECT count(*) AS initacl_deps FROM pg_shdepend
 WHERE deptype = 'i' AND classid = 'pg_proc'::regclass
   AND objid = 'idem_stats()'::regprocedure;
SET ROLE regress_idem_monitor;
SELECT rejected >= 0 AS new_columns FROM idem_stats();
RESET ROLE;
-- From 0.1 too (0.1 -> 0.2 -> 0.3 in one update): grants on 0.1's functions.
DROP EXTENSION idem;
CREATE EXTENSION idem VERSION '0.1';
GRANT EXECUTE ON FUNCTION idem_claim(bigint, bytea, bytea, interval) TO regress_idem_monitor;
ALTER EXTENSION idem UPDATE;
SELECT has_function_privilege('regress_idem_monitor', 'idem_claim(bigint, bytea, bytea, interval)', 'EXECUTE') AS claim,
       has_function_privilege('regress_idem_monitor', 'idem_stats()', 'EXECUTE') AS stats;
-- A view over idem_stats() cannot follow the function to its new row type:
-- the update refuses before changing anything, and says what to do.
DROP EXTENSION idem;
CREATE EXTENSION idem VERSION '0.2';
CREATE VIEW copy_stats AS SELECT queued, copied FROM idem_stats();
\set SHOW_CONTEXT never
ALTER EXTENSION idem UPDATE;
\set SHOW_CONTEXT errors
SELECT extversion FROM pg_extension WHERE extname = 'idem';
DROP VIEW copy_stats;
ALTER EXTENSION idem UPDATE;
SELECT extversion FROM pg_extension WHERE extname = 'idem';
CREATE VIEW copy_stats AS SELECT queued, copied, rejected FROM idem_stats();
DROP VIEW copy_stats;
-- A grant made by a role that holds the grant option stays that role's
-- through each update that re-creates idem_stats() (0.2 -> 0.3 -> 0.4, and
-- 0.3 -> 0.4), so that the role's own REVOKE still takes it back.
CREATE ROLE regress_idem_delegate;
-- (The function is looked up at each call: PostgreSQL 18 keeps a SQL
-- function's plan, and the extension is created again between calls.)
CREATE FUNCTION stats_grants() RETURNS TABLE (grantee text, grantor text, grantable boolean)
LANGUAGE sql AS $$
  SELECT CASE WHEN e.grantee = 0 THEN 'PUBLIC' ELSE e.grantee::regrole::text END,
         CASE WHEN e.grantor = p.proowner THEN 'the owner' ELSE e.grantor::regrole::text END,
         e.is_grantable
    FROM pg_proc p, aclexplode(p.proacl) e
   WHERE p.oid = to_regprocedure('idem_stats()') AND e.grantee <> p.proowner
   ORDER BY 1
$$;
DROP EXTENSION idem;
CREATE EXTENSION idem VERSION '0.2';
GRANT EXECUTE ON FUNCTION idem_stats() TO regress_idem_delegate WITH GRANT OPTION;
SET ROLE regress_idem_delegate;
GRANT EXECUTE ON FUNCTION idem_stats() TO regress_idem_monitor;
RESET ROLE;
ALTER EXTENSION idem UPDATE;
SELECT * FROM stats_grants();
SET ROLE regress_idem_delegate;
REVOKE EXECUTE ON FUNCTION idem_stats() FROM regress_idem_monitor;
RESET ROLE;
SELECT has_function_privilege('regress_idem_monitor', 'idem_stats()', 'EXECUTE') AS after_revoke;
DROP EXTENSION idem;
CREATE EXTENSION idem VERSION '0.3';
GRANT EXECUTE ON FUNCTION idem_stats() TO regress_idem_delegate WITH GRANT OPTION;
SET ROLE regress_idem_delegate;
GRANT EXECUTE ON FUNCTION idem_stats() TO regress_idem_monitor WITH GRANT OPTION;
RESET ROLE;
SET ROLE regress_idem_monitor;
GRANT EXECUTE ON FUNCTION idem_stats() TO PUBLIC;
RESET ROLE;
ALTER EXTENSION idem UPDATE;
SELECT * FROM stats_grants();
SET ROLE regress_idem_monitor;
REVOKE EXECUTE ON FUNCTION idem_stats() FROM PUBLIC;
RESET ROLE;
SELECT has_function_privilege('public', 'idem_stats()', 'EXECUTE') AS public_after_revoke;
DROP FUNCTION stats_grants();
DROP EXTENSION idem;
CREATE EXTENSION idem;
DROP ROLE regress_idem_delegate;
DROP ROLE regress_idem_monitor;

-- 0.4: a claim answers its fence, a fifth column of idem_claim_result;
-- the same session sees it once the update added it.
DROP EXTENSION idem;
CREATE EXTENSION idem VERSION '0.3';
SELECT idem_install('tenants');
SELECT decision, attempt FROM idem_claim(1, idem_key('up', 'f'), idem_fingerprint('{}'), interval '1 hour');
SELECT count(*) AS columns FROM idem_claim(1, idem_key('up', 'g'), idem_fingerprint('{}'), interval '1 hour') c, jsonb_each(to_jsonb(c));
ALTER EXTENSION idem UPDATE;
SELECT decision, attempt, fence > 0 AS fenced
  FROM idem_claim(1, idem_key('up', 'h'), idem_fingerprint('{}'), interval '1 hour');
SELECT decision, fence FROM idem_claim(1, idem_key('up', 'f'), idem_fingerprint('{}'));

-- Leave the database as we found it for the next test.
DROP TABLE idempotency_keys, platform_idempotency_keys, tenants;
DROP EXTENSION idem;
