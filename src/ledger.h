/*-------------------------------------------------------------------------
 *
 * ledger.h
 *	  Internal interface between the ledger files:
 *		ledger.c		the SQL API and its decisions
 *		ledger_store.c	how a ledger table is read (index probes) and
 *						written (prepared SPI statements)
 *		ledger_insert.c	the direct write of a new row (the hot write)
 *		pending.c		claims of the running transaction whose row is not
 *						written yet
 *
 *	  A claim of a new key writes nothing: the key lock keeps other claimers
 *	  out, and the row is written once, by idem_complete / idem_fail, or as a
 *	  processing row at pre-commit when the transaction commits the claim
 *	  alone (lease mode).  One row write per message, like the floor.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_LEDGER_H
#define IDEM_LEDGER_H

#include "idem.h"

#include "utils/jsonb.h"
#include "utils/snapshot.h"
#include "datatype/timestamp.h"

typedef enum LedgerKind
{
	LEDGER_TENANT = 0,
	LEDGER_PLATFORM,
	LEDGER_KINDS
} LedgerKind;

/* The identity of a ledger row: which ledger, whose, which key. */
typedef struct LedgerKey
{
	LedgerKind	kind;
	int64		tenant_id;		/* 0 on the platform ledger */
	uint8		key[IDEM_DIGEST_LEN];
} LedgerKey;

/* A ledger row as the API sees it. */
typedef struct LedgerRow
{
	IdemStatus	status;
	uint8		fingerprint[IDEM_DIGEST_LEN];
	int32		attempt;
	Datum		outcome;		/* jsonb, detoasted, in the caller's context */
	TimestampTz expires_at;
	bool		ours;			/* written by this transaction */
	TransactionId writer;		/* its xmin (Invalid: not read from the table) */
} LedgerRow;

typedef struct LedgerStore LedgerStore;

/* What a claim answers (the columns of idem_claim_result). */
typedef struct ClaimAnswer
{
	IdemDecision decision;
	int32		attempt;		/* 0: none (NULL) */
	Datum		outcome;		/* jsonb, or 0 for NULL */
	TimestampTz expires_at;
	bool		committed_row;	/* read from a row another transaction wrote */
	TransactionId writer;		/* that transaction, when committed_row */
	bool		wrote_row;		/* the claim wrote the row (out of attempts) */
} ClaimAnswer;

/* ledger.c: one key's claim and settlement, and the argument checks */
extern void ledger_claim_key(LedgerStore *store, const LedgerKey *lk,
							 const uint8 *fingerprint, TimestampTz now,
							 TimestampTz lease_end, bool lease_given,
							 int32 max_attempts, ClaimAnswer *ans);
extern void ledger_claim_key_nowait(LedgerStore *store, const LedgerKey *lk,
									const uint8 *fingerprint, TimestampTz now,
									TimestampTz lease_end, bool lease_given,
									int32 max_attempts, ClaimAnswer *ans);
extern bool ledger_answer_needs_durable(const ClaimAnswer *ans);
extern void ledger_answer_values(const ClaimAnswer *ans, Datum *values,
								 bool *nulls);
extern void ledger_settle_key(LedgerStore *store, const LedgerKey *lk,
							  const char *what, IdemStatus status,
							  Jsonb *outcome, const char *outcome_text,
							  TimestampTz retention_end, int32 fence);
extern void ledger_check_digest(const bytea *d, const char *name, uint8 *out);
extern char *ledger_check_outcome(Jsonb *jb, const char *name);
extern TimestampTz ledger_deadline(Interval *iv, const char *name,
								   int64 default_ms, TimestampTz now);
extern TimestampTz ledger_retention_end(Interval *iv, TimestampTz now);

/* ledger_store.c */
#define IDEM_REGISTRY_TABLE "idem_ledgers"	/* kind -> ledger, by idem_install */
extern Oid	ledger_relation_find(Oid nsp, LedgerKind kind, Oid *registry);
extern void ledger_check_permanent(LedgerKind kind, Oid relid);
extern const char *ledger_table_name(LedgerKind kind);
extern const char *ledger_kind_name(LedgerKind kind);
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
extern void ledger_insert(LedgerStore *store, const LedgerKey *lk,
						  const uint8 *fingerprint, IdemStatus status,
						  int32 attempt, Datum outcome, TimestampTz expires_at);
extern bool ledger_reclaim(LedgerStore *store, const LedgerKey *lk,
						   const LedgerRow *seen, TimestampTz lease_end,
						   int32 *attempt);
extern bool ledger_exhaust(LedgerStore *store, const LedgerKey *lk,
						   const LedgerRow *seen, TimestampTz expires_at,
						   TimestampTz *kept_until);
extern bool ledger_finish(LedgerStore *store, const LedgerKey *lk,
						  IdemStatus status, Datum outcome,
						  TimestampTz expires_at, int32 fence,
						  int32 *attempt, uint8 *fingerprint);
extern int64 ledger_purge(LedgerStore *store, TimestampTz terminal_before,
						  TimestampTz processing_before,
						  TimestampTz finished_before, int32 batch);

/* ledger_insert.c */
extern bool ledger_insert_direct(Oid relid, const LedgerKey *lk,
								 const uint8 *fingerprint, IdemStatus status,
								 int32 attempt, Datum outcome,
								 TimestampTz expires_at);
extern void ledger_insert_relcache_cb(Datum arg, Oid relid);
extern void ledger_insert_syscache_cb(Datum arg, int cacheid, uint32 hashvalue);

/* pending.c */
typedef struct PendingClaim
{
	LedgerKey	lk;				/* hash key: must stay first */
	uint8		fingerprint[IDEM_DIGEST_LEN];
	TimestampTz lease_end;
	bool		lease_given;	/* the caller chose the lease (not idem.lease) */
	Oid			relid;
	int			nest_level;		/* subtransaction that made the claim */
	int			settled_level;	/* subtransaction that wrote its row; 0: not yet */
} PendingClaim;

/* ledger_guard.c */
extern void idem_ledger_guard_register(void);
extern void idem_ledger_guard_xact_event(XactEvent event);
extern void ledger_guard_own_begin(void);
extern void ledger_guard_own_end(void);

extern void idem_pending_xact_event(XactEvent event);
extern void idem_pending_subxact_end(bool committed, int level);
extern PendingClaim *pending_find(const LedgerKey *lk);
extern void pending_add(const LedgerKey *lk, const uint8 *fingerprint,
						TimestampTz lease_end, bool lease_given, Oid relid);
extern void pending_settle(PendingClaim *claim);
extern void pending_check_change(const char *what);

#endif							/* IDEM_LEDGER_H */
