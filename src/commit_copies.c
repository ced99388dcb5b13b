/*-------------------------------------------------------------------------
 *
 * commit_copies.c
 *	  The commit hook: this transaction's copies of terminal results, to be
 *	  queued for the Valkey cache when the transaction commits.
 *
 * idem_complete() and idem_fail(retryable => false) (and their platform
 * twins) call idem_copies_add() inside the user's transaction.  The copy is
 * kept in backend-local memory (TopTransactionContext), tagged with the
 * subtransaction nesting level, and follows its subtransaction by xact.c's
 * rule (idem_subxact_follow):
 *
 *	  - a subtransaction that aborts (ROLLBACK TO, an exception block) drops
 *		the copies made at its level and below; one that commits (RELEASE)
 *		hands them to its parent;
 *	  - a transaction committed in two phases (PREPARE TRANSACTION, as
 *		Citus does for a handler that writes more than one node) copies
 *		nothing: COMMIT PREPARED may run in another session, after a
 *		restart, or never, and idem does not defer copies to it.
 *		PostgreSQL stays the truth; a reader that misses the cache reads
 *		the ledger and repopulates Valkey;
 *	  - at XACT_EVENT_COMMIT, which runs after the commit record is written,
 *		the copies move into the shared queue (commit_ring.c), each marked
 *		with the end of the commit record (XactLastCommitEnd), and the
 *		worker's latch is set; the worker copies a record only once WAL is
 *		durable up to its mark.  Nothing there allocates, raises an error or
 *		waits: a full queue drops the copy and counts it (PostgreSQL stays
 *		the truth, and a cache miss repopulates Valkey);
 *	  - an abort forgets them.
 *
 * idem_copies_repopulate() puts a copy of a terminal row that a lookup or
 * claim read (not wrote) straight into the queue, marked with the end of
 * the WAL inserted at the read (idem_insert_end_lsn): the row's commit
 * record is before it.  That position may also cover WAL of no commit, which
 * nothing but the WAL writer flushes, two or three wal_writer_delay cycles
 * later: the full-page images that setting hint bits writes when data
 * checksums are on (initdb's default from PostgreSQL 18) or wal_log_hints
 * is, and on-access pruning, written by any read before this one.  So such
 * a copy is marked may_flush: the worker flushes WAL up to it itself
 * (XLogFlush, as a committing backend would) instead of waiting.  A
 * commit's own copy is not: with synchronous_commit = off it waits for the
 * WAL writer, as the commit's durability does.
 *
 * Every copy carries the renewal generation it was read under (a
 * commit's own copy: when idem_copies_add makes it), and the worker never
 * writes it into an epoch made after a later removal of ledger rows
 * (epoch_renewal.c).
 *
 * The events arrive from xact.c, which owns the transaction callbacks.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "access/xlog.h"
#include "access/xlog_internal.h"
#include "miscadmin.h"
#include "utils/memutils.h"

#include "commit_copies.h"
#include "cache_format.h"
#include "epoch_renewal.h"
#include "commit_ring.h"
#include "stats.h"
#include "subxact.h"

/* This transaction's pending copies, in TopTransactionContext. */
static List *pending_records = NIL;	/* of IdemRingRecord * */
static List *pending_levels = NIL;	/* nesting level of each, same order */

/*
 * What the pending copies would take in the ring, and the copies dropped
 * at once because the ring could never take them all: a transaction's
 * memory for copies is bounded by the ring's size, whatever it completes.
 * The dropped copies are counted per nesting level, as runs (level,
 * count) whose levels never decrease, so that a subtransaction that rolls
 * back takes its count with it: idem_stats().dropped counts copies of
 * committed work only.
 */
static uint64 pending_bytes = 0;
static uint64 pending_dropped = 0;	/* the sum of pending_dropped_counts */
static List *pending_dropped_levels = NIL;	/* of int */
static List *pending_dropped_counts = NIL;	/* of int, same order */

static void
copies_pending_reset(void)
{
	/* The lists live in TopTransactionContext, which goes away. */
	pending_records = NIL;
	pending_levels = NIL;
	pending_bytes = 0;
	pending_dropped = 0;
	pending_dropped_levels = NIL;
	pending_dropped_counts = NIL;
}

/* One copy dropped at once, at the current nesting level. */
static void
copies_count_dropped(void)
{
	int			level = GetCurrentTransactionNestLevel();
	MemoryContext oldcxt;

	pending_dropped++;
	if (pending_dropped_levels != NIL &&
		llast_int(pending_dropped_levels) == level &&
		llast_int(pending_dropped_counts) < PG_INT32_MAX)
	{
		llast_int(pending_dropped_counts)++;
		return;
	}
	oldcxt = MemoryContextSwitchTo(TopTransactionContext);
	pending_dropped_levels = lappend_int(pending_dropped_levels, level);
	pending_dropped_counts = lappend_int(pending_dropped_counts, 1);
	MemoryContextSwitchTo(oldcxt);
}

/*
 * Where the WAL inserted so far ends, as the flush position reaches it.
 * GetXLogInsertRecPtr() is where the next record will start: past the page
 * header when the last record ended at a page boundary (as after
 * pg_switch_wal()), a position no flush reaches until more WAL is written,
 * and one XLogFlush() refuses.  (GetXLogInsertEndRecPtr() is not in every
 * minor release of 15.)
 */
XLogRecPtr
idem_insert_end_lsn(void)
{
	XLogRecPtr	lsn = GetXLogInsertRecPtr();
	uint64		segoff = XLogSegmentOffset(lsn, wal_segment_size);

	if (segoff == SizeOfXLogLongPHD)
		return lsn - SizeOfXLogLongPHD;
	if (segoff % XLOG_BLCKSZ == SizeOfXLogShortPHD)
		return lsn - SizeOfXLogShortPHD;
	return lsn;
}

/*
 * At commit: mark each copy with the end of this transaction's commit
 * record, so that the worker copies it only once WAL is durable that far.
 */
static void
copies_set_lsn(void)
{
	ListCell   *lc;
	XLogRecPtr	commit_end = XactLastCommitEnd;

	/* Copies are queued only by transactions that wrote a ledger row. */
	if (XLogRecPtrIsInvalid(commit_end))
		commit_end = idem_insert_end_lsn();
	foreach(lc, pending_records)
		((IdemRingRecord *) lfirst(lc))->lsn = commit_end;
}

/* A transaction event, from xact.c. */
void
idem_copies_xact_event(XactEvent event)
{
	if (pending_records == NIL && pending_dropped == 0)
		return;

	switch (event)
	{
		case XACT_EVENT_COMMIT:
			/* The commit record is written: no ERROR from here on. */
			copies_set_lsn();
			/* handed to the ring and dropped (stats.h's identity) */
			idem_stats_add(IDEM_STAT_QUEUED, pending_dropped);
			idem_stats_add(IDEM_STAT_DROPPED, pending_dropped);
			idem_ring_put(pending_records);
			copies_pending_reset();
			break;
		case XACT_EVENT_PREPARE:
			/* Two-phase commit: no copy (see the header comment). */
		case XACT_EVENT_ABORT:
		case XACT_EVENT_PARALLEL_COMMIT:
		case XACT_EVENT_PARALLEL_ABORT:
			copies_pending_reset();
			break;
		default:
			break;
	}
}

/* The subtransaction at level ended (committed or aborted), from xact.c. */
void
idem_copies_subxact_end(bool committed, int level)
{
	int			i;

	/*
	 * Copies are appended at the current level, so levels never decrease
	 * along the list: those of this subtransaction are a suffix.
	 */
	for (i = list_length(pending_levels) - 1; i >= 0; i--)
	{
		ListCell   *cell = list_nth_cell(pending_levels, i);

		if (lfirst_int(cell) < level)
			break;
		if (!idem_subxact_follow(&lfirst_int(cell), committed, level))
		{
			IdemRingRecord *rec = list_nth(pending_records, i);

			Assert(i == list_length(pending_levels) - 1);
			pending_bytes -= rec->size;
			pfree(rec);
			pending_records = list_delete_last(pending_records);
			pending_levels = list_delete_last(pending_levels);
		}
	}
	/* The same for the copies dropped at once, counted per level. */
	for (i = list_length(pending_dropped_levels) - 1; i >= 0; i--)
	{
		ListCell   *cell = list_nth_cell(pending_dropped_levels, i);

		if (lfirst_int(cell) < level)
			break;
		if (!idem_subxact_follow(&lfirst_int(cell), committed, level))
		{
			Assert(i == list_length(pending_dropped_levels) - 1);
			pending_dropped -= llast_int(pending_dropped_counts);
			pending_dropped_levels = list_delete_last(pending_dropped_levels);
			pending_dropped_counts = list_delete_last(pending_dropped_counts);
		}
	}
}

/* A record of a terminal result, palloc'd in the current context. */
static IdemRingRecord *
copies_record(bool is_platform, int64 tenant_id, const uint8 *key,
			  IdemCacheKind kind, int32 attempt, const uint8 *fingerprint,
			  const char *outcome, int outcome_len, TimestampTz expires_at,
			  XLogRecPtr lsn, bool may_flush, uint64 generation)
{
	Size		size = IDEM_RING_RECORD_SIZE(outcome_len);
	IdemRingRecord *rec = palloc0(size);

	rec->size = (uint32) size;
	rec->outcome_len = (uint16) outcome_len;
	rec->kind = (char) kind;
	rec->is_platform = is_platform;
	rec->attempt = attempt;
	rec->dboid = MyDatabaseId;
	rec->tenant_id = is_platform ? 0 : tenant_id;
	rec->expires_at = expires_at;
	rec->lsn = lsn;
	rec->may_flush = may_flush;
	rec->generation = generation;
	memcpy(rec->key, key, IDEM_DIGEST_LEN);
	memcpy(rec->fingerprint, fingerprint, IDEM_DIGEST_LEN);
	memcpy(rec->outcome, outcome, outcome_len);
	return rec;
}

/*
 * Queue a copy of a terminal result, to be written to Valkey if and when
 * this transaction commits.  A no-op unless idem is preloaded.
 */
void
idem_copies_add(bool is_platform, int64 tenant_id, const uint8 *key,
				IdemCacheKind kind, int32 attempt, const uint8 *fingerprint,
				const char *outcome, int outcome_len, TimestampTz expires_at)
{
	MemoryContext oldcxt;
	Size		size = IDEM_RING_RECORD_SIZE(outcome_len);

	if (!idem_ring_available())
		return;

	if (outcome_len < 0 ||
		!idem_cache_result_ok(kind, attempt, outcome, (size_t) outcome_len))
		elog(ERROR, "invalid result queued for the Valkey cache (kind %d, attempt %d, outcome length %d)",
			 (int) kind, (int) attempt, outcome_len);

	if (!idem_ring_fits(list_length(pending_records) + 1,
							   pending_bytes + size))
	{
		/* More than the ring can ever take from one commit: drop it now. */
		copies_count_dropped();
		return;
	}
	pending_bytes += size;
	oldcxt = MemoryContextSwitchTo(TopTransactionContext);
	/*
	 * The WAL position is set at commit; the renewal generation now, before
	 * the commit is visible (epoch_renewal.c says why that is the right
	 * one).
	 */
	pending_records = lappend(pending_records,
							  copies_record(is_platform, tenant_id, key, kind,
											attempt, fingerprint, outcome,
											outcome_len, expires_at,
											InvalidXLogRecPtr, false,
											idem_renewal_generation()));
	pending_levels = lappend_int(pending_levels,
								 GetCurrentTransactionNestLevel());
	MemoryContextSwitchTo(oldcxt);
}

/*
 * Queue a copy of a terminal row that this transaction read but did not
 * write (idem_lookup, or a claim answering with a replay after a cache
 * miss), straight into the shared queue: the row is committed already.  Its
 * commit record is before the end of the WAL inserted now, so the worker
 * copies it once WAL is durable up to there, flushing it itself if need be
 * (see the header comment).  Nothing is queued during
 * recovery (a hot standby copies nothing), nor while the queue is more than
 * half full (idem_ring_offer).  generation is the renewal
 * generation the caller read before it read the row, and checked
 * (epoch_renewal.c).
 */
void
idem_copies_repopulate(bool is_platform, int64 tenant_id, const uint8 *key,
					   IdemCacheKind kind, int32 attempt,
					   const uint8 *fingerprint, const char *outcome,
					   int outcome_len, TimestampTz expires_at,
					   uint64 generation)
{
	IdemRingRecord *rec;

	if (!idem_ring_available() || RecoveryInProgress() || outcome_len < 0 ||
		!idem_cache_result_ok(kind, attempt, outcome, (size_t) outcome_len))
		return;

	rec = copies_record(is_platform, tenant_id, key, kind, attempt,
						fingerprint, outcome, outcome_len, expires_at,
						idem_insert_end_lsn(), true, generation);
	(void) idem_ring_offer(rec);
	pfree(rec);
}
