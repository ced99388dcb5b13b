-- A ledger is a permanent table.  An unlogged ledger is emptied by a crash
-- while the effects it recorded survive (every redelivery would run its
-- effect again), so idem_install and every call refuse one with 55000,
-- naming the table, until ALTER TABLE ... SET LOGGED.  Seen both by this
-- session, which used the ledgers before the change, and by a new one
-- (\c), for both ledgers and the batch form.
CREATE EXTENSION idem;
CREATE TABLE tenants (id bigint PRIMARY KEY);
INSERT INTO tenants VALUES (1);
SELECT idem_install('tenants');
SELECT decision FROM idem_claim(1, idem_key('p', 'a'), idem_fingerprint('{}'), '30 seconds');
SELECT decision FROM idem_platform_claim(idem_key('p', 'a'), idem_fingerprint('{}'), '30 seconds');

-- "It is only an idempotency table": refused.
ALTER TABLE idempotency_keys SET UNLOGGED;
SELECT decision FROM idem_claim(1, idem_key('p', 'b'), idem_fingerprint('{}'), '30 seconds');
SELECT status FROM idem_lookup(1, idem_key('p', 'a'));
SELECT decision FROM idem_claim_many(ARRAY[1], ARRAY[idem_key('p', 'c')],
                                     ARRAY[idem_fingerprint('{}')]);
SELECT idem_install('tenants');
\c
SELECT decision FROM idem_claim(1, idem_key('p', 'b'), idem_fingerprint('{}'), '30 seconds');
-- The other ledger is not affected.
SELECT decision FROM idem_platform_claim(idem_key('p', 'b'), idem_fingerprint('{}'), '30 seconds');
ALTER TABLE idempotency_keys SET LOGGED;
SELECT decision FROM idem_claim(1, idem_key('p', 'b'), idem_fingerprint('{}'), '30 seconds');
SELECT idem_install('tenants');

ALTER TABLE platform_idempotency_keys SET UNLOGGED;
SELECT decision FROM idem_platform_claim(idem_key('p', 'c'), idem_fingerprint('{}'), '30 seconds');
SELECT idem_install('tenants');
\c
SELECT decision FROM idem_platform_claim(idem_key('p', 'c'), idem_fingerprint('{}'), '30 seconds');
ALTER TABLE platform_idempotency_keys SET LOGGED;
SELECT decision FROM idem_platform_claim(idem_key('p', 'c'), idem_fingerprint('{}'), '30 seconds');
SELECT idem_install('tenants');
SELECT relname, relpersistence FROM pg_class
 WHERE relname IN ('idempotency_keys', 'platform_idempotency_keys') ORDER BY 1;

-- Leave the database as we found it for the next test.
DROP TABLE idempotency_keys, platform_idempotency_keys, tenants;
DROP EXTENSION idem;
