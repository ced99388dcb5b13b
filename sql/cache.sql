-- The Valkey keyspace and the cache secret (README, "The cache secret").
CREATE EXTENSION idem;

-- No keyspace until the worker has taken this start's history epoch over in
-- Valkey (none runs here): runners then use PostgreSQL alone.  (Its shape,
-- cluster, timeline, epoch and database, is checked with a real Valkey in
-- test/t/022_history_epoch.pl.)
SELECT idem_cache_keyspace();
-- One current secret of 32 bytes to start with (created at first start).
SELECT key_id > 0 AS has_id, octet_length(secret), is_current FROM idem_cache_secrets();
-- ... and no epoch owner key or token for runners to check while no
-- worker has taken the epoch over.
SELECT owner_key IS NULL AND owner_token IS NULL AS no_owner FROM idem_cache_secrets();
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

-- idem_renew_epoch(): a new history epoch when the transaction commits,
-- with a new secret (the next key id, and no previous one: nothing of the
-- old epoch is accepted); a rollback keeps the epoch.
CREATE TEMP TABLE s1 AS SELECT * FROM idem_cache_secrets() WHERE is_current;
BEGIN;
SELECT idem_renew_epoch();
ROLLBACK;
SELECT s.key_id - s1.key_id AS id_step, s.secret = s1.secret AS same_secret
  FROM idem_cache_secrets() s, s1 WHERE s.is_current;
SELECT idem_renew_epoch();
SELECT s.key_id - s1.key_id AS id_step, s.is_current, s.secret = s1.secret AS same_secret
  FROM idem_cache_secrets() s, s1 ORDER BY s.key_id;

-- Not for PUBLIC: the secret authenticates every cached result.
CREATE ROLE regress_idem_cache_nobody;
SET ROLE regress_idem_cache_nobody;
SELECT * FROM idem_cache_secrets();
SELECT idem_rotate_cache_secret();
SELECT idem_cache_keyspace();
-- ... nor is renewing the epoch (a cold cache for every runner).
SELECT idem_renew_epoch();
RESET ROLE;
GRANT EXECUTE ON FUNCTION idem_cache_secrets(), idem_cache_keyspace()
  TO regress_idem_cache_nobody;
SET ROLE regress_idem_cache_nobody;
SELECT count(*) FROM idem_cache_secrets();
DO $$ BEGIN PERFORM idem_cache_keyspace();
EXCEPTION WHEN object_not_in_prerequisite_state THEN
  RAISE NOTICE 'allowed, and not ready yet (55000)';
END $$;
RESET ROLE;
DROP OWNED BY regress_idem_cache_nobody;
DROP ROLE regress_idem_cache_nobody;
DROP EXTENSION idem;
