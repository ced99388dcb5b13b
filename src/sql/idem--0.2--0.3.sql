-- idem 0.2 -> 0.3.  A fresh install runs 0.1, 0.1 -> 0.2, then this script.

\echo Use "ALTER EXTENSION idem UPDATE TO '0.3'" to load this file. \quit

-- The Valkey namespace of this database right now:
-- <idem.valkey_prefix><system identifier>.<timeline>.<database oid>:
-- Raises 55000 during recovery (nothing is copied there).
CREATE FUNCTION @extschema@.idem_cache_keyspace()
RETURNS text
AS 'MODULE_PATHNAME', 'idem_cache_keyspace_sql'
LANGUAGE C STABLE STRICT PARALLEL SAFE;

-- The secrets that MAC Valkey values: the current one, then the previous
-- one (still accepted) if any.  Grant EXECUTE to the client's handler role.
CREATE FUNCTION @extschema@.idem_cache_secrets(
    OUT key_id integer, OUT secret bytea, OUT is_current boolean)
RETURNS SETOF record
AS 'MODULE_PATHNAME', 'idem_cache_secrets'
LANGUAGE C VOLATILE STRICT PARALLEL SAFE ROWS 2;

-- A new current secret (key id + 1); the old current one stays accepted
-- until the next rotation.
CREATE FUNCTION @extschema@.idem_rotate_cache_secret()
RETURNS integer
AS 'MODULE_PATHNAME', 'idem_rotate_cache_secret'
LANGUAGE C VOLATILE STRICT PARALLEL UNSAFE;

REVOKE ALL ON FUNCTION
    @extschema@.idem_cache_keyspace(),
    @extschema@.idem_cache_secrets(),
    @extschema@.idem_rotate_cache_secret()
FROM PUBLIC;
