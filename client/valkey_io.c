/*
 * valkey_io.c
 *	  The bytes of the gate's Valkey connection, and what a failure means.
 *
 *	  hiredis formats commands and parses replies; after the TCP connect
 *	  (valkey_conn.c), the bytes go through send(MSG_NOSIGNAL) and recv()
 *	  here, so a dead Valkey is an error, never SIGPIPE, without masking
 *	  signals on every call.  The command timeout is a deadline: a reply is
 *	  waited for by a blocking recv() whose SO_RCVTIMEO is what is left of
 *	  it (a send that finds the socket full waits with poll()), and a signal
 *	  (EINTR) never restarts the clock; an exchange is two system calls, as
 *	  hiredis's own GET.
 *
 *	  Errors are classified by errno, never by message text: only a
 *	  connection that died (EOF, reset, broken pipe) is worth one immediate
 *	  retry on a new connection, and only if it was a reused one.  A command
 *	  that timed out leaves its reply unread, so the connection is always
 *	  dropped after any error.
 *
 *	  On a cluster the same calls go through the shared router
 *	  (../src/common/valkey_cluster.c), one command or a pipeline of a few
 *	  single-key commands, each node's share sent before any reply is read.
 */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include <hiredis/hiredis.h>

#include "valkey_cluster.h"
#include "valkey_conn.h"

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
int
idemc_vk_socket_setup(idem_gate *g)
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
int
idemc_vk_send_all(idem_gate *g, const char *buf, size_t len, int64_t deadline)
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
redisReply *
idemc_vk_read_reply(idem_gate *g, int64_t deadline)
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
	rc = idemc_vk_send_all(g, cmd, (size_t) len, deadline);
	redisFreeCommand(cmd);
	if (rc != 0)
		return NULL;
	return idemc_vk_read_reply(g, deadline);
}

/* Append one formatted command to *buf (a malloc'd string of *len bytes). */
int
idemc_vk_append_cmd(char **buf, size_t *len, int argc, const char **argv)
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

/*
 * Single node: n commands in one pipeline and their replies (out[i], the
 * caller frees), within the command timeout.  0, or -1 with the connection
 * dropped and out[] all NULL.
 */
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
			  idemc_vk_append_cmd(&buf, &len, argc[i], (const char **) argv[i])) == 0;
	if (!ok)
		io_error(g->c, REDIS_ERR_OOM, "Out of memory");
	else
		ok = idemc_vk_send_all(g, buf, len, deadline) == 0;
	free(buf);
	for (i = 0; ok && i < n; i++)
		ok = (out[i] = idemc_vk_read_reply(g, deadline)) != NULL;
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
void
idemc_vk_commands(idem_gate *g, int n, const int *argc, const char *const *const *argv,
		 redisReply **out)
{
	int			i,
				tries;

	for (i = 0; i < n; i++)
		out[i] = NULL;
	if (idemc_gate_ensure(g) != 0)
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

		if (idemc_gate_ensure(g) != 0)
			return;
		g->round_trips++;
		if (exchange_pipeline(g, n, argc, argv, out) == 0)
			return;
		died = connection_died(g);
		idemc_gate_drop(g);
		if (!died || !reused)
			return;
	}
}

/*
 * Run one command; on a dead reused connection, reconnect and try once more.
 * Returns the reply (caller frees) or NULL with the connection dropped.
 */
redisReply *
idemc_vk_command(idem_gate *g, int argc, const char **argv, const size_t *argvlen)
{
	int			tries;

	if (g->vc != NULL)
		return idemc_gate_ensure(g) == 0 ? cluster_command(g, argc, argv, argvlen) : NULL;

	for (tries = 0; tries < 2; tries++)
	{
		redisReply *r;
		int			died;
		int			reused = g->c != NULL;

		if (idemc_gate_ensure(g) != 0)
			return NULL;
		g->round_trips++;
		r = exchange(g, argc, argv, argvlen);
		if (r != NULL)
			return r;
		died = connection_died(g);
		idemc_gate_drop(g);
		if (!died || !reused)
			return NULL;
	}
	return NULL;
}
