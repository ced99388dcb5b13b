/*-------------------------------------------------------------------------
 *
 * epoch_renewal.c
 *	  The renewal generation: a counter in shared memory that every commit
 *	  removing or changing ledger rows outside idem bumps (ledger_guard.c
 *	  asks for the new history epoch, for a DELETE, TRUNCATE, logical
 *	  replication's apply or idem_renew_epoch(); cache_secret.c's
 *	  idem_cache_epoch_renew bumps).  "A removal" below is any of those.
 *	  It orders such a removal against the copies of results waiting in the
 *	  commit ring and against the reads that repopulate Valkey, and it lets
 *	  the removing commit wait, bounded, until the worker has retired the
 *	  epoch that the removal replaced.
 *
 * Nothing crosses an epoch.  Each queued copy (IdemRingRecord.generation)
 * carries the generation it was read under, and each epoch the generation
 * it was made at (IdemCacheSecrets.generation, set under the secret's lock
 * when the epoch is made).  The worker reads both with one copy of the
 * secrets per batch (worker_encoder_init) and writes a copy into the epoch
 * only if its generation is not older than the epoch's; older copies are
 * dropped, counted (IDEM_STAT_SKIPPED_EPOCH) and logged
 * (worker_count_skips; idem_stats().skipped_epoch).  So a copy read before
 * a removal is never written into the epoch that follows it, however long
 * it waited in the ring (Valkey down, a standby of idem.standby_slots
 * stopped).
 *
 * Why a copy of generation g is consistent with every removal counted up
 * to g (the removals counted before its stamp was read):
 *	  - the bump happens at the removal's XACT_EVENT_COMMIT, after
 *		ProcArrayEndTransaction: any snapshot taken after the bump sees the
 *		removal.  The renewal is asked for after the bump, so the epoch
 *		made for it records a generation that counts it (a later epoch
 *		counts at least as much: generations only grow);
 *	  - a commit's own copy is stamped when it is made (idem_copies_add),
 *		before that commit is visible.  A removal counted in the stamp had
 *		committed before then, and so cannot have removed the row version
 *		this transaction writes: a DELETE or UPDATE of it would have waited
 *		for this transaction's row lock, a TRUNCATE, DROP or ALTER for its
 *		table lock (all held past its commit callbacks), and a row this
 *		transaction inserts was invisible to it.  A removal not counted
 *		gets a newer generation, so the epoch made for it drops the copy;
 *	  - a read's copy (repopulation, ledger.c) is stamped with the
 *		generation read before the probe that found the row.  Under READ
 *		COMMITTED each probe takes a new snapshot, after that read, which
 *		sees every removal counted.  Under REPEATABLE READ and SERIALIZABLE
 *		the transaction's snapshot may predate one (a transaction started
 *		before a DELETE): the row is probed again under a snapshot taken
 *		now (GetLatestSnapshot), and copied only if it is still there with
 *		the same content;
 *	  - an epoch made at generation m is made after the m-th bump: its
 *		copies all reflect the m removals before it.
 *
 * The wait.  Runners connected before the removal may still use the epoch
 * it replaced, until the worker has overwritten that epoch's owner key with
 * a retired marker (worker_take_epoch: it retires the old epoch, then takes
 * the new one over).  The removing backend, after its commit record, waits
 * until the worker has taken over an epoch of the removal's generation or
 * newer (retired below, set by idem_renewal_taken), for at most
 * idem.epoch_retire_timeout: once the commit returns, no runner replays
 * from the old epoch.  A timeout (the worker cannot reach Valkey) is a
 * WARNING, never an ERROR (the transaction is committed): runners then
 * stop at their own bound, secrets_max_age_ms.  A query cancel or a
 * termination ends the wait early with a WARNING, as they end a wait for
 * synchronous replication.  Nothing waits when no epoch was ever taken
 * over (no runner can trust one), nor at PREPARE TRANSACTION.  Like a
 * wait for synchronous replication it holds the transaction's locks (they
 * are released after the commit callbacks).
 *
 * Two-phase commit.  A transaction that removed ledger rows renews at
 * PREPARE TRANSACTION (the commit may come from another session), before
 * COMMIT PREPARED makes the removal visible: a read in between still finds
 * the rows, under a generation that counts the removal.  So PREPARE first
 * registers the transaction (idem_renewal_prepared), then bumps; a reader
 * that finds one still in progress, after reading the generation and
 * before its probe, copies nothing (idem_renewal_stamp).  Once it has
 * ended, a later probe sees its outcome.  The registry is lost with shared
 * memory: a transaction prepared before a clean restart and committed after
 * it is not covered.
 *
 * Locking: generation and retired are 64-bit atomics (the bump is a
 * fetch-add, a full barrier); retired only grows.  The condition variable
 * wakes the waiters whenever retired grows.  The prepared registry is an
 * array of max_prepared_transactions xids (0: free), each slot taken and
 * freed by compare-and-swap, with a count of the slots in use that readers
 * check first (0 nearly always).  No lock of its own; the generation is
 * read by every copy and every repopulation, and written only by
 * removals.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/twophase.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "port/atomics.h"
#include "storage/condition_variable.h"
#include "storage/latch.h"
#include "storage/procarray.h"
#include "storage/shmem.h"
#include "utils/timestamp.h"

#include "epoch_renewal.h"
#include "guc.h"

typedef struct IdemRenewalShared
{
	pg_atomic_uint64 generation;	/* removal commits counted so far */
	pg_atomic_uint64 retired;	/* the newest epoch's generation the
								 * worker took over (older epochs retired) */
	ConditionVariable retired_cv;	/* retired grew */
	pg_atomic_uint32 nprepared;	/* slots of prepared in use */
	int			nslots;			/* max_prepared_transactions */
	pg_atomic_uint32 prepared[FLEXIBLE_ARRAY_MEMBER];	/* xids; 0: free */
} IdemRenewalShared;

static IdemRenewalShared *renewal = NULL;

static Size
renewal_size(void)
{
	return add_size(offsetof(IdemRenewalShared, prepared),
					mul_size(max_prepared_xacts, sizeof(pg_atomic_uint32)));
}

Size
idem_renewal_shmem_size(void)
{
	return MAXALIGN(renewal_size());
}

/* From shmem.c's startup hook, with AddinShmemInitLock held. */
void
idem_renewal_shmem_init(void)
{
	bool		found;

	renewal = ShmemInitStruct("idem renewal generation", renewal_size(),
							  &found);
	if (!found)
	{
		pg_atomic_init_u64(&renewal->generation, 0);
		pg_atomic_init_u64(&renewal->retired, 0);
		ConditionVariableInit(&renewal->retired_cv);
		pg_atomic_init_u32(&renewal->nprepared, 0);
		renewal->nslots = max_prepared_xacts;
		for (int i = 0; i < renewal->nslots; i++)
			pg_atomic_init_u32(&renewal->prepared[i], InvalidTransactionId);
	}
}

/* The generation now: the removal commits counted so far. */
uint64
idem_renewal_generation(void)
{
	if (renewal == NULL)
		return 0;
	return pg_atomic_read_u64(&renewal->generation);
}

/*
 * Is a transaction that removed ledger rows prepared and not yet committed
 * or rolled back?  Frees the slots of those that ended.
 */
static bool
renewal_prepared_pending(void)
{
	if (pg_atomic_read_u32(&renewal->nprepared) == 0)
		return false;
	for (int i = 0; i < renewal->nslots; i++)
	{
		uint32		xid = pg_atomic_read_u32(&renewal->prepared[i]);

		if (xid == InvalidTransactionId)
			continue;
		if (TransactionIdIsInProgress(xid))
			return true;
		if (pg_atomic_compare_exchange_u32(&renewal->prepared[i], &xid,
										   InvalidTransactionId))
			pg_atomic_fetch_sub_u32(&renewal->nprepared, 1);
	}
	return false;
}

/*
 * What a read's copy is stamped with: the generation now, read before the
 * probe that finds the row (see the file header), or IDEM_RENEWAL_NO_COPY
 * while a transaction that removed ledger rows is prepared: the row read
 * may be one it removes, under a generation that already counts it.
 */
uint64
idem_renewal_stamp(void)
{
	uint64		generation;

	if (renewal == NULL)
		return 0;
	generation = pg_atomic_read_u64(&renewal->generation);
	pg_read_barrier();
	if (renewal_prepared_pending())
		return IDEM_RENEWAL_NO_COPY;
	return generation;
}

/*
 * At PREPARE TRANSACTION of a transaction that removed ledger rows, before
 * its renewal bumps the generation: register it, so that reads copy nothing
 * until it ends (idem_renewal_stamp).  Safe after the prepare record: no
 * allocation, no error.
 */
void
idem_renewal_prepared(TransactionId xid)
{
	if (renewal == NULL || !TransactionIdIsValid(xid))
		return;
	/* a slot is always free: at most max_prepared_transactions are prepared */
	for (int i = 0; i < renewal->nslots; i++)
	{
		uint32		old = pg_atomic_read_u32(&renewal->prepared[i]);
		bool		was_free = (old == InvalidTransactionId);

		/* a free slot, or one whose transaction ended */
		if (!was_free && TransactionIdIsInProgress(old))
			continue;
		/* counted before it can be seen */
		if (was_free)
			pg_atomic_fetch_add_u32(&renewal->nprepared, 1);
		if (pg_atomic_compare_exchange_u32(&renewal->prepared[i], &old, xid))
			return;
		if (was_free)
			pg_atomic_fetch_sub_u32(&renewal->nprepared, 1);
	}
}

/*
 * Count a removal that is committed and visible, before its renewal is
 * asked for (see the file header).  Returns the new generation.  Safe
 * after a commit record: no allocation, no error.
 */
uint64
idem_renewal_bump(void)
{
	if (renewal == NULL)
		return 0;
	return pg_atomic_add_fetch_u64(&renewal->generation, 1);
}

/*
 * The worker took over an epoch made at generation (after retiring the one
 * it replaced): wake the removals that waited for it.
 */
void
idem_renewal_taken(uint64 generation)
{
	uint64		old;

	if (renewal == NULL)
		return;
	old = pg_atomic_read_u64(&renewal->retired);
	while (old < generation)
	{
		/* only the worker writes it; the loop is for form's sake */
		if (pg_atomic_compare_exchange_u64(&renewal->retired, &old, generation))
		{
			ConditionVariableBroadcast(&renewal->retired_cv);
			break;
		}
	}
}

/*
 * After the commit record of a transaction that removed ledger rows: wait
 * until the worker has retired the epoch the removal replaced, at most
 * idem.epoch_retire_timeout (see the file header).  generation is what the
 * renewal returned (0: nothing to wait for).  Never raises an ERROR.
 */
void
idem_renewal_wait(uint64 generation)
{
	TimestampTz start;
	bool		timed_out = false;

	if (renewal == NULL || generation == 0 || idem_epoch_retire_timeout_ms <= 0 ||
		pg_atomic_read_u64(&renewal->retired) >= generation)
		return;
	start = GetCurrentTimestamp();
	for (;;)
	{
		long		left;

		/*
		 * On the waiters' list before the check, so that no wakeup is lost
		 * (a wakeup takes a waiter off the list: put it back each time).
		 * Not ConditionVariableTimedSleep: interrupts are held here, and it
		 * would sleep through a cancel until its timeout.
		 */
		ConditionVariablePrepareToSleep(&renewal->retired_cv);
		if (pg_atomic_read_u64(&renewal->retired) >= generation)
			break;
		if (ProcDiePending || QueryCancelPending)
		{
			/* answered once the commit is done and interrupts resume */
			ereport(WARNING,
					(errmsg("canceling the wait for the history epoch's retirement"),
					 errdetail("The transaction has already committed.  Runners connected before it may replay results of the removed ledger rows from Valkey until they learn the cache keyspace again.")));
			QueryCancelPending = false;
			break;
		}
		left = idem_epoch_retire_timeout_ms -
			TimestampDifferenceMilliseconds(start, GetCurrentTimestamp());
		if (left <= 0)
		{
			timed_out = true;
			break;
		}
		(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
						 left, PG_WAIT_EXTENSION);
		ResetLatch(MyLatch);
	}
	ConditionVariableCancelSleep();
	if (timed_out)
		ereport(WARNING,
				(errmsg("the idem worker did not retire the replaced history epoch in Valkey within %d ms",
						idem_epoch_retire_timeout_ms),
				 errdetail("The transaction has committed.  Runners connected before it may replay results of the removed ledger rows from Valkey until they learn the cache keyspace again, at the latest after their secrets_max_age_ms."),
				 errhint("Check that the worker reaches Valkey: see last_error in idem_stats().")));
}
