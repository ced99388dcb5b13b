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
 *	  The cache is keyed by the ledger's OID, looked up by name on every
 *	  open: a ledger dropped and re-created (a restore) is picked up.
 *
 *-------------------------------------------------------------------------
 */
#include "ledger.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "catalog/pg_constraint.h"
#include "catalog/pg_type.h"
#include "common/hashfn.h"
#include "executor/spi.h"
#include "executor/tuptable.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
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
	PLAN_COUNT
} StorePlanId;

typedef enum StoreColumn
{
	COL_STATUS = 0,
	COL_FINGERPRINT,
	COL_ATTEMPT,
	COL_OUTCOME,
	COL_EXPIRES_AT,
	COL_COUNT
} StoreColumn;

static const char *const column_names[COL_COUNT] = {
	"status", "request_fingerprint", "attempt", "outcome", "expires_at"
};

struct LedgerStore
{
	LedgerKind	kind;
	Oid			relid;			/* the ledger */
	Oid			keyidx;			/* its unique index on the key */
	Oid			tenants_relid;	/* tenant ledger: the FK's table ... */
	Oid			tenants_idx;	/* ... and its unique index on id */
	AttrNumber	att[COL_COUNT];
	SPIPlanPtr	plans[PLAN_COUNT];
};

static LedgerStore stores[LEDGER_KINDS];

static const char *const ledger_tables[LEDGER_KINDS] = {
	"idempotency_keys", "platform_idempotency_keys"
};

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

static SPIPlanPtr
prepare_plan(LedgerKind kind, StorePlanId id, const char *qtable)
{
	const char *owner = owner_clause[kind];
	char	   *sql;
	Oid			types[7] = {INT8OID, BYTEAOID};
	int			nargs;
	SPIPlanPtr	plan;

	switch (id)
	{
		case PLAN_INSERT:
			sql = psprintf("INSERT INTO %s (%sidempotency_key, request_fingerprint,"
						   " status, attempt, outcome, expires_at)"
						   " VALUES (%s$2, $3, $4, $5, $6, $7)",
						   qtable,
						   kind == LEDGER_TENANT ? "tenant_id, " : "",
						   kind == LEDGER_TENANT ? "$1, " : "");
			types[2] = BYTEAOID;
			types[3] = TEXTOID;
			types[4] = INT4OID;
			types[5] = JSONBOID;
			types[6] = TIMESTAMPTZOID;
			nargs = 7;
			break;
		case PLAN_RECLAIM:
			sql = psprintf("UPDATE %s SET status = 'processing',"
						   " attempt = attempt OPERATOR(pg_catalog.+) 1,"
						   " outcome = '{}'::pg_catalog.jsonb, expires_at = $3,"
						   " updated_at = pg_catalog.clock_timestamp()"
						   " WHERE %s AND attempt OPERATOR(pg_catalog.=) $4"
						   " AND status OPERATOR(pg_catalog.=) $5"
						   " RETURNING attempt", qtable, owner);
			types[2] = TIMESTAMPTZOID;
			types[3] = INT4OID;
			types[4] = TEXTOID;
			nargs = 5;
			break;
		case PLAN_FINISH:
			sql = psprintf("UPDATE %s SET status = $3, outcome = $4, expires_at = $5,"
						   " updated_at = pg_catalog.clock_timestamp()"
						   " WHERE %s AND status OPERATOR(pg_catalog.=) 'processing'"
						   " AND ($6 OPERATOR(pg_catalog.=) 0 OR attempt OPERATOR(pg_catalog.=) $6)"
						   " RETURNING attempt, request_fingerprint", qtable, owner);
			types[2] = TEXTOID;
			types[3] = JSONBOID;
			types[4] = TIMESTAMPTZOID;
			types[5] = INT4OID;
			nargs = 6;
			break;
		case PLAN_PURGE:
			sql = psprintf("DELETE FROM %s WHERE id OPERATOR(pg_catalog.=) ANY (ARRAY("
						   "SELECT id FROM %s WHERE"
						   " (status OPERATOR(pg_catalog.<>) 'processing' AND expires_at OPERATOR(pg_catalog.<) $1)"
						   " OR (status OPERATOR(pg_catalog.=) 'processing' AND expires_at OPERATOR(pg_catalog.<) $2)"
						   " LIMIT $3 FOR UPDATE SKIP LOCKED))", qtable, qtable);
			types[0] = TIMESTAMPTZOID;
			types[1] = TIMESTAMPTZOID;
			types[2] = INT4OID;
			nargs = 3;
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

static void
store_build(LedgerStore *store, LedgerKind kind, Oid nsp, Oid relid)
{
	char	   *qtable = quote_qualified_identifier(get_namespace_name(nsp),
													ledger_tables[kind]);
	int			i;

	for (i = 0; i < PLAN_COUNT; i++)
	{
		if (store->plans[i])
			SPI_freeplan(store->plans[i]);
		store->plans[i] = NULL;
	}
	store->relid = InvalidOid;
	store->kind = kind;

	store->keyidx = constraint_index(get_relation_constraint_oid(relid,
																 ledger_unique[kind],
																 false));
	for (i = 0; i < COL_COUNT; i++)
	{
		store->att[i] = get_attnum(relid, column_names[i]);
		if (store->att[i] == InvalidAttrNumber)
			elog(ERROR, "idem ledger \"%s\" has no column \"%s\"",
				 ledger_tables[kind], column_names[i]);
	}

	store->tenants_relid = InvalidOid;
	store->tenants_idx = InvalidOid;
	if (kind == LEDGER_TENANT)
	{
		Relation	rel = table_open(relid, AccessShareLock);
		List	   *fkeys = RelationGetFKeyList(rel);
		ListCell   *lc;

		foreach(lc, fkeys)
		{
			ForeignKeyCacheInfo *fk = lfirst_node(ForeignKeyCacheInfo, lc);

			store->tenants_relid = fk->confrelid;
			store->tenants_idx = constraint_index(fk->conoid);
		}
		table_close(rel, NoLock);
		if (!OidIsValid(store->tenants_idx))
			ereport(ERROR,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("the idem tenant ledger has no foreign key to a tenants table"),
					 errhint("Re-create it with idem_install('tenants').")));
	}

	SPI_connect();
	for (i = 0; i < PLAN_COUNT; i++)
		store->plans[i] = prepare_plan(kind, (StorePlanId) i, qtable);
	SPI_finish();
	store->relid = relid;
}

/*
 * The ledger of this kind in the extension's schema; ERROR when
 * idem_install has not run.
 */
LedgerStore *
ledger_store_open(Oid nsp, LedgerKind kind)
{
	Oid			relid = get_relname_relid(ledger_tables[kind], nsp);
	LedgerStore *store = &stores[kind];

	if (!OidIsValid(relid))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idem is not installed in this database: table %s.%s does not exist",
						get_namespace_name(nsp), ledger_tables[kind]),
				 errhint("Run SELECT idem_install('tenants') once after CREATE EXTENSION idem.")));
	if (store->relid != relid)
		store_build(store, kind, nsp, relid);

	/*
	 * Probes read the table without the executor, so check what the
	 * executor would: reading a ledger needs SELECT on it.  Writes go
	 * through SPI, which checks INSERT and UPDATE itself.
	 */
	if (pg_class_aclcheck(relid, GetUserId(), ACL_SELECT) != ACLCHECK_OK)
		aclcheck_error(ACLCHECK_NO_PRIV, OBJECT_TABLE, ledger_tables[kind]);

	/*
	 * Nor do probes apply row-level security policies: refuse, rather than
	 * answer from rows a policy would hide.
	 */
	if (check_enable_rls(relid, InvalidOid, false) == RLS_ENABLED)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("idem does not support row-level security on table %s",
						ledger_tables[kind]),
				 errdetail("idem reads the ledger by key without applying policies."),
				 errhint("Disable row-level security on the ledger, or run the caller as a role that bypasses it, and restrict access with grants.")));
	return store;
}

/* The store a pending claim was made against (pre-commit has no fcinfo). */
LedgerStore *
ledger_store_for(LedgerKind kind, Oid relid)
{
	LedgerStore *store = &stores[kind];

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
	scan = index_beginscan(rel, idx, snapshot, nkeys, 0);
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
key_scankeys(const LedgerKey *lk, ScanKey keys, int *nkeys, bytea *keybuf)
{
	SET_VARSIZE(keybuf, VARHDRSZ + IDEM_DIGEST_LEN);
	memcpy(VARDATA(keybuf), lk->key, IDEM_DIGEST_LEN);
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

/* Read the row of a key as the snapshot sees it. */
bool
ledger_probe(LedgerStore *store, const LedgerKey *lk, Snapshot snapshot,
			 LedgerRow *row)
{
	ScanKeyData keys[2];
	int			nkeys;
	char		keybuf[VARHDRSZ + IDEM_DIGEST_LEN];
	Relation	rel;
	TupleTableSlot *slot;
	bool		isnull;
	bytea	   *fp;
	Datum		xmin;

	key_scankeys(lk, keys, &nkeys, (bytea *) keybuf);
	slot = probe_unique(store->relid, store->keyidx, keys, nkeys, snapshot, &rel);
	if (slot == NULL)
	{
		table_close(rel, NoLock);
		return false;
	}

	text_to_cstring_buffer(DatumGetTextPP(slot_getattr(slot, store->att[COL_STATUS], &isnull)),
						   row->status, sizeof(row->status));
	fp = DatumGetByteaPP(slot_getattr(slot, store->att[COL_FINGERPRINT], &isnull));
	if (VARSIZE_ANY_EXHDR(fp) != IDEM_DIGEST_LEN)
		elog(ERROR, "idem ledger row has a fingerprint of %d bytes",
			 (int) VARSIZE_ANY_EXHDR(fp));
	memcpy(row->fingerprint, VARDATA_ANY(fp), IDEM_DIGEST_LEN);
	row->attempt = DatumGetInt32(slot_getattr(slot, store->att[COL_ATTEMPT], &isnull));
	row->outcome = PointerGetDatum(PG_DETOAST_DATUM_COPY(slot_getattr(slot,
																	  store->att[COL_OUTCOME],
																	  &isnull)));
	row->expires_at = DatumGetTimestampTz(slot_getattr(slot, store->att[COL_EXPIRES_AT],
													   &isnull));
	xmin = slot_getsysattr(slot, MinTransactionIdAttributeNumber, &isnull);
	row->ours = TransactionIdIsCurrentTransactionId(DatumGetTransactionId(xmin));

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
	TransactionId xmin;
	bool		isnull;

	if (tenant_cache.relid != store->tenants_relid)
	{
		memset(&tenant_cache, 0, sizeof(tenant_cache));
		tenant_cache.relid = store->tenants_relid;
	}
	else if (tenant_cache.valid[h] && tenant_cache.ids[h] == tenant_id &&
			 !IsolationUsesXactSnapshot())
		return true;		/* (a snapshot from the past may not see it) */

	ScanKeyInit(&key, 1, BTEqualStrategyNumber, F_INT8EQ, Int64GetDatum(tenant_id));
	slot = probe_unique(store->tenants_relid, store->tenants_idx, &key, 1,
						snapshot, &rel);
	table_close(rel, NoLock);
	if (slot == NULL)
		return false;

	/* Remember only rows that no transaction of ours may still undo. */
	xmin = DatumGetTransactionId(slot_getsysattr(slot, MinTransactionIdAttributeNumber,
												 &isnull));
	if (!TransactionIdIsCurrentTransactionId(xmin))
	{
		tenant_cache.ids[h] = tenant_id;
		tenant_cache.valid[h] = true;
	}
	ExecDropSingleTupleTableSlot(slot);
	return true;
}

/* ---------- writes: prepared statements ---------- */

static void
run_write(LedgerStore *store, StorePlanId id, const LedgerKey *lk,
		  Datum *extra, int nextra, int expect)
{
	Datum		values[7];
	char		keybuf[VARHDRSZ + IDEM_DIGEST_LEN];
	int			i;
	int			rc;

	SET_VARSIZE(keybuf, VARHDRSZ + IDEM_DIGEST_LEN);
	memcpy(VARDATA(keybuf), lk->key, IDEM_DIGEST_LEN);
	values[0] = Int64GetDatum(lk->tenant_id);
	values[1] = PointerGetDatum(keybuf);
	for (i = 0; i < nextra; i++)
		values[2 + i] = extra[i];
	rc = SPI_execute_plan(store->plans[id], values, NULL, false, 0);
	if (rc != expect)
		elog(ERROR, "idem ledger statement failed: %s", SPI_result_code_string(rc));
}

bytea *
ledger_digest_datum(const uint8 *digest)
{
	bytea	   *b = palloc(VARHDRSZ + IDEM_DIGEST_LEN);

	SET_VARSIZE(b, VARHDRSZ + IDEM_DIGEST_LEN);
	memcpy(VARDATA(b), digest, IDEM_DIGEST_LEN);
	return b;
}

/* Write a new row (the claim's only write). */
void
ledger_insert(LedgerStore *store, const LedgerKey *lk, const uint8 *fingerprint,
			  const char *status, int32 attempt, Datum outcome,
			  TimestampTz expires_at)
{
	Datum		extra[5];

	if (ledger_insert_direct(store->relid, lk, fingerprint, status, attempt,
							 outcome, expires_at))
		return;
	extra[0] = PointerGetDatum(ledger_digest_datum(fingerprint));
	extra[1] = CStringGetTextDatum(status);
	extra[2] = Int32GetDatum(attempt);
	extra[3] = outcome;
	extra[4] = TimestampTzGetDatum(expires_at);
	SPI_connect();
	run_write(store, PLAN_INSERT, lk, extra, 5, SPI_OK_INSERT);
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

	extra[0] = TimestampTzGetDatum(lease_end);
	extra[1] = Int32GetDatum(seen->attempt);
	extra[2] = CStringGetTextDatum(seen->status);
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
 * processing -> a final status; false when no processing row exists (of
 * attempt fence, when fence is not 0).
 */
bool
ledger_finish(LedgerStore *store, const LedgerKey *lk, const char *status,
			  Datum outcome, TimestampTz expires_at, int32 fence,
			  int32 *attempt, uint8 *fingerprint)
{
	Datum		extra[4];
	bool		isnull;
	bool		done;

	extra[0] = CStringGetTextDatum(status);
	extra[1] = outcome;
	extra[2] = TimestampTzGetDatum(expires_at);
	extra[3] = Int32GetDatum(fence);
	SPI_connect();
	run_write(store, PLAN_FINISH, lk, extra, 4, SPI_OK_UPDATE_RETURNING);
	done = SPI_processed == 1;
	if (done)
	{
		bytea	   *fp;

		*attempt = DatumGetInt32(SPI_getbinval(SPI_tuptable->vals[0],
											   SPI_tuptable->tupdesc, 1, &isnull));
		fp = DatumGetByteaPP(SPI_getbinval(SPI_tuptable->vals[0],
										   SPI_tuptable->tupdesc, 2, &isnull));
		memcpy(fingerprint, VARDATA_ANY(fp), IDEM_DIGEST_LEN);
	}
	SPI_finish();
	return done;
}

/* Delete one batch of expired rows; rows locked by others are skipped. */
int64
ledger_purge(LedgerStore *store, TimestampTz terminal_before,
			 TimestampTz processing_before, int32 batch)
{
	Datum		values[3];
	int64		deleted;

	values[0] = TimestampTzGetDatum(terminal_before);
	values[1] = TimestampTzGetDatum(processing_before);
	values[2] = Int32GetDatum(batch);
	SPI_connect();
	if (SPI_execute_plan(store->plans[PLAN_PURGE], values, NULL, false, 0) != SPI_OK_DELETE)
		elog(ERROR, "idem purge failed");
	deleted = (int64) SPI_processed;
	SPI_finish();
	return deleted;
}
