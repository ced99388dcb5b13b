-- Lease mode: the fence survives idem_purge.  The attempt fence first: a holder whose lease ended
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

-- The fence that survives every purge: each claim answers its fence, the
-- id of the key's row for that claim, which no later claim has (a takeover
-- gives the row a new id; a purged row claimed again is a new row).
-- Here the first holder stalls, the key is taken over (attempt 2) and
-- failed retryably, and that settled row is purged on its retention (the
-- floor lowered for the test): the next claim is attempt 1 again.  The
-- stale holder's attempt => 1 cannot tell it from its own claim; its fence
-- can.
SET idem.min_retention = 0;
SELECT fence AS stale_fence FROM idem_claim(1, k('d'), f(), interval '1 millisecond') \gset
SELECT :stale_fence > 0 AS fenced;
SELECT pg_sleep(0.01);
SELECT decision, attempt, fence AS taker_fence FROM idem_claim(1, k('d'), f(), interval '1 hour') \gset
SELECT :'decision' AS decision, :attempt AS attempt, :taker_fence > :stale_fence AS new_fence;
SELECT idem_fail_fenced(1, k('d'), :stale_fence, '{"by": "stale"}', true);
SELECT idem_fail_fenced(1, k('d'), :taker_fence, '{"by": "taker"}', true, interval '1 millisecond');
SELECT pg_sleep(0.01);
SELECT idem_purge() > 0 AS purged;
SELECT count(*) AS kept FROM idem_lookup(1, k('d'));
SELECT decision, attempt, fence AS new_fence FROM idem_claim(1, k('d'), f(), interval '1 hour') \gset
SELECT :'decision' AS decision, :attempt AS attempt, :new_fence > :taker_fence AS new_fence;
BEGIN;
SELECT idem_complete(1, k('d'), '{"by": "stale"}', attempt => 1);   -- fooled
ROLLBACK;
SELECT idem_complete_fenced(1, k('d'), :stale_fence, '{"by": "stale"}');
SELECT idem_complete_fenced(1, k('d'), :new_fence, '{"by": "new"}');
SELECT status, attempt, outcome FROM idem_lookup(1, k('d'));
SELECT id = :new_fence AS row_id_is_fence FROM idempotency_keys WHERE idempotency_key = k('d');
RESET idem.min_retention;

-- In the claim's own transaction the fence is checked too; answers other
-- than claimed carry none; bad fences are refused.
BEGIN;
SELECT decision, attempt, fence AS own_fence FROM idem_claim(1, k('e'), f()) \gset
SAVEPOINT s;
SELECT idem_complete_fenced(1, k('e'), :own_fence + 1, '{}');
ROLLBACK TO s;
SELECT idem_complete_fenced(1, k('e'), :own_fence, '{"ok": true}');
COMMIT;
SELECT id = :own_fence AS row_id_is_fence FROM idempotency_keys WHERE idempotency_key = k('e');
SELECT decision, attempt, fence FROM idem_claim(1, k('e'), f());
SELECT idem_complete_fenced(1, k('e'), 0, '{}');
SELECT idem_complete_fenced(1, k('e'), NULL, '{}');
SELECT idem_complete_fenced(1, k('nope'), 42, '{}');
SELECT idem_complete_fenced(1, k('e'), :own_fence, '{}');
-- The platform ledger's, the same.
SELECT fence AS p_fence FROM idem_platform_claim(k('p'), f(), interval '1 hour') \gset
SELECT idem_platform_fail_fenced(k('p'), :p_fence + 1, '{}', false);
SELECT idem_platform_complete_fenced(k('p'), :p_fence, '{"ok": 1}');
SELECT status, outcome FROM idem_platform_lookup(k('p'));

-- A trigger on the ledger that completes the key whose row idem is
-- writing: refused with 55000 (the key is being settled), not 23505.
CREATE FUNCTION settle_again() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.status <> 'processing' THEN
    PERFORM idem_complete(NEW.tenant_id, NEW.idempotency_key, '{"by": "trigger"}');
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER settle_again AFTER INSERT OR UPDATE ON idempotency_keys
  FOR EACH ROW EXECUTE FUNCTION settle_again();
\set VERBOSITY sqlstate
BEGIN;
SELECT decision FROM idem_claim(1, k('t'), f());
SELECT idem_complete(1, k('t'), '{}');
ROLLBACK;
SELECT decision FROM idem_claim(1, k('t2'), f(), interval '1 hour');
SELECT idem_complete(1, k('t2'), '{}');
-- ... also through a chain: completing c1 completes c2, whose row's
-- trigger completes c1 again.
CREATE OR REPLACE FUNCTION settle_again() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.status <> 'processing' AND NEW.idempotency_key IN (k('c1'), k('c2')) THEN
    PERFORM idem_complete(NEW.tenant_id,
                          CASE WHEN NEW.idempotency_key = k('c1') THEN k('c2') ELSE k('c1') END,
                          '{"by": "trigger"}');
  END IF;
  RETURN NEW;
END $$;
BEGIN;
SELECT decision FROM idem_claim(1, k('c1'), f());
SELECT decision FROM idem_claim(1, k('c2'), f());
SELECT idem_complete(1, k('c1'), '{}');
ROLLBACK;
\set VERBOSITY default
DROP TRIGGER settle_again ON idempotency_keys;
DROP FUNCTION settle_again();

-- Leave the database as we found it for the next test.
DROP TABLE idempotency_keys, platform_idempotency_keys, tenants;
DROP FUNCTION k(text);
DROP FUNCTION f();
DROP OWNED BY regress_idem_purger;
DROP ROLE regress_idem_purger;
DROP EXTENSION idem;
