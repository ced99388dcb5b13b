/*-------------------------------------------------------------------------
 *
 * commit_ring.h
 *	  The shared-memory queue between committing backends and the worker:
 *	  the record format and both sides' functions.  See commit_ring.c for
 *	  the layout and its locking rules.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_COMMIT_RING_H
#define IDEM_COMMIT_RING_H

#include "access/xlogdefs.h"
#include "datatype/timestamp.h"
#include "nodes/pg_list.h"

#include "cache_format.h"

/*
 * One queued copy as it sits in the shared queue.  Records are variable
 * length (the header plus the outcome, MAXALIGNed); kind 0 marks the padding
 * that skips the end of the ring.  Only the worker reads them.
 */
typedef struct IdemRingRecord
{
	uint64		published;		/* in the ring: its position + 1 once it is
								 * written (commit_ring.c); unused elsewhere */
	uint32		size;			/* bytes this record occupies in the ring */
	uint16		outcome_len;
	char		kind;			/* IdemCacheKind, or 0 for padding */
	bool		is_platform;
	bool		may_flush;		/* a read's copy: the worker may flush WAL
								 * up to lsn itself (see commit_copies.c) */
	int32		attempt;
	Oid			dboid;			/* the database: part of the Valkey keyspace */
	uint32		queued_ms;		/* in the ring: when it was queued, in
								 * milliseconds modulo 2^32, never 0
								 * (idem_ring_oldest_age) */
	int64		tenant_id;
	TimestampTz expires_at;
	XLogRecPtr	lsn;			/* copy once WAL is durable up to here */
	uint64		generation;		/* the renewal generation it was read
								 * under: never written into a newer
								 * epoch (epoch_renewal.c) */
	uint8		key[IDEM_DIGEST_LEN];
	uint8		fingerprint[IDEM_DIGEST_LEN];
	char		outcome[FLEXIBLE_ARRAY_MEMBER];
} IdemRingRecord;

#define IDEM_RING_RECORD_SIZE(outcome_len) \
	MAXALIGN(offsetof(IdemRingRecord, outcome) + (outcome_len))

/* Shared memory (shmem.c). */
extern Size idem_ring_shmem_size(void);
extern void idem_ring_shmem_init(void);

/* The writers' side: committing backends. */
extern bool idem_ring_available(void);
extern void idem_ring_put(List *records);
extern bool idem_ring_offer(const IdemRingRecord *rec);
extern void idem_ring_wake(void);
extern bool idem_ring_fits(uint64 nrecords, uint64 bytes);

/* The worker's side of the queue (single consumer). */
extern void idem_ring_attach_worker(void);
extern void idem_ring_detach_worker(void);
extern void idem_ring_worker_awake(void);
extern bool idem_ring_worker_sleepy(bool *coming);
extern int	idem_ring_peek(uint64 *pos, const IdemRingRecord **records,
							 int max, XLogRecPtr durable, bool *held,
							 XLogRecPtr *flush_to);
extern void idem_ring_consume(uint64 next_pos, int nrecords);
extern uint64 idem_ring_depth(void);
extern bool idem_ring_oldest_age(int64 *age_ms);

#endif							/* IDEM_COMMIT_RING_H */
