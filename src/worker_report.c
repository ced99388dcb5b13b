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

#include "stats.h"
#include "worker_int.h"

static TimestampTz last_logged = 0;
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
	idem_stats_set_valkey(vk_connected(), text);
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
 * Record a problem (worker_errbuf) in idem_stats() (counted as a copy error
 * if is_error) and, at most every IDEM_LOG_INTERVAL_MS, in the server log.
 */
void
worker_report_problem(const char *doing, int retry_ms, bool is_error)
{
	TimestampTz now = GetCurrentTimestamp();
	char		text[IDEM_ERRBUF_LEN + 128];

	snprintf(text, sizeof(text), "%s: %s %s:%d: %s",
			 timestamptz_to_str(now), doing, vk_host, vk_port, worker_errbuf);
	idem_stats_set_valkey(vk_connected(), text);
	if (is_error)
		idem_stats_add(IDEM_STAT_COPY_ERRORS, 1);
	if (!worker_failing ||
		TimestampDifferenceExceeds(last_logged, now, IDEM_LOG_INTERVAL_MS))
	{
		ereport(LOG,
				(errmsg("%s Valkey at %s:%d failed: %s",
						doing, vk_host, vk_port, worker_errbuf),
				 retry_ms > 0 ?
				 errdetail("Queued results are kept while the commit ring has room; retrying in %d ms.",
						   retry_ms) : 0));
		last_logged = now;
	}
	worker_failing = true;
}
