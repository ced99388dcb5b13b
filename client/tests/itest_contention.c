/*
 * itest_contention.c: exactly once under contention, and under faults.
 *
 *	  itest contention clean|faults
 *
 * W worker processes, each with its own runner, get shuffled streams of
 * deliveries in which every message appears 1-4 times across the workers
 * (at-least-once delivery with duplicates and reordering).  A delivery that
 * ends busy or in an error goes back to the worker's queue (redelivery); a
 * worker ends when its queue is empty.  The handler inserts into `effects`,
 * a table with no unique key, so a doubled effect would show.
 *
 * "faults" also, while the workers run: FLUSHALL; pg_terminate_backend() of
 * a runner's backend in the middle of a handler; SIGKILL of a worker in the
 * middle of a handler, then the worker's whole stream delivered again; Valkey
 * killed and restarted; and some handlers that sleep past their lease.
 *
 * Then: every message has exactly one effect and one completed ledger row
 * (attempt 1); every delivery's log line is applied (once per message),
 * replayed or busy -- or, in the faults round, an error that was redelivered;
 * every replay returned the applied outcome byte for byte.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include "itest.h"

#define W		4
#define MAXDEL	1024

typedef struct wslot
{
	volatile pid_t pid;
	volatile int in_handler;	/* message index + 1 while in the handler;
								 * the parent swaps it to -(index + 1) to
								 * hold the worker in its handler */
	volatile int backend_pid;
} wslot;

typedef struct shm
{
	volatile long handler_done;
	wslot		w[W];
} shm;

static shm *SH;
static int	faults;
static int	M;
static int	lease_ms;
static char scope[64];
static char workdir[512];
static int	ndel[W];
static int	del[W][MAXDEL];

static uint64_t rs = 88172645463325252ULL;

static uint32_t
rnd32(void)
{
	rs ^= rs << 13;
	rs ^= rs >> 7;
	rs ^= rs << 17;
	return (uint32_t) (rs >> 11);
}

static int
is_platform(int i)
{
	return i % 10 == 9;
}

static int64_t
tenant_of(int i)
{
	return 1 + i % 5;
}

static int
is_slow(int i)
{
	return faults && i % 29 == 11;
}

static void
msg_id(int i, char *buf, size_t n)
{
	snprintf(buf, n, "m%03d", i);
}

static void
request_of(int i, char *buf, size_t n)
{
	snprintf(buf, n, "{\"amount\": %d, \"m\": %d}", i * 3, i);
}

static void
outcome_of(int i, char *buf, size_t n)
{
	/* already canonical: keys by length, then bytes */
	snprintf(buf, n, "{\"m\": %d, \"id\": \"m%03d\", \"double\": %d}", i, i, i * 6);
}

typedef struct wctx
{
	int			idx;
	int			msg;
	int			first;			/* the INSERT went with the claim (first_sql) */
} wctx;

#define EFFECT_SQL "INSERT INTO effects (scope, id, tenant, attempt, worker) VALUES ($1, $2, $3, 1, $4)"

static idem_handler_status
whandler(PGconn *conn, idem_call *call, void *ud)
{
	wctx	   *c = ud;
	char		id[16],
				ten[24],
				wk[16],
				out[128];
	const char *p[4];
	PGresult   *r;
	int			ok;

	SH->w[c->idx].backend_pid = PQbackendPID(conn);
	SH->w[c->idx].in_handler = c->msg + 1;
	msg_id(c->msg, id, sizeof(id));
	snprintf(ten, sizeof(ten), "%lld", (long long) idem_call_tenant_id(call));
	snprintf(wk, sizeof(wk), "%d", c->idx);
	p[0] = scope;
	p[1] = id;
	p[2] = ten;
	p[3] = wk;
	if (c->first)
	{
		const PGresult *f = idem_call_first_result(call);

		ok = f != NULL && PQresultStatus(f) == PGRES_COMMAND_OK;
	}
	else
	{
		r = PQexecParams(conn, EFFECT_SQL, 4, NULL, p, NULL, NULL, 0);
		ok = PQresultStatus(r) == PGRES_COMMAND_OK;
		PQclear(r);
	}
	if (ok)
		sleep_ms(is_slow(c->msg) ? lease_ms + 400 : faults ? 15 : 1);
	/* leave the handler, unless the parent holds us in it for a fault */
	for (;;)
	{
		int			v = SH->w[c->idx].in_handler;

		if (v == 0 ||
			(v == c->msg + 1 &&
			 __sync_bool_compare_and_swap(&SH->w[c->idx].in_handler, v, 0)))
			break;
		sleep_ms(1);
	}
	__sync_fetch_and_add(&SH->handler_done, 1);
	if (!ok)
	{
		idem_call_set_json(call, "{\"error\": \"insert failed\"}");
		return IDEM_HANDLER_RETRYABLE;
	}
	outcome_of(c->msg, out, sizeof(out));
	idem_call_set_json(call, out);
	return IDEM_HANDLER_OK;
}

/* The warm-up's handler: no effect. */
static idem_handler_status
warm_handler(PGconn *conn, idem_call *call, void *ud)
{
	(void) conn;
	(void) ud;
	idem_call_set_json(call, "{}");
	return IDEM_HANDLER_OK;
}

static void
logline(int fd, const char *fmt,...) __attribute__((format(printf, 2, 3)));
static void
logline(int fd, const char *fmt,...)
{
	char		buf[512];
	va_list		ap;
	int			n;

	va_start(ap, fmt);
	n = vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	if (n > 0 && write(fd, buf, (size_t) n) != n)
		_exit(5);
}

/*
 * After the run, once the server's worker has copied every result: one more
 * delivery of each message, which the Valkey gate must answer (a replay of
 * the stored result, from Valkey).  During the run most duplicates race
 * their first delivery and meet its marker, so how many the gate answers
 * there depends on timing; here it does not.  Returns how many came from
 * Valkey, byte for byte the applied outcome.
 */
static int
late_valkey_replays(void)
{
	idem_options o;
	idem_runner *r;
	int			m,
				n = 0;

	await_worker_settled(10000);
	idem_options_init(&o);
	o.lease_ms = lease_ms;
	r = idem_runner_open(E.pg, "127.0.0.1", E.valkey_port, &o);
	if (r == NULL)
		return -1;
	for (m = 0; m < M; m++)
	{
		char		id[16],
					req[128],
					want[128];
		idem_result res;
		wctx		c;

		idem_result_init(&res);
		msg_id(m, id, sizeof(id));
		request_of(m, req, sizeof(req));
		outcome_of(m, want, sizeof(want));
		c.idx = 0;			/* the handler must not run; if it did, the check fails */
		c.msg = m;
		c.first = 0;
		if (is_platform(m))
			idem_run_platform(r, scope, id, req, whandler, &c, &res);
		else
			idem_run(r, tenant_of(m), scope, id, req, whandler, &c, &res);
		if (res.status == IDEM_REPLAYED && res.source == IDEM_SOURCE_VALKEY &&
			strcmp(res.outcome, want) == 0)
			n++;
		else
			tap_diag_ext("late delivery of m%03d: %s/%s", m, idem_status_name(res.status),
						 idem_source_name(res.source));
	}
	idem_runner_close(r);
	return n;
}

/* One worker: its stream, with redelivery of busy and failed deliveries. */
static int
worker(int idx)
{
	idem_options o;
	idem_runner *r;
	int			q[4 * MAXDEL];
	int64_t		nb[4 * MAXDEL];
	int			head = 0,
				tail = 0,
				i;
	char		path[600];
	int			fd;
	int			bad = 0;
	int64_t		deadline = now_ms() + 90000;

	snprintf(path, sizeof(path), "%s/%s-%d.log", workdir, scope, idx);
	fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
	if (fd < 0)
		return 6;
	idem_options_init(&o);
	o.lease_ms = lease_ms;
	o.valkey_retry_ms = 100;
	o.valkey_command_timeout_ms = 200;
	o.cache_results = idx % 2 == 0;
	r = idem_runner_open(E.pg, "127.0.0.1", E.valkey_port, &o);
	if (r == NULL)
		return 7;
	/*
	 * 32 new keys of its own first (another scope, no effect): the runner
	 * then skips the gate until a claim answers a duplicate, so the
	 * stream's first deliveries, and the first duplicate among them, go
	 * that way.
	 */
	{
		char		wscope[80],
					wid[32];
		idem_result wres;

		snprintf(wscope, sizeof(wscope), "%s.warm", scope);
		idem_result_init(&wres);
		for (i = 0; i < 32; i++)
		{
			snprintf(wid, sizeof(wid), "%d-%d", (int) getpid(), i);
			idem_run(r, 1, wscope, wid, "{}", warm_handler, NULL, &wres);
		}
	}
	for (i = 0; i < ndel[idx]; i++)
	{
		q[tail] = del[idx][i];
		nb[tail++] = 0;
	}
	while (head < tail)
	{
		int			m = q[head];
		int64_t		when = nb[head];
		char		id[16],
					req[128],
					want[128];
		idem_result res;
		wctx		c;
		int			again = 0;

		idem_result_init(&res);
		head++;
		if (now_ms() > deadline)
			return 3;
		if (when > now_ms())
			sleep_ms((int) (when - now_ms()));
		msg_id(m, id, sizeof(id));
		request_of(m, req, sizeof(req));
		outcome_of(m, want, sizeof(want));
		c.idx = idx;
		c.msg = m;
		/* the odd workers send their effect with the claim (first_sql):
		 * a named prepared statement, but unnamed through a pooler */
		c.first = idx % 2 == 1 && !is_platform(m);
		if (is_platform(m))
			idem_run_platform(r, scope, id, req, whandler, &c, &res);
		else if (c.first)
		{
			idem_run_options ro;
			char		ten[24],
						wk[16];
			const char *fp[4] = {scope, id, ten, wk};

			snprintf(ten, sizeof(ten), "%lld", (long long) tenant_of(m));
			snprintf(wk, sizeof(wk), "%d", idx);
			idem_run_options_init(&ro);
			ro.first_sql = EFFECT_SQL;
			ro.first_nparams = 4;
			ro.first_params = fp;
			idem_run_with(r, tenant_of(m), scope, id, req, &ro, whandler, &c, &res);
		}
		else
			idem_run(r, tenant_of(m), scope, id, req, whandler, &c, &res);
		logline(fd, "%s %s %s %d %d\n", id, idem_status_name(res.status),
				idem_source_name(res.source), res.attempt, (int) res.error_code);
		switch (res.status)
		{
			case IDEM_APPLIED:
			case IDEM_REPLAYED:
				if (strcmp(res.outcome, want) != 0)
				{
					bad++;
					logline(fd, "# %s outcome %s, want %s\n", id, res.outcome, want);
				}
				break;
			case IDEM_BUSY:
				again = res.retry_after_ms < 100 ? (int) res.retry_after_ms : 100;
				if (again < 5)
					again = 5;
				break;
			case IDEM_ERROR:
				logline(fd, "# %s error: %s\n", id, res.error_message);
				again = 50;
				break;
			default:
				bad++;
				again = 50;
				break;
		}
		if (again)
		{
			if (tail >= 4 * MAXDEL)
			{
				/* compact the queue */
				memmove(q, q + head, (size_t) (tail - head) * sizeof(int));
				memmove(nb, nb + head, (size_t) (tail - head) * sizeof(int64_t));
				tail -= head;
				head = 0;
			}
			q[tail] = m;
			nb[tail++] = now_ms() + again;
		}
	}
	idem_runner_close(r);
	close(fd);
	return bad ? 4 : 0;
}

static pid_t
spawn(int idx)
{
	pid_t		pid;

	fflush(stdout);
	pid = fork();
	if (pid == 0)
		_exit(worker(idx));
	SH->w[idx].pid = pid;
	return pid;
}

/*
 * A worker in the middle of a handler (not a slow one), held there until
 * release(): the fault then surely lands mid-handler.  -1 if none came.
 */
static int
hold_in_handler(int wait_ms)
{
	int64_t		until = now_ms() + wait_ms;

	while (now_ms() < until)
	{
		int			i;

		for (i = 0; i < W; i++)
		{
			int			m = SH->w[i].in_handler;

			if (m > 0 && !is_slow(m - 1) && SH->w[i].pid > 0 &&
				__sync_bool_compare_and_swap(&SH->w[i].in_handler, m, -m))
				return i;
		}
		sleep_ms(1);
	}
	return -1;
}

static void
release(int w)
{
	SH->w[w].in_handler = 0;
}

int
contention_main(int argc, char **argv)
{
	PGconn	   *admin;
	int			i,
				k;
	int			total_del = 0;
	pid_t		pids[W];
	int			alive = W;
	int			wfail = 0;
	int			did_flush = 0,
				did_term = 0,
				did_kill = 0,
				did_valkey = 0;
	int			killed_msg = -1,
				term_msg = -1;
	int			applied[MAXDEL],
				replayed[MAXDEL],
				busy[MAXDEL],
				errors[MAXDEL],
				other[MAXDEL],
				unknown_commit[MAXDEL];
	long		n_rep_vk = 0,
				n_rep_pg = 0,
				n_busy_vk = 0,
				n_busy_pg = 0;
	int64_t		t0 = now_ms();

	faults = argc >= 2 && strcmp(argv[1], "faults") == 0;
	snprintf(scope, sizeof(scope), "%s%s", faults ? "cont.faults" : "cont.clean", E.suffix);
	M = faults ? 120 : 100;
	if (E.slow)
		M /= 4;
	lease_ms = faults ? 600 : 2000;
	snprintf(workdir, sizeof(workdir), "%s", getenv("IDEM_TEST_WORKDIR") ? getenv("IDEM_TEST_WORKDIR") : "/tmp");
	rs ^= (uint64_t) (faults ? 7 : 3);

	/*
	 * The worker copies before the deliveries start: an earlier test that
	 * stopped or restarted Valkey may have left it in its reconnect backoff
	 * (up to 5 s), and a run of this test lasts about as long.
	 */
	{
		int			took = worker_copies_within(15000);

		tap_diag_ext("the server's worker copied a probe result in %d ms", took);
	}

	SH = mmap(NULL, sizeof(shm), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (SH == MAP_FAILED)
		return 1;
	memset((void *) SH, 0, sizeof(shm));

	/* the streams: each message 1-4 times, on random workers, shuffled */
	for (i = 0; i < M; i++)
	{
		int			copies = 1 + rnd32() % 4;

		for (k = 0; k < copies; k++)
		{
			int			w = rnd32() % W;

			if (ndel[w] < MAXDEL)
			{
				del[w][ndel[w]++] = i;
				total_del++;
			}
		}
	}
	for (i = 0; i < W; i++)
		for (k = ndel[i] - 1; k > 0; k--)
		{
			int			j = rnd32() % (k + 1);
			int			t = del[i][k];

			del[i][k] = del[i][j];
			del[i][j] = t;
		}

	admin = pg_open(E.pg);
	if (admin == NULL)
	{
		tap_ok_ext(0, "connect");
		return tap_finish();
	}
	for (i = 0; i < W; i++)
		pids[i] = spawn(i);

	/* faults, at points of progress, while the workers run */
	while (alive > 0)
	{
		int			st;
		pid_t		p = waitpid(-1, &st, WNOHANG);
		long		done = SH->handler_done;

		if (p > 0)
		{
			for (i = 0; i < W; i++)
				if (pids[i] == p)
				{
					pids[i] = 0;
					alive--;
					if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
					{
						wfail++;
						tap_diag_ext("worker %d ended with status %d", i,
									 WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st));
					}
				}
			continue;
		}
		if (faults && !did_flush && done >= M * 15 / 100)
		{
			did_flush = rv_cmd_ok("FLUSHALL");
			tap_diag_ext("FLUSHALL after %ld handler runs", done);
		}
		else if (faults && did_flush && !did_term && done >= M * 30 / 100)
		{
			int			w = hold_in_handler(3000);

			if (w >= 0)
			{
				char		pid[16];
				const char *pp[1] = {pid};
				char	   *v;
				int			j;

				term_msg = -SH->w[w].in_handler - 1;
				snprintf(pid, sizeof(pid), "%d", SH->w[w].backend_pid);
				v = pg_val(admin, "SELECT pg_terminate_backend($1::int)", 1, pp);
				did_term = v && strcmp(v, "t") == 0;
				free(v);
				for (j = 0; j < 300 && pg_int(admin, "SELECT count(*) FROM pg_stat_activity WHERE pid = $1::int", 1, pp) > 0; j++)
					sleep_ms(10);
				release(w);
				tap_diag_ext("pg_terminate_backend(%s) of worker %d in the handler of m%03d", pid, w, term_msg);
			}
			else
				did_term = -1;
		}
		else if (faults && did_term && !did_kill && done >= M * 45 / 100)
		{
			int			w = hold_in_handler(3000);

			if (w >= 0)
			{
				int			st2;

				killed_msg = -SH->w[w].in_handler - 1;
				kill(pids[w], SIGKILL);
				waitpid(pids[w], &st2, 0);
				tap_diag_ext("SIGKILL of worker %d in the handler of m%03d; its stream is delivered again", w, killed_msg);
				SH->w[w].in_handler = 0;
				pids[w] = spawn(w);
				did_kill = 1;
			}
			else
				did_kill = -1;
		}
		else if (faults && did_kill && !did_valkey && done >= M * 60 / 100)
		{
			valkey_kill(SIGKILL);
			sleep_ms(300);
			did_valkey = valkey_start() == 0;
			tap_diag_ext("Valkey killed and restarted after %ld handler runs", done);
		}
		sleep_ms(2);
	}

	/* effects: exactly one per message */
	{
		const char *p[1] = {scope};
		PGresult   *r = PQexecParams(admin, "SELECT id, count(*) FROM effects WHERE scope = $1 GROUP BY id",
									 1, NULL, p, NULL, NULL, 0);
		int			once = 0,
					wrong = 0;

		for (i = 0; i < PQntuples(r); i++)
		{
			if (strcmp(PQgetvalue(r, i, 1), "1") == 0)
				once++;
			else
			{
				wrong++;
				tap_diag_ext("%s has %s effects", PQgetvalue(r, i, 0), PQgetvalue(r, i, 1));
			}
		}
		PQclear(r);
		tap_ok_ext(once == M && wrong == 0,
				   "%s: %d messages, %d deliveries on %d workers: each effect exactly once (%d once, %d wrong, %d missing)",
				   scope, M, total_del, W, once, wrong, M - once - wrong);
	}
	/* the ledger: one completed row per message, attempt 1 */
	{
		int			good = 0;

		for (i = 0; i < M; i++)
		{
			char		id[16],
						ten[24];
			const char *p[3];
			char	   *v;

			msg_id(i, id, sizeof(id));
			snprintf(ten, sizeof(ten), "%lld", (long long) tenant_of(i));
			p[0] = scope;
			p[1] = id;
			p[2] = ten;
			if (is_platform(i))
				v = pg_val(admin, "SELECT status || ' ' || attempt FROM idem_platform_lookup(idem_key($1, $2))", 2, p);
			else
				v = pg_val(admin, "SELECT status || ' ' || attempt FROM idem_lookup($3::bigint, idem_key($1, $2))", 3, p);
			if (v && strcmp(v, "completed 1") == 0)
				good++;
			else
				tap_diag_ext("ledger of %s: %s", id, v ? v : "(no row)");
			free(v);
		}
		tap_ok_ext(good == M, "%s: every message has one completed ledger row, attempt 1 (%d of %d)", scope, good, M);
	}
	/* the logs */
	memset(applied, 0, sizeof(applied));
	memset(replayed, 0, sizeof(replayed));
	memset(busy, 0, sizeof(busy));
	memset(errors, 0, sizeof(errors));
	memset(other, 0, sizeof(other));
	memset(unknown_commit, 0, sizeof(unknown_commit));
	for (i = 0; i < W; i++)
	{
		char		path[600],
					line[512];
		FILE	   *f;

		snprintf(path, sizeof(path), "%s/%s-%d.log", workdir, scope, i);
		f = fopen(path, "r");
		if (f == NULL)
			continue;
		while (fgets(line, sizeof(line), f))
		{
			int			m,
						att,
						code;
			char		st[32],
						src[32];

			if (line[0] == '#')
			{
				if (strstr(line, "outcome"))
					tap_diag_ext("%s", line);
				continue;
			}
			if (sscanf(line, "m%d %31s %31s %d %d", &m, st, src, &att, &code) != 5 || m < 0 || m >= M)
				continue;
			if (strcmp(st, "applied") == 0)
				applied[m]++;
			else if (strcmp(st, "replayed") == 0)
			{
				replayed[m]++;
				if (strcmp(src, "valkey") == 0)
					n_rep_vk++;
				else
					n_rep_pg++;
			}
			else if (strcmp(st, "busy") == 0)
			{
				busy[m]++;
				if (strcmp(src, "valkey") == 0)
					n_busy_vk++;
				else
					n_busy_pg++;
			}
			else if (strcmp(st, "error") == 0)
			{
				errors[m]++;
				if (code == IDEM_ERR_COMMIT_UNKNOWN)
					unknown_commit[m]++;
			}
			else
				other[m]++;
		}
		fclose(f);
	}
	{
		int			once = 0,
					nerr = 0,
					noth = 0,
					dups_ok = 1;

		for (i = 0; i < M; i++)
		{
			if (applied[i] == 1 || (applied[i] == 0 && unknown_commit[i] > 0))
				once++;
			else
				tap_diag_ext("m%03d applied %d times", i, applied[i]);
			nerr += errors[i];
			noth += other[i];
		}
		if (noth)
			dups_ok = 0;
		tap_ok_ext(once == M && dups_ok,
				   "%s: every message applied by exactly one delivery; every other delivery got replay or busy"
				   " (replays: %ld Valkey, %ld PostgreSQL; busy: %ld Valkey, %ld PostgreSQL; other: %d)",
				   scope, n_rep_vk, n_rep_pg, n_busy_vk, n_busy_pg, noth);
		tap_ok_ext(wfail == 0, "%s: all workers drained their queues, and every replay returned the applied outcome byte for byte", scope);
		if (!faults)
		{
			int			late = worker_writes_idem2() ? late_valkey_replays() : M;

			tap_ok_ext(nerr == 0 && late == M,
					   "%s: no errors without faults; the Valkey gate answered %ld replays during the run, and all %d late redeliveries (%d)",
					   scope, n_rep_vk, M, late);
		}
		else
		{
			tap_ok_ext(did_flush == 1, "faults: FLUSHALL mid-run, zero lost and zero doubled effects (checked above)");
			tap_ok_ext(did_term == 1 && term_msg >= 0 && errors[term_msg] > 0,
					   "faults: pg_terminate_backend of a runner's backend mid-handler of m%03d; that delivery failed (%d errors) and was redelivered",
					   term_msg, term_msg >= 0 ? errors[term_msg] : 0);
			tap_ok_ext(did_kill == 1 && killed_msg >= 0 && applied[killed_msg] + unknown_commit[killed_msg] == 1,
					   "faults: worker SIGKILLed mid-handler of m%03d; redelivered after the lease, applied once", killed_msg);
			tap_ok_ext(did_valkey == 1, "faults: Valkey killed mid-run and restarted (empty); runners went on without it");
			{
				int			slow = 0,
							slow_ok = 0;

				for (i = 0; i < M; i++)
					if (is_slow(i))
					{
						slow++;
						if (applied[i] == 1)
							slow_ok++;
					}
				tap_ok_ext(slow > 0 && slow_ok == slow,
						   "faults: %d handlers ran %d ms past their %d ms lease; each applied once", slow, 400, lease_ms);
			}
		}
		tap_diag_ext("%s took %lld ms", scope, (long long) (now_ms() - t0));
	}
	PQfinish(admin);
	munmap((void *) SH, sizeof(shm));
	return tap_finish();
}
