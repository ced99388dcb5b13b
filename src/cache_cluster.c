/*-------------------------------------------------------------------------
 *
 * cache_cluster.c
 *	  One Valkey cache for a Citus cluster: the cluster keyspace the
 *	  coordinator names, the secrets every node MACs its copies with, and
 *	  how each node joins them (docs/citus.md says why).
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
 *		text, so never in a log), then sends the secrets encrypted and
 *		MACed with it (HMAC-SHA-256 as a stream cipher and as the tag).
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
 * The coordinator refreshes the joins whenever it is asked for the
 * keyspace (runners ask at least every secrets_max_age_ms): one
 * run_command_on_workers to read each node's identity, and one
 * master_run_on_worker for the nodes whose join is missing or stale.  A
 * node that does not answer (within CLUSTER_CONNECT_TIMEOUT_MS to connect)
 * is left out of the hash and not joined: its tenants are served by
 * PostgreSQL alone until it answers again.
 *
 * Locking: a spinlock over the shared struct, held only to copy a few
 * hundred bytes in or out; the idem worker reads it for every batch.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xlog.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "storage/shmem.h"
#include "storage/spin.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/lsyscache.h"

#include "cache_cluster.h"
#include "cache_format.h"
#include "cache_keyspace.h"
#include "cache_secret.h"
#include "compat.h"
#include "outbox_ring.h"
#include "sha256.h"

#define CLUSTER_DBS			IDEM_CLUSTER_SLOTS
/* "<system id>.<timeline>.<epoch as 16 hex>" */
#define NODE_ID_MAX			(20 + 1 + 10 + 1 + 16 + 1)
#define SEAL_NONCE_LEN		16
/* current id, current secret, previous id, previous secret */
#define SEAL_PLAIN_LEN		(4 + IDEM_MAC_LEN + 4 + IDEM_MAC_LEN)
#define SEAL_LEN			(SEAL_NONCE_LEN + SEAL_PLAIN_LEN + IDEM_MAC_LEN)
/* How long the coordinator waits to connect to a node it asks. */
#define CLUSTER_CONNECT_TIMEOUT_MS	2000

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
	/* the coordinator only: the owner key of keyspace (see the header) */
	uint64		owner_token;	/* its token; 0: none chosen */
	bool		owner_set;		/* the worker set it: runners may be told */
	/* a keyspace whose owner key the worker must retire; "": none */
	char		retire[IDEM_CACHE_KEYSPACE_MAX + 1];
} ClusterSlot;

typedef struct ClusterShared
{
	slock_t		mutex;
	Oid			seal_db;		/* the one-time key's database */
	bool		seal_valid;
	uint8		seal_key[IDEM_MAC_LEN];
	ClusterSlot slots[CLUSTER_DBS];
} ClusterShared;

static ClusterShared *cluster_shared = NULL;

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

	cluster_shared = ShmemInitStruct("idem cache cluster",
									 sizeof(ClusterShared), &found);
	if (!found)
	{
		memset(cluster_shared, 0, sizeof(ClusterShared));
		SpinLockInit(&cluster_shared->mutex);
	}
}

/* The slot of dboid, or a free one if create; NULL.  Mutex held. */
static ClusterSlot *
slot_find(Oid dboid, bool create)
{
	int			i;

	for (i = 0; i < CLUSTER_DBS; i++)
		if (cluster_shared->slots[i].dboid == dboid)
			return &cluster_shared->slots[i];
	if (!create)
		return NULL;
	for (i = 0; i < CLUSTER_DBS; i++)
		if (cluster_shared->slots[i].dboid == InvalidOid)
		{
			memset(&cluster_shared->slots[i], 0, sizeof(ClusterSlot));
			cluster_shared->slots[i].dboid = dboid;
			return &cluster_shared->slots[i];
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

	if (cluster_shared == NULL)
		return;
	SpinLockAcquire(&cluster_shared->mutex);
	slot = slot_find(dboid, true);
	SpinLockRelease(&cluster_shared->mutex);
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

	if (cluster_shared == NULL)
		return 0;
	SpinLockAcquire(&cluster_shared->mutex);
	slot = slot_find(dboid, false);
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
	SpinLockRelease(&cluster_shared->mutex);
	if (r == 1)
	{
		idem_hmac_key(mac_key, secret, IDEM_MAC_LEN);
		explicit_bzero(secret, sizeof(secret));
	}
	return r;
}

/* This node's identity now, or false if it has no keyspace now. */
static bool
node_identity(char *buf, size_t len, TimeLineID *tli, uint64 *epoch)
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

	if (cluster_shared == NULL)
		return 0;
	ready = node_identity(id, sizeof(id), &tli, &epoch);
	SpinLockAcquire(&cluster_shared->mutex);
	slot = slot_find(dboid, false);
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
	SpinLockRelease(&cluster_shared->mutex);
	return r;
}

/*
 * Install a join for dboid (the mutex not held).  On the coordinator
 * new_token is a fresh random token: it becomes the owner token of a
 * keyspace that changed (or has none), and the keyspace it replaces is
 * retired if runners were told its owner; an unused keyspace passes its
 * retire on.  Returns whether the worker has an owner key to set.
 */
static bool
slot_join(Oid dboid, const char *keyspace, TimeLineID tli, uint64 epoch,
		  const IdemCacheSecrets *s, uint64 new_token)
{
	ClusterSlot *slot;
	bool		wake = false;

	SpinLockAcquire(&cluster_shared->mutex);
	slot = slot_find(dboid, true);
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
	SpinLockRelease(&cluster_shared->mutex);
	return slot != NULL && (wake || new_token == 0);
}

/* ---------- the owner key of the cluster keyspace ---------- */

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

	if (cluster_shared == NULL)
		return false;
	SpinLockAcquire(&cluster_shared->mutex);
	slot = slot_find(dboid, false);
	if (slot != NULL && slot->joined && slot->owner_set &&
		slot->owner_token != 0)
	{
		memcpy(keyspace, slot->keyspace, sizeof(keyspace));
		*token = slot->owner_token;
		ok = true;
	}
	SpinLockRelease(&cluster_shared->mutex);
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
	if (cluster_shared == NULL)
		return false;
	SpinLockAcquire(&cluster_shared->mutex);
	for (int i = 0; i < CLUSTER_DBS && !found; i++)
	{
		ClusterSlot *slot = &cluster_shared->slots[i];

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
	SpinLockRelease(&cluster_shared->mutex);
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

	SpinLockAcquire(&cluster_shared->mutex);
	slot = slot_find(d->dboid, false);
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
	SpinLockRelease(&cluster_shared->mutex);
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
	if (cluster_shared == NULL)
		return false;
	slot = &cluster_shared->slots[i];
	SpinLockAcquire(&cluster_shared->mutex);
	ok = slot->dboid != InvalidOid && slot->joined && slot->owner_set &&
		slot->owner_token != 0;
	if (ok)
	{
		d->kind = IDEM_CLUSTER_SET;
		d->dboid = slot->dboid;
		d->token = slot->owner_token;
		memcpy(d->keyspace, slot->keyspace, sizeof(d->keyspace));
	}
	SpinLockRelease(&cluster_shared->mutex);
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

	SpinLockAcquire(&cluster_shared->mutex);
	slot = slot_find(d->dboid, false);
	if (slot != NULL && slot->owner_token == d->token &&
		strcmp(slot->keyspace, d->keyspace) == 0)
	{
		slot->owner_token = 0;
		slot->owner_set = false;
	}
	SpinLockRelease(&cluster_shared->mutex);
}

/* ---------- sealing the secrets for one node ---------- */

/*
 * out[0..SEAL_PLAIN_LEN) ^= the key stream of (key, nonce): HMAC-SHA-256
 * of "idem seal" 0x00 nonce <block number>, block after block.
 */
static void
seal_stream(const idem_hmac *h, const uint8 *nonce, uint8 *out)
{
	uint8		msg[10 + SEAL_NONCE_LEN + 1];
	uint8		block[IDEM_MAC_LEN];
	int			done = 0;
	uint8		n = 0;

	memcpy(msg, "idem seal", 10);	/* with its NUL */
	memcpy(msg + 10, nonce, SEAL_NONCE_LEN);
	while (done < SEAL_PLAIN_LEN)
	{
		int			i;

		msg[10 + SEAL_NONCE_LEN] = n++;
		idem_hmac_sha256(h, msg, sizeof(msg), block);
		for (i = 0; i < IDEM_MAC_LEN && done < SEAL_PLAIN_LEN; i++)
			out[done++] ^= block[i];
	}
	explicit_bzero(block, sizeof(block));
}

/* The tag over nonce, ciphertext, the node's identity and the keyspace. */
static void
seal_tag(const idem_hmac *h, const uint8 *sealed, const char *identity,
		 const char *keyspace, uint8 *tag)
{
	StringInfoData m;

	initStringInfo(&m);
	appendBinaryStringInfo(&m, "idem tag", 9);
	appendBinaryStringInfo(&m, (const char *) sealed,
						   SEAL_NONCE_LEN + SEAL_PLAIN_LEN);
	appendBinaryStringInfo(&m, identity, strlen(identity) + 1);
	appendBinaryStringInfo(&m, keyspace, strlen(keyspace) + 1);
	idem_hmac_sha256(h, m.data, m.len, tag);
	pfree(m.data);
}

static void
put32(uint8 *p, int32 v)
{
	p[0] = (uint8) ((uint32) v >> 24);
	p[1] = (uint8) ((uint32) v >> 16);
	p[2] = (uint8) ((uint32) v >> 8);
	p[3] = (uint8) v;
}

static int32
get32(const uint8 *p)
{
	return (int32) (((uint32) p[0] << 24) | ((uint32) p[1] << 16) |
					((uint32) p[2] << 8) | p[3]);
}

/* Seal secrets s with key for the node identity and keyspace: hex text. */
static char *
seal(const uint8 *key, const IdemCacheSecrets *s, const char *identity,
	 const char *keyspace)
{
	uint8		buf[SEAL_LEN];
	uint8	   *plain = buf + SEAL_NONCE_LEN;
	idem_hmac	h;
	char	   *hex = palloc(2 * SEAL_LEN + 1);

	if (!pg_strong_random(buf, SEAL_NONCE_LEN))
		ereport(ERROR,
				(errcode(ERRCODE_INTERNAL_ERROR),
				 errmsg("could not generate a random nonce")));
	put32(plain, s->current_id);
	memcpy(plain + 4, s->current, IDEM_MAC_LEN);
	put32(plain + 4 + IDEM_MAC_LEN, s->previous_id);
	memcpy(plain + 8 + IDEM_MAC_LEN, s->previous, IDEM_MAC_LEN);
	idem_hmac_key(&h, key, IDEM_MAC_LEN);
	seal_stream(&h, buf, plain);
	seal_tag(&h, buf, identity, keyspace, buf + SEAL_NONCE_LEN + SEAL_PLAIN_LEN);
	explicit_bzero(&h, sizeof(h));
	idem_cache_hex(hex, buf, SEAL_LEN);
	hex[2 * SEAL_LEN] = '\0';
	return hex;
}

/* ---------- a worker node: what the coordinator calls ---------- */

PG_FUNCTION_INFO_V1(idem_cache_node);

/*
 * idem_cache_node() RETURNS text: "<identity> <one-time key as 64 hex>
 * <joined keyspace or -> <joined key id or 0>", or NULL while this node
 * has no keyspace (recovery, its epoch not taken over yet).  Marks the
 * database as clustered.  Only the coordinator calls it (revoked from
 * PUBLIC), as the extension's owner.
 */
Datum
idem_cache_node(PG_FUNCTION_ARGS)
{
	char		id[NODE_ID_MAX];
	char		keyhex[2 * IDEM_MAC_LEN + 1];
	char		joined[IDEM_CACHE_KEYSPACE_MAX + 1];
	TimeLineID	tli;
	uint64		epoch;
	uint8		key[IDEM_MAC_LEN];
	IdemCacheSecrets s;
	char	   *out;

	if (cluster_shared == NULL || !node_identity(id, sizeof(id), &tli, &epoch))
		PG_RETURN_NULL();
	idem_cache_cluster_mark(MyDatabaseId);
	if (!pg_strong_random(key, sizeof(key)))
		ereport(ERROR,
				(errcode(ERRCODE_INTERNAL_ERROR),
				 errmsg("could not generate a random key")));
	SpinLockAcquire(&cluster_shared->mutex);
	memcpy(cluster_shared->seal_key, key, sizeof(key));
	cluster_shared->seal_db = MyDatabaseId;
	cluster_shared->seal_valid = true;
	SpinLockRelease(&cluster_shared->mutex);
	idem_cache_hex(keyhex, key, sizeof(key));
	keyhex[2 * IDEM_MAC_LEN] = '\0';
	explicit_bzero(key, sizeof(key));
	memset(&s, 0, sizeof(s));
	if (idem_cache_cluster_joined(MyDatabaseId, joined, &s) != 1)
		strcpy(joined, "-");
	out = psprintf("%s %s %s %d", id, keyhex, joined, s.current_id);
	explicit_bzero(keyhex, sizeof(keyhex));
	explicit_bzero(&s, sizeof(s));
	PG_RETURN_TEXT_P(cstring_to_text(out));
}

PG_FUNCTION_INFO_V1(idem_cache_node_join);

/*
 * idem_cache_node_join(keyspace text, identity text, sealed text) RETURNS
 * boolean: join the cluster cache with the secrets sealed with the last
 * one-time key idem_cache_node() handed out (which this consumes), if this
 * node's identity is still the one the coordinator hashed.  false: not
 * joined (the key was used or replaced, the identity changed, the seal
 * does not verify).
 */
Datum
idem_cache_node_join(PG_FUNCTION_ARGS)
{
	char	   *keyspace = text_to_cstring(PG_GETARG_TEXT_PP(0));
	char	   *identity = text_to_cstring(PG_GETARG_TEXT_PP(1));
	char	   *sealedhex = text_to_cstring(PG_GETARG_TEXT_PP(2));
	char		id[NODE_ID_MAX];
	TimeLineID	tli;
	uint64		epoch;
	uint8		key[IDEM_MAC_LEN];
	uint8		buf[SEAL_LEN];
	uint8		tag[IDEM_MAC_LEN];
	uint8	   *plain = buf + SEAL_NONCE_LEN;
	bool		have_key;
	idem_hmac	h;
	IdemCacheSecrets s;
	bool		ok;

	if (cluster_shared == NULL)
		PG_RETURN_BOOL(false);
	SpinLockAcquire(&cluster_shared->mutex);
	have_key = cluster_shared->seal_valid &&
		cluster_shared->seal_db == MyDatabaseId;
	memcpy(key, cluster_shared->seal_key, sizeof(key));
	cluster_shared->seal_valid = false;
	explicit_bzero(cluster_shared->seal_key, sizeof(key));
	SpinLockRelease(&cluster_shared->mutex);
	if (!have_key || strlen(keyspace) > IDEM_CACHE_KEYSPACE_MAX ||
		strlen(sealedhex) != 2 * SEAL_LEN ||
		idem_cache_unhex(buf, sealedhex, SEAL_LEN) != 0 ||
		!node_identity(id, sizeof(id), &tli, &epoch) ||
		strcmp(id, identity) != 0)
	{
		explicit_bzero(key, sizeof(key));
		PG_RETURN_BOOL(false);
	}
	idem_hmac_key(&h, key, IDEM_MAC_LEN);
	explicit_bzero(key, sizeof(key));
	seal_tag(&h, buf, identity, keyspace, tag);
	if (!idem_cache_mac_equal(tag, buf + SEAL_NONCE_LEN + SEAL_PLAIN_LEN))
	{
		explicit_bzero(&h, sizeof(h));
		PG_RETURN_BOOL(false);
	}
	seal_stream(&h, buf, plain);
	explicit_bzero(&h, sizeof(h));
	memset(&s, 0, sizeof(s));
	s.current_id = get32(plain);
	memcpy(s.current, plain + 4, IDEM_MAC_LEN);
	s.previous_id = get32(plain + 4 + IDEM_MAC_LEN);
	memcpy(s.previous, plain + 8 + IDEM_MAC_LEN, IDEM_MAC_LEN);
	explicit_bzero(buf, sizeof(buf));
	ok = s.current_id > 0 && s.previous_id >= 0 &&
		slot_join(MyDatabaseId, keyspace, tli, epoch, &s, 0);
	explicit_bzero(&s, sizeof(s));
	PG_RETURN_BOOL(ok);
}

/* ---------- the coordinator ---------- */

static int
cmp_str(const void *a, const void *b)
{
	return strcmp(*(char *const *) a, *(char *const *) b);
}

/*
 * idem_cache_keyspace() on a database whose tenant ledger is distributed
 * by Citus (the caller has checked: idem_citus_distributed).  Returns 0
 * without idem's shared memory (the server's own keyspace applies); 1 with
 * the cluster keyspace in buf (on the coordinator, after refreshing the
 * nodes' joins; on another node, the one it joined); -1 on a node that has
 * not joined.
 */
int
idem_cache_cluster_keyspace(char *buf, size_t buflen, Oid ledger, uint64 epoch)
{
	Oid			nsp = get_rel_namespace(ledger);
	Oid			owner;
	Oid			save_userid;
	int			save_sec_context;
	int			group;
	bool		isnull;
	char		id[NODE_ID_MAX];
	TimeLineID	tli;
	uint64		own_epoch;
	char	  **ids;
	char	  **keys;
	char	  **names;
	int		   *ports;
	bool	   *need;
	int			n = 0;
	int			njoin = 0;
	uint64		i;
	idem_sha256 ctx;
	uint8		digest[32];
	uint64		cluster_epoch = 0;
	IdemCacheSecrets s;
	char	   *node_fn;
	int			guc_level;

	if (cluster_shared == NULL)
		return 0;

	SPI_connect();
	if (SPI_execute("SELECT e.extowner, (SELECT groupid FROM pg_catalog.pg_dist_local_group)"
					" FROM pg_catalog.pg_extension e WHERE e.extname OPERATOR(pg_catalog.=) 'idem'",
					true, 1) != SPI_OK_SELECT || SPI_processed != 1)
		elog(ERROR, "could not read the idem extension's owner");
	owner = DatumGetObjectId(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1, &isnull));
	group = DatumGetInt32(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 2, &isnull));
	if (isnull || group != 0)
	{
		SPI_finish();
		/* a worker node: the join the coordinator made */
		idem_cache_cluster_mark(MyDatabaseId);
		return idem_cache_cluster_joined(MyDatabaseId, buf, NULL);
	}
	idem_cache_cluster_mark(MyDatabaseId);
	if (!node_identity(id, sizeof(id), &tli, &own_epoch) || own_epoch != epoch)
	{
		SPI_finish();
		return -1;
	}

	/*
	 * Each worker node's identity, one-time key and join, read as the
	 * extension's owner (the functions are revoked from PUBLIC, and Citus
	 * connects as the current user).
	 */
	node_fn = psprintf("SELECT %s.idem_cache_node()",
					   quote_identifier(get_namespace_name(nsp)));

	/*
	 * A node that does not answer is left out: bound the wait for its
	 * connection, so that a runner learning the keyspace is not held for
	 * Citus's default (30 s).  Restored when this returns.
	 */
	guc_level = NewGUCNestLevel();
	(void) set_config_option("citus.node_connection_timeout",
							 CppAsString2(CLUSTER_CONNECT_TIMEOUT_MS),
							 PGC_USERSET, PGC_S_SESSION, GUC_ACTION_SAVE,
							 true, WARNING, false);
	GetUserIdAndSecContext(&save_userid, &save_sec_context);
	SetUserIdAndSecContext(owner, save_sec_context | SECURITY_LOCAL_USERID_CHANGE);
	{
		Oid			argtypes[1] = {TEXTOID};
		Datum		args[1] = {CStringGetTextDatum(node_fn)};

		if (SPI_execute_with_args("SELECT nodename, nodeport, success, result"
								  " FROM pg_catalog.run_command_on_workers($1)",
								  1, argtypes, args, NULL, false, 0) != SPI_OK_SELECT)
			elog(ERROR, "could not ask the Citus worker nodes for their cache identity");
	}
	ids = palloc0(sizeof(char *) * (SPI_processed + 1));
	keys = palloc0(sizeof(char *) * (SPI_processed + 1));
	names = palloc0(sizeof(char *) * (SPI_processed + 1));
	ports = palloc0(sizeof(int) * (SPI_processed + 1));
	need = palloc0(sizeof(bool) * (SPI_processed + 1));
	for (i = 0; i < SPI_processed; i++)
	{
		HeapTuple	tup = SPI_tuptable->vals[i];
		TupleDesc	desc = SPI_tuptable->tupdesc;
		bool		ok = DatumGetBool(SPI_getbinval(tup, desc, 3, &isnull));
		char	   *res = SPI_getvalue(tup, desc, 4);
		char	   *f[4];
		int			nf = 0;
		char	   *save = NULL;
		char	   *tok;

		/* a node that fails or has no keyspace now is left out */
		if (isnull || !ok || res == NULL)
			continue;
		for (tok = strtok_r(res, " ", &save); tok != NULL && nf < 4;
			 tok = strtok_r(NULL, " ", &save))
			f[nf++] = tok;
		if (nf != 4 || strlen(f[0]) >= NODE_ID_MAX ||
			strlen(f[1]) != 2 * IDEM_MAC_LEN ||
			strlen(f[2]) > IDEM_CACHE_KEYSPACE_MAX)
			continue;
		ids[n] = pstrdup(f[0]);
		/* the one-time key, the node's join and its key id */
		keys[n] = psprintf("%s %s %s", f[1], f[2], f[3]);
		names[n] = SPI_getvalue(tup, desc, 1);
		ports[n] = DatumGetInt32(SPI_getbinval(tup, desc, 2, &isnull));
		explicit_bzero(f[1], strlen(f[1]));
		n++;
	}

	/* the cluster epoch: a hash of every node's identity */
	{
		char	  **sorted = palloc(sizeof(char *) * (n + 1));

		memcpy(sorted, ids, sizeof(char *) * n);
		qsort(sorted, n, sizeof(char *), cmp_str);
		idem_sha256_init(&ctx);
		idem_sha256_update(&ctx, "idem cluster epoch", 19);
		idem_sha256_update(&ctx, id, strlen(id) + 1);
		for (int j = 0; j < n; j++)
			idem_sha256_update(&ctx, sorted[j], strlen(sorted[j]) + 1);
		idem_sha256_final(&ctx, digest);
		for (int j = 0; j < 8; j++)
			cluster_epoch = (cluster_epoch << 8) | digest[j];
		if (cluster_epoch == 0)
			cluster_epoch = 1;
	}
	if (idem_cache_keyspace_of(buf, buflen, MyDatabaseId, tli, cluster_epoch) < 0)
		elog(ERROR, "idem.valkey_prefix is longer than %d bytes",
			 IDEM_CACHE_PREFIX_MAX);

	/*
	 * The coordinator joins itself, with its own current secrets, and
	 * holds the owner key of the cluster keyspace: a new keyspace gets a
	 * new token, which its worker sets (woken now), and the one it
	 * replaces is retired.
	 */
	idem_cache_secrets_get(&s);
	{
		uint64		token = 0;

		while (token == 0)
			if (!pg_strong_random(&token, sizeof(token)))
				ereport(ERROR,
						(errcode(ERRCODE_INTERNAL_ERROR),
						 errmsg("could not generate a random token")));
		if (slot_join(MyDatabaseId, buf, tli, own_epoch, &s, token))
			idem_outbox_wake();
	}

	/* Seal the secrets for each node whose join is missing or stale. */
	{
		Datum	   *dnames = palloc(sizeof(Datum) * (n + 1));
		Datum	   *dports = palloc(sizeof(Datum) * (n + 1));
		Datum	   *dcmds = palloc(sizeof(Datum) * (n + 1));
		const char *qns = quote_identifier(get_namespace_name(nsp));

		for (int j = 0; j < n; j++)
		{
			char	   *nkey = keys[j];
			char	   *njoined = strchr(nkey, ' ') + 1;
			char	   *nkeyid = strchr(njoined, ' ') + 1;
			uint8		key[IDEM_MAC_LEN];
			char	   *sealed;

			njoined[-1] = '\0';
			nkeyid[-1] = '\0';
			need[j] = strcmp(njoined, buf) != 0 ||
				pg_strtoint32(nkeyid) != s.current_id;
			if (!need[j] || idem_cache_unhex(key, nkey, IDEM_MAC_LEN) != 0)
				continue;
			sealed = seal(key, &s, ids[j], buf);
			explicit_bzero(key, sizeof(key));
			dnames[njoin] = CStringGetTextDatum(names[j]);
			dports[njoin] = Int32GetDatum(ports[j]);
			dcmds[njoin] = CStringGetTextDatum(psprintf("SELECT %s.idem_cache_node_join(%s, %s, %s)",
														qns, quote_literal_cstr(buf),
														quote_literal_cstr(ids[j]),
														quote_literal_cstr(sealed)));
			njoin++;
		}
		explicit_bzero(&s, sizeof(s));
		if (njoin > 0)
		{
			Oid			argtypes[3] = {TEXTARRAYOID, INT4ARRAYOID, TEXTARRAYOID};
			Datum		args[3];

			args[0] = PointerGetDatum(construct_array(dnames, njoin, TEXTOID, -1, false, TYPALIGN_INT));
			args[1] = PointerGetDatum(construct_array(dports, njoin, INT4OID, 4, true, TYPALIGN_INT));
			args[2] = PointerGetDatum(construct_array(dcmds, njoin, TEXTOID, -1, false, TYPALIGN_INT));
			/* a node that fails to join copies nothing: no ERROR for it */
			if (SPI_execute_with_args("SELECT pg_catalog.master_run_on_worker($1, $2, $3, true)",
									  3, argtypes, args, NULL, false, 0) != SPI_OK_SELECT)
				elog(ERROR, "could not send the cache secrets to the Citus worker nodes");
		}
	}
	SetUserIdAndSecContext(save_userid, save_sec_context);
	AtEOXact_GUC(true, guc_level);
	SPI_finish();
	return 1;
}
