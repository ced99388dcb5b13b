/*-------------------------------------------------------------------------
 *
 * outbox.c
 *	  The commit hook: per-transaction pending copies, and the shared-memory
 *	  queue they move to when the transaction commits.
 *
 * idem_complete() and idem_fail(retryable => false) (and their platform
 * twins) call idem_outbox_add() inside the user's transaction.  The copy is
 * kept in backend-local memory (TopTransactionContext), tagged with the
 * subtransaction nesting level:
 *
 *	  - a subtransaction that aborts (ROLLBACK TO, an exception block) drops
 *		the copies made at its level and below; one that commits (RELEASE)
 *		hands them to its parent;
 *	  - PREPARE TRANSACTION with pending copies is refused (0A000): the copy
 *		would have to wait for COMMIT PREPARED, which may run in another
 *		session after a restart, and idem does not defer it;
 *	  - at XACT_EVENT_COMMIT, which runs after the commit record is written,
 *		the copies move into the shared queue, each marked with the end of
 *		the commit record (XactLastCommitEnd), and the worker's latch is set;
 *		the worker copies a record only once WAL is durable up to its mark.
 *		Nothing there allocates, raises an error or waits: a full queue drops
 *		the copy and counts it (PostgreSQL stays the truth, and a cache miss
 *		repopulates Valkey);
 *	  - an abort forgets them.
 *
 * The shared queue is a byte ring of variable-length IdemOutboxRecords
 * (header plus outcome), written by committing backends and read by the
 * single background worker, under one LWLock held only to copy a record in
 * or to move the read position.  It accepts at most idem.queue_size records
 * and reserves IDEM_OUTBOX_BYTES_PER_RECORD bytes per record (plus room for
 * two records of the largest size), so a queue of large outcomes holds fewer
 * records.  The worker reads records in place between its snapshot of the
 * read and write positions (writers never touch that span) and moves the
 * read position only once Valkey has acknowledged them, so records survive a
 * Valkey outage while the queue has room.
 *
 * idem_outbox_repopulate() puts a copy of a terminal row that a lookup or
 * claim read (not wrote) straight into the queue, marked with the WAL
 * insert position at the read.
 *
 * Shared memory holds no process-local pointers: the worker is found by its
 * PGPROC number, and the LWLock through the named tranche.
 *
 *-------------------------------------------------------------------------
 */
#include "idem.h"

#include "access/xact.h"
#include "access/xlog.h"
#include "miscadmin.h"
#include "nodes/pg_list.h"
#include "port/atomics.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "storage/lwlock.h"
#include "storage/proc.h"
#include "storage/shmem.h"
#include "utils/memutils.h"

/* Average bytes reserved per queued record (96-byte header + outcome). */
#define IDEM_OUTBOX_BYTES_PER_RECORD	256
#define IDEM_OUTBOX_RECORD_SIZE(outcome_len) \
	MAXALIGN(offsetof(IdemOutboxRecord, outcome) + (outcome_len))
#define IDEM_OUTBOX_RECORD_MAX	IDEM_OUTBOX_RECORD_SIZE(IDEM_OUTCOME_MAX)
#define IDEM_OUTBOX_NO_WORKER	PG_UINT32_MAX
#define IDEM_OUTBOX_TRANCHE		"idem"

typedef struct IdemOutboxShared
{
	/* Protected by the LWLock; positions are byte offsets that only grow. */
	uint64		head;			/* where the next record is written */
	uint64		tail;			/* the oldest record not yet copied */
	uint64		nrecords;		/* records (not padding) in [tail, head) */
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
static LWLock *outbox_lock = NULL;

/* This transaction's pending copies, in TopTransactionContext. */
static List *pending_records = NIL;	/* of IdemOutboxRecord * */
static List *pending_levels = NIL;	/* nesting level of each, same order */

/*
 * What the pending copies would take in the ring, and the copies dropped
 * at once because the ring could never take them all: a transaction's
 * memory for copies is bounded by the ring's size, whatever it completes.
 * (Copies dropped inside a subtransaction that rolls back are counted all
 * the same.)
 */
static uint64 pending_bytes = 0;
static uint64 pending_dropped = 0;

static void
outbox_pending_reset(void)
{
	/* The lists live in TopTransactionContext, which goes away. */
	pending_records = NIL;
	pending_levels = NIL;
	pending_bytes = 0;
	pending_dropped = 0;
}

static bool callbacks_registered = false;

#if PG_VERSION_NUM >= 150000
static shmem_request_hook_type prev_shmem_request_hook = NULL;
#endif
static shmem_startup_hook_type prev_shmem_startup_hook = NULL;

static Size
outbox_ring_capacity(void)
{
	return mul_size(idem_queue_size, IDEM_OUTBOX_BYTES_PER_RECORD) +
		2 * IDEM_OUTBOX_RECORD_MAX;
}

static Size
outbox_shmem_size(void)
{
	return add_size(MAXALIGN(sizeof(IdemOutboxShared)), outbox_ring_capacity());
}

static void
outbox_shmem_request(void)
{
#if PG_VERSION_NUM >= 150000
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
#endif
	RequestAddinShmemSpace(add_size(outbox_shmem_size(),
									idem_stats_shmem_size()));
	RequestNamedLWLockTranche(IDEM_OUTBOX_TRANCHE, 1);
	idem_cache_secret_shmem_request();
}

static void
outbox_shmem_startup(void)
{
	bool		found;

	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();

	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	outbox = ShmemInitStruct("idem outbox", outbox_shmem_size(), &found);
	if (!found)
	{
		outbox->head = 0;
		outbox->tail = 0;
		outbox->nrecords = 0;
		outbox->capacity = outbox_ring_capacity();
		outbox->max_records = idem_queue_size;
		pg_atomic_init_u32(&outbox->worker_procno, IDEM_OUTBOX_NO_WORKER);
		pg_atomic_init_u32(&outbox->worker_awake, 0);
	}
	idem_stats_shmem_init();
	idem_cache_secret_shmem_init();
	LWLockRelease(AddinShmemInitLock);

	outbox_lock = &(GetNamedLWLockTranche(IDEM_OUTBOX_TRANCHE))->lock;
}

/*
 * Append one record to the ring.  Caller holds outbox_lock exclusively.
 * Returns false, changing nothing, when the queue is full.  No allocation,
 * no error: this runs after the commit record.
 */
static bool
outbox_ring_append(const IdemOutboxRecord *rec)
{
	char	   *ring = IDEM_OUTBOX_RING(outbox);
	uint64		off = outbox->head % outbox->capacity;
	uint64		contiguous = outbox->capacity - off;
	uint64		pad = (rec->size > contiguous) ? contiguous : 0;

	if (outbox->nrecords >= outbox->max_records ||
		outbox->head + pad + rec->size - outbox->tail > outbox->capacity)
		return false;

	if (pad > 0)
	{
		/* Skip the end of the ring: a padding record (kind 0). */
		IdemOutboxRecord *p = (IdemOutboxRecord *) (ring + off);

		p->size = (uint32) pad;
		p->kind = 0;
		outbox->head += pad;
		off = 0;
	}
	memcpy(ring + off, rec, rec->size);
	outbox->head += rec->size;
	outbox->nrecords++;
	return true;
}

/*
 * Called after the records are in the ring and the LWLock is released (a
 * full barrier).  A worker that is awake looks at the queue again before
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
 * XACT_EVENT_COMMIT: move the pending copies to the shared queue, each with
 * the end of this transaction's commit record, so that the worker copies
 * it only once WAL is durable that far.
 */
static void
outbox_flush(void)
{
	ListCell   *lc;
	uint64		accepted = 0;
	uint64		dropped = 0;
	XLogRecPtr	commit_end = XactLastCommitEnd;

	/* Copies are queued only by transactions that wrote a ledger row. */
	if (XLogRecPtrIsInvalid(commit_end))
		commit_end = GetXLogInsertRecPtr();

	LWLockAcquire(outbox_lock, LW_EXCLUSIVE);
	foreach(lc, pending_records)
	{
		IdemOutboxRecord *rec = (IdemOutboxRecord *) lfirst(lc);

		rec->lsn = commit_end;
		if (outbox_ring_append(rec))
			accepted++;
		else
			dropped++;
	}
	LWLockRelease(outbox_lock);

	idem_stats_add(IDEM_STAT_QUEUED, accepted);
	idem_stats_add(IDEM_STAT_DROPPED, dropped + pending_dropped);
	if (accepted > 0)
		outbox_wake_worker();
}

static void
outbox_xact_callback(XactEvent event, void *arg)
{
	if (pending_records == NIL && pending_dropped == 0)
		return;

	switch (event)
	{
		case XACT_EVENT_PRE_PREPARE:
			if (pending_records == NIL)
				break;			/* only dropped copies: nothing to defer */
			ereport(ERROR,
					(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
					 errmsg("cannot PREPARE a transaction that completed or failed an idem key"),
					 errdetail_plural("The transaction queued %d result for the Valkey cache; idem copies results when a transaction commits, not at COMMIT PREPARED.",
									  "The transaction queued %d results for the Valkey cache; idem copies results when a transaction commits, not at COMMIT PREPARED.",
									  list_length(pending_records),
									  list_length(pending_records)),
					 errhint("Call idem_complete() and idem_fail() in a transaction that is committed directly, not with PREPARE TRANSACTION.")));
			break;
		case XACT_EVENT_COMMIT:
			/* The commit record is written: no ERROR from here on. */
			if (outbox != NULL)
				outbox_flush();
			outbox_pending_reset();
			break;
		case XACT_EVENT_ABORT:
		case XACT_EVENT_PREPARE:
		case XACT_EVENT_PARALLEL_COMMIT:
		case XACT_EVENT_PARALLEL_ABORT:
			outbox_pending_reset();
			break;
		default:
			break;
	}
}

static void
outbox_subxact_callback(SubXactEvent event, SubTransactionId mySubid,
						SubTransactionId parentSubid, void *arg)
{
	int			level;

	if (pending_records == NIL)
		return;
	level = GetCurrentTransactionNestLevel();

	/*
	 * Copies are appended at the current level, so levels never decrease
	 * along the list: those of this subtransaction are a suffix.
	 */
	switch (event)
	{
		case SUBXACT_EVENT_ABORT_SUB:
			while (pending_levels != NIL && llast_int(pending_levels) >= level)
			{
				pending_bytes -= ((IdemOutboxRecord *) llast(pending_records))->size;
				pfree(llast(pending_records));
				pending_records = list_delete_last(pending_records);
				pending_levels = list_delete_last(pending_levels);
			}
			break;
		case SUBXACT_EVENT_COMMIT_SUB:
			{
				int			i;

				for (i = list_length(pending_levels) - 1; i >= 0; i--)
				{
					ListCell   *cell = list_nth_cell(pending_levels, i);

					if (lfirst_int(cell) < level)
						break;
					lfirst_int(cell) = level - 1;
				}
			}
			break;
		default:
			break;
	}
}

void
idem_outbox_init(bool preloading)
{
	if (!callbacks_registered)
	{
		RegisterXactCallback(outbox_xact_callback, NULL);
		RegisterSubXactCallback(outbox_subxact_callback, NULL);
		callbacks_registered = true;
	}

	if (!preloading)
		return;

#if PG_VERSION_NUM >= 150000
	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = outbox_shmem_request;
#else
	outbox_shmem_request();
#endif
	prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = outbox_shmem_startup;
}

bool
idem_outbox_available(void)
{
	return outbox != NULL;
}

/*
 * Queue a copy of a terminal result, to be written to Valkey if and when
 * this transaction commits.  A no-op unless idem is preloaded.
 */
void
idem_outbox_add(bool is_platform, int64 tenant_id, const uint8 *key,
				IdemCacheKind kind, int32 attempt, const uint8 *fingerprint,
				const char *outcome, int outcome_len, TimestampTz expires_at)
{
	IdemOutboxRecord *rec;
	MemoryContext oldcxt;
	Size		size;

	if (outbox == NULL)
		return;

	if ((kind != IDEM_CACHE_COMPLETED && kind != IDEM_CACHE_FAILED_PERMANENT) ||
		attempt <= 0 || outcome_len <= 0 || outcome_len > IDEM_OUTCOME_MAX ||
		outcome[0] != '{')
		elog(ERROR, "idem: invalid result queued for the Valkey cache (kind %d, attempt %d, outcome length %d)",
			 (int) kind, (int) attempt, outcome_len);

	size = IDEM_OUTBOX_RECORD_SIZE(outcome_len);
	if ((uint64) list_length(pending_records) >= outbox->max_records ||
		pending_bytes + size > outbox->capacity)
	{
		/* More than the ring can ever take from one commit: drop it now. */
		pending_dropped++;
		return;
	}
	pending_bytes += size;
	oldcxt = MemoryContextSwitchTo(TopTransactionContext);
	rec = palloc0(size);
	rec->size = (uint32) size;
	rec->outcome_len = (uint16) outcome_len;
	rec->kind = (char) kind;
	rec->is_platform = is_platform;
	rec->attempt = attempt;
	rec->dboid = MyDatabaseId;
	rec->tenant_id = is_platform ? 0 : tenant_id;
	rec->expires_at = expires_at;
	rec->lsn = InvalidXLogRecPtr;	/* set at commit */
	memcpy(rec->key, key, IDEM_DIGEST_LEN);
	memcpy(rec->fingerprint, fingerprint, IDEM_DIGEST_LEN);
	memcpy(rec->outcome, outcome, outcome_len);
	pending_records = lappend(pending_records, rec);
	pending_levels = lappend_int(pending_levels,
								 GetCurrentTransactionNestLevel());
	MemoryContextSwitchTo(oldcxt);
}

/*
 * Queue a copy of a terminal row that this transaction read but did not
 * write (idem_lookup, or a claim answering with a replay after a cache
 * miss), straight into the shared queue: the row is committed already.  Its
 * commit record is before the WAL insert position now, so the worker copies
 * it once WAL is durable up to that position.  Nothing is queued during
 * recovery (a hot standby copies nothing), nor while the queue is more than
 * half full, so that reads cannot crowd out the copies of new commits.
 */
void
idem_outbox_repopulate(bool is_platform, int64 tenant_id, const uint8 *key,
					   IdemCacheKind kind, int32 attempt,
					   const uint8 *fingerprint, const char *outcome,
					   int outcome_len, TimestampTz expires_at)
{
	IdemOutboxRecord *rec;
	Size		size;
	bool		accepted = false;

	if (outbox == NULL || RecoveryInProgress() ||
		(kind != IDEM_CACHE_COMPLETED && kind != IDEM_CACHE_FAILED_PERMANENT) ||
		attempt <= 0 || outcome_len <= 0 || outcome_len > IDEM_OUTCOME_MAX ||
		outcome[0] != '{')
		return;

	size = IDEM_OUTBOX_RECORD_SIZE(outcome_len);
	rec = palloc0(size);
	rec->size = (uint32) size;
	rec->outcome_len = (uint16) outcome_len;
	rec->kind = (char) kind;
	rec->is_platform = is_platform;
	rec->attempt = attempt;
	rec->dboid = MyDatabaseId;
	rec->tenant_id = is_platform ? 0 : tenant_id;
	rec->expires_at = expires_at;
	rec->lsn = GetXLogInsertRecPtr();
	memcpy(rec->key, key, IDEM_DIGEST_LEN);
	memcpy(rec->fingerprint, fingerprint, IDEM_DIGEST_LEN);
	memcpy(rec->outcome, outcome, outcome_len);

	LWLockAcquire(outbox_lock, LW_EXCLUSIVE);
	if (outbox->nrecords < outbox->max_records / 2)
		accepted = outbox_ring_append(rec);
	LWLockRelease(outbox_lock);
	pfree(rec);
	if (accepted)
	{
		idem_stats_add(IDEM_STAT_QUEUED, 1);
		outbox_wake_worker();
	}
}

/*
 * The worker's side.  There is exactly one reader, so the span between the
 * read position and the write position it saw cannot change under it.
 */
void
idem_outbox_attach_worker(void)
{
#if PG_VERSION_NUM >= 170000
	pg_atomic_write_u32(&outbox->worker_procno, (uint32) MyProcNumber);
#else
	pg_atomic_write_u32(&outbox->worker_procno, (uint32) MyProc->pgprocno);
#endif
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
 * not sleep).  When false, the worker has been marked awake again.
 */
bool
idem_outbox_worker_sleepy(void)
{
	pg_atomic_write_u32(&outbox->worker_awake, 0);
	pg_memory_barrier();
	if (idem_outbox_depth() == 0)
		return true;
	idem_outbox_worker_awake();
	return false;
}

/*
 * Point records[] at up to max queued records from *pos on (or from the
 * oldest, if *pos is older than that), without removing them, and move *pos
 * past them (and past any padding).  The worker may peek further while
 * earlier records are still being written, and passes a position it was
 * given to idem_outbox_consume() once everything before it is written.
 * Stops before the first record whose WAL position is beyond durable, and
 * then sets *held (records stay in order: one not durable yet holds back
 * those behind it, which become durable at about the same time).
 */
int
idem_outbox_peek(uint64 *pos, const IdemOutboxRecord **records, int max,
				 XLogRecPtr durable, bool *held)
{
	const char *ring = IDEM_OUTBOX_RING(outbox);
	uint64		p;
	uint64		head;
	int			n = 0;

	LWLockAcquire(outbox_lock, LW_SHARED);
	p = Max(*pos, outbox->tail);
	head = outbox->head;
	LWLockRelease(outbox_lock);

	*held = false;
	while (p < head && n < max)
	{
		const IdemOutboxRecord *rec =
			(const IdemOutboxRecord *) (ring + p % outbox->capacity);

		if (rec->kind != 0)
		{
			if (rec->lsn > durable)
			{
				*held = true;
				break;
			}
			records[n++] = rec;
		}
		p += rec->size;
	}
	*pos = p;
	return n;
}

void
idem_outbox_consume(uint64 next_pos, int nrecords)
{
	LWLockAcquire(outbox_lock, LW_EXCLUSIVE);
	Assert(next_pos >= outbox->tail && next_pos <= outbox->head);
	outbox->tail = next_pos;
	outbox->nrecords -= nrecords;
	LWLockRelease(outbox_lock);
}

uint64
idem_outbox_depth(void)
{
	uint64		n;

	if (outbox == NULL)
		return 0;
	LWLockAcquire(outbox_lock, LW_SHARED);
	n = outbox->nrecords;
	LWLockRelease(outbox_lock);
	return n;
}
