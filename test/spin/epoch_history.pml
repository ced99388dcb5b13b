/*
 * epoch_history.pml -- the history epoch across restores, crashes, ledger
 * rows removed and a Valkey restored from a snapshot (src/cache_secret.c,
 * src/worker_epoch.c): which epochs a server retires, so that a runner
 * that learnt an epoch before the event never replays a result the
 * server's database no longer holds.
 *
 * One message m, one server at a time (a restore replaces it, on the same
 * address), one runner that learns the keyspace once and then only reads
 * Valkey (a long secrets_max_age_ms), one Valkey.  Epochs are numbered
 * 1..NEPOCH as they are made.
 *
 *   server:  db_m (its database holds m's result), and its secret file:
 *            f_epoch, f_taken (a token recorded: the worker took it over),
 *            f_dead (the dead epochs it remembers, a bit mask);
 *            first: no takeover since the server started.
 *   Valkey:  owner[e] (NONE, LIVE: a token, RETIRED), cached[e] (m's result
 *            copied under e), elist (the epoch list: the epochs the last
 *            takeovers took over, a bit mask; the code keeps the last 8),
 *            up.
 *   backup:  a copy of the server's file and database, taken at any time.
 *   rdb:     a copy of Valkey, taken at any time, loaded later.
 *
 * Steps: m applied (db_m) and copied under the confirmed epoch; the
 * server's epoch renewed by a DELETE of m's row (db_m false) or a crash
 * (a start that ran recovery); Valkey down and up (a takeover waits for
 * it, so a backup may name an epoch not yet taken over); the runner
 * learning the confirmed epoch; the runner's lookup (a replay if its
 * epoch's owner key is LIVE and holds m: then the server's database must
 * hold m -- the property); a restore of the backup (database and file;
 * the start ran recovery, so a new epoch, taken over at once if Valkey is
 * up: the window before the takeover is the documented one, in which a
 * runner replays what the old history vouched for just before); the
 * worker's owner check (a lost owner key set again and listed, the dead
 * epochs re-retired); Valkey loaded from the rdb, with the worker's next
 * check (within a second: the window is the same as a restore's).
 *
 * Broken variants (check.sh requires a counterexample):
 *   NO_LIST       the takeover does not retire the epochs the epoch list
 *                 names (idem before the list): a restored server retires
 *                 only the epoch its stale file names, so a runner on the
 *                 original's newer epoch replays m, which the restored
 *                 database lacks;
 *   LIST_OF_ONE   the list holds the last epoch taken over only: after two
 *                 epochs of the original since the backup, a Valkey loaded
 *                 from a snapshot brings back the older one, which the
 *                 restored server never learnt was dead;
 *   NO_RERETIRE   the owner check does not retire the dead epochs again:
 *                 a Valkey loaded from a snapshot taken before a retirement
 *                 brings the epoch back to life.
 * And RETIRE_ONLY_TAKEN (an epoch never taken over by this data directory
 * is not retired when it is replaced, as before the list) shows that the
 * list alone covers a backup taken while the newest epoch waited for its
 * takeover (point-in-time recovery from it).
 */

#ifndef NEPOCH
#define NEPOCH 6
#endif
#ifndef NRENEW
#define NRENEW 2			/* DELETEs and crashes */
#endif

#define O_NONE		0
#define O_LIVE		1
#define O_RETIRED	2

#define BIT(e)		(1 << (e))

/* the server */
bool db_m = false;
byte f_epoch = 1;
bool f_taken = true;
byte f_dead = 0;
bool first = false;

/* Valkey */
byte owner[NEPOCH + 1];
bool cached[NEPOCH + 1];
byte elist = BIT(1);
bool vk_up = true;

/* the backup, the Valkey snapshot */
bool b_taken = false;
bool b_db_m;
byte b_epoch;
bool b_ftaken;
byte b_dead;
bool rdb_taken = false;
bool rdb_loaded = false;
byte r_owner[NEPOCH + 1];
bool r_cached[NEPOCH + 1];
byte r_elist;

/* the runner */
byte r_ep = 0;				/* the epoch it learnt; 0: none yet */

byte next_epoch = 2;
byte renewals = 0;
bool restored = false;
bool outage = false;

#define RETIRE(e)	owner[e] = O_RETIRED
#ifdef LIST_OF_ONE
#define LIST(e)		elist = BIT(e)
#else
#define LIST(e)		elist = elist | BIT(e)
#endif

/*
 * worker_take_epoch: retire the dead epochs, then those the epoch list
 * names if this is the first takeover since the start (of a new epoch),
 * then take the epoch over and list it.
 */
inline take_over()
{
	byte i;

	i = 1;
	do
	:: i <= NEPOCH ->
		if
		:: f_dead & BIT(i) -> RETIRE(i)
		:: else -> skip
		fi;
		i++
	:: else -> break
	od;
#ifndef NO_LIST
	i = 1;
	do
	:: i <= NEPOCH ->
		if
		:: first && (elist & BIT(i)) && i != f_epoch ->
			RETIRE(i);
			f_dead = f_dead | BIT(i)
		:: else -> skip
		fi;
		i++
	:: else -> break
	od;
#endif
	owner[f_epoch] = O_LIVE;
	LIST(f_epoch);
	f_taken = true;
	first = false
}

/*
 * secret_fit: a new epoch replaces f_epoch, which joins the dead ones
 * (RETIRE_ONLY_TAKEN: only if it was taken over); taken over at once if
 * Valkey is up, else when it comes back.
 */
inline renew()
{
#ifdef RETIRE_ONLY_TAKEN
	if
	:: f_taken -> f_dead = f_dead | BIT(f_epoch)
	:: else -> skip
	fi;
#else
	f_dead = f_dead | BIT(f_epoch);
#endif
	f_epoch = next_epoch;
	next_epoch++;
	f_taken = false;
	if
	:: vk_up -> take_over()
	:: else -> skip
	fi
}

/* worker_check_owner, worker_dead_keep_retired */
inline owner_check()
{
	byte j;

	if
	:: owner[f_epoch] == O_NONE -> owner[f_epoch] = O_LIVE; LIST(f_epoch)
	:: else -> skip
	fi;
#ifndef NO_RERETIRE
	j = 1;
	do
	:: j <= NEPOCH ->
		if
		:: (f_dead & BIT(j)) && owner[j] == O_LIVE -> RETIRE(j)
		:: else -> skip
		fi;
		j++
	:: else -> break
	od
#endif
}

active proctype world()
{
	byte k;

	owner[1] = O_LIVE;
end_loop:
	do
	/* m applied */
	:: atomic { !db_m -> db_m = true }
	/* the worker copies m's result under the confirmed epoch */
	:: atomic { db_m && f_taken && vk_up && !cached[f_epoch] -> cached[f_epoch] = true }
	/* a DELETE of m's row: a new epoch */
	:: atomic { db_m && renewals < NRENEW && next_epoch <= NEPOCH ->
		db_m = false; renewals++; renew() }
	/* a crash: the start ran recovery (durable commits survive) */
	:: atomic { renewals < NRENEW && next_epoch <= NEPOCH ->
		renewals++; first = true; renew() }
	/* Valkey out of reach for a while (once) */
	:: atomic { vk_up && !outage -> vk_up = false; outage = true }
	:: atomic { !vk_up ->
		vk_up = true;
		if
		:: !f_taken -> take_over()
		:: else -> owner_check()
		fi }
	/* a base backup */
	:: atomic { !b_taken ->
		b_taken = true; b_db_m = db_m; b_epoch = f_epoch; b_ftaken = f_taken;
		b_dead = f_dead }
	/* the runner learns the keyspace (refused until the takeover) */
	:: atomic { f_taken && r_ep != f_epoch -> r_ep = f_epoch }
	/* the runner's lookup: a replay from Valkey is m's committed result */
	:: atomic { vk_up && r_ep != 0 && cached[r_ep] && owner[r_ep] == O_LIVE ->
		assert(db_m) }
	/* the backup replaces the server */
	:: atomic { b_taken && !restored && next_epoch <= NEPOCH ->
		restored = true;
		db_m = b_db_m; f_epoch = b_epoch; f_taken = b_ftaken; f_dead = b_dead;
		first = true;
		renew() }
	/* the worker's owner check */
	:: atomic { vk_up && f_taken -> owner_check() }
	/* a snapshot of Valkey */
	:: atomic { vk_up && !rdb_taken ->
		rdb_taken = true; r_elist = elist;
		k = 1;
		do
		:: k <= NEPOCH -> r_owner[k] = owner[k]; r_cached[k] = cached[k]; k++
		:: else -> break
		od }
	/* Valkey loaded from it, and the worker's next check */
	:: atomic { vk_up && rdb_taken && !rdb_loaded ->
		rdb_loaded = true; elist = r_elist;
		k = 1;
		do
		:: k <= NEPOCH -> owner[k] = r_owner[k]; cached[k] = r_cached[k]; k++
		:: else -> break
		od;
		if
		:: f_taken -> owner_check()
		:: else -> take_over()
		fi }
	od
}
