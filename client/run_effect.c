/*
 * run_effect.c
 *	  Step 3b of a run: the claim, the handler on the open transaction (a C
 *	  handler between two pipelines, or idem_apply's SQL handler in one
 *	  statement), its completion or failure, and the COMMIT.  The honesty
 *	  rules of runner.c's header apply here.
 */
#include "run.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
	return idemc_run_error(s, IDEM_ERR_HANDLER_ENDED_TX, NULL,
						"the handler ended the runner's transaction (COMMIT, ROLLBACK or COMMIT; BEGIN) or released its savepoint: its effect may have committed without its idempotency key, and a redelivery after the lease may run it again");
}

/*
 * {"sqlstate": st, "message": m} in out (m escaped as a JSON string; out
 * is large enough for every character of m escaped as \u00XX).
 */
static void
timeout_detail(char *out, size_t n, const char *st, const char *m)
{
	size_t		k = (size_t) snprintf(out, n, "{\"sqlstate\": \"%s\", \"message\": \"", st);

	for (; *m != '\0' && k + 8 < n; m++)
	{
		unsigned char c = (unsigned char) *m;

		if (c == '"' || c == '\\')
		{
			out[k++] = '\\';
			out[k++] = (char) c;
		}
		else if (c < 0x20)
			k += (size_t) snprintf(out + k, n - k, "\\u%04x", (unsigned) c);
		else
			out[k++] = (char) c;
	}
	snprintf(out + k, n - k, "\"}");
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
	char		tdetail[sizeof(s->r->pg.handler_last_message) * 6 + 64];
	char	   *canon;
	size_t		clen;
	char		err[200];
	pg_cmd		cmds[4];
	int			emit;
	int			ncmds;
	pg_outcome	o;

	if (hs != IDEM_HANDLER_OK && hs != IDEM_HANDLER_RETRYABLE &&
		hs != IDEM_HANDLER_PERMANENT)
	{
		idemc_run_rollback_quietly(s);
		return idemc_run_error(s, IDEM_ERR_HANDLER, NULL,
							"handler returned an unknown status %d; rolled back",
							(int) hs);
	}
	if (PQstatus(conn) != CONNECTION_OK)
	{
		idemc_pg_drop(pg);
		return idemc_run_error(s, IDEM_ERR_CONNECTION, NULL,
							"connection to PostgreSQL lost during the handler; nothing was committed");
	}
	if (PQpipelineStatus(conn) != PQ_PIPELINE_OFF)
	{
		idemc_pg_drop(pg);		/* the safest way out of an unknown state */
		return idemc_run_error(s, IDEM_ERR_HANDLER, NULL,
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
		return idemc_run_error(s, IDEM_ERR_CONNECTION, NULL,
							"connection to PostgreSQL lost during the handler; nothing was committed");
	}
	ts = PQtransactionStatus(conn);
	if (ts == PQTRANS_IDLE)
		return handler_ended_tx(s);
	if (ts != PQTRANS_INTRANS && ts != PQTRANS_INERROR)
	{
		idemc_pg_drop(pg);
		return idemc_run_error(s, IDEM_ERR_HANDLER, NULL,
							"connection in an unexpected state after the handler");
	}

	/*
	 * A statement of the handler met the server's state (a serialization
	 * failure, a deadlock, an operator's cancel: idem_apply's rule), and
	 * the handler reported a failure or left the transaction in error: not
	 * an attempt.  Recorded, a few transient conflicts would spend the
	 * key's attempts (idem.max_attempts) and dead-letter a healthy
	 * message.  Rolled back, nothing recorded, the server's error: the
	 * next delivery runs the same attempt again.  A handler that recovered
	 * (its own savepoint) and answered success goes on.
	 */
	if (pg->handler_sqlstate[0] != '\0' &&
		(hs != IDEM_HANDLER_OK || ts == PQTRANS_INERROR))
	{
		char		st[6];
		char		m[200];

		snprintf(st, sizeof(st), "%s", pg->handler_sqlstate);
		snprintf(m, sizeof(m), "%s", pg->handler_message);
		idemc_run_rollback_quietly(s);
		return idemc_run_error(s, IDEM_ERR_SERVER, st,
							"a statement of the handler failed with SQLSTATE %s (%s): the server's state, not the handler's answer; rolled back, nothing recorded (redeliver: the same attempt runs again)",
							st, m);
	}
	if (ts == PQTRANS_INERROR && hs == IDEM_HANDLER_OK &&
		idemc_error_is_timeout(pg->handler_last_sqlstate, pg->handler_last_message))
	{
		/*
		 * The handler caught a timeout's cancel (statement_timeout's 57014,
		 * lock_timeout's 55P03) and returned success: its transaction is
		 * aborted, the effect cannot commit.  It is the attempt it would be
		 * had the handler reported it: a retryable failure, recorded with
		 * {"sqlstate", "message"} as idem_apply records one, so that
		 * idem.max_attempts ends a handler that overruns on every delivery.
		 */
		timeout_detail(tdetail, sizeof(tdetail), pg->handler_last_sqlstate,
					   pg->handler_last_message);
		json = tdetail;
		hs = IDEM_HANDLER_RETRYABLE;
	}
	if (ts == PQTRANS_INERROR && hs == IDEM_HANDLER_OK)
	{
		idemc_run_rollback_quietly(s);
		return idemc_run_error(s, IDEM_ERR_HANDLER, NULL,
							"handler returned success, but a statement of its transaction failed; rolled back");
	}
	if (call->oom)
	{
		idemc_run_rollback_quietly(s);
		return idemc_run_error(s, IDEM_ERR_OUT_OF_MEMORY, NULL,
							"out of memory storing the handler's result; rolled back");
	}
	err[0] = '\0';
	errno = 0;
	canon = idem_json_canonical(json, strlen(json), &clen, err, sizeof(err));
	if (canon == NULL && errno == ENOMEM)
	{
		idemc_run_rollback_quietly(s);
		return idemc_run_error(s, IDEM_ERR_OUT_OF_MEMORY, NULL,
							"out of memory storing the handler's result; rolled back");
	}
	if (canon == NULL || canon[0] != '{' || clen > IDEM_OUTCOME_MAX)
	{
		/*
		 * An outcome that cannot be stored is the handler's failure of this
		 * attempt, as in idem_apply: its writes roll back to the savepoint
		 * and the attempt is recorded with {"sqlstate", "message"}: 22023
		 * (not a JSON object) permanent, 54000 (too long) retryable, so
		 * that idem.max_attempts ends it (else every redelivery would run
		 * the handler again as attempt 1).  A failure the handler said was
		 * permanent stays permanent.
		 */
		const char *what = hs == IDEM_HANDLER_OK ? "handler outcome" : "failure detail";
		int			too_long = canon != NULL && canon[0] == '{';
		char		detail[200];

		if (too_long)
			snprintf(detail, sizeof(detail),
					 "{\"sqlstate\": \"54000\", \"message\": \"%s is %zu bytes as JSON text, over the limit of %d bytes\"}",
					 what, clen, IDEM_OUTCOME_MAX);
		else
			snprintf(detail, sizeof(detail),
					 "{\"sqlstate\": \"22023\", \"message\": \"%s must be a JSON object\"}",
					 what);
		free(canon);
		hs = too_long && hs != IDEM_HANDLER_PERMANENT ?
			IDEM_HANDLER_RETRYABLE : IDEM_HANDLER_PERMANENT;
		canon = idem_json_canonical(detail, strlen(detail), &clen, err, sizeof(err));
		if (canon == NULL)
		{
			idemc_run_rollback_quietly(s);
			return idemc_run_error(s, IDEM_ERR_OUT_OF_MEMORY, NULL,
								"out of memory storing the handler's result; rolled back");
		}
	}

	/*
	 * Round trip 2: savepoint, the handler's messages (idem_call_emit:
	 * only with its success, and while the claim is still open), record,
	 * COMMIT.
	 */
	emit = hs == IDEM_HANDLER_OK && call->nemits > 0;
	ncmds = emit ? 4 : 3;
	cmds[0] = idemc_run_tx_cmd(s, hs == IDEM_HANDLER_OK ?
					 STMT_RELEASE : STMT_ROLLBACK_TO);
	if (emit)
		idemc_emit_cmd(s, call, &cmds[1]);
	idemc_run_params_finish(s, &cmds[emit + 1], hs == IDEM_HANDLER_OK,
				  hs == IDEM_HANDLER_RETRYABLE, canon);
	cmds[ncmds - 1] = idemc_run_tx_cmd(s, STMT_COMMIT);
	idemc_pg_pipeline(pg, cmds, ncmds, &o);

	/*
	 * A COMMIT whose result arrived has committed, even if the connection
	 * dropped before the pipeline's Sync: that is not "unknown".  A
	 * pipeline that ran to its Sync on a live connection answered for
	 * itself: the COMMIT failed or was skipped after an error, nothing
	 * committed.  Once the COMMIT was handed to the connection, a lost
	 * connection is "unknown" whatever arrived before, unless it was an
	 * error that proves a rollback (idemc_run_proves_rollback): a pooler answers
	 * with an error of its own when the server connection dies under a
	 * COMMIT that may have committed.
	 */
	if (!(o.completed == ncmds && o.res[ncmds - 1] &&
		  strcmp(PQcmdStatus(o.res[ncmds - 1]), "COMMIT") == 0))
	{
		idem_status st;
		int			definite = o.rc != PG_CONN_LOST || o.queued < ncmds ||
			idemc_run_proves_rollback(&o);

		if (!definite)
			st = idemc_run_error(s, IDEM_ERR_COMMIT_UNKNOWN, o.sqlstate,
							  "connection to PostgreSQL lost after COMMIT was sent; whether it committed is unknown (redeliver: the ledger decides): %s",
							  o.message);
		else if (strcmp(o.sqlstate, "3B001") == 0)
		{
			/* our savepoint is gone: the handler ended our transaction
			 * (COMMIT; BEGIN) or released the savepoint */
			idemc_run_rollback_quietly(s);
			idemc_pg_outcome_clear(&o);
			free(canon);
			return handler_ended_tx(s);
		}
		else if (o.rc == PG_CONN_LOST && o.queued < ncmds)
			st = idemc_run_error(s, IDEM_ERR_CONNECTION, o.sqlstate,
							  "connection to PostgreSQL lost before COMMIT was sent; nothing was committed: %s",
							  o.message);
		else if (o.rc == PG_CONN_LOST)
			st = idemc_run_error(s, IDEM_ERR_SERVER, o.sqlstate,
							  "PostgreSQL refused a statement before COMMIT (rolled back, nothing committed), then the connection was lost: %s",
							  o.message);
		else
		{
			idemc_run_rollback_quietly(s);
			st = idemc_run_error(s, IDEM_ERR_SERVER, o.sqlstate,
							  "%s failed; rolled back, nothing committed: %s",
							  o.failed_cmd == emit + 1 ?
							  (hs == IDEM_HANDLER_OK ? "idem_complete" : "idem_fail") :
							  emit && o.failed_cmd == 1 ? "idem_emit" :
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
			idemc_run_leave_marker(s);
			break;
		case IDEM_HANDLER_PERMANENT:
			s->out->status = IDEM_FAILED_PERMANENT;
			idemc_run_leave_marker(s);
			break;
		case IDEM_HANDLER_RETRYABLE:
			/* no terminal value follows: the next delivery must not
			 * meet our marker */
			s->out->status = IDEM_FAILED_RETRYABLE;
			idemc_run_release_marker(s);
			break;
	}
	free(canon);
	return s->out->status;
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
			return idemc_run_error(s, IDEM_ERR_CONNECTION, NULL,
								"PostgreSQL connection keeps failing: %s",
								o.message[0] ? o.message : "no detail");
		memset(&o, 0, sizeof(o));
		msg[0] = '\0';
		if (idemc_pg_ensure(pg, &fresh, msg, sizeof(msg)) != 0)
			return idemc_run_error(s, IDEM_ERR_CONNECTION, NULL, "%s", msg);
		if (PQtransactionStatus(pg->conn) != PQTRANS_IDLE)
			idemc_run_rollback_quietly(s);	/* left over; cannot normally happen */
		if (pg->conn == NULL)
			continue;
		/*
		 * Round trip 1: BEGIN; claim; SAVEPOINT; and the handler's first
		 * statement if it gave one (run option first_sql), optimistically:
		 * if the key is not ours, round trip 2 rolls it back.
		 */
		cmds[0] = idemc_run_tx_cmd(s, STMT_BEGIN);
		idemc_run_params_claim(s, &cmds[1]);
		cmds[2] = idemc_run_tx_cmd(s, STMT_SAVEPOINT);
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
			idemc_run_rollback_quietly(s);
		return idemc_run_pg_error(s, &o, o.failed_cmd == 1 ? "idem_claim" :
						o.failed_cmd == 2 ? "SAVEPOINT" : "BEGIN");
	}
	if (idemc_run_decision_row(o.res[1], 4, &decision, &attempt, &ms, &outcome) != 0)
	{
		idemc_pg_outcome_clear(&o);
		idemc_run_rollback_quietly(s);
		return idemc_run_error(s, IDEM_ERR_PROTOCOL, NULL,
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

			cmds[0] = idemc_run_tx_cmd(s, STMT_ROLLBACK_TO);
			cmds[1] = cmds[3];
			idemc_pg_pipeline(pg, cmds, 2, &o2);
			if (o2.rc == PG_CONN_LOST)
			{
				/* the transaction is gone with it: nothing committed */
				idemc_pg_outcome_clear(&o);
				return idemc_run_pg_error(s, &o2, "the handler's first statement");
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
		idemc_pg_watch_handler(pg, 1);
		if (call.first != NULL &&
			PQresultStatus(call.first) == PGRES_FATAL_ERROR)	/* sent with the claim */
			idemc_pg_handler_error(pg, PQresultErrorField(call.first, PG_DIAG_SQLSTATE),
								   PQresultErrorField(call.first, PG_DIAG_MESSAGE_PRIMARY));
		hs = handler(pg->conn, &call, user_data);
		idemc_pg_watch_handler(pg, 0);
		if (call.first)
			PQclear(call.first);
		call.first = NULL;
		st = finish_claimed(s, hs, &call, attempt);
		free(call.json);
		free(call.emits);
		return st;
	}

	s->out->source = IDEM_SOURCE_POSTGRES;
	s->out->attempt = attempt;
	if (strcmp(decision, "completed") == 0 ||
		strcmp(decision, "failed_permanent") == 0)
	{
		if (idemc_run_set_terminal(s, decision[0] == 'c', outcome) != 0)
		{
			idemc_pg_outcome_clear(&o);
			idemc_run_rollback_quietly(s);
			return idemc_run_error(s, IDEM_ERR_PROTOCOL, NULL,
								"idem_claim returned an outcome that is not a JSON object of at most %d bytes",
								IDEM_OUTCOME_MAX);
		}
		idemc_run_leave_marker(s);		/* the claim queued the worker's copy */
	}
	else if (!idemc_run_busy_or_mismatch(s, decision, ms))
	{
		char		d[32];

		snprintf(d, sizeof(d), "%s", decision);
		idemc_pg_outcome_clear(&o);
		idemc_run_rollback_quietly(s);
		return idemc_run_error(s, IDEM_ERR_PROTOCOL, NULL,
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
	cmds[0] = idemc_run_tx_cmd(s, STMT_ROLLBACK_TO);
	cmds[1] = idemc_run_tx_cmd(s, STMT_COMMIT);
	if (first)
		idemc_pg_pipeline(pg, cmds, 2, &o);
	else
		idemc_pg_pipeline(pg, &cmds[1], 1, &o);
	if (o.rc == PG_SERVER_ERROR)
		idemc_run_rollback_quietly(s);
	idemc_pg_outcome_clear(&o);
	return s->out->status;
}

/*
 * Step 3b with a SQL handler: one autocommit statement, idem_apply, claims,
 * runs the handler in a subtransaction and completes or fails the key.
 * Once it is sent, a lost connection is "commit unknown" (the statement
 * commits by itself), unless an error that proves a rollback arrived first
 * (idemc_run_proves_rollback); a server error answered before its Sync committed
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
			return idemc_run_error(s, errno == ENOMEM ?
								IDEM_ERR_OUT_OF_MEMORY : IDEM_ERR_ARGUMENT,
								NULL, "sql_args: %s", err);
	}
	msg[0] = '\0';
	if (idemc_pg_ensure(pg, &fresh, msg, sizeof(msg)) != 0)
	{
		free(args);
		return idemc_run_error(s, IDEM_ERR_CONNECTION, NULL, "%s", msg);
	}
	if (PQtransactionStatus(pg->conn) != PQTRANS_IDLE)
		idemc_run_rollback_quietly(s);	/* left over; cannot normally happen */
	if (pg->conn == NULL)
	{
		free(args);
		return idemc_run_error(s, IDEM_ERR_CONNECTION, NULL,
							"PostgreSQL connection lost");
	}
	i = idemc_run_params_key(s, &cmd, STMT_APPLY_T);
	i = idemc_run_param_digest(&cmd, i, s->fp);
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
		if (o.rc == PG_CONN_LOST && o.queued == 1 && !idemc_run_proves_rollback(&o))
			st = idemc_run_error(s, IDEM_ERR_COMMIT_UNKNOWN, o.sqlstate,
							  "connection to PostgreSQL lost after idem_apply was sent; whether it committed is unknown (redeliver: the ledger decides): %s",
							  o.message);
		else if (o.rc == PG_CONN_LOST && o.queued == 1)
			st = idemc_run_error(s, IDEM_ERR_SERVER, o.sqlstate,
							  "idem_apply failed (rolled back, nothing committed), then the connection was lost: %s",
							  o.message);
		else
			st = idemc_run_pg_error(s, &o, "idem_apply");
		idemc_pg_outcome_clear(&o);
		return st;
	}
	if (idemc_run_decision_row(o.res[0], 5, &decision, &attempt, &ms, &outcome) != 0 ||
		PQgetisnull(o.res[0], 0, 4))
	{
		idemc_pg_outcome_clear(&o);
		return idemc_run_error(s, IDEM_ERR_PROTOCOL, NULL,
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
			return idemc_run_error(s, IDEM_ERR_PROTOCOL, NULL,
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
			idemc_run_leave_marker(s);	/* a terminal row: the worker's copy follows */
	}
	else if (!idemc_run_busy_or_mismatch(s, decision, ms))
	{
		char		d[32];

		snprintf(d, sizeof(d), "%s", decision);
		idemc_pg_outcome_clear(&o);
		return idemc_run_error(s, IDEM_ERR_PROTOCOL, NULL,
							"idem_apply returned an unknown decision \"%s\"", d);
	}
	idemc_pg_outcome_clear(&o);
	return s->out->status;
}

/* Step 3b: the claim and a C handler, or idem_apply with a SQL handler. */
idem_status
idemc_run_effect(run_state *s, const idem_run_options *ro, const char *scope,
			const char *id, idem_handler_fn handler, void *user_data)
{
	if (ro != NULL && ro->sql_handler != NULL)
		return apply_step(s, ro);
	return pg_step(s, ro, scope, id, handler, user_data);
}
