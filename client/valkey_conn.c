/*
 * valkey_conn.c
 *	  The Valkey connections of a runner's gate, and the commands sent on
 *	  them.  They are the router's (../src/common/valkey_router.c), as
 *	  the extension's worker's are: a single Valkey is a one-node map, a
 *	  Valkey Cluster a map of its masters, told apart by INFO cluster in
 *	  the connect's round trip (unless the mode is forced); connect, setup,
 *	  the bytes and the classification of error replies are the shared
 *	  code's.  What is the runner's own:
 *	    - the options: reads are one blocking recv() bounded by what is
 *	      left of the command timeout (an exchange is two system calls, as
 *	      a GET with hiredis is); a connection that had answered and died
 *	      (Valkey restarted, or closed an idle client) is connected again
 *	      at once and its commands resent, since every command the gate
 *	      sends may run twice (gate.c: a SET NX GET that finds our own
 *	      marker is ours; the release compares before it deletes);
 *	    - the setup: SCRIPT LOAD of the release script in every
 *	      connection's setup round trip, its answer checked against the
 *	      script's SHA-1 (release.c), so a script changed without it fails
 *	      every connect;
 *	    - the rest after a failed open (retry_ms), and valkey_db on a
 *	      cluster, a configuration error that keeps the gate off;
 *	    - what went wrong, told to the runner's report function (an
 *	      open that failed, and why: down, AUTH refused or missing, the
 *	      setup refused; an exchange left without replies; the first
 *	      answer after such a report), and a rest the runner asks for
 *	      (idemc_gate_rest: the owner check found another Valkey).
 *
 *	  A failure never fails a run: the gate is skipped and PostgreSQL
 *	  decides.  A node that cannot be reached rests for retry_ms: only its
 *	  keys go without the gate meanwhile.
 *
 *	  Locking: none; a gate belongs to its runner, used by one thread at a
 *	  time.
 */
#include "internal.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>

#include <hiredis/hiredis.h>

#include "valkey_router.h"
#include "valkey_conn.h"

/* The setup's own command: load the release script (release.c). */
static const char *const load_argv[3] = {"SCRIPT", "LOAD", idemc_cad_script};
static const char *const *const setup_argv[1] = {load_argv};
static const int setup_argc[1] = {3};

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
	idem_vc_format_endpoint(g->endpoint, sizeof(g->endpoint), host, port);
	g->db = db;
	g->connect_timeout_ms = connect_timeout_ms;
	g->command_timeout_ms = command_timeout_ms;
	g->retry_ms = retry_ms;
	return g;
}

void
idemc_gate_free(idem_gate *g)
{
	if (g == NULL)
		return;
	idem_vc_free(g->vc);
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
	/* before the first use: the router is made with these */
	idem_vc_free(g->vc);
	g->vc = NULL;
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

/* SCRIPT LOAD's answer must be the release script's SHA-1. */
static int
check_setup(redisReply *const *replies, char *err, size_t errlen)
{
	const redisReply *sha = replies[0];

	if (sha != NULL && sha->type == REDIS_REPLY_STRING && sha->len == 40 &&
		memcmp(idemc_cad_sha1, sha->str, 40) == 0)
		return 0;
	if (sha != NULL && sha->type == REDIS_REPLY_ERROR)
		snprintf(err, errlen, "SCRIPT LOAD refused: %.*s",
				 (int) (sha->len > 100 ? 100 : sha->len), sha->str);
	else
		snprintf(err, errlen, "SCRIPT LOAD did not answer the release script's SHA-1");
	return -1;
}

void
idemc_gate_set_report(idem_gate *g, gate_report_fn report, void *arg)
{
	if (g == NULL)
		return;
	g->report = report;
	g->report_arg = arg;
}

const char *
idemc_gate_endpoint(const idem_gate *g)
{
	return g ? g->endpoint : "";
}

int
idemc_gate_retry_ms(const idem_gate *g)
{
	return g ? g->retry_ms : 0;
}

void
idemc_gate_rest(idem_gate *g, int ms)
{
	if (g != NULL)
		g->rest_until = idemc_now_ms() + ms;
}

/* Tell the runner what went wrong (problem) and why, or (VALKEY_OK) that
 * Valkey answered again after a report. */
static void
report(idem_gate *g, valkey_problem problem, const char *why)
{
	char		msg[600];

	if (problem == VALKEY_OK)
	{
		if (!g->reported)
			return;
		g->reported = 0;
		msg[0] = '\0';
	}
	else
	{
		g->reported = 1;
		snprintf(msg, sizeof(msg), "Valkey at %.270s: %.300s", g->endpoint,
				 why && why[0] ? why : "no answer");
	}
	if (g->report)
		g->report(g->report_arg, problem, msg);
}

/*
 * What an open's error text says: AUTH refused (WRONGPASS, or a password
 * given to a Valkey that has none) or missing (NOAUTH: any command of the
 * setup), the setup refused otherwise, or no answer at all.
 */
static valkey_problem
open_problem(const char *err)
{
	if (strstr(err, "NOAUTH") || strstr(err, "WRONGPASS") ||
		strstr(err, "AUTH refused") || strstr(err, "invalid password") ||
		strstr(err, "invalid username-password"))
		return VALKEY_AUTH;
	if (strstr(err, " refused: ") || strstr(err, "SCRIPT LOAD did not"))
		return VALKEY_REFUSED;
	return VALKEY_DOWN;
}

idem_vc *
idemc_vc_client_new(const char *host, int port, const char *nodes, int cluster,
					idem_vc_options *opt, char *err, size_t errlen)
{
	idem_vc_io	io = {idemc_vc_poll_wait, NULL, NULL};
	char		first[IDEM_VC_HOST_MAX + 8];
	char		seeds[1024];

	idem_vc_format_endpoint(first, sizeof(first), host, port);
	snprintf(seeds, sizeof(seeds), "%s%s%s", first,
			 nodes ? "," : "", nodes ? nodes : "");
	opt->seeds = seeds;
	opt->default_port = port;
	if (cluster > 0)
		opt->mode = opt->db != 0 ? IDEM_VC_MODE_AUTO : IDEM_VC_MODE_CLUSTER;
	else
		opt->mode = cluster < 0 ? IDEM_VC_MODE_SINGLE : IDEM_VC_MODE_AUTO;
	opt->blocking_reads = 1;
	return idem_vc_new(opt, &io, err, errlen);
}

/* The gate's router, made once (it connects nothing yet).  0 or -1. */
static int
router_make(idem_gate *g)
{
	idem_vc_options opt;
	char		err[256];

	if (g->vc != NULL)
		return 0;
	memset(&opt, 0, sizeof(opt));
	opt.password = g->password;
	opt.db = g->db;
	opt.connect_timeout_ms = g->connect_timeout_ms;
	opt.retry_ms = g->retry_ms;
	opt.reconnect_dead = 1;
	opt.nsetup = 1;
	opt.setup_argc = setup_argc;
	opt.setup_argv = setup_argv;
	opt.setup_check = check_setup;
	g->vc = idemc_vc_client_new(g->host, g->port, g->nodes, g->cluster_mode,
								&opt, err, sizeof(err));
	return g->vc != NULL ? 0 : -1;
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
 * Open the router: the first seed that answers in its budget (the connect
 * and command timeouts: a seed that hangs costs its own time only) says
 * whether it is a cluster's.  0; -1 with err set; -2 valkey_db on a
 * cluster (config_error set).  A failure makes the gate rest for retry_ms.
 */
static int
open_router(idem_gate *g, char *err, size_t errlen)
{
	int			rc;

	err[0] = '\0';
	if (router_make(g) != 0)
	{
		snprintf(err, errlen, "out of memory, or the nodes do not parse");
		rc = -1;
	}
	else
		rc = idem_vc_open(g->vc, g->connect_timeout_ms + g->command_timeout_ms,
						  err, errlen);
	if (rc == -2)
		db_on_cluster(g);		/* not an outage: the gate stays off */
	if (rc == 0 && g->cluster_mode > 0 && !idem_vc_is_cluster(g->vc))
	{
		/* a cluster was asked for: a single Valkey is not used instead */
		idem_vc_close_all(g->vc);
		snprintf(err, errlen, "not a Valkey Cluster, and valkey_cluster is 1");
		rc = -1;
	}
	if (rc != 0)
	{
		g->down_until = idemc_now_ms() + g->retry_ms;
		return rc == -2 ? -2 : -1;
	}
	g->down_until = 0;
	return 0;
}

/* Open, and tell the runner what came of it.  0 or -1. */
static int
gate_open(idem_gate *g)
{
	char		err[256];
	int			rc = open_router(g, err, sizeof(err));

	if (rc == -2)
		report(g, VALKEY_CONFIG, g->config_error);
	else if (rc != 0)
		report(g, open_problem(err), err);
	else
		report(g, VALKEY_OK, NULL);
	return rc == 0 ? 0 : -1;
}

int
idemc_gate_open_now(idem_gate *g, valkey_problem *problem, char *why,
				   size_t whylen)
{
	char		err[256];
	int			rc;

	*problem = VALKEY_OK;
	why[0] = '\0';
	if (g->config_error[0])
	{
		*problem = VALKEY_CONFIG;
		snprintf(why, whylen, "%s", g->config_error);
		return -1;
	}
	/* a fresh connection: its setup (AUTH, SCRIPT LOAD, SELECT) is checked */
	if (g->vc != NULL)
		idem_vc_close_all(g->vc);
	rc = open_router(g, err, sizeof(err));
	if (rc == 0)
		return 0;
	*problem = rc == -2 ? VALKEY_CONFIG : open_problem(err);
	snprintf(why, whylen, "%s", rc == -2 ? g->config_error : err);
	return -1;
}

int
idemc_gate_get_now(idem_gate *g, const char *key, char *buf, size_t buflen,
				  char *why, size_t whylen)
{
	const char *argv[2] = {"GET", key};
	idem_vc_cmd cmd;
	redisReply *r;
	int			rc = -1;

	memset(&cmd, 0, sizeof(cmd));
	cmd.key = key;
	cmd.keylen = strlen(key);
	cmd.argc = 2;
	cmd.argv = argv;
	why[0] = '\0';
	if (!idem_vc_is_open(g->vc))
	{
		snprintf(why, whylen, "not connected");
		return -1;
	}
	g->round_trips++;
	(void) idem_vc_pipeline(g->vc, &cmd, 1,
							idemc_now_ms() + g->command_timeout_ms);
	r = cmd.reply;
	if (r == NULL)
		snprintf(why, whylen, "no answer to GET: %s", idem_vc_last_error(g->vc));
	else if (r->type == REDIS_REPLY_NIL)
		rc = 0;
	else if (r->type == REDIS_REPLY_STRING)
	{
		snprintf(buf, buflen, "%.*s", (int) r->len, r->str);
		rc = 1;
	}
	else
		snprintf(why, whylen, "GET answered %.*s", r->type == REDIS_REPLY_ERROR ?
				 (int) (r->len > 200 ? 200 : r->len) : 0,
				 r->type == REDIS_REPLY_ERROR ? r->str : "");
	if (r)
		freeReplyObject(r);
	return rc;
}

const char *
idemc_gate_config_error(const idem_gate *g)
{
	return (g && g->config_error[0]) ? g->config_error : NULL;
}

/* The exchanges of runs, and the connections' setups. */
long
idemc_gate_round_trips(const idem_gate *g)
{
	if (g == NULL)
		return 0;
	return g->round_trips +
		(g->vc ? (long) idem_vc_get_stats(g->vc)->setups : 0);
}

long
idemc_gate_connects(const idem_gate *g)
{
	if (g == NULL)
		return 0;
	return g->vc ? (long) idem_vc_get_stats(g->vc)->connects : 0;
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

int
idemc_gate_resting(const idem_gate *g)
{
	if (g->config_error[0])
		return 1;
	if (g->rest_until != 0 && idemc_now_ms() < g->rest_until)
		return 1;
	/*
	 * Open: nodes rest one by one.  A single Valkey's one node resting is
	 * the gate's; a cluster's masters all resting is not (the next
	 * pipeline re-reads the map: a replica may have been promoted).
	 */
	if (idem_vc_is_open(g->vc))
		return !idem_vc_is_cluster(g->vc) && idem_vc_all_resting(g->vc);
	return idemc_now_ms() < g->down_until;
}

/* Open, or open now. */
int
idemc_gate_ensure(idem_gate *g)
{
	if (idem_vc_is_open(g->vc))
		return 0;
	if (idemc_gate_resting(g))
		return -1;
	return gate_open(g);
}

void
idemc_gate_connect(idem_gate *g)
{
	if (g != NULL)
		(void) idemc_gate_ensure(g);
}

/*
 * Single-key commands in one round trip (cmds[i].key routes command i):
 * each node's share sent before any reply is read, one pipeline on a
 * single Valkey, within the command timeout.  cmds[i].reply is command i's
 * reply (the caller frees), or NULL if it has none (its node failed or
 * rests, or the deadline passed).
 */
void
idemc_gate_pipeline(idem_gate *g, idem_vc_cmd *cmds, int n)
{
	int			i;

	for (i = 0; i < n; i++)
		cmds[i].reply = NULL;
	if (n <= 0 || idemc_gate_ensure(g) != 0)
		return;
	g->round_trips++;
	if (idem_vc_pipeline(g->vc, cmds, n,
						 idemc_now_ms() + g->command_timeout_ms) == n)
		report(g, VALKEY_OK, NULL);
	else
	{
		char		why[300];

		/* a node failed or hung: it rests (the router's), and it is said */
		snprintf(why, sizeof(why), "no answer in %d ms (%.250s)",
				 g->command_timeout_ms, idem_vc_last_error(g->vc));
		report(g, VALKEY_DOWN, why);
	}
}
