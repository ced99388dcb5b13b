/*-------------------------------------------------------------------------
 *
 * pending.h
 *	  The claims the running transaction holds (pending.c): what the
 *	  decisions (ledger.c) keep of a claim between idem_claim and the write
 *	  of its row, the claims taken over (whose row is written at once),
 *	  which idem_emit asks for the run a message belongs to (outbox.c), and
 *	  how they follow the transaction's ends (xact.c, by the rule of
 *	  subxact.h).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_PENDING_H
#define IDEM_PENDING_H

#include "access/xact.h"
#include "datatype/timestamp.h"

#include "cache_format.h"
#include "ledger_row.h"

typedef struct PendingClaim
{
	LedgerKey	lk;				/* hash key: must stay first */
	uint8		fingerprint[IDEM_DIGEST_LEN];
	TimestampTz lease_end;
	bool		lease_given;	/* the caller chose the lease (not idem.lease) */
	int64		fence;			/* the id its row gets (idem_claim answered it
								 * as the fence); 0: drawn when written */
	Oid			relid;
	int			nest_level;		/* subtransaction that made the claim */
	int			settled_level;	/* subtransaction that wrote its row (taken:
								 * completed or failed it); 0: not yet */
	bool		taken;			/* taken over (ledger_reclaim): its row is
								 * written; held, not pending */
} PendingClaim;

extern void idem_pending_xact_event(XactEvent event);
extern void idem_pending_subxact_end(bool committed, int level);
extern PendingClaim *pending_find(const LedgerKey *lk);
extern void pending_add(const LedgerKey *lk, const uint8 *fingerprint,
						TimestampTz lease_end, bool lease_given, Oid relid);
extern void pending_add_taken(const LedgerKey *lk, Oid relid);
extern void pending_settle(PendingClaim *claim);
extern void pending_settle_taken(const LedgerKey *lk);
extern int	pending_held(const uint8 *key, LedgerKey *found);
extern void pending_check_change(const char *what);

#endif							/* IDEM_PENDING_H */
