/*-------------------------------------------------------------------------
 *
 * cache_keyspace.c
 *	  The Valkey namespace of a database: idem.valkey_prefix, the cluster's
 *	  system identifier, the WAL timeline and the database's OID
 *	  (cache_format.h), and the SQL function idem_cache_keyspace() that tells
 *	  clients the namespace their connection's database uses right now.
 *
 * Two databases, two clusters, or one cluster before and after a promotion
 * or a point-in-time restore (each starts a new timeline) never share a
 * key, so a value written for one of them is never read for another: after
 * a failover the cache starts empty and old keys expire.  Nothing is copied
 * during recovery, so there is no keyspace on a hot standby.
 *
 * No state and no locks: everything is read from PostgreSQL when asked.
 *
 *-------------------------------------------------------------------------
 */
#include "idem.h"

#include "access/xlog.h"
#include "miscadmin.h"
#include "utils/builtins.h"

/*
 * Write the keyspace of database dboid on the given timeline into buf
 * (IDEM_CACHE_KEYSPACE_MAX + 1 bytes).  Returns its length, or -1 if the
 * prefix is too long (the GUC's check prevents that).
 */
int
idem_cache_keyspace_of(char *buf, size_t buflen, Oid dboid, TimeLineID timeline)
{
	return idem_cache_keyspace(buf, buflen,
							   idem_valkey_prefix ? idem_valkey_prefix : "",
							   GetSystemIdentifier(), timeline, dboid);
}

PG_FUNCTION_INFO_V1(idem_cache_keyspace_sql);

/* idem_cache_keyspace() RETURNS text */
Datum
idem_cache_keyspace_sql(PG_FUNCTION_ARGS)
{
	char		buf[IDEM_CACHE_KEYSPACE_MAX + 1];

	if (RecoveryInProgress())
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("recovery is in progress"),
				 errdetail("idem copies nothing to Valkey during recovery, so there is no cache keyspace."),
				 errhint("Use PostgreSQL alone, or connect to the primary.")));
	if (idem_cache_keyspace_of(buf, sizeof(buf), MyDatabaseId,
							   GetWALInsertionTimeLine()) < 0)
		elog(ERROR, "idem.valkey_prefix is longer than %d bytes",
			 IDEM_CACHE_PREFIX_MAX);
	PG_RETURN_TEXT_P(cstring_to_text(buf));
}
