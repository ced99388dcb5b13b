/*-------------------------------------------------------------------------
 *
 * cache_keyspace.c
 *	  The Valkey namespace of a database: idem.valkey_prefix, the cluster's
 *	  system identifier, the WAL timeline, the history epoch and the
 *	  database's OID (cache_format.h), and the SQL function
 *	  idem_cache_keyspace() that tells clients the namespace their
 *	  connection's database uses right now.
 *
 * Two databases, two clusters, one cluster before and after a promotion,
 * or two histories of one cluster (a restore, a clone: the epoch,
 * cache_secret.c) never share a key, so a value written for one of them is
 * never read for another: the cache starts empty and old keys expire.
 * Nothing is copied during recovery, so there is no keyspace on a hot
 * standby; nor before the worker has taken this start's epoch over in
 * Valkey, so that runners never read Valkey for a history that may not be
 * this server's.
 *
 * On Citus the keyspace is the cluster's, which the coordinator names
 * (cache_cluster.c).
 *
 * No state and no locks of its own: everything is read when asked.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox_ring.h"

#include "access/xlog.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"

/*
 * Write the keyspace of database dboid on the given timeline and epoch into
 * buf (IDEM_CACHE_KEYSPACE_MAX + 1 bytes).  Returns its length, or -1 if
 * the prefix is too long (the GUC's check prevents that).
 */
int
idem_cache_keyspace_of(char *buf, size_t buflen, Oid dboid, TimeLineID timeline,
					   uint64 epoch)
{
	return idem_cache_keyspace(buf, buflen,
							   idem_valkey_prefix ? idem_valkey_prefix : "",
							   GetSystemIdentifier(), timeline, epoch, dboid);
}

/* The same for the epoch owner key (IDEM_CACHE_EPOCH_KEY_MAX bytes). */
int
idem_cache_epoch_key_of(char *buf, size_t buflen, TimeLineID timeline,
						uint64 epoch)
{
	return idem_cache_epoch_key(buf, buflen,
								idem_valkey_prefix ? idem_valkey_prefix : "",
								GetSystemIdentifier(), timeline, epoch);
}

PG_FUNCTION_INFO_V1(idem_cache_keyspace_sql);

/* idem_cache_keyspace() RETURNS text */
Datum
idem_cache_keyspace_sql(PG_FUNCTION_ARGS)
{
	char		buf[IDEM_CACHE_KEYSPACE_MAX + 1];
	uint64		epoch;

	if (RecoveryInProgress())
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("recovery is in progress"),
				 errdetail("idem copies nothing to Valkey during recovery, so there is no cache keyspace."),
				 errhint("Use PostgreSQL alone, or connect to the primary.")));
	if (!idem_outbox_available())
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idem is not in shared_preload_libraries"),
				 errdetail("Without idem's worker nothing is copied to Valkey, so there is no cache keyspace."),
				 errhint("Use PostgreSQL alone, or preload idem.")));
	if (!idem_cache_epoch_confirmed(&epoch))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("the Valkey cache is not ready"),
				 errdetail("idem's worker has not yet taken this server's cache epoch over in Valkey since the server started or the epoch changed."),
				 errhint("Use PostgreSQL alone meanwhile, and ask again later; idem_stats() shows whether the worker reaches Valkey.")));
	/* On Citus, the cluster's keyspace (cache_cluster.c) */
	switch (idem_cache_cluster_keyspace(buf, sizeof(buf),
										get_func_namespace(fcinfo->flinfo->fn_oid),
										epoch))
	{
		case 1:
			PG_RETURN_TEXT_P(cstring_to_text(buf));
		case -1:
			ereport(ERROR,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("the Valkey cache of this Citus cluster is not ready on this node"),
					 errdetail("This node copies into the cluster's cache once the coordinator has sent it the cluster's keyspace and secrets for this node's current cache epoch."),
					 errhint("Learn the keyspace on the coordinator, or ask again later.")));
		default:
			break;
	}
	if (idem_cache_keyspace_of(buf, sizeof(buf), MyDatabaseId,
							   GetWALInsertionTimeLine(), epoch) < 0)
		elog(ERROR, "idem.valkey_prefix is longer than %d bytes",
			 IDEM_CACHE_PREFIX_MAX);
	PG_RETURN_TEXT_P(cstring_to_text(buf));
}
