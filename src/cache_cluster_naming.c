/*-------------------------------------------------------------------------
 *
 * cache_cluster_naming.c
 *	  Which cluster keyspace the coordinator names: the one it named
 *	  before, while no node it was named with lost anything, or a new one.
 *
 * The cluster keyspace's epoch must change whenever a node's history may
 * differ from what Valkey holds: a node whose identity (system id,
 * timeline, history epoch) changed, or that does not answer and so may
 * have changed.  It need not change when a node is added that holds no
 * placement of the tenant ledger (it has nothing to lose: the rows moved
 * onto it later were true where they were copied from, and any removal
 * on it from then on changes its identity), nor when a node is removed
 * (Citus removes only nodes that hold no placement; their copies are of
 * rows that moved and are still true).  So the coordinator remembers, for
 * the keyspaces it named last (a naming), the identities of the nodes it
 * named each with, its members, and names a keyspace again while:
 *	  - its own identity is the one it named it with;
 *	  - every member that is still a node of the cluster answers with the
 *		identity it had (a node found by its address or its system id);
 *	  - every node that is not a member holds no placement of the tenant
 *		ledger now: it becomes a member.
 * A node that does not answer and is not a member is left out, as before.
 * Otherwise the keyspace is a new one, a hash of every answering node's
 * identity (idem_cluster_naming_epoch), whose members they are.  The older
 * naming is tried first, so that a member back after a clean restart
 * brings the keyspace it had back, with all its copies.
 *
 * The namings live in shared memory: a coordinator that restarts has
 * none, and names the hash of the nodes it finds (the keyspace before
 * unless nodes were added since).
 *
 * Locking: the joins' spinlock (cache_cluster_int.h), held to copy a
 * slot's namings in or out (a few kilobytes, no call).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "storage/spin.h"

#include "cache_cluster.h"
#include "cache_cluster_int.h"
#include "sha256.h"

/* The first 8 bytes of the SHA-256 of a text, never 0. */
static uint64
naming_hash(const char *label, const char *text)
{
	idem_sha256 ctx;
	uint8		digest[32];
	uint64		h = 0;

	idem_sha256_init(&ctx);
	idem_sha256_update(&ctx, label, strlen(label) + 1);
	idem_sha256_update(&ctx, text, strlen(text) + 1);
	idem_sha256_final(&ctx, digest);
	for (int j = 0; j < 8; j++)
		h = (h << 8) | digest[j];
	return h == 0 ? 1 : h;
}

/* A node's entry: its address (name and port) and identity, hashed. */
void
idem_cluster_naming_member(ClusterMember *m, const char *name, int port,
						   const char *identity)
{
	char	   *addr = psprintf("%s:%d", name, port);

	m->addr = naming_hash("idem node address", addr);
	m->sysid = strtou64(identity, NULL, 10);
	m->ident = naming_hash("idem node identity", identity);
	pfree(addr);
}

static int
cmp_str(const void *a, const void *b)
{
	return strcmp(*(char *const *) a, *(char *const *) b);
}

/*
 * The epoch of a new cluster keyspace: a hash of the coordinator's
 * identity and every answering node's, in any order.
 */
uint64
idem_cluster_naming_epoch(const char *coord_id, char **ids, int n)
{
	char	  **sorted = palloc(sizeof(char *) * (n + 1));
	idem_sha256 ctx;
	uint8		digest[32];
	uint64		epoch = 0;

	memcpy(sorted, ids, sizeof(char *) * n);
	qsort(sorted, n, sizeof(char *), cmp_str);
	idem_sha256_init(&ctx);
	idem_sha256_update(&ctx, "idem cluster epoch", 19);
	idem_sha256_update(&ctx, coord_id, strlen(coord_id) + 1);
	for (int j = 0; j < n; j++)
		idem_sha256_update(&ctx, sorted[j], strlen(sorted[j]) + 1);
	idem_sha256_final(&ctx, digest);
	for (int j = 0; j < 8; j++)
		epoch = (epoch << 8) | digest[j];
	pfree(sorted);
	return epoch == 0 ? 1 : epoch;
}

static const ClusterMember *
naming_find(const ClusterNaming *nm, const ClusterMember *node)
{
	for (int i = 0; i < nm->nmembers; i++)
		if (nm->members[i].addr == node->addr ||
			nm->members[i].sysid == node->sysid)
			return &nm->members[i];
	return NULL;
}

static bool
naming_in(const ClusterMember *nodes, int n, uint64 addr)
{
	for (int i = 0; i < n; i++)
		if (nodes[i].addr == addr)
			return true;
	return false;
}

/*
 * Can naming nm be named again, now that the coordinator's identity is
 * coord, the nodes that answered are answered[0 .. nanswered - 1], those
 * that did not, silent[0 .. nsilent - 1] (only their addresses), and
 * held[0 .. nheld - 1] the addresses that hold placements of the tenant
 * ledger?  If so, nm gains the answering nodes that were not members.
 */
static bool
naming_holds(ClusterNaming *nm, uint64 coord,
			 const ClusterMember *answered, int nanswered,
			 const ClusterMember *silent, int nsilent,
			 const ClusterMember *held, int nheld)
{
	int			nnew = 0;

	if (nm->epoch == 0 || nm->coord != coord)
		return false;
	for (int i = 0; i < nsilent; i++)
		if (naming_in(nm->members, nm->nmembers, silent[i].addr))
			return false;		/* a member that does not answer */
	for (int i = 0; i < nanswered; i++)
	{
		const ClusterMember *m = naming_find(nm, &answered[i]);

		if (m != NULL)
		{
			if (m->ident != answered[i].ident)
				return false;	/* a member whose history changed */
			continue;
		}
		if (naming_in(held, nheld, answered[i].addr))
			return false;		/* a node new to it that holds rows */
		nnew++;
	}
	if (nm->nmembers + nnew > CLUSTER_MEMBERS)
		return false;
	for (int i = 0; i < nanswered; i++)
		if (naming_find(nm, &answered[i]) == NULL)
			nm->members[nm->nmembers++] = answered[i];
	return true;
}

/*
 * The epoch of the cluster keyspace of database dboid, given what the
 * nodes answered (see naming_holds' arguments): a naming's again if one
 * holds, else new_epoch (the hash of them all), remembered with the
 * answering nodes as its members.  A coordinator whose owner key a node
 * retired (idem_cache_cluster_disown) names new_epoch and forgets the
 * namings.  Returns the epoch; 0 when the database has no slot.
 */
uint64
idem_cluster_naming_choose(Oid dboid, uint64 coord, uint64 new_epoch,
						   const ClusterMember *answered, int nanswered,
						   const ClusterMember *silent, int nsilent,
						   const ClusterMember *held, int nheld)
{
	ClusterSlot *slot;
	ClusterNaming names[CLUSTER_NAMINGS];
	ClusterNaming chosen;
	int			found = -1;
	bool		force = false;

	SpinLockAcquire(&idem_cluster_shared->mutex);
	slot = idem_cluster_slot_find(dboid, true);
	if (slot != NULL)
	{
		memcpy(names, slot->named, sizeof(names));
		force = slot->joined && slot->owner_token == 0;
	}
	SpinLockRelease(&idem_cluster_shared->mutex);
	if (slot == NULL)
		return 0;

	/* the oldest naming first: it has the most copies */
	for (int i = CLUSTER_NAMINGS - 1; i >= 0 && !force && found < 0; i--)
		if (naming_holds(&names[i], coord, answered, nanswered,
						 silent, nsilent, held, nheld))
			found = i;
	if (found >= 0)
		chosen = names[found];
	else
	{
		memset(&chosen, 0, sizeof(chosen));
		chosen.epoch = new_epoch;
		chosen.coord = coord;
		if (nanswered <= CLUSTER_MEMBERS)
		{
			chosen.nmembers = nanswered;
			memcpy(chosen.members, answered, sizeof(ClusterMember) * nanswered);
		}
		else
			chosen.epoch = 0;	/* too many to remember: named, not kept */
	}

	/* the chosen one becomes the newest; the others keep their order */
	SpinLockAcquire(&idem_cluster_shared->mutex);
	slot = idem_cluster_slot_find(dboid, false);
	if (slot != NULL)
	{
		int			j = 1;

		for (int i = 0; i < CLUSTER_NAMINGS && j < CLUSTER_NAMINGS && !force; i++)
			if (i != found && names[i].epoch != 0 &&
				names[i].epoch != chosen.epoch)
				slot->named[j++] = names[i];
		while (j < CLUSTER_NAMINGS)
			memset(&slot->named[j++], 0, sizeof(ClusterNaming));
		slot->named[0] = chosen;
	}
	SpinLockRelease(&idem_cluster_shared->mutex);
	return found >= 0 ? chosen.epoch : new_epoch;
}
