/*-------------------------------------------------------------------------
 *
 * cache_cluster_int.h
 *	  What the files of the Citus cluster cache share: the joins in shared
 *	  memory (cache_cluster.c owns them), and the node's identity.
 *
 * Locking: idem_cluster_shared->mutex, a spinlock, is held only to copy a
 * slot or the one-time key in or out (a few hundred bytes; the
 * coordinator's namings, a few kilobytes, only when it names): no call, no
 * allocation, no ERROR while it is held.  The idem worker takes it for
 * every batch it encodes.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_CACHE_CLUSTER_INT_H
#define IDEM_CACHE_CLUSTER_INT_H

#include "storage/spin.h"

#include "cache_cluster.h"
#include "cache_cluster_seal.h"

#define CLUSTER_DBS			IDEM_CLUSTER_SLOTS
/* "<system id>.<timeline>.<epoch as 16 hex>" */
#define NODE_ID_MAX			(20 + 1 + 10 + 1 + 16 + 1)

/* The coordinator only: a keyspace it named, and the nodes it named it with. */
#define CLUSTER_MEMBERS		64
#define CLUSTER_NAMINGS		2
typedef struct ClusterMember
{
	uint64		addr;			/* a hash of its name and port */
	uint64		sysid;			/* its system identifier */
	uint64		ident;			/* a hash of its identity */
} ClusterMember;

typedef struct ClusterNaming
{
	uint64		epoch;			/* the cluster epoch; 0: none */
	uint64		coord;			/* the coordinator's identity, hashed */
	int			nmembers;
	ClusterMember members[CLUSTER_MEMBERS];
} ClusterNaming;

/* One database's join of a cluster keyspace. */
typedef struct ClusterSlot
{
	Oid			dboid;			/* InvalidOid: free */
	bool		joined;
	TimeLineID	node_tli;		/* this node's identity at the join */
	uint64		node_epoch;
	char		keyspace[IDEM_CACHE_KEYSPACE_MAX + 1];
	int32		current_id;
	uint8		current[IDEM_MAC_LEN];
	int32		previous_id;	/* 0: none */
	uint8		previous[IDEM_MAC_LEN];
	/* the coordinator only: the owner key of keyspace (cache_cluster.h) */
	uint64		owner_token;	/* its token; 0: none chosen */
	bool		owner_set;		/* the worker set it: runners may be told */
	/* a keyspace whose owner key the worker must retire; "": none */
	char		retire[IDEM_CACHE_KEYSPACE_MAX + 1];
	/* the coordinator only: its last namings, the newest first */
	ClusterNaming named[CLUSTER_NAMINGS];
} ClusterSlot;

typedef struct ClusterShared
{
	slock_t		mutex;
	/* a worker node: the last one-time key idem_cache_node handed out */
	Oid			seal_db;		/* its database */
	bool		seal_valid;
	uint8		seal_key[IDEM_SEAL_KEY_LEN];
	ClusterSlot slots[CLUSTER_DBS];
} ClusterShared;

/* NULL without idem's shared memory (not preloaded). */
extern ClusterShared *idem_cluster_shared;

extern ClusterSlot *idem_cluster_slot_find(Oid dboid, bool create);
extern bool idem_cluster_slot_join(Oid dboid, const char *keyspace,
								   TimeLineID tli, uint64 epoch,
								   const IdemCacheSecrets *s,
								   uint64 new_token);
extern bool idem_cluster_node_identity(char *buf, size_t len, TimeLineID *tli,
									   uint64 *epoch);

/* Which keyspace the coordinator names (cache_cluster_naming.c). */
extern void idem_cluster_naming_member(ClusterMember *m, const char *name,
									   int port, const char *identity);
extern uint64 idem_cluster_naming_epoch(const char *coord_id, char **ids, int n);
extern uint64 idem_cluster_naming_choose(Oid dboid, uint64 coord,
										 uint64 new_epoch,
										 const ClusterMember *answered,
										 int nanswered,
										 const ClusterMember *silent,
										 int nsilent,
										 const ClusterMember *held, int nheld);

#endif							/* IDEM_CACHE_CLUSTER_INT_H */
