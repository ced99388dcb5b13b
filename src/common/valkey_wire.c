/*-------------------------------------------------------------------------
 *
 * valkey_wire.c
 *	  The bytes of one Valkey connection, for every connection idem opens
 *	  (the router's nodes, hence the worker's; the runner's gate): send a
 *	  buffer, read one reply, both before a deadline; and the setup of a new
 *	  connection (AUTH, the caller's commands, SELECT) pipelined in one
 *	  round trip.
 *
 *	  Sends use send(MSG_NOSIGNAL | MSG_DONTWAIT): a dead Valkey is an
 *	  error, never SIGPIPE, and a full socket buffer waits through
 *	  idem_vc_io.wait, on a blocking socket too.  A reply is read one of two
 *	  ways, chosen by the caller:
 *	    - a non-blocking socket (the router's nodes): recv, and wait through
 *	      idem_vc_io.wait on EAGAIN, or before the first recv when the reply
 *	      cannot be in yet (saves a recv that would say EAGAIN);
 *	    - a blocking socket with SO_RCVTIMEO (the runner's router): one
 *	      blocking recv per reply, the timeout kept within what is left of
 *	      the deadline, so an exchange is two system calls, as hiredis's own
 *	      GET.
 *	  Either way a read times out only when a recv made past the deadline
 *	  finds nothing: what came in while another connection spent the
 *	  deadline is still read.  A signal never extends the deadline: a recv
 *	  on a socket with a timeout is not restarted (EINTR), and what is left
 *	  is recomputed.
 *	  On failure errno is kept as the system call left it (ECONNRESET for
 *	  EOF, 0 for the deadline and a protocol error), so a caller can tell a
 *	  connection that died from one that timed out.
 *
 *	  No locking: a connection belongs to one thread.
 *
 *-------------------------------------------------------------------------
 */
#include "valkey_wire.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>

int64_t
idem_vc_now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t) ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void
wire_err(char *err, size_t errlen, const char *text)
{
	if (err != NULL && errlen > 0)
		snprintf(err, errlen, "%s", text);
}

/* "what: strerror(errno)" into err, errno kept. */
static void
sys_err(char *err, size_t errlen, const char *what)
{
	int			e = errno;

	if (err != NULL && errlen > 0)
		snprintf(err, errlen, "%s: %s", what, e ? strerror(e) : "nothing sent");
	errno = e;
}

int
idem_vc_wire_send(int fd, const char *buf, size_t len, int64_t deadline,
				  const idem_vc_io *io, char *err, size_t errlen)
{
	size_t		off = 0;

	while (off < len)
	{
		ssize_t		w = send(fd, buf + off, len - off,
							 MSG_NOSIGNAL | MSG_DONTWAIT);

		if (w > 0)
		{
			off += (size_t) w;
			continue;
		}
		if (w < 0 && errno == EINTR)
			continue;
		if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
		{
			int			rc = io->wait(io->arg, fd, 1, deadline);

			if (rc != 0)
			{
				if (rc == -1)
				{
					wire_err(err, errlen, "timed out sending");
					errno = 0;
				}
				return rc;
			}
			continue;
		}
		if (w == 0)
			errno = 0;
		sys_err(err, errlen, "could not send");
		return -1;
	}
	return 0;
}

/* SO_RCVTIMEO of a blocking socket, in ms (> 0). */
static int
set_rcvtimeo(int fd, int64_t ms, int *rcvtimeo_ms)
{
	struct timeval tv;

	tv.tv_sec = (time_t) (ms / 1000);
	tv.tv_usec = (suseconds_t) ((ms % 1000) * 1000);
	if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0)
		return -1;
	*rcvtimeo_ms = (int) ms;
	return 0;
}

int
idem_vc_wire_set_blocking(int fd, int timeout_ms, int *rcvtimeo_ms)
{
	int			fl = fcntl(fd, F_GETFL);

	if (fl < 0 ||
		((fl & O_NONBLOCK) && fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0))
		return -1;
	return set_rcvtimeo(fd, timeout_ms, rcvtimeo_ms);
}

int
idem_vc_wire_read(int fd, redisReader *rd, int64_t deadline, int wait_first,
				  int *rcvtimeo_ms, const idem_vc_io *io,
				  char *err, size_t errlen, redisReply **out)
{
	int			waited_out = 0;	/* io.wait said the time is up */

	*out = NULL;
	for (;;)
	{
		void	   *reply = NULL;
		char		buf[16 * 1024];
		ssize_t		got;
		int			late;
		int			rc;
		int64_t		left;

		if (redisReaderGetReply(rd, &reply) != REDIS_OK)
		{
			wire_err(err, errlen, "protocol error");
			errno = 0;
			return -1;
		}
		if (reply != NULL)
		{
			*out = reply;
			return 0;
		}

		/*
		 * A read times out only when a recv made past the deadline finds
		 * nothing: the deadline may have been spent on another connection
		 * (a hung node read first) while this one's reply came in.  Before
		 * it, a blocking socket's recv waits at most what is left, and a
		 * non-blocking one is waited for through io (first, when the reply
		 * cannot be in yet: that saves a recv that would say EAGAIN).
		 */
		left = deadline - idem_vc_now_ms();
		late = left <= 0 || waited_out;
		if (!late && rcvtimeo_ms != NULL &&
			(*rcvtimeo_ms > left + 1 || *rcvtimeo_ms < left - 1) &&
			set_rcvtimeo(fd, left, rcvtimeo_ms) != 0)
		{
			sys_err(err, errlen, "could not set a timeout");
			return -1;
		}
		if (!late && rcvtimeo_ms == NULL && wait_first)
		{
			wait_first = 0;
			if ((rc = io->wait(io->arg, fd, 0, deadline)) == -2)
				return -2;
			waited_out = rc != 0;
			continue;
		}
		got = recv(fd, buf, sizeof(buf), late ? MSG_DONTWAIT : 0);
		if (got > 0)
		{
			if (redisReaderFeed(rd, buf, (size_t) got) != REDIS_OK)
			{
				wire_err(err, errlen, "protocol error");
				errno = 0;
				return -1;
			}
			continue;
		}
		if (got == 0)
		{
			wire_err(err, errlen, "server closed the connection");
			errno = ECONNRESET;
			return -1;
		}
		if (errno == EINTR)
			continue;
		if (errno != EAGAIN && errno != EWOULDBLOCK)
		{
			sys_err(err, errlen, "could not receive");
			return -1;
		}
		if (late)
		{
			wire_err(err, errlen, "timed out waiting for a reply");
			errno = 0;
			return -1;
		}
		/* a blocking socket's SO_RCVTIMEO ran out: the loop sees the deadline */
		if (rcvtimeo_ms == NULL)
		{
			if ((rc = io->wait(io->arg, fd, 0, deadline)) == -2)
				return -2;
			waited_out = rc != 0;
		}
	}
}

int
idem_vc_wire_append(char **buf, size_t *len, int argc, const char **argv)
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

int
idem_vc_wire_setup(int fd, idem_vc_setup *s, int64_t deadline,
				   const idem_vc_io *io, char *err, size_t errlen)
{
	redisReader *rd = redisReaderCreate();
	char	   *buf = NULL;
	size_t		len = 0;
	char		dbtxt[16];
	int			ok = rd != NULL;
	int			rc = 0;
	int			n = 0;
	int			i;

	s->refused = IDEM_VC_SETUP_OK;
	for (i = 0; i < s->nextra; i++)
		s->extra_replies[i] = NULL;
	if (ok && s->password != NULL && s->password[0])
	{
		const char *argv[2] = {"AUTH", s->password};

		ok = idem_vc_wire_append(&buf, &len, 2, argv) == 0;
		n++;
	}
	for (i = 0; ok && i < s->nextra; i++)
	{
		ok = idem_vc_wire_append(&buf, &len, s->extra_argc[i],
						(const char **) s->extra_argv[i]) == 0;
		n++;
	}
	if (ok && s->db != 0)
	{
		const char *argv[2] = {"SELECT", dbtxt};

		snprintf(dbtxt, sizeof(dbtxt), "%d", s->db);
		ok = idem_vc_wire_append(&buf, &len, 2, argv) == 0;
		n++;
	}
	if (!ok)
	{
		wire_err(err, errlen, "out of memory");
		rc = -1;
	}
	else
		rc = idem_vc_wire_send(fd, buf, len, deadline, io, err, errlen);
	free(buf);

	/*
	 * Every reply is read, a refusal's too, so that the caller sees its own
	 * commands' answers (INFO cluster says why SELECT was refused).
	 */
	for (i = 0; rc == 0 && i < n; i++)
	{
		redisReply *r = NULL;
		int			auth = s->password != NULL && s->password[0] && i == 0;
		int			extra = i - (s->password != NULL && s->password[0]);

		rc = idem_vc_wire_read(fd, rd, deadline, i == 0, NULL, io,
							   err, errlen, &r);
		if (rc != 0)
			break;
		if (extra >= 0 && extra < s->nextra)
		{
			s->extra_replies[extra] = r;
			continue;
		}
		if (r->type == REDIS_REPLY_ERROR && s->refused == IDEM_VC_SETUP_OK)
		{
			if (err != NULL && errlen > 0)
				snprintf(err, errlen, "%s refused: %.*s",
						 auth ? "AUTH" : "SELECT", (int) r->len, r->str);
			s->refused = auth ? IDEM_VC_SETUP_AUTH :
				IDEM_VC_SETUP_SELECT;
		}
		freeReplyObject(r);
	}
	if (rd != NULL)
		redisReaderFree(rd);
	if (rc != 0)
	{
		for (i = 0; i < s->nextra; i++)
		{
			if (s->extra_replies[i])
				freeReplyObject(s->extra_replies[i]);
			s->extra_replies[i] = NULL;
		}
		return rc;
	}
	return s->refused != IDEM_VC_SETUP_OK ? -3 : 0;
}
