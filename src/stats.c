/*-------------------------------------------------------------------------
 *
 * stats.c
 *	  idem_stats() and the shared counters behind it.
 *
 * The counters live in shared memory (reserved and initialised through
 * shmem.c when idem is preloaded) as 64-bit atomics, so that counting a claim or a
 * copy takes no lock.  The worker's connection state and last error text
 * sit beside them, the text under a spinlock held for one copy.  Without
 * preloading there is no shared memory: counting is a no-op and
 * idem_stats() says that nothing is copied.
 *
 *-------------------------------------------------------------------------
 */
#include "outbox_ring.h"

#include "access/htup_details.h"
#include "funcapi.h"
#include "port/atomics.h"
#include "storage/shmem.h"
#include "storage/spin.h"
#include "utils/builtins.h"

#define IDEM_LAST_ERROR_LEN 256
#define IDEM_NODES_TEXT_LEN 1024

typedef struct IdemStatsShared
{
	pg_atomic_uint64 counters[IDEM_STAT_COUNT];
	pg_atomic_uint64 claims[IDEM_DECISION_COUNT];
	pg_atomic_uint64 cluster_counters[IDEM_CLUSTER_STAT_COUNT];
	pg_atomic_uint32 connected;
	pg_atomic_uint32 cluster;	/* the worker talks to a Valkey Cluster */
	slock_t		mutex;			/* protects last_error and nodes */
	char		last_error[IDEM_LAST_ERROR_LEN];
	char		nodes[IDEM_NODES_TEXT_LEN];
} IdemStatsShared;

static IdemStatsShared *idem_stats_shared = NULL;

/* Column order of idem_stats(); see idem--0.2--0.3.sql. */
enum
{
	COL_PRELOADED = 0,
	COL_CONNECTED,
	COL_QUEUED,
	COL_COPIED,
	COL_DROPPED,
	COL_COPY_ERRORS,
	COL_REJECTED,
	COL_QUEUE_STALLS,			/* COL_QUEUED..here follow IdemStat's order */
	COL_QUEUE_DEPTH,
	COL_LAST_ERROR,
	COL_CLAIMS,					/* one column per IdemDecision from here */
	COL_CLUSTER = COL_CLAIMS + IDEM_DECISION_COUNT,
	COL_CLUSTER_COUNTERS,		/* one column per IdemClusterStat from here */
	COL_NODES = COL_CLUSTER_COUNTERS + IDEM_CLUSTER_STAT_COUNT,
	COL_COUNT
};

StaticAssertDecl(COL_QUEUED + IDEM_STAT_COUNT == COL_QUEUE_DEPTH,
				 "idem_stats() columns must follow IdemStat");

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
	pg_atomic_init_u32(&idem_stats_shared->connected, 0);
	pg_atomic_init_u32(&idem_stats_shared->cluster, 0);
	SpinLockInit(&idem_stats_shared->mutex);
	idem_stats_shared->last_error[0] = '\0';
	idem_stats_shared->nodes[0] = '\0';
}

/* Called by ledger.c on every claim: one atomic add, no lock. */
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

PG_FUNCTION_INFO_V1(idem_stats);

/*
 * idem_stats() RETURNS one row; the columns are documented in the README
 * and declared in idem--0.2--0.3.sql.
 */
Datum
idem_stats(PG_FUNCTION_ARGS)
{
	TupleDesc	tupdesc;
	Datum		values[COL_COUNT];
	bool		nulls[COL_COUNT];
	char		last_error[IDEM_LAST_ERROR_LEN];
	char		nodes[IDEM_NODES_TEXT_LEN];
	int			i;

	if (get_call_result_type(fcinfo, NULL, &tupdesc) != TYPEFUNC_COMPOSITE)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("function returning record called in context that cannot accept type record")));
	if (tupdesc->natts != COL_COUNT)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idem_stats() is declared with %d columns, the loaded library returns %d",
						tupdesc->natts, COL_COUNT),
				 errhint("Run ALTER EXTENSION idem UPDATE.")));
	tupdesc = BlessTupleDesc(tupdesc);

	memset(nulls, 0, sizeof(nulls));
	if (idem_stats_shared == NULL)
	{
		values[COL_PRELOADED] = BoolGetDatum(false);
		values[COL_CONNECTED] = BoolGetDatum(false);
		for (i = COL_QUEUED; i < COL_COUNT; i++)
			values[i] = Int64GetDatum(0);
		values[COL_LAST_ERROR] = CStringGetTextDatum("idem is not in shared_preload_libraries: results are not copied to Valkey");
		values[COL_CLUSTER] = BoolGetDatum(false);
		nulls[COL_NODES] = true;
	}
	else
	{
		values[COL_PRELOADED] = BoolGetDatum(true);
		values[COL_CONNECTED] =
			BoolGetDatum(pg_atomic_read_u32(&idem_stats_shared->connected) != 0);
		/* queued .. queue_stalls: IdemStat order */
		for (i = 0; i < IDEM_STAT_COUNT; i++)
			values[COL_QUEUED + i] =
				Int64GetDatum((int64) pg_atomic_read_u64(&idem_stats_shared->counters[i]));
		values[COL_QUEUE_DEPTH] = Int64GetDatum((int64) idem_outbox_depth());

		SpinLockAcquire(&idem_stats_shared->mutex);
		strlcpy(last_error, idem_stats_shared->last_error, sizeof(last_error));
		strlcpy(nodes, idem_stats_shared->nodes, sizeof(nodes));
		SpinLockRelease(&idem_stats_shared->mutex);
		if (last_error[0] == '\0')
			nulls[COL_LAST_ERROR] = true;
		else
			values[COL_LAST_ERROR] = CStringGetTextDatum(last_error);

		for (i = 0; i < IDEM_DECISION_COUNT; i++)
			values[COL_CLAIMS + i] =
				Int64GetDatum((int64) pg_atomic_read_u64(&idem_stats_shared->claims[i]));

		values[COL_CLUSTER] =
			BoolGetDatum(pg_atomic_read_u32(&idem_stats_shared->cluster) != 0);
		for (i = 0; i < IDEM_CLUSTER_STAT_COUNT; i++)
			values[COL_CLUSTER_COUNTERS + i] =
				Int64GetDatum((int64) pg_atomic_read_u64(&idem_stats_shared->cluster_counters[i]));
		if (nodes[0] == '\0')
			nulls[COL_NODES] = true;
		else
			values[COL_NODES] = CStringGetTextDatum(nodes);
	}

	PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(tupdesc, values, nulls)));
}
