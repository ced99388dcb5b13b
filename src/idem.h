/*-------------------------------------------------------------------------
 *
 * idem.h
 *	  Declarations shared between the files of the idem extension.
 *
 * Who owns what (one file per concern):
 *	  idem.c		module load: _PG_init registers every callback and hook
 *	  shmem.c		shared memory: the one request/startup hook pair
 *	  xact.c		transaction and subtransaction ends, and the one rule
 *					by which per-transaction state follows subtransactions
 *	  compat.h		differences between PostgreSQL versions; exports
 *	  guc.c			every idem.* setting, its checks and documentation
 *	  digest.c		idem_key() and idem_fingerprint(): the SHA-256 helpers,
 *					and the 32-byte bytea of keys and fingerprints
 *	  install.c		idem_install(): creates the two ledgers
 *	  ledger.c		claim / complete / fail / lookup / purge on both ledgers
 *	  ledger_batch.c	idem_claim_many / idem_complete_many
 *	  ledger_apply.c	idem_apply: claim, a SQL handler, complete
 *	  ledger_store.c	index probes and prepared writes on a ledger table
 *	  ledger_insert.c	the direct write of a new row (the hot write)
 *	  ledger_guard.c	ledger rows removed outside idem (DELETE, TRUNCATE,
 *					DROP...): a new cache epoch at commit
 *	  pending.c		this transaction's claims not written yet (ledger.h)
 *	  outbox.c		the commit hook: this transaction's copies for Valkey
 *	  outbox_ring.c	the shared-memory queue they move to at commit, and
 *					the worker's side of it (outbox_ring.h)
 *	  worker.c		the background worker that drains the queue into Valkey
 *	  worker_cluster.c	the worker's copies to a Valkey Cluster
 *	  valkey_cluster.c	Valkey Cluster routing (valkey_cluster.h), shared
 *					with client/
 *	  cache_secret.c	the secret that MACs Valkey values and the history
 *					epoch that names the keyspace: file, shared copy,
 *					rotation, renewal, takeover, HMAC
 *	  sha256.c, hmac.c	SHA-256 and HMAC-SHA-256 (sha256.h), shared with
 *					client/
 *	  standby_slots.c	idem.standby_slots: the standbys a copy waits for
 *	  cache_keyspace.c	the Valkey namespace of a database (cluster,
 *					timeline, epoch, database) and idem_cache_keyspace()
 *	  stats.c		idem_stats() and the shared counters behind it
 *	  citus.c		idem on Citus: the tenant's local shard, distribution
 *					at install, the purge of every shard (citus.h)
 *	  cache_format.h the Valkey key/value format, shared with client/
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

extern const char *const idem_decision_names[IDEM_DECISION_COUNT];

/*
 * The status of a ledger row.  idem_status_names[] is its spelling in the
 * ledgers' status column: install.c builds the CHECK constraint from it, and
 * every read and write of the column goes through it.
 */
typedef enum IdemStatus
{
	IDEM_STATUS_PROCESSING = 0,
	IDEM_STATUS_COMPLETED,
	IDEM_STATUS_FAILED_RETRYABLE,
	IDEM_STATUS_FAILED_PERMANENT,
	IDEM_STATUS_COUNT
} IdemStatus;

extern const char *const idem_status_names[IDEM_STATUS_COUNT];
extern bool idem_status_parse(const char *name, IdemStatus *status);

/* Every SQL function refuses NULL arguments with the same error. */
static inline void
idem_require_arg(FunctionCallInfo fcinfo, int argno, const char *name)
{
	if (PG_ARGISNULL(argno))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("%s must not be null", name)));
}

/* digest.c */

/* Room for a digest as a bytea (e.g. on the stack), suitably aligned. */
typedef union IdemDigestBytea
{
	char		bytes[VARHDRSZ + IDEM_DIGEST_LEN];
	int32		align;
} IdemDigestBytea;

extern bytea *idem_digest_bytea(const uint8 *digest, IdemDigestBytea *buf);

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

/*
 * Subtransactions (xact.c).  Per-transaction state is tagged with the
 * nesting level that made it (GetCurrentTransactionNestLevel()).  When the
 * subtransaction at level ends, each tag goes through this one rule: state
 * of outer levels is untouched; state of this level or deeper is handed to
 * the parent (level - 1) when the subtransaction committed, and must be
 * forgotten (false) when it aborted.
 */
static inline bool
idem_subxact_follow(int *tag, bool committed, int level)
{
	if (*tag < level)
		return true;
	if (!committed)
		return false;
	*tag = level - 1;
	return true;
}

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

#endif							/* IDEM_H */
