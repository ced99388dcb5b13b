/*-------------------------------------------------------------------------
 *
 * outbox_publish.c
 *	  The publisher of one database's outbox: a dynamic background worker
 *	  connected to it (started by the launcher, outbox_launch.c) that sends
 *	  each committed message to its Valkey stream,
 *
 *		XADD <stream> * id <message_id> body <message, compact JSON>
 *
 *	  once its commit is durable, and then deletes it.
 *
 * A round reads up to IDEM_PUBLISH_BATCH of the oldest messages (by seq)
 * in one transaction, which first deletes what the round before sent (two
 * statements prepared once, publish_prepare).
 * Every commit its snapshot sees has its commit record before the WAL
 * inserted at the end of that read, so the publisher waits until WAL is
 * durable that far by the rules of the copies (worker_durable_lsn: flushed
 * here, on the synchronous standbys and on those of idem.standby_slots),
 * flushing it itself, as a committing backend would, when no commit has
 * within IDEM_PUBLISH_FLUSH_GRACE_MS (asynchronous commits' WAL).  Then it
 * sends them (publish_send): per stream one EVAL of a script that XADDs
 * the stream's messages of the round in seq order, all or none, every
 * stream's pipelined at once (on a Valkey Cluster each to the master of
 * its stream's slot).  A stream whose script has no reply or an error
 * reply keeps all its messages of the round, sent again from the first
 * the next round: repeats of the same ids are possible, an overtake within
 * a stream is not; other streams go on.  A crash between the EVAL and the
 * delete, or before the delete's asynchronous commit is flushed, sends
 * those messages again after the restart, with the same ids: at least
 * once.  A message Valkey refuses (an error reply, say a stream
 * name that is a key of another type) is retried, with backoff, and
 * counted in publish_errors: nothing is dropped.
 *
 * Prepared transactions: COMMIT PREPARED runs no callback of idem's, so a
 * database with prepared transactions that emitted (flagged at PREPARE,
 * or found by the publisher's first look after it starts) is polled every
 * IDEM_PUBLISH_PREPARED_POLL_MS while it has any.
 *
 * Wakeups: a commit that emits sets the publisher's latch only while it
 * sleeps (idem_outbox_publisher_sleepy); an awake publisher reads again
 * after each round, idem.valkey_batch_delay after a round without a
 * backlog, so that a round gathers the commits of that delay, as the
 * worker's batches do.
 *
 * Order: seq is drawn when idem_emit() runs, so a transaction's messages
 * keep their order, and one whose transaction committed before another's
 * began has a smaller seq; it is visible (and durable) whenever the later
 * one is, so it goes out first.  Concurrent transactions may interleave.
 *
 * The Valkey connection is the worker's code (worker_valkey.c, the router
 * of worker_router.c: one Valkey or a cluster, AUTH, SELECT, timeouts),
 * in this process: its settings are idem.outbox_valkey_* when
 * idem.outbox_valkey_host or idem.outbox_valkey_nodes is set (the streams'
 * own, durable Valkey), else the cache's idem.valkey_*; the timeouts are
 * the cache's either way.  A reload that changes them reconnects.
 * Between failed attempts the publisher backs off from
 * IDEM_PUBLISH_BACKOFF_MIN_MS to IDEM_PUBLISH_BACKOFF_MAX_MS.
 *
 * Locking: none of its own; one process.  The outbox rows are read and
 * deleted by this process only (one publisher per database, the launcher's
 * slots say which); idem_emit() inserts new ones concurrently.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <hiredis/hiredis.h>

#include "access/xact.h"
#include "access/xlog.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "postmaster/bgworker.h"
#include "postmaster/interrupt.h"
#include "storage/ipc.h"
#include "tcop/tcopprot.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

#include "outbox_publish.h"
#include "commit_copies.h"
#include "ledger_guard.h"
#include "guc.h"
#include "outbox.h"
#include "standby_slots.h"
#include "stats.h"
#include "valkey_router.h"
#include "worker_int.h"

#define IDEM_PUBLISH_BATCH			256
/* a round's bodies, at most (but one message): sent within the timeout */
#define IDEM_PUBLISH_ROUND_BYTES	(2 * 1024 * 1024)
#define IDEM_PUBLISH_BACKOFF_MIN_MS	100
#define IDEM_PUBLISH_BACKOFF_MAX_MS	1000
#define IDEM_PUBLISH_LINGER_MS		1000
#define IDEM_PUBLISH_LOG_MS			10000
#define IDEM_PUBLISH_FLUSH_GRACE_MS	5
#define IDEM_PUBLISH_PREPARED_POLL_MS	1000

typedef struct PublishMessage
{
	int64		seq;
	char	   *stream;
	char	   *id;
	char	   *body;			/* compact JSON text */
} PublishMessage;

static Oid	publish_dboid = InvalidOid;
static bool publish_done = false;	/* left idle: nothing waits */
static MemoryContext publish_cxt = NULL;
static TimestampTz publish_logged_at = 0;

static void
publish_on_exit(int code, Datum arg)
{
	worker_router_disconnect();
	idem_outbox_publisher_detach(publish_dboid, !publish_done);
}

/*
 * jsonb's text without the blanks it puts after ':' and ',' (outside
 * strings, the only blanks it writes).
 */
static char *
publish_compact(const char *text)
{
	StringInfoData out;
	bool		in_string = false;
	const char *p;

	initStringInfo(&out);
	for (p = text; *p; p++)
	{
		if (in_string)
		{
			appendStringInfoChar(&out, *p);
			if (*p == '\\' && p[1] != '\0')
				appendStringInfoChar(&out, *++p);
			else if (*p == '"')
				in_string = false;
			continue;
		}
		if (*p == ' ')
			continue;
		if (*p == '"')
			in_string = true;
		appendStringInfoChar(&out, *p);
	}
	return out.data;
}

/* The outbox's schema, or InvalidOid (no idem here, or not updated). */
static Oid
publish_outbox_nsp(void)
{
	Oid			nsp = idem_extension_schema();

	if (!OidIsValid(nsp) ||
		!OidIsValid(get_relname_relid(IDEM_OUTBOX_TABLE, nsp)))
		return InvalidOid;
	return nsp;
}

/* The messages sent and not deleted yet (by their seq). */
static int64 publish_sent[IDEM_PUBLISH_BATCH];
static int	publish_nsent = 0;

/*
 * The round's two statements, prepared once per backend for the outbox of
 * one schema (PostgreSQL replans them when the table changes): the delete
 * of what was sent, and the read of the oldest messages.
 */
static SPIPlanPtr publish_delete_plan = NULL;
static SPIPlanPtr publish_read_plan = NULL;
static Oid	publish_plans_nsp = InvalidOid;

/* The statements of the outbox of schema nsp (SPI connected). */
static void
publish_prepare(Oid nsp)
{
	Oid			argtypes[1] = {INT8ARRAYOID};
	const char *schema;
	SPIPlanPtr	del;
	SPIPlanPtr	rd;

	if (publish_plans_nsp == nsp && publish_delete_plan && publish_read_plan)
		return;
	if (publish_delete_plan)
		SPI_freeplan(publish_delete_plan);
	if (publish_read_plan)
		SPI_freeplan(publish_read_plan);
	publish_delete_plan = publish_read_plan = NULL;
	publish_plans_nsp = InvalidOid;
	schema = quote_identifier(get_namespace_name(nsp));
	del = SPI_prepare(psprintf("DELETE FROM %s.%s WHERE seq = ANY ($1)",
							   schema, IDEM_OUTBOX_TABLE), 1, argtypes);
	rd = SPI_prepare(psprintf("SELECT seq, stream, message_id, body::text FROM %s.%s ORDER BY seq LIMIT %d",
							  schema, IDEM_OUTBOX_TABLE, IDEM_PUBLISH_BATCH), 0, NULL);
	if (del == NULL || rd == NULL)
		elog(ERROR, "could not prepare the publisher's statements: %s",
			 SPI_result_code_string(SPI_result));
	SPI_keepplan(del);
	SPI_keepplan(rd);
	publish_delete_plan = del;
	publish_read_plan = rd;
	publish_plans_nsp = nsp;
}

/* Delete the messages sent (SPI connected, in a transaction). */
static void
publish_delete_sent(void)
{
	Datum	   *seqs;
	Datum		values[1];
	int			i;

	if (publish_nsent == 0)
		return;
	seqs = palloc(sizeof(Datum) * publish_nsent);
	for (i = 0; i < publish_nsent; i++)
		seqs[i] = Int64GetDatum(publish_sent[i]);
	values[0] = PointerGetDatum(construct_array(seqs, publish_nsent, INT8OID,
												sizeof(int64), FLOAT8PASSBYVAL,
												TYPALIGN_DOUBLE));
	pgstat_report_activity(STATE_RUNNING, "deleting published messages");
	if (SPI_execute_plan(publish_delete_plan, values, NULL, false, 0) != SPI_OK_DELETE)
		elog(ERROR, "could not delete published messages");
}

/*
 * One transaction: delete the messages sent last round, then (unless
 * delete_only) read the oldest messages into *msgs (in publish_cxt).
 * Returns their count, or -1 when this database has no outbox.  *lsn:
 * where WAL must be durable before they go out.
 */
static int
publish_read(PublishMessage **msgs, XLogRecPtr *lsn, bool delete_only)
{
	Oid			nsp;
	int			n = -1;

	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	PushActiveSnapshot(GetTransactionSnapshot());
	nsp = publish_outbox_nsp();
	if (OidIsValid(nsp))
	{
		uint64		i;

		if (SPI_connect() != SPI_OK_CONNECT)
			elog(ERROR, "SPI_connect failed");
		publish_prepare(nsp);
		publish_delete_sent();
		if (delete_only)
		{
			SPI_finish();
			PopActiveSnapshot();
			CommitTransactionCommand();
			pgstat_report_activity(STATE_IDLE, NULL);
			publish_nsent = 0;
			return 0;
		}
		pgstat_report_activity(STATE_RUNNING, "reading the outbox");
		if (SPI_execute_plan(publish_read_plan, NULL, NULL, false, 0) != SPI_OK_SELECT)	/* after the delete */
			elog(ERROR, "could not read the outbox");

		/*
		 * After the read's snapshot: past the commit record of every row it
		 * saw (a commit's record is inserted before it is visible), and
		 * before this transaction's own commit record, which nothing waits
		 * for.
		 */
		*lsn = idem_insert_end_lsn();
		n = (int) SPI_processed;
		*msgs = MemoryContextAlloc(publish_cxt, sizeof(PublishMessage) * Max(n, 1));
		for (i = 0; i < SPI_processed; i++)
		{
			HeapTuple	tup = SPI_tuptable->vals[i];
			TupleDesc	td = SPI_tuptable->tupdesc;
			bool		isnull;
			MemoryContext old = MemoryContextSwitchTo(publish_cxt);

			(*msgs)[i].seq = DatumGetInt64(SPI_getbinval(tup, td, 1, &isnull));
			(*msgs)[i].stream = SPI_getvalue(tup, td, 2);
			(*msgs)[i].id = SPI_getvalue(tup, td, 3);
			(*msgs)[i].body = publish_compact(SPI_getvalue(tup, td, 4));
			MemoryContextSwitchTo(old);
		}
		SPI_finish();
	}
	PopActiveSnapshot();
	CommitTransactionCommand();
	pgstat_report_activity(STATE_IDLE, NULL);
	publish_nsent = 0;
	return n;
}

/* Whether this database has prepared transactions (their messages wait). */
static bool
publish_has_prepared(void)
{
	bool		some;
	bool		isnull;

	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	PushActiveSnapshot(GetTransactionSnapshot());
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	if (SPI_execute("SELECT EXISTS (SELECT FROM pg_catalog.pg_prepared_xacts WHERE database OPERATOR(pg_catalog.=) pg_catalog.current_database())",
					true, 1) != SPI_OK_SELECT)
		elog(ERROR, "could not read pg_prepared_xacts");
	some = DatumGetBool(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull));
	SPI_finish();
	PopActiveSnapshot();
	CommitTransactionCommand();
	return some;
}

/*
 * Wait until WAL is durable up to lsn; false on shutdown.  A standby that
 * holds it back is logged every IDEM_PUBLISH_LOG_MS.
 */
static bool
publish_wait_durable(XLogRecPtr lsn)
{
	TimestampTz held_since = GetCurrentTimestamp();
	bool		flushed = false;

	for (;;)
	{
		TimeLineID	tli;
		bool		problem;
		XLogRecPtr	durable = worker_durable_lsn(&tli, &problem);
		TimestampTz now;

		if (!problem && durable >= lsn)
			return true;
		CHECK_FOR_INTERRUPTS();
		if (ShutdownRequestPending)
			return false;
		now = GetCurrentTimestamp();

		/*
		 * lsn may cover WAL of transactions still running, which their
		 * commits flush soon (under load, within a few ms): flush it
		 * ourselves only after IDEM_PUBLISH_FLUSH_GRACE_MS, so that a
		 * round costs no fsync of its own then.  Asynchronous commits
		 * wait for the WAL writer otherwise.
		 */
		if (!flushed &&
			TimestampDifferenceExceeds(held_since, now, IDEM_PUBLISH_FLUSH_GRACE_MS))
		{
			worker_flush_wal(lsn);
			flushed = true;
			continue;
		}
		if (TimestampDifferenceExceeds(publish_logged_at, now, IDEM_PUBLISH_LOG_MS) &&
			TimestampDifferenceExceeds(held_since, now, IDEM_PUBLISH_LOG_MS / 10))
		{
			char		what[256];

			if (problem)
				strlcpy(what, worker_errbuf, sizeof(what));
			else
				idem_standby_slots_holder(durable, what, sizeof(what));
			ereport(LOG,
					(errmsg("outgoing messages wait for their commit to be durable: %s", what)));
			publish_logged_at = now;
		}
		worker_nap(worker_durable_poll_ms(held_since, now));
	}
}

/* A failure: log it (at most every IDEM_PUBLISH_LOG_MS), count it. */
static void
publish_problem(const char *doing)
{
	TimestampTz now = GetCurrentTimestamp();

	idem_stats_add_outbox(IDEM_STAT_PUBLISH_ERRORS, 1);
	if (!TimestampDifferenceExceeds(publish_logged_at, now, IDEM_PUBLISH_LOG_MS))
		return;
	publish_logged_at = now;
	ereport(WARNING,
			(errmsg("could not publish outgoing messages %s Valkey at %s:%d: %s",
					doing, worker_valkey_host ? worker_valkey_host : "",
					worker_valkey_port, worker_errbuf),
			 errdetail("The messages wait in the outbox and are sent again.")));
}

/*
 * The script that publishes one stream's messages of a round, KEYS[1] the
 * stream, ARGV id, body, id, body, ...: their XADDs in order, all or none.
 * A script runs alone, and its XADDs can only be refused before the first
 * takes effect (the stream is a key of another type, Valkey is out of
 * memory, read-only or loading: a script that has written is let finish).
 */
#define PUBLISH_SCRIPT \
	"for i = 1, #ARGV, 2 do " \
	"redis.call('XADD', KEYS[1], '*', 'id', ARGV[i], 'body', ARGV[i + 1]) " \
	"end return #ARGV / 2"

/*
 * Publish a round: for each stream, one EVAL of PUBLISH_SCRIPT with its
 * messages in seq order, all streams' pipelined (on a cluster, each to the
 * master of its stream's slot).  A stream whose EVAL has no reply or an
 * error reply keeps all its messages of the round (sent again next round,
 * from the first: repeats possible, overtakes not); the others' are sent.
 * Only the oldest messages up to IDEM_PUBLISH_ROUND_BYTES (one at least)
 * go in the round: *n is cut to them.  The seqs of the messages sent go to
 * publish_sent; returns how many.  *failed: some stream's did not go out.
 * *shutdown: SIGTERM arrived.
 */
static int
publish_send(PublishMessage *msgs, int *n_inout, bool *failed, bool *shutdown)
{
	MemoryContext old = MemoryContextSwitchTo(publish_cxt);	/* reset each round */
	int		   *stream_of = palloc(sizeof(int) * *n_inout);	/* message -> cmd */
	int		   *count = palloc0(sizeof(int) * *n_inout);	/* per cmd */
	idem_vc_cmd *cmds = palloc0(sizeof(idem_vc_cmd) * *n_inout);
	int			ncmds = 0;
	int			answered;
	int			sent = 0;
	char		problem[IDEM_ERRBUF_LEN] = "";
	int			n;
	size_t		bytes = 0;
	int			i,
				c;

	*shutdown = false;
	*failed = false;
	for (n = 0; n < *n_inout; n++)
	{
		bytes += strlen(msgs[n].body);
		if (n > 0 && bytes > IDEM_PUBLISH_ROUND_BYTES)
			break;
	}
	*n_inout = n;
	/* streams in order of their first message; n is small (a round) */
	for (i = 0; i < n; i++)
	{
		for (c = 0; c < ncmds; c++)
			if (strcmp(cmds[c].key, msgs[i].stream) == 0)
				break;
		if (c == ncmds)
		{
			cmds[c].key = msgs[i].stream;
			cmds[c].keylen = strlen(msgs[i].stream);
			ncmds++;
		}
		stream_of[i] = c;
		count[c]++;
	}
	for (c = 0; c < ncmds; c++)
	{
		int			argc = 4 + 2 * count[c];
		const char **argv = palloc(sizeof(char *) * argc);
		size_t	   *argvlen = palloc(sizeof(size_t) * argc);
		int			a = 4;

		argv[0] = "EVAL";
		argv[1] = PUBLISH_SCRIPT;
		argv[2] = "1";
		argv[3] = cmds[c].key;
		for (i = 0; i < n; i++)
		{
			if (stream_of[i] != c)
				continue;
			argv[a++] = msgs[i].id;
			argv[a++] = msgs[i].body;
		}
		for (a = 0; a < argc; a++)
			argvlen[a] = strlen(argv[a]);
		cmds[c].argc = argc;
		cmds[c].argv = argv;
		cmds[c].argvlen = argvlen;
	}
	pgstat_report_activity(STATE_RUNNING, "publishing messages");
	answered = worker_pipeline(cmds, ncmds, shutdown);
	if (answered < ncmds)
		strlcpy(problem, worker_errbuf, sizeof(problem));
	for (c = 0; c < ncmds; c++)
	{
		redisReply *reply = cmds[c].reply;

		if (reply == NULL)
		{
			count[c] = 0;		/* not sent */
			continue;
		}
		if (reply->type == REDIS_REPLY_ERROR)
		{
			if (problem[0] == '\0')
				snprintf(problem, sizeof(problem),
						 "XADD to stream \"%.64s\": Valkey replied: %.*s",
						 cmds[c].key, (int) Min(reply->len, 100), reply->str);
			count[c] = 0;
		}
		freeReplyObject(reply);
		cmds[c].reply = NULL;
	}
	pgstat_report_activity(STATE_IDLE, NULL);
	MemoryContextSwitchTo(old);
	for (i = 0; i < n; i++)
		if (count[stream_of[i]] > 0)
			publish_sent[sent++] = msgs[i].seq;
	if (sent < n && !*shutdown)
	{
		*failed = true;
		strlcpy(worker_errbuf, problem, sizeof(worker_errbuf));
		publish_problem("to");
		if (answered < ncmds)
			worker_router_disconnect();
	}
	return sent;
}

void
idem_outbox_publisher_main(Datum main_arg)
{
	int			backoff_ms = IDEM_PUBLISH_BACKOFF_MIN_MS;
	TimestampTz idle_since = 0;
	bool		published_any = false;
	bool		looked_prepared = false;

	publish_dboid = DatumGetObjectId(main_arg);
	worker_valkey_use_outbox();
	pqsignal(SIGHUP, SignalHandlerForConfigReload);
	pqsignal(SIGTERM, SignalHandlerForShutdownRequest);
	pqsignal(SIGPIPE, SIG_IGN);
	BackgroundWorkerUnblockSignals();
	before_shmem_exit(publish_on_exit, (Datum) 0);
	if (!idem_outbox_publisher_attach(publish_dboid))
	{
		publish_done = true;	/* another one runs: leave it the flag */
		proc_exit(0);
	}
	BackgroundWorkerInitializeConnectionByOid(publish_dboid, InvalidOid, 0);
	/*
	 * The deletes of published messages wait for no flush and no standby:
	 * a delete lost in a crash sends its messages again, with their ids
	 * (at least once).  A round waits only for the commits it read
	 * (publish_read's lsn comes before its own commit record), which the
	 * committing backends flush, or publish_wait_durable after
	 * IDEM_PUBLISH_FLUSH_GRACE_MS (asynchronous commits): one flush per
	 * round at most, and none of the publisher's own in the committers'
	 * group commits.
	 */
	SetConfigOption("synchronous_commit", "off", PGC_SUSET, PGC_S_OVERRIDE);

	/*
	 * Its two statements are planned once (publish_prepare), and a plan
	 * made while the outbox was small (a scan of the whole table and a
	 * sort) would read all of it every round once it grows, until the
	 * next ANALYZE: they always take the oldest messages by the seq index.
	 */
	SetConfigOption("enable_seqscan", "off", PGC_SUSET, PGC_S_OVERRIDE);
	SetConfigOption("enable_bitmapscan", "off", PGC_SUSET, PGC_S_OVERRIDE);
	publish_cxt = AllocSetContextCreate(TopMemoryContext, "idem publisher",
										ALLOCSET_DEFAULT_SIZES);

	while (!ShutdownRequestPending)
	{
		PublishMessage *msgs = NULL;
		XLogRecPtr	lsn;
		int			n;
		int			sent;
		int			read;
		bool		failed;
		bool		shutdown;

		CHECK_FOR_INTERRUPTS();
		if (ConfigReloadPending)
		{
			ConfigReloadPending = false;
			ProcessConfigFile(PGC_SIGHUP);
			if (worker_connected() && worker_settings_changed())
				worker_router_disconnect();
		}
		MemoryContextReset(publish_cxt);
		n = publish_read(&msgs, &lsn, false);
		if (n == 0)
		{
			/*
			 * Prepared transactions that emitted (flagged at PREPARE, or
			 * any found after a start): their COMMIT PREPARED wakes nobody,
			 * so look again every IDEM_PUBLISH_PREPARED_POLL_MS until none
			 * is left, then once more.
			 */
			uint32		gen = idem_outbox_publisher_prepared(publish_dboid,
															 !looked_prepared && publish_has_prepared());

			looked_prepared = true;
			if (gen != 0)
			{
				if (publish_has_prepared())
				{
					worker_nap(IDEM_PUBLISH_PREPARED_POLL_MS);
					continue;
				}
				idem_outbox_publisher_prepared_gone(publish_dboid, gen);
				continue;
			}
		}
		if (n <= 0)
		{
			TimestampTz now = GetCurrentTimestamp();
			long		left_ms;

			if (n < 0 || idle_since == 0)
				idle_since = now;
			/*
			 * Linger after publishing, for the next commits; a publisher
			 * that found nothing at all (the launcher's look at every
			 * database after a start) leaves at once.
			 */
			left_ms = (n < 0 || !published_any) ? 0 : IDEM_PUBLISH_LINGER_MS -
				TimestampDifferenceMilliseconds(idle_since, now);
			if (left_ms <= 0)
			{
				if (idem_outbox_publisher_idle(publish_dboid))
				{
					publish_done = true;
					break;
				}
				idle_since = 0;
				continue;
			}
			/* a commit that emits wakes us, unless one came meanwhile */
			if (idem_outbox_publisher_sleepy(publish_dboid))
			{
				worker_nap(left_ms);
				idem_outbox_publisher_awake(publish_dboid);
			}
			continue;
		}
		idle_since = 0;
		if (!publish_wait_durable(lsn))
			break;
		if (!worker_connected())
		{
			WorkerResult r = worker_connect();

			if (r == WORKER_SHUTDOWN)
				break;
			if (r != WORKER_OK)
			{
				publish_problem("connecting to");
				worker_router_disconnect();
				worker_nap(backoff_ms);
				backoff_ms = Min(backoff_ms * 2, IDEM_PUBLISH_BACKOFF_MAX_MS);
				continue;
			}
		}
		/* what went out is deleted with the next round's read */
		read = n;
		sent = publish_nsent = publish_send(msgs, &n, &failed, &shutdown);
		if (sent > 0)
		{
			published_any = true;
			idem_stats_add_outbox(IDEM_STAT_PUBLISHED, sent);
			backoff_ms = IDEM_PUBLISH_BACKOFF_MIN_MS;
		}
		if (shutdown)
			break;
		if (failed)
		{
			worker_nap(backoff_ms);
			backoff_ms = Min(backoff_ms * 2, IDEM_PUBLISH_BACKOFF_MAX_MS);
		}
		else if (n == read && n < IDEM_PUBLISH_BATCH && idem_valkey_batch_delay_ms > 0)
		{
			/*
			 * No backlog: let the commits of idem.valkey_batch_delay gather
			 * into the next round (commits do not wake an awake publisher).
			 */
			worker_nap(idem_valkey_batch_delay_ms);
		}
	}
	/* what went out is deleted, so that a restart does not send it again */
	if (publish_nsent > 0)
	{
		PublishMessage *none;
		XLogRecPtr	lsn;

		(void) publish_read(&none, &lsn, true);
	}
	proc_exit(0);
}
