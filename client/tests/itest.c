/*
 * itest.c: the client's integration tests, against the real PostgreSQL (with
 * the idem extension) and the real RESP server that tests/run.sh starts.
 *
 *	  itest setup		create the test database, extension, tables
 *	  itest diff		key/fingerprint/canonical JSON against the server
 *	  itest scenario	every path of a run, one process: decisions, round
 *						trips, faults, bad values and outcomes
 *	  itest contention	several worker processes (itest_contention.c)
 *	  itest trust		what Valkey may not change (itest_trust.c)
 *	  itest router		the Valkey router's rounds (itest_router.c)
 *
 * Output: TAP lines on stdout; exit status 1 on any failure.
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
#include <sys/wait.h>

#include "itest.h"
#include "tap.h"
#include "internal.h"

itest_env	E;

/* ------------------------------------------------------------------ */
/* helpers */

int
tap_ok_ext(int cond, const char *fmt,...)
{
	va_list		ap;
	char		buf[1024];

	va_start(ap, fmt);
	vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	return tap_ok(cond, "%s", buf);
}

void
tap_diag_ext(const char *fmt,...)
{
	va_list		ap;
	char		buf[1024];

	va_start(ap, fmt);
	vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	tap_diag("%s", buf);
}

void
tap_skip_ext(const char *fmt,...)
{
	va_list		ap;
	char		buf[1024];

	va_start(ap, fmt);
	vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	printf("ok %d - # SKIP %s\n", ++tap_n, buf);
	fflush(stdout);
}

int
tap_finish(void)
{
	return tap_done();
}

static const char *
env_or(const char *name, const char *dflt)
{
	const char *v = getenv(name);

	return v && v[0] ? v : dflt;
}

void
itest_env_load(void)
{
	static char pg[512],
				admin[512];

	E.pg_host = env_or("IDEM_TEST_PGHOST", "127.0.0.1");
	E.pg_port = atoi(env_or("IDEM_TEST_PGPORT", "5432"));
	E.dbname = env_or("IDEM_TEST_DB", "idemtest");
	snprintf(pg, sizeof(pg), "host=%s port=%d dbname=%s connect_timeout=5 application_name=itest",
			 E.pg_host, E.pg_port, E.dbname);
	snprintf(admin, sizeof(admin), "host=%s port=%d dbname=postgres connect_timeout=5 application_name=itest-admin",
			 E.pg_host, E.pg_port);
	E.pg = pg;
	E.pg_admin = admin;
	E.valkey_port = atoi(env_or("IDEM_TEST_VALKEY_PORT", "6379"));
	E.valkey_start = env_or("IDEM_TEST_VALKEY_START", "");
	E.valkey_pidfile = env_or("IDEM_TEST_VALKEY_PIDFILE", "");
	E.pg_crash = env_or("IDEM_TEST_PG_CRASH", "");
	E.slow = atoi(env_or("IDEM_TEST_SLOW", "0"));
	E.suffix = env_or("IDEM_TEST_SUFFIX", "");
}

PGconn *
pg_open(const char *conninfo)
{
	PGconn	   *c = PQconnectdb(conninfo);

	if (PQstatus(c) != CONNECTION_OK)
	{
		tap_diag("connect %s: %s", conninfo, PQerrorMessage(c));
		PQfinish(c);
		return NULL;
	}
	return c;
}

char *
pg_val(PGconn *c, const char *sql, int n, const char *const *params)
{
	PGresult   *r = PQexecParams(c, sql, n, NULL, params, NULL, NULL, 0);
	char	   *v = NULL;

	if (PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) > 0 &&
		!PQgetisnull(r, 0, 0))
		v = strdup(PQgetvalue(r, 0, 0));
	else if (PQresultStatus(r) != PGRES_TUPLES_OK &&
			 PQresultStatus(r) != PGRES_COMMAND_OK)
		tap_diag("SQL failed: %s: %s", sql, PQresultErrorMessage(r));
	PQclear(r);
	return v;
}

long long
pg_int(PGconn *c, const char *sql, int n, const char *const *params)
{
	char	   *v = pg_val(c, sql, n, params);
	long long	x = v ? strtoll(v, NULL, 10) : -1;

	free(v);
	return x;
}

int
pg_ok(PGconn *c, const char *sql)
{
	PGresult   *r = PQexec(c, sql);
	int			ok = PQresultStatus(r) == PGRES_COMMAND_OK ||
		PQresultStatus(r) == PGRES_TUPLES_OK;

	if (!ok)
		tap_diag("SQL failed: %s: %s", sql, PQresultErrorMessage(r));
	PQclear(r);
	return ok;
}

redisContext *
rv_open(void)
{
	struct timeval tv = {2, 0};
	redisContext *c = redisConnectWithTimeout("127.0.0.1", E.valkey_port, tv);

	if (c == NULL || c->err)
	{
		if (c)
			redisFree(c);
		return NULL;
	}
	redisSetTimeout(c, tv);
	return c;
}

static redisContext *rvc;

redisReply *
rv(redisContext *c, const char *fmt,...)
{
	va_list		ap;
	redisReply *r;

	(void) c;
	if (rvc == NULL)
		rvc = rv_open();
	if (rvc == NULL)
		return NULL;
	va_start(ap, fmt);
	r = redisvCommand(rvc, fmt, ap);
	va_end(ap);
	if (r == NULL)
	{
		redisFree(rvc);
		rvc = NULL;
	}
	return r;
}

int
rv_cmd_ok(const char *fmt,...)
{
	va_list		ap;
	redisReply *r;
	int			ok;

	if (rvc == NULL)
		rvc = rv_open();
	if (rvc == NULL)
		return 0;
	va_start(ap, fmt);
	r = redisvCommand(rvc, fmt, ap);
	va_end(ap);
	if (r == NULL)
	{
		redisFree(rvc);
		rvc = NULL;
		return 0;
	}
	ok = r->type != REDIS_REPLY_ERROR;
	freeReplyObject(r);
	return ok;
}

char *
rv_get(const char *key)
{
	redisReply *r = rv(NULL, "GET %s", key);
	char	   *v = NULL;

	if (r && r->type == REDIS_REPLY_STRING)
	{
		v = malloc(r->len + 1);
		memcpy(v, r->str, r->len);
		v[r->len] = '\0';
	}
	if (r)
		freeReplyObject(r);
	return v;
}

long long
rv_pttl(const char *key)
{
	redisReply *r = rv(NULL, "PTTL %s", key);
	long long	v = -3;

	if (r && r->type == REDIS_REPLY_INTEGER)
		v = r->integer;
	if (r)
		freeReplyObject(r);
	return v;
}

pid_t
valkey_pid(void)
{
	FILE	   *f = fopen(E.valkey_pidfile, "r");
	long		pid = 0;

	if (f)
	{
		if (fscanf(f, "%ld", &pid) != 1)
			pid = 0;
		fclose(f);
	}
	return (pid_t) pid;
}

int
valkey_kill(int sig)
{
	pid_t		pid = valkey_pid();

	if (rvc && sig == SIGKILL)
	{
		redisFree(rvc);
		rvc = NULL;
	}
	if (pid <= 0)
		return -1;
	if (kill(pid, sig) != 0)
		return -1;
	if (sig == SIGKILL)
	{
		int			i;

		for (i = 0; i < 200 && kill(pid, 0) == 0; i++)
			sleep_ms(10);
	}
	return 0;
}

int
valkey_start(void)
{
	if (E.valkey_start[0] == '\0')
		return -1;
	return system(E.valkey_start) == 0 ? 0 : -1;
}

/* The keyspace the server gives its clients (idem_cache_keyspace()). */
const char *
test_keyspace(void)
{
	static char ks[IDEM_CACHE_KEYSPACE_MAX + 1];

	if (ks[0] == '\0')
	{
		PGconn	   *c = pg_open(E.pg);
		char	   *v = c ? pg_val(c, "SELECT idem_cache_keyspace()", 0, NULL) : NULL;

		snprintf(ks, sizeof(ks), "%s", v ? v : "no-keyspace:");
		free(v);
		if (c)
			PQfinish(c);
	}
	return ks;
}

/*
 * Until the epoch owner key holds a token again (at most 10 s): after
 * Valkey lost it (a restart, a flush) the server's worker sets it again,
 * and until then runners trust no value.
 */
void
wait_owner_key(void)
{
	PGconn	   *c = pg_open(E.pg);
	char	   *k = c ? pg_val(c, "SELECT owner_key FROM idem_cache_secrets() WHERE is_current", 0, NULL) : NULL;
	int			i;

	for (i = 0; k != NULL && i < 200; i++)
	{
		char	   *v = rv_get(k);
		int			set = v != NULL;

		free(v);
		if (set)
			break;
		sleep_ms(50);
	}
	free(k);
	if (c)
		PQfinish(c);
}

void
cache_key_of(char *buf, size_t n, int platform, int64_t tenant,
			 const char *scope, const char *id)
{
	uint8_t		k[32];

	idem_key(scope, id, k);
	idem_cache_key(buf, n, test_keyspace(), platform, tenant, k);
}

/* The key of the same row before 0.3 (one keyspace: "idem:"). */
void
old_cache_key_of(char *buf, size_t n, int platform, int64_t tenant,
				 const char *scope, const char *id)
{
	uint8_t		k[32];

	idem_key(scope, id, k);
	idem_cache_key(buf, n, "idem:", platform, tenant, k);
}

/* The server's current secret (as the worker has it). */
static int
current_secret(int32_t *key_id, idem_hmac *h)
{
	PGconn	   *c = pg_open(E.pg);
	PGresult   *r;
	int			ok = 0;

	if (c == NULL)
		return -1;
	r = PQexec(c, "SELECT key_id, encode(secret, 'hex') FROM idem_cache_secrets() WHERE is_current");
	if (PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1)
	{
		uint8_t		sec[32];

		*key_id = (int32_t) atoi(PQgetvalue(r, 0, 0));
		ok = idem_cache_unhex(sec, PQgetvalue(r, 0, 1), 32) == 0;
		if (ok)
			idem_hmac_key(h, sec, 32);
	}
	PQclear(r);
	PQfinish(c);
	return ok ? 0 : -1;
}

/* MAC an encoded value of length n stored under key with the current
 * secret (what the server's worker does). */
static int
mac_value(const char *key, char *value, int n)
{
	idem_hmac	h;
	int32_t		id;
	char		input[IDEM_CACHE_MAC_INPUT_MAX];
	uint8_t		mac[32];
	int			in;

	if (n < 0 || current_secret(&id, &h) != 0)
		return -1;
	in = idem_cache_mac_input(input, sizeof(input), key, strlen(key), value, (size_t) n);
	if (in < 0)
		return -1;
	idem_hmac_sha256(&h, input, (size_t) in, mac);
	idem_cache_set_mac(value, mac);
	return 0;
}

static int32_t
current_key_id(void)
{
	idem_hmac	h;
	int32_t		id = 1;

	current_secret(&id, &h);
	return id;
}

/*
 * Encode an authentic idem2 terminal value into buf (MACed with the
 * server's current secret) for key.  Returns its length or -1.
 */
int
authentic_terminal(char *buf, size_t buflen, const char *key, int completed,
				   int attempt, const uint8_t fp[32], const char *outcome,
				   int64_t expires_ms)
{
	int			n = idem_cache_encode_terminal(buf, buflen, current_key_id(),
											   completed ? IDEM_CACHE_COMPLETED :
											   IDEM_CACHE_FAILED_PERMANENT,
											   attempt, expires_ms, fp,
											   outcome, strlen(outcome));

	return mac_value(key, buf, n) == 0 ? n : -1;
}

/* An authentic marker for key with the given deadline (epoch ms). */
int
authentic_marker(char *buf, size_t buflen, const char *key, int64_t expires_ms)
{
	uint8_t		tok[IDEM_TOKEN_LEN];
	int			n;

	memset(tok, 0x5a, sizeof(tok));
	n = idem_cache_encode_lease_marker(buf, buflen, current_key_id(),
									   expires_ms, tok);
	return mac_value(key, buf, n) == 0 ? n : -1;
}

/*
 * Write into Valkey the copy of a committed terminal row that the server's
 * worker writes (idem2, MACed, PX = retention left).  For tests of the
 * client's reading that must not wait for the worker.  0, or -1 (no
 * terminal row).
 */
int
worker_copy(int platform, int64_t tenant, const char *scope, const char *id)
{
	PGconn	   *c = pg_open(E.pg);
	char		t[24];
	const char *p[3] = {t, scope, id};
	PGresult   *r;
	char		key[IDEM_CACHE_KEY_MAX];
	char		val[IDEM_CACHE_VALUE_MAX];
	int			rc = -1;

	if (c == NULL)
		return -1;
	snprintf(t, sizeof(t), "%lld", (long long) tenant);
	if (platform)
		r = PQexecParams(c, "SELECT status, attempt, encode(fingerprint, 'hex'), outcome::text,"
						 " floor(extract(epoch FROM expires_at) * 1000)::bigint"
						 " FROM idem_platform_lookup(idem_key($1, $2))", 2, NULL, p + 1, NULL, NULL, 0);
	else
		r = PQexecParams(c, "SELECT status, attempt, encode(fingerprint, 'hex'), outcome::text,"
						 " floor(extract(epoch FROM expires_at) * 1000)::bigint"
						 " FROM idem_lookup($1::bigint, idem_key($2, $3))", 3, NULL, p, NULL, NULL, 0);
	if (PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1 &&
		(strcmp(PQgetvalue(r, 0, 0), "completed") == 0 ||
		 strcmp(PQgetvalue(r, 0, 0), "failed_permanent") == 0))
	{
		uint8_t		fp[32];
		long long	exp = atoll(PQgetvalue(r, 0, 4));
		int			n;

		idem_cache_unhex(fp, PQgetvalue(r, 0, 2), 32);
		cache_key_of(key, sizeof(key), platform, tenant, scope, id);
		n = authentic_terminal(val, sizeof(val), key, PQgetvalue(r, 0, 0)[0] == 'c',
							   atoi(PQgetvalue(r, 0, 1)), fp, PQgetvalue(r, 0, 3), exp);
		if (n > 0 && rv_cmd_ok("SET %s %b PX %lld", key, val, (size_t) n,
							   (long long) (exp - wall_ms())))
			rc = 0;
	}
	PQclear(r);
	PQfinish(c);
	return rc;
}

/*
 * Wait (up to ms) until the server's worker has written its terminal copy
 * at key, other than not_this: a test that plants a value must not race the
 * worker's copy of the commit, or its repopulation after a read.
 */
void
await_worker_copy(const char *key, const char *not_this, int ms)
{
	int			i;

	if (!worker_writes_idem2())
		return;
	for (i = 0; i < ms / 20; i++)
	{
		char	   *v = rv_get(key);
		int			done = v != NULL && strncmp(v, "idem2 ", 6) == 0 &&
			strstr(v, " p ") == NULL && (not_this == NULL || strcmp(v, not_this) != 0);

		free(v);
		if (done)
			return;
		sleep_ms(20);
	}
}

int64_t
wall_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_REALTIME, &ts);
	return (int64_t) ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/*
 * Does the server's worker copy results into Valkey now?  A row completed
 * over SQL, then up to ms for its idem2 copy (the worker may be waiting out
 * its reconnect backoff after a test stopped Valkey).  Returns the ms it
 * took, or -1.
 */
int
worker_copies_within(int ms)
{
	PGconn	   *c = pg_open(E.pg);
	char		key[IDEM_CACHE_KEY_MAX];
	char		id[64];
	const char *p[1] = {id};
	int64_t		t0 = now_ms();
	int			took = -1;

	snprintf(id, sizeof(id), "probe-%d-%lld", (int) getpid(), (long long) wall_ms());
	if (c && pg_ok(c, "BEGIN"))
	{
		free(pg_val(c, "SELECT decision FROM idem_claim(1, idem_key('itest.probe', $1), idem_fingerprint('{}'), '10 s')", 1, p));
		free(pg_val(c, "SELECT idem_complete(1, idem_key('itest.probe', $1), '{}')", 1, p));
		pg_ok(c, "COMMIT");
	}
	cache_key_of(key, sizeof(key), 0, 1, "itest.probe", id);
	while (took < 0 && now_ms() - t0 <= ms)
	{
		char	   *v = rv_get(key);

		if (v != NULL && strncmp(v, "idem2 ", 6) == 0)
			took = (int) (now_ms() - t0);
		free(v);
		if (took < 0)
			sleep_ms(50);
	}
	if (c)
		PQfinish(c);
	return took;
}

/* Does the server's worker write idem2 values in the keyspace?  Probed
 * once, with up to 3 s for the copy. */
int
worker_writes_idem2(void)
{
	static int	known = -1;

	if (known < 0)
		known = worker_copies_within(3000) >= 0;
	return known;
}

void
sleep_ms(int ms)
{
	struct timespec ts;

	ts.tv_sec = ms / 1000;
	ts.tv_nsec = (long) (ms % 1000) * 1000000L;
	while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
		;
}

int64_t
now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t) ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/*
 * A listening TCP socket on 127.0.0.1, on a port the kernel picks (*port);
 * -1 on failure.  For the tests' proxies.
 */
int
itest_listen_loopback(int backlog, int *port)
{
	struct sockaddr_in a;
	socklen_t	al = sizeof(a);
	int			one = 1;
	int			fd = socket(AF_INET, SOCK_STREAM, 0);

	if (fd < 0)
		return -1;
	setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	memset(&a, 0, sizeof(a));
	a.sin_family = AF_INET;
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	if (bind(fd, (struct sockaddr *) &a, sizeof(a)) != 0 ||
		listen(fd, backlog) != 0 ||
		getsockname(fd, (struct sockaddr *) &a, &al) != 0)
	{
		close(fd);
		return -1;
	}
	*port = ntohs(a.sin_port);
	return fd;
}

/* A TCP connection to 127.0.0.1:port, or -1. */
int
itest_connect_loopback(int port)
{
	struct sockaddr_in a;
	int			fd = socket(AF_INET, SOCK_STREAM, 0);

	if (fd < 0)
		return -1;
	memset(&a, 0, sizeof(a));
	a.sin_family = AF_INET;
	a.sin_port = htons((uint16_t) port);
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	if (connect(fd, (struct sockaddr *) &a, sizeof(a)) != 0)
	{
		close(fd);
		return -1;
	}
	return fd;
}

/* ------------------------------------------------------------------ */
/* setup */

static int
cmd_setup(void)
{
	PGconn	   *a = pg_open(E.pg_admin);
	PGconn	   *c;
	char		sql[256];
	int			ok = 1;

	if (a == NULL)
		return 1;
	snprintf(sql, sizeof(sql), "CREATE DATABASE %s", E.dbname);
	ok = pg_ok(a, sql);
	PQfinish(a);
	if (!ok || (c = pg_open(E.pg)) == NULL)
		return 1;
	ok = pg_ok(c, "CREATE EXTENSION idem") &&
		pg_ok(c, "CREATE TABLE tenants (id bigint PRIMARY KEY)") &&
		pg_ok(c, "INSERT INTO tenants SELECT generate_series(1, 20)") &&
		pg_ok(c, "SELECT idem_install('tenants')") &&
		/* effects: no unique key on purpose, so a doubled effect shows */
		pg_ok(c, "CREATE TABLE effects (scope text NOT NULL, id text NOT NULL,"
			  " tenant bigint, attempt int, worker int,"
			  " at timestamptz DEFAULT clock_timestamp())") &&
		/* a SQL handler for idem_apply (idem_run_options.sql_handler) */
		pg_ok(c, "CREATE FUNCTION itest_effect(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$\n"
			  "BEGIN\n"
			  "  INSERT INTO effects (scope, id, tenant) VALUES (args->>'scope', args->>'id', 1);\n"
			  "  IF args ? 'die' THEN PERFORM pg_terminate_backend(pg_backend_pid()); PERFORM pg_sleep(5); END IF;\n"
			  "  IF args ? 'fail' THEN RAISE EXCEPTION USING ERRCODE = args->>'fail', MESSAGE = 'no'; END IF;\n"
			  "  RETURN jsonb_build_object('id', args->>'id');\n"
			  "END $$");
	PQfinish(c);
	return ok ? 0 : 1;
}

/* ------------------------------------------------------------------ */
/* differential: client vs server */

static uint64_t rng_state = 0x9E3779B97F4A7C15ULL;

static uint32_t
rnd(void)
{
	rng_state ^= rng_state << 13;
	rng_state ^= rng_state >> 7;
	rng_state ^= rng_state << 17;
	return (uint32_t) (rng_state >> 16);
}

static int
chance(int pct)
{
	return (int) (rnd() % 100) < pct;
}

typedef struct gbuf
{
	char	   *p;
	size_t		len,
				cap;
} gbuf;

static void
gput(gbuf *b, const char *s, size_t n)
{
	if (b->len + n + 1 > b->cap)
	{
		b->cap = (b->len + n + 1) * 2;
		b->p = realloc(b->p, b->cap);
	}
	memcpy(b->p + b->len, s, n);
	b->len += n;
	b->p[b->len] = '\0';
}

static void
gputs(gbuf *b, const char *s)
{
	gput(b, s, strlen(s));
}

static void
gws(gbuf *b)
{
	static const char *const ws[] = {"", "", "", " ", "\n", "\t", "\r\n  "};

	gputs(b, ws[rnd() % 7]);
}

static void
gen_string(gbuf *b, int keyish)
{
	int			n = keyish ? (int) (rnd() % 4) : (int) (rnd() % 12);
	int			i;

	gputs(b, "\"");
	for (i = 0; i < n; i++)
	{
		char		t[16];

		switch (rnd() % 14)
		{
			case 0:
				snprintf(t, sizeof(t), "\\u%04x", 1 + rnd() % 0x1f);
				gputs(b, t);
				break;
			case 1:
				{
					static const char *const esc[] = {"\\\"", "\\\\", "\\/", "\\b", "\\f", "\\n", "\\r", "\\t"};

					gputs(b, esc[rnd() % 8]);
					break;
				}
			case 2:
				snprintf(t, sizeof(t), "\\u%04X", 0x20 + rnd() % 0xD000);
				gputs(b, t);
				break;
			case 3:
				{
					unsigned	cp = 0x10000 + rnd() % 0xFFFFF;

					snprintf(t, sizeof(t), "\\u%04x\\u%04X", 0xD800 + ((cp - 0x10000) >> 10),
							 0xDC00 + ((cp - 0x10000) & 0x3FF));
					gputs(b, t);
					break;
				}
			case 4:
				gputs(b, "\xc3\xa9");	/* é */
				break;
			case 5:
				gputs(b, "\xe2\x82\xac");	/* € */
				break;
			case 6:
				gputs(b, "\xf0\x9f\x98\x80");
				break;
			case 7:
				gputs(b, "\x7f");
				break;
			default:
				t[0] = keyish ? "abcAB_"[rnd() % 6] : (char) (0x20 + rnd() % 95);
				if (t[0] == '"' || t[0] == '\\')
					t[0] = 'q';
				gput(b, t, 1);
				break;
		}
	}
	gputs(b, "\"");
}

static void
gen_number(gbuf *b)
{
	char		t[64];
	int			k = rnd() % 10;

	if (chance(30))
		gputs(b, "-");
	if (k < 2)
		gputs(b, "0");
	else
	{
		snprintf(t, sizeof(t), "%u", 1 + rnd() % (k < 6 ? 100 : 4000000000u));
		gputs(b, t);
	}
	if (chance(45))
	{
		int			n = 1 + rnd() % 6,
					i;

		gputs(b, ".");
		for (i = 0; i < n; i++)
		{
			t[0] = (char) ('0' + (chance(30) ? 0 : rnd() % 10));
			gput(b, t, 1);
		}
	}
	if (chance(35))
	{
		snprintf(t, sizeof(t), "%s%s%u", chance(50) ? "e" : "E",
				 chance(30) ? "-" : chance(30) ? "+" : "", rnd() % (chance(10) ? 400 : 12));
		gputs(b, t);
	}
}

static void
gen_value(gbuf *b, int depth)
{
	int			k = rnd() % (depth > 4 ? 6 : 10);
	int			n,
				i;

	switch (k)
	{
		case 0:
			gputs(b, "null");
			break;
		case 1:
			gputs(b, chance(50) ? "true" : "false");
			break;
		case 2:
		case 3:
			gen_number(b);
			break;
		case 4:
		case 5:
			gen_string(b, 0);
			break;
		case 6:
		case 7:
			n = rnd() % 5;
			gputs(b, "[");
			for (i = 0; i < n; i++)
			{
				if (i)
					gputs(b, ",");
				gws(b);
				gen_value(b, depth + 1);
				gws(b);
			}
			gputs(b, "]");
			break;
		default:
			n = rnd() % 6;
			gputs(b, "{");
			for (i = 0; i < n; i++)
			{
				if (i)
					gputs(b, ",");
				gws(b);
				gen_string(b, 1);	/* short keys: duplicates happen */
				gws(b);
				gputs(b, ":");
				gws(b);
				gen_value(b, depth + 1);
				gws(b);
			}
			gputs(b, "}");
			break;
	}
}

static int
cmd_diff(void)
{
	PGconn	   *c = pg_open(E.pg);
	int			n = E.slow ? 300 : 3000;
	int			i;
	int			canon_bad = 0,
				fp_bad = 0,
				valid_bad = 0,
				key_bad = 0,
				invalid_seen = 0;
	gbuf		b = {0};

	if (c == NULL)
	{
		tap_ok(0, "connect to the test database");
		return tap_done();
	}
	/* canonical text and fingerprint of generated documents */
	for (i = 0; i < n; i++)
	{
		const char *params[1];
		PGresult   *r;
		char	   *mine;
		size_t		mlen;
		uint8_t		fp[32];
		char		fph[65];

		b.len = 0;
		gws(&b);
		gen_value(&b, 0);
		gws(&b);
		params[0] = b.p;
		r = PQexecParams(c, "SELECT $1::jsonb::text, encode(idem_fingerprint($1::jsonb), 'hex')",
						 1, NULL, params, NULL, NULL, 0);
		mine = idem_json_canonical(b.p, b.len, &mlen, NULL, 0);
		if (PQresultStatus(r) != PGRES_TUPLES_OK)
		{
			if (mine != NULL && valid_bad++ < 5)
				tap_diag("server refused, client accepted: %s (%s)", b.p,
						 PQresultErrorMessage(r));
		}
		else if (mine == NULL)
		{
			if (valid_bad++ < 5)
				tap_diag("client refused, server accepted: %s", b.p);
		}
		else
		{
			if (strcmp(mine, PQgetvalue(r, 0, 0)) != 0 && canon_bad++ < 5)
				tap_diag("canonical differs for %s: server %s client %s", b.p,
						 PQgetvalue(r, 0, 0), mine);
			idem_fingerprint(b.p, b.len, fp, NULL, 0);
			idem_cache_hex(fph, fp, 32);
			fph[64] = '\0';
			if (strcmp(fph, PQgetvalue(r, 0, 1)) != 0 && fp_bad++ < 5)
				tap_diag("fingerprint differs for %s", b.p);
		}
		free(mine);
		PQclear(r);
	}
	tap_ok(canon_bad == 0, "canonical JSON equals $1::jsonb::text for %d generated documents (%d differ)",
		   n, canon_bad);
	tap_ok(fp_bad == 0, "idem_fingerprint: client equals SQL for the same documents (%d differ)", fp_bad);

	/* mutated documents: the client refuses exactly what jsonb refuses */
	for (i = 0; i < n; i++)
	{
		const char *params[1];
		PGresult   *r;
		char	   *mine;
		size_t		pos;
		static const char *const junk[] = {",", "]", "}", "\"", "\\", ":", "-", "e", "0", "{", "[", " ", "\\u", "tru", ".5"};

		b.len = 0;
		gen_value(&b, 0);
		pos = rnd() % (b.len + 1);
		/* cut only between UTF-8 sequences: the server would refuse a
		 * broken sequence as text, before JSON */
		while (pos < b.len && ((unsigned char) b.p[pos] & 0xC0) == 0x80)
			pos++;
		if (chance(50))
			b.len = pos;		/* truncate */
		else
		{
			gbuf		t = {0};

			gput(&t, b.p, pos);
			gputs(&t, junk[rnd() % 15]);
			gput(&t, b.p + pos, b.len - pos);
			free(b.p);
			b = t;
		}
		b.p[b.len] = '\0';
		params[0] = b.p;
		r = PQexecParams(c, "SELECT $1::jsonb::text", 1, NULL, params, NULL, NULL, 0);
		mine = idem_json_canonical(b.p, b.len, NULL, NULL, 0);
		if (PQresultStatus(r) != PGRES_TUPLES_OK)
		{
			invalid_seen++;
			if (mine != NULL && valid_bad++ < 5)
				tap_diag("server refused, client accepted: %s", b.p);
		}
		else if (mine == NULL || strcmp(mine, PQgetvalue(r, 0, 0)) != 0)
		{
			if (valid_bad++ < 5)
				tap_diag("client refused or differs, server accepted: %s", b.p);
		}
		free(mine);
		PQclear(r);
	}
	tap_ok(valid_bad == 0 && invalid_seen > n / 4,
		   "client and jsonb agree on validity of %d mutated documents (%d invalid)",
		   n, invalid_seen);

	/* edge numbers and strings, one by one */
	{
		static const char *const edge[] = {
			"1e1000", "1e-1000", "1e16383", "1e-16383", "0e-16383", "0e-16384",
			"1e131071", "1e131072", "0e1073741822", "0e1073741823",
			"-0.0e-3", "123456789012345678901234567890.123456789e-40",
			"9.99999999999999999999e+25", "[-0, 0.0, -0.00, 1E0, 1e+0, 1.0E-0]",
			"{\"a\":{\"a\":{\"a\":[]}},\"\":\"\",\"\\u0000x\":1}",
			"\"\\ud83d\\ude00\\u00e9\\u20AC\\u001F\\u007f\\u0080\"",
			"{\"\xc3\xa9\":1,\"e\":2,\"ee\":3,\"\xf0\x9f\x98\x80\":4}",
		};
		size_t		j;
		int			bad = 0;

		for (j = 0; j < sizeof(edge) / sizeof(edge[0]); j++)
		{
			const char *params[1] = {edge[j]};
			PGresult   *r = PQexecParams(c, "SELECT $1::jsonb::text", 1, NULL, params, NULL, NULL, 0);
			char	   *mine = idem_json_canonical(edge[j], strlen(edge[j]), NULL, NULL, 0);
			int			srv_ok = PQresultStatus(r) == PGRES_TUPLES_OK;

			if (srv_ok != (mine != NULL) ||
				(srv_ok && strcmp(mine, PQgetvalue(r, 0, 0)) != 0))
			{
				bad++;
				tap_diag("edge %s: server %s, client %s", edge[j],
						 srv_ok ? "accepts" : "refuses", mine ? "accepts" : "refuses");
			}
			free(mine);
			PQclear(r);
		}
		tap_ok(bad == 0, "edge numbers and strings: client equals server (%zu cases)",
			   sizeof(edge) / sizeof(edge[0]));
	}

	/* idem_key */
	for (i = 0; i < n; i++)
	{
		gbuf		s = {0},
					d = {0};
		const char *params[2];
		char	   *srv;
		uint8_t		k[32];
		char		kh[65];

		gen_string(&s, 0);
		gen_string(&d, 0);
		/* use the decoded text: the canonical form without its quotes,
		 * which has no escapes left only when no escape was generated;
		 * simpler: take raw printable/UTF-8 strings */
		{
			size_t		j,
						w = 0;

			for (j = 1; j + 1 < s.len; j++)
				if (s.p[j] != '\\' && (unsigned char) s.p[j] >= 0x20)
					s.p[w++] = s.p[j];
			s.p[w] = '\0';
			w = 0;
			for (j = 1; j + 1 < d.len; j++)
				if (d.p[j] != '\\' && (unsigned char) d.p[j] >= 0x20)
					d.p[w++] = d.p[j];
			d.p[w] = '\0';
		}
		params[0] = s.p;
		params[1] = d.p;
		srv = pg_val(c, "SELECT encode(idem_key($1, $2), 'hex')", 2, params);
		if (idem_key(s.p, d.p, k) != 0)
		{
			/* invalid UTF-8 after the strip: the server refuses it too */
			if (srv != NULL && key_bad++ < 5)
				tap_diag("idem_key refused by client only: '%s' '%s'", s.p, d.p);
		}
		else
		{
			idem_cache_hex(kh, k, 32);
			kh[64] = '\0';
			if ((srv == NULL || strcmp(srv, kh) != 0) && key_bad++ < 5)
				tap_diag("idem_key differs: '%s' '%s'", s.p, d.p);
		}
		free(srv);
		free(s.p);
		free(d.p);
	}
	{
		const char *params[2] = {"billing.charge", "run-42"};
		char	   *srv = pg_val(c, "SELECT encode(idem_key($1, $2), 'hex')", 2, params);

		tap_ok(srv && strcmp(srv, "5c76c6f58eff897da07846a990b77e88e8a0d282df751a06dfd7653c771f32cd") == 0,
			   "SQL idem_key('billing.charge', 'run-42') equals the client's test vector");
		free(srv);
	}
	tap_ok(key_bad == 0, "idem_key: client equals SQL for %d generated (scope, id) pairs", n);
	free(b.p);
	PQfinish(c);
	return tap_done();
}

/* ------------------------------------------------------------------ */
/* a counting TCP proxy: how many round trips did the client make? */

typedef struct proxy
{
	int			listen_fd;
	int			port;
	int			target_port;
	pthread_t	thread;
	volatile int stop;
	volatile long bursts;		/* client->server sends after a reply */
	volatile int kill_conns;	/* set: drop the current connection */
} proxy;

static void *
proxy_main(void *arg)
{
	proxy	   *p = arg;
	int			conns[16][2];	/* client, server */
	int			last_dir[16];
	int			n = 0;

	while (!p->stop)
	{
		struct pollfd pf[33];
		int			i,
					np = 0;

		pf[np].fd = p->listen_fd;
		pf[np++].events = POLLIN;
		for (i = 0; i < n; i++)
		{
			pf[np].fd = conns[i][0];
			pf[np++].events = POLLIN;
			pf[np].fd = conns[i][1];
			pf[np++].events = POLLIN;
		}
		if (poll(pf, np, 50) <= 0)
			continue;
		if ((pf[0].revents & POLLIN) && n < 16)
		{
			int			c = accept(p->listen_fd, NULL, NULL);
			int			s = c >= 0 ? itest_connect_loopback(p->target_port) : -1;
			int			one = 1;

			if (s >= 0)
			{
				setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
				setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
				conns[n][0] = c;
				conns[n][1] = s;
				last_dir[n] = 1;
				n++;
			}
			else if (c >= 0)
				close(c);
			continue;
		}
		for (i = 0; i < n; i++)
		{
			int			d;

			for (d = 0; d < 2; d++)
			{
				char		buf[65536];
				ssize_t		got;

				if (!(pf[1 + 2 * i + d].revents & (POLLIN | POLLHUP | POLLERR)))
					continue;
				got = read(conns[i][d], buf, sizeof(buf));
				if (got <= 0)
				{
					close(conns[i][0]);
					close(conns[i][1]);
					conns[i][0] = conns[i][1] = -1;
					break;
				}
				if (d == 0 && last_dir[i] == 1)
					p->bursts++;
				last_dir[i] = d;
				if (send(conns[i][1 - d], buf, (size_t) got, MSG_NOSIGNAL) != got)
				{
					close(conns[i][0]);
					close(conns[i][1]);
					conns[i][0] = conns[i][1] = -1;
					break;
				}
			}
		}
		/* compact closed connections */
		{
			int			w = 0;

			for (i = 0; i < n; i++)
				if (conns[i][0] >= 0)
				{
					conns[w][0] = conns[i][0];
					conns[w][1] = conns[i][1];
					last_dir[w] = last_dir[i];
					w++;
				}
			n = w;
		}
	}
	{
		int			i;

		for (i = 0; i < n; i++)
		{
			close(conns[i][0]);
			close(conns[i][1]);
		}
	}
	return NULL;
}

static int
proxy_start(proxy *p, int target_port)
{
	memset(p, 0, sizeof(*p));
	p->target_port = target_port;
	p->listen_fd = itest_listen_loopback(16, &p->port);
	if (p->listen_fd < 0)
		return -1;
	return pthread_create(&p->thread, NULL, proxy_main, p) == 0 ? 0 : -1;
}

static void
proxy_stop(proxy *p)
{
	p->stop = 1;
	pthread_join(p->thread, NULL);
	close(p->listen_fd);
}

/* ------------------------------------------------------------------ */
/* scenario */

typedef struct hctx
{
	const char *mode;
	int			calls;
	int			sleep_ms;
	int			backend_pid;
	const char *outcome;
	/* for "dup_during": a duplicate run in a child process */
	const char *dup_scope;
	const char *dup_id;
	const char *dup_req;
	int			dup_after_ms;
	pid_t		dup_child;
	int			dup_fd[2];		/* the child's result comes back here */
	char		stmts[512];		/* "stmts": the connection's prepared statements */
	const char *first_text;		/* "first_stmts": whose executions to count */
} hctx;

static PGconn *admin;

static idem_handler_status
handler(PGconn *conn, idem_call *call, void *ud)
{
	hctx	   *h = ud;
	char		att[16],
				ten[24];
	const char *params[4];
	PGresult   *r;
	const char *m = h->mode ? h->mode : "insert";
	char		out[256];

	h->calls++;
	h->backend_pid = PQbackendPID(conn);
	if (strcmp(m, "noop") == 0)
	{
		idem_call_set_json(call, h->outcome ? h->outcome : "{\"ok\": true}");
		return IDEM_HANDLER_OK;
	}
	if (strcmp(m, "first") == 0 || strcmp(m, "first_stmts") == 0)
	{
		/* the effect was sent with the claim (run option first_sql) */
		const PGresult *f = idem_call_first_result(call);

		if (m[5] == '_')
		{
			/* how often the named statement of first_text ran */
			const char *p1[1] = {h->first_text};

			r = PQexecParams(conn, "SELECT string_agg((generic_plans + custom_plans)::text, ',') "
							 "FROM pg_prepared_statements WHERE name LIKE 'idem\\_client\\_first\\_%' "
							 "AND statement = $1", 1, NULL, p1, NULL, NULL, 0);
			snprintf(h->stmts, sizeof(h->stmts), "%s",
					 PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1 ?
					 PQgetvalue(r, 0, 0) : "error");
			PQclear(r);
		}

		snprintf(out, sizeof(out), "{\"n\": %s}",
				 f && PQresultStatus(f) == PGRES_TUPLES_OK && PQntuples(f) == 1 ?
				 PQgetvalue(f, 0, 0) : "null");
		idem_call_set_json(call, out);
		return f && PQresultStatus(f) == PGRES_TUPLES_OK ?
			IDEM_HANDLER_OK : IDEM_HANDLER_RETRYABLE;
	}
	if (strcmp(m, "stmts") == 0)
	{
		r = PQexec(conn, "SELECT string_agg(name, ',' ORDER BY name) FROM pg_prepared_statements");
		snprintf(h->stmts, sizeof(h->stmts), "%s",
				 PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1 ?
				 PQgetvalue(r, 0, 0) : "error");
		PQclear(r);
		idem_call_set_json(call, "{\"ok\": true}");
		return IDEM_HANDLER_OK;
	}
	if (strcmp(m, "deallocate_one") == 0)
	{
		/* drops one of the runner's prepared statements */
		r = PQexec(conn, "DEALLOCATE idem_client_release");
		PQclear(r);
		idem_call_set_json(call, "{\"ok\": true}");
		return IDEM_HANDLER_OK;
	}
	if (strcmp(m, "deallocate") == 0)
	{
		/* drops the runner's prepared statements on its connection */
		r = PQexec(conn, "DEALLOCATE ALL");
		PQclear(r);
		idem_call_set_json(call, "{\"ok\": true}");
		return IDEM_HANDLER_OK;
	}
	if (strcmp(m, "dup_during") == 0)
	{
		pid_t		pid;

		fflush(stdout);
		pid = fork();
		if (pid == 0)
		{
			/* the duplicate delivery, on its own runner */
			idem_options o;
			idem_runner *r2;
			idem_result res;
			hctx		h2;
			char		vk[16];

			(void) vk;
			sleep_ms(h->dup_after_ms);
			idem_options_init(&o);
			idem_result_init(&res);
			o.lease_ms = 300;
			memset(&h2, 0, sizeof(h2));
			r2 = idem_runner_open(E.pg, "127.0.0.1", E.valkey_port, &o);
			idem_run(r2, 1, h->dup_scope, h->dup_id, h->dup_req, handler, &h2, &res);
			idem_runner_close(r2);
			{
				int			code = 10 + (int) res.status * 4 + (int) res.source;

				if (write(h->dup_fd[1], &code, sizeof(code)) != sizeof(code))
					_exit(1);
			}
			_exit(0);
		}
		h->dup_child = pid;
	}
	snprintf(att, sizeof(att), "%d", idem_call_attempt(call));
	snprintf(ten, sizeof(ten), "%lld", (long long) idem_call_tenant_id(call));
	params[0] = idem_call_scope(call);
	params[1] = idem_call_id(call);
	params[2] = ten;
	params[3] = att;
	r = PQexecParams(conn, "INSERT INTO effects (scope, id, tenant, attempt) VALUES ($1, $2, $3, $4)",
					 4, NULL, params, NULL, NULL, 0);
	if (PQresultStatus(r) != PGRES_COMMAND_OK)
	{
		PQclear(r);
		idem_call_set_json(call, "{\"error\": \"insert failed\"}");
		return IDEM_HANDLER_RETRYABLE;
	}
	PQclear(r);
	if (h->sleep_ms)
		sleep_ms(h->sleep_ms);
	if (strcmp(m, "dup_during") == 0 && h->dup_fd[0] >= 0)
	{
		/*
		 * However slow the machine (valgrind, load), the duplicate must run
		 * while this handler holds the claim: stay until its result is in
		 * the pipe (left there for the test to read).
		 */
		struct pollfd pfd = {h->dup_fd[0], POLLIN, 0};

		(void) poll(&pfd, 1, 60000);
	}
	if (strcmp(m, "terminate") == 0 || strcmp(m, "terminate2") == 0)
	{
		char		pid[16];
		const char *p1[1] = {pid};
		int			i;

		snprintf(pid, sizeof(pid), "%d", PQbackendPID(conn));
		free(pg_val(admin, "SELECT pg_terminate_backend($1::int)", 1, p1));
		for (i = 0; i < 200; i++)
		{
			if (pg_int(admin, "SELECT count(*) FROM pg_stat_activity WHERE pid = $1::int", 1, p1) == 0)
				break;
			sleep_ms(10);
		}
		{
			/*
			 * And until its FATAL (or the end of the stream) has reached
			 * our socket: the backend may leave pg_stat_activity before
			 * the kernel hands its last bytes over, and the runner judges
			 * the connection by what it can read when the handler
			 * returns.
			 */
			struct pollfd pfd = {PQsocket(conn), POLLIN, 0};

			(void) poll(&pfd, 1, 5000);
		}
		if (strcmp(m, "terminate2") == 0)
		{
			r = PQexec(conn, "INSERT INTO effects (scope, id) VALUES ('x', 'after-terminate')");
			PQclear(r);
			idem_call_set_json(call, "{\"error\": \"connection lost\"}");
			return IDEM_HANDLER_RETRYABLE;
		}
	}
	if (strcmp(m, "breaktx") == 0 || strcmp(m, "sqlfail") == 0)
	{
		r = PQexec(conn, "SELECT 1/0");
		PQclear(r);
		if (strcmp(m, "sqlfail") == 0)
		{
			idem_call_set_json(call, "{\"error\": \"division by zero\"}");
			return IDEM_HANDLER_RETRYABLE;
		}
	}
	if (strcmp(m, "permanent") == 0)
	{
		idem_call_set_json(call, "{\"reason\":\"card declined\", \"code\": 51}");
		return IDEM_HANDLER_PERMANENT;
	}
	if (strcmp(m, "retryable") == 0)
	{
		idem_call_set_json(call, "{\"reason\":\"gateway timeout\"}");
		return IDEM_HANDLER_RETRYABLE;
	}
	if (strcmp(m, "oversize") == 0)
	{
		char	   *big = malloc(5100);

		memcpy(big, "{\"blob\": \"", 10);
		memset(big + 10, 'x', 5000);
		memcpy(big + 5010, "\"}", 3);
		idem_call_set_json(call, big);
		free(big);
		return IDEM_HANDLER_OK;
	}
	if (strcmp(m, "notobject") == 0)
	{
		idem_call_set_json(call, "[1, 2]");
		return IDEM_HANDLER_OK;
	}
	if (strcmp(m, "badjson") == 0)
	{
		idem_call_set_json(call, "{\"a\": ");
		return IDEM_HANDLER_OK;
	}
	if (h->outcome)
		idem_call_set_json(call, h->outcome);
	else
	{
		snprintf(out, sizeof(out), "{\"id\":\"%s\",  \"n\" : 1.50e1, \"attempt\": %d}",
				 idem_call_id(call), idem_call_attempt(call));
		idem_call_set_json(call, out);
	}
	return IDEM_HANDLER_OK;
}

static long long
effects_of(const char *scope, const char *id)
{
	const char *p[2] = {scope, id};

	return pg_int(admin, "SELECT count(*) FROM effects WHERE scope = $1 AND id = $2", 2, p);
}

/*
 * Terminate a runner's backend while the runner is idle, and wait until it
 * is gone and a moment more: the backend leaves pg_stat_activity before its
 * FATAL is always readable on the runner's socket (seen: without a gate
 * round trip in between, the next statement met the FATAL in flight, which
 * is a termination at the moment of sending, not while idle).
 */
static void
terminate_idle_backend(int backend_pid)
{
	char		pid[16];
	const char *p1[1] = {pid};
	int			i;

	snprintf(pid, sizeof(pid), "%d", backend_pid);
	free(pg_val(admin, "SELECT pg_terminate_backend($1::int)", 1, p1));
	for (i = 0; i < 200 && pg_int(admin, "SELECT count(*) FROM pg_stat_activity WHERE pid = $1::int", 1, p1) > 0; i++)
		sleep_ms(10);
	sleep_ms(200);
}

static char *
ledger_status(int64_t tenant, const char *scope, const char *id)
{
	char		t[24];
	const char *p[3] = {t, scope, id};

	snprintf(t, sizeof(t), "%lld", (long long) tenant);
	return pg_val(admin, "SELECT status || ' ' || attempt FROM idem_lookup($1::bigint, idem_key($2, $3))", 3, p);
}

static int
ledger_is(int64_t tenant, const char *scope, const char *id, const char *want)
{
	char	   *s = ledger_status(tenant, scope, id);
	int			ok = (want == NULL && s == NULL) || (want && s && strcmp(s, want) == 0);

	if (!ok)
		tap_diag("ledger of %s/%s is %s, want %s", scope, id, s ? s : "(no row)",
				 want ? want : "(no row)");
	free(s);
	return ok;
}

static int
cache_absent(int platform, int64_t tenant, const char *scope, const char *id)
{
	char		k[IDEM_CACHE_KEY_MAX];
	char	   *v;

	cache_key_of(k, sizeof(k), platform, tenant, scope, id);
	v = rv_get(k);
	if (v)
		tap_diag("cache key %s holds %s", k, v);
	free(v);
	return v == NULL;
}

/*
 * No processing marker under the key: it is absent, or holds a terminal
 * value (after a read of a terminal row from PostgreSQL, the server's
 * worker may already have repopulated the key).
 */
static int
cache_no_marker(int platform, int64_t tenant, const char *scope, const char *id)
{
	char		k[IDEM_CACHE_KEY_MAX];
	char	   *v;
	char		kind = 0;

	cache_key_of(k, sizeof(k), platform, tenant, scope, id);
	v = rv_get(k);
	if (v == NULL)
		return 1;
	if (sscanf(v, "idem2 %*s %*s %c", &kind) != 1 || kind == 'p')
		tap_diag("cache key %s holds %s", k, v);
	free(v);
	return kind == 'c' || kind == 'f';
}

/*
 * Wait (up to ms) until the server's worker has settled every copy queued
 * so far (written, dropped or refused), while it holds a Valkey
 * connection: a commit's copy, or the repopulation an idem_lookup queues,
 * must not land after a test deleted the key to see PostgreSQL answer.
 */
void
await_worker_settled(int ms)
{
	PGconn	   *c = pg_open(E.pg);
	int			i;

	if (c == NULL)
		return;
	for (i = 0; i < ms / 10; i++)
	{
		PGresult   *r = PQexec(c, "SELECT valkey_connected AND queued > copied + dropped + rejected + skipped"
							   " FROM idem_stats()");
		int			waiting = PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1 &&
			strcmp(PQgetvalue(r, 0, 0), "t") == 0;

		PQclear(r);
		if (!waiting)
			break;
		sleep_ms(10);
	}
	PQfinish(c);
}

static void
cache_del(int platform, int64_t tenant, const char *scope, const char *id)
{
	char		k[IDEM_CACHE_KEY_MAX];

	await_worker_settled(3000);
	cache_key_of(k, sizeof(k), platform, tenant, scope, id);
	rv_cmd_ok("DEL %s", k);
}

/* Another session that holds the claim of tenant 1's key (scope, id) in
 * an open transaction (ROLLBACK and PQfinish it). */
static PGconn *
claim_holder(const char *scope, const char *id)
{
	PGconn	   *holder = pg_open(E.pg);
	const char *p[2] = {scope, id};

	pg_ok(holder, "BEGIN");
	PQclear(PQexecParams(holder, "SELECT decision FROM idem_claim(1, idem_key($1, $2), idem_fingerprint('{}'), '10 s')",
						 2, NULL, p, NULL, NULL, 0));
	return holder;
}

static const char *
res_str(const idem_result *r)
{
	static char buf[800];

	snprintf(buf, sizeof(buf), "%s/%s attempt %d retry %ld %.300s%s%s",
			 idem_status_name(r->status), idem_source_name(r->source),
			 r->attempt, r->retry_after_ms,
			 r->status == IDEM_ERROR ? r->error_message : r->outcome,
			 r->sqlstate[0] ? " sqlstate " : "", r->sqlstate);
	return buf;
}

#define R_IS(res, st, src) ((res).status == (st) && (res).source == (src))

static long long
xact_commits(void)
{
	char		buf[256];
	const char *p[1] = {buf};
	PGconn	   *m = pg_open(E.pg_admin);
	long long	v;

	snprintf(buf, sizeof(buf), "%s", E.dbname);
	v = pg_int(m, "SELECT xact_commit FROM pg_stat_database WHERE datname = $1", 1, p);
	PQfinish(m);
	return v;
}

/* A loopback port nobody listens on (bound, then closed). */
static int
closed_port(void)
{
	struct sockaddr_in a;
	socklen_t	len = sizeof(a);
	int			fd = socket(AF_INET, SOCK_STREAM, 0);
	int			port = 1;

	memset(&a, 0, sizeof(a));
	a.sin_family = AF_INET;
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	if (fd >= 0 && bind(fd, (struct sockaddr *) &a, sizeof(a)) == 0 &&
		getsockname(fd, (struct sockaddr *) &a, &len) == 0)
		port = ntohs(a.sin_port);
	if (fd >= 0)
		close(fd);
	return port;
}

typedef struct rt
{
	long		pg,
				vk,
				pg_lib,
				vk_lib;
} rt;

static idem_runner *R;			/* through the proxies */
static proxy PP,
			VP;

static void
rt_mark(rt *m)
{
	idem_runner_stats st;

	idem_runner_stats_init(&st);
	idem_runner_get_stats(R, &st);
	m->pg = PP.bursts;
	m->vk = VP.bursts;
	m->pg_lib = st.pg_round_trips;
	m->vk_lib = st.valkey_round_trips;
}

static void
rt_since(const rt *a, rt *d)
{
	rt			b;

	sleep_ms(30);				/* let the proxy thread see the last bytes */
	rt_mark(&b);
	d->pg = b.pg - a->pg;
	d->vk = b.vk - a->vk;
	d->pg_lib = b.pg_lib - a->pg_lib;
	d->vk_lib = b.vk_lib - a->vk_lib;
}

static int
rt_check(const char *path, const rt *d, long want_pg, long want_vk)
{
	int			ok = d->pg == want_pg && d->vk == want_vk &&
		d->pg_lib == want_pg && d->vk_lib == want_vk;

	tap_diag("round trips, %-34s PostgreSQL %ld (library says %ld), Valkey %ld (library says %ld)",
			 path, d->pg, d->pg_lib, d->vk, d->vk_lib);
	return tap_ok(ok, "round trips of %s: PostgreSQL %ld, Valkey %ld", path, want_pg, want_vk);
}

/* Runs the new keys wc<from> .. wc<to - 1> of scope: whether each applied. */
static int
run_new_keys(idem_runner *R, const char *scope, int from, int to, hctx *h)
{
	idem_result res;
	char		id[32];
	int			ok = 1;
	int			i;

	idem_result_init(&res);
	for (i = from; i < to; i++)
	{
		snprintf(id, sizeof(id), "wc%d", i);
		idem_run(R, 1, scope, id, "{}", handler, h, &res);
		ok = ok && R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER);
	}
	return ok;
}

static int
cmd_scenario(void)
{
	idem_options o;
	idem_result res;
	hctx		h;
	rt			m,
				d;
	char		conninfo[512];
	char		ck[IDEM_CACHE_KEY_MAX];
	char	   *v;
	char		S[64],
				PS[64];
	char		req_a[] = "{\"amount\": 5, \"currency\": \"EUR\"}";
	char		expect_a[] = "{\"n\": 15.0, \"id\": \"a1\", \"attempt\": 1}";
	FILE	   *trace;
	char		tracepath[256];

	snprintf(S, sizeof(S), "scn.pay%s", E.suffix);
	snprintf(PS, sizeof(PS), "maintenance.purge%s", E.suffix);
	admin = pg_open(E.pg);
	rvc = rv_open();
	if (admin == NULL || rvc == NULL)
	{
		tap_ok(0, "servers reachable");
		return tap_done();
	}
	if (proxy_start(&PP, E.pg_port) != 0 || proxy_start(&VP, E.valkey_port) != 0)
	{
		tap_ok(0, "proxies start");
		return tap_done();
	}
	snprintf(conninfo, sizeof(conninfo), "host=127.0.0.1 port=%d dbname=%s connect_timeout=5 application_name=itest-runner",
			 PP.port, E.dbname);
	snprintf(tracepath, sizeof(tracepath), "%s/pgtrace.txt", getenv("IDEM_TEST_WORKDIR") ? getenv("IDEM_TEST_WORKDIR") : "/tmp");
	trace = fopen(tracepath, "w+");
	idem_options_init(&o);
	idem_result_init(&res);
	o.lease_ms = 1000;
	o.valkey_retry_ms = 200;
	o.valkey_command_timeout_ms = E.slow ? 2000 : 200;
	o.pg_trace = trace;
	o.secrets_max_age_ms = IDEM_SECRETS_MAX_AGE_MAX_MS;	/* the round trips counted below are exact */
	R = idem_runner_open(conninfo, "127.0.0.1", VP.port, &o);
	tap_ok(R != NULL && idem_runner_error_message(R)[0] == '\0',
		   "runner opens on both servers (%s)", R ? idem_runner_error_message(R) : "NULL");

	/* --- applied, then replays ------------------------------------ */
	memset(&h, 0, sizeof(h));
	rt_mark(&m);
	idem_run(R, 1, S, "a1", req_a, handler, &h, &res);
	rt_since(&m, &d);
	tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && res.attempt == 1 &&
		   h.calls == 1 && strcmp(res.outcome, expect_a) == 0 && res.valkey_used,
		   "first delivery: applied by the handler, attempt 1, canonical outcome (%s)", res_str(&res));
	tap_ok(effects_of(S, "a1") == 1 && ledger_is(1, S, "a1", "completed 1"),
		   "effect and completed row committed together");
	tap_diag("(applied with a handler that does one INSERT: PostgreSQL %ld round trips, 2 + 1 of the handler)", d.pg);
	cache_key_of(ck, sizeof(ck), 0, 1, S, "a1");
	v = rv_get(ck);
	tap_ok(v != NULL && strncmp(v, "idem2 ", 6) == 0 &&
		   strncmp(ck, test_keyspace(), strlen(test_keyspace())) == 0,
		   "after the commit the key (in the server's keyspace) holds our marker, left for the worker's idem2 copy to replace, or that copy (%s)",
		   v ? v : "absent");
	free(v);
	/* what the worker writes once the commit is durable */
	tap_ok(worker_copy(0, 1, S, "a1") == 0, "the worker's copy of a1 is in Valkey");
	{
		long long	pttl = rv_pttl(ck);

		tap_ok(pttl > 23 * 3600 * 1000LL && pttl <= 24 * 3600 * 1000LL,
			   "its TTL is the retention left on the row (PTTL %lld ms)", pttl);
	}
	rt_mark(&m);
	idem_run(R, 1, S, "a1", "{\"currency\":\"EUR\",\"amount\":5e0}", handler, &h, &res);
	rt_since(&m, &d);
	tap_ok(R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_VALKEY) && h.calls == 1 &&
		   strcmp(res.outcome, expect_a) == 0 && res.attempt == 1,
		   "redelivery (same request, other spelling): replay from Valkey, same bytes (%s)", res_str(&res));
	rt_check("replay from Valkey", &d, 0, 1);

	/*
	 * --- the gate's connection closed by Valkey while idle (a restart, its
	 * timeout setting, CLIENT KILL): the next run connects again at once
	 * and is answered by Valkey, not sent to PostgreSQL for retry_ms.
	 */
	{
		idem_runner_stats s0,
					s1;

		idem_runner_stats_init(&s0);
		idem_runner_stats_init(&s1);
		idem_runner_get_stats(R, &s0);
		tap_ok(rv_cmd_ok("CLIENT KILL TYPE normal SKIPME yes"),
			   "Valkey closes every client's connection (CLIENT KILL)");
		sleep_ms(100);			/* the proxy sees the close and passes it on */
		idem_run(R, 1, S, "a1", "{\"currency\":\"EUR\",\"amount\":5e0}", handler, &h, &res);
		idem_runner_get_stats(R, &s1);
		tap_ok(R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_VALKEY) && h.calls == 1 &&
			   s1.valkey_connects == s0.valkey_connects + 1 &&
			   s1.valkey_skipped == s0.valkey_skipped,
			   "a gate connection closed while idle: the next run connects again at once and replays from Valkey (%s; connects %ld -> %ld, skipped %ld -> %ld)",
			   res_str(&res), s0.valkey_connects, s1.valkey_connects,
			   s0.valkey_skipped, s1.valkey_skipped);
	}

	/*
	 * --- a redelivery (delivery_count > 1): the gate alone -------------
	 * Its SET NX GET answers a stored result as a GET would and, the key
	 * being there, writes nothing: the value and its TTL stay the worker's.
	 */
	{
		idem_run_options ro;
		char		ck1[IDEM_CACHE_KEY_MAX];
		char	   *v0,
				   *v1;
		long long	t0,
					t1;

		cache_key_of(ck1, sizeof(ck1), 0, 1, S, "a1");
		v0 = rv_get(ck1);
		t0 = rv_pttl(ck1);
		idem_run_options_init(&ro);
		ro.delivery_count = 2;
		rt_mark(&m);
		idem_run_with(R, 1, S, "a1", "{\"currency\":\"EUR\",\"amount\":5e0}", &ro,
					  handler, &h, &res);
		rt_since(&m, &d);
		v1 = rv_get(ck1);
		t1 = rv_pttl(ck1);
		tap_ok(R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_VALKEY) && h.calls == 1 &&
			   strcmp(res.outcome, expect_a) == 0,
			   "delivery_count 2, cached: replay from Valkey (%s)", res_str(&res));
		rt_check("redelivery replayed by the gate", &d, 0, 1);
		tap_ok(v0 && v1 && strcmp(v0, v1) == 0 && t0 > 0 && t1 <= t0 && t1 > t0 - 5000,
			   "... which left the stored value and its TTL as they were (PTTL %lld, then %lld)", t0, t1);
		free(v0);
		free(v1);
		idem_run_with(R, 1, S, "a1", "{\"amount\": 6, \"currency\": \"EUR\"}", &ro,
					  handler, &h, &res);
		tap_ok(R_IS(res, IDEM_MISMATCH, IDEM_SOURCE_POSTGRES) && h.calls == 1,
			   "delivery_count 2, another request: the gate and PostgreSQL say mismatch (%s)", res_str(&res));
		memset(&h, 0, sizeof(h));
		rt_mark(&m);
		idem_run_with(R, 1, S, "redeliv1", "{}", &ro, handler, &h, &res);
		rt_since(&m, &d);
		d.pg -= 1;				/* the handler's INSERT */
		tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && h.calls == 1 &&
			   effects_of(S, "redeliv1") == 1,
			   "delivery_count 2, not cached: the gate and the claim apply it once (%s)", res_str(&res));
		rt_check("redelivery not cached (the gate only; handler excluded)", &d, 2, 1);
	}

	/* --- idem_cached: Valkey alone, no marker, no transaction --------- */
	{
		char		ck2[IDEM_CACHE_KEY_MAX];
		char	   *v2;
		int			rc;

		rt_mark(&m);
		rc = idem_cached(R, 1, S, "a1", "{\"currency\":\"EUR\",\"amount\":5e0}", &res);
		rt_since(&m, &d);
		tap_ok(rc == 1 && R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_VALKEY) && h.calls == 1 &&
			   strcmp(res.outcome, expect_a) == 0 && res.attempt == 1,
			   "idem_cached: a cached result for the same request decides (%s)", res_str(&res));
		rt_check("idem_cached, cached", &d, 0, 1);
		rc = idem_cached(R, 1, S, "a1", "{\"amount\": 6, \"currency\": \"EUR\"}", &res);
		tap_ok(rc == 0 && res.status != IDEM_REPLAYED,
			   "idem_cached: another request under the key is left to PostgreSQL (a mismatch is its to say)");
		rt_mark(&m);
		rc = idem_cached(R, 1, S, "never-run", req_a, &res);
		rt_since(&m, &d);
		cache_key_of(ck2, sizeof(ck2), 0, 1, S, "never-run");
		v2 = rv_get(ck2);
		tap_ok(rc == 0 && v2 == NULL && h.calls == 1,
			   "idem_cached: nothing cached: 0, the handler does not run, and no marker is left (%s)",
			   v2 ? v2 : "absent");
		free(v2);
		rt_check("idem_cached, nothing cached", &d, 0, 1);
		{
			idem_result many[3];
			int64_t		tn[3] = {1, 1, 1};
			const char *sc[3] = {S, S, S};
			const char *idv[3] = {"a1", "never-run", "a1"};
			const char *rq[3] = {req_a, req_a, "{\"amount\": 6}"};
			int			k;

			for (k = 0; k < 3; k++)
				idem_result_init(&many[k]);
			rt_mark(&m);
			rc = idem_cached_many(R, 3, tn, sc, idv, rq, many);
			rt_since(&m, &d);
			tap_ok(rc == 1 && many[0].source == IDEM_SOURCE_VALKEY &&
				   many[0].status == IDEM_REPLAYED &&
				   strcmp(many[0].outcome, expect_a) == 0 &&
				   many[1].source == IDEM_SOURCE_NONE && many[2].source == IDEM_SOURCE_NONE,
				   "idem_cached_many: the cached task decided, the others left to PostgreSQL");
			rt_check("idem_cached_many of 3", &d, 0, 1);
		}
	}

	/* --- xact_commit: a replay from Valkey opens no transaction ------ */
	{
		long long	x0,
					x1,
					x2;
		int			i,
					all = 1;
		long		before = 0;

		int			tries;

		/* other sessions' statistics reach pg_stat_database within about
		 * a second of their going idle; measure again if one came late */
		for (tries = 0; tries < 3; tries++)
		{
			fflush(trace);
			fseek(trace, 0, SEEK_END);
			before = ftell(trace);
			sleep_ms(1200);
			x0 = xact_commits();
			all = 1;
			for (i = 0; i < 20; i++)
			{
				idem_run(R, 1, S, "a1", req_a, handler, &h, &res);
				if (!R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_VALKEY))
					all = 0;
			}
			sleep_ms(1200);
			x1 = xact_commits();
			fflush(trace);
			fseek(trace, 0, SEEK_END);
			if (all && x1 == x0 && ftell(trace) == before)
				break;
		}
		tap_ok(all && x1 == x0 && ftell(trace) == before,
			   "20 replays from Valkey: xact_commit unchanged (%lld -> %lld), no PostgreSQL message sent",
			   x0, x1);
		cache_del(0, 1, S, "a1");
		idem_run(R, 1, S, "a1", req_a, handler, &h, &res);
		sleep_ms(1200);
		x2 = xact_commits();
		tap_ok(R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_POSTGRES) && x2 >= x1 + 1,
			   "control: a replay from PostgreSQL does move xact_commit (%lld -> %lld)", x1, x2);
		worker_copy(0, 1, S, "a1");
	}
	{
		char		line[512];
		int			rfq = 0;

		fflush(trace);
		rewind(trace);
		while (fgets(line, sizeof(line), trace))
			if (strncmp(line, "B\t", 2) == 0 && strstr(line, "\tReadyForQuery\t"))
				rfq++;
		tap_ok(rfq > 0, "PQtrace option: the protocol trace shows the ReadyForQuery messages (%d)", rfq);
	}

	/* --- replay from PostgreSQL: the worker repopulates Valkey -------- */
	cache_del(0, 1, S, "a1");
	rt_mark(&m);
	idem_run(R, 1, S, "a1", req_a, handler, &h, &res);
	rt_since(&m, &d);
	tap_ok(R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_POSTGRES) && h.calls == 1 &&
		   strcmp(res.outcome, expect_a) == 0,
		   "key gone from Valkey: replay from PostgreSQL, same bytes (%s)", res_str(&res));
	rt_check("replay from PostgreSQL", &d, 2, 1);
	if (worker_writes_idem2())
	{
		int			i;

		for (i = 0; i < 60; i++)
		{
			v = rv_get(ck);
			if (v && strncmp(v, "idem2 ", 6) == 0)
				break;
			free(v);
			v = NULL;
			sleep_ms(50);
		}
		tap_ok(v != NULL, "the replay from PostgreSQL: the server's worker repopulated Valkey");
		free(v);
		idem_run(R, 1, S, "a1", req_a, handler, &h, &res);
		tap_ok(R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_VALKEY), "and the next replay comes from Valkey");
	}
	else
		tap_skip_ext("the server's worker does not write idem2 values yet: repopulation");

	/* --- round trips of the applied path ------------------------------ */
	memset(&h, 0, sizeof(h));
	h.mode = "noop";
	rt_mark(&m);
	idem_run(R, 1, S, "rt-applied", "{}", handler, &h, &res);
	rt_since(&m, &d);
	tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER), "no-op handler applied");
	rt_check("applied (handler excluded)", &d, 2, 1);

	/* --- a first delivery skips the gate (delivery_count = 1) --------- */
	{
		idem_run_options ro;
		idem_runner_stats s0,
					s1;

		idem_run_options_init(&ro);
		ro.delivery_count = 1;
		idem_runner_stats_init(&s0);
		idem_runner_stats_init(&s1);
		memset(&h, 0, sizeof(h));
		idem_runner_get_stats(R, &s0);
		rt_mark(&m);
		idem_run_with(R, 1, S, "first1", "{}", &ro, handler, &h, &res);
		rt_since(&m, &d);
		idem_runner_get_stats(R, &s1);
		d.pg -= 1;				/* the handler's INSERT */
		tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && h.calls == 1 &&
			   effects_of(S, "first1") == 1 && !res.valkey_used &&
			   s1.gate_skipped_first == s0.gate_skipped_first + 1,
			   "delivery_count 1: applied without the Valkey gate (%s)", res_str(&res));
		rt_check("first delivery (handler excluded)", &d, 2, 0);
		/* the same message flagged as a first delivery by mistake, before
		 * and after the worker's copy: the claim answers, once */
		idem_run_with(R, 1, S, "first1", "{}", &ro, handler, &h, &res);
		tap_ok(R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_POSTGRES) && h.calls == 1 &&
			   effects_of(S, "first1") == 1,
			   "a duplicate wrongly flagged first: replay from PostgreSQL, effect once (%s)", res_str(&res));
		worker_copy(0, 1, S, "first1");
		idem_run_with(R, 1, S, "first1", "{\"other\": 1}", &ro, handler, &h, &res);
		tap_ok(R_IS(res, IDEM_MISMATCH, IDEM_SOURCE_POSTGRES) && h.calls == 1 &&
			   effects_of(S, "first1") == 1,
			   "a reuse of the key wrongly flagged first: mismatch from PostgreSQL (%s)", res_str(&res));
		/* flagged first while another session holds the claim */
		{
			PGconn	   *holder = claim_holder(S, "first2");

			idem_run_with(R, 1, S, "first2", "{}", &ro, handler, &h, &res);
			tap_ok(R_IS(res, IDEM_BUSY, IDEM_SOURCE_POSTGRES) && h.calls == 1 &&
				   effects_of(S, "first2") == 0,
				   "a concurrent duplicate wrongly flagged first: busy from PostgreSQL (%s)", res_str(&res));
			pg_ok(holder, "ROLLBACK");
			PQfinish(holder);
		}
		ro.delivery_count = -1;
		idem_run_with(R, 1, S, "first3", "{}", &ro, handler, &h, &res);
		tap_ok(res.status == IDEM_ERROR && res.error_code == IDEM_ERR_ARGUMENT && h.calls == 1,
			   "a negative delivery_count is refused (%s)", res.error_message);
		ro.delivery_count = 2;
		idem_run_with(R, 1, S, "first3", "{}", &ro, handler, &h, &res);
		tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && res.valkey_used,
			   "delivery_count 2: through the gate as before (%s)", res_str(&res));
	}

	/* --- a SQL handler: the whole run is one idem_apply ---------------- */
	{
		idem_run_options ro;
		char		args[256];

		idem_run_options_init(&ro);
		ro.sql_handler = "itest_effect(jsonb)";
		ro.sql_args = args;
		snprintf(args, sizeof(args), "{\"scope\": \"%s\", \"id\": \"sql1\"}", S);
		rt_mark(&m);
		idem_run_with(R, 1, S, "sql1", "{}", &ro, NULL, NULL, &res);
		rt_since(&m, &d);
		tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && res.attempt == 1 &&
			   strcmp(res.outcome, "{\"id\": \"sql1\"}") == 0 &&
			   effects_of(S, "sql1") == 1 && ledger_is(1, S, "sql1", "completed 1"),
			   "sql_handler: applied by idem_apply, effect and key committed together (%s)", res_str(&res));
		rt_check("applied with a SQL handler", &d, 1, 1);
		idem_run_with(R, 1, S, "sql1", "{}", &ro, NULL, NULL, &res);
		tap_ok((R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_POSTGRES) ||
				R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_VALKEY)) &&
			   strcmp(res.outcome, "{\"id\": \"sql1\"}") == 0 && effects_of(S, "sql1") == 1,
			   "sql_handler: its duplicate is a replay, the effect stays once (%s)", res_str(&res));
		ro.delivery_count = 1;
		snprintf(args, sizeof(args), "{\"scope\": \"%s\", \"id\": \"sql2\"}", S);
		rt_mark(&m);
		idem_run_with(R, 1, S, "sql2", "{}", &ro, NULL, NULL, &res);
		rt_since(&m, &d);
		tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && effects_of(S, "sql2") == 1,
			   "sql_handler on a first delivery: applied (%s)", res_str(&res));
		rt_check("first delivery with a SQL handler", &d, 1, 0);
		idem_run_with(R, 1, S, "sql2", "{}", &ro, NULL, NULL, &res);
		tap_ok(R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_POSTGRES) && effects_of(S, "sql2") == 1,
			   "sql_handler, a duplicate wrongly flagged first: replay from PostgreSQL, effect once (%s)", res_str(&res));
		ro.delivery_count = 0;
		/* errors the handler raises are recorded */
		snprintf(args, sizeof(args), "{\"scope\": \"%s\", \"id\": \"sql3\", \"fail\": \"P0001\"}", S);
		idem_run_with(R, 1, S, "sql3", "{}", &ro, NULL, NULL, &res);
		tap_ok(R_IS(res, IDEM_FAILED_PERMANENT, IDEM_SOURCE_HANDLER) && effects_of(S, "sql3") == 0 &&
			   strcmp(res.outcome, "{\"message\": \"no\", \"sqlstate\": \"P0001\"}") == 0 &&
			   ledger_is(1, S, "sql3", "failed_permanent 1"),
			   "sql_handler raising P0001: failed_permanent, its writes rolled back (%s)", res_str(&res));
		snprintf(args, sizeof(args), "{\"scope\": \"%s\", \"id\": \"sql4\", \"fail\": \"55P03\"}", S);
		idem_run_with(R, 1, S, "sql4", "{}", &ro, NULL, NULL, &res);
		tap_ok(R_IS(res, IDEM_FAILED_RETRYABLE, IDEM_SOURCE_HANDLER) && effects_of(S, "sql4") == 0 &&
			   ledger_is(1, S, "sql4", "failed_retryable 1") && cache_absent(0, 1, S, "sql4"),
			   "sql_handler raising 55P03: failed_retryable, marker removed (%s)", res_str(&res));
		snprintf(args, sizeof(args), "{\"scope\": \"%s\", \"id\": \"sql4\"}", S);
		idem_run_with(R, 1, S, "sql4", "{}", &ro, NULL, NULL, &res);
		tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && res.attempt == 2 &&
			   effects_of(S, "sql4") == 1 && ledger_is(1, S, "sql4", "completed 2"),
			   "sql_handler: the retry is attempt 2, applied once (%s)", res_str(&res));
		/* the backend dies inside the handler (it terminates itself) */
		snprintf(args, sizeof(args), "{\"scope\": \"%s\", \"id\": \"sql5\", \"die\": true}", S);
		idem_run_with(R, 1, S, "sql5", "{}", &ro, NULL, NULL, &res);
		tap_ok(res.status == IDEM_ERROR && effects_of(S, "sql5") == 0 &&
			   ledger_is(1, S, "sql5", NULL) && cache_absent(0, 1, S, "sql5"),
			   "sql_handler: backend terminated inside the handler: error, nothing committed, marker removed (%s: %s)",
			   res_str(&res), res.error_message);
		snprintf(args, sizeof(args), "{\"scope\": \"%s\", \"id\": \"sql5\"}", S);
		idem_run_with(R, 1, S, "sql5", "{}", &ro, NULL, NULL, &res);
		tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && effects_of(S, "sql5") == 1,
			   "sql_handler: redelivered after that, applied once (%s)", res_str(&res));
		/* a handler that does not exist: a server error, nothing claimed */
		ro.sql_handler = "itest_no_such_handler(jsonb)";
		idem_run_with(R, 1, S, "sql6", "{}", &ro, NULL, NULL, &res);
		tap_ok(res.status == IDEM_ERROR && res.error_code == IDEM_ERR_SERVER &&
			   strcmp(res.sqlstate, "42883") == 0 && ledger_is(1, S, "sql6", NULL),
			   "sql_handler that does not exist: server error 42883, nothing claimed (%s)", res.error_message);
		ro.sql_handler = "";
		idem_run_with(R, 1, S, "sql6", "{}", &ro, NULL, NULL, &res);
		tap_ok(res.status == IDEM_ERROR && res.error_code == IDEM_ERR_ARGUMENT,
			   "an empty sql_handler is refused (%s)", res.error_message);
	}

	/* --- the handler's first statement sent with the claim ------------- */
	{
		idem_run_options ro;
		const char *fp[2] = {S, NULL};
		char		fid[16];

		idem_run_options_init(&ro);
		ro.first_sql = "INSERT INTO effects (scope, id, tenant) VALUES ($1, $2, 1) RETURNING 7";
		ro.first_nparams = 2;
		ro.first_params = fp;
		fp[1] = fid;
		snprintf(fid, sizeof(fid), "fs1");
		memset(&h, 0, sizeof(h));
		h.mode = "first";
		rt_mark(&m);
		idem_run_with(R, 1, S, fid, "{}", &ro, handler, &h, &res);
		rt_since(&m, &d);
		tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && h.calls == 1 &&
			   strcmp(res.outcome, "{\"n\": 7}") == 0 &&
			   effects_of(S, fid) == 1 && ledger_is(1, S, fid, "completed 1"),
			   "first_sql: sent with the claim, its result given to the handler, applied once (%s)", res_str(&res));
		rt_check("applied with first_sql", &d, 2, 1);
		/* a duplicate the claim answers (flagged first: no gate) */
		ro.delivery_count = 1;
		idem_run_with(R, 1, S, fid, "{}", &ro, handler, &h, &res);
		tap_ok(R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_POSTGRES) && h.calls == 1 &&
			   effects_of(S, fid) == 1,
			   "first_sql on a duplicate: replay, its statement rolled back, the handler not called (%s)", res_str(&res));
		idem_run_with(R, 1, S, fid, "{\"other\": 1}", &ro, handler, &h, &res);
		tap_ok(R_IS(res, IDEM_MISMATCH, IDEM_SOURCE_POSTGRES) && h.calls == 1 &&
			   effects_of(S, fid) == 1,
			   "first_sql on a reuse of the key: mismatch, its statement rolled back (%s)", res_str(&res));
		/* another session holds the claim */
		{
			PGconn	   *holder = pg_open(E.pg);
			const char *p1[1] = {S};

			snprintf(fid, sizeof(fid), "fs2");
			pg_ok(holder, "BEGIN");
			PQclear(PQexecParams(holder, "SELECT decision FROM idem_claim(1, idem_key($1, 'fs2'), idem_fingerprint('{}'), '10 s')",
								 1, NULL, p1, NULL, NULL, 0));
			idem_run_with(R, 1, S, fid, "{}", &ro, handler, &h, &res);
			tap_ok(R_IS(res, IDEM_BUSY, IDEM_SOURCE_POSTGRES) && h.calls == 1 &&
				   effects_of(S, fid) == 0 && PQtransactionStatus(R->pg.conn) == PQTRANS_IDLE,
				   "first_sql while another run holds the key: busy, its statement rolled back, the transaction ended (%s)", res_str(&res));
			pg_ok(holder, "ROLLBACK");
			PQfinish(holder);
		}
		/* the first statement fails: the handler reports it */
		ro.first_sql = "INSERT INTO effects (scope, id, tenant) VALUES ($1, $2, 1/0) RETURNING 7";
		snprintf(fid, sizeof(fid), "fs3");
		idem_run_with(R, 1, S, fid, "{}", &ro, handler, &h, &res);
		tap_ok(R_IS(res, IDEM_FAILED_RETRYABLE, IDEM_SOURCE_HANDLER) && h.calls == 2 &&
			   effects_of(S, fid) == 0 && ledger_is(1, S, fid, "failed_retryable 1"),
			   "first_sql that fails: the handler sees the error, failed_retryable, nothing of it committed (%s)", res_str(&res));
		/* ... and on a key that is not ours: the error is rolled back too */
		snprintf(fid, sizeof(fid), "fs1");
		idem_run_with(R, 1, S, fid, "{}", &ro, handler, &h, &res);
		tap_ok(R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_POSTGRES) && h.calls == 2 &&
			   strcmp(res.outcome, "{\"n\": 7}") == 0,
			   "first_sql that fails on a duplicate: replay, as without it (%s)", res_str(&res));
		ro.sql_handler = "itest_effect(jsonb)";
		idem_run_with(R, 1, S, "fs4", "{}", &ro, handler, &h, &res);
		tap_ok(res.status == IDEM_ERROR && res.error_code == IDEM_ERR_ARGUMENT && h.calls == 2,
			   "first_sql with sql_handler is refused (%s)", res.error_message);
		ro.sql_handler = NULL;
		ro.first_params = NULL;
		idem_run_with(R, 1, S, "fs4", "{}", &ro, handler, &h, &res);
		tap_ok(res.status == IDEM_ERROR && res.error_code == IDEM_ERR_ARGUMENT && h.calls == 2,
			   "first_sql with parameters but no first_params is refused (%s)", res.error_message);

		/*
		 * The first statement is a named prepared statement of the
		 * connection (one per distinct text, for the first few texts):
		 * prepared once, then reused; prepared again after a DEALLOCATE
		 * ALL and after a reconnect.
		 */
		ro.first_params = fp;
		ro.delivery_count = 0;
		ro.first_sql = "INSERT INTO effects (scope, id, tenant) VALUES ($1, $2, 1) RETURNING 8";
		memset(&h, 0, sizeof(h));
		h.mode = "first_stmts";
		h.first_text = ro.first_sql;
		idem_run_with(R, 1, S, "fs5", "{}", &ro, handler, &h, &res);
		snprintf(fid, sizeof(fid), "fs6");
		idem_run_with(R, 1, S, fid, "{}", &ro, handler, &h, &res);
		tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && strcmp(res.outcome, "{\"n\": 8}") == 0 &&
			   effects_of(S, fid) == 1 && strcmp(h.stmts, "2") == 0,
			   "first_sql: one named prepared statement, run by both runs (executions: %s; %s)", h.stmts, res_str(&res));
		h.mode = "deallocate";
		snprintf(fid, sizeof(fid), "fs7");
		idem_run_with(R, 1, S, fid, "{}", &ro, handler, &h, &res);
		h.mode = "first_stmts";
		idem_run_with(R, 1, S, fid, "{}", &ro, handler, &h, &res);
		tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && effects_of(S, fid) == 1 &&
			   strcmp(h.stmts, "1") == 0,
			   "first_sql after the handler's DEALLOCATE ALL: prepared again, applied once (executions: %s; %s)", h.stmts, res_str(&res));
		terminate_idle_backend(h.backend_pid);
		snprintf(fid, sizeof(fid), "fs8");
		idem_run_with(R, 1, S, fid, "{}", &ro, handler, &h, &res);
		tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && effects_of(S, fid) == 1 &&
			   strcmp(h.stmts, "1") == 0,
			   "first_sql after a reconnect: prepared again on the new connection, applied once (executions: %s; %s)", h.stmts, res_str(&res));

		/*
		 * A DDL that changes the first statement's result type: its named
		 * plan cannot be used ("cached plan must not change result type"),
		 * which an unnamed statement never meets; the runner sends it
		 * again, unnamed, and the handler sees its result.
		 */
		pg_ok(admin, "DROP TABLE IF EXISTS itest_first");
		pg_ok(admin, "CREATE TABLE itest_first (n int)");
		pg_ok(admin, "INSERT INTO itest_first VALUES (5)");
		ro.first_sql = "SELECT * FROM itest_first";
		ro.first_nparams = 0;
		ro.first_params = NULL;
		h.mode = "first";
		idem_run_with(R, 1, S, "fs9", "{}", &ro, handler, &h, &res);
		pg_ok(admin, "ALTER TABLE itest_first ADD COLUMN m int");
		idem_run_with(R, 1, S, "fs10", "{}", &ro, handler, &h, &res);
		tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && strcmp(res.outcome, "{\"n\": 5}") == 0,
			   "first_sql whose result type a DDL changed: sent again unnamed, applied (%s)", res_str(&res));
		idem_run_with(R, 1, S, "fs11", "{}", &ro, handler, &h, &res);
		tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && strcmp(res.outcome, "{\"n\": 5}") == 0,
			   "... and unnamed from then on (%s)", res_str(&res));
		/* beyond the slots (4 texts on this connection): unnamed */
		ro.first_sql = "SELECT n + 0 FROM itest_first";
		idem_run_with(R, 1, S, "fs12", "{}", &ro, handler, &h, &res);
		ro.first_sql = "SELECT n + 1 FROM itest_first";
		idem_run_with(R, 1, S, "fs13", "{}", &ro, handler, &h, &res);
		ro.first_sql = "SELECT n + 2 FROM itest_first";
		h.mode = "first_stmts";
		h.first_text = ro.first_sql;
		idem_run_with(R, 1, S, "fs14", "{}", &ro, handler, &h, &res);
		tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && strcmp(res.outcome, "{\"n\": 7}") == 0 &&
			   h.stmts[0] == '\0',
			   "a fifth first_sql text on a connection runs unnamed (%s; executions: \"%s\")", res_str(&res), h.stmts);
	}

	/* --- busy: a marker held by another runner ---------------------- */
	memset(&h, 0, sizeof(h));
	cache_key_of(ck, sizeof(ck), 0, 2, S, "b1");
	{
		char		mk[IDEM_CACHE_VALUE_MAX];
		int64_t		t0 = wall_ms(),
					elapsed;

		/* its deadline within our lease (1000 ms) and the 1 s skew */
		authentic_marker(mk, sizeof(mk), ck, t0 + 1800);
		rv_cmd_ok("SET %s %s PX 5000", ck, mk);
		v = rv_get(ck);
		rt_mark(&m);
		idem_run(R, 2, S, "b1", "{}", handler, &h, &res);
		rt_since(&m, &d);
		/* what is left of the deadline, however slow this machine is */
		elapsed = wall_ms() - t0;
		tap_ok(R_IS(res, IDEM_BUSY, IDEM_SOURCE_VALKEY) &&
			   res.retry_after_ms >= 1800 - elapsed - 5 &&
			   res.retry_after_ms <= 1800 && h.calls == 0,
			   "marker of another run: busy from Valkey, retry after its deadline (%s, %lld ms after the marker)",
			   res_str(&res), (long long) elapsed);
	}
	rt_check("busy from Valkey", &d, 1, 1);
	{
		char	   *v2 = rv_get(ck);

		tap_ok(v && v2 && strcmp(v, v2) == 0, "the other run's marker is left alone");
		free(v2);
	}
	/* a committed run's marker, not yet replaced by the worker's copy
	 * (runs that commit leave it): the duplicate reads the row */
	cache_key_of(ck, sizeof(ck), 0, 1, S, "a1");
	await_worker_copy(ck, NULL, 3000);
	{
		char		mk[IDEM_CACHE_VALUE_MAX];

		authentic_marker(mk, sizeof(mk), ck, wall_ms() + 1800);
		rv_cmd_ok("SET %s %s PX 5000", ck, mk);
	}
	memset(&h, 0, sizeof(h));
	rt_mark(&m);
	idem_run(R, 1, S, "a1", req_a, handler, &h, &res);
	rt_since(&m, &d);
	tap_ok(R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_POSTGRES) && h.calls == 0 &&
		   strcmp(res.outcome, expect_a) == 0,
		   "a duplicate that meets the marker of a run that committed: replay from PostgreSQL (idem_lookup), not busy (%s)",
		   res_str(&res));
	rt_check("duplicate meeting a committed run's marker", &d, 1, 1);
	idem_run(R, 1, S, "a1", "{\"amount\": 6}", handler, &h, &res);
	tap_ok(R_IS(res, IDEM_MISMATCH, IDEM_SOURCE_POSTGRES) && h.calls == 0,
		   "another request meeting that marker: mismatch from PostgreSQL (%s)", res_str(&res));
	free(v);
	/* a marker without TTL in Valkey: itest_trust.c (its deadline bounds it) */

	/* --- busy from PostgreSQL: another transaction holds the claim ----- */
	{
		PGconn	   *holder = pg_open(E.pg);
		PGresult   *r;

		memset(&h, 0, sizeof(h));
		pg_ok(holder, "BEGIN");
		{
			const char *p1[1] = {S};

			r = PQexecParams(holder, "SELECT decision FROM idem_claim(2, idem_key($1, 'b2'), idem_fingerprint('{}'), '10 s')",
							 1, NULL, p1, NULL, NULL, 0);
		}
		tap_ok(PQresultStatus(r) == PGRES_TUPLES_OK && strcmp(PQgetvalue(r, 0, 0), "claimed") == 0,
			   "another session claims b2 and keeps its transaction open");
		PQclear(r);
		rt_mark(&m);
		idem_run(R, 2, S, "b2", "{}", handler, &h, &res);
		rt_since(&m, &d);
		tap_ok(R_IS(res, IDEM_BUSY, IDEM_SOURCE_POSTGRES) && res.retry_after_ms > 0 && h.calls == 0,
			   "claim held by an open transaction: busy from PostgreSQL, at once (%s)", res_str(&res));
		rt_check("busy from PostgreSQL", &d, 2, 2);
		tap_ok(cache_absent(0, 2, S, "b2"), "our marker was removed (compare-and-delete)");
		pg_ok(holder, "ROLLBACK");
		PQfinish(holder);
		idem_run(R, 2, S, "b2", "{}", handler, &h, &res);
		tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && effects_of(S, "b2") == 1,
			   "after the other transaction rolled back: applied (%s)", res_str(&res));
	}

	/* --- mismatch ------------------------------------------------------ */
	memset(&h, 0, sizeof(h));
	worker_copy(0, 1, S, "a1");
	rt_mark(&m);
	idem_run(R, 1, S, "a1", "{\"amount\": 6}", handler, &h, &res);
	rt_since(&m, &d);
	tap_ok(R_IS(res, IDEM_MISMATCH, IDEM_SOURCE_POSTGRES) && h.calls == 0,
		   "same key, other request: the cached fingerprint differs, PostgreSQL confirms the mismatch (%s)", res_str(&res));
	rt_check("mismatch hinted by Valkey", &d, 1, 1);
	cache_del(0, 1, S, "a1");
	idem_run(R, 1, S, "a1", "{\"amount\": 6}", handler, &h, &res);
	tap_ok(R_IS(res, IDEM_MISMATCH, IDEM_SOURCE_POSTGRES) && h.calls == 0 &&
		   cache_no_marker(0, 1, S, "a1") && effects_of(S, "a1") == 1,
		   "not cached: mismatch from PostgreSQL; marker removed, nothing changed (%s)", res_str(&res));

	/* --- Valkey down: a duplicate is read, not claimed ------------------ */
	{
		idem_runner *RD;
		idem_options od;
		idem_runner_stats s0,
					s1;
		long		b0;
		int			i;

		/* Valkey configured on a port nobody listens on: it rests after
		 * the first failed connect */
		idem_options_init(&od);
		idem_runner_stats_init(&s0);
		idem_runner_stats_init(&s1);
		od.valkey_retry_ms = 60000;
		RD = idem_runner_open(conninfo, "127.0.0.1", closed_port(), &od);
		memset(&h, 0, sizeof(h));
		h.mode = "noop";
		idem_run(RD, 1, S, "a1", req_a, handler, &h, &res);	/* connects */
		for (i = 0; i < 4; i++)
		{
			static const char *const what[4] = {
				"replay", "mismatch", "new key", "its replay"
			};
			const char *id = i < 2 ? "a1" : "down-new";
			const char *req = i == 1 ? "{\"amount\": 6}" : i == 0 ? req_a : "{}";
			static const long want_pg[4] = {1, 1, 3, 1};

			b0 = PP.bursts;
			idem_runner_get_stats(RD, &s0);
			idem_run(RD, 1, S, id, req, handler, &h, &res);
			sleep_ms(30);
			idem_runner_get_stats(RD, &s1);
			tap_diag("Valkey down, %s: PostgreSQL %ld round trips (library says %ld), %s",
					 what[i], PP.bursts - b0, s1.pg_round_trips - s0.pg_round_trips,
					 res_str(&res));
			tap_ok((i == 0 ? R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_POSTGRES) &&
					strcmp(res.outcome, expect_a) == 0 :
					i == 1 ? R_IS(res, IDEM_MISMATCH, IDEM_SOURCE_POSTGRES) :
					i == 2 ? R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) :
					R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_POSTGRES)) &&
				   h.calls == (i < 2 ? 0 : 1) && !res.valkey_used &&
				   PP.bursts - b0 == want_pg[i] &&
				   s1.pg_round_trips - s0.pg_round_trips == want_pg[i],
				   "Valkey down, %s: %ld PostgreSQL round trip(s)%s (%s)", what[i],
				   want_pg[i], i == 2 ? " (lookup, claim, complete)" : ", no transaction",
				   res_str(&res));
		}
		tap_ok(effects_of(S, "a1") == 1 && ledger_is(1, S, "down-new", "completed 1"),
			   "Valkey down: still one effect for a1; the new key completed once");
		idem_runner_close(RD);

		/* lookup_first = 0: the claim answers the duplicate (2 round trips) */
		od.lookup_first = 0;
		RD = idem_runner_open(conninfo, "127.0.0.1", closed_port(), &od);
		idem_run(RD, 1, S, "a1", req_a, handler, &h, &res);	/* connects */
		b0 = PP.bursts;
		idem_runner_get_stats(RD, &s0);
		idem_run(RD, 1, S, "a1", req_a, handler, &h, &res);
		sleep_ms(30);
		idem_runner_get_stats(RD, &s1);
		tap_ok(R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_POSTGRES) && PP.bursts - b0 == 2 &&
			   s1.pg_round_trips - s0.pg_round_trips == 2,
			   "lookup_first = 0: a duplicate is claimed, 2 round trips (%s)", res_str(&res));
		idem_runner_close(RD);
	}

	/* --- a handler that deallocates the runner's statements ------------ */
	memset(&h, 0, sizeof(h));
	h.mode = "deallocate";
	idem_run(R, 1, S, "dealloc", "{}", handler, &h, &res);
	tap_ok(res.status == IDEM_ERROR && strcmp(res.sqlstate, "26000") == 0 &&
		   ledger_is(1, S, "dealloc", NULL) && cache_absent(0, 1, S, "dealloc"),
		   "handler ran DEALLOCATE ALL: the run fails, nothing committed, no marker left (%s)",
		   res_str(&res));
	h.mode = "noop";
	idem_run(R, 1, S, "dealloc", "{}", handler, &h, &res);
	tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && ledger_is(1, S, "dealloc", "completed 1"),
		   "the next run prepares its statements again and applies (%s)", res_str(&res));

	/*
	 * A handler that deallocates one of them: the others are still there,
	 * so preparing every statement again would fail on each ("already
	 * exists", 42P05) for ever.  The runner re-reads which exist.
	 */
	h.mode = "deallocate_one";
	idem_run(R, 1, S, "dealloc1", "{}", handler, &h, &res);
	tap_ok(res.status == IDEM_ERROR && strcmp(res.sqlstate, "26000") == 0 &&
		   ledger_is(1, S, "dealloc1", NULL),
		   "handler deallocated the runner's RELEASE: the run fails, nothing committed (%s)",
		   res_str(&res));
	{
		int			applied = 0;
		char		id[16];

		h.mode = "noop";
		for (int i = 0; i < 3; i++)
		{
			snprintf(id, sizeof(id), "dealloc1-%d", i);
			idem_run(R, 1, S, i == 0 ? "dealloc1" : id, "{}", handler, &h, &res);
			applied += R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER);
		}
		h.mode = "stmts";
		idem_run(R, 1, S, "dealloc1-stmts", "{}", handler, &h, &res);
		tap_ok(applied == 3 && R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) &&
			   strstr(h.stmts, "idem_client_begin,") && strstr(h.stmts, "idem_client_release"),
			   "the next runs apply: the runner prepares only the statement that is gone (%d of 3; %s; %s)",
			   applied, h.stmts, res_str(&res));
	}

	/*
	 * The runner's transaction control is prepared like its other
	 * statements, once per connection (BEGIN and SAVEPOINT by the first
	 * pipeline of a run, the rest by the completion), and again after a
	 * DEALLOCATE ALL.
	 */
	h.mode = "stmts";
	idem_run(R, 1, S, "stmts1", "{}", handler, &h, &res);
	idem_run(R, 1, S, "stmts2", "{}", handler, &h, &res);
	tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) &&
		   strstr(h.stmts, "idem_client_begin,") && strstr(h.stmts, "idem_client_commit,") &&
		   strstr(h.stmts, "idem_client_release,") && strstr(h.stmts, "idem_client_savepoint"),
		   "BEGIN, SAVEPOINT, RELEASE and COMMIT are prepared statements of the connection (%s)", h.stmts);
	h.mode = "deallocate";
	idem_run(R, 1, S, "stmts3", "{}", handler, &h, &res);
	h.mode = "noop";
	idem_run(R, 1, S, "stmts3", "{}", handler, &h, &res);
	h.mode = "stmts";
	idem_run(R, 1, S, "stmts4", "{}", handler, &h, &res);
	tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) &&
		   strstr(h.stmts, "idem_client_begin,") && strstr(h.stmts, "idem_client_claim_t,"),
		   "after DEALLOCATE ALL they are prepared again (%s)", h.stmts);

	/* --- malformed and forged values --------------------------------- */
	{
		uint8_t		fp[32];
		char		fph[65],
					good[IDEM_CACHE_VALUE_MAX];
		char		vals[12][IDEM_CACHE_VALUE_MAX + 16];
		int			nv = 0,
					i,
					gl,
					all = 1;

		idem_fingerprint(req_a, strlen(req_a), fp, NULL, 0);
		idem_cache_hex(fph, fp, 32);
		fph[64] = '\0';
		cache_key_of(ck, sizeof(ck), 0, 1, S, "a1");
		gl = authentic_terminal(good, sizeof(good), ck, 1, 1, fp, expect_a,
								wall_ms() + 3600 * 1000);
		snprintf(vals[nv++], 600, "garbage");
		snprintf(vals[nv++], 600, "idem1 c 1 %s %s", fph, expect_a);
		snprintf(vals[nv++], 600, "idem2 c 1 %s %s", fph, expect_a);
		snprintf(vals[nv++], 600, "%.*s {oops}", gl - (int) strlen(expect_a) - 1, good);
		snprintf(vals[nv++], sizeof(vals[0]), "%s trailing", good);
		snprintf(vals[nv++], 600, "idem1 p 0123");
		/* the authentic value with one hex digit of the MAC changed */
		snprintf(vals[nv], sizeof(vals[0]), "%s", good);
		vals[nv][6] = vals[nv][6] == '0' ? '1' : '0';
		nv++;
		/* an authentic value of the same row, made for another key */
		{
			char		other[IDEM_CACHE_KEY_MAX];

			cache_key_of(other, sizeof(other), 0, 2, S, "a1");
			authentic_terminal(vals[nv++], sizeof(vals[0]), other, 1, 1, fp, expect_a,
							   wall_ms() + 3600 * 1000);
		}
		/* an authentic value whose deadline has passed */
		authentic_terminal(vals[nv++], sizeof(vals[0]), ck, 1, 1, fp, expect_a, wall_ms() - 1000);
		memset(&h, 0, sizeof(h));
		await_worker_copy(ck, NULL, 2000);
		for (i = 0; i < nv; i++)
		{
			int			try;

			/* a repopulation by the server's worker (queued by an earlier
			 * replay from PostgreSQL) may land between our SET and the run:
			 * then the run read the authentic copy; plant again */
			for (try = 0; try < 3; try++)
			{
				rv_cmd_ok("SET %s %s PX 60000", ck, vals[i]);
				idem_run(R, 1, S, "a1", req_a, handler, &h, &res);
				await_worker_copy(ck, vals[i], 2000);
				if (!R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_VALKEY))
					break;
			}
			if (!R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_POSTGRES) ||
				strcmp(res.outcome, expect_a) != 0)
			{
				all = 0;
				tap_diag("value '%s': %s", vals[i], res_str(&res));
			}
		}
		/* a key of another type */
		rv_cmd_ok("DEL %s", ck);
		rv_cmd_ok("HSET %s f v", ck);
		idem_run(R, 1, S, "a1", req_a, handler, &h, &res);
		if (!R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_POSTGRES))
		{
			all = 0;
			tap_diag("hash key: %s", res_str(&res));
		}
		rv_cmd_ok("DEL %s", ck);
		tap_ok(all && h.calls == 0 && effects_of(S, "a1") == 1,
			   "%d malformed/forged/moved/expired values and a hash key: ignored, PostgreSQL replays", nv + 1);
		/* control: the authentic value itself is a replay from Valkey */
		rv_cmd_ok("SET %s %s PX 60000", ck, good);
		idem_run(R, 1, S, "a1", req_a, handler, &h, &res);
		tap_ok(R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_VALKEY) && strcmp(res.outcome, expect_a) == 0,
			   "control: the same value, authentic, replays from Valkey (%s)", res_str(&res));
		/* forged value for a key PostgreSQL has never seen */
		cache_key_of(ck, sizeof(ck), 0, 1, S, "f1");
		rv_cmd_ok("SET %s %s PX 60000", ck, "idem1 c 1 zz {}");
		idem_run(R, 1, S, "f1", "{}", handler, &h, &res);
		tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && effects_of(S, "f1") == 1,
			   "forged value on a new key: ignored, the handler runs once (%s)", res_str(&res));
		/* an authentic cached result with another fingerprint, but no row */
		{
			uint8_t		other[32];
			char		val[IDEM_CACHE_VALUE_MAX];

			memset(other, 0xab, 32);
			cache_key_of(ck, sizeof(ck), 0, 1, S, "f2");
			authentic_terminal(val, sizeof(val), ck, 1, 1, other, "{}", wall_ms() + 60000);
			rv_cmd_ok("SET %s %s PX 60000", ck, val);
			memset(&h, 0, sizeof(h));
			idem_run(R, 1, S, "f2", "{}", handler, &h, &res);
			tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && h.calls == 1 &&
				   effects_of(S, "f2") == 1,
				   "cached result with another fingerprint that PostgreSQL does not confirm: no mismatch, applied once (%s)",
				   res_str(&res));
			rv_cmd_ok("DEL %s", ck);
		}
	}

	/* --- bad outcomes from the handler ------------------------------ */
	{
		const char *modes[3] = {"oversize", "notobject", "badjson"};
		const char *details[3] = {
			"{\"message\": \"handler outcome is 5012 bytes as JSON text, over the limit of 4096 bytes\", \"sqlstate\": \"54000\"}",
			"{\"message\": \"handler outcome must be a JSON object\", \"sqlstate\": \"22023\"}",
			"{\"message\": \"handler outcome must be a JSON object\", \"sqlstate\": \"22023\"}"};
		const char *rows[3] = {"failed_retryable 1", "failed_permanent 1", "failed_permanent 1"};
		idem_status want[3] = {IDEM_FAILED_RETRYABLE, IDEM_FAILED_PERMANENT, IDEM_FAILED_PERMANENT};
		int			i;

		for (i = 0; i < 3; i++)
		{
			char		id[16];

			snprintf(id, sizeof(id), "o%d", i);
			memset(&h, 0, sizeof(h));
			h.mode = modes[i];
			idem_run(R, 1, S, id, "{}", handler, &h, &res);
			tap_ok(R_IS(res, want[i], IDEM_SOURCE_HANDLER) && res.attempt == 1 &&
				   strcmp(res.outcome, details[i]) == 0 && h.calls == 1 &&
				   effects_of(S, id) == 0 && ledger_is(1, S, id, rows[i]),
				   "%s outcome: the attempt fails as in idem_apply, effect rolled back, failure recorded (%s)",
				   modes[i], res_str(&res));
		}
		memset(&h, 0, sizeof(h));
		idem_run(R, 1, S, "o0", "{}", handler, &h, &res);
		tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && res.attempt == 2 &&
			   effects_of(S, "o0") == 1,
			   "redelivered after the oversize outcome: attempt 2 applied once (%s)", res_str(&res));

		/* idem.max_attempts = 2 ends a handler whose outcome is always too long */
		{
			char		ci[600];
			idem_runner *RM;
			idem_options om;
			int			runs;

			idem_options_init(&om);
			om.lease_ms = 1000;
			/* directly, not through the proxies that count round trips */
			snprintf(ci, sizeof(ci), "%s options=-cidem.max_attempts=2", E.pg);
			RM = idem_runner_open(ci, "127.0.0.1", E.valkey_port, &om);
			memset(&h, 0, sizeof(h));
			h.mode = "oversize";
			for (runs = 0; runs < 5; runs++)
			{
				idem_run(RM, 1, S, "o3", "{}", handler, &h, &res);
				if (res.status != IDEM_FAILED_RETRYABLE)
					break;
			}
			tap_ok(RM != NULL && res.status == IDEM_FAILED_PERMANENT && h.calls == 2 &&
				   effects_of(S, "o3") == 0 &&
				   ledger_is(1, S, "o3", "failed_permanent 2"),
				   "max_attempts=2 ends an always-oversize outcome: failed_permanent after 2 runs (%s, %d calls)",
				   res_str(&res), h.calls);
			idem_runner_close(RM);
		}
	}

	/* --- handler failures -------------------------------------------- */
	memset(&h, 0, sizeof(h));
	h.mode = "permanent";
	rt_mark(&m);
	idem_run(R, 1, S, "p1", "{}", handler, &h, &res);
	rt_since(&m, &d);
	d.pg -= 1;					/* the handler's INSERT */
	rt_check("permanent failure (handler excluded)", &d, 2, 1);
	tap_ok(R_IS(res, IDEM_FAILED_PERMANENT, IDEM_SOURCE_HANDLER) &&
		   strcmp(res.outcome, "{\"code\": 51, \"reason\": \"card declined\"}") == 0 &&
		   effects_of(S, "p1") == 0 && ledger_is(1, S, "p1", "failed_permanent 1"),
		   "permanent failure: detail recorded, the handler's writes rolled back to the savepoint (%s)", res_str(&res));
	worker_copy(0, 1, S, "p1");
	idem_run(R, 1, S, "p1", "{}", handler, &h, &res);
	tap_ok(R_IS(res, IDEM_FAILED_PERMANENT, IDEM_SOURCE_VALKEY) && h.calls == 1,
		   "its redelivery replays the failure from Valkey (%s)", res_str(&res));
	cache_del(0, 1, S, "p1");
	idem_run(R, 1, S, "p1", "{}", handler, &h, &res);
	tap_ok(R_IS(res, IDEM_FAILED_PERMANENT, IDEM_SOURCE_POSTGRES) && h.calls == 1,
		   "and from PostgreSQL when Valkey lost it (%s)", res_str(&res));
	memset(&h, 0, sizeof(h));
	h.mode = "retryable";
	rt_mark(&m);
	idem_run(R, 1, S, "r1", "{}", handler, &h, &res);
	rt_since(&m, &d);
	d.pg -= 1;					/* the handler's INSERT */
	rt_check("retryable failure (handler excluded)", &d, 2, 2);
	tap_ok(R_IS(res, IDEM_FAILED_RETRYABLE, IDEM_SOURCE_HANDLER) && effects_of(S, "r1") == 0 &&
		   ledger_is(1, S, "r1", "failed_retryable 1") && cache_absent(0, 1, S, "r1"),
		   "retryable failure: recorded, writes rolled back, marker removed (%s)", res_str(&res));
	h.mode = NULL;
	idem_run(R, 1, S, "r1", "{}", handler, &h, &res);
	tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && res.attempt == 2 &&
		   effects_of(S, "r1") == 1 && ledger_is(1, S, "r1", "completed 2"),
		   "retried: claimed again as attempt 2 and applied once (%s)", res_str(&res));

	memset(&h, 0, sizeof(h));
	h.mode = "sqlfail";
	idem_run(R, 1, S, "r2", "{}", handler, &h, &res);
	tap_ok(R_IS(res, IDEM_FAILED_RETRYABLE, IDEM_SOURCE_HANDLER) && effects_of(S, "r2") == 0 &&
		   ledger_is(1, S, "r2", "failed_retryable 1"),
		   "a statement of the handler failed and it reported a retryable failure: rolled back to the savepoint, failure recorded (%s)",
		   res_str(&res));

	/* --- a handler that breaks the transaction ----------------------- */
	memset(&h, 0, sizeof(h));
	h.mode = "breaktx";
	idem_run(R, 1, S, "x1", "{}", handler, &h, &res);
	tap_ok(res.status == IDEM_ERROR && res.error_code == IDEM_ERR_HANDLER &&
		   effects_of(S, "x1") == 0 && ledger_is(1, S, "x1", NULL) && cache_absent(0, 1, S, "x1"),
		   "handler returns success after a failed statement: error, nothing committed (%s)", res.error_message);

	/* --- unknown tenant ------------------------------------------------ */
	memset(&h, 0, sizeof(h));
	idem_run(R, 999999, S, "t1", "{}", handler, &h, &res);
	tap_ok(res.status == IDEM_ERROR && res.error_code == IDEM_ERR_SERVER && res.sqlstate[0] &&
		   h.calls == 0 && cache_absent(0, 999999, S, "t1"),
		   "unknown tenant: server error with SQLSTATE %s, marker removed (%s)", res.sqlstate, res.error_message);

	/* --- platform ledger ------------------------------------------------ */
	memset(&h, 0, sizeof(h));
	idem_run_platform(R, PS, "2026-11-29", "{\"batch\": 100}", handler, &h, &res);
	tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER), "platform ledger: applied (%s)", res_str(&res));
	worker_copy(1, 0, PS, "2026-11-29");
	idem_run_platform(R, PS, "2026-11-29", "{\"batch\": 100}", handler, &h, &res);
	cache_key_of(ck, sizeof(ck), 1, 0, PS, "2026-11-29");
	v = rv_get(ck);
	tap_ok(R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_VALKEY) && h.calls == 1 && v &&
		   strncmp(ck + strlen(test_keyspace()), "p:", 2) == 0,
		   "platform ledger: replay from Valkey under %s...", test_keyspace());
	free(v);
	{
		const char *p[2] = {PS, "2026-11-29"};
		char	   *st = pg_val(admin, "SELECT status FROM idem_platform_lookup(idem_key($1, $2))", 2, p);

		tap_ok(st && strcmp(st, "completed") == 0, "platform ledger row completed");
		free(st);
	}

	/* --- PostgreSQL backend terminated mid-handler ------------------ */
	{
		int			i;
		const char *modes[2] = {"terminate", "terminate2"};

		for (i = 0; i < 2; i++)
		{
			char		id[16];

			snprintf(id, sizeof(id), "k%d", i);
			memset(&h, 0, sizeof(h));
			h.mode = modes[i];
			idem_run(R, 1, S, id, "{}", handler, &h, &res);
			tap_ok(res.status == IDEM_ERROR && res.error_code == IDEM_ERR_CONNECTION &&
				   effects_of(S, id) == 0 && ledger_is(1, S, id, NULL) && cache_absent(0, 1, S, id),
				   "pg_terminate_backend mid-handler (%s): connection error, nothing committed, marker removed (%s)",
				   modes[i], res.error_message);
			h.mode = NULL;
			idem_run(R, 1, S, id, "{}", handler, &h, &res);
			tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && effects_of(S, id) == 1,
				   "redelivered: the runner reconnects, applied once (%s)", res_str(&res));
		}
	}
	/* killed while idle between runs: the next run reconnects by itself */
	{
		terminate_idle_backend(h.backend_pid);
		memset(&h, 0, sizeof(h));
		idem_run(R, 1, S, "k9", "{}", handler, &h, &res);
		tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && effects_of(S, "k9") == 1,
			   "backend terminated while idle: the next run retries on a new connection (%s)", res_str(&res));

		/*
		 * The same for a SQL handler (one autocommit idem_apply): the dead
		 * connection is seen before the statement goes out, so the run
		 * reconnects and applies; "commit unknown" would be a lie, nothing
		 * reached a live server.
		 */
		{
			idem_run_options ro;
			char		args[256];
			char		id[16];
			int			j;

			idem_run_options_init(&ro);
			ro.sql_handler = "itest_effect(jsonb)";
			ro.sql_args = args;
			for (j = 0; j < 2; j++)
			{
				/* a run on the new connection (the cache's keys are learnt
				 * again on it), then its backend is terminated */
				snprintf(id, sizeof(id), "k1%d", j);
				memset(&h, 0, sizeof(h));
				idem_run(R, 1, S, id, "{}", handler, &h, &res);
				terminate_idle_backend(h.backend_pid);
				snprintf(id, sizeof(id), "k2%d", j);
				snprintf(args, sizeof(args), "{\"scope\": \"%s\", \"id\": \"%s\"}", S, id);
				ro.delivery_count = j;	/* through the gate, then without */
				idem_run_with(R, 1, S, id, "{}", &ro, NULL, NULL, &res);
				tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && effects_of(S, id) == 1 &&
					   ledger_is(1, S, id, "completed 1"),
					   "sql_handler (delivery_count %d), backend terminated while idle: reconnects before sending, applied once (%s: %s)",
					   j, res_str(&res), res.error_message);
			}
		}
	}

	/* --- a handler that runs longer than its lease -------------------- */
	{
		idem_runner *R2;
		idem_options o2;
		int			wst = 0;

		idem_options_init(&o2);
		o2.lease_ms = 300;
		R2 = idem_runner_open(E.pg, "127.0.0.1", E.valkey_port, &o2);
		memset(&h, 0, sizeof(h));
		h.mode = "dup_during";
		h.sleep_ms = 1000;
		h.dup_scope = S;
		h.dup_id = "L1";
		h.dup_req = "{}";
		h.dup_after_ms = 500;
		if (pipe(h.dup_fd) != 0)
			h.dup_fd[0] = h.dup_fd[1] = -1;
		idem_run(R2, 1, S, "L1", "{}", handler, &h, &res);
		waitpid(h.dup_child, &wst, 0);
		if (read(h.dup_fd[0], &wst, sizeof(wst)) != sizeof(wst))
			wst = -1;
		close(h.dup_fd[0]);
		close(h.dup_fd[1]);
		tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER),
			   "handler of 1000 ms on a 300 ms lease: applied (%s)", res_str(&res));
		tap_ok(wst == 10 + IDEM_BUSY * 4 + IDEM_SOURCE_POSTGRES,
			   "the duplicate that came after the lease (and the marker) ended got busy from PostgreSQL (code %d)",
			   wst);
		memset(&h, 0, sizeof(h));
		idem_run(R2, 1, S, "L1", "{}", handler, &h, &res);
		tap_ok((res.status == IDEM_REPLAYED) && h.calls == 0 && effects_of(S, "L1") == 1,
			   "after the commit the duplicate replays; one effect (%s)", res_str(&res));
		idem_runner_close(R2);
	}

	/* --- Valkey slow (stopped) and down ------------------------------ */
	if (valkey_pid() > 0)
	{
		int64_t		t0;
		idem_runner *R3;
		idem_options o3;

		idem_options_init(&o3);
		o3.valkey_command_timeout_ms = 150;
		o3.valkey_retry_ms = 200;
		o3.lease_ms = 500;
		R3 = idem_runner_open(E.pg, "127.0.0.1", E.valkey_port, &o3);
		memset(&h, 0, sizeof(h));
		valkey_kill(SIGSTOP);
		t0 = now_ms();
		idem_run(R3, 1, S, "v1", "{}", handler, &h, &res);
		t0 = now_ms() - t0;
		valkey_kill(SIGCONT);
		tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && !res.valkey_used &&
			   effects_of(S, "v1") == 1 && (E.slow || t0 < 1000),
			   "Valkey not answering: gate skipped after the command timeout, applied on PostgreSQL alone in %lld ms",
			   (long long) t0);
		valkey_kill(SIGKILL);
		idem_run(R3, 1, S, "v1", "{}", handler, &h, &res);
		tap_ok(R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_POSTGRES) && h.calls == 1,
			   "Valkey down: replay from PostgreSQL (%s)", res_str(&res));
		idem_run(R3, 1, S, "v2", "{}", handler, &h, &res);
		tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && !res.valkey_used && effects_of(S, "v2") == 1,
			   "Valkey down: new key applied on PostgreSQL alone");
		tap_ok(valkey_start() == 0, "Valkey restarted (empty)");
		sleep_ms(300);
		idem_run(R3, 1, S, "v2", "{}", handler, &h, &res);
		/* the extension's worker may have copied v2 into the new Valkey
		 * already: then the replay comes from there */
		tap_ok(res.status == IDEM_REPLAYED && res.valkey_used && h.calls == 2,
			   "after the restart the runner reconnects to Valkey by itself (%s)", res_str(&res));
		wait_owner_key();
		worker_copy(0, 1, S, "v2");
		idem_run(R3, 1, S, "v2", "{}", handler, &h, &res);
		tap_ok(R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_VALKEY) && h.calls == 2,
			   "and Valkey answers the next replay (%s)", res_str(&res));
		idem_runner_close(R3);
	}
	else
		tap_skip_ext("Valkey pid unknown: slow/down tests");

	/*
	 * --- new keys in a row: no gate -----------------------------------
	 * After IDEM_NEW_KEYS_NO_GATE_AFTER (32) gates in a row that set their
	 * marker, a run of unknown delivery count skips the gate (no Valkey
	 * round trip, no marker): PostgreSQL decides, as for a first delivery.
	 * A duplicate answered by the claim ends the stretch.
	 */
	{
		idem_runner *RC = idem_runner_open(E.pg, "127.0.0.1", E.valkey_port, NULL);
		idem_runner_stats s0,
					s1;
		char		id[32];
		int			i,
					ok = 1;

		idem_runner_stats_init(&s0);
		idem_runner_stats_init(&s1);
		memset(&h, 0, sizeof(h));
		for (i = 0; i < 40; i++)
		{
			snprintf(id, sizeof(id), "wc%d", i);
			if (i == 32)
				idem_runner_get_stats(RC, &s0);
			idem_run(RC, 1, S, id, "{}", handler, &h, &res);
			ok = ok && R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) &&
				res.valkey_used == (i < 32) && effects_of(S, id) == 1 &&
				ledger_is(1, S, id, "completed 1");
		}
		idem_runner_get_stats(RC, &s1);
		tap_ok(ok && h.calls == 40 &&
			   s1.valkey_round_trips == s0.valkey_round_trips &&
			   s1.valkey_skipped - s0.valkey_skipped == 8,
			   "40 new keys in a row, the last 8 without the gate (Valkey round trips %ld, skipped %ld): each applied once (%s)",
			   s1.valkey_round_trips - s0.valkey_round_trips,
			   s1.valkey_skipped - s0.valkey_skipped, res_str(&res));
		cache_key_of(ck, sizeof(ck), 0, 1, S, "wc39");
		await_worker_copy(ck, NULL, 3000);
		tap_ok(cache_no_marker(0, 1, S, "wc39"),
			   "the worker copies the result of a run without the gate");
		/* a duplicate: the claim answers it ... */
		worker_copy(0, 1, S, "wc38");
		idem_runner_get_stats(RC, &s0);
		idem_run(RC, 1, S, "wc38", "{}", handler, &h, &res);
		idem_runner_get_stats(RC, &s1);
		tap_ok(R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_POSTGRES) && h.calls == 40 &&
			   effects_of(S, "wc38") == 1 &&
			   s1.valkey_round_trips == s0.valkey_round_trips,
			   "a duplicate in the stretch: replay from PostgreSQL, no Valkey round trip, effect once (%s)",
			   res_str(&res));
		/* ... and ends the stretch: the runs after it go through the gate */
		worker_copy(0, 1, S, "wc37");
		idem_run(RC, 1, S, "wc37", "{}", handler, &h, &res);
		tap_ok(R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_VALKEY) && h.calls == 40 &&
			   effects_of(S, "wc37") == 1,
			   "the next duplicate: replay from Valkey, no transaction (%s)", res_str(&res));
		/* 32 new keys again; then a key another session holds */
		ok = run_new_keys(RC, S, 40, 72, &h);
		{
			PGconn	   *holder = claim_holder(S, "wc-held");

			idem_runner_get_stats(RC, &s0);
			idem_run(RC, 1, S, "wc-held", "{}", handler, &h, &res);
			idem_runner_get_stats(RC, &s1);
			tap_ok(ok && R_IS(res, IDEM_BUSY, IDEM_SOURCE_POSTGRES) && h.calls == 72 &&
				   effects_of(S, "wc-held") == 0 && cache_absent(0, 1, S, "wc-held") &&
				   s1.valkey_round_trips == s0.valkey_round_trips,
				   "in the stretch, a key another session holds: busy from PostgreSQL, no marker, no Valkey round trip (%s)",
				   res_str(&res));
			pg_ok(holder, "ROLLBACK");
			PQfinish(holder);
		}
		/* busy ended the stretch too: the next new key has its gate */
		idem_runner_get_stats(RC, &s0);
		idem_run(RC, 1, S, "wc72", "{}", handler, &h, &res);
		idem_runner_get_stats(RC, &s1);
		tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && res.valkey_used &&
			   s1.valkey_round_trips == s0.valkey_round_trips + 1,
			   "after a busy answer the next new key goes through the gate (%s)", res_str(&res));
		/* a failure in the stretch: recorded; its redelivery applies */
		ok = run_new_keys(RC, S, 73, 105, &h);
		h.mode = "retryable";
		idem_run(RC, 1, S, "wc-fail", "{}", handler, &h, &res);
		tap_ok(ok && res.status == IDEM_FAILED_RETRYABLE && h.calls == 106 &&
			   !res.valkey_used && ledger_is(1, S, "wc-fail", "failed_retryable 1") &&
			   cache_absent(0, 1, S, "wc-fail"),
			   "a retryable failure in the stretch: recorded, nothing in Valkey (%s)", res_str(&res));
		h.mode = NULL;
		idem_run(RC, 1, S, "wc-fail", "{}", handler, &h, &res);
		tap_ok(R_IS(res, IDEM_APPLIED, IDEM_SOURCE_HANDLER) && res.attempt == 2 &&
			   !res.valkey_used && effects_of(S, "wc-fail") == 1 &&
			   ledger_is(1, S, "wc-fail", "completed 2"),
			   "its redelivery, still in the stretch: attempt 2 applied, effect once (%s)", res_str(&res));
		idem_runner_close(RC);
	}

	/* --- results written by the extension's worker ------------------- */
	if (worker_writes_idem2())
	{
		idem_runner *R4;
		int			i;

		R4 = idem_runner_open(E.pg, "127.0.0.1", E.valkey_port, NULL);
		memset(&h, 0, sizeof(h));
		idem_run(R4, 1, S, "w1", "{\"x\": 1}", handler, &h, &res);
		cache_key_of(ck, sizeof(ck), 0, 1, S, "w1");
		for (i = 0; i < 60; i++)
		{
			v = rv_get(ck);
			if (v && strncmp(v, "idem2 ", 6) == 0 && strstr(v, " c ") != NULL)
				break;
			free(v);
			v = NULL;
			sleep_ms(50);
		}
		free(v);
		idem_run(R4, 1, S, "w1", "{\"x\": 1}", handler, &h, &res);
		tap_ok(R_IS(res, IDEM_REPLAYED, IDEM_SOURCE_VALKEY) && h.calls == 1,
			   "the server's worker replaced our marker with the result and the client replays it (%s)",
			   res_str(&res));
		idem_runner_close(R4);
	}
	else
		tap_skip_ext("the server's worker does not write idem2 values yet");

	idem_runner_close(R);
	fclose(trace);
	proxy_stop(&PP);
	proxy_stop(&VP);
	PQfinish(admin);
	if (rvc)
		redisFree(rvc);
	return tap_done();
}

int
main(int argc, char **argv)
{
	/* SIGPIPE keeps its default action: the library must not die of it */
	itest_env_load();
	if (argc >= 2 && strcmp(argv[1], "setup") == 0)
		return cmd_setup();
	if (argc >= 2 && strcmp(argv[1], "diff") == 0)
		return cmd_diff();
	if (argc >= 2 && strcmp(argv[1], "scenario") == 0)
		return cmd_scenario();
	if (argc >= 2 && strcmp(argv[1], "contention") == 0)
		return contention_main(argc - 1, argv + 1);
	if (argc >= 2 && strcmp(argv[1], "trust") == 0)
		return trust_main(argc - 1, argv + 1);
	if (argc >= 2 && strcmp(argv[1], "router") == 0)
		return router_main(argc - 1, argv + 1);
	if (argc >= 2 && strcmp(argv[1], "honesty") == 0)
		return honesty_main(argc - 1, argv + 1);
	if (argc >= 2 && strcmp(argv[1], "health") == 0)
		return health_main(argc - 1, argv + 1);
	if (argc >= 2 && strcmp(argv[1], "consume") == 0)
		return consume_main(argc - 1, argv + 1);
	fprintf(stderr, "usage: itest setup|diff|scenario|contention|trust|router|honesty|health|consume ...\n");
	return 2;
}
