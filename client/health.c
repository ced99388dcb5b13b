/*
 * health.c
 *	  What a runner says about its Valkey, and when it gives up on one.
 *
 *	  The gate (valkey_conn.c) reports each open or exchange that fails,
 *	  and why: the node does not answer (down, stalled), it refused AUTH
 *	  (WRONGPASS, or a password given to a Valkey without one) or wants
 *	  one (NOAUTH), it refused the setup otherwise (SCRIPT LOAD, SELECT),
 *	  or valkey_db is set on a cluster; each failure already makes the
 *	  gate rest for valkey_retry_ms.  The owner check of every lookup
 *	  (run_gate.c, cached.c) tells whether the epoch owner key held the
 *	  token the server names (trust.c): when it has not, with the node
 *	  answering, for IDEM_OWNER_GRACE_MS in a row, this Valkey is not the
 *	  one the server's worker writes to (or that worker cannot reach it),
 *	  and the gate rests as for a node that is down, so that such a runner
 *	  does not write markers into a Valkey nobody reads on every run.
 *
 *	  Each problem is counted (idem_runner_stats) and told to the notice
 *	  hook with its reason: at once the first time, then at most once
 *	  every IDEM_NOTICE_REPEAT_MS while it lasts (with how many times it
 *	  happened meanwhile), and once when Valkey answers again after a
 *	  problem that was told.
 *
 *	  Locking: none; the runner's, used by one thread at a time.
 */
#include "internal.h"

#include <stdio.h>
#include <string.h>

/* A problem that lasts is told again at most this often. */
#define IDEM_NOTICE_REPEAT_MS	60000

/*
 * How long the owner key may fail to hold the server's token, its node
 * answering, before this Valkey is taken for another than the server's:
 * longer than the server's worker takes to set the key again after Valkey
 * lost it (it checks every second).
 */
#define IDEM_OWNER_GRACE_MS		3000

void
idemc_runner_notice(idem_runner *r, const char *message)
{
	r->stats.notices++;
	if (r->notice)
		r->notice(r->notice_arg, message);
}

/* Tell problem p (why: what happened), unless it was told less than
 * IDEM_NOTICE_REPEAT_MS ago. */
static void
tell(idem_runner *r, valkey_problem p, const char *why)
{
	int64_t		now = idemc_now_ms();
	int64_t		at = r->health.told_at[p];
	char		msg[700];
	char		more[80];

	if (at != 0 && now - at < IDEM_NOTICE_REPEAT_MS)
	{
		r->health.untold[p]++;
		return;
	}
	more[0] = '\0';
	if (r->health.untold[p] > 0)
		snprintf(more, sizeof(more), " (%ld more time%s since the last notice)",
				 r->health.untold[p], r->health.untold[p] == 1 ? "" : "s");
	if (p == VALKEY_CONFIG)
		snprintf(msg, sizeof(msg),
				 "%s: running without the Valkey cache, on PostgreSQL only",
				 why);
	else
		snprintf(msg, sizeof(msg),
				 "%s: running on PostgreSQL only, Valkey is tried again in %d ms%s",
				 why, idemc_gate_retry_ms(r->gate), more);
	r->health.told_at[p] = now;
	r->health.untold[p] = 0;
	r->health.said = p;
	idemc_runner_notice(r, msg);
}

/* The problem told is over. */
static void
tell_over(idem_runner *r)
{
	char		msg[400];

	snprintf(msg, sizeof(msg),
			 "Valkey at %s answers again%s: the runner uses the cache again",
			 idemc_gate_endpoint(r->gate),
			 r->health.said == VALKEY_NOT_SERVERS ?
			 " with the server's epoch owner token" : "");
	r->health.said = VALKEY_OK;
	idemc_runner_notice(r, msg);
}

/* The gate's report function (idemc_gate_set_report). */
void
idemc_health_report(void *arg, valkey_problem p, const char *why)
{
	idem_runner *r = arg;

	if (p == VALKEY_OK)
	{
		/* the connection's problems are over; another Valkey's is not */
		if (r->health.said != VALKEY_OK &&
			r->health.said != VALKEY_NOT_SERVERS)
			tell_over(r);
		return;
	}
	if (p != VALKEY_CONFIG)
		r->stats.valkey_failures++;
	if (p == VALKEY_AUTH)
		r->stats.valkey_auth_failures++;
	if (p == VALKEY_AUTH && strstr(why, "NOAUTH"))
	{
		char		w[600];

		snprintf(w, sizeof(w), "%s (it wants a password: set valkey_password)", why);
		tell(r, p, w);
	}
	else if (p == VALKEY_AUTH)
	{
		char		w[600];

		snprintf(w, sizeof(w), "%s (check valkey_password)", why);
		tell(r, p, w);
	}
	else
		tell(r, p, why);
}

void
idemc_health_owner(idem_runner *r, int checked)
{
	int64_t		now;
	char		why[600];

	if (checked == GATE_CHECK_HOLDS)
	{
		r->health.owner_bad_since = 0;
		if (r->health.said == VALKEY_NOT_SERVERS)
			tell_over(r);
		return;
	}
	if (checked == GATE_CHECK_NOREPLY || r->gate == NULL)
		return;					/* the gate reported its node */
	now = idemc_now_ms();
	/* failed checks in a row: none of them further apart than a rest */
	if (r->health.owner_bad_since == 0 ||
		now - r->health.owner_bad_last >
		IDEM_OWNER_GRACE_MS + idemc_gate_retry_ms(r->gate))
		r->health.owner_bad_since = now;
	r->health.owner_bad_last = now;
	if (now - r->health.owner_bad_since < IDEM_OWNER_GRACE_MS)
		return;
	r->stats.valkey_not_servers++;
	idemc_gate_rest(r->gate, idemc_gate_retry_ms(r->gate));
	snprintf(why, sizeof(why),
			 "Valkey at %s is not the server's: its epoch owner key %s has %s, not the token idem_cache_secrets() names, for %lld ms (point the runner at the Valkey the server's worker writes to, idem.valkey_host and idem.valkey_port; or that worker cannot reach it)",
			 idemc_gate_endpoint(r->gate), r->trust.owner_key,
			 checked == GATE_CHECK_OTHER ? "another value" : "no value",
			 (long long) (now - r->health.owner_bad_since));
	tell(r, VALKEY_NOT_SERVERS, why);
}
