/*-------------------------------------------------------------------------
 *
 * citus.c
 *	  idem on Citus: whether a table is distributed, the local shard that
 *	  holds a tenant's keys, the Citus half of idem_install, and the purge
 *	  of every shard.  idem does not link against Citus: everything here
 *	  goes through Citus's catalog tables and SQL functions, and only when
 *	  they exist (pg_catalog.pg_dist_partition), so plain PostgreSQL never
 *	  runs any of it.
 *
 *	  On Citus the tenant ledger is distributed by tenant_id and co-located
 *	  with tenants, and the tenant API functions (idem_apply included) are
 *	  distributed by their tenant_id argument with force_delegation: Citus
 *	  runs the call in the worker backend that holds the tenant's shard,
 *	  inside the handler's distributed transaction (idem_apply's handler
 *	  runs there too).  There idem reads and writes the shard
 *	  itself (idempotency_keys_<shardid>, with its FK to the co-located
 *	  tenants shard), exactly as it does the single-node ledger: key lock,
 *	  probes, direct write, commit hook and Valkey copy all run in that
 *	  backend.  The distributed table on the coordinator and the shell
 *	  tables on workers are never read or written by idem: a call that
 *	  reaches a node without an active placement of the shard fails.
 *	  idem_install delegates the functions the installed version has; a
 *	  utility hook delegates those ALTER EXTENSION idem UPDATE creates, on
 *	  the coordinator, once the update has run (Citus runs it on the
 *	  workers after the coordinator).
 *
 *	  Locking: once it knows the tenant's shard, a call takes the lock
 *	  Citus's executor takes for a write to that shard, through Citus's own
 *	  lock_shard_metadata(ShareLock, ...): Citus picks the lock tag (for a
 *	  hash-distributed table, one per co-location group and shard index),
 *	  so idem meets whatever Citus takes.  A shard move or split, in either
 *	  transfer mode, takes that lock in ExclusiveLock on every node
 *	  (BlockWritesToShardList) before it copies (block_writes) or before
 *	  its final catch-up (logical replication), and holds it to its commit.
 *	  So a move waits for every running transaction that read or wrote the
 *	  shard through idem, handler transactions and idem's own alike, and
 *	  idem's transactions, all in ShareLock, never wait for one another.
 *	  A call arriving meanwhile waits for the move, then reads the
 *	  placement again under a fresh snapshot and finds the shard gone (an
 *	  error: the caller retries and Citus delegates to the new node).
 *	  Nothing is lost or written twice.
 *
 *	  Cached state: whether a ledger is distributed is remembered per
 *	  relation and forgotten by a relcache callback (Citus invalidates the
 *	  relation when its distribution changes).  The local shard of each
 *	  tenant is remembered per backend and forgotten on any relcache
 *	  invalidation of the ledger, which Citus sends for every change to its
 *	  shards or placements: a call for a tenant seen before takes the shard
 *	  lock, receives pending invalidations, and skips the two catalog
 *	  lookups when nothing changed.  The lock is taken on every call.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "catalog/namespace.h"
#include "catalog/pg_class.h"
#include "catalog/pg_namespace.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "storage/lockdefs.h"
#include "tcop/utility.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/hsearch.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"

#include "citus.h"
#include "cache_cluster.h"
#include "ledger_row.h"

/* The last relation asked about, and the answer. */
static Oid	dist_relid = InvalidOid;
static bool dist_answer = false;

static ProcessUtility_hook_type citus_prev_utility = NULL;

/*
 * The tenant API functions Citus delegates to the node of the tenant's
 * shard: those of these names whose first argument is tenant_id (bigint),
 * so idem_emit(tenant_id, key, stream, message) and not idem_emit(stream,
 * message, key).
 */
#define IDEM_CITUS_DELEGATED \
	"idem_claim,idem_complete,idem_fail,idem_lookup,idem_apply,idem_complete_fenced,idem_fail_fenced,idem_emit,idem_emit_many"

static SPIPlanPtr shard_plan = NULL;
static SPIPlanPtr lock_plan = NULL;
static SPIPlanPtr placement_plan = NULL;

/*
 * The local shard of each tenant seen, for the distributed ledger
 * tenant_shards_ledger.  An entry holds while tenant_shards_gen has not
 * moved: any relcache invalidation of the ledger moves it, and Citus
 * sends one for every change to the ledger's shards or placements (a
 * move, a split, a shard dropped), on every node with metadata.
 */
typedef struct TenantShard
{
	int64		tenant_id;		/* hash key */
	int64		shardid;
	Oid			shard;			/* the local shard table */
	uint64		gen;			/* tenant_shards_gen when looked up */
} TenantShard;

#define TENANT_SHARDS_MAX	65536

static HTAB *tenant_shards = NULL;
static Oid	tenant_shards_ledger = InvalidOid;
static uint64 tenant_shards_gen = 1;

/* Called by ledger_store_relcache_cb: no callback slot of its own. */
void
idem_citus_relcache_cb(Datum arg, Oid relid)
{
	if (relid == InvalidOid || relid == dist_relid)
		dist_relid = InvalidOid;
	if (relid == InvalidOid || relid == tenant_shards_ledger)
		tenant_shards_gen++;
}

/* Citus is loaded and created in this database. */
static bool
citus_present(void)
{
	return OidIsValid(get_relname_relid("pg_dist_partition", PG_CATALOG_NAMESPACE));
}

/*
 * The distribution method of a Citus table ('h' hash, 'n' reference or
 * local, ...), or 0 for a table Citus does not know; *distcol receives
 * the name of the hash distribution column.
 */
static char
citus_partmethod(Oid relid, char **distcol)
{
	Datum		arg = ObjectIdGetDatum(relid);
	Oid			argtype = OIDOID;
	char		method = 0;
	bool		isnull;

	if (!citus_present())
		return 0;
	SPI_connect();
	if (SPI_execute_with_args("SELECT partmethod::text,"
							  " CASE WHEN partmethod OPERATOR(pg_catalog.=) 'h'"
							  " THEN pg_catalog.column_to_column_name(logicalrelid, partkey) END"
							  " FROM pg_catalog.pg_dist_partition WHERE logicalrelid OPERATOR(pg_catalog.=) $1",
							  1, &argtype, &arg, NULL, true, 1) != SPI_OK_SELECT)
		elog(ERROR, "could not read pg_dist_partition");
	if (SPI_processed > 0)
	{
		char	   *m = SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1);
		char	   *col = SPI_getvalue(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2);

		method = m ? m[0] : 0;
		if (distcol)
			*distcol = col ? MemoryContextStrdup(CurrentMemoryContext, col) : NULL;
		(void) isnull;
	}
	SPI_finish();
	if (distcol && method == 0)
		*distcol = NULL;
	return method;
}

bool
idem_citus_distributed(Oid relid)
{
	if (relid != dist_relid)
	{
		bool		answer = citus_partmethod(relid, NULL) == 'h';

		dist_answer = answer;
		dist_relid = relid;
	}
	return dist_answer;
}

/* A plan prepared once per backend and kept (inside SPI_connect). */
static SPIPlanPtr
kept_plan(SPIPlanPtr *slot, const char *sql, int nargs, Oid *argtypes)
{
	if (*slot == NULL)
	{
		SPIPlanPtr	plan = SPI_prepare(sql, nargs, argtypes);

		if (plan == NULL)
			elog(ERROR, "could not prepare \"%s\": %s",
				 sql, SPI_result_code_string(SPI_result));
		SPI_keepplan(plan);
		*slot = plan;
	}
	return *slot;
}

/*
 * Take, until the transaction ends, the lock Citus's executor takes on the
 * metadata of a shard it writes (ShareLock), by calling Citus's own
 * lock_shard_metadata(): a move or split of the shard's co-location group
 * takes the same lock in ExclusiveLock, so it waits for this transaction,
 * and a call made while a move holds it waits for the move.  Citus lets
 * only the table's owner take it: the call runs as the ledger's owner,
 * in a restricted security context (inside SPI_connect).
 */
static void
lock_citus_shard(Oid relid, int64 shardid)
{
	Oid			argtypes[2] = {INT4OID, INT8OID};
	Datum		args[2];
	HeapTuple	tuple;
	Oid			owner;
	Oid			save_userid;
	int			save_sec_context;
	int			rc;

	tuple = SearchSysCache1(RELOID, ObjectIdGetDatum(relid));
	if (!HeapTupleIsValid(tuple))
		elog(ERROR, "cache lookup failed for relation %u", relid);
	owner = ((Form_pg_class) GETSTRUCT(tuple))->relowner;
	ReleaseSysCache(tuple);

	args[0] = Int32GetDatum(ShareLock);
	args[1] = Int64GetDatum(shardid);
	GetUserIdAndSecContext(&save_userid, &save_sec_context);
	SetUserIdAndSecContext(owner, save_sec_context |
						   SECURITY_LOCAL_USERID_CHANGE |
						   SECURITY_RESTRICTED_OPERATION);
	rc = SPI_execute_plan(kept_plan(&lock_plan,
									"SELECT pg_catalog.lock_shard_metadata($1, ARRAY[$2])",
									2, argtypes),
						  args, NULL, false, 1);
	SetUserIdAndSecContext(save_userid, save_sec_context);
	if (rc != SPI_OK_SELECT)
		elog(ERROR, "could not lock the metadata of Citus shard " INT64_FORMAT ": %s",
			 shardid, SPI_result_code_string(rc));
}

/* Remember the local shard of a tenant, as of generation gen. */
static void
tenant_shard_remember(Oid relid, int64 tenant_id, int64 shardid, Oid shard,
					  uint64 gen)
{
	TenantShard *entry;

	if (tenant_shards != NULL &&
		(relid != tenant_shards_ledger ||
		 hash_get_num_entries(tenant_shards) >= TENANT_SHARDS_MAX))
	{
		hash_destroy(tenant_shards);
		tenant_shards = NULL;
	}
	if (tenant_shards == NULL)
	{
		HASHCTL		ctl;

		ctl.keysize = sizeof(int64);
		ctl.entrysize = sizeof(TenantShard);
		ctl.hcxt = TopMemoryContext;
		tenant_shards = hash_create("idem Citus tenant shards", 256, &ctl,
									HASH_ELEM | HASH_BLOBS | HASH_CONTEXT);
		tenant_shards_ledger = relid;
	}
	entry = hash_search(tenant_shards, &tenant_id, HASH_ENTER, NULL);
	entry->shardid = shardid;
	entry->shard = shard;
	entry->gen = gen;
}

/*
 * The local shard of the distributed ledger that holds tenant_id; ERROR
 * when this node has no active placement of it.  *shardid receives the
 * shard's id, which suffixes the shard's table and constraint names.
 *
 * A tenant seen before costs the lock alone: once the lock is held, no
 * move or split of the shard can start, and one that ended before has
 * sent its invalidations, which AcceptInvalidationMessages receives; an
 * entry still current then is the shard's placement for the rest of the
 * transaction.  Otherwise the shard is looked up in Citus's metadata.
 */
Oid
idem_citus_local_shard(Oid relid, int64 tenant_id, int64 *shardid)
{
	Datum		args[2];
	Oid			argtypes[2] = {REGCLASSOID, INT8OID};
	bool		isnull;
	bool		local;
	int64		id;
	Snapshot	snapshot;
	int			rc;
	char	   *shardname;
	Oid			shard;
	uint64		gen;

	if (tenant_shards != NULL && relid == tenant_shards_ledger)
	{
		TenantShard *entry = hash_search(tenant_shards, &tenant_id, HASH_FIND, NULL);

		if (entry != NULL && entry->gen == tenant_shards_gen)
		{
			gen = entry->gen;
			SPI_connect();
			lock_citus_shard(relid, entry->shardid);
			SPI_finish();
			AcceptInvalidationMessages();
			if (gen == tenant_shards_gen)
			{
				*shardid = entry->shardid;
				return entry->shard;
			}
		}
	}

	args[0] = ObjectIdGetDatum(relid);
	args[1] = Int64GetDatum(tenant_id);
	SPI_connect();
	if (SPI_execute_plan(kept_plan(&shard_plan,
								   "SELECT pg_catalog.get_shard_id_for_distribution_column($1, $2)",
								   2, argtypes),
						 args, NULL, true, 1) != SPI_OK_SELECT ||
		SPI_processed != 1)
		elog(ERROR, "could not find the Citus shard of tenant " INT64_FORMAT, tenant_id);
	id = DatumGetInt64(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1,
									 &isnull));
	if (isnull)
		elog(ERROR, "could not find the Citus shard of tenant " INT64_FORMAT, tenant_id);

	/*
	 * Hold off moves and splits of the shard until the transaction ends,
	 * then look at the placement as it is now, not as the transaction's
	 * snapshot (REPEATABLE READ) saw it before a move that finished while
	 * this call waited: such a move has taken the shard away.
	 */
	lock_citus_shard(relid, id);
	AcceptInvalidationMessages();
	gen = tenant_shards_gen;

	args[0] = Int64GetDatum(id);
	argtypes[0] = INT8OID;
	snapshot = RegisterSnapshot(GetLatestSnapshot());
	rc = SPI_execute_snapshot(kept_plan(&placement_plan,
										"SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_dist_placement p"
										" WHERE p.shardid OPERATOR(pg_catalog.=) $1"
										" AND p.shardstate OPERATOR(pg_catalog.=) 1"
										" AND p.groupid OPERATOR(pg_catalog.=) (SELECT groupid FROM pg_catalog.pg_dist_local_group))",
										1, argtypes),
							  args, NULL, snapshot, InvalidSnapshot, true, false, 1);
	UnregisterSnapshot(snapshot);
	if (rc != SPI_OK_SELECT || SPI_processed != 1)
		elog(ERROR, "could not read the placement of Citus shard " INT64_FORMAT, id);
	local = DatumGetBool(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1,
									   &isnull));
	SPI_finish();

	shardname = psprintf("%s_" INT64_FORMAT, get_rel_name(relid), id);
	shard = local ? get_relname_relid(shardname, get_rel_namespace(relid)) : InvalidOid;
	if (!OidIsValid(shard))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("the idem ledger shard of tenant " INT64_FORMAT " is not on this node", tenant_id),
				 errdetail("On Citus, idem reads and writes only the local shard that holds the tenant (%s), never the distributed table; Citus did not delegate this call to the node that holds it, or the shard moved away while the call waited for the move.",
						   shardname),
				 errhint("Call the function as a statement of its own, SELECT idem_claim(...) or SELECT * FROM idem_claim(...), with tenant_id a constant or a parameter, so that Citus delegates it; not from a PL/pgSQL expression, a subquery or an INSERT ... SELECT.")));
	/* this node copies into the cluster's cache only (cache_cluster.c) */
	idem_cache_cluster_mark(MyDatabaseId);
	tenant_shard_remember(relid, tenant_id, id, shard, gen);
	*shardid = id;
	return shard;
}

/*
 * idem_install on a coordinator whose tenants table is distributed: the
 * tenants table must be hash-distributed by id.  Returns false when
 * tenants is not a Citus table (plain PostgreSQL), true when the tenant
 * ledger is to be distributed.
 */
bool
idem_citus_check_tenants(Oid tenants)
{
	char	   *distcol = NULL;
	char		method = citus_partmethod(tenants, &distcol);

	if (method == 0)
		return false;
	if (method != 'h' || distcol == NULL || strcmp(distcol, "id") != 0)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("table \"%s\" is a Citus table not distributed by \"id\"",
						get_rel_name(tenants)),
				 errdetail("On Citus, idem distributes its tenant ledger by tenant_id, co-located with tenants, which must be hash-distributed by id."),
				 errhint("SELECT create_distributed_table('%s', 'id'), then idem_install.",
						 get_rel_name(tenants))));
	return true;
}

/*
 * Distribute the tenant API functions of the extension's schema NSP that
 * Citus does not know yet by their tenant_id argument, co-located with the
 * distributed tenant ledger QLEDGER, with force_delegation (inside SPI).
 * Returns how many it distributed.
 */
static uint64
citus_delegate(const char *qledger, Oid nsp)
{
	StringInfoData sql;

	initStringInfo(&sql);
	appendStringInfo(&sql,
					 "SELECT pg_catalog.create_distributed_function(p.oid::pg_catalog.regprocedure,"
					 " '$1'::pg_catalog.text, colocate_with => %s::pg_catalog.text, force_delegation => true)"
					 " FROM pg_catalog.pg_proc p WHERE p.pronamespace OPERATOR(pg_catalog.=) %u"
					 " AND p.proname OPERATOR(pg_catalog.=) ANY ('{" IDEM_CITUS_DELEGATED "}')"
					 " AND p.proargtypes[0] OPERATOR(pg_catalog.=) 'pg_catalog.int8'::pg_catalog.regtype"
					 " AND NOT EXISTS (SELECT FROM pg_catalog.pg_dist_object o"
					 " WHERE o.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass"
					 " AND o.objid OPERATOR(pg_catalog.=) p.oid"
					 " AND o.distribution_argument_index IS NOT NULL)",
					 quote_literal_cstr(qledger), nsp);
	if (SPI_execute(sql.data, false, 0) != SPI_OK_SELECT)
		elog(ERROR, "could not distribute the idem tenant functions");
	pfree(sql.data);
	return SPI_processed;
}

/*
 * After ALTER EXTENSION idem UPDATE on a Citus coordinator whose tenant
 * ledger is distributed: the tenant API functions the update created
 * (idem_complete_fenced, idem_fail_fenced, the tenant form of idem_emit and
 * idem_emit_many from 0.4) are delegated as
 * idem_install delegated those that existed then.  Citus has run the
 * update on the workers by now (it propagates the statement after running
 * it here), so they have the functions too.  Runs as the caller of the
 * update, the extension's owner or a superuser, as idem_install does.
 */
static void
citus_delegate_after_update(void)
{
	Oid			nsp = InvalidOid;
	Oid			ledger;
	bool		coordinator = false;
	bool		isnull;

	if (!citus_present())
		return;
	SPI_connect();
	if (SPI_execute("SELECT e.extnamespace, pg_catalog.citus_is_coordinator()"
					" FROM pg_catalog.pg_extension e WHERE e.extname OPERATOR(pg_catalog.=) 'idem'",
					true, 1) != SPI_OK_SELECT)
		elog(ERROR, "could not ask Citus whether this node is the coordinator");
	if (SPI_processed == 1)
	{
		nsp = DatumGetObjectId(SPI_getbinval(SPI_tuptable->vals[0],
											 SPI_tuptable->tupdesc, 1, &isnull));
		coordinator = DatumGetBool(SPI_getbinval(SPI_tuptable->vals[0],
												 SPI_tuptable->tupdesc, 2, &isnull)) && !isnull;
	}
	ledger = coordinator ? get_relname_relid(ledger_table_name(LEDGER_TENANT), nsp) : InvalidOid;
	if (OidIsValid(ledger) && idem_citus_distributed(ledger))
		(void) citus_delegate(quote_qualified_identifier(get_namespace_name(nsp),
														 get_rel_name(ledger)),
							  nsp);
	SPI_finish();
}

static void
citus_process_utility(PlannedStmt *pstmt, const char *queryString, bool readOnlyTree,
					  ProcessUtilityContext context, ParamListInfo params,
					  QueryEnvironment *queryEnv, DestReceiver *dest, QueryCompletion *qc)
{
	Node	   *stmt = pstmt->utilityStmt;
	bool		idem_update = IsA(stmt, AlterExtensionStmt) &&
		strcmp(((AlterExtensionStmt *) stmt)->extname, "idem") == 0;

	if (citus_prev_utility)
		citus_prev_utility(pstmt, queryString, readOnlyTree, context, params,
						   queryEnv, dest, qc);
	else
		standard_ProcessUtility(pstmt, queryString, readOnlyTree, context, params,
								queryEnv, dest, qc);
	if (idem_update)
		citus_delegate_after_update();
}

/* From _PG_init. */
void
idem_citus_register(void)
{
	citus_prev_utility = ProcessUtility_hook;
	ProcessUtility_hook = citus_process_utility;
}

/*
 * Distribute the tenant ledger (just created, its primary key made
 * (tenant_id, id) because Citus requires the distribution column in every
 * unique constraint) co-located with tenants, and the tenant API by its
 * tenant_id argument with force_delegation.  Runs inside idem_install's
 * SPI connection and search_path.
 */
void
idem_citus_distribute(const char *qledger, const char *qtenants, Oid nsp)
{
	StringInfoData sql;

	initStringInfo(&sql);
	appendStringInfo(&sql,
					 "SELECT pg_catalog.create_distributed_table(%s, 'tenant_id',"
					 " colocate_with => %s)",
					 quote_literal_cstr(qledger), quote_literal_cstr(qtenants));
	if (SPI_execute(sql.data, false, 0) != SPI_OK_SELECT)
		elog(ERROR, "could not distribute the idem tenant ledger");
	if (citus_delegate(qledger, nsp) < 5)
		elog(ERROR, "could not distribute the idem tenant functions");
}

/*
 * Run CMD, one purge batch (ledger_store.c) that returns the rows it
 * deleted, on every shard of the distributed tenant ledger RELID, through
 * run_command_on_shards (%1$L in it is the shard's name, as a literal; a
 * connection per shard placement, outside this transaction: each shard's
 * batch commits on its own, like a purge batch).  Returns the rows deleted.
 *
 * CMD calls idem_shard_purge, revoked from PUBLIC: it runs as the idem
 * extension's owner, once the caller is known to hold on the ledger the
 * privileges the single-node purge needs (SELECT, UPDATE for its FOR
 * UPDATE SKIP LOCKED, DELETE).
 */
int64
idem_citus_purge(Oid relid, const char *cmd)
{
	Datum		args[2];
	Oid			argtypes[2] = {REGCLASSOID, TEXTOID};
	int64		deleted = 0;
	uint64		i;
	AclMode		modes[3] = {ACL_SELECT, ACL_UPDATE, ACL_DELETE};
	Oid			owner;
	Oid			save_userid;
	int			save_sec_context;
	bool		isnull;
	int			rc;

	for (i = 0; i < lengthof(modes); i++)
	{
		AclResult	acl = pg_class_aclcheck(relid, GetUserId(), modes[i]);

		if (acl != ACLCHECK_OK)
			aclcheck_error(acl, OBJECT_TABLE, get_rel_name(relid));
	}
	args[0] = ObjectIdGetDatum(relid);
	args[1] = CStringGetTextDatum(cmd);
	SPI_connect();
	if (SPI_execute("SELECT extowner FROM pg_catalog.pg_extension"
					" WHERE extname OPERATOR(pg_catalog.=) 'idem'", true, 1) != SPI_OK_SELECT ||
		SPI_processed != 1)
		elog(ERROR, "could not read the idem extension's owner");
	owner = DatumGetObjectId(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull));
	GetUserIdAndSecContext(&save_userid, &save_sec_context);
	SetUserIdAndSecContext(owner, save_sec_context | SECURITY_LOCAL_USERID_CHANGE);
	rc = SPI_execute_with_args("SELECT success, result FROM pg_catalog.run_command_on_shards($1, $2)",
							   2, argtypes, args, NULL, false, 0);
	SetUserIdAndSecContext(save_userid, save_sec_context);
	if (rc != SPI_OK_SELECT)
		elog(ERROR, "could not run the idem purge on the Citus shards");
	for (i = 0; i < SPI_processed; i++)
	{
		bool		ok = DatumGetBool(SPI_getbinval(SPI_tuptable->vals[i],
													SPI_tuptable->tupdesc, 1, &isnull));
		char	   *result = SPI_getvalue(SPI_tuptable->vals[i], SPI_tuptable->tupdesc, 2);

		if (!ok)
			ereport(ERROR,
					(errcode(ERRCODE_CONNECTION_FAILURE),
					 errmsg("idem purge failed on a shard of the tenant ledger"),
					 errdetail("%s", result ? result : "(no message)")));
		deleted += pg_strtoint64(result);
	}
	SPI_finish();
	return deleted;
}
