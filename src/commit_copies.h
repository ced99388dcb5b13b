/*-------------------------------------------------------------------------
 *
 * commit_copies.h
 *	  The commit hook's side of the copies to Valkey (commit_copies.c): the
 *	  results this transaction queues, handed to the shared queue
 *	  (commit_ring.h) once its commit record is written.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_COMMIT_COPIES_H
#define IDEM_COMMIT_COPIES_H

#include "access/xact.h"
#include "access/xlogdefs.h"
#include "datatype/timestamp.h"

#include "cache_format.h"

extern void idem_copies_add(bool is_platform, int64 tenant_id,
							const uint8 *key, IdemCacheKind kind,
							int32 attempt, const uint8 *fingerprint,
							const char *outcome, int outcome_len,
							TimestampTz expires_at);
extern void idem_copies_repopulate(bool is_platform, int64 tenant_id,
								   const uint8 *key, IdemCacheKind kind,
								   int32 attempt, const uint8 *fingerprint,
								   const char *outcome, int outcome_len,
								   TimestampTz expires_at, uint64 generation);

/* Transaction ends (xact.c), by the rule of subxact.h. */
extern void idem_copies_xact_event(XactEvent event);
extern void idem_copies_subxact_end(bool committed, int level);

/* Where the WAL inserted so far ends (also for standby_slots.c). */
extern XLogRecPtr idem_insert_end_lsn(void);

#endif							/* IDEM_COMMIT_COPIES_H */
