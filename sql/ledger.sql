-- The claim decisions and the complete / fail / lookup / purge cycle.
CREATE EXTENSION idem;
CREATE TABLE tenants (id bigint PRIMARY KEY);
INSERT INTO tenants VALUES (1), (2);
SELECT idem_install('tenants');

-- Shared test vectors with the client helper (README, "Digests").
SELECT encode(idem_key('', ''), 'hex') AS key_empty;
SELECT encode(idem_key('payments.transfer', 'run-1'), 'hex') AS key_run;
SELECT idem_key('ab', 'c') <> idem_key('a', 'bc') AS unambiguous;
SELECT encode(idem_fingerprint('{}'), 'hex') AS fp_empty;
SELECT encode(idem_fingerprint('{"b": 1, "a": [1, 2.50, "x"]}'), 'hex') AS fp_doc;
SELECT idem_fingerprint('{"a":1,"b":2}') = idem_fingerprint('{ "b" : 2, "a" : 1 }') AS canonical;

CREATE FUNCTION k(text) RETURNS bytea LANGUAGE sql AS $$ SELECT idem_key('test', $1) $$;
CREATE FUNCTION f(jsonb) RETURNS bytea LANGUAGE sql AS $$ SELECT idem_fingerprint($1) $$;

-- A new key is claimed; the transaction completes it.
BEGIN;
SELECT decision, attempt, outcome, expires_at > now() AS leased
  FROM idem_claim(1, k('a'), f('{"amount": 10}'));
SELECT status, attempt, outcome FROM idem_lookup(1, k('a'));
-- The same transaction claiming again is told busy, not given a second run.
SELECT decision, attempt FROM idem_claim(1, k('a'), f('{"amount": 10}'));
SELECT idem_complete(1, k('a'), '{"transfer_id": 7}');
COMMIT;

-- Replays: the stored outcome, with its retention deadline.
SELECT decision, attempt, outcome, expires_at > now() + interval '23 hours' AS retained
  FROM idem_claim(1, k('a'), f('{"amount": 10}'));
-- Same key, other request: mismatch, nothing changes.
SELECT decision, attempt, outcome FROM idem_claim(1, k('a'), f('{"amount": 11}'));
-- The same key under another tenant is another key.
SELECT decision, attempt FROM idem_claim(2, k('a'), f('{"amount": 10}'));
SELECT status, attempt, outcome, encode(fingerprint, 'hex') = encode(f('{"amount": 10}'), 'hex') AS fp
  FROM idem_lookup(1, k('a'));
SELECT count(*) FROM idem_lookup(1, k('never'));

-- A rolled-back claim leaves nothing behind.
BEGIN;
SELECT decision FROM idem_claim(1, k('rb'), f('{}'));
ROLLBACK;
SELECT count(*) FROM idem_lookup(1, k('rb'));
-- ... and so does a claim in a rolled-back savepoint.
BEGIN;
SAVEPOINT s;
SELECT decision FROM idem_claim(1, k('sp'), f('{}'));
ROLLBACK TO SAVEPOINT s;
SELECT decision, attempt FROM idem_claim(1, k('sp'), f('{}'));
COMMIT;

-- Savepoints around a claim's one write.
-- A completion rolled back to its savepoint leaves the claim open again.
BEGIN;
SELECT decision FROM idem_claim(1, k('sv1'), f('{}'));
SAVEPOINT s;
SELECT idem_complete(1, k('sv1'), '{"try": 1}');
ROLLBACK TO SAVEPOINT s;
SELECT status, attempt, outcome FROM idem_lookup(1, k('sv1'));
SELECT idem_fail(1, k('sv1'), '{"try": 2}', false);
COMMIT;
SELECT decision, outcome FROM idem_claim(1, k('sv1'), f('{}'));
-- A claim made and completed inside a released savepoint commits.
BEGIN;
SAVEPOINT s;
SELECT decision FROM idem_claim(1, k('sv2'), f('{}'));
SAVEPOINT t;
SELECT idem_complete(1, k('sv2'), '{"nested": true}');
RELEASE SAVEPOINT t;
RELEASE SAVEPOINT s;
COMMIT;
SELECT decision, outcome FROM idem_claim(1, k('sv2'), f('{}'));
-- A completion rolled back, and the transaction then commits the claim
-- alone: a processing row (lease mode).
BEGIN;
SELECT decision FROM idem_claim(1, k('sv3'), f('{}'), interval '1 hour');
SAVEPOINT s;
SELECT idem_complete(1, k('sv3'), '{}');
ROLLBACK TO SAVEPOINT s;
COMMIT;
SELECT status, attempt, outcome FROM idem_lookup(1, k('sv3'));
-- Completing twice in one transaction is refused.
BEGIN;
SELECT decision FROM idem_claim(1, k('sv4'), f('{}'));
SELECT idem_complete(1, k('sv4'), '{"n": 1}');
SAVEPOINT s;
SELECT idem_complete(1, k('sv4'), '{"n": 2}');
ROLLBACK TO SAVEPOINT s;
-- ... and a claim after the completion, in the same transaction, replays it.
SELECT decision, outcome FROM idem_claim(1, k('sv4'), f('{}'));
COMMIT;

-- Retryable failure: claimed again with attempt + 1.
BEGIN;
SELECT decision, attempt FROM idem_claim(1, k('r'), f('{}'));
SELECT idem_fail(1, k('r'), '{"error": "timeout"}', true);
COMMIT;
SELECT status, attempt, outcome FROM idem_lookup(1, k('r'));
BEGIN;
SELECT decision, attempt, outcome FROM idem_claim(1, k('r'), f('{}'));
SELECT status, attempt, outcome FROM idem_lookup(1, k('r'));
SELECT idem_complete(1, k('r'), '{"ok": true}', interval '1 hour');
COMMIT;
SELECT decision, attempt, outcome FROM idem_claim(1, k('r'), f('{}'));

-- Permanent failure: replayed like a result.
BEGIN;
SELECT decision FROM idem_claim(1, k('p'), f('{}'));
SELECT idem_fail(1, k('p'), '{"error": "card declined"}', false);
COMMIT;
SELECT decision, attempt, outcome FROM idem_claim(1, k('p'), f('{}'));

-- Lease mode: a committed processing row is busy until its lease ends,
-- then taken over with attempt + 1.
SELECT decision, attempt FROM idem_claim(1, k('lease'), f('{}'), interval '1 hour');
SELECT decision, attempt, expires_at > now() + interval '59 minutes' AS until_lease_end
  FROM idem_claim(1, k('lease'), f('{}'));
SELECT decision, attempt FROM idem_claim(1, k('short'), f('{}'), interval '10 milliseconds');
SELECT pg_sleep(0.05);
SELECT decision, attempt FROM idem_claim(1, k('short'), f('{}'));
-- A claim outside a transaction block without a lease: the statement's own
-- transaction commits it alone, in lease mode, most likely by accident (a
-- handler that forgot BEGIN): a WARNING says so.  Not with a lease given
-- (above), nor when the statement completes the key too.
SELECT decision FROM idem_claim(1, k('accident'), f('{}'));
SELECT status FROM idem_lookup(1, k('accident'));
SELECT count(*) FROM idem_claim_many(ARRAY[1, 1], ARRAY[k('acc1'), k('acc2')], ARRAY[f('{}'), f('{}')]);
SELECT c.decision, idem_complete(1, k('acc3'), '{}') IS NULL AS completed
  FROM idem_claim(1, k('acc3'), f('{}')) AS c;
-- The holder of attempt 1, whose lease ended, is fenced off by its attempt.
SELECT idem_complete(1, k('short'), '{"done": 1}', NULL, 1);
SELECT idem_fail(1, k('short'), '{"late": 1}', true, NULL, 1);
-- ... and attempt 2 completes it later from its own transaction.
SELECT idem_complete(1, k('short'), '{"done": 2}', NULL, 2);
SELECT decision, attempt, outcome FROM idem_claim(1, k('short'), f('{}'));

-- Platform ledger: the same decisions without a tenant.
BEGIN;
SELECT decision, attempt FROM idem_platform_claim(k('maintenance.purge'), f('{}'));
SELECT idem_platform_complete(k('maintenance.purge'), '{"deleted": 0}');
COMMIT;
SELECT decision, attempt, outcome FROM idem_platform_claim(k('maintenance.purge'), f('{}'));
SELECT decision FROM idem_platform_claim(k('maintenance.purge'), f('{"x": 1}'));
SELECT status, attempt FROM idem_platform_lookup(k('maintenance.purge'));
-- Tenant and platform keys never meet.
SELECT count(*) FROM idem_lookup(1, k('maintenance.purge'));
BEGIN;
SELECT decision FROM idem_platform_claim(k('pf'), f('{}'));
SELECT idem_platform_fail(k('pf'), '{"error": "x"}', true);
COMMIT;
SELECT decision, attempt FROM idem_platform_claim(k('pf'), f('{}'));

-- Purge: only rows past retention, and processing rows past lease + grace.
-- (No retention or grace floor here: sql/retention.sql and sql/lease_purge.sql
-- test them.)
SET idem.purge_grace = 0;
SET idem.min_purge_grace = 0;
SET idem.min_retention = 0;
BEGIN;
SELECT decision FROM idem_claim(1, k('old'), f('{}'));
SELECT idem_complete(1, k('old'), '{}', interval '1 millisecond');
COMMIT;
SELECT decision FROM idem_claim(1, k('stale'), f('{}'), interval '1 millisecond');
SELECT pg_sleep(0.05);
SELECT idem_purge(1) >= 1 AS purged_some;
SELECT idem_purge() >= 1 AS purged_rest;
SELECT idem_purge();
SELECT count(*) FROM idem_lookup(1, k('old'));
SELECT count(*) FROM idem_lookup(1, k('stale'));
SELECT status FROM idem_lookup(1, k('a'));
-- A purged key is new again.
SELECT decision, attempt FROM idem_claim(1, k('old'), f('{}'));
RESET idem.purge_grace;
RESET idem.min_purge_grace;
RESET idem.min_retention;

-- The GUC defaults.
SHOW idem.lease;
SHOW idem.retention;
SHOW idem.purge_grace;
SET idem.lease = '5s';
SELECT decision, expires_at < now() + interval '6 seconds' AS short_lease
  FROM idem_claim(1, k('guc'), f('{}'));
RESET idem.lease;

-- Leave the database as we found it for the next test.
DROP TABLE idempotency_keys, platform_idempotency_keys, tenants;
DROP FUNCTION k(text), f(jsonb);
DROP EXTENSION idem;
