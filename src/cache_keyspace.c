/*-------------------------------------------------------------------------
 *
 * cache_keyspace.c
 *	  The Valkey keyspace of a database: idem.valkey_prefix, the cluster's
 *	  system identifier, the WAL timeline, the history epoch and the
 *	  database's OID (cache_format.h).  The SQL function
 *	  idem_cache_keyspace() (cache_sql.c) tells clients the keyspace their
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
#include "postgres.h"

#include "access/xlog.h"

#include "cache_keyspace.h"
#include "cache_format.h"
#include "guc.h"

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


/*
 * The key of this cluster's epoch list into buf (IDEM_CACHE_EPOCH_KEY_MAX
 * bytes): <prefix><system identifier>:epochs, a Valkey list of the epochs
 * the last takeovers took over (cache_secret.c).  Returns its length, or -1.
 */
int
idem_cache_epoch_list_of(char *buf, size_t buflen)
{
	const char *prefix = idem_valkey_prefix ? idem_valkey_prefix : "";
	int			n;

	if (strlen(prefix) > IDEM_CACHE_PREFIX_MAX ||
		buflen < IDEM_CACHE_EPOCH_KEY_MAX)
		return -1;
	n = snprintf(buf, buflen, "%s" UINT64_FORMAT ":epochs", prefix,
				 GetSystemIdentifier());
	return (n < 0 || (size_t) n >= buflen) ? -1 : n;
}
