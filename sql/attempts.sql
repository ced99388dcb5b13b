-- idem.max_attempts: retries that end.  The claim after the last attempt
-- failed retryably records failed_permanent with that failure's detail,
-- instead of claiming the key again forever.
CREATE EXTENSION idem;
CREATE TABLE tenants (id bigint PRIMARY KEY);
INSERT INTO tenants VALUES (1);
SELECT idem_install('tenants');
CREATE FUNCTION k(text) RETURNS bytea LANGUAGE sql AS $$ SELECT idem_key('attempts', $1) $$;
CREATE FUNCTION f(jsonb) RETURNS bytea LANGUAGE sql AS $$ SELECT idem_fingerprint($1) $$;
-- n attempts of one key, each failing retryably in its own transaction.
CREATE PROCEDURE fail_n(key text, n integer) LANGUAGE plpgsql AS $$
DECLARE
  c idem_claim_result;
BEGIN
  FOR i IN 1..n LOOP
    c := idem_claim(1, k(key), f('{}'));
    IF c.decision <> 'claimed' THEN
      RAISE EXCEPTION 'attempt % answered %', i, c.decision;
    END IF;
    PERFORM idem_fail(1, k(key), jsonb_build_object('error', 'timeout ' || c.attempt), true);
    COMMIT;
  END LOOP;
END $$;

-- 0, the default: no limit, as before.
SHOW idem.max_attempts;
CALL fail_n('unlimited', 5);
BEGIN;
SELECT decision, attempt FROM idem_claim(1, k('unlimited'), f('{}'));
ROLLBACK;

-- Three attempts.
SET idem.max_attempts = 3;
CALL fail_n('a', 3);
SELECT status, attempt, outcome FROM idem_lookup(1, k('a'));
-- The fourth claim: failed_permanent with the third failure's detail,
-- recorded, and replayed from then on (by the batch claim too).
SELECT decision, attempt, outcome, expires_at > now() + interval '23 hours' AS retained
  FROM idem_claim(1, k('a'), f('{}'));
SELECT status, attempt, outcome FROM idem_lookup(1, k('a'));
SELECT decision, attempt, outcome FROM idem_claim(1, k('a'), f('{}'));
SELECT ord, decision, attempt FROM idem_claim_many(ARRAY[1], ARRAY[k('a')], ARRAY[f('{}')]);
-- Another request under the key is still a mismatch.
SELECT decision FROM idem_claim(1, k('a'), f('{"other": 1}'));
-- A key with attempts left is claimed as before.
CALL fail_n('b', 2);
BEGIN;
SELECT decision, attempt FROM idem_claim(1, k('b'), f('{}'));
ROLLBACK;

-- For one call: SET LOCAL in its transaction.
RESET idem.max_attempts;
BEGIN;
SET LOCAL idem.max_attempts = 2;
SELECT decision, attempt, outcome FROM idem_claim(1, k('b'), f('{}'));
COMMIT;
SHOW idem.max_attempts;

-- idem_apply: a handler whose attempts are spent does not run again.
-- (a sequence counts the runs: the handler's writes roll back)
CREATE SEQUENCE runs;
CREATE FUNCTION flaky(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
BEGIN
  PERFORM nextval('runs');
  RAISE EXCEPTION 'upstream down' USING ERRCODE = '08006';
END $$;
SET idem.max_attempts = 2;
SELECT decision, attempt, outcome, ran FROM idem_apply(1, k('apply'), f('{}'), 'flaky(jsonb)', '{}');
SELECT decision, attempt, outcome, ran FROM idem_apply(1, k('apply'), f('{}'), 'flaky(jsonb)', '{}');
SELECT decision, attempt, outcome, ran FROM idem_apply(1, k('apply'), f('{}'), 'flaky(jsonb)', '{}');
SELECT decision, attempt, ran FROM idem_apply(1, k('apply'), f('{}'), 'flaky(jsonb)', '{}');
SELECT last_value AS handler_runs FROM runs;

-- idem_attempt(): the handler sees its attempt, and may give up early
-- (failed_permanent from the third on); NULL outside a handler, and the
-- outer handler's again after a nested idem_apply.
RESET idem.max_attempts;
CREATE FUNCTION patient(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
BEGIN
  IF idem_attempt() >= 3 THEN
    RAISE EXCEPTION 'giving up at attempt %', idem_attempt();
  END IF;
  RAISE EXCEPTION 'upstream down at attempt %', idem_attempt() USING ERRCODE = '08006';
END $$;
SELECT idem_attempt() AS outside;
SELECT decision, attempt, outcome->>'message' AS message
  FROM idem_apply(1, k('patient'), f('{}'), 'patient(jsonb)', '{}');
SELECT decision, attempt, outcome->>'message' AS message
  FROM idem_apply(1, k('patient'), f('{}'), 'patient(jsonb)', '{}');
SELECT decision, attempt, outcome->>'message' AS message
  FROM idem_apply(1, k('patient'), f('{}'), 'patient(jsonb)', '{}');
SELECT idem_attempt() AS after;
CREATE FUNCTION outer_handler(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
  before integer := idem_attempt();
  inner_outcome jsonb;
BEGIN
  SELECT outcome INTO inner_outcome
    FROM idem_apply(1, k('inner'), f('{}'), 'inner_handler(jsonb)', '{}');
  RETURN jsonb_build_object('before', before, 'inner', inner_outcome, 'after', idem_attempt());
END $$;
CREATE FUNCTION inner_handler(args jsonb) RETURNS jsonb LANGUAGE sql AS $$
  SELECT jsonb_build_object('attempt', idem_attempt()) $$;
SELECT idem_fail(1, k('outer'), '{}', true)
  FROM idem_claim(1, k('outer'), f('{}')) WHERE decision = 'claimed';
SELECT decision, attempt, outcome
  FROM idem_apply(1, k('outer'), f('{}'), 'outer_handler(jsonb)', '{}');

-- Out of range.
SET idem.max_attempts = -1;
RESET idem.max_attempts;

DROP PROCEDURE fail_n(text, integer);
DROP FUNCTION k(text), f(jsonb), flaky(jsonb), patient(jsonb), outer_handler(jsonb),
  inner_handler(jsonb);
DROP SEQUENCE runs;
DROP TABLE idempotency_keys, platform_idempotency_keys, tenants;
DROP EXTENSION idem;
