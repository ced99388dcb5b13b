/*-------------------------------------------------------------------------
 *
 * worker_cluster.h
 *	  The worker's router (worker_cluster.c), as the worker's other files
 *	  see it: a Valkey Cluster, or a single Valkey as its one node.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_WORKER_CLUSTER_H
#define IDEM_WORKER_CLUSTER_H

#include "outbox_ring.h"

/*
 * The most records one batch holds: the worker's drains take at most this
 * many from the commit ring at a time, and idem_wc_send() and idem_wc_copy()
 * size their per-batch arrays by it.  One constant, so that neither side can
 * outgrow the other.
 */
#define IDEM_BATCH_MAX			512

typedef enum IdemWcConnect
{
	IDEM_WC_SINGLE,				/* not a cluster: the router's one node */
	IDEM_WC_CLUSTER,			/* routing through the cluster */
	IDEM_WC_FAILED,				/* no node answered; errbuf says why */
	IDEM_WC_MISCONFIGURED,		/* a cluster, but idem.valkey_db is not 0 */
	IDEM_WC_SHUTDOWN
} IdemWcConnect;

typedef enum IdemWcCopy
{
	IDEM_WC_ACKED,				/* every record answered: consume the batch */
	IDEM_WC_NOT_ACKED,			/* keep the batch queued; errbuf says why */
	IDEM_WC_STOPPING
} IdemWcCopy;

/*
 * How the caller encodes one queued record as SET key value PX ttl
 * (vk_encode_record()): 1 done,
 * 0 the record's retention is over (skip it), -1 it cannot be encoded.
 */
typedef int (*IdemWcEncode) (void *arg, const IdemOutboxRecord *rec,
							 char *key, int *keylen, char *value,
							 int *valuelen, char *ttl, size_t ttllen);

extern IdemWcConnect idem_wc_connect(const char *password, char *errbuf,
									 size_t errlen);
extern bool idem_wc_active(void);	/* on a cluster */
extern bool idem_wc_connected(void);	/* on a cluster or a single Valkey */
extern void idem_wc_disconnect(void);
extern int	idem_wc_send(const IdemOutboxRecord **records, int n,
						 bool *done, IdemWcEncode encode, void *encode_arg,
						 uint64 *rejected);
extern IdemWcCopy idem_wc_collect(bool waited,
								  uint64 *copied, uint64 *rejected,
								  char *errbuf, size_t errlen);
extern IdemWcCopy idem_wc_copy(const IdemOutboxRecord **records, int n,
							   bool *done,
							   IdemWcEncode encode, void *encode_arg,
							   uint64 *copied,
							   uint64 *rejected, char *errbuf, size_t errlen);
extern struct redisReply *idem_wc_command(const char *key, size_t keylen, int argc,
								   const char **argv, const size_t *argvlen,
								   bool *shutdown, char *errbuf,
								   size_t errlen);
extern int	idem_wc_single_append(int argc, const char **argv,
								  const size_t *argvlen, char *errbuf,
								  size_t errlen);
extern int	idem_wc_single_flush(int64 deadline_ms, char *errbuf,
								 size_t errlen);
extern int	idem_wc_single_read(int64 deadline_ms, bool read_first,
								struct redisReply **reply, char *errbuf,
								size_t errlen);
extern void idem_wc_report_stats(void);
extern const char *idem_wc_describe(void);

#endif							/* IDEM_WORKER_CLUSTER_H */
