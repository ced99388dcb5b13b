/*-------------------------------------------------------------------------
 *
 * pending.h
 *	  Claims of the running transaction whose row is not written yet
 *	  (pending.c): what the decisions (ledger.c) keep of a claim between
 *	  idem_claim and the write of its row, and how they follow the
 *	  transaction's ends (xact.c, by the rule of subxact.h).
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
	int			settled_level;	/* subtransaction that wrote its row; 0: not yet */
} PendingClaim;

extern void idem_pending_xact_event(XactEvent event);
extern void idem_pending_subxact_end(bool committed, int level);
extern PendingClaim *pending_find(const LedgerKey *lk);
extern void pending_add(const LedgerKey *lk, const uint8 *fingerprint,
						TimestampTz lease_end, bool lease_given, Oid relid);
extern void pending_settle(PendingClaim *claim);
extern void pending_check_change(const char *what);

#endif							/* IDEM_PENDING_H */
