/*-------------------------------------------------------------------------
 *
 * valkey_router.h
 *	  The Valkey router on hiredis, for a Valkey Cluster and a single Valkey
 *	  alike (a one-node map): one definition, compiled into both the
 *	  extension's background worker and the client library.  The layers
 *	  below it have headers of their own: valkey_wire.h (one connection's
 *	  bytes), valkey_slots.h, valkey_map.h, valkey_endpoint.h (pure
 *	  functions); this one includes them, so a caller of the router needs
 *	  no other.
 *
 * Debian 12's hiredis (0.14.1) has no cluster support, so the routing is
 * here: the slot of a key (CRC16 with hash tags), the slot map (from
 * CLUSTER SHARDS, or CLUSTER SLOTS where a server has no SHARDS), one
 * connection per master, and a pipelined batch of
 * single-key commands split per node whose replies are matched back to the
 * commands.  MOVED updates the map (and refreshes it) and resends that
 * command; ASK sends ASKING and the command to the named node; replies that
 * say the cluster is between two states (valkey_reply.c: CLUSTERDOWN,
 * TRYAGAIN, READONLY, LOADING, MASTERDOWN) keep the command and retry it
 * with a backoff until the deadline; every other error reply, the other
 * "not now" codes among them, is the caller's.  A caller
 * may split a pipeline after its first send (idem_vc_send, then
 * idem_vc_collect) to do something else while the replies come.  A command
 * whose node cannot be reached is left pending: the caller decides (the
 * worker keeps its records queued, the runner falls back to PostgreSQL for
 * that key only).  After a failed connect a node rests for retry_ms.
 *
 * The same code also drives a single Valkey that is not a cluster: every
 * slot then maps to the node given first (a one-node map), whose error
 * replies, transient ones too, are all the caller's; the worker also
 * pipelines its batches to that node directly (idem_vc_single_*).
 * idem_vc_open() detects the mode with INFO cluster (unless forced).
 *
 * Every Valkey connection of idem is a router's: the worker's and the
 * runner's gate's, to a single Valkey or a cluster.
 *
 * Plain C11 and POSIX: no PostgreSQL or libpq headers, malloc only.
 * Sockets are non-blocking and waiting is the caller's (idem_vc_io.wait),
 * so the worker waits on its latch-aware WaitEventSet and the client on
 * poll(); a caller may ask for blocking reads after the setup instead
 * (idem_vc_options.blocking_reads: the runner).  Writes use
 * send(MSG_NOSIGNAL): a dead node is an error, never SIGPIPE.  hiredis is
 * used only for its RESP writer and reader.
 * An idem_vc is used by one thread at a time.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_VALKEY_ROUTER_H
#define IDEM_VALKEY_ROUTER_H

#include <stddef.h>
#include <stdint.h>

#include <hiredis/hiredis.h>

/* The layers below the router, each with its own header. */
#include "valkey_endpoint.h"
#include "valkey_map.h"
#include "valkey_slots.h"
#include "valkey_wire.h"

/* ---- the router ---- */

typedef enum idem_vc_mode
{
	IDEM_VC_MODE_AUTO = 0,		/* INFO cluster decides */
	IDEM_VC_MODE_SINGLE,
	IDEM_VC_MODE_CLUSTER
} idem_vc_mode;

typedef struct idem_vc_options
{
	const char *seeds;			/* "host:port[,host:port...]"; a host alone
								 * takes default_port */
	int			default_port;
	const char *password;		/* NULL or "" for none */
	int			db;				/* single mode only; cluster needs 0 */
	idem_vc_mode mode;
	int			connect_timeout_ms;
	int			retry_ms;		/* a node that failed rests this long */

	/*
	 * The runner's choices (the worker leaves them 0):
	 *
	 * blocking_reads: after its setup a node's socket is made blocking, and
	 * a reply is read with one recv() whose SO_RCVTIMEO is what is left of
	 * the deadline (no poll() before it): an exchange with one node is two
	 * system calls.  io.wait is then used for connects, full send buffers
	 * and backoffs only, so a caller whose wait must also watch something
	 * else (the worker's latch) leaves it 0.
	 *
	 * reconnect_dead: a connection that had answered before and is found
	 * dead (EOF, reset, broken pipe: Valkey restarted, or closed an idle
	 * client) is connected again at once and the node's unanswered commands
	 * are resent, instead of the node resting for retry_ms.  Only a
	 * connection that dies before its first answer makes the node rest, so
	 * a node that is down costs one connect per retry_ms.  Commands are
	 * then sent twice when the first copy ran and its reply was lost: set
	 * it only if every command the caller sends may run twice.
	 *
	 * nsetup commands (setup_argc, setup_argv; the arrays outlive the
	 * router) are sent in every connection's setup round trip, after AUTH
	 * and before SELECT; setup_check, if not NULL, judges their replies
	 * (0, or -1 with err set: the connect fails and the node rests).
	 */
	int			blocking_reads;
	int			reconnect_dead;
	int			nsetup;
	const int  *setup_argc;
	const char *const *const *setup_argv;
	int			(*setup_check) (redisReply *const *replies, char *err,
								size_t errlen);
} idem_vc_options;

typedef struct idem_vc_stats
{
	long long	moved;			/* MOVED replies followed */
	long long	ask;			/* ASK replies followed */
	long long	retries;		/* CLUSTERDOWN/TRYAGAIN/... retried */
	long long	refreshes;		/* slot maps read */
	long long	node_errors;	/* connects or exchanges that failed */
	long long	connects;
	long long	round_trips;	/* rounds of a pipeline (per node sent) */
	long long	setups;			/* connections' setup round trips */
} idem_vc_stats;

typedef struct idem_vc idem_vc;

/* One single-key command of a pipeline, and what came of it. */
typedef struct idem_vc_cmd
{
	const char *key;			/* routes the command */
	size_t		keylen;
	int			argc;
	const char **argv;
	const size_t *argvlen;
	/* out */
	redisReply *reply;			/* NULL: still pending (node unreachable,
								 * deadline); caller frees */
	int			node;			/* node that answered, or last tried */
	/* internal */
	int			ask_node;
	int			rounds;
} idem_vc_cmd;

/*
 * Make a router.  NULL only when out of memory or the seeds do not parse
 * (err says why).  Connects nothing yet.
 */
idem_vc    *idem_vc_new(const idem_vc_options *opt, const idem_vc_io *io,
						char *err, size_t errlen);
void		idem_vc_free(idem_vc *vc);

/*
 * Connect to the first seed that answers, authenticate, detect the mode
 * and (cluster) read the slot map.  Each seed in turn has seed_budget_ms
 * for all of that: a seed that accepts connections but hangs (stopped,
 * overloaded) costs its budget, and the next seed is asked.  0, or -1 with
 * the reason in err (a cluster with idem.valkey_db other than 0 is -2, a
 * configuration error).  -3: abandoned (io.wait said so).
 */
int			idem_vc_open(idem_vc *vc, int seed_budget_ms, char *err,
						 size_t errlen);
int			idem_vc_is_cluster(const idem_vc *vc);
int			idem_vc_is_open(const idem_vc *vc);
/* Open, and every node of the map rests after a failure (not connected,
 * its retry_ms not over): a pipeline now would send nothing. */
int			idem_vc_all_resting(const idem_vc *vc);

/*
 * Send the commands, pipelined per node, and collect their replies, following
 * redirects, until each has a reply or the deadline passes.  Returns the
 * number of commands with a reply, or -2 if abandoned.  Error replies other
 * than redirects and transient errors are replies (the caller judges them).
 */
int			idem_vc_pipeline(idem_vc *vc, idem_vc_cmd *cmds, int n,
							 int64_t deadline_ms);

/*
 * idem_vc_pipeline in two steps, for a caller that does something else
 * before the replies come: idem_vc_send routes and sends the commands
 * (0, or -2 if abandoned); idem_vc_collect then does the rest with the
 * same cmds and returns what idem_vc_pipeline would.  waited: time has
 * passed since the send (the worker's batch delay), so the replies are
 * likely in: each node's are read before its socket is waited for.
 */
int			idem_vc_send(idem_vc *vc, idem_vc_cmd *cmds, int n,
						 int64_t deadline_ms);
int			idem_vc_collect(idem_vc *vc, idem_vc_cmd *cmds, int n,
							int64_t deadline_ms, int waited);

/*
 * A single Valkey (idem_vc_open found no cluster, or the mode is single),
 * driven directly (valkey_single.c): append commands to its one node, send
 * them, read their replies in order, with batches written ahead of the
 * replies to earlier ones.  read_first: time has passed since the send,
 * receive before waiting.  0; -1 (idem_vc_last_error says why; the node is
 * dropped); -2 abandoned (io.wait said so).  No pipeline may be in flight.
 */
int			idem_vc_single_append(idem_vc *vc, int argc, const char **argv,
								  const size_t *argvlen);
int			idem_vc_single_flush(idem_vc *vc, int64_t deadline_ms);
int			idem_vc_single_read(idem_vc *vc, int64_t deadline_ms,
								int read_first, redisReply **out);

/* Close every connection (the map is kept; the next pipeline reconnects). */
void		idem_vc_close_all(idem_vc *vc);

const idem_vc_stats *idem_vc_get_stats(const idem_vc *vc);
int			idem_vc_nnodes(const idem_vc *vc);
/* host:port of node i, its error count, and whether it is a master now. */
const char *idem_vc_node_name(const idem_vc *vc, int i);
long long	idem_vc_node_errors(const idem_vc *vc, int i);
int			idem_vc_node_in_map(const idem_vc *vc, int i);
/* The last error text (connection failures and the like). */
const char *idem_vc_last_error(const idem_vc *vc);

/*
 * A TCP connection to host:port by deadline_ms (monotonic), waiting through
 * io: each address the name resolves to in turn; the socket non-blocking,
 * close-on-exec, TCP_NODELAY.  Every Valkey connection of the worker and
 * the router's nodes are made here, and the client's gate connection too.
 * The socket, or -1 (err says why), or -2 abandoned (io.wait said so).
 */
int			idem_vc_tcp_connect(const char *host, int port, int64_t deadline_ms,
								const idem_vc_io *io, char *err, size_t errlen);

#endif							/* IDEM_VALKEY_ROUTER_H */
