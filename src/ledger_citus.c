/*-------------------------------------------------------------------------
 *
 * ledger_citus.c
 *	  The stores of a Citus tenant ledger (ledger_store_int.h): one per
 *	  local shard this backend used, keyed by the shard's table, and one
 *	  standing for the distributed table, which serves only the purge
 *	  (ledger_purge hands it to citus.c).  What Citus itself says (which
 *	  table is distributed, which shard holds a tenant) comes from citus.c.
 *
 *	  A shard's store is cached catalog state like any other: the relcache
 *	  callback (ledger_store_relcache_cb) invalidates it through
 *	  ledger_citus_invalidate, and ledger_registry.c checks and locks it
 *	  before use.  Entries live in TopMemoryContext for the backend's life.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/dependency.h"
#include "utils/hsearch.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"

#include "ledger_store_int.h"
#include "citus.h"
#include "compat.h"
#include "ledger_row.h"

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

/*
 * The tenant ledger when it is a Citus distributed table (found by name:
 * the registry is the coordinator's, and Citus's own catalog says what the
 * table is), or InvalidOid.
 */
Oid
ledger_citus_ledger(Oid nsp, LedgerKind kind)
{
	Oid			relid;

	if (kind != LEDGER_TENANT)
		return InvalidOid;
	relid = get_relname_relid(ledger_table_name(kind), nsp);
	return OidIsValid(relid) && idem_citus_distributed(relid) ? relid : InvalidOid;
}

/* The store standing for the distributed tenant ledger: purge only. */
LedgerStore *
ledger_citus_distributed_store(Oid ledger, LedgerKind kind)
{
	distributed_store.relid = ledger;
	distributed_store.kind = kind;
	distributed_store.distributed = true;
	return &distributed_store;
}

/*
 * The store of the local shard of the tenant ledger that holds this
 * tenant's keys, not yet checked nor locked (the caller does both:
 * store_lock_valid).
 */
LedgerStore *
ledger_citus_shard_store(Oid ledger, int64 tenant_id)
{
	int64		shardid;
	Oid			shard = idem_citus_local_shard(ledger, tenant_id, &shardid);
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
	return &entry->store;
}

/* The store of a shard this backend used, or NULL. */
LedgerStore *
ledger_citus_store_find(Oid shard)
{
	CitusStore *entry;

	if (citus_stores == NULL)
		return NULL;
	entry = hash_search(citus_stores, &shard, HASH_FIND, NULL);
	return entry != NULL ? &entry->store : NULL;
}

/* From ledger_store_relcache_cb: forget the shards' stores that changed. */
void
ledger_citus_invalidate(Oid relid)
{
	HASH_SEQ_STATUS seq;
	CitusStore *entry;

	if (citus_stores == NULL)
		return;
	hash_seq_init(&seq, citus_stores);
	while ((entry = hash_seq_search(&seq)) != NULL)
		store_invalidate(&entry->store, relid);
}
