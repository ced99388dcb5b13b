/*-------------------------------------------------------------------------
 *
 * ledger_insert.h
 *	  The direct write of a new ledger row, the hot write (ledger_insert.c),
 *	  the cache callbacks that invalidate what it prepared, and the
 *	  executor state around one direct row write, which the outbox's
 *	  direct write (outbox_insert) uses too.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_LEDGER_INSERT_H
#define IDEM_LEDGER_INSERT_H

#include "executor/executor.h"

#include "ledger_row.h"

/*
 * One row written with ExecSimpleRelationInsert: idem_direct_begin opens
 * it (in its own executor state's memory, slot cleared), the caller fills
 * slot and inserts, idem_direct_end closes and frees it.
 */
typedef struct IdemDirectWrite
{
	EState	   *estate;
	ResultRelInfo *rri;
	TupleTableSlot *slot;
	MemoryContext old;
} IdemDirectWrite;

extern void idem_direct_begin(IdemDirectWrite *dw, Relation rel,
							  ExprState **checks);
extern void idem_direct_end(IdemDirectWrite *dw);

extern bool ledger_insert_direct(Oid relid, const LedgerKey *lk, int64 fence,
								 const uint8 *fingerprint, IdemStatus status,
								 int32 attempt, Datum outcome,
								 TimestampTz expires_at);
extern void ledger_insert_relcache_cb(Datum arg, Oid relid);
extern void ledger_insert_syscache_cb(Datum arg, int cacheid, uint32 hashvalue);

#endif							/* IDEM_LEDGER_INSERT_H */
