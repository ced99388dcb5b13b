/*-------------------------------------------------------------------------
 *
 * ledger_store.c
 *	  How a ledger table is read and written.
 *
 *	  Reads are direct probes of the ledger's unique index (and of the
 *	  tenants table's unique index on id): no SPI, no executor, no parse.
 *	  They run on every claim, so they are the hot path of a replay.
 *
 *	  Writes go through SPI with statements prepared once per backend and
 *	  ledger, so constraints, the FK and every index are maintained by
 *	  PostgreSQL itself; a new row is written directly where that is the
 *	  same (ledger_insert.c), with the SPI INSERT as the fallback.  Every
 *	  name in the statements is schema-qualified (the ledger in the
 *	  extension's schema, operators and functions in pg_catalog), so the
 *	  caller's search_path can neither redirect them nor force a replan.
 *
 *	  Which table is a ledger is decided in one place,
 *	  ledger_relation_find(): the table idem_install recorded by OID in the
 *	  registry idem_ledgers.  What is known about it (its OID, its key
 *	  index, the tenants table and index, the column numbers, the prepared
 *	  statements) is kept per backend and rebuilt, with every column's type
 *	  and every index's shape checked again, whenever the relcache callback
 *	  says one of them changed.  Locking: every use locks the ledger, its
 *	  key index and the tenants table and index (AccessShareLock, to the end
 *	  of the transaction) before trusting the OIDs; see store_get().
 *
 *-------------------------------------------------------------------------
 */
#include "ledger_store.h"
#include "citus.h"
#include "digest.h"
#include "ledger_guard.h"
#include "ledger_insert.h"

#include "access/genam.h"
#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/relation.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "catalog/pg_am.h"
#include "catalog/pg_class.h"
#include "catalog/dependency.h"
#include "catalog/pg_constraint.h"
#include "catalog/pg_index.h"
#include "commands/defrem.h"
#include "commands/sequence.h"
#include "catalog/pg_type.h"
#include "common/hashfn.h"
#include "executor/spi.h"
#include "executor/tuptable.h"
#include "miscadmin.h"
#include "storage/lmgr.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"
#include "utils/rls.h"
#include "utils/snapmgr.h"
#include "utils/syscache.h"

typedef enum StorePlanId
{
	PLAN_INSERT = 0,			/* a row, any status */
	PLAN_RECLAIM,				/* failed_retryable / expired lease -> processing */
	PLAN_FINISH,				/* processing -> completed / failed_* */
	PLAN_PURGE,					/* delete one batch of expired rows */
	PLAN_EXHAUST,				/* failed_retryable, out of attempts -> failed_permanent */
	PLAN_COUNT
} StorePlanId;

/*
 * The columns the API reads, and every column a prepared statement names,
 * with the one type idem reads and writes it as.  A ledger whose column is
 * missing or of another type is refused before anything reads it (reading
 * a json outcome as jsonb crashes).
 */
typedef enum StoreColumn
{
	COL_STATUS = 0,
	COL_FINGERPRINT,
	COL_ATTEMPT,
	COL_OUTCOME,
	COL_EXPIRES_AT,
	COL_ID,
	COL_TENANT,
	COL_KEY,
	COL_UPDATED_AT,
	COL_COUNT
} StoreColumn;

static const struct
{
	const char *name;
	Oid			type;
}			store_columns[COL_COUNT] = {
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

/*
 * What is known about one ledger, kept across transactions.  valid is
 * cleared by the relcache callback when the ledger, one of the indexes
 * probed, the tenants table or the registry changes (any DDL, REINDEX,
 * VACUUM FULL, CLUSTER, SET TABLESPACE, ...), and everything is looked up
 * and checked again on the next use.
 */
struct LedgerStore
{
	LedgerKind	kind;
	bool		valid;			/* false: rebuild before use */
	uint32		generation;		/* bumped by every invalidation */
	Oid			nsp;			/* the extension's schema */
	Oid			registry;		/* idem_ledgers, or InvalidOid (before 0.3) */
	Oid			relid;			/* the ledger */
	Oid			keyidx;			/* its unique index on the key */
	Oid			tenants_relid;	/* tenant ledger: the FK's table ... */
	Oid			tenants_idx;	/* ... and its unique index on id */
	bool		tenants_probe;	/* the index can be probed directly */
	AttrNumber	att[COL_COUNT];
	SPIPlanPtr	plans[PLAN_COUNT];
	Oid			plan_roles[PLAN_COUNT];	/* the role each was planned for */
	/* On Citus (citus.c): */
	bool		distributed;	/* the distributed ledger: purge only */
	Oid			shard;			/* a shard of it: its table ... */
	int64		shardid;		/* ... its shard id (name suffix) ... */
	Oid			idseq;			/* ... and the sequence of its id */
};

static LedgerStore stores[LEDGER_KINDS];

/*
 * On Citus, one store per shard of the tenant ledger this backend used
 * (keyed by the shard's table), and one standing for the distributed table
 * itself, which only the purge uses.
 */
typedef struct CitusStore
{
	Oid			shard;			/* hash key */
	LedgerStore store;
} CitusStore;

static HTAB *citus_stores = NULL;
static LedgerStore distributed_store;

static void
store_invalidate(LedgerStore *store, Oid relid)
{
	if (!OidIsValid(relid) || relid == store->relid ||
		relid == store->keyidx || relid == store->tenants_relid ||
		relid == store->tenants_idx || relid == store->registry)
	{
		store->valid = false;
		store->generation++;
	}
}

static const char *const ledger_unique[LEDGER_KINDS] = {
	"idempotency_keys_owner_key", "platform_idempotency_keys_key"
};

/*
 * Every statement takes the owner of the key as $1 (tenant_id, unused on
 * the platform ledger) and the key as $2, so all bind them the same way.
 */
static const char *const owner_clause[LEDGER_KINDS] = {
	"tenant_id OPERATOR(pg_catalog.=) $1 AND idempotency_key OPERATOR(pg_catalog.=) $2",
	"idempotency_key OPERATOR(pg_catalog.=) $2"
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
	idem_citus_relcache_cb(arg, relid);
	if (citus_stores != NULL)
	{
		HASH_SEQ_STATUS seq;
		CitusStore *entry;

		hash_seq_init(&seq, citus_stores);
		while ((entry = hash_seq_search(&seq)) != NULL)
			store_invalidate(&entry->store, relid);
	}
}

/*
 * The purge's DELETE of up to LIMIT expired rows of TABLE, skipping rows
 * locked by others: terminal rows that expired before TERMINAL_BEFORE and
 * finished before FINISHED_BEFORE (younger ones are within
 * idem.min_retention), processing rows whose lease ended before
 * PROCESSING_BEFORE.  The arguments are SQL text: parameters for the local
 * plan, literals for the Citus shards.
 */
static char *
purge_sql(const char *table, const char *terminal_before,
		  const char *processing_before, const char *finished_before,
		  const char *limit)
{
	const char *processing = quote_literal_cstr(idem_status_names[IDEM_STATUS_PROCESSING]);

	return psprintf("DELETE FROM %s WHERE id OPERATOR(pg_catalog.=) ANY (ARRAY("
					"SELECT id FROM %s WHERE"
					" (status OPERATOR(pg_catalog.<>) %s AND expires_at OPERATOR(pg_catalog.<) %s"
					"  AND updated_at OPERATOR(pg_catalog.<) %s)"
					" OR (status OPERATOR(pg_catalog.=) %s AND expires_at OPERATOR(pg_catalog.<) %s)"
					" LIMIT %s FOR UPDATE SKIP LOCKED))",
					table, table, processing, terminal_before, finished_before,
					processing, processing_before, limit);
}

/* A timestamp as an SQL literal. */
static char *
timestamptz_literal(TimestampTz t)
{
	char	   *text = DatumGetCString(DirectFunctionCall1(timestamptz_out,
														   TimestampTzGetDatum(t)));

	return psprintf("%s::pg_catalog.timestamptz", quote_literal_cstr(text));
}

static SPIPlanPtr
prepare_plan(LedgerKind kind, StorePlanId id, const char *qtable, Oid idseq)
{
	const char *owner = owner_clause[kind];
	const char *processing = idem_status_names[IDEM_STATUS_PROCESSING];
	char	   *sql;
	Oid			types[8] = {INT8OID, BYTEAOID};
	int			nargs;
	SPIPlanPtr	plan;

	switch (id)
	{
		case PLAN_INSERT:
			/*
			 * A Citus shard has no identity of its own: its id ($8) comes
			 * from the identity sequence of the node's shell table, which
			 * Citus gives a range of its own on each node (ledger_insert).
			 */
			sql = psprintf("INSERT INTO %s (%s%sidempotency_key, request_fingerprint,"
						   " status, attempt, outcome, expires_at)"
						   " VALUES (%s%s$2, $3, $4, $5, $6, $7)",
						   qtable,
						   OidIsValid(idseq) ? "id, " : "",
						   kind == LEDGER_TENANT ? "tenant_id, " : "",
						   OidIsValid(idseq) ? "$8, " : "",
						   kind == LEDGER_TENANT ? "$1, " : "");
			types[2] = BYTEAOID;
			types[3] = TEXTOID;
			types[4] = INT4OID;
			types[5] = JSONBOID;
			types[6] = TIMESTAMPTZOID;
			types[7] = INT8OID;
			nargs = OidIsValid(idseq) ? 8 : 7;
			break;
		case PLAN_RECLAIM:
			sql = psprintf("UPDATE %s SET status = '%s',"
						   " attempt = attempt OPERATOR(pg_catalog.+) 1,"
						   " outcome = '{}'::pg_catalog.jsonb, expires_at = $3,"
						   " updated_at = pg_catalog.clock_timestamp()"
						   " WHERE %s AND attempt OPERATOR(pg_catalog.=) $4"
						   " AND status OPERATOR(pg_catalog.=) $5"
						   " RETURNING attempt", qtable, processing, owner);
			types[2] = TIMESTAMPTZOID;
			types[3] = INT4OID;
			types[4] = TEXTOID;
			nargs = 5;
			break;
		case PLAN_FINISH:
			sql = psprintf("UPDATE %s SET status = $3, outcome = $4, expires_at = $5,"
						   " updated_at = pg_catalog.clock_timestamp()"
						   " WHERE %s AND status OPERATOR(pg_catalog.=) '%s'"
						   " AND ($6 OPERATOR(pg_catalog.=) 0 OR attempt OPERATOR(pg_catalog.=) $6)"
						   " RETURNING attempt, request_fingerprint",
						   qtable, owner, processing);
			types[2] = TEXTOID;
			types[3] = JSONBOID;
			types[4] = TIMESTAMPTZOID;
			types[5] = INT4OID;
			nargs = 6;
			break;
		case PLAN_EXHAUST:
			sql = psprintf("UPDATE %s SET status = '%s',"
						   " expires_at = GREATEST(expires_at, $3),"
						   " updated_at = pg_catalog.clock_timestamp()"
						   " WHERE %s AND attempt OPERATOR(pg_catalog.=) $4"
						   " AND status OPERATOR(pg_catalog.=) '%s'"
						   " RETURNING expires_at", qtable,
						   idem_status_names[IDEM_STATUS_FAILED_PERMANENT], owner,
						   idem_status_names[IDEM_STATUS_FAILED_RETRYABLE]);
			types[2] = TIMESTAMPTZOID;
			types[3] = INT4OID;
			nargs = 4;
			break;
		case PLAN_PURGE:
			sql = purge_sql(qtable, "$1", "$2", "$4", "$3");
			types[0] = TIMESTAMPTZOID;
			types[1] = TIMESTAMPTZOID;
			types[2] = INT4OID;
			types[3] = TIMESTAMPTZOID;
			nargs = 4;
			break;
		default:
			elog(ERROR, "unknown ledger statement %d", (int) id);
	}

	plan = SPI_prepare(sql, nargs, types);
	if (plan == NULL)
		elog(ERROR, "could not prepare idem ledger statement: %s",
			 SPI_result_code_string(SPI_result));
	SPI_keepplan(plan);
	pfree(sql);
	return plan;
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

/* The ledger is not in a shape idem can use: one error for every case. */
#define ereport_altered(table, detail, hint) \
	ereport(ERROR, \
			(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE), \
			 errmsg("idem ledger \"%s\" has been altered and cannot be used", (table)), \
			 errdetail detail, \
			 errhint hint))

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

/*
 * A prepared statement of the store, for the current role (the caller is
 * connected to SPI).  The planner inlines a SQL function in a default or
 * a constraint only for a role that may execute it, and a plan is kept for
 * reuse: so each role gets statements planned for it, and a role that may
 * not run such a function gets the executor's permission error, never the
 * previous role's inlined result.
 */
static SPIPlanPtr
store_plan(LedgerStore *store, StorePlanId id)
{
	Oid			role = GetUserId();

	if (store->plans[id] == NULL || store->plan_roles[id] != role)
	{
		if (store->plans[id])
			SPI_freeplan(store->plans[id]);
		store->plans[id] = NULL;
		store->plans[id] = prepare_plan(store->kind, id,
										quote_qualified_identifier(get_namespace_name(store->nsp),
																   get_rel_name(store->relid)),
										store->idseq);
		store->plan_roles[id] = role;
	}
	return store->plans[id];
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
 * The tenant ledger when it is a Citus distributed table (found by name:
 * the registry is the coordinator's, and Citus's own catalog says what the
 * table is), or InvalidOid.
 */
static Oid
citus_ledger(Oid nsp, LedgerKind kind)
{
	Oid			relid;

	if (kind != LEDGER_TENANT)
		return InvalidOid;
	relid = get_relname_relid(ledger_table_name(kind), nsp);
	return OidIsValid(relid) && idem_citus_distributed(relid) ? relid : InvalidOid;
}

/* The store of one local Citus shard of the tenant ledger, checked and locked. */
static LedgerStore *
store_open_shard(Oid nsp, Oid ledger, Oid shard, int64 shardid)
{
	CitusStore *entry;
	bool		found;

	if (citus_stores == NULL)
	{
		HASHCTL		ctl;

		ctl.keysize = sizeof(Oid);
		ctl.entrysize = sizeof(CitusStore);
		ctl.hcxt = TopMemoryContext;
		citus_stores = hash_create("idem Citus ledger shards", 16, &ctl,
								   HASH_ELEM | HASH_BLOBS | HASH_CONTEXT);
	}
	entry = hash_search(citus_stores, &shard, HASH_ENTER, &found);
	if (!found)
	{
		memset(&entry->store, 0, sizeof(LedgerStore));
		entry->store.shard = shard;
		entry->store.shardid = shardid;
		entry->store.idseq = idem_identity_sequence(ledger, get_attnum(ledger, "id"));
	}
	return store_lock_valid(&entry->store, nsp, LEDGER_TENANT);
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
	Oid			ledger = citus_ledger(nsp, kind);

	if (OidIsValid(ledger))
	{
		distributed_store.relid = ledger;
		distributed_store.kind = kind;
		distributed_store.distributed = true;
		return &distributed_store;
	}
	return store_checked(store_get(nsp, kind), kind);
}

/* The store that holds this key: on Citus, the tenant's local shard. */
LedgerStore *
ledger_store_open_key(Oid nsp, const LedgerKey *lk)
{
	Oid			ledger = citus_ledger(nsp, lk->kind);
	int64		shardid;
	Oid			shard;

	if (!OidIsValid(ledger))
		return ledger_store_open(nsp, lk->kind);
	shard = idem_citus_local_shard(ledger, lk->tenant_id, &shardid);
	return store_checked(store_open_shard(nsp, ledger, shard, shardid), lk->kind);
}

/*
 * The store of a Citus distributed ledger stands for the whole table and
 * serves only the purge.  The batch API, whose keys may belong to tenants
 * on several workers, ends here.
 */
static void
store_check_local(const LedgerStore *store)
{
	if (store->distributed)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("the idem batch API is not available for the tenant ledger on Citus"),
				 errdetail("The keys of a batch may belong to tenants on different workers; idem reads and writes only the local shard of one tenant."),
				 errhint("Call idem_claim and idem_complete per key: Citus delegates each call to the tenant's worker.")));
}

/*
 * The store a pending claim was made against (pre-commit has no fcinfo),
 * checked again: the ledger may have been altered since the claim.
 */
LedgerStore *
ledger_store_for(LedgerKind kind, Oid relid)
{
	LedgerStore *store;

	if (citus_stores != NULL)
	{
		CitusStore *entry = hash_search(citus_stores, &relid, HASH_FIND, NULL);

		if (entry != NULL)
			return store_lock_valid(&entry->store, entry->store.nsp, kind);
	}
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

/* ---------- reads: index probes ---------- */

/*
 * Fetch the first tuple of an equality scan on a unique index.  Returns
 * the slot (owned by the caller, to drop) or NULL.  The scan and the
 * relations are closed before returning; the locks stay to xact end.
 */
static TupleTableSlot *
probe_unique(Oid relid, Oid indexid, ScanKey keys, int nkeys, Snapshot snapshot,
			 Relation *relp)
{
	Relation	rel = table_open(relid, AccessShareLock);
	Relation	idx = index_open(indexid, AccessShareLock);
	IndexScanDesc scan;
	TupleTableSlot *slot = table_slot_create(rel, NULL);
	bool		found;

	snapshot = RegisterSnapshot(snapshot);
	scan = idem_index_beginscan(rel, idx, snapshot, nkeys, 0);
	index_rescan(scan, keys, nkeys, NULL, 0);
	found = index_getnext_slot(scan, ForwardScanDirection, slot);
	if (found)
		slot_getallattrs(slot);
	index_endscan(scan);
	UnregisterSnapshot(snapshot);
	index_close(idx, NoLock);
	*relp = rel;
	if (!found)
	{
		ExecDropSingleTupleTableSlot(slot);
		return NULL;
	}
	return slot;
}

static void
key_scankeys(const LedgerKey *lk, ScanKey keys, int *nkeys,
			 IdemDigestBytea *buf)
{
	bytea	   *keybuf = idem_digest_bytea(lk->key, buf);

	if (lk->kind == LEDGER_TENANT)
	{
		ScanKeyInit(&keys[0], 1, BTEqualStrategyNumber, F_INT8EQ,
					Int64GetDatum(lk->tenant_id));
		ScanKeyInit(&keys[1], 2, BTEqualStrategyNumber, F_BYTEAEQ,
					PointerGetDatum(keybuf));
		*nkeys = 2;
	}
	else
	{
		ScanKeyInit(&keys[0], 1, BTEqualStrategyNumber, F_BYTEAEQ,
					PointerGetDatum(keybuf));
		*nkeys = 1;
	}
}

/*
 * The transaction that wrote the row (FrozenTransactionId once frozen).
 * Read through the heap accessor: a frozen row's raw xmin is meaningless
 * (and may one day equal a running xid); the ledger is checked to be a
 * heap table when the store is built.
 */
static TransactionId
slot_row_writer(TupleTableSlot *slot)
{
	bool		should_free;
	HeapTuple	tup = ExecFetchSlotHeapTuple(slot, false, &should_free);
	TransactionId writer = HeapTupleHeaderGetXmin(tup->t_data);

	if (should_free)
		heap_freetuple(tup);
	return writer;
}

/* Whether this transaction (or one of its subtransactions) wrote the row. */
static bool
slot_row_is_ours(TupleTableSlot *slot)
{
	return TransactionIdIsCurrentTransactionId(slot_row_writer(slot));
}

/* A column of a probed row; a NULL is refused (NOT NULL was dropped). */
static Datum
row_attr(LedgerStore *store, TupleTableSlot *slot, StoreColumn col)
{
	bool		isnull;
	Datum		d = slot_getattr(slot, store->att[col], &isnull);

	if (isnull)
		ereport_altered(ledger_table_name(store->kind),
						("A row has a NULL \"%s\".", store_columns[col].name),
						("Restore the constraint: ALTER TABLE %s ALTER COLUMN %s SET NOT NULL.",
						 ledger_table_name(store->kind), store_columns[col].name));
	return d;
}

/* A 32-byte digest column; any other length is refused (its CHECK was dropped). */
StaticAssertDecl(IDEM_DIGEST_LEN == 32, "the size stated above");
static void
digest_value(LedgerStore *store, Datum d, uint8 *out)
{
	bytea	   *b = DatumGetByteaPP(d);

	if (VARSIZE_ANY_EXHDR(b) != IDEM_DIGEST_LEN)
		ereport_altered(ledger_table_name(store->kind),
						("A row has a request_fingerprint of %d bytes, not %d.",
						 (int) VARSIZE_ANY_EXHDR(b), IDEM_DIGEST_LEN),
						("Restore the constraint %s_request_fingerprint_check.",
						 ledger_table_name(store->kind)));
	memcpy(out, VARDATA_ANY(b), IDEM_DIGEST_LEN);
}

/* Read the row of a key as the snapshot sees it. */
bool
ledger_probe(LedgerStore *store, const LedgerKey *lk, Snapshot snapshot,
			 LedgerRow *row)
{
	ScanKeyData keys[2];
	int			nkeys;
	IdemDigestBytea keybuf;
	Relation	rel;
	TupleTableSlot *slot;
	char	   *status;

	store_check_local(store);
	key_scankeys(lk, keys, &nkeys, &keybuf);
	slot = probe_unique(store->relid, store->keyidx, keys, nkeys, snapshot, &rel);
	if (slot == NULL)
	{
		table_close(rel, NoLock);
		return false;
	}

	/* Every column read here was checked to be of its type (store_check). */
	status = TextDatumGetCString(row_attr(store, slot, COL_STATUS));
	if (!idem_status_parse(status, &row->status))
		ereport_altered(ledger_table_name(store->kind),
						("A row has the status \"%s\".", status),
						("Restore the constraint %s_status_check and correct the row.",
						 ledger_table_name(store->kind)));
	pfree(status);
	digest_value(store, row_attr(store, slot, COL_FINGERPRINT), row->fingerprint);
	row->attempt = DatumGetInt32(row_attr(store, slot, COL_ATTEMPT));
	row->outcome = PointerGetDatum(PG_DETOAST_DATUM_COPY(row_attr(store, slot, COL_OUTCOME)));
	row->expires_at = DatumGetTimestampTz(row_attr(store, slot, COL_EXPIRES_AT));
	row->writer = slot_row_writer(slot);
	row->ours = TransactionIdIsCurrentTransactionId(row->writer);

	ExecDropSingleTupleTableSlot(slot);
	table_close(rel, NoLock);
	return true;
}

/*
 * Tenants seen to exist, committed by other transactions: a direct-mapped
 * cache of ids, so a claim usually skips the probe.  It only ever answers
 * "exists", and the foreign key checks the row again when it is written,
 * so a tenant deleted since costs only the friendlier error: the write
 * then fails with the FK's own 23503 instead of the claim.  A transaction
 * snapshot (REPEATABLE READ and up) probes, to answer as it sees it.
 */
#define TENANT_CACHE_SIZE	1024

static struct
{
	Oid			relid;			/* the tenants table the ids are from */
	int64		ids[TENANT_CACHE_SIZE];
	bool		valid[TENANT_CACHE_SIZE];
}			tenant_cache;

/* Whether the tenants table has this id (the FK's own check, done early). */
bool
ledger_tenant_exists(LedgerStore *store, int64 tenant_id, Snapshot snapshot)
{
	uint32		h = hash_bytes_uint32((uint32) tenant_id ^
									  (uint32) ((uint64) tenant_id >> 32)) % TENANT_CACHE_SIZE;
	ScanKeyData key;
	Relation	rel;
	TupleTableSlot *slot;

	if (tenant_cache.relid != store->tenants_relid)
	{
		memset(&tenant_cache, 0, sizeof(tenant_cache));
		tenant_cache.relid = store->tenants_relid;
	}
	else if (tenant_cache.valid[h] && tenant_cache.ids[h] == tenant_id &&
			 !IsolationUsesXactSnapshot())
		return true;		/* (a snapshot from the past may not see it) */

	/* Not a plain heap and bigint btree: the FK checks at the write. */
	if (!store->tenants_probe)
		return true;

	ScanKeyInit(&key, 1, BTEqualStrategyNumber, F_INT8EQ, Int64GetDatum(tenant_id));
	slot = probe_unique(store->tenants_relid, store->tenants_idx, &key, 1,
						snapshot, &rel);
	table_close(rel, NoLock);
	if (slot == NULL)
		return false;

	/* Remember only rows that no transaction of ours may still undo. */
	if (!slot_row_is_ours(slot))
	{
		tenant_cache.ids[h] = tenant_id;
		tenant_cache.valid[h] = true;
	}
	ExecDropSingleTupleTableSlot(slot);
	return true;
}

/* ---------- writes: prepared statements ---------- */

/*
 * Run one of idem's own prepared statements on the ledger: its rows do not
 * leave the ledger behind idem's back (ledger_guard.c), whatever it does.
 * Returns SPI_execute_plan's code.
 */
static int
store_execute_own(LedgerStore *store, StorePlanId id, Datum *values)
{
	volatile int rc = 0;

	ledger_guard_own_begin();
	PG_TRY();
	{
		rc = SPI_execute_plan(store_plan(store, id), values, NULL, false, 0);
	}
	PG_FINALLY();
	{
		ledger_guard_own_end();
	}
	PG_END_TRY();
	return rc;
}

static void
run_write(LedgerStore *store, StorePlanId id, const LedgerKey *lk,
		  Datum *extra, int nextra, int expect)
{
	Datum		values[8];
	IdemDigestBytea keybuf;
	int			i;
	int			rc;

	values[0] = Int64GetDatum(lk->tenant_id);
	values[1] = PointerGetDatum(idem_digest_bytea(lk->key, &keybuf));
	for (i = 0; i < nextra; i++)
		values[2 + i] = extra[i];
	rc = store_execute_own(store, id, values);
	if (rc != expect)
		elog(ERROR, "idem ledger statement failed: %s", SPI_result_code_string(rc));
}

/* Write a new row (the claim's only write). */
void
ledger_insert(LedgerStore *store, const LedgerKey *lk, const uint8 *fingerprint,
			  IdemStatus status, int32 attempt, Datum outcome,
			  TimestampTz expires_at)
{
	Datum		extra[6];
	int			nextra = 5;

	store_check_local(store);
	if (!OidIsValid(store->idseq) &&
		ledger_insert_direct(store->relid, lk, fingerprint, status, attempt,
							 outcome, expires_at))
		return;
	extra[0] = PointerGetDatum(idem_digest_bytea(fingerprint, NULL));
	extra[1] = CStringGetTextDatum(idem_status_names[status]);
	extra[2] = Int32GetDatum(attempt);
	extra[3] = outcome;
	extra[4] = TimestampTzGetDatum(expires_at);

	/*
	 * A Citus shard's id, drawn from the shell table's identity sequence as
	 * an identity column's default draws it: without the USAGE privilege on
	 * the sequence, which the INSERT privilege on the ledger stands for.
	 */
	if (OidIsValid(store->idseq))
		extra[nextra++] = Int64GetDatum(nextval_internal(store->idseq, false));
	SPI_connect();
	run_write(store, PLAN_INSERT, lk, extra, nextra, SPI_OK_INSERT);
	SPI_finish();
}

/* Take over a row seen as failed_retryable or with an expired lease. */
bool
ledger_reclaim(LedgerStore *store, const LedgerKey *lk, const LedgerRow *seen,
			   TimestampTz lease_end, int32 *attempt)
{
	Datum		extra[3];
	bool		isnull;
	bool		done;

	store_check_local(store);
	extra[0] = TimestampTzGetDatum(lease_end);
	extra[1] = Int32GetDatum(seen->attempt);
	extra[2] = CStringGetTextDatum(idem_status_names[seen->status]);
	SPI_connect();
	run_write(store, PLAN_RECLAIM, lk, extra, 3, SPI_OK_UPDATE_RETURNING);
	done = SPI_processed == 1;
	if (done)
		*attempt = DatumGetInt32(SPI_getbinval(SPI_tuptable->vals[0],
											   SPI_tuptable->tupdesc, 1, &isnull));
	SPI_finish();
	return done;
}

/*
 * A failed_retryable row seen out of attempts becomes failed_permanent, its
 * detail kept, retained at least until expires_at.  False when the row
 * changed since it was seen.
 */
bool
ledger_exhaust(LedgerStore *store, const LedgerKey *lk, const LedgerRow *seen,
			   TimestampTz expires_at, TimestampTz *kept_until)
{
	Datum		extra[2];
	bool		isnull;
	bool		done;

	store_check_local(store);
	extra[0] = TimestampTzGetDatum(expires_at);
	extra[1] = Int32GetDatum(seen->attempt);
	SPI_connect();
	run_write(store, PLAN_EXHAUST, lk, extra, 2, SPI_OK_UPDATE_RETURNING);
	done = SPI_processed == 1;
	if (done)
		*kept_until = DatumGetTimestampTz(SPI_getbinval(SPI_tuptable->vals[0],
														SPI_tuptable->tupdesc, 1, &isnull));
	SPI_finish();
	return done;
}

/*
 * processing -> a final status; false when no processing row exists (of
 * attempt fence, when fence is not 0).
 */
bool
ledger_finish(LedgerStore *store, const LedgerKey *lk, IdemStatus status,
			  Datum outcome, TimestampTz expires_at, int32 fence,
			  int32 *attempt, uint8 *fingerprint)
{
	Datum		extra[4];
	bool		isnull;
	bool		done;

	store_check_local(store);
	extra[0] = CStringGetTextDatum(idem_status_names[status]);
	extra[1] = outcome;
	extra[2] = TimestampTzGetDatum(expires_at);
	extra[3] = Int32GetDatum(fence);
	SPI_connect();
	run_write(store, PLAN_FINISH, lk, extra, 4, SPI_OK_UPDATE_RETURNING);
	done = SPI_processed == 1;
	if (done)
	{
		Datum		fp;

		*attempt = DatumGetInt32(SPI_getbinval(SPI_tuptable->vals[0],
											   SPI_tuptable->tupdesc, 1, &isnull));
		fp = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2, &isnull);
		if (isnull)
			ereport_altered(ledger_table_name(store->kind),
							("A row has a NULL \"request_fingerprint\"."),
							("Restore the column's NOT NULL constraint."));
		digest_value(store, fp, fingerprint);
	}
	SPI_finish();
	return done;
}

/* Delete one batch of expired rows; rows locked by others are skipped. */
int64
ledger_purge(LedgerStore *store, TimestampTz terminal_before,
			 TimestampTz processing_before, TimestampTz finished_before,
			 int32 batch)
{
	Datum		values[4];
	int64		deleted;
	int			rc;

	values[0] = TimestampTzGetDatum(terminal_before);
	values[1] = TimestampTzGetDatum(processing_before);
	values[2] = Int32GetDatum(batch);
	values[3] = TimestampTzGetDatum(finished_before);
	if (store->distributed)
	{
		/*
		 * Every shard, through Citus: %1$L is the shard's name there, as a
		 * literal.  idem_shard_purge runs the batch on it as idem's own
		 * write, so that the worker's ledger guard lets it through.
		 */
		return idem_citus_purge(store->relid,
								psprintf("SELECT %s.idem_shard_purge(%%1$L, %s, %s, %s, %d)",
										 quote_identifier(get_namespace_name(get_rel_namespace(store->relid))),
										 timestamptz_literal(terminal_before),
										 timestamptz_literal(processing_before),
										 timestamptz_literal(finished_before),
										 batch));
	}
	SPI_connect();
	/* expired rows, whose copies have expired too */
	rc = store_execute_own(store, PLAN_PURGE, values);
	if (rc != SPI_OK_DELETE)
		elog(ERROR, "idem purge failed");
	deleted = (int64) SPI_processed;
	SPI_finish();
	return deleted;
}

PG_FUNCTION_INFO_V1(idem_shard_purge);

/*
 * idem_shard_purge(shard regclass, terminal_before timestamptz,
 * processing_before timestamptz, finished_before timestamptz, batch integer)
 * RETURNS bigint: one purge batch on a Citus shard of the tenant ledger, run
 * on the node that holds it by idem_purge on the coordinator (through
 * run_command_on_shards), with the caller's privileges on the shard.  Only
 * expired rows leave, whose copies have expired too, so the batch is idem's
 * own write for the ledger guard (ledger_guard.c), as the single-node purge
 * is.  Returns the rows deleted.
 */
Datum
idem_shard_purge(PG_FUNCTION_ARGS)
{
	Oid			shard = PG_GETARG_OID(0);
	Datum		values[4];
	Oid			types[4] = {TIMESTAMPTZOID, TIMESTAMPTZOID, INT4OID, TIMESTAMPTZOID};
	bool		is_shard;
	char	   *sql;
	volatile int rc = 0;
	int64		deleted;

	if (PG_NARGS() != 5 || PG_ARGISNULL(0) || PG_ARGISNULL(1) ||
		PG_ARGISNULL(2) || PG_ARGISNULL(3) || PG_ARGISNULL(4))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("idem_shard_purge arguments must not be null")));
	if (!idem_ledger_guard_is_ledger(shard, &is_shard) || !is_shard)
		ereport(ERROR,
				(errcode(ERRCODE_WRONG_OBJECT_TYPE),
				 errmsg("relation \"%s\" is not a Citus shard of the idem tenant ledger",
						get_rel_name(shard) ? get_rel_name(shard) : "?"),
				 errhint("idem_purge() calls this function on every shard; call idem_purge() on the coordinator.")));
	sql = purge_sql(quote_qualified_identifier(get_namespace_name(get_rel_namespace(shard)),
											   get_rel_name(shard)),
					"$1", "$2", "$4", "$3");
	values[0] = PG_GETARG_DATUM(1);
	values[1] = PG_GETARG_DATUM(2);
	values[2] = PG_GETARG_DATUM(4);
	values[3] = PG_GETARG_DATUM(3);
	SPI_connect();
	ledger_guard_own_begin();
	PG_TRY();
	{
		rc = SPI_execute_with_args(sql, 4, types, values, NULL, false, 0);
	}
	PG_FINALLY();
	{
		ledger_guard_own_end();
	}
	PG_END_TRY();
	if (rc != SPI_OK_DELETE)
		elog(ERROR, "idem purge of shard \"%s\" failed", get_rel_name(shard));
	deleted = (int64) SPI_processed;
	SPI_finish();
	PG_RETURN_INT64(deleted);
}
