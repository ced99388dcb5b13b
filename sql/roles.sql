-- Permissions are the current role's on every call, also for what the
-- direct row write prepared once per backend: EXECUTE on a function in a
-- column default or a CHECK constraint, after SET ROLE, inside SECURITY
-- DEFINER functions, and across the role switches of a pooler.
CREATE EXTENSION idem;
CREATE TABLE tenants (id bigint PRIMARY KEY);
INSERT INTO tenants VALUES (1);
SELECT idem_install('tenants');
CREATE FUNCTION stamp() RETURNS text LANGUAGE sql AS $$ SELECT 'stamped' $$;
CREATE FUNCTION sane(jsonb) RETURNS boolean LANGUAGE sql IMMUTABLE AS $$ SELECT true $$;
REVOKE EXECUTE ON FUNCTION stamp(), sane(jsonb) FROM PUBLIC;
ALTER TABLE idempotency_keys ADD COLUMN note text DEFAULT stamp();

CREATE ROLE regress_idem_r1;
CREATE ROLE regress_idem_r2;
GRANT EXECUTE ON FUNCTION idem_key(text, text), idem_fingerprint(jsonb),
    idem_claim(bigint, bytea, bytea, interval),
    idem_complete(bigint, bytea, jsonb, interval, integer),
    idem_lookup(bigint, bytea)
  TO regress_idem_r1, regress_idem_r2;
GRANT SELECT, INSERT, UPDATE ON idempotency_keys TO regress_idem_r1, regress_idem_r2;
GRANT EXECUTE ON FUNCTION stamp(), sane(jsonb) TO regress_idem_r1;

CREATE FUNCTION run(tag text) RETURNS text LANGUAGE plpgsql AS $$
BEGIN
  PERFORM idem_claim(1, idem_key('roles', tag), idem_fingerprint('{}'));
  PERFORM idem_complete(1, idem_key('roles', tag), '{}');
  RETURN (SELECT note FROM idempotency_keys WHERE idempotency_key = idem_key('roles', tag));
END $$;
GRANT EXECUTE ON FUNCTION run(text) TO regress_idem_r1, regress_idem_r2;

-- r1 may run stamp(): its write prepares the default in this backend.
SET ROLE regress_idem_r1;
SELECT run('r1');
-- r2 may not, even though the default is prepared already.
SET ROLE regress_idem_r2;
SELECT run('r2');
-- and back: a pooler handing the connection to r1 again.
SET ROLE regress_idem_r1;
SELECT run('r1-again');
RESET ROLE;

-- SECURITY DEFINER: the definer's rights, either way.
CREATE FUNCTION run_as_r1(tag text) RETURNS text LANGUAGE sql SECURITY DEFINER
  AS $$ SELECT run(tag) $$;
ALTER FUNCTION run_as_r1(text) OWNER TO regress_idem_r1;
CREATE FUNCTION run_as_r2(tag text) RETURNS text LANGUAGE sql SECURITY DEFINER
  AS $$ SELECT run(tag) $$;
ALTER FUNCTION run_as_r2(text) OWNER TO regress_idem_r2;
GRANT EXECUTE ON FUNCTION run_as_r1(text), run_as_r2(text) TO regress_idem_r1, regress_idem_r2;
SET ROLE regress_idem_r2;
SELECT run_as_r1('definer-r1');
SET ROLE regress_idem_r1;
SELECT run_as_r2('definer-r2');
SELECT run('r1-after-definer');
RESET ROLE;

-- A function in a CHECK constraint, and a grant revoked since the
-- expression was prepared.
ALTER TABLE idempotency_keys ALTER COLUMN note SET DEFAULT 'plain';
ALTER TABLE idempotency_keys ADD CONSTRAINT sane_outcome CHECK (sane(outcome));
SET ROLE regress_idem_r1;
SELECT run('check-r1');
SET ROLE regress_idem_r2;
SELECT run('check-r2');
RESET ROLE;
REVOKE EXECUTE ON FUNCTION sane(jsonb) FROM regress_idem_r1;
SET ROLE regress_idem_r1;
SELECT run('check-r1-revoked');
RESET ROLE;

SELECT note, count(*) FROM idempotency_keys GROUP BY note ORDER BY note;

-- Leave the database as we found it for the next test.
DROP TABLE idempotency_keys, platform_idempotency_keys, tenants;
DROP FUNCTION run(text), run_as_r1(text), run_as_r2(text), stamp(), sane(jsonb);
DROP OWNED BY regress_idem_r1;
DROP OWNED BY regress_idem_r2;
DROP ROLE regress_idem_r1, regress_idem_r2;
DROP EXTENSION idem;
