-- Rows idem writes at pre-commit (a claim its transaction commits alone,
-- lease mode) are written after the transaction's deferred triggers fired:
-- their deferred checks still run, so an orphan never commits.
CREATE EXTENSION idem;
CREATE TABLE tenants (id bigint PRIMARY KEY);
INSERT INTO tenants VALUES (1), (50);
SELECT idem_install('tenants');
\set fp 'idem_fingerprint(''{}'')'

-- The foreign key to tenants, made DEFERRABLE INITIALLY DEFERRED.
ALTER TABLE idempotency_keys ALTER CONSTRAINT idempotency_keys_tenant_id_fkey
  DEFERRABLE INITIALLY DEFERRED;
BEGIN;
SELECT decision FROM idem_claim(50, idem_key('d', '1'), :fp);
DELETE FROM tenants WHERE id = 50;
COMMIT;
SELECT count(*) AS orphans FROM idempotency_keys WHERE tenant_id = 50;
SELECT count(*) AS tenant_50 FROM tenants WHERE id = 50;
-- The same with the row written by idem_complete, inside the transaction.
BEGIN;
SELECT decision FROM idem_claim(50, idem_key('d', '2'), :fp);
SELECT idem_complete(50, idem_key('d', '2'), '{}');
DELETE FROM tenants WHERE id = 50;
COMMIT;
SELECT count(*) AS orphans FROM idempotency_keys WHERE tenant_id = 50;
-- With the tenant still there, a lease-mode claim commits as before.
BEGIN;
SELECT decision FROM idem_claim(50, idem_key('d', '3'), :fp);
COMMIT;
SELECT status FROM idem_lookup(50, idem_key('d', '3'));

-- A deferred constraint trigger of the application's on the ledger fires
-- for the pre-commit row too.
CREATE FUNCTION audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.tenant_id = 1 AND NEW.status = 'processing' THEN
    RAISE EXCEPTION 'tenant 1 may not hold leases';
  END IF;
  RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER audit AFTER INSERT ON idempotency_keys
  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION audit();
BEGIN;
SELECT decision FROM idem_claim(1, idem_key('d', '4'), :fp);
COMMIT;
SELECT count(*) AS rows FROM idem_lookup(1, idem_key('d', '4'));
DROP TRIGGER audit ON idempotency_keys;

-- A trigger on the ledger that calls idem while idem writes the open
-- claims at commit (walking its table of them): refused, before the commit
-- record, whether it claims a new key or settles another open claim.
CREATE FUNCTION chain() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.status = 'processing' AND current_setting('test.chain', true) = 'claim' THEN
    PERFORM idem_claim(50, idem_key('chain', NEW.id::text), idem_fingerprint('{}'));
  ELSIF NEW.status = 'processing' AND current_setting('test.chain', true) = 'complete' THEN
    PERFORM idem_complete(50, k, '{}') FROM (VALUES (idem_key('d', '5')), (idem_key('d', '6'))) v(k)
      WHERE k <> NEW.idempotency_key;
  END IF;
  RETURN NULL;
END $$;
CREATE TRIGGER chain AFTER INSERT ON idempotency_keys
  FOR EACH ROW EXECUTE FUNCTION chain();
SET test.chain = 'claim';
BEGIN;
SELECT decision FROM idem_claim(50, idem_key('d', '5'), :fp, lease => '1 minute');
SELECT decision FROM idem_claim(50, idem_key('d', '6'), :fp, lease => '1 minute');
COMMIT;
SET test.chain = 'complete';
BEGIN;
SELECT decision FROM idem_claim(50, idem_key('d', '5'), :fp, lease => '1 minute');
SELECT decision FROM idem_claim(50, idem_key('d', '6'), :fp, lease => '1 minute');
COMMIT;
-- Only d/3's row (above) for tenant 50: nothing of either commit.
SELECT count(*) AS rows FROM idempotency_keys WHERE tenant_id = 50;
RESET test.chain;

-- Leave the database as we found it for the next test.
DROP TABLE idempotency_keys, platform_idempotency_keys, tenants;
DROP FUNCTION audit(), chain();
DROP EXTENSION idem;
