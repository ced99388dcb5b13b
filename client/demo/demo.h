/*
 * demo.h
 *	  The main job of idem (make demo): a Valkey Streams queue delivering
 *	  money transfers at least once to K worker processes, each running its
 *	  handler through an idem runner, while chaos is injected; each transfer
 *	  also emits a notification that a second stage of consumers applies;
 *	  then a check, from PostgreSQL, that every effect of both stages
 *	  happened exactly once.
 *
 *	  main.c      options, setup, the parent's loop (reaping, progress, end)
 *	  shared.c    what the processes share: counters, last error, clock, runner
 *	  queue.c     Valkey Streams: XADD, XREADGROUP, XAUTOCLAIM, XACK, XPENDING
 *	  workload.c  the plan (tasks, duplicates), the schema, the handlers
 *	  worker.c    one worker process: read, run through the runner, ack
 *	  batch.c     a batch of new messages in one transaction (batch API)
 *	  notices.c   stage two: consumers of the transfers' notifications
 *	  chaos.c     kill -9 workers and consumers, restart/FLUSHALL the cache,
 *	              kill backends, kill -9 the server's idem worker/publisher
 *	  misses.c    why a replay missed Valkey (buckets for the report)
 *	  report.c    progress line, final report, the exactly-once check
 */
#ifndef IDEM_DEMO_H
#define IDEM_DEMO_H

#include <stdint.h>
#include <sys/types.h>

#include <libpq-fe.h>
#include "idem_client.h"

#define DEMO_MAX_WORKERS 64

typedef enum demo_kind
{
	KIND_TRANSFER = 0,			/* transfer.create, keyed by the run_id */
	KIND_INVOICE,				/* invoice.pay, keyed by the invoice number */
	KIND_PURGE					/* maintenance.purge, platform ledger */
} demo_kind;

/* One logical task: what must happen exactly once. */
typedef struct demo_task
{
	demo_kind	kind;
	int64_t		tenant;
	int			from;			/* account numbers inside the tenant */
	int			to;
	int64_t		amount;
	int			flaky;			/* the handler fails (retryable) on attempt 1 */
	int			should_apply;	/* 0: touches a frozen account (permanent) */
	char		id[64];			/* run_id, or invoice number */
	char		task_key[80];	/* transfers.task_key of its effect */
} demo_task;

/* One message put on the stream. */
typedef struct demo_msg
{
	int			task;			/* index in plan.tasks */
	int			copy;			/* 0: first enqueue; 1..: duplicate */
	char		run_id[64];
	double		pos;			/* sort key: place in the stream */
} demo_msg;

typedef struct demo_plan
{
	demo_task  *tasks;
	int			ntasks;
	demo_msg   *msgs;
	int			nmsgs;
	int			n_transfers;
	int			n_invoices;
	int			n_purges;
	int			n_dup_msgs;		/* same run_id enqueued again */
	int			n_invoice_resubmits;	/* invoice enqueued again, new run_id */
	int			n_frozen_tasks;
	int			n_flaky;
	int			n_accounts;
} demo_plan;

typedef struct demo_config
{
	int			ntasks;
	int			workers;
	int			tenants;
	int			accounts;		/* per tenant */
	double		dup_ratio;
	int			chaos;
	int			short_mode;
	unsigned	seed;
	int			lease_ms;
	int			max_seconds;
	int			chaos_interval_ms;
	int			purges;
	int			seed_expired;	/* expired ledger rows for purge to delete */
	const char *pg;
	char		cache_host[128];
	int			cache_port;
	int			cache_db;
	char		broker_host[128];
	int			broker_port;
	int			broker_db;
	int			shared_valkey;	/* broker and cache on one server */
	const char *cache_nodes;	/* Valkey Cluster: the other nodes,
								 * "host:port,..." (NULL: not a cluster) */
	const char *cache_restart_cmd;
	int			flush_all_masters;	/* cluster: a flush empties every master */
	int			min_valkey_share;	/* cluster: the check wants more than
									 * this % of replays from Valkey */
	int			verbose;
	int			handler_sleep_ms;	/* up to this long inside the handler */
	int			batch;			/* messages per XREADGROUP; > 1: batch runs */
	int			without_idem;	/* negative control: no runner at all */
	int			notices;		/* stage two's consumer processes (0: no
								 * stage two: transfers emit nothing) */
	int			broken_consumer;	/* stage two acks before the run: its
									 * check must fail */
	char		notice_host[128];	/* the Valkey the server's publisher
									 * XADDs the notifications to */
	int			notice_port;
	int			notice_db;
	int			notice_in_cache;	/* that is the cache Valkey: the chaos
									 * spares streams there */
	char		notice_stream[64];
	char		notice_group[32];
	char		tag[16];		/* this run's tag: run ids, stream name */
	char		stream[64];
	char		group[32];
	char		schema[128];	/* the extension's schema, quoted */
	int			citus;			/* the database is a Citus coordinator's */
} demo_config;

/* Counters; one block per worker slot in shared memory, plus totals. */
typedef struct demo_counters
{
	long		deliveries;
	long		redeliveries;	/* handed out again by XAUTOCLAIM */
	long		applied;
	long		applied_transfer;
	long		applied_invoice;
	long		applied_purge;
	long		replay_valkey;
	long		replay_pg;
	long		replay_twin;	/* a duplicate in its original's batch,
								 * answered by that batch's transaction */
	long		busy_valkey;
	long		busy_pg;
	long		mismatch;
	long		failed_retryable;
	long		failed_permanent_now;
	long		failed_permanent_replay;
	long		err_connection;
	long		err_commit_unknown;
	long		err_other;
	long		acks;
	long		purge_deleted;
	long		pg_round_trips;
	long		pg_connects;
	long		valkey_round_trips;
	long		valkey_skipped;
	long		broker_errors;
	long		broker_round_trips;
	long		batches;		/* batch transactions (idem_claim_many) */
	long		batch_msgs;		/* messages run in them */
	/* replays from PostgreSQL, by why Valkey did not answer (misses.c) */
	long		miss_not_asked;
	long		miss_unseen;
	long		miss_flushed;
	long		miss_failover;
	long		miss_copy_lag;
	long		miss_not_refilled;
	long		miss_unexplained;
	/* stage two (notices.c): runs of a consumer's entries */
	long		notice_read;
	long		notice_applied;
	long		notice_replayed;
	long		notice_retryable;
	long		notice_busy;
	long		notice_errors;
	long		notice_acked;
	long		notice_valkey_errors;
} demo_counters;

/* A chaos event that empties (part of) the cache, for misses.c. */
#define DEMO_MAX_EVENTS 1024
#define DEMO_EV_FLUSH 1
#define DEMO_EV_FAILOVER 2
typedef struct demo_event
{
	int			kind;
	int64_t		start_ms;
	int64_t		end_ms;			/* 0: still going */
} demo_event;

typedef struct demo_shared
{
	demo_counters slot[DEMO_MAX_WORKERS];
	long		enqueued;
	int			producer_done;
	char		last_id[48];	/* the producer's last XADD */
	long		kills;
	long		notice_kills;	/* kill -9 of stage two's consumers */
	long		server_kills;	/* kill -9 of the server's idem processes */
	long		server_terms;	/* ... or pg_terminate_backend when not ours */
	long		restarts;
	long		backends_terminated;
	long		terminate_events;
	long		flushes;
	long		masters_flushed;	/* cluster: masters a flush emptied */
	long		cache_restarts;
	long		cache_restart_failures;
	long		worker_exits_unexpected;
	int			nevents;
	demo_event	events[DEMO_MAX_EVENTS];
	char		last_error[512];
} demo_shared;

/* shared.c */
extern demo_shared *g_shared;
int			demo_shared_open(void);
void		demo_shared_close(void);
int64_t		demo_now_ms(void);
void		demo_note_error(const char *fmt,...) __attribute__((format(printf, 1, 2)));
void		demo_counters_sum(demo_counters *out);
idem_runner *demo_runner_open(const demo_config *cfg);

/* workload.c */
int			plan_build(const demo_config *cfg, demo_plan *plan);
void		plan_free(demo_plan *plan);
const char *kind_name(demo_kind k);
const char *kind_scope(demo_kind k);
int			request_json(const demo_config *cfg, const demo_task *t, char *buf, size_t len);
int			db_setup(PGconn *conn, demo_config *cfg, const demo_plan *plan, char *err, size_t errlen);
int			db_exec(PGconn *conn, const char *sql, char *err, size_t errlen);

/* queue.c */
typedef struct queue queue;
typedef struct queue_msg
{
	char		id[48];
	char		run_id[64];
	char		kind[32];
	int64_t		tenant;
	int			from;
	int			to;
	int64_t		amount;
	int			flaky;
	char		invoice[64];
	char		request[512];
	int			redelivered;
} queue_msg;

queue	   *queue_open(const char *host, int port, int db, const char *stream,
					   const char *group, char *err, size_t errlen);
void		queue_close(queue *q);
int			queue_create_group(queue *q, char *err, size_t errlen);
int			queue_add(queue *q, const demo_config *cfg, const demo_plan *plan,
					  int from, int to, char *last_id, size_t last_len);
int			queue_read(queue *q, const char *consumer, int count, int block_ms,
					   queue_msg *out, int max);
int			queue_autoclaim(queue *q, const char *consumer, int min_idle_ms,
							char *cursor, size_t cursorlen, int count,
							queue_msg *out, int max);
int			queue_ack(queue *q, const char *id);
int			queue_ack_many(queue *q, const char *const *ids, int n);
int			queue_group_state(queue *q, long *pending, char *last_delivered,
							  size_t len);
int			queue_drop_stream(queue *q);
int			queue_last_id(queue *q, char *last, size_t len);

/* worker.c */
void		worker_main(const demo_config *cfg, int slot, int gen) __attribute__((noreturn));
void		producer_main(const demo_config *cfg, const demo_plan *plan) __attribute__((noreturn));

/* batch.c */
typedef struct batch_ctx batch_ctx;
batch_ctx  *batch_new(const demo_config *cfg, int slot);
void		batch_free(batch_ctx *b);
/* Runs msgs[0..n) that batch_wants(); returns how many it took. */
int			batch_wants(const queue_msg *m);
void		batch_run(batch_ctx *b, idem_runner *runner, queue *q,
					  const queue_msg *const *msgs, int n);

/* notices.c */
void		consumer_main(const demo_config *cfg, int slot, int gen) __attribute__((noreturn));
int			notices_drained(PGconn *conn, queue *nq, const demo_config *cfg);
void		notices_outbox_sql(const demo_config *cfg, char *sql, size_t len);

/* chaos.c */
typedef struct chaos chaos;
chaos	   *chaos_new(const demo_config *cfg);
void		chaos_free(chaos *c);
/* Maybe inject one fault; pids[0..n): the workers (the first nworkers),
 * then stage two's consumers; returns the slot killed or -1. */
int			chaos_tick(chaos *c, pid_t *pids, int n, int nworkers);
void		chaos_describe(const chaos *c, char *buf, size_t len);

/* misses.c */
int			misses_init(int ntasks);
void		misses_note_done(const queue_msg *m);
void		misses_note_pg_replay(demo_counters *c, const queue_msg *m,
								  int valkey_asked);
void		misses_note_event(int kind, int64_t start_ms, int64_t end_ms);
void		misses_event_ended(int kind, int64_t end_ms);

/* report.c */
void		progress_tick(const demo_config *cfg, const demo_plan *plan,
						  int64_t started, int final);
int			report_and_check(PGconn *conn, const demo_config *cfg,
							 const demo_plan *plan, double seconds,
							 long pending, int all_delivered, int timed_out,
							 queue *nq);

#endif
