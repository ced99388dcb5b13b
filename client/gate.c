/*
 * gate.c
 *	  The Valkey side of a runner: one hiredis connection with short connect
 *	  and command timeouts, the gate and compare-and-delete of our own
 *	  marker.  The client writes no terminal value (the server's worker
 *	  does, once the commit is durable).
 *
 *	  The gate is one native command, SET <key> <marker> NX PX <lease> GET:
 *	  atomically, an existing value is returned (and nothing is set), an
 *	  absent key gets our marker.  A replay costs Valkey what a GET costs.
 *	  No TTL comes back: a marker's deadline is in its MACed content
 *	  (trust.c bounds it by our own lease).
 *
 *	  The gate and the read-only lookups carry, in the same round trip, a
 *	  GET of the history epoch's owner key (trust.c): the caller is told
 *	  whether it still holds the token the server gave.  On one node the
 *	  two commands are pipelined; on a cluster the owner key usually lives
 *	  in another slot, and the router sends each node its share before
 *	  reading any reply, so the round trip is the slower node's.
 *
 *	  Every command touches one key (Valkey Cluster: one slot), and only
 *	  commands that both Redis >= 7.0 and Valkey have are used: GET,
 *	  SET NX PX GET (NX with GET needs 7.0), DEL inside EVAL/EVALSHA,
 *	  SCRIPT LOAD, AUTH, SELECT.
 *
 *	  A failure never fails a run: the gate is skipped and PostgreSQL
 *	  decides.  After a failed connect the gate is left alone for retry_ms;
 *	  a broken established connection is dropped and reconnected on next
 *	  use.  A command that timed out leaves its reply unread, so the
 *	  connection is always dropped after any error.
 *
 *	  hiredis formats commands and parses replies; after the TCP connect,
 *	  the bytes go through send(MSG_NOSIGNAL) and recv() here, so a dead
 *	  Valkey is an error, never SIGPIPE, without masking signals on every
 *	  call.  The command timeout is a deadline: a reply is waited for by a
 *	  blocking recv() whose SO_RCVTIMEO is what is left of it (a send that
 *	  finds the socket full waits with poll()), and a signal (EINTR) never
 *	  restarts the clock; an exchange is two system calls, as hiredis's
 *	  own GET.  Errors are classified by errno, never by message text.
 *
 *	  Valkey Cluster: the connect pipeline also asks INFO cluster (unless the
 *	  mode is forced); a cluster node hands the gate to the shared router
 *	  (../src/common/valkey_cluster.c), which sends every command to the
 *	  master of its key's slot, follows MOVED/ASK and retries
 *	  CLUSTERDOWN/TRYAGAIN.
 *	  A node that cannot be reached rests for retry_ms: only its keys go
 *	  without the gate meanwhile.  A node that never saw a script answers
 *	  EVALSHA with NOSCRIPT, and EVAL runs it (and caches it there).
 */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <pthread.h>
#include <sys/socket.h>

#include <hiredis/hiredis.h>

#include "valkey_cluster.h"

/* KEYS[1] = key, ARGV[1] = our marker: delete it only if it is still ours. */
static const char CAD_SCRIPT[] =
"if redis.call('GET', KEYS[1]) == ARGV[1] then\n"
"  return redis.call('DEL', KEYS[1])\n"
"end\n"
"return 0\n";

/*
 * CAD_SCRIPT's SHA-1: its EVALSHA name.  The connect checks it against what
 * SCRIPT LOAD answers, so a script changed without it fails every connect.
 */
static const char CAD_SHA1[] = "c89cee65b7ab260d98c281f3c3eb6fa7c992cdd2";

struct idem_gate
{
	char	   *host;
	int			port;
	char	   *password;
	int			db;
	int			connect_timeout_ms;
	int			command_timeout_ms;
	int			retry_ms;
	redisContext *c;
	int64_t		down_until;		/* monotonic ms */
	long		round_trips;
	long		connects;
	int			last_errno;		/* of the last failed exchange; 0: EOF,
								 * timeout or protocol error */
	int			rcvtimeo_ms;	/* SO_RCVTIMEO of g->c's socket */
	/* Valkey Cluster */
	char	   *nodes;			/* more seeds, "host:port,..." */
	int			cluster_mode;	/* 0 auto, 1 on, -1 off */
	idem_vc    *vc;				/* non-NULL: cluster mode */
	long		stat_connects;	/* of routers freed */
	char	   *get_cmd;		/* GET <get_key>, formatted once: the owner */
	size_t		get_cmd_len;	/* check of every lookup (trust.c) */
	char	   *get_key;
	char		config_error[160];	/* non-empty: Valkey is not usable as
									 * configured (valkey_db on a cluster) */
};

/* ---- SIGPIPE while hiredis connects: blocked, a pending one discarded (libpq's way) */

typedef struct pipe_guard
{
	sigset_t	old;
	int			was_pending;
} pipe_guard;

static void
pipe_block(pipe_guard *pg)
{
	sigset_t	set,
				pend;

	sigemptyset(&set);
	sigaddset(&set, SIGPIPE);
	pthread_sigmask(SIG_BLOCK, &set, &pg->old);
	sigemptyset(&pend);
	sigpending(&pend);
	pg->was_pending = sigismember(&pend, SIGPIPE);
}

static void
pipe_unblock(pipe_guard *pg)
{
	sigset_t	set,
				pend;

	sigemptyset(&set);
	sigaddset(&set, SIGPIPE);
	sigemptyset(&pend);
	if (!pg->was_pending && sigpending(&pend) == 0 &&
		sigismember(&pend, SIGPIPE))
	{
		struct timespec zero = {0, 0};

		while (sigtimedwait(&set, NULL, &zero) < 0 && errno == EINTR)
			;
	}
	pthread_sigmask(SIG_SETMASK, &pg->old, NULL);
}

int64_t
idemc_now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t) ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static struct timeval
ms_tv(int ms)
{
	struct timeval tv;

	tv.tv_sec = ms / 1000;
	tv.tv_usec = (ms % 1000) * 1000;
	return tv;
}

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

static void
drop(idem_gate *g)
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
	drop(g);
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

static int	reply_ok(redisReply *r, int want_sha, const char *sha);

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

/* A connect pipeline's reply: OK, or (SCRIPT LOAD) the script's SHA-1, sha. */
static int
reply_ok(redisReply *r, int want_sha, const char *sha)
{
	if (r == NULL)
		return 0;
	if (want_sha)
		return r->type == REDIS_REPLY_STRING && r->len == 40 &&
			memcmp(sha, r->str, 40) == 0;
	return r->type == REDIS_REPLY_STATUS;
}

static int	send_all(idem_gate *g, const char *buf, size_t len,
					 int64_t deadline);
static redisReply *read_reply(idem_gate *g, int64_t deadline);
static int	socket_setup(idem_gate *g);

/* Append one formatted command to *buf (a malloc'd string of *len bytes). */
static int
append_cmd(char **buf, size_t *len, int argc, const char **argv)
{
	char	   *cmd = NULL;
	long long	n = redisFormatCommandArgv(&cmd, argc, argv, NULL);
	char	   *grown;

	if (n < 0)
		return -1;
	grown = realloc(*buf, *len + (size_t) n);
	if (grown == NULL)
	{
		redisFreeCommand(cmd);
		return -1;
	}
	memcpy(grown + *len, cmd, (size_t) n);
	*buf = grown;
	*len += (size_t) n;
	redisFreeCommand(cmd);
	return 0;
}

/* Connect, authenticate, select, load the script: one round trip after the
 * TCP connect, within the command timeout (a deadline).  0 on success; on
 * failure the gate stays down for retry_ms. */
static int
do_connect(idem_gate *g)
{
	struct timeval tv = ms_tv(g->connect_timeout_ms);
	redisContext *c;
	int			ok = 1;
	int			n = 0,
				i;
	char		dbtxt[16];
	char	   *buf = NULL;
	size_t		len = 0;
	int64_t		deadline;
	int			info_at = -1;	/* index of INFO cluster's reply */
	int			cluster = 0;
	int			io_failed = 0;	/* no reply (not an error reply) */

	g->connects++;
	if (g->cluster_mode > 0 || g->vc != NULL)
		return cluster_open(g);
	c = redisConnectWithTimeout(g->host, g->port, tv);
	if (c == NULL || c->err)
	{
		if (c)
			redisFree(c);
		/* the first node is down: the others may be a cluster's */
		if (g->nodes != NULL && g->cluster_mode == 0)
			return cluster_open(g);
		g->down_until = idemc_now_ms() + g->retry_ms;
		return -1;
	}
	g->c = c;
	ok = socket_setup(g) == 0;
	if (ok && g->password)
	{
		const char *argv[2] = {"AUTH", g->password};

		ok = append_cmd(&buf, &len, 2, argv) == 0;
		n++;
	}
	/* before SELECT, which a cluster refuses: it must be recognised */
	if (ok && g->cluster_mode == 0)
	{
		const char *argv[2] = {"INFO", "cluster"};

		ok = append_cmd(&buf, &len, 2, argv) == 0;
		n++;
		info_at = n - 1;
	}
	if (ok && g->db != 0)
	{
		const char *argv[2] = {"SELECT", dbtxt};

		snprintf(dbtxt, sizeof(dbtxt), "%d", g->db);
		ok = append_cmd(&buf, &len, 2, argv) == 0;
		n++;
	}
	if (ok)
	{
		const char *argv[3] = {"SCRIPT", "LOAD", CAD_SCRIPT};

		ok = append_cmd(&buf, &len, 3, argv) == 0;
		n++;
	}
	deadline = idemc_now_ms() + g->command_timeout_ms;
	if (ok)
	{
		g->round_trips++;
		ok = send_all(g, buf, len, deadline) == 0;
		io_failed = !ok;
	}
	free(buf);
	for (i = 0; ok && i < n; i++)
	{
		redisReply *rep = read_reply(g, deadline);
		int			is_sha = i == n - 1;

		if (rep == NULL)
			ok = 0, io_failed = 1;
		else if (i == info_at)
			cluster = ((redisReply *) rep)->type == REDIS_REPLY_STRING &&
				strstr(((redisReply *) rep)->str, "cluster_enabled:1") != NULL;
		else if (!reply_ok(rep, is_sha, CAD_SHA1))
			ok = 0;
		if (rep)
			freeReplyObject(rep);
	}
	if (cluster && g->db != 0)
	{
		/* a configuration error, not an outage: the gate stays off */
		db_on_cluster(g);
		drop(g);
		return -1;
	}
	if (!ok)
	{
		drop(g);
		/* the first node hangs: the others may be a cluster's */
		if (io_failed && g->nodes != NULL && g->cluster_mode == 0)
			return cluster_open(g);
		g->down_until = idemc_now_ms() + g->retry_ms;
		return -1;
	}
	if (cluster)
	{
		drop(g);
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

/*
 * Connected, or connect now.  hiredis writes the connection's first
 * commands itself, with write(): a Valkey dying right then would raise
 * SIGPIPE, so connecting runs with it blocked.  Commands afterwards go
 * through exchange(), which sends with MSG_NOSIGNAL and needs no mask.
 */
static int
ensure(idem_gate *g)
{
	pipe_guard	pg;
	int			rc;

	if (g->c || (g->vc != NULL && idem_vc_is_open(g->vc)))
		return 0;
	if (idemc_gate_resting(g))
		return -1;
	pipe_block(&pg);
	rc = do_connect(g);
	pipe_unblock(&pg);
	return rc;
}

void
idemc_gate_connect(idem_gate *g)
{
	if (g != NULL)
		(void) ensure(g);
}

static void
io_error(redisContext *c, int type, const char *what)
{
	c->err = type;
	snprintf(c->errstr, sizeof(c->errstr), "%s", what);
}

/*
 * Wait until fd is ready for events, or the deadline (monotonic ms) passes.
 * A signal does not extend the wait: what is left is recomputed.  Returns
 * 1 ready, 0 deadline passed, -1 error (errno set).
 */
static int
wait_fd(int fd, short events, int64_t deadline)
{
	for (;;)
	{
		struct pollfd pfd;
		int64_t		left = deadline - idemc_now_ms();
		int			rc;

		if (left <= 0)
			return 0;
		pfd.fd = fd;
		pfd.events = events;
		pfd.revents = 0;
		rc = poll(&pfd, 1, (int) left);
		if (rc > 0)
			return 1;
		if (rc == 0)
			return 0;
		if (errno != EINTR)
			return -1;
	}
}

/* SO_RCVTIMEO of g->c's socket, in ms (> 0). */
static int
set_rcvtimeo(idem_gate *g, int64_t ms)
{
	struct timeval tv = ms_tv((int) ms);

	if (setsockopt(g->c->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0)
		return -1;
	g->rcvtimeo_ms = (int) ms;
	return 0;
}

/*
 * A new connection's socket: blocking, with the command timeout as
 * SO_RCVTIMEO, so that waiting for a reply is one recv() (no poll() before
 * it: a gate run costs two system calls, send and recv, as a GET does).
 */
static int
socket_setup(idem_gate *g)
{
	int			fl = fcntl(g->c->fd, F_GETFL);

	if (fl < 0 ||
		((fl & O_NONBLOCK) && fcntl(g->c->fd, F_SETFL, fl & ~O_NONBLOCK) != 0))
		return -1;
	return set_rcvtimeo(g, g->command_timeout_ms);
}

/*
 * Send len bytes before the deadline, with MSG_NOSIGNAL: at once, waiting
 * (poll) only when the socket's buffer is full.  0, or -1 with the error
 * left in g->c and g->last_errno (0 for the deadline).
 */
static int
send_all(idem_gate *g, const char *buf, size_t len, int64_t deadline)
{
	redisContext *c = g->c;
	size_t		off = 0;

	while (off < len)
	{
		ssize_t		n = send(c->fd, buf + off, len - off,
							 MSG_NOSIGNAL | MSG_DONTWAIT);

		if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK))
		{
			int			w = wait_fd(c->fd, POLLOUT, deadline);

			if (w <= 0)
			{
				g->last_errno = w < 0 ? errno : 0;
				io_error(c, REDIS_ERR_IO, w < 0 ? strerror(errno) : "timeout");
				return -1;
			}
			continue;
		}
		if (n <= 0)
		{
			g->last_errno = n < 0 ? errno : 0;
			io_error(c, REDIS_ERR_IO, n < 0 ? strerror(errno) : "send");
			return -1;
		}
		off += (size_t) n;
	}
	return 0;
}

/*
 * Read one reply before the deadline.  Returns it (caller frees), or NULL
 * with the error left in g->c and g->last_errno (0: EOF, deadline,
 * protocol).
 *
 * A blocking recv() bounded by SO_RCVTIMEO: the socket's timeout is brought
 * down to what is left of the deadline whenever it exceeds it by more than
 * a millisecond (after a partial reply, or a signal: a recv() on a socket
 * with a timeout is never restarted, it fails with EINTR), and back up at
 * the next command; so a signal never extends the deadline.
 */
static redisReply *
read_reply(idem_gate *g, int64_t deadline)
{
	redisContext *c = g->c;

	for (;;)
	{
		void	   *reply = NULL;
		char		buf[16 * 1024];
		ssize_t		n;
		int64_t		left;

		if (redisGetReplyFromReader(c, &reply) != REDIS_OK)
		{
			g->last_errno = 0;
			return NULL;
		}
		if (reply != NULL)
			return reply;
		left = deadline - idemc_now_ms();
		if (left <= 0)
		{
			g->last_errno = 0;
			io_error(c, REDIS_ERR_IO, "timeout");
			return NULL;
		}
		if ((g->rcvtimeo_ms > left + 1 || g->rcvtimeo_ms < left - 1) &&
			set_rcvtimeo(g, left) != 0)
		{
			g->last_errno = errno;
			io_error(c, REDIS_ERR_IO, strerror(errno));
			return NULL;
		}
		n = recv(c->fd, buf, sizeof(buf), 0);
		if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK))
			continue;			/* the deadline is checked above */
		if (n == 0)
		{
			g->last_errno = 0;
			io_error(c, REDIS_ERR_EOF, "Server closed the connection");
			return NULL;
		}
		if (n < 0)
		{
			g->last_errno = errno;
			io_error(c, REDIS_ERR_IO, strerror(errno));
			return NULL;
		}
		if (redisReaderFeed(c->reader, buf, (size_t) n) != REDIS_OK)
		{
			g->last_errno = 0;
			io_error(c, REDIS_ERR_PROTOCOL, "Protocol error");
			return NULL;
		}
	}
}

/*
 * One command and its reply, within the command timeout (a deadline).
 * Returns the reply (caller frees) or NULL, with the error in g->c and
 * g->last_errno.
 */
static redisReply *
exchange(idem_gate *g, int argc, const char **argv, const size_t *argvlen)
{
	redisContext *c = g->c;
	int64_t		deadline = idemc_now_ms() + g->command_timeout_ms;
	char	   *cmd = NULL;
	long long	len = redisFormatCommandArgv(&cmd, argc, argv, argvlen);
	int			rc;

	g->last_errno = 0;
	if (len < 0)
	{
		io_error(c, REDIS_ERR_OOM, "Out of memory");
		return NULL;
	}
	rc = send_all(g, cmd, (size_t) len, deadline);
	redisFreeCommand(cmd);
	if (rc != 0)
		return NULL;
	return read_reply(g, deadline);
}

/* Did the established connection die (EOF, reset, broken pipe), as opposed
 * to a timeout?  Only then is one immediate retry on a new connection worth
 * it. */
static int
connection_died(const idem_gate *g)
{
	return g->c->err == REDIS_ERR_EOF ||
		g->last_errno == ECONNRESET || g->last_errno == EPIPE ||
		g->last_errno == ECONNABORTED;
}

/*
 * Cluster mode: one command to the master of its key (argv[3] of EVAL and
 * EVALSHA, argv[1] otherwise).  NULL when that node cannot answer now.
 */
static redisReply *
cluster_command(idem_gate *g, int argc, const char **argv,
				const size_t *argvlen)
{
	idem_vc_cmd cmd;
	int			k = (argv[0][0] == 'E') ? 3 : 1;

	memset(&cmd, 0, sizeof(cmd));
	cmd.key = argv[k];
	cmd.keylen = argvlen ? argvlen[k] : strlen(argv[k]);
	cmd.argc = argc;
	cmd.argv = argv;
	cmd.argvlen = argvlen;
	g->round_trips++;
	if (idem_vc_pipeline(g->vc, &cmd, 1, idemc_now_ms() + g->command_timeout_ms) != 1)
		return NULL;
	return cmd.reply;
}

/*
 * Single node: n commands in one pipeline and their replies (out[i], the
 * caller frees), within the command timeout.  0, or -1 with the connection
 * dropped and out[] all NULL.
 */
/*
 * Append GET key to *buf: the gate's owner check, the same key lookup after
 * lookup, so its bytes are formatted once and kept.
 */
static int
append_get(idem_gate *g, char **buf, size_t *len, const char *key)
{
	char	   *grown;

	if (g->get_key == NULL || strcmp(g->get_key, key) != 0)
	{
		const char *argv[2] = {"GET", key};
		char	   *cmd = NULL;
		long long	n = redisFormatCommandArgv(&cmd, 2, argv, NULL);
		char	   *k = strdup(key);

		if (n < 0 || k == NULL)
		{
			if (n >= 0)
				redisFreeCommand(cmd);
			free(k);
			return -1;
		}
		free(g->get_cmd);
		free(g->get_key);
		g->get_cmd = malloc((size_t) n);
		if (g->get_cmd == NULL)
		{
			redisFreeCommand(cmd);
			free(k);
			g->get_key = NULL;
			return -1;
		}
		memcpy(g->get_cmd, cmd, (size_t) n);
		redisFreeCommand(cmd);
		g->get_cmd_len = (size_t) n;
		g->get_key = k;
	}
	grown = realloc(*buf, *len + g->get_cmd_len);
	if (grown == NULL)
		return -1;
	memcpy(grown + *len, g->get_cmd, g->get_cmd_len);
	*buf = grown;
	*len += g->get_cmd_len;
	return 0;
}

static int
exchange_pipeline(idem_gate *g, int n, const int *argc, const char *const *const *argv,
				  redisReply **out)
{
	int64_t		deadline = idemc_now_ms() + g->command_timeout_ms;
	char	   *buf = NULL;
	size_t		len = 0;
	int			ok = 1;
	int			i;

	g->last_errno = 0;
	for (i = 0; i < n; i++)
		out[i] = NULL;
	for (i = 0; ok && i < n; i++)
		ok = (argc[i] == 2 && strcmp(argv[i][0], "GET") == 0 ?
			  append_get(g, &buf, &len, argv[i][1]) :
			  append_cmd(&buf, &len, argc[i], (const char **) argv[i])) == 0;
	if (!ok)
		io_error(g->c, REDIS_ERR_OOM, "Out of memory");
	else
		ok = send_all(g, buf, len, deadline) == 0;
	free(buf);
	for (i = 0; ok && i < n; i++)
		ok = (out[i] = read_reply(g, deadline)) != NULL;
	if (ok)
		return 0;
	for (i = 0; i < n; i++)
	{
		if (out[i])
			freeReplyObject(out[i]);
		out[i] = NULL;
	}
	return -1;
}

/*
 * n single-key commands (the key is argv[i][1]) in one round trip: one
 * pipeline on a single node (retried once on a new connection if a reused
 * one was dead), or each node's share sent before any reply is read on a
 * cluster.  out[i] is command i's reply (the caller frees), or NULL if it
 * has none (its node failed, or the connection did).
 */
static void
commands(idem_gate *g, int n, const int *argc, const char *const *const *argv,
		 redisReply **out)
{
	int			i,
				tries;

	for (i = 0; i < n; i++)
		out[i] = NULL;
	if (ensure(g) != 0)
		return;
	if (g->vc != NULL)
	{
		idem_vc_cmd cmds[2];

		if (n > 2)
			return;
		memset(cmds, 0, sizeof(cmds));
		for (i = 0; i < n; i++)
		{
			cmds[i].key = argv[i][1];
			cmds[i].keylen = strlen(argv[i][1]);
			cmds[i].argc = argc[i];
			cmds[i].argv = (const char **) argv[i];
		}
		g->round_trips++;
		(void) idem_vc_pipeline(g->vc, cmds, n,
								idemc_now_ms() + g->command_timeout_ms);
		for (i = 0; i < n; i++)
			out[i] = cmds[i].reply;
		return;
	}
	for (tries = 0; tries < 2; tries++)
	{
		int			died;
		int			reused = g->c != NULL;

		if (ensure(g) != 0)
			return;
		g->round_trips++;
		if (exchange_pipeline(g, n, argc, argv, out) == 0)
			return;
		died = connection_died(g);
		drop(g);
		if (!died || !reused)
			return;
	}
}

/* What the check key's reply says (gate_reply.checked). */
static int
check_holds(const redisReply *r, const char *value)
{
	if (r == NULL || value == NULL || r->type != REDIS_REPLY_STRING)
		return GATE_CHECK_ABSENT;
	return (r->len == strlen(value) && memcmp(r->str, value, r->len) == 0) ?
		GATE_CHECK_HOLDS : GATE_CHECK_OTHER;
}

/*
 * Run one command; on a dead reused connection, reconnect and try once more.
 * Returns the reply (caller frees) or NULL with the connection dropped.
 */
static redisReply *
command(idem_gate *g, int argc, const char **argv, const size_t *argvlen)
{
	int			tries;

	if (g->vc != NULL)
		return ensure(g) == 0 ? cluster_command(g, argc, argv, argvlen) : NULL;

	for (tries = 0; tries < 2; tries++)
	{
		redisReply *r;
		int			died;
		int			reused = g->c != NULL;

		if (ensure(g) != 0)
			return NULL;
		g->round_trips++;
		r = exchange(g, argc, argv, argvlen);
		if (r != NULL)
			return r;
		died = connection_died(g);
		drop(g);
		if (!died || !reused)
			return NULL;
	}
	return NULL;
}

/* EVALSHA, and EVAL if the server lost the script (SCRIPT FLUSH, restart). */
static redisReply *
eval(idem_gate *g, const char *sha, const char *script, int nargs,
	 const char **args)
{
	const char *argv[8];
	size_t		argvlen[8];
	redisReply *r;
	int			i;

	if (ensure(g) != 0)
		return NULL;
	argv[0] = "EVALSHA";
	argv[1] = sha;
	argv[2] = "1";
	for (i = 0; i < nargs; i++)
		argv[3 + i] = args[i];
	for (i = 0; i < 3 + nargs; i++)
		argvlen[i] = strlen(argv[i]);
	r = command(g, 3 + nargs, argv, argvlen);
	if (r && r->type == REDIS_REPLY_ERROR && strncmp(r->str, "NOSCRIPT", 8) == 0)
	{
		freeReplyObject(r);
		argv[0] = "EVAL";
		argv[1] = script;
		argvlen[0] = 4;
		argvlen[1] = strlen(script);
		r = command(g, 3 + nargs, argv, argvlen);
	}
	return r;
}

/* A GET (or SET ... GET) reply into a gate_reply: GATE_VALUE for a string,
 * GATE_ABSENT for nil (the node answered: the key is not there). */
static void
take_value(gate_reply *out, const redisReply *r)
{
	if (r != NULL && r->type == REDIS_REPLY_NIL)
		out->answer = GATE_ABSENT;
	if (r == NULL || r->type != REDIS_REPLY_STRING ||
		(out->value = malloc(r->len + 1)) == NULL)
		return;
	memcpy(out->value, r->str, r->len);
	out->value[r->len] = '\0';
	out->value_len = r->len;
	out->answer = GATE_VALUE;
}

void
idemc_gate_enter(idem_gate *g, const char *key, const char *marker,
				const char *lease_ms, const char *check_key,
				const char *check_value, gate_reply *out)
{
	const char *argv[7];
	const char *get[2];
	const char *const *argvs[2];
	int			argc[2] = {7, 2};
	size_t		marker_len = strlen(marker);
	redisReply *replies[2];
	redisReply *r;

	memset(out, 0, sizeof(*out));
	out->answer = GATE_SKIPPED;
	if (g == NULL || idemc_gate_resting(g))
		return;
	argv[0] = "SET";
	argv[1] = key;
	argv[2] = marker;
	argv[3] = "NX";
	argv[4] = "PX";
	argv[5] = lease_ms;
	argv[6] = "GET";
	get[0] = "GET";
	get[1] = check_key;
	argvs[0] = argv;
	argvs[1] = get;
	commands(g, check_key ? 2 : 1, argc, argvs, replies);
	if (check_key)
	{
		out->checked = check_holds(replies[1], check_value);
		if (replies[1])
			freeReplyObject(replies[1]);
	}
	r = replies[0];
	if (r == NULL)
		return;
	if (r->type == REDIS_REPLY_NIL)
		out->answer = GATE_ACQUIRED;	/* absent: our marker is set */
	else
	{
		take_value(out, r);
		/* our own marker, from a command retried after a dead connection */
		if (out->answer == GATE_VALUE && out->value_len == marker_len &&
			memcmp(out->value, marker, out->value_len) == 0)
		{
			free(out->value);
			out->value = NULL;
			out->value_len = 0;
			out->answer = GATE_ACQUIRED;
		}
	}

	/*
	 * Anything else is an error reply (say WRONGTYPE for a key of another
	 * type, or a server older than Redis 7.0 refusing NX with GET): Valkey
	 * answered but has nothing usable; skip the gate.
	 */
	freeReplyObject(r);
}

void
idemc_gate_get_many(idem_gate *g, const char *const *keys, int n,
				   const char *check_key, const char *check_value,
				   gate_reply *out, int *checked)
{
	int64_t		deadline;
	int			i;
	int			ncmd = n + (check_key != NULL);

	memset(out, 0, sizeof(*out) * (n > 0 ? n : 0));	/* GATE_SKIPPED */
	*checked = 0;
	if (g == NULL || n <= 0 || idemc_gate_resting(g) || ensure(g) != 0)
		return;
	deadline = idemc_now_ms() + g->command_timeout_ms;
	g->round_trips++;
	if (g->vc != NULL)
	{
		/* split per node by the router; a node that fails skips its keys */
		idem_vc_cmd *cmds = calloc(ncmd, sizeof(idem_vc_cmd));
		const char **argv = calloc(2 * (size_t) ncmd, sizeof(char *));

		if (cmds != NULL && argv != NULL)
		{
			for (i = 0; i < ncmd; i++)
			{
				const char *k = i < n ? keys[i] : check_key;

				argv[2 * i] = "GET";
				argv[2 * i + 1] = k;
				cmds[i].key = k;
				cmds[i].keylen = strlen(k);
				cmds[i].argc = 2;
				cmds[i].argv = &argv[2 * i];
			}
			(void) idem_vc_pipeline(g->vc, cmds, ncmd, deadline);
			for (i = 0; i < ncmd; i++)
			{
				if (i < n)
					take_value(&out[i], cmds[i].reply);
				else
					*checked = check_holds(cmds[i].reply, check_value);
				if (cmds[i].reply)
					freeReplyObject(cmds[i].reply);
			}
		}
		free(cmds);
		free(argv);
		return;
	}
	{
		char	   *buf = NULL;
		size_t		len = 0;
		int			ok = 1;

		for (i = 0; ok && i < ncmd; i++)
		{
			const char *argv[2] = {"GET", i < n ? keys[i] : check_key};

			ok = append_cmd(&buf, &len, 2, argv) == 0;
		}
		if (ok)
			ok = send_all(g, buf, len, deadline) == 0;
		free(buf);
		for (i = 0; ok && i < ncmd; i++)
		{
			redisReply *r = read_reply(g, deadline);

			if (r == NULL)
				ok = 0;
			if (i < n)
				take_value(&out[i], r);
			else
				*checked = check_holds(r, check_value);
			if (r)
				freeReplyObject(r);
		}
		if (!ok)
			drop(g);			/* replies may be pending: a fresh one next */
	}
}

int
idemc_gate_release(idem_gate *g, const char *key, const char *marker)
{
	const char *args[2];
	redisReply *r;
	int			rc = -1;

	if (g == NULL || idemc_gate_resting(g))
		return -1;
	args[0] = key;
	args[1] = marker;
	r = eval(g, CAD_SHA1, CAD_SCRIPT, 2, args);
	if (r == NULL)
		return -1;
	if (r->type == REDIS_REPLY_INTEGER)
		rc = r->integer > 0 ? 1 : 0;
	freeReplyObject(r);
	return rc;
}
