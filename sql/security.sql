-- No function is executable by PUBLIC; the documented grants are enough for
-- a handler role; nothing follows the caller's search_path.
CREATE EXTENSION idem;
CREATE TABLE tenants (id bigint PRIMARY KEY);
INSERT INTO tenants VALUES (1);
SELECT idem_install('tenants');

SELECT p.proname, has_function_privilege('public', p.oid, 'EXECUTE') AS public_can_execute
  FROM pg_proc p JOIN pg_depend d ON d.objid = p.oid AND d.classid = 'pg_proc'::regclass
 WHERE d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e'
   AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'idem')
 ORDER BY p.proname;

-- A role without grants is refused.
CREATE ROLE regress_idem_nobody;
SET ROLE regress_idem_nobody;
SELECT idem_claim(1, decode(repeat('00', 32), 'hex'), decode(repeat('00', 32), 'hex'));
SELECT idem_key('s', '1');
RESET ROLE;
-- EXECUTE alone is not enough: the functions run with the caller's rights.
GRANT EXECUTE ON FUNCTION idem_claim(bigint, bytea, bytea, interval) TO regress_idem_nobody;
SET ROLE regress_idem_nobody;
SELECT idem_claim(1, decode(repeat('00', 32), 'hex'), decode(repeat('00', 32), 'hex'));
RESET ROLE;

-- The grants a handler role needs (README, "Grants").
CREATE ROLE regress_idem_handler;
GRANT EXECUTE ON FUNCTION idem_key(text, text), idem_fingerprint(jsonb),
    idem_claim(bigint, bytea, bytea, interval),
    idem_complete(bigint, bytea, jsonb, interval, integer),
    idem_fail(bigint, bytea, jsonb, boolean, interval, integer),
    idem_lookup(bigint, bytea)
  TO regress_idem_handler;
GRANT SELECT, INSERT, UPDATE ON idempotency_keys TO regress_idem_handler;
SET ROLE regress_idem_handler;
BEGIN;
SELECT decision, attempt FROM idem_claim(1, idem_key('s', '1'), idem_fingerprint('{}'));
SELECT idem_complete(1, idem_key('s', '1'), '{"ok": 1}');
COMMIT;
SELECT decision, outcome FROM idem_claim(1, idem_key('s', '1'), idem_fingerprint('{}'));
-- ... but not maintenance, install, or the platform ledger.
SELECT idem_purge();
SELECT idem_install('tenants');
SELECT idem_platform_claim(idem_key('s', '1'), idem_fingerprint('{}'));
RESET ROLE;

-- A hostile search_path: look-alike tables, operators and functions that
-- would change the answers if the extension resolved names through it.
CREATE SCHEMA evil;
CREATE TABLE evil.idempotency_keys (LIKE idempotency_keys);
CREATE FUNCTION evil.always(bytea, bytea) RETURNS boolean
  LANGUAGE plpgsql AS $$ BEGIN RAISE NOTICE 'hijacked'; RETURN true; END $$;
CREATE OPERATOR evil.= (LEFTARG = bytea, RIGHTARG = bytea, FUNCTION = evil.always);
CREATE FUNCTION evil.clock_timestamp() RETURNS timestamptz
  LANGUAGE plpgsql AS $$ BEGIN RAISE NOTICE 'hijacked'; RETURN now(); END $$;
SET search_path = evil, pg_catalog, public;
BEGIN;
SELECT decision FROM public.idem_claim(1, public.idem_key('s', '2'), public.idem_fingerprint('{}'));
SELECT public.idem_complete(1, public.idem_key('s', '2'), '{"ok": 2}');
COMMIT;
SELECT decision, outcome FROM public.idem_claim(1, public.idem_key('s', '2'), public.idem_fingerprint('{}'));
SELECT decision FROM public.idem_claim(1, public.idem_key('s', '2'), public.idem_fingerprint('{"x": 1}'));
SELECT count(*) AS evil_rows FROM evil.idempotency_keys;
RESET search_path;
SELECT count(*) AS real_rows FROM idempotency_keys;

DROP SCHEMA evil CASCADE;
DROP OWNED BY regress_idem_handler;
DROP ROLE regress_idem_handler;
DROP OWNED BY regress_idem_nobody;
DROP ROLE regress_idem_nobody;

-- Leave the database as we found it for the next test.
DROP TABLE idempotency_keys, platform_idempotency_keys, tenants;
DROP EXTENSION idem;
