-- The Valkey namespace and the cache secret (README, "The Valkey cache").
CREATE EXTENSION idem;

-- The keyspace names the cluster, its timeline and this database.
SELECT idem_cache_keyspace() = 'idem:' || system_identifier || '.1.'
       || (SELECT oid FROM pg_database WHERE datname = current_database()) || ':'
       AS keyspace_is_cluster_timeline_database
  FROM pg_control_system();
-- One current secret of 32 bytes to start with (created at first start).
SELECT key_id > 0 AS has_id, octet_length(secret), is_current FROM idem_cache_secrets();
CREATE TEMP TABLE s0 AS SELECT * FROM idem_cache_secrets();

-- Rotation: a new current id, the old secret kept as the previous one.
SELECT idem_rotate_cache_secret() = (SELECT key_id + 1 FROM s0) AS next_id;
SELECT s.key_id - s0.key_id AS id_step, s.is_current,
       s.secret = s0.secret AS same_secret, octet_length(s.secret)
  FROM idem_cache_secrets() s, s0 ORDER BY s.key_id;
-- Another rotation forgets the oldest: two secrets at most.
SELECT idem_rotate_cache_secret() = (SELECT key_id + 2 FROM s0) AS next_id;
SELECT s.key_id - s0.key_id AS id_step, s.is_current, s.secret = s0.secret AS same_secret
  FROM idem_cache_secrets() s, s0 ORDER BY s.key_id;
SELECT count(DISTINCT secret) FROM idem_cache_secrets();

-- Not for PUBLIC: the secret authenticates every cached result.
CREATE ROLE regress_idem_cache_nobody;
SET ROLE regress_idem_cache_nobody;
SELECT * FROM idem_cache_secrets();
SELECT idem_rotate_cache_secret();
SELECT idem_cache_keyspace();
RESET ROLE;
GRANT EXECUTE ON FUNCTION idem_cache_secrets(), idem_cache_keyspace()
  TO regress_idem_cache_nobody;
SET ROLE regress_idem_cache_nobody;
SELECT count(*) FROM idem_cache_secrets();
SELECT idem_cache_keyspace() IS NOT NULL AS has_keyspace;
RESET ROLE;
DROP OWNED BY regress_idem_cache_nobody;
DROP ROLE regress_idem_cache_nobody;
DROP EXTENSION idem;
