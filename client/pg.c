/*
 * pg.c
 *	  The PostgreSQL side of a runner: one libpq connection, the statements
 *	  of the idem SQL API (schema-qualified: nothing depends on search_path),
 *	  and a pipeline helper that sends several commands with one Sync, so
 *	  that they cost one round trip.  The API's statements and the
 *	  runner's transaction control (BEGIN .. COMMIT) are named
 *	  prepared statements, prepared inside the pipeline that first uses
 *	  them on a connection (no extra round trip), so the server parses and
 *	  plans them once per connection instead of once per call -- except
 *	  through a transaction pooler (idem_options.prepared_statements),
 *	  where every command is an unnamed statement.  So is a C handler's
 *	  first statement (idem_run_options.first_sql), for the first few
 *	  distinct texts a connection meets.
 */
#include "internal.h"

#include <libpq-events.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/random.h>

void
idemc_pg_init(idem_pg *p)
{
	memset(p, 0, sizeof(*p));
}

static void
free_sql(idem_pg *p)
{
	int			i;

	for (i = 0; i < STMT_COUNT; i++)
	{
		free(p->sql[i]);
		p->sql[i] = NULL;
	}
	for (i = 0; i < PG_FIRST_SLOTS; i++)
	{
		free(p->first_sql[i]);
		p->first_sql[i] = NULL;
	}
	p->first_unnamed = 0;
}

void
idemc_pg_drop(idem_pg *p)
{
	if (p->conn)
	{
		if (p->trace)
			PQuntrace(p->conn);
		PQfinish(p->conn);
	}
	p->conn = NULL;
	p->prepared = 0;
	p->resync = 0;
	p->named = 0;
	free_sql(p);
}

void
idemc_pg_close(idem_pg *p)
{
	idemc_pg_drop(p);
	free(p->conninfo);
	free(p->schema_opt);
	p->conninfo = NULL;
	p->schema_opt = NULL;
}

static void
copy_msg(char *msg, size_t msglen, const char *prefix, const char *text)
{
	size_t		n;

	idemc_set_err(msg, msglen, "%s%s", prefix, text ? text : "");
	n = strlen(msg);
	while (n > 0 && (msg[n - 1] == '\n' || msg[n - 1] == ' '))
		msg[--n] = '\0';
}

static char *
fmt_sql(const char *fmt, const char *schema)
{
	size_t		n = strlen(fmt) + strlen(schema) + 1;
	char	   *s = malloc(n);

	if (s)
		snprintf(s, n, fmt, schema);
	return s;
}

/*
 * The name of the savepoint the handler runs after: idem_handler_ and 16
 * random hex digits, drawn anew for each connection.  A handler that ends
 * the runner's transaction and opens another with a savepoint of the
 * documented name (COMMIT; BEGIN; SAVEPOINT idem_handler) does not have
 * ours: the RELEASE (or ROLLBACK TO) of the completion fails (3B001) and
 * the run reports IDEM_ERR_HANDLER_ENDED_TX instead of "applied".  Fixed
 * per connection, so that the savepoint statements stay prepared.
 */
static void
savepoint_name(idem_pg *p, char out[40])
{
	uint8_t		b[8];
	ssize_t		got = getrandom(b, sizeof(b), GRND_NONBLOCK);

	if (got != (ssize_t) sizeof(b))
	{
		/* no entropy yet: unguessable enough against a handler's mistake */
		uint64_t	x = (uint64_t) idemc_now_ms() ^ ((uint64_t) getpid() << 32) ^
			(uint64_t) (uintptr_t) p ^ (uint64_t) p->connects * 0x9E3779B97F4A7C15ULL;
		int			i;

		for (i = 0; i < 8; i++)
			b[i] = (uint8_t) (x >> (8 * i));
	}
	memcpy(out, "idem_handler_", 13);
	idem_cache_hex(out + 13, b, sizeof(b));
	out[13 + 16] = '\0';
}

static int
build_sql(idem_pg *p, const char *s)
{
	/* each format has one %s, the quoted schema, but transaction control */
	static const char *const fmts[STMT_COUNT] = {
		/* CLAIM_T: decision, attempt, outcome, ms until expires_at */
		"SELECT c.decision, c.attempt, c.outcome::text, "
		"floor(extract(epoch FROM c.expires_at - clock_timestamp()) * 1000)::bigint "
		"FROM %s.idem_claim($1::bigint, $2::bytea, $3::bytea, $4::interval) AS c",
		"SELECT c.decision, c.attempt, c.outcome::text, "
		"floor(extract(epoch FROM c.expires_at - clock_timestamp()) * 1000)::bigint "
		"FROM %s.idem_platform_claim($1::bytea, $2::bytea, $3::interval) AS c",
		"SELECT %s.idem_complete($1::bigint, $2::bytea, $3::jsonb, $4::interval)",
		"SELECT %s.idem_platform_complete($1::bytea, $2::jsonb, $3::interval)",
		"SELECT %s.idem_fail($1::bigint, $2::bytea, $3::jsonb, $4::boolean, $5::interval)",
		"SELECT %s.idem_platform_fail($1::bytea, $2::jsonb, $3::boolean, $4::interval)",
		/*
		 * TTL_*: ms until the row's expires_at (retention deadline).  The
		 * tenant one selects a second column: Citus delegates SELECT ...
		 * FROM f(...) to the tenant's worker only when the select list is
		 * not one function call (here the ::bigint).
		 */
		"SELECT floor(extract(epoch FROM l.expires_at - clock_timestamp()) * 1000)::bigint, l.attempt "
		"FROM %s.idem_lookup($1::bigint, $2::bytea) AS l",
		"SELECT floor(extract(epoch FROM l.expires_at - clock_timestamp()) * 1000)::bigint "
		"FROM %s.idem_platform_lookup($1::bytea) AS l",
		/* LOOKUP_*: status, attempt, outcome, same fingerprint, ms left */
		"SELECT l.status, l.attempt, l.outcome::text, l.fingerprint = $3::bytea, "
		"floor(extract(epoch FROM l.expires_at - clock_timestamp()) * 1000)::bigint "
		"FROM %s.idem_lookup($1::bigint, $2::bytea) AS l",
		"SELECT l.status, l.attempt, l.outcome::text, l.fingerprint = $2::bytea, "
		"floor(extract(epoch FROM l.expires_at - clock_timestamp()) * 1000)::bigint "
		"FROM %s.idem_platform_lookup($1::bytea) AS l",
		/* KEYSPACE, SECRETS: trust.c */
		"SELECT %s.idem_cache_keyspace()",
		"SELECT s.key_id, s.secret, s.is_current, s.owner_key, s.owner_token "
		"FROM %s.idem_cache_secrets() AS s",
		/* APPLY_*: decision, attempt, outcome, ms until expires_at, ran */
		"SELECT a.decision, a.attempt, a.outcome::text, "
		"floor(extract(epoch FROM a.expires_at - clock_timestamp()) * 1000)::bigint, a.ran "
		"FROM %s.idem_apply($1::bigint, $2::bytea, $3::bytea, $4::regprocedure, $5::jsonb, $6::interval) AS a",
		"SELECT a.decision, a.attempt, a.outcome::text, "
		"floor(extract(epoch FROM a.expires_at - clock_timestamp()) * 1000)::bigint, a.ran "
		"FROM %s.idem_platform_apply($1::bytea, $2::bytea, $3::regprocedure, $4::jsonb, $5::interval) AS a",
		/*
		 * EMIT: a C handler's messages, [[stream, message], ...], for the
		 * run's key, recorded in order (the function scan's rows, one
		 * call each): their ids
		 */
		"SELECT %s.idem_emit(e.value->>0, e.value->1, $2::bytea) "
		"FROM jsonb_array_elements($1::jsonb) AS e",
		/*
		 * DURABLE: synchronous_commit at least on (remote_apply is kept)
		 * until the transaction ends (no schema, as transaction control).
		 */
		"SELECT pg_catalog.set_config('synchronous_commit', 'on', true) "
		"WHERE pg_catalog.current_setting('synchronous_commit') <> 'remote_apply'",
		/*
		 * BEGIN .. COMMIT: the runner's transaction around a C handler.
		 * The savepoint's %s is its name, drawn for each connection
		 * (savepoint_name).
		 */
		"BEGIN",
		"SAVEPOINT %s",
		"RELEASE SAVEPOINT %s",
		"ROLLBACK TO SAVEPOINT %s",
		"COMMIT"
	};
	char		sp[40];
	int			i;

	savepoint_name(p, sp);
	free_sql(p);
	for (i = 0; i < STMT_COUNT; i++)
	{
		p->sql[i] = fmt_sql(fmts[i],
							i == STMT_SAVEPOINT || i == STMT_RELEASE ||
							i == STMT_ROLLBACK_TO ? sp : s);
		if (p->sql[i] == NULL)
			return -1;
	}
	return 0;
}

/*
 * The library never writes to stderr: libpq's default notice receiver
 * would print server notices.  An ErrorResponse that arrives while the
 * connection is idle comes here too: a FATAL (or PANIC) one is the server
 * ending this session (pg_terminate_backend, a shutdown, a crash of
 * another backend), although the socket may not have shown its end yet.
 */
static void
notice_receiver(void *arg, const PGresult *res)
{
	idem_pg    *p = arg;
	const char *sev = PQresultErrorField(res, PG_DIAG_SEVERITY_NONLOCALIZED);

	if (sev && (strcmp(sev, "FATAL") == 0 || strcmp(sev, "PANIC") == 0))
		p->server_ended = 1;
}

/*
 * An operator's cancel (pg_cancel_backend, a client's cancel request) has
 * statement_timeout's SQLSTATE, 57014; only the message tells them apart,
 * in the session's lc_messages.  The English text is compared: with
 * another language, an operator's cancel counts as the handler's attempt,
 * as statement_timeout's does (idem_apply compares the untranslated id).
 */
#define OPERATOR_CANCEL "canceling statement due to user request"

int
idemc_error_is_servers(const char *st, const char *message)
{
	if (st == NULL || strlen(st) != 5)
		return 0;
	if (strcmp(st, "57014") == 0)
		return message != NULL && strcmp(message, OPERATOR_CANCEL) == 0;
	return strncmp(st, "40", 2) == 0 || strncmp(st, "53", 2) == 0 ||
		strncmp(st, "57", 2) == 0 || strncmp(st, "58", 2) == 0 ||
		strncmp(st, "XX", 2) == 0;
}

int
idemc_error_is_timeout(const char *st, const char *message)
{
	if (st == NULL)
		return 0;
	return strcmp(st, "55P03") == 0 ||
		(strcmp(st, "57014") == 0 && !idemc_error_is_servers(st, message));
}

void
idemc_pg_handler_error(idem_pg *p, const char *st, const char *m)
{
	if (st == NULL || strlen(st) != 5)
		return;
	if (p->handler_sqlstate[0] == '\0' && idemc_error_is_servers(st, m))
	{
		snprintf(p->handler_sqlstate, sizeof(p->handler_sqlstate), "%s", st);
		snprintf(p->handler_message, sizeof(p->handler_message), "%s",
				 m ? m : "");
	}
	if (strcmp(st, "25P02") != 0)
	{
		snprintf(p->handler_last_sqlstate, sizeof(p->handler_last_sqlstate), "%s", st);
		snprintf(p->handler_last_message, sizeof(p->handler_last_message), "%s",
				 m ? m : "");
	}
}

/*
 * libpq's event procedure on our connection: while a handler runs, the
 * errors its statements get are seen (idemc_pg_handler_error), so that the
 * runner can tell the server's state (the first error of a serialization
 * failure, a deadlock, an operator's cancel) from the handler's answer,
 * and knows what aborted a transaction the handler left in error (the
 * handler sees the errors; the runner never sees its results).
 */
static int
result_event(PGEventId id, void *info, void *pass)
{
	idem_pg    *p = pass;

	if (id == PGEVT_RESULTCREATE && p->watching)
	{
		const PGresult *res = ((const PGEventResultCreate *) info)->result;

		if (PQresultStatus(res) == PGRES_FATAL_ERROR)
			idemc_pg_handler_error(p, PQresultErrorField(res, PG_DIAG_SQLSTATE),
								   PQresultErrorField(res, PG_DIAG_MESSAGE_PRIMARY));
	}
	return 1;
}

void
idemc_pg_watch_handler(idem_pg *p, int on)
{
	if (on)
	{
		p->handler_sqlstate[0] = '\0';
		p->handler_message[0] = '\0';
		p->handler_last_sqlstate[0] = '\0';
		p->handler_last_message[0] = '\0';
	}
	p->watching = on;
}

/*
 * Whether the connection, idle between runs, is still alive: reads without
 * blocking what the server sent since the last command, so a session the
 * server ended while we were idle (its FATAL message, or the end of the
 * stream) is seen before a statement goes out.  A statement sent on such a
 * connection reached no live server; a lost connection after sending must
 * otherwise be taken as "commit unknown".  No round trip; in the common
 * case (nothing arrived) one system call: poll first, read only when the
 * socket is readable (a message, or the end of the stream).
 */
static int
idle_conn_alive(idem_pg *p)
{
	PGconn	   *c = p->conn;
	int			i;

	if (PQstatus(c) != CONNECTION_OK)
		return 0;
	/* also parses what libpq has buffered: a FATAL goes to the receiver */
	if (PQisBusy(c) || PQpipelineStatus(c) != PQ_PIPELINE_OFF)
		return 1;				/* not idle: not judged here */
	if (p->server_ended)
		return 0;
	for (i = 0; i < 4; i++)
	{
		struct pollfd pfd;

		pfd.fd = PQsocket(c);
		pfd.events = POLLIN;
		pfd.revents = 0;
		if (pfd.fd < 0)
			return 0;
		if (poll(&pfd, 1, 0) <= 0)
			return 1;			/* nothing to read: alive */
		if (!PQconsumeInput(c) || PQstatus(c) != CONNECTION_OK)
			return 0;			/* the end of the stream */
		(void) PQisBusy(c);		/* parses it: a FATAL goes to the receiver */
		if (p->server_ended)
			return 0;
	}
	return 1;
}

int
idemc_pg_alive(idem_pg *p)
{
	return p->conn != NULL && idle_conn_alive(p);
}

/*
 * Whether this connection may use named prepared statements.  A pooler in
 * transaction mode (pgbouncer) runs each transaction on any of its server
 * connections, where a statement prepared earlier may be missing, or
 * present under the same name from another client: only unnamed
 * statements are safe there.  A pooler gives the client its own cancel
 * key, so the backend pid libpq was told is not the server's.
 */
static int
use_named(const idem_pg *p, int server_pid)
{
	if (p->named_opt >= 0)
		return p->named_opt > 0;
	return server_pid == PQbackendPID(p->conn);
}

int
idemc_pg_ensure(idem_pg *p, int *fresh, char *msg, size_t msglen)
{
	char	   *quoted = NULL;
	int			rc = -1;

	*fresh = 0;
	if (p->conn && p->sql[0] && idle_conn_alive(p))
		return 0;
	idemc_pg_drop(p);
	*fresh = 1;
	p->connects++;
	p->conn = PQconnectdb(p->conninfo);
	if (p->conn == NULL)
	{
		copy_msg(msg, msglen, "PostgreSQL: ", "out of memory");
		return -1;
	}
	if (PQstatus(p->conn) != CONNECTION_OK)
	{
		copy_msg(msg, msglen, "PostgreSQL connection failed: ",
				 PQerrorMessage(p->conn));
		idemc_pg_drop(p);
		return -1;
	}
	p->server_ended = 0;
	PQsetNoticeReceiver(p->conn, notice_receiver, p);
	if (!PQregisterEventProc(p->conn, result_event, "idem_client", p))
	{
		copy_msg(msg, msglen, "PostgreSQL: ", "could not register the runner's event procedure");
		idemc_pg_drop(p);
		return -1;
	}
	if (p->trace)
	{
		PQtrace(p->conn, p->trace);
		PQsetTraceFlags(p->conn, PQTRACE_SUPPRESS_TIMESTAMPS);
	}
	if (p->schema_opt)
	{
		quoted = PQescapeIdentifier(p->conn, p->schema_opt,
									strlen(p->schema_opt));
		if (quoted == NULL)
			copy_msg(msg, msglen, "PostgreSQL: ", PQerrorMessage(p->conn));
	}
	else
	{
		PGresult   *r;

		p->round_trips++;
		r = PQexec(p->conn,
				   "SELECT (SELECT pg_catalog.quote_ident(n.nspname) "
				   "FROM pg_catalog.pg_extension e "
				   "JOIN pg_catalog.pg_namespace n ON n.oid = e.extnamespace "
				   "WHERE e.extname = 'idem'), pg_catalog.pg_backend_pid()");
		if (PQresultStatus(r) != PGRES_TUPLES_OK || PQntuples(r) != 1)
			copy_msg(msg, msglen, "PostgreSQL: looking up the idem extension: ",
					 PQresultErrorMessage(r));
		else if (PQgetisnull(r, 0, 0))
			copy_msg(msg, msglen, "",
					 "the extension idem is not installed in this database (CREATE EXTENSION idem)");
		else
		{
			quoted = strdup(PQgetvalue(r, 0, 0));
			if (quoted == NULL)
				copy_msg(msg, msglen, "", "out of memory");
			p->named = use_named(p, atoi(PQgetvalue(r, 0, 1)));
		}
		PQclear(r);
	}
	if (p->schema_opt && quoted != NULL && p->named_opt < 0)
	{
		PGresult   *r;

		p->round_trips++;
		r = PQexec(p->conn, "SELECT pg_catalog.pg_backend_pid()");
		if (PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) == 1)
			p->named = use_named(p, atoi(PQgetvalue(r, 0, 0)));
		PQclear(r);
	}
	else if (p->schema_opt)
		p->named = p->named_opt > 0;
	if (quoted != NULL)
	{
		if (build_sql(p, quoted) == 0)
			rc = 0;
		else
			copy_msg(msg, msglen, "", "out of memory");
		if (p->schema_opt)
			PQfreemem(quoted);
		else
			free(quoted);
	}
	if (rc != 0)
		idemc_pg_drop(p);
	return rc;
}

void
idemc_pg_outcome_clear(pg_outcome *o)
{
	int			i;

	for (i = 0; i < PG_MAX_CMDS; i++)
	{
		if (o->res[i])
			PQclear(o->res[i]);
		o->res[i] = NULL;
	}
}

static void
set_error(pg_outcome *out, const PGresult *r, PGconn *conn)
{
	const char *st = r ? PQresultErrorField(r, PG_DIAG_SQLSTATE) : NULL;
	const char *sev = r ? PQresultErrorField(r, PG_DIAG_SEVERITY_NONLOCALIZED) : NULL;

	if (out->message[0] != '\0')
		return;
	if (st)
		snprintf(out->sqlstate, sizeof(out->sqlstate), "%s", st);
	if (sev)
		snprintf(out->severity, sizeof(out->severity), "%s", sev);
	copy_msg(out->message, sizeof(out->message), "",
			 r ? PQresultErrorMessage(r) : PQerrorMessage(conn));
	if (out->message[0] == '\0')
		copy_msg(out->message, sizeof(out->message), "", PQerrorMessage(conn));
}

static void
lost(idem_pg *p, pg_outcome *out)
{
	set_error(out, NULL, p->conn);
	if (out->message[0] == '\0')
		snprintf(out->message, sizeof(out->message),
				 "connection to PostgreSQL lost");
	out->rc = PG_CONN_LOST;
	idemc_pg_drop(p);
}

/* one bit of idem_pg.prepared per statement and per first_sql slot */
typedef char prepared_bits_fit[STMT_COUNT + PG_FIRST_SLOTS <= 32 ? 1 : -1];

/* Names of the prepared statements, by pg_stmt; unlikely to meet a handler's. */
static const char *const stmt_names[STMT_COUNT] = {
	"idem_client_claim_t", "idem_client_claim_p",
	"idem_client_complete_t", "idem_client_complete_p",
	"idem_client_fail_t", "idem_client_fail_p",
	"idem_client_ttl_t", "idem_client_ttl_p",
	"idem_client_lookup_t", "idem_client_lookup_p",
	"idem_client_keyspace", "idem_client_secrets",
	"idem_client_apply_t", "idem_client_apply_p",
	"idem_client_emit", "idem_client_durable",
	"idem_client_begin", "idem_client_savepoint", "idem_client_release",
	"idem_client_rollback_to", "idem_client_commit"
};

/* The name of statement stmt (a pg_stmt, or STMT_COUNT + a first_sql slot). */
static const char *
stmt_name(int stmt, char *buf, size_t len)
{
	if (stmt < STMT_COUNT)
		return stmt_names[stmt];
	snprintf(buf, len, "idem_client_first_%d", stmt - STMT_COUNT);
	return buf;
}

/*
 * The statement that runs command c: its pg_stmt, STMT_COUNT + the
 * first_sql slot of a handler's first statement (a free slot is taken on
 * its first use), or -1 for an unnamed command.
 */
static int
stmt_of(idem_pg *p, const pg_cmd *c)
{
	int			i;

	if (c->first)
	{
		for (i = 0; i < PG_FIRST_SLOTS; i++)
		{
			if (p->first_sql[i] == NULL)
			{
				p->first_sql[i] = strdup(c->sql);
				if (p->first_sql[i] == NULL)
					return -1;
				p->first_nparams[i] = c->nparams;
				p->prepared &= ~(1u << (STMT_COUNT + i));
			}
			if (p->first_nparams[i] == c->nparams &&
				strcmp(p->first_sql[i], c->sql) == 0)
				return (p->first_unnamed & (1u << i)) ? -1 : STMT_COUNT + i;
		}
		return -1;				/* beyond the slots: unnamed */
	}
	for (i = 0; i < STMT_COUNT; i++)
		if (p->sql[i] == c->sql)
			return i;
	return -1;
}

/*
 * Read the result of a Parse sent ahead of command i: on success the
 * statement is prepared on this connection from now on.  0, or -1 when the
 * connection is gone.  A failed Parse's result goes to *failed (its
 * command's own result will only say the pipeline was aborted).
 */
static int
read_prepare(idem_pg *p, int stmt, int i, pg_outcome *out, PGresult **failed)
{
	PGresult   *r = PQgetResult(p->conn);
	PGresult   *extra;

	if (r == NULL)
		return -1;
	if (PQresultStatus(r) == PGRES_COMMAND_OK)
		p->prepared |= 1u << stmt;
	else if (PQstatus(p->conn) != CONNECTION_OK)
	{
		/* a lost connection is not a failed command */
		set_error(out, r, p->conn);
		PQclear(r);
		return -1;
	}
	else
	{
		const char *state = PQresultErrorField(r, PG_DIAG_SQLSTATE);

		/*
		 * Already there under our name (42P05): we lost track of it, not
		 * the server.  This run fails; the next pipeline re-reads which
		 * statements exist, instead of failing on this Parse for ever.
		 */
		if (state && strcmp(state, "42P05") == 0)
		{
			p->prepared |= 1u << stmt;
			p->resync = 1;
		}
		if (out->failed_cmd < 0)
			out->failed_cmd = i;
		if (PQresultStatus(r) != PGRES_PIPELINE_ABORTED)
		{
			set_error(out, r, p->conn);
			*failed = r;
			r = NULL;
		}
	}
	if (r)
		PQclear(r);
	while ((extra = PQgetResult(p->conn)) != NULL)
		PQclear(extra);
	return PQstatus(p->conn) == CONNECTION_OK ? 0 : -1;
}

/*
 * Which of our named statements the session holds, after a sign that we
 * lost track (a handler's DEALLOCATE of some or all of them): one query,
 * only then, and only between transactions (never inside a caller's); if
 * it fails, every statement is prepared again.
 */
static void
resync_prepared(idem_pg *p)
{
	PGresult   *r;
	unsigned	found = 0;
	char		name[32];
	int			i,
				j;

	if (PQtransactionStatus(p->conn) != PQTRANS_IDLE)
		return;
	p->round_trips++;
	r = PQexec(p->conn,
			   "SELECT name FROM pg_catalog.pg_prepared_statements"
			   " WHERE name LIKE 'idem\\_client\\_%'");
	if (PQresultStatus(r) == PGRES_TUPLES_OK)
	{
		for (i = 0; i < PQntuples(r); i++)
			for (j = 0; j < STMT_COUNT + PG_FIRST_SLOTS; j++)
				if (strcmp(PQgetvalue(r, i, 0),
						   stmt_name(j, name, sizeof(name))) == 0)
					found |= 1u << j;
	}
	p->prepared = found;
	p->resync = 0;
	PQclear(r);
}

static void
pipeline_run(idem_pg *p, const pg_cmd *cmds, int n, pg_outcome *out)
{
	PGconn	   *conn = p->conn;
	int			stmt[PG_MAX_CMDS];
	int			parse[PG_MAX_CMDS];
	char		name[32];
	int			i;

	memset(out, 0, sizeof(*out));
	out->failed_cmd = -1;
	if (conn == NULL || PQstatus(conn) != CONNECTION_OK)
	{
		lost(p, out);
		return;
	}
	if (p->resync && p->named)
	{
		resync_prepared(p);
		if (PQstatus(conn) != CONNECTION_OK)
		{
			lost(p, out);
			return;
		}
	}
	p->round_trips++;
	if (PQenterPipelineMode(conn) != 1)
	{
		lost(p, out);
		return;
	}
	for (i = 0; i < n; i++)
	{
		int			ok;

		stmt[i] = p->named ? stmt_of(p, &cmds[i]) : -1;
		parse[i] = stmt[i] >= 0 && !(p->prepared & (1u << stmt[i]));
		if (parse[i] &&
			PQsendPrepare(conn, stmt_name(stmt[i], name, sizeof(name)),
						  cmds[i].sql, cmds[i].nparams, NULL) != 1)
		{
			lost(p, out);
			return;
		}
		if (stmt[i] >= 0 && cmds[i].text_values)
			ok = PQsendQueryPrepared(conn, stmt_name(stmt[i], name, sizeof(name)),
									 cmds[i].nparams, cmds[i].text_values,
									 NULL, NULL, 0);
		else if (stmt[i] >= 0)
			ok = PQsendQueryPrepared(conn, stmt_name(stmt[i], name, sizeof(name)),
									 cmds[i].nparams, cmds[i].values,
									 cmds[i].lengths, cmds[i].formats, 0);
		else if (cmds[i].text_values)
			ok = PQsendQueryParams(conn, cmds[i].sql, cmds[i].nparams, NULL,
								   cmds[i].text_values, NULL, NULL, 0);
		else
			ok = PQsendQueryParams(conn, cmds[i].sql, cmds[i].nparams, NULL,
								   cmds[i].values, cmds[i].lengths,
								   cmds[i].formats, 0);
		if (ok != 1)
		{
			lost(p, out);
			return;
		}
		out->queued++;
	}
	if (PQpipelineSync(conn) != 1 || PQflush(conn) != 0)
	{
		lost(p, out);
		return;
	}
	for (i = 0; i < n; i++)
	{
		PGresult   *r;
		PGresult   *extra;
		PGresult   *parse_failed = NULL;
		ExecStatusType st;

		if (parse[i] && read_prepare(p, stmt[i], i, out, &parse_failed) != 0)
		{
			if (parse_failed)
				PQclear(parse_failed);
			lost(p, out);
			return;
		}
		r = PQgetResult(conn);
		if (r == NULL)
		{
			if (parse_failed)
				PQclear(parse_failed);
			lost(p, out);
			return;
		}
		if (parse_failed)
		{
			/* the command's result is the error of its Parse */
			PQclear(r);
			r = parse_failed;
		}
		st = PQresultStatus(r);
		out->res[i] = r;
		if (st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK)
			out->completed++;
		else
		{
			const char *state = PQresultErrorField(r, PG_DIAG_SQLSTATE);

			/* a lost connection is not a failed command */
			if (PQstatus(conn) != CONNECTION_OK)
			{
				set_error(out, r, conn);
				lost(p, out);
				return;
			}
			if (out->failed_cmd < 0)
				out->failed_cmd = i;
			if (st != PGRES_PIPELINE_ABORTED)
				set_error(out, r, conn);
			/*
			 * The handler deallocated this statement, and maybe others of
			 * ours: the next pipeline finds out which are left.
			 */
			if (stmt[i] >= 0 && state && strcmp(state, "26000") == 0)
			{
				p->prepared &= ~(1u << stmt[i]);
				p->resync = 1;
			}
			/*
			 * A handler's first statement whose result type a DDL changed
			 * ("cached plan must not change result type"): an unnamed
			 * statement would have run, so it is one from now on.
			 */
			if (stmt[i] >= STMT_COUNT && !parse_failed && state &&
				strcmp(state, "0A000") == 0)
			{
				p->first_unnamed |= 1u << (stmt[i] - STMT_COUNT);
				out->stale_first = 1;
			}
			if (PQstatus(conn) != CONNECTION_OK)
			{
				lost(p, out);
				return;
			}
		}
		/* each command's results end with a NULL */
		while ((extra = PQgetResult(conn)) != NULL)
		{
			if (PQresultStatus(extra) == PGRES_FATAL_ERROR)
			{
				/* an error after the command's rows: it failed after all */
				set_error(out, extra, conn);
				if (out->failed_cmd < 0 && PQstatus(conn) == CONNECTION_OK)
					out->failed_cmd = i;
			}
			PQclear(extra);
			if (PQstatus(conn) != CONNECTION_OK)
			{
				lost(p, out);
				return;
			}
		}
		if (PQstatus(conn) != CONNECTION_OK)
		{
			lost(p, out);
			return;
		}
	}
	{
		PGresult   *r = PQgetResult(conn);
		int			ok;

		/*
		 * An error at the Sync: the commit of an implicit transaction (a
		 * deferred constraint of one autocommit statement) failed.  Its
		 * answer counts as the last command's.
		 */
		while (r && PQresultStatus(r) == PGRES_FATAL_ERROR &&
			   PQstatus(conn) == CONNECTION_OK)
		{
			set_error(out, r, conn);
			if (out->failed_cmd < 0)
				out->failed_cmd = n - 1;
			PQclear(r);
			r = PQgetResult(conn);
			if (r == NULL)
				r = PQgetResult(conn);
		}
		ok = r && PQresultStatus(r) == PGRES_PIPELINE_SYNC;

		if (r)
			PQclear(r);
		if (!ok || PQexitPipelineMode(conn) != 1)
		{
			if (out->message[0] == '\0')
				snprintf(out->message, sizeof(out->message),
						 "unexpected PostgreSQL protocol state");
			lost(p, out);
			return;
		}
	}
	out->rc = out->failed_cmd >= 0 ? PG_SERVER_ERROR : PG_OK;
}

/*
 * A pipeline that starts a transaction on a durable connection
 * (idem_pg.durable) runs STMT_DURABLE first, in the same transaction: an
 * explicit one its BEGIN takes over, or the implicit one of autocommit
 * statements that lasts until the Sync.  The caller sees only its own
 * commands: their results, indexes and counts are as without it; should
 * the setting fail, the error is its first command's.
 */
void
idemc_pg_pipeline(idem_pg *p, const pg_cmd *cmds, int n, pg_outcome *out)
{
	pg_cmd		all[PG_MAX_CMDS];
	int			set_ok;

	if (!p->durable || n < 1 || n >= PG_MAX_CMDS || p->conn == NULL ||
		PQtransactionStatus(p->conn) != PQTRANS_IDLE)
	{
		pipeline_run(p, cmds, n, out);
		return;
	}
	memset(&all[0], 0, sizeof(all[0]));
	all[0].sql = p->sql[STMT_DURABLE];
	memcpy(&all[1], cmds, sizeof(pg_cmd) * n);
	pipeline_run(p, all, n + 1, out);
	set_ok = out->res[0] != NULL &&
		PQresultStatus(out->res[0]) == PGRES_TUPLES_OK;
	if (out->res[0])
		PQclear(out->res[0]);
	memmove(&out->res[0], &out->res[1], sizeof(PGresult *) * n);
	out->res[n] = NULL;
	if (out->failed_cmd > 0)
		out->failed_cmd--;
	if (set_ok && out->completed > 0)
		out->completed--;
	if (out->queued > 0)
		out->queued--;
}

int
idemc_pg_exec(idem_pg *p, const char *sql)
{
	PGresult   *r;
	int			ok;

	if (p->conn == NULL || PQstatus(p->conn) != CONNECTION_OK)
		return -1;
	p->round_trips++;
	r = PQexec(p->conn, sql);
	ok = PQresultStatus(r) == PGRES_COMMAND_OK;
	PQclear(r);
	if (PQstatus(p->conn) != CONNECTION_OK)
	{
		idemc_pg_drop(p);
		return -1;
	}
	return ok ? 0 : -1;
}
