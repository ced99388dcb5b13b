/*
 * queue.c
 *	  The at-least-once queue: a Valkey Stream with one consumer group.
 *
 *	  Producer: XADD (pipelined).  Worker: XREADGROUP ... > for new
 *	  messages, XAUTOCLAIM for messages that stayed pending longer than the
 *	  lease (a consumer that died, a busy or failed run left unacked), XACK
 *	  once the run ended with a final decision (one XACK for a whole batch).  A message carries its
 *	  run_id in a field: a duplicate is the same run_id enqueued again.
 *	  Only commands that Redis 7 and Valkey both have.
 */
#include "demo.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <hiredis/hiredis.h>

struct queue
{
	redisContext *c;
	char		host[128];
	int			port;
	int			db;
	char		stream[64];
	char		group[32];
};

static int
queue_connect(queue *q, char *err, size_t errlen)
{
	struct timeval tv = {2, 0};
	redisReply *r;

	if (q->c)
		redisFree(q->c);
	q->c = redisConnectWithTimeout(q->host, q->port, tv);
	if (q->c == NULL || q->c->err)
	{
		if (err)
			snprintf(err, errlen, "cannot connect to the broker %s:%d: %s",
					 q->host, q->port, q->c ? q->c->errstr : "out of memory");
		if (q->c)
			redisFree(q->c);
		q->c = NULL;
		return -1;
	}
	tv.tv_sec = 5;
	redisSetTimeout(q->c, tv);
	if (q->db)
	{
		r = redisCommand(q->c, "SELECT %d", q->db);
		if (r == NULL || r->type == REDIS_REPLY_ERROR)
		{
			if (err)
				snprintf(err, errlen, "SELECT %d failed on the broker", q->db);
			if (r)
				freeReplyObject(r);
			redisFree(q->c);
			q->c = NULL;
			return -1;
		}
		freeReplyObject(r);
	}
	return 0;
}

queue *
queue_open(const char *host, int port, int db, const char *stream,
		   const char *group, char *err, size_t errlen)
{
	queue	   *q = calloc(1, sizeof(queue));

	if (q == NULL)
		return NULL;
	snprintf(q->host, sizeof(q->host), "%s", host);
	q->port = port;
	q->db = db;
	snprintf(q->stream, sizeof(q->stream), "%s", stream);
	snprintf(q->group, sizeof(q->group), "%s", group);
	if (queue_connect(q, err, errlen) != 0)
	{
		free(q);
		return NULL;
	}
	return q;
}

void
queue_close(queue *q)
{
	if (q == NULL)
		return;
	if (q->c)
		redisFree(q->c);
	free(q);
}

/* A command; reconnects once if the connection is gone. */
static redisReply *
command_argv(queue *q, int argc, const char **argv)
{
	redisReply *r;
	int			tries;

	for (tries = 0; tries < 2; tries++)
	{
		if (q->c == NULL && queue_connect(q, NULL, 0) != 0)
			return NULL;
		r = redisCommandArgv(q->c, argc, argv, NULL);
		if (r != NULL)
			return r;
		redisFree(q->c);
		q->c = NULL;
	}
	return NULL;
}

int
queue_create_group(queue *q, char *err, size_t errlen)
{
	const char *argv[] = {"XGROUP", "CREATE", q->stream, q->group, "0", "MKSTREAM"};
	redisReply *r = command_argv(q, 6, argv);
	int			rc = 0;

	if (r == NULL || (r->type == REDIS_REPLY_ERROR &&
					  strstr(r->str, "BUSYGROUP") == NULL))
	{
		snprintf(err, errlen, "XGROUP CREATE failed: %s",
				 r ? r->str : "no answer from the broker");
		rc = -1;
	}
	if (r)
		freeReplyObject(r);
	return rc;
}

/* XADD messages [from, to) of the plan, pipelined.  Returns the count. */
int
queue_add(queue *q, const demo_config *cfg, const demo_plan *plan,
		  int from, int to, char *last_id, size_t last_len)
{
	int			i,
				ok = 0;

	if (q->c == NULL && queue_connect(q, NULL, 0) != 0)
		return -1;
	for (i = from; i < to; i++)
	{
		const demo_msg *m = &plan->msgs[i];
		const demo_task *t = &plan->tasks[m->task];
		char		req[512],
					tenant[24],
					fromb[16],
					tob[16],
					amount[24],
					flaky[4];
		const char *argv[24];
		int			argc = 0;

		request_json(cfg, t, req, sizeof(req));
		snprintf(tenant, sizeof(tenant), "%lld", (long long) t->tenant);
		snprintf(fromb, sizeof(fromb), "%d", t->from);
		snprintf(tob, sizeof(tob), "%d", t->to);
		snprintf(amount, sizeof(amount), "%lld", (long long) t->amount);
		snprintf(flaky, sizeof(flaky), "%d", t->flaky);
		argv[argc++] = "XADD";
		argv[argc++] = q->stream;
		argv[argc++] = "*";
		argv[argc++] = "run_id";
		argv[argc++] = m->run_id;
		argv[argc++] = "kind";
		argv[argc++] = kind_scope(t->kind);
		argv[argc++] = "request";
		argv[argc++] = req;
		if (t->kind != KIND_PURGE)
		{
			argv[argc++] = "tenant";
			argv[argc++] = tenant;
		}
		if (t->kind == KIND_TRANSFER)
		{
			argv[argc++] = "from";
			argv[argc++] = fromb;
			argv[argc++] = "to";
			argv[argc++] = tob;
			argv[argc++] = "amount";
			argv[argc++] = amount;
			argv[argc++] = "flaky";
			argv[argc++] = flaky;
		}
		if (t->kind == KIND_INVOICE)
		{
			argv[argc++] = "invoice";
			argv[argc++] = t->id;
		}
		redisAppendCommandArgv(q->c, argc, argv, NULL);
	}
	for (i = from; i < to; i++)
	{
		redisReply *r = NULL;

		if (redisGetReply(q->c, (void **) &r) != REDIS_OK || r == NULL)
		{
			redisFree(q->c);
			q->c = NULL;
			return -1;
		}
		if (r->type == REDIS_REPLY_STRING)
		{
			ok++;
			if (last_id)
				snprintf(last_id, last_len, "%s", r->str);
		}
		freeReplyObject(r);
	}
	return ok;
}

static void
field_copy(char *dst, size_t len, const redisReply *v)
{
	if (v->type == REDIS_REPLY_STRING)
		snprintf(dst, len, "%.*s", (int) v->len, v->str);
	else
		dst[0] = '\0';
}

/* One entry [id, [f1, v1, ...]] into m; 0 if it is usable. */
static int
parse_entry(const redisReply *e, queue_msg *m)
{
	const redisReply *f;
	size_t		i;
	char		buf[64];

	memset(m, 0, sizeof(*m));
	if (e == NULL || e->type != REDIS_REPLY_ARRAY || e->elements < 2 ||
		e->element[0]->type != REDIS_REPLY_STRING)
		return -1;
	field_copy(m->id, sizeof(m->id), e->element[0]);
	f = e->element[1];
	if (f->type != REDIS_REPLY_ARRAY)
		return -1;				/* deleted entry (nil) */
	for (i = 0; i + 1 < f->elements; i += 2)
	{
		const redisReply *k = f->element[i],
				   *v = f->element[i + 1];

		if (k->type != REDIS_REPLY_STRING)
			continue;
		if (strcmp(k->str, "run_id") == 0)
			field_copy(m->run_id, sizeof(m->run_id), v);
		else if (strcmp(k->str, "kind") == 0)
			field_copy(m->kind, sizeof(m->kind), v);
		else if (strcmp(k->str, "request") == 0)
			field_copy(m->request, sizeof(m->request), v);
		else if (strcmp(k->str, "invoice") == 0)
			field_copy(m->invoice, sizeof(m->invoice), v);
		else
		{
			field_copy(buf, sizeof(buf), v);
			if (strcmp(k->str, "tenant") == 0)
				m->tenant = strtoll(buf, NULL, 10);
			else if (strcmp(k->str, "from") == 0)
				m->from = atoi(buf);
			else if (strcmp(k->str, "to") == 0)
				m->to = atoi(buf);
			else if (strcmp(k->str, "amount") == 0)
				m->amount = strtoll(buf, NULL, 10);
			else if (strcmp(k->str, "flaky") == 0)
				m->flaky = atoi(buf);
		}
	}
	return m->run_id[0] && m->kind[0] ? 0 : -1;
}

static int
parse_entries(const redisReply *list, queue_msg *out, int max, int redelivered)
{
	size_t		i;
	int			n = 0;

	if (list == NULL || list->type != REDIS_REPLY_ARRAY)
		return 0;
	for (i = 0; i < list->elements && n < max; i++)
		if (parse_entry(list->element[i], &out[n]) == 0)
			out[n++].redelivered = redelivered;
	return n;
}

/* New messages for this consumer.  -1: broker error; 0: none (timeout). */
int
queue_read(queue *q, const char *consumer, int count, int block_ms,
		   queue_msg *out, int max)
{
	char		cnt[16],
				blk[16];
	const char *argv[] = {"XREADGROUP", "GROUP", q->group, consumer,
		"COUNT", cnt, "BLOCK", blk, "STREAMS", q->stream, ">"};
	redisReply *r;
	int			n = 0;

	snprintf(cnt, sizeof(cnt), "%d", count);
	snprintf(blk, sizeof(blk), "%d", block_ms);
	r = command_argv(q, 11, argv);
	if (r == NULL)
		return -1;
	if (r->type == REDIS_REPLY_ERROR)
	{
		freeReplyObject(r);
		return -1;
	}
	/* [[stream, [entries]]] or nil */
	if (r->type == REDIS_REPLY_ARRAY && r->elements >= 1 &&
		r->element[0]->type == REDIS_REPLY_ARRAY &&
		r->element[0]->elements >= 2)
		n = parse_entries(r->element[0]->element[1], out, max, 0);
	freeReplyObject(r);
	return n;
}

/*
 * Messages pending (delivered, never acked) for longer than min_idle_ms, from
 * any consumer: a dead worker's, or ones left unacked after busy or a
 * failure.  cursor is XAUTOCLAIM's: "0-0" to start a scan.
 */
int
queue_autoclaim(queue *q, const char *consumer, int min_idle_ms,
				char *cursor, size_t cursorlen, int count,
				queue_msg *out, int max)
{
	char		idle[16],
				cnt[16];
	const char *argv[] = {"XAUTOCLAIM", q->stream, q->group, consumer, idle,
		cursor, "COUNT", cnt};
	redisReply *r;
	int			n = 0;

	snprintf(idle, sizeof(idle), "%d", min_idle_ms);
	snprintf(cnt, sizeof(cnt), "%d", count);
	r = command_argv(q, 8, argv);
	if (r == NULL)
		return -1;
	if (r->type == REDIS_REPLY_ERROR)
	{
		freeReplyObject(r);
		return -1;
	}
	if (r->type == REDIS_REPLY_ARRAY && r->elements >= 2)
	{
		if (r->element[0]->type == REDIS_REPLY_STRING)
			snprintf(cursor, cursorlen, "%s", r->element[0]->str);
		n = parse_entries(r->element[1], out, max, 1);
	}
	freeReplyObject(r);
	return n;
}

/* 1 acked now, 0 already acked (by another consumer), -1 error. */
int
queue_ack(queue *q, const char *id)
{
	const char *argv[] = {"XACK", q->stream, q->group, id};
	redisReply *r = command_argv(q, 4, argv);
	int			rc = -1;

	if (r && r->type == REDIS_REPLY_INTEGER)
		rc = (int) r->integer;
	if (r)
		freeReplyObject(r);
	return rc;
}

/* XACK of many ids in one command.  Returns the count acked, or -1. */
int
queue_ack_many(queue *q, const char *const *ids, int n)
{
	const char **argv;
	redisReply *r;
	int			rc = -1,
				i;

	if (n <= 0)
		return 0;
	argv = malloc(sizeof(char *) * (n + 3));
	if (argv == NULL)
		return -1;
	argv[0] = "XACK";
	argv[1] = q->stream;
	argv[2] = q->group;
	for (i = 0; i < n; i++)
		argv[3 + i] = ids[i];
	r = command_argv(q, n + 3, argv);
	free(argv);
	if (r && r->type == REDIS_REPLY_INTEGER)
		rc = (int) r->integer;
	if (r)
		freeReplyObject(r);
	return rc;
}

int
queue_drop_stream(queue *q)
{
	const char *argv[] = {"DEL", q->stream};
	redisReply *r = command_argv(q, 2, argv);

	if (r)
		freeReplyObject(r);
	return r ? 0 : -1;
}

/*
 * The id of the stream's last entry (XREVRANGE ... COUNT 1) into last: ""
 * when the stream is empty or missing.  0 on success.
 */
int
queue_last_id(queue *q, char *last, size_t len)
{
	const char *argv[] = {"XREVRANGE", q->stream, "+", "-", "COUNT", "1"};
	redisReply *r = command_argv(q, 6, argv);
	int			rc = -1;

	snprintf(last, len, "%s", "");
	if (r && r->type == REDIS_REPLY_ARRAY)
	{
		rc = 0;
		if (r->elements > 0 && r->element[0]->type == REDIS_REPLY_ARRAY &&
			r->element[0]->elements > 0)
			field_copy(last, len, r->element[0]->element[0]);
	}
	if (r)
		freeReplyObject(r);
	return rc;
}

/*
 * The group's state from the broker itself: pending count and the last id
 * handed out (XINFO GROUPS).  0 on success.  The broker is the authority on
 * what was acknowledged: a worker killed right after its XACK reached the
 * server never counted it.
 */
int
queue_group_state(queue *q, long *pending, char *last_delivered, size_t len)
{
	const char *argv[] = {"XINFO", "GROUPS", q->stream};
	redisReply *r = command_argv(q, 3, argv);
	size_t		i,
				j;
	int			rc = -1;

	if (r && r->type == REDIS_REPLY_ARRAY)
	{
		for (i = 0; i < r->elements; i++)
		{
			const redisReply *g = r->element[i];
			int			ours = 0;
			long		pend = -1;
			char		last[48] = "";

			if (g->type != REDIS_REPLY_ARRAY)
				continue;
			for (j = 0; j + 1 < g->elements; j += 2)
			{
				const redisReply *k = g->element[j],
						   *v = g->element[j + 1];

				if (k->type != REDIS_REPLY_STRING)
					continue;
				if (strcmp(k->str, "name") == 0 && v->type == REDIS_REPLY_STRING)
					ours = strcmp(v->str, q->group) == 0;
				else if (strcmp(k->str, "pending") == 0 && v->type == REDIS_REPLY_INTEGER)
					pend = (long) v->integer;
				else if (strcmp(k->str, "last-delivered-id") == 0)
					field_copy(last, sizeof(last), v);
			}
			if (ours)
			{
				*pending = pend;
				snprintf(last_delivered, len, "%s", last);
				rc = pend >= 0 ? 0 : -1;
			}
		}
	}
	if (r)
		freeReplyObject(r);
	return rc;
}
