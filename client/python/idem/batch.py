"""Batches: many deliveries decided together, for consumers that receive
messages in batches (Streams COUNT n, SQS, a RabbitMQ prefetch).  Valkey
first, one pipelined GET per key and no marker (the C client's
idem_cached_many): a verified terminal result for the same request is a
replay.  The rest are claimed in one statement (idem_claim_many) in the
caller's transaction, the effects follow, and one more round trip completes
and fails them (idem_complete_many, idem_fail_many) and commits.  The
claim is the only guard against a concurrent duplicate here (busy); this
module sets no marker and leaves the gate (run.py) alone."""
import contextlib
import json

import psycopg
from psycopg.pq import TransactionStatus

from . import cache
from .errors import CommitUnknown, Failure, IdemError, ValkeyClusterNotSupported
from .pg import _raise_pg_error, _session_ended
from .result import (APPLIED, BUSY, FAILED_PERMANENT, FAILED_RETRYABLE, MISMATCH,
                     REPLAYED, SOURCE_HANDLER, SOURCE_POSTGRES, Run,
                     _failure_of, _make_run, _outcome_text, _result_from_cache)


def from_cache(runner, st, runs):
    """Decide from Valkey what it can: one pipelined GET for all of runs
    (one per node on a cluster), no marker.  A run decided gets status
    replayed or failed_permanent and source valkey; the others are left
    alone.  Returns how many were decided."""
    if not runs or not runner._valkey_ok() or st.keyspace is None or st.owner_suspect:
        return 0
    ckeys = [cache.cache_key(st.keyspace, run.tenant_id, run.key) for run in runs]
    try:
        runner._check_cluster()
        pipe = runner.valkey.pipeline(transaction=False)
        for k in ckeys:
            pipe.get(k)
        pipe.get(st.owner_key)      # the epoch's owner, in the same round trip
        values = pipe.execute(raise_on_error=False)
    except ValkeyClusterNotSupported:
        raise
    except Exception as e:
        runner._valkey_failed(e)
        return 0
    # as at the gate: the owner key read in the same round trip decides
    # whether anything read here is trusted (trust.py)
    owner = values.pop()
    held, entries = st.judge(owner, list(zip(ckeys, values)), runner.lease_ms, runner.stats)
    runner._health.answered()
    runner._health.owner(held, owner, st.owner_key)     # another Valkey: told, rested
    if not held:
        return 0
    decided = 0
    for run, value, e in zip(runs, values, entries):
        if isinstance(value, Exception):
            continue            # an error reply (WRONGTYPE...): PostgreSQL decides
        run.valkey_used = True
        if e is None or e.kind == cache.MARKER or e.fingerprint != run.fingerprint:
            continue            # absent, not trusted, a run in progress, or a hint: PostgreSQL decides
        if not _result_from_cache(run, e):
            runner.stats["cache_rejected"] += 1
            continue
        runner.stats["replayed_from_valkey"] += 1
        decided += 1
    return decided


def cached_many(runner, conn, items):
    """runner.cached_many: [Run or None] for items (tenant, scope, run_id,
    request), from Valkey alone."""
    runs = [_make_run(Run, *item) for item in items]
    if conn.info.transaction_status != TransactionStatus.IDLE:
        raise IdemError("state", "the connection must be idle (the runner reads the "
                        "keyspace and secrets on it when it has not yet)")
    try:
        st = runner._state(conn)
    except psycopg.Error as e:
        raise IdemError("server", "learning the schema: %s" % str(e).strip(),
                        getattr(e.diag, "sqlstate", None)) from e
    from_cache(runner, st, runs)
    return [run if run.status is not None else None for run in runs]


class Batch:
    """``with runner.batch(conn, items) as batch:`` then, for each run of
    ``batch.claimed``, do its effect on ``conn`` and set ``run.outcome``
    (or ``run.fail(detail)``); ``with batch.step(run):`` gives one run a
    savepoint of its own.  ``batch.runs``: every item's Run, in order."""

    _failure = None     # the batch's own (none): each run records its own

    def __init__(self, runner, conn, items):
        self.r = runner
        self.conn = conn
        self.runs = [_make_run(Run, *item) for item in items]
        self.st = None
        self.tx_open = False

    @property
    def claimed(self):
        """The runs whose effect is the block's to do, in order."""
        return [run for run in self.runs if run.claimed]

    def __iter__(self):
        return iter(self.claimed)

    # -- SQL --
    def _sql(self, name, platform):
        s = self.st.schema
        if name == "claim":
            cols = ("SELECT c.ord, c.decision, c.attempt, c.outcome::text, "
                    "floor(extract(epoch FROM c.expires_at - clock_timestamp()) * 1000)::bigint ")
            return cols + ("FROM %s.idem_platform_claim_many(%%s::bytea[], %%s::bytea[], "
                           "%%s::interval) AS c ORDER BY c.ord" % s if platform else
                           "FROM %s.idem_claim_many(%%s::bigint[], %%s::bytea[], %%s::bytea[], "
                           "%%s::interval) AS c ORDER BY c.ord" % s)
        if name == "complete":
            return ("SELECT %s.idem_platform_complete_many(%%s::bytea[], %%s::jsonb[], %%s::interval)"
                    if platform else
                    "SELECT %s.idem_complete_many(%%s::bigint[], %%s::bytea[], %%s::jsonb[], "
                    "%%s::interval)") % s
        return ("SELECT %s.idem_platform_fail_many(%%s::bytea[], %%s::jsonb[], %%s::boolean[], "
                "%%s::interval)" if platform else
                "SELECT %s.idem_fail_many(%%s::bigint[], %%s::bytea[], %%s::jsonb[], "
                "%%s::boolean[], %%s::interval)") % s

    @staticmethod
    def _keys(runs, platform):
        keys = [run.key for run in runs]
        return [keys] if platform else [[run.tenant_id for run in runs], keys]

    def _groups(self, runs):
        """(platform, runs) for each ledger that has runs."""
        ten = [run for run in runs if run.tenant_id is not None]
        plat = [run for run in runs if run.tenant_id is None]
        return [(p, g) for p, g in ((False, ten), (True, plat)) if g]

    def _error(self, e, what):
        _raise_pg_error(self.conn, e, what)

    def __enter__(self):
        r, conn = self.r, self.conn
        r.stats["runs"] += len(self.runs)
        self.st = r._idle_state(conn, "the batch's transaction is begun and committed by "
                                "the runner")
        from_cache(r, self.st, self.runs)
        pending = [run for run in self.runs if run.status is None]
        if not pending:
            return self
        lease = "%d milliseconds" % r.lease_ms
        try:
            # one round trip: BEGIN, the claims of each ledger, the savepoint
            with conn.pipeline():
                if conn.autocommit:
                    conn.execute("BEGIN")
                self.tx_open = True
                if r.max_attempts is not None:
                    conn.execute("SELECT pg_catalog.set_config('idem.max_attempts', %s, true)",
                                 [str(r.max_attempts)])
                curs = [(g, conn.execute(self._sql("claim", p), self._keys(g, p) +
                                         [[run.fingerprint for run in g], lease]))
                        for p, g in self._groups(pending)]
                conn.execute("SAVEPOINT idem_batch")
            for group, cur in curs:
                for ordinal, decision, attempt, outcome, ms in cur.fetchall():
                    self._decided(group[ordinal - 1], decision, attempt, outcome, ms)
            if not any(run.claimed for run in pending):
                conn.commit()
                self.tx_open = False
        except psycopg.Error as e:
            self.tx_open = False
            for run in pending:
                run.claimed = False
            self._error(e, "idem_claim_many")
        return self

    @staticmethod
    def _decided(run, decision, attempt, outcome, ms):
        run.attempt = attempt
        if decision == "claimed":
            run.claimed = True
            return
        run.source = SOURCE_POSTGRES
        if decision in ("completed", "failed_permanent"):
            run.status = REPLAYED if decision == "completed" else FAILED_PERMANENT
            run.outcome = json.loads(outcome)
        elif decision == "busy":
            run.status = BUSY
            run.retry_after_ms = max(1, ms or 1)
        elif decision == "mismatch":
            run.status = MISMATCH
        else:
            raise IdemError("protocol", "unknown decision %r" % decision)

    @contextlib.contextmanager
    def step(self, run):
        """One run's effect in a savepoint of its own: an exception rolls
        back only this run's statements and records its failure (a
        Failure's kind and detail, else retryable with the exception's
        type and message, kept on ``run.error``); the batch goes on.  Two
        round trips more per run (SAVEPOINT, then RELEASE or ROLLBACK TO)."""
        conn = self.conn
        if not run.claimed:
            raise IdemError("state", "step() on a run that was not claimed")
        conn.execute("SAVEPOINT idem_step")
        try:
            yield run
        except Failure as f:
            conn.execute("ROLLBACK TO SAVEPOINT idem_step")
            run.fail(f.detail, retryable=f.retryable)
        except Exception as e:
            if conn.broken or conn.closed:
                raise
            conn.execute("ROLLBACK TO SAVEPOINT idem_step")
            run.error = e
            run.fail({"error": type(e).__name__, "message": str(e)[:1000]}, retryable=True)
        else:
            if conn.info.transaction_status == TransactionStatus.INERROR and run._failure is None:
                run.fail({"error": "the step left the transaction in error"}, retryable=True)
            conn.execute("ROLLBACK TO SAVEPOINT idem_step" if run._failure is not None
                         else "RELEASE SAVEPOINT idem_step")

    def __exit__(self, et, ev, tb):
        conn = self.conn
        claimed = self.claimed
        if not claimed:
            if conn.info.transaction_status not in (TransactionStatus.IDLE,
                                                    TransactionStatus.UNKNOWN):
                conn.rollback()
                if et is None:
                    raise IdemError("state", "the block ran statements in a batch that claimed "
                                    "nothing (check batch.claimed): rolled back")
            return False
        ts = conn.info.transaction_status
        if et is not None and not issubclass(et, Exception):
            if not (conn.broken or conn.closed) and ts != TransactionStatus.IDLE:
                conn.rollback()
            return False
        if conn.broken or conn.closed:
            err = IdemError("connection", "connection lost during the batch (nothing committed)")
            if et is not None:
                raise err from ev
            raise err
        if ts == TransactionStatus.IDLE:
            raise IdemError("handler_ended_tx",
                            "the block ended the batch's transaction (COMMIT or ROLLBACK): its "
                            "effects may have committed without their idempotency keys")
        block_failure, suppress = _failure_of(self, et, ev)
        if et is None and ts == TransactionStatus.INERROR:
            conn.rollback()
            raise IdemError("handler", "the block left the transaction in error (a failed "
                            "statement it caught): rolled back, nothing recorded")
        # what each claimed run records; the block's failure (its statements
        # rolled back) fails every run that did not fail by itself
        done, failed = [], []
        try:
            for run in claimed:
                failure = run._failure or block_failure
                if failure is None:
                    done.append((run, _outcome_text({} if run.outcome is None else run.outcome,
                                                    "the outcome")))
                else:
                    failed.append((run, _outcome_text(failure[0], "the failure detail"),
                                   bool(failure[1])))
        except IdemError:
            conn.rollback()
            raise
        if _session_ended(conn):
            raise IdemError("connection", "connection lost during the batch (nothing committed)")
        retention = self.r.retention
        try:
            with conn.pipeline():
                conn.execute("ROLLBACK TO SAVEPOINT idem_batch" if block_failure
                             else "RELEASE SAVEPOINT idem_batch")
                for p, g in self._groups([run for run, _ in done]):
                    texts = dict((id(run), t) for run, t in done)
                    conn.execute(self._sql("complete", p), self._keys(g, p) +
                                 [[texts[id(run)] for run in g], retention])
                for p, g in self._groups([run for run, _, _ in failed]):
                    info = dict((id(run), (t, rt)) for run, t, rt in failed)
                    conn.execute(self._sql("fail", p), self._keys(g, p) +
                                 [[info[id(run)][0] for run in g],
                                  [info[id(run)][1] for run in g], retention])
                conn.execute("COMMIT")
        except psycopg.Error as e:
            if conn.broken or conn.closed:
                raise CommitUnknown("connection lost while the batch's COMMIT was in flight: "
                                    "its effects and keys committed together or not at all; "
                                    "redeliver, the ledger decides (%s)" % str(e).strip()) from e
            if e.diag.sqlstate == "3B001":
                conn.rollback()
                raise IdemError("handler_ended_tx",
                                "the block released the batch's savepoint") from e
            self._error(e, "completing the batch")
        for run, text in done:
            run.status, run.source, run.outcome = APPLIED, SOURCE_HANDLER, json.loads(text)
        for run, text, retryable in failed:
            run.status = FAILED_RETRYABLE if retryable else FAILED_PERMANENT
            run.source, run.outcome = SOURCE_HANDLER, json.loads(text)
        return suppress
