/*
 * runner.c
 *	  The gated idempotency runner: one run, step by step (the Valkey
 *	  gate, then PostgreSQL's claim, the handler and the completion).  Opening and closing a runner is in lifecycle.c, what the
 *	  handler sees of its run and the names of the results in call.c, the
 *	  read-only lookups (idem_cached) in cached.c.
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
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <unistd.h>
#include <sys/random.h>


/* ---- one run ---- */

/*
 * How long another run's marker answers its duplicates "busy" from Valkey
 * alone.  After that a duplicate asks PostgreSQL (the claim, which never
 * waits: busy at once if the key is really held), so that a runner that
 * died mid-handler (SIGKILL: PostgreSQL rolls its claim back at once) does
 * not keep its key busy in Valkey for the rest of its lease.  A live run's
 * duplicates within this first second stay cheap.
 */
#define IDEM_MARKER_CHEAP_MS 1000

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

static idem_status
finish_error(run_state *s, idem_error_code code, const char *sqlstate,
			 const char *fmt,...) __attribute__((format(printf, 4, 5)));

static idem_status
finish_error(run_state *s, idem_error_code code, const char *sqlstate,
			 const char *fmt,...)
{
	va_list		ap;
	char	   *p;

	s->out->status = IDEM_ERROR;
	s->out->error_code = code;
	snprintf(s->out->sqlstate, sizeof(s->out->sqlstate), "%s",
			 sqlstate ? sqlstate : "");
	va_start(ap, fmt);
	vsnprintf(s->out->error_message, sizeof(s->out->error_message), fmt, ap);
	va_end(ap);
	/* one line: libpq's messages carry newlines and tabs */
	for (p = s->out->error_message; *p; p++)
		if ((unsigned char) *p < ' ')
			*p = ' ';
	snprintf(s->r->errmsg, sizeof(s->r->errmsg), "%s", s->out->error_message);
	s->out->outcome[0] = '\0';
	s->out->outcome_len = 0;
	return IDEM_ERROR;
}

void
idemc_result_set_outcome(idem_result *out, const char *text, size_t len)
{
	if (len > IDEM_OUTCOME_MAX_BYTES)
		len = IDEM_OUTCOME_MAX_BYTES;	/* cannot happen: checked before */
	memcpy(out->outcome, text, len);
	out->outcome[len] = '\0';
	out->outcome_len = len;
}

/* A trusted terminal value in Valkey (completed or failed_permanent) as
 * the run's result. */
void
idemc_result_from_cache(idem_result *out, const IdemCacheEntry *e)
{
	out->valkey_used = 1;
	out->source = IDEM_SOURCE_VALKEY;
	out->status = e->kind == IDEM_CACHE_COMPLETED ?
		IDEM_REPLAYED : IDEM_FAILED_PERMANENT;
	out->attempt = e->attempt;
	idemc_result_set_outcome(out, e->outcome, e->outcome_len);
}

/* Forks since the library was loaded, + 1: a child draws a new token base. */
static volatile uint64_t fork_gen = 1;
static pthread_once_t fork_hook_once = PTHREAD_ONCE_INIT;

static void
fork_child(void)
{
	fork_gen++;
}

static void
fork_hook(void)
{
	(void) pthread_atfork(NULL, NULL, fork_child);
}

/* 16 random bytes; never fails. */
static void
random_bytes(idem_runner *r, uint8_t tok[IDEM_TOKEN_LEN])
{
	ssize_t		got = getrandom(tok, IDEM_TOKEN_LEN, GRND_NONBLOCK);

	if (got != IDEM_TOKEN_LEN)
	{
		int			fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);

		got = fd >= 0 ? read(fd, tok, IDEM_TOKEN_LEN) : -1;
		if (fd >= 0)
			close(fd);
	}
	if (got != IDEM_TOKEN_LEN)
	{
		/* last resort: unique per runner and process, still unguessable
		 * enough for a compare-and-delete token */
		idem_sha256 c;
		uint8_t		d[32];
		struct
		{
			int64_t		t;
			int64_t		wall;
			pid_t		pid;
			const void *self;
		}			seed;

		seed.t = idemc_now_ms();
		seed.wall = idemc_wall_ms();
		seed.pid = getpid();
		seed.self = r;
		idem_sha256_init(&c);
		idem_sha256_update(&c, &seed, sizeof(seed));
		idem_sha256_final(&c, d);
		memcpy(tok, d, IDEM_TOKEN_LEN);
	}
}

/*
 * The marker's token: unique among the runs of all runners (what the
 * compare-and-delete needs).  A random base, drawn once per runner (and
 * again in a forked child), with the run's counter in its last 8 bytes: no
 * system call per run.
 */
static void
random_token(idem_runner *r, uint8_t tok[IDEM_TOKEN_LEN])
{
	uint64_t	n;
	int			i;

	if (r->token_fork_gen != fork_gen)
	{
		(void) pthread_once(&fork_hook_once, fork_hook);
		random_bytes(r, r->token_base);
		r->token_counter = 0;
		r->token_fork_gen = fork_gen;
	}
	n = ++r->token_counter;
	memcpy(tok, r->token_base, IDEM_TOKEN_LEN);
	for (i = 0; i < 8; i++)
		tok[IDEM_TOKEN_LEN - 1 - i] ^= (uint8_t) (n >> (8 * i));
}

static void
release_marker(run_state *s)
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
static void
leave_marker(run_state *s)
{
	s->own_marker = 0;
}

/* Step 2.  Returns 1 if the gate decided the run. */
static int
gate_step(run_state *s)
{
	gate_reply	g;
	IdemCacheEntry e;
	uint8_t		token[IDEM_TOKEN_LEN];
	int			decided = 0;

	if (s->r->gate == NULL)
	{
		s->r->stats.valkey_skipped++;
		return 0;
	}
	if (idemc_gate_resting(s->r->gate))
	{
		s->r->stats.valkey_skipped++;
		s->valkey_silent = 1;
		idemc_runner_gate_notice(s->r);
		return 0;
	}
	if (!idemc_runner_trust_ready(s->r) ||
		idem_cache_key(s->ckey, sizeof(s->ckey), s->r->trust.keyspace,
					   s->is_platform, s->tenant_id, s->key) < 0)
	{
		s->r->stats.valkey_skipped++;
		return 0;
	}
	random_token(s->r, token);
	if (idemc_trust_marker(&s->r->trust, s->ckey, s->r->lease_ms, token,
						  s->marker, sizeof(s->marker)) < 0)
	{
		s->r->stats.valkey_skipped++;
		return 0;
	}
	idemc_gate_enter(s->r->gate, s->ckey, s->marker, s->r->lease_ms_txt,
					s->r->trust.owner_key, s->r->trust.owner_token, &g);
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

static int
param_digest(pg_cmd *c, int i, const uint8_t *digest)
{
	c->values[i] = (const char *) digest;
	c->lengths[i] = IDEM_DIGEST_LEN;
	c->formats[i] = 1;
	return i + 1;
}

/*
 * Start the parameters of a statement of the API: its tenant or platform
 * twin (the pg_stmt after it), then [tenant,] key.  Returns the next index.
 */
static int
params_key(run_state *s, pg_cmd *c, pg_stmt tenant_stmt)
{
	int			i = 0;

	memset(c, 0, sizeof(*c));
	c->sql = s->r->pg.sql[tenant_stmt + (s->is_platform ? 1 : 0)];
	if (!s->is_platform)
	{
		if (s->tenant_txt[0] == '\0')
			snprintf(s->tenant_txt, sizeof(s->tenant_txt), "%lld",
					 (long long) s->tenant_id);
		c->values[i++] = s->tenant_txt;
	}
	return param_digest(c, i, s->key);
}

static void
params_claim(run_state *s, pg_cmd *c)
{
	int			i = params_key(s, c, STMT_CLAIM_T);

	i = param_digest(c, i, s->fp);
	c->values[i++] = s->r->lease_txt;
	c->nparams = i;
}

static void
params_finish(run_state *s, pg_cmd *c, int ok, int retryable,
			  const char *json)
{
	int			i = params_key(s, c, ok ? STMT_COMPLETE_T : STMT_FAIL_T);

	c->values[i++] = json;
	if (!ok)
		c->values[i++] = retryable ? "true" : "false";
	c->values[i++] = s->r->retention_txt[0] ? s->r->retention_txt : NULL;
	c->nparams = i;
}

static void
params_lookup(run_state *s, pg_cmd *c)
{
	c->nparams = param_digest(c, params_key(s, c, STMT_LOOKUP_T), s->fp);
}

/* A statement of the runner's transaction control (no parameters). */
static pg_cmd
tx_cmd(run_state *s, pg_stmt stmt)
{
	pg_cmd		c;

	memset(&c, 0, sizeof(c));
	c.sql = s->r->pg.sql[stmt];
	return c;
}

/* End the transaction after an error; the connection may be gone. */
static void
rollback_quietly(run_state *s)
{
	PGconn	   *conn = s->r->pg.conn;

	if (conn && PQstatus(conn) == CONNECTION_OK &&
		PQtransactionStatus(conn) != PQTRANS_IDLE)
	{
		if (idemc_pg_exec(&s->r->pg, "ROLLBACK") != 0)
			idemc_pg_drop(&s->r->pg);
	}
}

static long long
int_value(PGresult *r, int col, long long dflt)
{
	if (r == NULL || PQresultStatus(r) != PGRES_TUPLES_OK ||
		PQntuples(r) < 1 || PQnfields(r) <= col || PQgetisnull(r, 0, col))
		return dflt;
	return strtoll(PQgetvalue(r, 0, col), NULL, 10);
}

/*
 * The row of a decision (idem_claim's, idem_apply's): decision, attempt,
 * outcome, retry_after_ms first, NFIELDS columns in all.  0, or -1 when
 * the row is not that shape.
 */
static int
decision_row(PGresult *r, int nfields, const char **decision, int *attempt,
			 long long *ms, const char **outcome)
{
	if (PQntuples(r) != 1 || PQnfields(r) != nfields || PQgetisnull(r, 0, 0))
		return -1;
	*decision = PQgetvalue(r, 0, 0);
	*attempt = (int) int_value(r, 1, 0);
	*ms = int_value(r, 3, 0);
	*outcome = PQgetisnull(r, 0, 2) ? "" : PQgetvalue(r, 0, 2);
	return 0;
}

static idem_status
pg_error(run_state *s, pg_outcome *o, const char *what)
{
	idem_error_code code = o->rc == PG_CONN_LOST ? IDEM_ERR_CONNECTION :
		IDEM_ERR_SERVER;
	idem_status st = finish_error(s, code, o->sqlstate, "%s: %s", what,
								  o->message[0] ? o->message : "failed");

	idemc_pg_outcome_clear(o);
	return st;
}

/*
 * Whether the error that answered a pipeline ending in COMMIT (or the one
 * autocommit idem_apply) proves that its transaction rolled back, even if
 * the connection was lost after it.  Once the COMMIT has left the runner,
 * nothing else is definite: a lost connection, a FATAL, or an error that a
 * pooler made up (pgbouncer answers a query whose server connection died
 * with its own 08P01 and closes, in any position of the pipeline, and the
 * server may have committed before it died) all leave "commit unknown".
 *
 * Definite are only ERRORs (not FATAL or PANIC) that PostgreSQL raises in a
 * transaction that then cannot commit, and that no pooler makes up:
 *	 22xxx data exception (our outcome or an argument refused), 42xxx a
 *	 statement refused (a privilege, a missing function), 54xxx a program
 *	 limit, 55xxx object not in prerequisite state, P0xxx raised by
 *	 PL/pgSQL (idem_complete refusing), 26000 a prepared statement the
 *	 handler deallocated, 3B001 a savepoint the handler removed, 25P02 a
 *	 statement in a transaction already failed: a statement before COMMIT
 *	 failed, so the transaction is aborted and its COMMIT only rolls back;
 *	 23xxx an integrity constraint (a deferred one checked at COMMIT), 40xxx
 *	 transaction rollback (serialization failure, deadlock, also at COMMIT),
 *	 but not 40003 statement_completion_unknown, which says the opposite.
 * A COMMIT that fails with an ERROR has rolled back: what fails after the
 * commit record is written is a PANIC.
 */
static int
proves_rollback(const pg_outcome *o)
{
	static const char *const classes[] = {"22", "23", "40", "42", "54", "55",
	"P0"};
	static const char *const states[] = {"25P02", "26000", "3B001"};
	size_t		i;

	if (strcmp(o->severity, "ERROR") != 0 || strlen(o->sqlstate) != 5 ||
		strcmp(o->sqlstate, "40003") == 0)
		return 0;
	for (i = 0; i < sizeof(classes) / sizeof(classes[0]); i++)
		if (strncmp(o->sqlstate, classes[i], 2) == 0)
			return 1;
	for (i = 0; i < sizeof(states) / sizeof(states[0]); i++)
		if (strcmp(o->sqlstate, states[i]) == 0)
			return 1;
	return 0;
}

/*
 * The handler ended the runner's transaction (COMMIT, ROLLBACK, COMMIT;
 * BEGIN, or released the runner's savepoint).  What it committed, if
 * anything, committed without the key being completed: the claim may
 * stand as processing until its lease ends, and a redelivery then runs the
 * handler again.  The run fails, and says so.
 */
static idem_status
handler_ended_tx(run_state *s)
{
	return finish_error(s, IDEM_ERR_HANDLER_ENDED_TX, NULL,
						"the handler ended the runner's transaction (COMMIT, ROLLBACK or COMMIT; BEGIN) or released its savepoint: its effect may have committed without its idempotency key, and a redelivery after the lease may run it again");
}

/* The handler ran and said hs; finish the transaction.  The savepoint is
 * there, the claim is ours. */
static idem_status
finish_claimed(run_state *s, idem_handler_status hs, idem_call *call,
			   int attempt)
{
	idem_pg    *pg = &s->r->pg;
	PGconn	   *conn = pg->conn;
	PGTransactionStatusType ts;
	const char *json = call->json ? call->json : "{}";
	char	   *canon;
	size_t		clen;
	char		err[200];
	pg_cmd		cmds[3];
	pg_outcome	o;

	if (hs != IDEM_HANDLER_OK && hs != IDEM_HANDLER_RETRYABLE &&
		hs != IDEM_HANDLER_PERMANENT)
	{
		rollback_quietly(s);
		return finish_error(s, IDEM_ERR_HANDLER, NULL,
							"handler returned an unknown status %d; rolled back",
							(int) hs);
	}
	if (PQstatus(conn) != CONNECTION_OK)
	{
		idemc_pg_drop(pg);
		return finish_error(s, IDEM_ERR_CONNECTION, NULL,
							"connection to PostgreSQL lost during the handler; nothing was committed");
	}
	if (PQpipelineStatus(conn) != PQ_PIPELINE_OFF)
	{
		idemc_pg_drop(pg);		/* the safest way out of an unknown state */
		return finish_error(s, IDEM_ERR_HANDLER, NULL,
							"handler left the connection in pipeline mode; the transaction was abandoned (rolled back by the server)");
	}
	{
		PGresult   *pending;

		while ((pending = PQgetResult(conn)) != NULL)
			PQclear(pending);
	}
	/*
	 * The server may have ended the session while the handler ran
	 * (pg_terminate_backend, a restart): its FATAL, or the end of the
	 * stream, is waiting to be read.  Seen now, before COMMIT is sent, it
	 * is a definite "nothing was committed"; after, it could not be told
	 * from a COMMIT that was cut off.  No round trip: one poll().
	 */
	if (!idemc_pg_alive(pg))
	{
		idemc_pg_drop(pg);
		return finish_error(s, IDEM_ERR_CONNECTION, NULL,
							"connection to PostgreSQL lost during the handler; nothing was committed");
	}
	ts = PQtransactionStatus(conn);
	if (ts == PQTRANS_IDLE)
		return handler_ended_tx(s);
	if (ts != PQTRANS_INTRANS && ts != PQTRANS_INERROR)
	{
		idemc_pg_drop(pg);
		return finish_error(s, IDEM_ERR_HANDLER, NULL,
							"connection in an unexpected state after the handler");
	}
	if (ts == PQTRANS_INERROR && hs == IDEM_HANDLER_OK)
	{
		rollback_quietly(s);
		return finish_error(s, IDEM_ERR_HANDLER, NULL,
							"handler returned success, but a statement of its transaction failed; rolled back");
	}
	if (call->oom)
	{
		rollback_quietly(s);
		return finish_error(s, IDEM_ERR_OUT_OF_MEMORY, NULL,
							"out of memory storing the handler's result; rolled back");
	}
	err[0] = '\0';
	canon = idem_json_canonical(json, strlen(json), &clen, err, sizeof(err));
	if (canon == NULL || canon[0] != '{' || clen > IDEM_OUTCOME_MAX)
	{
		const char *what = hs == IDEM_HANDLER_OK ? "outcome" : "failure detail";

		rollback_quietly(s);
		if (canon == NULL)
			finish_error(s, IDEM_ERR_OUTCOME, NULL,
						 "handler %s is not valid JSON (%s); rolled back, nothing committed",
						 what, err);
		else if (canon[0] != '{')
			finish_error(s, IDEM_ERR_OUTCOME, NULL,
						 "handler %s must be a JSON object; rolled back, nothing committed",
						 what);
		else
			finish_error(s, IDEM_ERR_OUTCOME, NULL,
						 "handler %s is %zu bytes as jsonb text, over the limit of %d; rolled back, nothing committed",
						 what, clen, IDEM_OUTCOME_MAX);
		free(canon);
		return IDEM_ERROR;
	}

	/* round trip 2: savepoint, record, COMMIT */
	cmds[0] = tx_cmd(s, hs == IDEM_HANDLER_OK ?
					 STMT_RELEASE : STMT_ROLLBACK_TO);
	params_finish(s, &cmds[1], hs == IDEM_HANDLER_OK,
				  hs == IDEM_HANDLER_RETRYABLE, canon);
	cmds[2] = tx_cmd(s, STMT_COMMIT);
	idemc_pg_pipeline(pg, cmds, 3, &o);

	/*
	 * A COMMIT whose result arrived has committed, even if the connection
	 * dropped before the pipeline's Sync: that is not "unknown".  A
	 * pipeline that ran to its Sync on a live connection answered for
	 * itself: the COMMIT failed or was skipped after an error, nothing
	 * committed.  Once the COMMIT was handed to the connection, a lost
	 * connection is "unknown" whatever arrived before, unless it was an
	 * error that proves a rollback (proves_rollback): a pooler answers
	 * with an error of its own when the server connection dies under a
	 * COMMIT that may have committed.
	 */
	if (!(o.completed == 3 && o.res[2] &&
		  strcmp(PQcmdStatus(o.res[2]), "COMMIT") == 0))
	{
		idem_status st;
		int			definite = o.rc != PG_CONN_LOST || o.queued < 3 ||
			proves_rollback(&o);

		if (!definite)
			st = finish_error(s, IDEM_ERR_COMMIT_UNKNOWN, o.sqlstate,
							  "connection to PostgreSQL lost after COMMIT was sent; whether it committed is unknown (redeliver: the ledger decides): %s",
							  o.message);
		else if (strcmp(o.sqlstate, "3B001") == 0)
		{
			/* our savepoint is gone: the handler ended our transaction
			 * (COMMIT; BEGIN) or released the savepoint */
			rollback_quietly(s);
			idemc_pg_outcome_clear(&o);
			free(canon);
			return handler_ended_tx(s);
		}
		else if (o.rc == PG_CONN_LOST && o.queued < 3)
			st = finish_error(s, IDEM_ERR_CONNECTION, o.sqlstate,
							  "connection to PostgreSQL lost before COMMIT was sent; nothing was committed: %s",
							  o.message);
		else if (o.rc == PG_CONN_LOST)
			st = finish_error(s, IDEM_ERR_SERVER, o.sqlstate,
							  "PostgreSQL refused a statement before COMMIT (rolled back, nothing committed), then the connection was lost: %s",
							  o.message);
		else
		{
			rollback_quietly(s);
			st = finish_error(s, IDEM_ERR_SERVER, o.sqlstate,
							  "%s failed; rolled back, nothing committed: %s",
							  o.failed_cmd == 1 ?
							  (hs == IDEM_HANDLER_OK ? "idem_complete" : "idem_fail") :
							  o.failed_cmd == 0 ? "savepoint" : "commit",
							  o.message[0] ? o.message : "COMMIT did not commit");
		}
		idemc_pg_outcome_clear(&o);
		free(canon);
		return st;
	}
	idemc_pg_outcome_clear(&o);

	s->out->source = IDEM_SOURCE_HANDLER;
	s->out->attempt = attempt;
	idemc_result_set_outcome(s->out, canon, clen);
	switch (hs)
	{
		case IDEM_HANDLER_OK:
			s->out->status = IDEM_APPLIED;
			leave_marker(s);
			break;
		case IDEM_HANDLER_PERMANENT:
			s->out->status = IDEM_FAILED_PERMANENT;
			leave_marker(s);
			break;
		case IDEM_HANDLER_RETRYABLE:
			/* no terminal value follows: the next delivery must not
			 * meet our marker */
			s->out->status = IDEM_FAILED_RETRYABLE;
			release_marker(s);
			break;
	}
	free(canon);
	return s->out->status;
}

/*
 * A completed or failed_permanent answer read from PostgreSQL (the caller
 * has set source and attempt): 0, or -1 (nothing set) when the outcome is
 * not a JSON object of at most IDEM_OUTCOME_MAX bytes.
 */
static int
set_terminal(run_state *s, int completed, const char *outcome)
{
	size_t		len = strlen(outcome);

	if (len > IDEM_OUTCOME_MAX || outcome[0] != '{')
		return -1;
	s->out->status = completed ? IDEM_REPLAYED : IDEM_FAILED_PERMANENT;
	idemc_result_set_outcome(s->out, outcome, len);
	return 0;
}

/*
 * Step 3a, when Valkey is configured but gave no answer: read the row with
 * idem_lookup, one statement outside any transaction.  A completed or
 * failed_permanent row is final (only a purge removes it), so it answers
 * a duplicate as the claim would: replay, or mismatch for another
 * fingerprint.  Returns 1 when that decided the run; 0 (nothing changed)
 * for anything else, which the claim then decides.
 */
static int
lookup_step(run_state *s)
{
	idem_pg    *pg = &s->r->pg;
	pg_cmd		cmd;
	pg_outcome	o;
	int			fresh;
	int			decided = 0;
	char		msg[400];

	if (idemc_pg_ensure(pg, &fresh, msg, sizeof(msg)) != 0 ||
		PQtransactionStatus(pg->conn) != PQTRANS_IDLE)
		return 0;				/* the claim reports or cleans up */
	params_lookup(s, &cmd);
	idemc_pg_pipeline(pg, &cmd, 1, &o);
	if (o.rc == PG_SERVER_ERROR &&
		(strcmp(o.sqlstate, "42501") == 0 || strcmp(o.sqlstate, "42883") == 0))
		s->r->lookup_first = 0; /* not granted (or absent): claim from now on */
	if (o.rc == PG_OK && PQntuples(o.res[0]) == 1 && PQnfields(o.res[0]) == 5 &&
		!PQgetisnull(o.res[0], 0, 0) && !PQgetisnull(o.res[0], 0, 3))
	{
		const char *status = PQgetvalue(o.res[0], 0, 0);
		int			same = PQgetvalue(o.res[0], 0, 3)[0] == 't';
		int			attempt = (int) int_value(o.res[0], 1, 0);
		const char *outcome = PQgetisnull(o.res[0], 0, 2) ? "" :
			PQgetvalue(o.res[0], 0, 2);
		int			completed = strcmp(status, "completed") == 0;

		if (completed || strcmp(status, "failed_permanent") == 0)
		{
			s->out->source = IDEM_SOURCE_POSTGRES;
			s->out->attempt = attempt;
			if (!same)
			{
				s->out->status = IDEM_MISMATCH;
				decided = 1;
			}
			else if (set_terminal(s, completed, outcome) == 0)
				decided = 1;
		}
	}
	idemc_pg_outcome_clear(&o);
	return decided;
}

/*
 * The decisions of idem_claim and idem_apply that leave the key to another
 * run: busy (retry after the holder's lease) or mismatch.  0 for any other.
 */
static int
busy_or_mismatch(run_state *s, const char *decision, long long ms)
{
	if (strcmp(decision, "busy") == 0)
	{
		s->out->status = IDEM_BUSY;
		s->out->retry_after_ms = ms > 0 ? (long) ms : 1;
		return 1;
	}
	if (strcmp(decision, "mismatch") == 0)
	{
		s->out->status = IDEM_MISMATCH;
		return 1;
	}
	return 0;
}

/* Step 3b. */
static idem_status
pg_step(run_state *s, const idem_run_options *ro, const char *scope,
		const char *id, idem_handler_fn handler, void *user_data)
{
	idem_pg    *pg = &s->r->pg;
	pg_cmd		cmds[4];
	pg_outcome	o;
	int			first = ro != NULL && ro->first_sql != NULL;
	int			fresh;
	int			tries;
	const char *decision;
	int			attempt;
	long long	ms;
	const char *outcome;
	char		msg[400];

	for (tries = 0;; tries++)
	{
		if (tries > 2)
			return finish_error(s, IDEM_ERR_CONNECTION, NULL,
								"PostgreSQL connection keeps failing: %s",
								o.message[0] ? o.message : "no detail");
		memset(&o, 0, sizeof(o));
		msg[0] = '\0';
		if (idemc_pg_ensure(pg, &fresh, msg, sizeof(msg)) != 0)
			return finish_error(s, IDEM_ERR_CONNECTION, NULL, "%s", msg);
		if (PQtransactionStatus(pg->conn) != PQTRANS_IDLE)
			rollback_quietly(s);	/* left over; cannot normally happen */
		if (pg->conn == NULL)
			continue;
		/*
		 * Round trip 1: BEGIN; claim; SAVEPOINT; and the handler's first
		 * statement if it gave one (run option first_sql), optimistically:
		 * if the key is not ours, round trip 2 rolls it back.
		 */
		cmds[0] = tx_cmd(s, STMT_BEGIN);
		params_claim(s, &cmds[1]);
		cmds[2] = tx_cmd(s, STMT_SAVEPOINT);
		if (first)
		{
			memset(&cmds[3], 0, sizeof(cmds[3]));
			cmds[3].sql = ro->first_sql;
			cmds[3].nparams = ro->first_nparams;
			cmds[3].text_values = ro->first_params;
			cmds[3].first = 1;
		}
		idemc_pg_pipeline(pg, cmds, first ? 4 : 3, &o);
		/* a connection that died while idle: nothing was committed, so one
		 * retry on a new connection is safe */
		if (o.rc == PG_CONN_LOST && !fresh && tries == 0)
		{
			idemc_pg_outcome_clear(&o);
			continue;
		}
		break;
	}
	/* an error of the handler's first statement is the handler's to
	 * report (when the key is ours) */
	if (o.rc != PG_OK && !(o.rc == PG_SERVER_ERROR && o.failed_cmd == 3))
	{
		if (o.rc == PG_SERVER_ERROR)
			rollback_quietly(s);
		return pg_error(s, &o, o.failed_cmd == 1 ? "idem_claim" :
						o.failed_cmd == 2 ? "SAVEPOINT" : "BEGIN");
	}
	if (decision_row(o.res[1], 4, &decision, &attempt, &ms, &outcome) != 0)
	{
		idemc_pg_outcome_clear(&o);
		rollback_quietly(s);
		return finish_error(s, IDEM_ERR_PROTOCOL, NULL,
							"idem_claim returned an unexpected row");
	}

	if (strcmp(decision, "claimed") == 0)
	{
		idem_call	call;
		idem_handler_status hs;
		idem_status st;

		memset(&call, 0, sizeof(call));
		if (first && o.stale_first && o.failed_cmd == 3)
		{
			/*
			 * Its prepared plan went stale (a DDL changed its result type):
			 * once more as the unnamed statement it now is, in the savepoint,
			 * which is what an unprepared first statement would have met.
			 */
			pg_outcome o2;

			cmds[0] = tx_cmd(s, STMT_ROLLBACK_TO);
			cmds[1] = cmds[3];
			idemc_pg_pipeline(pg, cmds, 2, &o2);
			if (o2.rc == PG_CONN_LOST)
			{
				/* the transaction is gone with it: nothing committed */
				idemc_pg_outcome_clear(&o);
				return pg_error(s, &o2, "the handler's first statement");
			}
			if (o2.res[1] != NULL)
			{
				PQclear(o.res[3]);
				o.res[3] = o2.res[1];
				o2.res[1] = NULL;
			}
			idemc_pg_outcome_clear(&o2);
		}
		if (first)
		{
			call.first = o.res[3];	/* the handler's now */
			o.res[3] = NULL;
		}
		idemc_pg_outcome_clear(&o);
		call.attempt = attempt;
		call.is_platform = s->is_platform;
		call.tenant_id = s->tenant_id;
		call.scope = scope;
		call.id = id;
		call.request = s->request;
		call.key = s->key;
		hs = handler(pg->conn, &call, user_data);
		if (call.first)
			PQclear(call.first);
		call.first = NULL;
		st = finish_claimed(s, hs, &call, attempt);
		free(call.json);
		return st;
	}

	s->out->source = IDEM_SOURCE_POSTGRES;
	s->out->attempt = attempt;
	if (strcmp(decision, "completed") == 0 ||
		strcmp(decision, "failed_permanent") == 0)
	{
		if (set_terminal(s, decision[0] == 'c', outcome) != 0)
		{
			idemc_pg_outcome_clear(&o);
			rollback_quietly(s);
			return finish_error(s, IDEM_ERR_PROTOCOL, NULL,
								"idem_claim returned an outcome that is not a JSON object of at most %d bytes",
								IDEM_OUTCOME_MAX);
		}
		leave_marker(s);		/* the claim queued the worker's copy */
	}
	else if (!busy_or_mismatch(s, decision, ms))
	{
		char		d[32];

		snprintf(d, sizeof(d), "%s", decision);
		idemc_pg_outcome_clear(&o);
		rollback_quietly(s);
		return finish_error(s, IDEM_ERR_PROTOCOL, NULL,
							"idem_claim returned an unknown decision \"%s\"", d);
	}
	idemc_pg_outcome_clear(&o);

	/*
	 * Round trip 2: end the transaction.  The claim wrote nothing for these
	 * decisions and the answer was read from committed rows, so it stands
	 * even if the COMMIT fails (say the connection died just now; the next
	 * run reconnects).  The handler's first statement, if it was sent, ran
	 * inside the savepoint: rolled back before the COMMIT (a failed COMMIT
	 * or a lost connection rolls back everything anyway).
	 */
	cmds[0] = tx_cmd(s, STMT_ROLLBACK_TO);
	cmds[1] = tx_cmd(s, STMT_COMMIT);
	if (first)
		idemc_pg_pipeline(pg, cmds, 2, &o);
	else
		idemc_pg_pipeline(pg, &cmds[1], 1, &o);
	if (o.rc == PG_SERVER_ERROR)
		rollback_quietly(s);
	idemc_pg_outcome_clear(&o);
	return s->out->status;
}

/*
 * Step 3b with a SQL handler: one autocommit statement, idem_apply, claims,
 * runs the handler in a subtransaction and completes or fails the key.
 * Once it is sent, a lost connection is "commit unknown" (the statement
 * commits by itself), unless an error that proves a rollback arrived first
 * (proves_rollback); a server error answered before its Sync committed
 * nothing.
 */
static idem_status
apply_step(run_state *s, const idem_run_options *ro)
{
	idem_pg    *pg = &s->r->pg;
	pg_cmd		cmd;
	pg_outcome	o;
	int			fresh;
	int			i;
	const char *decision;
	int			attempt;
	int			ran;
	long long	ms;
	const char *outcome;
	char	   *args = NULL;
	size_t		args_len;
	char		err[200];
	char		msg[400];

	if (ro->sql_args != NULL)
	{
		err[0] = '\0';
		args = idem_json_canonical(ro->sql_args, strlen(ro->sql_args),
								   &args_len, err, sizeof(err));
		if (args == NULL)
			return finish_error(s, errno == ENOMEM ?
								IDEM_ERR_OUT_OF_MEMORY : IDEM_ERR_ARGUMENT,
								NULL, "sql_args: %s", err);
	}
	msg[0] = '\0';
	if (idemc_pg_ensure(pg, &fresh, msg, sizeof(msg)) != 0)
	{
		free(args);
		return finish_error(s, IDEM_ERR_CONNECTION, NULL, "%s", msg);
	}
	if (PQtransactionStatus(pg->conn) != PQTRANS_IDLE)
		rollback_quietly(s);	/* left over; cannot normally happen */
	if (pg->conn == NULL)
	{
		free(args);
		return finish_error(s, IDEM_ERR_CONNECTION, NULL,
							"PostgreSQL connection lost");
	}
	i = params_key(s, &cmd, STMT_APPLY_T);
	i = param_digest(&cmd, i, s->fp);
	cmd.values[i++] = ro->sql_handler;
	cmd.values[i++] = args ? args : s->request;
	cmd.values[i++] = s->r->retention_txt[0] ? s->r->retention_txt : NULL;
	cmd.nparams = i;
	idemc_pg_pipeline(pg, &cmd, 1, &o);
	free(args);
	if (o.rc != PG_OK)
	{
		idem_status st;

		/* as after a COMMIT (finish_claimed): once idem_apply is sent,
		 * only an answer that proves a rollback is definite */
		if (o.rc == PG_CONN_LOST && o.queued == 1 && !proves_rollback(&o))
			st = finish_error(s, IDEM_ERR_COMMIT_UNKNOWN, o.sqlstate,
							  "connection to PostgreSQL lost after idem_apply was sent; whether it committed is unknown (redeliver: the ledger decides): %s",
							  o.message);
		else if (o.rc == PG_CONN_LOST && o.queued == 1)
			st = finish_error(s, IDEM_ERR_SERVER, o.sqlstate,
							  "idem_apply failed (rolled back, nothing committed), then the connection was lost: %s",
							  o.message);
		else
			st = pg_error(s, &o, "idem_apply");
		idemc_pg_outcome_clear(&o);
		return st;
	}
	if (decision_row(o.res[0], 5, &decision, &attempt, &ms, &outcome) != 0 ||
		PQgetisnull(o.res[0], 0, 4))
	{
		idemc_pg_outcome_clear(&o);
		return finish_error(s, IDEM_ERR_PROTOCOL, NULL,
							"idem_apply returned an unexpected row");
	}
	ran = PQgetvalue(o.res[0], 0, 4)[0] == 't';
	s->out->source = ran ? IDEM_SOURCE_HANDLER : IDEM_SOURCE_POSTGRES;
	s->out->attempt = attempt;
	if (strcmp(decision, "completed") == 0 || strcmp(decision, "applied") == 0 ||
		strcmp(decision, "failed_permanent") == 0 ||
		strcmp(decision, "failed_retryable") == 0)
	{
		size_t		len = strlen(outcome);

		if (len > IDEM_OUTCOME_MAX || outcome[0] != '{')
		{
			idemc_pg_outcome_clear(&o);
			return finish_error(s, IDEM_ERR_PROTOCOL, NULL,
								"idem_apply returned an outcome that is not a JSON object of at most %d bytes",
								IDEM_OUTCOME_MAX);
		}
		idemc_result_set_outcome(s->out, outcome, len);
		if (decision[0] == 'c')
			s->out->status = IDEM_REPLAYED;
		else if (decision[0] == 'a')
			s->out->status = IDEM_APPLIED;
		else if (strcmp(decision, "failed_permanent") == 0)
			s->out->status = IDEM_FAILED_PERMANENT;
		else
			s->out->status = IDEM_FAILED_RETRYABLE;
		if (s->out->status != IDEM_FAILED_RETRYABLE)
			leave_marker(s);	/* a terminal row: the worker's copy follows */
	}
	else if (!busy_or_mismatch(s, decision, ms))
	{
		char		d[32];

		snprintf(d, sizeof(d), "%s", decision);
		idemc_pg_outcome_clear(&o);
		return finish_error(s, IDEM_ERR_PROTOCOL, NULL,
							"idem_apply returned an unknown decision \"%s\"", d);
	}
	idemc_pg_outcome_clear(&o);
	return s->out->status;
}

/* Step 3b: the claim and a C handler, or idem_apply with a SQL handler. */
static idem_status
effect_step(run_state *s, const idem_run_options *ro, const char *scope,
			const char *id, idem_handler_fn handler, void *user_data)
{
	if (ro != NULL && ro->sql_handler != NULL)
		return apply_step(s, ro);
	return pg_step(s, ro, scope, id, handler, user_data);
}

void
idem_result_init_size(idem_result *res, size_t size)
{
	if (res == NULL || !IDEM_STRUCT_SIZE_OK(size, IDEM_RESULT_SIZE_MIN))
		return;
	memset(res, 0, size);
	res->struct_size = size;
}

/* The function of the headers that passed no size: the first layout. */
void
(idem_result_init) (idem_result *res)
{
	idem_result_init_size(res, IDEM_RESULT_SIZE_MIN);
}

/*
 * A result the caller passed, checked (0) or refused (-1: nothing written,
 * the runner's message says why).
 */
int
idemc_result_size_ok(idem_runner *r, const idem_result *out)
{
	if (IDEM_STRUCT_SIZE_OK(out->struct_size, IDEM_RESULT_SIZE_MIN))
		return 0;
	/* its size is unknown: write nothing into it */
	if (r)
		idemc_set_err(r->errmsg, sizeof(r->errmsg),
					 "result was not initialised by idem_result_init() (struct_size %zu, expected %zu to %d)",
					 out->struct_size, (size_t) IDEM_RESULT_SIZE_MIN,
					 IDEM_STRUCT_SIZE_MAX);
	return -1;
}

/* Copy a full result into the caller's, within its struct_size. */
void
idemc_result_copy_out(idem_result *out, const idem_result *full)
{
	size_t		size = out->struct_size;

	memcpy(out, full, IDEM_MIN_SIZE(size, sizeof(*full)));
	out->struct_size = size;
}

void
idem_run_options_init_size(idem_run_options *o, size_t size)
{
	if (o == NULL || !IDEM_STRUCT_SIZE_OK(size, IDEM_RUN_OPTIONS_SIZE_MIN))
		return;
	memset(o, 0, size);
	o->struct_size = size;
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
		finish_error(&s, IDEM_ERR_ARGUMENT, NULL,
					 "invalid runner options: %s", m);
		snprintf(r->errmsg, sizeof(r->errmsg), "%s", m);
		return IDEM_ERROR;
	}
	r->errmsg[0] = '\0';
	if (ro != NULL &&
		!IDEM_STRUCT_SIZE_OK(ro->struct_size, IDEM_RUN_OPTIONS_SIZE_MIN))
		return finish_error(&s, IDEM_ERR_ARGUMENT, NULL,
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
		return finish_error(&s, IDEM_ERR_ARGUMENT, NULL,
							"delivery_count must be 0 (unknown) or positive, not %d",
							ro->delivery_count);
	if (handler == NULL && (ro == NULL || ro->sql_handler == NULL))
		return finish_error(&s, IDEM_ERR_ARGUMENT, NULL, "handler is NULL");
	if (ro != NULL && ro->sql_handler != NULL && ro->sql_handler[0] == '\0')
		return finish_error(&s, IDEM_ERR_ARGUMENT, NULL, "sql_handler is empty");
	if (ro != NULL && ro->first_sql != NULL &&
		(ro->sql_handler != NULL || ro->first_sql[0] == '\0' ||
		 ro->first_nparams < 0 || ro->first_nparams > 65535 ||
		 (ro->first_nparams > 0 && ro->first_params == NULL)))
		return finish_error(&s, IDEM_ERR_ARGUMENT, NULL,
							"first_sql must be a non-empty statement for a C handler (not with sql_handler), with first_nparams (0 to 65535) text parameters in first_params");
	if (scope == NULL || id == NULL || idem_key(scope, id, s.key) != 0)
		return finish_error(&s, IDEM_ERR_ARGUMENT, NULL,
							"task scope and id must be non-NULL valid UTF-8 strings");
	if (request_json == NULL)
		return finish_error(&s, IDEM_ERR_ARGUMENT, NULL, "request_json is NULL");
	err[0] = '\0';
	s.request = idem_json_canonical(request_json, strlen(request_json),
									&s.request_len, err, sizeof(err));
	if (s.request == NULL)
		return finish_error(&s, errno == ENOMEM ?
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
		st = effect_step(&s, ro, scope, id, handler, user_data);
	}
	else if (gate_step(&s))
	{
		st = out->status;

		/*
		 * Another run's marker: that run may have committed a terminal
		 * row whose copy has not yet replaced its marker.  One autocommit
		 * idem_lookup answers that duplicate now; anything else stays
		 * busy.
		 */
		if (s.marker_busy && r->lookup_first && lookup_step(&s))
			st = out->status;
	}
	else if ((s.valkey_silent || s.mismatch_hint) && r->lookup_first &&
			 lookup_step(&s))
		st = out->status;
	else
	{
		/*
		 * An old marker (marker_old) goes straight to the claim: busy at
		 * once if its run is alive, the key if it died; a committed run's
		 * row is replayed by the claim as by idem_lookup.
		 */
		st = effect_step(&s, ro, scope, id, handler, user_data);
	}

	/* no terminal result was written: our marker goes (compare-and-delete) */
	if (s.own_marker)
		release_marker(&s);
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
