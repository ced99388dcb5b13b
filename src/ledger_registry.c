/*-------------------------------------------------------------------------
 *
 * ledger_registry.c
 *	  Which table is a ledger, whether it is still in a shape idem can use,
 *	  and what each backend knows about it (ledger_store_int.h).
 *
 *	  Which table is a ledger is decided in one place,
 *	  ledger_relation_find(): the table idem_install recorded by OID in the
 *	  registry idem_ledgers.  What is known about it (its OID, its key
 *	  index, the tenants table and index, the column numbers, the prepared
 *	  statements of ledger_store.c) is kept per backend in a LedgerStore
 *	  and rebuilt, with every column's type and every index's shape checked
 *	  again (store_check), whenever the relcache callback says one of them
 *	  changed.  ledger_store_relcache_cb is the one relcache callback of
 *	  idem, registered once by _PG_init; it also calls the others (the
 *	  direct write's, the outbox's, citus.c's, the Citus shard stores').
 *
 *	  Locking: every use locks the ledger, its key index and the tenants
 *	  table and index (AccessShareLock, to the end of the transaction)
 *	  before trusting the OIDs; see store_lock_valid().  No shared state.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/relation.h"
#include "catalog/pg_am.h"
#include "catalog/pg_class.h"
#include "catalog/pg_constraint.h"
#include "catalog/pg_index.h"
#include "catalog/pg_type.h"
#include "commands/defrem.h"
#include "miscadmin.h"
#include "storage/lmgr.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"
#include "utils/rls.h"
#include "utils/syscache.h"

#include "ledger_store_int.h"
#include "citus.h"
#include "ledger_insert.h"
#include "ledger_row.h"
#include "outbox.h"

const StoreColumnDef store_columns[COL_COUNT] = {
	{"status", TEXTOID},
	{"request_fingerprint", BYTEAOID},
	{"attempt", INT4OID},
	{"outcome", JSONBOID},
	{"expires_at", TIMESTAMPTZOID},
	{"id", INT8OID},
	{"tenant_id", INT8OID},
	{"idempotency_key", BYTEAOID},
	{"updated_at", TIMESTAMPTZOID},
};

static LedgerStore stores[LEDGER_KINDS];

static const char *const ledger_unique[LEDGER_KINDS] = {
	"idempotency_keys_owner_key", "platform_idempotency_keys_key"
};

/* Registered by _PG_init: forget what we know about a ledger that changed. */
void
ledger_store_relcache_cb(Datum arg, Oid relid)
{
	int			i;

	for (i = 0; i < LEDGER_KINDS; i++)
		store_invalidate(&stores[i], relid);
	/*
	 * The other relcache callbacks of idem, from this one slot: PostgreSQL
	 * 15 has ten in all, shared by every library, and a Citus non-blocking
	 * split's walsender (Citus's decoder over pgoutput) needs the others.
	 */
	ledger_insert_relcache_cb(arg, relid);
	idem_outbox_relcache_cb(arg, relid);
	idem_citus_relcache_cb(arg, relid);
	ledger_citus_invalidate(relid);
}

/* The index behind a named unique constraint, or behind an FK's target. */
static Oid
constraint_index(Oid conoid)
{
	HeapTuple	tp = SearchSysCache1(CONSTROID, ObjectIdGetDatum(conoid));
	Oid			result;

	if (!HeapTupleIsValid(tp))
		elog(ERROR, "cache lookup failed for constraint %u", conoid);
	result = ((Form_pg_constraint) GETSTRUCT(tp))->conindid;
	ReleaseSysCache(tp);
	return result;
}

/*
 * The registry idem_install writes (0.3 on), or InvalidOid when the
 * extension's SQL objects predate it (ALTER EXTENSION idem UPDATE not run
 * yet): then the ledgers are found by name, as before.
 */
static Oid
registry_relid(Oid nsp)
{
	return get_relname_relid(IDEM_REGISTRY_TABLE, nsp);
}

/*
 * The ledger of this kind: the table idem_install recorded, by OID, in the
 * registry.  A table created later under the ledger's name is never used.
 * The recorded table must still carry the ledger's name in the extension's
 * schema, because the prepared statements name it: a ledger renamed away
 * (or swapped with another table by renames) is refused until it is
 * renamed back or idem_install adopts the table now under the name.
 *
 * This is the one place that decides which relation is a ledger.
 */
Oid
ledger_relation_find(Oid nsp, LedgerKind kind, Oid *registry)
{
	Oid			reg = registry_relid(nsp);
	Oid			relid = InvalidOid;
	HeapTuple	tp;
	bool		renamed;
	char	   *nspname = get_namespace_name(nsp);

	if (registry)
		*registry = reg;
	if (!OidIsValid(reg))
		relid = get_relname_relid(ledger_table_name(kind), nsp);
	else
	{
		char	   *sql = psprintf("SELECT ledger::pg_catalog.oid FROM %s WHERE kind OPERATOR(pg_catalog.=) $1",
								   quote_qualified_identifier(nspname, IDEM_REGISTRY_TABLE));
		Oid			argtype = TEXTOID;
		Datum		arg = CStringGetTextDatum(ledger_kind_name(kind));
		bool		isnull;

		SPI_connect();
		if (SPI_execute_with_args(sql, 1, &argtype, &arg, NULL, true, 1) != SPI_OK_SELECT)
			elog(ERROR, "could not read %s", IDEM_REGISTRY_TABLE);
		if (SPI_processed > 0)
		{
			Datum		d = SPI_getbinval(SPI_tuptable->vals[0],
										  SPI_tuptable->tupdesc, 1, &isnull);

			if (!isnull)
				relid = DatumGetObjectId(d);
		}
		SPI_finish();
		pfree(sql);
	}

	if (!OidIsValid(relid))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idem is not installed in this database: no %s ledger %s.%s",
						ledger_kind_name(kind), nspname, ledger_table_name(kind)),
				 errhint("Run SELECT idem_install('tenants') once after CREATE EXTENSION idem.")));

	tp = SearchSysCache1(RELOID, ObjectIdGetDatum(relid));
	if (!HeapTupleIsValid(tp))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("the idem %s ledger %s.%s was dropped",
						ledger_kind_name(kind), nspname, ledger_table_name(kind)),
				 errdetail("idem uses the table idem_install recorded, not whatever table has its name now."),
				 errhint("Restore the ledger, or run SELECT idem_install('tenants') to create (or adopt) it again.")));
	renamed = ((Form_pg_class) GETSTRUCT(tp))->relnamespace != nsp ||
		strcmp(NameStr(((Form_pg_class) GETSTRUCT(tp))->relname), ledger_table_name(kind)) != 0;
	if (renamed)
	{
		char	   *now = quote_qualified_identifier(get_namespace_name(((Form_pg_class) GETSTRUCT(tp))->relnamespace),
													 NameStr(((Form_pg_class) GETSTRUCT(tp))->relname));

		ReleaseSysCache(tp);
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("the idem %s ledger %s.%s was renamed to %s",
						ledger_kind_name(kind), nspname, ledger_table_name(kind), now),
				 errhint("Rename it back, or run SELECT idem_install('tenants') to adopt the table now named %s.%s (it must have the ledger's exact shape).",
						 nspname, ledger_table_name(kind))));
	}
	ReleaseSysCache(tp);
	return relid;
}

/* A plain btree on exactly these (attnum, type) columns, default opclasses. */
static bool
index_is_plain_btree(Relation idx, int nkeys, const AttrNumber *atts,
					 const Oid *types)
{
	Form_pg_index ind = idx->rd_index;
	int			i;

	if (idx->rd_rel->relam != BTREE_AM_OID || !ind->indisunique ||
		!ind->indisvalid || !ind->indimmediate ||
		ind->indnkeyatts != nkeys || ind->indnatts != nkeys ||
		RelationGetIndexExpressions(idx) != NIL ||
		RelationGetIndexPredicate(idx) != NIL)
		return false;
	for (i = 0; i < nkeys; i++)
		if (ind->indkey.values[i] != atts[i] ||
			idx->rd_opcintype[i] != types[i] ||
			idx->rd_opfamily[i] != get_opclass_family(GetDefaultOpClass(types[i], BTREE_AM_OID)))
			return false;
	return true;
}

/*
 * A ledger must be a permanent table.  An unlogged ledger is emptied by a
 * crash (and a temporary one at the end of its session) while the effects
 * it recorded survive: every redelivery would then run its effect again.
 * Checked by idem_install and whenever a backend (re)checks the ledger,
 * which ALTER TABLE ... SET UNLOGGED makes it do (it rewrites the table).
 */
void
ledger_check_permanent(LedgerKind kind, Oid relid)
{
	char		persistence = get_rel_persistence(relid);
	char	   *nspname;
	char	   *qtable;

	if (persistence == RELPERSISTENCE_PERMANENT)
		return;
	nspname = get_namespace_name(get_rel_namespace(relid));
	qtable = quote_qualified_identifier(nspname, get_rel_name(relid));
	if (persistence == RELPERSISTENCE_UNLOGGED)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idem ledger \"%s\" is an unlogged table", ledger_table_name(kind)),
				 errdetail("A crash empties an unlogged table while the effects it recorded survive, so every redelivered message would run its effect again."),
				 errhint("Make it permanent again: ALTER TABLE %s SET LOGGED.", qtable)));
	ereport(ERROR,
			(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
			 errmsg("idem ledger \"%s\" is a temporary table", ledger_table_name(kind)),
			 errdetail("A temporary table is gone at the end of its session while the effects it recorded survive."),
			 errhint("Drop it and run SELECT idem_install('tenants') to create a permanent ledger.")));
}

/* Check the ledger's columns and indexes, and remember where things are. */
static void
store_check(LedgerStore *store, Relation rel)
{
	LedgerKind	kind = store->kind;
	const char *table = ledger_table_name(kind);
	TupleDesc	desc = RelationGetDescr(rel);
	Oid			conoid;
	Relation	idx;
	AttrNumber	keyatts[2];
	Oid			keytypes[2];
	int			nkeys = 0;
	int			i;

	if (rel->rd_rel->relkind != RELKIND_RELATION ||
		rel->rd_rel->relam != HEAP_TABLE_AM_OID)
		ereport_altered(table,
						("It is no longer an ordinary heap table."),
						("Restore the ledger as idem_install created it."));
	ledger_check_permanent(kind, RelationGetRelid(rel));

	for (i = 0; i < COL_COUNT; i++)
	{
		const char *col = store_columns[i].name;
		AttrNumber	attnum;
		Form_pg_attribute att;

		store->att[i] = InvalidAttrNumber;
		if (i == COL_TENANT && kind != LEDGER_TENANT)
			continue;
		attnum = get_attnum(RelationGetRelid(rel), col);
		if (attnum <= 0)
			ereport_altered(table,
							("Column \"%s\" was dropped or renamed.", col),
							("idem reads and writes column \"%s\"; rename it back or restore it.", col));
		att = TupleDescAttr(desc, attnum - 1);
		if (att->atttypid != store_columns[i].type)
			ereport_altered(table,
							("Column \"%s\" is of type %s, not %s.", col,
							 format_type_be(att->atttypid),
							 format_type_be(store_columns[i].type)),
							("idem reads and writes \"%s\" as %s; change it back with ALTER TABLE %s ALTER COLUMN %s TYPE %s.",
							 col, format_type_be(store_columns[i].type), table, col,
							 format_type_be(store_columns[i].type)));
		store->att[i] = attnum;
	}

	/* The unique index probed by key (on a Citus shard, its suffixed copy). */
	conoid = get_relation_constraint_oid(RelationGetRelid(rel),
										 store->shardid ?
										 psprintf("%s_" INT64_FORMAT, ledger_unique[kind], store->shardid) :
										 ledger_unique[kind], true);
	if (OidIsValid(conoid))
		store->keyidx = constraint_index(conoid);
	if (kind == LEDGER_TENANT)
	{
		keyatts[nkeys] = store->att[COL_TENANT];
		keytypes[nkeys++] = INT8OID;
	}
	keyatts[nkeys] = store->att[COL_KEY];
	keytypes[nkeys++] = BYTEAOID;
	idx = OidIsValid(store->keyidx) ? try_relation_open(store->keyidx, AccessShareLock) : NULL;
	if (idx == NULL || idx->rd_rel->relkind != RELKIND_INDEX ||
		!index_is_plain_btree(idx, nkeys, keyatts, keytypes))
		ereport_altered(table,
						("Its unique constraint \"%s\" is missing or is not a plain unique btree on (%s).",
						 ledger_unique[kind],
						 kind == LEDGER_TENANT ? "tenant_id, idempotency_key" : "idempotency_key"),
						("Re-create it: ALTER TABLE %s ADD CONSTRAINT %s UNIQUE (%s).", table,
						 ledger_unique[kind],
						 kind == LEDGER_TENANT ? "tenant_id, idempotency_key" : "idempotency_key"));
	relation_close(idx, NoLock);

	/* The tenants table behind the foreign key, and its index on id. */
	store->tenants_probe = false;
	if (kind == LEDGER_TENANT)
	{
		List	   *fkeys = RelationGetFKeyList(rel);
		ListCell   *lc;
		Relation	trel;

		foreach(lc, fkeys)
		{
			ForeignKeyCacheInfo *fk = lfirst_node(ForeignKeyCacheInfo, lc);

			if (fk->nkeys == 1 && fk->conkey[0] == store->att[COL_TENANT])
			{
				store->tenants_relid = fk->confrelid;
				store->tenants_idx = constraint_index(fk->conoid);
			}
		}
		if (!OidIsValid(store->tenants_idx))
			ereport(ERROR,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("the idem tenant ledger has no foreign key to a tenants table"),
					 errdetail("Dropping the tenants table's primary key with CASCADE drops the ledger's foreign key."),
					 errhint("Give the tenants table a primary key on id again if it has none, then run SELECT idem_install('tenants') (naming your tenants table): it re-creates the foreign key.")));

		/*
		 * Probe tenants directly only where that reads what the FK reads: a
		 * heap table with a plain btree on a bigint id.  Otherwise the claim
		 * leaves the check to the FK, at the row's write.
		 */
		trel = try_relation_open(store->tenants_relid, AccessShareLock);
		idx = try_relation_open(store->tenants_idx, AccessShareLock);
		if (trel && idx && trel->rd_rel->relkind == RELKIND_RELATION &&
			trel->rd_rel->relam == HEAP_TABLE_AM_OID &&
			idx->rd_rel->relkind == RELKIND_INDEX &&
			idx->rd_index->indnkeyatts == 1)
		{
			AttrNumber	idatt = idx->rd_index->indkey.values[0];
			Oid			int8type = INT8OID;

			store->tenants_probe = idatt > 0 &&
				TupleDescAttr(RelationGetDescr(trel), idatt - 1)->atttypid == INT8OID &&
				index_is_plain_btree(idx, 1, &idatt, &int8type);
		}
		if (idx)
			relation_close(idx, NoLock);
		if (trel)
			relation_close(trel, NoLock);
	}
}

static void
store_build(LedgerStore *store, LedgerKind kind, Oid nsp)
{
	uint32		generation;
	Oid			relid;
	Relation	rel;
	int			i;

	store->valid = false;
	for (i = 0; i < PLAN_COUNT; i++)
	{
		if (store->plans[i])
			SPI_freeplan(store->plans[i]);
		store->plans[i] = NULL;
	}
	store->kind = kind;
	store->nsp = nsp;
	store->relid = InvalidOid;
	store->keyidx = InvalidOid;
	store->tenants_relid = InvalidOid;
	store->tenants_idx = InvalidOid;
	store->id_seq = InvalidOid;
	generation = store->generation;

	if (OidIsValid(store->shard))
		relid = store->shard;	/* a Citus shard (store_open_shard) */
	else
		relid = ledger_relation_find(nsp, kind, &store->registry);
	rel = try_relation_open(relid, AccessShareLock);
	if (rel == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("the idem %s ledger was dropped", ledger_kind_name(kind)),
				 errhint("Restore the ledger, or run SELECT idem_install('tenants') to create it again.")));
	store->relid = relid;
	store_check(store, rel);
	relation_close(rel, NoLock);

	/* The statements are prepared when first used (store_plan). */

	/* Valid unless something changed while we were looking. */
	store->valid = store->generation == generation;
}

/*
 * The store of a kind, checked and locked: the ledger, its key index and
 * the tenants table and index are locked (AccessShareLock, to the end of
 * the transaction) by OIDs that were valid when the locks were taken.
 * Taking a lock processes invalidations, so a change that committed just
 * before (a REINDEX CONCURRENTLY that swapped the index) is seen here and
 * the store is built again; once locked, nothing can drop them.
 */
static LedgerStore *
store_lock_valid(LedgerStore *store, Oid nsp, LedgerKind kind)
{
	int			tries;

	if (store->nsp != nsp)
		store->valid = false;
	for (tries = 0;; tries++)
	{
		if (!store->valid)
			store_build(store, kind, nsp);
		LockRelationOid(store->relid, AccessShareLock);
		LockRelationOid(store->keyidx, AccessShareLock);
		if (OidIsValid(store->tenants_relid))
		{
			LockRelationOid(store->tenants_relid, AccessShareLock);
			LockRelationOid(store->tenants_idx, AccessShareLock);
		}
		if (store->valid)
			return store;
		if (tries >= 10)
			ereport(ERROR,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("the idem %s ledger kept changing while it was opened",
							ledger_kind_name(kind)),
					 errhint("Retry once the concurrent schema changes are done.")));
	}
}

static LedgerStore *
store_get(Oid nsp, LedgerKind kind)
{
	return store_lock_valid(&stores[kind], nsp, kind);
}

/*
 * The ledger of this kind in the extension's schema, ready for use by the
 * current role; ERROR when idem_install has not run.
 */
static LedgerStore *
store_checked(LedgerStore *store, LedgerKind kind)
{
	Oid			relid = store->relid;

	/*
	 * Probes read the table without the executor, so check what the
	 * executor would: reading a ledger needs SELECT on it.  Writes go
	 * through SPI, which checks INSERT and UPDATE itself.
	 */
	if (pg_class_aclcheck(relid, GetUserId(), ACL_SELECT) != ACLCHECK_OK)
		aclcheck_error(ACLCHECK_NO_PRIV, OBJECT_TABLE, ledger_table_name(kind));

	/*
	 * Nor do probes apply row-level security policies: refuse, rather than
	 * answer from rows a policy would hide.
	 */
	if (check_enable_rls(relid, InvalidOid, false) == RLS_ENABLED)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("idem does not support row-level security on table %s",
						ledger_table_name(kind)),
				 errdetail("idem reads the ledger by key without applying policies."),
				 errhint("Disable row-level security on the ledger, or run the caller as a role that bypasses it, and restrict access with grants.")));
	return store;
}

/*
 * The ledger of this kind in the extension's schema, ready for use by the
 * current role; ERROR when idem_install has not run.  On Citus the tenant
 * ledger's store stands for the distributed table and serves only the
 * purge (ledger_purge); reading or writing a key needs its shard.
 */
LedgerStore *
ledger_store_open(Oid nsp, LedgerKind kind)
{
	Oid			ledger = ledger_citus_ledger(nsp, kind);

	if (OidIsValid(ledger))
		return ledger_citus_distributed_store(ledger, kind);
	return store_checked(store_get(nsp, kind), kind);
}

/* The store that holds this key: on Citus, the tenant's local shard. */
LedgerStore *
ledger_store_open_key(Oid nsp, const LedgerKey *lk)
{
	Oid			ledger = ledger_citus_ledger(nsp, lk->kind);

	if (!OidIsValid(ledger))
		return ledger_store_open(nsp, lk->kind);
	/* The store of the tenant's local shard, checked and locked. */
	return store_checked(store_lock_valid(ledger_citus_shard_store(ledger, lk->tenant_id),
										  nsp, LEDGER_TENANT), lk->kind);
}

/*
 * The store a pending claim was made against (pre-commit has no fcinfo),
 * checked again: the ledger may have been altered since the claim.
 */
LedgerStore *
ledger_store_for(LedgerKind kind, Oid relid)
{
	LedgerStore *store = ledger_citus_store_find(relid);

	if (store != NULL)
		return store_lock_valid(store, store->nsp, kind);
	store = store_get(stores[kind].nsp, kind);

	if (store->relid != relid)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("the idem ledger was dropped or replaced while a claim was open")));
	return store;
}

Oid
ledger_store_relid(const LedgerStore *store)
{
	return store->relid;
}

const char *
ledger_tenants_name(LedgerStore *store)
{
	return get_rel_name(store->tenants_relid);
}
