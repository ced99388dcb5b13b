/*
 * itest_consume.c: idem_call_emit and the stream consumer (itest consume),
 * on real servers.  The test is the stream's producer: it XADDs entries in
 * the published format ("id <message id> body <message>"), as the server's
 * worker does.
 *
 *	  - emit: a handler's messages are refused when not JSON or without a
 *		stream; with the extension's idem_emit, a committed run's messages
 *		are published as <key>-1, <key>-2 and a failed run's never; without
 *		it, the run fails with the server's error and commits nothing;
 *	  - the consumer: each message applied once, a publisher's repeat of an
 *		id replayed, every entry acknowledged; a retryable failure left
 *		pending and applied once when it comes back; a permanent failure
 *		acknowledged; malformed entries dead-lettered and acknowledged; a
 *		consumer SIGKILLed mid-message, its entry taken over (XAUTOCLAIM)
 *		by another and applied once; one killed after its commit, before
 *		its XACK, replayed;
 *	  - durable before acknowledged: a consumer whose connection has
 *		synchronous_commit = off, the server killed (-9) right after the
 *		XACK: the run applied, or replayed from a row not yet written
 *		out, is there after the restart.
 */
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/wait.h>

#include "itest.h"

static PGconn *admin;
static char S[64];
static int	emit_there;			/* the server has idem_emit */
static char DEAD[96];			/* the dead-letter stream */

static long long
effects_n(const char *scope, const char *id)
{
	const char *p[2] = {scope, id};

	return id ? pg_int(admin, "SELECT count(*) FROM effects WHERE scope = $1 AND id = $2", 2, p)
		: pg_int(admin, "SELECT count(*) FROM effects WHERE scope = $1", 1, p);
}

static long long
pending_n(const char *stream, const char *group)
{
	redisContext *c = rv_open();
	redisReply *r;
	long long	n = -1;

	if (c == NULL)
		return -1;
	r = rv(c, "XPENDING %s %s", stream, group);
	if (r && r->type == REDIS_REPLY_ARRAY && r->elements >= 1 &&
		r->element[0]->type == REDIS_REPLY_INTEGER)
		n = r->element[0]->integer;
	if (r)
		freeReplyObject(r);
	redisFree(c);
	return n;
}

static void
xadd(const char *stream, const char *id, const char *body)
{
	rv_cmd_ok("XADD %s * id %s body %s", stream, id, body);
}

/* ---- handlers ---- */

typedef struct hctx
{
	int			calls;
	int			fail_first;		/* the first call fails, retryable */
	int			hang;			/* write to fd, then sleep */
	int			fd;
	const char *emit_stream;
	int			emit_checks;	/* idem_call_emit's refusals seen */
} hctx;

static idem_handler_status
handler(PGconn *conn, idem_call *call, void *ud)
{
	hctx	   *h = ud;
	const char *p[2] = {idem_call_scope(call), idem_call_id(call)};
	PGresult   *r;
	const char *req = idem_call_request(call);

	h->calls++;
	if (h->fail_first && h->calls == 1)
		return IDEM_HANDLER_RETRYABLE;
	if (strstr(req, "\"permanent\""))
		return IDEM_HANDLER_PERMANENT;
	r = PQexecParams(conn, "INSERT INTO effects (scope, id, tenant) VALUES ($1, $2, 1)",
					 2, NULL, p, NULL, NULL, 0);
	PQclear(r);
	if (h->emit_stream)
	{
		errno = 0;
		if (idem_call_emit(call, "", "{}") == -1 && errno == EINVAL)
			h->emit_checks++;
		if (idem_call_emit(call, h->emit_stream, "{nope") == -1 && errno == EINVAL)
			h->emit_checks++;
		if (idem_call_emit(call, h->emit_stream, "{\"i\": 1, \"q\": \"\\\"\"}") != 0 ||
			idem_call_emit(call, h->emit_stream, "{\"i\": 2}") != 0)
			return IDEM_HANDLER_PERMANENT;
		if (strstr(req, "\"fail\""))
			return IDEM_HANDLER_PERMANENT;
	}
	if (h->hang)
	{
		if (write(h->fd, "x", 1) != 1)
			_exit(3);
		sleep(60);
	}
	return IDEM_HANDLER_OK;
}

static idem_runner *
open_runner_on(const char *conninfo)
{
	idem_options o;

	idem_options_init(&o);
	o.lease_ms = 5000;
	return idem_runner_open(conninfo, "127.0.0.1", E.valkey_port, &o);
}

static idem_runner *
open_runner(void)
{
	return open_runner_on(E.pg);
}

/* ---- emit ---- */

static void
test_emit(void)
{
	idem_runner *R = open_runner();
	char		stream[96];
	char		id2[80];
	hctx		h;
	idem_result res;
	char	   *has;

	snprintf(stream, sizeof(stream), "%s.out", S);
	has = pg_val(admin, "SELECT to_regproc('idem_emit') IS NOT NULL", 0, NULL);
	memset(&h, 0, sizeof(h));
	h.emit_stream = stream;
	idem_result_init(&res);
	idem_run(R, 1, S, "emit-1", "{\"fail\": 1}", handler, &h, &res);
	tap_ok_ext(h.emit_checks == 2,
			   "idem_call_emit refuses an empty stream name and a message that is not JSON (EINVAL)");
	tap_ok_ext(res.status == IDEM_FAILED_PERMANENT && effects_n(S, "emit-1") == 0,
			   "a handler that emits and fails: its failure is recorded, its writes rolled back (%s)",
			   idem_status_name(res.status));
	idem_run(R, 1, S, "emit-2", "{}", handler, &h, &res);
	emit_there = has && strcmp(has, "t") == 0;
	if (emit_there)
	{
		uint8_t		key[IDEM_DIGEST_BYTES];
		char		hex[65];
		redisContext *c = rv_open();
		redisReply *r = NULL;
		int64_t		end = now_ms() + 15000;
		int			i;

		tap_ok_ext(res.status == IDEM_APPLIED, "a run that emits two messages is applied (%s: %s)",
				   idem_status_name(res.status), res.error_message);
		idem_key(S, "emit-2", key);
		for (i = 0; i < 32; i++)
			sprintf(hex + 2 * i, "%02x", key[i]);
		while (c && now_ms() < end)
		{
			if (r)
				freeReplyObject(r);
			r = rv(c, "XRANGE %s - +", stream);
			if (r && r->type == REDIS_REPLY_ARRAY && r->elements >= 2)
				break;
			sleep_ms(50);
		}
		snprintf(id2, sizeof(id2), "%s-2", hex);
		tap_ok_ext(r && r->type == REDIS_REPLY_ARRAY && r->elements == 2 &&
				   r->element[0]->element[1]->elements == 4 &&
				   strcmp(r->element[0]->element[1]->element[0]->str, "id") == 0 &&
				   strncmp(r->element[0]->element[1]->element[1]->str, hex, 64) == 0 &&
				   strcmp(r->element[0]->element[1]->element[1]->str + 64, "-1") == 0 &&
				   strcmp(r->element[0]->element[1]->element[2]->str, "body") == 0 &&
				   strcmp(r->element[1]->element[1]->element[1]->str, id2) == 0,
				   "its messages are published in order as <key>-1 and <key>-2, and the failed run's never");
		if (r)
			freeReplyObject(r);
		if (c)
			redisFree(c);
	}
	else
	{
		tap_ok_ext(res.status == IDEM_ERROR && res.error_code == IDEM_ERR_SERVER &&
				   strcmp(res.sqlstate, "42883") == 0 && effects_n(S, "emit-2") == 0,
				   "without idem_emit in the server, a run that emits fails with its error and commits nothing (%s %s)",
				   res.sqlstate, res.error_message);
		tap_skip_ext("publishing: idem_emit is not in this extension yet");
	}
	free(has);
	idem_runner_close(R);
}

/* ---- the consumer ---- */

typedef struct seen
{
	int			n;
	char		status[16][24];
	int			acked[16];
} seen;

static void
on_settled(void *arg, const char *message_id, const idem_result *res, int acked)
{
	seen	   *s = arg;

	(void) message_id;
	if (s->n < 16)
	{
		snprintf(s->status[s->n], sizeof(s->status[0]), "%s", idem_status_name(res->status));
		s->acked[s->n] = acked;
	}
	s->n++;
}

static idem_consumer *
open_consumer(idem_runner *R, const char *stream, const char *name, hctx *h,
			  int claim_idle_ms, seen *s)
{
	idem_consumer_options co;

	idem_consumer_options_init(&co);
	co.stream = stream;
	co.group = "g";
	co.consumer = name;
	co.task_scope = S;
	co.tenant_id = 1;
	co.handler = handler;
	co.user_data = h;
	co.block_ms = 100;
	co.claim_idle_ms = claim_idle_ms;
	co.dead_letter_stream = DEAD;
	if (s)
	{
		co.settled = on_settled;
		co.settled_arg = s;
	}
	return idem_consumer_open(R, "127.0.0.1", E.valkey_port, &co);
}

static long
drain(idem_consumer *c, long acked)
{
	idem_consumer_stats st;
	int64_t		end = now_ms() + 15000;

	idem_consumer_stats_init(&st);
	for (;;)
	{
		idem_consumer_get_stats(c, &st);
		if (st.acked >= acked || now_ms() > end)
			return st.acked;
		if (idem_consumer_poll(c) < 0)
			tap_diag_ext("poll: %s", idem_consumer_error_message(c));
	}
}

/*
 * End to end: a run emits in stage 1 (and is redelivered: replayed, no new
 * message), the server's worker publishes, a consumer applies each
 * message once in stage 2.
 */
static void
test_pipeline(void)
{
	idem_runner *R = open_runner();
	char		stream[96];
	char		like[80];
	uint8_t		key[IDEM_DIGEST_BYTES];
	hctx		h;
	idem_result res;
	idem_consumer *c;
	const char *p[2];
	int			i;

	snprintf(stream, sizeof(stream), "%s.pipe", S);
	memset(&h, 0, sizeof(h));
	h.emit_stream = stream;
	idem_result_init(&res);
	idem_run(R, 1, S, "pipe-1", "{}", handler, &h, &res);
	idem_run(R, 1, S, "pipe-1", "{}", handler, &h, &res);
	tap_ok_ext(res.status == IDEM_REPLAYED && effects_n(S, "pipe-1") == 1,
			   "stage 1: a run that emits, redelivered, is replayed (%s)", idem_status_name(res.status));
	{
		/* the messages go with the completion: the runner's own waits for
		 * PostgreSQL (the handler's excluded) are as many as without */
		idem_runner_stats st0,
					st1,
					st2;
		hctx		plain;

		memset(&plain, 0, sizeof(plain));
		idem_runner_stats_init(&st0);
		idem_runner_stats_init(&st1);
		idem_runner_stats_init(&st2);
		idem_runner_get_stats(R, &st0);
		idem_run(R, 1, S, "pipe-plain", "{}", handler, &plain, &res);
		idem_runner_get_stats(R, &st1);
		idem_run(R, 1, S, "pipe-2", "{}", handler, &h, &res);
		idem_runner_get_stats(R, &st2);
		tap_ok_ext(res.status == IDEM_APPLIED &&
				   st2.pg_round_trips - st1.pg_round_trips == st1.pg_round_trips - st0.pg_round_trips,
				   "a run that emits two messages sends PostgreSQL no more pipelines than one that emits none: they go with the completion (%ld, %ld)",
				   st2.pg_round_trips - st1.pg_round_trips, st1.pg_round_trips - st0.pg_round_trips);
	}
	memset(&h, 0, sizeof(h));
	c = open_consumer(R, stream, "c1", &h, 30000, NULL);
	drain(c, 4);
	idem_key(S, "pipe-1", key);
	for (i = 0; i < 32; i++)
		sprintf(like + 2 * i, "%02x", key[i]);
	snprintf(like + 64, sizeof(like) - 64, "-%%");
	p[0] = S;
	p[1] = like;
	tap_ok_ext(pg_int(admin, "SELECT count(*) FROM effects WHERE scope = $1 AND id LIKE $2", 2, p) == 2 &&
			   pg_int(admin, "SELECT count(DISTINCT id) FROM effects WHERE scope = $1 AND id LIKE $2", 2, p) == 2 &&
			   pending_n(stream, "g") == 0,
			   "stage 2: the consumer applies each published message once and acknowledges it");
	idem_consumer_close(c);
	idem_runner_close(R);
}

static void
test_consume_once(void)
{
	idem_runner *R = open_runner();
	char		stream[96];
	char		id[32];
	hctx		h;
	idem_consumer *c;
	idem_consumer_stats st;
	int			i;
	int			once = 1;

	snprintf(stream, sizeof(stream), "%s.once", S);
	for (i = 0; i < 20; i++)
	{
		snprintf(id, sizeof(id), "m%d", i);
		xadd(stream, id, "{\"n\":1}");
	}
	for (i = 0; i < 20; i += 4)
	{
		snprintf(id, sizeof(id), "m%d", i);
		xadd(stream, id, "{\"n\":1}");	/* the publisher's repeat */
	}
	memset(&h, 0, sizeof(h));
	c = open_consumer(R, stream, "c1", &h, 30000, NULL);
	tap_ok_ext(drain(c, 25) == 25, "25 entries (5 of them repeats) are all acknowledged");
	for (i = 0; i < 20; i++)
	{
		snprintf(id, sizeof(id), "m%d", i);
		once &= effects_n(S, id) == 1;
	}
	idem_consumer_stats_init(&st);
	idem_consumer_get_stats(c, &st);
	tap_ok_ext(once && h.calls == 20 && pending_n(stream, "g") == 0 && st.read == 25,
			   "each message applied once, the repeats replayed, nothing pending (%d calls)", h.calls);
	idem_consumer_close(c);
	idem_runner_close(R);
}

static void
test_retry_and_malformed(void)
{
	idem_runner *R = open_runner();
	char		stream[96];
	hctx		h;
	seen		s;
	idem_consumer *c;
	idem_consumer_stats st;
	redisContext *rc;
	redisReply *r;

	snprintf(stream, sizeof(stream), "%s.retry", S);
	xadd(stream, "r1", "{}");
	memset(&h, 0, sizeof(h));
	memset(&s, 0, sizeof(s));
	h.fail_first = 1;
	c = open_consumer(R, stream, "c1", &h, 300, &s);
	(void) idem_consumer_poll(c);
	tap_ok_ext(s.n == 1 && strcmp(s.status[0], "failed_retryable") == 0 && !s.acked[0] &&
			   pending_n(stream, "g") == 1,
			   "a retryable failure is not acknowledged: the entry stays pending");
	drain(c, 1);
	tap_ok_ext(s.n == 2 && strcmp(s.status[1], "applied") == 0 && s.acked[1] &&
			   effects_n(S, "r1") == 1 && pending_n(stream, "g") == 0,
			   "it comes back after claim_idle_ms (XAUTOCLAIM), is applied once and acknowledged");

	rv_cmd_ok("XADD %s * body {}", stream);
	rv_cmd_ok("XADD %s * id x2 body {nope", stream);
	xadd(stream, "p1", "{\"permanent\":1}");
	drain(c, 4);
	idem_consumer_stats_init(&st);
	idem_consumer_get_stats(c, &st);
	rc = rv_open();
	r = rc ? rv(rc, "XRANGE %s - +", DEAD) : NULL;
	tap_ok_ext(st.malformed == 2 && st.dead_lettered == 2 && st.acked == 4 &&
			   pending_n(stream, "g") == 0 && r && r->type == REDIS_REPLY_ARRAY &&
			   r->elements == 2,
			   "two malformed entries (no id, a body not JSON) are dead-lettered and acknowledged, a permanent failure acknowledged");
	if (r)
		freeReplyObject(r);
	if (rc)
		redisFree(rc);
	idem_consumer_close(c);
	idem_runner_close(R);
}

static void
test_killed(void)
{
	char		stream[96];
	int			fds[2];
	pid_t		pid;
	char		b;
	idem_runner *R;
	idem_consumer *c;
	hctx		h;
	seen		s;
	idem_consumer_stats st;

	snprintf(stream, sizeof(stream), "%s.kill", S);
	xadd(stream, "k1", "{}");
	if (pipe(fds) != 0)
		return;
	pid = fork();
	if (pid == 0)
	{
		/* the consumer that dies mid-message */
		close(fds[0]);
		R = open_runner();
		memset(&h, 0, sizeof(h));
		h.hang = 1;
		h.fd = fds[1];
		c = open_consumer(R, stream, "dying", &h, 60000, NULL);
		for (;;)
			(void) idem_consumer_poll(c);
	}
	close(fds[1]);
	tap_ok_ext(read(fds[0], &b, 1) == 1, "a consumer runs the entry's handler");
	kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
	close(fds[0]);
	R = open_runner();
	memset(&h, 0, sizeof(h));
	memset(&s, 0, sizeof(s));
	c = open_consumer(R, stream, "heir", &h, 500, &s);
	drain(c, 1);
	idem_consumer_stats_init(&st);
	idem_consumer_get_stats(c, &st);
	tap_ok_ext(st.claimed == 1 && st.acked == 1 && s.n == 1 && strcmp(s.status[0], "applied") == 0 &&
			   effects_n(S, "k1") == 1 && pending_n(stream, "g") == 0,
			   "SIGKILLed mid-message: another consumer takes the entry over (XAUTOCLAIM) and applies it once");
	idem_consumer_close(c);
	idem_runner_close(R);
}

/*
 * Valkey restarted empty (no persistence) under a live consumer: its polls
 * fail meanwhile (-1, after waiting), then it connects again, creates the
 * group again (NOGROUP) and consumes what is published after.
 */
static void
test_valkey_restart(void)
{
	idem_runner *R = open_runner();
	char		stream[96];
	hctx		h;
	idem_consumer *c;
	idem_consumer_stats st;
	int			failed = 0;
	int			i;

	if (E.valkey_start == NULL || E.valkey_start[0] == '\0')
	{
		tap_skip_ext("Valkey restart: no start command");
		idem_runner_close(R);
		return;
	}
	snprintf(stream, sizeof(stream), "%s.restart", S);
	xadd(stream, "v1", "{}");
	memset(&h, 0, sizeof(h));
	c = open_consumer(R, stream, "c1", &h, 30000, NULL);
	drain(c, 1);
	valkey_kill(SIGKILL);
	for (i = 0; i < 3; i++)
		failed += idem_consumer_poll(c) == -1;
	valkey_start();
	wait_owner_key();
	xadd(stream, "v2", "{}");
	drain(c, 2);
	idem_consumer_stats_init(&st);
	idem_consumer_get_stats(c, &st);
	tap_ok_ext(failed == 3 && st.acked == 2 && effects_n(S, "v2") == 1 &&
			   pending_n(stream, "g") == 0,
			   "Valkey restarted empty under a live consumer: its polls fail meanwhile, then it creates the group again and applies what comes next (%d failed, %ld acked: %s)",
			   failed, st.acked, idem_consumer_error_message(c));
	idem_consumer_close(c);
	idem_runner_close(R);
}

/* ---- a crash of the server right after the XACK ---- */

/*
 * A long WAL-writer cycle that starts now: an asynchronous commit, then
 * wal_writer_delay = 10s reloaded (and wal_writer_flush_after = 0: what
 * it writes, it flushes, so that the flush position shows it); once the
 * WAL writer has written that commit out it sleeps 10 s (not hibernating:
 * it just did work), so that an asynchronous commit made meanwhile is in
 * shared memory only.  1 if the cycle started.
 */
static int
long_wal_cycle(void)
{
	char	   *lsn;
	int64_t		end = now_ms() + 5000;
	int			ok = 0;

	pg_ok(admin, "SET synchronous_commit = on");
	pg_ok(admin, "SET client_min_messages = warning");
	pg_ok(admin, "CREATE TABLE IF NOT EXISTS crash_marks (id text)");
	pg_ok(admin, "SET synchronous_commit = off");
	pg_ok(admin, "INSERT INTO crash_marks VALUES ('cycle')");
	lsn = pg_val(admin, "SELECT pg_current_wal_insert_lsn()::text", 0, NULL);
	pg_ok(admin, "ALTER SYSTEM SET wal_writer_delay = '10s'");
	pg_ok(admin, "ALTER SYSTEM SET wal_writer_flush_after = 0");
	pg_ok(admin, "SELECT pg_reload_conf()");
	while (lsn && !ok && now_ms() < end)
	{
		const char *p[1] = {lsn};

		ok = pg_int(admin, "SELECT (pg_current_wal_flush_lsn() >= $1::pg_lsn)::int", 1, p) == 1;
		if (!ok)
			sleep_ms(10);
	}
	free(lsn);
	return ok;
}

/* The crash: kill -9 of every process of the server, then its start. */
static void
crash_server(void)
{
	int			rc = system(E.pg_crash);

	if (rc != 0)
		tap_diag_ext("%s: status %d", E.pg_crash, rc);
	PQfinish(admin);
	admin = pg_open(E.pg);
	pg_ok(admin, "ALTER SYSTEM RESET wal_writer_delay");
	pg_ok(admin, "ALTER SYSTEM RESET wal_writer_flush_after");
	pg_ok(admin, "SELECT pg_reload_conf()");
}

static long long
mark_n(const char *id)
{
	const char *p[1] = {id};

	return pg_int(admin, "SELECT count(*) FROM crash_marks WHERE id = $1", 1, p);
}

/*
 * A consumer whose connection has synchronous_commit = off acknowledges
 * an entry; the server is killed (-9) right after the XACK, with a 10 s
 * WAL-writer cycle, and restarts.  The entry's run must be there (or the
 * entry still pending): applied by this consumer (its commit), or
 * replayed from a row another session committed with off, not flushed
 * (its answer).  An asynchronous commit made just before the crash is
 * lost: the crash did lose what was not written out.
 */
static void
test_crash_after_ack(int replay)
{
	char		conninfo[600];
	char		stream[96];
	const char *mid = replay ? "crash-replay" : "crash-applied";
	idem_runner *R;
	idem_consumer *c;
	idem_result res;
	hctx		h;
	seen		s;
	long		acked;
	long long	effects;
	long long	pending;
	long long	lost_mark;

	if (E.pg_crash[0] == '\0')
	{
		tap_skip_ext("a crash after the XACK: no crash command");
		return;
	}
	snprintf(conninfo, sizeof(conninfo), "%s options='-csynchronous_commit=off'", E.pg);
	snprintf(stream, sizeof(stream), "%s.crash%d", S, replay);
	R = open_runner_on(conninfo);
	memset(&h, 0, sizeof(h));
	memset(&s, 0, sizeof(s));
	c = open_consumer(R, stream, "c1", &h, 30000, &s);
	if (!long_wal_cycle())
		tap_diag_ext("the WAL writer did not write out a commit within 5 s");
	if (replay)
	{
		/* another session completes the id with off: not written out */
		idem_result_init(&res);
		idem_run(R, 1, S, mid, "{}", handler, &h, &res);
	}
	xadd(stream, mid, "{}");
	acked = drain(c, 1);
	pg_ok(admin, "INSERT INTO crash_marks VALUES ('lost')");	/* off */
	crash_server();
	effects = effects_n(S, mid);
	pending = pending_n(stream, "g");
	lost_mark = mark_n("lost");
	tap_ok_ext(acked == 1 && s.n == 1 &&
			   strcmp(s.status[0], replay ? "replayed" : "applied") == 0 &&
			   (effects == 1 || pending == 1) && lost_mark == 0,
			   "%s with synchronous_commit = off, acknowledged, then a crash of the server: the run survives (effects %lld, pending %lld; %s; an asynchronous commit just before the crash was %s)",
			   replay ? "a replay of a row committed by another session" : "a run applied",
			   effects, pending, s.n ? s.status[0] : "no run",
			   lost_mark == 0 ? "lost, as it should" : "kept: the crash proved nothing");
	pg_ok(admin, "DELETE FROM crash_marks");
	idem_consumer_close(c);
	idem_runner_close(R);
}

static void
test_options(void)
{
	idem_runner *R = open_runner();
	idem_consumer_options co;
	idem_consumer *c;

	idem_consumer_options_init(&co);
	co.stream = "s";
	c = idem_consumer_open(R, "127.0.0.1", E.valkey_port, &co);
	tap_ok_ext(c != NULL && idem_consumer_poll(c) == -1 &&
			   strstr(idem_consumer_error_message(c), "group is required") != NULL,
			   "a consumer without a group fails every poll and says why (%s)",
			   c ? idem_consumer_error_message(c) : "NULL");
	idem_consumer_close(c);
	idem_runner_close(R);
}

int
consume_main(int argc, char **argv)
{
	(void) argc;
	(void) argv;
	snprintf(S, sizeof(S), "consume%s.%d", E.suffix, (int) getpid());
	snprintf(DEAD, sizeof(DEAD), "%s.dead", S);
	admin = pg_open(E.pg);
	if (admin == NULL)
	{
		tap_ok_ext(0, "PostgreSQL reachable");
		return tap_finish();
	}
	test_options();
	test_emit();
	test_consume_once();
	test_retry_and_malformed();
	test_killed();
	test_valkey_restart();
	if (emit_there)
		test_pipeline();
	else
		tap_skip_ext("end to end: idem_emit is not in this extension yet");
	test_crash_after_ack(0);
	test_crash_after_ack(1);
	PQfinish(admin);
	return tap_finish();
}
