/*-------------------------------------------------------------------------
 *
 * ledger.h
 *	  The decisions (ledger.c: the SQL API and its decisions), which the
 *	  batch and apply forms (ledger_batch.c, ledger_apply.c) share.  They
 *	  stand on what is below them:
 *		pending.h		claims of the running transaction whose row is
 *						not written yet
 *		ledger_row.h	a row: its ledger, key, content and status
 *		ledger_store.h	how a ledger table is read (index probes) and
 *						written (prepared SPI statements)
 *		ledger_insert.h	the direct write of a new row (the hot write)
 *		ledger_guard.h	rows removed outside idem
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

#include "datatype/timestamp.h"
#include "utils/jsonb.h"

#include "decision.h"
#include "ledger_row.h"
#include "ledger_store.h"

/* The spelling of each IdemDecision (ledger.c): idem_claim's decision. */
extern const char *const idem_decision_names[IDEM_DECISION_COUNT];

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
	int64		fence;			/* claimed: the id of the claim's row, its
								 * fence; 0 for a new key until idem_claim
								 * draws it (ledger_new_fence) */
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
							  TimestampTz retention_end, int32 fence_attempt,
							  int64 fence);
extern char *ledger_check_outcome(Jsonb *jb, const char *name);
extern TimestampTz ledger_deadline(Interval *iv, const char *name,
								   int64 default_ms, TimestampTz now);
extern TimestampTz ledger_retention_end(Interval *iv, TimestampTz now);

#endif							/* IDEM_LEDGER_H */
