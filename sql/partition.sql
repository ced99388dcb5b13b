-- A ledger cannot become a partition: an INSERT ... ON CONFLICT DO UPDATE
-- routed through the partitioned table would change its rows without a
-- new history epoch.  Another partition of the same table, or the ledger
-- as a plain inheritance child, is left alone.  (PostgreSQL 17 and later
-- refuse the attach themselves, the ledger having an identity column:
-- partition_1.out.)
CREATE EXTENSION idem;
CREATE TABLE tenants (id bigint PRIMARY KEY);
SELECT idem_install('tenants');
CREATE TABLE ledger_parts (LIKE idempotency_keys) PARTITION BY LIST (tenant_id);
ALTER TABLE ledger_parts ATTACH PARTITION idempotency_keys FOR VALUES IN (1);
SELECT relispartition FROM pg_class WHERE oid = 'idempotency_keys'::regclass;
CREATE TABLE ledger_parts_2 PARTITION OF ledger_parts FOR VALUES IN (2);
ALTER TABLE ledger_parts DETACH PARTITION ledger_parts_2;
ALTER TABLE ledger_parts ATTACH PARTITION ledger_parts_2 FOR VALUES IN (2);
CREATE TABLE ledger_parent (LIKE idempotency_keys);
ALTER TABLE idempotency_keys INHERIT ledger_parent;
ALTER TABLE idempotency_keys NO INHERIT ledger_parent;
DROP TABLE ledger_parts, ledger_parent;
DROP TABLE idempotency_keys, platform_idempotency_keys, tenants;
DROP EXTENSION idem;
