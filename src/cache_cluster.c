/*-------------------------------------------------------------------------
 *
 * cache_cluster.c
 *	  One Valkey cache for a Citus cluster: the joins, in shared memory.
 *	  Which database of this node is in a cluster, the cluster keyspace and
 *	  secrets it joined, for which identity of this node, and what the idem
 *	  worker copies with (docs/citus.md says why).
 *
 * On Citus a runner connects to the coordinator, but the rows it replays
 * live on the worker nodes, and each node's worker copies what commits
 * there.  So every node of a database whose tenant ledger is distributed
 * copies into one cluster keyspace, with one set of secrets, both named
 * by the coordinator, which the runner learns there as on one server
 * (idem_cache_keyspace(), idem_cache_secrets()):
 *
 *	  - The cluster keyspace is <prefix><coordinator's system id>.<its
 *		timeline>.<cluster epoch>.<coordinator's database oid>:, where the
 *		cluster epoch is a hash of every node's identity (system id,
 *		timeline, history epoch) as each node reports it now.  A node
 *		whose epoch changes (a restore, a crash, ledger rows deleted by
 *		hand on a shard) changes the cluster epoch the next time the
 *		coordinator is asked, so runners move to a new keyspace, and that
 *		node no longer copies into the old one (below): its old copies are
 *		never read again by a runner that has learnt since, as on one
 *		server.
 *	  - The secrets are the coordinator's (rotation included).  A worker
 *		node receives them sealed: the coordinator first asks the node for
 *		a fresh one-time 32-byte key (a query result, never a statement
 *		text, so never in a log), then sends the secrets sealed with it
 *		(AES-256-GCM: idem_seal_secrets).
 *		The node keeps them in shared memory only: never in a table, a
 *		file or the log, so neither pg_dump nor a base backup copies them.
 *		A restarted node has none and copies nothing until it joins again.
 *	  - A join is valid only for the node's identity it was made with.  A
 *		node whose epoch or timeline changed stops copying into the
 *		cluster keyspace at once (idem_cache_cluster_encoder), and so does
 *		a node of a clustered database that has not joined: no node writes
 *		what no runner reads.
 *	  - The cluster keyspace has an epoch owner key, as a server's own
 *		(cache_secret.c): the keyspace without ".<dboid>:", then ":owner".
 *		The coordinator chooses a random token whenever it names a keyspace
 *		it did not name last, keeps it in its slot, and its worker sets the
 *		key (idem_cache_cluster_duty); idem_cache_secrets() hands the token
 *		out once set.  The worker retires (a marker, whatever the key held)
 *		the keyspace the coordinator replaced, if runners were told its
 *		token, and on any node the keyspace of a join this node's new epoch
 *		made stale, at once: runners that keep their connection stop
 *		trusting it at their next lookup.  A node restarted has lost its
 *		join and cannot retire it: the coordinator retires it when next
 *		asked (docs/citus.md, Limits).
 *
 * The mechanisms, each in a file of its own, share the joins
 * (cache_cluster_int.h):
 *	  - the joins (here): the slots, idem_cache_cluster_mark, the worker's
 *		idem_cache_cluster_encoder, idem_cache_cluster_joined;
 *	  - the owner key of the cluster keyspace, the worker's duties toward
 *		it (idem_cache_cluster_duty and the rest);
 *	  - the seal of the secrets for one node (idem_seal_secrets,
 *		idem_seal_open);
 *	  - a worker node's side: idem_cache_node(), idem_cache_node_join();
 *	  - the coordinator's refresh: idem_cache_cluster_keyspace.
 *
 * Locking: a spinlock over the shared struct (idem_cluster_shared->mutex),
 * held only to copy a few hundred bytes in or out, with no call, no
 * allocation and no ERROR inside; the idem worker takes it for every batch.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xlog.h"
#include "miscadmin.h"
#include "storage/shmem.h"
#include "storage/spin.h"

#include "cache_cluster.h"
#include "cache_cluster_int.h"
#include "cache_secret.h"
#include "sha256.h"

ClusterShared *idem_cluster_shared = NULL;

Size
idem_cache_cluster_shmem_size(void)
{
	return MAXALIGN(sizeof(ClusterShared));
}

/* From shmem.c's startup hook, with AddinShmemInitLock held. */
void
idem_cache_cluster_shmem_init(void)
{
	bool		found;

	idem_cluster_shared = ShmemInitStruct("idem cache cluster",
										  sizeof(ClusterShared), &found);
	if (!found)
	{
		memset(idem_cluster_shared, 0, sizeof(ClusterShared));
		SpinLockInit(&idem_cluster_shared->mutex);
	}
}

/* The slot of dboid, or a free one if create; NULL.  Mutex held. */
ClusterSlot *
idem_cluster_slot_find(Oid dboid, bool create)
{
	int			i;

	for (i = 0; i < CLUSTER_DBS; i++)
		if (idem_cluster_shared->slots[i].dboid == dboid)
			return &idem_cluster_shared->slots[i];
	if (!create)
		return NULL;
	for (i = 0; i < CLUSTER_DBS; i++)
		if (idem_cluster_shared->slots[i].dboid == InvalidOid)
		{
			memset(&idem_cluster_shared->slots[i], 0, sizeof(ClusterSlot));
			idem_cluster_shared->slots[i].dboid = dboid;
			return &idem_cluster_shared->slots[i];
		}
	return NULL;
}

/*
 * Database dboid belongs to a Citus cluster: from now on this node copies
 * its results only into the cluster keyspace, once joined.  When every slot
 * is taken the database keeps its own keyspace (which no runner of the
 * cluster reads): a WARNING says so.
 */
void
idem_cache_cluster_mark(Oid dboid)
{
	ClusterSlot *slot;

	if (idem_cluster_shared == NULL)
		return;
	SpinLockAcquire(&idem_cluster_shared->mutex);
	slot = idem_cluster_slot_find(dboid, true);
	SpinLockRelease(&idem_cluster_shared->mutex);
	if (slot == NULL)
		ereport(WARNING,
				(errcode(ERRCODE_CONFIGURATION_LIMIT_EXCEEDED),
				 errmsg("more than %d databases of this server are in Citus clusters",
						CLUSTER_DBS),
				 errdetail("This database's results are not copied where its cluster's runners read them.")));
}

/*
 * For the idem worker, encoding a batch: where to copy database dboid's
 * results, given this node's current timeline and epoch.  0: it is not in
 * a cluster (its own keyspace and secret); 1: the cluster's keyspace, key
 * id and MAC key are filled in; -1: it is in a cluster but not joined for
 * this node's identity: copy nothing.  No ERROR, no allocation.
 */
int
idem_cache_cluster_encoder(Oid dboid, TimeLineID tli, uint64 epoch,
						   char *keyspace, int32 *key_id, idem_hmac *mac_key)
{
	ClusterSlot *slot;
	uint8		secret[IDEM_MAC_LEN];
	int			r = 0;

	if (idem_cluster_shared == NULL)
		return 0;
	SpinLockAcquire(&idem_cluster_shared->mutex);
	slot = idem_cluster_slot_find(dboid, false);
	if (slot != NULL)
	{
		r = -1;
		if (slot->joined && slot->node_tli == tli && slot->node_epoch == epoch)
		{
			memcpy(keyspace, slot->keyspace, sizeof(slot->keyspace));
			*key_id = slot->current_id;
			memcpy(secret, slot->current, IDEM_MAC_LEN);
			r = 1;
		}
	}
	SpinLockRelease(&idem_cluster_shared->mutex);
	if (r == 1)
	{
		idem_hmac_key(mac_key, secret, IDEM_MAC_LEN);
		explicit_bzero(secret, sizeof(secret));
	}
	return r;
}

/* This node's identity now, or false if it has no keyspace now. */
bool
idem_cluster_node_identity(char *buf, size_t len, TimeLineID *tli,
						   uint64 *epoch)
{
	if (RecoveryInProgress() || !idem_cache_epoch_confirmed(epoch))
		return false;
	*tli = GetWALInsertionTimeLine();
	snprintf(buf, len, UINT64_FORMAT ".%u.%016llx", GetSystemIdentifier(),
			 *tli, (unsigned long long) *epoch);
	return true;
}

/*
 * The cluster keyspace and secrets this node joined for database dboid, if
 * the join holds for this node's identity now.  0: the database is not in
 * a cluster; 1: joined (keyspace and *s filled in, either may be NULL);
 * -1: in a cluster, not joined.
 */
int
idem_cache_cluster_joined(Oid dboid, char *keyspace, IdemCacheSecrets *s)
{
	ClusterSlot *slot;
	char		id[NODE_ID_MAX];
	TimeLineID	tli = 0;
	uint64		epoch = 0;
	bool		ready;
	int			r = 0;

	if (idem_cluster_shared == NULL)
		return 0;
	ready = idem_cluster_node_identity(id, sizeof(id), &tli, &epoch);
	SpinLockAcquire(&idem_cluster_shared->mutex);
	slot = idem_cluster_slot_find(dboid, false);
	if (slot != NULL)
	{
		r = -1;
		if (ready && slot->joined && slot->node_tli == tli &&
			slot->node_epoch == epoch)
		{
			r = 1;
			if (keyspace)
				memcpy(keyspace, slot->keyspace, sizeof(slot->keyspace));
			if (s)
			{
				memset(s, 0, sizeof(*s));
				s->current_id = slot->current_id;
				memcpy(s->current, slot->current, IDEM_MAC_LEN);
				s->previous_id = slot->previous_id;
				memcpy(s->previous, slot->previous, IDEM_MAC_LEN);
				s->timeline = tli;
				s->epoch = epoch;
			}
		}
	}
	SpinLockRelease(&idem_cluster_shared->mutex);
	return r;
}

/*
 * Install a join for dboid (the mutex not held).  On the coordinator
 * new_token is a fresh random token: it becomes the owner token of a
 * keyspace that changed (or has none), and the keyspace it replaces is
 * retired if runners were told its owner; an unused keyspace passes its
 * retire on.  Returns whether the worker has an owner key to set.
 */
bool
idem_cluster_slot_join(Oid dboid, const char *keyspace, TimeLineID tli,
					   uint64 epoch, const IdemCacheSecrets *s, uint64 new_token)
{
	ClusterSlot *slot;
	bool		wake = false;

	SpinLockAcquire(&idem_cluster_shared->mutex);
	slot = idem_cluster_slot_find(dboid, true);
	if (slot != NULL)
	{
		if (new_token != 0 &&
			(slot->owner_token == 0 || !slot->joined ||
			 strcmp(slot->keyspace, keyspace) != 0))
		{
			if (slot->owner_set && strcmp(slot->keyspace, keyspace) != 0)
				strlcpy(slot->retire, slot->keyspace, sizeof(slot->retire));
			slot->owner_token = new_token;
			slot->owner_set = false;
			wake = true;
		}
		slot->joined = true;
		slot->node_tli = tli;
		slot->node_epoch = epoch;
		strlcpy(slot->keyspace, keyspace, sizeof(slot->keyspace));
		slot->current_id = s->current_id;
		memcpy(slot->current, s->current, IDEM_MAC_LEN);
		slot->previous_id = s->previous_id;
		memcpy(slot->previous, s->previous, IDEM_MAC_LEN);
	}
	SpinLockRelease(&idem_cluster_shared->mutex);
	return slot != NULL && (wake || new_token == 0);
}
