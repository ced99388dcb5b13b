-- One row write per message: a claim completed in its own transaction is
-- a single INSERT.  In lease mode (the claim committed alone, completed
-- later) the processing -> completed update is HOT: fillfactor leaves room
-- on the page and the update touches no indexed column.
CREATE EXTENSION idem;
CREATE TABLE tenants (id bigint PRIMARY KEY);
INSERT INTO tenants VALUES (1);
SELECT idem_install('tenants');

-- One message per transaction, as handlers run them.
CREATE PROCEDURE handle_many(n integer, lease_mode boolean) LANGUAGE plpgsql AS $$
BEGIN
  FOR i IN 1..n LOOP
    -- lease mode on purpose: with its lease given (no WARNING)
    PERFORM idem_claim(1, idem_key(lease_mode::text, i::text), idem_fingerprint('{}'),
                       CASE WHEN lease_mode THEN interval '30 seconds' END);
    IF lease_mode THEN
      COMMIT;   -- the processing row is written here, at pre-commit
    END IF;
    PERFORM idem_complete(1, idem_key(lease_mode::text, i::text), jsonb_build_object('i', i));
    COMMIT;
  END LOOP;
END $$;

CALL handle_many(500, false);
SELECT pg_stat_force_next_flush();
SELECT n_tup_ins, n_tup_upd FROM pg_stat_user_tables WHERE relname = 'idempotency_keys';

CALL handle_many(500, true);
SELECT pg_stat_force_next_flush();
SELECT n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_upd = n_tup_hot_upd AS all_hot
  FROM pg_stat_user_tables WHERE relname = 'idempotency_keys';
SELECT status, count(*) FROM idempotency_keys GROUP BY status;

-- Leave the database as we found it for the next test.
DROP PROCEDURE handle_many(integer, boolean);
DROP TABLE idempotency_keys, platform_idempotency_keys, tenants;
DROP EXTENSION idem;
