/*
 * run.h
 *	  One run of the runner, step by step (runner.c has the steps in order):
 *	  what the files of a run share, and nothing else of the library uses.
 *
 *	  run_result.c	the run's result and its errors
 *	  run_token.c	the token of the run's marker
 *	  run_gate.c	step 2: the Valkey gate, and the run's marker
 *	  run_pg.c		PostgreSQL's statements of a run and their answers;
 *					step 3a, the lookup
 *	  run_effect.c	step 3b: the claim, the handler (C or SQL), its
 *					completion and the COMMIT
 *	  emit.c		the handler's messages (idem_call_emit), sent with
 *					the completion
 */
#ifndef IDEM_CLIENT_RUN_H
#define IDEM_CLIENT_RUN_H

#include "internal.h"

/*
 * How long another run's marker answers its duplicates "busy" from Valkey
 * alone.  After that a duplicate asks PostgreSQL (the claim, which never
 * waits: busy at once if the key is really held), so that a runner that
 * died mid-handler (SIGKILL: PostgreSQL rolls its claim back at once) does
 * not keep its key busy in Valkey for the rest of its lease.  A live run's
 * duplicates within this first second stay cheap.
 */
#define IDEM_MARKER_CHEAP_MS 1000

/*
 * After this many gates in a row found the key absent (new keys), a run
 * whose delivery count is unknown goes without the gate, as a first
 * delivery does (run_full); the first claim that does not take its key (a
 * duplicate) ends the stretch.
 */
#define IDEM_NEW_KEYS_NO_GATE_AFTER 32

typedef struct run_state
{
	idem_runner *r;
	idem_result *out;
	int			is_platform;
	int64_t		tenant_id;
	uint8_t		key[IDEM_DIGEST_LEN];
	uint8_t		fp[IDEM_DIGEST_LEN];
	char	   *request;		/* canonical */
	size_t		request_len;
	char		ckey[IDEM_CACHE_KEY_MAX];
	char		marker[IDEM_CACHE_REST_OFFSET + 64];
	int			own_marker;
	int			valkey_silent;	/* Valkey is configured but gave no answer */
	int			mismatch_hint;	/* Valkey holds another fingerprint: only
								 * PostgreSQL may say "mismatch" */
	int			marker_busy;	/* the gate met another run's marker */
	int			marker_old;		/* ... older than IDEM_MARKER_CHEAP_MS:
								 * PostgreSQL decides */
	/* parameters as text */
	char		tenant_txt[24];	/* of PostgreSQL's statements: params_key */
} run_state;

/* run_result.c */
extern idem_status idemc_run_error(run_state *s, idem_error_code code,
								   const char *sqlstate, const char *fmt,...)
			__attribute__((format(printf, 4, 5)));

/* run_token.c */
extern void idemc_run_token(idem_runner *r, uint8_t tok[IDEM_TOKEN_LEN]);

/* run_gate.c */
extern void idemc_run_release_marker(run_state *s);
extern void idemc_run_leave_marker(run_state *s);
extern int	idemc_run_gate(run_state *s);

/* run_pg.c */
extern int	idemc_run_param_digest(pg_cmd *c, int i, const uint8_t *digest);
extern int	idemc_run_params_key(run_state *s, pg_cmd *c, pg_stmt tenant_stmt);
extern void idemc_run_params_claim(run_state *s, pg_cmd *c);
extern void idemc_run_params_finish(run_state *s, pg_cmd *c, int ok,
									int retryable, const char *json);
extern pg_cmd idemc_run_tx_cmd(run_state *s, pg_stmt stmt);
extern void idemc_run_rollback_quietly(run_state *s);
extern int	idemc_run_decision_row(PGresult *r, int nfields,
								   const char **decision, int *attempt,
								   long long *ms, const char **outcome);
extern idem_status idemc_run_pg_error(run_state *s, pg_outcome *o,
									  const char *what);
extern int	idemc_run_proves_rollback(const pg_outcome *o);
extern int	idemc_run_set_terminal(run_state *s, int completed,
								   const char *outcome);
extern int	idemc_run_lookup(run_state *s);
extern int	idemc_run_busy_or_mismatch(run_state *s, const char *decision,
									   long long ms);

/* run_effect.c */
extern idem_status idemc_run_effect(run_state *s, const idem_run_options *ro,
									const char *scope, const char *id,
									idem_handler_fn handler, void *user_data);

/* emit.c: the handler's messages as one command of the run's last
 * pipeline (the call has some) */
extern void idemc_emit_cmd(run_state *s, const idem_call *call, pg_cmd *c);

#endif
