/*-------------------------------------------------------------------------
 *
 * commit_ring.c
 *	  The shared-memory queue that committing backends write and the
 *	  background worker reads: a byte ring of variable-length
 *	  IdemRingRecords (header plus outcome, see commit_ring.h).
 *
 * Size.  The ring accepts at most idem.queue_size records and reserves
 * IDEM_RING_BYTES_PER_RECORD bytes per record, plus room for two records
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
 *		tail would wrap.  The worker sleeps when head equals tail, also
 *		while a copy is counted in but not reserved yet (then for a
 *		bounded nap): its writer wakes it once the copy is published, as
 *		any other writer does (idem_ring_worker_sleepy).
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
 *		idem_ring_worker_sleepy for the handshake).
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

#include "access/xact.h"
#include "miscadmin.h"
#include "port/atomics.h"
#include "storage/latch.h"
#include "storage/proc.h"
#include "storage/shmem.h"
#include "utils/timestamp.h"

#include "commit_ring.h"
#include "cache_format.h"
#include "compat.h"
#include "guc.h"
#include "stats.h"

/*
 * A record's header (everything before the outcome) is 128 bytes; the ring
 * reserves IDEM_RING_BYTES_PER_RECORD (256) bytes per queued record on
 * average, header and a typical outcome.
 */
StaticAssertDecl(offsetof(IdemRingRecord, outcome) == 128,
				 "the header size stated above and in docs/commit-ring.md");
StaticAssertDecl(IDEM_RING_BYTES_PER_RECORD == 256,
				 "the size stated above, in idem.queue_size's description and in the README");
#define IDEM_RING_RECORD_MAX	IDEM_RING_RECORD_SIZE(IDEM_OUTCOME_MAX)
#define IDEM_RING_NO_WORKER	PG_UINT32_MAX

/*
 * The oldest record reserved but still unwritten this long holds back every
 * copy behind it: count it (idem_stats().queue_stalls), once per record.
 */
#define IDEM_RING_STALL_MS	1000

typedef struct IdemRingShared
{
	/* Byte positions in the ring; they only grow. */
	pg_atomic_uint64 head;		/* reserved up to here (writers) */
	pg_atomic_uint64 tail;		/* the oldest record not yet copied (reader) */
	pg_atomic_uint64 nrecords;	/* records (not padding) counted in, not yet
								 * consumed */
	/* Set once at startup. */
	uint64		capacity;		/* bytes in the ring, a MAXALIGN multiple */
	uint64		max_records;	/* idem.queue_size */
	/* The worker's PGPROC number, or IDEM_RING_NO_WORKER. */
	pg_atomic_uint32 worker_procno;
	/* 0 only while the worker sleeps waiting for work: wake it then. */
	pg_atomic_uint32 worker_awake;
} IdemRingShared;

#define IDEM_RING_BYTES(shared) \
	((char *) (shared) + MAXALIGN(sizeof(IdemRingShared)))

static IdemRingShared *commit_ring = NULL;

/*
 * Records are MAXALIGNed, so as little as MAXIMUM_ALIGNOF bytes can be left
 * at the ring's end, where a padding record then starts; its header fields
 * (published, size, kind) run past the ring by up to this much, which is
 * allocated after it.
 */
#define IDEM_RING_PAD_SLACK \
	MAXALIGN(offsetof(IdemRingRecord, kind) + sizeof(char))

static Size
ring_capacity(void)
{
	return mul_size(idem_queue_size, IDEM_RING_BYTES_PER_RECORD) +
		2 * IDEM_RING_RECORD_MAX;
}

Size
idem_ring_shmem_size(void)
{
	return add_size(add_size(MAXALIGN(sizeof(IdemRingShared)),
							 ring_capacity()),
					IDEM_RING_PAD_SLACK);
}

/* Called from shmem.c's startup hook, with AddinShmemInitLock held. */
void
idem_ring_shmem_init(void)
{
	bool		found;

	commit_ring = ShmemInitStruct("idem commit ring", idem_ring_shmem_size(),
							 &found);
	if (!found)
	{
		pg_atomic_init_u64(&commit_ring->head, 0);
		pg_atomic_init_u64(&commit_ring->tail, 0);
		pg_atomic_init_u64(&commit_ring->nrecords, 0);
		commit_ring->capacity = ring_capacity();
		commit_ring->max_records = idem_queue_size;
		pg_atomic_init_u32(&commit_ring->worker_procno, IDEM_RING_NO_WORKER);
		pg_atomic_init_u32(&commit_ring->worker_awake, 0);
		/* no published mark anywhere */
		memset(IDEM_RING_BYTES(commit_ring), 0,
			   commit_ring->capacity + IDEM_RING_PAD_SLACK);
	}
}

/*
 * Whether one commit's nrecords copies of bytes in all could ever go into
 * the ring (read without the lock: both limits are set once at startup).
 */
bool
idem_ring_fits(uint64 nrecords, uint64 bytes)
{
	return nrecords <= commit_ring->max_records && bytes <= commit_ring->capacity;
}

/* Whether the ring exists (idem is in shared_preload_libraries). */
bool
idem_ring_available(void)
{
	return commit_ring != NULL;
}

/*
 * Make a record written into the ring (all but its published field)
 * visible to the reader as the record at position pos.
 */
static inline void
ring_publish(IdemRingRecord *r, uint64 pos)
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
ring_touch(const char *p, uint32 size)
{
	(void) *(volatile const char *) p;
	(void) *(volatile const char *) (p + size - 1);
}

/*
 * A time as a record's queued_ms: milliseconds modulo 2^32 (49 days), never
 * 0, which marks a record whose bytes were zeroed under a reader.
 */
static inline uint32
ring_ms(TimestampTz t)
{
	uint32		ms = (uint32) ((uint64) t / 1000);

	return ms == 0 ? 1 : ms;
}

/*
 * Append one record to the ring: count it, reserve its bytes (and a
 * padding record's, to skip the end of the ring), copy it in with
 * queued_ms, publish it.  Returns false, changing nothing, when the queue
 * is full.  No allocation, no error, no wait: this runs after the commit
 * record.
 */
static bool
ring_append(const IdemRingRecord *rec, uint32 queued_ms)
{
	char	   *ring = IDEM_RING_BYTES(commit_ring);
	uint64		head;
	uint64		off;
	uint64		pad;
	IdemRingRecord *r;

	if (pg_atomic_fetch_add_u64(&commit_ring->nrecords, 1) >= commit_ring->max_records)
	{
		pg_atomic_fetch_sub_u64(&commit_ring->nrecords, 1);
		return false;
	}
	head = pg_atomic_read_u64(&commit_ring->head);

	/*
	 * Counted, not reserved: a test may hold this writer here, as a
	 * preemption would, while others commit and the reader consumes past
	 * the head read above.
	 */
	IDEM_INJECTION_POINT("idem-ring-counted");

	for (;;)
	{
		uint64		tail = pg_atomic_read_u64(&commit_ring->tail);
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
			head = pg_atomic_read_u64(&commit_ring->head);
			Assert(head >= tail);
		}
		off = head % commit_ring->capacity;
		contiguous = commit_ring->capacity - off;
		pad = (rec->size > contiguous) ? contiguous : 0;
		if (head + pad + rec->size - tail > commit_ring->capacity)
		{
			pg_atomic_fetch_sub_u64(&commit_ring->nrecords, 1);
			return false;
		}
		/* on failure, head is the value another writer moved it to */
		if (pg_atomic_compare_exchange_u64(&commit_ring->head, &head,
										   head + pad + rec->size))
			break;
	}

	/*
	 * Reserved, not written: a test may hold this writer here (as a
	 * preemption would) to check that the reader waits for it.
	 */
	IDEM_INJECTION_POINT("idem-ring-reserved");

	if (pad > 0)
	{
		/* Skip the end of the ring: a padding record (kind 0). */
		IdemRingRecord *p = (IdemRingRecord *) (ring + off);

		/* its header may run into IDEM_RING_PAD_SLACK */
		Assert(pad % MAXIMUM_ALIGNOF == 0 && pad >= MAXIMUM_ALIGNOF);
		p->size = (uint32) pad;
		p->kind = 0;
		ring_publish(p, head);
		head += pad;
		off = 0;
	}
	r = (IdemRingRecord *) (ring + off);
	ring_touch((const char *) r, rec->size);
	memcpy((char *) r + sizeof(r->published), (const char *) rec + sizeof(rec->published),
		   rec->size - sizeof(rec->published));
	r->queued_ms = queued_ms;
	ring_publish(r, head);
	return true;
}

/*
 * Called after the records are counted in (an atomic fetch-add: a full
 * barrier) and published.  A worker that is awake looks at the queue again before
 * it sleeps (see idem_ring_worker_sleepy), so only a sleeping one needs
 * the latch: a busy worker costs commits no system call.
 */
static void
ring_wake_worker(void)
{
	uint32		procno;

	if (pg_atomic_read_u32(&commit_ring->worker_awake) != 0)
		return;
	procno = pg_atomic_read_u32(&commit_ring->worker_procno);
	/* A stale number only costs another process a spurious wakeup. */
	if (procno != IDEM_RING_NO_WORKER)
		SetLatch(&GetPGProcByNumber(procno)->procLatch);
}

/*
 * Wake the worker for something other than a copy (a new history epoch to
 * take over, ledger_guard.c).  Safe after a commit record.
 */
void
idem_ring_wake(void)
{
	if (commit_ring != NULL)
		ring_wake_worker();
}

/*
 * At XACT_EVENT_COMMIT: move a transaction's copies (a List of
 * IdemRingRecord *) into the ring, stamped with the commit's time, count
 * them (each in queued, and the ones the ring has no room for in dropped
 * too) and wake the worker.  Safe after the commit record: no allocation,
 * no error.
 */
void
idem_ring_put(List *records)
{
	ListCell   *lc;
	uint64		accepted = 0;
	uint64		dropped = 0;
	uint32		queued_ms;

	if (commit_ring == NULL || records == NIL)
		return;

	/* the commit record's time, taken when it was written */
	queued_ms = ring_ms(GetCurrentTransactionStopTimestamp());
	/* counted before they enter the ring: queued is never behind depth */
	idem_stats_add(IDEM_STAT_QUEUED, list_length(records));
	foreach(lc, records)
	{
		if (ring_append((IdemRingRecord *) lfirst(lc), queued_ms))
			accepted++;
		else
			dropped++;
	}

	idem_stats_add(IDEM_STAT_DROPPED, dropped);
	if (accepted > 0)
		ring_wake_worker();
}

/*
 * Put one record into the ring now, unless the queue is more than half full
 * (so that repopulating reads cannot crowd out the copies of new commits);
 * count it and wake the worker.  Returns whether it was queued.  An offer
 * refused for the half-full ring is not counted at all (no copy is owed);
 * one that passes that check counts as a commit's copy does.
 */
bool
idem_ring_offer(const IdemRingRecord *rec)
{
	bool		accepted = false;

	if (commit_ring == NULL)
		return false;
	if (pg_atomic_read_u64(&commit_ring->nrecords) < commit_ring->max_records / 2)
	{
		idem_stats_add(IDEM_STAT_QUEUED, 1);
		accepted = ring_append(rec, ring_ms(GetCurrentTimestamp()));
		if (!accepted)
			idem_stats_add(IDEM_STAT_DROPPED, 1);	/* no room for its bytes */
	}
	if (accepted)
		ring_wake_worker();
	return accepted;
}

/*
 * The worker's side.  There is exactly one reader, so the span between the
 * read position and the write position it saw cannot change under it.
 */
void
idem_ring_attach_worker(void)
{
	pg_atomic_write_u32(&commit_ring->worker_procno, IDEM_MY_PROCNO);
	/* Until its first sleep, commits need not wake it. */
	pg_atomic_write_u32(&commit_ring->worker_awake, 1);
}

void
idem_ring_detach_worker(void)
{
	if (commit_ring != NULL)
		pg_atomic_write_u32(&commit_ring->worker_procno, IDEM_RING_NO_WORKER);
}

/* The worker is at work: committing backends need not set its latch. */
void
idem_ring_worker_awake(void)
{
	pg_atomic_write_u32(&commit_ring->worker_awake, 1);
}

/*
 * The worker is about to sleep: from now on committing backends set its
 * latch.  Returns whether the queue is empty, read after the flag is
 * cleared and a barrier, so that a commit either sees the flag cleared
 * (and wakes the worker) or its record is seen here (and the worker does
 * not sleep).  When false, the worker has been marked awake again.  Also
 * true, with *coming set, when nothing is reserved but a copy is counted
 * in (its committer is between the two): the worker sleeps, still
 * wakeable, for a bounded nap.  That committer, like every other, sets
 * the latch once it has published (it reads the flag after its
 * compare-and-swap on head), and so do the commits that pass it
 * meanwhile: a worker napping marked awake would leave all of them
 * waiting for the nap's end.
 */
bool
idem_ring_worker_sleepy(bool *coming)
{
	uint64		tail;

	pg_atomic_write_u32(&commit_ring->worker_awake, 0);
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
	tail = pg_atomic_read_u64(&commit_ring->tail);
	pg_read_barrier();
	if (pg_atomic_read_u64(&commit_ring->head) == tail)
	{
		*coming = idem_ring_depth() != 0;
		return true;
	}
	idem_ring_worker_awake();
	return false;
}

/*
 * The reader found the record at pos reserved but not written.  One that
 * stays so over IDEM_RING_STALL_MS is counted, once: its writer stopped
 * between its commit record and its copy (preempted, or stopped by a
 * debugger or SIGSTOP), and every copy behind it waits, so the queue
 * fills and drops new copies until it goes on.  The reader cannot skip it:
 * the writer will still write those bytes.  Worker-local state.
 */
static void
copies_note_unwritten(uint64 pos)
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
			 TimestampDifferenceExceeds(stall_since, now, IDEM_RING_STALL_MS))
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
 * given to idem_ring_consume() once everything before it is written.
 * Stops before the first record whose WAL position is beyond durable, and
 * then sets *held (records stay in order: one not durable yet holds back
 * those behind it, which become durable at about the same time); if that
 * record is a read's copy (may_flush), *flush_to is its WAL position, which
 * the worker may flush itself, else InvalidXLogRecPtr.
 */
int
idem_ring_peek(uint64 *pos, const IdemRingRecord **records, int max,
				 XLogRecPtr durable, bool *held, XLogRecPtr *flush_to)
{
	const char *ring = IDEM_RING_BYTES(commit_ring);
	uint64		p;
	uint64		head;
	int			n = 0;

	p = Max(*pos, pg_atomic_read_u64(&commit_ring->tail));
	head = pg_atomic_read_u64(&commit_ring->head);

	*held = false;
	*flush_to = InvalidXLogRecPtr;
	while (p < head && n < max)
	{
		const IdemRingRecord *rec =
			(const IdemRingRecord *) (ring + p % commit_ring->capacity);

		if (*(volatile const uint64 *) &rec->published != p + 1)
		{
			/* reserved, still being written: look again shortly */
			*held = true;
			copies_note_unwritten(p);
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
idem_ring_consume(uint64 next_pos, int nrecords)
{
	char	   *ring = IDEM_RING_BYTES(commit_ring);
	uint64		tail = pg_atomic_read_u64(&commit_ring->tail);

	Assert(next_pos >= tail && next_pos <= pg_atomic_read_u64(&commit_ring->head));
	while (tail < next_pos)
	{
		uint64		off = tail % commit_ring->capacity;
		uint64		len = Min(next_pos - tail, commit_ring->capacity - off);

		memset(ring + off, 0, len);
		tail += len;
	}
	pg_write_barrier();
	pg_atomic_write_u64(&commit_ring->tail, next_pos);
	if (nrecords > 0)
		pg_atomic_fetch_sub_u64(&commit_ring->nrecords, nrecords);
}

/* Records counted in and not consumed yet (some may still be written). */
uint64
idem_ring_depth(void)
{
	if (commit_ring == NULL)
		return 0;
	return pg_atomic_read_u64(&commit_ring->nrecords);
}

/*
 * How long the oldest copy in the ring has waited, in *age_ms: since its
 * commit (or since the read that offered it).  false when the ring is
 * empty, or its oldest record is reserved but not written yet, or is being
 * consumed under this look.  Any process may call it; it only reads.  The
 * worker zeroes a record's bytes before it moves tail past them, so a field
 * read meanwhile is its value or 0: the published mark is read again after
 * the fields, and a queued_ms of 0 is no time (ring_ms).
 */
bool
idem_ring_oldest_age(int64 *age_ms)
{
	const char *ring;
	uint64		p;
	uint64		head;

	if (commit_ring == NULL)
		return false;
	ring = IDEM_RING_BYTES(commit_ring);
	p = pg_atomic_read_u64(&commit_ring->tail);
	pg_read_barrier();
	head = pg_atomic_read_u64(&commit_ring->head);

	/* the oldest record, or a padding record and the one after it */
	for (int hops = 0; hops < 2 && p < head; hops++)
	{
		const IdemRingRecord *rec =
			(const IdemRingRecord *) (ring + p % commit_ring->capacity);
		char		kind;
		uint32		size;
		uint32		queued_ms = 0;
		uint32		waited;

		if (*(volatile const uint64 *) &rec->published != p + 1)
			return false;
		pg_read_barrier();
		kind = *(volatile const char *) &rec->kind;
		size = *(volatile const uint32 *) &rec->size;
		if (kind != 0)
			queued_ms = *(volatile const uint32 *) &rec->queued_ms;
		pg_read_barrier();
		if (*(volatile const uint64 *) &rec->published != p + 1 || size == 0)
			return false;
		if (kind == 0)
		{
			p += size;
			continue;
		}
		if (queued_ms == 0)
			return false;
		waited = ring_ms(GetCurrentTimestamp()) - queued_ms;
		/* a clock set back: no negative age (nor one of 49 days) */
		*age_ms = waited > PG_INT32_MAX ? 0 : (int64) waited;
		return true;
	}
	return false;
}
