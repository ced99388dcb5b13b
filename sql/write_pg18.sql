-- PostgreSQL 18 and later only (Makefile): the direct row write of a new
-- key (src/ledger_insert.c) against what 18 added to CHECK constraints.
-- Each case is also run as a plain INSERT: both must answer the same.
CREATE EXTENSION idem;
CREATE TABLE tenants (id bigint PRIMARY KEY);
INSERT INTO tenants VALUES (1);
SELECT idem_install('tenants');

CREATE FUNCTION msg(id text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
  c idem_claim_result;
BEGIN
  c := idem_claim(1, idem_key('w18', id), idem_fingerprint('{}'));
  IF c.decision <> 'claimed' THEN
    RETURN c.decision;
  END IF;
  PERFORM idem_complete(1, idem_key('w18', id), '{"n": 1}');
  RETURN 'applied';
END $$;
-- The same row, written by an INSERT.
CREATE FUNCTION ins(id text) RETURNS text
LANGUAGE sql AS $$
  INSERT INTO idempotency_keys (tenant_id, idempotency_key, request_fingerprint,
                                status, outcome, expires_at)
  VALUES (1, idem_key('w18-insert', id), idem_fingerprint('{}'), 'completed',
          '{"n": 1}', now() + interval '1 day');
  SELECT 'inserted';
$$;

\set VERBOSITY terse
-- A NOT ENFORCED check is not checked.
ALTER TABLE idempotency_keys ADD CONSTRAINT never CHECK (false) NOT ENFORCED;
SELECT msg('a');
SELECT ins('a');
ALTER TABLE idempotency_keys DROP CONSTRAINT never;

-- A check on a virtual generated column is checked on its expression.
ALTER TABLE idempotency_keys
  ADD COLUMN twice integer GENERATED ALWAYS AS (attempt * 2) VIRTUAL;
ALTER TABLE idempotency_keys ADD CONSTRAINT twice_small CHECK (twice < 10);
SELECT msg('c');
SELECT ins('c');
SELECT twice FROM idempotency_keys WHERE idempotency_key = idem_key('w18', 'c');
-- (constraints added to an empty ledger: 18 validates them on the rows)
DELETE FROM idempotency_keys;
ALTER TABLE idempotency_keys ADD CONSTRAINT twice_big CHECK (twice > 2);
SELECT msg('d');
SELECT ins('d');
ALTER TABLE idempotency_keys DROP CONSTRAINT twice_big;
-- A NOT NULL virtual generated column.
DELETE FROM idempotency_keys;
ALTER TABLE idempotency_keys
  ADD COLUMN maybe integer GENERATED ALWAYS AS (nullif(attempt, 1)) VIRTUAL NOT NULL;
SELECT msg('e');
SELECT ins('e');
ALTER TABLE idempotency_keys DROP COLUMN maybe, DROP COLUMN twice;
-- And with neither left, the path writes again.
SELECT msg('f');
SELECT count(*) FROM idempotency_keys;
