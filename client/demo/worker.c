/*
 * worker.c
 *	  One worker process and the producer.
 *
 *	  A worker owns one runner (one PostgreSQL and one Valkey connection),
 *	  with --batch > 1 a second PostgreSQL connection for batches
 *	  (batch.c), and one broker connection.  Loop: every claim interval,
 *	  XAUTOCLAIM the messages pending for longer than the lease (a killed
 *	  worker's, or ones left unacked); else XREADGROUP up to --batch new
 *	  ones.  New transfers and invoices run as one batch (batch.c); the
 *	  rest (redeliveries, purges, and everything with --batch 1) run one by
 *	  one through idem_run_with / idem_run_platform_with (an entry's first
 *	  delivery with delivery_count 1: no Valkey gate).  A final decision (applied,
 *	  replayed, failed_permanent, mismatch) is XACKed, anything else (busy,
 *	  retryable failure, error) stays pending and is redelivered after the
 *	  lease.
 */
#include "demo.h"
#include "idem_client.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static volatile sig_atomic_t stop_requested = 0;

static void
on_term(int sig)
{
	(void) sig;
	stop_requested = 1;
}

#define ADD(field, n) __atomic_add_fetch(&c->field, (n), __ATOMIC_RELAXED)

typedef struct handler_ctx
{
	const demo_config *cfg;
	const queue_msg *m;
	int			slot;
	long		purge_deleted;
	int			sleep_ms;
} handler_ctx;

static void
json_detail(idem_call *call, const char *what, PGconn *conn, PGresult *r)
{
	char		buf[200];
	const char *st = r ? PQresultErrorField(r, PG_DIAG_SQLSTATE) : NULL;

	(void) conn;
	snprintf(buf, sizeof(buf), "{\"error\": \"%s\", \"sqlstate\": \"%s\"}",
			 what, st ? st : "");
	idem_call_set_json(call, buf);
}

/*
 * libpq's default notice processor prints to stderr, and a terminated
 * backend's FATAL arrives as a notice on an idle connection: the chaos would
 * litter the progress display.  The handler gets the runner's connection,
 * so it quiets it (the run still sees the lost connection).
 */
static void
quiet_notices(void *arg, const char *message)
{
	(void) arg;
	(void) message;
}

/* transfer.create and invoice.pay: one call to the effect function. */
static idem_handler_status
money_handler(PGconn *conn, idem_call *call, void *arg)
{
	handler_ctx *h = arg;
	const queue_msg *m = h->m;
	char		tenant[24],
				from[16],
				to[16],
				amount[24],
				attempt[16],
				worker[16],
				key[96],
				out[160];
	PGresult   *r;
	idem_handler_status hs;

	/* a flaky downstream: the first attempt fails, a redelivery succeeds */
	if (m->flaky && idem_call_attempt(call) == 1)
	{
		idem_call_set_json(call, "{\"error\": \"downstream timeout (simulated)\"}");
		return IDEM_HANDLER_RETRYABLE;
	}
	snprintf(tenant, sizeof(tenant), "%lld", (long long) m->tenant);
	snprintf(attempt, sizeof(attempt), "%d", idem_call_attempt(call));
	snprintf(worker, sizeof(worker), "%d", h->slot);
	if (strcmp(m->kind, "invoice.pay") == 0)
	{
		const char *p[] = {tenant, m->invoice, m->run_id, attempt, worker};

		r = PQexecParams(conn,
						 "SELECT idem_demo.pay_invoice($1, $2, $3, $4, $5)",
						 5, NULL, p, NULL, NULL, 0);
	}
	else
	{
		const char *p[] = {tenant, key, m->run_id, from, to, amount, attempt, worker};

		snprintf(key, sizeof(key), "transfer:%s", m->run_id);
		snprintf(from, sizeof(from), "%d", m->from);
		snprintf(to, sizeof(to), "%d", m->to);
		snprintf(amount, sizeof(amount), "%lld", (long long) m->amount);
		r = PQexecParams(conn,
						 "SELECT idem_demo.transfer($1, $2, $3, $4, $5, $6, $7, $8)",
						 8, NULL, p, NULL, NULL, 0);
	}
	if (PQresultStatus(r) != PGRES_TUPLES_OK || PQntuples(r) != 1)
	{
		/* lost connection, deadlock, ...: the runner rolls back; retry */
		json_detail(call, "effect failed", conn, r);
		hs = IDEM_HANDLER_RETRYABLE;
	}
	else if (PQgetisnull(r, 0, 0))
	{
		idem_call_set_json(call, "{\"error\": \"account frozen\"}");
		hs = IDEM_HANDLER_PERMANENT;
	}
	else
	{
		if (h->sleep_ms > 0)
			usleep((useconds_t) (rand() % (h->sleep_ms + 1)) * 1000);
		snprintf(out, sizeof(out), "{\"transfer_id\": %s}", PQgetvalue(r, 0, 0));
		idem_call_set_json(call, out);
		hs = IDEM_HANDLER_OK;
		/* stage two: the notification leaves when the transfer commits */
		if (h->cfg->notices > 0)
		{
			char		body[256];

			snprintf(body, sizeof(body),
					 "{\"task_key\": \"%s:%s\", \"tenant\": %s, \"transfer_id\": %s}",
					 strcmp(m->kind, "invoice.pay") == 0 ? "invoice" : "transfer",
					 strcmp(m->kind, "invoice.pay") == 0 ? m->invoice : m->run_id,
					 tenant, PQgetvalue(r, 0, 0));
			if (idem_call_emit(call, h->cfg->notice_stream, body) != 0)
			{
				json_detail(call, "emit failed", conn, NULL);
				hs = IDEM_HANDLER_RETRYABLE;
			}
		}
	}
	PQclear(r);
	return hs;
}

/* maintenance.purge: idem_purge in batches, inside the run's transaction. */
static idem_handler_status
purge_handler(PGconn *conn, idem_call *call, void *arg)
{
	handler_ctx *h = arg;
	const char *schema = getenv("IDEM_DEMO_SCHEMA");
	char		sql[256],
				out[96];
	long		total = 0;
	int			i;

	snprintf(sql, sizeof(sql), "SELECT %s.idem_purge(500)",
			 schema && schema[0] ? schema : "public");
	for (i = 0; i < 20; i++)
	{
		PGresult   *r = PQexec(conn, sql);
		long		n;

		if (PQresultStatus(r) != PGRES_TUPLES_OK || PQntuples(r) != 1)
		{
			json_detail(call, "idem_purge failed", conn, r);
			PQclear(r);
			return IDEM_HANDLER_RETRYABLE;
		}
		n = atol(PQgetvalue(r, 0, 0));
		PQclear(r);
		total += n;
		if (n < 500)
			break;
	}
	h->purge_deleted = total;
	snprintf(out, sizeof(out), "{\"deleted\": %ld}", total);
	idem_call_set_json(call, out);
	return IDEM_HANDLER_OK;
}

/*
 * The negative control (--without-idem): the same effect, run directly in
 * its own transaction, no key, no gate.  Duplicates and redeliveries apply
 * it again: the check must catch that.
 */
static void
process_without_idem(PGconn **connp, const demo_config *cfg, queue *q,
					 int slot, const queue_msg *m)
{
	demo_counters *c = &g_shared->slot[slot];
	char		tenant[24],
				from[16],
				to[16],
				amount[24],
				worker[16],
				key[96];
	PGresult   *r;
	int			ok;

	ADD(deliveries, 1);
	if (m->redelivered)
		ADD(redeliveries, 1);
	if (*connp == NULL || PQstatus(*connp) != CONNECTION_OK)
	{
		PQfinish(*connp);
		*connp = PQconnectdb(cfg->pg);
		if (PQstatus(*connp) != CONNECTION_OK)
		{
			ADD(err_connection, 1);
			return;
		}
		PQsetNoticeProcessor(*connp, quiet_notices, NULL);
	}
	snprintf(tenant, sizeof(tenant), "%lld", (long long) m->tenant);
	snprintf(worker, sizeof(worker), "%d", slot);
	if (strcmp(m->kind, "maintenance.purge") == 0)
		r = PQexec(*connp, "SELECT 1");
	else if (strcmp(m->kind, "invoice.pay") == 0)
	{
		const char *p[] = {tenant, m->invoice, m->run_id, "1", worker};

		r = PQexecParams(*connp, "SELECT idem_demo.pay_invoice($1, $2, $3, $4, $5)",
						 5, NULL, p, NULL, NULL, 0);
	}
	else
	{
		const char *p[] = {tenant, key, m->run_id, from, to, amount, "1", worker};

		snprintf(key, sizeof(key), "transfer:%s", m->run_id);
		snprintf(from, sizeof(from), "%d", m->from);
		snprintf(to, sizeof(to), "%d", m->to);
		snprintf(amount, sizeof(amount), "%lld", (long long) m->amount);
		r = PQexecParams(*connp, "SELECT idem_demo.transfer($1, $2, $3, $4, $5, $6, $7, $8)",
						 8, NULL, p, NULL, NULL, 0);
	}
	ok = PQresultStatus(r) == PGRES_TUPLES_OK;
	PQclear(r);
	if (!ok)
	{
		ADD(err_other, 1);
		return;
	}
	ADD(applied, 1);
	if (queue_ack(q, m->id) == 1)
		ADD(acks, 1);
}

static void
process(const demo_config *cfg, idem_runner *runner, queue *q, int slot,
		const queue_msg *m)
{
	demo_counters *c = &g_shared->slot[slot];
	handler_ctx h;
	idem_result res;
	idem_runner_stats before,
				after;
	idem_run_options ro;
	int			final = 0;

	memset(&h, 0, sizeof(h));
	h.cfg = cfg;
	h.m = m;
	h.slot = slot;
	h.sleep_ms = cfg->handler_sleep_ms;
	ADD(deliveries, 1);
	if (m->redelivered)
		ADD(redeliveries, 1);
	idem_result_init(&res);
	idem_runner_stats_init(&before);
	idem_runner_stats_init(&after);
	idem_runner_get_stats(runner, &before);
	/*
	 * The stream's first delivery of an entry skips the Valkey gate
	 * (delivery_count 1); the claim guards the producer's duplicates, which
	 * are first deliveries of other entries with the same key.
	 */
	idem_run_options_init(&ro);
	ro.delivery_count = m->redelivered ? 0 : 1;
	if (strcmp(m->kind, "maintenance.purge") == 0)
		idem_run_platform_with(runner, m->kind, m->run_id, m->request, &ro,
							   purge_handler, &h, &res);
	else if (strcmp(m->kind, "invoice.pay") == 0)
		idem_run_with(runner, m->tenant, m->kind, m->invoice, m->request, &ro,
					  money_handler, &h, &res);	/* keyed by the business key */
	else
		idem_run_with(runner, m->tenant, m->kind, m->run_id, m->request, &ro,
					  money_handler, &h, &res);	/* keyed by the run_id */
	idem_runner_get_stats(runner, &after);
	ADD(pg_round_trips, after.pg_round_trips - before.pg_round_trips);
	ADD(pg_connects, after.pg_connects - before.pg_connects);
	ADD(valkey_round_trips, after.valkey_round_trips - before.valkey_round_trips);
	ADD(valkey_skipped, after.valkey_skipped - before.valkey_skipped);

	switch (res.status)
	{
		case IDEM_APPLIED:
			ADD(applied, 1);
			misses_note_done(m);
			if (strcmp(m->kind, "maintenance.purge") == 0)
			{
				ADD(applied_purge, 1);
				ADD(purge_deleted, h.purge_deleted);
			}
			else if (strcmp(m->kind, "invoice.pay") == 0)
				ADD(applied_invoice, 1);
			else
				ADD(applied_transfer, 1);
			final = 1;
			break;
		case IDEM_REPLAYED:
			if (res.source == IDEM_SOURCE_VALKEY)
			{
				ADD(replay_valkey, 1);
				misses_note_done(m);
			}
			else
			{
				ADD(replay_pg, 1);
				misses_note_pg_replay(c, m, res.valkey_used);
			}
			final = 1;
			break;
		case IDEM_FAILED_PERMANENT:
			if (res.source == IDEM_SOURCE_HANDLER)
				ADD(failed_permanent_now, 1);
			else
				ADD(failed_permanent_replay, 1);
			final = 1;
			break;
		case IDEM_MISMATCH:
			ADD(mismatch, 1);
			demo_note_error("worker %d: mismatch for %s %s", slot, m->kind,
							m->run_id);
			final = 1;
			break;
		case IDEM_BUSY:
			if (res.source == IDEM_SOURCE_VALKEY)
				ADD(busy_valkey, 1);
			else
				ADD(busy_pg, 1);
			break;
		case IDEM_FAILED_RETRYABLE:
			ADD(failed_retryable, 1);
			break;
		case IDEM_ERROR:
			if (res.error_code == IDEM_ERR_CONNECTION)
				ADD(err_connection, 1);
			else if (res.error_code == IDEM_ERR_COMMIT_UNKNOWN)
				ADD(err_commit_unknown, 1);
			else
			{
				ADD(err_other, 1);
				demo_note_error("worker %d: %s %s: %s", slot, m->kind,
								m->run_id, res.error_message);
			}
			if (cfg->verbose)
				fprintf(stderr, "worker %d: %s %s: error: %s\n", slot,
						m->kind, m->run_id, res.error_message);
			break;
	}
	if (final)
	{
		int			a = queue_ack(q, m->id);

		ADD(broker_round_trips, 1);
		if (a == 1)
			ADD(acks, 1);
		else if (a < 0)
			ADD(broker_errors, 1);	/* stays pending: redelivered, replayed */
	}
}

void
worker_main(const demo_config *cfg, int slot, int gen)
{
	demo_counters *c = &g_shared->slot[slot];
	idem_runner *runner;
	PGconn	   *direct = NULL;	/* --without-idem only */
	queue	   *q = NULL;
	char		consumer[64],
				appname[64],
				cursor[48] = "0-0",
				err[256];
	queue_msg  *msgs;
	int64_t		next_claim = 0;
	int			min_idle = cfg->lease_ms + 200;
	int			maxn = cfg->batch > 16 ? cfg->batch : 16;
	batch_ctx  *batch = NULL;
	const queue_msg **batched;

	signal(SIGTERM, on_term);
	signal(SIGINT, SIG_IGN);	/* the parent decides when to stop */
	signal(SIGPIPE, SIG_IGN);
	snprintf(appname, sizeof(appname), "idem-demo-w%d", slot);
	setenv("PGAPPNAME", appname, 1);
	snprintf(consumer, sizeof(consumer), "w%d.%d.%d", slot, gen, (int) getpid());
	srand((unsigned) getpid());
	msgs = calloc(maxn, sizeof(queue_msg));
	batched = calloc(maxn, sizeof(queue_msg *));
	if (cfg->batch > 1 && !cfg->without_idem)
		batch = batch_new(cfg, slot);

	runner = demo_runner_open(cfg);
	if (runner == NULL || msgs == NULL || batched == NULL ||
		(cfg->batch > 1 && !cfg->without_idem && batch == NULL))
		_exit(3);

	while (!stop_requested)
	{
		int			n = 0,
					i;

		if (q == NULL)
		{
			q = queue_open(cfg->broker_host, cfg->broker_port, cfg->broker_db,
						   cfg->stream, cfg->group, err, sizeof(err));
			if (q == NULL)
			{
				ADD(broker_errors, 1);
				usleep(100 * 1000);
				continue;
			}
		}
		if (demo_now_ms() >= next_claim)
		{
			n = queue_autoclaim(q, consumer, min_idle, cursor, sizeof(cursor),
								maxn, msgs, maxn);
			ADD(broker_round_trips, 1);
			if (n == 0 || strcmp(cursor, "0-0") == 0)
				next_claim = demo_now_ms() + 100;
		}
		if (n == 0)
		{
			n = queue_read(q, consumer, cfg->batch > 1 ? cfg->batch : 1, 100,
						   msgs, maxn);
			ADD(broker_round_trips, 1);
		}
		if (n < 0)
		{
			ADD(broker_errors, 1);
			queue_close(q);
			q = NULL;
			usleep(50 * 1000);
			continue;
		}
		if (batch)
		{
			int			nb = 0;

			for (i = 0; i < n; i++)
				if (batch_wants(&msgs[i]))
					batched[nb++] = &msgs[i];
			if (nb > 0 && !stop_requested)
				batch_run(batch, runner, q, batched, nb);
		}
		for (i = 0; i < n && !stop_requested; i++)
		{
			if (cfg->without_idem)
				process_without_idem(&direct, cfg, q, slot, &msgs[i]);
			else if (batch == NULL || !batch_wants(&msgs[i]))
				process(cfg, runner, q, slot, &msgs[i]);
		}
	}
	batch_free(batch);
	free(batched);
	idem_runner_close(runner);
	PQfinish(direct);
	queue_close(q);
	free(msgs);
	_exit(0);
}

/* The producer: XADD every message of the plan, in order, in batches. */
void
producer_main(const demo_config *cfg, const demo_plan *plan)
{
	queue	   *q;
	char		err[256],
				last[48] = "";
	int			i = 0,
				batch = 50;

	signal(SIGTERM, SIG_DFL);
	signal(SIGINT, SIG_IGN);
	signal(SIGPIPE, SIG_IGN);
	q = queue_open(cfg->broker_host, cfg->broker_port, cfg->broker_db,
				   cfg->stream, cfg->group, err, sizeof(err));
	if (q == NULL)
	{
		demo_note_error("producer: %s", err);
		_exit(2);
	}
	while (i < plan->nmsgs)
	{
		int			to = i + batch < plan->nmsgs ? i + batch : plan->nmsgs;
		int			n = queue_add(q, cfg, plan, i, to, last, sizeof(last));

		if (n != to - i)
		{
			/* a batch that failed part-way would enqueue duplicates when
			 * resent: fine for an at-least-once queue, but say so */
			demo_note_error("producer: XADD failed (%d of %d)", n, to - i);
			queue_close(q);
			_exit(2);
		}
		__atomic_add_fetch(&g_shared->enqueued, n, __ATOMIC_RELAXED);
		i = to;
		usleep(2000);
	}
	snprintf(g_shared->last_id, sizeof(g_shared->last_id), "%s", last);
	__atomic_store_n(&g_shared->producer_done, 1, __ATOMIC_RELEASE);
	queue_close(q);
	_exit(0);
}
