/*-------------------------------------------------------------------------
 *
 * decision.h
 *	  What a claim decides.  ledger.c makes the decisions and spells them
 *	  (idem_decision_names, ledger.h); stats.c counts them, in this order,
 *	  for idem_stats().  A leaf: no state, no call.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_DECISION_H
#define IDEM_DECISION_H

/* Claim decisions, in the order idem_stats() reports them. */
typedef enum IdemDecision
{
	IDEM_DECISION_CLAIMED = 0,
	IDEM_DECISION_COMPLETED,
	IDEM_DECISION_FAILED_PERMANENT,
	IDEM_DECISION_BUSY,
	IDEM_DECISION_MISMATCH,
	IDEM_DECISION_COUNT
} IdemDecision;

#endif							/* IDEM_DECISION_H */
