/*
 * idem.pml -- the REAL model of idem's exactly-once protocol.
 *
 * Everything lives in common.pml (state and protocol steps, each mapped to
 * the function of the code it models) and procs.pml (runners, worker,
 * timers, faults, invariant monitor).  The broken variants beside this file
 * include the same two files and replace exactly one step each.
 *
 * Safety properties are assertions (checked by pan in safety mode,
 * compiled with -DNOCLAIM); liveness is the LTL formula below, checked with
 * `spin -a` + `pan -a -f` on a LIVENESS configuration.  See check.sh.
 */
#include "common.pml"
#include "procs.pml"

/* LIVENESS: with redeliveries continuing until a terminal result and every
 * fault budget spent (faults cease), the effect is eventually applied. */
#ifdef LEASE_MODE
ltl eventually_applied { <> (row_st == S_DONE) }
#else
ltl eventually_applied { <> (effects == 1) }
#endif
