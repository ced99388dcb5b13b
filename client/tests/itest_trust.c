/*
 * itest_trust.c: the client's side of issue 12 against the real servers
 * (itest trust).  Valkey may only make things faster, never change an
 * outcome; the client is honest about what it knows.
 *
 *	  - forged, altered, moved values and markers that claim more than a
 *		lease: never a replay, never a mismatch, never busy past the lease;
 *		the effect applied once.  Each forgery is also written in the
 *		format and under the key name of the versions before 0.3, which
 *		trusted any well-formed value;
 *	  - a proxy that forwards COMMIT and drops its reply: "commit unknown";
 *	  - a 50 ms interval timer does not extend the Valkey deadline;
 *	  - a handler that ends the runner's transaction: its own error, also
 *		when it opens another with a savepoint of the documented name;
 *	  - a role without EXECUTE on idem_cache_secrets(): PostgreSQL only,
 *		said once.
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>

#include "itest.h"
#include "internal.h"

static PGconn *admin;
static char S[64];

typedef struct thctx
{
	const char *mode;
	int			calls;
} thctx;

static idem_handler_status
thandler(PGconn *conn, idem_call *call, void *ud)
{
	thctx	   *h = ud;
	char		ten[24],
				att[16];
	const char *p[4];
	PGresult   *r;

	h->calls++;
	snprintf(ten, sizeof(ten), "%lld", (long long) idem_call_tenant_id(call));
	snprintf(att, sizeof(att), "%d", idem_call_attempt(call));
	p[0] = idem_call_scope(call);
	p[1] = idem_call_id(call);
	p[2] = ten;
	p[3] = att;
	r = PQexecParams(conn, "INSERT INTO effects (scope, id, tenant, attempt) VALUES ($1, $2, $3, $4)",
					 4, NULL, p, NULL, NULL, 0);
	PQclear(r);
	if (h->mode && strcmp(h->mode, "commit") == 0)
		PQclear(PQexec(conn, "COMMIT"));
	else if (h->mode && strcmp(h->mode, "commit_begin") == 0)
		PQclear(PQexec(conn, "COMMIT; BEGIN"));
	else if (h->mode && strcmp(h->mode, "commit_begin_savepoint") == 0)
		PQclear(PQexec(conn, "COMMIT; BEGIN; SAVEPOINT idem_handler"));
	else if (h->mode && strcmp(h->mode, "rollback") == 0)
		PQclear(PQexec(conn, "ROLLBACK"));
	idem_call_set_json(call, "{\"done\": true}");
	return IDEM_HANDLER_OK;
}

static long long
effects(const char *id)
{
	const char *p[2] = {S, id};

	return pg_int(admin, "SELECT count(*) FROM effects WHERE scope = $1 AND id = $2", 2, p);
}

static char *
ledger(int64_t tenant, const char *id)
{
	char		t[24];
	const char *p[3] = {t, S, id};

	snprintf(t, sizeof(t), "%lld", (long long) tenant);
	return pg_val(admin, "SELECT status || ' ' || attempt FROM idem_lookup($1::bigint, idem_key($2, $3))", 3, p);
}

static const char *
rs(const idem_result *r)
{
	static char bufs[2][700];
	static int	which;
	char	   *buf = bufs[which++ % 2];	/* two in one message */

	snprintf(buf, sizeof(bufs[0]), "%s/%s attempt %d retry %ld %.300s",
			 idem_status_name(r->status), idem_source_name(r->source),
			 r->attempt, r->retry_after_ms,
			 r->status == IDEM_ERROR ? r->error_message : r->outcome);
	return buf;
}

/* Write value v under both the new key and the pre-0.3 key of (tenant, id). */
static void
plant(int64_t tenant, const char *id, const char *v_new, const char *v_old,
	  long long px)
{
	char		k[IDEM_CACHE_KEY_MAX];

	cache_key_of(k, sizeof(k), 0, tenant, S, id);
	if (v_new)
		rv_cmd_ok("SET %s %s PX %lld", k, v_new, px);
	old_cache_key_of(k, sizeof(k), 0, tenant, S, id);
	if (v_old)
		rv_cmd_ok("SET %s %s PX %lld", k, v_old, px);
}

/*
 * An idem1 value, the format before 0.3 ("idem1 <c|f> <attempt> <fingerprint
 * hex> <outcome>": no MAC, no expiry), as an older writer left it: nothing
 * reads it any more, and these tests plant it to check that it is ignored.
 */
static void
idem1_terminal(char *buf, size_t buflen, IdemCacheKind kind, int attempt,
			   const uint8_t fp[32], const char *outcome)
{
	char		fph[65];

	idem_cache_hex(fph, fp, 32);
	fph[64] = '\0';
	snprintf(buf, buflen, "idem1 %c %d %s %s", (char) kind, attempt, fph, outcome);
}

static void
fingerprint_of(const char *req, uint8_t fp[32], char fph[65])
{
	idem_fingerprint(req, strlen(req), fp, NULL, 0);
	idem_cache_hex(fph, fp, 32);
	fph[64] = '\0';
}

/* ---- forged and altered values ---- */
static void
test_values(idem_runner *R)
{
	idem_result res;
	thctx		h;
	uint8_t		fp[32],
				other[32],
				badkey[32];
	char		fph[65],
				oph[65];
	char		k[IDEM_CACHE_KEY_MAX];
	char		val[IDEM_CACHE_VALUE_MAX];
	char		old[IDEM_CACHE_VALUE_MAX];
	idem_runner_stats st0,
				st1;
	const char *req = "{\"amount\": 7}";
	const char *forged_out = "{\"done\": \"forged\"}";

	idem_result_init(&res);
	idem_runner_stats_init(&st0);
	idem_runner_stats_init(&st1);
	fingerprint_of(req, fp, fph);
	memset(other, 0xab, sizeof(other));
	idem_cache_hex(oph, other, 32);
	oph[64] = '\0';
	memset(badkey, 0x11, sizeof(badkey));

	/* 1. forged completed value with the right (public) fingerprint */
	cache_key_of(k, sizeof(k), 0, 1, S, "forged-c");
	{
		idem_hmac	hm;
		char		input[IDEM_CACHE_MAC_INPUT_MAX];
		uint8_t		mac[32];
		int			n = idem_cache_encode_terminal(val, sizeof(val), 1, IDEM_CACHE_COMPLETED, 1,
												   wall_ms() + 3600000, fp, forged_out,
												   strlen(forged_out));
		int			in = idem_cache_mac_input(input, sizeof(input), k, strlen(k), val, (size_t) n);

		/* a MAC made with a guessed secret */
		idem_hmac_key(&hm, badkey, sizeof(badkey));
		idem_hmac_sha256(&hm, input, (size_t) in, mac);
		idem_cache_set_mac(val, mac);
	}
	idem1_terminal(old, sizeof(old), IDEM_CACHE_COMPLETED, 1, fp, forged_out);
	plant(1, "forged-c", val, old, 3600000);
	idem_runner_get_stats(R, &st0);
	memset(&h, 0, sizeof(h));
	idem_run(R, 1, S, "forged-c", req, thandler, &h, &res);
	idem_runner_get_stats(R, &st1);
	tap_ok_ext(res.status == IDEM_APPLIED && h.calls == 1 && effects("forged-c") == 1,
			   "forged completed value (right fingerprint, no ledger row): not a replay; the handler applies the effect once (%s)",
			   rs(&res));
	tap_ok_ext(st1.cache_rejected > st0.cache_rejected,
			   "the forged value was counted as rejected (%ld -> %ld)", st0.cache_rejected, st1.cache_rejected);
	idem_run(R, 1, S, "forged-c", req, thandler, &h, &res);
	tap_ok_ext(res.status == IDEM_REPLAYED && strcmp(res.outcome, "{\"done\": true}") == 0 &&
			   h.calls == 1 && effects("forged-c") == 1,
			   "its redelivery replays the committed outcome, not the forged one (%s)", rs(&res));

	/* 2. forged mismatch: another fingerprint, no ledger row */
	{
		int			n = idem_cache_encode_terminal(val, sizeof(val), 1, IDEM_CACHE_COMPLETED, 1,
												   wall_ms() + 3600000, other, "{}", 2);

		(void) n;				/* all-zero MAC: forged */
	}
	idem1_terminal(old, sizeof(old), IDEM_CACHE_COMPLETED, 1, other, "{}");
	plant(1, "forged-m", val, old, 3600000);
	memset(&h, 0, sizeof(h));
	idem_run(R, 1, S, "forged-m", req, thandler, &h, &res);
	tap_ok_ext(res.status == IDEM_APPLIED && h.calls == 1 && effects("forged-m") == 1,
			   "forged value with another fingerprint: never a mismatch; applied once (%s)", rs(&res));
	/* an authentic value with another fingerprint: still PostgreSQL's word */
	cache_key_of(k, sizeof(k), 0, 1, S, "forged-m");
	await_worker_copy(k, NULL, 2000);	/* then plant over it */
	authentic_terminal(val, sizeof(val), k, 1, 1, other, "{}", wall_ms() + 3600000);
	rv_cmd_ok("SET %s %s PX 3600000", k, val);
	idem_run(R, 1, S, "forged-m", req, thandler, &h, &res);
	tap_ok_ext(res.status == IDEM_REPLAYED && res.source == IDEM_SOURCE_POSTGRES && h.calls == 1 &&
			   effects("forged-m") == 1,
			   "an authentic value with another fingerprint is only a hint: PostgreSQL says replay (%s)", rs(&res));

	/* 3. a value moved to another key (another id; another tenant) */
	memset(&h, 0, sizeof(h));
	idem_run(R, 1, S, "src", req, thandler, &h, &res);
	worker_copy(0, 1, S, "src");
	cache_key_of(k, sizeof(k), 0, 1, S, "src");
	{
		char	   *v = rv_get(k);

		idem_run(R, 1, S, "src", req, thandler, &h, &res);
		tap_ok_ext(v != NULL && res.status == IDEM_REPLAYED && res.source == IDEM_SOURCE_VALKEY,
				   "control: the authentic value replays from Valkey under its own key (%s)", rs(&res));
		idem1_terminal(old, sizeof(old), IDEM_CACHE_COMPLETED, 1, fp, "{\"done\": true}");
		plant(1, "moved", v, old, 3600000);
		plant(2, "src", v, old, 3600000);
		free(v);
	}
	memset(&h, 0, sizeof(h));
	idem_run(R, 1, S, "moved", req, thandler, &h, &res);
	tap_ok_ext(res.status == IDEM_APPLIED && h.calls == 1 && effects("moved") == 1,
			   "an authentic value moved to another key: not a replay; applied once (%s)", rs(&res));
	memset(&h, 0, sizeof(h));
	idem_run(R, 2, S, "src", req, thandler, &h, &res);
	tap_ok_ext(res.status == IDEM_APPLIED && h.calls == 1,
			   "an authentic value moved to another tenant's key: not a replay; applied once (%s)", rs(&res));

	/* 4. one flipped byte in the outcome of an authentic value */
	memset(&h, 0, sizeof(h));
	idem_run(R, 1, S, "flip", req, thandler, &h, &res);
	cache_key_of(k, sizeof(k), 0, 1, S, "flip");
	await_worker_copy(k, NULL, 2000);
	worker_copy(0, 1, S, "flip");
	{
		char	   *v = rv_get(k);
		char	   *t = v ? strstr(v, "true") : NULL;

		if (t)
			*t = 'T';			/* {"done": True} */
		rv_cmd_ok("SET %s %s PX 3600000", k, v ? v : "x");
		idem1_terminal(old, sizeof(old), IDEM_CACHE_COMPLETED, 1, fp, "{\"done\": 1}");
		plant(1, "flip", NULL, old, 3600000);
		free(v);
	}
	idem_run(R, 1, S, "flip", req, thandler, &h, &res);
	tap_ok_ext(res.status == IDEM_REPLAYED && res.source == IDEM_SOURCE_POSTGRES &&
			   strcmp(res.outcome, "{\"done\": true}") == 0 && h.calls == 1 && effects("flip") == 1,
			   "an authentic value with one byte flipped: ignored, PostgreSQL replays the committed outcome (%s)",
			   rs(&res));

	/* 5. a marker with a 1-day TTL */
	cache_key_of(k, sizeof(k), 0, 1, S, "day");
	authentic_marker(val, sizeof(val), k, wall_ms() + 86400000LL);
	plant(1, "day", val, "idem1 p 0123456789abcdef0123456789abcdef", 86400000LL);
	memset(&h, 0, sizeof(h));
	idem_run(R, 1, S, "day", req, thandler, &h, &res);
	tap_ok_ext(res.status == IDEM_APPLIED && h.calls == 1 && effects("day") == 1,
			   "a marker (even MACed) claiming a day on a %d ms lease: not busy; applied once (%s)",
			   30000, rs(&res));
	cache_key_of(k, sizeof(k), 0, 1, S, "day2");
	snprintf(val, sizeof(val), "idem2 %064d 1 p %lld 0123456789abcdef0123456789abcdef", 0,
			 (long long) (wall_ms() + 5000));
	plant(1, "day2", val, "idem1 p 0123456789abcdef0123456789abcdef", 86400000LL);
	memset(&h, 0, sizeof(h));
	idem_run(R, 1, S, "day2", req, thandler, &h, &res);
	tap_ok_ext(res.status == IDEM_APPLIED && h.calls == 1 && effects("day2") == 1,
			   "a forged marker with PX of a day: not busy; applied once (%s)", rs(&res));
	/*
	 * control: an authentic marker within the lease is busy, bounded by it
	 * (a marker set half a second ago on our lease of 30 s: one older than
	 * a second is the claim's to judge)
	 */
	cache_key_of(k, sizeof(k), 0, 1, S, "lease");
	authentic_marker(val, sizeof(val), k, wall_ms() + 29500);
	rv_cmd_ok("SET %s %s PX 86400000", k, val);
	memset(&h, 0, sizeof(h));
	idem_run(R, 1, S, "lease", req, thandler, &h, &res);
	tap_ok_ext(res.status == IDEM_BUSY && res.source == IDEM_SOURCE_VALKEY &&
			   res.retry_after_ms <= 29500 && h.calls == 0,
			   "control: an authentic marker within the lease is busy, retry after its deadline, not its PX (%s)",
			   rs(&res));

	/*
	 * 6. The gate (SET NX PX GET) returns no TTL: a marker is busy until the
	 * deadline in its MACed content, whatever Valkey's TTL of the key says
	 * (here none at all), and not a moment longer.  On a runner with a
	 * lease of 2 s, to which the marker is half a second old.
	 */
	cache_key_of(k, sizeof(k), 0, 1, S, "nottl");
	{
		int64_t		deadline = wall_ms() + 1500,
					t1;
		idem_options o2;
		idem_runner *R2;

		idem_options_init(&o2);
		o2.lease_ms = 2000;
		o2.valkey_command_timeout_ms = E.slow ? 2000 : 200;
		R2 = idem_runner_open(E.pg, "127.0.0.1", E.valkey_port, &o2);

		authentic_marker(val, sizeof(val), k, deadline);
		rv_cmd_ok("SET %s %s", k, val);
		memset(&h, 0, sizeof(h));
		t1 = wall_ms();
		idem_run(R2, 1, S, "nottl", req, thandler, &h, &res);
		tap_ok_ext(res.status == IDEM_BUSY && res.source == IDEM_SOURCE_VALKEY &&
				   res.retry_after_ms > 0 &&
				   res.retry_after_ms <= deadline - t1 && h.calls == 0,
				   "an authentic marker with no TTL in Valkey: busy until its own deadline (%s)",
				   rs(&res));
		while (wall_ms() <= deadline + 50)
			sleep_ms(50);
		idem_run(R2, 1, S, "nottl", req, thandler, &h, &res);
		tap_ok_ext(res.status == IDEM_APPLIED && h.calls == 1 && effects("nottl") == 1,
				   "the same marker, still in Valkey after its deadline: not busy; applied once (%s)",
				   rs(&res));
		idem_runner_close(R2);
	}
}

/* ---- a proxy that forwards COMMIT, then drops everything back ---- */
typedef struct cproxy
{
	int			listen_fd;
	int			port;
	int			target;
	pthread_t	thread;
	volatile int stop;
	volatile int armed;			/* drop after the next COMMIT */
	volatile int dropped;
} cproxy;

static int
contains(const char *buf, size_t n, const char *word)
{
	size_t		w = strlen(word),
				i;

	for (i = 0; i + w <= n; i++)
		if (memcmp(buf + i, word, w) == 0)
			return 1;
	return 0;
}

static void *
cproxy_main(void *arg)
{
	cproxy	   *p = arg;
	int			c = -1,
				s = -1;
	int			blackhole = 0;
	int64_t		close_at = 0;

	while (!p->stop)
	{
		struct pollfd pf[3];
		int			np = 0,
					i;

		pf[np].fd = p->listen_fd;
		pf[np++].events = POLLIN;
		if (c >= 0)
		{
			pf[np].fd = c;
			pf[np++].events = POLLIN;
			pf[np].fd = s;
			pf[np++].events = POLLIN;
		}
		if (close_at && now_ms() >= close_at)
		{
			/*
			 * The server has had time to commit; the client never hears.
			 * Say so before closing: the runner returns as soon as it sees
			 * the close, and the test reads this flag at once.
			 */
			__atomic_store_n(&p->dropped, 1, __ATOMIC_SEQ_CST);
			close(c);
			close(s);
			c = s = -1;
			close_at = 0;
			blackhole = 0;
			continue;
		}
		if (poll(pf, np, 20) <= 0)
			continue;
		if ((pf[0].revents & POLLIN) && c < 0)
		{
			c = accept(p->listen_fd, NULL, NULL);
			s = c >= 0 ? itest_connect_loopback(p->target) : -1;
			if (s < 0)
			{
				if (c >= 0)
					close(c);
				c = -1;
			}
			continue;
		}
		for (i = 1; i < np; i++)
		{
			char		buf[65536];
			ssize_t		n;
			int			from_client = pf[i].fd == c;

			if (!(pf[i].revents & (POLLIN | POLLHUP | POLLERR)))
				continue;
			n = read(pf[i].fd, buf, sizeof(buf));
			if (n <= 0)
			{
				close(c);
				close(s);
				c = s = -1;
				break;
			}
			if (from_client)
			{
				if (send(s, buf, (size_t) n, MSG_NOSIGNAL) != n)
					break;
				/* the text, or the prepared statement's name */
				if (p->armed && (contains(buf, (size_t) n, "COMMIT") ||
								 contains(buf, (size_t) n, "idem_client_commit")))
				{
					p->armed = 0;
					blackhole = 1;
					close_at = now_ms() + 300;
				}
			}
			else if (!blackhole)
			{
				if (send(c, buf, (size_t) n, MSG_NOSIGNAL) != n)
					break;
			}
		}
	}
	if (c >= 0)
	{
		close(c);
		close(s);
	}
	return NULL;
}

static int
cproxy_start(cproxy *p, int target)
{
	memset(p, 0, sizeof(*p));
	p->target = target;
	p->listen_fd = itest_listen_loopback(4, &p->port);
	if (p->listen_fd < 0)
		return -1;
	return pthread_create(&p->thread, NULL, cproxy_main, p) == 0 ? 0 : -1;
}

static void
test_commit_unknown(void)
{
	cproxy		p;
	char		conninfo[256];
	idem_runner *R;
	idem_result res;
	thctx		h;
	char	   *st;

	idem_result_init(&res);
	if (cproxy_start(&p, E.pg_port) != 0)
	{
		tap_ok_ext(0, "COMMIT-dropping proxy starts");
		return;
	}
	snprintf(conninfo, sizeof(conninfo), "host=127.0.0.1 port=%d dbname=%s connect_timeout=5",
			 p.port, E.dbname);
	R = idem_runner_open(conninfo, NULL, 0, NULL);
	memset(&h, 0, sizeof(h));
	p.armed = 1;
	idem_run(R, 1, S, "cu", "{}", thandler, &h, &res);
	st = ledger(1, "cu");
	tap_ok_ext(__atomic_load_n(&p.dropped, __ATOMIC_SEQ_CST) && res.status == IDEM_ERROR && res.error_code == IDEM_ERR_COMMIT_UNKNOWN &&
			   strstr(res.error_message, "unknown") != NULL,
			   "COMMIT sent, its reply lost: commit unknown, never \"nothing was committed\" (%s)", rs(&res));
	tap_ok_ext(st && strcmp(st, "completed 1") == 0 && effects("cu") == 1,
			   "and indeed the server committed the effect and the key (%s)", st ? st : "no row");
	free(st);
	memset(&h, 0, sizeof(h));
	idem_run(R, 1, S, "cu", "{}", thandler, &h, &res);
	tap_ok_ext(res.status == IDEM_REPLAYED && h.calls == 0 && effects("cu") == 1,
			   "the redelivery replays: the effect once (%s)", rs(&res));
	idem_runner_close(R);
	p.stop = 1;
	pthread_join(p.thread, NULL);
	close(p.listen_fd);
}

/* ---- the Valkey deadline under a 50 ms interval timer ---- */
static void
on_alarm(int sig)
{
	(void) sig;
}

/* In a child: run once with Valkey stopped while SIGALRM fires every 50 ms.
 * Exit 0 when the run was applied within bound_ms. */
static int
timer_child(int fresh_runner, int bound_ms)
{
	struct sigaction sa;
	struct itimerval it;
	idem_options o;
	idem_runner *R;
	idem_result res;
	thctx		h;
	int64_t		t0;
	char		id[32];

	idem_options_init(&o);
	idem_result_init(&res);
	o.valkey_command_timeout_ms = 200;
	o.valkey_connect_timeout_ms = 200;
	R = idem_runner_open(E.pg, "127.0.0.1", E.valkey_port, &o);
	memset(&h, 0, sizeof(h));
	if (!fresh_runner)
	{
		idem_run(R, 1, S, "timer-warm", "{}", thandler, &h, &res);	/* connected */
		kill(getppid(), SIGUSR1);	/* parent: stop Valkey now */
		sleep_ms(300);
	}
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_alarm;
	sa.sa_flags = SA_RESTART;
	sigaction(SIGALRM, &sa, NULL);
	it.it_interval.tv_sec = 0;
	it.it_interval.tv_usec = 50000;
	it.it_value = it.it_interval;
	setitimer(ITIMER_REAL, &it, NULL);
	snprintf(id, sizeof(id), "timer-%d", fresh_runner);
	t0 = now_ms();
	idem_run(R, 1, S, id, "{}", thandler, &h, &res);
	t0 = now_ms() - t0;
	memset(&it, 0, sizeof(it));
	setitimer(ITIMER_REAL, &it, NULL);
	idem_runner_close(R);
	return res.status == IDEM_APPLIED && !res.valkey_used && t0 < bound_ms ? 0 : 1;
}

static volatile sig_atomic_t child_ready;
static void
on_usr1(int sig)
{
	(void) sig;
	child_ready = 1;
}

static void
test_timer(void)
{
	int			fresh;

	if (valkey_pid() <= 0)
	{
		tap_skip_ext("Valkey pid unknown: interval timer tests");
		return;
	}
	for (fresh = 0; fresh < 2; fresh++)
	{
		struct sigaction sa;
		pid_t		pid;
		int			wst = -1,
					i;
		int			bound = E.slow ? 4000 : 1500;

		memset(&sa, 0, sizeof(sa));
		sa.sa_handler = on_usr1;
		sigaction(SIGUSR1, &sa, NULL);
		child_ready = 0;
		if (fresh)
			valkey_kill(SIGSTOP);
		fflush(stdout);
		pid = fork();
		if (pid == 0)
			_exit(timer_child(fresh, bound));
		if (!fresh)
		{
			for (i = 0; i < 1000 && !child_ready; i++)
				sleep_ms(10);
			valkey_kill(SIGSTOP);
		}
		/* the child must end by itself; give it 4 bounds */
		for (i = 0; i < bound * 4 / 20; i++)
		{
			if (waitpid(pid, &wst, WNOHANG) == pid)
				break;
			sleep_ms(20);
		}
		if (waitpid(pid, &wst, WNOHANG) == 0)
		{
			kill(pid, SIGKILL);
			waitpid(pid, &wst, 0);
			wst = -1;
		}
		valkey_kill(SIGCONT);
		tap_ok_ext(wst == 0,
				   "Valkey stopped, SIGALRM every 50 ms (%s connection): the 200 ms command timeout is a deadline, applied on PostgreSQL within %d ms (status %d)",
				   fresh ? "a new" : "an established", bound, wst);
	}
}

/* ---- a handler that ends the runner's transaction ---- */
static void
test_handler_ends_tx(idem_runner *R)
{
	const char *modes[4] = {"commit", "commit_begin", "rollback",
	"commit_begin_savepoint"};
	int			i;

	for (i = 0; i < 4; i++)
	{
		idem_result res;
		thctx		h;
		char		id[32];

		idem_result_init(&res);
		snprintf(id, sizeof(id), "htx-%s", modes[i]);
		memset(&h, 0, sizeof(h));
		h.mode = modes[i];
		idem_run(R, 1, S, id, "{}", thandler, &h, &res);
		tap_ok_ext(res.status == IDEM_ERROR && res.error_code == IDEM_ERR_HANDLER_ENDED_TX &&
				   strstr(res.error_message, "without its idempotency key") != NULL,
				   "handler runs %s: the run fails, saying the effect may have committed without its key (%s; effects now %lld)",
				   modes[i], rs(&res), effects(id));
	}
}

/* ---- a role that may not read the secrets ---- */
static int	notices;
static char last_notice[512];

static void
on_notice(void *arg, const char *msg)
{
	(void) arg;
	notices++;
	snprintf(last_notice, sizeof(last_notice), "%s", msg);
}

static void
test_no_grant(void)
{
	char		conninfo[512];
	idem_options o;
	idem_runner *R;
	idem_result res,
				res2;
	thctx		h;
	idem_runner_stats st;

	pg_ok(admin, "DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'idem_nocache') "
		  "THEN CREATE ROLE idem_nocache LOGIN; END IF; END $$");
	pg_ok(admin, "GRANT INSERT ON effects TO idem_nocache");
	/* everything in the extension's schema but the secrets */
	pg_ok(admin, "DO $$ DECLARE n text; f regprocedure; BEGIN "
		  "SELECT e.extnamespace::regnamespace::text INTO n FROM pg_extension e WHERE e.extname = 'idem'; "
		  "EXECUTE format('GRANT USAGE ON SCHEMA %s TO idem_nocache', n); "
		  "EXECUTE format('GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA %s TO idem_nocache', n); "
		  "EXECUTE format('GRANT ALL ON ALL TABLES IN SCHEMA %s TO idem_nocache', n); "
		  "EXECUTE format('GRANT ALL ON ALL SEQUENCES IN SCHEMA %s TO idem_nocache', n); "
		  "FOR f IN SELECT p.oid::regprocedure FROM pg_proc p WHERE p.proname = 'idem_cache_secrets' LOOP "
		  "EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM idem_nocache', f); END LOOP; END $$");
	pg_ok(admin, "GRANT ALL ON ALL TABLES IN SCHEMA public TO idem_nocache");
	pg_ok(admin, "GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO idem_nocache");
	snprintf(conninfo, sizeof(conninfo), "host=%s port=%d dbname=%s user=idem_nocache connect_timeout=5",
			 E.pg_host, E.pg_port, E.dbname);
	idem_options_init(&o);
	idem_result_init(&res);
	idem_result_init(&res2);
	idem_runner_stats_init(&st);
	o.notice = on_notice;
	R = idem_runner_open(conninfo, "127.0.0.1", E.valkey_port, &o);
	memset(&h, 0, sizeof(h));
	idem_run(R, 1, S, "nogrant", "{}", thandler, &h, &res);
	idem_run(R, 1, S, "nogrant", "{}", thandler, &h, &res2);
	idem_runner_get_stats(R, &st);
	tap_ok_ext(res.status == IDEM_APPLIED && !res.valkey_used && res2.status == IDEM_REPLAYED &&
			   res2.source == IDEM_SOURCE_POSTGRES && effects("nogrant") == 1,
			   "a role without EXECUTE on idem_cache_secrets(): applied and replayed on PostgreSQL alone (%s; %s)",
			   rs(&res), rs(&res2));
	tap_ok_ext(notices == 1 && strstr(last_notice, "without the Valkey cache") != NULL,
			   "and the notice hook heard it once (%d: %s)", notices, last_notice);
	idem_runner_close(R);
}

int
trust_main(int argc, char **argv)
{
	idem_runner *R;
	idem_options o;

	(void) argc;
	(void) argv;
	snprintf(S, sizeof(S), "trust%s", E.suffix);
	admin = pg_open(E.pg);
	if (admin == NULL)
	{
		tap_ok_ext(0, "PostgreSQL reachable");
		return tap_finish();
	}
	idem_options_init(&o);
	o.valkey_command_timeout_ms = E.slow ? 2000 : 200;
	R = idem_runner_open(E.pg, "127.0.0.1", E.valkey_port, &o);
	wait_owner_key();			/* the suites before may have emptied Valkey */
	test_values(R);
	test_handler_ends_tx(R);
	idem_runner_close(R);
	test_commit_unknown();
	test_timer();
	test_no_grant();
	PQfinish(admin);
	return tap_finish();
}
