/*-------------------------------------------------------------------------
 *
 * ledger_guard.c
 *	  Rows that leave a ledger outside idem: a DELETE, UPDATE or MERGE that
 *	  idem did not issue, a TRUNCATE, a ledger dropped (as pg_restore
 *	  --clean does before it restores an older copy), altered or renamed
 *	  into place.  Valkey may hold copies of those rows' results, which a
 *	  runner would replay although this database no longer holds them: a
 *	  lost effect if the message is delivered again to be applied again.
 *	  So a transaction that did any of that starts a new history epoch when
 *	  it commits (cache_secret.c): the old copies are never read again (and
 *	  expire), the cache starts cold.
 *
 *	  Found by two hooks that _PG_init installs once per process: the
 *	  executor's start (DML on a ledger, by any path: SQL, PL/pgSQL, SPI,
 *	  a CTE, a trigger) and the object access hook (OAT_TRUNCATE, OAT_DROP,
 *	  OAT_POST_ALTER of a ledger).  idem's own writes (its prepared
 *	  statements, the purge of expired rows, whose copies have expired
 *	  too) are let through by ledger_guard_own_begin/_end around them.
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
 *	  idem's own writes.
 *
 *	  State: one process-local flag per transaction (and the depth of
 *	  idem's own writes), reset at every transaction end; no shared memory
 *	  and no locks of its own.  At COMMIT (after the commit record: no
 *	  allocation, no ERROR) and at PREPARE (the commit may come from another
 *	  session, so the epoch is renewed then, conservatively) it asks for
 *	  the renewal and wakes the worker.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/objectaccess.h"
#include "catalog/pg_class.h"
#include "executor/executor.h"
#include "parser/parsetree.h"
#include "utils/lsyscache.h"

#include "ledger_guard.h"
#include "cache_secret.h"
#include "ledger_row.h"
#include "outbox_ring.h"

static bool guard_rows_removed = false;	/* this transaction */
static int	guard_own_depth = 0;	/* inside idem's own ledger writes */

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
 * update rows of a ledger?  MERGE counts, whatever its actions.
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
		mt->operation != CMD_MERGE)
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
			guard_rows_removed = true;
		/* data-modifying CTEs: each is a subplan topped by its ModifyTable */
		foreach(lc, stmt->subplans)
		{
			if (!guard_rows_removed &&
				guard_plan_removes(stmt, (Plan *) lfirst(lc)))
				guard_rows_removed = true;
		}
	}
	if (prev_executor_start)
		prev_executor_start(queryDesc, eflags);
	else
		standard_ExecutorStart(queryDesc, eflags);
}

static void
guard_object_access(ObjectAccessType access, Oid classId, Oid objectId,
					int subId, void *arg)
{
	if (prev_object_access)
		prev_object_access(access, classId, objectId, subId, arg);
	if (guard_rows_removed || guard_own_depth > 0 ||
		classId != RelationRelationId || subId != 0)
		return;
	if (access == OAT_TRUNCATE || access == OAT_DROP ||
		access == OAT_POST_ALTER)
	{
		bool		shard;

		/* Citus drops, creates and alters shards as it moves them */
		if (guard_is_ledger_or_shard(objectId, &shard) &&
			(!shard || access == OAT_TRUNCATE))
			guard_rows_removed = true;
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

/* From the transaction callback (xact.c). */
void
idem_ledger_guard_xact_event(XactEvent event)
{
	switch (event)
	{
		case XACT_EVENT_COMMIT:
		case XACT_EVENT_PARALLEL_COMMIT:
		case XACT_EVENT_PREPARE:
			if (guard_rows_removed)
			{
				idem_cache_epoch_renew(0, IDEM_EPOCH_LEDGER_ROWS_REMOVED);
				idem_outbox_wake();
			}
			/* FALLTHROUGH */
		case XACT_EVENT_ABORT:
		case XACT_EVENT_PARALLEL_ABORT:
			guard_rows_removed = false;
			guard_own_depth = 0;
			break;
		default:
			break;
	}
}
