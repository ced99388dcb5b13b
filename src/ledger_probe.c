/*-------------------------------------------------------------------------
 *
 * ledger_probe.c
 *	  Reads of a ledger: direct probes of its unique index on the key, and
 *	  of the tenants table's unique index on id (ledger_store.h).  No SPI,
 *	  no executor, no parse: they run on every claim, so they are the hot
 *	  path of a replay.
 *
 *	  A probe trusts the store it is given: ledger_registry.c has checked
 *	  every column's type and every index's shape, and locked them for the
 *	  transaction.  The probes check what the executor would have checked
 *	  (a NULL where NOT NULL was dropped, a digest of another length) and
 *	  refuse such a row.  State: the tenant cache below, per backend, keyed
 *	  by the tenants table and reset when that changes.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "common/hashfn.h"
#include "executor/tuptable.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

#include "ledger_store_int.h"
#include "cache_format.h"
#include "compat.h"
#include "digest.h"
#include "ledger_row.h"

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
void
ledger_digest_value(LedgerStore *store, Datum d, uint8 *out)
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
	ledger_digest_value(store, row_attr(store, slot, COL_FINGERPRINT), row->fingerprint);
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
