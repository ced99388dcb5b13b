-- idem_stats(): the counters of the commit ring, the worker and the claims.
-- This instance preloads idem and points the worker at port 1, where nothing
-- listens (test/regress.conf): results are queued and never copied.  The
-- counters are server-wide and earlier tests moved them, so this test looks
-- at differences.
CREATE EXTENSION idem;
CREATE TABLE tenants (id bigint PRIMARY KEY);
INSERT INTO tenants VALUES (1);
SELECT idem_install('tenants');

-- The columns, their types, and who may call it.
SELECT a.name, a.type
  FROM pg_proc p,
       unnest(p.proargnames, p.proallargtypes::regtype[]) WITH ORDINALITY AS a(name, type, n)
 WHERE p.oid = 'idem_stats()'::regprocedure
 ORDER BY a.n;
SELECT has_function_privilege('public', 'idem_stats()', 'execute') AS public_may_execute;

SELECT preloaded, valkey_connected, copied FROM idem_stats();
SELECT last_error LIKE '%connecting to 127.0.0.1:1: could not connect%' AS says_why
  FROM idem_stats();

SELECT queued AS q0, dropped AS d0, queue_depth AS depth0,
       claims_claimed AS c0, claims_completed AS cc0,
       claims_failed_permanent AS fp0, claims_busy AS b0, claims_mismatch AS m0
  FROM idem_stats() \gset

-- Every decision once; two terminal results committed, and the two replays
-- queue a copy of the row they read (repopulation after a cache miss).
SELECT decision FROM idem_claim(1, idem_key('s', '1'), idem_fingerprint('{}'));
SELECT idem_complete(1, idem_key('s', '1'), '{"n": 1}');
SELECT decision FROM idem_claim(1, idem_key('s', '1'), idem_fingerprint('{}'));
SELECT decision FROM idem_claim(1, idem_key('s', '1'), idem_fingerprint('{"other": 1}'));
SELECT decision FROM idem_claim(1, idem_key('s', '2'), idem_fingerprint('{}'));
SELECT idem_fail(1, idem_key('s', '2'), '{"why": "declined"}', false);
SELECT decision FROM idem_claim(1, idem_key('s', '2'), idem_fingerprint('{}'));
SELECT decision FROM idem_claim(1, idem_key('s', '3'), idem_fingerprint('{}'));
SELECT decision FROM idem_claim(1, idem_key('s', '3'), idem_fingerprint('{}'));

SELECT queued - :q0 AS queued, dropped - :d0 AS dropped,
       queue_depth - :depth0 AS queue_depth,
       claims_claimed - :c0 AS claimed, claims_completed - :cc0 AS completed,
       claims_failed_permanent - :fp0 AS failed_permanent,
       claims_busy - :b0 AS busy, claims_mismatch - :m0 AS mismatch
  FROM idem_stats();

-- Results that do not commit are not queued: a rollback, ROLLBACK TO, and a
-- retryable failure.
BEGIN;
SELECT decision FROM idem_claim(1, idem_key('s', '4'), idem_fingerprint('{}'));
SELECT idem_complete(1, idem_key('s', '4'), '{}');
ROLLBACK;
BEGIN;
SELECT decision FROM idem_claim(1, idem_key('s', '5'), idem_fingerprint('{}'));
SAVEPOINT before_complete;
SELECT idem_complete(1, idem_key('s', '5'), '{}');
ROLLBACK TO before_complete;
SELECT idem_fail(1, idem_key('s', '5'), '{}', true);
COMMIT;
SELECT queued - :q0 AS queued FROM idem_stats();

-- A released savepoint keeps its result.
BEGIN;
SELECT decision FROM idem_claim(1, idem_key('s', '6'), idem_fingerprint('{}'));
SAVEPOINT before_complete;
SELECT idem_complete(1, idem_key('s', '6'), '{}');
RELEASE before_complete;
COMMIT;
SELECT queued - :q0 AS queued FROM idem_stats();

-- Two-phase commit copies nothing at commit: a result committed by COMMIT
-- PREPARED is in the ledger, and the lookup that reads it queues its copy.
BEGIN;
SELECT decision FROM idem_claim(1, idem_key('s', '7'), idem_fingerprint('{}'));
SELECT idem_complete(1, idem_key('s', '7'), '{}');
PREPARE TRANSACTION 'idem_stats_prepared';
COMMIT PREPARED 'idem_stats_prepared';
SELECT status FROM idem_lookup(1, idem_key('s', '7'));
-- A claim alone: PREPARE writes its processing row.
BEGIN;
SELECT decision FROM idem_claim(1, idem_key('s', '8'), idem_fingerprint('{}'));
PREPARE TRANSACTION 'idem_stats_prepared';
COMMIT PREPARED 'idem_stats_prepared';
SELECT status FROM idem_lookup(1, idem_key('s', '8'));
SELECT queued - :q0 AS queued, copied FROM idem_stats();

-- Every copy handed to the ring is counted once it is settled, or is still
-- in the ring (here: Valkey is never reached, so all wait), and the oldest
-- one's age is shown.
SELECT queued = copied + dropped + rejected + skipped + queue_depth AS every_copy_counted,
       skipped = skipped_expired + skipped_unjoined + skipped_epoch AS skipped_is_the_sum,
       queue_age >= '0' AND queue_age < '1 hour' AS queue_age_shown
  FROM idem_stats();

-- Leave the database as we found it for the next test.
DROP TABLE idempotency_keys, platform_idempotency_keys, tenants;
DROP EXTENSION idem;
