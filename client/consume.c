/*
 * consume.c
 *	  The stream consumer (idem_consumer_*): a Valkey stream of idem_emit's
 *	  messages read with a consumer group, each entry run through the runner
 *	  with its message id as the run id, acknowledged once its run is
 *	  settled.  idem_client.h says what is acknowledged and what is left
 *	  pending; the rule is consumer_settled().
 *
 *	  Durable before acknowledged.  An XACK removes the entry from the
 *	  group's pending list for good, so the answer it acts on must survive
 *	  a crash of the server; the session's synchronous_commit (off on the
 *	  consumer's connection, say) must not decide that.  Each run's
 *	  transaction therefore runs with synchronous_commit at least on, set
 *	  locally (idem_pg.durable: one statement in the pipeline that starts
 *	  the transaction, no round trip of its own).  Every answer the
 *	  consumer acknowledges is then durable when idem_run_with returns:
 *	    - applied, failed_permanent recorded by this run: its COMMIT
 *	      flushed, and waited for the synchronous standbys, as with on;
 *	    - replayed, failed_permanent or mismatch answered from PostgreSQL
 *	      (the claim, idem_apply, the lookup of step 3a): read from another
 *	      transaction's row, perhaps committed with off and not flushed;
 *	      the server answers only once that commit is as durable as the
 *	      asking transaction's would be (idem_replay_durable), so on
 *	      flushes it first;
 *	    - replayed from Valkey: the worker copies a result only after its
 *	      commit is flushed and on the standbys idem waits for; no
 *	      PostgreSQL statement ran, and none is needed.
 *	  Cheaper ways were weighed: a flush per round (one transaction with
 *	  an xid, committed with on, before the round's XACK) saves flushes
 *	  only for a session set to off, costs every consumer a round trip
 *	  per round, and is wrong after a reconnect (a commit lost with the
 *	  old connection is not in the new server's WAL to flush).  With on,
 *	  the default, the setting costs nothing: the commit flushed anyway.
 *
 *	  Its Valkey connection is a router of its own (the shared router: a
 *	  single Valkey as a one-node map, or a cluster whose stream's slot
 *	  routes every command), with blocking reads bounded by block_ms and
 *	  the command timeout.  Dead connections are not reconnected and
 *	  resent at once (reconnect_dead off): a read sent twice would hand
 *	  entries to this consumer that it never saw (they would wait for
 *	  XAUTOCLAIM); the next poll connects again.
 *
 *	  Locking: none; a consumer is used by one thread at a time, as its
 *	  runner.
 */
#include "internal.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <hiredis/hiredis.h>

#include "valkey_router.h"

#define CONSUMER_OPTIONS_SIZE_MIN \
	IDEM_SIZE_THROUGH(idem_consumer_options, settled_arg)
#define CONSUMER_STATS_SIZE_MIN \
	IDEM_SIZE_THROUGH(idem_consumer_stats, valkey_errors)

struct idem_consumer
{
	idem_runner *runner;
	idem_consumer_options o;	/* strings below are our copies */
	char	   *stream;
	char	   *group;
	char	   *name;
	char	   *scope;
	char	   *dead_letter;
	char	   *host;
	char	   *password;
	char	   *nodes;
	int			port;
	idem_vc    *vc;
	int			group_ready;	/* XGROUP CREATE done on this connection */
	int64_t		next_claim;		/* monotonic ms: XAUTOCLAIM not before */
	char		claim_cursor[64];	/* XAUTOCLAIM's cursor ("0-0": from the
									 * start) */
	char		err[512];
	idem_consumer_stats stats;
	/* the entries of this round that are settled: acknowledged together */
	char	  **ack;
	int			nack;
	int			ack_cap;
};

static const idem_consumer_options consumer_defaults = {
	.struct_size = sizeof(idem_consumer_options),
	.count = 10,
	.block_ms = 1000,
	.claim_idle_ms = 30000,
	.valkey_connect_timeout_ms = 200,
	.valkey_command_timeout_ms = 1000,
};

void
idem_consumer_options_init_size(idem_consumer_options *opts, size_t size)
{
	idemc_struct_init(opts, size, CONSUMER_OPTIONS_SIZE_MIN,
					  &consumer_defaults, sizeof(consumer_defaults));
}

void
idem_consumer_stats_init_size(idem_consumer_stats *stats, size_t size)
{
	idemc_struct_init(stats, size, CONSUMER_STATS_SIZE_MIN, NULL, 0);
}

static void
notice(idem_consumer *c, const char *fmt,...)
{
	char		msg[600];
	va_list		ap;

	if (c->o.notice == NULL)
		return;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	c->o.notice(c->o.notice_arg, msg);
}

static char *
dup_opt(const char *s, int *oom)
{
	char	   *d;

	if (s == NULL || s[0] == '\0')
		return NULL;
	d = strdup(s);
	if (d == NULL)
		*oom = 1;
	return d;
}

/* The options' problem, or NULL. */
static const char *
options_problem(const idem_consumer_options *o)
{
	if (o->stream == NULL || o->stream[0] == '\0')
		return "stream is required";
	if (o->group == NULL || o->group[0] == '\0')
		return "group is required";
	if (o->consumer == NULL || o->consumer[0] == '\0')
		return "consumer (this consumer's name in the group) is required";
	if (o->task_scope == NULL || o->task_scope[0] == '\0')
		return "task_scope is required";
	if (o->handler == NULL &&
		(o->run_options == NULL || o->run_options->sql_handler == NULL))
		return "a handler, or run_options->sql_handler, is required";
	if (o->count < 1 || o->count > 10000)
		return "count must be 1 to 10000";
	if (o->block_ms < 1 || o->claim_idle_ms < 1 ||
		o->valkey_connect_timeout_ms < 1 || o->valkey_command_timeout_ms < 1)
		return "block_ms, claim_idle_ms and the Valkey timeouts must be positive";
	return NULL;
}

idem_consumer *
idem_consumer_open(idem_runner *runner, const char *valkey_host, int valkey_port,
				   const idem_consumer_options *opts)
{
	idem_consumer *c = calloc(1, sizeof(idem_consumer));
	int			oom = 0;
	const char *problem = NULL;

	if (c == NULL)
		return NULL;
	c->runner = runner;
	c->o = consumer_defaults;
	c->stats.struct_size = sizeof(c->stats);
	snprintf(c->claim_cursor, sizeof(c->claim_cursor), "0-0");
	if (opts == NULL || !IDEM_STRUCT_SIZE_OK(opts->struct_size,
											 CONSUMER_OPTIONS_SIZE_MIN))
		problem = "options were not initialised by idem_consumer_options_init()";
	else
	{
		memcpy(&c->o, opts, IDEM_MIN_SIZE(opts->struct_size, sizeof(c->o)));
		c->o.struct_size = sizeof(c->o);
		problem = options_problem(&c->o);
	}
	if (problem == NULL && runner == NULL)
		problem = "no runner";
	if (problem == NULL && (valkey_host == NULL || valkey_host[0] == '\0'))
		problem = "a Valkey host is required";
	if (problem != NULL)
	{
		snprintf(c->err, sizeof(c->err), "invalid consumer options: %s", problem);
		return c;
	}
	c->stream = dup_opt(c->o.stream, &oom);
	c->group = dup_opt(c->o.group, &oom);
	c->name = dup_opt(c->o.consumer, &oom);
	c->scope = dup_opt(c->o.task_scope, &oom);
	c->dead_letter = dup_opt(c->o.dead_letter_stream, &oom);
	c->host = dup_opt(valkey_host, &oom);
	c->password = dup_opt(c->o.valkey_password, &oom);
	c->nodes = dup_opt(c->o.valkey_nodes, &oom);
	c->port = valkey_port > 0 ? valkey_port : 6379;
	if (oom)
	{
		idem_consumer_close(c);
		return NULL;
	}
	return c;
}

void
idem_consumer_close(idem_consumer *c)
{
	int			i;

	if (c == NULL)
		return;
	idem_vc_free(c->vc);
	for (i = 0; i < c->nack; i++)
		free(c->ack[i]);
	free(c->ack);
	free(c->stream);
	free(c->group);
	free(c->name);
	free(c->scope);
	free(c->dead_letter);
	free(c->host);
	free(c->password);
	free(c->nodes);
	free(c);
}

const char *
idem_consumer_error_message(const idem_consumer *c)
{
	return c ? c->err : "no consumer";
}

void
idem_consumer_get_stats(const idem_consumer *c, idem_consumer_stats *out)
{
	if (c == NULL || out == NULL ||
		!IDEM_STRUCT_SIZE_OK(out->struct_size, CONSUMER_STATS_SIZE_MIN))
		return;
	idemc_struct_copy_out(out, &c->stats, sizeof(c->stats));
}

/* ---- Valkey ---- */

/* The router, opened.  0, or -1 with err set. */
static int
vc_ready(idem_consumer *c)
{
	char		e[256];

	if (c->vc == NULL)
	{
		idem_vc_options opt;

		memset(&opt, 0, sizeof(opt));
		opt.password = c->password;
		opt.db = c->o.valkey_db;
		opt.connect_timeout_ms = c->o.valkey_connect_timeout_ms;
		opt.retry_ms = 0;
		c->vc = idemc_vc_client_new(c->host, c->port, c->nodes,
									c->o.valkey_cluster, &opt, e, sizeof(e));
		if (c->vc == NULL)
		{
			snprintf(c->err, sizeof(c->err), "Valkey: %s", e);
			return -1;
		}
	}
	if (idem_vc_is_open(c->vc))
		return 0;
	c->group_ready = 0;
	if (idem_vc_open(c->vc, c->o.valkey_connect_timeout_ms +
					 c->o.valkey_command_timeout_ms, e, sizeof(e)) != 0)
	{
		snprintf(c->err, sizeof(c->err), "Valkey at %s:%d: %s", c->host,
				 c->port, e);
		return -1;
	}
	return 0;
}

/* One command on the stream's node; its reply (the caller frees) or NULL
 * with err set.  wait_ms: how long the server may hold it (BLOCK). */
static redisReply *
command(idem_consumer *c, int argc, const char **argv, int wait_ms)
{
	idem_vc_cmd cmd;

	memset(&cmd, 0, sizeof(cmd));
	cmd.key = c->stream;
	cmd.keylen = strlen(c->stream);
	cmd.argc = argc;
	cmd.argv = argv;
	(void) idem_vc_pipeline(c->vc, &cmd, 1, idemc_now_ms() + wait_ms +
							c->o.valkey_command_timeout_ms);
	if (cmd.reply == NULL)
	{
		snprintf(c->err, sizeof(c->err), "Valkey: no answer to %s: %s",
				 argv[0], idem_vc_last_error(c->vc));
		c->stats.valkey_errors++;
		idem_vc_close_all(c->vc);	/* the next poll connects again */
		c->group_ready = 0;		/* to a Valkey that may have restarted empty */
		return NULL;
	}
	if (cmd.reply->type == REDIS_REPLY_ERROR)
	{
		snprintf(c->err, sizeof(c->err), "Valkey: %s %s refused: %.300s",
				 argv[0], argc > 1 ? argv[1] : "", cmd.reply->str);
		if (strncmp(cmd.reply->str, "NOGROUP", 7) == 0)
			c->group_ready = 0; /* the stream or the group went (FLUSHALL) */
	}
	return cmd.reply;
}

/* The group, created from the stream's start (nothing published before the
 * first consumer is lost) if missing.  0 or -1. */
static int
group_ready(idem_consumer *c)
{
	const char *argv[6] = {"XGROUP", "CREATE", c->stream, c->group, "0",
	"MKSTREAM"};
	redisReply *r;
	int			ok;

	if (c->group_ready)
		return 0;
	r = command(c, 6, argv, 0);
	if (r == NULL)
		return -1;
	ok = r->type != REDIS_REPLY_ERROR || strncmp(r->str, "BUSYGROUP", 9) == 0;
	freeReplyObject(r);
	if (!ok)
		return -1;
	c->group_ready = 1;
	return 0;
}

/* ---- one entry ---- */

static int
ack_later(idem_consumer *c, const char *entry_id)
{
	char	   *d;

	if (c->nack == c->ack_cap)
	{
		int			cap = c->ack_cap ? c->ack_cap * 2 : 16;
		char	  **grown = realloc(c->ack, sizeof(char *) * cap);

		if (grown == NULL)
			return -1;
		c->ack = grown;
		c->ack_cap = cap;
	}
	d = strdup(entry_id);
	if (d == NULL)
		return -1;
	c->ack[c->nack++] = d;
	return 0;
}

/* A field's value in an entry's [f, v, f, v ...], or NULL. */
static const redisReply *
field(const redisReply *fields, const char *name)
{
	size_t		i;

	if (fields == NULL || fields->type != REDIS_REPLY_ARRAY)
		return NULL;
	for (i = 0; i + 1 < fields->elements; i += 2)
	{
		const redisReply *f = fields->element[i];

		if (f->type == REDIS_REPLY_STRING && strcmp(f->str, name) == 0)
			return fields->element[i + 1]->type == REDIS_REPLY_STRING ?
				fields->element[i + 1] : NULL;
	}
	return NULL;
}

/*
 * A malformed entry: told, copied to the dead-letter stream if there is
 * one, then acknowledged (unless that copy failed: it comes back).
 */
static void
malformed(idem_consumer *c, const char *entry_id, const redisReply *id,
		  const redisReply *body, const char *why)
{
	c->stats.malformed++;
	notice(c, "stream %s, entry %s: malformed (%s): %s", c->stream, entry_id,
		   why, c->dead_letter ? "dead-lettered and acknowledged" : "acknowledged");
	if (c->dead_letter)
	{
		/* the entry as it came, with where and why */
		const char *argv[13] = {"XADD", c->dead_letter, "*", "stream", c->stream,
		"entry", entry_id, "reason", why};
		size_t		argvlen[13];
		int			argc = 9;
		int			i;
		redisReply *r;
		idem_vc_cmd cmd;

		for (i = 0; i < argc; i++)
			argvlen[i] = strlen(argv[i]);
		if (id)
		{
			argv[argc] = "id";
			argvlen[argc++] = 2;
			argv[argc] = id->str;
			argvlen[argc++] = id->len;
		}
		if (body)
		{
			argv[argc] = "body";
			argvlen[argc++] = 4;
			argv[argc] = body->str;
			argvlen[argc++] = body->len;
		}
		memset(&cmd, 0, sizeof(cmd));
		cmd.key = c->dead_letter;
		cmd.keylen = strlen(c->dead_letter);
		cmd.argc = argc;
		cmd.argv = argv;
		cmd.argvlen = argvlen;
		(void) idem_vc_pipeline(c->vc, &cmd, 1, idemc_now_ms() +
								c->o.valkey_command_timeout_ms);
		r = cmd.reply;
		if (r == NULL || r->type == REDIS_REPLY_ERROR)
		{
			c->stats.valkey_errors++;
			c->stats.left_pending++;
			notice(c, "stream %s, entry %s: the dead-letter XADD to %s failed: left pending",
				   c->stream, entry_id, c->dead_letter);
			if (r)
				freeReplyObject(r);
			return;
		}
		freeReplyObject(r);
		c->stats.dead_lettered++;
	}
	if (ack_later(c, entry_id) != 0)
		c->stats.left_pending++;
}

/* Is this result settled (acknowledge), or must the entry come back? */
static int
consumer_settled(const idem_result *res)
{
	switch (res->status)
	{
		case IDEM_APPLIED:
		case IDEM_REPLAYED:
		case IDEM_FAILED_PERMANENT:
		case IDEM_MISMATCH:		/* the id came with another body: the
								 * ledger's answer stands for good */
			return 1;
		default:
			return 0;			/* busy, retryable, errors: redelivered */
	}
}

static void
run_entry(idem_consumer *c, const redisReply *entry, int first_read)
{
	const redisReply *eid;
	const redisReply *id;
	const redisReply *body;
	idem_run_options ro;
	idem_result res;
	uint8_t		key[IDEM_DIGEST_BYTES];
	int			settled;
	int			was_durable;

	if (entry == NULL || entry->type != REDIS_REPLY_ARRAY || entry->elements < 2 ||
		entry->element[0]->type != REDIS_REPLY_STRING)
		return;					/* an entry deleted meanwhile: nothing */
	eid = entry->element[0];
	c->stats.read++;
	id = field(entry->element[1], "id");
	body = field(entry->element[1], "body");
	if (id == NULL || body == NULL)
	{
		malformed(c, eid->str, id, body, id ? "no body field" : "no id field");
		return;
	}
	if (id->len == 0 || strlen(id->str) != id->len ||
		idem_key(c->scope, id->str, key) != 0)
	{
		malformed(c, eid->str, NULL, body, "the id is empty or not UTF-8");
		return;
	}
	if (strlen(body->str) != body->len ||
		idem_fingerprint(body->str, body->len, key, NULL, 0) != 0)
	{
		malformed(c, eid->str, id, body, "the body is not JSON");
		return;
	}
	idem_run_options_init(&ro);
	if (c->o.run_options != NULL)
		memcpy(&ro, c->o.run_options,
			   IDEM_MIN_SIZE(c->o.run_options->struct_size, sizeof(ro)));
	ro.struct_size = sizeof(ro);
	if (ro.delivery_count == 0)
		ro.delivery_count = first_read ? 1 : 2;
	idem_result_init(&res);
	/* durable before it is acknowledged: see the header */
	was_durable = c->runner->pg.durable;
	c->runner->pg.durable = 1;
	if (c->o.platform)
		idem_run_platform_with(c->runner, c->scope, id->str, body->str, &ro,
							   c->o.handler, c->o.user_data, &res);
	else
		idem_run_with(c->runner, c->o.tenant_id, c->scope, id->str, body->str,
					  &ro, c->o.handler, c->o.user_data, &res);
	c->runner->pg.durable = was_durable;
	settled = consumer_settled(&res);
	if (settled && ack_later(c, eid->str) != 0)
		settled = 0;
	if (!settled)
		c->stats.left_pending++;
	if (c->o.settled)
		c->o.settled(c->o.settled_arg, id->str, &res, settled);
}

/* Run the entries of an array ([[entry id, fields], ...]); how many. */
static int
run_entries(idem_consumer *c, const redisReply *entries, int first_read)
{
	size_t		i;
	int			n = 0;

	if (entries == NULL || entries->type != REDIS_REPLY_ARRAY)
		return 0;
	for (i = 0; i < entries->elements; i++)
	{
		const redisReply *e = entries->element[i];

		if (e->type != REDIS_REPLY_ARRAY)
			continue;
		run_entry(c, e, first_read);
		n++;
	}
	return n;
}

/* XACK the round's settled entries in one command.  0 or -1. */
static int
ack_all(idem_consumer *c)
{
	const char **argv;
	redisReply *r;
	int			i;
	int			ok;

	if (c->nack == 0)
		return 0;
	argv = malloc(sizeof(char *) * (c->nack + 3));
	if (argv == NULL)
	{
		snprintf(c->err, sizeof(c->err), "out of memory");
		ok = 0;
	}
	else
	{
		argv[0] = "XACK";
		argv[1] = c->stream;
		argv[2] = c->group;
		for (i = 0; i < c->nack; i++)
			argv[3 + i] = c->ack[i];
		r = command(c, c->nack + 3, argv, 0);
		ok = r != NULL && r->type == REDIS_REPLY_INTEGER;
		if (r)
			freeReplyObject(r);
		free(argv);
	}
	if (ok)
		c->stats.acked += c->nack;
	else
		c->stats.left_pending += c->nack;	/* they come back: replayed */
	for (i = 0; i < c->nack; i++)
		free(c->ack[i]);
	c->nack = 0;
	return ok ? 0 : -1;
}

static void
sleep_ms(int ms)
{
	struct timespec ts;

	ts.tv_sec = ms / 1000;
	ts.tv_nsec = (long) (ms % 1000) * 1000000L;
	while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
		;
}

/* Entries idle for claim_idle_ms, taken over: how many ran, or -1. */
static int
claim_round(idem_consumer *c)
{
	char		idle[16];
	char		count[16];
	const char *argv[8] = {"XAUTOCLAIM", c->stream, c->group, c->name, idle,
	c->claim_cursor, "COUNT", count};
	redisReply *r;
	int			n = 0;

	snprintf(idle, sizeof(idle), "%d", c->o.claim_idle_ms);
	snprintf(count, sizeof(count), "%d", c->o.count);
	r = command(c, 8, argv, 0);
	if (r == NULL)
		return -1;
	if (r->type == REDIS_REPLY_ARRAY && r->elements >= 2 &&
		r->element[0]->type == REDIS_REPLY_STRING)
	{
		snprintf(c->claim_cursor, sizeof(c->claim_cursor), "%s",
				 r->element[0]->str);
		n = run_entries(c, r->element[1], 0);
		c->stats.claimed += n;
	}
	else
		n = -1;
	freeReplyObject(r);
	/* more to take over: at once; else after half the idle time */
	c->next_claim = strcmp(c->claim_cursor, "0-0") != 0 ? 0 :
		idemc_now_ms() + (c->o.claim_idle_ms + 1) / 2;
	return n;
}

int
idem_consumer_poll(idem_consumer *c)
{
	char		count[16];
	char		block[16];
	const char *argv[11];
	redisReply *r;
	int			n = 0;

	if (c == NULL || c->stream == NULL)
		return -1;				/* invalid options: err says why */
	c->err[0] = '\0';
	if (vc_ready(c) != 0 || group_ready(c) != 0)
	{
		sleep_ms(c->o.block_ms);
		return -1;
	}
	if (idemc_now_ms() >= c->next_claim)
	{
		n = claim_round(c);
		if (ack_all(c) != 0 || n < 0)
			return -1;
		if (n > 0)
			return n;
	}
	snprintf(count, sizeof(count), "%d", c->o.count);
	snprintf(block, sizeof(block), "%d", c->o.block_ms);
	argv[0] = "XREADGROUP";
	argv[1] = "GROUP";
	argv[2] = c->group;
	argv[3] = c->name;
	argv[4] = "COUNT";
	argv[5] = count;
	argv[6] = "BLOCK";
	argv[7] = block;
	argv[8] = "STREAMS";
	argv[9] = c->stream;
	argv[10] = ">";
	r = command(c, 11, argv, c->o.block_ms);
	if (r == NULL)
		return -1;
	if (r->type == REDIS_REPLY_ERROR)
	{
		freeReplyObject(r);
		sleep_ms(c->o.block_ms / 10 + 1);
		return -1;
	}
	/* nil: nothing came within block_ms; else [[stream, entries]] */
	if (r->type == REDIS_REPLY_ARRAY && r->elements >= 1 &&
		r->element[0]->type == REDIS_REPLY_ARRAY &&
		r->element[0]->elements >= 2)
		n = run_entries(c, r->element[0]->element[1], 1);
	freeReplyObject(r);
	if (ack_all(c) != 0)
		return -1;
	return n;
}
