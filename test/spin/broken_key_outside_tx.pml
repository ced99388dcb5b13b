/*
 * ######################################################################
 * ##  DELIBERATELY BROKEN VARIANT -- NOT THE PROTOCOL.  check.sh       ##
 * ##  requires spin to REJECT it with a counterexample.               ##
 * ######################################################################
 *
 * broken_key_outside_tx.pml -- the idempotency key is written to
 * PostgreSQL in its own transaction, outside the effect's transaction
 * (writing the key outside the effect's transaction opens two holes:
 * a doubled effect, or a lost one).
 *
 * Identical to idem.pml except for ONE step, commit_step, replaced below:
 * instead of one COMMIT of {try-lock, row, effect, idem_complete}, the
 * runner commits two transactions, one after the other, and may die (or
 * its backend be terminated) between them.
 *
 *   default      the effect's transaction commits first, the ledger
 *                transaction (claim + idem_complete) second.  A death in
 *                between leaves the effect without a key; once the marker
 *                expires (or Valkey loses it) a redelivery claims the key
 *                afresh and applies the effect AGAIN  -> assertion
 *                `effects <= 1` (SAFETY) fails.
 *   -DKEY_FIRST  the ledger transaction commits `completed` first, the
 *                effect second ("a key marked completed before the effect
 *                commits").  The effect's transaction can still roll back:
 *                the key says completed, replays are served, the effect
 *                never happens  -> invariant `completed => effect
 *                committed` fails (a LOST effect).
 */
#define STEP_COMMIT
#include "common.pml"

bool eff_pending = false;   /* KEY_FIRST: the separate effect tx is open */

inline commit_step(me)
{
#ifndef KEY_FIRST
	/* BROKEN: T1 = the effect's transaction, COMMIT (without the key) */
	atomic {
		if
		:: tx_eff -> effects++; assert(effects <= 1); tx_eff = false
		:: else -> skip
		fi
	};
	if
	:: atomic { FAULT -> SPEND; runner_dies(me) }      /* dies between T1 and T2 */
	:: atomic {
		/* T2 = the ledger transaction (claim, idem_complete), COMMIT */
		if
		:: tx_st == S_FAILR -> res = R_REQUEUE
		:: else -> res = R_APPLIED; got_kind = VK_OF(tx_st); got_val = tx_out
		fi;
		tx_commit_effects(me) }
	fi
#else
	/* BROKEN: T1 = the ledger transaction marks the key completed, COMMIT */
	atomic {
		eff_pending = tx_eff; tx_eff = false;
		if
		:: tx_st == S_FAILR -> res = R_REQUEUE
		:: else -> res = R_APPLIED; got_kind = VK_OF(tx_st); got_val = tx_out
		fi;
		tx_commit_effects(me)
	};
	if
	:: atomic { FAULT -> SPEND; eff_pending = false; res = R_DIED }  /* T2 rolled back */
	:: atomic {                                                      /* T2 COMMIT */
		if
		:: eff_pending -> effects++; assert(effects <= 1)
		:: else -> skip
		fi;
		eff_pending = false }
	fi
#endif
}

#include "procs.pml"
