/*
 * batch.c
 *	  A batch of new messages in one transaction, with idem's batch API.
 *
 *	  A worker reads new messages with XREADGROUP COUNT n (--batch n) and
 *	  runs the transfers and invoices among them here, in two PostgreSQL
 *	  round trips for the whole batch:
 *
 *	    1. BEGIN; idem_claim_many(tenants, keys, fingerprints, lease)
 *	    2. idem_demo.lock_accounts(...) -- every account the claimed
 *	       effects touch, in one global order, so batches never deadlock;
 *	       one statement that runs each claimed message's effect
 *	       (transfer / pay_invoice) and settles the keys: idem_complete_many
 *	       for the applied ones (after idem_emit of each one's
 *	       notification, with stage two), idem_fail for the refused (frozen,
 *	       permanent); idem_fail_many for the flaky (retryable) ones; COMMIT
 *
 *	  Every statement but BEGIN and COMMIT is a named prepared statement,
 *	  prepared in the pipeline that first uses it on a connection.
 *
 *	  and one XACK for every message with a final decision.  The ledger
 *	  is the guard exactly as in a single run: a key another transaction
 *	  holds answers busy (left pending, redelivered after the lease), a
 *	  committed one replays; the effects and their keys commit together or
 *	  not at all.  Before round trip 1, each message is looked up in the
 *	  Valkey cache (idem_cached: one GET, no marker): a duplicate whose
 *	  result is cached is replayed from there and stays out of the
 *	  transaction; the gate's marker is not used, one transaction is
 *	  shared by the whole batch anyway.  Redeliveries (XAUTOCLAIM) and
 *	  purges still go through the runner (worker.c), so both paths meet
 *	  on the same keys under chaos.
 *
 *	  Any error inside the transaction rolls the whole batch back; its
 *	  claimed messages stay pending and are redelivered, one by one.
 */
#include "demo.h"
#include "idem_client.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define ADD(field, n) __atomic_add_fetch(&c->field, (n), __ATOMIC_RELAXED)

/* What happens to one message of the batch. */
typedef enum item_fate
{
	FATE_NONE = 0,				/* not decided yet / error: stays pending */
	FATE_EFFECT,				/* claimed: its effect runs */
	FATE_FAIL_RETRYABLE,		/* claimed, flaky first attempt */
	FATE_FAIL_PERMANENT,		/* claimed, the effect refused (frozen) */
	FATE_APPLIED,				/* claimed, the effect ran */
	FATE_REPLAY,				/* completed earlier */
	FATE_REPLAY_VALKEY,			/* completed earlier, found in Valkey */
	FATE_REPLAY_TWIN,			/* its twin in this batch completed now */
	FATE_REPLAY_FAILED,			/* failed_permanent earlier */
	FATE_MISMATCH,
	FATE_BUSY
} item_fate;

typedef struct item
{
	const queue_msg *m;
	uint8_t		key[IDEM_DIGEST_BYTES];
	uint8_t		fp[IDEM_DIGEST_BYTES];
	char		key_hex[2 * IDEM_DIGEST_BYTES + 1];
	int			ok;				/* key and fingerprint computed */
	int			attempt;
	item_fate	fate;
	int			effect_cmd;		/* its command in round trip 2 */
	char		outcome[160];
} item;

struct batch_ctx
{
	const demo_config *cfg;
	int			slot;
	PGconn	   *conn;
	unsigned	prepared;		/* bit per BSTMT_* prepared on conn */
	char		claim_sql[256];
	char		apply_sql[2560];
	char		fail_sql[256];
};

/*
 * The batch's statements are named prepared statements, prepared inside
 * the pipeline that first uses each on a connection (no extra round trip):
 * the server parses and plans them once per connection.
 */
enum
{
	BSTMT_CLAIM, BSTMT_LOCK, BSTMT_APPLY, BSTMT_FAIL, BSTMT_COUNT
};
static const char *const bstmt_names[BSTMT_COUNT] = {
	"idem_demo_claim_many", "idem_demo_lock", "idem_demo_apply", "idem_demo_fail_many"
};

typedef struct bcmd
{
	const char *sql;
	int			nparams;
	const char *values[10];
	int			stmt;			/* BSTMT_*, or -1: ad hoc (BEGIN, COMMIT) */
} bcmd;

#define LOCK_SQL "SELECT idem_demo.lock_accounts($1::bigint[], $2::int[], $3::int[], $4::text[])"

static void
quiet(void *arg, const char *message)
{
	(void) arg;
	(void) message;
}

batch_ctx *
batch_new(const demo_config *cfg, int slot)
{
	batch_ctx  *b = calloc(1, sizeof(batch_ctx));
	char		emit_cte[640];

	if (b == NULL)
		return NULL;
	b->cfg = cfg;
	b->slot = slot;
	snprintf(b->claim_sql, sizeof(b->claim_sql),
			 "SELECT ord, decision, attempt FROM %s.idem_claim_many("
			 "$1::bigint[], $2::bytea[], $3::bytea[], $4::interval)", cfg->schema);
	/*
	 * The claimed messages' effects, in order, then their keys settled:
	 * completed with the transfer id, or failed for good (frozen account).
	 * The unused outputs of done and refused stay: their functions are
	 * volatile, so PostgreSQL runs them.
	 */
	/*
	 * With stage two, each applied transfer also emits its notification
	 * (idem_emit naming its key, which the batch holds): em runs before
	 * done, whose rows wait for em's count, since a key can emit only
	 * until it is completed.
	 */
	if (cfg->notices > 0)
		snprintf(emit_cte, sizeof(emit_cte),
				 " em AS MATERIALIZED (SELECT %s.idem_emit('%s', jsonb_build_object("
				 "   'task_key', CASE WHEN inv IS NULL THEN 'transfer:' || run ELSE 'invoice:' || inv END,"
				 "   'tenant', t, 'transfer_id', tid), k) FROM e WHERE tid IS NOT NULL),",
				 cfg->schema, cfg->notice_stream);
	else
		snprintf(emit_cte, sizeof(emit_cte),
				 " em AS (SELECT 1 WHERE false),");
	snprintf(b->apply_sql, sizeof(b->apply_sql),
			 "WITH e AS MATERIALIZED ("
			 " SELECT u.ord, u.t, u.k, u.run, u.inv,"
			 "  CASE WHEN u.inv IS NULL"
			 "   THEN idem_demo.transfer(u.t, 'transfer:' || u.run, u.run, u.f, u.o, u.amt, u.att, $9::int)"
			 "   ELSE idem_demo.pay_invoice(u.t, u.inv, u.run, u.att, $9::int) END AS tid"
			 " FROM unnest($1::bigint[], $2::bytea[], $3::text[], $4::int[], $5::int[],"
			 "   $6::bigint[], $7::int[], $8::text[])"
			 "   WITH ORDINALITY AS u(t, k, run, f, o, amt, att, inv, ord)"
			 " ORDER BY u.ord),"
			 "%s"
			 " done AS (SELECT %s.idem_complete_many(array_agg(t ORDER BY ord), array_agg(k ORDER BY ord),"
			 "   array_agg(jsonb_build_object('transfer_id', tid) ORDER BY ord))"
			 "  FROM e CROSS JOIN (SELECT count(*) FROM em) x WHERE tid IS NOT NULL HAVING count(*) > 0),"
			 " refused AS (SELECT %s.idem_fail(t, k, '{\"error\": \"account frozen\"}', false)"
			 "  FROM e WHERE tid IS NULL)"
			 " SELECT e.ord, e.tid FROM e"
			 "  CROSS JOIN (SELECT count(*) FROM done) d CROSS JOIN (SELECT count(*) FROM refused) r"
			 " ORDER BY e.ord",
			 emit_cte, cfg->schema, cfg->schema);
	/* the flaky first attempts of the batch, failed retryably at once */
	snprintf(b->fail_sql, sizeof(b->fail_sql),
			 "SELECT %s.idem_fail_many($1::bigint[], $2::bytea[], $3::jsonb[], $4::boolean[])",
			 cfg->schema);
	return b;
}

void
batch_free(batch_ctx *b)
{
	if (b == NULL)
		return;
	PQfinish(b->conn);
	free(b);
}

int
batch_wants(const queue_msg *m)
{
	return !m->redelivered &&
		(strcmp(m->kind, "transfer.create") == 0 ||
		 strcmp(m->kind, "invoice.pay") == 0);
}

/*
 * cmds as one pipeline with one Sync: one round trip.  res[i] gets each
 * command's result.  Returns 0 when every command succeeded, 1 when one
 * failed (the transaction is aborted; err says why), -1 when the
 * connection was lost (it is closed).
 */
#define PIPELINE_MAX 8

static int
pipeline(batch_ctx *b, const bcmd *cmds, int n, PGresult **res,
		 char *err, size_t errlen)
{
	PGconn	   *conn = b->conn;
	int			i,
				rc = 0;
	PGresult   *r;

	int			parse[PIPELINE_MAX];

	for (i = 0; i < n; i++)
		res[i] = NULL;
	if (n > PIPELINE_MAX)
	{
		snprintf(err, errlen, "too many commands in one pipeline");
		return 1;
	}
	if (PQenterPipelineMode(conn) != 1)
		goto lost;
	for (i = 0; i < n; i++)
	{
		int			st = cmds[i].stmt;

		parse[i] = st >= 0 && !(b->prepared & (1u << st));
		if (parse[i] &&
			PQsendPrepare(conn, bstmt_names[st], cmds[i].sql, cmds[i].nparams, NULL) != 1)
			goto lost;
		if (st >= 0 ?
			PQsendQueryPrepared(conn, bstmt_names[st], cmds[i].nparams,
								cmds[i].values, NULL, NULL, 0) != 1 :
			PQsendQueryParams(conn, cmds[i].sql, cmds[i].nparams, NULL,
							  cmds[i].values, NULL, NULL, 0) != 1)
			goto lost;
	}
	if (PQpipelineSync(conn) != 1)
		goto lost;
	for (i = 0; i < n; i++)
	{
		ExecStatusType st;

		if (parse[i])
		{
			/* the Parse's own result: prepared from now on, if it worked */
			r = PQgetResult(conn);
			if (r == NULL)
				goto lost;
			if (PQresultStatus(r) == PGRES_COMMAND_OK)
				b->prepared |= 1u << cmds[i].stmt;
			else if (rc == 0)
			{
				snprintf(err, errlen, "%s", PQresultErrorMessage(r));
				rc = 1;
			}
			PQclear(r);
			while ((r = PQgetResult(conn)) != NULL)
				PQclear(r);
		}
		r = PQgetResult(conn);
		if (r == NULL)
			goto lost;
		res[i] = r;
		st = PQresultStatus(r);
		if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK)
		{
			if (rc == 0)
				snprintf(err, errlen, "%s", PQresultErrorMessage(r));
			rc = 1;
		}
		while ((r = PQgetResult(conn)) != NULL)
			PQclear(r);
		if (PQstatus(conn) != CONNECTION_OK)
			goto lost;
	}
	r = PQgetResult(conn);
	if (r == NULL || PQresultStatus(r) != PGRES_PIPELINE_SYNC)
	{
		if (r)
			PQclear(r);
		goto lost;
	}
	PQclear(r);
	if (PQexitPipelineMode(conn) != 1)
		goto lost;
	return rc;

lost:
	for (i = 0; i < n; i++)
	{
		if (res[i])
			PQclear(res[i]);
		res[i] = NULL;
	}
	snprintf(err, errlen, "%s", PQerrorMessage(conn));
	PQfinish(b->conn);
	b->conn = NULL;
	return -1;
}

static void
clear_all(PGresult **res, int n)
{
	int			i;

	for (i = 0; i < n; i++)
		if (res[i])
			PQclear(res[i]);
}

static void
hex(const uint8_t *d, char *out)
{
	static const char digits[] = "0123456789abcdef";
	int			i;

	for (i = 0; i < IDEM_DIGEST_BYTES; i++)
	{
		out[2 * i] = digits[d[i] >> 4];
		out[2 * i + 1] = digits[d[i] & 15];
	}
	out[2 * IDEM_DIGEST_BYTES] = '\0';
}

/* A growing text buffer for array literals; aborts the batch when full. */
typedef struct sbuf
{
	char	   *s;
	size_t		len;
	size_t		cap;
	int			failed;
} sbuf;

static void
sb_add(sbuf *sb, const char *fmt,...) __attribute__((format(printf, 2, 3)));

static void
sb_add(sbuf *sb, const char *fmt,...)
{
	va_list		ap;
	int			n;

	if (sb->failed)
		return;
	for (;;)
	{
		va_start(ap, fmt);
		n = vsnprintf(sb->s ? sb->s + sb->len : NULL,
					  sb->s ? sb->cap - sb->len : 0, fmt, ap);
		va_end(ap);
		if (n < 0)
		{
			sb->failed = 1;
			return;
		}
		if (sb->s && sb->len + n < sb->cap)
		{
			sb->len += n;
			return;
		}
		sb->cap = (sb->cap ? sb->cap * 2 : 1024) + n;
		sb->s = realloc(sb->s, sb->cap);
		if (sb->s == NULL)
		{
			sb->failed = 1;
			return;
		}
	}
}

/* A text[] element: quoted, with " and \ escaped. */
static void
sb_add_quoted(sbuf *sb, const char *v)
{
	sb_add(sb, "\"");
	for (; *v; v++)
		sb_add(sb, "%s%c", (*v == '"' || *v == '\\') ? "\\" : "", *v);
	sb_add(sb, "\"");
}

static int
is_invoice(const queue_msg *m)
{
	return strcmp(m->kind, "invoice.pay") == 0;
}

static int
ensure_conn(batch_ctx *b, demo_counters *c)
{
	if (b->conn && PQstatus(b->conn) == CONNECTION_OK)
		return 0;
	PQfinish(b->conn);
	ADD(pg_connects, 1);
	b->prepared = 0;
	b->conn = PQconnectdb(b->cfg->pg);
	if (PQstatus(b->conn) != CONNECTION_OK)
	{
		PQfinish(b->conn);
		b->conn = NULL;
		return -1;
	}
	PQsetNoticeProcessor(b->conn, quiet, NULL);
	return 0;
}

static void
rollback(batch_ctx *b)
{
	PGresult   *r;

	if (b->conn == NULL)
		return;
	r = PQexec(b->conn, "ROLLBACK");
	PQclear(r);
	if (PQstatus(b->conn) != CONNECTION_OK)
	{
		PQfinish(b->conn);
		b->conn = NULL;
	}
}

/*
 * Round trip 2, one pipeline: lock the accounts of the claimed messages,
 * run their effects and settle their keys in one statement
 * (idem_complete_many for the applied ones, idem_fail for the refused),
 * idem_fail for the flaky ones, COMMIT.  The account locks are held for
 * this one round trip only.
 */
static int
apply_and_commit(batch_ctx *b, item *items, int n, long *rts, char *err,
				 size_t errlen, int *commit_unknown)
{
	sbuf		a[8] = {{0}};	/* tenants, keys, run ids, from, to, amount,
								 * attempt, invoice (NULL: a transfer) */
	bcmd		cmds[PIPELINE_MAX];
	PGresult   *res[PIPELINE_MAX];
	sbuf		fa[4] = {{0}};	/* the flaky ones: tenants, keys, details,
								 * retryable */
	int			nflaky = 0;
	int		   *effect_item = calloc(n, sizeof(int));
	char		worker[16],
				sleep_sql[96];
	int			ncmd = 0,
				neffects = 0,
				effects_cmd = -1,
				i,
				j,
				rc;

	*commit_unknown = 0;
	memset(cmds, 0, sizeof(cmds));
	memset(res, 0, sizeof(res));
	for (i = 0; i < PIPELINE_MAX; i++)
		cmds[i].stmt = -1;
	if (effect_item == NULL)
	{
		snprintf(err, errlen, "out of memory");
		return 1;
	}
	snprintf(worker, sizeof(worker), "%d", b->slot);
	for (j = 0; j < 8; j++)
		sb_add(&a[j], "{");
	for (i = 0; i < n; i++)
	{
		const queue_msg *m = items[i].m;
		const char *sep = neffects ? "," : "";

		if (items[i].fate != FATE_EFFECT)
			continue;
		effect_item[neffects++] = i;
		sb_add(&a[0], "%s%lld", sep, (long long) m->tenant);
		sb_add(&a[1], "%s\"\\\\x%s\"", sep, items[i].key_hex);
		sb_add(&a[2], "%s", sep);
		sb_add_quoted(&a[2], m->run_id);
		sb_add(&a[3], "%s%d", sep, m->from);
		sb_add(&a[4], "%s%d", sep, m->to);
		sb_add(&a[5], "%s%lld", sep, (long long) m->amount);
		sb_add(&a[6], "%s%d", sep, items[i].attempt);
		sb_add(&a[7], "%s", sep);
		if (is_invoice(m))
			sb_add_quoted(&a[7], m->invoice);
		else
			sb_add(&a[7], "NULL");
	}
	for (j = 0; j < 8; j++)
		sb_add(&a[j], "}");
	if (neffects > 0)
	{
		cmds[ncmd].sql = LOCK_SQL;
		cmds[ncmd].stmt = BSTMT_LOCK;
		cmds[ncmd].nparams = 4;
		cmds[ncmd].values[0] = a[0].s;
		cmds[ncmd].values[1] = a[3].s;
		cmds[ncmd].values[2] = a[4].s;
		cmds[ncmd].values[3] = a[7].s;
		ncmd++;
		effects_cmd = ncmd;
		cmds[ncmd].sql = b->apply_sql;
		cmds[ncmd].stmt = BSTMT_APPLY;
		cmds[ncmd].nparams = 9;
		for (j = 0; j < 8; j++)
			cmds[ncmd].values[j] = a[j].s;
		cmds[ncmd].values[8] = worker;
		ncmd++;
	}
	for (j = 0; j < 4; j++)
		sb_add(&fa[j], "{");
	for (i = 0; i < n; i++)
	{
		const char *sep = nflaky ? "," : "";

		if (items[i].fate != FATE_FAIL_RETRYABLE)
			continue;
		nflaky++;
		sb_add(&fa[0], "%s%lld", sep, (long long) items[i].m->tenant);
		sb_add(&fa[1], "%s\"\\\\x%s\"", sep, items[i].key_hex);
		sb_add(&fa[2], "%s", sep);
		sb_add_quoted(&fa[2], items[i].outcome);
		sb_add(&fa[3], "%strue", sep);
	}
	for (j = 0; j < 4; j++)
		sb_add(&fa[j], "}");
	if (nflaky > 0)
	{
		cmds[ncmd].sql = b->fail_sql;
		cmds[ncmd].stmt = BSTMT_FAIL;
		cmds[ncmd].nparams = 4;
		for (j = 0; j < 4; j++)
			cmds[ncmd].values[j] = fa[j].s;
		ncmd++;
	}
	if (b->cfg->handler_sleep_ms > 0)
	{
		/* inside the transaction, so that kills land mid-batch */
		snprintf(sleep_sql, sizeof(sleep_sql), "SELECT pg_sleep(random() * %d / 1000.0)",
				 b->cfg->handler_sleep_ms);
		cmds[ncmd++].sql = sleep_sql;
	}
	cmds[ncmd++].sql = "COMMIT";
	rc = 0;
	for (j = 0; j < 8; j++)
		if (a[j].failed || (j < 4 && fa[j].failed))
		{
			snprintf(err, errlen, "out of memory");
			rc = 1;
		}
	if (rc == 0)
	{
		(*rts)++;
		rc = pipeline(b, cmds, ncmd, res, err, errlen);
		/* lost with COMMIT sent: it may have committed */
		if (rc < 0)
			*commit_unknown = 1;
		/* a failed command turns COMMIT into ROLLBACK */
		else if (rc == 0 && strcmp(PQcmdStatus(res[ncmd - 1]), "COMMIT") != 0)
		{
			snprintf(err, errlen, "COMMIT answered %s", PQcmdStatus(res[ncmd - 1]));
			rc = 1;
		}
	}
	if (rc == 0 && effects_cmd >= 0)
	{
		PGresult   *r = res[effects_cmd];

		if (PQntuples(r) != neffects)
		{
			/* committed, but the answer is not what was asked: say so */
			snprintf(err, errlen, "the effects returned %d rows for %d messages",
					 PQntuples(r), neffects);
			demo_note_error("worker %d: %s", b->slot, err);
		}
		for (j = 0; j < PQntuples(r); j++)
		{
			int			ord = atoi(PQgetvalue(r, j, 0));
			item	   *it;

			if (ord < 1 || ord > neffects)
				continue;
			it = &items[effect_item[ord - 1]];
			it->fate = PQgetisnull(r, j, 1) ? FATE_FAIL_PERMANENT : FATE_APPLIED;
		}
	}
	clear_all(res, ncmd);
	free(effect_item);
	for (j = 0; j < 8; j++)
		free(a[j].s);
	for (j = 0; j < 4; j++)
		free(fa[j].s);
	return rc;
}

/*
 * The same key twice in one batch: the second was told busy (one
 * transaction runs an effect once).  Once the first's result is committed,
 * the second is answered from it, as a claim would answer it now: a replay
 * with the same request, a mismatch with another.
 */
static void
answer_twins(item *items, int n)
{
	int			i,
				j;

	for (i = 0; i < n; i++)
	{
		if (items[i].fate != FATE_BUSY)
			continue;
		for (j = 0; j < i; j++)
		{
			const item *t = &items[j];

			if (!t->ok || t->m->tenant != items[i].m->tenant ||
				memcmp(t->key, items[i].key, IDEM_DIGEST_BYTES) != 0)
				continue;
			if (t->fate != FATE_APPLIED && t->fate != FATE_FAIL_PERMANENT)
				break;
			if (memcmp(t->fp, items[i].fp, IDEM_DIGEST_BYTES) != 0)
				items[i].fate = FATE_MISMATCH;
			else
				items[i].fate = t->fate == FATE_APPLIED ? FATE_REPLAY_TWIN : FATE_REPLAY_FAILED;
			break;
		}
	}
}

/*
 * The batch's messages looked up in Valkey in one pipelined round trip:
 * an array of n results (source VALKEY: decided there), or NULL.
 */
static idem_result *
lookup_cached(idem_runner *runner, const queue_msg *const *msgs, int n)
{
	idem_result *res = calloc(n, sizeof(idem_result));
	int64_t    *tenants = calloc(n, sizeof(int64_t));
	const char **scopes = calloc(n, sizeof(char *));
	const char **ids = calloc(n, sizeof(char *));
	const char **reqs = calloc(n, sizeof(char *));
	int			i;

	if (runner != NULL && res && tenants && scopes && ids && reqs)
	{
		for (i = 0; i < n; i++)
		{
			idem_result_init(&res[i]);
			tenants[i] = msgs[i]->tenant;
			scopes[i] = msgs[i]->kind;
			ids[i] = is_invoice(msgs[i]) ? msgs[i]->invoice : msgs[i]->run_id;
			reqs[i] = msgs[i]->request;
		}
		idem_cached_many(runner, n, tenants, scopes, ids, reqs, res);
	}
	else
	{
		free(res);
		res = NULL;
	}
	free(tenants);
	free(scopes);
	free(ids);
	free(reqs);
	return res;
}

void
batch_run(batch_ctx *b, idem_runner *runner, queue *q,
		  const queue_msg *const *msgs, int n)
{
	const demo_config *cfg = b->cfg;
	demo_counters *c = &g_shared->slot[b->slot];
	item	   *items = calloc(n, sizeof(item));
	const char **acks = calloc(n, sizeof(char *));
	sbuf		tenants = {0},
				keys = {0},
				fps = {0};
	char		lease[32],
				err[512] = "";
	bcmd		cmds[2];
	PGresult   *res[2] = {NULL, NULL};
	long		rts = 0;
	idem_runner_stats vs0,
				vs1;
	idem_result *cached;
	int			i,
				rc,
				nacks = 0,
				any_claimed = 0,
				first = 1,
				commit_unknown = 0;

	ADD(deliveries, n);
	ADD(batches, 1);
	ADD(batch_msgs, n);
	if (items == NULL || acks == NULL)
	{
		ADD(err_other, n);
		free(items);
		free(acks);
		return;
	}

	idem_runner_stats_init(&vs0);
	idem_runner_stats_init(&vs1);
	if (runner != NULL)
		idem_runner_get_stats(runner, &vs0);
	cached = lookup_cached(runner, msgs, n);

	/* Keys and fingerprints, as idem_run computes them. */
	sb_add(&tenants, "{");
	sb_add(&keys, "{");
	sb_add(&fps, "{");
	for (i = 0; i < n; i++)
	{
		const queue_msg *m = msgs[i];
		char		fphex[2 * IDEM_DIGEST_BYTES + 1];

		items[i].m = m;
		items[i].effect_cmd = -1;
		if (cached != NULL && cached[i].source == IDEM_SOURCE_VALKEY)
		{
			items[i].fate = cached[i].status == IDEM_REPLAYED ?
				FATE_REPLAY_VALKEY : FATE_REPLAY_FAILED;
			continue;
		}
		if (idem_key(m->kind, is_invoice(m) ? m->invoice : m->run_id, items[i].key) != 0 ||
			idem_fingerprint(m->request, strlen(m->request), items[i].fp, err, sizeof(err)) != 0)
		{
			demo_note_error("worker %d: %s %s: %s", b->slot, m->kind, m->run_id, err);
			ADD(err_other, 1);
			continue;
		}
		items[i].ok = 1;
		hex(items[i].key, items[i].key_hex);
		hex(items[i].fp, fphex);
		sb_add(&tenants, "%s%lld", first ? "" : ",", (long long) m->tenant);
		sb_add(&keys, "%s\"\\\\x%s\"", first ? "" : ",", items[i].key_hex);
		sb_add(&fps, "%s\"\\\\x%s\"", first ? "" : ",", fphex);
		first = 0;
	}
	sb_add(&tenants, "}");
	sb_add(&keys, "}");
	sb_add(&fps, "}");
	snprintf(lease, sizeof(lease), "%d milliseconds", cfg->lease_ms);
	if (tenants.failed || keys.failed || fps.failed)
		goto done;
	if (first)
		goto decide;			/* every message was answered by Valkey */

	if (ensure_conn(b, c) != 0)
	{
		for (i = 0; i < n; i++)
			if (items[i].ok)
				ADD(err_connection, 1);
		goto done;
	}

	/* Round trip 1: BEGIN and the claims. */
	cmds[0].sql = "BEGIN";
	cmds[0].nparams = 0;
	cmds[0].stmt = -1;
	cmds[1].sql = b->claim_sql;
	cmds[1].stmt = BSTMT_CLAIM;
	cmds[1].nparams = 4;
	cmds[1].values[0] = tenants.s;
	cmds[1].values[1] = keys.s;
	cmds[1].values[2] = fps.s;
	cmds[1].values[3] = lease;
	rts++;
	rc = pipeline(b, cmds, 2, res, err, sizeof(err));
	if (rc != 0)
	{
		for (i = 0; i < n; i++)
		{
			if (!items[i].ok)
				continue;
			if (rc < 0)
				ADD(err_connection, 1);
			else
				ADD(err_other, 1);
		}
		if (rc > 0)
		{
			demo_note_error("worker %d: idem_claim_many: %s", b->slot, err);
			rollback(b);
		}
		clear_all(res, 2);
		goto done;
	}
	{
		PGresult   *r = res[1];
		int			row,
					k = 0;
		int		   *pos = calloc(n, sizeof(int));

		/* ord counts only the items whose key was computed */
		for (i = 0; i < n && pos; i++)
			if (items[i].ok)
				pos[k++] = i;
		for (row = 0; pos && row < PQntuples(r); row++)
		{
			int			ord = atoi(PQgetvalue(r, row, 0));
			const char *d = PQgetvalue(r, row, 1);
			item	   *it;

			if (ord < 1 || ord > k)
				continue;
			it = &items[pos[ord - 1]];
			it->attempt = PQgetisnull(r, row, 2) ? 0 : atoi(PQgetvalue(r, row, 2));
			if (strcmp(d, "claimed") == 0)
			{
				any_claimed = 1;
				if (it->m->flaky && it->attempt == 1)
				{
					it->fate = FATE_FAIL_RETRYABLE;
					snprintf(it->outcome, sizeof(it->outcome),
							 "{\"error\": \"downstream timeout (simulated)\"}");
				}
				else
				{
					it->fate = FATE_EFFECT;
				}
			}
			else if (strcmp(d, "completed") == 0)
				it->fate = FATE_REPLAY;
			else if (strcmp(d, "failed_permanent") == 0)
				it->fate = FATE_REPLAY_FAILED;
			else if (strcmp(d, "mismatch") == 0)
				it->fate = FATE_MISMATCH;
			else
				it->fate = FATE_BUSY;
		}
		free(pos);
	}
	clear_all(res, 2);

	/* Round trips 2 and 3, only when something was claimed. */
	rc = 0;
	if (any_claimed)
	{
		rc = apply_and_commit(b, items, n, &rts, err, sizeof(err), &commit_unknown);
		if (rc == 0)
			answer_twins(items, n);
	}
	else
	{
		/* nothing claimed: end the (read-only) transaction */
		rts++;
		rollback(b);
	}
	if (rc != 0)
	{
		/* every claimed item stays pending: redelivered, one by one */
		for (i = 0; i < n; i++)
		{
			item_fate	f = items[i].fate;

			if (f == FATE_EFFECT || f == FATE_APPLIED || f == FATE_FAIL_PERMANENT ||
				f == FATE_FAIL_RETRYABLE)
			{
				items[i].fate = FATE_NONE;
				if (commit_unknown)
					ADD(err_commit_unknown, 1);
				else if (rc < 0)
					ADD(err_connection, 1);
				else
					ADD(err_other, 1);
			}
		}
		if (rc > 0)
		{
			demo_note_error("worker %d: batch rolled back: %s", b->slot, err);
			if (cfg->verbose)
				fprintf(stderr, "worker %d: batch rolled back: %s\n", b->slot, err);
			rts++;
			rollback(b);
		}
	}

	/* Decisions and one XACK for the final ones. */
decide:
	for (i = 0; i < n; i++)
	{
		const queue_msg *m = items[i].m;
		int			final = 1;

		switch (items[i].fate)
		{
			case FATE_APPLIED:
				ADD(applied, 1);
				misses_note_done(m);
				if (is_invoice(m))
					ADD(applied_invoice, 1);
				else
					ADD(applied_transfer, 1);
				break;
			case FATE_FAIL_PERMANENT:
				ADD(failed_permanent_now, 1);
				break;
			case FATE_REPLAY:
				ADD(replay_pg, 1);
				misses_note_pg_replay(c, m, cached && cached[i].valkey_used);
				break;
			case FATE_REPLAY_VALKEY:
				ADD(replay_valkey, 1);
				misses_note_done(m);
				break;
			case FATE_REPLAY_TWIN:
				ADD(replay_twin, 1);
				misses_note_done(m);
				break;
			case FATE_REPLAY_FAILED:
				ADD(failed_permanent_replay, 1);
				break;
			case FATE_MISMATCH:
				ADD(mismatch, 1);
				demo_note_error("worker %d: mismatch for %s %s", b->slot, m->kind,
								m->run_id);
				break;
			case FATE_FAIL_RETRYABLE:
				ADD(failed_retryable, 1);
				final = 0;
				break;
			case FATE_BUSY:
				ADD(busy_pg, 1);
				final = 0;
				break;
			default:
				final = 0;
				break;
		}
		if (final)
			acks[nacks++] = m->id;
	}
	if (nacks > 0)
	{
		int			a = queue_ack_many(q, acks, nacks);

		ADD(broker_round_trips, 1);
		if (a >= 0)
			ADD(acks, a);
		else
			ADD(broker_errors, 1);	/* stays pending: redelivered, replayed */
	}

done:
	free(cached);
	ADD(pg_round_trips, rts);
	if (runner != NULL)
	{
		idem_runner_get_stats(runner, &vs1);
		ADD(valkey_round_trips, vs1.valkey_round_trips - vs0.valkey_round_trips);
		ADD(pg_connects, vs1.pg_connects - vs0.pg_connects);
	}
	free(tenants.s);
	free(keys.s);
	free(fps.s);
	free(items);
	free(acks);
}
