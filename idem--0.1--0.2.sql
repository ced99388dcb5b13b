-- idem 0.1 -> 0.2: idem_stats(), the counters of the commit queue, the
-- Valkey worker and the claim decisions.  A fresh install runs 0.1 and then
-- this script.

\echo Use "ALTER EXTENSION idem UPDATE TO '0.2'" to load this file. \quit

-- One row.  Without shared_preload_libraries = 'idem', preloaded is false,
-- the counters are 0 and last_error says that nothing is copied.
CREATE FUNCTION @extschema@.idem_stats(
    OUT preloaded boolean,                 -- idem is in shared_preload_libraries
    OUT valkey_connected boolean,          -- the worker holds a Valkey connection
    OUT queued bigint,                     -- copies accepted into the commit queue
    OUT copied bigint,                     -- copies written to Valkey (SET answered OK)
    OUT dropped bigint,                    -- copies refused because the queue was full
    OUT copy_errors bigint,                -- failed connects, failed batches, error replies
    OUT queue_depth bigint,                -- copies waiting in the queue now
    OUT last_error text,                   -- the worker's last failure, with its time
    OUT claims_claimed bigint,             -- claim decisions since the server started
    OUT claims_completed bigint,
    OUT claims_failed_permanent bigint,
    OUT claims_busy bigint,
    OUT claims_mismatch bigint)
RETURNS record
AS 'MODULE_PATHNAME', 'idem_stats'
LANGUAGE C VOLATILE STRICT PARALLEL SAFE;

REVOKE ALL ON FUNCTION @extschema@.idem_stats() FROM PUBLIC;
