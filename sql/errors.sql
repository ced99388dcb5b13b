-- Bad input gets a specific SQLSTATE and changes nothing.
CREATE EXTENSION idem;
CREATE TABLE tenants (id bigint PRIMARY KEY);
INSERT INTO tenants VALUES (1);
SELECT idem_install('tenants');
\set VERBOSITY sqlstate
\set k 'idem_key(''e'', ''1'')'
\set fp 'idem_fingerprint(''{}'')'

-- Digests that are not 32 bytes.
SELECT idem_claim(1, '\x00'::bytea, :fp);
SELECT idem_claim(1, :k, '\x'::bytea);
SELECT idem_platform_claim(repeat('a', 33)::bytea, :fp);
-- NULL arguments.
SELECT idem_claim(NULL, :k, :fp);
SELECT idem_claim(1, NULL, :fp);
SELECT idem_claim(1, :k, NULL);
SELECT idem_complete(1, :k, NULL);
SELECT idem_fail(1, :k, '{}', NULL);
SELECT idem_key(NULL, 'x');
SELECT idem_fingerprint(NULL);
SELECT idem_purge(NULL);
-- Zero or negative leases and retentions, and bad batch sizes.
SELECT idem_claim(1, :k, :fp, interval '0');
SELECT idem_claim(1, :k, :fp, interval '-1 second');
SELECT idem_claim(1, :k, :fp, interval '1 month -40 days');
-- Leases and retentions are added on the calendar, in the session's time
-- zone, and must end after now as added: across a 23-hour day (a zone
-- whose daylight saving time starts 11 to 12 hours from now, whatever the
-- date and time: not at a fixed hour, which a day later could fall in
-- the hour the change skips), '1 day -24 hours 1 second' ends an hour
-- before the claim returns.
SELECT set_config('TimeZone', format('XST0XDT,%s/%s,%s/0', d, h, (d + 180) % 365), false)
       IS NOT NULL AS dst_in_half_a_day
  FROM (SELECT extract(doy FROM t)::int - 1 AS d, extract(hour FROM t)::int AS h
          FROM (SELECT (clock_timestamp() AT TIME ZONE 'UTC') + interval '12 hours' AS t) AS n) AS later;
SELECT (now() + interval '1 day') - now() AS one_day;
SELECT decision FROM idem_claim(1, :k, :fp, interval '1 day -24 hours 1 second');
BEGIN;
SET LOCAL idem.min_retention = 0;
SELECT decision FROM idem_claim(1, :k, :fp);
SAVEPOINT r;
SELECT idem_complete(1, :k, '{}', interval '1 day -24 hours 1 second');
ROLLBACK TO r;
\set VERBOSITY default
SELECT idem_complete(1, :k, '{}', interval '1 day -23 hours');
\set VERBOSITY sqlstate
ROLLBACK;
RESET TimeZone;
SELECT idem_purge(0);
-- An unknown tenant.
SELECT idem_claim(42, :k, :fp);
-- A read-only transaction (a claim has a row to write).
BEGIN READ ONLY;
SELECT idem_claim(1, :k, :fp);
ROLLBACK;

\set VERBOSITY default
-- The messages, once each, in full.
SELECT idem_claim(1, '\x00'::bytea, :fp);
SELECT idem_claim(1, NULL, :fp);
SELECT idem_claim(1, :k, :fp, interval '-1 second');
SELECT idem_claim(42, :k, :fp);
BEGIN READ ONLY;
SELECT idem_claim(1, :k, :fp);
ROLLBACK;
\set VERBOSITY sqlstate

-- Outcomes: a JSON object of at most 4096 bytes.
BEGIN;
SELECT decision FROM idem_claim(1, :k, :fp);
SAVEPOINT s;
SELECT idem_complete(1, :k, '[1, 2]');
ROLLBACK TO s;
SELECT idem_complete(1, :k, '"text"');
ROLLBACK TO s;
SELECT idem_complete(1, :k, jsonb_build_object('big', repeat('x', 4096)));
ROLLBACK TO s;
SELECT idem_complete(1, :k, '{}', interval '0');
ROLLBACK TO s;
\set VERBOSITY default
SELECT idem_complete(1, :k, '[1, 2]');
ROLLBACK TO s;
SELECT idem_complete(1, :k, jsonb_build_object('big', repeat('x', 4096)));
ROLLBACK TO s;
\set VERBOSITY sqlstate
-- Exactly 4096 bytes of JSON text is accepted.
SELECT length(jsonb_build_object('big', repeat('x', 4085))::text) AS bytes;
SELECT idem_complete(1, :k, jsonb_build_object('big', repeat('x', 4085)));
COMMIT;
SELECT status, attempt, length(outcome::text) FROM idem_lookup(1, :k);

-- complete / fail of a key this transaction did not claim.
\set VERBOSITY default
SELECT idem_complete(1, idem_key('e', 'never'), '{}');
SELECT idem_fail(1, idem_key('e', 'never'), '{}', true);
-- complete after complete, fail after complete.
SELECT idem_complete(1, :k, '{}');
SELECT idem_fail(1, :k, '{}', false);
-- complete of a retryable failure that has not been claimed again.
BEGIN;
SELECT decision FROM idem_claim(1, idem_key('e', 'r'), :fp);
SELECT idem_fail(1, idem_key('e', 'r'), '{"e": 1}', true);
COMMIT;
SELECT idem_complete(1, idem_key('e', 'r'), '{}');
SELECT idem_platform_complete(idem_key('e', 'never'), '{}');
\set VERBOSITY sqlstate

-- Nothing above changed the ledgers.
SELECT status, attempt, length(outcome::text) FROM idem_lookup(1, :k);
SELECT status, attempt, outcome FROM idem_lookup(1, idem_key('e', 'r'));
SELECT count(*) AS rows FROM idempotency_keys;
SELECT count(*) AS rows FROM platform_idempotency_keys;

-- The table's own checks hold even against direct writes.
INSERT INTO idempotency_keys (tenant_id, idempotency_key, request_fingerprint, expires_at)
VALUES (1, '\x00', :fp, now());
INSERT INTO idempotency_keys (tenant_id, idempotency_key, request_fingerprint, status, outcome, expires_at)
VALUES (1, idem_key('e', 'x'), :fp, 'processing', '{"a": 1}', now());
INSERT INTO idempotency_keys (tenant_id, idempotency_key, request_fingerprint, status, expires_at)
VALUES (1, idem_key('e', 'x'), :fp, 'done', now());
INSERT INTO idempotency_keys (tenant_id, idempotency_key, request_fingerprint, attempt, expires_at)
VALUES (1, idem_key('e', 'x'), :fp, 0, now());
INSERT INTO idempotency_keys (tenant_id, idempotency_key, request_fingerprint, expires_at)
VALUES (NULL, idem_key('e', 'x'), :fp, now());
INSERT INTO idempotency_keys (tenant_id, idempotency_key, request_fingerprint, status, outcome, expires_at)
VALUES (1, idem_key('e', 'x'), :fp, 'completed', '[1]', now());

-- An altered ledger: a status its check would refuse is reported, not trusted.
ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_status_check;
INSERT INTO idempotency_keys (tenant_id, idempotency_key, request_fingerprint, status, expires_at)
VALUES (1, idem_key('e', 'odd'), :fp, 'done', now() + interval '1 hour');
\set VERBOSITY default
SELECT idem_claim(1, idem_key('e', 'odd'), :fp);
\set VERBOSITY sqlstate
SELECT * FROM idem_lookup(1, idem_key('e', 'odd'));

-- Leave the database as we found it for the next test.
DROP TABLE idempotency_keys, platform_idempotency_keys, tenants;
DROP EXTENSION idem;
