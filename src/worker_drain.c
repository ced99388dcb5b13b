/*-------------------------------------------------------------------------
 *
 * worker_drain.c
 *	  The worker's two drains: the commit ring's durable records copied to a
 *	  single Valkey (worker_drain_single: batches pipelined ahead of their
 *	  replies) or to a Valkey Cluster (worker_drain_cluster: through
 *	  worker_router_send() and worker_router_collect(), a stuck batch's
 *	  successors sent ahead to the nodes that answer).  A batch leaves the ring
 *	  only when all its replies are read.  The batching: the comment above
 *	  idem_worker_main(), and docs/worker.md.
 *
 *	  Locking: only this file consumes the queue (commit_ring.c's rules);
 *	  the rest is the worker's own state.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "miscadmin.h"
#include "postmaster/interrupt.h"
#include "utils/timestamp.h"

#include "guc.h"
#include "commit_ring.h"
#include "stats.h"
#include "valkey_router.h"
#include "worker_router.h"
#include "worker_int.h"

/* batches sent ahead of a stuck one, to the nodes that answer */
#define IDEM_AHEAD_BATCHES		8
/* while one node does not answer and the others do: send what comes in
 * this often, and try the stuck batch again this often */
#define IDEM_STUCK_POLL_MS		20
#define IDEM_STUCK_RETRY_MS		100

/* A batch written to Valkey whose replies are not read yet. */
typedef struct WorkerBatch
{
	uint64		end_pos;		/* queue position after its records */
	int			nrecords;
	int			nsent;			/* SETs sent (skipped records are not) */
	uint64		unencodable;	/* records that could not be encoded */
	int64		sent_at;		/* when it was appended (and then written) */
	WorkerSkips	skips;			/* records skipped, by reason */
} WorkerBatch;

/* At most this many batches in flight (worker_drain_single, a backlog). */
#define IDEM_INFLIGHT 4

/*
 * The send window (worker_drain_single): at most this many records in flight,
 * whose SETs must be written and answered within idem.valkey_command_timeout.
 * On a slow link with large outcomes a full window (IDEM_INFLIGHT batches of
 * IDEM_BATCH_MAX) may take longer than that to write; resent whole after each
 * timeout it would never go through.  So a window that fails (a timeout, or
 * the connection lost) halves it, down to one record, and each batch answered
 * within half the timeout doubles it again, up to the full window: it settles
 * where a window is written and answered in time.
 */
#define IDEM_WINDOW_MAX (IDEM_INFLIGHT * IDEM_BATCH_MAX)
static int	worker_send_window = IDEM_WINDOW_MAX;

/* The window in flight failed: send half as many records next time. */
static WorkerResult
worker_window_failed(WorkerResult r)
{
	if (r == WORKER_FAILED && worker_send_window > 1)
	{
		worker_send_window = Max(1, worker_send_window / 2);
		ereport(DEBUG1,
				(errmsg_internal("send window now %d copies", worker_send_window)));
	}
	return r;
}

/*
 * Copy queued records until the queue is empty, batched as the file header
 * says: while a batch is in flight, the next one is written ahead of its
 * replies only when IDEM_BATCH_EAGER records wait (up to IDEM_INFLIGHT
 * batches, so Valkey and the worker work at the same time on a backlog).  Only records
 * whose WAL position is durable (worker_durable_lsn) are taken; while the
 * next one is not, the worker looks again shortly (worker_durable_poll_ms),
 * having flushed WAL up to it if it is a read's copy (worker_flush_wal).  A
 * batch leaves the queue once all its replies are read.  A reply that says
 * the server cannot take writes now (valkey_reply.c) fails the drain with
 * the batches kept; one that condemns a record drops that record.  Returns
 * early, once the batches in flight are answered, when a reload is pending.
 * *copied and *rejected count OK replies and dropped records (refused or
 * unencodable); idem_stats() counts them batch by batch.
 */
WorkerResult
worker_drain_single(uint64 *copied, uint64 *rejected)
{
	const IdemRingRecord *records[IDEM_BATCH_MAX];
	WorkerBatch	inflight[IDEM_INFLIGHT];
	int			first = 0;
	int			nin = 0;
	int			nrecords_in = 0;	/* records of the batches in flight */
	uint64		pos = 0;		/* from the oldest record */
	bool		standby_reported = false;
	TimestampTz held_since = 0; /* when the wait for durability began */

	*copied = 0;
	*rejected = 0;
	for (;;)
	{
		int64		deadline;
		TimestampTz now = GetCurrentTimestamp();
		WorkerBatch *b;
		WorkerResult r;
		int			i;
		uint64		ok;
		uint64		nrej;
		bool		waiting = false;	/* records held back by the delay */
		bool		slept;		/* out the delay, with a batch in flight */
		bool		held = false;	/* records held back for durability */
		bool		standby_problem;
		TimeLineID	timeline;
		XLogRecPtr	durable = worker_durable_lsn(&timeline, &standby_problem);

		if (standby_problem && !standby_reported)
		{
			worker_report_standby();
			standby_reported = true;
		}

		/*
		 * Fill the window with what is queued and durable beyond the
		 * batches in flight (see the file header).
		 */
		while (nin < IDEM_INFLIGHT && nrecords_in < worker_send_window &&
			   !ConfigReloadPending && worker_epoch_ready())
		{
			uint64		start = pos;
			XLogRecPtr	flush_to;
			int			n = idem_ring_peek(&pos, records,
											 Min(IDEM_BATCH_MAX,
												 worker_send_window - nrecords_in),
											 durable, &held, &flush_to);
			int			nsent;
			WorkerEncoder enc;

			worker_flush_wal(flush_to);
			if (pos == start)
				break;
			if ((nin > 0 && n < IDEM_BATCH_EAGER) || worker_batch_delay_holds(n, now))
			{
				/* Let them gather behind the batch in flight, or the delay. */
				pos = start;
				waiting = (nin == 0);
				break;
			}
			worker_encoder_init(&enc, timeline);
			nrej = 0;
			nsent = worker_append_batch(records, n, &enc, &nrej);
			worker_encoder_done(&enc);
			if (nsent < 0)
				return WORKER_FAILED;
			/* all counted once the batch leaves the ring, not if resent */
			b = &inflight[(first + nin) % IDEM_INFLIGHT];
			b->end_pos = pos;
			b->nrecords = n;
			b->nsent = nsent;
			b->unencodable = nrej;
			b->skips = enc.skips;
			b->sent_at = idem_vc_now_ms();
			nin++;
			nrecords_in += n;
			worker_batch_delay_start(now);
			if (n > 0)
				held_since = 0;
			if (held)
				break;
		}
		if (nin == 0)
		{
			long		wait_ms = PG_INT32_MAX;

			if (!waiting && !held)
				return WORKER_OK;
			/*
			 * Let the records held back by the delay gather until the delay
			 * passes; look at the durable position again meanwhile.
			 */
			if (waiting)
				wait_ms = worker_batch_delay_left_ms(now);
			if (held)
			{
				if (held_since == 0)
					held_since = now;
				wait_ms = Min(wait_ms, worker_durable_poll_ms(held_since, now));
				worker_report_held(durable);
			}
			worker_nap(wait_ms);
			if (ShutdownRequestPending)
				return WORKER_SHUTDOWN;
			if (ConfigReloadPending)
				return WORKER_OK;
			continue;
		}

		/* Send what is appended; read the oldest batch's replies. */
		deadline = idem_vc_now_ms() + idem_valkey_command_timeout_ms;
		r = worker_flush(deadline);
		if (r != WORKER_OK)
			return worker_window_failed(r);

		/* No backlog: sleep out the delay before reading the replies. */
		slept = nin == 1 && worker_batch_delay_sleep();
		if (ShutdownRequestPending)
			return WORKER_SHUTDOWN;
		if (slept)
			deadline = idem_vc_now_ms() + idem_valkey_command_timeout_ms;
		b = &inflight[first];
		for (i = 0, ok = 0, nrej = 0; i < b->nsent; i++)
		{
			WorkerReplyClass class;

			r = worker_read_reply(deadline, slept && i == 0, &class);
			if (r != WORKER_OK)
				return worker_window_failed(r);
			if (class == WORKER_REPLY_RETRY)
				return WORKER_FAILED;	/* worker_errbuf has the reply; batches kept */
			if (class == WORKER_REPLY_REJECT)
				nrej++;
			else
				ok++;
		}
		idem_ring_consume(b->end_pos, b->nrecords);
		nrej += b->unencodable;
		idem_stats_add(IDEM_STAT_COPIED, ok);
		idem_stats_add(IDEM_STAT_REJECTED, nrej);
		worker_count_skips(&b->skips);
		*copied += ok;
		*rejected += nrej;
		first = (first + 1) % IDEM_INFLIGHT;
		nin--;
		nrecords_in -= b->nrecords;
		/* answered well in time: let the window grow back */
		if (worker_send_window < IDEM_WINDOW_MAX &&
			idem_vc_now_ms() - b->sent_at < idem_valkey_command_timeout_ms / 2)
			worker_send_window = Min(IDEM_WINDOW_MAX, worker_send_window * 2);
	}
}

/*
 * Records up to here were sent ahead of a stuck batch (positions only grow;
 * one before the ring's tail means nothing is ahead).
 */
static uint64 worker_ahead_pos = 0;

/*
 * The head batch is stuck on a node that does not answer (down, failing over):
 * send the records behind it, up to IDEM_AHEAD_BATCHES batches, to the nodes
 * that do answer, so that one node's outage does not hold back every other
 * node's copies.  Nothing is consumed or counted here: each record still
 * leaves the queue only through worker_drain_cluster(), which sends it again
 * (a SET is idempotent) once the batches before it are acknowledged.  Each
 * retry sends only what was not sent ahead yet.
 */
static WorkerResult
worker_cluster_send_ahead(uint64 pos, XLogRecPtr durable, TimeLineID timeline,
						  uint64 *acked)
{
	const IdemRingRecord *records[IDEM_BATCH_MAX];
	char		scratch[256];
	WorkerEncoder enc;
	WorkerResult result = WORKER_OK;
	int			b;

	pos = Max(pos, worker_ahead_pos);
	for (b = 0; b < IDEM_AHEAD_BATCHES; b++)
	{
		bool		held;
		XLogRecPtr	flush_to;
		uint64		ok,
					nrej;
		int			n = idem_ring_peek(&pos, records, IDEM_BATCH_MAX, durable,
										 &held, &flush_to);

		if (n == 0)
			break;
		worker_encoder_init(&enc, timeline);
		if (worker_router_copy(records, n, NULL, worker_encode_record, &enc,
							   &ok, &nrej, scratch, sizeof(scratch)) == WORKER_ROUTER_STOPPING)
			result = WORKER_SHUTDOWN;
		worker_encoder_done(&enc);
		if (result != WORKER_OK)
			break;
		*acked += ok;
		worker_ahead_pos = pos;
	}
	return result;
}

/*
 * worker_drain_single() for a Valkey Cluster: the same durable records, one
 * batch at a time through worker_router.c (every node's share is sent before
 * any reply is read); a batch leaves the queue only when every node answered.
 * A batch that is not acknowledged stays queued, and the batches behind it are
 * sent ahead to the nodes that answer (worker_cluster_send_ahead).  While it
 * is stuck, each try sends only its records not settled yet (head_done): a
 * node that answered is not sent the same SETs every IDEM_STUCK_RETRY_MS for
 * as long as another node is down.  Batches keep idem.valkey_batch_delay as in
 * worker_drain_single() (worker_batch_delay_holds, worker_batch_delay_sleep):
 * the worker sends a batch to every master it has copies for
 * (worker_router_send), sleeps out the delay, then reads every master's
 * replies (worker_router_collect) and sends the next batch in the same wakeup;
 * a stuck batch's retries keep their own pace.
 */
WorkerResult
worker_drain_cluster(uint64 *copied, uint64 *rejected)
{
	const IdemRingRecord *records[IDEM_BATCH_MAX];
	bool		standby_reported = false;
	bool		stuck = false;	/* the head batch waits for a node */
	TimestampTz stuck_tried = 0;
	TimestampTz held_since = 0; /* when the wait for durability began */

	/*
	 * The stuck head batch: its first head_n records as the last try saw
	 * them, which of them are settled, and the counts of those.  Only this
	 * function consumes the queue, so while it stays here the head batch
	 * keeps its records (more may join it); checked anyway.
	 */
	const IdemRingRecord *head[IDEM_BATCH_MAX];
	bool		head_done[IDEM_BATCH_MAX];
	int			head_n = 0;
	TimeLineID	head_timeline = 0;
	uint64		head_ok = 0;
	uint64		head_rej = 0;
	WorkerSkips	head_skips;

	memset(&head_skips, 0, sizeof(head_skips));

	*copied = 0;
	*rejected = 0;
	for (;;)
	{
		uint64		pos = 0;	/* from the oldest record */
		bool		held = false;
		bool		standby_problem;
		TimeLineID	timeline;
		XLogRecPtr	durable = worker_durable_lsn(&timeline, &standby_problem);
		TimestampTz now;
		WorkerEncoder enc;
		uint64		ok = 0;
		uint64		nrej = 0;
		uint64		unencodable = 0;
		int			sent;
		bool		slept;
		WorkerRouterCopy rc;
		XLogRecPtr	flush_to;
		int			n;

		if (standby_problem && !standby_reported)
		{
			worker_report_standby();
			standby_reported = true;
		}
		if (ShutdownRequestPending)
			return WORKER_SHUTDOWN;
		if (ConfigReloadPending || !worker_epoch_ready())
			return WORKER_OK;
		n = idem_ring_peek(&pos, records, IDEM_BATCH_MAX, durable, &held,
							 &flush_to);
		worker_flush_wal(flush_to);
		if (n == 0)
		{
			if (!held)
			{
				idem_ring_consume(pos, 0);	/* past any padding */
				return WORKER_OK;
			}
			if (held_since == 0)
				held_since = GetCurrentTimestamp();
			worker_report_held(durable);
			worker_nap(worker_durable_poll_ms(held_since, GetCurrentTimestamp()));
			continue;
		}
		held_since = 0;
		if (stuck && !TimestampDifferenceExceeds(stuck_tried, GetCurrentTimestamp(),
												 IDEM_STUCK_RETRY_MS))
		{
			/* between tries of the stuck batch: only what came in since */
			uint64		acked = 0;

			if (worker_cluster_send_ahead(pos, durable, timeline, &acked) == WORKER_SHUTDOWN)
				return WORKER_SHUTDOWN;
			worker_nap(IDEM_STUCK_POLL_MS);
			continue;
		}
		now = GetCurrentTimestamp();
		if (!stuck && worker_batch_delay_holds(n, now))
		{
			/* Let them gather until the delay lets them go. */
			worker_nap(worker_batch_delay_left_ms(now));
			continue;
		}
		if (!stuck || timeline != head_timeline || n < head_n ||
			memcmp(head, records, head_n * sizeof(records[0])) != 0)
		{
			head_n = 0;			/* a new head batch: nothing settled */
			head_ok = head_rej = 0;
			memset(&head_skips, 0, sizeof(head_skips));
			head_timeline = timeline;
		}
		memcpy(head + head_n, records + head_n,
			   (n - head_n) * sizeof(records[0]));
		memset(head_done + head_n, 0, (n - head_n) * sizeof(bool));
		head_n = n;
		worker_encoder_init(&enc, timeline);
		sent = worker_router_send(records, n, head_done, worker_encode_record, &enc,
								  &unencodable);
		worker_encoder_done(&enc);
		/* a skipped record is settled (head_done): not encoded again */
		worker_skips_add(&head_skips, &enc.skips);
		if (sent < 0)
			return WORKER_SHUTDOWN;
		/*
		 * Pace what was sent (nothing, when every record is unencodable or
		 * settled); with no backlog, sleep out the delay before reading the
		 * replies.
		 */
		slept = false;
		if (sent > 0)
		{
			worker_batch_delay_start(now);
			slept = !stuck && n < IDEM_BATCH_EAGER && worker_batch_delay_sleep();
		}
		if (ShutdownRequestPending)
			return WORKER_SHUTDOWN;
		rc = worker_router_collect(slept, &ok, &nrej,
								   worker_errbuf, sizeof(worker_errbuf));
		if (rc == WORKER_ROUTER_STOPPING)
			return WORKER_SHUTDOWN;
		head_ok += ok;
		head_rej += nrej + unencodable;
		if (rc == WORKER_ROUTER_NOT_ACKED)
		{
			/* worker_errbuf says why; the batch is kept */
			uint64		acked = ok;

			if (worker_cluster_send_ahead(pos, durable, timeline, &acked) == WORKER_SHUTDOWN)
				return WORKER_SHUTDOWN;
			if (acked == 0 && !stuck)
				return WORKER_FAILED;	/* no node answered: back off */

			/*
			 * Some nodes answer, one does not (a failover): stay, so that
			 * the others keep getting their copies as commits come in, and
			 * try the stuck batch again shortly (the router re-reads the
			 * slot map and finds the promoted replica).  Once stuck, stay
			 * until the batch goes: a try costs little while its node rests.
			 */
			if (!stuck)
				worker_report_problem("copying results to", IDEM_STUCK_RETRY_MS, true);
			stuck = true;
			stuck_tried = GetCurrentTimestamp();
			worker_nap(IDEM_STUCK_POLL_MS);
			continue;
		}
		stuck = false;
		idem_ring_consume(pos, n);
		idem_stats_add(IDEM_STAT_COPIED, head_ok);
		idem_stats_add(IDEM_STAT_REJECTED, head_rej);
		worker_count_skips(&head_skips);
		*copied += head_ok;
		*rejected += head_rej;
	}
}
