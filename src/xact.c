/*-------------------------------------------------------------------------
 *
 * xact.c
 *	  Transaction and subtransaction ends: the one transaction callback and
 *	  the one subtransaction callback of idem (registered by _PG_init), which
 *	  pass each event on to the three holders of per-transaction state, in a
 *	  fixed order:
 *		commit_copies.c	the copies of terminal results for the Valkey cache
 *		pending.c	the claims held: those whose ledger row is not written
 *				yet, and those taken over
 *		outbox.c	the messages emitted, by key
 *	  and, last, to ledger_guard.c, which renews the history epoch when the
 *	  transaction removed ledger rows outside idem.
 *
 *	  All three tag their state with the subtransaction nesting level that made
 *	  it and follow subtransactions by the same rule, idem_subxact_follow()
 *	  (subxact.h): what the ending subtransaction made is forgotten when it
 *	  aborts and handed to its parent when it commits.
 *
 *	  The commit hook's copies go first; at PREPARE (two-phase commit:
 *	  nothing is copied, see idem_copies_xact_event()) and at COMMIT the
 *	  claims only drop their state, at COMMIT idem_outbox_xact_event flags
 *	  the database for the publisher when messages were emitted, and at
 *	  PRE_PREPARE pending.c writes the open claims as at PRE_COMMIT.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "xact.h"
#include "ledger_guard.h"
#include "commit_copies.h"
#include "pending.h"
#include "outbox.h"

void
idem_xact_callback(XactEvent event, void *arg)
{
	idem_copies_xact_event(event);
	idem_pending_xact_event(event);
	idem_outbox_xact_event(event);
	idem_ledger_guard_xact_event(event);
}

void
idem_subxact_callback(SubXactEvent event, SubTransactionId mySubid,
					  SubTransactionId parentSubid, void *arg)
{
	bool		committed;
	int			level;

	if (event == SUBXACT_EVENT_COMMIT_SUB)
		committed = true;
	else if (event == SUBXACT_EVENT_ABORT_SUB)
		committed = false;
	else
		return;
	level = GetCurrentTransactionNestLevel();
	idem_copies_subxact_end(committed, level);
	idem_pending_subxact_end(committed, level);
	idem_outbox_subxact_end(committed, level);
}
