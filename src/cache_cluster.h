/*-------------------------------------------------------------------------
 *
 * cache_cluster.h
 *	  One Valkey cache for a Citus cluster (cache_cluster.c): the
 *	  coordinator's keyspace, the secrets sealed to each node, and the
 *	  worker's duties toward the cluster keyspace's owner key.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CACHE_CLUSTER_H
#define IDEM_CACHE_CLUSTER_H

#include "access/xlogdefs.h"

#include "cache_format.h"
#include "cache_secret.h"
#include "sha256.h"

/* Shared memory (shmem.c). */
extern Size idem_cache_cluster_shmem_size(void);
extern void idem_cache_cluster_shmem_init(void);

/* A database that belongs to a Citus cluster (citus.c, and below). */
extern void idem_cache_cluster_mark(Oid dboid);

/* The keyspace and secrets a node copies with, and that runners learn. */
extern int	idem_cache_cluster_encoder(Oid dboid, TimeLineID tli, uint64 epoch,
									   char *keyspace, int32 *key_id,
									   idem_hmac *mac_key);
extern int	idem_cache_cluster_joined(Oid dboid, char *keyspace,
									  IdemCacheSecrets *s);
extern int	idem_cache_cluster_keyspace(char *buf, size_t buflen, Oid ledger,
										uint64 epoch);
extern void idem_cache_cluster_join_now(Oid ledger);

/* Databases of one server that may join a cluster cache at once. */
#define IDEM_CLUSTER_SLOTS	8
typedef enum IdemClusterDutyKind
{
	IDEM_CLUSTER_RETIRE = 1,	/* a keyspace the coordinator replaced */
	IDEM_CLUSTER_RETIRE_STALE,	/* a join this node's new epoch ended */
	IDEM_CLUSTER_SET			/* the coordinator's owner key */
} IdemClusterDutyKind;

/* What the worker is to do to a cluster keyspace's owner key. */
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

#endif							/* IDEM_CACHE_CLUSTER_H */
