/*-------------------------------------------------------------------------
 *
 * worker_epoch.c
 *	  The worker's part of the history epoch (cache_secret.c's file
 *	  header): taking this start's epoch over in Valkey (its owner key),
 *	  with the epoch pointer that names the last epoch taken over and the
 *	  epochs this history knows are dead; checking every
 *	  IDEM_OWNER_CHECK_MS that the owner key still holds this server's
 *	  token and that the dead epochs stay retired; on a standby, retiring
 *	  the epoch the pointer names if it was taken over on a branch of
 *	  history this server's timeline left (pg_rewind); and the owner keys
 *	  of Citus cluster keyspaces (cache_cluster.c).  Until the epoch is
 *	  taken over nothing is copied.
 *
 *	  Locking: none of its own; the epoch's shared state is
 *	  cache_secret.c's and cache_cluster.c's, behind their locks.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/timeline.h"
#include "access/xlog.h"
#include "access/xlogrecovery.h"
#include "utils/timestamp.h"

#include "cache_cluster.h"
#include "cache_format.h"
#include "cache_keyspace.h"
#include "cache_secret.h"
#include "worker_int.h"

/*
 * How long the epoch owner key lives after the last start that took the
 * epoch over: a server stopped for longer starts with a cold cache.
 */
#define IDEM_EPOCH_OWNER_TTL_MS		(INT64CONST(30) * 24 * 3600 * 1000)

/* When the owner key was last checked (worker_check_owner). */
TimestampTz owner_checked_at = 0;

/* When a standby last read the epoch pointer (worker_check_pointer). */
static TimestampTz pointer_checked_at = 0;

/*
 * What the epoch pointer holds: "<timeline>.<epoch: 16 hex> <LSN: 16 hex>",
 * the epoch the last takeover of this cluster took over and the WAL
 * position of that server then.
 */
typedef struct EpochPointer
{
	bool		valid;			/* false: no pointer, or not one of ours */
	IdemEpochName name;
	XLogRecPtr	lsn;
} EpochPointer;

#define POINTER_TEXT_MAX	(10 + 1 + 16 + 1 + 16 + 1)

/* The token an epoch's owner key holds (16 lower-case hex digits). */
#define OWNER_TOKEN_TEXT(buf, token) \
	snprintf((buf), sizeof(buf), "%016llx", (unsigned long long) (token))

/* Does a reply hold exactly that token's text? */
static bool
owner_reply_is(const redisReply *reply, const char *token)
{
	return reply->type == REDIS_REPLY_STRING &&
		reply->len == IDEM_CACHE_EPOCH_TOKEN_LEN &&
		memcmp(reply->str, token, IDEM_CACHE_EPOCH_TOKEN_LEN) == 0;
}

static VkResult vk_key_command(const char *key, int argc, const char **argv,
								redisReply **reply);

/*
 * One command on the owner key of epoch (timeline, epoch): argv[1] is set
 * to that key here, the other arguments are the caller's.  An error reply
 * is VK_FAILED, with worker_errbuf saying it; on VK_OK *reply (if reply is
 * not NULL) is the caller's to free.
 */
/* The owner key of epoch (timeline, epoch) into key; false (worker_errbuf
 * says why) if the prefix leaves it no room. */
static bool
owner_key_of(char *key, TimeLineID timeline, uint64 epoch)
{
	if (idem_cache_epoch_key_of(key, IDEM_CACHE_EPOCH_KEY_MAX, timeline, epoch) < 0)
	{
		snprintf(worker_errbuf, sizeof(worker_errbuf), "idem.valkey_prefix is too long");
		return false;
	}
	return true;
}

static VkResult
vk_owner_command(TimeLineID timeline, uint64 epoch, int argc,
				 const char **argv, redisReply **reply)
{
	char		key[IDEM_CACHE_EPOCH_KEY_MAX];

	if (!owner_key_of(key, timeline, epoch))
		return VK_FAILED;
	return vk_key_command(key, argc, argv, reply);
}

/* The same on any key: argv[1] is set to key here. */
static VkResult
vk_key_command(const char *key, int argc, const char **argv,
			   redisReply **reply)
{
	size_t		argvlen[6];
	int			keylen = strlen(key);
	redisReply *rep = NULL;
	VkResult	r;

	Assert(argc <= lengthof(argvlen));
	argv[1] = key;
	for (int i = 0; i < argc; i++)
		argvlen[i] = strlen(argv[i]);
	r = vk_command(key, keylen, argc, argv, argvlen, &rep);
	if (r == VK_OK && rep->type == REDIS_REPLY_ERROR)
	{
		snprintf(worker_errbuf, sizeof(worker_errbuf), "Valkey replied: %.*s",
				 (int) rep->len, rep->str);
		r = VK_FAILED;
	}
	if (r == VK_OK && reply != NULL)
		*reply = rep;
	else if (rep != NULL)
		freeReplyObject(rep);
	return r;
}

/* Is that the same epoch? */
static bool
epoch_is(const IdemEpochName *a, TimeLineID timeline, uint64 epoch)
{
	return a->timeline == timeline && a->epoch == epoch;
}

/*
 * Retire epoch *dead: its owner key gets a retired marker naming (timeline,
 * epoch), the epoch that replaces it, whatever it held: the runners still
 * on it stop trusting it at their next lookup.
 */
static VkResult
epoch_retire(const IdemEpochName *dead, TimeLineID timeline, uint64 epoch)
{
	char		retired[sizeof(IDEM_CACHE_EPOCH_RETIRED) + 10 + 1 + 16];
	char		ttl[32];
	const char *argv[5];

	snprintf(retired, sizeof(retired), IDEM_CACHE_EPOCH_RETIRED "%u.%016llx",
			 timeline, (unsigned long long) epoch);
	snprintf(ttl, sizeof(ttl), INT64_FORMAT, IDEM_EPOCH_OWNER_TTL_MS);
	argv[0] = "SET";
	argv[2] = retired;
	argv[3] = "PX";
	argv[4] = ttl;
	return vk_owner_command(dead->timeline, dead->epoch, 5, argv, NULL);
}

/*
 * The same for an epoch some other history (the pointer) named: retired,
 * logged, and remembered as dead in the secret file.
 */
static VkResult
epoch_retire_other(const EpochPointer *p, TimeLineID timeline, uint64 epoch,
				   const char *why)
{
	VkResult	r = epoch_retire(&p->name, timeline, epoch);

	if (r != VK_OK)
		return r;
	idem_cache_epoch_note_dead(&p->name);
	ereport(LOG,
			(errmsg("idem: retired cache epoch %016llx of timeline %u",
					(unsigned long long) p->name.epoch, p->name.timeline),
			 errdetail_internal("%s", why)));
	return VK_OK;
}

/* Parse a reply from the epoch pointer into *p (p->valid: it was one). */
static void
pointer_parse(const redisReply *reply, EpochPointer *p)
{
	char		text[POINTER_TEXT_MAX + 1];
	unsigned int tli;
	unsigned long long epoch;
	unsigned long long lsn;
	int			used = -1;

	memset(p, 0, sizeof(*p));
	if (reply->type != REDIS_REPLY_STRING || reply->len > POINTER_TEXT_MAX)
		return;
	memcpy(text, reply->str, reply->len);
	text[reply->len] = '\0';
	if (sscanf(text, "%u.%16llx %16llx%n", &tli, &epoch, &lsn, &used) != 3 ||
		used != (int) reply->len || tli == 0 || epoch == 0)
		return;
	p->valid = true;
	p->name.timeline = tli;
	p->name.epoch = epoch;
	p->lsn = (XLogRecPtr) lsn;
}

/*
 * GET the epoch pointer, or (with set, the epoch this server takes over)
 * SET it with GET; *p is what it held.
 */
static VkResult
pointer_command(const IdemEpochTakeover *set, EpochPointer *p)
{
	char		key[IDEM_CACHE_EPOCH_KEY_MAX];
	char		value[POINTER_TEXT_MAX + 1];
	char		ttl[32];
	const char *argv[6];
	redisReply *reply = NULL;
	VkResult	r;

	memset(p, 0, sizeof(*p));
	if (idem_cache_epoch_pointer_of(key, sizeof(key)) < 0)
	{
		snprintf(worker_errbuf, sizeof(worker_errbuf), "idem.valkey_prefix is too long");
		return VK_FAILED;
	}
	if (set == NULL)
	{
		argv[0] = "GET";
		r = vk_key_command(key, 2, argv, &reply);
	}
	else
	{
		snprintf(value, sizeof(value), "%u.%016llx %016llx", set->timeline,
				 (unsigned long long) set->epoch,
				 (unsigned long long) GetXLogInsertRecPtr());
		snprintf(ttl, sizeof(ttl), INT64_FORMAT, IDEM_EPOCH_OWNER_TTL_MS);
		argv[0] = "SET";
		argv[2] = value;
		argv[3] = "PX";
		argv[4] = ttl;
		argv[5] = "GET";
		r = vk_key_command(key, 6, argv, &reply);
	}
	if (r != VK_OK)
		return r;
	pointer_parse(reply, p);
	freeReplyObject(reply);
	return VK_OK;
}

/*
 * Was epoch *p taken over on a branch of history that timeline tli left, or
 * never had?  Its timeline is an ancestor of tli (in tli's history) that
 * ended before the takeover's WAL position: that server went on, on the old
 * timeline, after the one that made tli took over (an old primary after a
 * failover, then rewound).  Epochs of tli itself or of a later timeline are
 * never judged: they may be a live server's.
 */
static bool
pointer_diverged(const EpochPointer *p, TimeLineID tli)
{
	List	   *history;
	ListCell   *lc;
	bool		diverged = true;

	if (p->name.timeline >= tli)
		return false;
	history = readTimeLineHistory(tli);
	foreach(lc, history)
	{
		TimeLineHistoryEntry *e = (TimeLineHistoryEntry *) lfirst(lc);

		if (e->tli == p->name.timeline)
		{
			diverged = !XLogRecPtrIsInvalid(e->end) && p->lsn >= e->end;
			break;
		}
	}
	list_free_deep(history);
	return diverged;
}

/*
 * Must the takeover t retire epoch *p, which the pointer named?  Yes at the
 * first takeover since the start of a new epoch: this start cannot show
 * that it continues the history Valkey saw last (it ran recovery, was
 * restored, cloned, promoted, rewound or reset, or another start took its
 * epoch over), so the newest epoch of its system goes, whichever copy's it
 * is; and whenever *p was taken over on a branch this timeline left.  Not
 * otherwise: a renewal of a running server retires its own epoch, and a
 * server that lost its epoch to a copy must not retire the copy's in turn.
 */
static bool
pointer_must_retire(const EpochPointer *p, const IdemEpochTakeover *t)
{
	if (!p->valid || epoch_is(&p->name, t->timeline, t->epoch))
		return false;
	for (int i = 0; i < t->ndead; i++)
		if (epoch_is(&t->dead[i], p->name.timeline, p->name.epoch))
			return false;		/* retired already */
	return (t->first && t->expect_token == 0) ||
		pointer_diverged(p, t->timeline);
}

/*
 * Take this start's epoch over (cache_secret.c's file header), if it is not
 * yet.  First retire the epochs this history knows are dead, and the one
 * the epoch pointer names if this takeover must (pointer_must_retire):
 * their owner keys get a retired marker naming this epoch, whatever they
 * held, so the runners still on them stop trusting them at their next
 * lookup.  Then SET <epoch owner key> <new token> GET, and keep the epoch
 * only if the value replaced is the token this data directory recorded
 * (none, for a new epoch); otherwise make a new epoch and take that one
 * over.  Last, point the epoch pointer at this epoch (SET ... GET: an epoch
 * another start pointed it at meanwhile is judged as above).  Until this
 * succeeds nothing is copied and runners get no keyspace.  Every step can
 * be repeated: a worker that stops half-way does it again.
 */
VkResult
worker_take_epoch(void)
{
	IdemEpochTakeover t;
	int			tries;

	for (tries = 0; tries < 3 && idem_cache_epoch_takeover(&t); tries++)
	{
		char		token[IDEM_CACHE_EPOCH_TOKEN_LEN + 1];
		char		expect[IDEM_CACHE_EPOCH_TOKEN_LEN + 1];
		char		ttl[32];
		const char *argv[6];
		redisReply *reply = NULL;
		VkResult	r;
		bool		won;
		EpochPointer prev;
		EpochPointer now;

		OWNER_TOKEN_TEXT(token, t.new_token);
		OWNER_TOKEN_TEXT(expect, t.expect_token);
		snprintf(ttl, sizeof(ttl), INT64_FORMAT, IDEM_EPOCH_OWNER_TTL_MS);
		for (int i = 0; i < t.ndead; i++)
		{
			r = epoch_retire(&t.dead[i], t.timeline, t.epoch);
			if (r != VK_OK)
				return r;
		}
		r = pointer_command(NULL, &prev);
		if (r == VK_OK && pointer_must_retire(&prev, &t))
			r = epoch_retire_other(&prev, t.timeline, t.epoch,
								   "Valkey's epoch pointer named it: the newest epoch of this system, which this start's history may lack.");
		if (r != VK_OK)
			return r;
		argv[0] = "SET";
		argv[2] = token;
		argv[3] = "PX";
		argv[4] = ttl;
		argv[5] = "GET";
		r = vk_owner_command(t.timeline, t.epoch, 6, argv, &reply);
		if (r != VK_OK)
			return r;
		if (t.expect_token == 0)
			won = reply->type == REDIS_REPLY_NIL;
		else
			won = owner_reply_is(reply, expect);
		freeReplyObject(reply);
		if (won)
		{
			r = pointer_command(&t, &now);
			if (r == VK_OK && !(now.valid && prev.valid &&
								epoch_is(&now.name, prev.name.timeline, prev.name.epoch)) &&
				pointer_must_retire(&now, &t))
				r = epoch_retire_other(&now, t.timeline, t.epoch,
									   "Valkey's epoch pointer named it: another start took it over while this one did.");
			if (r != VK_OK)
				return r;
			idem_cache_epoch_taken(&t);
			owner_checked_at = GetCurrentTimestamp();
			ereport(LOG,
					(errmsg("idem: took cache epoch %016llx over in Valkey",
							(unsigned long long) t.epoch)));
		}
		else
			idem_cache_epoch_renew(t.epoch, IDEM_EPOCH_TAKEN_ELSEWHERE);
	}
	return VK_OK;
}

/*
 * An owner key that should hold token: GET it; if it does, push its expiry
 * back; if Valkey lost it, set it again (SET NX).  *taken: it holds
 * anything else (retired, or taken over elsewhere).
 */
static VkResult
owner_keep(const char *key, const char *token, bool *taken, bool *lost_out)
{
	char		ttl[32];
	const char *argv[6];
	redisReply *reply = NULL;
	VkResult	r;
	bool		ours;
	bool		lost;

	*taken = false;
	snprintf(ttl, sizeof(ttl), INT64_FORMAT, IDEM_EPOCH_OWNER_TTL_MS);
	argv[0] = "GET";
	r = vk_key_command(key, 2, argv, &reply);
	if (r != VK_OK)
		return r;
	ours = owner_reply_is(reply, token);
	lost = reply->type == REDIS_REPLY_NIL;
	freeReplyObject(reply);
	if (lost_out != NULL)
		*lost_out = lost;
	if (lost)
	{
		/* a racing writer wins: the next check sees it */
		argv[0] = "SET";
		argv[2] = token;
		argv[3] = "NX";
		argv[4] = "PX";
		argv[5] = ttl;
		return vk_key_command(key, 6, argv, NULL);
	}
	if (!ours)
	{
		*taken = true;
		return VK_OK;
	}
	argv[0] = "PEXPIRE";
	argv[2] = ttl;
	return vk_key_command(key, 3, argv, NULL);
}

/*
 * The epochs this history knows are dead stay retired: a Valkey restored
 * from a snapshot taken before they were retired brings their owner keys
 * back with a live token, which runners still on them would trust again.
 * One GET each; a SET only for one that holds something else than a
 * retired marker (a key Valkey lost stays lost: no runner trusts that).
 * (timeline, epoch) is the epoch this server owns, which the marker names.
 */
static VkResult
dead_keep_retired(TimeLineID timeline, uint64 epoch)
{
	IdemEpochName dead[IDEM_EPOCH_DEAD_MAX];
	int			n = idem_cache_epoch_dead(dead);

	for (int i = 0; i < n; i++)
	{
		const char *argv[2];
		redisReply *reply = NULL;
		VkResult	r;
		bool		live;

		argv[0] = "GET";
		r = vk_owner_command(dead[i].timeline, dead[i].epoch, 2, argv, &reply);
		if (r != VK_OK)
			return r;
		live = reply->type == REDIS_REPLY_STRING &&
			(reply->len < sizeof(IDEM_CACHE_EPOCH_RETIRED) - 1 ||
			 memcmp(reply->str, IDEM_CACHE_EPOCH_RETIRED,
					sizeof(IDEM_CACHE_EPOCH_RETIRED) - 1) != 0);
		freeReplyObject(reply);
		if (!live)
			continue;
		r = epoch_retire(&dead[i], timeline, epoch);
		if (r != VK_OK)
			return r;
		ereport(LOG,
				(errmsg("idem: retired cache epoch %016llx of timeline %u again",
						(unsigned long long) dead[i].epoch, dead[i].timeline),
				 errdetail("Its owner key held a token again although this server's history retired it: Valkey was restored from an older snapshot, perhaps.")));
	}
	return VK_OK;
}

/*
 * On a standby, every IDEM_OWNER_CHECK_MS: does the epoch pointer name an
 * epoch taken over on a branch of history that the timeline this server
 * replays left (pointer_diverged)?  That is an old primary's after a
 * failover, this server itself perhaps before pg_rewind replaced its
 * secret file with its new primary's: retire it, so that the runners still
 * on it stop replaying what this history lacks.  Nothing is copied during
 * recovery, so this is all a standby's worker does in Valkey.
 */
VkResult
worker_check_pointer(void)
{
	EpochPointer p;
	TimeLineID	tli = 0;
	IdemEpochName dead[IDEM_EPOCH_DEAD_MAX];
	int			ndead;
	IdemCacheSecrets s;
	VkResult	r;

	if (!RecoveryInProgress() ||
		!TimestampDifferenceExceeds(pointer_checked_at, GetCurrentTimestamp(),
									IDEM_OWNER_CHECK_MS))
		return VK_OK;
	(void) GetXLogReplayRecPtr(&tli);
	if (tli == 0)
		return VK_OK;
	r = pointer_command(NULL, &p);
	if (r != VK_OK)
		return r;
	pointer_checked_at = GetCurrentTimestamp();
	if (!p.valid || !pointer_diverged(&p, tli))
		return VK_OK;
	ndead = idem_cache_epoch_dead(dead);
	for (int i = 0; i < ndead; i++)
		if (epoch_is(&dead[i], p.name.timeline, p.name.epoch))
			return VK_OK;
	idem_cache_secrets_get(&s);
	explicit_bzero(s.current, sizeof(s.current));
	explicit_bzero(s.previous, sizeof(s.previous));
	return epoch_retire_other(&p, tli, s.epoch,
							  "It was taken over on a branch of history that the timeline this standby replays left (an old primary that went on after a failover).");
}

/*
 * Every IDEM_OWNER_CHECK_MS, after each connect and before the first copy
 * after an idle wait (so that the copies runners read next are vouched
 * for): does the owner key of
 * the epoch this server owns still hold its token?  If so its expiry is
 * pushed back.  If Valkey lost it (a restart without persistence, a flush,
 * an eviction), it is set again (SET NX): everything left under this
 * epoch's keyspace was written by this server, and runners trust nothing
 * there meanwhile.  If it holds anything else (another server started
 * from a copy of this one retired it or took it over), a new epoch is due,
 * which the main loop takes over next.  The epochs this history knows are
 * dead are checked too (dead_keep_retired).
 */
VkResult
worker_check_owner(void)
{
	IdemEpochTakeover t;
	char		token[IDEM_CACHE_EPOCH_TOKEN_LEN + 1];
	char		key[IDEM_CACHE_EPOCH_KEY_MAX];
	VkResult	r;
	bool		taken;
	bool		lost;

	if (!TimestampDifferenceExceeds(owner_checked_at, GetCurrentTimestamp(),
									IDEM_OWNER_CHECK_MS) ||
		!idem_cache_epoch_owned(&t))
		return VK_OK;
	if (!owner_key_of(key, t.timeline, t.epoch))
		return VK_FAILED;
	OWNER_TOKEN_TEXT(token, t.new_token);
	r = owner_keep(key, token, &taken, &lost);
	if (r == VK_OK && lost)
	{
		/* Valkey lost its state: the pointer too, perhaps */
		EpochPointer ignored;

		r = pointer_command(&t, &ignored);
	}
	if (r == VK_OK && !taken)
		r = dead_keep_retired(t.timeline, t.epoch);
	if (r != VK_OK)
		return r;
	owner_checked_at = GetCurrentTimestamp();
	if (taken)
	{
		ereport(LOG,
				(errmsg("idem: cache epoch %016llx is no longer this server's in Valkey",
						(unsigned long long) t.epoch),
				 errdetail("Its owner key was retired or taken over by another server started from a copy of this data directory; a new epoch follows.")));
		idem_cache_epoch_renew(t.epoch, IDEM_EPOCH_TAKEN_ELSEWHERE);
	}
	return VK_OK;
}

/*
 * The owner keys of Citus cluster keyspaces (cache_cluster.c): retire the
 * ones a coordinator replaced and the one of a join this node's new epoch
 * ended (a retired marker, whatever the key held: runners still on that
 * keyspace stop trusting it at their next lookup), and set the
 * coordinator's.  With check (as often as worker_check_owner), the owner
 * keys the coordinator set are checked as its own: pushed back if they
 * hold its token, set again if Valkey lost them, and given up if a node
 * retired them.
 */
VkResult
worker_cluster_owners(bool check)
{
	IdemEpochTakeover t;
	IdemClusterDuty d;
	bool		owned = idem_cache_epoch_owned(&t);
	char		ttl[32];
	char		token[IDEM_CACHE_EPOCH_TOKEN_LEN + 1];
	const char *argv[6];
	VkResult	r;

	snprintf(ttl, sizeof(ttl), INT64_FORMAT, IDEM_EPOCH_OWNER_TTL_MS);
	for (int n = 0; n < 3 * IDEM_CLUSTER_SLOTS &&
		 idem_cache_cluster_duty(&d, owned, t.timeline, t.epoch); n++)
	{
		argv[0] = "SET";
		argv[3] = "PX";
		argv[4] = ttl;
		if (d.kind == IDEM_CLUSTER_SET)
		{
			OWNER_TOKEN_TEXT(token, d.token);
			argv[2] = token;
		}
		else
			argv[2] = IDEM_CACHE_EPOCH_RETIRED "cluster";
		r = vk_key_command(d.key, 5, argv, NULL);
		if (r != VK_OK)
			return r;
		if (d.kind != IDEM_CLUSTER_SET)
			ereport(LOG,
					(errmsg("idem: retired the Citus cluster cache keyspace \"%s\"",
							d.keyspace),
					 errdetail(d.kind == IDEM_CLUSTER_RETIRE ?
							   "The coordinator named a new cluster keyspace." :
							   "This node's history epoch changed since it joined.")));
		idem_cache_cluster_duty_done(&d);
	}
	for (int i = 0; check && i < IDEM_CLUSTER_SLOTS; i++)
	{
		bool		taken;

		if (!idem_cache_cluster_owned(i, &d))
			continue;
		OWNER_TOKEN_TEXT(token, d.token);
		r = owner_keep(d.key, token, &taken, NULL);
		if (r == VK_OK && taken)
		{
			ereport(LOG,
					(errmsg("idem: the Citus cluster cache keyspace \"%s\" was retired",
							d.keyspace),
					 errdetail("The history epoch of a node of the cluster changed; the next time a runner asks, the coordinator names a new keyspace.")));
			idem_cache_cluster_disown(&d);
		}
		if (r != VK_OK)
			return r;
	}
	return VK_OK;
}

/*
 * May records be copied now?  Not while the epoch is not taken over (a
 * renewal since the last batch): the drain then returns, and the main loop
 * takes the new epoch over first.
 */
bool
worker_epoch_ready(void)
{
	uint64		epoch;

	return idem_cache_epoch_confirmed(&epoch);
}
