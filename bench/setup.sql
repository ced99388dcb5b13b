-- make bench: the schema every variant runs on, in one database.
CREATE EXTENSION idem;
CREATE TABLE tenants (id bigint PRIMARY KEY, name text NOT NULL);
INSERT INTO tenants SELECT g, 'tenant ' || g FROM generate_series(1, 100) g;
SELECT idem_install('tenants');

-- The effect: one row per transfer.
CREATE TABLE transfers (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id bigint NOT NULL REFERENCES tenants (id),
    amount bigint NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- The seed's ledger again, twice: for the hand-written alternative (3) and
-- for the floor (4).  Same columns, constraints, FK and fillfactor.
CREATE TABLE hand_keys (LIKE idempotency_keys INCLUDING ALL) WITH (fillfactor = 70);
ALTER TABLE hand_keys ADD FOREIGN KEY (tenant_id) REFERENCES tenants (id);
CREATE TABLE floor_keys (LIKE idempotency_keys INCLUDING ALL) WITH (fillfactor = 70);
ALTER TABLE floor_keys ADD FOREIGN KEY (tenant_id) REFERENCES tenants (id);

-- (1) The effect only.
CREATE FUNCTION v1_effect(t bigint, run bigint, amt bigint) RETURNS text
LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO transfers (tenant_id, amount) VALUES (t, amt);
  RETURN 'applied';
END $$;

-- (2) The effect through idem: claim, effect, complete.
CREATE FUNCTION v2_idem(t bigint, run bigint, amt bigint) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
  k  bytea := idem_key('bench.transfer', run::text);
  fp bytea := idem_fingerprint(jsonb_build_object('amount', amt));
  c  idem_claim_result;
  tid bigint;
BEGIN
  c := idem_claim(t, k, fp);
  IF c.decision <> 'claimed' THEN
    RETURN c.decision;
  END IF;
  INSERT INTO transfers (tenant_id, amount) VALUES (t, amt) RETURNING id INTO tid;
  PERFORM idem_complete(t, k, jsonb_build_object('transfer_id', tid));
  RETURN 'applied';
END $$;

-- (3) What a user writes without idem: INSERT ... ON CONFLICT DO NOTHING,
-- the effect, then UPDATE.  (It waits on a concurrent duplicate; idem does not.)
CREATE FUNCTION v3_hand(t bigint, run bigint, amt bigint) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
  k  bytea := idem_key('bench.transfer', run::text);
  fp bytea := idem_fingerprint(jsonb_build_object('amount', amt));
  r  record;
  tid bigint;
BEGIN
  INSERT INTO hand_keys (tenant_id, idempotency_key, request_fingerprint, expires_at)
  VALUES (t, k, fp, now() + interval '30 seconds')
  ON CONFLICT (tenant_id, idempotency_key) DO NOTHING;
  IF NOT FOUND THEN
    SELECT status, outcome INTO r FROM hand_keys
     WHERE tenant_id = t AND idempotency_key = k;
    RETURN r.status;
  END IF;
  INSERT INTO transfers (tenant_id, amount) VALUES (t, amt) RETURNING id INTO tid;
  UPDATE hand_keys
     SET status = 'completed', outcome = jsonb_build_object('transfer_id', tid),
         expires_at = now() + interval '1 day', updated_at = clock_timestamp()
   WHERE tenant_id = t AND idempotency_key = k;
  RETURN 'applied';
END $$;

-- (4) The floor: the effect plus one INSERT of an already-completed row.
CREATE FUNCTION v4_floor(t bigint, run bigint, amt bigint) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
  k  bytea := idem_key('bench.transfer', run::text);
  fp bytea := idem_fingerprint(jsonb_build_object('amount', amt));
  tid bigint;
BEGIN
  INSERT INTO transfers (tenant_id, amount) VALUES (t, amt) RETURNING id INTO tid;
  INSERT INTO floor_keys (tenant_id, idempotency_key, request_fingerprint, status,
                          outcome, expires_at)
  VALUES (t, k, fp, 'completed', jsonb_build_object('transfer_id', tid),
          now() + interval '1 day');
  RETURN 'applied';
END $$;

-- The runner's effect as a SQL handler (idem_apply, bench/runner.sh).
CREATE FUNCTION bench_transfer(args jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
  tid bigint;
BEGIN
  INSERT INTO transfers (tenant_id, amount)
  VALUES ((args->>'t')::bigint, (args->>'amount')::bigint) RETURNING id INTO tid;
  RETURN jsonb_build_object('transfer_id', tid);
END $$;

-- Replays from PostgreSQL (Valkey down): 10,000 completed keys.
CREATE PROCEDURE bench_fill_replays(n integer) LANGUAGE plpgsql AS $$
BEGIN
  FOR i IN 1..n LOOP
    PERFORM idem_claim(1 + i % 100, idem_key('bench.replay', i::text),
                       idem_fingerprint('{"amount": 1}'));
    PERFORM idem_complete(1 + i % 100, idem_key('bench.replay', i::text),
                          jsonb_build_object('transfer_id', i));
    IF i % 1000 = 0 THEN COMMIT; END IF;
  END LOOP;
END $$;
CALL bench_fill_replays(10000);
VACUUM ANALYZE;
