/*
 * procs.pml -- the processes of the idem model: runners (client helper),
 * the environment (background worker, timers, faults) and the invariant
 * monitor.  Included after common.pml (and after a variant's replaced step).
 */

/* Runner me: the client runner (idem_runner) in one worker
 * process.  Each loop iteration handles one delivery of the message; a
 * death ends that run (the next iteration is the restarted process). */
proctype runner(byte me)
{
	byte res, att, got_kind, got_val;
	byte fence;                     /* the claim's fence (FENCE_ID) */
	bool marked;
	bool silent;                    /* the gate found Valkey unreachable */
	bool saw_mark;                  /* the gate met a marker (busy) */
	byte tx_st, tx_att, tx_out;     /* this runner's open transaction */
	byte tx_id;                     /* the id its claim drew (FENCE_ID) */
	bool tx_wrote, tx_eff;
	byte tx_gen;                    /* pg_gen at BEGIN */

end_idle:
	do
#ifdef LIVENESS
	:: atomic { acked -> break }
	:: atomic { !acked -> res = R_GO };    /* redelivered until acked */
#else
	:: atomic { delivered >= NDELIV -> break }
	:: atomic { delivered < NDELIV -> delivered++; res = R_GO };
#endif
		marked = false; att = 0; fence = 0; tx_id = 0; silent = false; saw_mark = false;
		gate_step(me);
#ifndef NO_LOOKUP_FIRST
		if
		:: res == R_GO && silent -> lookup_step(me)
		:: res == R_BUSY && saw_mark -> lookup_step(me)  /* a committed run's marker? */
		:: else -> skip
		fi;
#endif
		if
		:: res == R_BUSY -> skip                          /* requeued */
		:: res == R_REPLAY -> acked = true                /* replay from Valkey, or the lookup */
		:: res == R_GO ->
			if
			:: atomic { FAULT -> SPEND; runner_dies(me) }   /* dies before BEGIN */
			:: claim_step(me)
			fi;
#ifdef FIRST_IN_CLAIM
			/* the handler's first statement (run option first_sql), in
			 * the claim's pipeline after SAVEPOINT: it runs whatever the
			 * claim decided */
			if
			:: res != R_DIED -> first_stmt_step(me)
			:: else -> skip
			fi;
#endif
			if
			:: res == R_DIED -> skip                      /* marker stays until PX */
			:: res == R_BUSY ->
				/* COMMIT of the empty transaction (the claim already let
				 * the lock go), then compare-and-delete our marker
				 * (client/runner.c release_marker); message requeued */
				not_ours_commit(me);
				cad_step(me)
			:: res == R_REPLAY ->
				/* REPLAY read from PostgreSQL is the committed outcome
				 * (unless a crash or promotion has since lost it) */
				assert(tx_gen != pg_gen ||
					(TERMINAL(row_st) && VK_OF(row_st) == got_kind && row_out == got_val));
				not_ours_commit(me);            /* COMMIT, nothing written */
#ifdef CLIENT_SETS_TERMINAL
				client_set_terminal();          /* old design: SET value PX */
#endif
				acked = true
			:: res == R_CLAIMED ->
#ifndef LEASE_MODE
				/* SAVEPOINT; handler; idem_complete | idem_fail; COMMIT */
				if
				:: atomic { FAULT -> SPEND; runner_dies(me) }   /* dies in handler */
				:: handler_step(me);
					if
					:: atomic { FAULT -> SPEND; runner_dies(me) }  /* dies before COMMIT */
					:: commit_step(me)
					fi
				fi;
				if
				:: res == R_APPLIED -> acked = true
#ifdef CLIENT_SETS_TERMINAL
					/* old design: SET our own terminal result after COMMIT */
					; client_set_terminal()
#endif
					/* no compare-and-delete (client/runner.c leave_marker):
					 * the worker's copy replaces the marker (or it
					 * expires); a duplicate meeting it looks the row up */
				:: res == R_REQUEUE -> cad_step(me)
				:: res == R_DIED -> skip              /* backend idle in tx until it is terminated */
				fi
#else
				/* lease mode (an application using the SQL API directly;
				 * the C client only runs in-transaction effects): COMMIT
				 * the processing row, effect outside PostgreSQL, then
				 * BEGIN; idem_complete; COMMIT */
				lease_commit_step(me);
				if
				:: res == R_CLAIMED ->
					if
					:: atomic { FAULT -> SPEND; in_lease[me] = false; res = R_DIED }  /* dies before effect */
					:: atomic { ext_effects++ };                                /* the external effect */
						if
						:: atomic { FAULT -> SPEND; in_lease[me] = false; res = R_DIED } /* dies after it */
						:: lease_complete_step(me)
						fi
					fi
				:: else -> skip
				fi;
				if
				:: res == R_APPLIED -> acked = true
				:: res == R_REQUEUE -> cad_step(me)
				:: res == R_DIED -> skip
				fi
#endif
			fi
		fi
	od
}

/* Background worker (src/worker.c): drains the shared-memory queue and
 * writes SET <key> <terminal value> PX <retention>, overwriting a marker,
 * in the current timeline's keyspace, once WORKER_MAY_COPY (the commit is
 * durable).  While Valkey is down the entry stays queued (reconnect with
 * backoff). */
active proctype worker()
{
end:	do
	:: atomic { ob_pending && vk_up && WORKER_MAY_COPY ->
		VK_PUT(ob_kind, ob_val); OB_EMPTY }
	od
}

#ifdef DURABILITY
/* PostgreSQL's WAL and its faults.  Flush: the WAL writer (or any
 * synchronous commit) flushes up to the last commit.  Replication: the
 * standby receives and flushes what the primary has flushed.  Crash: an
 * immediate stop (or power loss) and crash recovery: unflushed commits are
 * lost, every backend and the shared-memory queue with them; same timeline.
 * Promotion: the standby becomes the primary with what it has: a new
 * timeline, hence (unless NS_WITHOUT_TIMELINE) a new, empty keyspace;
 * clients keep their old keyspace until their next PostgreSQL round trip. */
#define LOSE_TO(pfx) \
	if \
	:: TERMINAL(row_st) && !TERMINAL(pfx##_row_st) -> lost_ack = true \
	:: else -> skip \
	fi; \
	row_st = pfx##_row_st; row_att = pfx##_row_att; row_out = pfx##_row_out; \
	row_holder = pfx##_row_holder; effects = pfx##_effects; \
	lock_owner = 0; OB_EMPTY; pg_gen++

/* A new history epoch (a promotion, a rewound start): a new, empty
 * keyspace.  The old one is kept, with its owner key retired, for the
 * runners that still use the keyspace they learnt before (ns_old) -- but
 * not under RELEARN_AT_GATE, where no gate reads it: keeping a copy nothing
 * reads would only split each state by what the copy holds. */
#ifndef RELEARN_AT_GATE
#if NRUN >= 3
#define NS_OLD_ALL ns_old[1] = true; ns_old[2] = true; ns_old[3] = true
#else
#define NS_OLD_ALL ns_old[1] = true; ns_old[2] = true
#endif
#define NEW_NAMESPACE \
	ovk_kind = vk_kind; ovk_val = vk_val; ovk_young = vk_young; VK_PUT(V_NONE, 0); \
	ovk_retired = true; NS_OLD_ALL
#else
#define NEW_NAMESPACE VK_PUT(V_NONE, 0)
#endif

active proctype pg_wal()
{
end:	do
	:: atomic { flushed_seq != commit_seq -> wal_flush() }
	:: atomic { standby_seq != flushed_seq ->
		s_row_st = d_row_st; s_row_att = d_row_att; s_row_out = d_row_out;
		s_row_holder = d_row_holder; s_effects = d_effects; standby_seq = flushed_seq }
	:: atomic { FAULT && flushed_seq != commit_seq -> SPEND;      /* crash */
		LOSE_TO(d); commit_seq = flushed_seq }
#ifdef REWIND
	:: atomic { !b_taken -> b_taken = true;                         /* a backup */
		b_row_st = d_row_st; b_row_att = d_row_att; b_row_out = d_row_out;
		b_row_holder = d_row_holder; b_effects = d_effects; b_seq = flushed_seq }
	:: atomic { FAULT && b_taken -> SPEND;              /* started from it */
		LOSE_TO(b);
		d_row_st = b_row_st; d_row_att = b_row_att; d_row_out = b_row_out;
		d_row_holder = b_row_holder; d_effects = b_effects;
		s_row_st = b_row_st; s_row_att = b_row_att; s_row_out = b_row_out;
		s_row_holder = b_row_holder; s_effects = b_effects;
		commit_seq = b_seq; flushed_seq = b_seq; standby_seq = b_seq;
#ifndef NO_EPOCH
		/* a new epoch: runners that learnt the old keyspace read it until
		 * they learn again (at their next PostgreSQL round trip), and the
		 * old epoch's owner key is retired (see REWIND in common.pml) */
		NEW_NAMESPACE;
#endif
		skip }
#endif
#ifdef FAILOVER
	:: atomic { FAULT && tl == 0 -> SPEND;                          /* promotion */
		LOSE_TO(s);
		d_row_st = s_row_st; d_row_att = s_row_att; d_row_out = s_row_out;
		d_row_holder = s_row_holder; d_effects = s_effects;
		commit_seq = standby_seq; flushed_seq = standby_seq; tl = 1;
#ifndef NS_WITHOUT_TIMELINE
		/* a new timeline, a new epoch: the promoted standby retires the
		 * epoch its copy of the secret file names (the old primary's) */
		NEW_NAMESPACE;
#endif
		skip }
#endif
	od
}
#endif

/* Time passes for markers: a marker's first second ends (it is then
 * "old": the gate lets its duplicates through to the claim), and its PX
 * (the lease) runs out (no fault: this is the normal end of a dead runner's
 * marker).  -DNO_MARKER_PX: the lease outlasts every redelivery (RabbitMQ
 * redelivers at once, far more often than a 30 s lease runs out). */
#ifndef NO_VALKEY_FAULTS
active proctype marker_px()
{
end:	do
	:: atomic { vk_kind == V_MARK && vk_young -> vk_young = false }
	:: atomic { ovk_kind == V_MARK && ovk_young -> ovk_young = false }
#ifndef NO_MARKER_PX
	:: atomic { vk_kind == V_MARK -> VK_PUT(V_NONE, 0) }
	:: atomic { ovk_kind == V_MARK -> OVK_CLEAR }
#endif
	od
}
#endif

/* The committed processing row's lease (expires_at) runs out.  A holder
 * that died or gave up loses it whenever time passes; a holder still
 * working overruns it -- free in safety checks, but a fault under
 * LIVENESS (liveness assumes leases eventually long enough for the effect;
 * -DLEASE_OVERRUN_FREE drops that assumption and spin finds a livelock). */
#if defined(LIVENESS) && !defined(LEASE_OVERRUN_FREE)
#define OVERRUN_OK FAULT
#define OVERRUN_SPEND SPEND
#else
#define OVERRUN_OK true
#define OVERRUN_SPEND skip
#endif
#ifdef LEASE_MODE
active proctype lease_timer()
{
end:	do
	:: atomic { row_st == S_PROC && lease_live[row_holder] && !in_lease[row_holder] ->
		lease_live[row_holder] = false }
	:: atomic { row_st == S_PROC && lease_live[row_holder] && in_lease[row_holder] && OVERRUN_OK ->
		OVERRUN_SPEND; lease_live[row_holder] = false }
	od
}
#endif

/* idem_purge (src/ledger.c): deletes a processing row whose lease ended
 * more than Max(idem.purge_grace, idem.min_purge_grace) ago, skipping a
 * row a running claim has locked (FOR UPDATE SKIP LOCKED; here: the key
 * lock held).  Time is abstract: the floor, set above the longest time a
 * holder may still complete after its lease ended, means no holder is
 * still working on the row (in_lease) when the purge takes it.
 * -DPURGE_NO_FLOOR: any session's idem.purge_grace = 0, no floor. */
#if defined(LEASE_MODE) && defined(LEASE_PURGE)
#ifdef PURGE_NO_FLOOR
#define PURGE_FLOOR_PASSED true
#elif NRUN >= 3
#define PURGE_FLOOR_PASSED (!in_lease[1] && !in_lease[2] && !in_lease[3])
#else
#define PURGE_FLOOR_PASSED (!in_lease[1] && !in_lease[2])
#endif
active proctype lease_purge()
{
end:	do
	:: atomic { row_st == S_PROC && !lease_live[row_holder] && lock_owner == 0 &&
		PURGE_FLOOR_PASSED ->
		row_st = S_NONE; row_att = 0; row_out = 0; row_holder = 0;
#ifdef FENCE_ID
		row_id = 0;
#endif
		}
	od
}
#endif

/* A dead client's backend, idle in transaction, is terminated
 * (idle_in_transaction_session_timeout, TCP keepalive, pg_terminate_backend):
 * its transaction rolls back and the try-lock is released.
 * -DNO_BACKEND_TIMEOUT drops it (liveness must then fail: check.sh). */
#ifndef NO_BACKEND_TIMEOUT
active proctype backend_timeout()
{
end:	do
	:: atomic { lock_owner == ZOMBIE -> lock_owner = 0 }
	od
}
#endif

/* Valkey faults: every key lost (restart, FLUSHALL; with one key this is
 * also a terminal value's PX expiry or eviction), unreachable, back. */
active proctype valkey_faults()
{
end:	do
	:: atomic { VK_FAULT -> SPEND; VK_PUT(V_NONE, 0); OVK_CLEAR }
	:: atomic { VK_FAULT && vk_up -> SPEND; vk_up = false }
	:: atomic { !vk_up -> vk_up = true }
	od
}

/* ---------------------------- invariants ---------------------------- */
#ifdef LEASE_MODE
#define EFFECTS_OF_DONE (row_st != S_DONE || ext_effects >= 1)
#define AT_MOST_ONCE true
#else
#define EFFECTS_OF_DONE (row_st != S_DONE || effects == 1)
#define AT_MOST_ONCE (effects <= 1)
#endif
#ifdef EXT_AT_MOST_ONCE
#define EXT_ONCE (ext_effects <= 1)
#else
#define EXT_ONCE true
#endif
#define NO_EFFECT_OF_FAILP (row_st != S_FAILP || effects == 0)
#define CACHE_IS_TRUTH (!(vk_kind == V_DONE || vk_kind == V_FAILP) || \
	(TERMINAL(row_st) && VK_OF(row_st) == vk_kind && vk_val == row_out))
#define ACK_IS_TERMINAL (!acked || TERMINAL(row_st) || lost_ack)
#define LV(i) (lease_live[i] && in_lease[i])
#if NRUN >= 3
#define ONE_LEASE (!(LV(1) && LV(2)) && !(LV(1) && LV(3)) && !(LV(2) && LV(3)))
#else
#define ONE_LEASE (!(LV(1) && LV(2)))
#endif

active proctype monitor()
{
end:	atomic {
		!(AT_MOST_ONCE && EFFECTS_OF_DONE && NO_EFFECT_OF_FAILP && CACHE_IS_TRUTH &&
		  ACK_IS_TERMINAL && ONE_LEASE && EXT_ONCE) ->
		assert(AT_MOST_ONCE);       /* SAFETY: effect committed at most once */
		assert(EFFECTS_OF_DONE);    /* completed => its effect committed (none lost) */
		assert(NO_EFFECT_OF_FAILP); /* failed_permanent => no effect */
		assert(CACHE_IS_TRUTH);     /* a cached terminal value is the committed one */
		assert(ACK_IS_TERMINAL);    /* a message is acked only on a terminal result */
		assert(ONE_LEASE);          /* at most one runner holds an unexpired lease */
		assert(EXT_ONCE)            /* (only with EXT_AT_MOST_ONCE: expected to fail) */
	}
}

init
{
	atomic {
		run runner(1);
		run runner(2);
#if NRUN >= 3
		run runner(3);
#endif
	}
}
