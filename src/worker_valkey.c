/*-------------------------------------------------------------------------
 *
 * worker_valkey.c
 *	  The worker's Valkey connection: which Valkey (the cache's, or in an
 *	  outbox publisher the outbox's when idem.outbox_valkey_host or
 *	  idem.outbox_valkey_nodes names one: worker_target), the settings it
 *	  was made with (and whether a reload changed them), the password, connect and disconnect
 *	  (through worker_router.c's router: a cluster, or a single Valkey as its
 *	  one node, whose connect, AUTH and SELECT are the router's), one command
 *	  outside a batch, and the single Valkey's pipelined I/O that
 *	  worker_drain_single() writes its batches with.  Every reply is freed
 *	  before anything is reported, and the password is never logged.
 *
 *	  Locking: none; the worker is one process and one thread, and this
 *	  state is its own (process-local).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "storage/fd.h"
#include "utils/memutils.h"

#include "guc.h"
#include "stats.h"
#include "valkey_reply.h"
#include "worker_router.h"
#include "worker_int.h"

/* An outbox publisher: its Valkey is the outbox's, if one is set. */
static bool worker_for_outbox = false;

/* The settings the connection (worker_router.c's router) was made with. */
char	   *worker_valkey_host = NULL;	/* for messages: host, or the nodes */
int			worker_valkey_port = 0;
static const char *worker_valkey_prefix = NULL;	/* which settings */
static char *worker_valkey_password = NULL;
static int	worker_valkey_db = 0;
static char *worker_valkey_nodes = NULL;	/* idem.valkey_nodes */
static int	worker_valkey_cluster = IDEM_VALKEY_CLUSTER_AUTO;

char		worker_errbuf[IDEM_ERRBUF_LEN];

/*
 * The process is an outbox publisher: it publishes to the outbox's Valkey
 * when one is set (from the next connect on).
 */
void
worker_valkey_use_outbox(void)
{
	worker_for_outbox = true;
}

/*
 * The Valkey to connect to, by the settings now: in an outbox publisher
 * with idem.outbox_valkey_host or idem.outbox_valkey_nodes set, the
 * outbox's (whether it is a cluster asked at every connect; the timeouts
 * are the cache's); otherwise the cache's.
 */
static inline const char *
worker_setting(const char *value)
{
	return value ? value : "";
}

static void
worker_target(WorkerValkeyTarget *t)
{
	bool		outbox = worker_for_outbox &&
		(worker_setting(idem_outbox_valkey_host)[0] != '\0' ||
		 worker_setting(idem_outbox_valkey_nodes)[0] != '\0');

	memset(t, 0, sizeof(*t));
	t->host = worker_setting(outbox ? idem_outbox_valkey_host : idem_valkey_host);
	t->port = outbox ? idem_outbox_valkey_port : idem_valkey_port;
	t->nodes = worker_setting(outbox ? idem_outbox_valkey_nodes : idem_valkey_nodes);
	t->password = worker_setting(outbox ? idem_outbox_valkey_password : idem_valkey_password);
	t->password_file = worker_setting(outbox ? idem_outbox_valkey_password_file :
									  idem_valkey_password_file);
	t->prefix = outbox ? "idem.outbox_valkey_" : "idem.valkey_";
	t->db = outbox ? idem_outbox_valkey_db : idem_valkey_db;
	t->cluster = outbox ? IDEM_VALKEY_CLUSTER_AUTO : idem_valkey_cluster;
	/* a publisher leaves idem_stats()'s Valkey columns to the worker */
	t->report = !worker_for_outbox;
}

/* A router's result (0, -1, -2) as the worker's. */
static WorkerResult
worker_result(int rc)
{
	return rc == 0 ? WORKER_OK : rc == -2 ? WORKER_SHUTDOWN : WORKER_FAILED;
}

/* Write everything appended (a single Valkey), before deadline_ms. */
WorkerResult
worker_flush(int64 deadline_ms)
{
	return worker_result(worker_router_single_flush(deadline_ms, worker_errbuf, sizeof(worker_errbuf)));
}

/*
 * Wait for the next reply and hand it over in *reply (the caller frees it).
 * read_first: the replies are most likely in already (the worker slept
 * since it sent): read before waiting for the socket.
 */
WorkerResult
worker_next_reply(int64 deadline_ms, bool read_first, redisReply **reply)
{
	return worker_result(worker_router_single_read(deadline_ms, read_first, reply,
												   worker_errbuf, sizeof(worker_errbuf)));
}

/*
 * Read the next reply.  On WORKER_OK, *class says what it means (for an error
 * reply its text is then in worker_errbuf); the reply itself is already
 * freed.
 */
WorkerResult
worker_read_reply(int64 deadline_ms, bool read_first, WorkerReplyClass *class)
{
	redisReply *rr;
	WorkerResult r = worker_next_reply(deadline_ms, read_first, &rr);

	if (r != WORKER_OK)
		return r;
	*class = WORKER_REPLY_OK;
	if (rr->type == REDIS_REPLY_ERROR)
	{
		*class = idem_vk_error_not_now(rr->str, rr->len) ?
			WORKER_REPLY_RETRY : WORKER_REPLY_REJECT;
		snprintf(worker_errbuf, sizeof(worker_errbuf), "Valkey replied: %.*s",
				 (int) rr->len, rr->str);
	}
	freeReplyObject(rr);
	return WORKER_OK;
}

/* Connected: to one Valkey or to a cluster (worker_router.c). */
bool
worker_connected(void)
{
	return worker_router_connected();
}

void
worker_disconnect(void)
{
	worker_router_disconnect();
	idem_stats_set_valkey(false, NULL);
}

/*
 * The password to send: the target's password setting, else the first line
 * of its password file (read now, so a changed file is picked up at the
 * next connect or reload), else none.  A file that cannot be read yields
 * NULL, with the reason (never the password) in worker_errbuf.
 */
static char *
worker_current_password(const WorkerValkeyTarget *t)
{
	FILE	   *f;
	char		line[1024];
	size_t		n;

	if (t->password[0] != '\0')
		return pstrdup(t->password);
	if (t->password_file[0] == '\0')
		return pstrdup("");
	f = AllocateFile(t->password_file, "r");
	if (f == NULL)
	{
		snprintf(worker_errbuf, sizeof(worker_errbuf), "could not open %spassword_file \"%s\": %s",
				 t->prefix, t->password_file, strerror(errno));
		return NULL;
	}
	if (fgets(line, sizeof(line), f) == NULL)
		line[0] = '\0';
	FreeFile(f);
	n = strlen(line);
	while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r'))
		line[--n] = '\0';
	return pstrdup(line);
}

/* Remember the settings a connection is made with; false if unusable. */
static bool
worker_remember_settings(const WorkerValkeyTarget *t)
{
	char	   *password = worker_current_password(t);

	if (worker_valkey_host)
		pfree(worker_valkey_host);
	if (worker_valkey_password)
		pfree(worker_valkey_password);
	if (worker_valkey_nodes)
		pfree(worker_valkey_nodes);
	worker_valkey_nodes = MemoryContextStrdup(TopMemoryContext, t->nodes);
	worker_valkey_cluster = t->cluster;
	worker_valkey_host = MemoryContextStrdup(TopMemoryContext,
											 t->host[0] != '\0' ? t->host : t->nodes);
	worker_valkey_password = MemoryContextStrdup(TopMemoryContext, password ? password : "");
	worker_valkey_port = t->port;
	worker_valkey_db = t->db;
	worker_valkey_prefix = t->prefix;
	if (password)
		pfree(password);
	return password != NULL;
}

bool
worker_settings_changed(void)
{
	WorkerValkeyTarget t;
	char	   *password;
	bool		changed;

	if (worker_valkey_host == NULL)
		return true;
	worker_target(&t);
	password = worker_current_password(&t);
	changed = worker_valkey_prefix != t.prefix ||
		strcmp(worker_valkey_host, t.host[0] != '\0' ? t.host : t.nodes) != 0 ||
		password == NULL || strcmp(worker_valkey_password, password) != 0 ||
		worker_valkey_port != t.port ||
		worker_valkey_db != t.db ||
		worker_valkey_cluster != t.cluster ||
		strcmp(worker_valkey_nodes, t.nodes) != 0;
	if (password)
		pfree(password);
	return changed;
}

/*
 * Connect: the router (worker_router.c) opens a cluster, or a single
 * Valkey as its one node (connect, AUTH, SELECT are the router's).
 */
WorkerResult
worker_connect(void)
{
	WorkerValkeyTarget t;

	worker_target(&t);
	if (!worker_remember_settings(&t))
		return WORKER_FAILED;	/* worker_errbuf says why */

	switch (worker_router_connect(&t, worker_valkey_password, worker_errbuf, sizeof(worker_errbuf)))
	{
		case WORKER_ROUTER_SINGLE:
		case WORKER_ROUTER_CLUSTER:
			return WORKER_OK;
		case WORKER_ROUTER_SHUTDOWN:
			return WORKER_SHUTDOWN;
		case WORKER_ROUTER_MISCONFIGURED:
		case WORKER_ROUTER_FAILED:
			break;
	}
	return WORKER_FAILED;
}

/*
 * Commands outside any batch, pipelined (routed by their keys on a
 * cluster): how many have a reply in cmds[i].reply (the caller frees
 * them; the others are NULL), with worker_errbuf saying why when not all
 * do.  *shutdown: SIGTERM arrived.
 */
int
worker_pipeline(struct idem_vc_cmd *cmds, int n, bool *shutdown)
{
	return worker_router_pipeline(cmds, n, shutdown, worker_errbuf,
								  sizeof(worker_errbuf));
}

/*
 * One command outside any batch: its reply in *reply (the caller frees
 * it), or WORKER_FAILED with worker_errbuf saying why.  key routes it on a
 * cluster.
 */
WorkerResult
worker_command(const char *key, size_t keylen, int argc, const char **argv,
			   const size_t *argvlen, redisReply **reply)
{
	bool		shutdown = false;

	*reply = worker_router_command(key, keylen, argc, argv, argvlen,
							 &shutdown, worker_errbuf, sizeof(worker_errbuf));
	if (shutdown)
		return WORKER_SHUTDOWN;
	return *reply != NULL ? WORKER_OK : WORKER_FAILED;
}
