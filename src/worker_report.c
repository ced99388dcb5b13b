/*-------------------------------------------------------------------------
 *
 * worker_report.c
 *	  What the worker says about Valkey: the problem of the last attempt
 *	  (worker_errbuf) in idem_stats() and, at most every
 *	  IDEM_LOG_INTERVAL_MS, in the server log; copies that wait for a
 *	  standby that cannot be used.  The password is never logged.
 *
 *	  Locking: none of its own; idem_stats() is stats.c's.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "utils/timestamp.h"

#include "commit_ring.h"
#include "standby_slots.h"
#include "stats.h"
#include "worker_int.h"

static TimestampTz worker_last_logged = 0;
bool		worker_failing = false;	/* last attempt failed; log the recovery */

/*
 * Copies wait for a standby that cannot be used (worker_errbuf says why):
 * say so in idem_stats() and, at most every IDEM_LOG_INTERVAL_MS, in the
 * log.
 */
void
worker_report_standby(void)
{
	static TimestampTz logged = 0;
	TimestampTz now = GetCurrentTimestamp();
	char		text[IDEM_ERRBUF_LEN + 64];

	snprintf(text, sizeof(text), "%s: copies wait: %s",
			 timestamptz_to_str(now), worker_errbuf);
	idem_stats_set_valkey(worker_connected(), text);
	if (TimestampDifferenceExceeds(logged, now, IDEM_LOG_INTERVAL_MS))
	{
		ereport(LOG,
				(errmsg("results wait before they are copied to Valkey: %s",
						worker_errbuf),
				 errhint("Check idem.standby_slots: each slot must be a physical slot in use by a standby.")));
		logged = now;
	}
}

/*
 * Copies held back for durability (worker_durable_lsn: WAL durable only up
 * to durable) once the oldest has waited IDEM_HELD_REPORT_MS: say what holds
 * them (idem_standby_slots_holder) in idem_stats() and in the log: at once
 * for a copy held back that was not logged yet, then at most every
 * IDEM_LOG_INTERVAL_MS while the same one waits.  A stopped standby of a slot that
 * idem.standby_slots = '*' waits for holds every copy, silently otherwise.
 * Looks at most every IDEM_HELD_REPORT_MS, so the drains may call it on
 * each wait.
 */
void
worker_report_held(XLogRecPtr durable)
{
	static TimestampTz noted = 0;
	static TimestampTz logged = 0;
	static TimestampTz logged_oldest = 0;	/* when the one logged was queued */
	TimestampTz now = GetCurrentTimestamp();
	TimestampTz oldest;
	int64		age_ms;
	char		what[IDEM_ERRBUF_LEN];
	char		text[IDEM_LAST_ERROR_LEN];

	if (!TimestampDifferenceExceeds(noted, now, IDEM_HELD_REPORT_MS))
		return;
	noted = now;
	if (!idem_ring_oldest_age(&age_ms) || age_ms < IDEM_HELD_REPORT_MS)
		return;
	oldest = now - age_ms * 1000;
	idem_standby_slots_holder(durable, what, sizeof(what));
	snprintf(text, sizeof(text), "%s: copies held back for %lld s: %s",
			 timestamptz_to_str(now), (long long) (age_ms / 1000), what);
	idem_stats_set_valkey(worker_connected(), text);
	if (TimestampDifferenceExceeds(logged, now, IDEM_LOG_INTERVAL_MS) ||
		TimestampDifferenceExceeds(logged_oldest, oldest, IDEM_HELD_REPORT_MS))
	{
		ereport(LOG,
				(errmsg("results have waited %lld s to be copied to Valkey: %s",
						(long long) (age_ms / 1000), what),
				 errdetail("%llu copies wait in the commit ring; once it is full, new ones are dropped.",
						   (unsigned long long) idem_ring_depth()),
				 errhint("Copies wait until every standby that idem.standby_slots names (by default every physical slot in use) has flushed their commit: start the standby, drop its slot, or change idem.standby_slots.")));
		logged = now;
		logged_oldest = oldest;
	}
}

/*
 * Record a problem (worker_errbuf) in idem_stats() (counted as a copy error
 * if is_error) and, at most every IDEM_LOG_INTERVAL_MS, in the server log.
 */
void
worker_report_problem(const char *doing, int retry_ms, bool is_error)
{
	TimestampTz now = GetCurrentTimestamp();
	char		text[IDEM_ERRBUF_LEN + 128];

	snprintf(text, sizeof(text), "%s: %s %s:%d: %s",
			 timestamptz_to_str(now), doing, worker_valkey_host, worker_valkey_port, worker_errbuf);
	idem_stats_set_valkey(worker_connected(), text);
	if (is_error)
		idem_stats_add(IDEM_STAT_COPY_ERRORS, 1);
	if (!worker_failing ||
		TimestampDifferenceExceeds(worker_last_logged, now, IDEM_LOG_INTERVAL_MS))
	{
		ereport(LOG,
				(errmsg("%s Valkey at %s:%d failed: %s",
						doing, worker_valkey_host, worker_valkey_port, worker_errbuf),
				 retry_ms > 0 ?
				 errdetail("Queued results are kept while the commit ring has room (%llu wait); retrying in %d ms.",
						   (unsigned long long) idem_ring_depth(), retry_ms) : 0));
		worker_last_logged = now;
	}
	worker_failing = true;
}

/* One record skipped for reason (an IDEM_STAT_SKIPPED_* counter). */
void
worker_skip(WorkerSkips *skips, IdemStat reason)
{
	Assert(reason >= IDEM_STAT_SKIPPED_EXPIRED && reason < IDEM_STAT_COUNT);
	skips->n[reason - IDEM_STAT_SKIPPED_EXPIRED]++;
}

void
worker_skips_add(WorkerSkips *into, const WorkerSkips *from)
{
	for (int i = 0; i < WORKER_SKIP_REASONS; i++)
		into->n[i] += from->n[i];
}

/* Why records of each IDEM_STAT_SKIPPED_* reason were not copied. */
static const char *const skip_reasons[] = {
	"their retention ended while they waited in the commit ring",
	"their database is in a Citus cluster whose cache keyspace this node has not joined",
	"they were read or committed under an older history epoch",
};

StaticAssertDecl(lengthof(skip_reasons) == WORKER_SKIP_REASONS,
				 "one text per IDEM_STAT_SKIPPED_* counter");

/*
 * Records skipped (skips) left the commit ring: count them in idem_stats(),
 * and say why in last_error and, at most every IDEM_LOG_INTERVAL_MS for
 * each reason, in the server log (with how many since the last line).
 */
void
worker_count_skips(const WorkerSkips *skips)
{
	static TimestampTz logged[WORKER_SKIP_REASONS];
	static uint64 unlogged[WORKER_SKIP_REASONS];
	TimestampTz now = 0;

	for (int i = 0; i < WORKER_SKIP_REASONS; i++)
	{
		char		text[IDEM_LAST_ERROR_LEN];

		if (skips->n[i] == 0)
			continue;
		idem_stats_add((IdemStat) (IDEM_STAT_SKIPPED_EXPIRED + i), skips->n[i]);
		unlogged[i] += skips->n[i];
		if (now == 0)
			now = GetCurrentTimestamp();
		snprintf(text, sizeof(text), "%s: results not copied: %s",
				 timestamptz_to_str(now), skip_reasons[i]);
		idem_stats_set_valkey(worker_connected(), text);
		if (!TimestampDifferenceExceeds(logged[i], now, IDEM_LOG_INTERVAL_MS))
			continue;
		ereport(LOG,
				(errmsg("%llu results were not copied to Valkey: %s",
						(unsigned long long) unlogged[i], skip_reasons[i]),
				 errdetail("PostgreSQL still answers for them; idem_stats() counts them by reason.")));
		logged[i] = now;
		unlogged[i] = 0;
	}
}
