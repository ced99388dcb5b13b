/*
 * valkey_conn.c
 *	  The Valkey connection of a runner's gate: its options and counters,
 *	  connect (TCP with a short timeout, made as the router makes every
 *	  node's: ../src/common/valkey_node.c; then the common setup of
 *	  ../src/common/valkey_wire.c, AUTH and SELECT, with INFO cluster and
 *	  SCRIPT LOAD of the release script in the same pipelined round trip
 *	  within the command timeout), reconnect on use, and the rest after a
 *	  failure.  The bytes themselves go through valkey_io.c.
 *
 *	  A failure never fails a run: the gate is skipped and PostgreSQL
 *	  decides.  After a failed connect the gate is left alone for retry_ms;
 *	  a broken established connection is dropped (valkey_io.c) and
 *	  reconnected on next use.
 *
 *	  Every byte goes out with send(MSG_NOSIGNAL) (hiredis only wraps the
 *	  socket and parses): no signal mask is needed, connecting or not.
 *
 *	  Valkey Cluster: the connect pipeline also asks INFO cluster (unless
 *	  the mode is forced); a cluster node hands the gate to the shared
 *	  router (../src/common/valkey_cluster.c), which sends every command to
 *	  the master of its key's slot, follows MOVED/ASK and retries
 *	  CLUSTERDOWN/TRYAGAIN.  A node that cannot be reached rests for
 *	  retry_ms: only its keys go without the gate meanwhile.  valkey_db on a
 *	  cluster is a configuration error: the gate stays off.
 *
 *	  Locking: none; a gate belongs to its runner, used by one thread at a
 *	  time.
 */
#include "internal.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#include "valkey_cluster.h"
#include "valkey_conn.h"

static char *
dup_or_null(const char *s)
{
	return (s && s[0]) ? strdup(s) : NULL;
}

idem_gate *
idemc_gate_new(const char *host, int port, const char *password, int db,
			  int connect_timeout_ms, int command_timeout_ms, int retry_ms)
{
	idem_gate  *g = calloc(1, sizeof(idem_gate));

	if (g == NULL)
		return NULL;
	g->host = strdup(host);
	g->password = dup_or_null(password);
	if (g->host == NULL || (password && password[0] && g->password == NULL))
	{
		idemc_gate_free(g);
		return NULL;
	}
	g->port = port;
	g->db = db;
	g->connect_timeout_ms = connect_timeout_ms;
	g->command_timeout_ms = command_timeout_ms;
	g->retry_ms = retry_ms;
	return g;
}

void
idemc_gate_drop(idem_gate *g)
{
	if (g->c)
		redisFree(g->c);
	g->c = NULL;
}

void
idemc_gate_free(idem_gate *g)
{
	if (g == NULL)
		return;
	idemc_gate_drop(g);
	idem_vc_free(g->vc);
	free(g->get_cmd);
	free(g->get_key);
	free(g->host);
	free(g->password);
	free(g->nodes);
	free(g);
}

int
idemc_gate_set_cluster(idem_gate *g, const char *nodes, int mode)
{
	if (g == NULL)
		return 0;
	free(g->nodes);
	g->nodes = dup_or_null(nodes);
	g->cluster_mode = mode;
	return (nodes && nodes[0] && g->nodes == NULL) ? -1 : 0;
}

/* idem_vc_io.wait for the client: poll(), or sleep with fd -1. */
int
idemc_vc_poll_wait(void *arg, int fd, int for_write, int64_t deadline)
{
	(void) arg;
	for (;;)
	{
		struct pollfd p;
		int64_t		left = deadline - idemc_now_ms();
		int			rc;

		if (left <= 0)
			return fd < 0 ? 0 : -1;
		p.fd = fd;
		p.events = for_write ? POLLOUT : POLLIN;
		p.revents = 0;
		rc = poll(fd < 0 ? NULL : &p, fd < 0 ? 0 : 1, (int) left);
		if (rc > 0)
			return 0;
		if (rc < 0 && errno != EINTR)
			return -1;
	}
}

/* valkey_db on a cluster: a configuration error; the gate stays off. */
static void
db_on_cluster(idem_gate *g)
{
	snprintf(g->config_error, sizeof(g->config_error),
			 "valkey_db is %d, but a Valkey Cluster has only database 0: set valkey_db = 0",
			 g->db);
}

/*
 * Open the cluster router (seeds: host:port, then the extra nodes; each
 * seed has the connect and command timeouts to answer, so a seed that hangs
 * costs its own time only).  The script is named by its SHA-1, computed
 * here: no SCRIPT LOAD, which would have to go to some node that may be the
 * one that hangs; each node loads it on its first NOSCRIPT (EVAL).
 * 0, or -1 with the gate resting.
 */
static int
cluster_open(idem_gate *g)
{
	idem_vc_options opt;
	idem_vc_io	io = {idemc_vc_poll_wait, NULL, NULL};
	char		seeds[1024];
	char		err[256];

	if (g->vc == NULL)
	{
		char		first[IDEM_VC_HOST_MAX + 8];

		idem_vc_format_endpoint(first, sizeof(first), g->host, g->port);
		snprintf(seeds, sizeof(seeds), "%s%s%s", first,
				 g->nodes ? "," : "", g->nodes ? g->nodes : "");
		memset(&opt, 0, sizeof(opt));
		opt.seeds = seeds;
		opt.default_port = g->port;
		opt.password = g->password;
		opt.db = g->db;
		/*
		 * With a database other than 0 ask the nodes (they cannot be a
		 * cluster's, and must not be taken for one): idem_vc_open says -2
		 * if they are.
		 */
		opt.mode = g->db != 0 ? IDEM_VC_MODE_AUTO : IDEM_VC_MODE_CLUSTER;
		opt.connect_timeout_ms = g->connect_timeout_ms;
		opt.retry_ms = g->retry_ms;
		g->vc = idem_vc_new(&opt, &io, err, sizeof(err));
		if (g->vc == NULL)
			goto fail;
	}
	if (!idem_vc_is_open(g->vc))
	{
		int			rc = idem_vc_open(g->vc,
									  g->connect_timeout_ms + g->command_timeout_ms,
									  err, sizeof(err));

		/* a configuration error, not an outage: the gate stays off */
		if (rc == -2)
			db_on_cluster(g);
		if (rc != 0 || !idem_vc_is_cluster(g->vc))
			goto fail;
	}
	return 0;
fail:
	if (g->vc != NULL && !idem_vc_is_cluster(g->vc))
	{
		/* not a cluster after all, or none answered: ask again next time */
		g->stat_connects += idem_vc_get_stats(g->vc)->connects;
		idem_vc_free(g->vc);
		g->vc = NULL;
	}
	g->down_until = idemc_now_ms() + g->retry_ms;
	return -1;
}

const char *
idemc_gate_config_error(const idem_gate *g)
{
	return (g && g->config_error[0]) ? g->config_error : NULL;
}

long
idemc_gate_round_trips(const idem_gate *g)
{
	return g ? g->round_trips : 0;
}

long
idemc_gate_connects(const idem_gate *g)
{
	if (g == NULL)
		return 0;
	return g->connects + g->stat_connects +
		(g->vc ? (long) idem_vc_get_stats(g->vc)->connects : 0);
}

void
idemc_gate_cluster_stats(const idem_gate *g, long *redirects, long *refreshes,
						long *node_errors)
{
	const idem_vc_stats *s = (g && g->vc) ? idem_vc_get_stats(g->vc) : NULL;

	*redirects = s ? (long) (s->moved + s->ask) : 0;
	*refreshes = s ? (long) s->refreshes : 0;
	*node_errors = s ? (long) s->node_errors : 0;
}

/* Connect, then in one round trip within the command timeout (a deadline)
 * the common setup (../src/common/valkey_wire.c: AUTH, the gate's own
 * commands, SELECT): INFO cluster unless the mode is forced (before
 * SELECT, which a cluster refuses: it must be recognised), and SCRIPT LOAD
 * of the release script.  0 on success; on failure the gate stays down for
 * retry_ms. */
static int
do_connect(idem_gate *g)
{
	idem_vc_io	io = {idemc_vc_poll_wait, NULL, NULL};
	char		err[256];
	int			fd;
	redisContext *c;
	const char *info[2] = {"INFO", "cluster"};
	const char *load[3] = {"SCRIPT", "LOAD", idemc_cad_script};
	const char *const *argv[2];
	int			argc[2];
	redisReply *replies[2] = {NULL, NULL};
	idem_vc_setup su;
	int			rc;
	int			ok;
	int			cluster = 0;
	int			i;
	redisReply *sha;

	g->connects++;
	if (g->cluster_mode > 0 || g->vc != NULL)
		return cluster_open(g);
	/* the TCP connect is the router's (as every node's), hiredis wraps it */
	fd = idem_vc_tcp_connect(g->host, g->port,
							 idemc_now_ms() + g->connect_timeout_ms, &io,
							 err, sizeof(err));
	c = fd >= 0 ? redisConnectFd(fd) : NULL;
	if (c == NULL || c->err)
	{
		if (c)
			redisFree(c);
		else if (fd >= 0)
			close(fd);
		/* the first node is down: the others may be a cluster's */
		if (g->nodes != NULL && g->cluster_mode == 0)
			return cluster_open(g);
		g->down_until = idemc_now_ms() + g->retry_ms;
		return -1;
	}
	g->c = c;
	memset(&su, 0, sizeof(su));
	su.password = g->password;
	su.db = g->db;
	su.extra_argc = argc;
	su.extra_argv = argv;
	su.extra_replies = replies;
	if (g->cluster_mode == 0)
	{
		argc[su.nextra] = 2;
		argv[su.nextra++] = info;
	}
	argc[su.nextra] = 3;
	argv[su.nextra++] = load;
	g->round_trips++;
	rc = idem_vc_wire_setup(c->fd, &su, idemc_now_ms() + g->command_timeout_ms,
							&io, err, sizeof(err));
	if (g->cluster_mode == 0 && replies[0] != NULL)
		cluster = replies[0]->type == REDIS_REPLY_STRING &&
			strstr(replies[0]->str, "cluster_enabled:1") != NULL;
	sha = replies[su.nextra - 1];
	ok = rc == 0 && sha != NULL && sha->type == REDIS_REPLY_STRING &&
		sha->len == 40 && memcmp(idemc_cad_sha1, sha->str, 40) == 0 &&
		idemc_vk_socket_setup(g) == 0;
	for (i = 0; i < su.nextra; i++)
		if (replies[i])
			freeReplyObject(replies[i]);
	if (cluster && g->db != 0)
	{
		/* a configuration error, not an outage: the gate stays off */
		db_on_cluster(g);
		idemc_gate_drop(g);
		return -1;
	}
	if (!ok)
	{
		idemc_gate_drop(g);
		/* the first node hangs: the others may be a cluster's */
		if ((rc == -1 || rc == -2) && g->nodes != NULL && g->cluster_mode == 0)
			return cluster_open(g);
		g->down_until = idemc_now_ms() + g->retry_ms;
		return -1;
	}
	if (cluster)
	{
		idemc_gate_drop(g);
		return cluster_open(g);
	}
	return 0;
}

int
idemc_gate_resting(const idem_gate *g)
{
	if (g->config_error[0])
		return 1;
	if (g->vc != NULL && idem_vc_is_open(g->vc))
		return 0;				/* nodes rest one by one */
	return g->c == NULL && idemc_now_ms() < g->down_until;
}

/* Connected, or connect now. */
int
idemc_gate_ensure(idem_gate *g)
{
	if (g->c || (g->vc != NULL && idem_vc_is_open(g->vc)))
		return 0;
	if (idemc_gate_resting(g))
		return -1;
	return do_connect(g);
}

void
idemc_gate_connect(idem_gate *g)
{
	if (g != NULL)
		(void) idemc_gate_ensure(g);
}
