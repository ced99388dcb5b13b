/*-------------------------------------------------------------------------
 *
 * stats.c
 *	  The shared counters behind idem_stats() (stats_sql.c).
 *
 * A leaf: every part of idem counts into it, and it calls none of them.
 * The counters live in shared memory (reserved and initialised through
 * shmem.c when idem is preloaded) as 64-bit atomics, so that counting a claim or a
 * copy takes no lock.  The worker's connection state and last error text
 * sit beside them, the text under a spinlock held for one copy.  Without
 * preloading there is no shared memory: counting is a no-op, and
 * idem_stats_read() says so.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "port/atomics.h"
#include "storage/shmem.h"
#include "storage/spin.h"

#include "stats.h"
#include "decision.h"

typedef struct IdemStatsShared
{
	pg_atomic_uint64 counters[IDEM_STAT_COUNT];
	pg_atomic_uint64 claims[IDEM_DECISION_COUNT];
	pg_atomic_uint64 cluster_counters[IDEM_CLUSTER_STAT_COUNT];
	pg_atomic_uint64 outbox_counters[IDEM_OUTBOX_STAT_COUNT];
	pg_atomic_uint32 connected;
	pg_atomic_uint32 cluster;	/* the worker talks to a Valkey Cluster */
	slock_t		mutex;			/* protects last_error and nodes */
	char		last_error[IDEM_LAST_ERROR_LEN];
	char		nodes[IDEM_NODES_TEXT_LEN];
} IdemStatsShared;

static IdemStatsShared *idem_stats_shared = NULL;

Size
idem_stats_shmem_size(void)
{
	return MAXALIGN(sizeof(IdemStatsShared));
}

/* Called from shmem.c's startup hook, with AddinShmemInitLock held. */
void
idem_stats_shmem_init(void)
{
	bool		found;
	int			i;

	idem_stats_shared = ShmemInitStruct("idem stats",
										sizeof(IdemStatsShared), &found);
	if (found)
		return;
	for (i = 0; i < IDEM_STAT_COUNT; i++)
		pg_atomic_init_u64(&idem_stats_shared->counters[i], 0);
	for (i = 0; i < IDEM_DECISION_COUNT; i++)
		pg_atomic_init_u64(&idem_stats_shared->claims[i], 0);
	for (i = 0; i < IDEM_CLUSTER_STAT_COUNT; i++)
		pg_atomic_init_u64(&idem_stats_shared->cluster_counters[i], 0);
	for (i = 0; i < IDEM_OUTBOX_STAT_COUNT; i++)
		pg_atomic_init_u64(&idem_stats_shared->outbox_counters[i], 0);
	pg_atomic_init_u32(&idem_stats_shared->connected, 0);
	pg_atomic_init_u32(&idem_stats_shared->cluster, 0);
	SpinLockInit(&idem_stats_shared->mutex);
	idem_stats_shared->last_error[0] = '\0';
	idem_stats_shared->nodes[0] = '\0';
}

/*
 * Called by ledger_claim_key_nowait() on every claim: one atomic add, no
 * lock.
 */
void
idem_stats_count_claim(IdemDecision decision)
{
	if (idem_stats_shared == NULL ||
		decision < 0 || decision >= IDEM_DECISION_COUNT)
		return;
	pg_atomic_fetch_add_u64(&idem_stats_shared->claims[decision], 1);
}

/* Safe on the commit path: no allocation, no error. */
void
idem_stats_add(IdemStat stat, uint64 n)
{
	if (idem_stats_shared == NULL || n == 0)
		return;
	pg_atomic_fetch_add_u64(&idem_stats_shared->counters[stat], n);
}

/*
 * The worker reports its connection state; error (if not NULL) replaces the
 * last error text.  The text is cut at IDEM_LAST_ERROR_LEN - 1 bytes.
 */
void
idem_stats_set_valkey(bool connected, const char *error)
{
	if (idem_stats_shared == NULL)
		return;
	pg_atomic_write_u32(&idem_stats_shared->connected, connected ? 1 : 0);
	if (error != NULL)
	{
		SpinLockAcquire(&idem_stats_shared->mutex);
		strlcpy(idem_stats_shared->last_error, error, IDEM_LAST_ERROR_LEN);
		SpinLockRelease(&idem_stats_shared->mutex);
	}
}

void
idem_stats_add_cluster(IdemClusterStat stat, uint64 n)
{
	if (idem_stats_shared == NULL || n == 0)
		return;
	pg_atomic_fetch_add_u64(&idem_stats_shared->cluster_counters[stat], n);
}

void
idem_stats_add_outbox(IdemOutboxStat stat, uint64 n)
{
	if (idem_stats_shared == NULL || n == 0)
		return;
	pg_atomic_fetch_add_u64(&idem_stats_shared->outbox_counters[stat], n);
}

/* Cluster mode or not, and (if not NULL) the nodes' summary text. */
void
idem_stats_set_cluster(bool cluster, const char *nodes)
{
	if (idem_stats_shared == NULL)
		return;
	pg_atomic_write_u32(&idem_stats_shared->cluster, cluster ? 1 : 0);
	if (nodes != NULL)
	{
		SpinLockAcquire(&idem_stats_shared->mutex);
		strlcpy(idem_stats_shared->nodes, nodes, IDEM_NODES_TEXT_LEN);
		SpinLockRelease(&idem_stats_shared->mutex);
	}
}

/*
 * Copy every counter and text into *out, as one reader sees them (each
 * value is read atomically, not the set).  false, and *out untouched,
 * when idem is not preloaded: there are no counters.
 */
bool
idem_stats_read(IdemStatsSnapshot *out)
{
	int			i;

	if (idem_stats_shared == NULL)
		return false;
	out->connected = pg_atomic_read_u32(&idem_stats_shared->connected) != 0;
	for (i = 0; i < IDEM_STAT_COUNT; i++)
		out->counters[i] = pg_atomic_read_u64(&idem_stats_shared->counters[i]);
	SpinLockAcquire(&idem_stats_shared->mutex);
	strlcpy(out->last_error, idem_stats_shared->last_error, IDEM_LAST_ERROR_LEN);
	strlcpy(out->nodes, idem_stats_shared->nodes, IDEM_NODES_TEXT_LEN);
	SpinLockRelease(&idem_stats_shared->mutex);
	for (i = 0; i < IDEM_DECISION_COUNT; i++)
		out->claims[i] = pg_atomic_read_u64(&idem_stats_shared->claims[i]);
	out->cluster = pg_atomic_read_u32(&idem_stats_shared->cluster) != 0;
	for (i = 0; i < IDEM_CLUSTER_STAT_COUNT; i++)
		out->cluster_counters[i] =
			pg_atomic_read_u64(&idem_stats_shared->cluster_counters[i]);
	for (i = 0; i < IDEM_OUTBOX_STAT_COUNT; i++)
		out->outbox_counters[i] =
			pg_atomic_read_u64(&idem_stats_shared->outbox_counters[i]);
	return true;
}
