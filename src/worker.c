/*-------------------------------------------------------------------------
 *
 * worker.c
 *	  The background worker that drains the commit ring into Valkey: its
 *	  registration and its main loop (connect, the epoch owner checks, a
 *	  drain, back off after a failure, sleep while the queue is empty).
 *	  Its mechanisms are in worker_*.c (worker_int.h lists them).
 *
 * One worker runs when idem is preloaded; the postmaster restarts it
 * IDEM_WORKER_RESTART_S seconds after it exits (it always exits with code 1,
 * also on SIGTERM, so that a killed worker comes back).  It needs no
 * database connection, only shared memory.  It starts on a standby too,
 * once recovery is consistent, but there it only watches the epoch list
 * (worker_standby_wait) until the promotion.
 *
 * It takes the oldest queued records in batches of up to IDEM_BATCH_MAX,
 * writes each as
 *
 *	  SET <key> <value> PX <ms until the row's expires_at>
 *
 * (worker_encode.c) pipelined, with up to IDEM_INFLIGHT batches written
 * ahead of the replies it reads, and removes a batch from the queue only
 * when all its replies have come back; a record whose retention has
 * already ended is skipped (worker_drain.c).
 *
 * Batching is Nagle-like: what is queued and durable goes out at once when
 * no batch is in flight; what is queued while one is in flight gathers
 * until its replies are in and then goes out as the next batch, unless
 * IDEM_BATCH_EAGER records wait (a backlog: then up to IDEM_INFLIGHT batches
 * are pipelined).  So under load a batch holds what committed during one
 * round trip to Valkey instead of each commit costing both processes a
 * wakeup.  idem.valkey_batch_delay (1 ms by default) also keeps batches at
 * least that far apart, trading copy latency for fewer wakeups (a lone
 * commit after a quiet spell still goes out at once): the worker sleeps
 * out the delay after sending a batch and reads its replies when it wakes,
 * so that a batch costs it one wakeup (with its write and read, tens of
 * microseconds of CPU), not one for the replies and one for the delay
 * (worker_durable.c).  The same holds on a Valkey Cluster
 * (worker_drain_cluster), where a batch is one write to each master it has
 * copies for and their replies are read after the sleep.
 * While the worker is awake, committing backends do not set its latch
 * (commit_ring.c).  An error reply that says the server cannot take
 * writes now (valkey_reply.c) counts a copy error and keeps the batch;
 * any other condemns its record only, dropped and counted in rejected.
 * A connection that fails,
 * or a batch not answered within idem.valkey_command_timeout, closes the
 * connection and keeps the batch queued; the worker reconnects after a
 * delay that doubles from IDEM_BACKOFF_MIN_MS to IDEM_BACKOFF_MAX_MS and
 * returns to the minimum after a batch goes through.
 *
 * All socket I/O is non-blocking (the router's, worker_router.c) and
 * waited for on a WaitEventSet that includes the process latch, so SIGTERM
 * and SIGHUP are answered at once even while Valkey hangs.  On SIGHUP the
 * configuration is reloaded; a change of host, port, password or database
 * reconnects immediately, a change of prefix or timeouts applies to the
 * next batch.
 *
 * Locking: none of its own; the worker is one single-threaded process.
 * Every Valkey reply is freed before anything is reported, and the
 * password is never logged.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "miscadmin.h"
#include "postmaster/bgworker.h"
#include "postmaster/interrupt.h"
#include "storage/ipc.h"
#include "tcop/tcopprot.h"
#include "utils/guc.h"
#include "utils/resowner.h"
#include "utils/timestamp.h"

#include "worker.h"
#include "cache_secret.h"
#include "commit_ring.h"
#include "stats.h"
#include "worker_router.h"
#include "worker_int.h"

#define IDEM_WORKER_RESTART_S	2
#define IDEM_BACKOFF_MIN_MS		100
/*
 * At most this long between attempts while Valkey is down: a connect to a
 * server that is not there costs next to nothing, and every second more is
 * a second of copies not made once it is back.
 */
#define IDEM_BACKOFF_MAX_MS		1000
/* a cluster's batch stuck on one node (a failover): retry this often */
#define IDEM_BACKOFF_CLUSTER_MAX_MS	400
#define IDEM_IDLE_WAIT_MS		10000
/*
 * The longest sleep while a copy is counted in but not reserved: its
 * committer wakes the worker once it is published, so this only bounds a
 * wait for one that never comes (the ring had no room for its bytes).
 */
#define IDEM_COMING_WAIT_MS		128

void
idem_worker_register(void)
{
	BackgroundWorker worker;

	memset(&worker, 0, sizeof(worker));
	worker.bgw_flags = BGWORKER_SHMEM_ACCESS;
	/* on a standby too: it watches the epoch list (worker_standby_wait) */
	worker.bgw_start_time = BgWorkerStart_ConsistentState;
	worker.bgw_restart_time = IDEM_WORKER_RESTART_S;
	strlcpy(worker.bgw_library_name, "idem", BGW_MAXLEN);
	strlcpy(worker.bgw_function_name, "idem_worker_main", BGW_MAXLEN);
	strlcpy(worker.bgw_name, "idem valkey worker", BGW_MAXLEN);
	strlcpy(worker.bgw_type, "idem worker", BGW_MAXLEN);
	worker.bgw_main_arg = (Datum) 0;
	worker.bgw_notify_pid = 0;
	RegisterBackgroundWorker(&worker);
}

/*
 * After a failed connect or batch: drop the connection, report, and set the
 * next attempt *backoff_ms from now, doubling the delay up to the maximum.
 */
static void
worker_backoff(const char *doing, int *backoff_ms, TimestampTz *retry_at)
{
	worker_disconnect();
	worker_report_problem(doing, *backoff_ms, true);
	*retry_at = TimestampTzPlusMilliseconds(GetCurrentTimestamp(), *backoff_ms);
	*backoff_ms = Min(*backoff_ms * 2, IDEM_BACKOFF_MAX_MS);
}

static void
worker_on_exit(int code, Datum arg)
{
	idem_ring_detach_worker();
	worker_disconnect();
}

void
idem_worker_main(Datum main_arg)
{
	int			backoff_ms = IDEM_BACKOFF_MIN_MS;
	TimestampTz retry_at = 0;

	pqsignal(SIGHUP, SignalHandlerForConfigReload);
	pqsignal(SIGTERM, SignalHandlerForShutdownRequest);
	pqsignal(SIGPIPE, SIG_IGN);
	BackgroundWorkerUnblockSignals();

	if (!idem_ring_available())
		ereport(FATAL,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idem worker started without idem's shared memory"),
				 errhint("Load idem through shared_preload_libraries.")));

	/* A resource owner, for the PostgreSQL routines that need one. */
	CurrentResourceOwner = ResourceOwnerCreate(NULL, "idem worker");
	before_shmem_exit(worker_on_exit, (Datum) 0);
	idem_stats_set_valkey(false, NULL);
	idem_ring_attach_worker();

	worker_standby_wait();

	/*
	 * Create the cache secret now if there is none, so that a primary has it
	 * before any base backup copies its data directory to a standby.
	 */
	{
		IdemCacheSecrets secrets;

		idem_cache_secrets_get(&secrets);
		explicit_bzero(&secrets, sizeof(secrets));
	}

	while (!ShutdownRequestPending)
	{
		uint64		copied;
		uint64		rejected;
		WorkerResult r;

		CHECK_FOR_INTERRUPTS();
		if (ConfigReloadPending)
		{
			ConfigReloadPending = false;
			ProcessConfigFile(PGC_SIGHUP);
			if (!worker_connected() || worker_settings_changed())
			{
				/* Reconnect now, to new settings or for a new try. */
				if (worker_connected())
					worker_disconnect();
				retry_at = 0;
				backoff_ms = IDEM_BACKOFF_MIN_MS;
			}
		}

		if (!worker_connected())
		{
			long		wait_ms = TimestampDifferenceMilliseconds(GetCurrentTimestamp(),
																  retry_at);

			if (wait_ms > 0)
			{
				worker_nap(wait_ms);
				continue;
			}
			r = worker_connect();
			if (r == WORKER_SHUTDOWN)
				break;
			if (r != WORKER_OK)
			{
				worker_backoff("connecting to", &backoff_ms, &retry_at);
				continue;
			}
			idem_stats_set_valkey(true, NULL);
			worker_owner_checked_at = 0;	/* Valkey may have lost it meanwhile */
			if (worker_router_active())
				ereport(LOG,
						(errmsg("connected to Valkey Cluster at %s:%d (%s)",
								worker_valkey_host, worker_valkey_port,
								worker_router_describe())));
			else
				ereport(LOG,
						(errmsg("connected to Valkey at %s:%d",
								worker_valkey_host, worker_valkey_port)));
		}

		{
			bool		check = TimestampDifferenceExceeds(worker_owner_checked_at,
														   GetCurrentTimestamp(),
														   IDEM_OWNER_CHECK_MS);

			r = worker_check_owner();
			if (r == WORKER_OK)
				r = worker_cluster_owners(check);

			/*
			 * On a Valkey Cluster the owner key lives on one master.  While
			 * that master is down runners trust no value (they read the
			 * owner key in the same round trip), but the copies owed to
			 * the masters that are up still go out, so that the cache is
			 * warm when it is back; the check is tried again next time.
			 */
			if (r == WORKER_FAILED && worker_router_active())
			{
				worker_report_problem("checking the history epoch's owner key at",
									  0, false);
				r = WORKER_OK;
			}
		}
		if (r == WORKER_OK)
			r = worker_take_epoch();
		if (r == WORKER_OK)
			r = worker_router_active() ? worker_drain_cluster(&copied, &rejected) :
				worker_drain_single(&copied, &rejected);
		if (r == WORKER_SHUTDOWN)
			break;
		if (r != WORKER_OK)
		{
			bool		cluster = worker_router_active();

			worker_backoff("copying results to", &backoff_ms, &retry_at);
			/*
			 * A cluster's batch stuck on one node is most likely a failover:
			 * its replica takes over within cluster-node-timeout, and the
			 * other nodes' copies went ahead; retry often enough to follow
			 * the promotion closely.
			 */
			if (cluster)
				backoff_ms = Min(backoff_ms, IDEM_BACKOFF_CLUSTER_MAX_MS);
			continue;
		}
		if (rejected > 0)
			worker_report_problem("writing to", 0, false);
		else if (copied > 0)
		{
			if (worker_failing)
				ereport(LOG,
						(errmsg("copying results to Valkey at %s:%d again",
								worker_valkey_host, worker_valkey_port)));
			worker_failing = false;
			backoff_ms = IDEM_BACKOFF_MIN_MS;
		}

		/*
		 * The queue was empty when worker_drain_single() last looked.  Sleep,
		 * and let commits wake us, unless a commit came in meanwhile.  A copy
		 * counted in but not reserved yet (its committer between the two) does
		 * not keep us awake: its committer, and every commit that passes it,
		 * wakes us (idem_ring_worker_sleepy).
		 */
		if (!ConfigReloadPending)
		{
			bool		coming;

			if (idem_ring_worker_sleepy(&coming))
			{
				worker_nap(coming ? IDEM_COMING_WAIT_MS : IDEM_IDLE_WAIT_MS);
				idem_ring_worker_awake();
				/* Valkey may have lost it while we slept (a flush) */
				worker_owner_checked_at = 0;
			}
		}
	}

	proc_exit(1);
}
