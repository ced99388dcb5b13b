/*-------------------------------------------------------------------------
 *
 * cache_cluster_owner.c
 *	  The owner key of a Citus cluster keyspace, and the idem worker's
 *	  duties toward it: set it on the coordinator, retire a keyspace the
 *	  coordinator replaced or a join this node's new epoch made stale, and
 *	  stop naming an owner whose key another node retired.
 *
 * The cluster keyspace has an epoch owner key, as a server's own: the
 * keyspace without ".<dboid>:", then ":owner".  The coordinator chooses a
 * random token whenever it names a keyspace it did not name last
 * (idem_cache_cluster_keyspace), keeps it in its slot, and its worker sets
 * the key (idem_cache_cluster_duty); idem_cache_secrets() hands the token
 * out once set (idem_cache_cluster_owner).
 *
 * Locking: the joins' spinlock (cache_cluster_int.h), held to copy a slot's
 * owner fields in or out; the key's text is made after it is released.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "storage/spin.h"

#include "cache_cluster.h"
#include "cache_cluster_int.h"

/*
 * The owner key of a cluster keyspace: the keyspace without its
 * ".<database oid>:", then ":owner", as for a server's own keyspace
 * (cache_format.h), so that clients check it the same way.  Returns its
 * length, or -1 if keyspace is not of that form.
 */
static int
owner_key_of(char *buf, size_t buflen, const char *keyspace)
{
	const char *dot = strrchr(keyspace, '.');
	int			n;

	if (dot == NULL || dot == keyspace)
		return -1;
	n = snprintf(buf, buflen, "%.*s:owner", (int) (dot - keyspace), keyspace);
	return n < 0 || (size_t) n >= buflen ? -1 : n;
}

/*
 * For idem_cache_secrets() on the coordinator: the owner key of the
 * cluster keyspace database dboid joined, and its token, once the worker
 * has set it.  false otherwise (a worker node, not joined, not set yet):
 * runners then do not use the cache.
 */
bool
idem_cache_cluster_owner(Oid dboid, char *key, size_t keylen, uint64 *token)
{
	ClusterSlot *slot;
	char		keyspace[IDEM_CACHE_KEYSPACE_MAX + 1];
	bool		ok = false;

	if (idem_cluster_shared == NULL)
		return false;
	SpinLockAcquire(&idem_cluster_shared->mutex);
	slot = idem_cluster_slot_find(dboid, false);
	if (slot != NULL && slot->joined && slot->owner_set &&
		slot->owner_token != 0)
	{
		memcpy(keyspace, slot->keyspace, sizeof(keyspace));
		*token = slot->owner_token;
		ok = true;
	}
	SpinLockRelease(&idem_cluster_shared->mutex);
	return ok && owner_key_of(key, keylen, keyspace) >= 0;
}

/*
 * For the idem worker: the next write to a cluster owner key, given this
 * node's epoch (owned: taken over, as (tli, epoch); idem_cache_epoch_owned).
 * In this order:
 *	  - IDEM_CLUSTER_RETIRE a keyspace the coordinator replaced;
 *	  - IDEM_CLUSTER_RETIRE the keyspace of a join gone stale: this node's
 *		epoch or timeline changed since (ledger rows deleted by hand on a
 *		shard, a promotion), so the cluster's history is no longer the
 *		one the keyspace was named for;
 *	  - IDEM_CLUSTER_SET the owner key of the coordinator's keyspace to its
 *		token.
 * false: nothing to do.  No ERROR, no allocation.
 */
bool
idem_cache_cluster_duty(IdemClusterDuty *d, bool owned, TimeLineID tli,
						uint64 epoch)
{
	bool		found = false;

	memset(d, 0, sizeof(*d));
	if (idem_cluster_shared == NULL)
		return false;
	SpinLockAcquire(&idem_cluster_shared->mutex);
	for (int i = 0; i < CLUSTER_DBS && !found; i++)
	{
		ClusterSlot *slot = &idem_cluster_shared->slots[i];

		if (slot->dboid == InvalidOid)
			continue;
		d->dboid = slot->dboid;
		if (slot->retire[0] != '\0')
		{
			d->kind = IDEM_CLUSTER_RETIRE;
			memcpy(d->keyspace, slot->retire, sizeof(d->keyspace));
			found = true;
		}
		else if (slot->joined &&
				 (!owned || slot->node_tli != tli || slot->node_epoch != epoch))
		{
			d->kind = IDEM_CLUSTER_RETIRE_STALE;
			memcpy(d->keyspace, slot->keyspace, sizeof(d->keyspace));
			found = true;
		}
		else if (slot->joined && slot->owner_token != 0 && !slot->owner_set)
		{
			d->kind = IDEM_CLUSTER_SET;
			memcpy(d->keyspace, slot->keyspace, sizeof(d->keyspace));
			d->token = slot->owner_token;
			found = true;
		}
	}
	SpinLockRelease(&idem_cluster_shared->mutex);
	if (found && owner_key_of(d->key, sizeof(d->key), d->keyspace) < 0)
	{
		/*
		 * Cannot happen (the coordinator made the keyspace): drop the duty,
		 * and idem_cache_cluster_owner() names no owner for it.
		 */
		idem_cache_cluster_duty_done(d);
		return false;
	}
	return found;
}

/* The worker did duty d in Valkey (or gives up on a malformed one). */
void
idem_cache_cluster_duty_done(const IdemClusterDuty *d)
{
	ClusterSlot *slot;

	SpinLockAcquire(&idem_cluster_shared->mutex);
	slot = idem_cluster_slot_find(d->dboid, false);
	if (slot != NULL)
	{
		switch (d->kind)
		{
			case IDEM_CLUSTER_RETIRE:
				if (strcmp(slot->retire, d->keyspace) == 0)
					slot->retire[0] = '\0';
				break;
			case IDEM_CLUSTER_RETIRE_STALE:
				/* the join is over: the coordinator's next refresh joins again */
				if (slot->joined && strcmp(slot->keyspace, d->keyspace) == 0)
				{
					slot->joined = false;
					slot->owner_token = 0;
					slot->owner_set = false;
				}
				break;
			case IDEM_CLUSTER_SET:
				if (slot->joined && slot->owner_token == d->token &&
					strcmp(slot->keyspace, d->keyspace) == 0)
					slot->owner_set = true;
				break;
		}
	}
	SpinLockRelease(&idem_cluster_shared->mutex);
}

/*
 * For the idem worker's periodic check: the owner key the coordinator set
 * in slot i (0 .. IDEM_CLUSTER_SLOTS - 1), and its token; false if none.
 */
bool
idem_cache_cluster_owned(int i, IdemClusterDuty *d)
{
	ClusterSlot *slot;
	bool		ok;

	memset(d, 0, sizeof(*d));
	if (idem_cluster_shared == NULL)
		return false;
	slot = &idem_cluster_shared->slots[i];
	SpinLockAcquire(&idem_cluster_shared->mutex);
	ok = slot->dboid != InvalidOid && slot->joined && slot->owner_set &&
		slot->owner_token != 0;
	if (ok)
	{
		d->kind = IDEM_CLUSTER_SET;
		d->dboid = slot->dboid;
		d->token = slot->owner_token;
		memcpy(d->keyspace, slot->keyspace, sizeof(d->keyspace));
	}
	SpinLockRelease(&idem_cluster_shared->mutex);
	return ok && owner_key_of(d->key, sizeof(d->key), d->keyspace) >= 0;
}

/*
 * The worker found the owner key of d (idem_cache_cluster_owned) holding
 * something else than its token: a node whose history changed retired it.
 * Runners are told no owner from now on, and the coordinator's next
 * refresh names a keyspace with a new token (the cluster epoch changed
 * with that node's identity).
 */
void
idem_cache_cluster_disown(const IdemClusterDuty *d)
{
	ClusterSlot *slot;

	SpinLockAcquire(&idem_cluster_shared->mutex);
	slot = idem_cluster_slot_find(d->dboid, false);
	if (slot != NULL && slot->owner_token == d->token &&
		strcmp(slot->keyspace, d->keyspace) == 0)
	{
		slot->owner_token = 0;
		slot->owner_set = false;
	}
	SpinLockRelease(&idem_cluster_shared->mutex);
}
