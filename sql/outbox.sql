-- idem_emit: outgoing messages in the outbox, in the claim's transaction.
CREATE EXTENSION idem;
CREATE TABLE tenants (id bigint PRIMARY KEY);
INSERT INTO tenants VALUES (1), (2);
SELECT idem_install('tenants');
CREATE FUNCTION k(text) RETURNS bytea LANGUAGE sql AS $$ SELECT idem_key('outbox', $1) $$;
CREATE FUNCTION f(jsonb) RETURNS bytea LANGUAGE sql AS $$ SELECT idem_fingerprint($1) $$;
-- Nothing listens on this instance's Valkey port (test/regress.conf): the
-- messages wait in the outbox, and are read here.
CREATE VIEW outbox AS
  SELECT stream, message_id = encode(k(split_part(stream, '.', 2)), 'hex') || '-' || n AS id_ok, body
    FROM idem_outbox, LATERAL (SELECT split_part(message_id, '-', 2) AS n) x
   ORDER BY seq;

-- No claim: refused, with a hint.
\set VERBOSITY sqlstate
SELECT idem_emit('s.a', '{"x": 1}');
BEGIN;
SELECT idem_emit('s.a', '{"x": 1}');
ROLLBACK;
\set VERBOSITY default

-- One claim: ids are <key in hex>-1, -2, ...; they commit with the effect.
BEGIN;
SELECT (idem_claim(1, k('a'), f('{}'))).decision;
SELECT idem_emit('s.a', '{"x": 1}') = encode(k('a'), 'hex') || '-1' AS first;
SELECT idem_emit('s.a', '{"x": 2, "s": "a b"}') = encode(k('a'), 'hex') || '-2' AS second;
SELECT idem_complete(1, k('a'), '{}');
-- Completed: no claim held any more.
SELECT idem_emit('s.a', '{"x": 3}');
ROLLBACK;
SELECT count(*) FROM idem_outbox;

BEGIN;
SELECT (idem_claim(1, k('a'), f('{}'))).decision;
SELECT idem_emit('s.a', '{"x": 1}') = encode(k('a'), 'hex') || '-1' AS first;
-- A savepoint rolled back forgets its emits and their positions.
SAVEPOINT h;
SELECT idem_emit('s.a', '{"x": 2}') = encode(k('a'), 'hex') || '-2' AS second;
ROLLBACK TO h;
SELECT idem_emit('s.a', '{"x": 3}') = encode(k('a'), 'hex') || '-2' AS second_again;
-- A released one keeps them.
SAVEPOINT h2;
SELECT idem_emit('s.a', '{"x": 4}') = encode(k('a'), 'hex') || '-3' AS third;
RELEASE h2;
SELECT idem_complete(1, k('a'), '{}');
COMMIT;
SELECT * FROM outbox;

-- idem_fail deletes the key's messages of this transaction; a rollback of
-- the failure brings them back.
BEGIN;
SELECT (idem_claim(1, k('b'), f('{}'))).decision;
SELECT idem_emit('s.b', '{"x": 1}') = encode(k('b'), 'hex') || '-1' AS first;
SAVEPOINT f;
SELECT idem_fail(1, k('b'), '{"why": "no"}', false);
SELECT count(*) FROM idem_outbox WHERE stream = 's.b';
ROLLBACK TO f;
SELECT count(*) FROM idem_outbox WHERE stream = 's.b';
SELECT idem_emit('s.b', '{"x": 2}') = encode(k('b'), 'hex') || '-2' AS second;
SELECT idem_fail(1, k('b'), '{"why": "flaky"}', true);
COMMIT;
SELECT count(*) FROM idem_outbox WHERE stream = 's.b';
-- Claimed again (attempt 2): the ids start again at 1.
BEGIN;
SELECT (idem_claim(1, k('b'), f('{}'))).attempt;
SELECT idem_emit('s.b', '{"x": 1}') = encode(k('b'), 'hex') || '-1' AS first;
SELECT idem_complete(1, k('b'), '{}');
COMMIT;

-- Two claims: the key must be named.
BEGIN;
SELECT decision FROM idem_claim_many(ARRAY[1, 2]::bigint[], ARRAY[k('c'), k('d')],
                                     ARRAY[f('{}'), f('{}')]);
\set VERBOSITY sqlstate
SAVEPOINT a;
SELECT idem_emit('s.c', '{"x": 1}');
ROLLBACK TO a;
SELECT idem_emit('s.c', '{"x": 1}', k('zz'));
ROLLBACK TO a;
\set VERBOSITY default
SELECT idem_emit('s.c', '{"x": 1}', k('c')) = encode(k('c'), 'hex') || '-1' AS c1;
SELECT idem_emit('s.d', '{"x": 1}', k('d')) = encode(k('d'), 'hex') || '-1' AS d1;
SELECT idem_emit('s.c', '{"x": 2}', k('c')) = encode(k('c'), 'hex') || '-2' AS c2;
SELECT idem_complete_many(ARRAY[1, 2]::bigint[], ARRAY[k('c'), k('d')],
                          ARRAY['{}', '{}']::jsonb[]);
COMMIT;

-- The platform ledger too.
BEGIN;
SELECT (idem_platform_claim(k('p'), f('{}'))).decision;
SELECT idem_emit('s.p', '{"x": 1}') = encode(k('p'), 'hex') || '-1' AS p1;
SELECT idem_platform_complete(k('p'), '{}');
COMMIT;
-- ... and idem_apply's SQL handler.
CREATE FUNCTION notify_handler(req jsonb) RETURNS jsonb LANGUAGE sql AS $$
  SELECT jsonb_build_object('id', idem_emit('s.h', req))
$$;
SELECT decision, outcome->>'id' = encode(k('h'), 'hex') || '-1' AS h1
  FROM idem_apply(1, k('h'), f('{"n": 1}'), 'notify_handler(jsonb)', '{"n": 1}');
SELECT * FROM outbox;

-- A batch of 64 keys with messages on some: each key numbers its own; a
-- failed key's messages go, the completed keys' stay.
BEGIN;
SELECT count(*) AS claimed
  FROM idem_claim_many(array_fill(1::bigint, ARRAY[64]),
                       ARRAY(SELECT k('m' || i) FROM generate_series(1, 64) i),
                       array_fill(f('{}'), ARRAY[64]))
 WHERE decision = 'claimed';
SELECT bool_and(idem_emit('s.m', jsonb_build_object('i', i), k('m' || i))
                = encode(k('m' || i), 'hex') || '-1') AS firsts
  FROM generate_series(1, 64, 3) i;
SELECT bool_and(idem_emit('s.m', jsonb_build_object('i', i, 'n', 2), k('m' || i))
                = encode(k('m' || i), 'hex') || '-2') AS seconds
  FROM generate_series(1, 64, 9) i;
\set VERBOSITY sqlstate
SAVEPOINT a;
SELECT idem_emit('s.m', '{}');
ROLLBACK TO a;
\set VERBOSITY default
SELECT idem_fail_many(ARRAY[1, 1]::bigint[], ARRAY[k('m1'), k('m2')],
                      ARRAY['{}', '{}']::jsonb[], ARRAY[false, false]);
SELECT idem_complete_many(array_fill(1::bigint, ARRAY[62]),
                          ARRAY(SELECT k('m' || i) FROM generate_series(3, 64) i),
                          array_fill('{}'::jsonb, ARRAY[62]));
COMMIT;
SELECT count(*) AS messages, count(DISTINCT message_id) AS ids,
       bool_and(body->>'i' NOT IN ('1', '2')) AS failed_gone
  FROM idem_outbox WHERE stream = 's.m';

-- The same key claimed for two tenants: it must name one claim.
BEGIN;
SELECT decision FROM idem_claim_many(ARRAY[1, 2]::bigint[], ARRAY[k('t'), k('t')],
                                     ARRAY[f('{}'), f('{}')]);
\set VERBOSITY sqlstate
SAVEPOINT a;
SELECT idem_emit('s.t', '{}', k('t'));
ROLLBACK TO a;
\set VERBOSITY default
SELECT idem_complete(1, k('t'), '{}');
SELECT idem_emit('s.t', '{}', k('t')) = encode(k('t'), 'hex') || '-1' AS t2_first;
ROLLBACK;

-- A key failed retryably and taken over again in the same transaction is
-- held until it completes.
BEGIN;
SELECT (idem_claim(1, k('r'), f('{}'))).decision;
SELECT idem_fail(1, k('r'), '{}', true);
SELECT (idem_claim(1, k('r'), f('{}'))).attempt;
SELECT idem_emit('s.r', '{}') = encode(k('r'), 'hex') || '-1' AS r1;
SELECT idem_complete(1, k('r'), '{}');
\set VERBOSITY sqlstate
SELECT idem_emit('s.r', '{}');
\set VERBOSITY default
ROLLBACK;

-- A change to the outbox table is seen by the next emit of this session:
-- a trigger fires, and no more once dropped; a new column gets its default.
CREATE FUNCTION outbox_seen() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE NOTICE 'outbox trigger: %', NEW.stream; RETURN NEW; END $$;
BEGIN;
SELECT (idem_claim(1, k('x'), f('{}'))).decision;
SELECT idem_emit('s.x', '{}') = encode(k('x'), 'hex') || '-1' AS x1;
CREATE TRIGGER seen BEFORE INSERT ON idem_outbox FOR EACH ROW EXECUTE FUNCTION outbox_seen();
SELECT idem_emit('s.x', '{}') = encode(k('x'), 'hex') || '-2' AS x2;
DROP TRIGGER seen ON idem_outbox;
SELECT idem_emit('s.x', '{}') = encode(k('x'), 'hex') || '-3' AS x3;
ALTER TABLE idem_outbox ADD COLUMN extra int;
ALTER TABLE idem_outbox ALTER COLUMN extra SET DEFAULT 7;
SELECT idem_emit('s.x', '{}') = encode(k('x'), 'hex') || '-4' AS x4;
SELECT message_id = encode(k('x'), 'hex') || '-' || seq - min(seq) OVER () + 1 AS in_order, extra
  FROM idem_outbox WHERE stream = 's.x' ORDER BY seq;
ROLLBACK;
DROP FUNCTION outbox_seen();

-- Bad arguments.
BEGIN;
SELECT (idem_claim(1, k('e'), f('{}'))).decision;
\set VERBOSITY sqlstate
SAVEPOINT a;
SELECT idem_emit(NULL, '{}');
ROLLBACK TO a;
SELECT idem_emit('s', NULL);
ROLLBACK TO a;
SELECT idem_emit('', '{}');
ROLLBACK TO a;
SELECT idem_emit(repeat('x', 257), '{}');
ROLLBACK TO a;
SELECT idem_emit('s', '[1]');
ROLLBACK TO a;
SELECT idem_emit('s', '"x"');
ROLLBACK TO a;
SELECT idem_emit('s', '{}', '\x00');
ROLLBACK TO a;
\set VERBOSITY default
SELECT idem_emit(repeat('x', 256), '{}') IS NOT NULL AS longest_ok;
ROLLBACK;

-- idem_stats() counts what waits in this database's outbox.
SELECT outbox_waiting, outbox_age > interval '0' AS aged, published
  FROM idem_stats();

DROP VIEW outbox;
DROP FUNCTION k(text), f(jsonb), notify_handler(jsonb);
DROP TABLE idempotency_keys, platform_idempotency_keys, tenants;
DROP EXTENSION idem;
