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
from types import TracebackType
from typing import (Any, Iterable, Iterator, List, NoReturn, Optional,
                    Tuple, Type)

import psycopg
from psycopg.pq import TransactionStatus

from . import cache
from .core import RunnerCore
from .emit import statement as emit_statement
from .errors import CommitUnknown, IdemError
from .pg import (MAX_ATTEMPTS_SQL, Conn, Statement, _check_conn, _exec, _pipeline,
                 _raise_ending, _raise_pg_error, _send, _session_ended, server_state_error,
                 sqlstate_of)
from .result import (APPLIED, BUSY, FAILED_PERMANENT, FAILED_RETRYABLE, MISMATCH,
                     REPLAYED, SOURCE_HANDLER, SOURCE_POSTGRES, Failure, FailureSpec, Run,
                     _failure_of, _make_run, _recorded_ending, _result_from_cache)
from .trust import _ConnState


# What a batch's end records (Batch._closing): the block's failure, the
# completed runs and their outcomes, the failed runs with their details
# and kinds, and whether the block's exception is suppressed.
Closing = Tuple[Optional[FailureSpec], List[Tuple[Run, str]], List[Tuple[Run, str, bool]], bool]


def from_cache(runner: RunnerCore, st: _ConnState, runs: List[Run]) -> int:
    """Decide from Valkey what it can: one pipelined GET for all of runs
    (one per node on a cluster), no marker.  A run decided gets status
    replayed or failed_permanent and source valkey; the others are left
    alone.  Returns how many were decided."""
    ckeys = cache_keys(runner, st, runs)
    if not ckeys:
        return 0
    values = runner._round_trip(lambda pipe: cache_reads(pipe, st, ckeys))
    return 0 if values is None else cache_answers(runner, st, runs, ckeys, values)


def cache_keys(runner: RunnerCore, st: _ConnState, runs: List[Run]) -> List[bytes]:
    """The cache keys from_cache reads (none: Valkey is not asked)."""
    if not runs or not runner._valkey_ok() or st.keyspace is None or st.owner_suspect:
        return []
    keyspace = st.keyspace
    return [cache.cache_key(keyspace, run.tenant_id, run.key) for run in runs]


def cache_reads(pipe: Any, st: _ConnState, ckeys: List[bytes]) -> Any:
    """from_cache's one round trip: each key's GET, and the epoch's owner
    key's in the same round trip."""
    for k in ckeys:
        pipe.get(k)
    pipe.get(st.owner_key)
    return pipe


def cache_answers(runner: RunnerCore, st: _ConnState, runs: List[Run], ckeys: List[bytes],
                  values: List[Any]) -> int:
    """What from_cache read (the keys' values, then the owner key's):
    the runs it decides.  Returns how many."""
    # as at the gate: the owner key read in the same round trip decides
    # whether anything read here is trusted (trust.py)
    owner = values.pop()
    held, entries = st.judge(owner, list(zip(ckeys, values)), runner.lease_ms, runner.stats)
    runner._health.answered()
    runner._health.owner(held, owner, st.owner_key)     # another Valkey: told, rested
    if not held:
        return 0
    decided = 0
    for run, value, entry in zip(runs, values, entries):
        if isinstance(value, Exception):
            continue            # an error reply (WRONGTYPE...): PostgreSQL decides
        run.valkey_used = True
        if entry is None or entry.kind == cache.MARKER or entry.fingerprint != run.fingerprint:
            continue            # absent, not trusted, a run in progress, or a hint: PostgreSQL decides
        if not _result_from_cache(run, entry):
            runner.stats["cache_rejected"] += 1
            continue
        runner.stats["replayed_from_valkey"] += 1
        decided += 1
    return decided


def cached_many(runner: RunnerCore, conn: Conn, items: Iterable[Any]) -> List[Optional[Run]]:
    """runner.cached_many: [Run or None] for items (tenant, scope, run_id,
    request), from Valkey alone."""
    _check_conn(conn)
    runs = [_make_run(Run, *item) for item in items]
    if conn.info.transaction_status != TransactionStatus.IDLE:
        raise IdemError("state", "the connection must be idle (the runner reads the "
                        "keyspace and secrets on it when it has not yet)")
    try:
        st = runner._state(conn)
    except psycopg.Error as e:
        _raise_pg_error(conn, e, "learning the schema")
    from_cache(runner, st, runs)
    return [run if run.status is not None else None for run in runs]


class Batch:
    """``with runner.batch(conn, items) as batch:`` then, for each run of
    ``batch.claimed``, do its effect on ``conn`` and set ``run.outcome``
    (or ``run.fail(detail)``); ``with batch.step(run):`` gives one run a
    savepoint of its own.  ``batch.runs``: every item's Run, in order."""

    _failure: Optional[FailureSpec] = None  # the batch's own (none): each run records its own
    asynchronous = False        # the connection is an AsyncConnection (idem.aio)

    def __init__(self, runner: RunnerCore, conn: Conn, items: Iterable[Any]) -> None:
        _check_conn(conn, self.asynchronous)
        self.r = runner
        self.conn = conn
        self.runs = [_make_run(Run, *item) for item in items]
        self.st = _ConnState(0)     # the session's, once entered
        self.tx_open = False

    @property
    def claimed(self) -> List[Run]:
        """The runs whose effect is the block's to do, in order."""
        return [run for run in self.runs if run.claimed]

    def __iter__(self) -> Iterator[Run]:
        return iter(self.claimed)

    # -- SQL --
    def _sql(self, name: str, platform: bool) -> str:
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
    def _keys(runs: List[Run], platform: bool) -> List[Any]:
        keys = [run.key for run in runs]
        return [keys] if platform else [[run.tenant_id for run in runs], keys]

    def _groups(self, runs: List[Run]) -> List[Tuple[bool, List[Run]]]:
        """(platform, runs) for each ledger that has runs."""
        ten = [run for run in runs if run.tenant_id is not None]
        plat = [run for run in runs if run.tenant_id is None]
        return [(p, g) for p, g in ((False, ten), (True, plat)) if g]

    def _error(self, e: psycopg.Error, what: str) -> NoReturn:
        _raise_pg_error(self.conn, e, what)

    def __enter__(self) -> "Batch":
        r, conn = self.r, self.conn
        r.stats["runs"] += len(self.runs)
        self.st = r._idle_state(conn, "the batch's transaction is begun and committed by "
                                "the runner")
        from_cache(r, self.st, self.runs)
        pending = [run for run in self.runs if run.status is None]
        if not pending:
            return self
        try:
            # one round trip: BEGIN, the claims of each ledger, the savepoint
            with _pipeline(conn):
                if conn.autocommit:
                    _exec(conn, "BEGIN")
                self.tx_open = True
                if r.max_attempts is not None:
                    _exec(conn, MAX_ATTEMPTS_SQL, [str(r.max_attempts)])
                curs = [(g, _exec(conn, sql, params))
                        for g, sql, params in self._claim_statements(pending)]
                _exec(conn, "SAVEPOINT idem_batch")
            for group, cur in curs:
                self._claims_answered(group, cur.fetchall())
            if not any(run.claimed for run in pending):
                conn.commit()
                self.tx_open = False
        except psycopg.Error as e:
            self.tx_open = False
            for run in pending:
                run.claimed = False
            self._error(e, "idem_claim_many")
        return self

    def _claim_statements(self, pending: List[Run]) -> List[Tuple[List[Run], str, List[Any]]]:
        """One idem_claim_many per ledger: (its runs, statement, parameters)."""
        lease = "%d milliseconds" % self.r.lease_ms
        return [(g, self._sql("claim", p), self._keys(g, p) + [[run.fingerprint for run in g],
                                                                 lease])
                for p, g in self._groups(pending)]

    def _claims_answered(self, group: List[Run], rows: List[Tuple[Any, ...]]) -> None:
        for ordinal, decision, attempt, outcome, ms in rows:
            self._decided(group[ordinal - 1], decision, attempt, outcome, ms)

    @staticmethod
    def _decided(run: Run, decision: str, attempt: Optional[int], outcome: Optional[str],
                 ms: Optional[int]) -> None:
        run.attempt = attempt
        if decision == "claimed":
            run.claimed = True
            return
        run.source = SOURCE_POSTGRES
        if decision in ("completed", "failed_permanent"):
            run.status = REPLAYED if decision == "completed" else FAILED_PERMANENT
            run.outcome = None if outcome is None else json.loads(outcome)
        elif decision == "busy":
            run.status = BUSY
            run._busy_for(ms)
        elif decision == "mismatch":
            run.status = MISMATCH
        else:
            raise IdemError("protocol", "unknown decision %r" % decision)

    @contextlib.contextmanager
    def step(self, run: Run) -> Iterator[Run]:
        """One run's effect in a savepoint of its own: an exception rolls
        back only this run's statements and records its failure (a
        Failure's kind and detail, else retryable with the exception's
        type and message, kept on ``run.error``); the batch goes on.  Two
        round trips more per run (SAVEPOINT, then RELEASE or ROLLBACK TO)."""
        conn = self.conn
        if not run.claimed:
            raise IdemError("state", "step() on a run that was not claimed")
        _exec(conn, "SAVEPOINT idem_step")
        try:
            yield run
        except Exception as e:
            if not self._step_failed(run, e):
                raise
            _exec(conn, "ROLLBACK TO SAVEPOINT idem_step")
        else:
            _exec(conn, self._step_ended(run))

    def _step_failed(self, run: Run, e: Exception) -> bool:
        """A step's exception: recorded as its run's failure (then rolled
        back to the step's savepoint), or False: the batch's to handle
        (the connection lost, or the server's state: a serialization
        failure...)."""
        if isinstance(e, Failure):
            run.fail(e.detail, retryable=e.retryable)
            return True
        if self.conn.broken or self.conn.closed or server_state_error(e) is not None:
            return False
        run.error = e
        run.fail({"error": type(e).__name__, "message": str(e)[:1000]}, retryable=True)
        return True

    def _step_ended(self, run: Run) -> str:
        """A step that raised nothing: the statement that ends it.  An
        outcome that cannot be stored fails the run's attempt, its
        statements rolled back, as a run's does (_recorded_ending)."""
        if self.conn.info.transaction_status == TransactionStatus.INERROR and run._failure is None:
            run.fail({"error": "the step left the transaction in error"}, retryable=True)
        if run._failure is None:
            run._failure = _recorded_ending(run, None, None, False)[0]
        return ("ROLLBACK TO SAVEPOINT idem_step" if run._failure is not None
                else "RELEASE SAVEPOINT idem_step")

    def _unclaimed_exit(self, et: Optional[Type[BaseException]]) -> Tuple[bool, Optional[IdemError]]:
        """The end of a block whose batch claimed nothing: (rollback, error)."""
        if self.conn.info.transaction_status in (TransactionStatus.IDLE, TransactionStatus.UNKNOWN):
            return False, None
        return True, None if et is not None else IdemError(
            "state", "the block ran statements in a batch that claimed nothing (check "
            "batch.claimed): rolled back")

    def _closing(self, et: Optional[Type[BaseException]],
                 ev: Optional[BaseException]) -> Tuple[bool, Optional[IdemError], Optional[Closing]]:
        """What the end of a batch with claimed runs does, decided before
        any I/O: (rollback, error, closing); closing None and no error:
        let the block's exception propagate.  closing: (the block's
        failure, the completed runs and outcomes, the failed runs, details
        and kinds, suppress)."""
        conn = self.conn
        ts = conn.info.transaction_status
        broken = conn.broken or conn.closed
        if et is not None and not issubclass(et, Exception):
            return not broken and ts != TransactionStatus.IDLE, None, None
        if broken:
            return False, IdemError("connection", "connection lost during the batch (nothing "
                                    "committed)"), None
        if not isinstance(ev, Failure) and server_state_error(ev) is not None:
            # a serialization failure, a deadlock, an operator's cancel...:
            # the server's state, not an answer; nothing recorded, raised again
            return ts != TransactionStatus.IDLE, None, None
        if ts == TransactionStatus.IDLE:
            return False, IdemError("handler_ended_tx", "the block ended the batch's transaction "
                                    "(COMMIT or ROLLBACK): its effects may have committed "
                                    "without their idempotency keys"), None
        block_failure, suppress = _failure_of(self, et, ev)
        if et is None and ts == TransactionStatus.INERROR:
            return True, IdemError("handler", "the block left the transaction in error (a "
                                   "failed statement it caught): rolled back, nothing "
                                   "recorded"), None
        # what each claimed run records (_recorded_ending: an outcome or
        # detail that cannot be stored fails the run's attempt); the block's
        # failure (its statements rolled back) fails every run that did not
        # fail by itself
        ends = [(run,) + _recorded_ending(run, run._failure or block_failure,
                                          None if run._failure else et, suppress)
                for run in self.claimed]
        unstorable = [f for run, f, _ in ends
                      if block_failure is None and run._failure is None and f is not None]
        if unstorable:
            # a run's outcome that cannot be stored, outside a step: its
            # statements cannot be told from the others', so the batch's
            # roll back, and the runs that did not fail by themselves fail
            # retryably with it, as after the block's exception
            block_failure = ({"sqlstate": unstorable[0][0]["sqlstate"],
                              "message": "the batch's statements rolled back: a run's "
                              "outcome cannot be stored"}, True)
            ends = [(run, f, t) if f is not None else
                    (run,) + _recorded_ending(run, block_failure, None, False)
                    for run, f, t in ends]
        done = [(run, t) for run, f, t in ends if f is None]
        failed = [(run, t, bool(f[1])) for run, f, t in ends if f is not None]
        return False, None, (block_failure, done, failed, suppress)

    def _exiting(self, et: Optional[Type[BaseException]],
                 ev: Optional[BaseException]) -> Tuple[bool, Optional[IdemError], Optional[Closing]]:
        """_closing, or _unclaimed_exit when the batch claimed nothing."""
        if self.claimed:
            return self._closing(et, ev)
        rollback, err = self._unclaimed_exit(et)
        return rollback, err, None

    def _closing_statements(self, closing: "Closing") -> List[Statement]:
        """The last round trip: the savepoint ended, the completions and
        failures of each ledger, COMMIT."""
        block_failure, done, failed, _ = closing
        retention = self.r.retention
        stmts: List[Statement] = [
            ("ROLLBACK TO SAVEPOINT idem_batch" if block_failure
             else "RELEASE SAVEPOINT idem_batch", None)]
        if not block_failure:
            # the messages of the runs that complete (run.emit), each
            # naming its run's key
            stmts += emit_statement(self.st.schema,
                                    [m for run, _ in done for m in run._emits])
        texts = dict((id(run), t) for run, t in done)
        for p, g in self._groups([run for run, _ in done]):
            stmts.append((self._sql("complete", p), self._keys(g, p) +
                          [[texts[id(run)] for run in g], retention]))
        info = dict((id(run), (t, rt)) for run, t, rt in failed)
        for p, g in self._groups([run for run, _, _ in failed]):
            stmts.append((self._sql("fail", p), self._keys(g, p) +
                          [[info[id(run)][0] for run in g],
                           [info[id(run)][1] for run in g], retention]))
        stmts.append(("COMMIT", None))
        return stmts

    def _closing_failed(self, e: psycopg.Error) -> Tuple[bool, IdemError]:
        """The last round trip failed: (rollback, what to raise)."""
        if self.conn.broken or self.conn.closed:
            return False, CommitUnknown(
                "connection lost while the batch's COMMIT was in flight: its effects and keys "
                "committed together or not at all; redeliver, the ledger decides (%s)"
                % str(e).strip())
        if sqlstate_of(e) == "3B001":
            return True, IdemError("handler_ended_tx", "the block released the batch's savepoint")
        return True, IdemError("server", "completing the batch: %s" % str(e).strip(),
                               sqlstate_of(e))

    @staticmethod
    def _closed(closing: "Closing") -> None:
        """Committed: each run's result."""
        _, done, failed, _ = closing
        for run, text in done:
            run.status, run.source, run.outcome = APPLIED, SOURCE_HANDLER, json.loads(text)
        for run, text, retryable in failed:
            run.status = FAILED_RETRYABLE if retryable else FAILED_PERMANENT
            run.source, run.outcome = SOURCE_HANDLER, json.loads(text)

    def __exit__(self, et: Optional[Type[BaseException]], ev: Optional[BaseException],
                 tb: Optional[TracebackType]) -> bool:
        conn = self.conn
        rollback, err, closing = self._exiting(et, ev)
        if rollback:
            conn.rollback()
        if closing is None:
            _raise_ending(err, ev)
            return False
        if _session_ended(conn):
            raise IdemError("connection", "connection lost during the batch (nothing committed)")
        _send(conn, self._closing_statements(closing), self._closing_failed)
        self._closed(closing)
        return closing[3]
