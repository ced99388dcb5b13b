/*-------------------------------------------------------------------------
 *
 * ledger_guard.c
 *	  Rows that leave a ledger outside idem: a DELETE, UPDATE, MERGE or
 *	  INSERT ... ON CONFLICT DO UPDATE that idem did not issue, a TRUNCATE,
 *	  a ledger dropped (as pg_restore --clean does before it restores an
 *	  older copy), altered or renamed into place.  Valkey may hold copies
 *	  of those rows' results, which a runner would replay although this
 *	  database no longer holds them: a lost effect if the message is
 *	  delivered again to be applied again.  So a transaction that did any
 *	  of that starts a new history epoch when it commits (cache_secret.c):
 *	  the old copies are never read again (and expire), the cache starts
 *	  cold.
 *
 *	  Found by two hooks that _PG_init installs once per process: the
 *	  executor's start (DML on a ledger, by any path: SQL, PL/pgSQL, SPI,
 *	  a CTE, a trigger) and the object access hook (OAT_TRUNCATE, OAT_DROP,
 *	  OAT_POST_ALTER of a ledger).  idem's own writes (its prepared
 *	  statements, the purge of expired rows, whose copies have expired
 *	  too) are let through by ledger_guard_own_begin/_end around them.
 *	  Logical replication's apply worker writes below the executor; its
 *	  transactions are caught at pre-commit by the ledger locks they hold
 *	  (guard_replayed_into_ledger).  A ledger may not become a partition
 *	  (guard_check_partition), where an upsert routed through its parent
 *	  would change it unseen.  What no hook sees (pg_surgery, files edited
 *	  by hand) the operator reports with idem_renew_epoch().
 *
 *	  A ledger is recognised by its name (idempotency_keys or
 *	  platform_idempotency_keys) in the schema that holds idem's registry
 *	  idem_ledgers: two syscache lookups, made only for relations of those
 *	  names.  On a Citus node the tenant ledger's rows live in its shards,
 *	  idempotency_keys_<shard id> in the same schema, and rows removed from
 *	  a shard renew this node's epoch the same way (a DELETE on the
 *	  distributed table reaches each shard as such a statement).  Dropping
 *	  or altering a shard does not: Citus itself drops a shard's old
 *	  placement after a move or split, and creates and alters the new one,
 *	  moving rows, never removing them; TRUNCATE of a shard does.  idem's
 *	  purge of the shards runs through idem_shard_purge(), bracketed like
 *	  idem's own writes.  Nor does altering a ledger this transaction
 *	  created and left empty (guard_new_and_empty): idem_install's, and the
 *	  shell table Citus creates on each worker node.
 *
 *	  State: one process-local flag per transaction, with its reason (and
 *	  the depth of idem's own writes), reset at every transaction end; no
 *	  shared memory and no locks of its own.  At COMMIT (after the commit
 *	  record: no allocation, no ERROR) and at PREPARE (the commit may come
 *	  from another session, so the epoch is renewed then, conservatively)
 *	  it asks for the renewal and wakes the worker; at COMMIT it then
 *	  waits, bounded, until the worker has retired the epoch replaced
 *	  (idem_renewal_wait).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/xlog.h"
#include "catalog/indexing.h"
#include "catalog/objectaccess.h"
#include "catalog/pg_class.h"
#include "catalog/pg_extension.h"
#include "catalog/pg_inherits.h"
#include "executor/executor.h"
#include "miscadmin.h"
#include "parser/parsetree.h"
#include "replication/origin.h"
#include "replication/worker_internal.h"
#include "storage/bufmgr.h"
#include "storage/lock.h"
#include "utils/fmgroids.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"

#include "ledger_guard.h"
#include "cache_secret.h"
#include "compat.h"
#include "epoch_renewal.h"
#include "ledger_row.h"
#include "commit_ring.h"

static bool guard_rows_removed = false;	/* this transaction */
static IdemEpochReason guard_reason = 0;	/* why, when it did */
static int	guard_own_depth = 0;	/* inside idem's own ledger writes */

/* The renewal at commit is due, for why (the first reason found wins). */
static void
guard_mark(IdemEpochReason why)
{
	if (!guard_rows_removed)
		guard_reason = why;
	guard_rows_removed = true;
}

static ExecutorStart_hook_type prev_executor_start = NULL;
static object_access_hook_type prev_object_access = NULL;

/*
 * Is relid a ledger, or a Citus shard of the tenant ledger (see the file
 * header)?  *shard says which.
 */
static bool
guard_is_ledger_or_shard(Oid relid, bool *shard)
{
	char	   *name = get_rel_name(relid);
	const char *tenant = ledger_table_name(LEDGER_TENANT);
	size_t		len = strlen(tenant);
	bool		ledger;

	*shard = false;
	if (name == NULL)
		return false;
	if (strncmp(name, tenant, len) == 0 && name[len] == '_' &&
		name[len + 1] != '\0' &&
		strspn(name + len + 1, "0123456789") == strlen(name + len + 1))
		*shard = true;
	ledger = (*shard || strcmp(name, tenant) == 0 ||
			  strcmp(name, ledger_table_name(LEDGER_PLATFORM)) == 0) &&
		OidIsValid(get_relname_relid("idem_ledgers", get_rel_namespace(relid)));
	pfree(name);
	if (!ledger)
		*shard = false;
	return ledger;
}

/* Is relid a ledger or a shard of one? */
bool
idem_ledger_guard_is_ledger(Oid relid, bool *shard)
{
	return guard_is_ledger_or_shard(relid, shard);
}

static bool
guard_is_ledger(Oid relid)
{
	bool		shard;

	return guard_is_ledger_or_shard(relid, &shard);
}

/*
 * Does plan (a statement's top plan, or a data-modifying CTE's) delete or
 * update rows of a ledger?  MERGE counts, whatever its actions, and so does
 * INSERT ... ON CONFLICT DO UPDATE (whether or not a row conflicts).
 */
static bool
guard_plan_removes(PlannedStmt *stmt, Plan *plan)
{
	ModifyTable *mt;
	ListCell   *lc;

	if (plan == NULL || !IsA(plan, ModifyTable))
		return false;
	mt = (ModifyTable *) plan;
	if (mt->operation != CMD_DELETE && mt->operation != CMD_UPDATE &&
		mt->operation != CMD_MERGE &&
		!(mt->operation == CMD_INSERT &&
		  mt->onConflictAction == ONCONFLICT_UPDATE))
		return false;
	foreach(lc, mt->resultRelations)
	{
		RangeTblEntry *rte = rt_fetch(lfirst_int(lc), stmt->rtable);

		if (rte->rtekind == RTE_RELATION && guard_is_ledger(rte->relid))
			return true;
	}
	return false;
}

static void
guard_executor_start(QueryDesc *queryDesc, int eflags)
{
	PlannedStmt *stmt = queryDesc->plannedstmt;

	if (!guard_rows_removed && guard_own_depth == 0 &&
		stmt->resultRelations != NIL && !(eflags & EXEC_FLAG_EXPLAIN_ONLY))
	{
		ListCell   *lc;

		if (guard_plan_removes(stmt, stmt->planTree))
			guard_mark(IDEM_EPOCH_LEDGER_ROWS_REMOVED);
		/* data-modifying CTEs: each is a subplan topped by its ModifyTable */
		foreach(lc, stmt->subplans)
		{
			if (!guard_rows_removed &&
				guard_plan_removes(stmt, (Plan *) lfirst(lc)))
				guard_mark(IDEM_EPOCH_LEDGER_ROWS_REMOVED);
		}
	}
	if (prev_executor_start)
		prev_executor_start(queryDesc, eflags);
	else
		standard_ExecutorStart(queryDesc, eflags);
}

/*
 * A ledger must not become a partition: an INSERT ... ON CONFLICT DO UPDATE
 * on its partitioned table would change its rows through tuple routing,
 * which no plan shows (guard_plan_removes).  Called when relid joined or
 * left parent (the object access hook's post-alter of pg_inherits, before
 * the command counter moves on: only SnapshotSelf sees the row it added).
 */
static void
guard_check_partition(Oid relid, Oid parent)
{
	Relation	rel;
	ScanKeyData key;
	SysScanDesc scan;
	HeapTuple	tup;
	bool		joined = false;
	bool		shard;

	if (get_rel_relkind(parent) != RELKIND_PARTITIONED_TABLE ||
		!guard_is_ledger_or_shard(relid, &shard) || shard)
		return;
	rel = table_open(InheritsRelationId, AccessShareLock);
	ScanKeyInit(&key, Anum_pg_inherits_inhrelid, BTEqualStrategyNumber,
				F_OIDEQ, ObjectIdGetDatum(relid));
	scan = systable_beginscan(rel, InheritsRelidSeqnoIndexId, true,
							  SnapshotSelf, 1, &key);
	while (!joined && HeapTupleIsValid(tup = systable_getnext(scan)))
		joined = ((Form_pg_inherits) GETSTRUCT(tup))->inhparent == parent;
	systable_endscan(scan);
	table_close(rel, AccessShareLock);
	if (joined)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("ledger \"%s\" cannot be a partition", get_rel_name(relid)),
				 errdetail("Rows routed into it through its partitioned table would be changed without idem knowing."),
				 errhint("Keep the ledger a table of its own.")));
}

/*
 * Was relid created by this transaction, and does it hold no rows (not
 * one page)?  Then altering it removes nothing Valkey may hold: no copy
 * of it exists (copies are made after commit), and no row is there to be
 * removed.  idem_install creates and alters a ledger so, and so does Citus
 * on each worker node for the tenant ledger's shell table, when the ledger
 * is distributed or a node added; such an install must not renew the
 * epoch, or the nodes' joins made during it (idem_cache_cluster_join_now)
 * would go stale at its commit.  A table created in this transaction and
 * renamed into a ledger's place needs none either: the ledger it replaces
 * was dropped or renamed away, which renews the epoch.
 */
static bool
guard_new_and_empty(Oid relid)
{
	Relation	rel = RelationIdGetRelation(relid);
	bool		r = false;

	if (RelationIsValid(rel))
	{
		r = rel->rd_createSubid != InvalidSubTransactionId &&
			rel->rd_rel->relkind == RELKIND_RELATION &&
			RelationGetNumberOfBlocks(rel) == 0;
		RelationClose(rel);
	}
	return r;
}

static void
guard_object_access(ObjectAccessType access, Oid classId, Oid objectId,
					int subId, void *arg)
{
	if (prev_object_access)
		prev_object_access(access, classId, objectId, subId, arg);
	if (access == OAT_POST_ALTER && classId == InheritsRelationId &&
		arg != NULL && guard_own_depth == 0)
		guard_check_partition(objectId,
							  ((ObjectAccessPostAlter *) arg)->auxiliary_id);
	if (guard_rows_removed || guard_own_depth > 0 ||
		classId != RelationRelationId || subId != 0)
		return;
	if (access == OAT_TRUNCATE || access == OAT_DROP ||
		access == OAT_POST_ALTER)
	{
		bool		shard;

		/* Citus drops, creates and alters shards as it moves them */
		if (guard_is_ledger_or_shard(objectId, &shard) &&
			(!shard || access == OAT_TRUNCATE) &&
			!(access == OAT_POST_ALTER && guard_new_and_empty(objectId)))
			guard_mark(IDEM_EPOCH_LEDGER_ROWS_REMOVED);
	}
}

/* From _PG_init. */
void
idem_ledger_guard_register(void)
{
	prev_executor_start = ExecutorStart_hook;
	ExecutorStart_hook = guard_executor_start;
	prev_object_access = object_access_hook;
	object_access_hook = guard_object_access;
}

/* Around idem's own writes of a ledger (ledger_store.c). */
void
ledger_guard_own_begin(void)
{
	guard_own_depth++;
}

void
ledger_guard_own_end(void)
{
	if (guard_own_depth > 0)
		guard_own_depth--;
}

/*
 * The schema of the extension idem in this database, or InvalidOid.  (15
 * does not export get_extension_schema.)  Also the outbox publisher's.
 */
Oid
idem_extension_schema(void)
{
	Relation	rel;
	ScanKeyData key;
	SysScanDesc scan;
	HeapTuple	tup;
	Oid			nsp = InvalidOid;

	rel = table_open(ExtensionRelationId, AccessShareLock);
	ScanKeyInit(&key, Anum_pg_extension_extname, BTEqualStrategyNumber,
				F_NAMEEQ, CStringGetDatum("idem"));
	scan = systable_beginscan(rel, ExtensionNameIndexId, true, NULL, 1, &key);
	tup = systable_getnext(scan);
	if (HeapTupleIsValid(tup))
		nsp = ((Form_pg_extension) GETSTRUCT(tup))->extnamespace;
	systable_endscan(scan);
	table_close(rel, AccessShareLock);
	return nsp;
}

/*
 * Is this process applying a Citus shard move's or split's own
 * subscription?  Citus names them so (multi_logical_replication.c).  Such
 * a subscription copies a shard's rows to their new placement and removes
 * none: a row removed on the source while it runs renews the source
 * node's epoch there, and changes the cluster keyspace with it.
 */
static bool
guard_citus_own_subscription(void)
{
	static const char *const prefixes[] = {
		"citus_shard_move_subscription_",
		"citus_shard_split_subscription_"
	};

	if (MySubscription == NULL || MySubscription->name == NULL)
		return false;
	for (int i = 0; i < lengthof(prefixes); i++)
		if (strncmp(MySubscription->name, prefixes[i], strlen(prefixes[i])) == 0)
			return true;
	return false;
}

/*
 * Does this transaction hold a write lock on a Citus shard of the tenant
 * ledger (idempotency_keys_<shard id> in schema nsp)?  The shards are
 * found by name, in one range scan of pg_class's name index.
 */
static bool
guard_replayed_into_shard(Oid nsp)
{
	const char *tenant = ledger_table_name(LEDGER_TENANT);
	size_t		len = strlen(tenant);
	NameData	lo;
	NameData	hi;
	Relation	rel;
	ScanKeyData key[2];
	SysScanDesc scan;
	HeapTuple	tup;
	bool		found = false;

	/* idempotency_keys_0 .. idempotency_keys_: (':' follows '9') */
	memset(&lo, 0, sizeof(lo));
	memset(&hi, 0, sizeof(hi));
	snprintf(NameStr(lo), NAMEDATALEN, "%s_0", tenant);
	snprintf(NameStr(hi), NAMEDATALEN, "%s_:", tenant);
	ScanKeyInit(&key[0], Anum_pg_class_relname, BTGreaterEqualStrategyNumber,
				F_NAMEGE, NameGetDatum(&lo));
	ScanKeyInit(&key[1], Anum_pg_class_relname, BTLessStrategyNumber,
				F_NAMELT, NameGetDatum(&hi));
	rel = table_open(RelationRelationId, AccessShareLock);
	scan = systable_beginscan(rel, ClassNameNspIndexId, true, NULL, 2, key);
	while (!found && HeapTupleIsValid(tup = systable_getnext(scan)))
	{
		Form_pg_class c = (Form_pg_class) GETSTRUCT(tup);
		const char *suffix = NameStr(c->relname) + len + 1;
		LOCKTAG		tag;

		if (c->relnamespace != nsp ||
			strspn(suffix, "0123456789") != strlen(suffix))
			continue;
		SET_LOCKTAG_RELATION(tag, MyDatabaseId, c->oid);
		found = idem_lock_held_by_me(&tag, RowExclusiveLock) ||
			idem_lock_held_by_me(&tag, AccessExclusiveLock);
	}
	systable_endscan(scan);
	table_close(rel, AccessShareLock);
	return found;
}

/*
 * Did this transaction, which replays changes made elsewhere, write a
 * ledger?  Logical replication's apply worker (and its table
 * synchronisation and parallel apply workers) writes rows below the
 * executor, as ExecSimpleRelationDelete and ExecSimpleRelationUpdate do,
 * and truncates through ExecuteTruncateGuts: neither hook above sees it.
 * But it runs with a replication origin set up, and holds RowExclusiveLock
 * (AccessExclusiveLock for a TRUNCATE) on every table it wrote until the
 * transaction ends.  An applied INSERT cannot be told from a DELETE or an
 * UPDATE that way, so any write counts: a subscriber that applies changes
 * to a ledger starts a new epoch with each such transaction.  So does one
 * that applies changes to a Citus shard of the tenant ledger, except
 * Citus's own subscriptions for a shard move or split
 * (guard_citus_own_subscription), which move rows and remove none.
 */
static bool
guard_replayed_into_ledger(void)
{
	Oid			nsp;
	int			kind;

	if (replorigin_session_origin == InvalidRepOriginId ||
		!IsTransactionState())
		return false;
	nsp = idem_extension_schema();
	if (!OidIsValid(nsp))
		return false;
	for (kind = 0; kind < LEDGER_KINDS; kind++)
	{
		const char *name = ledger_table_name((LedgerKind) kind);
		Oid			relid = get_relname_relid(name, nsp);
		LOCKTAG		tag;

		if (!OidIsValid(relid))
			continue;
		SET_LOCKTAG_RELATION(tag, MyDatabaseId, relid);
		if (idem_lock_held_by_me(&tag, RowExclusiveLock) ||
			idem_lock_held_by_me(&tag, AccessExclusiveLock))
			return true;
	}
	/* a Citus node's shards, unless Citus itself moves them */
	return !guard_citus_own_subscription() && guard_replayed_into_shard(nsp);
}

/* From the transaction callback (xact.c). */
void
idem_ledger_guard_xact_event(XactEvent event)
{
	switch (event)
	{
		case XACT_EVENT_PRE_COMMIT:
		case XACT_EVENT_PRE_PREPARE:
			if (!guard_rows_removed && guard_replayed_into_ledger())
				guard_mark(IDEM_EPOCH_LEDGER_ROWS_REPLICATED);
			break;
		case XACT_EVENT_COMMIT:
		case XACT_EVENT_PARALLEL_COMMIT:
		case XACT_EVENT_PREPARE:
			if (guard_rows_removed)
			{
				uint64		generation;

				/* reads copy nothing until COMMIT PREPARED (epoch_renewal.c) */
				if (event == XACT_EVENT_PREPARE)
					idem_renewal_prepared(GetTopTransactionIdIfAny());
				generation = idem_cache_epoch_renew(0, guard_reason);
				idem_ring_wake();
				/*
				 * The commit returns once runners no longer use the old
				 * epoch.  Not a logical replication apply worker's: it would
				 * hold back every later transaction of its subscription (a
				 * Citus shard move's catch-up among them); its renewal
				 * stands, and runners stop at the worker's retirement or at
				 * their re-learn bound.
				 */
				if (event == XACT_EVENT_COMMIT &&
					replorigin_session_origin == InvalidRepOriginId)
					idem_renewal_wait(generation);
			}
			/* FALLTHROUGH */
		case XACT_EVENT_ABORT:
		case XACT_EVENT_PARALLEL_ABORT:
			guard_rows_removed = false;
			guard_reason = 0;
			guard_own_depth = 0;
			break;
		default:
			break;
	}
}

PG_FUNCTION_INFO_V1(idem_renew_epoch);

/*
 * idem_renew_epoch() RETURNS void: start a new history epoch when this
 * transaction commits, as a removal the hooks see would.  For changes to
 * a ledger that nothing in PostgreSQL reports: pg_surgery's
 * heap_force_kill, a file put back by hand.  Transactional: a rollback
 * renews nothing.
 */
Datum
idem_renew_epoch(PG_FUNCTION_ARGS)
{
	if (RecoveryInProgress())
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("recovery is in progress"),
				 errdetail("A standby copies nothing to Valkey; it starts a new epoch of its own when it is promoted."),
				 errhint("Renew the epoch on the primary.")));
	if (!idem_ring_available())
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idem is not in shared_preload_libraries"),
				 errdetail("The history epoch lives in the shared memory of idem's worker."),
				 errhint("Preload idem; without it nothing is copied to Valkey.")));
	guard_mark(IDEM_EPOCH_RENEW_REQUESTED);
	PG_RETURN_VOID();
}
