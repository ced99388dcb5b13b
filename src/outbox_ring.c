/*-------------------------------------------------------------------------
 *
 * outbox_ring.c
 *	  The shared-memory queue that committing backends write and the
 *	  background worker reads: a byte ring of variable-length
 *	  IdemOutboxRecords (header plus outcome, see outbox_ring.h).
 *
 * Size.  The ring accepts at most idem.queue_size records and reserves
 * IDEM_OUTBOX_BYTES_PER_RECORD bytes per record, plus room for two records
 * of the largest size, so a queue of large outcomes holds fewer records.
 * Its space is reserved and initialised by shmem.c, the one owner of idem's
 * shared memory.
 *
 * Locking rules.  No lock: committing backends, many at a time, append
 * without waiting for one another, so that one preempted while it holds
 * the queue (on a machine with fewer cores than backends) does not make
 * every other commit sleep behind it.
 *	  - head, tail and nrecords are 64-bit atomics.  A writer first counts
 *		its record in nrecords (fetch-add; over idem.queue_size it takes the
 *		count back and drops the copy), then reserves its bytes by moving
 *		head with compare-and-swap, checking the room against tail.  The
 *		head it compares was read before tail, or before others moved it
 *		and the reader consumed past it: it rereads head then, as head -
 *		tail would wrap.  The worker sleeps when head equals tail and
 *		nothing is counted in; with a copy counted in but not reserved it
 *		naps briefly, marked awake (idem_outbox_worker_sleepy).
 *	  - A reserved record becomes visible to the reader only when published:
 *		the writer copies it in, then (after a write barrier) sets its
 *		published field to its position + 1.  The reader stops at the first
 *		record not yet published, as at one whose WAL is not durable yet:
 *		records are taken in the order of their reservation.  A writer
 *		that must skip the end of the ring reserves and publishes the
 *		padding record too.  A writer that stops between reserving and
 *		publishing (preempted, or stopped) holds back every copy behind it
 *		until it goes on, and the ring fills meanwhile: counted in
 *		idem_stats().queue_stalls when it lasts over a second.
 *	  - There is exactly one reader.  It reads records in place between
 *		tail and the head it saw; writers only write beyond head, so that
 *		span cannot change under it.  It moves tail only once Valkey has
 *		acknowledged the records, so they survive a Valkey outage while the
 *		queue has room, and it zeroes the span it gives back before moving
 *		tail, so that the bytes a writer reserves never hold a stale
 *		published mark (positions only grow; a mark is its position + 1,
 *		never 0).
 *	  - capacity and max_records are set once at startup and read freely.
 *	  - worker_procno and worker_awake are atomics too (see
 *		idem_outbox_worker_sleepy for the handshake).
 *	  - The writers' side runs after the commit record is written: nothing
 *		here allocates, raises an error or waits (but for a test's injection
 *		point, in builds that have them).  A full queue drops the copy and
 *		counts it.
 *
 * Shared memory holds no process-local pointers: the worker is found by its
 * PGPROC number.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "miscadmin.h"
#include "port/atomics.h"
#include "storage/latch.h"
#include "storage/proc.h"
#include "storage/shmem.h"
#include "utils/timestamp.h"

#include "outbox_ring.h"
#include "cache_format.h"
#include "compat.h"
#include "guc.h"
#include "stats.h"

/*
 * A record's header (everything before the outcome) is 120 bytes; the ring
 * reserves IDEM_OUTBOX_BYTES_PER_RECORD (256) bytes per queued record on
 * average, header and a typical outcome.
 */
StaticAssertDecl(offsetof(IdemOutboxRecord, outcome) == 120,
				 "the header size stated above and in docs/commit-ring.md");
StaticAssertDecl(IDEM_OUTBOX_BYTES_PER_RECORD == 256,
				 "the size stated above, in idem.queue_size's description and in the README");
#define IDEM_OUTBOX_RECORD_MAX	IDEM_OUTBOX_RECORD_SIZE(IDEM_OUTCOME_MAX)
#define IDEM_OUTBOX_NO_WORKER	PG_UINT32_MAX

/*
 * The oldest record reserved but still unwritten this long holds back every
 * copy behind it: count it (idem_stats().queue_stalls), once per record.
 */
#define IDEM_OUTBOX_STALL_MS	1000

typedef struct IdemOutboxShared
{
	/* Byte positions in the ring; they only grow. */
	pg_atomic_uint64 head;		/* reserved up to here (writers) */
	pg_atomic_uint64 tail;		/* the oldest record not yet copied (reader) */
	pg_atomic_uint64 nrecords;	/* records (not padding) counted in, not yet
								 * consumed */
	/* Set once at startup. */
	uint64		capacity;		/* bytes in the ring, a MAXALIGN multiple */
	uint64		max_records;	/* idem.queue_size */
	/* The worker's PGPROC number, or IDEM_OUTBOX_NO_WORKER. */
	pg_atomic_uint32 worker_procno;
	/* 0 only while the worker sleeps waiting for work: wake it then. */
	pg_atomic_uint32 worker_awake;
} IdemOutboxShared;

#define IDEM_OUTBOX_RING(shared) \
	((char *) (shared) + MAXALIGN(sizeof(IdemOutboxShared)))

static IdemOutboxShared *outbox = NULL;

/*
 * Records are MAXALIGNed, so as little as MAXIMUM_ALIGNOF bytes can be left
 * at the ring's end, where a padding record then starts; its header fields
 * (published, size, kind) run past the ring by up to this much, which is
 * allocated after it.
 */
#define IDEM_OUTBOX_PAD_SLACK \
	MAXALIGN(offsetof(IdemOutboxRecord, kind) + sizeof(char))

static Size
outbox_ring_capacity(void)
{
	return mul_size(idem_queue_size, IDEM_OUTBOX_BYTES_PER_RECORD) +
		2 * IDEM_OUTBOX_RECORD_MAX;
}

Size
idem_outbox_ring_shmem_size(void)
{
	return add_size(add_size(MAXALIGN(sizeof(IdemOutboxShared)),
							 outbox_ring_capacity()),
					IDEM_OUTBOX_PAD_SLACK);
}

/* Called from shmem.c's startup hook, with AddinShmemInitLock held. */
void
idem_outbox_ring_shmem_init(void)
{
	bool		found;

	outbox = ShmemInitStruct("idem commit ring", idem_outbox_ring_shmem_size(),
							 &found);
	if (!found)
	{
		pg_atomic_init_u64(&outbox->head, 0);
		pg_atomic_init_u64(&outbox->tail, 0);
		pg_atomic_init_u64(&outbox->nrecords, 0);
		outbox->capacity = outbox_ring_capacity();
		outbox->max_records = idem_queue_size;
		pg_atomic_init_u32(&outbox->worker_procno, IDEM_OUTBOX_NO_WORKER);
		pg_atomic_init_u32(&outbox->worker_awake, 0);
		/* no published mark anywhere */
		memset(IDEM_OUTBOX_RING(outbox), 0,
			   outbox->capacity + IDEM_OUTBOX_PAD_SLACK);
	}
}

/*
 * Whether one commit's nrecords copies of bytes in all could ever go into
 * the ring (read without the lock: both limits are set once at startup).
 */
bool
idem_outbox_ring_fits(uint64 nrecords, uint64 bytes)
{
	return nrecords <= outbox->max_records && bytes <= outbox->capacity;
}

/* Whether the ring exists (idem is in shared_preload_libraries). */
bool
idem_outbox_available(void)
{
	return outbox != NULL;
}

/*
 * Make a record written into the ring (all but its published field)
 * visible to the reader as the record at position pos.
 */
static inline void
outbox_ring_publish(IdemOutboxRecord *r, uint64 pos)
{
	pg_write_barrier();
	r->published = pos + 1;
}

/*
 * Read a reserved record's first and last bytes before writing it.  A
 * backend faults on each ring page it has not touched yet, and with many
 * backends taking turns that is about one fault per record.  The kernel
 * maps a page written to alone, but a page read together with its resident
 * neighbours (fault-around: 64 kB by default), so reading first leaves one
 * fault per 64 kB of the ring a backend crosses.  Harmless where the page
 * is mapped already: the cache line is about to be written anyway.
 */
static inline void
outbox_ring_touch(const char *p, uint32 size)
{
	(void) *(volatile const char *) p;
	(void) *(volatile const char *) (p + size - 1);
}

/*
 * Append one record to the ring: count it, reserve its bytes (and a
 * padding record's, to skip the end of the ring), copy it in, publish it.
 * Returns false, changing nothing, when the queue is full.  No allocation,
 * no error, no wait: this runs after the commit record.
 */
static bool
outbox_ring_append(const IdemOutboxRecord *rec)
{
	char	   *ring = IDEM_OUTBOX_RING(outbox);
	uint64		head;
	uint64		off;
	uint64		pad;
	IdemOutboxRecord *r;

	if (pg_atomic_fetch_add_u64(&outbox->nrecords, 1) >= outbox->max_records)
	{
		pg_atomic_fetch_sub_u64(&outbox->nrecords, 1);
		return false;
	}
	head = pg_atomic_read_u64(&outbox->head);

	/*
	 * Counted, not reserved: a test may hold this writer here, as a
	 * preemption would, while others commit and the reader consumes past
	 * the head read above.
	 */
	IDEM_INJECTION_POINT("idem-outbox-counted");

	for (;;)
	{
		uint64		tail = pg_atomic_read_u64(&outbox->tail);
		uint64		contiguous;

		/*
		 * The head read before (or returned by a failed compare-and-swap)
		 * may be older than tail: others reserved and the reader consumed
		 * past it meanwhile, and head - tail would wrap.  head read after
		 * tail is not older than it (tail never passes head).
		 */
		if (unlikely(head < tail))
		{
			pg_read_barrier();
			head = pg_atomic_read_u64(&outbox->head);
			Assert(head >= tail);
		}
		off = head % outbox->capacity;
		contiguous = outbox->capacity - off;
		pad = (rec->size > contiguous) ? contiguous : 0;
		if (head + pad + rec->size - tail > outbox->capacity)
		{
			pg_atomic_fetch_sub_u64(&outbox->nrecords, 1);
			return false;
		}
		/* on failure, head is the value another writer moved it to */
		if (pg_atomic_compare_exchange_u64(&outbox->head, &head,
										   head + pad + rec->size))
			break;
	}

	/*
	 * Reserved, not written: a test may hold this writer here (as a
	 * preemption would) to check that the reader waits for it.
	 */
	IDEM_INJECTION_POINT("idem-outbox-reserved");

	if (pad > 0)
	{
		/* Skip the end of the ring: a padding record (kind 0). */
		IdemOutboxRecord *p = (IdemOutboxRecord *) (ring + off);

		/* its header may run into IDEM_OUTBOX_PAD_SLACK */
		Assert(pad % MAXIMUM_ALIGNOF == 0 && pad >= MAXIMUM_ALIGNOF);
		p->size = (uint32) pad;
		p->kind = 0;
		outbox_ring_publish(p, head);
		head += pad;
		off = 0;
	}
	r = (IdemOutboxRecord *) (ring + off);
	outbox_ring_touch((const char *) r, rec->size);
	memcpy((char *) r + sizeof(r->published), (const char *) rec + sizeof(rec->published),
		   rec->size - sizeof(rec->published));
	outbox_ring_publish(r, head);
	return true;
}

/*
 * Called after the records are counted in (an atomic fetch-add: a full
 * barrier) and published.  A worker that is awake looks at the queue again before
 * it sleeps (see idem_outbox_worker_sleepy), so only a sleeping one needs
 * the latch: a busy worker costs commits no system call.
 */
static void
outbox_wake_worker(void)
{
	uint32		procno;

	if (pg_atomic_read_u32(&outbox->worker_awake) != 0)
		return;
	procno = pg_atomic_read_u32(&outbox->worker_procno);
	/* A stale number only costs another process a spurious wakeup. */
	if (procno != IDEM_OUTBOX_NO_WORKER)
		SetLatch(&GetPGProcByNumber(procno)->procLatch);
}

/*
 * Wake the worker for something other than a copy (a new history epoch to
 * take over, ledger_guard.c).  Safe after a commit record.
 */
void
idem_outbox_wake(void)
{
	if (outbox != NULL)
		outbox_wake_worker();
}

/*
 * At XACT_EVENT_COMMIT: move a transaction's copies (a List of
 * IdemOutboxRecord *) into the ring, count them and wake the worker.
 * Safe after the commit record: no allocation, no error.
 */
void
idem_outbox_ring_put(List *records)
{
	ListCell   *lc;
	uint64		accepted = 0;
	uint64		dropped = 0;

	if (outbox == NULL || records == NIL)
		return;

	foreach(lc, records)
	{
		if (outbox_ring_append((IdemOutboxRecord *) lfirst(lc)))
			accepted++;
		else
			dropped++;
	}

	idem_stats_add(IDEM_STAT_QUEUED, accepted);
	idem_stats_add(IDEM_STAT_DROPPED, dropped);
	if (accepted > 0)
		outbox_wake_worker();
}

/*
 * Put one record into the ring now, unless the queue is more than half full
 * (so that repopulating reads cannot crowd out the copies of new commits);
 * count it and wake the worker.  Returns whether it was queued.
 */
bool
idem_outbox_ring_offer(const IdemOutboxRecord *rec)
{
	bool		accepted = false;

	if (outbox == NULL)
		return false;
	if (pg_atomic_read_u64(&outbox->nrecords) < outbox->max_records / 2)
		accepted = outbox_ring_append(rec);
	if (accepted)
	{
		idem_stats_add(IDEM_STAT_QUEUED, 1);
		outbox_wake_worker();
	}
	return accepted;
}

/*
 * The worker's side.  There is exactly one reader, so the span between the
 * read position and the write position it saw cannot change under it.
 */
void
idem_outbox_attach_worker(void)
{
	pg_atomic_write_u32(&outbox->worker_procno, IDEM_MY_PROCNO);
	/* Until its first sleep, commits need not wake it. */
	pg_atomic_write_u32(&outbox->worker_awake, 1);
}

void
idem_outbox_detach_worker(void)
{
	if (outbox != NULL)
		pg_atomic_write_u32(&outbox->worker_procno, IDEM_OUTBOX_NO_WORKER);
}

/* The worker is at work: committing backends need not set its latch. */
void
idem_outbox_worker_awake(void)
{
	pg_atomic_write_u32(&outbox->worker_awake, 1);
}

/*
 * The worker is about to sleep: from now on committing backends set its
 * latch.  Returns whether the queue is empty, read after the flag is
 * cleared and a barrier, so that a commit either sees the flag cleared
 * (and wakes the worker) or its record is seen here (and the worker does
 * not sleep).  When false, the worker has been marked awake again.  Also
 * false, with *coming set, when nothing is reserved but a copy is counted
 * in (its committer is between the two): the worker, marked awake, naps
 * briefly and looks again, so that the committer need not set its latch
 * and the worker does not spin.
 */
bool
idem_outbox_worker_sleepy(bool *coming)
{
	uint64		tail;

	pg_atomic_write_u32(&outbox->worker_awake, 0);
	pg_memory_barrier();

	/*
	 * Empty means nothing reserved and not consumed, not nrecords: a writer
	 * counts its record in before it reserves it, and one held in between
	 * (preempted) would keep the worker from sleeping while there is
	 * nothing it can read.  Such a writer sets the latch once it has
	 * reserved and published (its compare-and-swap on head is a full
	 * barrier before it reads worker_awake).
	 */
	*coming = false;
	tail = pg_atomic_read_u64(&outbox->tail);
	pg_read_barrier();
	if (pg_atomic_read_u64(&outbox->head) == tail)
	{
		if (idem_outbox_depth() == 0)
			return true;
		*coming = true;
	}
	idem_outbox_worker_awake();
	return false;
}

/*
 * The reader found the record at pos reserved but not written.  One that
 * stays so over IDEM_OUTBOX_STALL_MS is counted, once: its writer stopped
 * between its commit record and its copy (preempted, or stopped by a
 * debugger or SIGSTOP), and every copy behind it waits, so the queue
 * fills and drops new copies until it goes on.  The reader cannot skip it:
 * the writer will still write those bytes.  Worker-local state.
 */
static void
outbox_note_unwritten(uint64 pos)
{
	static uint64 stall_mark = 0;	/* pos + 1 of the record watched */
	static TimestampTz stall_since = 0;
	static bool stall_counted = false;
	TimestampTz now = GetCurrentTimestamp();

	if (stall_mark != pos + 1)
	{
		stall_mark = pos + 1;
		stall_since = now;
		stall_counted = false;
	}
	else if (!stall_counted &&
			 TimestampDifferenceExceeds(stall_since, now, IDEM_OUTBOX_STALL_MS))
	{
		idem_stats_add(IDEM_STAT_QUEUE_STALLS, 1);
		stall_counted = true;
	}
}

/*
 * Point records[] at up to max queued records from *pos on (or from the
 * oldest, if *pos is older than that), without removing them, and move *pos
 * past them (and past any padding).  The worker may peek further while
 * earlier records are still being written, and passes a position it was
 * given to idem_outbox_consume() once everything before it is written.
 * Stops before the first record whose WAL position is beyond durable, and
 * then sets *held (records stay in order: one not durable yet holds back
 * those behind it, which become durable at about the same time); if that
 * record is a read's copy (may_flush), *flush_to is its WAL position, which
 * the worker may flush itself, else InvalidXLogRecPtr.
 */
int
idem_outbox_peek(uint64 *pos, const IdemOutboxRecord **records, int max,
				 XLogRecPtr durable, bool *held, XLogRecPtr *flush_to)
{
	const char *ring = IDEM_OUTBOX_RING(outbox);
	uint64		p;
	uint64		head;
	int			n = 0;

	p = Max(*pos, pg_atomic_read_u64(&outbox->tail));
	head = pg_atomic_read_u64(&outbox->head);

	*held = false;
	*flush_to = InvalidXLogRecPtr;
	while (p < head && n < max)
	{
		const IdemOutboxRecord *rec =
			(const IdemOutboxRecord *) (ring + p % outbox->capacity);

		if (*(volatile const uint64 *) &rec->published != p + 1)
		{
			/* reserved, still being written: look again shortly */
			*held = true;
			outbox_note_unwritten(p);
			break;
		}
		pg_read_barrier();
		if (rec->kind != 0)
		{
			if (rec->lsn > durable)
			{
				*held = true;
				if (rec->may_flush)
					*flush_to = rec->lsn;
				break;
			}
			records[n++] = rec;
		}
		p += rec->size;
	}
	*pos = p;
	return n;
}

/*
 * Give back the records before next_pos (nrecords of them, padding not
 * counted): zero their bytes, so that no stale published mark is left
 * where a writer reserves next, then move tail.
 */
void
idem_outbox_consume(uint64 next_pos, int nrecords)
{
	char	   *ring = IDEM_OUTBOX_RING(outbox);
	uint64		tail = pg_atomic_read_u64(&outbox->tail);

	Assert(next_pos >= tail && next_pos <= pg_atomic_read_u64(&outbox->head));
	while (tail < next_pos)
	{
		uint64		off = tail % outbox->capacity;
		uint64		len = Min(next_pos - tail, outbox->capacity - off);

		memset(ring + off, 0, len);
		tail += len;
	}
	pg_write_barrier();
	pg_atomic_write_u64(&outbox->tail, next_pos);
	if (nrecords > 0)
		pg_atomic_fetch_sub_u64(&outbox->nrecords, nrecords);
}

/* Records counted in and not consumed yet (some may still be written). */
uint64
idem_outbox_depth(void)
{
	if (outbox == NULL)
		return 0;
	return pg_atomic_read_u64(&outbox->nrecords);
}
