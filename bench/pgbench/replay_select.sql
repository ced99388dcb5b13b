\set i random(1, 10000)
SELECT status, outcome FROM idempotency_keys WHERE tenant_id = 1 + :i % 100 AND idempotency_key = idem_key('bench.replay', :i::text);
