/*-------------------------------------------------------------------------
 *
 * ledger_store.h
 *	  How a ledger table is found and checked (ledger_registry.c, Citus
 *	  shards in ledger_citus.c), read by index probes (ledger_probe.c) and
 *	  written by prepared SPI statements (ledger_store.c).  Storage only:
 *	  it knows rows (ledger_row.h), not the decisions made from them
 *	  (ledger.h).  The files share ledger_store_int.h.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_LEDGER_STORE_H
#define IDEM_LEDGER_STORE_H

#include "ledger_row.h"

#include "utils/snapshot.h"

typedef struct LedgerStore LedgerStore;

#define IDEM_REGISTRY_TABLE "idem_ledgers"	/* kind -> ledger, by idem_install */
extern Oid	ledger_relation_find(Oid nsp, LedgerKind kind, Oid *registry);
extern void ledger_check_permanent(LedgerKind kind, Oid relid);
extern void ledger_store_relcache_cb(Datum arg, Oid relid);
extern LedgerStore *ledger_store_open(Oid nsp, LedgerKind kind);
extern LedgerStore *ledger_store_open_key(Oid nsp, const LedgerKey *lk);
extern LedgerStore *ledger_store_for(LedgerKind kind, Oid relid);
extern Oid	ledger_store_relid(const LedgerStore *store);
extern bool ledger_probe(LedgerStore *store, const LedgerKey *lk,
						 Snapshot snapshot, LedgerRow *row);
extern bool ledger_tenant_exists(LedgerStore *store, int64 tenant_id,
								 Snapshot snapshot);
extern const char *ledger_tenants_name(LedgerStore *store);
extern int64 ledger_new_fence(LedgerStore *store);
extern void ledger_insert(LedgerStore *store, const LedgerKey *lk, int64 fence,
						  const uint8 *fingerprint, IdemStatus status,
						  int32 attempt, Datum outcome, TimestampTz expires_at);
extern bool ledger_reclaim(LedgerStore *store, const LedgerKey *lk,
						   const LedgerRow *seen, TimestampTz lease_end,
						   int32 *attempt, int64 *fence);
extern bool ledger_exhaust(LedgerStore *store, const LedgerKey *lk,
						   const LedgerRow *seen, TimestampTz expires_at,
						   TimestampTz *kept_until);
extern bool ledger_finish(LedgerStore *store, const LedgerKey *lk,
						  IdemStatus status, Datum outcome,
						  TimestampTz expires_at, int32 fence_attempt,
						  int64 fence, int32 *attempt, uint8 *fingerprint);
extern int64 ledger_purge(LedgerStore *store, TimestampTz terminal_before,
						  TimestampTz processing_before,
						  TimestampTz finished_before, int32 batch);

#endif							/* IDEM_LEDGER_STORE_H */
