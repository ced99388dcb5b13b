/*-------------------------------------------------------------------------
 *
 * worker_router.c
 *	  The worker's router, for a Valkey Cluster and a single Valkey alike:
 *	  mode detection at connect, and the copy of the commit ring's batches
 *	  through the shared router (valkey_router.c).
 *
 * worker_connect() calls worker_router_connect() when the worker (re)connects.
 * The router opens the first node of idem.valkey_host:idem.valkey_port then
 * idem.valkey_nodes that answers and asks it INFO cluster (idem.valkey_cluster
 * = on or off skips the question).  A node that is not a cluster is the
 * router's one node: worker_drain_single() pipelines its batches to it
 * (worker_router_single_*), and worker_command() sends the worker's other
 * commands through worker_router_command(), as on a cluster.  A cluster:
 * worker_router_send() writes the batches worker_drain_cluster() takes from
 * the commit ring (durable records, encoded and MACed by
 * worker_encode_record()): up to IDEM_BATCH_MAX records, each SET routed to
 * the master of its key's slot, all nodes pipelined at once.
 * worker_router_collect() reads the replies, redirects followed by the router;
 * worker_drain_cluster() sleeps out idem.valkey_batch_delay in between
 * (worker_router_copy() does both at once).  A batch leaves the ring only when
 * every SET in it has a reply from the node that owns its key; otherwise (node
 * down, failover in progress, deadline, a "not now" reply) the whole batch
 * stays queued and its unanswered SETs are sent again (worker_drain_cluster():
 * every 100 ms while other nodes answer, sending the batches behind it ahead
 * to them meanwhile with worker_cluster_send_ahead(); after the worker's
 * backoff when none does, then the whole batch): a SET is idempotent, and the
 * copies are counted only when the batch leaves the ring, so none is lost or
 * counted twice.
 *
 * Waits go through a WaitEventSet per socket that also holds the latch and
 * postmaster death, so SIGTERM is answered at once.  The sets are cached
 * per file descriptor and freed when the router closes that socket.
 * Runs in the worker only; no shared state besides the queue and the stats.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "postmaster/interrupt.h"
#include "storage/latch.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"

#include "worker_router.h"
#include "cache_format.h"
#include "compat.h"
#include "guc.h"
#include "commit_ring.h"
#include "stats.h"
#include "valkey_router.h"
#include "valkey_reply.h"

typedef struct WorkerRouterWait
{
	int			fd;				/* -1: free slot */
	WaitEventSet *wes;
	int			pos;
} WorkerRouterWait;

static idem_vc *worker_vc = NULL;
static WorkerRouterWait worker_router_waits[IDEM_VC_MAX_NODES];
static idem_vc_stats worker_router_reported;	/* what idem_stats() has seen */
static bool worker_router_reports = true;	/* WorkerValkeyTarget.report */

/*
 * Each node's errors under the routers closed before this one (the worker
 * makes a new one at each reconnect, as after a failed batch during a
 * failover), so that idem_stats() still names the node that failed.
 */
typedef struct WorkerRouterPastErrors
{
	char		name[IDEM_VC_HOST_MAX + 8];
	long long	errors;
} WorkerRouterPastErrors;

static WorkerRouterPastErrors worker_router_past[IDEM_VC_MAX_NODES];
static int	worker_router_npast = 0;

/* Per batch: the encoded commands (allocated once). */
typedef struct WorkerRouterSlot
{
	char		key[IDEM_CACHE_KEY_MAX];
	char		value[IDEM_CACHE_VALUE_MAX];
	char		ttl[32];
	const char *argv[5];
	size_t		argvlen[5];
	int			record;			/* index of its record in the batch */
} WorkerRouterSlot;

static WorkerRouterSlot *worker_router_slots = NULL;
static idem_vc_cmd *worker_router_cmds = NULL;

static void worker_router_publish_nodes(void);
static void worker_router_publish_stats(void);

static void
worker_router_forget_fd(void *arg, int fd)
{
	int			i;

	for (i = 0; i < IDEM_VC_MAX_NODES; i++)
		if (worker_router_waits[i].fd == fd)
		{
			FreeWaitEventSet(worker_router_waits[i].wes);
			worker_router_waits[i].fd = -1;
			worker_router_waits[i].wes = NULL;
		}
}

static WorkerRouterWait *
worker_router_wait_for(int fd)
{
	int			i;
	int			free_slot = -1;
	WorkerRouterWait *w;

	for (i = 0; i < IDEM_VC_MAX_NODES; i++)
	{
		if (worker_router_waits[i].fd == fd)
			return &worker_router_waits[i];
		if (worker_router_waits[i].fd < 0 && free_slot < 0)
			free_slot = i;
	}
	if (free_slot < 0)
		elog(ERROR, "more Valkey sockets than nodes");
	w = &worker_router_waits[free_slot];
	w->wes = idem_create_wait_event_set(3);
	AddWaitEventToSet(w->wes, WL_LATCH_SET, PGINVALID_SOCKET, MyLatch, NULL);
	AddWaitEventToSet(w->wes, WL_EXIT_ON_PM_DEATH, PGINVALID_SOCKET, NULL, NULL);
	w->pos = AddWaitEventToSet(w->wes, WL_SOCKET_WRITEABLE, fd, NULL, NULL);
	w->fd = fd;
	return w;
}

/* idem_vc_io.wait: latch wakeups are absorbed, SIGTERM abandons. */
static int
worker_router_wait(void *arg, int fd, int for_write, int64_t deadline_ms)
{
	for (;;)
	{
		long		timeout = (long) (deadline_ms - idem_vc_now_ms());
		uint32		events = for_write ? WL_SOCKET_WRITEABLE : WL_SOCKET_READABLE;

		if (ShutdownRequestPending)
			return -2;
		if (timeout <= 0)
			return fd < 0 ? 0 : -1;
		if (fd < 0)
		{
			(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
							 timeout, PG_WAIT_EXTENSION);
			ResetLatch(MyLatch);
		}
		else
		{
			WorkerRouterWait *w = worker_router_wait_for(fd);
			WaitEvent	ev;
			int			rc;

			ModifyWaitEvent(w->wes, w->pos, events, NULL);
			rc = WaitEventSetWait(w->wes, timeout, &ev, 1, PG_WAIT_EXTENSION);
			if (rc > 0 && (ev.events & WL_LATCH_SET))
			{
				ResetLatch(MyLatch);
				continue;
			}
			if (rc > 0 && (ev.events & events))
				return 0;
		}
	}
}

bool
worker_router_active(void)
{
	return worker_vc != NULL && idem_vc_is_cluster(worker_vc);
}

bool
worker_router_connected(void)
{
	return worker_vc != NULL && idem_vc_is_open(worker_vc);
}

/*
 * The entry of a node name in worker_router_past, added if room; NULL if
 * full.
 */
static WorkerRouterPastErrors *
worker_router_past_entry(const char *name)
{
	int			i;

	for (i = 0; i < worker_router_npast; i++)
		if (strcmp(worker_router_past[i].name, name) == 0)
			return &worker_router_past[i];
	if (worker_router_npast == IDEM_VC_MAX_NODES)
		return NULL;
	strlcpy(worker_router_past[worker_router_npast].name, name, sizeof(worker_router_past[worker_router_npast].name));
	worker_router_past[worker_router_npast].errors = 0;
	return &worker_router_past[worker_router_npast++];
}

/* A node's errors since the worker started: past routers' and this one's. */
static long long
worker_router_node_errors(int i)
{
	WorkerRouterPastErrors *p = worker_router_past_entry(idem_vc_node_name(worker_vc, i));

	return idem_vc_node_errors(worker_vc, i) + (p ? p->errors : 0);
}

void
worker_router_disconnect(void)
{
	if (worker_vc != NULL)
	{
		int			i;

		for (i = 0; i < idem_vc_nnodes(worker_vc); i++)
		{
			WorkerRouterPastErrors *p = worker_router_past_entry(idem_vc_node_name(worker_vc, i));

			if (p)
				p->errors += idem_vc_node_errors(worker_vc, i);
		}
		worker_router_report_stats();
		/* closes the sockets through worker_router_forget_fd */
		idem_vc_free(worker_vc);
		worker_vc = NULL;
	}
}

/* The nodes to try: the target's host:port ([host]:port for an IPv6
 * address), if it has a host, then its nodes. */
static char *
worker_router_seeds(const WorkerValkeyTarget *t)
{
	StringInfoData s;
	char		first[IDEM_VC_HOST_MAX + 8];

	initStringInfo(&s);
	if (t->host[0] != '\0')
	{
		idem_vc_format_endpoint(first, sizeof(first), t->host, t->port);
		appendStringInfoString(&s, first);
	}
	if (t->nodes[0] != '\0')
		appendStringInfo(&s, "%s%s", s.len > 0 ? "," : "", t->nodes);
	return s.data;
}

WorkerRouterConnect
worker_router_connect(const WorkerValkeyTarget *t, const char *password,
					  char *errbuf, size_t errlen)
{
	idem_vc_options opt;
	idem_vc_io	io;
	char	   *seeds;
	int			rc;
	int			i;

	worker_router_disconnect();
	for (i = 0; i < IDEM_VC_MAX_NODES; i++)
		if (worker_router_waits[i].wes == NULL)
			worker_router_waits[i].fd = -1;
	worker_router_reports = t->report;
	seeds = worker_router_seeds(t);
	memset(&opt, 0, sizeof(opt));
	opt.seeds = seeds;
	opt.default_port = t->port;
	opt.password = password;
	opt.db = t->db;
	opt.mode = t->cluster == IDEM_VALKEY_CLUSTER_ON ?
		IDEM_VC_MODE_CLUSTER :
		t->cluster == IDEM_VALKEY_CLUSTER_OFF ?
		IDEM_VC_MODE_SINGLE : IDEM_VC_MODE_AUTO;
	opt.connect_timeout_ms = idem_valkey_connect_timeout_ms;
	opt.retry_ms = 100;
	io.wait = worker_router_wait;
	io.closing = worker_router_forget_fd;
	io.arg = NULL;
	worker_vc = idem_vc_new(&opt, &io, errbuf, errlen);
	pfree(seeds);
	if (worker_vc == NULL)
		return WORKER_ROUTER_FAILED;
	memset(&worker_router_reported, 0, sizeof(worker_router_reported));
	rc = idem_vc_open(worker_vc, idem_valkey_connect_timeout_ms +
					  idem_valkey_command_timeout_ms, errbuf, errlen);
	if (rc == 0 && idem_vc_is_cluster(worker_vc))
	{
		if (worker_router_slots == NULL)
		{
			worker_router_slots = MemoryContextAllocHuge(TopMemoryContext,
											  sizeof(WorkerRouterSlot) * IDEM_BATCH_MAX);
			worker_router_cmds = MemoryContextAlloc(TopMemoryContext,
										 sizeof(idem_vc_cmd) * IDEM_BATCH_MAX);
		}
		worker_router_publish_nodes();
		worker_router_publish_stats();
		return WORKER_ROUTER_CLUSTER;
	}
	worker_router_publish_stats();
	if (worker_router_reports)
		idem_stats_set_cluster(false, "");
	if (rc == 0)
		return WORKER_ROUTER_SINGLE;	/* the router's one node: worker_vc stays */
	idem_vc_free(worker_vc);
	worker_vc = NULL;
	if (rc == -3)
		return WORKER_ROUTER_SHUTDOWN;
	if (rc == -2)
	{
		snprintf(errbuf, errlen,
				 "%sdb is %d, but a Valkey Cluster has only database 0: set %sdb = 0",
				 t->prefix, t->db, t->prefix);
		return WORKER_ROUTER_MISCONFIGURED;
	}
	return WORKER_ROUTER_FAILED;
}

/*
 * idem_stats().valkey_nodes: every node the worker knows, whether it
 * serves slots now, and its failed connects/exchanges since the worker
 * started (across its reconnects).
 */
static void
worker_router_publish_nodes(void)
{
	StringInfoData s;
	int			i;

	if (!worker_router_reports)
		return;
	initStringInfo(&s);
	for (i = 0; i < idem_vc_nnodes(worker_vc); i++)
		appendStringInfo(&s, "%s%s %s errors=%lld", i ? ", " : "",
						 idem_vc_node_name(worker_vc, i),
						 idem_vc_node_in_map(worker_vc, i) ? "master" : "other",
						 worker_router_node_errors(i));
	idem_stats_set_cluster(true, s.data);
	pfree(s.data);
}

/*
 * Add what the router counted since the last report to idem_stats(): on a
 * cluster, and at connect (a failed seed is a node error either way).
 */
void
worker_router_report_stats(void)
{
	if (worker_router_active())
		worker_router_publish_stats();
}

static void
worker_router_publish_stats(void)
{
	const idem_vc_stats *s;

	if (worker_vc == NULL || !worker_router_reports)
		return;
	s = idem_vc_get_stats(worker_vc);
	if (s->refreshes != worker_router_reported.refreshes ||
		s->node_errors != worker_router_reported.node_errors)
		worker_router_publish_nodes();
	idem_stats_add_cluster(IDEM_STAT_REDIRECTS,
				   (s->moved + s->ask) - (worker_router_reported.moved + worker_router_reported.ask));
	idem_stats_add_cluster(IDEM_STAT_MAP_REFRESHES, s->refreshes - worker_router_reported.refreshes);
	idem_stats_add_cluster(IDEM_STAT_NODE_ERRORS, s->node_errors - worker_router_reported.node_errors);
	idem_stats_add_cluster(IDEM_STAT_CLUSTER_RETRIES, s->retries - worker_router_reported.retries);
	worker_router_reported = *s;
}

/* "N masters, through host:port" for the log. */
const char *
worker_router_describe(void)
{
	static char text[64];
	int			i,
				masters = 0;

	if (worker_vc == NULL)
		return "";
	for (i = 0; i < idem_vc_nnodes(worker_vc); i++)
		masters += idem_vc_node_in_map(worker_vc, i);
	snprintf(text, sizeof(text), "%d masters", masters);
	return text;
}

/*
 * The batch worker_router_send sent and worker_router_collect answers: its
 * commands (worker_router_cmds, worker_router_slots) and its records' settled
 * flags.
 */
static int	worker_router_nc = 0;
static bool *worker_router_done = NULL;

/*
 * Send one batch: each record's SET to the master of its key's slot, every
 * node's share written before any reply is read.  worker_router_collect() then
 * reads the replies (following redirects).  Returns the SETs sent (0 when
 * every record is settled or unencodable), or -1 if abandoned (shutdown).
 *
 * done (NULL, or one flag per record): a record whose flag is set is skipped,
 * and each record settled (copied, refused, past its retention or unencodable)
 * gets its flag set, here or in worker_router_collect(), so that a batch tried
 * again after WORKER_ROUTER_NOT_ACKED sends only what is still owed.  *rejected
 * counts the records this call could not encode.
 */
int
worker_router_send(const IdemRingRecord **records, int n, bool *done,
				   WorkerRouterEncode encode, void *encode_arg, uint64 *rejected)
{
	int			nc = 0;
	int			i;

	Assert(n <= IDEM_BATCH_MAX);
	*rejected = 0;
	for (i = 0; i < n; i++)
	{
		WorkerRouterSlot *s = &worker_router_slots[nc];
		idem_vc_cmd *c = &worker_router_cmds[nc];
		int			keylen,
					valuelen;
		int			rc;

		if (done != NULL && done[i])
			continue;
		rc = encode(encode_arg, records[i], s->key, &keylen, s->value,
					&valuelen, s->ttl, sizeof(s->ttl));
		if (rc <= 0)
		{
			if (rc < 0)
				(*rejected)++;	/* errbuf says why */
			/* else its retention is over */
			if (done != NULL)
				done[i] = true;
			continue;
		}
		s->record = i;
		s->argv[0] = "SET";
		s->argvlen[0] = 3;
		s->argv[1] = s->key;
		s->argvlen[1] = keylen;
		s->argv[2] = s->value;
		s->argvlen[2] = valuelen;
		s->argv[3] = "PX";
		s->argvlen[3] = 2;
		s->argv[4] = s->ttl;
		s->argvlen[4] = strlen(s->ttl);
		memset(c, 0, sizeof(*c));
		c->key = s->key;
		c->keylen = keylen;
		c->argc = 5;
		c->argv = s->argv;
		c->argvlen = s->argvlen;
		nc++;
	}
	worker_router_nc = nc;
	worker_router_done = done;
	if (nc == 0)
		return 0;
	if (idem_vc_send(worker_vc, worker_router_cmds, nc,
					 idem_vc_now_ms() + idem_valkey_command_timeout_ms) == -2)
		return -1;
	return nc;
}

/*
 * Commands outside any batch (no batch is in flight), each routed by its
 * key, pipelined per node: how many have a reply (the caller frees them;
 * the others are NULL), with errbuf saying why when not all do (*shutdown
 * if the process is stopping).
 */
int
worker_router_pipeline(idem_vc_cmd *cmds, int n, bool *shutdown, char *errbuf,
					   size_t errlen)
{
	int			answered;

	answered = idem_vc_pipeline(worker_vc, cmds, n,
								idem_vc_now_ms() + idem_valkey_command_timeout_ms);
	worker_router_report_stats();
	*shutdown = answered == -2;
	if (answered < n)
		snprintf(errbuf, errlen, "%d of %d commands without a reply from %s: %s",
				 n - Max(answered, 0), n,
				 idem_vc_is_cluster(worker_vc) ? "the cluster" : "Valkey",
				 idem_vc_last_error(worker_vc));
	return Max(answered, 0);
}

/*
 * One command outside any batch (no batch is in flight), routed by key:
 * its reply (the caller frees it), or NULL with errbuf saying why
 * (*shutdown if the worker is stopping).
 */
redisReply *
worker_router_command(const char *key, size_t keylen, int argc, const char **argv,
					  const size_t *argvlen, bool *shutdown, char *errbuf,
					  size_t errlen)
{
	idem_vc_cmd c;
	int			n;

	memset(&c, 0, sizeof(c));
	c.key = key;
	c.keylen = keylen;
	c.argc = argc;
	c.argv = argv;
	c.argvlen = argvlen;
	n = idem_vc_pipeline(worker_vc, &c, 1,
						 idem_vc_now_ms() + idem_valkey_command_timeout_ms);
	worker_router_report_stats();
	*shutdown = n == -2;
	if (n == 1 && c.reply != NULL)
		return c.reply;
	if (c.reply != NULL)
		freeReplyObject(c.reply);
	snprintf(errbuf, errlen, "no reply from %s: %s",
			 idem_vc_is_cluster(worker_vc) ? "the cluster" : "Valkey",
			 idem_vc_last_error(worker_vc));
	return NULL;
}

/*
 * A single Valkey: the router's one node, driven by worker_drain_single()'s
 * pipelined batches (idem_vc_single_*).  0, -1 (errbuf says why), -2 shutdown.
 */
static int
worker_router_single_result(int rc, char *errbuf, size_t errlen)
{
	if (rc == -1)
		snprintf(errbuf, errlen, "%s", idem_vc_last_error(worker_vc));
	return rc;
}

int
worker_router_single_append(int argc, const char **argv, const size_t *argvlen,
							char *errbuf, size_t errlen)
{
	return worker_router_single_result(idem_vc_single_append(worker_vc, argc, argv, argvlen),
									   errbuf, errlen);
}

int
worker_router_single_flush(int64 deadline_ms, char *errbuf, size_t errlen)
{
	return worker_router_single_result(idem_vc_single_flush(worker_vc, deadline_ms),
									   errbuf, errlen);
}

int
worker_router_single_read(int64 deadline_ms, bool read_first,
						  struct redisReply **reply, char *errbuf, size_t errlen)
{
	return worker_router_single_result(idem_vc_single_read(worker_vc, deadline_ms, read_first,
												reply),
							errbuf, errlen);
}

/*
 * Read the replies to the batch worker_router_send() sent, within
 * idem.valkey_command_timeout from now; waited: the worker slept since the
 * send (its batch delay), so they are most likely in.  WORKER_ROUTER_ACKED when
 * every SET has a reply from the node that owns its key (*copied OK,
 * *rejected refused); otherwise the batch must stay queued.  *copied and
 * *rejected count this batch's records only.
 */
WorkerRouterCopy
worker_router_collect(bool waited, uint64 *copied,
					  uint64 *rejected, char *errbuf, size_t errlen)
{
	int			nc = worker_router_nc;
	int			answered;
	int			i;
	bool		keep = false;

	*copied = 0;
	*rejected = 0;
	if (nc == 0)
		return WORKER_ROUTER_ACKED;
	worker_router_nc = 0;
	answered = idem_vc_collect(worker_vc, worker_router_cmds, nc,
							   idem_vc_now_ms() + idem_valkey_command_timeout_ms,
							   waited);
	worker_router_report_stats();
	if (answered == -2)
	{
		/* the worker exits; still, free what came */
		for (i = 0; i < nc; i++)
		{
			if (worker_router_cmds[i].reply)
				freeReplyObject(worker_router_cmds[i].reply);
			worker_router_cmds[i].reply = NULL;
		}
		return WORKER_ROUTER_STOPPING;
	}
	for (i = 0; i < nc; i++)
	{
		redisReply *r = worker_router_cmds[i].reply;
		bool		settled = true;

		if (r == NULL)
			continue;
		if (r->type == REDIS_REPLY_ERROR)
		{
			snprintf(errbuf, errlen, "%s replied: %.*s",
					 idem_vc_node_name(worker_vc, worker_router_cmds[i].node),
					 (int) Min(r->len, 120), r->str);
			if (idem_vk_error_not_now(r->str, r->len))
				keep = settled = false;
			else
				(*rejected)++;
		}
		else
			(*copied)++;
		if (settled && worker_router_done != NULL)
			worker_router_done[worker_router_slots[i].record] = true;
		freeReplyObject(r);
		worker_router_cmds[i].reply = NULL;
	}
	if (answered < nc)
	{
		/* some node did not answer: keep the whole batch queued */
		snprintf(errbuf, errlen, "%d of %d copies not acknowledged: %s",
				 nc - answered, nc, idem_vc_last_error(worker_vc));
		return WORKER_ROUTER_NOT_ACKED;
	}
	return keep ? WORKER_ROUTER_NOT_ACKED : WORKER_ROUTER_ACKED;
}

/*
 * Copy one batch: worker_router_send() then worker_router_collect() at once,
 * with their counts added.
 */
WorkerRouterCopy
worker_router_copy(const IdemRingRecord **records, int n, bool *done,
				   WorkerRouterEncode encode, void *encode_arg, uint64 *copied, uint64 *rejected, char *errbuf, size_t errlen)
{
	uint64		unencodable;
	WorkerRouterCopy rc;

	if (worker_router_send(records, n, done, encode, encode_arg, &unencodable) < 0)
		return WORKER_ROUTER_STOPPING;
	rc = worker_router_collect(false, copied, rejected, errbuf, errlen);
	*rejected += unencodable;
	return rc;
}
