/*
 * client_bench.c: the client runner's paths against what they are built
 * on, at the same concurrency, in the same process model (one process per
 * client, one runner or one connection each, synchronous calls).
 *
 *   client_bench MODE CLIENTS SECONDS PG_CONNINFO VALKEY_HOST VALKEY_PORT
 *
 * MODE:
 *   valkey-replay  idem_run on completed keys, answered by the Valkey cache
 *                  (every value's MAC verified)
 *   valkey-replay-redelivery  the same, flagged as redeliveries
 *                  (delivery_count 2: the same gate; until the commit
 *                  after 1245f05, a plain GET before it)
 *   raw-get        hiredis GET of the same cache keys
 *   fill-cache     (setup, CLIENTS ignored) write the idem2 copies of the
 *                  replay keys that the server's worker writes, where absent
 *   pg-replay      idem_run on completed keys with Valkey down (PostgreSQL answers)
 *   pg-select      a bare prepared SELECT of the same ledger rows by unique key
 *   run-new        idem_run on new keys: gate, claim, effect, complete, commit
 *   run-dup        idem_run on keys run a moment before (duplicates)
 *   run-new-first  run-new flagged as first deliveries (delivery_count 1:
 *                  no Valkey gate)
 *   run-new-sql    run-new with the effect as a SQL handler (idem_apply:
 *                  one statement), through the gate
 *   run-new-sql-first  both: one PostgreSQL round trip, no Valkey
 *   run-dup-sql    run-dup with the SQL handler
 *   run-dup-sql-first  run-dup-sql with both deliveries flagged first
 *                  (delivery_count 1), as a producer's duplicate publish
 *                  comes: no gate, idem_apply answers the second
 *   run-new-pipe   run-new with the handler's INSERT as its first statement
 *                  (idem_run_options.first_sql), sent with the claim
 *   run-new-pipe-first  both that and delivery_count 1
 *   run-dup-pipe   run-dup with first_sql
 *   hand-new       the hand-written ledger of make bench's variant (3),
 *                  v3_hand(), as a prepared call: one round trip per key
 *   hand-dup       hand-new, every key twice in a row
 *   run-late       idem_run where every other run redelivers a key whose
 *                  run was acknowledged at least BENCH_REDELIVERY_MS
 *                  (default 500) before, flagged delivery_count 2: a
 *                  queue's redelivery (the first run's ack lost, then a
 *                  visibility timeout, XAUTOCLAIM's min-idle-time), which
 *                  finds the worker's copy in Valkey once the commit is
 *                  durable; new keys as run-new
 *   run-late-first run-late with new keys flagged delivery_count 1
 *   run-late-sql-first  run-late-first with the effect as a SQL handler
 *   hand-late      hand-new with run-late's redeliveries
 *   c-ledger-new   (3)'s ledger as a C client writes it around a C handler,
 *                  with the pipelining the runner's first_sql has: BEGIN,
 *                  the key's INSERT .. ON CONFLICT DO NOTHING and the
 *                  effect in one round trip, then the UPDATE to completed
 *                  and COMMIT (or, the key being there, ROLLBACK and the
 *                  stored row's SELECT) in a second: what a C handler's
 *                  two round trips cost without idem, the reference of
 *                  run-new-pipe-first
 *   c-ledger-dup   c-ledger-new, every key twice in a row
 *
 * Built with -DBENCH_BASELINE (against an older libidemclient.a, for a
 * before/after run), only the modes that older library has.
 *
 * The replay keys are those bench/setup.sql completes:
 * idem_key('bench.replay', i) for tenant 1 + i % 100, i in 1..10000,
 * request {"amount": 1}.  Prints "cpu MODE CLIENTS us": the clients' own
 * CPU time (user + system, their setup included) per operation, less
 * sensitive to other load on the machine than the rate; for a -late mode
 * "late MODE CLIENTS runs redeliveries answered_by_valkey"; for a replay
 * mode "valkey MODE CLIENTS replays answered_by_valkey"; then, last,
 * "MODE CLIENTS ops_per_second".
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <hiredis/hiredis.h>
#include <libpq-fe.h>

#include "internal.h"

#define REPLAY_KEYS 10000

/*
 * The late-redelivery modes' queue: keys run and acknowledged, oldest
 * first, with the time of the ack.  Every other run takes the oldest if it
 * is at least lag seconds old, and otherwise runs a new key.
 */
#define LATE_RING 65536

typedef struct late_queue
{
	int			on;				/* a -late mode */
	double		lag;
	long		next;			/* the next new key */
	long		head,
				tail;
	long		k[LATE_RING];
	double		t[LATE_RING];
	long		redeliveries;
	long		from_valkey;	/* redeliveries the Valkey cache answered */
} late_queue;

static double
now_wall_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_REALTIME, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static double
now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static idem_handler_status
transfer_handler(PGconn *conn, idem_call *call, void *user_data)
{
	char		tenant[32];
	const char *params[1] = {tenant};
	PGresult   *res;
	idem_handler_status st = IDEM_HANDLER_OK;

	(void) user_data;
	snprintf(tenant, sizeof(tenant), "%" PRId64, idem_call_tenant_id(call));
	res = PQexecParams(conn,
					   "INSERT INTO transfers (tenant_id, amount) VALUES ($1, 1)",
					   1, NULL, params, NULL, NULL, 0);
	if (PQresultStatus(res) != PGRES_COMMAND_OK)
		st = IDEM_HANDLER_RETRYABLE;
	PQclear(res);
	idem_call_set_json(call, "{\"ok\": true}");
	return st;
}

#ifndef BENCH_BASELINE
/* transfer_handler's INSERT, sent by the runner with the claim (first_sql) */
static idem_handler_status
transfer_first_handler(PGconn *conn, idem_call *call, void *user_data)
{
	const PGresult *res = idem_call_first_result(call);

	(void) conn;
	(void) user_data;
	idem_call_set_json(call, "{\"ok\": true}");
	return PQresultStatus(res) == PGRES_COMMAND_OK ?
		IDEM_HANDLER_OK : IDEM_HANDLER_RETRYABLE;
}
#endif

/*
 * The server's keyspace (what the runner learns), once its worker has taken
 * the history epoch over (55000 until then): up to 10 s.
 */
static int
keyspace_of(const char *conninfo, char ks[IDEM_CACHE_KEYSPACE_MAX + 1])
{
	PGconn	   *conn = PQconnectdb(conninfo);
	int			ok = 0;
	int			tries;

	for (tries = 0; tries < 100 && !ok; tries++)
	{
		PGresult   *res = PQexec(conn, "SELECT idem_cache_keyspace()");
		const char *state = PQresultErrorField(res, PG_DIAG_SQLSTATE);
		int			not_ready = state != NULL && strcmp(state, "55000") == 0;

		ok = PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) == 1;
		if (ok)
			snprintf(ks, IDEM_CACHE_KEYSPACE_MAX + 1, "%s", PQgetvalue(res, 0, 0));
		PQclear(res);
		if (ok || !not_ready)
			break;
		usleep(100000);
	}
	PQfinish(conn);
	return ok ? 0 : -1;
}

/*
 * Write the worker's idem2 copy of every replay key that Valkey lacks (the
 * server's worker writes them too once it copies idem2; SET NX keeps its
 * copies).  Returns the number written, or -1.
 */
static long
fill_cache(const char *conninfo, const char *vhost, int vport)
{
	struct timeval tv = {1, 0};
	redisContext *c = redisConnectWithTimeout(vhost, vport, tv);
	PGconn	   *conn = PQconnectdb(conninfo);
	PGresult   *res;
	char		ks[IDEM_CACHE_KEYSPACE_MAX + 1];
	idem_hmac	h;
	int32_t		key_id;
	uint8_t		sec[32];
	long		written = 0;
	int			i;

	if (c == NULL || c->err || PQstatus(conn) != CONNECTION_OK ||
		keyspace_of(conninfo, ks) != 0)
		return -1;
	res = PQexec(conn, "SELECT key_id, encode(secret, 'hex') FROM idem_cache_secrets() WHERE is_current");
	if (PQresultStatus(res) != PGRES_TUPLES_OK || PQntuples(res) != 1 ||
		idem_cache_unhex(sec, PQgetvalue(res, 0, 1), 32) != 0)
		return -1;
	key_id = atoi(PQgetvalue(res, 0, 0));
	idem_hmac_key(&h, sec, sizeof(sec));
	PQclear(res);
	res = PQexec(conn, "SELECT tenant_id, encode(idempotency_key, 'hex'), attempt,"
				 " encode(request_fingerprint, 'hex'), outcome::text,"
				 " floor(extract(epoch FROM expires_at) * 1000)::bigint"
				 " FROM idempotency_keys WHERE status = 'completed'"
				 " AND idempotency_key IN (SELECT idem_key('bench.replay', g::text)"
				 " FROM generate_series(1, 10000) g)");
	if (PQresultStatus(res) != PGRES_TUPLES_OK)
		return -1;
	for (i = 0; i < PQntuples(res); i++)
	{
		uint8_t		k[32],
					fp[32],
					mac[32];
		char		key[IDEM_CACHE_KEY_MAX];
		char		val[IDEM_CACHE_VALUE_MAX];
		char		input[IDEM_CACHE_MAC_INPUT_MAX];
		const char *out = PQgetvalue(res, i, 4);
		long long	exp = atoll(PQgetvalue(res, i, 5));
		int			n,
					in;
		redisReply *r;

		idem_cache_unhex(k, PQgetvalue(res, i, 1), 32);
		idem_cache_unhex(fp, PQgetvalue(res, i, 3), 32);
		idem_cache_key(key, sizeof(key), ks, 0, atoll(PQgetvalue(res, i, 0)), k);
		n = idem_cache_encode_terminal(val, sizeof(val), key_id, IDEM_CACHE_COMPLETED,
									   atoi(PQgetvalue(res, i, 2)), exp, fp,
									   out, strlen(out));
		in = n < 0 ? -1 : idem_cache_mac_input(input, sizeof(input), key, strlen(key),
											   val, (size_t) n);
		if (in < 0)
			return -1;
		idem_hmac_sha256(&h, input, (size_t) in, mac);
		idem_cache_set_mac(val, mac);
		r = redisCommand(c, "SET %s %b NX PX %lld", key, val, (size_t) n,
						 (long long) (exp - (long long) (now_wall_s() * 1000)));
		if (r && r->type == REDIS_REPLY_STATUS)
			written++;
		freeReplyObject(r);
	}
	PQclear(res);
	PQfinish(conn);
	redisFree(c);
	return written;
}

static void
late_init(late_queue *q, const char *mode)
{
	const char *ms = getenv("BENCH_REDELIVERY_MS");

	memset(q, 0, sizeof(*q));
	q->on = strstr(mode, "-late") != NULL;
	q->lag = (ms ? atof(ms) : 500.0) / 1000.0;
}

/*
 * The key of run n (n counts this client's runs): in a -dup mode every key
 * twice in a row, in a -late mode a redelivery of an old enough key every
 * other run, otherwise a new key.
 */
static long
late_next(late_queue *q, const char *mode, long n, int *redelivery)
{
	*redelivery = 0;
	if (strstr(mode, "-dup"))
	{
		*redelivery = n % 2;
		return n / 2;
	}
	if (q->on && n % 2 == 1 && q->head != q->tail &&
		now_s() - q->t[q->head % LATE_RING] >= q->lag)
	{
		*redelivery = 1;
		q->redeliveries++;
		return q->k[q->head++ % LATE_RING];
	}
	return q->next++;
}

/* Run k was acknowledged: queue it for its redelivery. */
static void
late_done(late_queue *q, long k, int redelivery)
{
	if (!q->on || redelivery || q->tail - q->head >= LATE_RING)
		return;
	q->k[q->tail % LATE_RING] = k;
	q->t[q->tail % LATE_RING] = now_s();
	q->tail++;
}

/*
 * Run ids of the modes that call (3)'s ledger (hand-*, c-ledger-*): a
 * random base per process (bigint; never repeated), run k as base + k.
 */
static long long
run_id_base(unsigned *seed)
{
	return (((long long) rand_r(seed) << 31) ^ rand_r(seed) ^
			((long long) now_wall_s() << 20)) & 0x3fffffffffffffffLL;
}

/* A handler that must not run: replays only. */
static idem_handler_status
never_handler(PGconn *conn, idem_call *call, void *user_data)
{
	(void) conn;
	(void) call;
	(*(long *) user_data)++;
	return IDEM_HANDLER_PERMANENT;
}

/* A prepared statement of c-ledger with its parameters (binary: the keys). */
typedef struct c_stmt
{
	const char *name;
	int			nparams;
	const char *values[3];
	int			lengths[3];
	int			formats[3];
} c_stmt;

/*
 * One pipelined round trip of c-ledger: the statements, then a sync.
 * Returns how many rows statement rows_of returned and puts the first value
 * of statement value_of into value (when value_of >= 0); -1 on any error.
 */
static int
c_ledger_round(PGconn *conn, const c_stmt *stmt, int nstmt, int rows_of,
			   int value_of, char *value, size_t valuelen)
{
	int			rows = 0;
	int			failed = 0;
	int			i;

	for (i = 0; i < nstmt; i++)
		if (PQsendQueryPrepared(conn, stmt[i].name, stmt[i].nparams,
								stmt[i].values, stmt[i].lengths,
								stmt[i].formats, 0) != 1)
			return -1;
	if (PQpipelineSync(conn) != 1)
		return -1;
	for (i = 0; i < nstmt; i++)
	{
		PGresult   *res = PQgetResult(conn);
		ExecStatusType st = PQresultStatus(res);

		if (res == NULL || (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK))
			failed = 1;
		if (st == PGRES_TUPLES_OK && i == rows_of)
			rows = PQntuples(res);
		if (st == PGRES_TUPLES_OK && i == value_of && PQntuples(res) > 0)
			snprintf(value, valuelen, "%s", PQgetvalue(res, 0, 0));
		PQclear(res);
		if (res != NULL)
			PQclear(PQgetResult(conn)); /* the NULL that ends each result */
	}
	for (;;)
	{
		PGresult   *res = PQgetResult(conn);
		ExecStatusType st = PQresultStatus(res);

		PQclear(res);
		if (st == PGRES_PIPELINE_SYNC)
			break;
		if (res == NULL && PQstatus(conn) != CONNECTION_OK)
			return -1;
	}
	return failed ? -1 : rows;
}

/* The c-ledger modes (see the header): the runs of one client. */
static long
c_ledger_client(const char *mode, double end, const char *conninfo,
				unsigned *seed, late_queue *late)
{
	static const char *const prep[][2] = {
		{"b", "BEGIN"},
		{"c", "COMMIT"},
		{"r", "ROLLBACK"},
		{"k", "INSERT INTO hand_keys (tenant_id, idempotency_key,"
		 " request_fingerprint, expires_at)"
		 " VALUES ($1, $2, $3, now() + interval '30 seconds')"
		 " ON CONFLICT (tenant_id, idempotency_key) DO NOTHING RETURNING 1"},
		{"e", "INSERT INTO transfers (tenant_id, amount) VALUES ($1, 1) RETURNING id"},
		{"u", "UPDATE hand_keys SET status = 'completed',"
		 " outcome = jsonb_build_object('transfer_id', $3::bigint),"
		 " expires_at = now() + interval '1 day', updated_at = clock_timestamp()"
		 " WHERE tenant_id = $1 AND idempotency_key = $2"},
		{"s", "SELECT status, outcome FROM hand_keys"
		 " WHERE tenant_id = $1 AND idempotency_key = $2"}
	};
	PGconn	   *conn = PQconnectdb(conninfo);
	uint8_t		fp[IDEM_DIGEST_BYTES];
	long		ops = 0;
	long long	base = run_id_base(seed);
	size_t		i;

	if (PQstatus(conn) != CONNECTION_OK ||
		idem_fingerprint("{\"amount\": 1}", 13, fp, NULL, 0) != 0)
	{
		PQfinish(conn);
		return -1;
	}
	for (i = 0; i < sizeof(prep) / sizeof(prep[0]); i++)
	{
		PGresult   *res = PQprepare(conn, prep[i][0], prep[i][1], 0, NULL);
		int			ok = PQresultStatus(res) == PGRES_COMMAND_OK;

		PQclear(res);
		if (!ok)
		{
			fprintf(stderr, "%s: %s", mode, PQerrorMessage(conn));
			PQfinish(conn);
			return -1;
		}
	}
	if (PQenterPipelineMode(conn) != 1)
	{
		PQfinish(conn);
		return -1;
	}
	while (now_s() < end)
	{
		int			redelivery;
		long		k = late_next(late, mode, ops, &redelivery);
		char		run[32];
		char		tenant[16];
		char		tid[32] = "";
		uint8_t		key[IDEM_DIGEST_BYTES];
		const char *kv = (const char *) key;
		int			claimed;
		int			rc = -1;

		snprintf(run, sizeof(run), "%lld", base + k);
		snprintf(tenant, sizeof(tenant), "%ld", 1 + k % 100);
		idem_key("bench.transfer", run, key);
		{
			c_stmt		s[] = {
				{"b"},
				{"k", 3, {tenant, kv, (const char *) fp},
				{0, IDEM_DIGEST_BYTES, IDEM_DIGEST_BYTES}, {0, 1, 1}},
				{"e", 1, {tenant}},
			};

			claimed = c_ledger_round(conn, s, 3, 1, 2, tid, sizeof(tid));
		}
		if (claimed > 0)
		{
			c_stmt		s[] = {
				{"u", 3, {tenant, kv, tid}, {0, IDEM_DIGEST_BYTES, 0}, {0, 1, 0}},
				{"c"},
			};

			rc = c_ledger_round(conn, s, 2, -1, -1, NULL, 0);
		}
		else if (claimed == 0)
		{
			c_stmt		s[] = {
				{"r"},
				{"s", 2, {tenant, kv}, {0, IDEM_DIGEST_BYTES}, {0, 1}},
			};

			rc = c_ledger_round(conn, s, 2, 1, -1, NULL, 0) == 1 ? 0 : -1;
		}
		if (rc < 0)
		{
			fprintf(stderr, "%s: failed: %s", mode, PQerrorMessage(conn));
			PQfinish(conn);
			return -1;
		}
		ops++;
	}
	PQfinish(conn);
	return ops;
}

/* A client's late-redelivery counts, for the parent's report. */
typedef struct late_counts
{
	long		redeliveries;
	long		from_valkey;
} late_counts;

static long
run_client(const char *mode, int client, double seconds, const char *conninfo,
		   const char *vhost, int vport, late_counts *late_out)
{
	double		end = now_s() + seconds;
	long		ops = 0;
	long		handler_runs = 0;
	unsigned	seed = (unsigned) (getpid() * 2654435761u);
	char		id[64];
	static late_queue late;

	late_init(&late, mode);
	memset(late_out, 0, sizeof(*late_out));

	if (strcmp(mode, "raw-get") == 0)
	{
		struct timeval tv = {1, 0};
		redisContext *c = redisConnectWithTimeout(vhost, vport, tv);
		char		key[IDEM_CACHE_KEY_MAX];
		uint8_t		k[IDEM_DIGEST_BYTES];
		char		ks[IDEM_CACHE_KEYSPACE_MAX + 1];

		if (c == NULL || c->err || keyspace_of(conninfo, ks) != 0)
			return -1;
		while (now_s() < end)
		{
			int			i = 1 + rand_r(&seed) % REPLAY_KEYS;
			redisReply *r;

			snprintf(id, sizeof(id), "%d", i);
			idem_key("bench.replay", id, k);
			idem_cache_key(key, sizeof(key), ks, 0, 1 + i % 100, k);
			r = redisCommand(c, "GET %s", key);
			if (r == NULL || r->type != REDIS_REPLY_STRING)
			{
				freeReplyObject(r);
				redisFree(c);
				return -1;
			}
			freeReplyObject(r);
			ops++;
		}
		redisFree(c);
		return ops;
	}

	if (strncmp(mode, "hand-", 5) == 0)
	{
		PGconn	   *conn = PQconnectdb(conninfo);
		PGresult   *res;
		long		n = 0;
		long long	base = run_id_base(&seed);

		if (PQstatus(conn) != CONNECTION_OK)
			return -1;
		res = PQprepare(conn, "h", "SELECT v3_hand($1, $2, 1)", 2, NULL);
		PQclear(res);
		while (now_s() < end)
		{
			char		tenant[16];
			char		run[32];
			const char *values[2] = {tenant, run};
			int			redelivery;
			long		k = late_next(&late, mode, n, &redelivery);

			snprintf(run, sizeof(run), "%lld", base + k);
			snprintf(tenant, sizeof(tenant), "%ld", 1 + k % 100);
			res = PQexecPrepared(conn, "h", 2, values, NULL, NULL, 0);
			if (PQresultStatus(res) != PGRES_TUPLES_OK)
			{
				fprintf(stderr, "%s: %s", mode, PQerrorMessage(conn));
				PQclear(res);
				PQfinish(conn);
				return -1;
			}
			PQclear(res);
			late_done(&late, k, redelivery);
			n++;
			ops++;
		}
		PQfinish(conn);
		late_out->redeliveries = late.redeliveries;
		late_out->from_valkey = late.from_valkey;
		return ops;
	}

	if (strncmp(mode, "c-ledger-", 9) == 0)
		return c_ledger_client(mode, end, conninfo, &seed, &late);

	if (strcmp(mode, "pg-select") == 0)
	{
		PGconn	   *conn = PQconnectdb(conninfo);
		PGresult   *res;

		if (PQstatus(conn) != CONNECTION_OK)
			return -1;
		res = PQprepare(conn, "s",
						"SELECT status, outcome FROM idempotency_keys"
						" WHERE tenant_id = $1 AND idempotency_key = $2", 2, NULL);
		PQclear(res);
		while (now_s() < end)
		{
			int			i = 1 + rand_r(&seed) % REPLAY_KEYS;
			uint8_t		k[IDEM_DIGEST_BYTES];
			char		tenant[16];
			const char *values[2] = {tenant, (const char *) k};
			int			lengths[2] = {0, IDEM_DIGEST_BYTES};
			int			formats[2] = {0, 1};

			snprintf(id, sizeof(id), "%d", i);
			snprintf(tenant, sizeof(tenant), "%d", 1 + i % 100);
			idem_key("bench.replay", id, k);
			res = PQexecPrepared(conn, "s", 2, values, lengths, formats, 0);
			if (PQresultStatus(res) != PGRES_TUPLES_OK || PQntuples(res) != 1)
			{
				PQclear(res);
				PQfinish(conn);
				return -1;
			}
			PQclear(res);
			ops++;
		}
		PQfinish(conn);
		return ops;
	}

	{
		int			replay = strncmp(mode, "valkey-replay", 13) == 0 ||
			strcmp(mode, "pg-replay") == 0;
		/* pg-replay: Valkey configured but down (nothing listens on port 1) */
		idem_runner *r = idem_runner_open(conninfo, vhost,
										  strcmp(mode, "pg-replay") == 0 ? 1 : vport,
										  NULL);
		idem_result *res = malloc(sizeof(idem_result));
		long		n = 0;

		if (r == NULL || res == NULL)
			return -1;
		idem_result_init(res);
		while (now_s() < end)
		{
			int64_t		tenant;
			idem_status st;

			if (replay)
			{
				int			i = 1 + rand_r(&seed) % REPLAY_KEYS;

				snprintf(id, sizeof(id), "%d", i);
				tenant = 1 + i % 100;
#ifndef BENCH_BASELINE
				if (strcmp(mode, "valkey-replay-redelivery") == 0)
				{
					idem_run_options ro;

					idem_run_options_init(&ro);
					ro.delivery_count = 2;
					st = idem_run_with(r, tenant, "bench.replay", id, "{\"amount\": 1}",
									   &ro, never_handler, &handler_runs, res);
				}
				else
#endif
					st = idem_run(r, tenant, "bench.replay", id, "{\"amount\": 1}",
								  never_handler, &handler_runs, res);
				if (st != IDEM_REPLAYED || handler_runs > 0)
				{
					fprintf(stderr, "%s: unexpected %s: %s\n", mode,
							idem_status_name(st), res->error_message);
					break;
				}
				/* counted as the -late modes count (the "valkey" line) */
				late.redeliveries++;
				if (res->source == IDEM_SOURCE_VALKEY)
					late.from_valkey++;
			}
			else
			{
				int			redelivery;
				long		k = late_next(&late, mode, n, &redelivery);

				snprintf(id, sizeof(id), "%d-%d-%ld", (int) getpid(), client, k);
				tenant = 1 + k % 100;
#ifndef BENCH_BASELINE
				if (strcmp(mode, "run-new") != 0 && strcmp(mode, "run-dup") != 0)
				{
					idem_run_options ro;
					char		args[64];
					char		ten[32];
					const char *fp[1] = {ten};

					idem_run_options_init(&ro);
					ro.delivery_count = strstr(mode, "-first") ? 1 : 0;
					if (strstr(mode, "-late") && redelivery)
						ro.delivery_count = 2;
					if (strstr(mode, "-sql"))
					{
						snprintf(args, sizeof(args), "{\"t\": %" PRId64 ", \"amount\": 1}", tenant);
						ro.sql_handler = "bench_transfer(jsonb)";
						ro.sql_args = args;
					}
					if (strstr(mode, "-pipe"))
					{
						snprintf(ten, sizeof(ten), "%" PRId64, tenant);
						ro.first_sql = "INSERT INTO transfers (tenant_id, amount) VALUES ($1, 1)";
						ro.first_nparams = 1;
						ro.first_params = fp;
					}
					st = idem_run_with(r, tenant, "bench.run", id, "{\"amount\": 1}",
									   &ro, strstr(mode, "-pipe") ?
									   transfer_first_handler : transfer_handler,
									   NULL, res);
				}
				else
#endif
					st = idem_run(r, tenant, "bench.run", id, "{\"amount\": 1}",
								  transfer_handler, NULL, res);
				if (st != IDEM_APPLIED && st != IDEM_REPLAYED)
				{
					fprintf(stderr, "%s: unexpected %s: %s\n", mode,
							idem_status_name(st), res->error_message);
					break;
				}
				late_done(&late, k, redelivery);
				if (redelivery && res->source == IDEM_SOURCE_VALKEY)
					late.from_valkey++;
			}
			n++;
			ops++;
		}
		free(res);
		idem_runner_close(r);
		late_out->redeliveries = late.redeliveries;
		late_out->from_valkey = late.from_valkey;
		return ops;
	}
}

int
main(int argc, char **argv)
{
	const char *mode;
	int			clients;
	double		seconds;
	int			fds[2];
	long		total = 0;
	long		cpu_us = 0;		/* the clients' CPU (user + system) */
	long		redeliveries = 0;
	long		from_valkey = 0;
	int			failed = 0;
	int			c;

	if (argc != 7)
	{
		fprintf(stderr, "usage: %s MODE CLIENTS SECONDS PG_CONNINFO VALKEY_HOST VALKEY_PORT\n",
				argv[0]);
		return 2;
	}
	mode = argv[1];
	clients = atoi(argv[2]);
	seconds = atof(argv[3]);
	if (strcmp(mode, "fill-cache") == 0)
	{
		long		n = fill_cache(argv[4], argv[5], atoi(argv[6]));

		printf("fill-cache %ld\n", n);
		return n < 0;
	}
	if (pipe(fds) != 0)
		return 1;
	for (c = 0; c < clients; c++)
	{
		pid_t		pid = fork();

		if (pid == 0)
		{
			long		res[4];
			struct rusage ru;
			late_counts lc;

			res[0] = run_client(mode, c, seconds, argv[4], argv[5], atoi(argv[6]),
								&lc);
			res[2] = lc.redeliveries;
			res[3] = lc.from_valkey;
			getrusage(RUSAGE_SELF, &ru);
			res[1] = (ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1000000L +
				ru.ru_utime.tv_usec + ru.ru_stime.tv_usec;
			if (write(fds[1], res, sizeof(res)) != sizeof(res))
				_exit(1);
			_exit(res[0] < 0);
		}
	}
	close(fds[1]);
	for (c = 0; c < clients; c++)
	{
		long		res[4];

		if (read(fds[0], res, sizeof(res)) != sizeof(res) || res[0] < 0)
			failed = 1;
		else
		{
			total += res[0];
			cpu_us += res[1];
			redeliveries += res[2];
			from_valkey += res[3];
		}
	}
	while (wait(NULL) > 0)
		;
	if (failed)
	{
		fprintf(stderr, "%s: a client failed\n", mode);
		return 1;
	}
	if (strstr(mode, "-late"))
		printf("late %s %d %ld %ld %ld\n", mode, clients, total, redeliveries,
			   from_valkey);
	if (strncmp(mode, "valkey-replay", 13) == 0 || strcmp(mode, "pg-replay") == 0)
		printf("valkey %s %d %ld %ld\n", mode, clients, redeliveries, from_valkey);
	/* the ops/s last: callers take the output's last field */
	printf("cpu %s %d %.2f\n", mode, clients,
		   total > 0 ? (double) cpu_us / total : 0.0);
	printf("%s %d %.0f\n", mode, clients, total / seconds);
	return 0;
}
