/*-------------------------------------------------------------------------
 *
 * worker_epoch.c
 *	  The worker's part of the history epoch (cache_secret.c's file
 *	  header): taking this start's epoch over in Valkey (its owner key),
 *	  checking every IDEM_OWNER_CHECK_MS that the owner key still holds
 *	  this server's token, and the owner keys of Citus cluster keyspaces
 *	  (cache_cluster.c).  Until the epoch is taken over nothing is copied.
 *
 *	  Locking: none of its own; the epoch's shared state is
 *	  cache_secret.c's and cache_cluster.c's, behind their locks.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

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

/*
 * Take this start's epoch over (cache_secret.c's file header), if it is not
 * yet: retire the epoch it replaced, if any (its owner key gets a retired
 * marker naming this epoch, whatever it held: the runners still on it stop
 * trusting it at their next lookup); then SET <epoch owner key> <new
 * token> GET, and keep the epoch only if the value replaced is the token
 * this data directory recorded (none, for a new epoch); otherwise make a
 * new epoch and take that one over.  Until this succeeds nothing is copied
 * and runners get no keyspace.
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
		char		retired[sizeof(IDEM_CACHE_EPOCH_RETIRED) + 10 + 1 + 16];
		char		ttl[32];
		const char *argv[6];
		redisReply *reply = NULL;
		VkResult	r;
		bool		won;

		OWNER_TOKEN_TEXT(token, t.new_token);
		OWNER_TOKEN_TEXT(expect, t.expect_token);
		snprintf(ttl, sizeof(ttl), INT64_FORMAT, IDEM_EPOCH_OWNER_TTL_MS);
		if (t.retire_epoch != 0)
		{
			snprintf(retired, sizeof(retired), IDEM_CACHE_EPOCH_RETIRED "%u.%016llx",
					 t.timeline, (unsigned long long) t.epoch);
			argv[0] = "SET";
			argv[2] = retired;
			argv[3] = "PX";
			argv[4] = ttl;
			r = vk_owner_command(t.retire_timeline, t.retire_epoch, 5, argv, NULL);
			if (r != VK_OK)
				return r;
		}
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
			idem_cache_epoch_taken(&t);
			owner_checked_at = GetCurrentTimestamp();
			ereport(LOG,
					(errmsg("took history epoch %016llx over in Valkey",
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
owner_keep(const char *key, const char *token, bool *taken)
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
 * Every IDEM_OWNER_CHECK_MS, after each connect and before the first copy
 * after an idle wait (so that the copies runners read next are vouched
 * for): does the owner key of
 * the epoch this server owns still hold its token?  If so its expiry is
 * pushed back.  If Valkey lost it (a restart without persistence, a flush,
 * an eviction), it is set again (SET NX): everything left under this
 * epoch's keyspace was written by this server, and runners trust nothing
 * there meanwhile.  If it holds anything else (another server started
 * from a copy of this one retired it or took it over), a new epoch is due,
 * which the main loop takes over next.
 */
VkResult
worker_check_owner(void)
{
	IdemEpochTakeover t;
	char		token[IDEM_CACHE_EPOCH_TOKEN_LEN + 1];
	char		key[IDEM_CACHE_EPOCH_KEY_MAX];
	VkResult	r;
	bool		taken;

	if (!TimestampDifferenceExceeds(owner_checked_at, GetCurrentTimestamp(),
									IDEM_OWNER_CHECK_MS) ||
		!idem_cache_epoch_owned(&t))
		return VK_OK;
	if (!owner_key_of(key, t.timeline, t.epoch))
		return VK_FAILED;
	OWNER_TOKEN_TEXT(token, t.new_token);
	r = owner_keep(key, token, &taken);
	if (r != VK_OK)
		return r;
	owner_checked_at = GetCurrentTimestamp();
	if (taken)
	{
		ereport(LOG,
				(errmsg("history epoch %016llx is no longer this server's in Valkey",
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
					(errmsg("retired the Citus cluster cache keyspace \"%s\"",
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
		r = owner_keep(d.key, token, &taken);
		if (r == VK_OK && taken)
		{
			ereport(LOG,
					(errmsg("the Citus cluster cache keyspace \"%s\" was retired",
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
