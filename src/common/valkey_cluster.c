/*-------------------------------------------------------------------------
 *
 * valkey_cluster.c
 *	  Valkey Cluster routing on hiredis (see valkey_cluster.h).
 *
 * Owns: the node table (one non-blocking socket, one hiredis reader and one
 * output buffer per node), the slot map, and the pipeline that splits a
 * batch of single-key commands per node and follows redirects, in one call
 * (idem_vc_pipeline) or split after its first round's send
 * (idem_vc_send, idem_vc_collect: the worker sleeps out its batch delay in
 * between).  No locking: an idem_vc belongs to one thread (the worker, or
 * one runner).
 *
 *-------------------------------------------------------------------------
 */
#include "valkey_cluster.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* A command is sent at most this often in one pipeline call (redirects). */
#define VC_MAX_ROUNDS		16
#define VC_BACKOFF_MIN_MS	5
#define VC_BACKOFF_MAX_MS	200
#define VC_ERR_LEN			256
/* A key's master rests after a failure: re-read the map at most this often
 * (a replica promoted in its place is found this soon). */
#define VC_RESTING_REFRESH_MS	100
/* vc_rounds: no first round was sent by the caller */
#define VC_UNSENT			(-3)

typedef struct vc_node
{
	char		host[IDEM_VC_HOST_MAX];
	int			port;
	char		name[IDEM_VC_HOST_MAX + 8];
	int			fd;				/* -1: not connected */
	redisReader *rd;
	char	   *obuf;			/* formatted commands not yet sent */
	size_t		olen;
	size_t		ocap;
	int		   *expect;			/* per reply due: command index, -1 ASKING */
	int			nexpect;
	int			expcap;
	int64_t		down_until;		/* resting after a failure */
	long long	errors;
	int			in_map;
	int			sent;			/* sent to since its last read */
} vc_node;

struct idem_vc
{
	idem_vc_io	io;
	idem_vc_mode mode;
	char	   *password;
	int			db;
	int			connect_timeout_ms;
	int			retry_ms;
	int			nseeds;
	int			seeds[IDEM_VC_MAX_NODES];	/* node indexes */
	int			nnodes;
	vc_node		nodes[IDEM_VC_MAX_NODES];
	int16_t		slot_node[IDEM_VC_SLOTS];
	int			is_open;
	int			cluster;
	int			need_refresh;
	int			use_slots;		/* CLUSTER SLOTS: the server has no SHARDS */
	int64_t		refreshed_at;	/* last map read (monotonic ms) */
	int			nsent;			/* nodes with sent set */
	int			round_sent;		/* what idem_vc_send's round gave */
	int			round_resting;
	idem_vc_stats stats;
	char		err[VC_ERR_LEN];
};

/* ---- pure functions ---- */

uint16_t
idem_vc_crc16(const char *buf, size_t len)
{
	uint16_t	crc = 0;
	size_t		i;
	int			b;

	for (i = 0; i < len; i++)
	{
		crc ^= (uint16_t) ((unsigned char) buf[i] << 8);
		for (b = 0; b < 8; b++)
			crc = (crc & 0x8000) ? (uint16_t) ((crc << 1) ^ 0x1021) : (uint16_t) (crc << 1);
	}
	return crc;
}

int
idem_vc_key_slot(const char *key, size_t len)
{
	size_t		s,
				e;

	for (s = 0; s < len && key[s] != '{'; s++)
		;
	if (s < len)
	{
		for (e = s + 1; e < len && key[e] != '}'; e++)
			;
		if (e < len && e > s + 1)
			return idem_vc_crc16(key + s + 1, e - s - 1) & (IDEM_VC_SLOTS - 1);
	}
	return idem_vc_crc16(key, len) & (IDEM_VC_SLOTS - 1);
}

static int
starts_with(const char *s, size_t len, const char *word)
{
	size_t		wl = strlen(word);

	return len >= wl && memcmp(s, word, wl) == 0 &&
		(len == wl || s[wl] == ' ');
}

/* "<slot> <host>:<port>" after the word; 0 on success. */
static int
parse_redirect(const char *p, size_t len, int *slot, char *host,
			   size_t hostlen, int *port)
{
	char		buf[IDEM_VC_HOST_MAX + 32];
	char	   *sp,
			   *colon,
			   *end;
	long		v;

	if (len >= sizeof(buf))
		return -1;
	memcpy(buf, p, len);
	buf[len] = '\0';
	errno = 0;
	v = strtol(buf, &end, 10);
	if (end == buf || *end != ' ' || errno != 0 || v < 0 || v >= IDEM_VC_SLOTS)
		return -1;
	*slot = (int) v;
	sp = end + 1;
	colon = strrchr(sp, ':');
	if (colon == NULL || (size_t) (colon - sp) >= hostlen)
		return -1;
	errno = 0;
	v = strtol(colon + 1, &end, 10);
	if (end == colon + 1 || *end != '\0' || errno != 0 || v <= 0 || v > 65535)
		return -1;
	*port = (int) v;
	memcpy(host, sp, colon - sp);
	host[colon - sp] = '\0';
	return 0;
}

idem_vc_errkind
idem_vc_classify(const char *err, size_t len, int *slot, char *host,
				 size_t hostlen, int *port)
{
	if (starts_with(err, len, "MOVED") || starts_with(err, len, "ASK"))
	{
		int			moved = err[1] == 'O';
		size_t		skip = moved ? 6 : 4;

		if (len <= skip ||
			parse_redirect(err + skip, len - skip, slot, host, hostlen, port) != 0)
			return IDEM_VC_REPLY;
		return moved ? IDEM_VC_MOVED : IDEM_VC_ASK;
	}
	if (starts_with(err, len, "CLUSTERDOWN") || starts_with(err, len, "TRYAGAIN") ||
		starts_with(err, len, "READONLY") || starts_with(err, len, "LOADING") ||
		starts_with(err, len, "MASTERDOWN"))
		return IDEM_VC_RETRY;
	return IDEM_VC_REPLY;
}

/* Index of host:port in map, added if new; -1 if it cannot be. */
static int
map_node(idem_vc_map *map, const char *host, size_t hostlen, long long port)
{
	int			n;

	if (hostlen == 0 || hostlen >= IDEM_VC_HOST_MAX || port <= 0 || port > 65535)
		return -1;
	for (n = 0; n < map->nnodes; n++)
		if (map->ports[n] == port &&
			strlen(map->hosts[n]) == hostlen &&
			memcmp(map->hosts[n], host, hostlen) == 0)
			return n;
	if (n == IDEM_VC_MAX_NODES)
		return -1;
	memcpy(map->hosts[n], host, hostlen);
	map->hosts[n][hostlen] = '\0';
	map->ports[n] = (int) port;
	map->nnodes++;
	return n;
}

/* Slots start..end to node n; the slots newly covered, or -1 if invalid. */
static int
map_cover(idem_vc_map *map, long long start, long long end, int n)
{
	int			s,
				covered = 0;

	if (start < 0 || end >= IDEM_VC_SLOTS || start > end)
		return -1;
	for (s = (int) start; s <= (int) end; s++)
	{
		if (map->slot_node[s] < 0)
			covered++;
		map->slot_node[s] = (int16_t) n;
	}
	return covered;
}

static void
map_init(idem_vc_map *map)
{
	int			i;

	map->nnodes = 0;
	for (i = 0; i < IDEM_VC_SLOTS; i++)
		map->slot_node[i] = -1;
}

int
idem_vc_parse_slots(const redisReply *r, const char *asked_host,
					idem_vc_map *map)
{
	size_t		i;
	int			covered = 0;

	map_init(map);
	if (r == NULL || r->type != REDIS_REPLY_ARRAY)
		return -1;
	for (i = 0; i < r->elements; i++)
	{
		const redisReply *e = r->element[i];
		const redisReply *m;
		const char *host;
		size_t		hostlen;
		int			n,
					c;

		if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
			e->element[0]->type != REDIS_REPLY_INTEGER ||
			e->element[1]->type != REDIS_REPLY_INTEGER ||
			e->element[2]->type != REDIS_REPLY_ARRAY)
			return -1;
		m = e->element[2];
		if (m->elements < 2 ||
			m->element[0]->type != REDIS_REPLY_STRING ||
			m->element[1]->type != REDIS_REPLY_INTEGER)
			return -1;
		host = m->element[0]->str;
		hostlen = m->element[0]->len;
		if (hostlen == 0 || (hostlen == 1 && host[0] == '?'))
		{
			host = asked_host;
			hostlen = strlen(asked_host);
		}
		if ((n = map_node(map, host, hostlen, m->element[1]->integer)) < 0 ||
			(c = map_cover(map, e->element[0]->integer,
						   e->element[1]->integer, n)) < 0)
			return -1;
		covered += c;
	}
	return covered;
}

/* The value of name in a flat [name, value, ...] array (RESP2); NULL if none. */
static const redisReply *
field(const redisReply *a, const char *name)
{
	size_t		i;

	if (a == NULL || a->type != REDIS_REPLY_ARRAY)
		return NULL;
	for (i = 0; i + 1 < a->elements; i += 2)
		if (a->element[i]->type == REDIS_REPLY_STRING &&
			strcmp(a->element[i]->str, name) == 0)
			return a->element[i + 1];
	return NULL;
}

static int
field_is(const redisReply *a, const char *name, const char *value)
{
	const redisReply *v = field(a, name);

	return v != NULL && v->type == REDIS_REPLY_STRING && strcmp(v->str, value) == 0;
}

int
idem_vc_parse_shards(const redisReply *r, const char *asked_host,
					 idem_vc_map *map)
{
	size_t		i,
				j;
	int			covered = 0;

	map_init(map);
	if (r == NULL || r->type != REDIS_REPLY_ARRAY)
		return -1;
	for (i = 0; i < r->elements; i++)
	{
		const redisReply *e = r->element[i];
		const redisReply *slots = field(e, "slots");
		const redisReply *nodes = field(e, "nodes");
		const redisReply *master = NULL;
		const redisReply *h;
		const redisReply *port;
		const char *host = "";
		size_t		hostlen = 0;
		int			n,
					c;

		if (slots == NULL || slots->type != REDIS_REPLY_ARRAY ||
			slots->elements % 2 != 0 ||
			nodes == NULL || nodes->type != REDIS_REPLY_ARRAY)
			return -1;
		if (slots->elements == 0)
			continue;			/* a shard that serves no slot */
		/* its master: one that is online if the shard lists several */
		for (j = 0; j < nodes->elements; j++)
		{
			const redisReply *nd = nodes->element[j];

			if (!field_is(nd, "role", "master") && !field_is(nd, "role", "primary"))
				continue;
			if (master == NULL || field_is(nd, "health", "online"))
				master = nd;
			if (field_is(nd, "health", "online"))
				break;
		}
		if (master == NULL)
			continue;			/* no master now: its slots are not served */
		/* the preferred endpoint; "?" or empty: its ip; none: the node asked */
		h = field(master, "endpoint");
		if (h == NULL || h->type != REDIS_REPLY_STRING || h->len == 0 ||
			(h->len == 1 && h->str[0] == '?'))
			h = field(master, "ip");
		if (h != NULL && h->type == REDIS_REPLY_STRING)
		{
			host = h->str;
			hostlen = h->len;
		}
		if (hostlen == 0 || (hostlen == 1 && host[0] == '?'))
		{
			host = asked_host;
			hostlen = strlen(asked_host);
		}
		port = field(master, "port");
		if (port == NULL || port->type != REDIS_REPLY_INTEGER ||
			(n = map_node(map, host, hostlen, port->integer)) < 0)
			return -1;
		for (j = 0; j < slots->elements; j += 2)
		{
			if (slots->element[j]->type != REDIS_REPLY_INTEGER ||
				slots->element[j + 1]->type != REDIS_REPLY_INTEGER ||
				(c = map_cover(map, slots->element[j]->integer,
							   slots->element[j + 1]->integer, n)) < 0)
				return -1;
			covered += c;
		}
	}
	return covered;
}

int
idem_vc_parse_endpoint(const char *s, size_t len, int default_port,
					   char *host, size_t hostlen, int *port)
{
	const char *h = s;
	const char *colon = NULL;	/* before the port, if one is given */
	size_t		hl = len;
	size_t		i;
	long		v = default_port;

	if (len > 0 && s[0] == '[')
	{
		const char *close = memchr(s, ']', len);

		if (close == NULL)
			return -1;
		h = s + 1;
		hl = close - h;
		if (close + 1 < s + len)
		{
			if (close[1] != ':')
				return -1;
			colon = close + 1;
		}
	}
	else
	{
		int			ncolons = 0;

		for (i = 0; i < len; i++)
			if (s[i] == ':')
			{
				ncolons++;
				colon = s + i;
			}
		if (ncolons == 1)
			hl = colon - s;
		else
			colon = NULL;		/* none, or a bare IPv6 address */
	}
	if (colon != NULL)
	{
		const char *d = colon + 1;

		if (d == s + len)
			return -1;
		for (v = 0; d < s + len; d++)
		{
			if (*d < '0' || *d > '9' || v > 65535)
				return -1;
			v = v * 10 + (*d - '0');
		}
	}
	if (hl == 0 || hl >= hostlen || v <= 0 || v > 65535)
		return -1;
	memcpy(host, h, hl);
	host[hl] = '\0';
	*port = (int) v;
	return 0;
}

void
idem_vc_format_endpoint(char *buf, size_t len, const char *host, int port)
{
	snprintf(buf, len, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port);
}

/* ---- node table and I/O ---- */

int64_t
idem_vc_now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t) ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void
set_err(idem_vc *vc, const char *fmt,...) __attribute__((format(printf, 2, 3)));

static void
set_err(idem_vc *vc, const char *fmt,...)
{
	va_list		ap;

	va_start(ap, fmt);
	vsnprintf(vc->err, sizeof(vc->err), fmt, ap);
	va_end(ap);
}

static void
copy_err(char *err, size_t errlen, const char *text)
{
	if (err != NULL && errlen > 0)
		snprintf(err, errlen, "%s", text);
}

/* Index of host:port in the node table, added if new; -1 if full. */
static int
node_get(idem_vc *vc, const char *host, int port)
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

static void
node_unsent(idem_vc *vc, vc_node *n)
{
	if (n->sent)
	{
		n->sent = 0;
		vc->nsent--;
	}
}

static void
node_drop(idem_vc *vc, vc_node *n)
{
	node_unsent(vc, n);
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
}

/* A failure on an established or new connection: drop it, let it rest. */
static void
node_failed(idem_vc *vc, vc_node *n, const char *what)
{
	char		why[VC_ERR_LEN];

	snprintf(why, sizeof(why), "%s", vc->err[0] ? vc->err : "failed");
	set_err(vc, "%s %s: %s", what, n->name, why);
	node_drop(vc, n);
	n->errors++;
	vc->stats.node_errors++;
	n->down_until = idem_vc_now_ms() + vc->retry_ms;
	if (vc->cluster)
		vc->need_refresh = 1;
}

static int
node_append(idem_vc *vc, vc_node *n, int argc, const char **argv,
			const size_t *argvlen)
{
	char	   *cmd = NULL;
	long long	len = redisFormatCommandArgv(&cmd, argc, argv, argvlen);

	if (len < 0)
	{
		set_err(vc, "out of memory");
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
			set_err(vc, "out of memory");
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

static int
node_expect(idem_vc *vc, vc_node *n, int what)
{
	if (n->nexpect == n->expcap)
	{
		int			cap = n->expcap ? n->expcap * 2 : 64;
		int		   *ne = realloc(n->expect, sizeof(int) * cap);

		if (ne == NULL)
		{
			set_err(vc, "out of memory");
			return -1;
		}
		n->expect = ne;
		n->expcap = cap;
	}
	n->expect[n->nexpect++] = what;
	return 0;
}

/* Wait through io; 0 ready, -1 timeout (err set), -2 abandon. */
static int
vc_wait(idem_vc *vc, int fd, int for_write, int64_t deadline, const char *what)
{
	int			rc = vc->io.wait(vc->io.arg, fd, for_write, deadline);

	if (rc == -1)
		set_err(vc, "timed out %s", what);
	return rc;
}

/* Send everything buffered.  0, -1 (err set), -2 abandon. */
static int
node_flush(idem_vc *vc, vc_node *n, int64_t deadline)
{
	size_t		off = 0;

	while (off < n->olen)
	{
		ssize_t		w = send(n->fd, n->obuf + off, n->olen - off, MSG_NOSIGNAL);

		if (w > 0)
		{
			off += (size_t) w;
			continue;
		}
		if (w < 0 && errno == EINTR)
			continue;
		if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
		{
			int			rc = vc_wait(vc, n->fd, 1, deadline, "sending");

			if (rc != 0)
				return rc;
			continue;
		}
		set_err(vc, "could not send: %s", strerror(errno));
		return -1;
	}
	if (n->olen > 0 && !n->sent)
	{
		n->sent = 1;
		vc->nsent++;
	}
	n->olen = 0;
	return 0;
}

/* Read the next reply.  0 (*out set), -1 (err set), -2 abandon. */
static int
node_read(idem_vc *vc, vc_node *n, int64_t deadline, redisReply **out)
{
	for (;;)
	{
		void	   *reply = NULL;
		char		buf[16 * 1024];
		ssize_t		got;

		if (redisReaderGetReply(n->rd, &reply) != REDIS_OK)
		{
			set_err(vc, "protocol error");
			return -1;
		}
		if (reply != NULL)
		{
			*out = reply;
			return 0;
		}

		/*
		 * Right after a send to this node alone, its reply is almost never
		 * in yet: wait first, which saves a recv that would only say EAGAIN
		 * (one system call per round trip).  When several nodes were sent
		 * to, the later ones' replies are usually in by the time they are
		 * read: recv first.
		 */
		if (n->sent)
		{
			int			alone = vc->nsent == 1;

			node_unsent(vc, n);
			if (alone)
			{
				int			rc = vc_wait(vc, n->fd, 0, deadline,
										 "waiting for a reply");

				if (rc != 0)
					return rc;
			}
		}
		got = recv(n->fd, buf, sizeof(buf), 0);
		if (got > 0)
		{
			if (redisReaderFeed(n->rd, buf, (size_t) got) != REDIS_OK)
			{
				set_err(vc, "protocol error");
				return -1;
			}
			continue;
		}
		if (got == 0)
		{
			set_err(vc, "server closed the connection");
			return -1;
		}
		if (errno == EINTR)
			continue;
		if (errno == EAGAIN || errno == EWOULDBLOCK)
		{
			int			rc = vc_wait(vc, n->fd, 0, deadline, "waiting for a reply");

			if (rc != 0)
				return rc;
			continue;
		}
		set_err(vc, "could not receive: %s", strerror(errno));
		return -1;
	}
}

/* One command and its reply, on a connected node (setup commands). */
static int
node_call(idem_vc *vc, vc_node *n, int argc, const char **argv,
		  int64_t deadline, redisReply **out)
{
	int			rc;

	*out = NULL;
	if (node_append(vc, n, argc, argv, NULL) != 0)
		return -1;
	rc = node_flush(vc, n, deadline);
	if (rc == 0)
		rc = node_read(vc, n, deadline, out);
	vc->stats.round_trips++;
	return rc;
}

/* Open the socket and authenticate.  0, -1 (err set), -2 abandon. */
static int
node_connect(idem_vc *vc, vc_node *n, int64_t deadline)
{
	struct addrinfo hints,
			   *res = NULL;
	char		portbuf[16];
	int			fd = -1;
	int			rc;
	int			one = 1;
	int			soerr = 0;
	socklen_t	slen = sizeof(soerr);
	int64_t		cdeadline = idem_vc_now_ms() + vc->connect_timeout_ms;
	redisReply *r;

	if (cdeadline > deadline)
		cdeadline = deadline;
	vc->err[0] = '\0';
	vc->stats.connects++;
	memset(&hints, 0, sizeof(hints));
	hints.ai_family = AF_UNSPEC;
	hints.ai_socktype = SOCK_STREAM;
	snprintf(portbuf, sizeof(portbuf), "%d", n->port);
	rc = getaddrinfo(n->host, portbuf, &hints, &res);
	if (rc != 0 || res == NULL)
	{
		set_err(vc, "could not resolve: %s", gai_strerror(rc));
		return -1;
	}
	fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0)
	{
		set_err(vc, "could not create a socket: %s", strerror(errno));
		freeaddrinfo(res);
		return -1;
	}
	rc = connect(fd, res->ai_addr, res->ai_addrlen);
	freeaddrinfo(res);
	n->fd = fd;
	if (rc != 0 && errno != EINPROGRESS)
	{
		set_err(vc, "could not connect: %s", strerror(errno));
		return -1;
	}
	if (rc != 0)
	{
		rc = vc_wait(vc, fd, 1, cdeadline, "connecting");
		if (rc != 0)
			return rc;
		if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &slen) != 0)
			soerr = errno;
		if (soerr != 0)
		{
			set_err(vc, "could not connect: %s", strerror(soerr));
			return -1;
		}
	}
	(void) setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	n->rd = redisReaderCreate();
	if (n->rd == NULL)
	{
		set_err(vc, "out of memory");
		return -1;
	}
	if (vc->password != NULL)
	{
		const char *argv[2] = {"AUTH", vc->password};

		rc = node_call(vc, n, 2, argv, cdeadline, &r);
		if (rc != 0)
			return rc;
		if (r->type == REDIS_REPLY_ERROR)
		{
			set_err(vc, "AUTH refused: %.*s", (int) r->len, r->str);
			freeReplyObject(r);
			return -1;
		}
		freeReplyObject(r);
	}
	if (!vc->cluster && vc->db != 0)
	{
		char		dbtxt[16];
		const char *argv[2] = {"SELECT", dbtxt};

		snprintf(dbtxt, sizeof(dbtxt), "%d", vc->db);
		rc = node_call(vc, n, 2, argv, cdeadline, &r);
		if (rc != 0)
			return rc;
		if (r->type == REDIS_REPLY_ERROR)
		{
			set_err(vc, "SELECT refused: %.*s", (int) r->len, r->str);
			freeReplyObject(r);
			return -1;
		}
		freeReplyObject(r);
	}
	return 0;
}

/* Connected, or connect now unless resting.  0, -1, -2. */
static int
node_ensure(idem_vc *vc, vc_node *n, int64_t deadline)
{
	int			rc;

	if (n->fd >= 0)
		return 0;
	if (idem_vc_now_ms() < n->down_until)
	{
		set_err(vc, "%s is resting after a failure", n->name);
		return -1;
	}
	rc = node_connect(vc, n, deadline);
	if (rc == -1)
		node_failed(vc, n, "connecting to");
	else if (rc == -2)
		node_drop(vc, n);
	return rc;
}

/*
 * Read the slot map from node i and install it: CLUSTER SHARDS, or CLUSTER
 * SLOTS from a server that has no SHARDS (before Redis 7) or refuses it
 * (an ACL); that server is not asked for SHARDS again.  0, -1, -2.
 */
static int
refresh_from(idem_vc *vc, int i, int64_t deadline)
{
	const char *argv[2] = {"CLUSTER", vc->use_slots ? "SLOTS" : "SHARDS"};
	vc_node    *n = &vc->nodes[i];
	idem_vc_map *map;
	redisReply *r;
	int			rc,
				s,
				k;
	int			idx[IDEM_VC_MAX_NODES];

	rc = node_ensure(vc, n, deadline);
	if (rc != 0)
		return rc;
	rc = node_call(vc, n, 2, argv, deadline, &r);
	if (rc != 0)
	{
		if (rc == -1)
			node_failed(vc, n, "reading the slot map from");
		else
			node_drop(vc, n);
		return rc;
	}
	if (!vc->use_slots && r->type == REDIS_REPLY_ERROR &&
		(starts_with(r->str, r->len, "ERR") || starts_with(r->str, r->len, "NOPERM")))
	{
		freeReplyObject(r);
		vc->use_slots = 1;
		return refresh_from(vc, i, deadline);
	}
	map = malloc(sizeof(idem_vc_map));
	if (map == NULL)
	{
		freeReplyObject(r);
		set_err(vc, "out of memory");
		return -1;
	}
	rc = vc->use_slots ? idem_vc_parse_slots(r, n->host, map) :
		idem_vc_parse_shards(r, n->host, map);
	if (rc <= 0)
	{
		if (r->type == REDIS_REPLY_ERROR)
			set_err(vc, "CLUSTER %s from %s: %.*s", argv[1], n->name, (int) r->len, r->str);
		else
			set_err(vc, "CLUSTER %s from %s: no slot map", argv[1], n->name);
		freeReplyObject(r);
		free(map);
		return -1;
	}
	freeReplyObject(r);
	for (k = 0; k < map->nnodes; k++)
	{
		idx[k] = node_get(vc, map->hosts[k], map->ports[k]);
		if (idx[k] < 0)
		{
			set_err(vc, "more than %d nodes", IDEM_VC_MAX_NODES);
			free(map);
			return -1;
		}
	}
	for (k = 0; k < vc->nnodes; k++)
		vc->nodes[k].in_map = 0;
	for (s = 0; s < IDEM_VC_SLOTS; s++)
	{
		int			m = map->slot_node[s];

		vc->slot_node[s] = m < 0 ? -1 : (int16_t) idx[m];
		if (m >= 0)
			vc->nodes[idx[m]].in_map = 1;
	}
	free(map);
	vc->stats.refreshes++;
	vc->need_refresh = 0;
	vc->refreshed_at = idem_vc_now_ms();
	return 0;
}

/* Read the slot map from a connected master, else any node, else a seed. */
static int
refresh(idem_vc *vc, int64_t deadline)
{
	int			pass,
				i,
				rc;

	for (pass = 0; pass < 2; pass++)
	{
		for (i = 0; i < vc->nnodes; i++)
		{
			vc_node    *n = &vc->nodes[i];

			if ((pass == 0) != (n->fd >= 0 && n->in_map))
				continue;
			if (n->nexpect > 0)
				continue;
			rc = refresh_from(vc, i, deadline);
			if (rc == 0 || rc == -2)
				return rc;
			if (idem_vc_now_ms() >= deadline)
				return -1;
		}
	}
	return -1;
}

/* ---- public ---- */

idem_vc *
idem_vc_new(const idem_vc_options *opt, const idem_vc_io *io, char *err,
			size_t errlen)
{
	idem_vc    *vc = calloc(1, sizeof(idem_vc));
	const char *p;
	int			s;

	if (vc == NULL)
	{
		copy_err(err, errlen, "out of memory");
		return NULL;
	}
	vc->io = *io;
	vc->mode = opt->mode;
	vc->db = opt->db;
	vc->connect_timeout_ms = opt->connect_timeout_ms;
	vc->retry_ms = opt->retry_ms;
	for (s = 0; s < IDEM_VC_SLOTS; s++)
		vc->slot_node[s] = -1;
	if (opt->password && opt->password[0])
	{
		vc->password = strdup(opt->password);
		if (vc->password == NULL)
		{
			copy_err(err, errlen, "out of memory");
			free(vc);
			return NULL;
		}
	}
	p = opt->seeds ? opt->seeds : "";
	while (*p)
	{
		char		host[IDEM_VC_HOST_MAX];
		size_t		len = strcspn(p, ", ");
		int			port;
		int			i;

		if (len == 0)
		{
			p++;
			continue;
		}
		if (idem_vc_parse_endpoint(p, len, opt->default_port, host,
								   sizeof(host), &port) != 0)
		{
			snprintf(err, errlen, "invalid Valkey node \"%.*s\": expected host:port, host, or [IPv6 address]:port",
					 (int) len, p);
			idem_vc_free(vc);
			return NULL;
		}
		i = node_get(vc, host, port);
		if (i < 0)
		{
			snprintf(err, errlen, "too many Valkey nodes");
			idem_vc_free(vc);
			return NULL;
		}
		vc->seeds[vc->nseeds++] = i;
		p += len;
	}
	if (vc->nseeds == 0)
	{
		copy_err(err, errlen, "no Valkey node given");
		idem_vc_free(vc);
		return NULL;
	}
	return vc;
}

void
idem_vc_close_all(idem_vc *vc)
{
	int			i;

	if (vc == NULL)
		return;
	for (i = 0; i < vc->nnodes; i++)
		node_drop(vc, &vc->nodes[i]);
}

void
idem_vc_free(idem_vc *vc)
{
	int			i;

	if (vc == NULL)
		return;
	idem_vc_close_all(vc);
	for (i = 0; i < vc->nnodes; i++)
	{
		free(vc->nodes[i].obuf);
		free(vc->nodes[i].expect);
	}
	free(vc->password);
	free(vc);
}

/* Is INFO cluster's text saying cluster_enabled:1? */
static int
info_says_cluster(const redisReply *r)
{
	return r->type == REDIS_REPLY_STRING &&
		strstr(r->str, "cluster_enabled:1") != NULL;
}

int
idem_vc_open(idem_vc *vc, int seed_budget_ms, char *err, size_t errlen)
{
	int			k;

	vc->is_open = 0;
	vc->err[0] = '\0';
	for (k = 0; k < vc->nseeds; k++)
	{
		vc_node    *n = &vc->nodes[vc->seeds[k]];
		int64_t		deadline_ms = idem_vc_now_ms() + seed_budget_ms;
		int			rc;
		int			cluster;

		/* connect as a cluster node first: no SELECT before we know */
		vc->cluster = 1;
		n->down_until = 0;
		rc = node_ensure(vc, n, deadline_ms);
		if (rc == -2)
			return -3;
		if (rc != 0)
			continue;
		if (vc->mode == IDEM_VC_MODE_AUTO)
		{
			const char *argv[2] = {"INFO", "cluster"};
			redisReply *r;

			rc = node_call(vc, n, 2, argv, deadline_ms, &r);
			if (rc == -2)
			{
				node_drop(vc, n);
				return -3;
			}
			if (rc != 0)
			{
				node_failed(vc, n, "asking");
				continue;
			}
			cluster = info_says_cluster(r);
			freeReplyObject(r);
		}
		else
			cluster = vc->mode == IDEM_VC_MODE_CLUSTER;
		vc->cluster = cluster;
		if (cluster)
		{
			if (vc->db != 0)
			{
				idem_vc_close_all(vc);
				copy_err(err, errlen,
						 "Valkey at the given node is a cluster, which has only database 0");
				return -2;
			}
			rc = refresh_from(vc, vc->seeds[k], deadline_ms);
			if (rc == -2)
				return -3;
			if (rc != 0)
				continue;
		}
		else
		{
			int			s;

			/* the connection did not SELECT: make it again */
			node_drop(vc, n);
			rc = node_ensure(vc, n, deadline_ms);
			if (rc == -2)
				return -3;
			if (rc != 0)
				continue;
			for (s = 0; s < IDEM_VC_SLOTS; s++)
				vc->slot_node[s] = (int16_t) vc->seeds[k];
			n->in_map = 1;
		}
		vc->is_open = 1;
		return 0;
	}
	copy_err(err, errlen, vc->err[0] ? vc->err : "no Valkey node answered");
	return -1;
}

int
idem_vc_is_cluster(const idem_vc *vc)
{
	return vc != NULL && vc->is_open && vc->cluster;
}

int
idem_vc_is_open(const idem_vc *vc)
{
	return vc != NULL && vc->is_open;
}

/*
 * Out of memory while a round is split: nothing of it has been sent, so
 * every node's share of it is dropped.  Left in a node's buffer, it would
 * go out with the next round, whose replies would then be matched to the
 * wrong commands.  (The round still counts against each command's
 * VC_MAX_ROUNDS.)
 */
static void
vc_abandon_round(idem_vc *vc)
{
	int			k;

	for (k = 0; k < vc->nnodes; k++)
	{
		vc->nodes[k].olen = 0;
		vc->nodes[k].nexpect = 0;
	}
}

/*
 * Route what is pending of cmds per node and send it, every node's share
 * written before any reply is read.  Returns the commands sent (0 if none
 * could be: their nodes rest after a failure), -1 out of memory (nothing
 * sent), -2 abandon.  *resting is set if a command's node rests.
 */
static int
vc_send_round(idem_vc *vc, idem_vc_cmd *cmds, int n, int64_t deadline_ms,
			  int *resting)
{
	int			sent = 0;
	int			i,
				k;

	if (vc->cluster && vc->need_refresh)
	{
		if (refresh(vc, deadline_ms) == -2)
			return -2;
	}

	/* Split what is pending per node. */
	for (i = 0; i < n; i++)
	{
		idem_vc_cmd *c = &cmds[i];
		int			target;
		vc_node    *nd;
		int			rc;

		if (c->reply != NULL || c->rounds >= VC_MAX_ROUNDS)
			continue;
		target = c->ask_node >= 0 ? c->ask_node :
			vc->slot_node[idem_vc_key_slot(c->key, c->keylen)];
		if (target < 0)
		{
			set_err(vc, "no node serves the slot of a key");
			vc->need_refresh = 1;
			continue;
		}
		nd = &vc->nodes[target];
		c->node = target;
		rc = node_ensure(vc, nd, deadline_ms);
		if (rc == -2)
			return -2;
		if (rc != 0)
		{
			*resting = 1;
			continue;
		}
		if (c->ask_node >= 0)
		{
			const char *asking[1] = {"ASKING"};

			if (node_append(vc, nd, 1, asking, NULL) != 0 ||
				node_expect(vc, nd, -1) != 0)
			{
				vc_abandon_round(vc);
				return -1;
			}
		}
		if (node_append(vc, nd, c->argc, c->argv, c->argvlen) != 0 ||
			node_expect(vc, nd, i) != 0)
		{
			vc_abandon_round(vc);
			return -1;
		}
		c->rounds++;
		sent++;
	}
	if (sent == 0)
		return 0;

	/* Send to every node. */
	for (k = 0; k < vc->nnodes; k++)
	{
		vc_node    *nd = &vc->nodes[k];
		int			rc;

		if (nd->olen == 0)
			continue;
		vc->stats.round_trips++;
		rc = node_flush(vc, nd, deadline_ms);
		if (rc == -2)
			return -2;
		if (rc != 0)
			node_failed(vc, nd, "sending to");
	}
	return sent;
}

/*
 * Read every node's replies to the round sent, matching them to cmds:
 * *done counts the commands answered; MOVED and ASK leave a command
 * pending for its new node, and a "not now" reply sets *retry.  0, or -2
 * abandon.
 */
static int
vc_read_round(idem_vc *vc, idem_vc_cmd *cmds, int64_t deadline_ms,
			  int *done, int *retry)
{
	int			k;

	for (k = 0; k < vc->nnodes; k++)
	{
		vc_node    *nd = &vc->nodes[k];
		int			e;

		for (e = 0; e < nd->nexpect; e++)
		{
			redisReply *r;
			int			what = nd->expect[e];
			int			rc = node_read(vc, nd, deadline_ms, &r);
			idem_vc_cmd *c;
			int			slot,
						port,
						to;
			char		host[IDEM_VC_HOST_MAX];

			if (rc == -2)
				return -2;
			if (rc != 0)
			{
				node_failed(vc, nd, "reading from");
				break;
			}
			if (what < 0)
			{
				freeReplyObject(r);	/* ASKING's OK */
				continue;
			}
			c = &cmds[what];
			if (r->type != REDIS_REPLY_ERROR)
			{
				c->reply = r;
				c->ask_node = -1;
				(*done)++;
				continue;
			}
			switch (idem_vc_classify(r->str, r->len, &slot, host,
									 sizeof(host), &port))
			{
				case IDEM_VC_MOVED:
					vc->stats.moved++;
					to = node_get(vc, host, port);
					if (to >= 0)
						vc->slot_node[slot] = (int16_t) to;
					vc->need_refresh = 1;
					c->ask_node = -1;
					freeReplyObject(r);
					break;
				case IDEM_VC_ASK:
					vc->stats.ask++;
					c->ask_node = node_get(vc, host, port);
					freeReplyObject(r);
					break;
				case IDEM_VC_RETRY:
					vc->stats.retries++;
					set_err(vc, "%s replied: %.*s", nd->name,
							(int) (r->len > 100 ? 100 : r->len), r->str);
					vc->need_refresh = vc->cluster;
					c->ask_node = -1;
					*retry = 1;
					freeReplyObject(r);
					break;
				case IDEM_VC_REPLY:
					c->reply = r;
					c->ask_node = -1;
					(*done)++;
					break;
			}
		}
		nd->nexpect = 0;
	}
	return 0;
}

/*
 * The rounds of a pipeline until every command has a reply or the
 * deadline passes.  sent, resting: what a first round sent by the caller
 * gave (vc_send_round), or VC_UNSENT for none.
 */
static int
vc_rounds(idem_vc *vc, idem_vc_cmd *cmds, int n, int64_t deadline_ms,
		  int sent, int resting)
{
	int			done = 0;
	int			backoff = VC_BACKOFF_MIN_MS;
	int			reread = 0;		/* the map was re-read for a resting node */

	while (done < n)
	{
		int			retry = 0;

		if (sent == VC_UNSENT)
		{
			resting = 0;
			sent = vc_send_round(vc, cmds, n, deadline_ms, &resting);
		}
		if (sent == -2)
			return -2;
		if (sent < 0)
			return done;
		if (sent == 0)
		{
			/*
			 * Only keys of a node that is down are left: if the map is not
			 * fresh, read it once more (a failover may have promoted a
			 * replica meanwhile) and route them again.
			 */
			if (resting && vc->cluster && !reread &&
				idem_vc_now_ms() - vc->refreshed_at >= VC_RESTING_REFRESH_MS)
			{
				vc->need_refresh = 1;
				reread = 1;
				sent = VC_UNSENT;
				continue;
			}
			break;
		}
		sent = VC_UNSENT;
		if (vc_read_round(vc, cmds, deadline_ms, &done, &retry) == -2)
			return -2;
		if (done < n && retry)
		{
			int64_t		until = idem_vc_now_ms() + backoff;

			if (until > deadline_ms)
				until = deadline_ms;
			if (vc->io.wait(vc->io.arg, -1, 0, until) == -2)
				return -2;
			backoff = backoff * 2 > VC_BACKOFF_MAX_MS ? VC_BACKOFF_MAX_MS : backoff * 2;
		}
		if (idem_vc_now_ms() >= deadline_ms)
			break;
	}
	return done;
}

static void
vc_start(idem_vc_cmd *cmds, int n)
{
	int			i;

	for (i = 0; i < n; i++)
	{
		cmds[i].reply = NULL;
		cmds[i].node = -1;
		cmds[i].ask_node = -1;
		cmds[i].rounds = 0;
	}
}

/* Route, redirect; see the header. */
int
idem_vc_pipeline(idem_vc *vc, idem_vc_cmd *cmds, int n, int64_t deadline_ms)
{
	vc_start(cmds, n);
	return vc_rounds(vc, cmds, n, deadline_ms, VC_UNSENT, 0);
}

/* The first round of idem_vc_pipeline; see the header. */
int
idem_vc_send(idem_vc *vc, idem_vc_cmd *cmds, int n, int64_t deadline_ms)
{
	vc_start(cmds, n);
	vc->round_resting = 0;
	vc->round_sent = vc_send_round(vc, cmds, n, deadline_ms,
								   &vc->round_resting);
	return vc->round_sent == -2 ? -2 : 0;
}

/* The rest of idem_vc_pipeline after idem_vc_send; see the header. */
int
idem_vc_collect(idem_vc *vc, idem_vc_cmd *cmds, int n, int64_t deadline_ms,
				int waited)
{
	int			k;

	if (waited)
	{
		/* the replies came meanwhile: read before waiting (node_read) */
		for (k = 0; k < vc->nnodes; k++)
			node_unsent(vc, &vc->nodes[k]);
	}
	return vc_rounds(vc, cmds, n, deadline_ms, vc->round_sent,
					 vc->round_resting);
}

const idem_vc_stats *
idem_vc_get_stats(const idem_vc *vc)
{
	return &vc->stats;
}

int
idem_vc_nnodes(const idem_vc *vc)
{
	return vc->nnodes;
}

const char *
idem_vc_node_name(const idem_vc *vc, int i)
{
	return vc->nodes[i].name;
}

long long
idem_vc_node_errors(const idem_vc *vc, int i)
{
	return vc->nodes[i].errors;
}

int
idem_vc_node_in_map(const idem_vc *vc, int i)
{
	return vc->nodes[i].in_map;
}

const char *
idem_vc_last_error(const idem_vc *vc)
{
	return vc->err;
}
