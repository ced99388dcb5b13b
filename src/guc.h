/*-------------------------------------------------------------------------
 *
 * guc.h
 *	  Every idem.* setting (guc.c): the variables that hold them, and what
 *	  their values mean.  The README's GUC table documents them.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_GUC_H
#define IDEM_GUC_H

/* Ledger settings */
extern int	idem_lease_ms;
extern int	idem_retention_s;
extern int	idem_purge_grace_s;
extern int	idem_min_retention_s;
extern int	idem_min_purge_grace_s;
extern int	idem_max_attempts;

/* Commit settings */
extern int	idem_epoch_retire_timeout_ms;

/* Worker settings */
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

/* Publisher settings: the outbox's own Valkey (none: the cache's) */
extern char *idem_outbox_valkey_host;
extern int	idem_outbox_valkey_port;
extern char *idem_outbox_valkey_nodes;
extern char *idem_outbox_valkey_password;
extern char *idem_outbox_valkey_password_file;
extern int	idem_outbox_valkey_db;
extern char *idem_standby_slots;

/* idem.valkey_cluster */
typedef enum IdemValkeyCluster
{
	IDEM_VALKEY_CLUSTER_AUTO = 0,
	IDEM_VALKEY_CLUSTER_ON,
	IDEM_VALKEY_CLUSTER_OFF
} IdemValkeyCluster;

/* idem.standby_slots: every physical replication slot (the default) */
#define IDEM_ALL_STANDBY_SLOTS "*"

/*
 * idem.queue_size counts results; the queue reserves this many bytes of
 * shared memory per result on average (commit_ring.c sizes it so, and the
 * setting's description says so).
 */
#define IDEM_RING_BYTES_PER_RECORD	256

/* Define them all: once, from _PG_init. */
extern void idem_define_gucs(void);

#endif							/* IDEM_GUC_H */
