-- idem 0.3 -> 0.4.  A fresh install runs 0.1, 0.1 -> 0.2, 0.2 -> 0.3, then
-- this script.

\echo Use "ALTER EXTENSION idem UPDATE TO '0.4'" to load this file. \quit

-- Start a new history epoch when the calling transaction commits, as a
-- DELETE of ledger rows does: for changes to a ledger that PostgreSQL does
-- not report (pg_surgery's heap_force_kill, a data file put back by hand).
-- Runners stop replaying what Valkey holds for the old history.
CREATE FUNCTION @extschema@.idem_renew_epoch()
RETURNS void
AS 'MODULE_PATHNAME', 'idem_renew_epoch'
LANGUAGE C VOLATILE STRICT PARALLEL UNSAFE;

REVOKE ALL ON FUNCTION @extschema@.idem_renew_epoch() FROM PUBLIC;
