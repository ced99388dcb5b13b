/*-------------------------------------------------------------------------
 *
 * ledger_store_int.h
 *	  What the ledger store's own files share and nothing else includes:
 *	  the per-backend LedgerStore (what is known about one ledger table),
 *	  its columns and prepared statements, and the error for a ledger in a
 *	  shape idem cannot use.
 *
 *	  ledger_registry.c  which table is a ledger, its shape checks, the
 *	                     stores and their relcache callback, opening one
 *	  ledger_citus.c     the stores of a Citus ledger's local shards
 *	  ledger_probe.c     reads: direct probes of the unique indexes
 *	  ledger_store.c     writes: the prepared SPI statements, the purge
 *
 *	  A LedgerStore is cached catalog state: it is trusted only while
 *	  valid, which the relcache callback (ledger_store_relcache_cb) clears
 *	  on any change to a relation it names, and only once
 *	  ledger_registry.c has locked those relations for the transaction.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_LEDGER_STORE_INT_H
#define IDEM_LEDGER_STORE_INT_H

#include "ledger_store.h"

#include "executor/spi.h"

typedef enum StorePlanId
{
	PLAN_INSERT = 0,			/* a row, any status */
	PLAN_RECLAIM,				/* failed_retryable / expired lease -> processing,
								 * under a new id: the new claim's fence */
	PLAN_FINISH,				/* processing -> completed / failed_* */
	PLAN_PURGE,					/* delete one batch of expired rows */
	PLAN_EXHAUST,				/* failed_retryable, out of attempts -> failed_permanent */
	PLAN_COUNT
} StorePlanId;

/*
 * The columns the API reads, and every column a prepared statement names,
 * with the one type idem reads and writes it as (store_columns[], in
 * ledger_registry.c).  A ledger whose column is missing or of another type
 * is refused before anything reads it (reading a json outcome as jsonb
 * crashes).
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

typedef struct StoreColumnDef
{
	const char *name;
	Oid			type;
} StoreColumnDef;

extern const StoreColumnDef store_columns[COL_COUNT];

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
	Oid			id_seq;			/* the sequence of its id (a claim's fence);
								 * InvalidOid: not looked up yet */
	/* On Citus (ledger_citus.c): */
	bool		distributed;	/* the distributed ledger: purge only */
	Oid			shard;			/* a shard of it: its table ... */
	int64		shardid;		/* ... its shard id (name suffix) ... */
	Oid			idseq;			/* ... and the sequence of its id */
};

/* The ledger is not in a shape idem can use: one error for every case. */
#define ereport_altered(table, detail, hint) \
	ereport(ERROR, \
			(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE), \
			 errmsg("idem ledger \"%s\" has been altered and cannot be used", (table)), \
			 errdetail detail, \
			 errhint hint))

/* Forget what the store knows if RELID is one of its relations (or any). */
static inline void
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

/*
 * The store of a Citus distributed ledger stands for the whole table and
 * serves only the purge.  The batch API, whose keys may belong to tenants
 * on several workers, ends here.
 */
static inline void
store_check_local(const LedgerStore *store)
{
	if (store->distributed)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("the idem batch API is not available for the tenant ledger on Citus"),
				 errdetail("The keys of a batch may belong to tenants on different workers; idem reads and writes only the local shard of one tenant."),
				 errhint("Call idem_claim and idem_complete per key: Citus delegates each call to the tenant's worker.")));
}

/* ledger_probe.c */
extern void ledger_digest_value(LedgerStore *store, Datum d, uint8 *out);

/* ledger_citus.c */
extern Oid	ledger_citus_ledger(Oid nsp, LedgerKind kind);
extern LedgerStore *ledger_citus_distributed_store(Oid ledger, LedgerKind kind);
extern LedgerStore *ledger_citus_shard_store(Oid ledger, int64 tenant_id);
extern LedgerStore *ledger_citus_store_find(Oid shard);
extern void ledger_citus_invalidate(Oid relid);

#endif							/* IDEM_LEDGER_STORE_INT_H */
