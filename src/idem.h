/*-------------------------------------------------------------------------
 *
 * idem.h
 *	  Declarations shared between the files of the idem extension.
 *
 * Which file owns what: the source-layout table of README.md, the one
 * file map (test/harness/file_map.sh checks it against the Makefile's
 * OBJS); each file's header says what it owns and its locking rules.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_H
#define IDEM_H

#include "postgres.h"

#include "compat.h"

#include "access/xact.h"
#include "access/xlogdefs.h"
#include "fmgr.h"
#include "utils/guc.h"
#include "utils/timestamp.h"

#include "cache_format.h"
#include "sha256.h"
#include "subxact.h"

/* Claim decisions, in the order idem_stats() reports them. */
typedef enum IdemDecision
{
	IDEM_DECISION_CLAIMED = 0,
	IDEM_DECISION_COMPLETED,
	IDEM_DECISION_FAILED_PERMANENT,
	IDEM_DECISION_BUSY,
	IDEM_DECISION_MISMATCH,
	IDEM_DECISION_COUNT
} IdemDecision;


/* guc.c */
extern int	idem_lease_ms;
extern int	idem_retention_s;
extern int	idem_purge_grace_s;
extern int	idem_min_retention_s;
extern int	idem_min_purge_grace_s;
extern int	idem_max_attempts;
extern char *idem_valkey_host;
extern int	idem_valkey_port;
extern char *idem_valkey_password;
extern char *idem_valkey_password_file;
extern int	idem_valkey_db;
extern char *idem_valkey_prefix;
extern int	idem_valkey_connect_timeout_ms;
extern int	idem_valkey_command_timeout_ms;
extern int	idem_valkey_batch_delay_ms;
extern char *idem_valkey_nodes;
extern int	idem_valkey_cluster;
extern int	idem_queue_size;
extern char *idem_standby_slots;

/* idem.valkey_cluster */
typedef enum IdemValkeyCluster
{
	IDEM_VALKEY_CLUSTER_AUTO = 0,
	IDEM_VALKEY_CLUSTER_ON,
	IDEM_VALKEY_CLUSTER_OFF
} IdemValkeyCluster;
extern void idem_define_gucs(void);

/* standby_slots.c */
extern bool idem_check_standby_slots(char **newval, void **extra,
									 GucSource source);
extern bool idem_standby_slots_flushed(XLogRecPtr *lsn, char *why,
									   size_t whylen);
extern XLogRecPtr idem_commit_lsn(TransactionId writer);
extern void idem_replay_durable(XLogRecPtr commit_lsn);

/* idem.standby_slots: every physical replication slot (the default) */
#define IDEM_ALL_STANDBY_SLOTS "*"

/* xact.c (the rule its callbacks apply: subxact.h) */
extern void idem_xact_callback(XactEvent event, void *arg);
extern void idem_subxact_callback(SubXactEvent event, SubTransactionId mySubid,
								  SubTransactionId parentSubid, void *arg);

/* shmem.c */
extern void idem_shmem_register(void);

/* outbox.c (the queue itself: outbox_ring.h) */
extern void idem_outbox_add(bool is_platform, int64 tenant_id,
							const uint8 *key, IdemCacheKind kind,
							int32 attempt, const uint8 *fingerprint,
							const char *outcome, int outcome_len,
							TimestampTz expires_at);
extern void idem_outbox_repopulate(bool is_platform, int64 tenant_id,
								   const uint8 *key, IdemCacheKind kind,
								   int32 attempt, const uint8 *fingerprint,
								   const char *outcome, int outcome_len,
								   TimestampTz expires_at);
extern void idem_outbox_xact_event(XactEvent event);
extern void idem_outbox_subxact_end(bool committed, int level);
extern XLogRecPtr idem_insert_end_lsn(void);

/* cache_secret.c */
typedef struct IdemCacheSecrets
{
	int32		current_id;		/* the key id values are written with */
	uint8		current[IDEM_MAC_LEN];
	int32		previous_id;	/* still accepted by readers; 0 if none */
	uint8		previous[IDEM_MAC_LEN];
	TimeLineID	timeline;		/* made on it (cache_secret.c); 0 unknown */
	uint64		epoch;			/* the history epoch (cache_format.h); 0:
								 * none yet */
	uint64		token;			/* the token of the last start that took
								 * the epoch over in Valkey; 0: none */
	TimeLineID	retire_timeline;	/* the epoch this one replaced, whose */
	uint64		retire_epoch;	/* owner key the worker retires; 0: none */
} IdemCacheSecrets;

/*
 * The worker's takeover of the epoch after a start (cache_secret.c): the
 * epoch owner key must show expect_token (0: the key must not exist), and
 * gets new_token.
 */
typedef struct IdemEpochTakeover
{
	uint64		epoch;
	TimeLineID	timeline;
	uint64		expect_token;
	uint64		new_token;
	TimeLineID	retire_timeline;	/* retire this epoch's owner key first */
	uint64		retire_epoch;	/* (0: none) */
} IdemEpochTakeover;

/* Why an epoch is replaced while the server runs (idem_cache_epoch_renew). */
typedef enum IdemEpochReason
{
	IDEM_EPOCH_RECOVERED_START = 1,	/* the start ran recovery */
	IDEM_EPOCH_TAKEN_ELSEWHERE,	/* Valkey: another start took it over */
	IDEM_EPOCH_LEDGER_ROWS_REMOVED	/* DELETE, TRUNCATE, DROP of a ledger */
} IdemEpochReason;

/* The named LWLock tranche of the shared copy (one lock), for shmem.c. */
#define IDEM_CACHE_SECRET_TRANCHE	"idem cache secret"

extern Size idem_cache_secret_shmem_size(void);
extern void idem_cache_secret_shmem_init(void);
extern void idem_cache_secrets_get(IdemCacheSecrets *out);
extern void idem_cache_mac_key(idem_hmac *mac_key,
							   const IdemCacheSecrets *secrets);
extern bool idem_cache_sign(const idem_hmac *mac_key, const char *key,
							int keylen, char *value, int valuelen,
							const char **why);
extern bool idem_cache_epoch_confirmed(uint64 *epoch);
extern bool idem_cache_epoch_takeover(IdemEpochTakeover *t);
extern void idem_cache_epoch_taken(const IdemEpochTakeover *t);
extern void idem_cache_epoch_renew(uint64 epoch, IdemEpochReason reason);
extern bool idem_cache_epoch_owned(IdemEpochTakeover *t);

/* cache_keyspace.c */
/* cache_cluster.c */
extern Size idem_cache_cluster_shmem_size(void);
extern void idem_cache_cluster_shmem_init(void);
extern void idem_cache_cluster_mark(Oid dboid);
extern int	idem_cache_cluster_encoder(Oid dboid, TimeLineID tli, uint64 epoch,
									   char *keyspace, int32 *key_id,
									   idem_hmac *mac_key);
extern int	idem_cache_cluster_joined(Oid dboid, char *keyspace,
									  IdemCacheSecrets *s);
extern int	idem_cache_cluster_keyspace(char *buf, size_t buflen, Oid nsp,
										uint64 epoch);
/* Databases of one server that may join a cluster cache at once. */
#define IDEM_CLUSTER_SLOTS	8
typedef enum IdemClusterDutyKind
{
	IDEM_CLUSTER_RETIRE = 1,	/* a keyspace the coordinator replaced */
	IDEM_CLUSTER_RETIRE_STALE,	/* a join this node's new epoch ended */
	IDEM_CLUSTER_SET			/* the coordinator's owner key */
} IdemClusterDutyKind;
typedef struct IdemClusterDuty
{
	IdemClusterDutyKind kind;
	Oid			dboid;
	uint64		token;			/* IDEM_CLUSTER_SET */
	char		keyspace[IDEM_CACHE_KEYSPACE_MAX + 1];
	char		key[IDEM_CACHE_EPOCH_KEY_MAX];	/* its owner key */
} IdemClusterDuty;
extern bool idem_cache_cluster_owner(Oid dboid, char *key, size_t keylen,
									 uint64 *token);
extern bool idem_cache_cluster_duty(IdemClusterDuty *d, bool owned,
									TimeLineID tli, uint64 epoch);
extern void idem_cache_cluster_duty_done(const IdemClusterDuty *d);
extern bool idem_cache_cluster_owned(int i, IdemClusterDuty *d);
extern void idem_cache_cluster_disown(const IdemClusterDuty *d);

extern int	idem_cache_keyspace_of(char *buf, size_t buflen, Oid dboid,
								   TimeLineID timeline, uint64 epoch);
extern int	idem_cache_epoch_key_of(char *buf, size_t buflen,
									TimeLineID timeline, uint64 epoch);

/* worker.c */
extern void idem_worker_register(void);
extern IDEM_EXPORT void idem_worker_main(Datum main_arg);

/* stats.c */
typedef enum IdemStat
{
	IDEM_STAT_QUEUED = 0,		/* copies accepted into the shared queue */
	IDEM_STAT_COPIED,			/* copies written to Valkey */
	IDEM_STAT_DROPPED,			/* copies refused because the queue was full */
	IDEM_STAT_COPY_ERRORS,		/* failed connects and batches (kept, resent) */
	IDEM_STAT_REJECTED,			/* copies Valkey refused one by one (dropped) */
	IDEM_STAT_QUEUE_STALLS,		/* the oldest copy reserved, unwritten over 1 s */
	IDEM_STAT_COUNT
} IdemStat;

extern void idem_stats_count_claim(IdemDecision decision);
extern Size idem_stats_shmem_size(void);
extern void idem_stats_shmem_init(void);
extern void idem_stats_add(IdemStat stat, uint64 n);
extern void idem_stats_set_valkey(bool connected, const char *error);

/* Valkey Cluster counters (worker_cluster.c), idem_stats()'s last columns. */
typedef enum IdemClusterStat
{
	IDEM_STAT_REDIRECTS = 0,	/* MOVED and ASK replies followed */
	IDEM_STAT_MAP_REFRESHES,	/* slot maps read */
	IDEM_STAT_NODE_ERRORS,		/* failed connects/exchanges with a node */
	IDEM_STAT_CLUSTER_RETRIES,	/* CLUSTERDOWN/TRYAGAIN/READONLY retried */
	IDEM_CLUSTER_STAT_COUNT
} IdemClusterStat;

extern void idem_stats_add_cluster(IdemClusterStat stat, uint64 n);
extern void idem_stats_set_cluster(bool cluster, const char *nodes);

/* What idem_stats_read() copies out of the shared counters. */
#define IDEM_LAST_ERROR_LEN 256
#define IDEM_NODES_TEXT_LEN 1024
typedef struct IdemStatsSnapshot
{
	uint64		counters[IDEM_STAT_COUNT];
	uint64		claims[IDEM_DECISION_COUNT];
	uint64		cluster_counters[IDEM_CLUSTER_STAT_COUNT];
	bool		connected;		/* the worker reaches Valkey */
	bool		cluster;		/* ... a Valkey Cluster */
	char		last_error[IDEM_LAST_ERROR_LEN];
	char		nodes[IDEM_NODES_TEXT_LEN];
} IdemStatsSnapshot;

extern bool idem_stats_read(IdemStatsSnapshot *out);

#endif							/* IDEM_H */
