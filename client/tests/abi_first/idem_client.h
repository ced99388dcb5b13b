/*-------------------------------------------------------------------------
 *
 * idem_client.h -- FROZEN: the header of 6afac70, the first with
 *	  struct_size, kept unchanged for tests/abi_first.c (a program built
 *	  against it must keep working with this library).  Never edit.
 *
 * idem_client.h
 *	  libidemclient: the GatedIdempotencyRunner of idem, in C.
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
 *	  idem_runner_stats) begin with struct_size, set by their _init
 *	  function, which the library checks: new fields are only ever added at
 *	  the end, so a program built against an older idem_client.h keeps
 *	  working with a newer library of the same soname.  Always call the
 *	  _init function before use.
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
#define IDEM_CLIENT_VERSION		"0.3.0"
#define IDEM_CLIENT_VERSION_NUM	300
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
 * (a wrong struct_size) make every run fail with IDEM_ERR_ARGUMENT.
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
	int			valkey_db;		/* SELECT this database when non-zero */
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
	 * NULL, or called (rarely, never more than once per cause) with what an
	 * operator should hear: that the runner runs without the Valkey cache
	 * and why (say the role lacks EXECUTE on idem_cache_secrets()).
	 */
	void		(*notice) (void *arg, const char *message);
	void	   *notice_arg;
	const char *valkey_nodes;	/* Valkey Cluster: more nodes to try when
								 * valkey_host:valkey_port does not answer,
								 * "host:port,host:port"; NULL: none */
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
} idem_options;

void		idem_options_init(idem_options *opts);

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
 * new connection (one round trip) and trusts no value in Valkey whose MAC
 * does not verify.  Without that grant it runs on PostgreSQL alone and
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

/*
 * Set the outcome (IDEM_HANDLER_OK) or the failure detail (the failure
 * kinds): a JSON object whose canonical (jsonb) text is at most
 * IDEM_OUTCOME_MAX_BYTES.  The text is copied.  Not calling it means "{}".
 * An invalid value is reported when the handler returns: the run then ends
 * with IDEM_ERROR / IDEM_ERR_OUTCOME and nothing is committed.  Returns 0,
 * or -1 when memory is exhausted.
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
	IDEM_ERR_COMMIT_UNKNOWN,	/* connection lost after COMMIT was sent:
								 * the effect and the key committed together
								 * or not at all, but which is unknown;
								 * redeliver (the ledger decides) */
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
 * not initialised (a wrong struct_size) is not written: idem_run() returns
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
	int			valkey_used;	/* 1 if the Valkey gate answered this run */
} idem_result;

void		idem_result_init(idem_result *res);

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

const char *idem_status_name(idem_status status);	/* "applied", ... */
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
} idem_runner_stats;

void		idem_runner_stats_init(idem_runner_stats *stats);
void		idem_runner_get_stats(const idem_runner *runner,
								  idem_runner_stats *out);

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
