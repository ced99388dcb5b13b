/*-------------------------------------------------------------------------
 *
 * worker.c
 *	  The background worker that drains the commit queue into Valkey.
 *
 * One worker runs when idem is preloaded; the postmaster restarts it
 * IDEM_WORKER_RESTART_S seconds after it exits (it always exits with code 1,
 * also on SIGTERM, so that a killed worker comes back).  It needs no
 * database connection, only shared memory.
 *
 * It takes the oldest queued records in batches of up to IDEM_BATCH_MAX,
 * writes each as
 *
 *	  SET <key> <value> PX <ms until the row's expires_at>
 *
 * pipelined, with up to IDEM_INFLIGHT batches written ahead of the replies
 * it reads, and removes a batch from the queue only when all its replies
 * have come back; a record whose retention has already ended is skipped.
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
 * microseconds of CPU), not one for the replies and one for the delay.
 * The same holds on a Valkey Cluster (vk_cluster_drain), where a batch is
 * one write to each master it has copies for and their replies are read
 * after the sleep.
 * While the worker is awake, committing backends do not set its latch
 * (outbox_ring.c).  An error reply that says the server cannot take
 * writes now (vk_classify_error) counts a copy error and keeps the batch;
 * any other condemns its record only, dropped and counted in rejected.
 * A connection that fails,
 * or a batch not answered within idem.valkey_command_timeout, closes the
 * connection and keeps the batch queued; the worker reconnects after a
 * delay that doubles from IDEM_BACKOFF_MIN_MS to IDEM_BACKOFF_MAX_MS and
 * returns to the minimum after a batch goes through.
 *
 * All socket I/O is non-blocking and waited for on a WaitEventSet that
 * includes the process latch, so SIGTERM and SIGHUP are answered at once
 * even while Valkey hangs.  On SIGHUP the configuration is reloaded; a
 * change of host, port, password or database reconnects immediately, a
 * change of prefix or timeouts applies to the next batch.
 *
 * hiredis is used here and nowhere else in the extension.  Every reply is
 * freed before anything is reported, and the password is never logged.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <sys/socket.h>

#include <hiredis/hiredis.h>

#include "access/xlog.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "postmaster/bgworker.h"
#include "postmaster/interrupt.h"
#include "storage/fd.h"
#include "storage/ipc.h"
#include "storage/latch.h"
#include "tcop/tcopprot.h"
#include "utils/datetime.h"
#include "utils/guc.h"
#include "utils/memutils.h"
#include "utils/resowner.h"
#include "utils/timestamp.h"

#include "worker.h"
#include "cache_cluster.h"
#include "cache_format.h"
#include "cache_keyspace.h"
#include "cache_secret.h"
#include "compat.h"
#include "guc.h"
#include "outbox_ring.h"
#include "sha256.h"
#include "standby_slots.h"
#include "stats.h"
#include "worker_cluster.h"

#define IDEM_WORKER_RESTART_S	2
#define IDEM_BATCH_MAX			512
#define IDEM_BACKOFF_MIN_MS		100
/*
 * At most this long between attempts while Valkey is down: a connect to a
 * server that is not there costs next to nothing, and every second more is
 * a second of copies not made once it is back.
 */
#define IDEM_BACKOFF_MAX_MS		1000
/* a cluster's batch stuck on one node (a failover): retry this often */
#define IDEM_BACKOFF_CLUSTER_MAX_MS	400
/* batches sent ahead of a stuck one, to the nodes that answer */
#define IDEM_AHEAD_BATCHES		8
/* while one node does not answer and the others do: send what comes in
 * this often, and try the stuck batch again this often */
#define IDEM_STUCK_POLL_MS		20
#define IDEM_STUCK_RETRY_MS		100
#define IDEM_IDLE_WAIT_MS		10000
/* Naps while a copy is counted in but not reserved: from 1 ms, doubling. */
#define IDEM_COMING_MAX_MS		128
/* A backlog: batches are pipelined ahead of replies when this many wait. */
#define IDEM_BATCH_EAGER		256
#define IDEM_LOG_INTERVAL_MS	10000
#define IDEM_ERRBUF_LEN			200
/*
 * How often to look at the durable WAL position while copies wait for it
 * (durable_poll_ms): a quarter of the time they have waited so far, at
 * least every IDEM_DURABLE_POLL_MS (a standby's reply comes within
 * milliseconds) and at most every IDEM_DURABLE_SLOW_POLL_MS.  A copy thus
 * goes out at most a quarter (and a millisecond) later than its commit
 * became durable, while a wait for the WAL writer (synchronous_commit off:
 * up to three wal_writer_delay cycles) or for a stopped standby costs tens
 * of wakeups a second, not a thousand.
 */
/*
 * How long the epoch owner key lives after the last start that took the
 * epoch over: a server stopped for longer starts with a cold cache.
 */
#define IDEM_EPOCH_OWNER_TTL_MS		(INT64CONST(30) * 24 * 3600 * 1000)
/*
 * How often the worker checks that its epoch owner key still holds its
 * token (and pushes its expiry back): a copy of this server may have
 * retired it, or Valkey lost it (cache_secret.c).  Runners check it at
 * every lookup, so this only bounds how long the cache stays unused.
 */
#define IDEM_OWNER_CHECK_MS			1000
#define IDEM_DURABLE_POLL_MS		1
#define IDEM_DURABLE_SLOW_POLL_MS	20
#define IDEM_DURABLE_POLL_DIVISOR	4

typedef enum VkResult
{
	VK_OK,
	VK_FAILED,					/* errbuf says why */
	VK_SHUTDOWN					/* SIGTERM arrived while waiting */
} VkResult;

/* The connection, and the settings it was made with. */
static redisContext *vk = NULL;
static WaitEventSet *vk_wes = NULL;
static int	vk_sock_pos = -1;
static char *vk_host = NULL;
static int	vk_port = 0;
static char *vk_password = NULL;
static int	vk_db = 0;
static char *vk_nodes = NULL;	/* idem.valkey_nodes */
static int	vk_cluster = IDEM_VALKEY_CLUSTER_AUTO;

static char errbuf[IDEM_ERRBUF_LEN];

static void worker_report_problem(const char *doing, int retry_ms, bool is_error);
static TimestampTz last_logged = 0;
static bool failing = false;	/* last attempt failed; log the recovery */

void
idem_worker_register(void)
{
	BackgroundWorker worker;

	memset(&worker, 0, sizeof(worker));
	worker.bgw_flags = BGWORKER_SHMEM_ACCESS;
	worker.bgw_start_time = BgWorkerStart_RecoveryFinished;
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
 * Wait until the socket is ready for events, or until deadline.  Wakeups of
 * the latch (committing backends, SIGHUP) are absorbed; the caller's main
 * loop looks at the queue and the configuration again afterwards.
 */
static VkResult
vk_wait(uint32 events, TimestampTz deadline, const char *what)
{
	ModifyWaitEvent(vk_wes, vk_sock_pos, events, NULL);
	for (;;)
	{
		WaitEvent	ev;
		long		timeout;
		int			rc;

		if (ShutdownRequestPending)
			return VK_SHUTDOWN;
		timeout = TimestampDifferenceMilliseconds(GetCurrentTimestamp(),
												  deadline);
		if (timeout <= 0)
		{
			snprintf(errbuf, sizeof(errbuf), "timed out %s", what);
			return VK_FAILED;
		}
		rc = WaitEventSetWait(vk_wes, timeout, &ev, 1, PG_WAIT_EXTENSION);
		if (rc > 0 && (ev.events & WL_LATCH_SET))
		{
			ResetLatch(MyLatch);
			continue;
		}
		if (rc > 0 && (ev.events & events))
			return VK_OK;
	}
}

static void
vk_context_error(const char *what)
{
	snprintf(errbuf, sizeof(errbuf), "%s: %s", what,
			 (vk != NULL && vk->err) ? vk->errstr : "out of memory");
}

/* Write everything appended to the context. */
static VkResult
vk_flush(TimestampTz deadline)
{
	int			done = 0;

	for (;;)
	{
		VkResult	r;

		if (redisBufferWrite(vk, &done) != REDIS_OK)
		{
			vk_context_error("could not send");
			return VK_FAILED;
		}
		if (done)
			return VK_OK;
		r = vk_wait(WL_SOCKET_WRITEABLE, deadline, "sending to Valkey");
		if (r != VK_OK)
			return r;
	}
}

/* What a reply to one SET means for its record. */
typedef enum VkReplyClass
{
	VK_REPLY_OK,				/* written */
	VK_REPLY_RETRY,				/* the server cannot take writes now: keep
								 * the batch, reconnect, resend */
	VK_REPLY_REJECT				/* this record cannot be written: drop it */
} VkReplyClass;

/*
 * Classify an error reply by its code (the first word).  The codes that say
 * "not now" keep the batch; anything else (WRONGTYPE, a per-key NOPERM, and
 * for now the cluster redirections MOVED and ASK) condemns its record only.
 */
static VkReplyClass
vk_classify_error(const char *str, size_t len)
{
	static const char *const not_now[] = {
		"READONLY", "LOADING", "NOAUTH", "MASTERDOWN", "BUSY", "OOM",
		"CLUSTERDOWN", "TRYAGAIN", "MISCONF", NULL
	};
	size_t		codelen = 0;
	int			i;

	while (codelen < len && str[codelen] != ' ')
		codelen++;
	for (i = 0; not_now[i] != NULL; i++)
		if (codelen == strlen(not_now[i]) &&
			memcmp(str, not_now[i], codelen) == 0)
			return VK_REPLY_RETRY;
	return VK_REPLY_REJECT;
}

/*
 * Wait for the next reply and hand it over in *reply (the caller frees it).
 * read_first: the replies are most likely in already (the worker slept
 * since it sent): read before waiting for the socket.
 */
static VkResult
vk_next_reply(TimestampTz deadline, bool read_first, redisReply **reply)
{
	for (;;)
	{
		void	   *r = NULL;
		VkResult	vr;

		if (read_first)
		{
			/* non-blocking: nothing to read is no error */
			if (redisBufferRead(vk) != REDIS_OK)
			{
				vk_context_error("could not read");
				return VK_FAILED;
			}
			read_first = false;
		}
		if (redisGetReplyFromReader(vk, &r) != REDIS_OK)
		{
			vk_context_error("could not parse the reply");
			return VK_FAILED;
		}
		if (r != NULL)
		{
			*reply = (redisReply *) r;
			return VK_OK;
		}
		vr = vk_wait(WL_SOCKET_READABLE, deadline, "waiting for Valkey's reply");
		if (vr != VK_OK)
			return vr;
		if (redisBufferRead(vk) != REDIS_OK)
		{
			vk_context_error("could not read");
			return VK_FAILED;
		}
	}
}

/*
 * Read the next reply.  On VK_OK, *class says what it means (for an error
 * reply its text is then in errbuf); the reply itself is already freed.
 */
static VkResult
vk_read_reply(TimestampTz deadline, bool read_first, VkReplyClass *class)
{
	redisReply *rr;
	VkResult	r = vk_next_reply(deadline, read_first, &rr);

	if (r != VK_OK)
		return r;
	*class = VK_REPLY_OK;
	if (rr->type == REDIS_REPLY_ERROR)
	{
		*class = vk_classify_error(rr->str, rr->len);
		snprintf(errbuf, sizeof(errbuf), "Valkey replied: %.*s",
				 (int) rr->len, rr->str);
	}
	freeReplyObject(rr);
	return VK_OK;
}

/* Connected: to one Valkey (vk), or to a cluster (worker_cluster.c). */
static bool
vk_connected(void)
{
	return vk != NULL || idem_wc_active();
}

static void
vk_disconnect(void)
{
	idem_wc_disconnect();
	if (vk_wes != NULL)
	{
		FreeWaitEventSet(vk_wes);
		vk_wes = NULL;
	}
	if (vk != NULL)
	{
		redisFree(vk);
		vk = NULL;
	}
	idem_stats_set_valkey(false, NULL);
}

/*
 * The password to send: idem.valkey_password, else the first line of
 * idem.valkey_password_file (read now, so a changed file is picked up at
 * the next connect or reload), else none.  A file that cannot be read
 * yields NULL, with the reason (never the password) in errbuf.
 */
static char *
vk_current_password(void)
{
	FILE	   *f;
	char		line[1024];
	size_t		n;

	if (idem_valkey_password && idem_valkey_password[0] != '\0')
		return pstrdup(idem_valkey_password);
	if (idem_valkey_password_file == NULL || idem_valkey_password_file[0] == '\0')
		return pstrdup("");
	f = AllocateFile(idem_valkey_password_file, "r");
	if (f == NULL)
	{
		snprintf(errbuf, sizeof(errbuf), "could not open idem.valkey_password_file \"%s\": %s",
				 idem_valkey_password_file, strerror(errno));
		return NULL;
	}
	if (fgets(line, sizeof(line), f) == NULL)
		line[0] = '\0';
	FreeFile(f);
	n = strlen(line);
	while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r'))
		line[--n] = '\0';
	return pstrdup(line);
}

/* Remember the settings a connection is made with; false if unusable. */
static bool
vk_remember_settings(void)
{
	char	   *password = vk_current_password();

	if (vk_host)
		pfree(vk_host);
	if (vk_password)
		pfree(vk_password);
	if (vk_nodes)
		pfree(vk_nodes);
	vk_nodes = MemoryContextStrdup(TopMemoryContext,
								   idem_valkey_nodes ? idem_valkey_nodes : "");
	vk_cluster = idem_valkey_cluster;
	vk_host = MemoryContextStrdup(TopMemoryContext, idem_valkey_host);
	vk_password = MemoryContextStrdup(TopMemoryContext, password ? password : "");
	vk_port = idem_valkey_port;
	vk_db = idem_valkey_db;
	if (password)
		pfree(password);
	return password != NULL;
}

static bool
vk_settings_changed(void)
{
	char	   *password;
	bool		changed;

	if (vk_host == NULL)
		return true;
	password = vk_current_password();
	changed = strcmp(vk_host, idem_valkey_host) != 0 ||
		password == NULL || strcmp(vk_password, password) != 0 ||
		vk_port != idem_valkey_port ||
		vk_db != idem_valkey_db ||
		vk_cluster != idem_valkey_cluster ||
		strcmp(vk_nodes, idem_valkey_nodes ? idem_valkey_nodes : "") != 0;
	if (password)
		pfree(password);
	return changed;
}

static VkResult
vk_connect(void)
{
	TimestampTz deadline;
	VkResult	r;
	int			sockerr = 0;
	socklen_t	len = sizeof(sockerr);
	int			nreplies = 0;
	int			i;

	if (!vk_remember_settings())
		return VK_FAILED;		/* errbuf says why */

	/* A Valkey Cluster (detected, or idem.valkey_cluster = on)? */
	switch (idem_wc_connect(vk_password, errbuf, sizeof(errbuf)))
	{
		case IDEM_WC_SINGLE:
			break;
		case IDEM_WC_CLUSTER:
			return VK_OK;
		case IDEM_WC_SHUTDOWN:
			return VK_SHUTDOWN;
		case IDEM_WC_MISCONFIGURED:
		case IDEM_WC_FAILED:
			return VK_FAILED;
	}

	vk = redisConnectNonBlock(vk_host, vk_port);
	if (vk == NULL || vk->err)
	{
		vk_context_error("could not connect");
		return VK_FAILED;
	}

	vk_wes = idem_create_wait_event_set(3);
	AddWaitEventToSet(vk_wes, WL_LATCH_SET, PGINVALID_SOCKET, MyLatch, NULL);
	AddWaitEventToSet(vk_wes, WL_EXIT_ON_PM_DEATH, PGINVALID_SOCKET, NULL, NULL);
	vk_sock_pos = AddWaitEventToSet(vk_wes, WL_SOCKET_WRITEABLE, vk->fd,
									NULL, NULL);

	deadline = TimestampTzPlusMilliseconds(GetCurrentTimestamp(),
										   idem_valkey_connect_timeout_ms);
	r = vk_wait(WL_SOCKET_WRITEABLE, deadline, "connecting");
	if (r != VK_OK)
		return r;
	if (getsockopt(vk->fd, SOL_SOCKET, SO_ERROR, &sockerr, &len) != 0)
		sockerr = errno;
	if (sockerr != 0)
	{
		snprintf(errbuf, sizeof(errbuf), "could not connect: %s",
				 strerror(sockerr));
		return VK_FAILED;
	}

	if (vk_password[0] != '\0')
	{
		const char *argv[2] = {"AUTH", vk_password};
		size_t		argvlen[2] = {4, strlen(vk_password)};

		if (redisAppendCommandArgv(vk, 2, argv, argvlen) != REDIS_OK)
		{
			vk_context_error("could not authenticate");
			return VK_FAILED;
		}
		nreplies++;
	}
	if (vk_db != 0)
	{
		if (redisAppendCommand(vk, "SELECT %d", vk_db) != REDIS_OK)
		{
			vk_context_error("could not select the database");
			return VK_FAILED;
		}
		nreplies++;
	}
	if (nreplies == 0)
		return VK_OK;

	deadline = TimestampTzPlusMilliseconds(GetCurrentTimestamp(),
										   idem_valkey_command_timeout_ms);
	r = vk_flush(deadline);
	for (i = 0; r == VK_OK && i < nreplies; i++)
	{
		VkReplyClass class;

		r = vk_read_reply(deadline, false, &class);
		if (r == VK_OK && class != VK_REPLY_OK)
			r = VK_FAILED;		/* errbuf holds the reply, not the password */
	}
	return r;
}

/*
 * One command outside any batch, on either connection: its reply in *reply
 * (the caller frees it), or VK_FAILED with errbuf saying why.  key routes
 * it on a cluster.
 */
static VkResult
vk_command(const char *key, size_t keylen, int argc, const char **argv,
		   const size_t *argvlen, redisReply **reply)
{
	TimestampTz deadline;
	VkResult	r;

	if (idem_wc_active())
	{
		bool		shutdown = false;

		*reply = idem_wc_command(key, keylen, argc, argv, argvlen,
								 &shutdown, errbuf, sizeof(errbuf));
		if (shutdown)
			return VK_SHUTDOWN;
		return *reply != NULL ? VK_OK : VK_FAILED;
	}
	if (redisAppendCommandArgv(vk, argc, argv, argvlen) != REDIS_OK)
	{
		vk_context_error("could not queue a command");
		return VK_FAILED;
	}
	deadline = TimestampTzPlusMilliseconds(GetCurrentTimestamp(),
										   idem_valkey_command_timeout_ms);
	r = vk_flush(deadline);
	if (r == VK_OK)
		r = vk_next_reply(deadline, false, reply);
	return r;
}

/* When the owner key was last checked (worker_check_owner). */
static TimestampTz owner_checked_at = 0;

/* The token an epoch's owner key holds (16 lower-case hex digits). */
#define OWNER_TOKEN_TEXT(buf, token) \
	snprintf((buf), sizeof(buf), "%016llx", (unsigned long long) (token))

/* Does a reply hold exactly that token's text? */
static bool
owner_reply_is(const redisReply *reply, const char *token)
{
	return reply->type == REDIS_REPLY_STRING &&
		reply->len == IDEM_CACHE_EPOCH_TOKEN_LEN &&
		memcmp(reply->str, token, IDEM_CACHE_EPOCH_TOKEN_LEN) == 0;
}

static VkResult vk_key_command(const char *key, int argc, const char **argv,
								redisReply **reply);

/*
 * One command on the owner key of epoch (timeline, epoch): argv[1] is set
 * to that key here, the other arguments are the caller's.  An error reply
 * is VK_FAILED, with errbuf saying it; on VK_OK *reply (if reply is not
 * NULL) is the caller's to free.
 */
static VkResult
vk_owner_command(TimeLineID timeline, uint64 epoch, int argc,
				 const char **argv, redisReply **reply)
{
	char		key[IDEM_CACHE_EPOCH_KEY_MAX];

	if (idem_cache_epoch_key_of(key, sizeof(key), timeline, epoch) < 0)
	{
		snprintf(errbuf, sizeof(errbuf), "idem.valkey_prefix is too long");
		return VK_FAILED;
	}
	return vk_key_command(key, argc, argv, reply);
}

/* The same on any key: argv[1] is set to key here. */
static VkResult
vk_key_command(const char *key, int argc, const char **argv,
			   redisReply **reply)
{
	size_t		argvlen[6];
	int			keylen = strlen(key);
	redisReply *rep = NULL;
	VkResult	r;

	Assert(argc <= lengthof(argvlen));
	argv[1] = key;
	for (int i = 0; i < argc; i++)
		argvlen[i] = strlen(argv[i]);
	r = vk_command(key, keylen, argc, argv, argvlen, &rep);
	if (r == VK_OK && rep->type == REDIS_REPLY_ERROR)
	{
		snprintf(errbuf, sizeof(errbuf), "Valkey replied: %.*s",
				 (int) rep->len, rep->str);
		r = VK_FAILED;
	}
	if (r == VK_OK && reply != NULL)
		*reply = rep;
	else if (rep != NULL)
		freeReplyObject(rep);
	return r;
}

/*
 * Take this start's epoch over (cache_secret.c's file header), if it is not
 * yet: retire the epoch it replaced, if any (its owner key gets a retired
 * marker naming this epoch, whatever it held: the runners still on it stop
 * trusting it at their next lookup); then SET <epoch owner key> <new
 * token> GET, and keep the epoch only if the value replaced is the token
 * this data directory recorded (none, for a new epoch); otherwise make a
 * new epoch and take that one over.  Until this succeeds nothing is copied
 * and runners get no keyspace.
 */
static VkResult
worker_take_epoch(void)
{
	IdemEpochTakeover t;
	int			tries;

	for (tries = 0; tries < 3 && idem_cache_epoch_takeover(&t); tries++)
	{
		char		token[IDEM_CACHE_EPOCH_TOKEN_LEN + 1];
		char		expect[IDEM_CACHE_EPOCH_TOKEN_LEN + 1];
		char		retired[sizeof(IDEM_CACHE_EPOCH_RETIRED) + 10 + 1 + 16];
		char		ttl[32];
		const char *argv[6];
		redisReply *reply = NULL;
		VkResult	r;
		bool		won;

		OWNER_TOKEN_TEXT(token, t.new_token);
		OWNER_TOKEN_TEXT(expect, t.expect_token);
		snprintf(ttl, sizeof(ttl), INT64_FORMAT, IDEM_EPOCH_OWNER_TTL_MS);
		if (t.retire_epoch != 0)
		{
			snprintf(retired, sizeof(retired), IDEM_CACHE_EPOCH_RETIRED "%u.%016llx",
					 t.timeline, (unsigned long long) t.epoch);
			argv[0] = "SET";
			argv[2] = retired;
			argv[3] = "PX";
			argv[4] = ttl;
			r = vk_owner_command(t.retire_timeline, t.retire_epoch, 5, argv, NULL);
			if (r != VK_OK)
				return r;
		}
		argv[0] = "SET";
		argv[2] = token;
		argv[3] = "PX";
		argv[4] = ttl;
		argv[5] = "GET";
		r = vk_owner_command(t.timeline, t.epoch, 6, argv, &reply);
		if (r != VK_OK)
			return r;
		if (t.expect_token == 0)
			won = reply->type == REDIS_REPLY_NIL;
		else
			won = owner_reply_is(reply, expect);
		freeReplyObject(reply);
		if (won)
		{
			idem_cache_epoch_taken(&t);
			owner_checked_at = GetCurrentTimestamp();
			ereport(LOG,
					(errmsg("idem: took cache epoch %016llx over in Valkey",
							(unsigned long long) t.epoch)));
		}
		else
			idem_cache_epoch_renew(t.epoch, IDEM_EPOCH_TAKEN_ELSEWHERE);
	}
	return VK_OK;
}

/*
 * Every IDEM_OWNER_CHECK_MS, after each connect and before the first copy
 * after an idle wait (so that the copies runners read next are vouched
 * for): does the owner key of
 * the epoch this server owns still hold its token?  If so its expiry is
 * pushed back.  If Valkey lost it (a restart without persistence, a flush,
 * an eviction), it is set again (SET NX): everything left under this
 * epoch's keyspace was written by this server, and runners trust nothing
 * there meanwhile.  If it holds anything else (another server started
 * from a copy of this one retired it or took it over), a new epoch is due,
 * which the main loop takes over next.
 */
static VkResult
worker_check_owner(void)
{
	IdemEpochTakeover t;
	char		token[IDEM_CACHE_EPOCH_TOKEN_LEN + 1];
	char		ttl[32];
	const char *argv[6];
	redisReply *reply = NULL;
	VkResult	r;
	bool		ours;
	bool		lost;

	if (!TimestampDifferenceExceeds(owner_checked_at, GetCurrentTimestamp(),
									IDEM_OWNER_CHECK_MS) ||
		!idem_cache_epoch_owned(&t))
		return VK_OK;
	OWNER_TOKEN_TEXT(token, t.new_token);
	snprintf(ttl, sizeof(ttl), INT64_FORMAT, IDEM_EPOCH_OWNER_TTL_MS);
	argv[0] = "GET";
	r = vk_owner_command(t.timeline, t.epoch, 2, argv, &reply);
	if (r != VK_OK)
		return r;
	ours = owner_reply_is(reply, token);
	lost = reply->type == REDIS_REPLY_NIL;
	freeReplyObject(reply);
	owner_checked_at = GetCurrentTimestamp();
	if (lost)
	{
		/* a racing writer wins: the next check sees it */
		argv[0] = "SET";
		argv[2] = token;
		argv[3] = "NX";
		argv[4] = "PX";
		argv[5] = ttl;
		return vk_owner_command(t.timeline, t.epoch, 6, argv, NULL);
	}
	if (!ours)
	{
		ereport(LOG,
				(errmsg("idem: cache epoch %016llx is no longer this server's in Valkey",
						(unsigned long long) t.epoch),
				 errdetail("Its owner key was retired or taken over by another server started from a copy of this data directory; a new epoch follows.")));
		idem_cache_epoch_renew(t.epoch, IDEM_EPOCH_TAKEN_ELSEWHERE);
		return VK_OK;
	}
	argv[0] = "PEXPIRE";
	argv[2] = ttl;
	return vk_owner_command(t.timeline, t.epoch, 3, argv, NULL);
}

/*
 * The owner keys of Citus cluster keyspaces (cache_cluster.c): retire the
 * ones a coordinator replaced and the one of a join this node's new epoch
 * ended (a retired marker, whatever the key held: runners still on that
 * keyspace stop trusting it at their next lookup), and set the
 * coordinator's.  With check (as often as worker_check_owner), the owner
 * keys the coordinator set are checked as its own: pushed back if they
 * hold its token, set again if Valkey lost them, and given up if a node
 * retired them.
 */
static VkResult
worker_cluster_owners(bool check)
{
	IdemEpochTakeover t;
	IdemClusterDuty d;
	bool		owned = idem_cache_epoch_owned(&t);
	char		ttl[32];
	char		token[IDEM_CACHE_EPOCH_TOKEN_LEN + 1];
	const char *argv[6];
	VkResult	r;

	snprintf(ttl, sizeof(ttl), INT64_FORMAT, IDEM_EPOCH_OWNER_TTL_MS);
	for (int n = 0; n < 3 * IDEM_CLUSTER_SLOTS &&
		 idem_cache_cluster_duty(&d, owned, t.timeline, t.epoch); n++)
	{
		argv[0] = "SET";
		argv[3] = "PX";
		argv[4] = ttl;
		if (d.kind == IDEM_CLUSTER_SET)
		{
			OWNER_TOKEN_TEXT(token, d.token);
			argv[2] = token;
		}
		else
			argv[2] = IDEM_CACHE_EPOCH_RETIRED "cluster";
		r = vk_key_command(d.key, 5, argv, NULL);
		if (r != VK_OK)
			return r;
		if (d.kind != IDEM_CLUSTER_SET)
			ereport(LOG,
					(errmsg("idem: retired the Citus cluster cache keyspace \"%s\"",
							d.keyspace),
					 errdetail(d.kind == IDEM_CLUSTER_RETIRE ?
							   "The coordinator named a new cluster keyspace." :
							   "This node's history epoch changed since it joined.")));
		idem_cache_cluster_duty_done(&d);
	}
	for (int i = 0; check && i < IDEM_CLUSTER_SLOTS; i++)
	{
		redisReply *reply = NULL;
		bool		ours;
		bool		lost;

		if (!idem_cache_cluster_owned(i, &d))
			continue;
		OWNER_TOKEN_TEXT(token, d.token);
		argv[0] = "GET";
		r = vk_key_command(d.key, 2, argv, &reply);
		if (r != VK_OK)
			return r;
		ours = owner_reply_is(reply, token);
		lost = reply->type == REDIS_REPLY_NIL;
		freeReplyObject(reply);
		if (lost)
		{
			argv[0] = "SET";
			argv[2] = token;
			argv[3] = "NX";
			argv[4] = "PX";
			argv[5] = ttl;
			r = vk_key_command(d.key, 6, argv, NULL);
		}
		else if (ours)
		{
			argv[0] = "PEXPIRE";
			argv[2] = ttl;
			r = vk_key_command(d.key, 3, argv, NULL);
		}
		else
		{
			ereport(LOG,
					(errmsg("idem: the Citus cluster cache keyspace \"%s\" was retired",
							d.keyspace),
					 errdetail("The history epoch of a node of the cluster changed; the next time a runner asks, the coordinator names a new keyspace.")));
			idem_cache_cluster_disown(&d);
		}
		if (r != VK_OK)
			return r;
	}
	return VK_OK;
}

/*
 * May records be copied now?  Not while the epoch is not taken over (a
 * renewal since the last batch): the drain then returns, and the main loop
 * takes the new epoch over first.
 */
static bool
worker_epoch_ready(void)
{
	uint64		epoch;

	return idem_cache_epoch_confirmed(&epoch);
}

/* Unix epoch milliseconds of a timestamp. */
static int64
epoch_ms(TimestampTz t)
{
	return t / 1000 +
		(int64) (POSTGRES_EPOCH_JDATE - UNIX_EPOCH_JDATE) * SECS_PER_DAY * 1000;
}

/*
 * What one batch's records are encoded with: the time, the timeline that
 * names the keyspace, the current secret's key id and its prepared HMAC key,
 * and the last database's keyspace.
 */
typedef struct VkEncoder
{
	TimestampTz now;
	TimeLineID	timeline;
	uint64		epoch;
	int32		key_id;			/* of keyspace_db */
	idem_hmac	mac_key;
	char		keyspace[IDEM_CACHE_KEYSPACE_MAX + 1];
	Oid			keyspace_db;
	bool		skip_db;		/* keyspace_db copies nothing (cache_cluster.c) */
	int32		own_key_id;		/* this server's own secret */
	idem_hmac	own_mac_key;
} VkEncoder;

static void
vk_encoder_init(VkEncoder *enc, TimeLineID timeline)
{
	IdemCacheSecrets secrets;

	enc->now = GetCurrentTimestamp();
	enc->timeline = timeline;
	enc->keyspace_db = InvalidOid;
	idem_cache_secrets_get(&secrets);
	enc->epoch = secrets.epoch;
	enc->own_key_id = secrets.current_id;
	idem_cache_mac_key(&enc->own_mac_key, &secrets);
	explicit_bzero(&secrets, sizeof(secrets));
}

/* The batch is encoded: wipe the key. */
static void
vk_encoder_done(VkEncoder *enc)
{
	explicit_bzero(&enc->mac_key, sizeof(enc->mac_key));
	explicit_bzero(&enc->own_mac_key, sizeof(enc->own_mac_key));
}

/*
 * One record as SET key value PX ttl (both modes use this): an idem2 value
 * in its database's keyspace on this timeline, MACed with the current
 * secret.  1 done, 0 nothing to copy (the row's retention already ended,
 * or its database copies nothing now: cache_cluster.c), -1 it cannot be
 * encoded (errbuf says why).
 */
static int
vk_encode_record(void *arg, const IdemOutboxRecord *rec,
				 char *key, int *keylen, char *value, int *valuelen,
				 char *ttl, size_t ttllen)
{
	VkEncoder  *enc = (VkEncoder *) arg;
	int64		ttl_ms = (rec->expires_at - enc->now) / 1000;	/* rounds down */
	const char *why = "could not encode a queued result";

	if (ttl_ms < 1)
		return 0;
	*keylen = -1;
	if (rec->dboid != enc->keyspace_db)
	{
		/* a Citus cluster's database: its keyspace and secret, or nothing */
		int			c = idem_cache_cluster_encoder(rec->dboid, enc->timeline,
												   enc->epoch, enc->keyspace,
												   &enc->key_id, &enc->mac_key);

		enc->skip_db = c < 0;
		if (c == 0)
		{
			enc->key_id = enc->own_key_id;
			enc->mac_key = enc->own_mac_key;
		}
		if (c != 0 ||
			idem_cache_keyspace_of(enc->keyspace, sizeof(enc->keyspace), rec->dboid,
								   enc->timeline, enc->epoch) >= 0)
			enc->keyspace_db = rec->dboid;
	}
	if (rec->dboid == enc->keyspace_db && enc->skip_db)
		return 0;
	if (rec->dboid == enc->keyspace_db)
		*keylen = idem_cache_key(key, IDEM_CACHE_KEY_MAX, enc->keyspace,
								 rec->is_platform, rec->tenant_id, rec->key);
	*valuelen = idem_cache_encode_terminal(value, IDEM_CACHE_VALUE_MAX,
										   enc->key_id,
										   (IdemCacheKind) rec->kind,
										   rec->attempt,
										   epoch_ms(rec->expires_at),
										   rec->fingerprint,
										   rec->outcome, rec->outcome_len);
	if (*keylen < 0 || *valuelen < 0 ||
		!idem_cache_sign(&enc->mac_key, key, *keylen, value, *valuelen, &why))
	{
		snprintf(errbuf, sizeof(errbuf), "%s", why);
		return -1;
	}
	snprintf(ttl, ttllen, INT64_FORMAT, ttl_ms);
	return 1;
}

/*
 * Append SETs for records[] to the connection's output buffer
 * (vk_encode_record).  Records whose retention already ended are skipped,
 * and one that cannot be encoded is counted in *errors.  Returns the number
 * of commands appended, or -1.
 */
static int
vk_append_batch(const IdemOutboxRecord **records, int n, VkEncoder *enc,
				uint64 *errors)
{
	char		key[IDEM_CACHE_KEY_MAX];
	char		value[IDEM_CACHE_VALUE_MAX];
	char		ttl[32];
	int			nsent = 0;
	int			i;

	for (i = 0; i < n; i++)
	{
		int			keylen;
		int			valuelen;
		const char *argv[5];
		size_t		argvlen[5];
		int			rc;

		rc = vk_encode_record(enc, records[i], key, &keylen, value, &valuelen,
							  ttl, sizeof(ttl));
		if (rc == 0)
			continue;			/* the row's retention already ended */
		if (rc < 0)
		{
			(*errors)++;		/* errbuf says why */
			continue;
		}
		argv[0] = "SET";
		argvlen[0] = 3;
		argv[1] = key;
		argvlen[1] = keylen;
		argv[2] = value;
		argvlen[2] = valuelen;
		argv[3] = "PX";
		argvlen[3] = 2;
		argv[4] = ttl;
		argvlen[4] = strlen(ttl);
		if (redisAppendCommandArgv(vk, 5, argv, argvlen) != REDIS_OK)
		{
			vk_context_error("could not queue a command");
			return -1;
		}
		nsent++;
	}
	return nsent;
}

/* A batch written to Valkey whose replies are not read yet. */
typedef struct VkBatch
{
	uint64		end_pos;		/* queue position after its records */
	int			nrecords;
	int			nsent;			/* SETs sent (expired records are not) */
} VkBatch;

/*
 * Copies wait for a standby that cannot be used (errbuf says why): say so in
 * idem_stats() and, at most every IDEM_LOG_INTERVAL_MS, in the log.
 */
static void
worker_report_standby(void)
{
	static TimestampTz logged = 0;
	TimestampTz now = GetCurrentTimestamp();
	char		text[IDEM_ERRBUF_LEN + 64];

	snprintf(text, sizeof(text), "%s: copies wait: %s",
			 timestamptz_to_str(now), errbuf);
	idem_stats_set_valkey(vk_connected(), text);
	if (TimestampDifferenceExceeds(logged, now, IDEM_LOG_INTERVAL_MS))
	{
		ereport(LOG,
				(errmsg("idem: results wait before they are copied to Valkey: %s",
						errbuf),
				 errhint("Check idem.standby_slots: each slot must be a physical slot in use by a standby.")));
		logged = now;
	}
}

/*
 * How far WAL is durable: flushed here, on the synchronous standbys (when
 * synchronous_standby_names is set) and on the standbys of
 * idem.standby_slots (by default, of every physical slot in use); see
 * standby_slots.c.  Also gives the timeline, which names the keyspace.
 * When a named standby cannot be used, returns InvalidXLogRecPtr and sets
 * *standby_problem (the reason is in errbuf).
 */
static XLogRecPtr
worker_durable_lsn(TimeLineID *timeline, bool *standby_problem)
{
	XLogRecPtr	lsn = GetFlushRecPtr(timeline);

	*standby_problem = !idem_standby_slots_flushed(&lsn, errbuf, sizeof(errbuf));
	return lsn;
}

/*
 * A read's copy is held for WAL up to lsn that may be no commit's, which
 * only the WAL writer would flush, cycles later (outbox.c): flush it now, as
 * a committing backend would.  The copy still goes out only once the
 * durable position (worker_durable_lsn) passes it.
 */
static void
worker_flush_wal(XLogRecPtr lsn)
{
	if (XLogRecPtrIsInvalid(lsn) || RecoveryInProgress() ||
		lsn <= GetFlushRecPtr(NULL))
		return;
	XLogFlush(lsn);
}

/* At most this many batches in flight (vk_drain, a backlog). */
#define IDEM_INFLIGHT 4

/* The next look at the durable position, for copies held since held_since. */
static long
durable_poll_ms(TimestampTz held_since, TimestampTz now)
{
	long		waited_ms = (long) ((now - held_since) / 1000);

	return Max(IDEM_DURABLE_POLL_MS,
			   Min(IDEM_DURABLE_SLOW_POLL_MS, waited_ms / IDEM_DURABLE_POLL_DIVISOR));
}

/* Sleep up to ms, or until the latch is set (a commit, SIGHUP, SIGTERM). */
static void
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
static TimestampTz last_batch_at = 0;

static void
batch_delay_start(TimestampTz now)
{
	last_batch_at = now;
}

static TimestampTz
batch_delay_next(void)
{
	return last_batch_at + idem_valkey_batch_delay_ms * INT64CONST(1000);
}

/* Milliseconds, rounded up, until the next batch may go (0: now). */
static long
batch_delay_left_ms(TimestampTz now)
{
	TimestampTz next = batch_delay_next();

	return next > now ? (long) ((next - now + 999) / 1000) : 0;
}

/* Must n queued records wait for the delay (fewer than a backlog)? */
static bool
batch_delay_holds(int n, TimestampTz now)
{
	return n < IDEM_BATCH_EAGER && now < batch_delay_next();
}

/*
 * A batch is sent and no backlog waits.  With a delay, sleep until the next
 * batch may go instead of until the replies come: they come meanwhile, and
 * are read and the next batch sent in one wakeup, not two.  True if it
 * slept (the replies are then read before their socket is waited for, and
 * the command timeout counts from now).
 */
static bool
batch_delay_sleep(void)
{
	long		sleep_ms;

	if (idem_valkey_batch_delay_ms <= 0)
		return false;
	sleep_ms = batch_delay_left_ms(GetCurrentTimestamp());
	if (sleep_ms <= 0)
		return false;
	worker_nap(sleep_ms);
	return true;
}

/*
 * Copy queued records until the queue is empty, batched as the file header
 * says: while a batch is in flight, the next one is written ahead of its
 * replies only when IDEM_BATCH_EAGER records wait (up to IDEM_INFLIGHT
 * batches, so Valkey and the worker work at the same time on a backlog).  Only records
 * whose WAL position is durable (worker_durable_lsn) are taken; while the
 * next one is not, the worker looks again shortly (durable_poll_ms),
 * having flushed WAL up to it if it is a read's copy (worker_flush_wal).  A
 * batch leaves the queue once all its replies are read.  A reply that says
 * the server cannot take writes now (vk_classify_error) fails the drain with
 * the batches kept; one that condemns a record drops that record.  Returns
 * early, once the batches in flight are answered, when a reload is pending.
 * *copied and *rejected count OK replies and dropped records (refused or
 * unencodable); idem_stats() counts them batch by batch.
 */
static VkResult
vk_drain(uint64 *copied, uint64 *rejected)
{
	const IdemOutboxRecord *records[IDEM_BATCH_MAX];
	VkBatch		inflight[IDEM_INFLIGHT];
	int			first = 0;
	int			nin = 0;
	uint64		pos = 0;		/* from the oldest record */
	bool		standby_reported = false;
	TimestampTz held_since = 0; /* when the wait for durability began */

	*copied = 0;
	*rejected = 0;
	for (;;)
	{
		TimestampTz deadline;
		TimestampTz now = GetCurrentTimestamp();
		VkBatch    *b;
		VkResult	r;
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
		while (nin < IDEM_INFLIGHT && !ConfigReloadPending &&
			   worker_epoch_ready())
		{
			uint64		start = pos;
			XLogRecPtr	flush_to;
			int			n = idem_outbox_peek(&pos, records, IDEM_BATCH_MAX,
											 durable, &held, &flush_to);
			int			nsent;
			VkEncoder	enc;

			worker_flush_wal(flush_to);
			if (pos == start)
				break;
			if ((nin > 0 && n < IDEM_BATCH_EAGER) || batch_delay_holds(n, now))
			{
				/* Let them gather behind the batch in flight, or the delay. */
				pos = start;
				waiting = (nin == 0);
				break;
			}
			vk_encoder_init(&enc, timeline);
			nrej = 0;
			nsent = vk_append_batch(records, n, &enc, &nrej);
			vk_encoder_done(&enc);
			if (nsent < 0)
				return VK_FAILED;
			idem_stats_add(IDEM_STAT_REJECTED, nrej);
			*rejected += nrej;
			b = &inflight[(first + nin) % IDEM_INFLIGHT];
			b->end_pos = pos;
			b->nrecords = n;
			b->nsent = nsent;
			nin++;
			batch_delay_start(now);
			if (n > 0)
				held_since = 0;
			if (held)
				break;
		}
		if (nin == 0)
		{
			long		wait_ms = PG_INT32_MAX;

			if (!waiting && !held)
				return VK_OK;
			/*
			 * Let the records held back by the delay gather until the delay
			 * passes; look at the durable position again meanwhile.
			 */
			if (waiting)
				wait_ms = batch_delay_left_ms(now);
			if (held)
			{
				if (held_since == 0)
					held_since = now;
				wait_ms = Min(wait_ms, durable_poll_ms(held_since, now));
			}
			worker_nap(wait_ms);
			if (ShutdownRequestPending)
				return VK_SHUTDOWN;
			if (ConfigReloadPending)
				return VK_OK;
			continue;
		}

		/* Send what is appended; read the oldest batch's replies. */
		deadline = TimestampTzPlusMilliseconds(GetCurrentTimestamp(),
											   idem_valkey_command_timeout_ms);
		r = vk_flush(deadline);
		if (r != VK_OK)
			return r;

		/* No backlog: sleep out the delay before reading the replies. */
		slept = nin == 1 && batch_delay_sleep();
		if (ShutdownRequestPending)
			return VK_SHUTDOWN;
		if (slept)
			deadline = TimestampTzPlusMilliseconds(GetCurrentTimestamp(),
												   idem_valkey_command_timeout_ms);
		b = &inflight[first];
		for (i = 0, ok = 0, nrej = 0; i < b->nsent; i++)
		{
			VkReplyClass class;

			r = vk_read_reply(deadline, slept && i == 0, &class);
			if (r != VK_OK)
				return r;
			if (class == VK_REPLY_RETRY)
				return VK_FAILED;	/* errbuf has the reply; batches kept */
			if (class == VK_REPLY_REJECT)
				nrej++;
			else
				ok++;
		}
		idem_outbox_consume(b->end_pos, b->nrecords);
		idem_stats_add(IDEM_STAT_COPIED, ok);
		idem_stats_add(IDEM_STAT_REJECTED, nrej);
		*copied += ok;
		*rejected += nrej;
		first = (first + 1) % IDEM_INFLIGHT;
		nin--;
	}
}

/* Does this error reply mean "not now" (keep the batch)? */
static bool
vk_reply_keeps_batch(const char *str, size_t len)
{
	return vk_classify_error(str, len) == VK_REPLY_RETRY;
}

/*
 * Records up to here were sent ahead of a stuck batch (positions only grow;
 * one before the ring's tail means nothing is ahead).
 */
static uint64 wc_ahead_pos = 0;

/*
 * The head batch is stuck on a node that does not answer (down, failing
 * over): send the records behind it, up to IDEM_AHEAD_BATCHES batches, to
 * the nodes that do answer, so that one node's outage does not hold back
 * every other node's copies.  Nothing is consumed or counted here: each
 * record still leaves the queue only through vk_cluster_drain(), which sends
 * it again (a SET is idempotent) once the batches before it are acknowledged.
 * Each retry sends only what was not sent ahead yet.
 */
static VkResult
vk_cluster_send_ahead(uint64 pos, XLogRecPtr durable, TimeLineID timeline,
					  uint64 *acked)
{
	const IdemOutboxRecord *records[IDEM_BATCH_MAX];
	char		scratch[256];
	VkEncoder	enc;
	VkResult	result = VK_OK;
	int			b;

	pos = Max(pos, wc_ahead_pos);
	for (b = 0; b < IDEM_AHEAD_BATCHES; b++)
	{
		bool		held;
		XLogRecPtr	flush_to;
		uint64		ok,
					nrej;
		int			n = idem_outbox_peek(&pos, records, IDEM_BATCH_MAX, durable,
										 &held, &flush_to);

		if (n == 0)
			break;
		vk_encoder_init(&enc, timeline);
		if (idem_wc_copy(records, n, NULL, vk_encode_record, &enc, vk_reply_keeps_batch,
						 &ok, &nrej, scratch, sizeof(scratch)) == IDEM_WC_STOPPING)
			result = VK_SHUTDOWN;
		vk_encoder_done(&enc);
		if (result != VK_OK)
			break;
		*acked += ok;
		wc_ahead_pos = pos;
	}
	return result;
}

/*
 * vk_drain() for a Valkey Cluster: the same durable records, one batch at a
 * time through worker_cluster.c (every node's share is sent before any
 * reply is read); a batch leaves the queue only when every node answered.
 * A batch that is not acknowledged stays queued, and the batches behind it
 * are sent ahead to the nodes that answer (vk_cluster_send_ahead).  While
 * it is stuck, each try sends only its records not settled yet (head_done):
 * a node that answered is not sent the same SETs every IDEM_STUCK_RETRY_MS
 * for as long as another node is down.  Batches keep
 * idem.valkey_batch_delay as in vk_drain() (batch_delay_holds,
 * batch_delay_sleep): the worker sends a batch to every master it has
 * copies for (idem_wc_send), sleeps out the delay, then reads every
 * master's replies (idem_wc_collect) and sends the next batch in the same
 * wakeup; a stuck batch's retries keep their own pace.
 */
static VkResult
vk_cluster_drain(uint64 *copied, uint64 *rejected)
{
	const IdemOutboxRecord *records[IDEM_BATCH_MAX];
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
	const IdemOutboxRecord *head[IDEM_BATCH_MAX];
	bool		head_done[IDEM_BATCH_MAX];
	int			head_n = 0;
	TimeLineID	head_timeline = 0;
	uint64		head_ok = 0;
	uint64		head_rej = 0;

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
		VkEncoder	enc;
		uint64		ok = 0;
		uint64		nrej = 0;
		uint64		unencodable = 0;
		int			sent;
		bool		slept;
		IdemWcCopy	rc;
		XLogRecPtr	flush_to;
		int			n;

		if (standby_problem && !standby_reported)
		{
			worker_report_standby();
			standby_reported = true;
		}
		if (ShutdownRequestPending)
			return VK_SHUTDOWN;
		if (ConfigReloadPending || !worker_epoch_ready())
			return VK_OK;
		n = idem_outbox_peek(&pos, records, IDEM_BATCH_MAX, durable, &held,
							 &flush_to);
		worker_flush_wal(flush_to);
		if (n == 0)
		{
			if (!held)
			{
				idem_outbox_consume(pos, 0);	/* past any padding */
				return VK_OK;
			}
			if (held_since == 0)
				held_since = GetCurrentTimestamp();
			worker_nap(durable_poll_ms(held_since, GetCurrentTimestamp()));
			continue;
		}
		held_since = 0;
		if (stuck && !TimestampDifferenceExceeds(stuck_tried, GetCurrentTimestamp(),
												 IDEM_STUCK_RETRY_MS))
		{
			/* between tries of the stuck batch: only what came in since */
			uint64		acked = 0;

			if (vk_cluster_send_ahead(pos, durable, timeline, &acked) == VK_SHUTDOWN)
				return VK_SHUTDOWN;
			worker_nap(IDEM_STUCK_POLL_MS);
			continue;
		}
		now = GetCurrentTimestamp();
		if (!stuck && batch_delay_holds(n, now))
		{
			/* Let them gather until the delay lets them go. */
			worker_nap(batch_delay_left_ms(now));
			continue;
		}
		if (!stuck || timeline != head_timeline || n < head_n ||
			memcmp(head, records, head_n * sizeof(records[0])) != 0)
		{
			head_n = 0;			/* a new head batch: nothing settled */
			head_ok = head_rej = 0;
			head_timeline = timeline;
		}
		memcpy(head + head_n, records + head_n,
			   (n - head_n) * sizeof(records[0]));
		memset(head_done + head_n, 0, (n - head_n) * sizeof(bool));
		head_n = n;
		vk_encoder_init(&enc, timeline);
		sent = idem_wc_send(records, n, head_done, vk_encode_record, &enc,
							&unencodable);
		vk_encoder_done(&enc);
		if (sent < 0)
			return VK_SHUTDOWN;
		/*
		 * Pace what was sent (nothing, when every record is unencodable or
		 * settled); with no backlog, sleep out the delay before reading the
		 * replies.
		 */
		slept = false;
		if (sent > 0)
		{
			batch_delay_start(now);
			slept = !stuck && n < IDEM_BATCH_EAGER && batch_delay_sleep();
		}
		if (ShutdownRequestPending)
			return VK_SHUTDOWN;
		rc = idem_wc_collect(slept, vk_reply_keeps_batch, &ok, &nrej,
							 errbuf, sizeof(errbuf));
		if (rc == IDEM_WC_STOPPING)
			return VK_SHUTDOWN;
		head_ok += ok;
		head_rej += nrej + unencodable;
		if (rc == IDEM_WC_NOT_ACKED)
		{
			/* errbuf says why; the batch is kept */
			uint64		acked = ok;

			if (vk_cluster_send_ahead(pos, durable, timeline, &acked) == VK_SHUTDOWN)
				return VK_SHUTDOWN;
			if (acked == 0 && !stuck)
				return VK_FAILED;	/* no node answered: back off */

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
		idem_outbox_consume(pos, n);
		idem_stats_add(IDEM_STAT_COPIED, head_ok);
		idem_stats_add(IDEM_STAT_REJECTED, head_rej);
		*copied += head_ok;
		*rejected += head_rej;
	}
}

/*
 * Record a problem (errbuf) in idem_stats() (counted as a copy error if
 * is_error) and, at most every IDEM_LOG_INTERVAL_MS, in the server log.
 */
static void
worker_report_problem(const char *doing, int retry_ms, bool is_error)
{
	TimestampTz now = GetCurrentTimestamp();
	char		text[IDEM_ERRBUF_LEN + 128];

	snprintf(text, sizeof(text), "%s: %s %s:%d: %s",
			 timestamptz_to_str(now), doing, vk_host, vk_port, errbuf);
	idem_stats_set_valkey(vk_connected(), text);
	if (is_error)
		idem_stats_add(IDEM_STAT_COPY_ERRORS, 1);
	if (!failing ||
		TimestampDifferenceExceeds(last_logged, now, IDEM_LOG_INTERVAL_MS))
	{
		ereport(LOG,
				(errmsg("idem: %s Valkey at %s:%d failed: %s",
						doing, vk_host, vk_port, errbuf),
				 retry_ms > 0 ?
				 errdetail("Queued results are kept while the queue has room; retrying in %d ms.",
						   retry_ms) : 0));
		last_logged = now;
	}
	failing = true;
}

/*
 * After a failed connect or batch: drop the connection, report, and set the
 * next attempt *backoff_ms from now, doubling the delay up to the maximum.
 */
static void
worker_backoff(const char *doing, int *backoff_ms, TimestampTz *retry_at)
{
	vk_disconnect();
	worker_report_problem(doing, *backoff_ms, true);
	*retry_at = TimestampTzPlusMilliseconds(GetCurrentTimestamp(), *backoff_ms);
	*backoff_ms = Min(*backoff_ms * 2, IDEM_BACKOFF_MAX_MS);
}

static void
worker_on_exit(int code, Datum arg)
{
	idem_outbox_detach_worker();
	vk_disconnect();
}

void
idem_worker_main(Datum main_arg)
{
	int			backoff_ms = IDEM_BACKOFF_MIN_MS;
	long		coming_ms = 0;	/* the last nap for a copy counted in */
	TimestampTz retry_at = 0;

	pqsignal(SIGHUP, SignalHandlerForConfigReload);
	pqsignal(SIGTERM, SignalHandlerForShutdownRequest);
	pqsignal(SIGPIPE, SIG_IGN);
	BackgroundWorkerUnblockSignals();

	if (!idem_outbox_available())
		ereport(FATAL,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idem worker started without idem's shared memory"),
				 errhint("Load idem through shared_preload_libraries.")));

	/* A resource owner, for the PostgreSQL routines that need one. */
	CurrentResourceOwner = ResourceOwnerCreate(NULL, "idem worker");
	before_shmem_exit(worker_on_exit, (Datum) 0);
	idem_stats_set_valkey(false, NULL);
	idem_outbox_attach_worker();

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
		VkResult	r;

		CHECK_FOR_INTERRUPTS();
		if (ConfigReloadPending)
		{
			ConfigReloadPending = false;
			ProcessConfigFile(PGC_SIGHUP);
			if (!vk_connected() || vk_settings_changed())
			{
				/* Reconnect now, to new settings or for a new try. */
				if (vk_connected())
					vk_disconnect();
				retry_at = 0;
				backoff_ms = IDEM_BACKOFF_MIN_MS;
			}
		}

		if (!vk_connected())
		{
			long		wait_ms = TimestampDifferenceMilliseconds(GetCurrentTimestamp(),
																  retry_at);

			if (wait_ms > 0)
			{
				worker_nap(wait_ms);
				continue;
			}
			r = vk_connect();
			if (r == VK_SHUTDOWN)
				break;
			if (r != VK_OK)
			{
				worker_backoff("connecting to", &backoff_ms, &retry_at);
				continue;
			}
			idem_stats_set_valkey(true, NULL);
			owner_checked_at = 0;	/* Valkey may have lost it meanwhile */
			if (idem_wc_active())
				ereport(LOG,
						(errmsg("idem: connected to Valkey Cluster at %s:%d (%s)",
								vk_host, vk_port, idem_wc_describe())));
			else
				ereport(LOG,
						(errmsg("idem: connected to Valkey at %s:%d", vk_host, vk_port)));
		}

		{
			bool		check = TimestampDifferenceExceeds(owner_checked_at,
														   GetCurrentTimestamp(),
														   IDEM_OWNER_CHECK_MS);

			r = worker_check_owner();
			if (r == VK_OK)
				r = worker_cluster_owners(check);

			/*
			 * On a Valkey Cluster the owner key lives on one master.  While
			 * that master is down runners trust no value (they read the
			 * owner key in the same round trip), but the copies owed to
			 * the masters that are up still go out, so that the cache is
			 * warm when it is back; the check is tried again next time.
			 */
			if (r == VK_FAILED && idem_wc_active())
			{
				worker_report_problem("checking the cache epoch's owner key at",
									  0, false);
				r = VK_OK;
			}
		}
		if (r == VK_OK)
			r = worker_take_epoch();
		if (r == VK_OK)
			r = idem_wc_active() ? vk_cluster_drain(&copied, &rejected) :
				vk_drain(&copied, &rejected);
		if (r == VK_SHUTDOWN)
			break;
		if (r != VK_OK)
		{
			bool		cluster = idem_wc_active();

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
			if (failing)
				ereport(LOG,
						(errmsg("idem: copying results to Valkey at %s:%d again",
								vk_host, vk_port)));
			failing = false;
			backoff_ms = IDEM_BACKOFF_MIN_MS;
		}

		/*
		 * The queue was empty when vk_drain() last looked.  Sleep, and let
		 * commits wake us, unless a commit came in meanwhile.  A copy
		 * counted in but not reserved yet (its committer between the two):
		 * look again shortly, less and less often while it stays so (a
		 * committer held there), neither spinning nor costing it a wakeup.
		 */
		if (!ConfigReloadPending)
		{
			bool		coming;

			if (idem_outbox_worker_sleepy(&coming))
			{
				worker_nap(IDEM_IDLE_WAIT_MS);
				idem_outbox_worker_awake();
				/* Valkey may have lost it while we slept (a flush) */
				owner_checked_at = 0;
			}
			if (coming)
			{
				coming_ms = coming_ms == 0 ? 1 : Min(coming_ms * 2, IDEM_COMING_MAX_MS);
				worker_nap(coming_ms);
			}
			else
				coming_ms = 0;
		}
	}

	proc_exit(1);
}
