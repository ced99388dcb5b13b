/*-------------------------------------------------------------------------
 *
 * idem_client.h
 *	  libidemclient: the idem runner, in C.
 *
 * Runs a handler exactly once per idempotency key over at-least-once
 * delivery: Valkey in front (a gate and a replay cache), PostgreSQL with the
 * idem extension as the source of truth, the key and the handler's effect
 * committed in one transaction.
 *
 *	  idem_runner *r = idem_runner_open("dbname=app", "127.0.0.1", 6379, NULL);
 *	  idem_result res;
 *
 *	  idem_result_init(&res);
 *	  idem_run(r, tenant_id, "billing.charge", run_id, request_json,
 *			   charge_handler, &ctx, &res);
 *	  switch (res.status) { case IDEM_APPLIED: ... case IDEM_BUSY: ... }
 *	  idem_runner_close(r);
 *
 * Rules, in the style of libpq and hiredis:
 *	- Handles are opaque; every call returns an explicit status; the library
 *	  never calls abort() or exit() and prints nothing itself (libpq's
 *	  default notice processor still prints server NOTICEs to stderr).
 *	- No global state.  A runner owns one PostgreSQL connection and one Valkey
 *	  connection and must be used by one thread at a time (the usual pattern:
 *	  one runner per worker thread).  Distinct runners are independent.
 *	- Either server may be down when the runner is opened or at any time
 *	  later: the runner reconnects on its next run.  Without Valkey it runs on
 *	  PostgreSQL alone (slower, still correct).
 *	- A Valkey crash never raises SIGPIPE: commands are sent with
 *	  send(MSG_NOSIGNAL).  Only while hiredis connects (its own writes) does
 *	  the calling thread block SIGPIPE and discard one raised meanwhile, as
 *	  libpq does; the process's signal handling is left alone otherwise.
 *	- The structs the caller allocates (idem_options, idem_result,
 *	  idem_runner_stats, idem_run_options) begin with struct_size: their
 *	  _init "function" is a macro that passes the library the size the
 *	  caller was compiled with (sizeof here), and the library reads and
 *	  writes only within it.  New fields are only ever added at the end,
 *	  and every size from the first layout on (0.3) is accepted: fields
 *	  beyond the caller's size take their defaults.  So a program built
 *	  against an older idem_client.h keeps working with a newer library of
 *	  the same soname.  Always call the _init macro before use.  (The
 *	  library still exports the _init functions that earlier headers
 *	  declared, which pass no size: they set up the first layout.)
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CLIENT_H
#define IDEM_CLIENT_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <libpq-fe.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * The version of this header: IDEM_CLIENT_VERSION_NUM is major * 10000 +
 * minor * 100 + patch (as PG_VERSION_NUM), for #if tests.
 * idem_client_version() returns the number of the library actually loaded.
 */
#define IDEM_CLIENT_VERSION		"0.4.0"
#define IDEM_CLIENT_VERSION_NUM	400
#define IDEM_DIGEST_BYTES		32
/* Longest outcome or failure detail: canonical JSON text, in bytes. */
#define IDEM_OUTCOME_MAX_BYTES	4096

typedef struct idem_runner idem_runner;

/* IDEM_CLIENT_VERSION_NUM of the library loaded at run time. */
int			idem_client_version(void);

/*
 * Options of a runner.  Initialise with idem_options_init() and change what
 * you need; a NULL idem_options * means all defaults.  The strings are copied
 * by idem_runner_open().  Options not initialised with idem_options_init()
 * (a struct_size below the first layout's, or absurd) make every run fail
 * with IDEM_ERR_ARGUMENT.
 */
typedef struct idem_options
{
	size_t		struct_size;	/* set by idem_options_init() */
	const char *schema;			/* schema of the extension; NULL: looked up
								 * in pg_extension at each connect */
	const char *valkey_prefix;	/* ignored since 0.3: the keyspace (the
								 * server's idem.valkey_prefix, cluster,
								 * timeline, database) comes from the server
								 * (idem_cache_keyspace()) */
	const char *valkey_password;	/* NULL or "": no AUTH */
	int			valkey_db;		/* SELECT this database when non-zero; a
								 * Valkey Cluster has only database 0: on
								 * one, another value keeps the cache off
								 * (the notice hook says why), and with
								 * valkey_cluster = 1 it is an invalid
								 * option */
	int			valkey_connect_timeout_ms;	/* default 200 */
	int			valkey_command_timeout_ms;	/* default 200 */
	int			valkey_retry_ms;	/* after a Valkey failure, go without it
									 * for this long (default 1000) */
	int			lease_ms;		/* claim lease, and the Valkey marker's TTL
								 * (default 30000) */
	int			retention_ms;	/* retention of results; 0 (default): the
								 * server's idem.retention */
	int			cache_results;	/* ignored since 0.3: only the server's
								 * worker writes results, once durable */
	FILE	   *pg_trace;		/* non-NULL: PQtrace() every connection to
								 * this stream (protocol debugging); it must
								 * stay open until idem_runner_close() */
	int			lookup_first;	/* 1 (default): when Valkey is configured
								 * but gives no answer (down), read the
								 * ledger with idem_lookup before claiming,
								 * so a duplicate costs one statement and
								 * no transaction (a new key one more round
								 * trip); 0: always claim directly.  A
								 * runner without Valkey always claims. */
	/*
	 * NULL, or called with what an operator should hear: that the runner
	 * runs without the Valkey cache and why -- Valkey does not answer, it
	 * refused AUTH or wants a password, it is not the Valkey the server's
	 * worker writes to (the epoch owner check), the role lacks EXECUTE on
	 * idem_cache_secrets() -- and when Valkey answers again.  A cause is
	 * told at once, then at most once a minute while it lasts (with how
	 * many times it happened meanwhile).  Called from within
	 * idem_runner_open() or a run, on its thread: it must not call the
	 * runner.
	 */
	void		(*notice) (void *arg, const char *message);
	void	   *notice_arg;
	const char *valkey_nodes;	/* Valkey Cluster: more nodes to try when
								 * valkey_host:valkey_port does not answer,
								 * "host:port,host:port" (an IPv6 address as
								 * "[::1]:port"); NULL: none */
	int			valkey_cluster; /* 0 (default): ask the node (INFO
								 * cluster); 1: a cluster; -1: not one */
	int			prepared_statements;	/* -1 (default): named prepared
										 * statements on a direct connection,
										 * none through a pooler (detected at
										 * connect: the backend pid libpq was
										 * given is not the server's, as
										 * behind pgbouncer); 1: always; 0:
										 * never (unnamed statements only,
										 * safe with transaction pooling) */
	int			secrets_max_age_ms; /* re-read the cache secrets from the
									 * server at least this often (one round
									 * trip), so that a secret rotated out
									 * there is soon not trusted here either
									 * and a cache epoch the server left is
									 * dropped even when the server cannot
									 * reach Valkey to retire it (default
									 * 5000); 0 or more than
									 * IDEM_SECRETS_MAX_AGE_MAX_MS: that
									 * maximum */
} idem_options;

/* The longest secrets_max_age_ms a runner uses (0 and more are capped). */
#define IDEM_SECRETS_MAX_AGE_MAX_MS 60000

void		idem_options_init(idem_options *opts);
/* (IDEMCLIENT_1.3) what the _init macro calls: struct_size is the
 * caller's sizeof */
void		idem_options_init_size(idem_options *opts, size_t struct_size);
#define idem_options_init(opts) idem_options_init_size((opts), sizeof(idem_options))

/*
 * Open a runner.  pg_conninfo is a libpq connection string; valkey_host NULL
 * means no Valkey at all.  Connects to both at once, but a server that is
 * down is not an error: the runner retries it on each run.  Returns NULL only
 * when memory is exhausted.  Invalid options make every run fail with
 * IDEM_ERROR and the message that idem_runner_error_message() shows.
 * Give pg_conninfo a connect_timeout (say connect_timeout=2): without one, a
 * PostgreSQL host that does not answer blocks a run until the OS gives up.
 * The role needs USAGE on the extension's schema and EXECUTE on idem_claim,
 * idem_complete, idem_fail, idem_lookup (and their idem_platform_ twins for
 * idem_run_platform), plus what the handlers do.  To use Valkey it also
 * needs EXECUTE on idem_cache_keyspace() and idem_cache_secrets(): the
 * runner learns the keyspace and the MAC secrets from the server on each
 * new connection (one round trip), again at least every secrets_max_age_ms,
 * and trusts no value in Valkey whose MAC does not verify.  Without that grant it runs on PostgreSQL alone and
 * tells the notice hook once.
 */
idem_runner *idem_runner_open(const char *pg_conninfo,
							  const char *valkey_host, int valkey_port,
							  const idem_options *opts);
void		idem_runner_close(idem_runner *runner);

/* Last error of the runner ("" if none); valid until the next call. */
const char *idem_runner_error_message(const idem_runner *runner);

/* ---------------------------------------------------------------------
 * Handlers
 * ---------------------------------------------------------------------
 */

/* What a handler returns. */
typedef enum idem_handler_status
{
	IDEM_HANDLER_OK = 0,		/* effect done; the JSON set is the outcome */
	IDEM_HANDLER_RETRYABLE = 1, /* failed, try again later; JSON = detail */
	IDEM_HANDLER_PERMANENT = 2	/* failed for good; JSON = detail */
} idem_handler_status;

/* The call a handler serves (valid only during the handler). */
typedef struct idem_call idem_call;

int			idem_call_attempt(const idem_call *call);	/* 1, 2, ... */
int			idem_call_is_platform(const idem_call *call);
int64_t		idem_call_tenant_id(const idem_call *call);
const char *idem_call_scope(const idem_call *call);
const char *idem_call_id(const idem_call *call);
/* The request, as canonical JSON text (what the fingerprint is taken of). */
const char *idem_call_request(const idem_call *call);
const uint8_t *idem_call_key(const idem_call *call);	/* 32 bytes */

/* The result of idem_run_options.first_sql (owned by the runner, valid
 * during the handler), or NULL when the run had none. */
const PGresult *idem_call_first_result(const idem_call *call);

/*
 * Set the outcome (IDEM_HANDLER_OK) or the failure detail (the failure
 * kinds): a JSON object whose canonical (jsonb) text is at most
 * IDEM_OUTCOME_MAX_BYTES.  The text is copied.  Not calling it means "{}".
 * An invalid value fails the attempt when the handler returns, as in
 * idem_apply: its writes roll back to the savepoint and the detail
 * {"message", "sqlstate"} is recorded, 22023 (not a JSON object) as
 * IDEM_FAILED_PERMANENT, 54000 (too long) as IDEM_FAILED_RETRYABLE.
 * Returns 0, or -1 when memory is exhausted.
 */
int			idem_call_set_json(idem_call *call, const char *json);

/*
 * A handler runs inside the run's transaction, after a SAVEPOINT: do the
 * effect with conn (blocking libpq calls; conn is not in pipeline mode) and
 * return.  It must not COMMIT, ROLLBACK or RELEASE the runner's savepoint; a
 * statement that fails is fine if the handler reports a failure (the runner
 * rolls back to the savepoint).  The effect commits together with the
 * outcome, or not at all.  A handler that ends the runner's transaction
 * anyway fails the run with IDEM_ERR_HANDLER_ENDED_TX.
 */
typedef idem_handler_status (*idem_handler_fn) (PGconn *conn,
												idem_call *call,
												void *user_data);

/*
 * (IDEMCLIENT_1.5) An outgoing message of this run: message_json (a JSON
 * document) for the Valkey stream named stream, recorded by the extension's
 * idem_emit in the run's transaction, so that it leaves when, and only
 * when, the effect commits.  The server's worker then publishes it as
 * XADD <stream> * id <message id> body <message>, at least once, the same
 * id on a repeat; the id is "<the run's key in lowercase hex>-<n>", n = 1,
 * 2, ... the order of the run's emits, so a run taken over or run again
 * emits the same ids.  The messages are sent with the completion (no round
 * trip of their own), only when the handler returns IDEM_HANDLER_OK: a
 * failure emits nothing.  Do not also call idem_emit in SQL in the same
 * run (the positions would interleave).  A SQL handler (sql_handler)
 * calls idem_emit itself.  Returns 0, or -1 with errno EINVAL (an empty
 * stream name, a name that is not UTF-8, a message that is not JSON) or
 * ENOMEM (the run then fails with IDEM_ERR_OUT_OF_MEMORY).  The role needs
 * EXECUTE on idem_emit; an emit the server refuses fails the run with
 * IDEM_ERR_SERVER, nothing committed.
 */
int			idem_call_emit(idem_call *call, const char *stream,
						   const char *message_json);

/* ---------------------------------------------------------------------
 * Runs
 * ---------------------------------------------------------------------
 */

typedef enum idem_status
{
	IDEM_APPLIED = 0,			/* the handler ran now; effect and outcome
								 * committed */
	IDEM_REPLAYED,				/* completed before: outcome is the stored
								 * result, the handler did not run */
	IDEM_BUSY,					/* another run holds the key; retry after
								 * retry_after_ms */
	IDEM_MISMATCH,				/* the key was used with another request
								 * (fingerprint); nothing changed */
	IDEM_FAILED_PERMANENT,		/* failed for good: now (source HANDLER) or
								 * before (a replay); outcome = detail */
	IDEM_FAILED_RETRYABLE,		/* the handler failed now and asked for a
								 * retry; committed as failed_retryable */
	IDEM_ERROR					/* no decision: see error_code / message;
								 * nothing was committed unless error_code is
								 * IDEM_ERR_COMMIT_UNKNOWN or
								 * IDEM_ERR_HANDLER_ENDED_TX */
} idem_status;

/* Where the decision came from. */
typedef enum idem_source
{
	IDEM_SOURCE_NONE = 0,
	IDEM_SOURCE_HANDLER,		/* the handler ran in this call */
	IDEM_SOURCE_VALKEY,			/* the gate or the cache (no PostgreSQL
								 * transaction was opened) */
	IDEM_SOURCE_POSTGRES		/* the ledger */
} idem_source;

typedef enum idem_error_code
{
	IDEM_ERR_NONE = 0,
	IDEM_ERR_ARGUMENT,			/* bad argument or option */
	IDEM_ERR_REQUEST_JSON,		/* request is not valid JSON (as jsonb) */
	IDEM_ERR_OUTCOME,			/* the handler's outcome/detail is not a JSON
								 * object of at most 4096 bytes */
	IDEM_ERR_HANDLER,			/* the handler broke the transaction */
	IDEM_ERR_CONNECTION,		/* PostgreSQL unreachable or connection lost
								 * before COMMIT was sent: nothing committed */
	IDEM_ERR_COMMIT_UNKNOWN,	/* a failure after COMMIT (or idem_apply)
								 * was sent -- a lost connection, a FATAL, a
								 * pooler's own error -- that does not prove
								 * a rollback: the effect and the key
								 * committed together or not at all, but
								 * which is unknown; redeliver (the ledger
								 * decides) */
	IDEM_ERR_SERVER,			/* PostgreSQL raised an error (sqlstate) */
	IDEM_ERR_PROTOCOL,			/* unexpected answer from PostgreSQL */
	IDEM_ERR_OUT_OF_MEMORY,
	IDEM_ERR_HANDLER_ENDED_TX	/* the handler ended the runner's
								 * transaction (COMMIT, ROLLBACK, COMMIT;
								 * BEGIN): its effect may have committed
								 * WITHOUT its key; a redelivery after the
								 * lease may run it again */
} idem_error_code;

/*
 * Filled by idem_run(); no allocation, nothing to free.  Initialise it once
 * with idem_result_init(); it can then serve any number of runs.  A result
 * not initialised (a struct_size below the first layout's, or absurd) is
 * not written: idem_run() returns
 * IDEM_ERROR and idem_runner_error_message() says why.
 */
typedef struct idem_result
{
	size_t		struct_size;	/* set by idem_result_init() */
	idem_status status;
	idem_source source;
	int			attempt;		/* attempt that produced the outcome, or this
								 * run's attempt; 0 if unknown */
	long		retry_after_ms; /* IDEM_BUSY: time left on the holder's lease */
	size_t		outcome_len;
	char		outcome[IDEM_OUTCOME_MAX_BYTES + 1];	/* canonical JSON text,
														 * NUL-terminated; ""
														 * when there is none */
	idem_error_code error_code;
	char		sqlstate[6];	/* IDEM_ERR_SERVER */
	char		error_message[512];
	int			valkey_used;	/* 1 if Valkey answered this run (or this
								 * idem_cached lookup), even "not there" */
} idem_result;

void		idem_result_init(idem_result *res);
/* (IDEMCLIENT_1.3) what the _init macro calls: struct_size is the
 * caller's sizeof */
void		idem_result_init_size(idem_result *res, size_t struct_size);
#define idem_result_init(res) idem_result_init_size((res), sizeof(idem_result))

/*
 * Run handler once for (task_scope, id) of tenant tenant_id (idem_run) or of
 * the platform ledger (idem_run_platform).  request_json is the request the
 * key stands for; its fingerprint tells a redelivery from a reuse of the key.
 * Returns out->status.
 */
idem_status idem_run(idem_runner *runner, int64_t tenant_id,
					 const char *task_scope, const char *id,
					 const char *request_json,
					 idem_handler_fn handler, void *user_data,
					 idem_result *out);
idem_status idem_run_platform(idem_runner *runner,
							  const char *task_scope, const char *id,
							  const char *request_json,
							  idem_handler_fn handler, void *user_data,
							  idem_result *out);

/*
 * Valkey alone, for callers that decide many tasks in one transaction of
 * their own (a batch): no PostgreSQL transaction, no marker, one GET.
 * Returns 1 with *out decided (IDEM_REPLAYED or IDEM_FAILED_PERMANENT,
 * source IDEM_SOURCE_VALKEY) when the cache holds this task's verified
 * terminal result for the same request; 0 when only PostgreSQL can decide
 * (nothing cached, a marker, another request, Valkey unavailable).
 */
int			idem_cached(idem_runner *runner, int64_t tenant_id,
						const char *task_scope, const char *id,
						const char *request_json, idem_result *out);
/*
 * idem_cached for n tenant tasks (parallel arrays) in one pipelined round
 * trip (one per node on a cluster).  Each out[i] must come from
 * idem_result_init; a decided one has source IDEM_SOURCE_VALKEY, the
 * others IDEM_SOURCE_NONE (valkey_used 1 if the key's node answered, 0 if
 * Valkey was not asked: down, resting, not configured).  Returns how many
 * were decided.
 */
int			idem_cached_many(idem_runner *runner, int n,
							 const int64_t *tenant_ids,
							 const char *const *task_scopes,
							 const char *const *ids,
							 const char *const *request_jsons,
							 idem_result *out);

/*
 * Options of one run (idem_run_with).  Initialise with
 * idem_run_options_init(); a NULL idem_run_options * means all defaults.
 */
typedef struct idem_run_options
{
	size_t		struct_size;	/* set by idem_run_options_init() */
	int			delivery_count; /* how many times the queue has delivered
								 * this message, this one included (SQS
								 * ApproximateReceiveCount, a Streams
								 * entry's delivery counter, ...); 0
								 * (default): unknown.  1: a first delivery,
								 * so no other run can have committed it:
								 * the Valkey gate is skipped (one round
								 * trip less) and the claim in PostgreSQL
								 * decides.  A duplicate flagged 1 by
								 * mistake is still answered exactly once
								 * (busy, replay or mismatch from the
								 * claim), only without the cache.  2 or
								 * more: as 0 (the gate's SET NX GET
								 * answers a stored result as a GET
								 * would, and writes nothing then). */
	const char *sql_handler;	/* non-NULL: the effect is this SQL function
								 * of the extension's idem_apply, named as
								 * a regprocedure ("public.charge(jsonb)"):
								 * (args jsonb) RETURNS jsonb, the outcome
								 * (an error it raises is recorded as a
								 * failure: see idem_apply).  The whole run
								 * is then one statement, one PostgreSQL
								 * round trip; the handler argument of
								 * idem_run_with may be NULL.  The role
								 * needs EXECUTE on idem_apply and on it. */
	const char *sql_args;		/* JSON text passed to sql_handler; NULL:
								 * the request */
	/*
	 * The C handler's first statement, sent in the claim's pipeline (BEGIN;
	 * claim; SAVEPOINT; this statement): one PostgreSQL round trip less for
	 * a handler that starts with a known statement.  NULL (default): none.
	 * It runs before the claim's answer is known, inside the run's
	 * savepoint: if the key is not ours (busy, replay, mismatch) the runner
	 * rolls back to the savepoint, so its effect is discarded and the
	 * handler is not called.  So it must have no effect outside the
	 * transaction (dblink, a sequence whose gaps matter), and it cannot use
	 * the attempt number.  Its parameters are text, first_nparams of
	 * them.  The handler reads its result with idem_call_first_result(); if
	 * it failed, the transaction is in error and the handler must report a
	 * failure.  Not with sql_handler.  Prepared per connection (the first
	 * 4 distinct texts; not through a pooler), like the runner's own.
	 */
	const char *first_sql;
	int			first_nparams;
	const char *const *first_params;
} idem_run_options;

void		idem_run_options_init(idem_run_options *opts);
/* (IDEMCLIENT_1.3) what the _init macro calls: struct_size is the
 * caller's sizeof */
void		idem_run_options_init_size(idem_run_options *opts, size_t struct_size);
#define idem_run_options_init(opts) idem_run_options_init_size((opts), sizeof(idem_run_options))

/* idem_run / idem_run_platform with options for this run (may be NULL). */
idem_status idem_run_with(idem_runner *runner, int64_t tenant_id,
						  const char *task_scope, const char *id,
						  const char *request_json,
						  const idem_run_options *run_opts,
						  idem_handler_fn handler, void *user_data,
						  idem_result *out);
idem_status idem_run_platform_with(idem_runner *runner,
								   const char *task_scope, const char *id,
								   const char *request_json,
								   const idem_run_options *run_opts,
								   idem_handler_fn handler, void *user_data,
								   idem_result *out);

const char *idem_status_name(idem_status status);	/* "applied", ... */

/* ---------------------------------------------------------------------
 * The start-up check (IDEMCLIENT_1.4), as libpq's PQping: is everything
 * the runner needs there, and as the server says?
 * ---------------------------------------------------------------------
 */

/* The first problem idem_runner_check() found, in the order it checks. */
typedef enum idem_check_status
{
	IDEM_CHECK_OK = 0,			/* all well (or Valkey not configured) */
	IDEM_CHECK_OPTIONS,			/* the runner's options are invalid */
	IDEM_CHECK_PG_UNREACHABLE,	/* no PostgreSQL connection */
	IDEM_CHECK_NO_EXTENSION,	/* idem is not installed in that database */
	IDEM_CHECK_CACHE_UNAVAILABLE,	/* the server gives no cache keyspace
									 * and secrets: the role lacks EXECUTE
									 * on idem_cache_secrets(), or the
									 * cache is not ready (55000) */
	IDEM_CHECK_VALKEY_UNREACHABLE,	/* Valkey does not answer */
	IDEM_CHECK_VALKEY_AUTH,		/* AUTH refused (WRONGPASS, or a password
								 * given to a Valkey without one), or
								 * wanted (NOAUTH) */
	IDEM_CHECK_VALKEY_REFUSED,	/* its setup refused otherwise (SCRIPT
								 * LOAD, SELECT, valkey_db on a cluster) */
	IDEM_CHECK_VALKEY_NOT_SERVERS	/* the epoch owner key does not hold the
									 * token idem_cache_secrets() names: not
									 * the Valkey the server's worker writes
									 * to (or it has not reached it yet) */
} idem_check_status;

typedef struct idem_check_report
{
	size_t		struct_size;	/* set by idem_check_report_init() */
	idem_check_status status;	/* the first problem, or IDEM_CHECK_OK */
	char		message[512];	/* that problem in words; "" when OK */
	int			pg_ok;			/* connected, and answered */
	char		extension_version[32];	/* idem's extversion; "" if not
										 * installed */
	long		pg_rtt_us;		/* one round trip to PostgreSQL; -1 unknown */
	int			valkey_configured;	/* a valkey_host was given */
	int			valkey_ok;		/* connected, AUTH and setup accepted */
	int			valkey_owner_ok;	/* the owner key holds the server's
									 * token */
	long		valkey_rtt_us;	/* one round trip to Valkey (the owner
								 * key's GET); -1 unknown */
} idem_check_report;

void		idem_check_report_init_size(idem_check_report *report,
										size_t struct_size);
#define idem_check_report_init(rep) idem_check_report_init_size((rep), sizeof(idem_check_report))

/*
 * Check now, without waiting out a rest: PostgreSQL reachable, the idem
 * extension installed (its version), the cache keyspace and secrets given
 * to the role, Valkey reachable with AUTH and its setup accepted, and the
 * epoch owner key there holding the token the server names (the same
 * Valkey as the server's worker), with the round trip time of each
 * server.  Fills *report (initialised with idem_check_report_init) and
 * returns its status.  Costs a few round trips and a new Valkey
 * connection: for start-up and health endpoints, not for every message.
 */
idem_check_status idem_runner_check(idem_runner *runner,
									idem_check_report *report);
const char *idem_check_status_name(idem_check_status status);	/* "ok", ... */
const char *idem_source_name(idem_source source);	/* "valkey", ... */

/*
 * Counters of a runner, for tests and monitoring.  Initialise with
 * idem_runner_stats_init(); idem_runner_get_stats() leaves a struct with a
 * wrong struct_size alone.
 */
typedef struct idem_runner_stats
{
	size_t		struct_size;	/* set by idem_runner_stats_init() */
	long		runs;
	long		pg_round_trips; /* waits for PostgreSQL, handler excluded */
	long		pg_connects;
	long		valkey_round_trips;
	long		valkey_connects;
	long		valkey_skipped; /* runs that went without Valkey */
	long		cache_rejected; /* values read from Valkey and ignored:
								 * malformed, idem1, a MAC that does not
								 * verify (forged, altered, moved to another
								 * key), an unknown key id, a marker claiming
								 * more than our lease */
	long		valkey_redirects;	/* Valkey Cluster: MOVED/ASK followed */
	long		valkey_map_refreshes;	/* slot maps read */
	long		valkey_node_errors; /* failed connects/exchanges with a node */
	long		gate_skipped_first; /* gates skipped for a first delivery
									 * (also counted in valkey_skipped) */
	/* since 0.4 */
	long		valkey_failures;	/* opens and exchanges of the gate that
									 * failed: Valkey down or stalled, AUTH
									 * refused or missing, its setup refused
									 * (each makes it rest valkey_retry_ms) */
	long		valkey_auth_failures;	/* of those: AUTH refused (WRONGPASS)
										 * or wanted (NOAUTH) */
	long		valkey_owner_mismatches;	/* lookups whose epoch owner key
											 * did not hold the server's
											 * token: nothing read trusted */
	long		valkey_not_servers; /* rests because it kept not holding
									 * it (3 s in a row): not the Valkey
									 * the server's worker writes to */
	long		notices;		/* messages given to the notice hook */
} idem_runner_stats;

void		idem_runner_stats_init(idem_runner_stats *stats);
/* (IDEMCLIENT_1.3) what the _init macro calls: struct_size is the
 * caller's sizeof */
void		idem_runner_stats_init_size(idem_runner_stats *stats, size_t struct_size);
#define idem_runner_stats_init(stats) idem_runner_stats_init_size((stats), sizeof(idem_runner_stats))
void		idem_runner_get_stats(const idem_runner *runner,
								  idem_runner_stats *out);

/* ---------------------------------------------------------------------
 * Consuming a Valkey stream through the runner (IDEMCLIENT_1.5)
 *
 * A consumer reads a stream that idem_emit's messages are published to
 * (entries "id <message id> body <message>") with a consumer group, runs
 * each message through the runner with its id as the run id and its body
 * as the request, and acknowledges it (XACK) only once its run is settled:
 * applied, replayed, failed permanently, or a mismatch (the id came with
 * another body).  A retryable failure, busy, or an error (the server's
 * state, a connection lost, a commit whose outcome is unknown) is not
 * acknowledged: the entry stays pending and comes back once it has been
 * idle claim_idle_ms (XAUTOCLAIM, by this consumer or another of the
 * group), which also takes over the entries of a consumer that died.  So
 * with the runner's exactly-once effects, the pipeline is exactly once.
 * An entry without an id or a body, or whose id or body is not
 * acceptable (not UTF-8, not JSON), is malformed: told to the notice
 * hook, copied to dead_letter_stream if one is set, and acknowledged (it
 * can never succeed).  On a Valkey Cluster the stream's slot routes every
 * command.  Uses a Valkey connection of its own; one thread at a time.
 * ---------------------------------------------------------------------
 */
typedef struct idem_consumer idem_consumer;

typedef struct idem_consumer_options
{
	size_t		struct_size;	/* set by idem_consumer_options_init() */
	const char *stream;			/* required */
	const char *group;			/* required: created (from the stream's
								 * first entry, MKSTREAM) if missing */
	const char *consumer;		/* required: this consumer's name in the
								 * group, one per live process */
	const char *task_scope;		/* required: the runs' scope */
	int64_t		tenant_id;		/* the runs' tenant ... */
	int			platform;		/* ... or 1: the platform ledger */
	idem_handler_fn handler;	/* the runs' handler (NULL with
								 * run_options->sql_handler) */
	void	   *user_data;
	const idem_run_options *run_options;	/* NULL: defaults; kept by
											 * pointer: it must outlive the
											 * consumer.  Its delivery_count
											 * 0 is 1 for a first read (the
											 * gate skipped) */
	int			count;			/* entries per read (default 10) */
	int			block_ms;		/* how long a read waits (default 1000) */
	int			claim_idle_ms;	/* take over entries pending this long
								 * (default 30000: a lease) */
	const char *dead_letter_stream; /* NULL: a malformed entry is only
									 * told and acknowledged */
	const char *valkey_password;	/* NULL: no AUTH */
	int			valkey_db;
	const char *valkey_nodes;	/* a cluster's other seeds, "h:p,h:p" */
	int			valkey_cluster; /* 0 ask (INFO cluster), 1 yes, -1 no */
	int			valkey_connect_timeout_ms;	/* default 200 */
	int			valkey_command_timeout_ms;	/* beyond block_ms; default
											 * 1000 */
	/* NULL, or told each malformed entry and each failed dead-letter
	 * copy (a Valkey that fails is a poll's -1 and its error message) */
	void		(*notice) (void *arg, const char *message);
	void	   *notice_arg;
	/* NULL, or called after each run with its entry's message id, its
	 * result, and whether the entry is acknowledged */
	void		(*settled) (void *arg, const char *message_id,
							const idem_result *res, int acked);
	void	   *settled_arg;
} idem_consumer_options;

void		idem_consumer_options_init_size(idem_consumer_options *opts,
											size_t struct_size);
#define idem_consumer_options_init(o) idem_consumer_options_init_size((o), sizeof(idem_consumer_options))

/* Counters of a consumer since it was opened. */
typedef struct idem_consumer_stats
{
	size_t		struct_size;	/* set by idem_consumer_stats_init() */
	long		read;			/* entries read (new, or taken over) */
	long		claimed;		/* of those, taken over (XAUTOCLAIM) */
	long		acked;			/* acknowledged */
	long		left_pending;	/* not acknowledged: they come back */
	long		malformed;
	long		dead_lettered;
	long		valkey_errors;	/* reads, claims, acks that failed */
} idem_consumer_stats;

void		idem_consumer_stats_init_size(idem_consumer_stats *stats,
										  size_t struct_size);
#define idem_consumer_stats_init(s) idem_consumer_stats_init_size((s), sizeof(idem_consumer_stats))

/*
 * A consumer for runner (which it uses, and which must outlive it) on the
 * Valkey at valkey_host:valkey_port.  Connects nothing yet.  NULL when
 * memory is exhausted; invalid options make every poll fail (-1, and
 * idem_consumer_error_message says why).
 */
idem_consumer *idem_consumer_open(idem_runner *runner, const char *valkey_host,
								  int valkey_port,
								  const idem_consumer_options *opts);
/*
 * One round: the entries idle for claim_idle_ms taken over (at most every
 * claim_idle_ms / 2), else a read of new entries waiting up to block_ms;
 * each run, then the settled ones acknowledged in one XACK.  Returns how
 * many entries it ran, or -1 when Valkey failed (after waiting block_ms,
 * so that a loop of polls does not spin): call it in a loop.
 */
int			idem_consumer_poll(idem_consumer *consumer);
const char *idem_consumer_error_message(const idem_consumer *consumer);
void		idem_consumer_get_stats(const idem_consumer *consumer,
									idem_consumer_stats *out);
void		idem_consumer_close(idem_consumer *consumer);

/* ---------------------------------------------------------------------
 * Keys, fingerprints, canonical JSON (no servers needed)
 * ---------------------------------------------------------------------
 */

/*
 * key = SHA-256( u32be(len scope) || scope || u32be(len id) || id ), lengths
 * in bytes: the same bytes as SQL idem_key(scope, id).  Both strings must be
 * valid UTF-8.  Returns 0, or -1 for invalid arguments.
 */
int			idem_key(const char *task_scope, const char *id,
					 uint8_t out[IDEM_DIGEST_BYTES]);

/*
 * fingerprint = SHA-256 of the canonical text of the JSON document: the same
 * bytes as SQL idem_fingerprint(json::jsonb).  Returns 0, or -1 if json is
 * not accepted by jsonb (errbuf, if given, says why).
 */
int			idem_fingerprint(const char *json, size_t len,
							 uint8_t out[IDEM_DIGEST_BYTES],
							 char *errbuf, size_t errbuflen);

/*
 * The text PostgreSQL prints for json::jsonb, byte for byte: keys
 * deduplicated (last wins) and sorted (shorter first, then bytewise),
 * separators ", " and ": ", strings re-escaped, numbers as numeric_out
 * prints them.  Returns a NUL-terminated malloc'd string (free it with
 * idem_free) and its length in *out_len, or NULL if json is invalid (errno
 * EINVAL) or memory is exhausted (errno ENOMEM); errbuf says why.  Nesting deeper than 512 levels is
 * refused (PostgreSQL's own limit depends on its stack).
 */
char	   *idem_json_canonical(const char *json, size_t len, size_t *out_len,
								char *errbuf, size_t errbuflen);
void		idem_free(void *ptr);

#ifdef __cplusplus
}
#endif

#endif							/* IDEM_CLIENT_H */
