-- idem 0.1: the in-transaction ledger API.
-- The ledgers themselves are created by idem_install(tenants), not here:
-- pg_dump must dump them after the application's tenants table (see the
-- README, "Why idem_install").

\echo Use "CREATE EXTENSION idem" to load this file. \quit

CREATE TYPE @extschema@.idem_claim_result AS (
    decision   text,         -- claimed | completed | failed_permanent | busy | mismatch
    attempt    integer,      -- this attempt (claimed) or the stored one
    outcome    jsonb,        -- the stored result or failure detail (replays)
    expires_at timestamptz   -- lease end (claimed), retention end (replays),
                             -- or when to retry (busy)
);

-- Setup, once after CREATE EXTENSION. No default for tenants: a regclass
-- default would be resolved when this script runs, before a restore has
-- created the application's tables.
CREATE FUNCTION @extschema@.idem_install(tenants regclass)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_install'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

-- Digests
CREATE FUNCTION @extschema@.idem_key(scope text, id text)
RETURNS bytea
AS 'MODULE_PATHNAME', 'idem_key'
LANGUAGE C IMMUTABLE PARALLEL SAFE;

CREATE FUNCTION @extschema@.idem_fingerprint(request jsonb)
RETURNS bytea
AS 'MODULE_PATHNAME', 'idem_fingerprint'
LANGUAGE C IMMUTABLE PARALLEL SAFE;

-- Tenant ledger
CREATE FUNCTION @extschema@.idem_claim(tenant_id bigint, key bytea, fingerprint bytea,
                                       lease interval DEFAULT NULL)
RETURNS @extschema@.idem_claim_result
AS 'MODULE_PATHNAME', 'idem_claim'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

-- attempt (optional) fences lease mode: refused if a later attempt took over.
CREATE FUNCTION @extschema@.idem_complete(tenant_id bigint, key bytea, outcome jsonb,
                                          retention interval DEFAULT NULL,
                                          attempt integer DEFAULT NULL)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_complete'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.idem_fail(tenant_id bigint, key bytea, detail jsonb,
                                      retryable boolean, retention interval DEFAULT NULL,
                                      attempt integer DEFAULT NULL)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_fail'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.idem_lookup(tenant_id bigint, key bytea)
RETURNS TABLE (status text, attempt integer, outcome jsonb, fingerprint bytea,
               expires_at timestamptz)
AS 'MODULE_PATHNAME', 'idem_lookup'
LANGUAGE C STABLE PARALLEL UNSAFE ROWS 1;

-- Platform ledger: the same without a tenant
CREATE FUNCTION @extschema@.idem_platform_claim(key bytea, fingerprint bytea,
                                                lease interval DEFAULT NULL)
RETURNS @extschema@.idem_claim_result
AS 'MODULE_PATHNAME', 'idem_platform_claim'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.idem_platform_complete(key bytea, outcome jsonb,
                                                   retention interval DEFAULT NULL,
                                                   attempt integer DEFAULT NULL)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_platform_complete'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.idem_platform_fail(key bytea, detail jsonb, retryable boolean,
                                               retention interval DEFAULT NULL,
                                               attempt integer DEFAULT NULL)
RETURNS void
AS 'MODULE_PATHNAME', 'idem_platform_fail'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

CREATE FUNCTION @extschema@.idem_platform_lookup(key bytea)
RETURNS TABLE (status text, attempt integer, outcome jsonb, fingerprint bytea,
               expires_at timestamptz)
AS 'MODULE_PATHNAME', 'idem_platform_lookup'
LANGUAGE C STABLE PARALLEL UNSAFE ROWS 1;

-- Maintenance (the task maintenance.purge)
CREATE FUNCTION @extschema@.idem_purge(batch_size integer DEFAULT 10000)
RETURNS bigint
AS 'MODULE_PATHNAME', 'idem_purge'
LANGUAGE C VOLATILE PARALLEL UNSAFE;

-- Nothing is executable by PUBLIC; the README lists the grants a handler needs.
REVOKE ALL ON FUNCTION
    @extschema@.idem_install(regclass),
    @extschema@.idem_key(text, text),
    @extschema@.idem_fingerprint(jsonb),
    @extschema@.idem_claim(bigint, bytea, bytea, interval),
    @extschema@.idem_complete(bigint, bytea, jsonb, interval, integer),
    @extschema@.idem_fail(bigint, bytea, jsonb, boolean, interval, integer),
    @extschema@.idem_lookup(bigint, bytea),
    @extschema@.idem_platform_claim(bytea, bytea, interval),
    @extschema@.idem_platform_complete(bytea, jsonb, interval, integer),
    @extschema@.idem_platform_fail(bytea, jsonb, boolean, interval, integer),
    @extschema@.idem_platform_lookup(bytea),
    @extschema@.idem_purge(integer)
FROM PUBLIC;
