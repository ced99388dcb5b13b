/*
 * valkey_io.c
 *	  The bytes of the gate's Valkey connection, and what a failure means.
 *
 *	  hiredis formats commands and parses replies; the bytes go through
 *	  the same send and receive as every Valkey connection of idem
 *	  (../src/common/valkey_wire.c): send(MSG_NOSIGNAL), so a dead Valkey
 *	  is an error, never SIGPIPE, without masking signals on every call.
 *	  The command timeout is a deadline: a reply is waited for by a
 *	  blocking recv() whose SO_RCVTIMEO is what is left of it (a send that
 *	  finds the socket full waits with poll()), and a signal (EINTR) never
 *	  restarts the clock; an exchange is two system calls, as hiredis's own
 *	  GET.
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
#include <stdlib.h>
#include <string.h>

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
 * A new connection's socket: blocking, with the command timeout as
 * SO_RCVTIMEO, so that waiting for a reply is one recv() (no poll() before
 * it: a gate run costs two system calls, send and recv, as a GET does).
 */
int
idemc_vk_socket_setup(idem_gate *g)
{
	return idem_vc_wire_set_blocking(g->c->fd, g->command_timeout_ms,
									 &g->rcvtimeo_ms);
}

/* A failed exchange: errno into g->last_errno, the error into g->c. */
static void
io_failed(idem_gate *g, const char *what)
{
	int			e = errno;

	g->last_errno = e;
	io_error(g->c, e == ECONNRESET ? REDIS_ERR_EOF : REDIS_ERR_IO, what);
}

/*
 * Send len bytes before the deadline (../src/common/valkey_wire.c: at once,
 * waiting with poll() only when the socket's buffer is full).  0, or -1
 * with the error left in g->c and g->last_errno (0 for the deadline).
 */
int
idemc_vk_send_all(idem_gate *g, const char *buf, size_t len, int64_t deadline)
{
	idem_vc_io	io = {idemc_vc_poll_wait, NULL, NULL};
	char		err[128];

	if (idem_vc_wire_send(g->c->fd, buf, len, deadline, &io, err,
						  sizeof(err)) == 0)
		return 0;
	io_failed(g, err);
	return -1;
}

/*
 * Read one reply before the deadline: a blocking recv() bounded by
 * SO_RCVTIMEO, kept within what is left of the deadline
 * (../src/common/valkey_wire.c).  Returns it (caller frees), or NULL with
 * the error left in g->c and g->last_errno (ECONNRESET for EOF; 0: the
 * deadline, a protocol error).
 */
redisReply *
idemc_vk_read_reply(idem_gate *g, int64_t deadline)
{
	redisReply *r = NULL;
	char		err[128];

	if (idem_vc_wire_read(g->c->fd, g->c->reader, deadline, 0,
						  &g->rcvtimeo_ms, NULL, err, sizeof(err), &r) == 0)
		return r;
	io_failed(g, err);
	return NULL;
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

/* Did the established connection die (EOF, reset, broken pipe), as opposed
 * to a timeout?  Only then is one immediate retry on a new connection worth
 * it. */
static int
connection_died(const idem_gate *g)
{
	return g->last_errno == ECONNRESET || g->last_errno == EPIPE ||
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
			  idem_vc_wire_append(&buf, &len, argc[i], (const char **) argv[i])) == 0;
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
