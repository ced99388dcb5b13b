/*-------------------------------------------------------------------------
 *
 * ledger_insert.c
 *	  The direct write of a new ledger row: the one write of every message.
 *
 *	  An INSERT through SPI runs the whole executor for one row, and most of
 *	  that is set-up repeated on every call: the plan is revalidated, and
 *	  the ledger's six CHECK constraints are parsed from their catalog text
 *	  and planned again for every new executor state (ExecRelCheck), which
 *	  profiling showed to be about 40% of the statement.  Here the row is
 *	  built from the values the caller already has and inserted with
 *	  ExecSimpleRelationInsert, as logical replication applies a row, while
 *	  the CHECK constraints and the column defaults (the identity, the
 *	  timestamps) are prepared once per backend and kept until the ledger,
 *	  or a function or type they use, changes (relcache and syscache
 *	  callbacks, registered by _PG_init).  The executor checks EXECUTE on
 *	  the functions of an expression when it prepares it; here that check
 *	  is made again for every role that writes (SET ROLE, SECURITY DEFINER,
 *	  a pooler switching roles), and a role that may not run them all gets
 *	  the SPI INSERT, which raises the error.
 *	  PostgreSQL still does all the checking: NOT NULL, the CHECK
 *	  constraints, every index (unique included), and the foreign key,
 *	  through its AFTER trigger at the end of the "query".
 *
 *	  The path applies only where it is exactly what the INSERT would do.
 *	  It declines, and the caller uses the prepared SPI INSERT, when the
 *	  transaction is read-only, when a permission hook (sepgsql) is
 *	  loaded, when the user lacks table-level INSERT (SPI then raises the
 *	  error, or uses column privileges), when row-level security, rules, or
 *	  triggers other than PostgreSQL's own (the FK) are on the ledger, when
 *	  it is partitioned, or when a column idem writes is no longer of its
 *	  plain type (another type, a typmod, generated, identity).
 *
 *	  The row's INSERT is not a statement of its own, so pg_stat_statements
 *	  (track = all) no longer lists it.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/table.h"
#include "access/xact.h"
#include "catalog/pg_type.h"
#include "commands/trigger.h"
#include "executor/executor.h"
#include "miscadmin.h"
#include "nodes/nodeFuncs.h"
#include "optimizer/optimizer.h"
#include "rewrite/rewriteHandler.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"

#include "ledger_insert.h"
#include "compat.h"
#include "digest.h"
#include "ledger_row.h"

/* The columns idem supplies, and their types. */
typedef enum InsertColumn
{
	IC_TENANT = 0,
	IC_KEY,
	IC_FINGERPRINT,
	IC_STATUS,
	IC_ATTEMPT,
	IC_OUTCOME,
	IC_EXPIRES_AT,
	IC_COUNT
} InsertColumn;

static const struct
{
	const char *name;
	Oid			type;
}			insert_columns[IC_COUNT] = {
	{"tenant_id", INT8OID},
	{"idempotency_key", BYTEAOID},
	{"request_fingerprint", BYTEAOID},
	{"status", TEXTOID},
	{"attempt", INT4OID},
	{"outcome", JSONBOID},
	{"expires_at", TIMESTAMPTZOID},
};

/* What is prepared once per ledger and kept across transactions. */
typedef struct InsertCache
{
	Oid			relid;			/* InvalidOid: nothing prepared */
	bool		stale;			/* an invalidation arrived: rebuild */
	bool		usable;			/* false: the layout rules the direct path out */
	MemoryContext cxt;
	int			natts;
	int8	   *source;			/* per attribute: an InsertColumn, or -1 */
	ExprState **defaults;		/* per attribute, for the others; NULL: null */
	int			id_att;			/* the identity column id, or -1 */
	int			ncheck;
	ExprState **checks;			/* in the relcache's constr->check order */

	/*
	 * The functions the prepared expressions call, and the column types:
	 * only a change to one of them makes the cache stale (not every
	 * function or type created elsewhere, such as a temporary table's row
	 * type).  The executor checks EXECUTE on a function when it prepares
	 * an expression, which happened once, as some role: the role allowed
	 * to run them all is remembered and any other role is checked again.
	 */
	int			nfuncs;
	Oid		   *funcs;
	uint32	   *func_hashes;
	int			ntypes;
	uint32	   *type_hashes;
	Oid			allowed_role;	/* InvalidOid: none checked yet */
} InsertCache;

static InsertCache caches[LEDGER_KINDS];

/* Called by ledger_store_relcache_cb: any change to a ledger's definition. */
void
ledger_insert_relcache_cb(Datum arg, Oid relid)
{
	int			i;

	for (i = 0; i < LEDGER_KINDS; i++)
		if (!OidIsValid(relid) || caches[i].relid == relid)
			caches[i].stale = true;
}

static bool
hash_listed(uint32 hashvalue, const uint32 *hashes, int n)
{
	int			i;

	for (i = 0; i < n; i++)
		if (hashes[i] == hashvalue)
			return true;
	return false;
}

/*
 * Registered by _PG_init for pg_proc, pg_type and role membership: a
 * function or type the expressions use changed (they may have inlined or
 * cached it, or its EXECUTE grant changed), or who may run what did.
 */
void
ledger_insert_syscache_cb(Datum arg, int cacheid, uint32 hashvalue)
{
	int			i;

	for (i = 0; i < LEDGER_KINDS; i++)
	{
		InsertCache *cache = &caches[i];

		if (cacheid == AUTHMEMROLEMEM)
			cache->allowed_role = InvalidOid;
		else if (hashvalue == 0 ||
				 (cacheid == PROCOID &&
				  hash_listed(hashvalue, cache->func_hashes, cache->nfuncs)) ||
				 (cacheid == TYPEOID &&
				  hash_listed(hashvalue, cache->type_hashes, cache->ntypes)))
			cache->stale = true;
	}
}

static bool
collect_func(Oid func, void *context)
{
	List	  **funcs = (List **) context;

	*funcs = list_append_unique_oid(*funcs, func);
	return false;
}

static bool
collect_funcs_walker(Node *node, void *context)
{
	if (node == NULL)
		return false;
	(void) check_functions_in_node(node, collect_func, context);
	return expression_tree_walker(node, collect_funcs_walker, context);
}

/*
 * Plan an expression, note the functions it calls, and prepare it.  The
 * functions are noted before planning too: the planner inlines a SQL
 * function only for a role that may execute it, so what it left out for
 * one role must still be checked for the next.
 */
static ExprState *
prepare_expr(Expr *expr, List **funcs)
{
	Expr	   *planned;

	(void) collect_funcs_walker((Node *) expr, funcs);
	planned = expression_planner(expr);
	(void) collect_funcs_walker((Node *) planned, funcs);
	return ExecInitExpr(planned, NULL);
}

/*
 * Whether the current role may run every function the prepared
 * expressions call, as the executor would check when it prepares them.
 */
static bool
insert_cache_allowed(InsertCache *cache)
{
	Oid			role = GetUserId();
	int			i;

	if (role == cache->allowed_role)
		return true;
	for (i = 0; i < cache->nfuncs; i++)
		if (idem_proc_aclcheck(cache->funcs[i], role, ACL_EXECUTE) != ACLCHECK_OK)
			return false;
	cache->allowed_role = role;
	return true;
}

/*
 * Prepare the defaults and CHECK constraints of the ledger, locked by the
 * caller.  Called outside any use of the previous cache (no user triggers
 * run inside an insert here), so the old one can go.
 */
static void
insert_cache_build(InsertCache *cache, Relation rel, LedgerKind kind)
{
	TupleDesc	desc = RelationGetDescr(rel);
	TupleConstr *constr = desc->constr;
	MemoryContext old;
	List	   *funcs = NIL;
	ListCell   *lc;
	int			i;

	if (cache->cxt != NULL)
		MemoryContextDelete(cache->cxt);
	memset(cache, 0, sizeof(*cache));
	cache->cxt = AllocSetContextCreate(CacheMemoryContext, "idem ledger insert",
									   ALLOCSET_SMALL_SIZES);
	old = MemoryContextSwitchTo(cache->cxt);

	cache->usable = true;
	cache->allowed_role = InvalidOid;
	cache->natts = desc->natts;
	cache->id_att = -1;
	cache->type_hashes = palloc(sizeof(uint32) * desc->natts);
	cache->source = palloc(sizeof(int8) * desc->natts);
	cache->defaults = palloc0(sizeof(ExprState *) * desc->natts);
	for (i = 0; i < desc->natts; i++)
	{
		Form_pg_attribute att = TupleDescAttr(desc, i);
		int			c;

		cache->source[i] = -1;
		if (att->attisdropped)
			continue;
		cache->type_hashes[cache->ntypes++] =
			GetSysCacheHashValue1(TYPEOID, ObjectIdGetDatum(att->atttypid));
		for (c = 0; c < IC_COUNT; c++)
		{
			if (c == IC_TENANT && kind != LEDGER_TENANT)
				continue;
			if (strcmp(NameStr(att->attname), insert_columns[c].name) == 0)
				break;
		}
		if (c < IC_COUNT)
		{
			/* exactly the type, as an INSERT of the value would store it */
			if (att->atttypid != insert_columns[c].type || att->atttypmod != -1 ||
				att->attgenerated || att->attidentity)
				cache->usable = false;
			cache->source[i] = (int8) c;
		}
		else if (!att->attgenerated)
		{
			/* What the INSERT would put there: the default, or null. */
			Node	   *def = build_column_default(rel, i + 1);

			/* the id a claim drew as its fence goes there instead */
			if (strcmp(NameStr(att->attname), "id") == 0 &&
				att->attidentity == ATTRIBUTE_IDENTITY_ALWAYS &&
				att->atttypid == INT8OID)
				cache->id_att = i;

			if (def != NULL)
				cache->defaults[i] = prepare_expr((Expr *) def, &funcs);
			else if (get_typtype(att->atttypid) == TYPTYPE_DOMAIN)
				cache->usable = false;	/* a null the domain must check */
		}
	}

	cache->ncheck = constr ? constr->num_check : 0;
	if (cache->ncheck > 0)
	{
		cache->checks = palloc(sizeof(ExprState *) * cache->ncheck);
		for (i = 0; i < cache->ncheck; i++)
		{
			Node	   *check;

			/* as ExecRelCheck: NULL for a NOT ENFORCED check (skipped) */
			cache->checks[i] = NULL;
			if (!IDEM_CHECK_ENFORCED(&constr->check[i]))
				continue;
			check = stringToNode(constr->check[i].ccbin);
			check = idem_expand_virtual_columns(check, rel);
			cache->checks[i] = prepare_expr((Expr *) check, &funcs);
		}
	}

	cache->nfuncs = list_length(funcs);
	cache->funcs = palloc(sizeof(Oid) * Max(cache->nfuncs, 1));
	cache->func_hashes = palloc(sizeof(uint32) * Max(cache->nfuncs, 1));
	i = 0;
	foreach(lc, funcs)
	{
		cache->funcs[i] = lfirst_oid(lc);
		cache->func_hashes[i++] = GetSysCacheHashValue1(PROCOID,
														ObjectIdGetDatum(lfirst_oid(lc)));
	}

	MemoryContextSwitchTo(old);
	cache->relid = RelationGetRelid(rel);
}

/* Whether an INSERT on rel would do anything this path does not. */
static bool
insert_declined(Relation rel)
{
	TriggerDesc *trig = rel->trigdesc;
	int			i;

	/*
	 * A read-only (sub)transaction: let the INSERT refuse it (25006).  A
	 * permission hook (sepgsql) must see the INSERT too.
	 */
	if (XactReadOnly || ExecutorCheckPerms_hook != NULL)
		return true;
	if (rel->rd_rel->relkind != RELKIND_RELATION ||
		rel->rd_rel->relispartition ||
		rel->rd_rel->relrowsecurity ||
		rel->rd_rules != NULL)
		return true;
	if (trig != NULL)
		for (i = 0; i < trig->numtriggers; i++)
			if (!trig->triggers[i].tgisinternal)
				return true;
	return pg_class_aclcheck(RelationGetRelid(rel), GetUserId(),
							 ACL_INSERT) != ACLCHECK_OK;
}

/*
 * Open the executor state of one row written directly into rel (opened
 * and locked by the caller), as the executor's INSERT would: this
 * command's id, the active snapshot, the indexes, checks (the prepared
 * CHECK constraints, NULL for none), an empty slot of rel's type.  Memory
 * is the executor state's until idem_direct_end.
 */
void
idem_direct_begin(IdemDirectWrite *dw, Relation rel, ExprState **checks)
{
	dw->estate = CreateExecutorState();
	dw->old = MemoryContextSwitchTo(dw->estate->es_query_cxt);
	dw->estate->es_output_cid = GetCurrentCommandId(true);
	if (ActiveSnapshotSet())
		dw->estate->es_snapshot = GetActiveSnapshot();	/* as the executor's */
	dw->rri = makeNode(ResultRelInfo);
	InitResultRelInfo(dw->rri, rel, 0, NULL, 0);
	IDEM_RRI_CHECK_EXPRS(dw->rri) = checks;
	dw->estate->es_opened_result_relations =
		lappend(dw->estate->es_opened_result_relations, dw->rri);
	ExecOpenIndices(dw->rri, false);
	dw->slot = table_slot_create(rel, &dw->estate->es_tupleTable);
	ExecClearTuple(dw->slot);
}

/* Close what idem_direct_begin opened, back in the caller's memory. */
void
idem_direct_end(IdemDirectWrite *dw)
{
	ExecCloseIndices(dw->rri);
	ExecResetTupleTable(dw->estate->es_tupleTable, false);
	MemoryContextSwitchTo(dw->old);
	FreeExecutorState(dw->estate);
}

/*
 * Insert the row, with id fence unless 0 (then the identity's next value),
 * or return false (having written nothing) when the SPI INSERT must be used
 * instead.
 */
bool
ledger_insert_direct(Oid relid, const LedgerKey *lk, int64 fence,
					 const uint8 *fingerprint, IdemStatus status,
					 int32 attempt, Datum outcome, TimestampTz expires_at)
{
	InsertCache *cache = &caches[lk->kind];
	Relation	rel;
	IdemDirectWrite dw;
	TupleTableSlot *slot;
	ExprContext *econtext;
	Datum		given[IC_COUNT];
	int			i;

	rel = table_open(relid, RowExclusiveLock);
	if (insert_declined(rel))
	{
		table_close(rel, NoLock);
		return false;
	}
	/* Any change to the ledger's definition invalidates its relcache entry. */
	if (cache->relid != relid || cache->stale)
		insert_cache_build(cache, rel, lk->kind);
	if (!cache->usable || !insert_cache_allowed(cache) ||
		(fence != 0 && cache->id_att < 0))
	{
		/* the INSERT raises the permission error, or uses the layout */
		table_close(rel, NoLock);
		return false;
	}

	given[IC_TENANT] = Int64GetDatum(lk->tenant_id);
	given[IC_KEY] = PointerGetDatum(idem_digest_bytea(lk->key, NULL));
	given[IC_FINGERPRINT] = PointerGetDatum(idem_digest_bytea(fingerprint, NULL));
	given[IC_STATUS] = CStringGetTextDatum(idem_status_names[status]);
	given[IC_ATTEMPT] = Int32GetDatum(attempt);
	given[IC_OUTCOME] = outcome;
	given[IC_EXPIRES_AT] = TimestampTzGetDatum(expires_at);

	idem_direct_begin(&dw, rel, cache->checks);
	slot = dw.slot;
	econtext = GetPerTupleExprContext(dw.estate);
	for (i = 0; i < cache->natts; i++)
	{
		slot->tts_isnull[i] = false;
		if (cache->source[i] >= 0)
			slot->tts_values[i] = given[cache->source[i]];
		else if (i == cache->id_att && fence != 0)
			slot->tts_values[i] = Int64GetDatum(fence);
		else if (cache->defaults[i] != NULL)
			slot->tts_values[i] = ExecEvalExprSwitchContext(cache->defaults[i],
															econtext,
															&slot->tts_isnull[i]);
		else
		{
			slot->tts_values[i] = (Datum) 0;
			slot->tts_isnull[i] = true;
		}
	}
	ExecStoreVirtualTuple(slot);

	AfterTriggerBeginQuery();
	ExecSimpleRelationInsert(dw.rri, dw.estate, slot);
	AfterTriggerEndQuery(dw.estate);	/* the foreign key's check */

	idem_direct_end(&dw);
	table_close(rel, NoLock);

	/* Later commands of the transaction see the row. */
	CommandCounterIncrement();
	return true;
}
