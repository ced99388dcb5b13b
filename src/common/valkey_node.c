/*-------------------------------------------------------------------------
 *
 * valkey_node.c
 *	  The router's node table and each node's I/O: one non-blocking socket,
 *	  one hiredis reader and one output buffer per node; connect (with AUTH
 *	  and SELECT in one round trip), send, read, rest after a failure.  The
 *	  bytes go through valkey_wire.c; waiting is the caller's
 *	  (idem_vc_io.wait).
 *
 *-------------------------------------------------------------------------
 */
#include "valkey_router_int.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

void
idem_vc_set_err(idem_vc *vc, const char *fmt,...)
{
	va_list		ap;

	va_start(ap, fmt);
	vsnprintf(vc->err, sizeof(vc->err), fmt, ap);
	va_end(ap);
}

void
idem_vc_copy_err(char *err, size_t errlen, const char *text)
{
	if (err != NULL && errlen > 0)
		snprintf(err, errlen, "%s", text);
}

/* Index of host:port in the node table, added if new; -1 if full. */
int
idem_vc_node_get(idem_vc *vc, const char *host, int port)
{
	int			i;
	vc_node    *n;

	for (i = 0; i < vc->nnodes; i++)
		if (vc->nodes[i].port == port && strcmp(vc->nodes[i].host, host) == 0)
			return i;
	if (vc->nnodes == IDEM_VC_MAX_NODES || strlen(host) >= IDEM_VC_HOST_MAX)
		return -1;
	n = &vc->nodes[vc->nnodes];
	memset(n, 0, sizeof(*n));
	snprintf(n->host, sizeof(n->host), "%s", host);
	n->port = port;
	idem_vc_format_endpoint(n->name, sizeof(n->name), host, port);
	n->fd = -1;
	return vc->nnodes++;
}

void
idem_vc_node_unsent(idem_vc *vc, vc_node *n)
{
	if (n->sent)
	{
		n->sent = 0;
		vc->nsent--;
	}
}

void
idem_vc_node_drop(idem_vc *vc, vc_node *n)
{
	idem_vc_node_unsent(vc, n);
	if (n->fd >= 0)
	{
		if (vc->io.closing)
			vc->io.closing(vc->io.arg, n->fd);
		close(n->fd);
		n->fd = -1;
	}
	if (n->rd)
		redisReaderFree(n->rd);
	n->rd = NULL;
	n->olen = 0;
	n->nexpect = 0;
	n->rcvtimeo_ms = 0;
	n->answered = 0;
}

/* A failure on an established or new connection: drop it, let it rest. */
void
idem_vc_node_failed(idem_vc *vc, vc_node *n, const char *what)
{
	char		why[VC_ERR_LEN];

	snprintf(why, sizeof(why), "%s", vc->err[0] ? vc->err : "failed");
	idem_vc_set_err(vc, "%s %s: %s", what, n->name, why);
	snprintf(n->failure, sizeof(n->failure), "%.159s", vc->err);
	idem_vc_node_drop(vc, n);
	n->errors++;
	vc->stats.node_errors++;
	n->down_until = idem_vc_now_ms() + vc->retry_ms;
	if (vc->cluster)
		vc->need_refresh = 1;
}

/*
 * A failure of an exchange on n's connection: with reconnect_dead, a
 * connection that had answered before and died is dropped without a rest
 * (the next round connects again and resends what it left unanswered);
 * anything else fails the node.
 */
void
idem_vc_node_lost(idem_vc *vc, vc_node *n, const char *what)
{
	if (vc->reconnect_dead && n->answered && n->died)
		idem_vc_node_drop(vc, n);
	else
		idem_vc_node_failed(vc, n, what);
}

int
idem_vc_node_append(idem_vc *vc, vc_node *n, int argc, const char **argv,
			const size_t *argvlen)
{
	char	   *cmd = NULL;
	long long	len = redisFormatCommandArgv(&cmd, argc, argv, argvlen);

	if (len < 0)
	{
		idem_vc_set_err(vc, "out of memory");
		return -1;
	}
	if (n->olen + (size_t) len > n->ocap)
	{
		size_t		cap = n->ocap ? n->ocap : 4096;
		char	   *nb;

		while (cap < n->olen + (size_t) len)
			cap *= 2;
		nb = realloc(n->obuf, cap);
		if (nb == NULL)
		{
			redisFreeCommand(cmd);
			idem_vc_set_err(vc, "out of memory");
			return -1;
		}
		n->obuf = nb;
		n->ocap = cap;
	}
	memcpy(n->obuf + n->olen, cmd, (size_t) len);
	n->olen += (size_t) len;
	redisFreeCommand(cmd);
	return 0;
}

int
idem_vc_node_expect(idem_vc *vc, vc_node *n, int what)
{
	if (n->nexpect == n->expcap)
	{
		int			cap = n->expcap ? n->expcap * 2 : 64;
		int		   *ne = realloc(n->expect, sizeof(int) * cap);

		if (ne == NULL)
		{
			idem_vc_set_err(vc, "out of memory");
			return -1;
		}
		n->expect = ne;
		n->expcap = cap;
	}
	n->expect[n->nexpect++] = what;
	return 0;
}

/*
 * Did the connection die (EOF, reset, broken pipe), rather than time out or
 * say something unreadable?  errno as valkey_wire.c leaves it.
 */
static int
node_died(void)
{
	return errno == ECONNRESET || errno == EPIPE || errno == ECONNABORTED;
}

/* Send everything buffered.  0, -1 (err set), -2 abandon. */
int
idem_vc_node_flush(idem_vc *vc, vc_node *n, int64_t deadline)
{
	int			rc = idem_vc_wire_send(n->fd, n->obuf, n->olen, deadline,
									   &vc->io, vc->err, sizeof(vc->err));

	if (rc == -1)
		n->died = node_died();
	if (rc != 0)
		return rc;
	if (n->olen > 0 && !n->sent)
	{
		n->sent = 1;
		vc->nsent++;
	}
	n->olen = 0;
	return 0;
}

/* Read the next reply.  0 (*out set), -1 (err set), -2 abandon. */
int
idem_vc_node_read(idem_vc *vc, vc_node *n, int64_t deadline, redisReply **out)
{
	/*
	 * Right after a send to this node alone, its reply is almost never in
	 * yet: wait first, which saves a recv that would only say EAGAIN (one
	 * system call per round trip).  When several nodes were sent to, the
	 * later ones' replies are usually in by the time they are read: recv
	 * first.  (A node read after a hung one spent the deadline is still
	 * read: idem_vc_wire_read times out only on a recv that finds nothing.)
	 */
	int			wait_first = n->sent && vc->nsent == 1;
	int			rc;

	idem_vc_node_unsent(vc, n);
	rc = idem_vc_wire_read(n->fd, n->rd, deadline, wait_first,
						   n->rcvtimeo_ms > 0 ? &n->rcvtimeo_ms : NULL,
						   &vc->io, vc->err, sizeof(vc->err), out);
	if (rc == 0)
		n->answered = 1;
	else if (rc == -1)
		n->died = node_died();
	return rc;
}

/* One command and its reply, on a connected node (setup commands). */
int
idem_vc_node_call(idem_vc *vc, vc_node *n, int argc, const char **argv,
		  int64_t deadline, redisReply **out)
{
	int			rc;

	*out = NULL;
	if (idem_vc_node_append(vc, n, argc, argv, NULL) != 0)
		return -1;
	rc = idem_vc_node_flush(vc, n, deadline);
	if (rc == 0)
		rc = idem_vc_node_read(vc, n, deadline, out);
	vc->stats.round_trips++;
	return rc;
}

/* Close a socket this module opened, telling io first. */
static void
tcp_close(const idem_vc_io *io, int fd)
{
	if (io->closing)
		io->closing(io->arg, fd);
	close(fd);
}

int
idem_vc_tcp_connect(const char *host, int port, int64_t deadline,
					const idem_vc_io *io, char *err, size_t errlen)
{
	struct addrinfo hints,
			   *res = NULL,
			   *ai;
	char		portbuf[16];
	int			rc;
	int			one = 1;

	memset(&hints, 0, sizeof(hints));
	hints.ai_family = AF_UNSPEC;
	hints.ai_socktype = SOCK_STREAM;
	snprintf(portbuf, sizeof(portbuf), "%d", port);
	rc = getaddrinfo(host, portbuf, &hints, &res);
	if (rc != 0 || res == NULL)
	{
		snprintf(err, errlen, "could not resolve: %s", gai_strerror(rc));
		return -1;
	}
	snprintf(err, errlen, "could not connect: no address");
	for (ai = res; ai != NULL; ai = ai->ai_next)
	{
		int			fd = socket(ai->ai_family,
								SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
		int			soerr = 0;
		socklen_t	slen = sizeof(soerr);

		if (fd < 0)
		{
			snprintf(err, errlen, "could not create a socket: %s", strerror(errno));
			continue;
		}
		rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
		if (rc != 0 && errno == EINPROGRESS)
		{
			rc = io->wait(io->arg, fd, 1, deadline);
			if (rc != 0)
			{
				tcp_close(io, fd);
				freeaddrinfo(res);
				if (rc == -1)
					snprintf(err, errlen, "timed out connecting");
				return rc;
			}
			if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &slen) != 0)
				soerr = errno;
			rc = soerr != 0 ? -1 : 0;
			errno = soerr;
		}
		if (rc != 0)
		{
			snprintf(err, errlen, "could not connect: %s", strerror(errno));
			tcp_close(io, fd);
			continue;
		}
		(void) setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
		freeaddrinfo(res);
		err[0] = '\0';
		return fd;
	}
	freeaddrinfo(res);
	return -1;
}

/* Open the socket and authenticate.  0, -1 (err set), -2 abandon. */
static int
node_connect(idem_vc *vc, vc_node *n, int64_t deadline)
{
	int			rc;
	int64_t		cdeadline = idem_vc_now_ms() + vc->connect_timeout_ms;

	if (cdeadline > deadline)
		cdeadline = deadline;
	vc->err[0] = '\0';
	vc->stats.connects++;
	n->fd = idem_vc_tcp_connect(n->host, n->port, cdeadline, &vc->io,
								vc->err, sizeof(vc->err));
	if (n->fd < 0)
	{
		rc = n->fd;
		n->fd = -1;
		return rc;
	}
	n->rd = redisReaderCreate();
	if (n->rd == NULL)
	{
		idem_vc_set_err(vc, "out of memory");
		return -1;
	}
	{
		idem_vc_setup su;
		const char *info[2] = {"INFO", "cluster"};
		const char *const *argv[1 + VC_MAX_SETUP];
		int			argc[1 + VC_MAX_SETUP];
		redisReply *replies[1 + VC_MAX_SETUP];
		int			ask = vc->ask_cluster;
		int			i;

		memset(&su, 0, sizeof(su));
		su.password = vc->password;
		su.db = vc->cluster ? 0 : vc->db;
		if (ask)
		{
			/* open, in auto mode: SELECT after INFO cluster, which says
			 * whether its refusal is a cluster's */
			su.db = vc->db;
			argc[su.nextra] = 2;
			argv[su.nextra++] = info;
			vc->said_cluster = -1;
		}
		for (i = 0; i < vc->nsetup; i++)
		{
			argc[su.nextra] = vc->setup_argc[i];
			argv[su.nextra++] = vc->setup_argv[i];
		}
		su.extra_argc = argc;
		su.extra_argv = argv;
		su.extra_replies = replies;
		rc = idem_vc_wire_setup(n->fd, &su, cdeadline, &vc->io,
								vc->err, sizeof(vc->err));
		if (su.password != NULL || su.db != 0 || su.nextra > 0)
		{
			vc->stats.round_trips++;
			vc->stats.setups++;
		}
		if (ask && replies[0] != NULL)
		{
			vc->said_cluster = replies[0]->type == REDIS_REPLY_STRING &&
				strstr(replies[0]->str, "cluster_enabled:1") != NULL;
			/* a cluster's SELECT refused: idem_vc_open says why */
			if (rc == -3 && su.refused == IDEM_VC_SETUP_SELECT &&
				vc->said_cluster == 1)
				rc = 0;
		}
		if (rc == 0 && vc->setup_check != NULL &&
			vc->setup_check(replies + ask, vc->err,
							sizeof(vc->err)) != 0)
			rc = -1;
		for (i = 0; i < su.nextra; i++)
			if (replies[i] != NULL)
				freeReplyObject(replies[i]);
		if (rc == 0 && vc->blocking_reads &&
			idem_vc_wire_set_blocking(n->fd, vc->connect_timeout_ms,
									  &n->rcvtimeo_ms) != 0)
		{
			idem_vc_set_err(vc, "could not make the socket blocking: %s",
							strerror(errno));
			rc = -1;
		}
	}
	n->answered = 0;
	n->died = 0;
	return rc == -3 ? -1 : rc;
}

/* Connected, or connect now unless resting.  0, -1, -2. */
int
idem_vc_node_ensure(idem_vc *vc, vc_node *n, int64_t deadline)
{
	int			rc;

	if (n->fd >= 0)
		return 0;
	if (idem_vc_now_ms() < n->down_until)
	{
		idem_vc_set_err(vc, "%s is resting after a failure (%s)", n->name,
						n->failure[0] ? n->failure : "no detail");
		return -1;
	}

	/*
	 * Another node of the same round used the whole deadline up (a hung
	 * master): this one is not tried now, and is not failed for it.  Had it
	 * been, a healthy node (the one holding the epoch owner key, say) would
	 * rest for retry_ms after any lookup that met the hung one first.
	 */
	if (idem_vc_now_ms() >= deadline)
	{
		idem_vc_set_err(vc, "no time left to connect to %s", n->name);
		return -1;
	}
	rc = node_connect(vc, n, deadline);
	if (rc == -1)
		idem_vc_node_failed(vc, n, "connecting to");
	else if (rc == -2)
		idem_vc_node_drop(vc, n);
	return rc;
}
