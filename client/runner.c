/*
 * runner.c
 *	  The gated idempotency runner: one run, step by step (the Valkey
 *	  gate, then PostgreSQL's claim, the handler and the completion), in
 *	  the order below; each step's code is in a file of its own (run.h:
 *	  run_gate.c, run_pg.c, run_effect.c, with run_result.c and
 *	  run_token.c).  Opening and closing a runner is in lifecycle.c, what
 *	  the handler sees of its run and the names of the results in call.c,
 *	  the read-only lookups (idem_cached) in cached.c.
 *
 *	  1. key = idem_key(scope, id); fingerprint of the canonical request.
 *	  2. Valkey, one round trip (SET NX PX GET, and a GET of the epoch's
 *		 owner key: a value counts only if it holds the token the server
 *		 gave), in the keyspace the server gave (trust.c; learnt on each
 *		 new connection): a terminal value
 *		 whose MAC verifies, with our fingerprint, is a replay (no
 *		 PostgreSQL at all); another fingerprint is only a hint, which
 *		 PostgreSQL confirms (3a or 3b); an authentic marker within our own
 *		 lease and younger than IDEM_MARKER_CHEAP_MS is busy (unless
 *		 idem_lookup finds its run committed: a replay or mismatch), an
 *		 older one is the claim's to judge (3b: its run may be dead);
 *		 anything else is ignored (counted); absent: our
 *		 MACed marker is set, in the same command.  Valkey down or slow: skip
 *		 the gate (for retry_ms after a failure, without trying).
 *	  3a. Valkey configured but silent, or a mismatch hint (lookup_first):
 *		 one autocommit idem_lookup; a completed or failed_permanent row
 *		 answers a duplicate (replay or mismatch) with no transaction.
 *	  3b. PostgreSQL, round trip 1 (pipeline): BEGIN; idem_claim; SAVEPOINT.
 *		 claimed: the handler runs on the open transaction; then round trip
 *		 2 (pipeline): RELEASE SAVEPOINT (or ROLLBACK TO SAVEPOINT);
 *		 idem_complete (or idem_fail); expires_at of the row; COMMIT.
 *		 Another decision: round trip 2 is COMMIT alone.
 *	  4. The client writes no terminal value: the server's worker copies
 *		 results (and terminal rows that a claim or lookup read) once their
 *		 commit is durable.  A run that ends with a terminal row leaves its
 *		 marker for that copy to overwrite (no round trip after COMMIT); a
 *		 duplicate meeting it reads the row (idem_lookup) instead of
 *		 answering busy.  Any other run removes its marker by
 *		 compare-and-delete on its token.
 *
 *	  New keys in a row: after IDEM_NEW_KEYS_NO_GATE_AFTER gates in a row
 *	  that set their marker, a run of unknown delivery count skips step 2,
 *	  as a first delivery does: no Valkey round trip, no marker, the claim
 *	  decides.  The first claim that does not take its key (a duplicate:
 *	  replay, busy or mismatch from PostgreSQL) ends the stretch, and the
 *	  next runs go through the gate first again.
 *
 *	  Per-run options (idem_run_with): delivery_count 1 skips step 2 (the
 *	  claim guards a wrongly flagged duplicate); a redelivery (2 or more)
 *	  goes through the gate like an unknown count: SET NX GET answers a
 *	  stored result as a GET would, without writing; sql_handler makes
 *	  step 3b one idem_apply statement.
 *
 *	  Honesty: once COMMIT is sent, any failure is "commit unknown" unless
 *	  the answer proves a rollback (proves_rollback);
 *	  a handler that ends the runner's transaction fails the run with
 *	  IDEM_ERR_HANDLER_ENDED_TX (its effect may have committed without the
 *	  key).
 */
#include "run.h"

#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

void
idem_run_options_init_size(idem_run_options *o, size_t size)
{
	idemc_struct_init(o, size, IDEM_RUN_OPTIONS_SIZE_MIN, NULL, 0);
}

/* The function of the headers that passed no size: the first layout. */
void
(idem_run_options_init) (idem_run_options *o)
{
	idem_run_options_init_size(o, IDEM_RUN_OPTIONS_SIZE_MIN);
}

static idem_status run_full(idem_runner *r, int is_platform, int64_t tenant_id,
							const char *scope, const char *id,
							const char *request_json,
							const idem_run_options *ro,
							idem_handler_fn handler, void *user_data,
							idem_result *out);

/*
 * A run into the caller's result: directly when it has our size, else
 * through a full one copied back within the caller's size.
 */
static idem_status
run(idem_runner *r, int is_platform, int64_t tenant_id, const char *scope,
	const char *id, const char *request_json, const idem_run_options *ro,
	idem_handler_fn handler, void *user_data, idem_result *out)
{
	idem_result full;
	idem_status st;

	if (out == NULL || idemc_result_size_ok(r, out) != 0)
		return IDEM_ERROR;
	if (out->struct_size == sizeof(idem_result))
		return run_full(r, is_platform, tenant_id, scope, id, request_json,
						ro, handler, user_data, out);
	idem_result_init(&full);
	st = run_full(r, is_platform, tenant_id, scope, id, request_json, ro,
				  handler, user_data, &full);
	idemc_result_copy_out(out, &full);
	return st;
}

static idem_status
run_full(idem_runner *r, int is_platform, int64_t tenant_id, const char *scope,
		 const char *id, const char *request_json, const idem_run_options *ro,
		 idem_handler_fn handler, void *user_data, idem_result *out)
{
	run_state	s;
	idem_run_options ro_full;
	char		err[200];
	idem_status st;

	idem_result_init(out);
	memset(&s, 0, sizeof(s));
	s.r = r;
	s.out = out;
	s.is_platform = is_platform;
	s.tenant_id = tenant_id;
	out->status = IDEM_ERROR;
	if (r == NULL)
	{
		out->error_code = IDEM_ERR_ARGUMENT;
		snprintf(out->error_message, sizeof(out->error_message),
				 "runner is NULL");
		return IDEM_ERROR;
	}
	r->stats.runs++;
	if (r->broken)
	{
		char		m[sizeof(r->errmsg)];

		/* the options' message stays: every run repeats it */
		snprintf(m, sizeof(m), "%s", r->errmsg);
		idemc_run_error(&s, IDEM_ERR_ARGUMENT, NULL,
					 "invalid runner options: %s", m);
		snprintf(r->errmsg, sizeof(r->errmsg), "%s", m);
		return IDEM_ERROR;
	}
	r->errmsg[0] = '\0';
	if (ro != NULL &&
		!IDEM_STRUCT_SIZE_OK(ro->struct_size, IDEM_RUN_OPTIONS_SIZE_MIN))
		return idemc_run_error(&s, IDEM_ERR_ARGUMENT, NULL,
							"run options were not initialised by idem_run_options_init() (struct_size %zu, expected %zu to %d)",
							ro->struct_size, (size_t) IDEM_RUN_OPTIONS_SIZE_MIN,
							IDEM_STRUCT_SIZE_MAX);
	if (ro != NULL && ro->struct_size != sizeof(idem_run_options))
	{
		/* another layout: its fields, and defaults for those it lacks
		 * (first_sql before 0.3's last ones) */
		idem_run_options_init(&ro_full);
		memcpy(&ro_full, ro, IDEM_MIN_SIZE(ro->struct_size, sizeof(ro_full)));
		ro_full.struct_size = sizeof(ro_full);
		ro = &ro_full;
	}
	if (ro != NULL && ro->delivery_count < 0)
		return idemc_run_error(&s, IDEM_ERR_ARGUMENT, NULL,
							"delivery_count must be 0 (unknown) or positive, not %d",
							ro->delivery_count);
	if (handler == NULL && (ro == NULL || ro->sql_handler == NULL))
		return idemc_run_error(&s, IDEM_ERR_ARGUMENT, NULL, "handler is NULL");
	if (ro != NULL && ro->sql_handler != NULL && ro->sql_handler[0] == '\0')
		return idemc_run_error(&s, IDEM_ERR_ARGUMENT, NULL, "sql_handler is empty");
	if (ro != NULL && ro->first_sql != NULL &&
		(ro->sql_handler != NULL || ro->first_sql[0] == '\0' ||
		 ro->first_nparams < 0 || ro->first_nparams > 65535 ||
		 (ro->first_nparams > 0 && ro->first_params == NULL)))
		return idemc_run_error(&s, IDEM_ERR_ARGUMENT, NULL,
							"first_sql must be a non-empty statement for a C handler (not with sql_handler), with first_nparams (0 to 65535) text parameters in first_params");
	if (scope == NULL || id == NULL || idem_key(scope, id, s.key) != 0)
		return idemc_run_error(&s, IDEM_ERR_ARGUMENT, NULL,
							"task scope and id must be non-NULL valid UTF-8 strings");
	if (request_json == NULL)
		return idemc_run_error(&s, IDEM_ERR_ARGUMENT, NULL, "request_json is NULL");
	err[0] = '\0';
	s.request = idem_json_canonical(request_json, strlen(request_json),
									&s.request_len, err, sizeof(err));
	if (s.request == NULL)
		return idemc_run_error(&s, errno == ENOMEM ?
							IDEM_ERR_OUT_OF_MEMORY : IDEM_ERR_REQUEST_JSON,
							NULL, "request: %s", err);
	{
		idem_sha256 c;

		idem_sha256_init(&c);
		idem_sha256_update(&c, s.request, s.request_len);
		idem_sha256_final(&c, s.fp);
	}

	if (ro != NULL && ro->delivery_count == 1 && r->gate != NULL)
	{
		/*
		 * A first delivery: no run can have committed this key, so the gate
		 * could only answer "absent" (or busy for a concurrent duplicate,
		 * which the claim answers too).  The claim is the guard.
		 */
		r->stats.valkey_skipped++;
		r->stats.gate_skipped_first++;
		st = idemc_run_effect(&s, ro, scope, id, handler, user_data);
	}
	else if ((ro == NULL || ro->delivery_count == 0) && r->gate != NULL &&
			 r->gate_new_streak >= IDEM_NEW_KEYS_NO_GATE_AFTER)
	{
		/*
		 * New keys, run after run: no gate, as for a first delivery.  On a
		 * new key the gate would only set a marker; a duplicate is
		 * answered by the claim instead (replay, busy or mismatch, from
		 * PostgreSQL), and that answer ends the stretch: the runs after
		 * it go through the gate first again.
		 */
		r->stats.valkey_skipped++;
		st = idemc_run_effect(&s, ro, scope, id, handler, user_data);
		if (out->source == IDEM_SOURCE_POSTGRES)
			r->gate_new_streak = 0;
	}
	else if (idemc_run_gate(&s))
	{
		st = out->status;

		/*
		 * Another run's marker: that run may have committed a terminal
		 * row whose copy has not yet replaced its marker.  One autocommit
		 * idem_lookup answers that duplicate now; anything else stays
		 * busy.
		 */
		if (s.marker_busy && r->lookup_first && idemc_run_lookup(&s))
			st = out->status;
	}
	else if ((s.valkey_silent || s.mismatch_hint) && r->lookup_first &&
			 idemc_run_lookup(&s))
		st = out->status;
	else
	{
		/*
		 * An old marker (marker_old) goes straight to the claim: busy at
		 * once if its run is alive, the key if it died; a committed run's
		 * row is replayed by the claim as by idem_lookup.
		 */
		st = idemc_run_effect(&s, ro, scope, id, handler, user_data);
	}

	/* no terminal result was written: our marker goes (compare-and-delete) */
	if (s.own_marker)
		idemc_run_release_marker(&s);
	free(s.request);
	return st;
}

idem_status
idem_run(idem_runner *runner, int64_t tenant_id, const char *task_scope,
		 const char *id, const char *request_json, idem_handler_fn handler,
		 void *user_data, idem_result *out)
{
	return run(runner, 0, tenant_id, task_scope, id, request_json, NULL,
			   handler, user_data, out);
}

idem_status
idem_run_with(idem_runner *runner, int64_t tenant_id, const char *task_scope,
			  const char *id, const char *request_json,
			  const idem_run_options *run_opts, idem_handler_fn handler,
			  void *user_data, idem_result *out)
{
	return run(runner, 0, tenant_id, task_scope, id, request_json, run_opts,
			   handler, user_data, out);
}

idem_status
idem_run_platform_with(idem_runner *runner, const char *task_scope,
					   const char *id, const char *request_json,
					   const idem_run_options *run_opts,
					   idem_handler_fn handler, void *user_data,
					   idem_result *out)
{
	return run(runner, 1, 0, task_scope, id, request_json, run_opts, handler,
			   user_data, out);
}

idem_status
idem_run_platform(idem_runner *runner, const char *task_scope, const char *id,
				  const char *request_json, idem_handler_fn handler,
				  void *user_data, idem_result *out)
{
	return run(runner, 1, 0, task_scope, id, request_json, NULL, handler,
			   user_data, out);
}
