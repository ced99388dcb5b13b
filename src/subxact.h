/*-------------------------------------------------------------------------
 *
 * subxact.h
 *	  The one rule by which per-transaction state follows subtransactions,
 *	  for every file that keeps such state (commit_copies.c, pending.c,
 *	  outbox.c); xact.c calls them as each subtransaction ends.  A leaf: no
 *	  state, no call.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_SUBXACT_H
#define IDEM_SUBXACT_H

#include "postgres.h"

/*
 * Per-transaction state is tagged with the nesting level that made it
 * (GetCurrentTransactionNestLevel()).  When the subtransaction at level
 * ends, each tag goes through this one rule: state
 * of outer levels is untouched; state of this level or deeper is handed to
 * the parent (level - 1) when the subtransaction committed, and must be
 * forgotten (false) when it aborted.
 */
static inline bool
idem_subxact_follow(int *tag, bool committed, int level)
{
	if (*tag < level)
		return true;
	if (!committed)
		return false;
	*tag = level - 1;
	return true;
}

#endif							/* IDEM_SUBXACT_H */
