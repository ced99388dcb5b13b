-- Every DDL on a ledger or on tenants, seen by a session that used idem
-- before it (warm) and by a new one (fresh): each operation either works or
-- fails with a documented SQLSTATE (55000 for an altered ledger, with a
-- hint naming what changed).  Never a crash (08006 here), never an
-- internal error (XX000), never a stale OID.
--
-- The ledgers live in database regress_idem_ddl, used through dblink with
-- every statement committed: `ddl` resets the ledgers and applies the
-- change, `warm` runs the operations before and after it, `fresh` connects
-- after it.  This session only directs (from another database, so that
-- REINDEX CONCURRENTLY does not wait for it).
CREATE EXTENSION dblink;
CREATE DATABASE regress_idem_ddl;
SET allow_in_place_tablespaces = on;
CREATE TABLESPACE regress_idem_space LOCATION '';
RESET allow_in_place_tablespaces;

CREATE FUNCTION conninfo() RETURNS text LANGUAGE sql AS $$
  SELECT format('dbname=regress_idem_ddl user=%s port=%s host=%s options=-csynchronous_commit=off',
                current_user,
                current_setting('port'),
                split_part(current_setting('unix_socket_directories'), ',', 1))
$$;
SELECT dblink_connect('ddl', conninfo());

SELECT dblink_exec('ddl', $setup$
CREATE EXTENSION idem;
CREATE TABLE tenants (id bigint PRIMARY KEY);
INSERT INTO tenants VALUES (1);

-- One operation, in the session that runs it.  Errors propagate.
CREATE FUNCTION m_op(platform boolean, op text, tag text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
  fp bytea := idem_fingerprint('{}');
  k bytea := idem_key('m', tag);
  r record;
BEGIN
  CASE op
  WHEN 'claim_new' THEN      -- committed alone: written at pre-commit (lease mode)
    SELECT * INTO r FROM idem_claim(1, k, fp) WHERE NOT platform
      UNION ALL SELECT * FROM idem_platform_claim(k, fp) WHERE platform;
    RETURN r.decision;
  WHEN 'complete', 'fail' THEN
    IF platform THEN
      PERFORM idem_platform_claim(k, fp);
      IF op = 'complete' THEN PERFORM idem_platform_complete(k, '{"r": 1}');
      ELSE PERFORM idem_platform_fail(k, '{"e": 1}', false); END IF;
    ELSE
      PERFORM idem_claim(1, k, fp);
      IF op = 'complete' THEN PERFORM idem_complete(1, k, '{"r": 1}');
      ELSE PERFORM idem_fail(1, k, '{"e": 1}', false); END IF;
    END IF;
    RETURN 'ok';
  WHEN 'claim_done' THEN     -- a replay, read by the index probe
    k := idem_key('m', 'done');
    SELECT * INTO r FROM idem_claim(1, k, fp) WHERE NOT platform
      UNION ALL SELECT * FROM idem_platform_claim(k, fp) WHERE platform;
    RETURN r.decision;
  WHEN 'takeover' THEN       -- a lease that ran out, taken over and completed
    SELECT * INTO r FROM idem_claim(1, k, fp) WHERE NOT platform
      UNION ALL SELECT * FROM idem_platform_claim(k, fp) WHERE platform;
    IF r.decision = 'claimed' THEN
      IF platform THEN PERFORM idem_platform_complete(k, '{"r": 2}', NULL, r.attempt);
      ELSE PERFORM idem_complete(1, k, '{"r": 2}', NULL, r.attempt); END IF;
    END IF;
    RETURN r.decision || r.attempt;
  WHEN 'lookup' THEN
    k := idem_key('m', 'done');
    SELECT * INTO r FROM idem_lookup(1, k) WHERE NOT platform
      UNION ALL SELECT * FROM idem_platform_lookup(k) WHERE platform;
    RETURN r.status;
  WHEN 'purge' THEN
    PERFORM idem_purge();
    RETURN 'ok';
  END CASE;
END $$;

-- Before retyping a column: drop the checks that mention it.
CREATE FUNCTION m_loosen(tbl regclass, col text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE con record;
BEGIN
  FOR con IN SELECT conname FROM pg_constraint
              WHERE conrelid = tbl AND contype = 'c'
                AND pg_get_constraintdef(oid) ~ ('\m' || col || '\M') LOOP
    EXECUTE format('ALTER TABLE %s DROP CONSTRAINT %I', tbl, con.conname);
  END LOOP;
  RETURN 'ok';
END $$;
$setup$);

-- A query returning one text column, in a dblink session.
CREATE FUNCTION m_sel(conn text, sql text) RETURNS void LANGUAGE sql AS $$
  SELECT FROM dblink(conn, sql) AS t(x text)
$$;

-- An operation in a dblink session: its result, or the SQLSTATE it failed with.
CREATE FUNCTION m_run(conn text, platform boolean, op text, tag text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE res text;
BEGIN
  SELECT x INTO res FROM dblink(conn, format('SELECT m_op(%L, %L, %L)', platform, op, tag)) AS t(x text);
  RETURN res;
EXCEPTION WHEN OTHERS THEN
  RETURN SQLSTATE;
END $$;

-- sess: w0, w or f, whose expired lease the takeover takes.
CREATE FUNCTION m_ops(conn text, platform boolean, scenario text, sess text) RETURNS text
LANGUAGE sql AS $$
  SELECT string_agg(m_run(conn, platform, op,
                          CASE op WHEN 'takeover' THEN sess ELSE scenario || sess END || '-' || op),
                    ' ' ORDER BY n)
    FROM unnest(ARRAY['claim_new', 'claim_done', 'complete', 'fail', 'lookup', 'takeover', 'purge'])
         WITH ORDINALITY AS o(op, n)
$$;

-- Fresh ledgers with a completed key and, per session, a lease that ran out.
CREATE FUNCTION m_reset(platform boolean) RETURNS void LANGUAGE plpgsql AS $$
DECLARE t text;
BEGIN
  PERFORM dblink_exec('ddl', 'DROP TABLE IF EXISTS idempotency_keys, platform_idempotency_keys');
  PERFORM m_sel('ddl', 'SELECT idem_install(''tenants'')::text');
  PERFORM m_sel('ddl', format('SELECT m_op(%L, ''complete'', ''done'')', platform));
  FOREACH t IN ARRAY ARRAY['w0', 'w', 'f'] LOOP
    PERFORM m_sel('ddl', format(
      'SELECT (%s(%sidem_key(''m'', %L), idem_fingerprint(''{}''), interval ''1 millisecond'')).decision',
      CASE WHEN platform THEN 'idem_platform_claim' ELSE 'idem_claim' END,
      CASE WHEN platform THEN '' ELSE '1, ' END, t || '-takeover'));
  END LOOP;
  PERFORM pg_sleep(0.01);
END $$;

-- The changes: %1$s is the ledger, %2$s the column, %3$s its unique
-- constraint, %4$s that constraint's columns.
CREATE TABLE changes (n serial, platform boolean, col text, change text, ddl text);
INSERT INTO changes (platform, col, change, ddl)
SELECT p, c.col, c.change, c.ddl
  FROM (VALUES (false), (true)) AS l(p)
  CROSS JOIN (VALUES
    ('id', 'integer', 'ALTER TABLE %1$s ALTER %2$s TYPE integer'),
    ('tenant_id', 'integer', 'ALTER TABLE %1$s ALTER %2$s TYPE integer'),
    ('tenant_id', 'numeric', 'ALTER TABLE %1$s ALTER %2$s TYPE numeric'),
    ('idempotency_key', 'text', 'ALTER TABLE %1$s ALTER %2$s TYPE text USING encode(%2$s, ''hex'')'),
    ('request_fingerprint', 'text', 'ALTER TABLE %1$s ALTER %2$s TYPE text USING encode(%2$s, ''hex'')'),
    ('status', 'varchar', 'ALTER TABLE %1$s ALTER %2$s TYPE varchar'),
    ('status', 'char(20)', 'ALTER TABLE %1$s ALTER %2$s TYPE char(20)'),
    ('attempt', 'bigint', 'ALTER TABLE %1$s ALTER %2$s TYPE bigint'),
    ('attempt', 'smallint', 'ALTER TABLE %1$s ALTER %2$s TYPE smallint'),
    ('attempt', 'numeric', 'ALTER TABLE %1$s ALTER %2$s TYPE numeric'),
    ('outcome', 'json', 'ALTER TABLE %1$s ALTER %2$s DROP DEFAULT, ALTER %2$s TYPE json'),
    ('outcome', 'text', 'ALTER TABLE %1$s ALTER %2$s TYPE text'),
    ('expires_at', 'timestamp', 'ALTER TABLE %1$s ALTER %2$s TYPE timestamp'),
    ('expires_at', 'text', 'ALTER TABLE %1$s ALTER %2$s TYPE text'),
    ('created_at', 'timestamp', 'ALTER TABLE %1$s ALTER %2$s TYPE timestamp'),
    ('updated_at', 'timestamp', 'ALTER TABLE %1$s ALTER %2$s TYPE timestamp')
  ) AS c(col, change, ddl)
 WHERE NOT (p AND c.col = 'tenant_id');
-- drop and rename, for every column
INSERT INTO changes (platform, col, change, ddl)
SELECT p, a.col, c.change, c.ddl
  FROM (VALUES (false), (true)) AS l(p)
  CROSS JOIN unnest(ARRAY['id', 'tenant_id', 'idempotency_key', 'request_fingerprint', 'status',
                          'attempt', 'outcome', 'expires_at', 'created_at', 'updated_at']) AS a(col)
  CROSS JOIN (VALUES
    ('drop', 'ALTER TABLE %1$s DROP %2$s CASCADE'),
    ('rename', 'ALTER TABLE %1$s RENAME %2$s TO %2$s_renamed')
  ) AS c(change, ddl)
 WHERE NOT (p AND a.col = 'tenant_id');
-- maintenance and other DDL on a ledger
INSERT INTO changes (platform, col, change, ddl)
SELECT p, '-', c.change, c.ddl
  FROM (VALUES (false), (true)) AS l(p)
  CROSS JOIN (VALUES
    ('vacuum full', 'VACUUM FULL %1$s'),
    ('cluster', 'CLUSTER %1$s USING %1$s_pkey'),
    ('set tablespace', 'ALTER TABLE %1$s SET TABLESPACE regress_idem_space'),
    ('fillfactor', 'ALTER TABLE %1$s SET (fillfactor = 100)'),
    ('reindex', 'REINDEX TABLE %1$s'),
    ('reindex concurrently', 'REINDEX TABLE CONCURRENTLY %1$s'),
    ('add column', 'ALTER TABLE %1$s ADD COLUMN note text DEFAULT ''n'''),
    ('add check', 'ALTER TABLE %1$s ADD CONSTRAINT extra CHECK (attempt < 100)'),
    ('drop checks', 'ALTER TABLE %1$s DROP CONSTRAINT %1$s_check, DROP CONSTRAINT %1$s_outcome_check'),
    ('drop not null', 'ALTER TABLE %1$s ALTER status DROP NOT NULL'),
    ('drop unique', 'ALTER TABLE %1$s DROP CONSTRAINT %3$s'),
    ('unique as index only', 'ALTER TABLE %1$s DROP CONSTRAINT %3$s; CREATE UNIQUE INDEX ON %1$s (%4$s)'),
    ('unique deferrable', 'ALTER TABLE %1$s DROP CONSTRAINT %3$s, ADD CONSTRAINT %3$s UNIQUE (%4$s) DEFERRABLE'),
    ('swap by rename', 'CREATE TABLE swap (LIKE %1$s INCLUDING ALL); ALTER TABLE %1$s RENAME TO old; ALTER TABLE swap RENAME TO %1$s'),
    ('renamed away', 'ALTER TABLE %1$s RENAME TO old'),
    ('dropped', 'DROP TABLE %1$s'),
    ('planted look-alike', 'CREATE TABLE old (LIKE %1$s INCLUDING ALL); DROP TABLE %1$s; ALTER TABLE old RENAME TO %1$s')
  ) AS c(change, ddl);
-- DDL on tenants and on the foreign key
INSERT INTO changes (platform, col, change, ddl) VALUES
  (false, 'tenants', 'reindex concurrently', 'REINDEX TABLE CONCURRENTLY tenants'),
  (false, 'tenants', 'vacuum full', 'VACUUM FULL tenants'),
  (false, 'tenants', 'id integer', 'ALTER TABLE tenants ALTER id TYPE integer'),
  (false, 'tenants', 'fk deferrable', 'ALTER TABLE idempotency_keys ALTER CONSTRAINT idempotency_keys_tenant_id_fkey DEFERRABLE INITIALLY DEFERRED'),
  (false, 'tenants', 'fk dropped', 'ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_tenant_id_fkey'),
  (false, 'tenants', 'renamed', 'ALTER TABLE tenants RENAME TO tenants_renamed');

CREATE FUNCTION m_scenario(c changes) RETURNS TABLE (warm text, fresh text)
LANGUAGE plpgsql AS $$
DECLARE
  tbl text := CASE WHEN c.platform THEN 'platform_idempotency_keys' ELSE 'idempotency_keys' END;
  uniq text := CASE WHEN c.platform THEN 'platform_idempotency_keys_key' ELSE 'idempotency_keys_owner_key' END;
  ukey text := CASE WHEN c.platform THEN 'idempotency_key' ELSE 'tenant_id, idempotency_key' END;
  tag text := 's' || c.n;
BEGIN
  PERFORM m_reset(c.platform);
  PERFORM dblink_connect('warm', conninfo());
  PERFORM m_ops('warm', c.platform, tag, 'w0');
  IF c.change NOT IN ('drop', 'rename') AND c.col NOT IN ('-', 'tenants') THEN
    PERFORM m_sel('ddl', format('SELECT m_loosen(%L, %L)', tbl, c.col));
  END IF;
  BEGIN
    PERFORM dblink_exec('ddl', format(c.ddl, tbl, c.col, uniq, ukey));
  EXCEPTION WHEN OTHERS THEN
    warm := 'ddl refused: ' || SQLSTATE;
  END;
  IF warm IS NULL THEN
    warm := m_ops('warm', c.platform, tag, 'w');
    PERFORM dblink_connect('fresh', conninfo());
    fresh := m_ops('fresh', c.platform, tag, 'f');
    PERFORM dblink_disconnect('fresh');
  END IF;
  PERFORM dblink_disconnect('warm');
  IF c.col = 'tenants' THEN
    -- put tenants back for the next scenario
    PERFORM dblink_exec('ddl', 'DROP TABLE IF EXISTS idempotency_keys, platform_idempotency_keys');
    PERFORM dblink_exec('ddl', 'DROP TABLE IF EXISTS tenants, tenants_renamed CASCADE');
    PERFORM dblink_exec('ddl', 'CREATE TABLE tenants (id bigint PRIMARY KEY); INSERT INTO tenants VALUES (1)');
  END IF;
  PERFORM dblink_exec('ddl', 'DROP TABLE IF EXISTS old');
  RETURN NEXT;
END $$;

\pset format unaligned
\pset fieldsep ' | '
-- operations: claim_new claim_done complete fail lookup takeover purge
SELECT CASE WHEN c.platform THEN 'platform' ELSE 'tenant' END AS ledger, c.col, c.change,
       s.warm, s.fresh
  FROM changes c, LATERAL m_scenario(c) s
 ORDER BY c.n;
\pset format aligned

-- No backend crashed or failed an assertion meanwhile (each would have
-- reset every connection, this one included).
SELECT dblink_disconnect('ddl');
DROP DATABASE regress_idem_ddl;
DROP TABLESPACE regress_idem_space;
DROP FUNCTION m_scenario(changes), m_ops(text, boolean, text, text), m_run(text, boolean, text, text),
  m_reset(boolean), m_sel(text, text), conninfo();
DROP TABLE changes;
DROP EXTENSION dblink;
