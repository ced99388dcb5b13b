-- The batch API: idem_claim_many / idem_complete_many and the platform twins.
CREATE EXTENSION idem;
CREATE TABLE tenants (id bigint PRIMARY KEY);
INSERT INTO tenants VALUES (1), (2);
SELECT idem_install('tenants');
CREATE FUNCTION k(text) RETURNS bytea LANGUAGE sql AS $$ SELECT idem_key('batch', $1) $$;
CREATE FUNCTION f(jsonb) RETURNS bytea LANGUAGE sql AS $$ SELECT idem_fingerprint($1) $$;
CREATE VIEW my_key_locks AS
  SELECT count(*) AS key_locks FROM pg_locks
   WHERE locktype = 'advisory' AND objsubid = 478 AND pid = pg_backend_pid();

-- New keys are claimed, in array order; the same key twice in one batch is
-- busy the second time (one transaction runs an effect once).
BEGIN;
SELECT ord, decision, attempt, outcome, expires_at > now() AS leased
  FROM idem_claim_many(ARRAY[1, 2, 1, 1]::bigint[],
                       ARRAY[k('a'), k('a'), k('b'), k('a')],
                       ARRAY[f('{"n": 1}'), f('{"n": 1}'), f('{"n": 2}'), f('{"n": 1}')]);
-- One lock per claimed key, none for the busy one.
SELECT * FROM my_key_locks;
SELECT idem_complete_many(ARRAY[1, 2, 1]::bigint[], ARRAY[k('a'), k('a'), k('b')],
                          ARRAY['{"r": "1a"}', '{"r": "2a"}', '{"r": "1b"}']::jsonb[]);
COMMIT;
SELECT tenant_id, status, attempt, outcome FROM idempotency_keys ORDER BY tenant_id, outcome::text;

-- Replays, a mismatch, a new key and a failed_retryable key, in one batch;
-- only the claimed keys keep their lock.
BEGIN;
SELECT (idem_claim(1, k('c'), f('{}'))).decision;
SELECT idem_fail(1, k('c'), '{"why": "flaky"}', true);
COMMIT;
BEGIN;
SELECT ord, decision, attempt, outcome, expires_at > now() + interval '23 hours' AS retained
  FROM idem_claim_many(ARRAY[1, 2, 1, 1, 1]::bigint[],
                       ARRAY[k('a'), k('a'), k('b'), k('d'), k('c')],
                       ARRAY[f('{"n": 1}'), f('{"n": 1}'), f('{"n": 3}'), f('{}'), f('{}')],
                       '5 minutes');
SELECT * FROM my_key_locks;
SELECT idem_complete_many(ARRAY[1, 1]::bigint[], ARRAY[k('d'), k('c')],
                          ARRAY['{"r": "1d"}', '{"r": "1c"}']::jsonb[]);
COMMIT;
SELECT status, attempt, outcome FROM idem_lookup(1, k('c'));
SELECT status, attempt, outcome FROM idem_lookup(1, k('d'));

-- A rolled-back batch leaves nothing behind.
BEGIN;
SELECT ord, decision FROM idem_claim_many(ARRAY[1]::bigint[], ARRAY[k('e')], ARRAY[f('{}')]);
SELECT idem_complete_many(ARRAY[1]::bigint[], ARRAY[k('e')], ARRAY['{}']::jsonb[]);
ROLLBACK;
SELECT count(*) FROM idem_lookup(1, k('e'));

-- Empty batches.
SELECT count(*) FROM idem_claim_many('{}', '{}', '{}');
SELECT idem_complete_many('{}', '{}', '{}');

-- Errors name the element; the whole call fails and nothing changes.
BEGIN;
SELECT ord, decision FROM idem_claim_many(ARRAY[1, 1]::bigint[], ARRAY[k('f'), '\x00'::bytea],
                                         ARRAY[f('{}'), f('{}')]);
ROLLBACK;
SELECT count(*) FROM idem_lookup(1, k('f'));
SELECT * FROM idem_claim_many(ARRAY[1, 42]::bigint[], ARRAY[k('f'), k('g')], ARRAY[f('{}'), f('{}')]);
SELECT * FROM idem_claim_many(ARRAY[1]::bigint[], ARRAY[k('f'), k('g')], ARRAY[f('{}'), f('{}')]);
SELECT * FROM idem_claim_many(ARRAY[1, 1]::bigint[], ARRAY[k('f'), k('g')], ARRAY[f('{}')]);
SELECT * FROM idem_claim_many(ARRAY[1, 1]::bigint[], ARRAY[k('f'), NULL], ARRAY[f('{}'), f('{}')]);
SELECT * FROM idem_claim_many(NULL, ARRAY[k('f')], ARRAY[f('{}')]);
SELECT * FROM idem_claim_many(ARRAY[[1]]::bigint[], ARRAY[[k('f')]], ARRAY[[f('{}')]]);
SELECT * FROM idem_claim_many(ARRAY[1]::bigint[], ARRAY[k('f')], ARRAY[f('{}')], '0 seconds');
BEGIN;
SELECT idem_complete_many(ARRAY[1, 1]::bigint[], ARRAY[k('a'), k('h')],
                          ARRAY['{}', '{}']::jsonb[]);
ROLLBACK;
BEGIN;
SELECT count(*) FROM idem_claim_many(ARRAY[1, 1]::bigint[], ARRAY[k('h'), k('i')], ARRAY[f('{}'), f('{}')]);
SELECT idem_complete_many(ARRAY[1, 1]::bigint[], ARRAY[k('h'), k('i')],
                          ARRAY['{}', '[1]']::jsonb[]);
ROLLBACK;

-- At most max_locks_per_transaction keys per call.
SELECT current_setting('max_locks_per_transaction') AS max_locks;
SELECT count(*) FROM idem_claim_many(
    (SELECT array_agg(1::bigint) FROM generate_series(1, 65)),
    (SELECT array_agg(k('many' || i)) FROM generate_series(1, 65) i),
    (SELECT array_agg(f('{}')) FROM generate_series(1, 65)));
BEGIN;
SELECT count(*) FILTER (WHERE decision = 'claimed') AS claimed FROM idem_claim_many(
    (SELECT array_agg(1::bigint) FROM generate_series(1, 64)),
    (SELECT array_agg(k('many' || i)) FROM generate_series(1, 64) i),
    (SELECT array_agg(f('{}')) FROM generate_series(1, 64)));
SELECT * FROM my_key_locks;
ROLLBACK;

-- Read-only transactions cannot claim.
BEGIN READ ONLY;
SELECT * FROM idem_claim_many(ARRAY[1]::bigint[], ARRAY[k('f')], ARRAY[f('{}')]);
ROLLBACK;

-- The platform ledger.
BEGIN;
SELECT ord, decision, attempt FROM idem_platform_claim_many(ARRAY[k('p1'), k('p2')], ARRAY[f('{}'), f('{}')]);
SELECT idem_platform_complete_many(ARRAY[k('p1'), k('p2')], ARRAY['{"p": 1}', '{"p": 2}']::jsonb[]);
COMMIT;
SELECT ord, decision, attempt, outcome FROM idem_platform_claim_many(ARRAY[k('p2'), k('p1')], ARRAY[f('{}'), f('{"x": 1}')]);

-- Failures in a batch: idem_fail_many, retryable or permanent per key.
BEGIN;
SELECT ord, decision, attempt FROM idem_claim_many(ARRAY[1, 1, 1]::bigint[],
    ARRAY[k('fa'), k('fb'), k('fc')], ARRAY[f('{}'), f('{}'), f('{}')]);
SELECT idem_fail_many(ARRAY[1, 1]::bigint[], ARRAY[k('fa'), k('fb')],
                      ARRAY['{"why": "later"}', '{"why": "never"}']::jsonb[],
                      ARRAY[true, false]);
SELECT idem_complete_many(ARRAY[1]::bigint[], ARRAY[k('fc')], ARRAY['{"ok": 1}']::jsonb[]);
COMMIT;
SELECT ord, decision, attempt, outcome FROM idem_claim_many(ARRAY[1, 1, 1]::bigint[],
    ARRAY[k('fa'), k('fb'), k('fc')], ARRAY[f('{}'), f('{}'), f('{}')]);
SELECT idem_fail_many(ARRAY[1]::bigint[], ARRAY[k('fa')], ARRAY['{}']::jsonb[], ARRAY[true, false]);
SELECT idem_fail_many(ARRAY[1]::bigint[], ARRAY[k('fa')], ARRAY['{}']::jsonb[], ARRAY[NULL]::boolean[]);
SELECT idem_fail_many(ARRAY[1]::bigint[], ARRAY[k('zz')], ARRAY['{}']::jsonb[], ARRAY[true]);
SELECT idem_fail_many('{}', '{}', '{}', '{}');
BEGIN;
SELECT count(*) FROM idem_platform_claim_many(ARRAY[k('pf')], ARRAY[f('{}')]);
SELECT idem_platform_fail_many(ARRAY[k('pf')], ARRAY['{"why": "x"}']::jsonb[], ARRAY[false]);
COMMIT;
SELECT status, attempt, outcome FROM idem_platform_lookup(k('pf'));

-- Not executable by PUBLIC; the caller's grants decide.
CREATE ROLE batch_nobody;
SET ROLE batch_nobody;
SELECT * FROM idem_claim_many('{1}', '{}', '{}');
SELECT idem_complete_many('{1}', '{}', '{}');
SELECT idem_fail_many('{1}', '{}', '{}', '{}');
RESET ROLE;
DROP ROLE batch_nobody;
SELECT p.proname, has_function_privilege('public', p.oid, 'EXECUTE') AS public_execute
  FROM pg_proc p WHERE p.proname LIKE 'idem%many' ORDER BY 1;

DROP VIEW my_key_locks;
DROP FUNCTION k(text), f(jsonb);
DROP TABLE idempotency_keys, platform_idempotency_keys, tenants;
DROP EXTENSION idem;
