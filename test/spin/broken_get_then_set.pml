/*
 * ######################################################################
 * ##  DELIBERATELY BROKEN VARIANT -- NOT THE PROTOCOL.  check.sh       ##
 * ##  requires spin to REJECT it with a counterexample.               ##
 * ######################################################################
 *
 * broken_get_then_set.pml -- the Valkey gate reclaimed with GET, then SET
 * (two commands) instead of the atomic gate, SET NX PX GET.
 *
 * What the variant must drop for spin to find the double effect: in idem
 * the Valkey gate is only a filter -- PostgreSQL decides.  With the real
 * idem_claim (try-lock, unique key, claim in the effect's transaction) a
 * racy gate costs nothing: both runners pass the gate, one gets `claimed`,
 * the other `busy` or a replay (check.sh proves this: control 2).  So this
 * variant replaces TWO steps:
 *   1. gate_step:  GET; then, if the key was absent, SET marker PX (no NX);
 *   2. claim_step: no try-lock and no unique key -- a plain SELECT of the
 *      committed row, then a plain INSERT that never conflicts (the
 *      "check, then insert" that a naive ledger does).
 * check.sh compiles it with -DNO_VALKEY_FAULTS (no FLUSHALL, restart,
 * unreachable, lost reply or marker expiry), so the ONLY way left to a
 * second effect is the GET-then-SET race itself: both runners GET nothing,
 * both SET their marker, both claim, both commit  -> `effects <= 1` fails.
 *
 * Controls (same file, compiled with):
 *   -DCONTROL_ATOMIC_GATE  the real atomic gate + the unprotected claim, no
 *                          Valkey faults: safe -> the counterexample above is
 *                          due to GET-then-SET and nothing else;
 *   -DCONTROL_PG_CLAIM     the GET-then-SET gate + the real idem_claim, WITH
 *                          Valkey faults: safe -> PostgreSQL is the authority.
 *   -DCONTROL_ATOMIC_GATE without -DNO_VALKEY_FAULTS: unsafe -> without the
 *                          PostgreSQL claim, Valkey alone cannot be trusted.
 */
#ifndef CONTROL_ATOMIC_GATE
#define STEP_GATE
#endif
#ifndef CONTROL_PG_CLAIM
#define STEP_CLAIM
#endif
#include "common.pml"

#ifndef CONTROL_ATOMIC_GATE
/* BROKEN: GET, then a separate SET <marker> PX (no NX). */
inline gate_step(me)
{
	if
	:: atomic { vk_up ->                                  /* GET */
		if
		:: vk_kind == V_NONE -> res = R_GO
		:: vk_kind == V_MARK -> res = R_BUSY
		:: vk_kind == V_DONE || vk_kind == V_FAILP ->
			got_kind = vk_kind; got_val = vk_val; res = R_REPLAY;
			assert(TERMINAL(row_st) && VK_OF(row_st) == got_kind && row_out == got_val)
		fi }
		if
		:: res == R_GO ->
			atomic {                                      /* SET ... PX */
				if
				:: vk_up -> vk_kind = V_MARK; vk_val = me; marked = true
				:: else -> skip
				fi }
		:: else -> skip
		fi
	:: atomic { !vk_up -> res = R_GO }
	fi
}
#endif

#ifndef CONTROL_PG_CLAIM
/* BROKEN: no try-lock, no unique key: SELECT the committed row, then a
 * plain INSERT (or UPDATE) in the effect's transaction. */
inline claim_step(me)
{
	atomic {
		if
		:: row_st == S_NONE ->
			tx_st = S_PROC; tx_att = 1; tx_wrote = true; res = R_CLAIMED
		:: TERMINAL(row_st) ->
			got_kind = VK_OF(row_st); got_val = row_out; res = R_REPLAY
		:: row_st == S_FAILR ->
			tx_st = S_PROC; tx_att = row_att + 1; tx_wrote = true; res = R_CLAIMED
		:: row_st == S_PROC && lease_live[row_holder] -> res = R_BUSY
		:: row_st == S_PROC && !lease_live[row_holder] ->
			tx_st = S_PROC; tx_att = row_att + 1; tx_wrote = true; res = R_CLAIMED
		fi;
		att = tx_att
	}
}
#endif

#include "procs.pml"
