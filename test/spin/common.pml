/*
 * common.pml -- declarations and protocol steps of the idem model.
 *
 * Included by idem.pml (the real model) and by the two deliberately broken
 * variants.  The order of inclusion is always:
 *
 *     common.pml      globals + every protocol step as an `inline`
 *     (a variant replaces the step it breaks here; see the STEP_* guards)
 *     procs.pml       the runner, the environment (timers, worker, faults)
 *                     and the invariant monitor
 *
 * One key, NRUN concurrent runners (client helpers) that each take
 * deliveries of the same message, Valkey (one key), PostgreSQL (one row of
 * the ledger, the key's try-lock, the effect), the commit hook's copies and the
 * background worker.  Time is abstracted: every expiry (marker PX, terminal
 * PX, lease, idle-backend timeout) is a nondeterministic event.
 *
 * Configuration (cpp -D, set by check.sh):
 *   NRUN     runners (2 or 3)                                      default 2
 *   NDELIV   deliveries of the message, duplicates included        default 3
 *            (ignored with LIVENESS: redelivery continues until acked)
 *   NFAULT   fault budget shared by every fault kind               default 2
 *   LEASE_MODE  runners commit a `processing` row and do the effect
 *            outside PostgreSQL (lease mode) instead of in-transaction
 *   PERM_FAIL   handlers may fail permanently (idem_fail retryable=false)
 *   NO_VALKEY_FAULTS  no FLUSHALL/restart/unreachable/lost replies and no
 *            marker expiry (used to isolate the gate race)
 *   LEASE_FENCE idem_complete in lease mode refuses a row whose attempt is
 *            not the caller's: idem_complete(..., attempt), as implemented in
 *            ledger_settle (src/ledger.c)
 *   FENCE_ID (with LEASE_FENCE) the completion is fenced by the claim's
 *            fence instead, the row's id: drawn from the identity sequence
 *            for every claim (a takeover gives the row a new one) and never
 *            reused, as idem_complete_fenced does
 *   LIVENESS redeliveries continue until a run ends with a terminal result
 *   NO_MARKER_PX  a marker never expires within the run (a lease longer
 *            than every redelivery): only its first second ending matters
 *   MARKER_BUSY_WHOLE_LEASE  (broken) another run's marker answers busy
 *            for as long as it lives, not its first second only
 *   NO_BUSY_BOUND  leave out the assertion that a dead run's marker is
 *            busy in its first second only (a liveness variant)
 *   CHECK_COMPLETION_ATTEMPT  assert, in lease mode, that idem_complete
 *            stores an outcome under the attempt that produced it, in the
 *            row that attempt's claim wrote
 *   LEASE_PURGE  (with LEASE_MODE) idem_purge deletes a processing row
 *            whose lease ended, kept for idem.min_purge_grace: only once
 *            no holder is still between its lease claim and its completion
 *            (the floor, set above the longest holder stall, as the README
 *            asks; -DPURGE_NO_FLOOR: whenever the lease ended, as with
 *            idem.purge_grace = 0 in idem 0.3)
 *   EXT_AT_MOST_ONCE  assert that the lease-mode (external) effect happens
 *            at most once -- expected to FAIL: it is at-least-once
 *   NO_BACKEND_TIMEOUT  a dead client's backend is never terminated
 *            (liveness is expected to FAIL)
 *   LEASE_OVERRUN_FREE  under LIVENESS, a working lease holder may overrun
 *            its lease without limit (lease-mode liveness expected to FAIL)
 *   DURABILITY  commits may return before their WAL is flushed
 *            (synchronous_commit = off, any role may set it); a crash
 *            (immediate stop + crash recovery) loses every unflushed commit
 *   FAILOVER    (with DURABILITY) one promotion of a streaming standby that
 *            may lack the newest flushed commits: a new timeline
 *   STANDBY_SLOTS  the worker also waits until the standby has flushed a
 *            commit before copying it (idem.standby_slots names its slot,
 *            or by default every physical slot)
 *   SYNC_CANCELLED  the standby is a synchronous one whose wait a COMMIT
 *            gave up (cancelled, or its backend terminated): the commit
 *            is acknowledged without it, as an asynchronous commit is;
 *            the worker waits for the synchronous flush position (the
 *            same rule as STANDBY_SLOTS)
 *   FIRST_DELIVERY  any delivery (duplicates included) may skip the gate
 *            and claim directly: the consumer flags it as a first delivery
 *            (delivery_count = 1), or the runner is in a stretch of new
 *            keys (client/runner.c run_full)
 *   REWIND      (with DURABILITY) the server's history goes back: a base
 *            backup or copy of the data directory (what was flushed when
 *            it was taken) is started later, as it is, in place of the
 *            server or beside it; the effects go back with the ledger.
 *            The start ran recovery (or Valkey shows that another start
 *            took the epoch over), so a new history epoch, hence a new,
 *            empty keyspace (src/cache_secret.c)
 *            The new server retires the old epoch's owner key, and every
 *            gate reads that key in its round trip: a runner still on the
 *            old keyspace trusts nothing there once it is retired
 *            (client/trust.c).  The retire is modelled in the step that
 *            starts the server: until its worker has retired the old
 *            epoch, no runner can learn the new keyspace (55000), so a
 *            replay from the old epoch in that window is one the old
 *            history vouched for, as if made just before the restore
 *   NO_OWNER_CHECK  broken: the gate does not read the owner key (idem
 *            0.3 before it): a runner on the old keyspace replays from it
 *            until it learns again
 *   NO_EPOCH    broken: the keyspace has no history epoch (idem 0.3: a
 *            rewound server keeps its keyspace and its secret)
 *   RELEARN_AT_GATE  control: every gate uses the current keyspace (the
 *            code re-learns it on every (re)connect, so a client may use
 *            the old one until its next PostgreSQL round trip)
 *
 * The cache design (issue 12) is the default: terminal values are written
 * only by the worker, once their commit is durable, in a keyspace of the
 * current timeline; the client writes only its marker.  A variant restores
 * the old design by defining, before including this file:
 *   CLIENT_SETS_TERMINAL   the runner SETs its own result after COMMIT and
 *            every replay it reads from PostgreSQL (repopulation)
 *   COPY_AT_COMMIT         the worker copies as soon as it sees the entry
 *   NS_WITHOUT_TIMELINE    the keyspace survives a promotion
 */

#ifndef NRUN
#define NRUN 2
#endif
#ifndef NDELIV
#define NDELIV 3
#endif
#ifndef NFAULT
#define NFAULT 2
#endif

/* ---- ledger row status (idempotency_keys.status) ---- */
#define S_NONE   0      /* no committed row */
#define S_PROC   1      /* processing */
#define S_DONE   2      /* completed */
#define S_FAILR  3      /* failed_retryable */
#define S_FAILP  4      /* failed_permanent */
#define TERMINAL(s) ((s) == S_DONE || (s) == S_FAILP)

/* ---- Valkey value kinds (src/common/cache_format.h) ---- */
#define V_NONE   0      /* no key */
#define V_MARK   1      /* "idem1 p <token>"  processing marker */
#define V_DONE   2      /* "idem1 c <attempt> <fp> <outcome>" */
#define V_FAILP  3      /* "idem1 f <attempt> <fp> <detail>" */
#define VK_OF(s)  ((s) == S_DONE -> V_DONE : V_FAILP)
/* Valkey values are idem2 (MACed, src/common/cache_format.h): forged or altered
 * values are ignored by every reader and are not modelled. */

/* An outcome (or failure detail) names the attempt and the runner that
 * produced it, so that a replay of anything but the committed outcome is
 * detectable. */
#define OUT(r, a) ((a) * 4 + (r))

/* ---- how one run (one delivery) ends ---- */
#define R_GO       0    /* gate passed (or skipped): go to PostgreSQL */
#define R_BUSY     1    /* busy: message goes back to the queue */
#define R_REPLAY   2    /* replay returned to the caller */
#define R_CLAIMED  3    /* idem_claim said claimed */
#define R_APPLIED  4    /* effect committed, terminal result */
#define R_REQUEUE  5    /* no terminal result (retryable failure, error) */
#define R_DIED     6    /* the runner process died */

/* ======================= PostgreSQL (committed) ======================= */
byte row_st = S_NONE;   /* ledger row status */
byte row_att = 0;       /* ledger row attempt */
byte row_out = 0;       /* ledger row outcome */
byte row_holder = 0;    /* ghost: runner whose attempt the row records */
#ifdef FENCE_ID
byte row_id = 0;        /* ledger row id: the fence of the claim it records */
byte next_id = 1;       /* the ledger's identity sequence: never reused */
#endif
bool lease_live[NRUN + 1];  /* ghost: runner i's committed lease unexpired */
byte effects = 0;       /* effect rows committed (in-PostgreSQL mode) */
byte ext_effects = 0;   /* effects performed outside PostgreSQL (lease mode) */

/* The key's transaction-scoped try-lock.  Each runner's open transaction
 * lives in the runner's locals (tx_st, tx_att, tx_out, tx_wrote, tx_eff:
 * the row as this transaction wrote it, and whether it holds the effect).
 * When a runner dies holding the lock, its backend stays idle in
 * transaction holding it (ZOMBIE) until the backend is terminated; such a
 * transaction can only roll back, so its writes are dropped at once. */
#define ZOMBIE (NRUN + 1)
byte lock_owner = 0;    /* runner id, ZOMBIE, 0 = free */

/* ===================== durability (DURABILITY) ===================== */
/* Commits are numbered (commit_seq = the WAL insert position of the last
 * commit record); flushed_seq is the primary's WAL flush position,
 * standby_seq the standby's.  d_* is the ledger as flushed, s_* as the
 * standby has it (a prefix: walsender ships flushed WAL only).  A crash
 * restores d_*, a promotion s_* (and starts timeline 1). */
byte commit_seq = 0;
byte flushed_seq = 0;
byte standby_seq = 0;
byte d_row_st = S_NONE, d_row_att = 0, d_row_out = 0, d_row_holder = 0, d_effects = 0;
byte s_row_st = S_NONE, s_row_att = 0, s_row_out = 0, s_row_holder = 0, s_effects = 0;
#ifdef REWIND
/* the backup (REWIND): the flushed ledger and effects when it was taken */
bool b_taken = false;
byte b_row_st = S_NONE, b_row_att = 0, b_row_out = 0, b_row_holder = 0, b_effects = 0;
byte b_seq = 0;
#endif
byte pg_gen = 0;        /* server incarnation: a crash or promotion ends every
                         * open transaction (its client sees an error) */
byte tl = 0;            /* timeline */
bool lost_ack = false;  /* ghost: a crash or promotion lost an acknowledged
                         * terminal commit (synchronous_commit = off, an
                         * asynchronous standby: PostgreSQL's own limit) */

/* ============================== Valkey ============================== */
/* vk_* is the key in the current keyspace (<prefix><sysid>.<timeline>.
 * <dboid>:, idem_cache_keyspace()); ovk_* the same key in the previous
 * timeline's keyspace, read only by a client that has not yet re-learnt
 * its keyspace since a promotion (ns_old[i]). */
byte vk_kind = V_NONE;
byte vk_val = 0;        /* marker: runner id (token); terminal: outcome */
byte ovk_kind = V_NONE;
byte ovk_val = 0;
bool ovk_retired = false;   /* the old keyspace's epoch owner key is
                             * retired (a new epoch replaced it) */
/* A marker's age (client/runner.c IDEM_MARKER_CHEAP_MS): young in its
 * first second, when another run's marker answers "busy" from Valkey;
 * older, the gate passes and the claim in PostgreSQL decides.  Time passes
 * in marker_px (procs.pml).  vk_orphan (ghost): the runner that set the
 * current marker died holding it (its marker stays in Valkey). */
bool vk_young = false;
bool ovk_young = false;
bool vk_orphan = false;
bool ns_old[NRUN + 1];
bool vk_up = true;      /* reachable */

/* ================== commit ring (src/commit_ring.c) ================== */
bool ob_pending = false;    /* a terminal copy waits for the worker */
byte ob_kind = V_NONE;
byte ob_val = 0;
byte ob_seq = 0;            /* the WAL position the copy waits for */
/* The queue emptied (copied, or lost with the server): the entry's fields
 * are read only while one is pending, so they are reset with it (one state
 * for spin, not one per leftover entry). */
#define OB_EMPTY ob_pending = false; ob_kind = V_NONE; ob_val = 0; ob_seq = 0

/* When the worker may write a queued copy (src/worker.c): once the WAL is
 * flushed past it, and past it on the named standby. */
#ifndef COPY_AT_COMMIT
#if defined(STANDBY_SLOTS) || defined(SYNC_CANCELLED)
#define WORKER_MAY_COPY (ob_seq <= flushed_seq && ob_seq <= standby_seq)
#else
#define WORKER_MAY_COPY (ob_seq <= flushed_seq)
#endif
#else
#define WORKER_MAY_COPY true
#endif

/* ============================ bookkeeping ============================ */
byte faults = 0;        /* faults spent from NFAULT */
byte delivered = 0;     /* deliveries taken */
bool acked = false;     /* some run ended with a terminal result */
bool in_lease[NRUN + 1];    /* ghost: runner i is between its lease claim
                             * commit and its completion */

#define FAULT  (faults < NFAULT)
#define SPEND  faults++

#ifdef NO_VALKEY_FAULTS
#define VK_FAULT false
#else
#define VK_FAULT FAULT
#endif

/* ========================== protocol steps ========================== */

/*
 * Valkey gate -- the client's one atomic command (client/gate.c,
 * SET <key> <marker with this runner's token> NX PX <lease> GET): the
 * value if the key exists, else the marker is set.
 * A terminal value with the right fingerprint is a replay, without any
 * PostgreSQL transaction; a marker means busy.  Valkey unreachable (or a
 * timed-out reply) means: skip the gate, PostgreSQL decides.
 * A variant may replace this step (#define STEP_GATE before including).
 */
#ifdef RELEARN_AT_GATE
#define STALE_NS(me) false      /* control: the keyspace is always current */
#else
#define STALE_NS(me) ns_old[me]
#endif
#ifdef NO_OWNER_CHECK
#define OWNER_RETIRED false     /* broken: the owner key is not read */
#else
#define OWNER_RETIRED ovk_retired
#endif
/* -DMARKER_BUSY_WHOLE_LEASE: the rule before issue 26, another run's
 * marker is busy for as long as it lives (its whole lease). */
#ifdef MARKER_BUSY_WHOLE_LEASE
#define MARK_BUSY(young) true
#else
#define MARK_BUSY(young) (young)
#endif
/* How long a dead run's marker may answer "busy" from Valkey: only in its
 * first second; after that only PostgreSQL may say busy (while the dead
 * runner's backend still holds the key), as it would without Valkey. */
#ifndef NO_BUSY_BOUND
#define BUSY_BOUND assert(!vk_orphan || vk_young)
#else
#define BUSY_BOUND skip /* a liveness variant: the cycle is what it shows */
#endif
/* A marker set by this runner: young, its run alive. */
#define SET_MARK(me) vk_kind = V_MARK; vk_val = me; vk_young = true; vk_orphan = false
/* The key's value replaced by something that is not a marker (none, or a
 * terminal value).  vk_young and vk_orphan describe a marker and are read
 * only while there is one: reset them with it, so that states that differ
 * only in a dead marker's leftovers are one state for spin (the same
 * behaviours, fewer states to store).  Likewise for the old keyspace. */
#define VK_PUT(kind, val) vk_kind = kind; vk_val = val; vk_young = false; vk_orphan = false
#define OVK_CLEAR ovk_kind = V_NONE; ovk_val = 0; ovk_young = false
#ifndef STEP_GATE
inline gate_step(me)
{
	if
	:: atomic { vk_up && STALE_NS(me) && OWNER_RETIRED ->
		/* the owner key, read in the same round trip, is retired: nothing
		 * read is trusted; PostgreSQL decides (a lookup first), and the
		 * runner learns again there.  A marker it set there guards
		 * nothing. */
		res = R_GO; silent = true }
	:: atomic { vk_up && STALE_NS(me) && !OWNER_RETIRED ->
		/* a keyspace learnt before a promotion: the old keyspace */
		if
		:: ovk_kind == V_NONE -> res = R_GO    /* its marker there guards nothing */
		:: ovk_kind == V_MARK && MARK_BUSY(ovk_young) -> res = R_BUSY; saw_mark = true
		:: ovk_kind == V_MARK && !MARK_BUSY(ovk_young) -> res = R_GO  /* the claim decides */
		:: ovk_kind == V_DONE || ovk_kind == V_FAILP ->
			got_kind = ovk_kind; got_val = ovk_val; res = R_REPLAY;
			assert(TERMINAL(row_st) && VK_OF(row_st) == got_kind && row_out == got_val)
		fi }
	:: atomic { vk_up && !STALE_NS(me) ->
		if
		:: vk_kind == V_NONE -> SET_MARK(me); marked = true; res = R_GO
		:: vk_kind == V_MARK && MARK_BUSY(vk_young) -> res = R_BUSY; saw_mark = true;
			BUSY_BOUND
		:: vk_kind == V_MARK && !MARK_BUSY(vk_young) ->
			/* older than a second: not ours, no marker of our own; the
			 * claim never waits (busy at once while its run holds the
			 * key, the key itself if that run died) */
			res = R_GO
		:: vk_kind == V_DONE || vk_kind == V_FAILP ->
			got_kind = vk_kind; got_val = vk_val; res = R_REPLAY;
			/* REPLAY: a cached terminal value is the committed one */
			assert(TERMINAL(row_st) && VK_OF(row_st) == got_kind && row_out == got_val)
		fi }
	:: atomic { vk_up && !STALE_NS(me) && vk_kind == V_NONE && VK_FAULT ->
		/* the command ran (marker set) but its reply timed out: the runner
		 * does not know it holds a marker and goes to PostgreSQL */
		SPEND; SET_MARK(me); res = R_GO }
	:: atomic { !vk_up -> res = R_GO; silent = true }
#ifdef FIRST_DELIVERY
	:: res = R_GO   /* the consumer says "first delivery" (rightly or
	                 * not), or the runner's gates met new keys run after
	                 * run: no gate, no marker; the claim decides */
#endif
	fi
}
#endif

/* Any PostgreSQL round trip after a promotion fails on the old connection;
 * the client reconnects and re-learns its keyspace in the first pipeline
 * (client/runner.c).  With NS_WITHOUT_TIMELINE there is one keyspace. */
#define LEARN_KEYSPACE(me) ns_old[me] = false

/* idem_claim / idem_lookup read a terminal row: the backend queues a copy
 * for the worker with the WAL insert position at read time (the row's
 * commit record is before it).  The queue may be full (dropped). */
inline server_repopulate()
{
	if
	:: !ob_pending -> ob_pending = true; ob_kind = got_kind; ob_val = got_val; ob_seq = commit_seq
	:: ob_pending -> skip               /* the same terminal value is queued */
	:: FAULT -> SPEND                   /* queue full: dropped */
	fi
}

/*
 * Valkey silent (the gate skipped it), or the gate met a marker: the
 * runner's lookup_first step (client/runner.c lookup_step), one autocommit
 * idem_lookup before any transaction.  A committed terminal row answers
 * the delivery as the claim would (replay); anything else goes on to the
 * claim (Valkey silent) or stays busy (a marker: a run that committed
 * leaves its marker for the worker's copy to overwrite).  The server queues
 * the terminal row it read for the worker (server_repopulate).
 */
inline lookup_step(me)
{
	atomic {
		LEARN_KEYSPACE(me);
		if
		:: TERMINAL(row_st) -> got_kind = VK_OF(row_st); got_val = row_out; res = R_REPLAY;
			server_repopulate()
		:: else -> skip
		fi
	}
}

/*
 * Compare-and-delete of the runner's own marker (client/, the release
 * script: DEL only if the value is still this token).  Used whenever a run
 * ends without a terminal result.  Valkey down: the marker stays until PX.
 */
inline cad_step(me)
{
	atomic {
		if
		:: marked && vk_up && vk_kind == V_MARK && vk_val == me -> VK_PUT(V_NONE, 0)
		:: else -> skip
		fi;
		marked = false
	}
}

/*
 * BEGIN; SELECT idem_claim(...); SAVEPOINT  -- src/ledger.c ledger_claim():
 * LockAcquire(dontWait) of the key's transaction-scoped lock (key_locktag).
 *  - not available: answer from the committed row (answer_from_row): a
 *    terminal row is replayed, anything else is busy -- no wait;
 *  - acquired (claim_locked): probe the committed row; none -> claimed,
 *    attempt 1 (the row itself is written later, by idem_complete/idem_fail
 *    or at pre-commit in lease mode: src/pending.c -- invisible to others
 *    until COMMIT either way, so the model writes it in the transaction);
 *    failed_retryable or processing with an expired lease -> ledger_reclaim
 *    (UPDATE ... attempt + 1) -> claimed; terminal -> replay; processing
 *    with a running lease -> busy.  Any decision but claimed releases the
 *    lock at once ("let the next claimer in").
 * The probe uses a snapshot taken after the lock is granted (a holder
 * releases it only after its commit is visible), so it sees every earlier
 * holder's commit; under REPEATABLE READ claim_locked raises 40001 instead.
 * A variant may replace this step (#define STEP_CLAIM).
 */
#ifndef STEP_CLAIM
inline claim_step(me)
{
	atomic {
		LEARN_KEYSPACE(me);
		tx_gen = pg_gen;
		if
		:: lock_owner != 0 ->                            /* lock not available */
			if
			:: TERMINAL(row_st) -> got_kind = VK_OF(row_st); got_val = row_out; res = R_REPLAY;
				server_repopulate()
			:: else -> res = R_BUSY
			fi
		:: lock_owner == 0 ->
			if
			:: row_st == S_NONE ->                       /* new key: pending claim */
				tx_st = S_PROC; tx_att = 1; tx_wrote = true; res = R_CLAIMED
			:: TERMINAL(row_st) ->                       /* replay */
				got_kind = VK_OF(row_st); got_val = row_out; res = R_REPLAY;
				server_repopulate()
			:: row_st == S_FAILR ->                      /* re-claim */
				tx_st = S_PROC; tx_att = row_att + 1; tx_wrote = true; res = R_CLAIMED
			:: row_st == S_PROC && lease_live[row_holder] -> res = R_BUSY
			:: row_st == S_PROC && !lease_live[row_holder] ->   /* takeover */
				tx_st = S_PROC; tx_att = row_att + 1; tx_wrote = true; res = R_CLAIMED
			fi;
			if
			:: res == R_CLAIMED -> lock_owner = me;      /* kept until the tx ends */
#ifdef FENCE_ID
				tx_id = next_id; next_id++                  /* the claim's fence */
#else
				skip
#endif
			:: else -> skip                              /* released at once */
			fi
		fi;
		att = tx_att; fence = tx_id
	}
}
#endif

/* Transaction end without commit (ROLLBACK, backend terminated): the
 * try-lock, the row write and the effect vanish together; the
 * per-transaction copies are discarded (src/commit_copies.c, abort). */
inline tx_clear()
{
	tx_st = S_NONE; tx_att = 0; tx_out = 0; tx_wrote = false; tx_eff = false
}
inline tx_rollback(me)
{
	if
	:: lock_owner == me -> lock_owner = 0
	:: else -> skip
	fi;
	tx_clear()
}
/* The runner process dies: its backend stays idle in transaction (still
 * holding the try-lock if it had it) until it is terminated. */
inline runner_dies(me)
{
	if
	:: lock_owner == me -> lock_owner = ZOMBIE
	:: else -> skip
	fi;
	if
	:: vk_kind == V_MARK && vk_val == me -> vk_orphan = true   /* its marker stays */
	:: else -> skip
	fi;
	tx_clear();
	res = R_DIED
}

/* idem_copies_add (src/commit_copies.c) queues the copy in the transaction; the
 * XACT_EVENT_COMMIT callback moves it to the bounded shared-memory queue,
 * or drops it if the queue is full (allowed: PostgreSQL is the truth). */
inline copies_at_commit(kind, val)
{
	if
	:: ob_pending = true; ob_kind = kind; ob_val = val; ob_seq = commit_seq
	:: FAULT -> SPEND                                  /* queue full: dropped */
	fi
}

/* COMMIT of the lock holder's transaction: the row, the effect and the
 * copy become durable together, then the try-lock is released. */
inline tx_commit_effects(me)
{
	if
	:: tx_eff -> effects++;
		assert(effects <= 1)        /* SAFETY: effect committed at most once */
	:: else -> skip
	fi;
	if
	:: tx_wrote -> assert(!TERMINAL(row_st));  /* a terminal row is never overwritten */
		row_st = tx_st; row_att = tx_att; row_out = tx_out; row_holder = me;
#ifdef FENCE_ID
		row_id = tx_id
#else
		skip
#endif
	:: else -> skip
	fi;
#ifdef DURABILITY
	if
	:: tx_wrote || tx_eff -> commit_seq++   /* its commit record */
	:: else -> skip
	fi;
#endif
	if
	:: TERMINAL(tx_st) -> copies_at_commit(VK_OF(tx_st), tx_out)
	:: else -> skip
	fi;
	tx_rollback(me)                 /* releases the try-lock, clears the tx */
}

/* The WAL is flushed up to the last commit (the WAL writer, a synchronous
 * commit, or the worker's nudge): the flushed state is the visible one. */
inline wal_flush()
{
	d_row_st = row_st; d_row_att = row_att; d_row_out = row_out;
	d_row_holder = row_holder; d_effects = effects; flushed_seq = commit_seq
}

/*
 * The key is not ours (busy, replay): round trip 2 ends the transaction,
 * which wrote nothing -- with first_sql (FIRST_IN_CLAIM) after ROLLBACK TO
 * SAVEPOINT, which discards the handler's first statement
 * (client/runner.c pg_step).  BROKEN_FIRST_KEPT: COMMIT without the
 * ROLLBACK TO (must fail: the discarded effect commits).
 */
inline not_ours_commit(me)
{
	atomic {
#if defined(FIRST_IN_CLAIM) && !defined(BROKEN_FIRST_KEPT)
		tx_eff = false;                 /* ROLLBACK TO SAVEPOINT idem_handler */
#endif
		if
		:: tx_gen == pg_gen && tx_eff -> tx_commit_effects(me)
		:: else -> tx_rollback(me)      /* COMMIT of nothing */
		fi
	}
}

#ifdef FIRST_IN_CLAIM
/* The handler's first statement, sent after SAVEPOINT in the claim's
 * pipeline (run option first_sql): its effect is in the transaction before
 * the client has read the claim's answer. */
inline first_stmt_step(me)
{
	if
	:: atomic { FAULT -> SPEND; runner_dies(me) }      /* dies meanwhile */
	:: atomic { tx_eff = true }
	fi
}
#endif

/*
 * In-transaction mode, after `claimed`: SAVEPOINT; the handler writes its
 * effect; idem_complete (src/ledger.c: row -> completed with the outcome,
 * and idem_copies_add) or, on a handler failure, ROLLBACK TO SAVEPOINT and
 * idem_fail (src/ledger.c).  Invisible to others until COMMIT.
 */
inline handler_step(me)
{
	atomic {
		if
		:: tx_eff = true; tx_st = S_DONE; tx_out = OUT(me, att)      /* ok */
		/* a failure rolls back to the savepoint: the effect (first_sql's
		 * included) is gone */
		:: FAULT -> SPEND; tx_eff = false; tx_st = S_FAILR; tx_out = OUT(me, att)
#ifdef PERM_FAIL
		:: tx_eff = false; tx_st = S_FAILP; tx_out = OUT(me, att)    /* permanent */
#endif
		fi
	}
}

/*
 * COMMIT, in-transaction mode (a variant may replace it: STEP_COMMIT).
 * Faults: the backend is terminated before or during commit (rolled back),
 * or the commit succeeds but its reply is lost (the client sees an error).
 */
#ifndef STEP_COMMIT
inline commit_step(me)
{
	atomic {
		if
		:: tx_gen != pg_gen ->
			/* the server crashed or was promoted away since BEGIN: the
			 * transaction is gone; COMMIT fails ("commit unknown" to the
			 * client, which requeues) */
			tx_clear(); res = R_REQUEUE
		:: tx_gen == pg_gen ->
		if
		:: if
			:: tx_st == S_FAILR -> res = R_REQUEUE
			:: else -> res = R_APPLIED; got_kind = VK_OF(tx_st); got_val = tx_out
			fi;
			tx_commit_effects(me)
#ifdef DURABILITY
			/* synchronous_commit = on for this transaction: flushed first */
			; if
			:: wal_flush()
			:: skip                     /* off: returns before the flush */
			fi
#endif
		:: FAULT -> SPEND; tx_rollback(me); res = R_REQUEUE          /* terminated */
		:: FAULT -> SPEND; tx_commit_effects(me); res = R_REQUEUE    /* reply lost */
		fi
		fi
	}
}
#endif

/* The OLD design only (CLIENT_SETS_TERMINAL): the runner's publish()
 * SET <terminal value> PX <remaining retention> over any marker, for a
 * replay read from PostgreSQL and for its own result after COMMIT.  The
 * client no longer writes terminal values (issue 12). */
inline client_set_terminal()
{
	atomic {
		if
		:: vk_up && !ns_old[me] -> VK_PUT(got_kind, got_val); marked = false
		:: else -> skip
		fi
	}
}

/* ---------------------------- lease mode ---------------------------- */

/* Lease mode claim COMMIT: the processing row (with expires_at = the lease)
 * commits alone; the effect happens outside PostgreSQL afterwards. */
inline lease_commit_step(me)
{
	atomic {
		if
		:: assert(!TERMINAL(row_st));
			row_st = S_PROC; row_att = tx_att; row_out = 0; row_holder = me;
#ifdef FENCE_ID
			row_id = tx_id;
#endif
			lease_live[me] = true; in_lease[me] = true;
			tx_rollback(me); res = R_CLAIMED
		:: FAULT -> SPEND; tx_rollback(me); res = R_REQUEUE          /* terminated */
		fi
	}
}

/*
 * Lease mode completion: BEGIN; idem_complete; COMMIT -- src/ledger.c
 * ledger_settle(), the not-pending path: LockAcquire(dontWait) of the key
 * lock (held elsewhere -> ERROR), then ledger_finish: UPDATE ... SET status
 * = 'completed' WHERE key AND status = 'processing' (PLAN_FINISH in
 * src/ledger_store.c), else ERROR "its status is already ...".
 * With the optional attempt argument PLAN_FINISH also requires
 * attempt = $6 (LEASE_FENCE: refuse unless row_att is ours); without it
 * any committed processing row is completed -- also one that another
 * runner has taken over since (the unfenced check shows the damage).
 * FENCE_ID: idem_complete_fenced, PLAN_FINISH with id = $7: refuse unless
 * the row's id is the fence our claim answered.
 */
#if defined(LEASE_FENCE) && defined(FENCE_ID)
#define FENCE_OK (row_id == fence)
#elif defined(LEASE_FENCE)
#define FENCE_OK (row_att == att)
#else
#define FENCE_OK true
#endif
inline lease_complete_step(me)
{
	atomic {
		if
		:: lock_owner != 0 -> res = R_REQUEUE   /* ERROR: another transaction holds it */
		:: lock_owner == 0 && row_st == S_PROC && FENCE_OK ->
#ifdef CHECK_COMPLETION_ATTEMPT
			/* the outcome stored is produced by the attempt the row records */
			assert(row_att == att);
			/* ... in the row that attempt's claim wrote: a purged key's
			 * next claim is attempt 1 again (LEASE_PURGE) */
			assert(row_holder == me);
#endif
			if
			:: row_st = S_DONE; row_out = OUT(me, att);
				copies_at_commit(V_DONE, row_out); res = R_APPLIED
			:: FAULT -> SPEND; res = R_REQUEUE                   /* rolled back */
			fi
		:: lock_owner == 0 && !(row_st == S_PROC && FENCE_OK) ->
			res = R_REQUEUE             /* ERROR: its status is already ... */
		fi;
		in_lease[me] = false;
		if
		:: res == R_APPLIED -> lease_live[me] = false   /* row no longer processing */
		:: else -> skip                 /* a rolled-back completion: the lease runs on */
		fi
	}
}
