-- idem_install: the ledgers it creates, with the exact columns, checks and
-- constraint names the README's "The ledgers" section documents.
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

-- Constraints: exact names and definitions.  PostgreSQL 18 also lists
-- NOT NULL as constraints (contype 'n'); the columns above show those.
SELECT conrelid::regclass AS ledger, conname, contype,
       pg_get_constraintdef(oid) AS definition
  FROM pg_constraint
 WHERE conrelid IN ('idempotency_keys'::regclass, 'platform_idempotency_keys'::regclass)
   AND contype <> 'n'
 ORDER BY conrelid::regclass::text, conname;

-- Storage: room on each page for the HOT processing -> completed update.
SELECT relname, reloptions FROM pg_class
 WHERE relname IN ('idempotency_keys', 'platform_idempotency_keys') ORDER BY relname;

-- The ledgers are ordinary tables (pg_dump dumps them), not extension members.
SELECT count(*) AS members FROM pg_depend
 WHERE refclassid = 'pg_extension'::regclass AND deptype = 'e'
   AND objid IN ('idempotency_keys'::regclass, 'platform_idempotency_keys'::regclass);

-- The ledgers are found by the OID idem_install recorded, never by name.
SELECT kind, ledger FROM idem_ledgers ORDER BY kind;

-- A look-alike planted under a ledger's name by a role that may create
-- tables in the schema: never used, and idem_install refuses to adopt it.
CREATE ROLE regress_idem_planter;
GRANT CREATE ON SCHEMA public TO regress_idem_planter;
CREATE TABLE spare (LIKE platform_idempotency_keys INCLUDING ALL);
DROP TABLE platform_idempotency_keys;
ALTER TABLE spare OWNER TO regress_idem_planter;
SET ROLE regress_idem_planter;
ALTER TABLE spare RENAME TO platform_idempotency_keys;
CREATE FUNCTION steal() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE NOTICE 'running as %', current_user; RETURN NEW; END $$;
CREATE TRIGGER steal BEFORE INSERT ON platform_idempotency_keys
  FOR EACH ROW EXECUTE FUNCTION steal();
GRANT ALL ON platform_idempotency_keys TO PUBLIC;
RESET ROLE;
SELECT idem_platform_claim(idem_key('t', '1'), idem_fingerprint('{}'));
SELECT idem_install('tenants');
-- Owned by us, it is still not the ledger's shape.
ALTER TABLE platform_idempotency_keys OWNER TO CURRENT_USER;
SELECT idem_install('tenants');
DROP TABLE platform_idempotency_keys;
DROP FUNCTION steal();
REVOKE CREATE ON SCHEMA public FROM regress_idem_planter;
DROP ROLE regress_idem_planter;
SELECT idem_install('tenants');
SELECT decision FROM idem_platform_claim(idem_key('t', '1'), idem_fingerprint('{}'));

-- Dropping the tenants table's key with CASCADE drops the ledger's foreign
-- key: every call then fails (55000) with a hint to run idem_install, which
-- re-creates the foreign key once tenants has a unique id again.
INSERT INTO tenants VALUES (1, 'one');
ALTER TABLE tenants DROP CONSTRAINT tenants_pkey CASCADE;
SELECT idem_claim(1, idem_key('t', 'fk'), idem_fingerprint('{}'));
SELECT idem_install('tenants');
ALTER TABLE tenants ADD PRIMARY KEY (id);
SELECT idem_install('tenants');
SELECT conname, pg_get_constraintdef(oid) AS definition FROM pg_constraint
 WHERE conrelid = 'idempotency_keys'::regclass AND contype = 'f';
SELECT decision FROM idem_claim(1, idem_key('t', 'fk'), idem_fingerprint('{}'));
SELECT idem_install('tenants');

-- Leave the database as we found it for the next test.
DROP VIEW a_view;
DROP TABLE idempotency_keys, platform_idempotency_keys, tenants, no_id, int_id, not_unique, wide_key, other_tenants;
DROP EXTENSION idem;

-- Only a UTF8 database: in another, idem_key() and idem_fingerprint()
-- would hash other bytes than the clients, and one message would have two
-- keys.  CREATE EXTENSION refuses it; a 0.3 install there refuses
-- idem_install(), the digests, and its update.
SELECT current_database() AS regress_db \gset
CREATE DATABASE regress_idem_latin1 TEMPLATE template0 ENCODING 'LATIN1'
  LC_COLLATE 'C' LC_CTYPE 'C';
\c regress_idem_latin1
\set SHOW_CONTEXT never
CREATE EXTENSION idem;
CREATE EXTENSION idem VERSION '0.3';
CREATE TABLE tenants (id bigint PRIMARY KEY);
SELECT idem_install('tenants');
SELECT idem_key('payments', 'caf' || chr(233));
SELECT idem_fingerprint('{"who": "caf\u00e9"}');
ALTER EXTENSION idem UPDATE;
\set SHOW_CONTEXT errors
\c :regress_db
DROP DATABASE regress_idem_latin1;
