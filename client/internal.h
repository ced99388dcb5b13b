/*
 * internal.h
 *	  Declarations shared by the files of libidemclient; not installed.
 *
 *	  Internal functions are idemc_*: only the public API bears idem_, in
 *	  the static library too (shared_names.h renames those of
 *	  ../src/common).
 *
 *	  Which file owns what: the source-layout table of ../CONTRIBUTING.md, the
 *	  one file map (test/harness/file_map.sh checks it against the
 *	  Makefile's OBJS).
 */
#ifndef IDEM_CLIENT_INTERNAL_H
#define IDEM_CLIENT_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "shared_names.h"
#include "idem_client.h"
#include "cache_format.h"
#include "sha256.h"

/* The public header's sizes are the server's (idem_client.h states them). */
_Static_assert(IDEM_OUTCOME_MAX_BYTES == IDEM_OUTCOME_MAX,
			   "idem_client.h's outcome limit is the server's");
_Static_assert(IDEM_DIGEST_LEN == 32, "idem_call_key() is stated as 32 bytes");

/* 1 if buf[0..len) is valid UTF-8 without NUL bytes (what PostgreSQL text
 * accepts in a UTF8 database). */
int			idemc_utf8_valid(const char *buf, size_t len);

/* Error strings: always NUL-terminated, truncated to fit (error.c). */
void		idemc_set_err(char *buf, size_t buflen, const char *fmt,...)
			__attribute__((format(printf, 3, 4)));

/* Monotonic milliseconds: the router's clock (src/common/valkey_wire.c). */
int64_t		idem_vc_now_ms(void);
#define idemc_now_ms idem_vc_now_ms
/* idem_vc_io.wait for the client's routers (valkey_conn.c): poll(), or sleep. */
int			idemc_vc_poll_wait(void *arg, int fd, int for_write, int64_t deadline);
/*
 * A router of the client's (valkey_conn.c; it connects nothing yet): the
 * gate's, or a stream consumer's.  Seeds host:port, then nodes
 * ("host:port,..." or NULL); cluster > 0 a Valkey Cluster, < 0 a single
 * Valkey, 0 INFO cluster decides (a cluster asked for with a db other
 * than 0 is asked all the same: idem_vc_open then says -2); blocking
 * reads, waited for with poll().  *opt holds the rest (password, db,
 * timeouts, retry, setup); the seeds, port, mode and reads are set here.
 * NULL with err set.
 */
struct idem_vc_options;
struct idem_vc *idemc_vc_client_new(const char *host, int port, const char *nodes,
									int cluster, struct idem_vc_options *opt,
									char *err, size_t errlen);

/* ---- the Valkey side: valkey_conn.c (the connections, on the shared
 * router), gate.c (the gate, lookups), release.c (compare-and-delete) ---- */

typedef struct idem_gate idem_gate;

typedef enum gate_answer
{
	GATE_SKIPPED = 0,			/* Valkey down, slow, or not configured */
	GATE_ACQUIRED,				/* our marker is set */
	GATE_VALUE,					/* a value exists: value/len */
	GATE_ABSENT					/* GET: the node answered, no such key */
} gate_answer;

typedef struct gate_reply
{
	gate_answer answer;
	char	   *value;			/* GATE_VALUE: malloc'd, NUL-terminated */
	size_t		value_len;
	int			checked;		/* GATE_CHECK_*: what the check key held */
} gate_reply;

/* The check key (gate_reply.checked): */
#define GATE_CHECK_HOLDS	1	/* the check value */
#define GATE_CHECK_ABSENT	0	/* nothing (nil) */
#define GATE_CHECK_OTHER	(-1)	/* another value */
#define GATE_CHECK_NOREPLY	(-2)	/* its node did not answer */

idem_gate  *idemc_gate_new(const char *host, int port, const char *password,
						  int db, int connect_timeout_ms,
						  int command_timeout_ms, int retry_ms);
void		idemc_gate_free(idem_gate *g);
/* After a failure, within retry_ms: every call skips Valkey at once. */
int			idemc_gate_resting(const idem_gate *g);

/*
 * What is wrong with the gate's Valkey, as the gate and the owner check
 * report it to the runner (health.c tells the notice hook).
 */
typedef enum valkey_problem
{
	VALKEY_OK = 0,				/* it answered: a problem told is over */
	VALKEY_DOWN,				/* no connection, or no answer in time */
	VALKEY_AUTH,				/* AUTH refused (WRONGPASS), or NOAUTH */
	VALKEY_REFUSED,				/* the setup refused otherwise (SCRIPT
								 * LOAD, SELECT) */
	VALKEY_CONFIG,				/* valkey_db on a cluster */
	VALKEY_NOT_SERVERS,			/* the epoch owner key does not hold the
								 * token the server names */
	VALKEY_PROBLEMS
} valkey_problem;

typedef void (*gate_report_fn) (void *arg, valkey_problem problem,
								const char *why);

/* The gate tells report what goes wrong with its Valkey (and when it
 * answers again). */
void		idemc_gate_set_report(idem_gate *g, gate_report_fn report, void *arg);
/* Leave Valkey alone for ms (it is not the server's). */
void		idemc_gate_rest(idem_gate *g, int ms);
/* "host:port" of the gate's first node. */
const char *idemc_gate_endpoint(const idem_gate *g);
int			idemc_gate_retry_ms(const idem_gate *g);
/* Open now even when resting (the start-up check).  0, or -1 with the
 * problem and why. */
int			idemc_gate_open_now(idem_gate *g, valkey_problem *problem,
							   char *why, size_t whylen);
/* GET key now (the start-up check): 1 a value (copied into buf), 0 nil,
 * -1 no answer or an error reply (why says it). */
int			idemc_gate_get_now(idem_gate *g, const char *key, char *buf,
							  size_t buflen, char *why, size_t whylen);
/* One round trip: SET key marker NX PX lease_ms GET (the value if one
 * exists, else our marker is set; lease_ms in decimal), and GET check_key
 * (the epoch owner key; NULL: none): out->checked says whether it held
 * exactly check_value (GATE_CHECK_*). */
void		idemc_gate_enter(idem_gate *g, const char *key, const char *marker,
							const char *lease_ms, const char *check_key,
							const char *check_value, gate_reply *out);
/* GET of n keys and of check_key in one pipeline (per node on a cluster),
 * no marker: out[i] GATE_VALUE, GATE_ABSENT (nil), or GATE_SKIPPED;
 * *checked as out->checked above. */
void		idemc_gate_get_many(idem_gate *g, const char *const *keys, int n,
							   const char *check_key, const char *check_value,
							   gate_reply *out, int *checked);
/* Compare-and-delete of our marker (script).  Returns 1 deleted, 0 not,
 * -1 Valkey unavailable. */
int			idemc_gate_release(idem_gate *g, const char *key,
							  const char *marker);
/* Why Valkey cannot be used as configured (the gate stays off), or NULL. */
const char *idemc_gate_config_error(const idem_gate *g);
/* Counters. */
long		idemc_gate_round_trips(const idem_gate *g);
long		idemc_gate_connects(const idem_gate *g);
/* Try to connect now (used at open). */
void		idemc_gate_connect(idem_gate *g);
/* Valkey Cluster: more seed nodes ("host:port,..."), mode 0 auto, 1 on,
 * -1 off.  Before the first connect.  0, or -1 out of memory. */
int			idemc_gate_set_cluster(idem_gate *g, const char *nodes, int mode);
void		idemc_gate_cluster_stats(const idem_gate *g, long *redirects,
									long *refreshes, long *node_errors);

/* ---- pg.c: the PostgreSQL side ---- */

/* Each statement of the tenant ledger is followed by its platform twin. */
typedef enum pg_stmt
{
	STMT_CLAIM_T = 0, STMT_CLAIM_P,
	STMT_COMPLETE_T, STMT_COMPLETE_P,
	STMT_FAIL_T, STMT_FAIL_P,
	STMT_TTL_T, STMT_TTL_P,
	STMT_LOOKUP_T, STMT_LOOKUP_P,
	STMT_KEYSPACE, STMT_SECRETS,	/* trust.c: what the cache may be */
	STMT_APPLY_T, STMT_APPLY_P, /* idem_apply: a run with a SQL handler */
	STMT_EMIT_T, STMT_EMIT_P,	/* idem_emit: a C handler's messages (emit.c) */
	STMT_DURABLE,				/* synchronous_commit at least on, for this
								 * transaction (idem_pg.durable) */
	/* the runner's transaction control, prepared like the rest */
	STMT_BEGIN, STMT_SAVEPOINT, STMT_RELEASE, STMT_ROLLBACK_TO, STMT_COMMIT,
	STMT_COUNT
} pg_stmt;

/*
 * A handler's first statement (idem_run_options.first_sql) is prepared too,
 * under a name of its own per distinct text and parameter count, for the
 * first PG_FIRST_SLOTS texts a connection meets; further texts stay
 * unnamed.  Its prepared bit is STMT_COUNT + slot.
 */
#define PG_FIRST_SLOTS 4

typedef struct idem_pg
{
	char	   *conninfo;
	char	   *schema_opt;		/* NULL: look it up */
	FILE	   *trace;
	PGconn	   *conn;
	char	   *sql[STMT_COUNT];	/* built at connect, schema-qualified */
	unsigned	prepared;		/* bit per pg_stmt prepared on this conn,
								 * then per first_sql slot */
	char	   *first_sql[PG_FIRST_SLOTS];	/* texts met on this conn */
	int			first_nparams[PG_FIRST_SLOTS];
	unsigned	first_unnamed;	/* bit per slot: its plan went stale (the
								 * result type changed): unnamed from now */
	int			resync;			/* a statement of ours was missing, or one
								 * we meant to prepare was there: re-read
								 * which exist before the next pipeline */
	int			named_opt;		/* idem_options.prepared_statements */
	int			named;			/* this connection uses named statements */
	int			server_ended;	/* a FATAL arrived: this session is over */
	int			durable;		/* each transaction a pipeline starts on
								 * the idle connection runs STMT_DURABLE
								 * first: its commit, and a replay it
								 * answers, are durable when answered (the
								 * stream consumer's runs, consume.c) */
	int			watching;		/* a handler runs: its errors are seen */
	char		handler_sqlstate[6];	/* the first error of the server's
										 * state (idemc_error_is_servers)
										 * a handler's statement met; "" */
	char		handler_message[200];	/* ... its message */
	char		handler_last_sqlstate[6];	/* the last error a handler's
											 * statement met, but 25P02 (the
											 * one that aborted its
											 * transaction); "" */
	char		handler_last_message[200];	/* ... its message */
	long		round_trips;
	long		connects;
} idem_pg;

/*
 * One command of a pipeline: SQL text (NULL-free) and parameters.  A
 * command whose sql is one of idem_pg.sql[] runs as a named prepared
 * statement, prepared in the same pipeline the first time.
 */
typedef struct pg_cmd
{
	const char *sql;
	int			nparams;
	const char *values[6];
	int			lengths[6];
	int			formats[6];
	const char *const *text_values; /* non-NULL: nparams text parameters,
									 * instead of values[] */
	int			first;			/* a handler's first statement: prepared
								 * in a first_sql slot when one is free */
} pg_cmd;

#define PG_MAX_CMDS 6

typedef enum pg_rc
{
	PG_OK = 0,
	PG_SERVER_ERROR,			/* a command failed; res[] has its error */
	PG_CONN_LOST				/* connection lost; the conn is closed */
} pg_rc;

typedef struct pg_outcome
{
	pg_rc		rc;
	int			failed_cmd;		/* index of the first failed command, or -1 */
	int			completed;		/* commands with a successful result */
	int			queued;			/* commands handed to libpq (perhaps sent) */
	PGresult   *res[PG_MAX_CMDS];
	char		sqlstate[6];
	char		severity[10];	/* of that error: ERROR, FATAL, PANIC; "" if
								 * none arrived (only a lost connection) */
	char		message[400];
	int			stale_first;	/* a prepared first statement failed as its
								 * plan went stale: unnamed from now on,
								 * worth sending again */
} pg_outcome;

void		idemc_pg_init(idem_pg *p);
void		idemc_pg_close(idem_pg *p);
/* Connect if needed (and look up the schema).  0, or -1 with msg set;
 * *fresh says whether a new connection was made. */
int			idemc_pg_ensure(idem_pg *p, int *fresh, char *msg, size_t msglen);
/* Whether the idle connection is still alive: what the server sent since
 * the last command is read without blocking (a FATAL, the end of the
 * stream), no round trip.  1 alive, 0 ended. */
int			idemc_pg_alive(idem_pg *p);
/* Send cmds as one pipeline with one Sync: one round trip. */
void		idemc_pg_pipeline(idem_pg *p, const pg_cmd *cmds, int n,
							 pg_outcome *out);
void		idemc_pg_outcome_clear(pg_outcome *o);
/* An error that is the server's state, not a handler's answer: classes
 * 40 (serialization failure, deadlock), 53, 57 (a shutdown; of the
 * cancels, 57014, an operator's only: statement_timeout's is the
 * handler's attempt), 58 and XX, as idem_apply judges them.  message: the
 * error's primary message. */
int			idemc_error_is_servers(const char *sqlstate, const char *message);
/* A timeout's cancel: statement_timeout's 57014 (not an operator's) or
 * lock_timeout's 55P03, the handler's attempt. */
int			idemc_error_is_timeout(const char *sqlstate, const char *message);
/* The error a handler's statement (or its first statement) met, seen by
 * the runner (idem_pg.handler_sqlstate, .handler_last_sqlstate). */
void		idemc_pg_handler_error(idem_pg *p, const char *sqlstate,
								   const char *message);
/* Watch the errors of the handler's statements (on) until off. */
void		idemc_pg_watch_handler(idem_pg *p, int on);
/* Simple statement (ROLLBACK, COMMIT): one round trip.  0 ok, -1 failed. */
int			idemc_pg_exec(idem_pg *p, const char *sql);
void		idemc_pg_drop(idem_pg *p);

/* ---- trust.c: keyspace, secrets, value verification ---- */

#define IDEM_TRUST_MAX_KEYS 4

typedef enum trust_state
{
	TRUST_UNKNOWN = 0,			/* not learnt on this connection yet */
	TRUST_READY,				/* keyspace and secrets known */
	TRUST_DENIED				/* no cache: not granted, or too old a server */
} trust_state;

typedef enum trust_verdict
{
	TRUST_VALUE_OK = 0,			/* authentic and current */
	TRUST_VALUE_EXPIRED,		/* authentic but past its deadline (or a
								 * marker claiming more than our lease) */
	TRUST_VALUE_BAD				/* malformed, forged, moved, unknown key id */
} trust_verdict;

typedef struct idem_trust
{
	trust_state state;
	char		keyspace[IDEM_CACHE_KEYSPACE_MAX + 1];
	struct
	{
		int32_t		key_id;
		idem_hmac	hmac;
	}			keys[IDEM_TRUST_MAX_KEYS];
	int			nkeys;
	int			current;		/* index into keys of the current secret */
	long		learnt_at_connect;	/* idem_pg.connects when learnt */
	int64_t		learnt_ms;		/* monotonic */
	int			refresh_wanted; /* met an unknown key id, or the owner
								 * key did not hold owner_token */
	int			owner_suspect;	/* ...the latter held another value: no
								 * cache until learnt */
	int			owner_relearnt; /* learnt at once after a mismatch, and no
								 * check passed since: the next waits the
								 * second */
	char		owner_key[IDEM_CACHE_EPOCH_KEY_MAX];	/* the epoch's owner key */
	char		owner_token[IDEM_CACHE_EPOCH_TOKEN_LEN + 1];	/* it holds */
	long		owner_mismatches;	/* lookups whose owner check failed */
	int			max_age_ms;		/* re-learn at least this often
								 * (idemc_trust_max_age) */
	long		rejected;		/* values ignored: failed verification */
} idem_trust;

int64_t		idemc_wall_ms(void);
void		idemc_trust_init(idem_trust *t);
void		idemc_trust_clear(idem_trust *t);
int			idemc_trust_stale(const idem_trust *t, const idem_pg *pg);
int			idemc_trust_max_age(int option_ms);
trust_state idemc_trust_learn(idem_trust *t, idem_pg *pg, char *msg,
							 size_t msglen);
/* The owner key did not hold our token in a lookup's round trip
 * (GATE_CHECK_ABSENT or _OTHER): trust nothing read in it, and learn
 * again; if it held another value (the epoch was retired or taken), no
 * cache until then. */
void		idemc_trust_owner_mismatch(idem_trust *t, int checked);
/* ... and it did. */
void		idemc_trust_owner_ok(idem_trust *t);
trust_verdict idemc_trust_check(idem_trust *t, const char *key,
							   const char *value, size_t len, int lease_ms,
							   IdemCacheEntry *e);
int			idemc_trust_marker(idem_trust *t, const char *key, int lease_ms,
							  const uint8_t token[IDEM_TOKEN_LEN], char *buf,
							  size_t buflen);

/* ---- the runner: lifecycle.c opens and closes it, runner.c runs it ---- */

/*
 * The caller-allocated structs start with struct_size: the caller's sizeof,
 * passed by the _init macros of idem_client.h.  Every size from the first
 * layout with struct_size (0.3) on is accepted, also one larger than ours
 * (a program built against a newer header): the library reads and writes
 * only the first min(struct_size, sizeof) bytes, and fields beyond the
 * caller's size take their defaults.  A size below the first layout, out
 * of bounds or misaligned is refused: most likely the struct was never
 * initialised.
 *
 * IDEM_SIZE_THROUGH(type, member): the sizeof a struct of type's fields up
 * to member had (its tail padded to the struct's alignment).
 */
#define IDEM_SIZE_THROUGH(type, member) \
	((offsetof(type, member) + sizeof(((type *) 0)->member) + \
	  _Alignof(type) - 1) / _Alignof(type) * _Alignof(type))
/* the first layouts: 0.3's first header with struct_size */
#define IDEM_OPTIONS_SIZE_MIN	IDEM_SIZE_THROUGH(idem_options, prepared_statements)
#define IDEM_RESULT_SIZE_MIN	IDEM_SIZE_THROUGH(idem_result, valkey_used)
#define IDEM_STATS_SIZE_MIN		IDEM_SIZE_THROUGH(idem_runner_stats, valkey_node_errors)
#define IDEM_RUN_OPTIONS_SIZE_MIN IDEM_SIZE_THROUGH(idem_run_options, sql_args)
/* 0.4's first layout of the start-up check's report */
#define IDEM_CHECK_REPORT_SIZE_MIN IDEM_SIZE_THROUGH(idem_check_report, valkey_rtt_us)
#define IDEM_STRUCT_SIZE_MAX	65536
#define IDEM_STRUCT_SIZE_OK(size, min) \
	((size) >= (min) && (size) <= IDEM_STRUCT_SIZE_MAX && \
	 (size) % _Alignof(size_t) == 0)
#define IDEM_MIN_SIZE(a, b)		((a) < (b) ? (a) : (b))

/* Each such struct starts with its size_t struct_size. */
_Static_assert(offsetof(idem_options, struct_size) == 0, "struct_size first");
_Static_assert(offsetof(idem_result, struct_size) == 0, "struct_size first");
_Static_assert(offsetof(idem_run_options, struct_size) == 0, "struct_size first");
_Static_assert(offsetof(idem_runner_stats, struct_size) == 0, "struct_size first");
_Static_assert(offsetof(idem_check_report, struct_size) == 0, "struct_size first");

/*
 * The body of every *_init_size(): a size IDEM_STRUCT_SIZE_OK refuses (or a
 * NULL struct) writes nothing; otherwise the caller's size bytes are zeroed,
 * the defaults (NULL: all zero; a struct of our layout, dsize bytes) copied
 * within them, and struct_size set to the caller's size.
 */
static inline void
idemc_struct_init(void *p, size_t size, size_t min, const void *defaults,
				  size_t dsize)
{
	if (p == NULL || !IDEM_STRUCT_SIZE_OK(size, min))
		return;
	memset(p, 0, size);
	if (defaults != NULL)
		memcpy(p, defaults, IDEM_MIN_SIZE(size, dsize));
	memcpy(p, &size, sizeof(size));
}

/*
 * A full struct of our layout (fsize bytes) copied into the caller's, whose
 * struct_size is already checked: only within the caller's size (what lies
 * beyond ours stays as the caller's init left it), struct_size kept.
 */
static inline void
idemc_struct_copy_out(void *out, const void *full, size_t fsize)
{
	size_t		size;

	memcpy(&size, out, sizeof(size));
	memcpy(out, full, IDEM_MIN_SIZE(size, fsize));
	memcpy(out, &size, sizeof(size));
}

struct idem_runner
{
	idem_pg		pg;
	idem_gate  *gate;			/* NULL: no Valkey */
	idem_trust	trust;			/* keyspace and secrets (trust.c) */
	void		(*notice) (void *arg, const char *message);
	void	   *notice_arg;
	int			cache_off_said; /* the "running without the cache" notice */
	struct
	{
		valkey_problem said;	/* the problem last told, not yet over */
		int64_t		told_at[VALKEY_PROBLEMS];	/* monotonic ms; 0: never */
		long		untold[VALKEY_PROBLEMS];	/* times since told */
		int64_t		owner_bad_since;	/* the first of the failed owner
										 * checks in a row; 0: none */
		int64_t		owner_bad_last; /* the last of them */
	}			health;			/* health.c */
	int			lease_ms;
	int			retention_ms;
	char		lease_txt[32];	/* "<lease_ms> milliseconds" */
	char		lease_ms_txt[16];	/* "<lease_ms>": the gate's PX */
	char		retention_txt[32];	/* "<retention_ms> milliseconds", or "" */
	int			lookup_first;	/* option; cleared if idem_lookup is refused */
	int			gate_new_streak;	/* gates in a row that set our marker
									 * (run_full: no gate past
									 * IDEM_NEW_KEYS_NO_GATE_AFTER) */
	int			broken;			/* invalid options: every run fails */
	uint64_t	token_counter;	/* markers made since token_base */
	uint8_t		token_base[IDEM_TOKEN_LEN];	/* random, per runner and fork */
	uint64_t	token_fork_gen; /* fork generation token_base was drawn in;
								 * 0: not drawn yet */
	char		errmsg[512];
	idem_runner_stats stats;
};

/* health.c: what the runner says about Valkey.  The gate's report
 * function (arg: the runner); the owner check of a lookup (GATE_CHECK_*);
 * a message for the notice hook, counted. */
void		idemc_health_report(void *arg, valkey_problem problem,
								const char *why);
void		idemc_health_owner(idem_runner *r, int checked);
void		idemc_runner_notice(idem_runner *r, const char *message);

/* A handler's view of its run (filled by pg_step(), read through the
 * idem_call_* accessors). */
struct idem_call
{
	int			attempt;
	int			is_platform;
	int64_t		tenant_id;
	const char *scope;
	const char *id;
	const char *request;
	const uint8_t *key;
	char	   *json;
	int			oom;
	PGresult   *first;			/* run option first_sql's result, or NULL */
	char	   *emits;			/* idem_call_emit's messages, a JSON array
								 * of [stream, message] (emit.c), or NULL */
	size_t		emits_len;
	size_t		emits_cap;
	int			nemits;
};

/* The keyspace and secrets are known and current: the cache may be used
 * (learns them if stale; lifecycle.c). */
int			idemc_runner_trust_ready(idem_runner *r);

/* A caller's result: 0 if its struct_size is one we accept, else -1 and the
 * runner's message says why. */
int			idemc_result_size_ok(idem_runner *r, const idem_result *out);
/* Copy a result of our size into the caller's, within its struct_size. */
void		idemc_result_copy_out(idem_result *out, const idem_result *full);

/* Copy an outcome (at most IDEM_OUTCOME_MAX_BYTES) into a result. */
void		idemc_result_set_outcome(idem_result *out, const char *text, size_t len);

/* A trusted terminal value from Valkey as the result: a replay, or the
 * permanent failure. */
void		idemc_result_from_cache(idem_result *out, const IdemCacheEntry *e);

#endif
