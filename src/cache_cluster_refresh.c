/*-------------------------------------------------------------------------
 *
 * cache_cluster_refresh.c
 *	  The coordinator's refresh of a Citus cluster cache: name the cluster
 *	  keyspace from every node's identity, join it itself, and send its
 *	  secrets, sealed, to each node whose join is missing or stale.
 *
 * The coordinator refreshes the joins whenever it is asked for the
 * keyspace (runners ask at least every secrets_max_age_ms): one
 * run_command_on_workers to read each node's identity and one-time key
 * (idem_cache_node), and one master_run_on_worker for the nodes whose join
 * is missing or stale (idem_cache_node_join).  Which keyspace it names is
 * idem_cluster_naming_choose's choice.  A node that does not answer
 * (within CLUSTER_CONNECT_TIMEOUT_MS to connect) is left out of the hash
 * and not joined: its tenants are served by PostgreSQL alone until it
 * answers again.
 *
 * idem_install on the coordinator refreshes the joins too, as its last
 * step (idem_cache_cluster_join_now), so that a fresh cluster's worker
 * nodes copy from their first commit rather than from the first runner's
 * learn.
 *
 * Locking: none of its own; the joins' spinlock through
 * idem_cluster_slot_join.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "access/xlog.h"
#include "catalog/pg_type.h"
#include "commands/dbcommands.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/lsyscache.h"
#include "utils/snapmgr.h"

#include "cache_cluster.h"
#include "cache_cluster_int.h"
#include "cache_cluster_seal.h"
#include "cache_format.h"
#include "cache_keyspace.h"
#include "cache_secret.h"
#include "citus.h"
#include "commit_ring.h"
#include "sha256.h"

/* How long the coordinator waits to connect to a node it asks. */
#define CLUSTER_CONNECT_TIMEOUT_MS	2000

/*
 * Seal secrets s for the node of this identity, under its one-time key,
 * for the cluster keyspace and this database: hex text, palloc'd.
 */
static char *
seal_for_node(const uint8 *key, const IdemCacheSecrets *s,
			  const char *identity, const char *keyspace)
{
	uint8		nonce[IDEM_SEAL_NONCE_LEN];
	uint8		sealed[IDEM_SEAL_LEN];
	IdemSealFor what;
	char	   *hex = palloc(2 * IDEM_SEAL_LEN + 1);

	what.identity = identity;
	what.keyspace = keyspace;
	what.database = get_database_name(MyDatabaseId);
	if (what.database == NULL)
		elog(ERROR, "could not read the name of database %u", MyDatabaseId);
	if (!pg_strong_random(nonce, sizeof(nonce)))
		ereport(ERROR,
				(errcode(ERRCODE_INTERNAL_ERROR),
				 errmsg("could not generate a random nonce")));
	if (idem_seal_secrets(key, nonce, s, &what, sealed) != IDEM_SEAL_OK)
		ereport(ERROR,
				(errcode(ERRCODE_INTERNAL_ERROR),
				 errmsg("could not seal the cache secrets for a Citus worker node"),
				 errdetail("OpenSSL's AES-256-GCM failed.")));
	idem_cache_hex(hex, sealed, IDEM_SEAL_LEN);
	hex[2 * IDEM_SEAL_LEN] = '\0';
	return hex;
}

/*
 * idem_cache_keyspace() on a database whose tenant ledger is distributed
 * by Citus (the caller has checked: idem_citus_distributed).  Returns 0
 * without idem's shared memory (the server's own keyspace applies); 1 with
 * the cluster keyspace in buf (on the coordinator, after refreshing the
 * nodes' joins; on another node, the one it joined); -1 on a node that has
 * not joined.
 */
int
idem_cache_cluster_keyspace(char *buf, size_t buflen, Oid ledger, uint64 epoch)
{
	Oid			nsp = get_rel_namespace(ledger);
	Oid			owner;
	Oid			save_userid;
	int			save_sec_context;
	int			group;
	bool		isnull;
	char		id[NODE_ID_MAX];
	TimeLineID	tli;
	uint64		own_epoch;
	char	  **ids;
	char	  **keys;
	char	  **names;
	int		   *ports;
	bool	   *need;
	ClusterMember *answered;
	ClusterMember *silent;
	ClusterMember *held;
	int			nsilent = 0;
	int			nheld = 0;
	int			n = 0;
	int			njoin = 0;
	uint64		i;
	uint64		cluster_epoch;
	ClusterMember coord;
	IdemCacheSecrets s;
	char	   *node_fn;
	int			guc_level;

	if (idem_cluster_shared == NULL)
		return 0;

	SPI_connect();
	if (SPI_execute("SELECT e.extowner, (SELECT groupid FROM pg_catalog.pg_dist_local_group)"
					" FROM pg_catalog.pg_extension e WHERE e.extname OPERATOR(pg_catalog.=) 'idem'",
					true, 1) != SPI_OK_SELECT || SPI_processed != 1)
		elog(ERROR, "could not read the idem extension's owner");
	owner = DatumGetObjectId(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull));
	group = DatumGetInt32(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2, &isnull));
	if (isnull || group != 0)
	{
		SPI_finish();
		/* a worker node: the join the coordinator made */
		idem_cache_cluster_mark(MyDatabaseId);
		return idem_cache_cluster_joined(MyDatabaseId, buf, NULL);
	}
	idem_cache_cluster_mark(MyDatabaseId);
	if (!idem_cluster_node_identity(id, sizeof(id), &tli, &own_epoch) || own_epoch != epoch)
	{
		SPI_finish();
		return -1;
	}

	/*
	 * Each worker node's identity, one-time key and join, read as the
	 * extension's owner (the functions are revoked from PUBLIC, and Citus
	 * connects as the current user).
	 */
	node_fn = psprintf("SELECT %s.idem_cache_node()",
					   quote_identifier(get_namespace_name(nsp)));

	/*
	 * A node that does not answer is left out: bound the wait for its
	 * connection, so that a runner learning the keyspace is not held for
	 * Citus's default (30 s).  Restored when this returns.
	 */
	guc_level = NewGUCNestLevel();
	(void) set_config_option("citus.node_connection_timeout",
							 CppAsString2(CLUSTER_CONNECT_TIMEOUT_MS),
							 PGC_USERSET, PGC_S_SESSION, GUC_ACTION_SAVE,
							 true, WARNING, false);
	GetUserIdAndSecContext(&save_userid, &save_sec_context);
	SetUserIdAndSecContext(owner, save_sec_context | SECURITY_LOCAL_USERID_CHANGE);
	{
		Oid			argtypes[1] = {TEXTOID};
		Datum		args[1] = {CStringGetTextDatum(node_fn)};

		if (SPI_execute_with_args("SELECT nodename, nodeport, success, result"
								  " FROM pg_catalog.run_command_on_workers($1)",
								  1, argtypes, args, NULL, false, 0) != SPI_OK_SELECT)
			elog(ERROR, "could not ask the Citus worker nodes for their cache identity");
	}
	ids = palloc0(sizeof(char *) * (SPI_processed + 1));
	keys = palloc0(sizeof(char *) * (SPI_processed + 1));
	names = palloc0(sizeof(char *) * (SPI_processed + 1));
	ports = palloc0(sizeof(int) * (SPI_processed + 1));
	need = palloc0(sizeof(bool) * (SPI_processed + 1));
	answered = palloc0(sizeof(ClusterMember) * (SPI_processed + 1));
	silent = palloc0(sizeof(ClusterMember) * (SPI_processed + 1));
	for (i = 0; i < SPI_processed; i++)
	{
		HeapTuple	tup = SPI_tuptable->vals[i];
		TupleDesc	desc = SPI_tuptable->tupdesc;
		bool		ok = DatumGetBool(SPI_getbinval(tup, desc, 3, &isnull));
		char	   *res = SPI_getvalue(tup, desc, 4);
		char	   *f[4] = {NULL, NULL, NULL, NULL};
		int			nf = 0;
		char	   *save = NULL;
		char	   *tok;

		char	   *name = SPI_getvalue(tup, desc, 1);
		int			port = DatumGetInt32(SPI_getbinval(tup, desc, 2, &isnull));

		if (!(isnull || !ok || res == NULL))
			for (tok = strtok_r(res, " ", &save); tok != NULL && nf < 4;
				 tok = strtok_r(NULL, " ", &save))
				f[nf++] = tok;
		/* a node that fails or has no keyspace now is left out */
		if (nf != 4 || strlen(f[0]) >= NODE_ID_MAX ||
			strlen(f[1]) != 2 * IDEM_SEAL_KEY_LEN ||
			strlen(f[2]) > IDEM_CACHE_KEYSPACE_MAX)
		{
			if (name != NULL)
				idem_cluster_naming_member(&silent[nsilent++], name, port, "0");
			continue;
		}
		ids[n] = pstrdup(f[0]);
		/* the one-time key, the node's join and its key id */
		keys[n] = psprintf("%s %s %s", f[1], f[2], f[3]);
		names[n] = name;
		ports[n] = port;
		idem_cluster_naming_member(&answered[n], name, port, f[0]);
		explicit_bzero(f[1], strlen(f[1]));
		n++;
	}

	/* the nodes that hold placements of the tenant ledger now */
	{
		Oid			argtypes[1] = {OIDOID};
		Datum		args[1] = {ObjectIdGetDatum(ledger)};

		if (SPI_execute_with_args("SELECT DISTINCT n.nodename, n.nodeport"
								  " FROM pg_catalog.pg_dist_shard s"
								  " JOIN pg_catalog.pg_dist_placement p USING (shardid)"
								  " JOIN pg_catalog.pg_dist_node n USING (groupid)"
								  " WHERE s.logicalrelid OPERATOR(pg_catalog.=) $1",
								  1, argtypes, args, NULL, true, 0) != SPI_OK_SELECT)
			elog(ERROR, "could not read the placements of the tenant ledger");
		held = palloc0(sizeof(ClusterMember) * (SPI_processed + 1));
		for (i = 0; i < SPI_processed; i++)
		{
			char	   *name = SPI_getvalue(SPI_tuptable->vals[i], SPI_tuptable->tupdesc, 1);
			int			port = DatumGetInt32(SPI_getbinval(SPI_tuptable->vals[i],
														   SPI_tuptable->tupdesc, 2, &isnull));

			if (name != NULL && !isnull)
				idem_cluster_naming_member(&held[nheld++], name, port, "0");
		}
	}

	/*
	 * The cluster epoch: the one named before while no node it was named
	 * with lost anything, else a hash of every node's identity
	 * (idem_cluster_naming_choose).
	 */
	idem_cluster_naming_member(&coord, "coordinator", 0, id);
	cluster_epoch = idem_cluster_naming_choose(MyDatabaseId, coord.ident,
											   idem_cluster_naming_epoch(id, ids, n),
											   answered, n, silent, nsilent,
											   held, nheld);
	if (cluster_epoch == 0)
		cluster_epoch = idem_cluster_naming_epoch(id, ids, n);
	if (idem_cache_keyspace_of(buf, buflen, MyDatabaseId, tli, cluster_epoch) < 0)
		elog(ERROR, "idem.valkey_prefix is longer than %d bytes",
			 IDEM_CACHE_PREFIX_MAX);

	/*
	 * The coordinator joins itself, with its own current secrets, and
	 * holds the owner key of the cluster keyspace: a new keyspace gets a
	 * new token, which its worker sets (woken now), and the one it
	 * replaces is retired.
	 */
	idem_cache_secrets_get(&s);
	{
		uint64		token = 0;

		while (token == 0)
			if (!pg_strong_random(&token, sizeof(token)))
				ereport(ERROR,
						(errcode(ERRCODE_INTERNAL_ERROR),
						 errmsg("could not generate a random token")));
		if (idem_cluster_slot_join(MyDatabaseId, buf, tli, own_epoch, &s,
								   token))
			idem_ring_wake();
	}

	/* Seal the secrets for each node whose join is missing or stale. */
	{
		Datum	   *dnames = palloc(sizeof(Datum) * (n + 1));
		Datum	   *dports = palloc(sizeof(Datum) * (n + 1));
		Datum	   *dcmds = palloc(sizeof(Datum) * (n + 1));
		const char *qns = quote_identifier(get_namespace_name(nsp));

		for (int j = 0; j < n; j++)
		{
			char	   *nkey = keys[j];
			char	   *njoined = strchr(nkey, ' ') + 1;
			char	   *nkeyid = strchr(njoined, ' ') + 1;
			uint8		key[IDEM_SEAL_KEY_LEN];
			char	   *sealed;

			njoined[-1] = '\0';
			nkeyid[-1] = '\0';
			need[j] = strcmp(njoined, buf) != 0 ||
				pg_strtoint32(nkeyid) != s.current_id;
			if (!need[j] || idem_cache_unhex(key, nkey, IDEM_SEAL_KEY_LEN) != 0)
				continue;
			sealed = seal_for_node(key, &s, ids[j], buf);
			explicit_bzero(key, sizeof(key));
			dnames[njoin] = CStringGetTextDatum(names[j]);
			dports[njoin] = Int32GetDatum(ports[j]);
			dcmds[njoin] = CStringGetTextDatum(psprintf("SELECT %s.idem_cache_node_join(%s, %s, %s)",
														qns, quote_literal_cstr(buf),
														quote_literal_cstr(ids[j]),
														quote_literal_cstr(sealed)));
			njoin++;
		}
		explicit_bzero(&s, sizeof(s));
		if (njoin > 0)
		{
			Oid			argtypes[3] = {TEXTARRAYOID, INT4ARRAYOID, TEXTARRAYOID};
			Datum		args[3];

			args[0] = PointerGetDatum(construct_array(dnames, njoin, TEXTOID, -1, false, TYPALIGN_INT));
			args[1] = PointerGetDatum(construct_array(dports, njoin, INT4OID, 4, true, TYPALIGN_INT));
			args[2] = PointerGetDatum(construct_array(dcmds, njoin, TEXTOID, -1, false, TYPALIGN_INT));
			/* a node that fails to join copies nothing: no ERROR for it */
			if (SPI_execute_with_args("SELECT pg_catalog.master_run_on_worker($1, $2, $3, true)",
									  3, argtypes, args, NULL, false, 0) != SPI_OK_SELECT)
				elog(ERROR, "could not send the cache secrets to the Citus worker nodes");
		}
	}
	SetUserIdAndSecContext(save_userid, save_sec_context);
	AtEOXact_GUC(true, guc_level);
	SPI_finish();
	return 1;
}

/*
 * From idem_install, once the tenant ledger is created: if it is
 * distributed, the coordinator names the cluster keyspace and joins every
 * node that answers now, as a runner's first learn would, so that results
 * committed on the worker nodes right after the install are copied, not
 * skipped as unjoined.  Nothing to do until this server's worker has taken
 * its epoch over (a runner's learn joins the nodes then); on a worker node,
 * idem_cache_cluster_keyspace only marks the database.  Reads the catalogs
 * with a snapshot that sees what the install has done (the ledger just
 * distributed, its placements).
 */
void
idem_cache_cluster_join_now(Oid ledger)
{
	char		buf[IDEM_CACHE_KEYSPACE_MAX + 1];
	uint64		epoch;

	if (idem_cluster_shared == NULL || !OidIsValid(ledger) ||
		RecoveryInProgress() || !idem_cache_epoch_confirmed(&epoch))
		return;
	CommandCounterIncrement();
	PushActiveSnapshot(GetTransactionSnapshot());
	if (idem_citus_distributed(ledger))
		(void) idem_cache_cluster_keyspace(buf, sizeof(buf), ledger, epoch);
	PopActiveSnapshot();
}
