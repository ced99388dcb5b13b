/*-------------------------------------------------------------------------
 *
 * cache_sql.c
 *	  What a runner learns of the Valkey cache, as SQL: the keyspace its
 *	  connection's database copies into (idem_cache_keyspace()), and the
 *	  secrets that MAC the values with the epoch owner key and token that
 *	  make them trustworthy (idem_cache_secrets()).  On a Citus cluster
 *	  both are the cluster's (cache_cluster.c); else this server's own
 *	  (cache_keyspace.c, cache_secret.c).  Above the three, which it reads
 *	  and which never call it.
 *
 * No state and no locks of its own: each file it calls takes its own.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xlog.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"

#include "cache_cluster.h"
#include "cache_format.h"
#include "cache_keyspace.h"
#include "cache_secret.h"
#include "citus.h"
#include "compat.h"
#include "commit_ring.h"

PG_FUNCTION_INFO_V1(idem_cache_keyspace_sql);

/* idem_cache_keyspace() RETURNS text */
Datum
idem_cache_keyspace_sql(PG_FUNCTION_ARGS)
{
	char		buf[IDEM_CACHE_KEYSPACE_MAX + 1];
	uint64		epoch;
	Oid			ledger;

	if (RecoveryInProgress())
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("recovery is in progress"),
				 errdetail("idem copies nothing to Valkey during recovery, so there is no cache keyspace."),
				 errhint("Use PostgreSQL alone, or connect to the primary.")));
	if (!idem_ring_available())
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idem is not in shared_preload_libraries"),
				 errdetail("Without idem's worker nothing is copied to Valkey, so there is no cache keyspace."),
				 errhint("Use PostgreSQL alone, or preload idem.")));
	if (!idem_cache_epoch_confirmed(&epoch))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("the Valkey cache is not ready"),
				 errdetail("idem's worker has not yet taken this server's history epoch over in Valkey since the server started or the epoch changed."),
				 errhint("Use PostgreSQL alone meanwhile, and ask again later; idem_stats() shows whether the worker reaches Valkey.")));
	/*
	 * On Citus, where the tenant ledger is distributed, the cluster's
	 * keyspace (idem_cache_cluster_keyspace)
	 */
	ledger = get_relname_relid("idempotency_keys",
							   get_func_namespace(fcinfo->flinfo->fn_oid));
	switch (OidIsValid(ledger) && idem_citus_distributed(ledger) ?
			idem_cache_cluster_keyspace(buf, sizeof(buf), ledger, epoch) : 0)
	{
		case 1:
			PG_RETURN_TEXT_P(cstring_to_text(buf));
		case -1:
			ereport(ERROR,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("the Valkey cache of this Citus cluster is not ready on this node"),
					 errdetail("This node copies into the cluster's cache once the coordinator has sent it the cluster's keyspace and secrets for this node's current history epoch."),
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

PG_FUNCTION_INFO_V1(idem_cache_secrets);

/*
 * idem_cache_secrets() RETURNS TABLE(key_id integer, secret bytea,
 * is_current boolean, owner_key text, owner_token text): the current
 * secret, then the previous one if any; on each row the epoch owner key and
 * the token it holds while this server owns the epoch (cache_secret.c's
 * header), both NULL when the worker has not taken the epoch over (the
 * runner then does not use the cache).
 */
Datum
idem_cache_secrets(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	IdemCacheSecrets s;
	IdemEpochTakeover owned;
	char		owner_key[IDEM_CACHE_EPOCH_KEY_MAX];
	char		owner_token[IDEM_CACHE_EPOCH_TOKEN_LEN + 1];
	bool		has_owner;
	Datum		values[5];
	bool		nulls[5] = {false, false, false, false, false};
	bytea	   *b;
	int			i;

	InitMaterializedSRF(fcinfo, 0);
	/*
	 * On a node of a Citus cluster, the cluster's secrets, and on the
	 * coordinator the cluster keyspace's owner key (idem_cache_cluster_owner).
	 */
	if (idem_cache_cluster_joined(MyDatabaseId, NULL, &s) == 1)
		has_owner = idem_cache_cluster_owner(MyDatabaseId, owner_key,
											 sizeof(owner_key),
											 &owned.new_token);
	else
	{
		idem_cache_secrets_get(&s);
		/* the owner of the epoch these secrets belong to, if it is this one */
		has_owner = idem_cache_epoch_owned(&owned) && owned.epoch == s.epoch &&
			idem_cache_epoch_key_of(owner_key, sizeof(owner_key), owned.timeline,
									owned.epoch) >= 0;
	}
	if (has_owner)
	{
		snprintf(owner_token, sizeof(owner_token), "%016llx",
				 (unsigned long long) owned.new_token);
		values[3] = CStringGetTextDatum(owner_key);
		values[4] = CStringGetTextDatum(owner_token);
	}
	nulls[3] = nulls[4] = !has_owner;
	for (i = 0; i < 2; i++)
	{
		int32		id = i == 0 ? s.current_id : s.previous_id;

		if (id <= 0)
			continue;
		b = (bytea *) palloc(VARHDRSZ + IDEM_MAC_LEN);
		SET_VARSIZE(b, VARHDRSZ + IDEM_MAC_LEN);
		memcpy(VARDATA(b), i == 0 ? s.current : s.previous, IDEM_MAC_LEN);
		values[0] = Int32GetDatum(id);
		values[1] = PointerGetDatum(b);
		values[2] = BoolGetDatum(i == 0);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}
	explicit_bzero(&s, sizeof(s));
	return (Datum) 0;
}
