-- idem_install: the ledgers it creates, exactly as SPEC section 2 says.
CREATE EXTENSION idem;

-- Before idem_install, every ledger function refuses clearly.
SELECT idem_claim(1, idem_key('t', '1'), idem_fingerprint('{}'));
SELECT idem_platform_claim(idem_key('t', '1'), idem_fingerprint('{}'));

-- Unsuitable tenants tables are refused.
CREATE TABLE no_id (name text);
SELECT idem_install('no_id');
CREATE TABLE int_id (id integer PRIMARY KEY);
SELECT idem_install('int_id');
CREATE TABLE not_unique (id bigint);
SELECT idem_install('not_unique');
CREATE TABLE wide_key (id bigint, region text, PRIMARY KEY (id, region));
SELECT idem_install('wide_key');
CREATE VIEW a_view AS SELECT 1::bigint AS id;
SELECT idem_install('a_view');
SELECT idem_install(NULL);
SELECT count(*) AS ledgers FROM pg_class
 WHERE relname IN ('idempotency_keys', 'platform_idempotency_keys');

-- The application's tenants table, then the install.
CREATE TABLE tenants (id bigint PRIMARY KEY, name text NOT NULL);
SELECT idem_install('tenants');
-- Again: harmless.
SELECT idem_install('tenants');
-- Another tenants table: refused, nothing changes.
CREATE TABLE other_tenants (id bigint PRIMARY KEY);
SELECT idem_install('other_tenants');

-- Columns: order, types, nullability, defaults, identity.
SELECT c.relname, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod) AS type,
       a.attnotnull AS not_null, a.attidentity AS identity,
       pg_get_expr(d.adbin, d.adrelid) AS default
  FROM pg_attribute a
  JOIN pg_class c ON c.oid = a.attrelid
  LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
 WHERE c.relname IN ('idempotency_keys', 'platform_idempotency_keys')
   AND a.attnum > 0 AND NOT a.attisdropped
 ORDER BY c.relname, a.attnum;

-- Constraints: exact names and definitions.
SELECT conrelid::regclass AS ledger, conname, contype,
       pg_get_constraintdef(oid) AS definition
  FROM pg_constraint
 WHERE conrelid IN ('idempotency_keys'::regclass, 'platform_idempotency_keys'::regclass)
 ORDER BY conrelid::regclass::text, conname;

-- Storage: room on each page for the HOT processing -> completed update.
SELECT relname, reloptions FROM pg_class
 WHERE relname IN ('idempotency_keys', 'platform_idempotency_keys') ORDER BY relname;

-- The ledgers are ordinary tables (pg_dump dumps them), not extension members.
SELECT count(*) AS members FROM pg_depend
 WHERE refclassid = 'pg_extension'::regclass AND deptype = 'e'
   AND objid IN ('idempotency_keys'::regclass, 'platform_idempotency_keys'::regclass);

-- Leave the database as we found it for the next test.
DROP VIEW a_view;
DROP TABLE idempotency_keys, platform_idempotency_keys, tenants, no_id, int_id, not_unique, wide_key, other_tenants;
DROP EXTENSION idem;
