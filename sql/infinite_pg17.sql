-- PostgreSQL 17 and later only (Makefile): infinite intervals.  A lease that
-- never ends would hold its key forever, a retention that never ends would
-- keep the row from idem_purge forever: both are refused, 22023.
CREATE EXTENSION idem;
CREATE TABLE tenants (id bigint PRIMARY KEY);
INSERT INTO tenants VALUES (1);
SELECT idem_install('tenants');
\set k 'idem_key(''inf'', ''1'')'
\set fp 'idem_fingerprint(''{}'')'
CREATE FUNCTION h(args jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT '{}'::jsonb $$;

SELECT idem_claim(1, :k, :fp, interval 'infinity');
SELECT idem_claim(1, :k, :fp, interval '-infinity');
SELECT idem_platform_claim(:k, :fp, interval 'infinity');
SELECT * FROM idem_claim_many(ARRAY[1::bigint], ARRAY[:k], ARRAY[:fp], interval 'infinity');
BEGIN;
SELECT decision FROM idem_claim(1, :k, :fp);
SAVEPOINT s;
SELECT idem_complete(1, :k, '{}', interval 'infinity');
ROLLBACK TO s;
SELECT idem_fail(1, :k, '{}', false, interval '-infinity');
ROLLBACK TO s;
SELECT idem_complete(1, :k, '{}', interval '1 day');
COMMIT;
SELECT * FROM idem_apply(1, idem_key('inf', '2'), :fp, 'h(jsonb)', '{}', interval 'infinity');
SELECT count(*) FROM idempotency_keys;

DROP FUNCTION h(jsonb);
DROP TABLE idempotency_keys, platform_idempotency_keys, tenants;
DROP EXTENSION idem;
