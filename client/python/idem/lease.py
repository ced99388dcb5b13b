"""Lease mode, for an effect outside PostgreSQL (an e-mail, a payment
API): the claim commits alone with a lease, the effect happens, and the
completion, fenced by the claim's fence (the id of the claim's row, which
no later claim has, even after the row was purged and the key claimed
again), commits later in a transaction of its own.  At-least-once for the effect (a holder that dies after it and
before completing cannot be told from one that died before it), exactly
one recorded outcome.  The gate in front is the one run's (run.py);
this module owns the committed claim and the fenced completion."""
from types import TracebackType
from typing import Any, List, Optional, Tuple, Type, cast

import psycopg
from psycopg.pq import TransactionStatus

from .canonical import idem_key
from .core import RunnerCore
from .errors import CommitUnknown, IdemError
from .pg import (Conn, Statement, _check_conn, _exec, _one, _raise_pg_error, _session_ended,
                 server_state_error, sqlstate_of)
from .result import (APPLIED, FAILED_PERMANENT, FAILED_RETRYABLE, Failure, FailureSpec, Run,
                     _failure_of, _recorded, _recorded_ending)
from .run import Ending, _caught_timeout_failure, _RunContext



class LeaseLost(IdemError):
    """The completion was refused: the lease ended and another claim took
    the key over (or has already finished it).  The effect may have run
    twice; the ledger keeps the later attempt's outcome."""

    def __init__(self, message: str, sqlstate: Optional[str] = "55000") -> None:
        super().__init__("lease_lost", message, sqlstate)


class Lease(Run):
    """A run in lease mode: ``claimed``, ``attempt``, ``fence`` (what the
    completion is fenced by), ``duration`` (the lease it holds, in seconds),
    and after the block the result."""

    emit_refused = ("lease mode cannot emit: its claim committed before the effect, and the "
                    "completion's transaction holds no claim; emit from a run whose effect is "
                    "in PostgreSQL (runner.run, call, batch)")

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.duration: Optional[float] = None
        self.fence: Optional[int] = None
        self.deferred = False

    def defer(self) -> None:
        """Inside the block: record nothing now; the key is completed later
        (``runner.complete(..., fence=lease.fence)``), from any process,
        before the lease ends."""
        if not self.claimed:
            raise IdemError("state", "defer() on a lease that was not claimed")
        self.deferred = True


def _claim_sql(schema: str, tenant_id: Optional[int]) -> str:
    """The lease-mode claim: the decision, and the claim's fence last."""
    ms = "floor(extract(epoch FROM c.expires_at - clock_timestamp()) * 1000)::bigint"
    return ("SELECT c.decision, c.attempt, c.outcome::text, " + ms + ", c.fence" +
            (" FROM %s.idem_platform_claim(%%s, %%s, %%s::interval) AS c" if tenant_id is None
             else " FROM %s.idem_claim(%%s, %%s, %%s, %%s::interval) AS c") % schema)


def _fenced_sql(schema: str, tenant_id: Optional[int], failure: Optional[FailureSpec],
                fence: Optional[int]) -> str:
    """The fenced completion: by the claim's fence (idem_complete_fenced), or
    by its attempt (idem_complete(..., attempt), for callers that kept only
    the attempt: a row purged and claimed again is attempt 1 again)."""
    if fence is not None:
        if tenant_id is None:
            return ("SELECT %s.idem_platform_fail_fenced(%%s, %%s, %%s::jsonb, %%s, %%s::interval)"
                    if failure else
                    "SELECT %s.idem_platform_complete_fenced(%%s, %%s, %%s::jsonb, %%s::interval)"
                    ) % schema
        return ("SELECT %s.idem_fail_fenced(%%s, %%s, %%s, %%s::jsonb, %%s, %%s::interval)" if failure
                else "SELECT %s.idem_complete_fenced(%%s, %%s, %%s, %%s::jsonb, %%s::interval)") % schema
    if tenant_id is None:
        return ("SELECT %s.idem_platform_fail(%%s, %%s::jsonb, %%s, %%s::interval, %%s)" if failure
                else "SELECT %s.idem_platform_complete(%%s, %%s::jsonb, %%s::interval, %%s)") % schema
    return ("SELECT %s.idem_fail(%%s, %%s, %%s::jsonb, %%s, %%s::interval, %%s)" if failure
            else "SELECT %s.idem_complete(%%s, %%s, %%s::jsonb, %%s::interval, %%s)") % schema


def fenced_params(tenant_id: Optional[int], key: bytes, text: str,
                  failure: Optional[FailureSpec], retention: Any, attempt: Any,
                  fence: Optional[int]) -> List[Any]:
    p: List[Any] = [key] if tenant_id is None else [tenant_id, key]
    if fence is not None:
        p.append(int(fence))
    p.append(text)
    if failure is not None:
        p.append(bool(failure[1]))
    p.append(retention)
    return p if fence is not None else p + [int(attempt)]


class _LeaseContext(_RunContext):
    """The gate, then a claim that commits alone with a lease; after the
    block, the fenced completion (or failure) in a transaction of its own."""
    run_class: Type[Run] = Lease

    def __init__(self, runner: RunnerCore, conn: Conn, tenant_id: Optional[int], scope: str,
                 run_id: str, request: Any, lease_ms: Optional[int] = None,
                 delivery_count: int = 0) -> None:
        super().__init__(runner, conn, tenant_id, scope, run_id, request,
                         delivery_count=delivery_count)
        lease_ms = runner.lease_ms if lease_ms is None else int(lease_ms)
        if not (0 < lease_ms <= 2147483647):
            raise IdemError("argument", "the lease must be positive")
        self.lease_ms = lease_ms
        self.lease = cast(Lease, self.run)
        self.lease.duration = lease_ms / 1000.0

    def _lease_claim_failed(self, e: psycopg.Error) -> Optional[IdemError]:
        """The committed claim's round trip failed: what to raise if the
        connection is lost (None: a statement error)."""
        if not self._broken():
            return None
        # the claim may have committed: the key then answers busy until its
        # lease ends, and a redelivery takes it over
        return IdemError("connection", "connection lost while the lease-mode claim was in "
                         "flight (if it committed, the key is busy until its lease ends): %s"
                         % str(e).strip())

    def _claim_params(self) -> List[Any]:
        return self._key_params() + [self.run.fingerprint, "%d milliseconds" % self.lease_ms]

    def _sql(self, name: str) -> str:
        if name == "claim":
            return _claim_sql(self.st.schema, self.run.tenant_id)
        return super()._sql(name)

    def _claimed(self, row: Tuple[Any, ...], first_rows: Optional[List[Any]]) -> bool:
        """The claim's answer, and its fence (the last column)."""
        self.lease.fence = row[4]
        return super()._claimed(row[:4], first_rows)

    # step 3b: the claim, committed alone, with its lease given explicitly
    def _claim(self) -> None:
        conn = self.conn
        if _session_ended(conn):
            raise IdemError("connection", "connection lost before the claim was sent "
                            "(nothing committed)")
        try:
            cur = self._committed_alone(self._sql("claim"), self._claim_params())
        except psycopg.Error as e:
            err = self._lease_claim_failed(e)
            if err is not None:
                raise err from e
            self._pg_error(e, "idem_claim")
        self._claimed(_one(cur), None)

    def __enter__(self) -> Lease:
        super().__enter__()
        return self.lease

    def __exit__(self, et: Optional[Type[BaseException]], ev: Optional[BaseException],
                 tb: Optional[TracebackType]) -> bool:
        run = self.run
        if not run.claimed:
            return super().__exit__(et, ev, tb)
        try:
            return self._finish(et, ev)
        finally:
            if self._drops_marker():
                self._drop_marker()

    def _drops_marker(self) -> bool:
        """After the block: our marker goes unless a terminal row's copy
        will overwrite it."""
        return self.own_marker and self.run.status in (None, FAILED_RETRYABLE)

    lost_before_end = ("connection lost before the completion was sent (nothing recorded; "
                       "the lease ends it)")

    def _ending(self, et: Optional[Type[BaseException]], ev: Optional[BaseException]) -> Ending:
        """What the end of a claimed lease's block does, decided before any
        I/O, as _RunContext._ending: (rollback, error, failure, text,
        suppress); text None and no error: nothing recorded (the lease ends
        it, or the completion is deferred)."""
        run, conn = self.lease, self.conn
        ts = conn.info.transaction_status
        if et is not None and not issubclass(et, Exception):
            return False, None, None, None, False   # KeyboardInterrupt...: the lease ends it
        if not isinstance(ev, Failure) and server_state_error(ev) is not None:
            # the server's state (a serialization failure...), not the
            # block's answer: nothing recorded (the lease ends it), raised again
            return not self._broken() and ts != TransactionStatus.IDLE, None, None, None, False
        failure, suppress = _failure_of(run, et, ev)
        if et is None and run.deferred:
            return False, None, None, None, False   # completed later, by its fence
        if ts == TransactionStatus.INERROR and et is None:
            # a timeout's cancel the block caught is its attempt (run.py)
            caught = _caught_timeout_failure(conn) if failure is None else None
            if caught is None:
                return True, IdemError("handler", "the block left the connection's transaction "
                                       "in error: rolled back, nothing recorded (the lease "
                                       "ends it)"), None, None, False
            failure = caught
        # an outcome or detail that cannot be stored fails the attempt, as in
        # a run (_recorded_ending); what the block left open rolls back
        # with it, as a handler's writes do in idem_apply
        recorded, text = _recorded_ending(run, failure, et, suppress)
        rollback = ts == TransactionStatus.INERROR or (
            recorded is not failure and ts == TransactionStatus.INTRANS)
        return rollback, None, recorded, text, suppress

    def _ending_statements(self, failure: Optional[FailureSpec], text: str) -> List[Statement]:
        """One round trip: the fenced completion (or failure) and COMMIT,
        with whatever the block left open on this connection."""
        run = self.lease
        begin: List[Statement] = [("BEGIN", None)] if (
            self.conn.info.transaction_status == TransactionStatus.IDLE and
            self.conn.autocommit) else []
        return begin + [(_fenced_sql(self.st.schema, run.tenant_id, failure, run.fence),
                         fenced_params(run.tenant_id, run.key, text, failure, self.r.retention,
                                       run.attempt, run.fence)),
                        ("COMMIT", None)]

    def _ending_failed(self, e: psycopg.Error) -> Tuple[bool, IdemError]:
        """The completion's round trip failed: (rollback, what to raise)."""
        if self._broken():
            return False, CommitUnknown("connection lost while the completion's COMMIT was in "
                                        "flight: redeliver, the ledger decides (%s)"
                                        % str(e).strip())
        return True, _refused(e)


def _refused(e: psycopg.Error) -> IdemError:
    """A refused completion: why."""
    state = sqlstate_of(e)
    if state == "55000":
        return LeaseLost(str(e).strip())
    return IdemError("server", "completing the lease: %s" % str(e).strip(), state)


def settle(runner: RunnerCore, conn: Conn, tenant_id: Optional[int], scope: str, run_id: str,
           attempt: Optional[int], outcome: Any = None, failure: Optional[FailureSpec] = None,
           fence: Optional[int] = None) -> str:
    """runner.complete / runner.fail: the fenced statement in the
    connection's transaction (committed by itself on an autocommit
    connection; else the caller commits); the status it records."""
    _check_conn(conn)
    try:
        st = runner._state(conn)
    except psycopg.Error as e:
        _raise_pg_error(conn, e, "learning the schema")
    sql, params, status = settle_statement(runner, st, tenant_id, scope, run_id, attempt,
                                           outcome, failure, fence)
    try:
        _exec(conn, sql, params)
    except psycopg.Error as e:
        raise settle_failed(conn, e) from e
    return status


def settle_statement(runner: RunnerCore, st: Any, tenant_id: Optional[int], scope: str,
                     run_id: str, attempt: Optional[int], outcome: Any,
                     failure: Optional[FailureSpec],
                     fence: Optional[int] = None) -> Tuple[str, List[Any], str]:
    """runner.complete's (or fail's) fenced statement, its parameters, and
    the status it records: by the claim's fence, or (older callers) by its
    attempt.  An outcome or failure detail the ledger cannot store fails
    the attempt, as at the end of a lease's block (_recorded)."""
    if (attempt is None) == (fence is None):
        raise IdemError("argument", "give the claim's fence (or, for callers that kept only "
                        "its attempt, attempt), not both")
    if tenant_id is not None:
        tenant_id = int(tenant_id)
    try:
        key = idem_key(scope, run_id)
    except (TypeError, ValueError) as e:
        raise IdemError("argument", str(e)) from None
    failure, text = _recorded(outcome, failure)
    status = APPLIED if failure is None else FAILED_RETRYABLE if failure[1] else FAILED_PERMANENT
    return (_fenced_sql(st.schema, tenant_id, failure, fence),
            fenced_params(tenant_id, key, text, failure, runner.retention, attempt, fence), status)


def settle_failed(conn: Any, e: psycopg.Error) -> IdemError:
    """runner.complete's statement failed: why."""
    if conn.broken or conn.closed:
        if conn.autocommit:
            return CommitUnknown("connection lost while the completion was in flight: look "
                                 "the key up (%s)" % str(e).strip())
        return IdemError("connection", "connection lost (the transaction with the completion "
                         "did not commit): %s" % str(e).strip())
    state = sqlstate_of(e)
    if state == "55000":
        return LeaseLost(str(e).strip())
    return IdemError("server", str(e).strip(), state)
