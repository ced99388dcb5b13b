/*
 * notices.c
 *	  Stage two of the main job: the consumers of the transfers'
 *	  notifications.
 *
 *	  Each applied transfer emitted one notification in its own transaction
 *	  (idem_call_emit in worker.c, idem_emit in batch.c); the server's
 *	  publisher XADDs it, once committed, to the notice stream as
 *	  "id <message id> body <message>".  A consumer process owns one runner
 *	  and one idem_consumer: it reads the stream with its consumer group,
 *	  runs each entry through the runner with the message id as its run id
 *	  (task notice.apply, platform ledger: a namespace of its own), the
 *	  handler inserting one row into idem_demo.notices, and acknowledges
 *	  settled runs only.  About one notification in 20 fails retryably on
 *	  its first attempt (a flaky downstream): it stays pending, and comes
 *	  back by XAUTOCLAIM after the lease.
 *
 *	  --broken-consumer: a consumer that acknowledges each entry before its
 *	  run (its own XREADGROUP and XACK).  A flaky first attempt, or a kill
 *	  in between, then loses the notification for good: the check must fail.
 *
 *	  Locking: none; one thread per process, one process per slot.
 */
#include "demo.h"
#include "idem_client.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

static volatile sig_atomic_t stop_requested = 0;

#define ADD(field, n) __atomic_add_fetch(&c->field, (n), __ATOMIC_RELAXED)

typedef struct notice_ctx
{
	const demo_config *cfg;
	int			slot;
} notice_ctx;

static void
on_term(int sig)
{
	(void) sig;
	stop_requested = 1;
}

static void
quiet_notices(void *arg, const char *message)
{
	(void) arg;
	(void) message;
}

/* One notification in 20 is flaky, chosen by its message id (FNV-1a). */
static int
notice_flaky(const char *id)
{
	uint32_t	h = 2166136261u;

	for (; *id; id++)
		h = (h ^ (unsigned char) *id) * 16777619u;
	return h % 20 == 0;
}

/* notice.apply: one row into the ledger of notices, from the body. */
static idem_handler_status
notice_handler(PGconn *conn, idem_call *call, void *arg)
{
	notice_ctx *h = arg;
	char		attempt[16],
				consumer[16],
				out[96];
	const char *p[4];
	PGresult   *r;
	idem_handler_status hs;

	PQsetNoticeProcessor(conn, quiet_notices, NULL);
	if (notice_flaky(idem_call_id(call)) && idem_call_attempt(call) == 1)
	{
		idem_call_set_json(call, "{\"error\": \"notice service timeout (simulated)\"}");
		return IDEM_HANDLER_RETRYABLE;
	}
	snprintf(attempt, sizeof(attempt), "%d", idem_call_attempt(call));
	snprintf(consumer, sizeof(consumer), "%d", h->slot - h->cfg->workers);
	p[0] = idem_call_id(call);
	p[1] = idem_call_request(call);
	p[2] = attempt;
	p[3] = consumer;
	r = PQexecParams(conn,
					 "INSERT INTO idem_demo.notices (message_id, task_key, tenant_id,"
					 " transfer_id, attempt, consumer)"
					 " SELECT $1, b->>'task_key', (b->>'tenant')::bigint,"
					 " (b->>'transfer_id')::bigint, $3, $4 FROM (SELECT $2::jsonb AS b) s"
					 " RETURNING id",
					 4, NULL, p, NULL, NULL, 0);
	if (PQresultStatus(r) != PGRES_TUPLES_OK || PQntuples(r) != 1)
	{
		idem_call_set_json(call, "{\"error\": \"notice insert failed\"}");
		hs = IDEM_HANDLER_RETRYABLE;
	}
	else
	{
		snprintf(out, sizeof(out), "{\"notice_id\": %s}", PQgetvalue(r, 0, 0));
		idem_call_set_json(call, out);
		hs = IDEM_HANDLER_OK;
	}
	PQclear(r);
	return hs;
}

static void
count_result(demo_counters *c, const idem_result *res, int acked)
{
	switch (res->status)
	{
		case IDEM_APPLIED:
			ADD(notice_applied, 1);
			break;
		case IDEM_REPLAYED:
			ADD(notice_replayed, 1);
			break;
		case IDEM_FAILED_RETRYABLE:
			ADD(notice_retryable, 1);
			break;
		case IDEM_BUSY:
			ADD(notice_busy, 1);
			break;
		default:
			ADD(notice_errors, 1);
			break;
	}
	if (acked)
		ADD(notice_acked, 1);
}

static void
on_settled(void *arg, const char *message_id, const idem_result *res, int acked)
{
	(void) message_id;
	count_result(arg, res, acked);
}

/*
 * The broken consumer: XREADGROUP, XACK at once, then the run.  What a
 * run leaves undone is never redelivered.
 */
static void
broken_loop(const demo_config *cfg, idem_runner *runner, notice_ctx *h,
			const char *name)
{
	demo_counters *c = &g_shared->slot[h->slot];
	redisContext *rc = NULL;
	idem_run_options ro;

	idem_run_options_init(&ro);
	ro.delivery_count = 1;
	while (!stop_requested)
	{
		struct timeval tv = {2, 0};
		redisReply *r;
		size_t		i;

		if (rc == NULL)
		{
			rc = redisConnectWithTimeout(cfg->notice_host, cfg->notice_port, tv);
			if (rc == NULL || rc->err)
			{
				if (rc)
					redisFree(rc);
				rc = NULL;
				ADD(notice_valkey_errors, 1);
				usleep(100 * 1000);
				continue;
			}
			redisSetTimeout(rc, tv);
			if (cfg->notice_db)
				freeReplyObject(redisCommand(rc, "SELECT %d", cfg->notice_db));
			r = redisCommand(rc, "XGROUP CREATE %s %s 0 MKSTREAM",
							 cfg->notice_stream, cfg->notice_group);
			if (r)
				freeReplyObject(r);
		}
		r = redisCommand(rc, "XREADGROUP GROUP %s %s COUNT 10 BLOCK 100 STREAMS %s >",
						 cfg->notice_group, name, cfg->notice_stream);
		if (r == NULL || r->type == REDIS_REPLY_ERROR)
		{
			if (r)
				freeReplyObject(r);
			redisFree(rc);
			rc = NULL;
			ADD(notice_valkey_errors, 1);
			continue;
		}
		if (r->type == REDIS_REPLY_ARRAY && r->elements == 1 &&
			r->element[0]->elements == 2)
		{
			const redisReply *list = r->element[0]->element[1];

			for (i = 0; i < list->elements && !stop_requested; i++)
			{
				const redisReply *e = list->element[i],
						   *f = e->element[1];
				const char *id = NULL,
						   *body = NULL;
				idem_result res;
				size_t		j;
				redisReply *a;

				for (j = 0; j + 1 < f->elements; j += 2)
				{
					if (strcmp(f->element[j]->str, "id") == 0)
						id = f->element[j + 1]->str;
					else if (strcmp(f->element[j]->str, "body") == 0)
						body = f->element[j + 1]->str;
				}
				ADD(notice_read, 1);
				/* the defect: acknowledged before the run has settled */
				a = redisCommand(rc, "XACK %s %s %s", cfg->notice_stream,
								 cfg->notice_group, e->element[0]->str);
				if (a)
					freeReplyObject(a);
				if (id == NULL || body == NULL)
					continue;
				idem_result_init(&res);
				idem_run_platform_with(runner, "notice.apply", id, body, &ro,
									   notice_handler, h, &res);
				count_result(c, &res, 1);
			}
		}
		freeReplyObject(r);
	}
	if (rc)
		redisFree(rc);
}

void
consumer_main(const demo_config *cfg, int slot, int gen)
{
	demo_counters *c = &g_shared->slot[slot];
	idem_runner *runner;
	idem_consumer_options co;
	idem_consumer *consumer;
	notice_ctx	h;
	char		name[64],
				appname[64];

	signal(SIGTERM, on_term);
	signal(SIGINT, SIG_IGN);
	signal(SIGPIPE, SIG_IGN);
	snprintf(appname, sizeof(appname), "idem-demo-c%d", slot - cfg->workers);
	setenv("PGAPPNAME", appname, 1);
	snprintf(name, sizeof(name), "c%d.%d.%d", slot - cfg->workers, gen, (int) getpid());
	h.cfg = cfg;
	h.slot = slot;

	runner = demo_runner_open(cfg);
	if (runner == NULL)
		_exit(3);
	if (cfg->broken_consumer)
	{
		broken_loop(cfg, runner, &h, name);
		idem_runner_close(runner);
		_exit(0);
	}

	idem_consumer_options_init(&co);
	co.stream = cfg->notice_stream;
	co.group = cfg->notice_group;
	co.consumer = name;
	co.task_scope = "notice.apply";
	co.platform = 1;
	co.handler = notice_handler;
	co.user_data = &h;
	co.count = 10;
	co.block_ms = 100;
	co.claim_idle_ms = cfg->lease_ms + 200;
	co.valkey_db = cfg->notice_db;
	co.valkey_cluster = -1;
	co.settled = on_settled;
	co.settled_arg = c;
	consumer = idem_consumer_open(runner, cfg->notice_host, cfg->notice_port, &co);
	if (consumer == NULL)
		_exit(3);
	while (!stop_requested)
	{
		int			n = idem_consumer_poll(consumer);

		if (n < 0)
		{
			ADD(notice_valkey_errors, 1);
			demo_note_error("consumer %d: %s", slot - cfg->workers,
							idem_consumer_error_message(consumer));
		}
		else
			ADD(notice_read, n);
	}
	idem_consumer_close(consumer);
	idem_runner_close(runner);
	_exit(0);
}

/*
 * The statement that counts the messages waiting in the outbox: on Citus,
 * in every node's (each node records and publishes its tenants' own).
 */
void
notices_outbox_sql(const demo_config *cfg, char *sql, size_t len)
{
	if (cfg->citus)
		snprintf(sql, len, "SELECT CASE WHEN bool_and(success) THEN sum(result::bigint) ELSE -1 END "
				 "FROM run_command_on_all_nodes('SELECT count(*) FROM %s.idem_outbox')",
				 cfg->schema);
	else
		snprintf(sql, len, "SELECT count(*) FROM %s.idem_outbox", cfg->schema);
}

/*
 * Stage two is done when the outbox is empty (every committed notification
 * published) and the notice stream's group has handed out its last entry
 * and has nothing pending.  1: done; 0: not yet (or cannot tell).
 */
int
notices_drained(PGconn *conn, queue *nq, const demo_config *cfg)
{
	char		sql[512],
				last[48],
				delivered[48];
	long		pending;
	PGresult   *r;
	int			empty;

	notices_outbox_sql(cfg, sql, sizeof(sql));
	r = PQexec(conn, sql);
	empty = PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1 &&
		strcmp(PQgetvalue(r, 0, 0), "0") == 0;
	PQclear(r);
	if (PQstatus(conn) != CONNECTION_OK)
		PQreset(conn);
	if (!empty)
		return 0;
	if (queue_last_id(nq, last, sizeof(last)) != 0 ||
		queue_group_state(nq, &pending, delivered, sizeof(delivered)) != 0)
		return 0;
	return pending == 0 && strcmp(last, delivered) == 0;
}
