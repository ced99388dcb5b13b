/*-------------------------------------------------------------------------
 *
 * worker_router.h
 *	  The worker's router (worker_router.c), as the worker's other files
 *	  see it: a Valkey Cluster, or a single Valkey as its one node.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_WORKER_ROUTER_H
#define IDEM_WORKER_ROUTER_H

#include "commit_ring.h"

struct idem_vc_cmd;				/* valkey_router.h */
struct redisReply;

/*
 * The most records one batch holds: the worker's drains take at most this many
 * from the commit ring at a time, and worker_router_send() and
 * worker_router_copy() size their per-batch arrays by it.  One constant, so
 * that neither side can outgrow the other.
 */
#define IDEM_BATCH_MAX			512

/*
 * The Valkey a process connects to (worker_valkey.c's worker_target): the
 * cache's, from the idem.valkey_* settings, or in an outbox publisher the
 * outbox's, from the idem.outbox_valkey_* settings when they name one.
 */
typedef struct WorkerValkeyTarget
{
	const char *host;			/* "": the nodes only */
	int			port;
	const char *nodes;			/* more seeds, "" for none */
	const char *password;		/* the setting; "" for none */
	const char *password_file;	/* the setting; "" for none */
	const char *prefix;			/* "idem.valkey_" or "idem.outbox_valkey_",
								 * to name the settings in messages */
	int			db;
	int			cluster;		/* IdemValkeyCluster */
	bool		report;			/* idem_stats()'s cluster columns describe
								 * this connection (the cache's) */
} WorkerValkeyTarget;

typedef enum WorkerRouterConnect
{
	WORKER_ROUTER_SINGLE,		/* not a cluster: the router's one node */
	WORKER_ROUTER_CLUSTER,		/* routing through the cluster */
	WORKER_ROUTER_FAILED,		/* no node answered; errbuf says why */
	WORKER_ROUTER_MISCONFIGURED,	/* a cluster, but idem.valkey_db is not 0 */
	WORKER_ROUTER_SHUTDOWN
} WorkerRouterConnect;

typedef enum WorkerRouterCopy
{
	WORKER_ROUTER_ACKED,		/* every record answered: consume the batch */
	WORKER_ROUTER_NOT_ACKED,	/* keep the batch queued; errbuf says why */
	WORKER_ROUTER_STOPPING
} WorkerRouterCopy;

/*
 * How the caller encodes one queued record as SET key value PX ttl
 * (worker_encode_record()): 1 done,
 * 0 the record's retention is over (skip it), -1 it cannot be encoded.
 */
typedef int (*WorkerRouterEncode) (void *arg, const IdemRingRecord *rec,
								   char *key, int *keylen, char *value,
								   int *valuelen, char *ttl, size_t ttllen);

extern WorkerRouterConnect worker_router_connect(const WorkerValkeyTarget *target,
												 const char *password, char *errbuf,
												 size_t errlen);
extern bool worker_router_active(void);	/* on a cluster */
extern bool worker_router_connected(void);	/* on a cluster or a single Valkey */
extern void worker_router_disconnect(void);
extern int	worker_router_send(const IdemRingRecord **records, int n,
							   bool *done, WorkerRouterEncode encode, void *encode_arg,
							   uint64 *rejected);
extern WorkerRouterCopy worker_router_collect(bool waited,
											  uint64 *copied, uint64 *rejected,
											  char *errbuf, size_t errlen);
extern WorkerRouterCopy worker_router_copy(const IdemRingRecord **records, int n,
										   bool *done,
										   WorkerRouterEncode encode, void *encode_arg,
										   uint64 *copied,
										   uint64 *rejected, char *errbuf, size_t errlen);
extern int	worker_router_pipeline(struct idem_vc_cmd *cmds, int n, bool *shutdown,
								   char *errbuf, size_t errlen);
extern struct redisReply *worker_router_command(const char *key, size_t keylen, int argc,
												const char **argv, const size_t *argvlen,
												bool *shutdown, char *errbuf,
												size_t errlen);
extern int	worker_router_single_append(int argc, const char **argv,
										const size_t *argvlen, char *errbuf,
										size_t errlen);
extern int	worker_router_single_flush(int64 deadline_ms, char *errbuf,
									   size_t errlen);
extern int	worker_router_single_read(int64 deadline_ms, bool read_first,
									  struct redisReply **reply, char *errbuf,
									  size_t errlen);
extern void worker_router_report_stats(void);
extern const char *worker_router_describe(void);

#endif							/* IDEM_WORKER_ROUTER_H */
