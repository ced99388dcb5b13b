-- idem.min_retention: the retention floor.  A key purged before the queue
-- stops redelivering its message lets a redelivery run the effect again,
-- so no retention below the floor is accepted and idem_purge never
-- deletes a result younger than it.
CREATE EXTENSION idem;
CREATE TABLE tenants (id bigint PRIMARY KEY);
INSERT INTO tenants VALUES (1);
SELECT idem_install('tenants');
CREATE FUNCTION k(text) RETURNS bytea LANGUAGE sql AS $$ SELECT idem_key('r', $1) $$;

SHOW idem.min_retention;
SELECT setting, unit, context FROM pg_settings WHERE name = 'idem.min_retention';

-- Shorter retentions are refused, given or by default; the floor itself is fine.
BEGIN;
SELECT decision FROM idem_claim(1, k('a'), idem_fingerprint('{}'));
SAVEPOINT s;
SELECT idem_complete(1, k('a'), '{}', interval '59 minutes');
ROLLBACK TO s;
SELECT idem_fail(1, k('a'), '{}', false, interval '10 seconds');
ROLLBACK TO s;
SELECT idem_fail(1, k('a'), '{}', true, interval '1 second');
ROLLBACK TO s;
SET LOCAL idem.retention = '30min';
SELECT idem_complete(1, k('a'), '{}');
ROLLBACK TO s;
SELECT idem_complete(1, k('a'), '{"ok": 1}', interval '1 hour 1 second');
COMMIT;

-- Nor a retention later than a Valkey copy can say (year 287396): refused,
-- rather than kept in PostgreSQL and rejected by the worker's copy.
BEGIN;
SELECT decision FROM idem_claim(1, k('far'), idem_fingerprint('{}'));
SAVEPOINT s;
SELECT idem_complete(1, k('far'), '{}', interval '290000 years');
ROLLBACK TO s;
SELECT idem_complete(1, k('far'), '{}', interval '283000 years');
SELECT extract(year FROM expires_at) > 280000 AS far FROM idem_lookup(1, k('far'));
ROLLBACK;
SELECT status, outcome FROM idem_lookup(1, k('a'));
BEGIN;
SELECT decision FROM idem_platform_claim(k('p'), idem_fingerprint('{}'));
SELECT idem_platform_complete(k('p'), '{}', interval '1 minute');
ROLLBACK;

-- Only a superuser (or a role granted SET on it) moves the floor.
CREATE ROLE regress_idem_handler;
SET ROLE regress_idem_handler;
SET idem.min_retention = 0;
RESET ROLE;
DROP ROLE regress_idem_handler;

-- idem_purge never deletes a result finished less than the floor ago, even
-- one whose retention ended (given when the floor was lower).
BEGIN;
SELECT decision FROM idem_claim(1, k('young'), idem_fingerprint('{}'));
SELECT idem_complete(1, k('young'), '{}', interval '2 hours');
COMMIT;
UPDATE idempotency_keys SET expires_at = now() - interval '1 minute'
 WHERE idempotency_key = k('young');
BEGIN;
SELECT decision FROM idem_claim(1, k('old'), idem_fingerprint('{}'));
SELECT idem_complete(1, k('old'), '{}', interval '2 hours');
COMMIT;
UPDATE idempotency_keys SET expires_at = now() - interval '1 minute',
                            updated_at = now() - interval '61 minutes'
 WHERE idempotency_key = k('old');
SELECT idem_purge();
SELECT count(*) AS young_kept FROM idem_lookup(1, k('young'));
SELECT count(*) AS old_purged FROM idem_lookup(1, k('old'));
SET idem.min_retention = '10min';
SELECT idem_purge();
SELECT count(*) AS young_kept FROM idem_lookup(1, k('young'));
SET idem.min_retention = 0;
SELECT idem_purge();
SELECT count(*) AS young_purged FROM idem_lookup(1, k('young'));
RESET idem.min_retention;

-- Leave the database as we found it for the next test.
DROP TABLE idempotency_keys, platform_idempotency_keys, tenants;
DROP FUNCTION k(text);
DROP EXTENSION idem;
