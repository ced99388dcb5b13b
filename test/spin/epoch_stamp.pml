/*
 * epoch_stamp.pml -- a model of one key's ledger row removed by hand (a
 * DELETE, TRUNCATE or pg_restore --clean), the history epoch it renews,
 * and everything that could carry the removed row's result into Valkey
 * or replay it from there afterwards (src/epoch_renewal.c's file header):
 *
 *   committer  the transaction that completes the key: its copy is
 *              stamped with the renewal generation when idem_complete
 *              makes it (idem_copies_add), before the commit is visible;
 *              at commit the row appears and the copy enters the commit
 *              ring (XACT_EVENT_COMMIT)
 *   remover    the DELETE: the row goes (ProcArrayEndTransaction), then
 *              the generation is bumped and the renewal asked for
 *              (idem_cache_epoch_renew), then the commit waits until the
 *              worker has taken over an epoch of that generation, i.e.
 *              retired the old one (idem_renewal_wait), or times out (the
 *              worker cannot reach Valkey, or is slow: any time)
 *   reader     idem_lookup() repopulating Valkey: it reads the generation
 *              before the row (ledger_lookup); under READ COMMITTED the
 *              probe's snapshot is taken after that, under REPEATABLE
 *              READ at any time before it (the transaction's), and then
 *              the row is probed again under a fresh snapshot when the
 *              generation is not 0 (repopulate in src/ledger.c)
 *   worker     a new epoch is made (secret_shared_fit: it records the
 *              generation), taken over when the worker reaches Valkey
 *              (worker_take_epoch: the old epoch's owner key retired
 *              first); the ring's head copy is written into the current
 *              epoch, or dropped when its generation is older than the
 *              epoch's (worker_encode_record)
 *   runner     learns a taken epoch (idem_cache_keyspace(); 55000 until
 *              taken), replays a value of its epoch unless that epoch's
 *              owner key is retired (the owner check in every lookup),
 *              and learns again at least every BOUND ticks
 *              (secrets_max_age_ms, idemc_trust_max_age)
 *   clock      ticks, up to BOUND + 1 (time is abstract)
 *   faults     the worker loses and regains Valkey (runners still reach
 *              it: a partition), at most NFAULT times
 *
 * Properties, asserted at every replay of the removed row (row absent):
 *   (stamp)  it is replayed only from an epoch that existed when the row
 *            was removed: nothing read before a removal crosses into the
 *            epoch made for it;
 *   (window) once the DELETE's commit has returned, it is not replayed,
 *            unless the commit's wait timed out, and then only within
 *            BOUND ticks of its return.
 *
 * Broken variants (each a counterexample, test/spin/check.sh):
 *   NO_STAMP    the worker writes every copy into the current epoch
 *   NO_RECHECK  a REPEATABLE READ reader does not probe again
 *   NO_WAIT     the DELETE's commit returns at once (no timeout either)
 *   NO_BOUND    secrets_max_age_ms 0 meaning "never" (before the cap)
 */

#ifndef BOUND
#define BOUND 2
#endif
#ifndef NFAULT
#define NFAULT 2
#endif
#define NEP 4           /* epochs 1..3 */

/* the history epoch (src/cache_secret.c) */
byte gen = 0;           /* renewal generation */
byte ep = 1;            /* the current epoch */
byte ep_gen[NEP];       /* the generation each epoch was made at */
bool taken[NEP];        /* its owner key was taken over */
bool retired[NEP];      /* its owner key holds a retired marker */
byte retire_ep = 0;     /* the epoch the next takeover retires */
bool renew = false;     /* a renewal asked for, no new epoch made yet */
byte taken_gen = 0;     /* the newest taken epoch's generation */
bool wk_up = true;      /* the worker reaches Valkey */
byte faults = 0;

/* PostgreSQL: the key's row (one outcome: only the committer writes it) */
bool row = false;

/* Valkey: the key's value in each epoch's keyspace */
bool vk[NEP];

/* the commit ring: at most two copies, their generations */
byte ring_n = 0;
byte ring_g0 = 0;
byte ring_g1 = 0;

/* the DELETE (ghosts for the properties) */
byte rm_ep = 0;         /* the current epoch when the row went (0: not yet) */
bool returned = false;  /* its commit returned */
bool timed_out = false; /* ... after its wait timed out */
byte ret_tick = 0;

byte ticks = 0;

inline enqueue(g)
{
	if
	:: ring_n == 0 -> ring_g0 = g; ring_n = 1
	:: ring_n == 1 -> ring_g1 = g; ring_n = 2
	:: else -> skip     /* a full ring drops the copy */
	fi
}

proctype committer()
{
	byte s;
	s = gen;                                    /* idem_copies_add */
	atomic { row = true; enqueue(s) }           /* commit, XACT_EVENT_COMMIT */
}

proctype remover()
{
	byte mine;
	atomic { row -> row = false; rm_ep = ep }   /* the DELETE is visible */
	atomic { gen++; mine = gen; renew = true }  /* bump, then the renewal */
#ifdef NO_WAIT
	atomic { returned = true; ret_tick = ticks }
#else
	if
	:: atomic { taken_gen >= mine -> returned = true; ret_tick = ticks }
	:: atomic { returned = true; timed_out = true; ret_tick = ticks }
	fi
#endif
}

proctype reader()
{
	byte g;
	bool seen;
	if
	:: atomic { g = gen }; atomic { seen = row }    /* READ COMMITTED */
	:: atomic { seen = row }; atomic { g = gen };   /* REPEATABLE READ */
#ifndef NO_RECHECK
		atomic { seen = seen && (g == 0 || row) }   /* a fresh snapshot */
#endif
	fi;
	atomic { seen -> enqueue(g) }
}

proctype worker()
{
	do
	:: atomic { renew && ep < NEP - 1 ->        /* a new epoch is made */
		if
		:: taken[ep] -> retire_ep = ep
		:: else -> skip                         /* passes its retire on */
		fi;
		ep++; ep_gen[ep] = gen; renew = false }
	:: atomic { wk_up && !renew && !taken[ep] ->    /* the takeover */
		if
		:: retire_ep != 0 -> retired[retire_ep] = true
		:: else -> skip
		fi;
		taken[ep] = true; taken_gen = ep_gen[ep] }
	:: atomic { wk_up && ring_n > 0 ->          /* the head copy */
#ifdef NO_STAMP
		vk[ep] = true;
#else
		if
		:: ring_g0 >= ep_gen[ep] -> vk[ep] = true
		:: else -> skip                         /* dropped, counted */
		fi;
#endif
		ring_g0 = ring_g1; ring_g1 = 0; ring_n-- }
	od
}

proctype runner()
{
	byte my = 0;
	byte learnt = 0;
	do
	:: atomic { taken[ep] && !renew -> my = ep; learnt = ticks }    /* learn */
	:: atomic { my != 0 && vk[my] && !retired[my] &&
#ifndef NO_BOUND
		ticks - learnt < BOUND &&
#endif
		!row ->
		/* a replay of the removed row */
		assert(my <= rm_ep);
		assert(!returned || (timed_out && ticks - ret_tick < BOUND)) }
	od
}

proctype clock()
{
	do
	:: atomic { ticks < BOUND + 1 -> ticks++ }
	od
}

proctype faults_()
{
	do
	:: atomic { faults < NFAULT -> wk_up = !wk_up; faults++ }
	od
}

init
{
	ep_gen[1] = 0;
	atomic {
		run committer();
		run remover();
		run reader();
		run worker();
		run runner();
		run clock();
		run faults_()
	}
}
