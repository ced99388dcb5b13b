/*-------------------------------------------------------------------------
 *
 * worker_epoch.c
 *	  The worker's part of the history epoch (cache_secret.c's file
 *	  header): taking this start's epoch over in Valkey (its owner key),
 *	  with the epoch list that names the last epochs taken over and the
 *	  epochs this history knows are dead; checking every
 *	  IDEM_OWNER_CHECK_MS that the owner key still holds this server's
 *	  token and that the dead epochs stay retired; on a standby, retiring
 *	  the listed epochs taken over on a branch of history this server's
 *	  timeline left (pg_rewind); and the owner keys
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
#include "miscadmin.h"
#include "postmaster/interrupt.h"
#include "utils/guc.h"
#include "utils/timestamp.h"

#include "cache_cluster.h"
#include "cache_format.h"
#include "cache_keyspace.h"
#include "cache_secret.h"
#include "epoch_renewal.h"
#include "stats.h"
#include "worker_int.h"

/*
 * How long the epoch owner key lives after the last start that took the
 * epoch over: a server stopped for longer starts with a cold cache.
 */
#define IDEM_EPOCH_OWNER_TTL_MS		(INT64CONST(30) * 24 * 3600 * 1000)

/* When the owner key was last checked (worker_check_owner). */
TimestampTz worker_owner_checked_at = 0;

/* When a standby last read the epoch list (worker_check_list). */
static TimestampTz worker_list_checked_at = 0;

/*
 * An entry of the epoch list: "<timeline>.<epoch: 16 hex> <LSN: 16 hex>",
 * an epoch a takeover of this cluster took over and the WAL position of
 * that server then.  The list holds the last IDEM_EPOCH_DEAD_MAX, newest
 * first.
 */
typedef struct EpochListed
{
	IdemEpochName name;
	XLogRecPtr	lsn;
} EpochListed;

#define LISTED_TEXT_MAX	(10 + 1 + 16 + 1 + 16)

/* The token an epoch's owner key holds (16 lower-case hex digits). */
#define OWNER_TOKEN_TEXT(buf, token) \
	snprintf((buf), sizeof(buf), "%016llx", (unsigned long long) (token))

/* Does a reply hold exactly that token's text? */
static bool
worker_owner_reply_is(const redisReply *reply, const char *token)
{
	return reply->type == REDIS_REPLY_STRING &&
		reply->len == IDEM_CACHE_EPOCH_TOKEN_LEN &&
		memcmp(reply->str, token, IDEM_CACHE_EPOCH_TOKEN_LEN) == 0;
}

static WorkerResult worker_key_command(const char *key, int argc, const char **argv,
									   redisReply **reply);

/*
 * One command on the owner key of epoch (timeline, epoch): argv[1] is set
 * to that key here, the other arguments are the caller's.  An error reply
 * is WORKER_FAILED, with worker_errbuf saying it; on WORKER_OK *reply (if reply is
 * not NULL) is the caller's to free.
 */
/* The owner key of epoch (timeline, epoch) into key; false (worker_errbuf
 * says why) if the prefix leaves it no room. */
static bool
worker_owner_key_of(char *key, TimeLineID timeline, uint64 epoch)
{
	if (idem_cache_epoch_key_of(key, IDEM_CACHE_EPOCH_KEY_MAX, timeline, epoch) < 0)
	{
		snprintf(worker_errbuf, sizeof(worker_errbuf), "idem.valkey_prefix is too long");
		return false;
	}
	return true;
}

static WorkerResult
worker_owner_command(TimeLineID timeline, uint64 epoch, int argc,
					 const char **argv, redisReply **reply)
{
	char		key[IDEM_CACHE_EPOCH_KEY_MAX];

	if (!worker_owner_key_of(key, timeline, epoch))
		return WORKER_FAILED;
	return worker_key_command(key, argc, argv, reply);
}

/* The same on any key: argv[1] is set to key here. */
static WorkerResult
worker_key_command(const char *key, int argc, const char **argv,
				   redisReply **reply)
{
	size_t		argvlen[6];
	int			keylen = strlen(key);
	redisReply *rep = NULL;
	WorkerResult r;

	Assert(argc <= lengthof(argvlen));
	argv[1] = key;
	for (int i = 0; i < argc; i++)
		argvlen[i] = strlen(argv[i]);
	r = worker_command(key, keylen, argc, argv, argvlen, &rep);
	if (r == WORKER_OK && rep->type == REDIS_REPLY_ERROR)
	{
		snprintf(worker_errbuf, sizeof(worker_errbuf), "Valkey replied: %.*s",
				 (int) rep->len, rep->str);
		r = WORKER_FAILED;
	}
	if (r == WORKER_OK && reply != NULL)
		*reply = rep;
	else if (rep != NULL)
		freeReplyObject(rep);
	return r;
}

/* Is that the same epoch? */
static bool
worker_epoch_is(const IdemEpochName *a, TimeLineID timeline, uint64 epoch)
{
	return a->timeline == timeline && a->epoch == epoch;
}

/*
 * Retire epoch *dead: its owner key gets a retired marker naming (timeline,
 * epoch), the epoch that replaces it, whatever it held: the runners still
 * on it stop trusting it at their next lookup.
 */
static WorkerResult
worker_epoch_retire(const IdemEpochName *dead, TimeLineID timeline, uint64 epoch)
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
	return worker_owner_command(dead->timeline, dead->epoch, 5, argv, NULL);
}

/*
 * The same for an epoch some other history listed: retired, logged, and
 * remembered as dead in the secret file.
 */
static WorkerResult
worker_epoch_retire_listed(const EpochListed *e, TimeLineID timeline, uint64 epoch,
						   const char *why)
{
	WorkerResult r = worker_epoch_retire(&e->name, timeline, epoch);

	if (r != WORKER_OK)
		return r;
	idem_cache_epoch_note_dead(&e->name);
	ereport(LOG,
			(errmsg("retired history epoch %016llx of timeline %u",
					(unsigned long long) e->name.epoch, e->name.timeline),
			 errdetail_internal("%s", why)));
	return WORKER_OK;
}

/* Parse one element of the epoch list into *e; false if it is not one. */
static bool
worker_listed_parse(const redisReply *reply, EpochListed *e)
{
	char		text[LISTED_TEXT_MAX + 1];
	unsigned int tli;
	unsigned long long epoch;
	unsigned long long lsn;
	int			used = -1;

	if (reply->type != REDIS_REPLY_STRING || reply->len > LISTED_TEXT_MAX)
		return false;
	memcpy(text, reply->str, reply->len);
	text[reply->len] = '\0';
	if (sscanf(text, "%u.%16llx %16llx%n", &tli, &epoch, &lsn, &used) != 3 ||
		used != (int) reply->len || tli == 0 || epoch == 0)
		return false;
	e->name.timeline = tli;
	e->name.epoch = epoch;
	e->lsn = (XLogRecPtr) lsn;
	return true;
}

/* The epoch list's key into key; false (worker_errbuf says why) if none. */
static bool
worker_list_key(char *key)
{
	if (idem_cache_epoch_list_of(key, IDEM_CACHE_EPOCH_KEY_MAX) < 0)
	{
		snprintf(worker_errbuf, sizeof(worker_errbuf), "idem.valkey_prefix is too long");
		return false;
	}
	return true;
}

/*
 * Read the epoch list (LRANGE): its entries into list (at most
 * IDEM_EPOCH_DEAD_MAX), their number into *n.  What is not an entry is
 * skipped.
 */
static WorkerResult
worker_list_read(EpochListed *list, int *n)
{
	char		key[IDEM_CACHE_EPOCH_KEY_MAX];
	char		last[12];
	const char *argv[4];
	redisReply *reply = NULL;
	WorkerResult r;

	*n = 0;
	if (!worker_list_key(key))
		return WORKER_FAILED;
	snprintf(last, sizeof(last), "%d", IDEM_EPOCH_DEAD_MAX - 1);
	argv[0] = "LRANGE";
	argv[2] = "0";
	argv[3] = last;
	r = worker_key_command(key, 4, argv, &reply);
	if (r != WORKER_OK)
		return r;
	if (reply->type == REDIS_REPLY_ARRAY)
		for (size_t i = 0; i < reply->elements && *n < IDEM_EPOCH_DEAD_MAX; i++)
			if (worker_listed_parse(reply->element[i], &list[*n]))
				(*n)++;
	freeReplyObject(reply);
	return WORKER_OK;
}

/*
 * Put epoch (timeline, epoch), which this server took over, at the head of
 * the epoch list (LPUSH), keep the last IDEM_EPOCH_DEAD_MAX (LTRIM), and
 * push the list's expiry back.
 */
static WorkerResult
worker_list_push(TimeLineID timeline, uint64 epoch)
{
	char		key[IDEM_CACHE_EPOCH_KEY_MAX];
	char		value[LISTED_TEXT_MAX + 1];
	char		last[12];
	char		ttl[32];
	const char *argv[4];
	WorkerResult r;

	if (!worker_list_key(key))
		return WORKER_FAILED;
	snprintf(value, sizeof(value), "%u.%016llx %016llx", timeline,
			 (unsigned long long) epoch,
			 (unsigned long long) GetXLogInsertRecPtr());
	snprintf(last, sizeof(last), "%d", IDEM_EPOCH_DEAD_MAX - 1);
	snprintf(ttl, sizeof(ttl), INT64_FORMAT, IDEM_EPOCH_OWNER_TTL_MS);
	argv[0] = "LPUSH";
	argv[2] = value;
	r = worker_key_command(key, 3, argv, NULL);
	if (r != WORKER_OK)
		return r;
	argv[0] = "LTRIM";
	argv[2] = "0";
	argv[3] = last;
	r = worker_key_command(key, 4, argv, NULL);
	if (r != WORKER_OK)
		return r;
	argv[0] = "PEXPIRE";
	argv[2] = ttl;
	return worker_key_command(key, 3, argv, NULL);
}

/*
 * Was listed epoch *e taken over on a branch of history that timeline tli
 * left, or never had?  Its timeline is not in tli's history, or is an
 * ancestor that ended before the takeover's WAL position: that server went
 * on, on the old timeline, after the one that made tli took over (an old
 * primary after a failover, then rewound).  Epochs of tli itself or of a
 * later timeline are never judged: they may be a live server's.
 */
static bool
worker_listed_diverged(const EpochListed *e, TimeLineID tli)
{
	List	   *history;
	ListCell   *lc;
	bool		diverged = true;

	if (e->name.timeline >= tli)
		return false;
	history = readTimeLineHistory(tli);
	foreach(lc, history)
	{
		TimeLineHistoryEntry *h = (TimeLineHistoryEntry *) lfirst(lc);

		if (h->tli == e->name.timeline)
		{
			diverged = !XLogRecPtrIsInvalid(h->end) && e->lsn >= h->end;
			break;
		}
	}
	list_free_deep(history);
	return diverged;
}

/* Is epoch *e one of the n in dead? */
static bool
worker_epoch_in(const IdemEpochName *e, const IdemEpochName *dead, int n)
{
	for (int i = 0; i < n; i++)
		if (worker_epoch_is(&dead[i], e->timeline, e->epoch))
			return true;
	return false;
}

/*
 * Must the takeover t retire listed epoch *e?  Yes at the first takeover
 * since the start of a new epoch: this start cannot show that it continues
 * the history Valkey saw last (it ran recovery, was restored, cloned,
 * promoted, rewound or reset, or another start took its epoch over), so
 * every epoch its system took over lately goes, whichever copy's it is;
 * and whenever *e was taken over on a branch this timeline left.  Not
 * otherwise: a renewal of a running server retires its own epoch, and a
 * server that lost its epoch to a copy must not retire the copy's in turn.
 */
static bool
worker_listed_must_retire(const EpochListed *e, const IdemEpochTakeover *t)
{
	if (worker_epoch_is(&e->name, t->timeline, t->epoch) ||
		worker_epoch_in(&e->name, t->dead, t->ndead))
		return false;
	return (t->first && t->expect_token == 0) ||
		worker_listed_diverged(e, t->timeline);
}

/* Is epoch *e among the n entries of list? */
static bool
worker_listed_in(const EpochListed *e, const EpochListed *list, int n)
{
	for (int i = 0; i < n; i++)
		if (worker_epoch_is(&list[i].name, e->name.timeline, e->name.epoch))
			return true;
	return false;
}

/*
 * Take this start's epoch over (cache_secret.c's file header), if it is not
 * yet.  First retire the epochs this history knows are dead, and those the
 * epoch list names that this takeover must (worker_listed_must_retire): their
 * owner keys get a retired marker naming this epoch, whatever they held, so
 * the runners still on them stop trusting them at their next lookup.  Then SET
 * <epoch owner key> <new token> GET, and keep the epoch only if the value
 * replaced is the token this data directory recorded (none, for a new epoch);
 * otherwise make a new epoch and take that one over.  Last, list this epoch,
 * and judge as above what another start listed meanwhile.  Until this succeeds
 * nothing is copied and runners get no keyspace.  Every step can be repeated:
 * a worker that stops half-way does it again.  Once the epoch is owned, the
 * commits that removed ledger rows before it was made stop waiting
 * (idem_renewal_taken).
 */
WorkerResult
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
		WorkerResult r;
		bool		won;
		EpochListed before[IDEM_EPOCH_DEAD_MAX];
		EpochListed after[IDEM_EPOCH_DEAD_MAX];
		int			nbefore;
		int			nafter;

		OWNER_TOKEN_TEXT(token, t.new_token);
		OWNER_TOKEN_TEXT(expect, t.expect_token);
		snprintf(ttl, sizeof(ttl), INT64_FORMAT, IDEM_EPOCH_OWNER_TTL_MS);
		for (int i = 0; i < t.ndead; i++)
		{
			r = worker_epoch_retire(&t.dead[i], t.timeline, t.epoch);
			if (r != WORKER_OK)
				return r;
		}
		r = worker_list_read(before, &nbefore);
		for (int i = 0; r == WORKER_OK && i < nbefore; i++)
			if (worker_listed_must_retire(&before[i], &t))
				r = worker_epoch_retire_listed(&before[i], t.timeline, t.epoch,
											   "Valkey's epoch list named it: a recent epoch of this system, whose history this start may lack.");
		if (r != WORKER_OK)
			return r;
		argv[0] = "SET";
		argv[2] = token;
		argv[3] = "PX";
		argv[4] = ttl;
		argv[5] = "GET";
		r = worker_owner_command(t.timeline, t.epoch, 6, argv, &reply);
		if (r != WORKER_OK)
			return r;
		if (t.expect_token == 0)
			won = reply->type == REDIS_REPLY_NIL;
		else
			won = worker_owner_reply_is(reply, expect);
		freeReplyObject(reply);
		if (won)
		{
			r = worker_list_push(t.timeline, t.epoch);
			if (r == WORKER_OK)
				r = worker_list_read(after, &nafter);
			for (int i = 0; r == WORKER_OK && i < nafter; i++)
				if (!worker_listed_in(&after[i], before, nbefore) &&
					worker_listed_must_retire(&after[i], &t))
					r = worker_epoch_retire_listed(&after[i], t.timeline, t.epoch,
												   "Valkey's epoch list named it: another start took it over while this one did.");
			if (r != WORKER_OK)
				return r;
			idem_cache_epoch_taken(&t);
			worker_owner_checked_at = GetCurrentTimestamp();
			ereport(LOG,
					(errmsg("took history epoch %016llx over in Valkey",
							(unsigned long long) t.epoch)));
		}
		else
			idem_cache_epoch_renew(t.epoch, IDEM_EPOCH_TAKEN_ELSEWHERE);
	}
	/* the epochs before the one owned are retired: wake their removals */
	if (idem_cache_epoch_owned(&t))
		idem_renewal_taken(t.generation);
	return WORKER_OK;
}

/*
 * An owner key that should hold token: GET it; if it does, push its expiry
 * back; if Valkey lost it, set it again (SET NX).  *taken: it holds
 * anything else (retired, or taken over elsewhere).
 */
static WorkerResult
worker_owner_keep(const char *key, const char *token, bool *taken, bool *lost_out)
{
	char		ttl[32];
	const char *argv[6];
	redisReply *reply = NULL;
	WorkerResult r;
	bool		ours;
	bool		lost;

	*taken = false;
	snprintf(ttl, sizeof(ttl), INT64_FORMAT, IDEM_EPOCH_OWNER_TTL_MS);
	argv[0] = "GET";
	r = worker_key_command(key, 2, argv, &reply);
	if (r != WORKER_OK)
		return r;
	ours = worker_owner_reply_is(reply, token);
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
		return worker_key_command(key, 6, argv, NULL);
	}
	if (!ours)
	{
		*taken = true;
		return WORKER_OK;
	}
	argv[0] = "PEXPIRE";
	argv[2] = ttl;
	return worker_key_command(key, 3, argv, NULL);
}

/*
 * The epochs this history knows are dead stay retired: a Valkey restored
 * from a snapshot taken before they were retired brings their owner keys
 * back with a live token, which runners still on them would trust again.
 * One GET each; a SET only for one that holds something else than a
 * retired marker (a key Valkey lost stays lost: no runner trusts that).
 * (timeline, epoch) is the epoch this server owns, which the marker names.
 */
static WorkerResult
worker_dead_keep_retired(TimeLineID timeline, uint64 epoch)
{
	IdemEpochName dead[IDEM_EPOCH_DEAD_MAX];
	int			n = idem_cache_epoch_dead(dead);

	for (int i = 0; i < n; i++)
	{
		const char *argv[2];
		redisReply *reply = NULL;
		WorkerResult r;
		bool		live;

		argv[0] = "GET";
		r = worker_owner_command(dead[i].timeline, dead[i].epoch, 2, argv, &reply);
		if (r != WORKER_OK)
			return r;
		live = reply->type == REDIS_REPLY_STRING &&
			(reply->len < sizeof(IDEM_CACHE_EPOCH_RETIRED) - 1 ||
			 memcmp(reply->str, IDEM_CACHE_EPOCH_RETIRED,
					sizeof(IDEM_CACHE_EPOCH_RETIRED) - 1) != 0);
		freeReplyObject(reply);
		if (!live)
			continue;
		r = worker_epoch_retire(&dead[i], timeline, epoch);
		if (r != WORKER_OK)
			return r;
		ereport(LOG,
				(errmsg("retired history epoch %016llx of timeline %u again",
						(unsigned long long) dead[i].epoch, dead[i].timeline),
				 errdetail("Its owner key held a token again although this server's history retired it: Valkey was restored from an older snapshot, perhaps.")));
	}
	return WORKER_OK;
}

/*
 * On a standby, every IDEM_OWNER_CHECK_MS: does the epoch list name an
 * epoch taken over on a branch of history that the timeline this server
 * replays left (worker_listed_diverged)?  That is an old primary's after a
 * failover, this server itself perhaps, before pg_rewind replaced its
 * secret file with its new primary's: retire it, so that the runners still
 * on it stop replaying what this history lacks.  Nothing is copied during
 * recovery, so this is all a standby's worker does in Valkey.
 */
WorkerResult
worker_check_list(void)
{
	EpochListed list[IDEM_EPOCH_DEAD_MAX];
	int			n;
	TimeLineID	tli = 0;
	IdemEpochName dead[IDEM_EPOCH_DEAD_MAX];
	int			ndead;
	WorkerResult r;

	if (!RecoveryInProgress() ||
		!TimestampDifferenceExceeds(worker_list_checked_at, GetCurrentTimestamp(),
									IDEM_OWNER_CHECK_MS))
		return WORKER_OK;
	(void) GetXLogReplayRecPtr(&tli);
	if (tli == 0)
		return WORKER_OK;
	r = worker_list_read(list, &n);
	if (r != WORKER_OK)
		return r;
	worker_list_checked_at = GetCurrentTimestamp();
	ndead = idem_cache_epoch_dead(dead);
	for (int i = 0; r == WORKER_OK && i < n; i++)
	{
		IdemCacheSecrets s;

		if (worker_epoch_in(&list[i].name, dead, ndead) ||
			!worker_listed_diverged(&list[i], tli))
			continue;
		idem_cache_secrets_get(&s);
		explicit_bzero(s.current, sizeof(s.current));
		explicit_bzero(s.previous, sizeof(s.previous));
		r = worker_epoch_retire_listed(&list[i], tli, s.epoch,
									   "It was taken over on a branch of history that the timeline this standby replays left (an old primary that went on after a failover).");
	}
	return r;
}

/*
 * The worker's loop while the server is a standby (it starts once recovery
 * reached a consistent state): connect to Valkey and check the epoch list
 * every IDEM_OWNER_CHECK_MS (worker_check_list), until recovery ends or a
 * shutdown is asked for.  Nothing else: nothing is copied during recovery.
 */
void
worker_standby_wait(void)
{
	while (!ShutdownRequestPending && RecoveryInProgress())
	{
		CHECK_FOR_INTERRUPTS();
		if (ConfigReloadPending)
		{
			ConfigReloadPending = false;
			ProcessConfigFile(PGC_SIGHUP);
			if (worker_connected() && worker_settings_changed())
				worker_disconnect();
		}
		if (!worker_connected())
		{
			WorkerResult r = worker_connect();

			if (r == WORKER_SHUTDOWN)
				return;
			if (r != WORKER_OK)
			{
				worker_disconnect();
				worker_report_problem("connecting to", IDEM_OWNER_CHECK_MS, false);
				worker_nap(IDEM_OWNER_CHECK_MS);
				continue;
			}
			idem_stats_set_valkey(true, NULL);
			worker_list_checked_at = 0;
		}
		if (worker_check_list() != WORKER_OK)
		{
			worker_disconnect();
			idem_stats_set_valkey(false, NULL);
			worker_report_problem("checking the epoch list at",
								  IDEM_OWNER_CHECK_MS, false);
		}
		worker_nap(IDEM_OWNER_CHECK_MS);
	}
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
 * dead are checked too (worker_dead_keep_retired).
 */
WorkerResult
worker_check_owner(void)
{
	IdemEpochTakeover t;
	char		token[IDEM_CACHE_EPOCH_TOKEN_LEN + 1];
	char		key[IDEM_CACHE_EPOCH_KEY_MAX];
	WorkerResult r;
	bool		taken;
	bool		lost;

	if (!TimestampDifferenceExceeds(worker_owner_checked_at, GetCurrentTimestamp(),
									IDEM_OWNER_CHECK_MS) ||
		!idem_cache_epoch_owned(&t))
		return WORKER_OK;
	if (!worker_owner_key_of(key, t.timeline, t.epoch))
		return WORKER_FAILED;
	OWNER_TOKEN_TEXT(token, t.new_token);
	r = worker_owner_keep(key, token, &taken, &lost);
	if (r == WORKER_OK && lost)
		r = worker_list_push(t.timeline, t.epoch);	/* lost with it, perhaps */
	if (r != WORKER_OK)
		return r;
	worker_owner_checked_at = GetCurrentTimestamp();
	if (taken)
	{
		ereport(LOG,
				(errmsg("history epoch %016llx is no longer this server's in Valkey",
						(unsigned long long) t.epoch),
				 errdetail("Its owner key was retired or taken over by another server started from a copy of this data directory; a new epoch follows.")));
		idem_cache_epoch_renew(t.epoch, IDEM_EPOCH_TAKEN_ELSEWHERE);
		return WORKER_OK;
	}

	/*
	 * After worker_owner_checked_at: a failure here (a dead epoch's node down,
	 * on a cluster) is reported and tried again at the next check.
	 */
	return worker_dead_keep_retired(t.timeline, t.epoch);
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
WorkerResult
worker_cluster_owners(bool check)
{
	IdemEpochTakeover t;
	IdemClusterDuty d;
	bool		owned = idem_cache_epoch_owned(&t);
	char		ttl[32];
	char		token[IDEM_CACHE_EPOCH_TOKEN_LEN + 1];
	const char *argv[6];
	WorkerResult r;

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
		r = worker_key_command(d.key, 5, argv, NULL);
		if (r != WORKER_OK)
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
		r = worker_owner_keep(d.key, token, &taken, NULL);
		if (r == WORKER_OK && taken)
		{
			ereport(LOG,
					(errmsg("the Citus cluster cache keyspace \"%s\" was retired",
							d.keyspace),
					 errdetail("The history epoch of a node of the cluster changed; the next time a runner asks, the coordinator names a new keyspace.")));
			idem_cache_cluster_disown(&d);
		}
		if (r != WORKER_OK)
			return r;
	}
	return WORKER_OK;
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
