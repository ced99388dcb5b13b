/*-------------------------------------------------------------------------
 *
 * worker_durable.c
 *	  When a copy may go out, and how the worker waits: the durable WAL
 *	  position (flushed here, on the synchronous standbys and on those of
 *	  idem.standby_slots), the flush a read's copy needs, how often to look
 *	  again while copies wait for it (worker_durable_poll_ms), the latch nap,
 *	  and idem.valkey_batch_delay's pacing of batches (both drains).
 *
 *	  Locking: none of its own; the WAL positions are PostgreSQL's.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xlog.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "storage/latch.h"
#include "utils/timestamp.h"

#include "guc.h"
#include "standby_slots.h"
#include "worker_int.h"

/*
 * How often to look at the durable WAL position while copies wait for it
 * (worker_durable_poll_ms): a quarter of the time they have waited so far, at
 * least every IDEM_DURABLE_POLL_MS (a standby's reply comes within
 * milliseconds) and at most every IDEM_DURABLE_SLOW_POLL_MS.  A copy thus
 * goes out at most a quarter (and a millisecond) later than its commit
 * became durable, while a wait for the WAL writer (synchronous_commit off:
 * up to three wal_writer_delay cycles) or for a stopped standby costs tens
 * of wakeups a second, not a thousand.
 */
#define IDEM_DURABLE_POLL_MS		1
#define IDEM_DURABLE_SLOW_POLL_MS	20
#define IDEM_DURABLE_POLL_DIVISOR	4

/*
 * How far WAL is durable: flushed here, on the synchronous standbys (when
 * synchronous_standby_names is set) and on the standbys of
 * idem.standby_slots (by default, of every physical slot in use); see
 * standby_slots.c.  Also gives the timeline, which names the keyspace.
 * When a named standby cannot be used, returns InvalidXLogRecPtr and sets
 * *standby_problem (the reason is in worker_errbuf).
 */
XLogRecPtr
worker_durable_lsn(TimeLineID *timeline, bool *standby_problem)
{
	XLogRecPtr	lsn = GetFlushRecPtr(timeline);

	*standby_problem = !idem_standby_slots_flushed(&lsn, worker_errbuf,
												   sizeof(worker_errbuf));
	return lsn;
}

/*
 * A read's copy is held for WAL up to lsn that may be no commit's, which
 * only the WAL writer would flush, cycles later (commit_copies.c): flush it now, as
 * a committing backend would.  The copy still goes out only once the
 * durable position (worker_durable_lsn) passes it.
 */
void
worker_flush_wal(XLogRecPtr lsn)
{
	if (XLogRecPtrIsInvalid(lsn) || RecoveryInProgress() ||
		lsn <= GetFlushRecPtr(NULL))
		return;
	XLogFlush(lsn);
}

/* The next look at the durable position, for copies held since held_since. */
long
worker_durable_poll_ms(TimestampTz held_since, TimestampTz now)
{
	long		waited_ms = (long) ((now - held_since) / 1000);

	return Max(IDEM_DURABLE_POLL_MS,
			   Min(IDEM_DURABLE_SLOW_POLL_MS, waited_ms / IDEM_DURABLE_POLL_DIVISOR));
}

/* Sleep up to ms, or until the latch is set (a commit, SIGHUP, SIGTERM). */
void
worker_nap(long ms)
{
	(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
					 ms, PG_WAIT_EXTENSION);
	ResetLatch(MyLatch);
}

/*
 * idem.valkey_batch_delay, for both modes (file header): when the last batch
 * went out.  The next may go once the delay has passed since, the delay as
 * set now (a reload that shortens it lets the next batch go sooner).
 */
static TimestampTz worker_last_batch_at = 0;

void
worker_batch_delay_start(TimestampTz now)
{
	worker_last_batch_at = now;
}

static TimestampTz
worker_batch_delay_next(void)
{
	return worker_last_batch_at + idem_valkey_batch_delay_ms * INT64CONST(1000);
}

/* Milliseconds, rounded up, until the next batch may go (0: now). */
long
worker_batch_delay_left_ms(TimestampTz now)
{
	TimestampTz next = worker_batch_delay_next();

	return next > now ? (long) ((next - now + 999) / 1000) : 0;
}

/* Must n queued records wait for the delay (fewer than a backlog)? */
bool
worker_batch_delay_holds(int n, TimestampTz now)
{
	return n < IDEM_BATCH_EAGER && now < worker_batch_delay_next();
}

/*
 * A batch is sent and no backlog waits.  With a delay, sleep until the next
 * batch may go instead of until the replies come: they come meanwhile, and
 * are read and the next batch sent in one wakeup, not two.  True if it
 * slept (the replies are then read before their socket is waited for, and
 * the command timeout counts from now).
 */
bool
worker_batch_delay_sleep(void)
{
	long		sleep_ms;

	if (idem_valkey_batch_delay_ms <= 0)
		return false;
	sleep_ms = worker_batch_delay_left_ms(GetCurrentTimestamp());
	if (sleep_ms <= 0)
		return false;
	worker_nap(sleep_ms);
	return true;
}
