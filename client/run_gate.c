/*
 * run_gate.c
 *	  Step 2 of a run (runner.c): the Valkey gate, one SET NX PX GET, and
 *	  the run's marker (released by compare-and-delete, or left for the
 *	  worker's copy to overwrite).
 */
#include "run.h"

#include <stdlib.h>
#include <string.h>

void
idemc_run_release_marker(run_state *s)
{
	if (s->own_marker)
		idemc_gate_release(s->r->gate, s->ckey, s->marker);
	s->own_marker = 0;
}

/*
 * A terminal row is committed (ours, or one the claim read): the worker
 * overwrites our marker with its copy once the commit is durable (the
 * claim queued a copy of a row it read), so no compare-and-delete round
 * trip.  A duplicate that meets the marker meanwhile reads the row in
 * PostgreSQL (idem_lookup) instead of answering busy; if the copy is lost
 * (a full queue, Valkey restarted) the marker ends with its lease.
 */
void
idemc_run_leave_marker(run_state *s)
{
	s->own_marker = 0;
}

/*
 * Before the gate: its key and our marker.  1 if the gate is to be sent;
 * 0 if it is skipped (counted; valkey_silent set if Valkey rests).
 */
static int
gate_prepare(run_state *s)
{
	uint8_t		token[IDEM_TOKEN_LEN];

	if (s->r->gate == NULL)
	{
		s->r->stats.valkey_skipped++;
		return 0;
	}
	if (idemc_gate_resting(s->r->gate))
	{
		s->r->stats.valkey_skipped++;
		s->valkey_silent = 1;
		return 0;
	}
	if (!idemc_runner_trust_ready(s->r) ||
		idem_cache_key(s->ckey, sizeof(s->ckey), s->r->trust.keyspace,
					   s->is_platform, s->tenant_id, s->key) < 0)
	{
		s->r->stats.valkey_skipped++;
		return 0;
	}
	idemc_run_token(s->r, token);
	if (idemc_trust_marker(&s->r->trust, s->ckey, s->r->lease_ms, token,
						  s->marker, sizeof(s->marker)) < 0)
	{
		s->r->stats.valkey_skipped++;
		return 0;
	}
	return 1;
}

/* The gate's answer: counted towards IDEM_NEW_KEYS_NO_GATE_AFTER. */
static void
gate_streak(run_state *s, const gate_reply *g)
{
	if (g->answer == GATE_ACQUIRED)
	{
		if (s->r->gate_new_streak < IDEM_NEW_KEYS_NO_GATE_AFTER)
			s->r->gate_new_streak++;
	}
	else
		s->r->gate_new_streak = 0;
}

/* Step 2.  Returns 1 if the gate decided the run. */
int
idemc_run_gate(run_state *s)
{
	gate_reply	g;
	IdemCacheEntry e;
	int			decided = 0;

	if (!gate_prepare(s))
		return 0;
	idemc_gate_enter(s->r->gate, s->ckey, s->marker, s->r->lease_ms_txt,
					s->r->trust.owner_key, s->r->trust.owner_token, &g);
	gate_streak(s, &g);
	idemc_health_owner(s->r, g.checked);
	if (g.answer == GATE_VALUE && g.checked != GATE_CHECK_HOLDS)
	{
		/*
		 * The epoch's owner key did not hold the token the server gave (a
		 * newer epoch retired it, or that node did not answer): the value
		 * may be of a history this server does not hold.  PostgreSQL
		 * decides, as if Valkey were silent (a lookup first); the runner
		 * learns again before it uses the cache.  A marker we set in that
		 * keyspace is ours all the same (below), and released as usual.
		 */
		idemc_trust_owner_mismatch(&s->r->trust, g.checked);
		s->r->stats.valkey_skipped++;
		s->valkey_silent = 1;
		free(g.value);
		return 0;
	}
	if (g.answer == GATE_ACQUIRED && g.checked != GATE_CHECK_HOLDS)
		idemc_trust_owner_mismatch(&s->r->trust, g.checked);
	else if (g.checked == GATE_CHECK_HOLDS)
		idemc_trust_owner_ok(&s->r->trust);
	switch (g.answer)
	{
		case GATE_SKIPPED:
		case GATE_ABSENT:		/* not an answer of the gate */
			s->r->stats.valkey_skipped++;
			s->valkey_silent = 1;
			break;
		case GATE_ACQUIRED:
			s->own_marker = 1;
			s->out->valkey_used = 1;
			break;
		case GATE_VALUE:
			s->out->valkey_used = 1;
			if (idemc_trust_check(&s->r->trust, s->ckey, g.value, g.value_len,
								 s->r->lease_ms, &e) != TRUST_VALUE_OK)
				break;			/* not trusted: PostgreSQL decides */
			if (e.kind == IDEM_CACHE_MARKER)
			{
				long long	left = e.expires_ms - idemc_wall_ms();

				/*
				 * Its age: the marker carries its deadline, set by a
				 * runner with (normally) our lease.  One made with a longer
				 * lease looks younger (idemc_trust_check refused it if more
				 * than 1 s longer), a shorter one older: PostgreSQL is
				 * asked sooner, which costs time, never correctness.
				 */
				if ((long long) s->r->lease_ms - left >= IDEM_MARKER_CHEAP_MS)
				{
					s->marker_old = 1;
					break;		/* PostgreSQL decides */
				}

				/*
				 * Busy until the deadline in its MACed content, which
				 * idemc_trust_check bounded by our own lease (+ 1 s of
				 * skew); Valkey's TTL of the key is not consulted, so a
				 * marker planted with a longer TTL is busy no longer.
				 */
				s->out->status = IDEM_BUSY;
				s->out->source = IDEM_SOURCE_VALKEY;
				s->out->retry_after_ms = (long) (left > 0 ? left : 1);
				s->marker_busy = 1;
				decided = 1;
				break;
			}
			/*
			 * The MAC says the server wrote it: jsonb text of an object of
			 * at most IDEM_OUTCOME_MAX bytes (the parser checked its
			 * braces and length), so it is not parsed again here.
			 */
			if (memcmp(e.fingerprint, s->fp, IDEM_DIGEST_LEN) != 0)
			{
				s->mismatch_hint = 1;	/* PostgreSQL confirms */
				break;
			}
			idemc_result_from_cache(s->out, &e);
			decided = 1;
			break;
	}
	free(g.value);
	return decided;
}
