/*-------------------------------------------------------------------------
 *
 * valkey_router_int.h
 *	  What the files of the Valkey router share, and nothing outside them
 *	  may use: the router (struct idem_vc) and its node table, and the
 *	  functions one file of it calls in another.
 *
 *	  valkey_slots.c	CRC16, the slot of a key, the class of an error reply
 *	  valkey_reply.c	which error codes mean "not now" (also the worker's)
 *	  valkey_map.c		the slot map, from CLUSTER SLOTS or CLUSTER SHARDS
 *	  valkey_endpoint.c	host:port, as settings and maps spell it
 *	  valkey_node.c		the node table and each node's socket I/O
 *	  valkey_wire.c		a connection's bytes and setup (also the client's)
 *	  valkey_router.c	the router: open, map refresh, close, accessors
 *	  valkey_pipeline.c	a batch split per node, redirects followed
 *	  valkey_single.c	a single Valkey's one node, driven directly
 *
 *	  No locking: an idem_vc belongs to one thread (the worker, or one
 *	  runner).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_VALKEY_ROUTER_INT_H
#define IDEM_VALKEY_ROUTER_INT_H

#include "valkey_router.h"
#include "valkey_reply.h"

#include <string.h>

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
/* idem_vc_options.nsetup at most */
#define VC_MAX_SETUP		4

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
	char		failure[160];	/* that failure, in words */
	long long	errors;
	int			in_map;
	int			sent;			/* sent to since its last read */
	int			answered;		/* a reply read on this connection */
	int			died;			/* the last failure: EOF, reset, broken pipe */
	int			rcvtimeo_ms;	/* blocking_reads: the socket's SO_RCVTIMEO */
} vc_node;

struct idem_vc
{
	idem_vc_io	io;
	idem_vc_mode mode;
	char	   *password;
	int			db;
	int			connect_timeout_ms;
	int			retry_ms;
	int			blocking_reads;
	int			reconnect_dead;
	int			nsetup;
	const int  *setup_argc;
	const char *const *setup_argv[VC_MAX_SETUP];
	int			(*setup_check) (redisReply *const *replies, char *err,
								size_t errlen);
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
	int			ask_cluster;	/* node connects ask INFO cluster (open, auto) */
	int			said_cluster;	/* what it said: 1, 0, -1 no answer */
	idem_vc_stats stats;
	char		err[VC_ERR_LEN];
};

/* valkey_node.c */
extern void idem_vc_set_err(idem_vc *vc, const char *fmt,...)
			__attribute__((format(printf, 2, 3)));
extern void idem_vc_copy_err(char *err, size_t errlen, const char *text);
extern int	idem_vc_node_get(idem_vc *vc, const char *host, int port);
extern void idem_vc_node_unsent(idem_vc *vc, vc_node *n);
extern void idem_vc_node_drop(idem_vc *vc, vc_node *n);
extern void idem_vc_node_failed(idem_vc *vc, vc_node *n, const char *what);
extern void idem_vc_node_lost(idem_vc *vc, vc_node *n, const char *what);
extern int	idem_vc_node_append(idem_vc *vc, vc_node *n, int argc, const char **argv, const size_t *argvlen);
extern int	idem_vc_node_expect(idem_vc *vc, vc_node *n, int what);
extern int	idem_vc_node_flush(idem_vc *vc, vc_node *n, int64_t deadline);
extern int	idem_vc_node_read(idem_vc *vc, vc_node *n, int64_t deadline, redisReply **out);
extern int	idem_vc_node_call(idem_vc *vc, vc_node *n, int argc, const char **argv, int64_t deadline, redisReply **out);
extern int	idem_vc_node_ensure(idem_vc *vc, vc_node *n, int64_t deadline);

/* valkey_router.c */
extern int	idem_vc_refresh(idem_vc *vc, int64_t deadline);

#endif							/* IDEM_VALKEY_ROUTER_INT_H */
