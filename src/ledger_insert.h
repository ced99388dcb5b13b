/*-------------------------------------------------------------------------
 *
 * ledger_insert.h
 *	  The direct write of a new ledger row, the hot write (ledger_insert.c),
 *	  and the cache callbacks that invalidate what it prepared.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_LEDGER_INSERT_H
#define IDEM_LEDGER_INSERT_H

#include "ledger_row.h"

extern bool ledger_insert_direct(Oid relid, const LedgerKey *lk, int64 fence,
								 const uint8 *fingerprint, IdemStatus status,
								 int32 attempt, Datum outcome,
								 TimestampTz expires_at);
extern void ledger_insert_relcache_cb(Datum arg, Oid relid);
extern void ledger_insert_syscache_cb(Datum arg, int cacheid, uint32 hashvalue);

#endif							/* IDEM_LEDGER_INSERT_H */
