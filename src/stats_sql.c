/*-------------------------------------------------------------------------
 *
 * stats_sql.c
 *	  idem_stats(): one row of the shared counters (stats.c) and the depth
 *	  of the commit ring (idem_ring_depth()), and this database's outbox
 *	  backlog (idem_outbox_backlog()).  It stands above them, so
 *	  that the counters stay a leaf that the ring counts into.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "funcapi.h"
#include "utils/builtins.h"
#include "utils/lsyscache.h"
#include "utils/timestamp.h"

#include "compat.h"
#include "decision.h"
#include "commit_ring.h"
#include "stats.h"
#include "outbox.h"

/* Column order of idem_stats(); see idem--0.3--0.4.sql. */
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
	COL_SKIPPED,				/* the sum of the reasons that follow */
	COL_SKIPPED_REASONS,		/* one column per IDEM_STAT_SKIPPED_* from here */
	COL_QUEUE_AGE = COL_SKIPPED_REASONS + IDEM_STAT_COUNT - IDEM_STAT_SKIPPED_EXPIRED,
	COL_OUTBOX_WAITING,			/* this database's outbox */
	COL_OUTBOX_AGE,
	COL_OUTBOX_COUNTERS,		/* one column per IdemOutboxStat from here */
	COL_COUNT = COL_OUTBOX_COUNTERS + IDEM_OUTBOX_STAT_COUNT
};

#define IDEM_STAT_FIRST_SKIPPED IDEM_STAT_SKIPPED_EXPIRED
StaticAssertDecl(COL_QUEUED + IDEM_STAT_QUEUE_STALLS + 1 == COL_QUEUE_DEPTH &&
				 IDEM_STAT_QUEUE_STALLS + 1 == IDEM_STAT_FIRST_SKIPPED,
				 "idem_stats() columns must follow IdemStat");

PG_FUNCTION_INFO_V1(idem_stats);

/*
 * idem_stats() RETURNS one row; the columns are documented in the README
 * and declared in idem--0.3--0.4.sql.
 */
Datum
idem_stats(PG_FUNCTION_ARGS)
{
	TupleDesc	tupdesc;
	Datum		values[COL_COUNT];
	bool		nulls[COL_COUNT];
	IdemStatsSnapshot snap;
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
	if (!idem_stats_read(&snap))
	{
		values[COL_PRELOADED] = BoolGetDatum(false);
		values[COL_CONNECTED] = BoolGetDatum(false);
		for (i = COL_QUEUED; i < COL_COUNT; i++)
			values[i] = Int64GetDatum(0);
		values[COL_LAST_ERROR] = CStringGetTextDatum("idem is not in shared_preload_libraries: results are not copied to Valkey");
		values[COL_CLUSTER] = BoolGetDatum(false);
		nulls[COL_NODES] = true;
		nulls[COL_QUEUE_AGE] = true;
	}
	else
	{
		int64		skipped = 0;
		int64		age_ms;

		values[COL_PRELOADED] = BoolGetDatum(true);
		values[COL_CONNECTED] = BoolGetDatum(snap.connected);

		/* queued, copied, dropped, copy_errors, rejected: IdemStat order */
		for (i = 0; i < IDEM_STAT_FIRST_SKIPPED; i++)
			values[COL_QUEUED + i] = Int64GetDatum((int64) snap.counters[i]);
		for (i = IDEM_STAT_FIRST_SKIPPED; i < IDEM_STAT_COUNT; i++)
		{
			values[COL_SKIPPED_REASONS + i - IDEM_STAT_FIRST_SKIPPED] =
				Int64GetDatum((int64) snap.counters[i]);
			skipped += (int64) snap.counters[i];
		}
		values[COL_SKIPPED] = Int64GetDatum(skipped);
		values[COL_QUEUE_DEPTH] = Int64GetDatum((int64) idem_ring_depth());
		if (idem_ring_oldest_age(&age_ms))
		{
			Interval   *age = (Interval *) palloc0(sizeof(Interval));

			age->time = age_ms * 1000;
			values[COL_QUEUE_AGE] = IntervalPGetDatum(age);
		}
		else
			nulls[COL_QUEUE_AGE] = true;
		if (snap.last_error[0] == '\0')
			nulls[COL_LAST_ERROR] = true;
		else
			values[COL_LAST_ERROR] = CStringGetTextDatum(snap.last_error);
		for (i = 0; i < IDEM_DECISION_COUNT; i++)
			values[COL_CLAIMS + i] = Int64GetDatum((int64) snap.claims[i]);
		values[COL_CLUSTER] = BoolGetDatum(snap.cluster);
		for (i = 0; i < IDEM_CLUSTER_STAT_COUNT; i++)
			values[COL_CLUSTER_COUNTERS + i] =
				Int64GetDatum((int64) snap.cluster_counters[i]);
		if (snap.nodes[0] == '\0')
			nulls[COL_NODES] = true;
		else
			values[COL_NODES] = CStringGetTextDatum(snap.nodes);
	}

	/* the messages waiting in this database's outbox, preloaded or not */
	{
		int64		waiting;
		Interval   *age;

		idem_outbox_backlog(get_func_namespace(fcinfo->flinfo->fn_oid),
							&waiting, &age);
		values[COL_OUTBOX_WAITING] = Int64GetDatum(waiting);
		if (age)
			values[COL_OUTBOX_AGE] = IntervalPGetDatum(age);
		else
			nulls[COL_OUTBOX_AGE] = true;
		if (!idem_stats_read(&snap))
			memset(snap.outbox_counters, 0, sizeof(snap.outbox_counters));
		for (i = 0; i < IDEM_OUTBOX_STAT_COUNT; i++)
			values[COL_OUTBOX_COUNTERS + i] =
				Int64GetDatum((int64) snap.outbox_counters[i]);
	}

	PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(tupdesc, values, nulls)));
}
