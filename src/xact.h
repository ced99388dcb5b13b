/*-------------------------------------------------------------------------
 *
 * xact.h
 *	  The transaction and subtransaction callbacks (xact.c), which _PG_init
 *	  registers: they hand each event to the files that keep
 *	  per-transaction state, by the rule of subxact.h.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_XACT_H
#define IDEM_XACT_H

#include "access/xact.h"

extern void idem_xact_callback(XactEvent event, void *arg);
extern void idem_subxact_callback(SubXactEvent event, SubTransactionId mySubid,
								  SubTransactionId parentSubid, void *arg);

#endif							/* IDEM_XACT_H */
