-- Lease mode: the fence survives idem_purge.  A holder whose lease ended
-- and whose key was taken over is refused when it completes with its old
-- attempt.  If idem_purge dropped the expired processing row first, the
-- next claim would start again at attempt 1, and the stale holder's
-- idem_complete(..., attempt => 1) would complete the new holder's claim
-- with the stale outcome.  idem.purge_grace is user-settable, so a floor
-- only a superuser moves (idem.min_purge_grace) keeps such rows.
CREATE EXTENSION idem;
CREATE TABLE tenants (id bigint PRIMARY KEY);
INSERT INTO tenants VALUES (1);
SELECT idem_install('tenants');
CREATE FUNCTION k(text) RETURNS bytea LANGUAGE sql AS $$ SELECT idem_key('lp', $1) $$;
CREATE FUNCTION f() RETURNS bytea LANGUAGE sql AS $$ SELECT idem_fingerprint('{}') $$;

SELECT name, setting, unit, context FROM pg_settings
 WHERE name IN ('idem.purge_grace', 'idem.min_purge_grace') ORDER BY name;

-- Without a purge: the takeover is attempt 2 and the stale holder is refused.
SELECT decision, attempt FROM idem_claim(1, k('a'), f(), interval '1 millisecond');
SELECT pg_sleep(0.01);
SELECT decision, attempt FROM idem_claim(1, k('a'), f(), interval '1 hour');
SELECT idem_complete(1, k('a'), '{"by": "stale"}', attempt => 1);
SELECT idem_complete(1, k('a'), '{"by": "new"}', attempt => 2);
SELECT status, attempt, outcome FROM idem_lookup(1, k('a'));

-- An ordinary role allowed to purge sets idem.purge_grace to 0 and purges
-- just after the lease ended: the processing row is kept all the same.
CREATE ROLE regress_idem_purger;
GRANT EXECUTE ON FUNCTION idem_purge(integer) TO regress_idem_purger;
-- (FOR UPDATE SKIP LOCKED in the purge needs UPDATE as well as DELETE.)
GRANT SELECT, UPDATE, DELETE ON idempotency_keys, platform_idempotency_keys TO regress_idem_purger;
SELECT decision, attempt FROM idem_claim(1, k('b'), f(), interval '1 millisecond');
SELECT pg_sleep(0.01);
SET ROLE regress_idem_purger;
SET idem.purge_grace = 0;
SET idem.min_purge_grace = 0;
SELECT idem_purge();
RESET idem.purge_grace;
RESET ROLE;
SELECT count(*) AS kept FROM idem_lookup(1, k('b'));
-- So the new claim is attempt 2, the stale holder's attempt 1 is refused,
-- and the new holder's completion wins.
SELECT decision, attempt FROM idem_claim(1, k('b'), f(), interval '1 hour');
SELECT idem_complete(1, k('b'), '{"by": "stale"}', attempt => 1);
SELECT idem_complete(1, k('b'), '{"by": "new"}', attempt => 2);
SELECT status, attempt, outcome FROM idem_lookup(1, k('b'));

-- The floor is the administrator's: a superuser who lowers it (here, for
-- the test) lets the purge take the expired processing row, and the key
-- starts again at attempt 1.
SELECT decision, attempt FROM idem_claim(1, k('c'), f(), interval '1 millisecond');
SELECT pg_sleep(0.01);
SET idem.purge_grace = 0;
SELECT idem_purge();
SELECT count(*) AS kept FROM idem_lookup(1, k('c'));
SET idem.min_purge_grace = 0;
SELECT idem_purge();
SELECT count(*) AS kept FROM idem_lookup(1, k('c'));
RESET idem.min_purge_grace;
RESET idem.purge_grace;

-- Leave the database as we found it for the next test.
DROP TABLE idempotency_keys, platform_idempotency_keys, tenants;
DROP FUNCTION k(text);
DROP FUNCTION f();
DROP OWNED BY regress_idem_purger;
DROP ROLE regress_idem_purger;
DROP EXTENSION idem;
