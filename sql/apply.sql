-- idem_apply: claim, the caller's SQL function as the effect, complete or
-- fail, in one statement; and idem_platform_apply.
CREATE EXTENSION idem;
CREATE TABLE tenants (id bigint PRIMARY KEY);
INSERT INTO tenants VALUES (1), (2);
SELECT idem_install('tenants');
CREATE FUNCTION k(text) RETURNS bytea LANGUAGE sql AS $$ SELECT idem_key('apply', $1) $$;
CREATE FUNCTION f(jsonb) RETURNS bytea LANGUAGE sql AS $$ SELECT idem_fingerprint($1) $$;
CREATE TABLE transfers (id serial, amount int NOT NULL CHECK (amount > 0), who text DEFAULT current_user);
CREATE FUNCTION transfer(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO transfers (amount) VALUES ((args->>'amount')::int);
  IF args ? 'fail' THEN
    RAISE EXCEPTION USING ERRCODE = args->>'fail', MESSAGE = 'handler says ' || (args->>'fail');
  END IF;
  RETURN jsonb_build_object('amount', (args->>'amount')::int);
END $$;

-- Applied once: the effect and the completed key in one statement.
SELECT decision, attempt, outcome, expires_at > now() + interval '23 hours' AS retained, ran
  FROM idem_apply(1, k('a'), f('{"amount": 5}'), 'transfer(jsonb)', '{"amount": 5}');
-- The duplicate is answered by the claim: the handler does not run.
SELECT decision, attempt, outcome, ran
  FROM idem_apply(1, k('a'), f('{"amount": 5}'), 'transfer(jsonb)', '{"amount": 5}');
SELECT decision, ran
  FROM idem_apply(1, k('a'), f('{"amount": 6}'), 'transfer(jsonb)', '{"amount": 6}');
SELECT count(*) AS transfers FROM transfers;
SELECT status, attempt, outcome FROM idem_lookup(1, k('a'));

-- Errors the handler raises roll its writes back and are recorded:
-- P0001 (RAISE's default) and classes 22, 23: failed_permanent.
SELECT decision, attempt, outcome, ran
  FROM idem_apply(1, k('p'), f('{}'), 'transfer(jsonb)', '{"amount": 1, "fail": "P0001"}');
SELECT decision, attempt, outcome, ran
  FROM idem_apply(1, k('c'), f('{}'), 'transfer(jsonb)', '{"amount": -1}');
SELECT decision, attempt, ran
  FROM idem_apply(1, k('p'), f('{}'), 'transfer(jsonb)', '{"amount": 1}');
-- Any other: failed_retryable; the next call is attempt 2.
SELECT decision, attempt, outcome, ran
  FROM idem_apply(1, k('r'), f('{}'), 'transfer(jsonb)', '{"amount": 1, "fail": "55P03"}');
SELECT decision, attempt, outcome, ran
  FROM idem_apply(1, k('r'), f('{}'), 'transfer(jsonb)', '{"amount": 2}');
SELECT count(*) AS transfers, sum(amount) FROM transfers;
-- The server's state (classes 40, 53, 57, 58, XX) is not the handler's
-- answer: the statement fails and nothing is recorded.
SELECT decision FROM idem_apply(1, k('s'), f('{}'), 'transfer(jsonb)', '{"amount": 1, "fail": "40001"}');
SELECT count(*) FROM idem_lookup(1, k('s'));

-- In a transaction: the key lock is held until it ends, and a rollback
-- takes the effect and the key with it.
BEGIN;
SELECT decision FROM idem_apply(2, k('t'), f('{}'), 'transfer(jsonb)', '{"amount": 3}');
SELECT count(*) AS key_locks FROM pg_locks
 WHERE locktype = 'advisory' AND objsubid = 478 AND pid = pg_backend_pid();
ROLLBACK;
SELECT count(*) FROM idem_lookup(2, k('t'));

-- The outcome must be a JSON object of at most 4096 bytes; NULL is {}.
CREATE FUNCTION h_null(jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT NULL::jsonb $$;
CREATE FUNCTION h_array(jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT '[1]'::jsonb $$;
SELECT decision, outcome FROM idem_apply(1, k('n'), f('{}'), 'h_null(jsonb)', '{}');
-- An outcome that cannot be stored fails the handler: its writes roll
-- back and the attempt is recorded, as for an error it raised (22023:
-- permanent; 54000: retryable, counted by idem.max_attempts).  Recording
-- nothing would run it again on every redelivery, never capped.
CREATE FUNCTION h_array_write(jsonb) RETURNS jsonb LANGUAGE sql
  AS $$ INSERT INTO transfers (amount) VALUES (99); SELECT '[1]'::jsonb $$;
CREATE FUNCTION h_big(jsonb) RETURNS jsonb LANGUAGE sql
  AS $$ INSERT INTO transfers (amount) VALUES (98);
        SELECT jsonb_build_object('pad', repeat('x', 5000)) $$;
SELECT decision, attempt, outcome, ran FROM idem_apply(1, k('arr'), f('{}'), 'h_array(jsonb)', '{}');
SELECT status, attempt FROM idem_lookup(1, k('arr'));
SELECT decision, outcome->>'sqlstate' AS sqlstate, ran
  FROM idem_apply(1, k('arrw'), f('{}'), 'h_array_write(jsonb)', '{}');
SELECT decision, outcome->>'sqlstate' AS sqlstate, outcome->>'message' AS message, ran
  FROM idem_apply(1, k('big'), f('{}'), 'h_big(jsonb)', '{}');
SELECT decision, attempt, ran FROM idem_apply(1, k('big'), f('{}'), 'h_big(jsonb)', '{}');
BEGIN;
SET LOCAL idem.max_attempts = 2;
SELECT decision, attempt, outcome->>'sqlstate' AS sqlstate, ran
  FROM idem_apply(1, k('big'), f('{}'), 'h_big(jsonb)', '{}');
COMMIT;
SELECT count(*) AS rolled_back FROM transfers WHERE amount IN (98, 99);

-- A handler stopped by statement_timeout: the cancel is its attempt,
-- recorded as failed_retryable, so that idem.max_attempts ends a handler
-- that overruns on every run.
CREATE FUNCTION h_slow(jsonb) RETURNS jsonb LANGUAGE sql
  AS $$ INSERT INTO transfers (amount) VALUES (97); SELECT pg_sleep(10); SELECT '{}'::jsonb $$;
SET statement_timeout = '200ms';
SELECT decision, attempt, outcome->>'sqlstate' AS sqlstate, ran
  FROM idem_apply(1, k('slow'), f('{}'), 'h_slow(jsonb)', '{}');
SET idem.max_attempts = 1;
SELECT decision, attempt, outcome->>'sqlstate' AS sqlstate, ran
  FROM idem_apply(1, k('slow'), f('{}'), 'h_slow(jsonb)', '{}');
RESET idem.max_attempts;
RESET statement_timeout;
SELECT count(*) AS rolled_back FROM transfers WHERE amount = 97;
-- lock_timeout cancels with 55P03, not 57014: an attempt as well.
CREATE TABLE apply_locked (id int PRIMARY KEY);
INSERT INTO apply_locked VALUES (1);
BEGIN;
SELECT id FROM apply_locked FOR UPDATE;
PREPARE TRANSACTION 'apply_lock_timeout';
CREATE FUNCTION h_locked(jsonb) RETURNS jsonb LANGUAGE sql
  AS $$ INSERT INTO transfers (amount) VALUES (96);
        UPDATE apply_locked SET id = 1 WHERE id = 1; SELECT '{}'::jsonb $$;
SET lock_timeout = '100ms';
SELECT decision, attempt, outcome->>'sqlstate' AS sqlstate, ran
  FROM idem_apply(1, k('locked'), f('{}'), 'h_locked(jsonb)', '{}');
SET idem.max_attempts = 1;
SELECT decision, attempt, outcome->>'sqlstate' AS sqlstate, ran
  FROM idem_apply(1, k('locked'), f('{}'), 'h_locked(jsonb)', '{}');
RESET idem.max_attempts;
RESET lock_timeout;
ROLLBACK PREPARED 'apply_lock_timeout';
-- An operator's cancel (pg_cancel_backend, here the session's own) is the
-- server's state, as a shutdown is: raised, nothing recorded (idem_apply
-- compares the message's untranslated id, whatever lc_messages says).
CREATE FUNCTION h_cancelled(jsonb) RETURNS jsonb LANGUAGE sql
  AS $$ INSERT INTO transfers (amount) VALUES (95);
        SELECT pg_cancel_backend(pg_backend_pid()), pg_sleep(10);
        SELECT '{}'::jsonb $$;
\set VERBOSITY sqlstate
SELECT decision FROM idem_apply(1, k('cancelled'), f('{}'), 'h_cancelled(jsonb)', '{}');
\set VERBOSITY default
SELECT count(*) AS recorded FROM idem_lookup(1, k('cancelled'));
SELECT count(*) AS rolled_back FROM transfers WHERE amount IN (95, 96);

-- A handler's error message that quotes the request: clipped after JSON
-- escaping (control characters take six bytes each escaped), so that the
-- failure is recorded instead of failing the statement with 54000 on
-- every redelivery.
CREATE FUNCTION h_cast(args jsonb) RETURNS jsonb LANGUAGE sql
  AS $$ SELECT jsonb_build_object('n', (args->>'n')::int) $$;
SELECT decision, attempt, outcome->>'sqlstate' AS sqlstate,
       left(outcome->>'message', 37) AS message,
       octet_length(outcome::text) AS detail_bytes, ran
  FROM idem_apply(1, k('ctl'), f('{}'), 'h_cast(jsonb)',
                  jsonb_build_object('n', repeat(chr(1), 2000)));
SELECT status, attempt, octet_length(outcome::text) <= 4096 AS fits
  FROM idem_lookup(1, k('ctl'));
-- Clipped between escapes, never inside one (42 characters in 43 bytes,
-- then 163 six-byte escapes: 1021 bytes).
SELECT decision, octet_length(outcome::text) AS detail_bytes,
       length(outcome->>'message') AS message_chars
  FROM idem_apply(1, k('ctl2'), f('{}'), 'h_cast(jsonb)',
                  jsonb_build_object('n', 'ab' || repeat(chr(2), 2000)));

-- Bad handlers and NULL arguments, before the key is touched.
CREATE FUNCTION h_text(jsonb) RETURNS text LANGUAGE sql AS $$ SELECT 'x' $$;
CREATE FUNCTION h_two(jsonb, int) RETURNS jsonb LANGUAGE sql AS $$ SELECT $1 $$;
CREATE FUNCTION h_set(jsonb) RETURNS SETOF jsonb LANGUAGE sql AS $$ SELECT $1 $$;
CREATE PROCEDURE h_proc(jsonb) LANGUAGE sql AS $$ SELECT 1 $$;
\set VERBOSITY sqlstate
SELECT * FROM idem_apply(1, k('x'), f('{}'), 'h_text(jsonb)', '{}');
SELECT * FROM idem_apply(1, k('x'), f('{}'), 'h_two(jsonb, int)', '{}');
SELECT * FROM idem_apply(1, k('x'), f('{}'), 'h_set(jsonb)', '{}');
SELECT * FROM idem_apply(1, k('x'), f('{}'), 'h_proc(jsonb)', '{}');
SELECT * FROM idem_apply(1, k('x'), f('{}'), 99999999::oid::regprocedure, '{}');
SELECT * FROM idem_apply(NULL, k('x'), f('{}'), 'transfer(jsonb)', '{}');
SELECT * FROM idem_apply(1, NULL, f('{}'), 'transfer(jsonb)', '{}');
SELECT * FROM idem_apply(1, k('x'), NULL, 'transfer(jsonb)', '{}');
SELECT * FROM idem_apply(1, k('x'), f('{}'), NULL, '{}');
SELECT * FROM idem_apply(1, k('x'), f('{}'), 'transfer(jsonb)', NULL);
SELECT * FROM idem_apply(1, '\x00', f('{}'), 'transfer(jsonb)', '{}');
SELECT * FROM idem_apply(3, k('x'), f('{}'), 'transfer(jsonb)', '{}');
\set VERBOSITY default
SELECT * FROM idem_apply(1, k('x'), f('{}'), 'h_text(jsonb)', '{}');
SELECT count(*) FROM idem_lookup(1, k('x'));

-- Permissions: EXECUTE on idem_apply and on the handler; the handler runs
-- as the caller, a SECURITY DEFINER handler as its owner.
CREATE ROLE idem_apply_user;
GRANT USAGE ON SCHEMA public TO idem_apply_user;
GRANT INSERT, SELECT ON transfers TO idem_apply_user;
GRANT USAGE ON SEQUENCE transfers_id_seq TO idem_apply_user;
GRANT SELECT, INSERT, UPDATE ON idempotency_keys TO idem_apply_user;
GRANT SELECT ON tenants TO idem_apply_user;
GRANT EXECUTE ON FUNCTION idem_key(text, text), idem_fingerprint(jsonb) TO idem_apply_user;
CREATE FUNCTION h_definer(args jsonb) RETURNS jsonb LANGUAGE sql SECURITY DEFINER
  AS $$ SELECT jsonb_build_object('as_owner', current_user = session_user) $$;
SET ROLE idem_apply_user;
SELECT decision FROM idem_apply(1, k('u'), f('{}'), 'transfer(jsonb)', '{"amount": 1}');
RESET ROLE;
GRANT EXECUTE ON FUNCTION idem_apply(bigint, bytea, bytea, regprocedure, jsonb, interval)
  TO idem_apply_user;
REVOKE EXECUTE ON FUNCTION transfer(jsonb) FROM PUBLIC;
SET ROLE idem_apply_user;
SELECT decision FROM idem_apply(1, k('u'), f('{}'), 'transfer(jsonb)', '{"amount": 1}');
RESET ROLE;
SELECT count(*) FROM idem_lookup(1, k('u'));
GRANT EXECUTE ON FUNCTION transfer(jsonb) TO idem_apply_user;
SET ROLE idem_apply_user;
SELECT decision FROM idem_apply(1, k('u'), f('{}'), 'transfer(jsonb)', '{"amount": 1}');
SELECT decision, outcome FROM idem_apply(1, k('d'), f('{}'), 'h_definer(jsonb)', '{}');
RESET ROLE;
SELECT who FROM transfers ORDER BY id DESC LIMIT 1;
-- USAGE on the handler's schema, as a direct call needs it: given by OID,
-- a handler in a schema the caller cannot use is refused (42501), before
-- the key is touched, even a SECURITY DEFINER one.
CREATE SCHEMA idem_private;
CREATE FUNCTION idem_private.h_hidden(args jsonb) RETURNS jsonb LANGUAGE sql
  SECURITY DEFINER AS $$ SELECT '{"hidden": true}'::jsonb $$;
SELECT 'idem_private.h_hidden(jsonb)'::regprocedure::oid AS h_hidden \gset
SET ROLE idem_apply_user;
SELECT idem_private.h_hidden('{}');
SELECT decision, outcome FROM idem_apply(1, k('hid'), f('{}'), :h_hidden::oid::regprocedure, '{}');
RESET ROLE;
SELECT count(*) FROM idem_lookup(1, k('hid'));
GRANT USAGE ON SCHEMA idem_private TO idem_apply_user;
SET ROLE idem_apply_user;
SELECT decision, outcome FROM idem_apply(1, k('hid'), f('{}'), :h_hidden::oid::regprocedure, '{}');
RESET ROLE;
DROP SCHEMA idem_private CASCADE;

-- A handler that drops the ledger: the ledger is checked again before the
-- key is settled (55000), and the statement's failure undoes the drop.
CREATE FUNCTION h_drop(args jsonb) RETURNS jsonb LANGUAGE plpgsql
  AS $$ BEGIN DROP TABLE idempotency_keys; RETURN '{}'; END $$;
SELECT decision FROM idem_apply(1, k('drop'), f('{}'), 'h_drop(jsonb)', '{}');
SELECT count(*) FROM idem_lookup(1, k('drop'));
DROP FUNCTION h_drop(jsonb);

-- The platform ledger.
SELECT decision, attempt, outcome, ran
  FROM idem_platform_apply(k('plat'), f('{}'), 'transfer(jsonb)', '{"amount": 9}');
SELECT decision, ran
  FROM idem_platform_apply(k('plat'), f('{}'), 'transfer(jsonb)', '{"amount": 9}');
SELECT status, attempt FROM idem_platform_lookup(k('plat'));

DROP OWNED BY idem_apply_user;
DROP ROLE idem_apply_user;
DROP FUNCTION k(text), f(jsonb), transfer(jsonb), h_null(jsonb), h_array(jsonb), h_cast(jsonb),
  h_array_write(jsonb), h_big(jsonb), h_slow(jsonb), h_locked(jsonb), h_cancelled(jsonb),
  h_text(jsonb), h_two(jsonb, int), h_set(jsonb), h_definer(jsonb);
DROP PROCEDURE h_proc(jsonb);
DROP TABLE transfers, apply_locked, idempotency_keys, platform_idempotency_keys, tenants;
DROP EXTENSION idem;
