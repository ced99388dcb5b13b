/*-------------------------------------------------------------------------
 *
 * stats.h
 *	  The shared counters (stats.c) behind idem_stats(): what committing
 *	  backends and the worker count, and the worker's connection state.  A
 *	  leaf: stats.c calls no other file; stats_sql.c reads them.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_STATS_H
#define IDEM_STATS_H

#include "decision.h"

/*
 * What the shared counters count.  Every copy handed to the commit ring is
 * counted in queued and, once settled, in exactly one of copied, dropped,
 * rejected or a skipped reason; until then it is in the ring's depth.  So
 * queued = copied + dropped + rejected + skipped + depth whenever no copy
 * is between the ring and the counters (stats_sql.c reports the skipped
 * reasons and their sum).
 */
typedef enum IdemStat
{
	IDEM_STAT_QUEUED = 0,		/* copies handed to the commit ring */
	IDEM_STAT_COPIED,			/* copies written to Valkey */
	IDEM_STAT_DROPPED,			/* copies refused because the ring was full */
	IDEM_STAT_COPY_ERRORS,		/* failed connects and batches (kept, resent) */
	IDEM_STAT_REJECTED,			/* copies Valkey refused one by one (dropped) */
	IDEM_STAT_QUEUE_STALLS,		/* the oldest copy reserved, unwritten over 1 s */
	IDEM_STAT_SKIPPED_EXPIRED,	/* copies whose retention ended in the ring */
	IDEM_STAT_SKIPPED_UNJOINED, /* copies of a database in a Citus cluster
								 * this node has not joined (for its epoch) */
	IDEM_STAT_SKIPPED_EPOCH,	/* copies read or committed under an older
								 * history epoch */
	IDEM_STAT_COUNT
} IdemStat;

/* Shared memory (shmem.c). */
extern Size idem_stats_shmem_size(void);
extern void idem_stats_shmem_init(void);

extern void idem_stats_count_claim(IdemDecision decision);
extern void idem_stats_add(IdemStat stat, uint64 n);
extern void idem_stats_set_valkey(bool connected, const char *error);

/* Valkey Cluster counters (worker_router.c), idem_stats()'s last columns. */
typedef enum IdemClusterStat
{
	IDEM_STAT_REDIRECTS = 0,	/* MOVED and ASK replies followed */
	IDEM_STAT_MAP_REFRESHES,	/* slot maps read */
	IDEM_STAT_NODE_ERRORS,		/* failed connects/exchanges with a node */
	IDEM_STAT_CLUSTER_RETRIES,	/* CLUSTERDOWN/TRYAGAIN/READONLY retried */
	IDEM_CLUSTER_STAT_COUNT
} IdemClusterStat;

extern void idem_stats_add_cluster(IdemClusterStat stat, uint64 n);
extern void idem_stats_set_cluster(bool cluster, const char *nodes);

/* The outbox publishers' counters (outbox_publish.c), idem_stats()'s too. */
typedef enum IdemOutboxStat
{
	IDEM_STAT_PUBLISHED = 0,	/* messages written to their stream (XADD) */
	IDEM_STAT_PUBLISH_ERRORS,	/* failed connects and XADDs (kept, resent) */
	IDEM_OUTBOX_STAT_COUNT
} IdemOutboxStat;

extern void idem_stats_add_outbox(IdemOutboxStat stat, uint64 n);

/* What idem_stats_read() copies out of the shared counters. */
#define IDEM_LAST_ERROR_LEN 256
#define IDEM_NODES_TEXT_LEN 1024
typedef struct IdemStatsSnapshot
{
	uint64		counters[IDEM_STAT_COUNT];
	uint64		claims[IDEM_DECISION_COUNT];
	uint64		cluster_counters[IDEM_CLUSTER_STAT_COUNT];
	uint64		outbox_counters[IDEM_OUTBOX_STAT_COUNT];
	bool		connected;		/* the worker reaches Valkey */
	bool		cluster;		/* ... a Valkey Cluster */
	char		last_error[IDEM_LAST_ERROR_LEN];
	char		nodes[IDEM_NODES_TEXT_LEN];
} IdemStatsSnapshot;

extern bool idem_stats_read(IdemStatsSnapshot *out);

#endif							/* IDEM_STATS_H */
