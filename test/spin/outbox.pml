/*
 * outbox.pml -- a model of its own: the exactly-once pipeline of issue 40,
 * one key's run that emits one message, its publisher, and the stream's
 * consumers that run the message through idem keyed by its id.
 *
 *   runner     (two of them, NDELIV deliveries in all) the upstream run
 *              (run_full, idem_call_emit): idem_claim's non-blocking key lock
 *              (ledger_claim: a completed row is a replay, a held lock
 *              busy), SAVEPOINT, the effect and idem_emit (idem_emit: an
 *              outbox row in the same transaction, its id the key and its
 *              position n among the run's emits, the position forgotten by
 *              ROLLBACK TO SAVEPOINT), idem_complete; or the handler fails:
 *              ROLLBACK TO SAVEPOINT (effect and emit gone) and idem_fail;
 *              COMMIT -- the row, the effect and the message commit or
 *              vanish together.  It may die at any step (its transaction
 *              aborts; a dead client's backend is terminated).
 *   wal        commits are visible before their WAL is flushed
 *              (synchronous_commit = off); a flush makes every earlier
 *              commit durable; a crash (or kill -9 of any backend, the
 *              publisher included: PostgreSQL restarts) loses what was not
 *              flushed and aborts every open transaction.
 *   publisher  (publish_read, publish_wait_durable, publish_send) reads
 *              a committed message once its commit
 *              is durable, XADDs it (the id in a field), then deletes the
 *              row in a transaction of its own; a crash between the XADD
 *              and the delete's flush publishes it again, with the same id.
 *   consumer   (two of them; idem_consumer_poll, consumer_settled, and
 *              the Python client's consumer) XREADGROUP the next new entry, or XAUTOCLAIM a
 *              pending entry nobody works on (its consumer died, or gave
 *              up on busy), or (at most NSTEAL times) one whose consumer is
 *              still running it, past the claim timeout; run it through
 *              idem keyed by the message id (claim, effect, complete,
 *              COMMIT); XACK only once the run settled (applied, or a
 *              replay); busy leaves it pending.  It may die at any step
 *              (pending entries stay, its transaction aborts).  Its
 *              session has synchronous_commit = off, on the upstream's
 *              server; its runs are durable all the same (the consumer's
 *              durable runs: synchronous_commit at least on for the run's
 *              transaction): its COMMIT returns once flushed, and a replay
 *              of a row not flushed yet flushes it before it answers
 *              (idem_replay_durable).  A flush writes all WAL before it.
 *   faults     at most NFAULT: crashes and deaths.
 *
 * Properties:
 *   (effects<=1)     the upstream effect commits at most once, and the
 *                    downstream effect (dn_eff<=1) too;
 *   (slen==0)        no message is on the stream for an effect that rolled
 *                    back or was lost by a crash (checked wherever an
 *                    effect can go);
 *   (id==1)          every XADD carries the message's one id (the key,
 *                    position 1): duplicates only with the same id, and the
 *                    downstream run is keyed by it;
 *   (dn_eff==1)      none lost: whenever nothing is left to run (timeout:
 *                    deliveries and faults spent, every commit flushed, no
 *                    entry new or idle), a durable upstream effect has
 *                    been applied downstream, exactly once, and a
 *                    downstream effect has its upstream effect durable.
 *
 * Broken variants (each a counterexample, test/spin/check.sh):
 *   PUBLISH_IN_HANDLER   the handler XADDs itself, before COMMIT: a message
 *                        for an effect that rolls back
 *   PUBLISH_AFTER_COMMIT the handler XADDs itself, after COMMIT: the runner
 *                        dies in between, the redelivery replays, the
 *                        message is lost (with SYNC_COMMIT, the runners'
 *                        commits flushed at once, synchronous_commit = on:
 *                        without it a crash after the XADD comes first)
 *   PUBLISH_BEFORE_FLUSH the publisher sends committed messages before their
 *                        WAL is flushed: a crash loses an effect whose
 *                        message was published
 *   ACK_BEFORE_RUN       the consumer XACKs on receipt, before the run
 *                        settles: it dies, the message is lost
 *   CONSUMER_NO_CLAIM    the consumer applies the message without idem's
 *                        claim: a republished message (or one claimed from
 *                        a slow consumer) is applied twice
 *
 *   NO_DURABLE_RUN       the consumer's runs as its session has them
 *                        (synchronous_commit = off; idem before the
 *                        durable runs): a crash after the XACK loses the
 *                        downstream effect, and the message is gone
 *   NO_DURABLE_REPLAY    with DN_FOREIGN, a replay answered without
 *                        flushing the row's commit first: the foreign
 *                        writer's row, not flushed, is replayed and
 *                        acknowledged, then lost in a crash
 *
 *   DN_FOREIGN           consumer 1 is a writer of the message's key that
 *                        is not a durable consumer (a session with off
 *                        running the id; it never XACKs, reads only new
 *                        entries): what consumer 0 replays from its row
 *                        may not be flushed (the real model passes)
 */

#ifndef NDELIV
#define NDELIV 3
#endif
#define NCONS 2         /* consumers 0 and 1 (IDLE, the steal) */
#ifndef NFAULT
#define NFAULT 2
#endif
#ifndef NSTEAL
#define NSTEAL 1
#endif
#define SLEN 4          /* one XADD, and one more per crash: NFAULT <= 2 */
#ifdef DN_FOREIGN
#define FOREIGN(c) (c == 1)
#else
#define FOREIGN(c) false
#endif
#ifdef NO_DURABLE_RUN
#define NO_DURABLE_REPLAY
#define DURABLE(c) false
#else
#define DURABLE(c) (!FOREIGN(c))
#endif
#if NFAULT > 2
#error "outbox.pml: SLEN holds NFAULT + 2 entries"
#endif
/* an entry pending that no consumer runs (its consumer died or gave up) */
#define IDLE(i) (i < slen && st[i] == 1 && work[0] != i + 1 && work[1] != i + 1)

/* upstream PostgreSQL: committed (visible) and durable (flushed) state */
byte up_lock = 0;       /* the runner holding the key's lock (0: none) */
byte row = 0;           /* 0 none, 1 failed_retryable, 2 completed */
byte eff = 0;           /* committed effects */
byte ob = 0;            /* the outbox row: its message id (0: none) */
byte d_row = 0;
byte d_eff = 0;
byte d_ob = 0;
bool flushed = true;    /* every commit durable */
byte crashes = 0;       /* restarts: an open transaction of an older one is gone */
byte deliv = 0;
byte faults = 0;

/* the stream and its consumer group */
byte slen = 0;
byte sid[SLEN];         /* the entry's id field */
byte st[SLEN];          /* 0 new, 1 pending, 2 acknowledged */
byte rd = 0;            /* the group's last delivered entry */
byte work[NCONS];       /* the entry (index + 1) a consumer runs (0: none) */
byte steals = 0;

/* downstream: the message id's key, on the same server (one WAL) */
byte dn_lock = 0;       /* the consumer (+ 1) holding the key's lock */
byte dn_row = 0;        /* 0 none, 2 completed */
byte dn_eff = 0;
byte d_dn_row = 0;
byte d_dn_eff = 0;

inline xadd(m)
{
	assert(m == 1);     /* (id==1) */
	assert(slen < SLEN);
	sid[slen] = m; st[slen] = 0; slen++
}

/* a flush: every commit so far durable (WAL is written in order) */
inline flush_all()
{
	d_row = row; d_eff = eff; d_ob = ob;
	d_dn_row = dn_row; d_dn_eff = dn_eff;
	flushed = true
}

/* an effect that may have gone: no message may stay on the stream for it */
inline no_orphan()
{
	assert(slen == 0 || eff == 1)
}

proctype runner(byte me)
{
	byte my_crashes;
	byte pos;
	byte t_ob;
	bool ok;
end:
	do
	:: atomic { deliv < NDELIV -> deliv++; my_crashes = crashes;
		if
		:: row == 2 -> goto settled                 /* replayed */
		:: row != 2 && up_lock != 0 -> goto settled /* busy */
		:: row != 2 && up_lock == 0 -> up_lock = me /* claimed */
		fi }
		/* SAVEPOINT; the handler: the effect and idem_emit, or a failure */
		pos = 0; t_ob = 0;
		if
		:: ok = true; pos++; t_ob = pos;
#ifdef PUBLISH_IN_HANDLER
			atomic { xadd(t_ob) };
#endif
#ifdef PUBLISH_AFTER_COMMIT
			t_ob = 0;           /* nothing in the outbox */
#endif
			skip
		:: ok = false; pos++; t_ob = pos;
#ifdef PUBLISH_IN_HANDLER
			atomic { xadd(t_ob) };
#endif
			/* ROLLBACK TO SAVEPOINT: the effect, the emit and its position */
			t_ob = 0; pos = 0
		fi;
		if
		:: atomic { crashes == my_crashes ->                /* COMMIT */
			if
			:: ok -> row = 2; eff++; ob = t_ob
			:: else -> row = 1; no_orphan()
			fi;
			assert(eff <= 1);   /* (effects<=1) */
#ifdef SYNC_COMMIT
			d_row = row; d_eff = eff; d_ob = ob;
#else
			flushed = false;
#endif
			up_lock = 0 }
#ifdef PUBLISH_AFTER_COMMIT
			if
			:: ok -> atomic { xadd(1) }
			:: atomic { ok && faults < NFAULT -> faults++ }  /* dies first */
			:: !ok -> skip
			fi
#endif
		:: atomic { crashes != my_crashes -> no_orphan() }  /* lost in a crash */
		:: atomic { faults < NFAULT -> faults++;            /* dies: aborted */
			if
			:: crashes == my_crashes -> up_lock = 0
			:: else -> skip
			fi;
			no_orphan() }
		fi;
settled:
		skip
	od
}

proctype wal()
{
end:
	do
	:: atomic { !flushed -> flush_all() }
	:: atomic { faults < NFAULT -> faults++;                /* crash */
		row = d_row; eff = d_eff; ob = d_ob; flushed = true;
		up_lock = 0; crashes++;
		dn_row = d_dn_row; dn_eff = d_dn_eff; dn_lock = 0;
		no_orphan() }
	od
}

proctype publisher()
{
	byte m;
	byte my_crashes;
end:
	do
	:: atomic { ob != 0 &&
#ifndef PUBLISH_BEFORE_FLUSH
		d_ob == ob &&           /* its commit durable */
#endif
		true -> m = ob; my_crashes = crashes }
		if
		:: atomic { crashes == my_crashes -> xadd(m) }
		:: atomic { crashes != my_crashes -> skip }          /* restarted */
		fi;
		/* the delete, in a transaction of its own (not flushed yet) */
		if
		:: atomic { crashes == my_crashes && ob == m -> ob = 0; flushed = false }
		:: atomic { crashes != my_crashes -> skip }          /* restarted */
		fi
	od
}

proctype consumer(byte me)
{
	byte e;
	byte mc;        /* the restarts when the run began */
end:
	do
	:: atomic { rd < slen ->            /* XREADGROUP: the next new entry */
		st[rd] = 1; rd++; e = rd; work[me] = e }
		goto running
	:: atomic {                         /* XAUTOCLAIM: a pending entry nobody runs */
		if
		:: !FOREIGN(me) && IDLE(0) -> e = 1
		:: !FOREIGN(me) && IDLE(1) -> e = 2
		:: !FOREIGN(me) && IDLE(2) -> e = 3
		:: !FOREIGN(me) && IDLE(3) -> e = 4
		fi;
		work[me] = e }
		goto running
	:: atomic {                         /* XAUTOCLAIM past the timeout of a live one */
		!FOREIGN(me) && steals < NSTEAL && work[1 - me] != 0 && st[work[1 - me] - 1] == 1 ->
		steals++; e = work[1 - me]; work[me] = e }
		goto running
	od;
running:
#ifdef ACK_BEFORE_RUN
	atomic { st[e - 1] = 2 };
#endif
	/* the run keyed by the message id, as the runner runs it */
	assert(sid[e - 1] == 1);
	if
	:: atomic { faults < NFAULT -> faults++; work[me] = 0 }; goto end  /* dies */
	:: skip
	fi;
#ifdef CONSUMER_NO_CLAIM
	atomic { dn_eff++; dn_row = 2; assert(dn_eff <= 1) };
#else
	if
	:: atomic { dn_row == 2 ->                          /* replayed: settled */
#ifndef NO_DURABLE_REPLAY
		if
		:: DURABLE(me) && d_dn_row != 2 -> flush_all()  /* idem_replay_durable */
		:: else -> skip
		fi;
#endif
		skip }
	:: atomic { dn_row != 2 && dn_lock != 0 ->          /* busy: stays pending */
		work[me] = 0 }; goto end
	:: atomic { dn_row != 2 && dn_lock == 0 -> dn_lock = me + 1; mc = crashes }
		if
		:: atomic { mc == crashes ->                    /* effect, complete, COMMIT */
			dn_row = 2; dn_eff++; dn_lock = 0;
			if
			:: DURABLE(me) -> flush_all()             /* returns once flushed */
			:: else -> flushed = false
			fi;
			assert(dn_eff <= 1) }
		:: atomic { mc != crashes ->                    /* aborted by a crash */
			if
			:: dn_lock == me + 1 -> dn_lock = 0
			:: else -> skip
			fi;
			work[me] = 0 }; goto end
		:: atomic { faults < NFAULT -> faults++;        /* dies: aborted */
			if                                          /* its lock, unless a crash */
			:: dn_lock == me + 1 -> dn_lock = 0         /* released it already */
			:: else -> skip
			fi;
			work[me] = 0 }; goto end
		fi
	fi;
#endif
	if
	:: atomic { faults < NFAULT -> faults++; work[me] = 0 }; goto end  /* dies before XACK */
	:: atomic { !FOREIGN(me) -> st[e - 1] = 2; work[me] = 0 }  /* XACK */
	:: atomic { FOREIGN(me) -> work[me] = 0 }           /* left pending */
	fi;
	goto end
}

init
{
	atomic {
		run wal();
		run publisher();
		run runner(1);
		run runner(2);
		run consumer(0);
		run consumer(1)
	}
	/* nothing left to run: the pipeline has settled */
	timeout ->
		assert(d_eff == 0 || dn_eff == 1);  /* (dn_eff==1): none lost */
		assert(dn_eff == 0 || d_eff == 1)
}
