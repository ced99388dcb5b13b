/*
 * itest_health.c: what the runner says about a Valkey that is wrong, and
 * the server's state met by a handler (itest health), on real servers.
 *
 *	  - Valkey down, a wrong password (WRONGPASS), none where one is
 *		wanted (NOAUTH), another Valkey than the server's (its epoch owner
 *		key never holds the server's token): the runs go on on PostgreSQL,
 *		the notice hook hears why at once and not again within a minute,
 *		the stats count it, and Valkey rests (no attempt on every run);
 *		the server's own Valkey killed and started again: told, and told
 *		when it answers again;
 *	  - idem_runner_check(): each of those, an unreachable PostgreSQL, a
 *		database without the extension, and all well (versions, round
 *		trip times);
 *	  - a serialization failure (40001), a deadlock (40P01) and an
 *		operator's cancel (57014, pg_cancel_backend) inside the handler,
 *		which reports a retryable failure: nothing recorded, the server's
 *		error returned, so idem.max_attempts = 2 does not dead-letter the
 *		message; another error (22012) is still recorded, and so are
 *		statement_timeout's cancel (57014) and lock_timeout's (55P03):
 *		idem.max_attempts = 2 ends them at the third delivery, also when the
 *		handler catches them and returns success.
 *
 *	  A second Valkey (valkey-server with requirepass) is started here on
 *	  a free loopback port and always stopped.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/wait.h>

#include "itest.h"

static PGconn *admin;
static char S[64];
static pid_t other_pid = -1;	/* the second Valkey, ours */
static int	other_port;

#define OTHER_PASSWORD "idem-health-secret"

/* ---- notices ---- */
#define MAX_NOTICES 32
typedef struct heard
{
	int			n;
	char		msg[MAX_NOTICES][700];
} heard;

static void
on_notice(void *arg, const char *message)
{
	heard	   *h = arg;

	if (h->n < MAX_NOTICES)
		snprintf(h->msg[h->n], sizeof(h->msg[0]), "%s", message);
	h->n++;
}

static int
heard_with(const heard *h, const char *a, const char *b)
{
	int			i,
				k = 0;

	for (i = 0; i < h->n && i < MAX_NOTICES; i++)
		if (strstr(h->msg[i], a) && (b == NULL || strstr(h->msg[i], b)))
			k++;
	return k;
}

static const char *
last(const heard *h)
{
	return h->n > 0 ? h->msg[(h->n > MAX_NOTICES ? MAX_NOTICES : h->n) - 1] : "(none)";
}

/* ---- the second Valkey ---- */
static void
stop_other(void)
{
	if (other_pid > 0)
	{
		kill(other_pid, SIGKILL);
		waitpid(other_pid, NULL, 0);
		other_pid = -1;
	}
}

static int
start_other(void)
{
	const char *bin = getenv("IDEM_TEST_VALKEY_SERVER");
	char		port[16];
	int			fd,
				i;

	if (bin == NULL || bin[0] == '\0')
		bin = "valkey-server";
	fd = itest_listen_loopback(1, &other_port);
	if (fd < 0)
		return -1;
	close(fd);
	snprintf(port, sizeof(port), "%d", other_port);
	other_pid = fork();
	if (other_pid < 0)
		return -1;
	if (other_pid == 0)
	{
		int			null = open("/dev/null", O_WRONLY);

		if (null >= 0)
		{
			dup2(null, 1);
			dup2(null, 2);
		}
		execlp(bin, bin, "--port", port, "--bind", "127.0.0.1", "--save", "",
			   "--appendonly", "no", "--dir", "/tmp", "--requirepass",
			   OTHER_PASSWORD, (char *) NULL);
		_exit(127);
	}
	atexit(stop_other);
	for (i = 0; i < 500; i++)
	{
		fd = itest_connect_loopback(other_port);
		if (fd >= 0)
		{
			close(fd);
			return 0;
		}
		sleep_ms(20);
	}
	return -1;
}

/* A loopback port nothing listens on. */
static int
dead_port(void)
{
	int			port;
	int			fd = itest_listen_loopback(1, &port);

	if (fd < 0)
		return 1;
	close(fd);
	return port;
}

/* ---- handlers ---- */
typedef struct hctx
{
	const char *mode;
	int			calls;
} hctx;

static idem_handler_status
handler(PGconn *conn, idem_call *call, void *ud)
{
	hctx	   *h = ud;
	PGresult   *r = NULL;
	idem_handler_status st = IDEM_HANDLER_OK;
	int			swallow = 0;

	h->calls++;
	if (h->mode != NULL && strstr(h->mode, "-swallowed") != NULL)
	{
		/* the timeout's statement, its error caught */
		swallow = 1;
		h->mode = strncmp(h->mode, "lock_", 5) == 0 ? "lock_timeout" : "timeout";
	}
	if (h->mode == NULL)
		r = PQexec(conn, "SELECT 1");
	else if (strcmp(h->mode, "serialize") == 0)
	{
		/* the run's snapshot is the claim's: a row updated since is a
		 * serialization failure under SERIALIZABLE */
		pg_ok(admin, "UPDATE health_rows SET n = n + 1 WHERE id = 1");
		r = PQexec(conn, "UPDATE health_rows SET n = n + 1 WHERE id = 1");
	}
	else if (strcmp(h->mode, "deadlock") == 0)
	{
		PGconn	   *other = pg_open(E.pg);

		/* row 2 ours, row 3 the other's; it waits for 2, we for 3 */
		PQclear(PQexec(conn, "UPDATE health_rows SET n = n + 1 WHERE id = 2"));
		pg_ok(other, "BEGIN");
		pg_ok(other, "SET LOCAL deadlock_timeout = '60s'");
		pg_ok(other, "UPDATE health_rows SET n = n + 1 WHERE id = 3");
		PQsendQuery(other, "UPDATE health_rows SET n = n + 1 WHERE id = 2");
		sleep_ms(200);
		PQclear(PQexec(conn, "SET LOCAL deadlock_timeout = '100ms'"));
		r = PQexec(conn, "UPDATE health_rows SET n = n + 1 WHERE id = 3");
		/* the other waits until our transaction ends, after we return:
		 * its backend then sees it was left, and rolls back */
		PQfinish(other);
	}
	else if (strcmp(h->mode, "cancel") == 0)	/* an operator's */
		r = PQexec(conn, "SELECT pg_cancel_backend(pg_backend_pid()), pg_sleep(2)");
	else if (strcmp(h->mode, "timeout") == 0)
	{
		PQclear(PQexec(conn, "SET LOCAL statement_timeout = '50ms'"));
		r = PQexec(conn, "SELECT pg_sleep(2)");
	}
	else if (strcmp(h->mode, "lock_timeout") == 0)
	{
		PQclear(PQexec(conn, "SET LOCAL lock_timeout = '50ms'"));
		r = PQexec(conn, "UPDATE health_rows SET n = n + 1 WHERE id = 4");
	}
	else if (strcmp(h->mode, "divide") == 0)
		r = PQexec(conn, "SELECT 1 / 0");
	if (swallow)
	{
		/* the error caught, the handler answers success anyway */
		PQclear(r);
		idem_call_set_json(call, "{\"done\": true}");
		return IDEM_HANDLER_OK;
	}
	if (r == NULL || (PQresultStatus(r) != PGRES_TUPLES_OK &&
					  PQresultStatus(r) != PGRES_COMMAND_OK))
	{
		char		j[300];

		snprintf(j, sizeof(j), "{\"sqlstate\": \"%s\"}",
				 r ? (PQresultErrorField(r, PG_DIAG_SQLSTATE) ?
					  PQresultErrorField(r, PG_DIAG_SQLSTATE) : "") : "");
		idem_call_set_json(call, j);
		st = IDEM_HANDLER_RETRYABLE;	/* what a handler usually says */
	}
	else
		idem_call_set_json(call, "{\"done\": true}");
	PQclear(r);
	return st;
}

static const char *
rs(const idem_result *r)
{
	static char bufs[2][700];
	static int	which;
	char	   *buf = bufs[which++ % 2];

	snprintf(buf, sizeof(bufs[0]), "%s/%s attempt %d %s %.400s",
			 idem_status_name(r->status), idem_source_name(r->source),
			 r->attempt, r->sqlstate,
			 r->status == IDEM_ERROR ? r->error_message : r->outcome);
	return buf;
}

static idem_runner *
open_runner(int port, const char *password, heard *h, int retry_ms)
{
	idem_options o;

	idem_options_init(&o);
	o.notice = on_notice;
	o.notice_arg = h;
	o.valkey_password = password;
	o.valkey_retry_ms = retry_ms;
	o.valkey_command_timeout_ms = E.slow ? 2000 : 300;
	o.valkey_connect_timeout_ms = E.slow ? 2000 : 300;
	return idem_runner_open(E.pg, "127.0.0.1", port, &o);
}

/* n runs of new keys, all applied on PostgreSQL: 1 if so */
static int
runs_apply(idem_runner *R, const char *tag, int n)
{
	int			i,
				ok = 1;
	static int	seq;

	for (i = 0; i < n; i++)
	{
		char		id[64];
		idem_result res;
		hctx		h = {NULL, 0};

		snprintf(id, sizeof(id), "%s-%d-%d", tag, (int) getpid(), seq++);
		idem_result_init(&res);
		if (idem_run(R, 1, S, id, "{}", handler, &h, &res) != IDEM_APPLIED)
		{
			tap_diag_ext("%s: %s", id, rs(&res));
			ok = 0;
		}
	}
	return ok;
}

static void
test_down(void)
{
	heard		h = {0};
	int			port = dead_port();
	idem_runner *R = open_runner(port, NULL, &h, 1000);
	idem_runner_stats st;
	char		at[64];

	snprintf(at, sizeof(at), "Valkey at 127.0.0.1:%d", port);
	tap_ok_ext(runs_apply(R, "down", 5), "Valkey down: five runs apply on PostgreSQL");
	idem_runner_stats_init(&st);
	idem_runner_get_stats(R, &st);
	tap_ok_ext(h.n == 1 && heard_with(&h, at, "running on PostgreSQL only") == 1 &&
			   heard_with(&h, "onnection refused", NULL) == 1,
			   "Valkey down: the notice hook hears it once, with the reason (%d: %s)",
			   h.n, last(&h));
	tap_ok_ext(st.valkey_failures == 1 && st.notices == 1,
			   "Valkey down: one failure counted, the other runs rested (failures %ld, notices %ld)",
			   st.valkey_failures, st.notices);
	sleep_ms(1100);
	runs_apply(R, "down", 1);
	idem_runner_get_stats(R, &st);
	tap_ok_ext(st.valkey_failures == 2 && h.n == 1,
			   "after valkey_retry_ms it is tried again and counted, and not told again within a minute (failures %ld, notices %d)",
			   st.valkey_failures, h.n);
	idem_runner_close(R);
}

static void
test_auth(const char *password, const char *word, const char *what)
{
	heard		h = {0};
	idem_runner *R = open_runner(other_port, password, &h, 1000);
	idem_runner_stats st;

	tap_ok_ext(runs_apply(R, "auth", 5), "%s: five runs apply on PostgreSQL", what);
	idem_runner_stats_init(&st);
	idem_runner_get_stats(R, &st);
	tap_ok_ext(h.n == 1 && heard_with(&h, word, "valkey_password") == 1,
			   "%s: the notice hook hears %s once, with what to set (%d: %s)",
			   what, word, h.n, last(&h));
	tap_ok_ext(st.valkey_auth_failures == 1 && st.valkey_failures == 1,
			   "%s: counted once, and rested (auth failures %ld, failures %ld)",
			   what, st.valkey_auth_failures, st.valkey_failures);
	idem_runner_close(R);
}

static void
test_not_servers(void)
{
	heard		h = {0};
	idem_runner *R = open_runner(other_port, OTHER_PASSWORD, &h, 1000);
	idem_runner_stats st,
				st2;
	int64_t		start = now_ms();

	idem_runner_stats_init(&st);
	idem_runner_stats_init(&st2);
	/* runs until the notice (the grace is 3 s), at most 8 s */
	while (h.n == 0 && now_ms() - start < 8000)
	{
		if (!runs_apply(R, "other", 1))
			break;
		sleep_ms(100);
	}
	tap_ok_ext(h.n == 1 && heard_with(&h, "is not the server's", "owner key") == 1,
			   "another Valkey than the server's: the notice hook hears it within %lld ms (%d: %s)",
			   (long long) (now_ms() - start), h.n, last(&h));
	idem_runner_get_stats(R, &st);
	runs_apply(R, "other", 5);
	idem_runner_get_stats(R, &st2);
	tap_ok_ext(st.valkey_not_servers == 1 && st.valkey_owner_mismatches >= 2 &&
			   st2.valkey_round_trips == st.valkey_round_trips &&
			   st2.valkey_skipped == st.valkey_skipped + 5,
			   "... counted, and it rests as a Valkey that is down: five more runs do not touch it (not the server's %ld, owner mismatches %ld, round trips %ld then %ld)",
			   st.valkey_not_servers, st.valkey_owner_mismatches,
			   st.valkey_round_trips, st2.valkey_round_trips);
	sleep_ms(1100);
	runs_apply(R, "other", 3);
	idem_runner_get_stats(R, &st2);
	tap_ok_ext(st2.valkey_not_servers == 2 && h.n == 1,
			   "after the rest one lookup finds it still not the server's: rested again, not told again within a minute (%ld, notices %d)",
			   st2.valkey_not_servers, h.n);
	idem_runner_close(R);
}

static void
test_outage(void)
{
	heard		h = {0};
	idem_runner *R = open_runner(E.valkey_port, NULL, &h, 300);
	idem_result res;
	hctx		hc = {NULL, 0};
	int			i;

	wait_owner_key();
	idem_result_init(&res);
	idem_run(R, 1, S, "outage-1", "{}", handler, &hc, &res);
	tap_ok_ext(res.status == IDEM_APPLIED && res.valkey_used && h.n == 0,
			   "the server's Valkey: applied through the gate, nothing told (%s, %d)",
			   rs(&res), h.n);
	valkey_kill(SIGKILL);
	sleep_ms(100);
	runs_apply(R, "outage", 3);
	tap_ok_ext(h.n == 1 && heard_with(&h, "running on PostgreSQL only", NULL) == 1,
			   "Valkey killed: told once (%d: %s)", h.n, last(&h));
	valkey_start();
	wait_owner_key();
	for (i = 0; i < 40 && h.n < 2; i++)
	{
		sleep_ms(100);
		runs_apply(R, "outage", 1);
	}
	tap_ok_ext(h.n == 2 && heard_with(&h, "answers again", NULL) == 1,
			   "Valkey started again: told that it answers again (%d: %s)", h.n, last(&h));
	idem_runner_close(R);
}

static idem_check_status
check_of(int port, const char *password, const char *conninfo,
		 idem_check_report *rep)
{
	heard		h = {0};
	idem_options o;
	idem_runner *R;
	idem_check_status st;

	idem_options_init(&o);
	o.notice = on_notice;
	o.notice_arg = &h;
	o.valkey_password = password;
	R = idem_runner_open(conninfo, port ? "127.0.0.1" : NULL, port, &o);
	idem_check_report_init(rep);
	st = idem_runner_check(R, rep);
	idem_runner_close(R);
	return st;
}

static void
test_check(void)
{
	idem_check_report rep;
	idem_check_status st;
	char		ci[300];
	char	   *v;

	wait_owner_key();
	v = pg_val(admin, "SELECT extversion FROM pg_extension WHERE extname = 'idem'", 0, NULL);
	st = check_of(E.valkey_port, NULL, E.pg, &rep);
	tap_ok_ext(st == IDEM_CHECK_OK && rep.status == st && rep.pg_ok && v &&
			   strcmp(rep.extension_version, v) == 0 && rep.pg_rtt_us > 0 &&
			   rep.valkey_configured && rep.valkey_ok && rep.valkey_owner_ok &&
			   rep.valkey_rtt_us > 0 && rep.message[0] == '\0',
			   "check, all well: ok, extension %s, PostgreSQL %ld us, Valkey %ld us (%s: %s)",
			   rep.extension_version, rep.pg_rtt_us, rep.valkey_rtt_us,
			   idem_check_status_name(st), rep.message);
	free(v);
	st = check_of(0, NULL, E.pg, &rep);
	tap_ok_ext(st == IDEM_CHECK_OK && !rep.valkey_configured && rep.valkey_rtt_us == -1,
			   "check without Valkey: ok (%s)", idem_check_status_name(st));
	st = check_of(dead_port(), NULL, E.pg, &rep);
	tap_ok_ext(st == IDEM_CHECK_VALKEY_UNREACHABLE && rep.pg_ok && !rep.valkey_ok &&
			   strstr(rep.message, "onnection refused"),
			   "check, Valkey down: %s (%s)", idem_check_status_name(st), rep.message);
	st = check_of(other_port, "wrong", E.pg, &rep);
	tap_ok_ext(st == IDEM_CHECK_VALKEY_AUTH && strstr(rep.message, "WRONGPASS"),
			   "check, a wrong password: %s (%s)", idem_check_status_name(st), rep.message);
	st = check_of(other_port, NULL, E.pg, &rep);
	tap_ok_ext(st == IDEM_CHECK_VALKEY_AUTH && strstr(rep.message, "NOAUTH"),
			   "check, no password where one is wanted: %s (%s)", idem_check_status_name(st), rep.message);
	st = check_of(other_port, OTHER_PASSWORD, E.pg, &rep);
	tap_ok_ext(st == IDEM_CHECK_VALKEY_NOT_SERVERS && rep.valkey_ok && !rep.valkey_owner_ok &&
			   strstr(rep.message, "owner key") && rep.valkey_rtt_us > 0,
			   "check, another Valkey than the server's: %s (%s)",
			   idem_check_status_name(st), rep.message);
	/* a role that may not read the secrets (not granted to PUBLIC) */
	pg_ok(admin, "DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'idem_health_nocache') "
		  "THEN CREATE ROLE idem_health_nocache LOGIN; END IF; END $$");
	pg_ok(admin, "DO $$ BEGIN EXECUTE format('GRANT USAGE ON SCHEMA %s TO idem_health_nocache', "
		  "(SELECT e.extnamespace::regnamespace::text FROM pg_extension e WHERE e.extname = 'idem')); END $$");
	snprintf(ci, sizeof(ci), "host=%s port=%d dbname=%s user=idem_health_nocache connect_timeout=5",
			 E.pg_host, E.pg_port, E.dbname);
	st = check_of(E.valkey_port, NULL, ci, &rep);
	tap_ok_ext(st == IDEM_CHECK_CACHE_UNAVAILABLE && rep.pg_ok && rep.extension_version[0] &&
			   strstr(rep.message, "GRANT EXECUTE"),
			   "check, a role without EXECUTE on idem_cache_secrets(): %s (%s)",
			   idem_check_status_name(st), rep.message);
	snprintf(ci, sizeof(ci), "host=127.0.0.1 port=%d dbname=x connect_timeout=2", dead_port());
	st = check_of(E.valkey_port, NULL, ci, &rep);
	tap_ok_ext(st == IDEM_CHECK_PG_UNREACHABLE && !rep.pg_ok,
			   "check, PostgreSQL down: %s (%s)", idem_check_status_name(st), rep.message);
	v = pg_val(admin, "SELECT count(*) FROM pg_database WHERE datname = 'idem_health_noext'", 0, NULL);
	if (v && strcmp(v, "0") == 0)
		pg_ok(admin, "CREATE DATABASE idem_health_noext");
	free(v);
	snprintf(ci, sizeof(ci), "host=%s port=%d dbname=idem_health_noext connect_timeout=5",
			 E.pg_host, E.pg_port);
	st = check_of(E.valkey_port, NULL, ci, &rep);
	tap_ok_ext(st == IDEM_CHECK_NO_EXTENSION && rep.pg_ok && rep.extension_version[0] == '\0' &&
			   strstr(rep.message, "CREATE EXTENSION"),
			   "check, a database without the extension: %s (%s)", idem_check_status_name(st), rep.message);
}

/* ---- the server's state in the handler ---- */
static char *
ledger(const char *id)
{
	const char *p[2] = {S, id};

	return pg_val(admin, "SELECT coalesce((SELECT status || ' ' || attempt FROM idem_lookup(1::bigint, idem_key($1, $2))), 'none')", 2, p);
}

static void
test_servers_state(void)
{
	char		ci[600];
	idem_options o;
	idem_runner *R;
	idem_result res;
	hctx		h;
	char	   *l;
	int			i,
				errors = 0;
	char		sqlstates[64] = "";
	const char *modes[3] = {"serialize", "deadlock", "cancel"};
	const char *want[3] = {"40001", "40P01", "57014"};

	pg_ok(admin, "CREATE TABLE IF NOT EXISTS health_rows (id int PRIMARY KEY, n int NOT NULL)");
	pg_ok(admin, "INSERT INTO health_rows VALUES (1, 0), (2, 0), (3, 0) ON CONFLICT DO NOTHING");
	/* SERIALIZABLE (a concurrent update fails the run's), at most 2
	 * attempts */
	snprintf(ci, sizeof(ci), "%s options='-c default_transaction_isolation=serializable -c idem.max_attempts=2'",
			 E.pg);
	idem_options_init(&o);
	R = idem_runner_open(ci, NULL, 0, &o);
	for (i = 0; i < 3; i++)
	{
		int			k;

		for (k = 0; k < 2; k++)
		{
			char		id[64];

			snprintf(id, sizeof(id), "state-%s-%d", modes[i], (int) getpid());
			memset(&h, 0, sizeof(h));
			h.mode = modes[i];
			idem_result_init(&res);
			idem_run(R, 1, S, id, "{}", handler, &h, &res);
			if (res.status == IDEM_ERROR && res.error_code == IDEM_ERR_SERVER &&
				strcmp(res.sqlstate, want[i]) == 0)
				errors++;
			else
				tap_diag_ext("%s: %s", modes[i], rs(&res));
			if (k == 1)
				snprintf(sqlstates + strlen(sqlstates), sizeof(sqlstates) - strlen(sqlstates),
						 "%s%s", i ? " " : "", res.sqlstate);
		}
	}
	tap_ok_ext(errors == 6,
			   "a serialization failure, a deadlock, an operator's cancel in the handler (twice each, idem.max_attempts = 2): the server's error each time (%s)",
			   sqlstates);
	for (i = 0; i < 3; i++)
	{
		char		id[64];

		snprintf(id, sizeof(id), "state-%s-%d", modes[i], (int) getpid());
		l = ledger(id);
		memset(&h, 0, sizeof(h));
		idem_result_init(&res);
		idem_run(R, 1, S, id, "{}", handler, &h, &res);
		tap_ok_ext(l && strcmp(l, "none") == 0 && res.status == IDEM_APPLIED && res.attempt == 1,
				   "%s: nothing recorded (%s), and the next delivery applies as attempt 1 (%s)",
				   want[i], l ? l : "?", rs(&res));
		free(l);
	}
	{
		char		id[64];

		snprintf(id, sizeof(id), "state-divide-%d", (int) getpid());
		memset(&h, 0, sizeof(h));
		h.mode = "divide";
		idem_result_init(&res);
		idem_run(R, 1, S, id, "{}", handler, &h, &res);
		l = ledger(id);
		tap_ok_ext(res.status == IDEM_FAILED_RETRYABLE && l && strcmp(l, "failed_retryable 1") == 0,
				   "another error (22012) the handler reports is recorded as before (%s; %s)",
				   rs(&res), l ? l : "?");
		free(l);
	}
	{
		/* a timeout's cancel is the handler's attempt: max_attempts ends it */
		const char *tmodes[2] = {"timeout", "lock_timeout"};
		const char *twant[2] = {"57014", "55P03"};
		PGconn	   *locker = pg_open(E.pg);

		pg_ok(admin, "INSERT INTO health_rows VALUES (4, 0) ON CONFLICT DO NOTHING");
		pg_ok(locker, "BEGIN");
		pg_ok(locker, "SELECT * FROM health_rows WHERE id = 4 FOR UPDATE");
		for (i = 0; i < 2; i++)
		{
			char		id[64];
			char		got[200] = "";
			int			k;

			snprintf(id, sizeof(id), "state-%s-%d", tmodes[i], (int) getpid());
			for (k = 0; k < 3; k++)
			{
				memset(&h, 0, sizeof(h));
				h.mode = tmodes[i];
				idem_result_init(&res);
				idem_run(R, 1, S, id, "{}", handler, &h, &res);
				snprintf(got + strlen(got), sizeof(got) - strlen(got), "%s%s/%d",
						 k ? " " : "", idem_status_name(res.status), res.attempt);
			}
			l = ledger(id);
			tap_ok_ext(strcmp(got, "failed_retryable/1 failed_retryable/2 failed_permanent/2") == 0 &&
					   l && strcmp(l, "failed_permanent 2") == 0 && h.calls == 0 &&
					   strstr(res.outcome, twant[i]) != NULL,
					   "%s's cancel (%s) in the handler is its attempt: recorded, and idem.max_attempts = 2 ends it (%s; %s; %s)",
					   tmodes[i], twant[i], got, l ? l : "?", rs(&res));
			free(l);
		}
		/*
		 * The same cancels caught by the handler, which returns success:
		 * its transaction is aborted, so it is the same attempt, recorded
		 * with the server's sqlstate and message; not a handler error
		 * with nothing recorded (redelivered for ever).
		 */
		for (i = 0; i < 2; i++)
		{
			char		id[64];
			char		mode[64];
			char		got[200] = "";
			char		first[IDEM_OUTCOME_MAX_BYTES + 1] = "";
			int			k;

			snprintf(id, sizeof(id), "state-%s-swallowed-%d", tmodes[i], (int) getpid());
			snprintf(mode, sizeof(mode), "%s-swallowed", tmodes[i]);
			for (k = 0; k < 3; k++)
			{
				memset(&h, 0, sizeof(h));
				h.mode = mode;
				idem_result_init(&res);
				idem_run(R, 1, S, id, "{}", handler, &h, &res);
				snprintf(got + strlen(got), sizeof(got) - strlen(got), "%s%s/%d",
						 k ? " " : "", idem_status_name(res.status), res.attempt);
				if (k == 0)
					snprintf(first, sizeof(first), "%s", rs(&res));
			}
			l = ledger(id);
			tap_ok_ext(strcmp(got, "failed_retryable/1 failed_retryable/2 failed_permanent/2") == 0 &&
					   l && strcmp(l, "failed_permanent 2") == 0 &&
					   strstr(res.outcome, twant[i]) != NULL &&
					   strstr(res.outcome, "canceling statement due to") != NULL,
					   "%s's cancel caught by the handler, which returns success: the same attempt, recorded with the server's error, and idem.max_attempts = 2 ends it (%s; %s; first %s; last %s)",
					   tmodes[i], got, l ? l : "?", first, rs(&res));
			free(l);
		}
		PQfinish(locker);
	}
	idem_runner_close(R);
}

int
health_main(int argc, char **argv)
{
	(void) argc;
	(void) argv;
	snprintf(S, sizeof(S), "health%s", E.suffix);
	admin = pg_open(E.pg);
	if (admin == NULL)
	{
		tap_ok_ext(0, "PostgreSQL reachable");
		return tap_finish();
	}
	if (start_other() != 0)
		tap_ok_ext(0, "a second Valkey (requirepass) starts");
	test_servers_state();
	test_down();
	test_auth("wrong", "WRONGPASS", "a wrong password");
	test_auth(NULL, "NOAUTH", "no password where one is wanted");
	test_not_servers();
	test_check();
	test_outage();
	stop_other();
	PQfinish(admin);
	return tap_finish();
}
