/*-------------------------------------------------------------------------
 *
 * worker_int.h
 *	  What the files of the background worker share, and nothing outside
 *	  them may use:
 *
 *	  worker.c			registration and the main loop (connect, epoch,
 *						drain, back off, sleep)
 *	  worker_valkey.c	the connection: settings, password, connect, one
 *						command, a single Valkey's pipelined I/O
 *	  worker_epoch.c	the epoch owner keys: take over, check, Citus
 *	  worker_encode.c	records as SET commands (key, idem2 value, MAC)
 *	  worker_durable.c	durability waits, naps and the batch delay
 *	  worker_drain.c	the drains: single Valkey and Valkey Cluster
 *	  worker_report.c	problems in idem_stats() and the log
 *	  worker_router.c	the router (worker_router.h)
 *
 *	  The outbox publisher (outbox_publish.c) is another process that uses
 *	  the connection, durability and nap functions of this list.
 *
 *	  Locking: none; the worker is one single-threaded process, and the
 *	  state declared here is process-local.  What it shares with other
 *	  processes (the commit ring, the stats, the cache secrets) has its
 *	  own file and locking rules.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_WORKER_INT_H
#define IDEM_WORKER_INT_H

#include <hiredis/hiredis.h>

#include "access/xlogdefs.h"
#include "datatype/timestamp.h"

#include "cache_format.h"
#include "commit_ring.h"
#include "sha256.h"
#include "stats.h"
#include "worker_router.h"	/* IDEM_BATCH_MAX */

/* A backlog: batches are pipelined ahead of replies when this many wait. */
#define IDEM_BATCH_EAGER		256
#define IDEM_LOG_INTERVAL_MS	10000
/* copies held back this long for durability are reported (worker_report_held) */
#define IDEM_HELD_REPORT_MS		1000
#define IDEM_ERRBUF_LEN			200
/*
 * How often the worker checks that its epoch owner key still holds its
 * token (and pushes its expiry back): a copy of this server may have
 * retired it, or Valkey lost it (cache_secret.c).  Runners check it at
 * every lookup, so this only bounds how long the cache stays unused.
 */
#define IDEM_OWNER_CHECK_MS			1000

typedef enum WorkerResult
{
	WORKER_OK,
	WORKER_FAILED,				/* worker_errbuf says why */
	WORKER_SHUTDOWN				/* SIGTERM arrived while waiting */
} WorkerResult;

/*
 * What a reply to one SET means for its record.  An error reply that says
 * "not now" (valkey_reply.c: LOADING, READONLY, OOM, ...) keeps the batch;
 * any other (WRONGTYPE, a per-key NOPERM, and for now the cluster
 * redirections MOVED and ASK) condemns its record only.
 */
typedef enum WorkerReplyClass
{
	WORKER_REPLY_OK,			/* written */
	WORKER_REPLY_RETRY,			/* the server cannot take writes now: keep
								 * the batch, reconnect, resend */
	WORKER_REPLY_REJECT			/* this record cannot be written: drop it */
} WorkerReplyClass;

/*
 * Records not copied, by reason (IDEM_STAT_SKIPPED_* from
 * IDEM_STAT_SKIPPED_EXPIRED on): counted in idem_stats() and logged once
 * the records leave the commit ring (worker_count_skips).
 */
#define WORKER_SKIP_REASONS (IDEM_STAT_COUNT - IDEM_STAT_SKIPPED_EXPIRED)
typedef struct WorkerSkips
{
	uint64		n[WORKER_SKIP_REASONS];
} WorkerSkips;

/*
 * What one batch's records are encoded with: the time, the timeline that
 * names the keyspace, the current secret's key id and its prepared HMAC key,
 * and the last database's keyspace.
 */
typedef struct WorkerEncoder
{
	TimestampTz now;
	TimeLineID	timeline;
	uint64		epoch;
	int32		key_id;			/* of keyspace_db */
	idem_hmac	mac_key;
	char		keyspace[IDEM_CACHE_KEYSPACE_MAX + 1];
	Oid			keyspace_db;
	bool		skip_db;		/* keyspace_db copies nothing (cache_cluster.c) */
	int32		own_key_id;		/* this server's own secret */
	idem_hmac	own_mac_key;
	uint64		generation;		/* the epoch's renewal generation: older
								 * records are not written into it */
	WorkerSkips	skips;			/* records it skipped, by reason */
} WorkerEncoder;

/* worker_valkey.c */
extern char worker_errbuf[IDEM_ERRBUF_LEN];	/* the last problem */
extern char *worker_valkey_host;
extern int	worker_valkey_port;
extern WorkerResult worker_flush(int64 deadline_ms);
extern WorkerResult worker_next_reply(int64 deadline_ms, bool read_first,
									  redisReply **reply);
extern WorkerResult worker_read_reply(int64 deadline_ms, bool read_first,
									  WorkerReplyClass *class);
extern bool worker_connected(void);
extern void worker_disconnect(void);
extern bool worker_settings_changed(void);
extern void worker_valkey_use_outbox(void);
extern int	worker_pipeline(struct idem_vc_cmd *cmds, int n, bool *shutdown);
extern WorkerResult worker_connect(void);
extern WorkerResult worker_command(const char *key, size_t keylen, int argc,
								   const char **argv, const size_t *argvlen,
								   redisReply **reply);

/* worker_epoch.c */
extern TimestampTz worker_owner_checked_at;
extern WorkerResult worker_take_epoch(void);
extern WorkerResult worker_check_owner(void);
extern WorkerResult worker_check_list(void);
extern void worker_standby_wait(void);
extern WorkerResult worker_cluster_owners(bool check);
extern bool worker_epoch_ready(void);

/* worker_encode.c */
extern void worker_encoder_init(WorkerEncoder *enc, TimeLineID timeline);
extern void worker_encoder_done(WorkerEncoder *enc);
extern int	worker_encode_record(void *arg, const IdemRingRecord *rec,
								 char *key, int *keylen, char *value,
								 int *valuelen, char *ttl, size_t ttllen);
extern int	worker_append_batch(const IdemRingRecord **records, int n,
								WorkerEncoder *enc, uint64 *errors);

/* worker_durable.c */
extern XLogRecPtr worker_durable_lsn(TimeLineID *timeline,
									 bool *standby_problem);
extern void worker_flush_wal(XLogRecPtr lsn);
extern long worker_durable_poll_ms(TimestampTz held_since, TimestampTz now);
extern void worker_nap(long ms);
extern void worker_batch_delay_start(TimestampTz now);
extern long worker_batch_delay_left_ms(TimestampTz now);
extern bool worker_batch_delay_holds(int n, TimestampTz now);
extern bool worker_batch_delay_sleep(void);

/* worker_drain.c */
extern WorkerResult worker_drain_single(uint64 *copied, uint64 *rejected);
extern WorkerResult worker_drain_cluster(uint64 *copied, uint64 *rejected);

/* worker_report.c */
extern bool worker_failing;
extern void worker_report_standby(void);
extern void worker_report_held(XLogRecPtr durable);
extern void worker_report_problem(const char *doing, int retry_ms,
								  bool is_error);
extern void worker_skip(WorkerSkips *skips, IdemStat reason);
extern void worker_skips_add(WorkerSkips *into, const WorkerSkips *from);
extern void worker_count_skips(const WorkerSkips *skips);

#endif							/* IDEM_WORKER_INT_H */
