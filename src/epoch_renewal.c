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
 * Nothing crosses an epoch.  Each queued copy (IdemOutboxRecord.generation)
 * carries the generation it was read under, and each epoch the generation
 * it was made at (IdemCacheSecrets.generation, set under the secret's lock
 * when the epoch is made).  The worker reads both with one copy of the
 * secrets per batch (vk_encoder_init) and writes a copy into the epoch
 * only if its generation is not older than the epoch's; older copies are
 * dropped, counted (IDEM_STAT_SKIPPED_EPOCH) and logged
 * (worker_report_skipped).  So a copy read before
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
 *	  - a commit's own copy is stamped when it is made (idem_outbox_add),
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
 * Not covered: PREPARE TRANSACTION renews (and bumps) before COMMIT
 * PREPARED makes the removal visible, so a read in between may still copy
 * the row into the new epoch.
 *
 * Locking: generation and retired are 64-bit atomics (the bump is a
 * fetch-add, a full barrier); retired only grows.  The condition variable
 * wakes the waiters whenever retired grows.  No lock of its own; the
 * generation is read by every copy and every repopulation, and written
 * only by removals.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "miscadmin.h"
#include "pgstat.h"
#include "port/atomics.h"
#include "storage/condition_variable.h"
#include "storage/latch.h"
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
} IdemRenewalShared;

static IdemRenewalShared *renewal = NULL;

Size
idem_renewal_shmem_size(void)
{
	return MAXALIGN(sizeof(IdemRenewalShared));
}

/* From shmem.c's startup hook, with AddinShmemInitLock held. */
void
idem_renewal_shmem_init(void)
{
	bool		found;

	renewal = ShmemInitStruct("idem renewal generation",
							  sizeof(IdemRenewalShared), &found);
	if (!found)
	{
		pg_atomic_init_u64(&renewal->generation, 0);
		pg_atomic_init_u64(&renewal->retired, 0);
		ConditionVariableInit(&renewal->retired_cv);
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
