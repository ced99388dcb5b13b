/*
 * itest_honesty.c: what the runner says when it cannot know, and a dead
 * runner's marker (itest honesty).
 *
 *	  - COMMIT in flight when the server connection dies: the server holds
 *		the COMMIT after writing it locally (a synchronous standby that
 *		never comes: synchronous_standby_names set for this test only, and
 *		synchronous_commit on in the run's transaction), then the backend
 *		is ended (pg_terminate_backend) or the server stops (immediate
 *		shutdown).  The key and the effect are committed; the runner must
 *		say "commit unknown", never "nothing was committed".  On a direct
 *		connection, and through a real pgbouncer in transaction pooling,
 *		which answers the COMMIT with an error of its own and closes; for
 *		a C handler and for idem_apply (sql_handler);
 *	  - an answer that proves a rollback (a deferred constraint at COMMIT)
 *		stays definite, through pgbouncer too;
 *	  - a runner SIGKILLed in the middle of its handler: PostgreSQL frees
 *		the key at once, and its marker in Valkey answers busy for a second
 *		only, not for the rest of its lease.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/prctl.h>
#include <sys/wait.h>

#include "itest.h"
#include "internal.h"

/* a marker older than this is the claim's to judge (IDEM_MARKER_CHEAP_MS
 * in runner.c is 1000) */
#define IDEM_MARKER_TEST_MS 1200

static PGconn *admin;
static char S[64];
static const char *workdir;
static const char *pgbin;

typedef struct hctx
{
	const char *mode;
	int			calls;
	int			fd;				/* "wait": told when the claim is ours */
} hctx;

static idem_handler_status
h_effect(PGconn *conn, idem_call *call, void *ud)
{
	hctx	   *h = ud;
	const char *p[2] = {idem_call_scope(call), idem_call_id(call)};
	PGresult   *r;

	h->calls++;
	if (h->mode && strcmp(h->mode, "syncrep") == 0)
		PQclear(PQexec(conn, "SET LOCAL synchronous_commit = on"));
	r = PQexecParams(conn, "INSERT INTO effects (scope, id, tenant) VALUES ($1, $2, 1)",
					 2, NULL, p, NULL, NULL, 0);
	PQclear(r);
	if (h->mode && strcmp(h->mode, "deferred") == 0)
		PQclear(PQexec(conn, "INSERT INTO itest_deferred VALUES (1), (1)"));
	if (h->mode && strcmp(h->mode, "wait") == 0)
	{
		char		c = 'c';

		if (write(h->fd, &c, 1) != 1)
			_exit(3);
		sleep_ms(60000);
	}
	idem_call_set_json(call, "{\"done\": true}");
	return IDEM_HANDLER_OK;
}

static long long
effects(const char *id)
{
	const char *p[2] = {S, id};

	return pg_int(admin, "SELECT count(*) FROM effects WHERE scope = $1 AND id = $2", 2, p);
}

/* "completed 1", or NULL: no row */
static char *
ledger(const char *id)
{
	const char *p[2] = {S, id};

	return pg_val(admin, "SELECT status || ' ' || attempt FROM idem_lookup(1, idem_key($1, $2))", 2, p);
}

static const char *
rs(const idem_result *r)
{
	static char buf[700];

	snprintf(buf, sizeof(buf), "%s/%s code %d sqlstate %s %.400s",
			 idem_status_name(r->status), idem_source_name(r->source),
			 (int) r->error_code, r->sqlstate,
			 r->status == IDEM_ERROR ? r->error_message : r->outcome);
	return buf;
}

static int
admin_open(void)
{
	if (admin)
		PQfinish(admin);
	admin = pg_open(E.pg);
	return admin != NULL;
}

/* ---- a COMMIT the server holds: a synchronous standby that never comes ---- */

static void
syncrep(int on)
{
	int			i;

	pg_ok(admin, on ?
		  "ALTER SYSTEM SET synchronous_standby_names = 'idem_itest_nobody'" :
		  "ALTER SYSTEM RESET synchronous_standby_names");
	pg_ok(admin, "SELECT pg_reload_conf()");
	/* the checkpointer tells the backends whether standbys are defined */
	for (i = 0; i < 100; i++)
	{
		PGconn	   *c = pg_open(E.pg);
		char	   *v = c ? pg_val(c, "SHOW synchronous_standby_names", 0, NULL) : NULL;
		int			done = v && (on ? v[0] != '\0' : v[0] == '\0');

		free(v);
		if (c)
			PQfinish(c);
		if (done)
			break;
		sleep_ms(50);
	}
	sleep_ms(300);
}

/*
 * A child that waits for a backend held in its COMMIT (wait_event SyncRep)
 * and then ends it: pg_terminate_backend, or an immediate shutdown of the
 * server.  If none comes within 30 s it lets any waiter go (no standbys)
 * and exits 3.
 */
static pid_t
killer(int immediate)
{
	pid_t		pid;

	fflush(stdout);
	pid = fork();
	if (pid != 0)
		return pid;
	{
		PGconn	   *c = pg_open(E.pg);
		int			i;

		for (i = 0; c && i < 3000; i++)
		{
			char	   *bp = pg_val(c, "SELECT pid FROM pg_stat_activity WHERE wait_event = 'SyncRep' LIMIT 1",
									0, NULL);

			if (bp)
			{
				const char *p[1] = {bp};
				char		cmd[1200];
				int			rc = 0;

				if (immediate)
				{
					PQfinish(c);
					snprintf(cmd, sizeof(cmd), "'%s/pg_ctl' -D '%s/pg' -m immediate -w stop >/dev/null 2>&1",
							 pgbin, workdir);
					rc = system(cmd);
				}
				else
				{
					free(pg_val(c, "SELECT pg_terminate_backend($1::int)", 1, p));
					PQfinish(c);
				}
				free(bp);
				_exit(rc == 0 ? 0 : 4);
			}
			sleep_ms(10);
		}
		if (c)
		{
			pg_ok(c, "ALTER SYSTEM RESET synchronous_standby_names");
			pg_ok(c, "SELECT pg_reload_conf()");
			PQfinish(c);
		}
		_exit(3);
	}
}

static int
killer_wait(pid_t pid)
{
	int			st = 0;

	if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st))
		return -1;
	return WEXITSTATUS(st);
}

/* ---- pgbouncer, transaction pooling, for this test only ---- */

static pid_t bouncer_pid = -1;
static int	bouncer_port;

static int
bouncer_start(void)
{
	const char *bin = "/usr/sbin/pgbouncer";
	char		dir[600],
				path[700];
	struct passwd *pw = getpwuid(getuid());
	FILE	   *f;
	int			fd,
				i;

	if (access(bin, X_OK) != 0 || pw == NULL)
		return -1;
	snprintf(dir, sizeof(dir), "%s/bouncer%s.XXXXXX", workdir, E.suffix);
	if (mkdtemp(dir) == NULL)
		return -1;
	fd = itest_listen_loopback(1, &bouncer_port);
	if (fd < 0)
		return -1;
	close(fd);
	snprintf(path, sizeof(path), "%s/userlist.txt", dir);
	if ((f = fopen(path, "w")) == NULL)
		return -1;
	fprintf(f, "\"%s\" \"\"\n", pw->pw_name);
	fclose(f);
	snprintf(path, sizeof(path), "%s/pgbouncer.ini", dir);
	if ((f = fopen(path, "w")) == NULL)
		return -1;
	fprintf(f, "[databases]\n* = host=%s port=%d\n[pgbouncer]\n"
			"listen_addr = 127.0.0.1\nlisten_port = %d\nunix_socket_dir =\n"
			"auth_type = trust\nauth_file = %s/userlist.txt\n"
			"pool_mode = transaction\ndefault_pool_size = 4\nmax_client_conn = 20\n"
			"ignore_startup_parameters = extra_float_digits\n"
			"logfile = %s/pgbouncer.log\n",
			E.pg_host, E.pg_port, bouncer_port, dir, dir);
	fclose(f);
	fflush(stdout);
	bouncer_pid = fork();
	if (bouncer_pid == 0)
	{
		int			nul = open("/dev/null", O_RDWR);

		/* stopped with this test, whatever becomes of it */
		prctl(PR_SET_PDEATHSIG, SIGTERM);
		if (getppid() == 1)
			_exit(1);
		if (nul >= 0)
		{
			dup2(nul, 1);
			dup2(nul, 2);
		}
		execl(bin, "pgbouncer", path, (char *) NULL);
		_exit(127);
	}
	if (bouncer_pid < 0)
		return -1;
	for (i = 0; i < 200; i++)
	{
		char		ci[256];
		PGconn	   *c;
		int			up;

		snprintf(ci, sizeof(ci), "host=127.0.0.1 port=%d dbname=%s connect_timeout=2",
				 bouncer_port, E.dbname);
		c = PQconnectdb(ci);
		up = PQstatus(c) == CONNECTION_OK;
		PQfinish(c);
		if (up)
			return 0;
		if (waitpid(bouncer_pid, NULL, WNOHANG) == bouncer_pid)
		{
			bouncer_pid = -1;
			return -1;
		}
		sleep_ms(50);
	}
	return -1;
}

static void
bouncer_stop(void)
{
	int			i;

	if (bouncer_pid <= 0)
		return;
	kill(bouncer_pid, SIGTERM);
	for (i = 0; i < 100; i++)
	{
		if (waitpid(bouncer_pid, NULL, WNOHANG) == bouncer_pid)
		{
			bouncer_pid = -1;
			return;
		}
		sleep_ms(50);
	}
	kill(bouncer_pid, SIGKILL);
	waitpid(bouncer_pid, NULL, 0);
	bouncer_pid = -1;
}

/* ---- commit unknown ---- */

/*
 * One run whose COMMIT the server holds until the killer ends it; the key
 * and the effect committed locally before that.
 */
static void
held_commit(const char *conninfo, const char *via, int sql, int immediate)
{
	idem_runner *R;
	idem_run_options ro;
	idem_result res;
	hctx		h;
	char		id[64];
	char		args[256];
	char	   *st;
	pid_t		k;
	int			krc;

	snprintf(id, sizeof(id), "held-%s-%s%s", via, sql ? "sql" : "c",
			 immediate ? "-immediate" : "");
	idem_result_init(&res);
	idem_run_options_init(&ro);
	memset(&h, 0, sizeof(h));
	h.mode = "syncrep";
	snprintf(args, sizeof(args), "{\"scope\": \"%s\", \"id\": \"%s\"}", S, id);
	ro.sql_args = args;
	if (sql)
		ro.sql_handler = "itest_syncrep_effect(jsonb)";
	R = idem_runner_open(conninfo, NULL, 0, NULL);
	k = killer(immediate);
	idem_run_with(R, 1, S, id, "{}", sql ? &ro : NULL, sql ? NULL : h_effect,
				  &h, &res);
	krc = killer_wait(k);
	idem_runner_close(R);
	if (immediate)
	{
		char		cmd[1200];

		snprintf(cmd, sizeof(cmd), "'%s/pg_ctl' -D '%s/pg' -l '%s/pg.log' -w -t 120 start >/dev/null 2>&1",
				 pgbin, workdir, workdir);
		if (system(cmd) != 0)
			tap_diag_ext("could not start PostgreSQL again");
		admin_open();
	}
	st = ledger(id);
	tap_ok_ext(krc == 0 && res.status == IDEM_ERROR &&
			   res.error_code == IDEM_ERR_COMMIT_UNKNOWN,
			   "%s, %s: the server connection ends while COMMIT%s is in flight (%s): commit unknown, never \"nothing was committed\" (%s; killer %d)",
			   via, sql ? "idem_apply" : "a C handler", sql ? " (idem_apply's)" : "",
			   immediate ? "immediate shutdown" : "pg_terminate_backend",
			   rs(&res), krc);
	tap_ok_ext(st && strcmp(st, "completed 1") == 0 && effects(id) == 1,
			   "... and it had committed: the key completed with its effect (%s, effects %lld)",
			   st ? st : "no row", effects(id));
	free(st);
}

/* A deferred constraint fails at COMMIT: a definite answer, nothing committed. */
static void
deferred_violation(const char *conninfo, const char *via, int sql)
{
	idem_runner *R;
	idem_run_options ro;
	idem_result res;
	hctx		h;
	char		id[64];
	char		args[256];
	char	   *st;

	snprintf(id, sizeof(id), "deferred-%s-%s", via, sql ? "sql" : "c");
	idem_result_init(&res);
	idem_run_options_init(&ro);
	memset(&h, 0, sizeof(h));
	h.mode = "deferred";
	snprintf(args, sizeof(args), "{\"scope\": \"%s\", \"id\": \"%s\"}", S, id);
	ro.sql_args = args;
	if (sql)
		ro.sql_handler = "itest_deferred_effect(jsonb)";
	R = idem_runner_open(conninfo, NULL, 0, NULL);
	idem_run_with(R, 1, S, id, "{}", sql ? &ro : NULL, sql ? NULL : h_effect,
				  &h, &res);
	idem_runner_close(R);
	st = ledger(id);
	tap_ok_ext(res.status == IDEM_ERROR && res.error_code == IDEM_ERR_SERVER &&
			   strcmp(res.sqlstate, "23505") == 0 && st == NULL && effects(id) == 0,
			   "%s, %s: a deferred unique constraint fails at COMMIT: a definite error (23505), nothing committed (%s; %s)",
			   via, sql ? "idem_apply" : "a C handler", rs(&res), st ? st : "no row");
	free(st);
}

static void
test_commit_unknown(void)
{
	char		bouncer[256];

	pg_ok(admin, "CREATE TABLE IF NOT EXISTS itest_deferred (v int UNIQUE DEFERRABLE INITIALLY DEFERRED)");
	pg_ok(admin, "CREATE OR REPLACE FUNCTION itest_syncrep_effect(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$\n"
		  "BEGIN\n"
		  "  PERFORM set_config('synchronous_commit', 'on', true);\n"
		  "  INSERT INTO effects (scope, id, tenant) VALUES (args->>'scope', args->>'id', 1);\n"
		  "  RETURN '{}'::jsonb;\n"
		  "END $$");
	pg_ok(admin, "CREATE OR REPLACE FUNCTION itest_deferred_effect(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$\n"
		  "BEGIN\n"
		  "  INSERT INTO effects (scope, id, tenant) VALUES (args->>'scope', args->>'id', 1);\n"
		  "  INSERT INTO itest_deferred VALUES (2), (2);\n"
		  "  RETURN '{}'::jsonb;\n"
		  "END $$");

	if (bouncer_start() != 0)
		tap_skip_ext("pgbouncer (/usr/sbin/pgbouncer) is not installed or did not start: the pooler cases are not run");
	syncrep(1);
	if (bouncer_pid > 0)
	{
		snprintf(bouncer, sizeof(bouncer), "host=127.0.0.1 port=%d dbname=%s connect_timeout=5",
				 bouncer_port, E.dbname);
		held_commit(bouncer, "through pgbouncer", 0, 0);
		held_commit(bouncer, "through pgbouncer", 1, 0);
	}
	held_commit(E.pg, "direct", 0, 0);
	held_commit(E.pg, "direct", 1, 0);
	syncrep(0);
	if (bouncer_pid > 0)
	{
		deferred_violation(bouncer, "through pgbouncer", 0);
		deferred_violation(bouncer, "through pgbouncer", 1);
	}
	deferred_violation(E.pg, "direct", 0);
	deferred_violation(E.pg, "direct", 1);
	bouncer_stop();
	/* last: the server stops and starts again */
	syncrep(1);
	held_commit(E.pg, "direct", 0, 1);
	syncrep(0);
}

/* ---- a dead runner's marker ---- */

static void
test_dead_marker(void)
{
	char		ci[600];
	char		id[64];
	int			fds[2];
	pid_t		pid;
	char		c;
	struct pollfd pfd;
	idem_runner *R;
	idem_result res,
				res2;
	hctx		h;
	int64_t		claimed_at;
	int			i;

	snprintf(id, sizeof(id), "dead-%d", (int) getpid());
	snprintf(ci, sizeof(ci), "%s application_name=itest-dead", E.pg);
	if (pipe(fds) != 0)
	{
		tap_ok_ext(0, "pipe");
		return;
	}
	fflush(stdout);
	pid = fork();
	if (pid == 0)
	{
		idem_runner *r = idem_runner_open(ci, "127.0.0.1", E.valkey_port, NULL);
		idem_result res0;
		hctx		h0;

		memset(&h0, 0, sizeof(h0));
		h0.mode = "wait";
		h0.fd = fds[1];
		idem_result_init(&res0);
		idem_run(r, 1, S, id, "{}", h_effect, &h0, &res0);
		_exit(0);
	}
	close(fds[1]);
	pfd.fd = fds[0];
	pfd.events = POLLIN;
	pfd.revents = 0;
	if (poll(&pfd, 1, 30000) != 1 || read(fds[0], &c, 1) != 1)
	{
		kill(pid, SIGKILL);
		waitpid(pid, NULL, 0);
		close(fds[0]);
		tap_ok_ext(0, "a runner in its handler");
		return;
	}
	claimed_at = now_ms();
	kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
	close(fds[0]);
	/* PostgreSQL ends its backend, and the claim with it */
	for (i = 0; i < 500; i++)
	{
		if (pg_int(admin, "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'itest-dead'",
				   0, NULL) == 0)
			break;
		sleep_ms(10);
	}

	R = idem_runner_open(E.pg, "127.0.0.1", E.valkey_port, NULL);
	idem_result_init(&res);
	idem_result_init(&res2);
	memset(&h, 0, sizeof(h));
	/* after the marker's first second: PostgreSQL decides */
	while (now_ms() - claimed_at < IDEM_MARKER_TEST_MS)
		sleep_ms(20);
	idem_run(R, 1, S, id, "{}", h_effect, &h, &res);
	tap_ok_ext(res.status == IDEM_APPLIED && res.source == IDEM_SOURCE_HANDLER &&
			   effects(id) == 1,
			   "a runner SIGKILLed in its handler: a redelivery a second later is applied, not busy from its marker for the rest of the lease (%s)",
			   rs(&res));
	idem_run(R, 1, S, id, "{}", h_effect, &h, &res2);
	tap_ok_ext(res2.status == IDEM_REPLAYED && h.calls == 1,
			   "... and the next one is a replay (%s)", rs(&res2));
	idem_runner_close(R);
}

/* A live run's duplicates: busy from Valkey in its first second, then
 * busy from PostgreSQL (the claim, which does not wait). */
static void
test_live_marker(void)
{
	char		id[64];
	int			fds[2];
	pid_t		pid;
	char		c;
	struct pollfd pfd;
	idem_runner *R;
	idem_result res,
				res2;
	hctx		h;
	int64_t		claimed_at,
				t0;
	long		took;
	int			young;

	snprintf(id, sizeof(id), "live-%d", (int) getpid());
	if (pipe(fds) != 0)
	{
		tap_ok_ext(0, "pipe");
		return;
	}
	fflush(stdout);
	pid = fork();
	if (pid == 0)
	{
		idem_runner *r = idem_runner_open(E.pg, "127.0.0.1", E.valkey_port, NULL);
		idem_result res0;
		hctx		h0;

		memset(&h0, 0, sizeof(h0));
		h0.mode = "wait";
		h0.fd = fds[1];
		idem_result_init(&res0);
		idem_run(r, 1, S, id, "{}", h_effect, &h0, &res0);
		_exit(0);
	}
	close(fds[1]);
	pfd.fd = fds[0];
	pfd.events = POLLIN;
	pfd.revents = 0;
	if (poll(&pfd, 1, 30000) != 1 || read(fds[0], &c, 1) != 1)
	{
		kill(pid, SIGKILL);
		waitpid(pid, NULL, 0);
		close(fds[0]);
		tap_ok_ext(0, "a runner in its handler");
		return;
	}
	claimed_at = now_ms();
	R = idem_runner_open(E.pg, "127.0.0.1", E.valkey_port, NULL);
	idem_result_init(&res);
	idem_result_init(&res2);
	memset(&h, 0, sizeof(h));
	idem_run(R, 1, S, id, "{}", h_effect, &h, &res);
	young = now_ms() - claimed_at < 800;
	while (now_ms() - claimed_at < IDEM_MARKER_TEST_MS)
		sleep_ms(20);
	t0 = now_ms();
	idem_run(R, 1, S, id, "{}", h_effect, &h, &res2);
	took = (long) (now_ms() - t0);
	kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
	close(fds[0]);
	tap_ok_ext(res.status == IDEM_BUSY &&
			   (res.source == IDEM_SOURCE_VALKEY || !young) && h.calls == 0,
			   "a live run's duplicate within its first second: busy from Valkey (%s)", rs(&res));
	tap_ok_ext(res2.status == IDEM_BUSY && res2.source == IDEM_SOURCE_POSTGRES &&
			   res2.retry_after_ms > 0 && took < 5000 && h.calls == 0,
			   "after it: busy from PostgreSQL, at once (%ld ms, retry after %ld ms; %s)",
			   took, res2.retry_after_ms, rs(&res2));
	idem_runner_close(R);
}

int
honesty_main(int argc, char **argv)
{
	(void) argc;
	(void) argv;
	snprintf(S, sizeof(S), "honesty%s", E.suffix);
	workdir = getenv("IDEM_TEST_WORKDIR");
	pgbin = getenv("IDEM_TEST_PGBIN");
	if (!admin_open() || workdir == NULL || pgbin == NULL)
	{
		tap_ok_ext(0, "PostgreSQL reachable, IDEM_TEST_WORKDIR and IDEM_TEST_PGBIN set");
		return tap_finish();
	}
	test_dead_marker();
	test_live_marker();
	test_commit_unknown();
	PQfinish(admin);
	return tap_finish();
}
