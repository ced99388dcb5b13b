/*-------------------------------------------------------------------------
 *
 * ledger_guard.h
 *	  Ledger rows removed outside idem: a new history epoch at commit
 *	  (ledger_guard.c); idem's own statements are let through between
 *	  ledger_guard_own_begin and _end.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_LEDGER_GUARD_H
#define IDEM_LEDGER_GUARD_H

#include "access/xact.h"

extern void idem_ledger_guard_register(void);
extern void idem_ledger_guard_xact_event(XactEvent event);
extern void ledger_guard_own_begin(void);
extern void ledger_guard_own_end(void);
extern Oid	idem_extension_schema(void);
extern bool idem_ledger_guard_is_ledger(Oid relid, bool *shard);

#endif							/* IDEM_LEDGER_GUARD_H */
