/*
 * run_pg.c
 *	  PostgreSQL's side of a run: the statements' parameters, the
 *	  transaction commands, the decision row and its errors (what proves a
 *	  rollback after COMMIT), the terminal result; and step 3a, the
 *	  autocommit idem_lookup.
 */
#include "run.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int
idemc_run_param_digest(pg_cmd *c, int i, const uint8_t *digest)
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
int
idemc_run_params_key(run_state *s, pg_cmd *c, pg_stmt tenant_stmt)
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
	return idemc_run_param_digest(c, i, s->key);
}

void
idemc_run_params_claim(run_state *s, pg_cmd *c)
{
	int			i = idemc_run_params_key(s, c, STMT_CLAIM_T);

	i = idemc_run_param_digest(c, i, s->fp);
	c->values[i++] = s->r->lease_txt;
	c->nparams = i;
}

void
idemc_run_params_finish(run_state *s, pg_cmd *c, int ok, int retryable,
			  const char *json)
{
	int			i = idemc_run_params_key(s, c, ok ? STMT_COMPLETE_T : STMT_FAIL_T);

	c->values[i++] = json;
	if (!ok)
		c->values[i++] = retryable ? "true" : "false";
	c->values[i++] = s->r->retention_txt[0] ? s->r->retention_txt : NULL;
	c->nparams = i;
}

static void
params_lookup(run_state *s, pg_cmd *c)
{
	c->nparams = idemc_run_param_digest(c, idemc_run_params_key(s, c, STMT_LOOKUP_T), s->fp);
}

/* A statement of the runner's transaction control (no parameters). */
pg_cmd
idemc_run_tx_cmd(run_state *s, pg_stmt stmt)
{
	pg_cmd		c;

	memset(&c, 0, sizeof(c));
	c.sql = s->r->pg.sql[stmt];
	return c;
}

/* End the transaction after an error; the connection may be gone. */
void
idemc_run_rollback_quietly(run_state *s)
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
int
idemc_run_decision_row(PGresult *r, int nfields, const char **decision, int *attempt,
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

idem_status
idemc_run_pg_error(run_state *s, pg_outcome *o, const char *what)
{
	idem_error_code code = o->rc == PG_CONN_LOST ? IDEM_ERR_CONNECTION :
		IDEM_ERR_SERVER;
	idem_status st = idemc_run_error(s, code, o->sqlstate, "%s: %s", what,
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
int
idemc_run_proves_rollback(const pg_outcome *o)
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
 * A completed or failed_permanent answer read from PostgreSQL (the caller
 * has set source and attempt): 0, or -1 (nothing set) when the outcome is
 * not a JSON object of at most IDEM_OUTCOME_MAX bytes.
 */
int
idemc_run_set_terminal(run_state *s, int completed, const char *outcome)
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
int
idemc_run_lookup(run_state *s)
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
			else if (idemc_run_set_terminal(s, completed, outcome) == 0)
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
int
idemc_run_busy_or_mismatch(run_state *s, const char *decision, long long ms)
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
