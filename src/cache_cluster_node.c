/*-------------------------------------------------------------------------
 *
 * cache_cluster_node.c
 *	  A worker node's side of the Citus cluster cache: the two functions
 *	  the coordinator calls on it, as the extension's owner.
 *	  idem_cache_node() hands out the node's identity and a fresh one-time
 *	  key; idem_cache_node_join() opens the secrets sealed with that key
 *	  (idem_seal_open) and joins the cluster keyspace.
 *
 * The one-time key is a query result, never a statement text, so it is in
 * no log; the node keeps it in shared memory until the next join call
 * consumes it, whatever that call's outcome, so a seal is good for one
 * join only.
 *
 * Locking: the joins' spinlock (cache_cluster_int.h), held to copy the
 * one-time key in or out.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "commands/dbcommands.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "storage/spin.h"
#include "utils/builtins.h"

#include "cache_cluster.h"
#include "cache_cluster_int.h"
#include "cache_cluster_seal.h"
#include "cache_format.h"
#include "compat.h"

PG_FUNCTION_INFO_V1(idem_cache_node);

/*
 * idem_cache_node() RETURNS text: "<identity> <one-time key as 64 hex>
 * <joined keyspace or -> <joined key id or 0>", or NULL while this node
 * has no keyspace (recovery, its epoch not taken over yet).  Marks the
 * database as clustered.  Only the coordinator calls it (revoked from
 * PUBLIC), as the extension's owner.
 */
Datum
idem_cache_node(PG_FUNCTION_ARGS)
{
	char		id[NODE_ID_MAX];
	char		keyhex[2 * IDEM_SEAL_KEY_LEN + 1];
	char		joined[IDEM_CACHE_KEYSPACE_MAX + 1];
	TimeLineID	tli;
	uint64		epoch;
	uint8		key[IDEM_SEAL_KEY_LEN];
	IdemCacheSecrets s;
	char	   *out;

	if (idem_cluster_shared == NULL ||
		!idem_cluster_node_identity(id, sizeof(id), &tli, &epoch))
		PG_RETURN_NULL();
	idem_cache_cluster_mark(MyDatabaseId);
	if (!pg_strong_random(key, sizeof(key)))
		ereport(ERROR,
				(errcode(ERRCODE_INTERNAL_ERROR),
				 errmsg("could not generate a random key")));
	SpinLockAcquire(&idem_cluster_shared->mutex);
	memcpy(idem_cluster_shared->seal_key, key, sizeof(key));
	idem_cluster_shared->seal_db = MyDatabaseId;
	idem_cluster_shared->seal_valid = true;
	SpinLockRelease(&idem_cluster_shared->mutex);
	idem_cache_hex(keyhex, key, sizeof(key));
	keyhex[2 * IDEM_SEAL_KEY_LEN] = '\0';
	explicit_bzero(key, sizeof(key));
	memset(&s, 0, sizeof(s));
	if (idem_cache_cluster_joined(MyDatabaseId, joined, &s) != 1)
		strcpy(joined, "-");
	out = psprintf("%s %s %s %d", id, keyhex, joined, s.current_id);
	explicit_bzero(keyhex, sizeof(keyhex));
	explicit_bzero(&s, sizeof(s));
	PG_RETURN_TEXT_P(cstring_to_text(out));
}

PG_FUNCTION_INFO_V1(idem_cache_node_join);

/*
 * idem_cache_node_join(keyspace text, identity text, sealed text) RETURNS
 * boolean: join the cluster cache with the secrets sealed with the last
 * one-time key idem_cache_node() handed out (which this consumes), if this
 * node's identity is still the one the coordinator hashed.  false: not
 * joined (the key was used or replaced, the identity changed, the seal
 * does not open for this node, keyspace and database).  A seal of an
 * older idem is refused with a LOG line that says so: a coordinator and a
 * node of different versions do not join until both are upgraded.
 */
Datum
idem_cache_node_join(PG_FUNCTION_ARGS)
{
	char	   *keyspace = text_to_cstring(PG_GETARG_TEXT_PP(0));
	char	   *identity = text_to_cstring(PG_GETARG_TEXT_PP(1));
	char	   *sealedhex = text_to_cstring(PG_GETARG_TEXT_PP(2));
	size_t		hexlen = strlen(sealedhex);
	char		id[NODE_ID_MAX];
	TimeLineID	tli;
	uint64		epoch;
	uint8		key[IDEM_SEAL_KEY_LEN];
	uint8		buf[IDEM_SEAL_V1_LEN > IDEM_SEAL_LEN ?
					IDEM_SEAL_V1_LEN : IDEM_SEAL_LEN];
	bool		have_key;
	IdemSealFor what;
	IdemSealResult r;
	IdemCacheSecrets s;
	bool		ok;

	if (idem_cluster_shared == NULL)
		PG_RETURN_BOOL(false);
	SpinLockAcquire(&idem_cluster_shared->mutex);
	have_key = idem_cluster_shared->seal_valid &&
		idem_cluster_shared->seal_db == MyDatabaseId;
	memcpy(key, idem_cluster_shared->seal_key, sizeof(key));
	idem_cluster_shared->seal_valid = false;
	explicit_bzero(idem_cluster_shared->seal_key, sizeof(key));
	SpinLockRelease(&idem_cluster_shared->mutex);
	if (!have_key || strlen(keyspace) > IDEM_CACHE_KEYSPACE_MAX ||
		hexlen % 2 != 0 || hexlen / 2 > sizeof(buf) ||
		idem_cache_unhex(buf, sealedhex, hexlen / 2) != 0 ||
		!idem_cluster_node_identity(id, sizeof(id), &tli, &epoch) ||
		strcmp(id, identity) != 0)
	{
		explicit_bzero(key, sizeof(key));
		PG_RETURN_BOOL(false);
	}
	what.identity = identity;
	what.keyspace = keyspace;
	what.database = get_database_name(MyDatabaseId);
	r = what.database == NULL ? IDEM_SEAL_REFUSED :
		idem_seal_open(key, buf, hexlen / 2, &what, &s);
	explicit_bzero(key, sizeof(key));
	explicit_bzero(buf, sizeof(buf));
	if (r == IDEM_SEAL_OLD_FORMAT)
		ereport(LOG,
				(errmsg("cache secrets sealed by an older version of idem were refused"),
				 errdetail("This node does not copy into its Citus cluster's cache until the coordinator runs the same version of idem as this node."),
				 errhint("Finish upgrading idem on every node of the cluster.")));
	ok = r == IDEM_SEAL_OK && s.current_id > 0 && s.previous_id >= 0 &&
		idem_cluster_slot_join(MyDatabaseId, keyspace, tli, epoch, &s, 0);
	explicit_bzero(&s, sizeof(s));
	PG_RETURN_BOOL(ok);
}
