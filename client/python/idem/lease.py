"""Lease mode, for an effect outside PostgreSQL (an e-mail, a payment
API): the claim commits alone with a lease, the effect happens, and the
completion, fenced by the claim's fence (the id of the claim's row, which
no later claim has, even after the row was purged and the key claimed
again), commits later in a transaction of its own.  At-least-once for the effect (a holder that dies after it and
before completing cannot be told from one that died before it), exactly
one recorded outcome.  The gate in front is the one run's (run.py);
this module owns the committed claim and the fenced completion."""
import json

import psycopg
from psycopg.pq import TransactionStatus

from .canonical import idem_key
from .errors import CommitUnknown, IdemError
from .pg import _session_ended
from .result import (APPLIED, FAILED_PERMANENT, FAILED_RETRYABLE, SOURCE_HANDLER, Run,
                     _failure_of, _outcome_text)
from .run import _RunContext


class LeaseLost(IdemError):
    """The completion was refused: the lease ended and another claim took
    the key over (or has already finished it).  The effect may have run
    twice; the ledger keeps the later attempt's outcome."""

    def __init__(self, message, sqlstate="55000"):
        super().__init__("lease_lost", message, sqlstate)


class Lease(Run):
    """A run in lease mode: ``claimed``, ``attempt``, ``fence`` (what the
    completion is fenced by), ``lease_ms`` (the lease it holds), and after
    the block the result."""

    def __init__(self, *a):
        super().__init__(*a)
        self.lease_ms = None
        self.fence = None
        self.deferred = False

    def defer(self):
        """Inside the block: record nothing now; the key is completed later
        (``runner.complete(..., fence=lease.fence)``), from any process,
        before the lease ends."""
        if not self.claimed:
            raise IdemError("state", "defer() on a lease that was not claimed")
        self.deferred = True


def _claim_sql(schema, tenant_id):
    """The lease-mode claim: the decision and the claim's fence."""
    ms = "floor(extract(epoch FROM c.expires_at - clock_timestamp()) * 1000)::bigint"
    return ("SELECT c.decision, c.attempt, c.outcome::text, " + ms + ", c.fence" +
            (" FROM %s.idem_platform_claim(%%s, %%s, %%s::interval) AS c" if tenant_id is None else
             " FROM %s.idem_claim(%%s, %%s, %%s, %%s::interval) AS c") % schema)


def _fenced_sql(schema, tenant_id, failure, fence):
    """The fenced completion: by the claim's fence (idem_complete_fenced), or
    by its attempt (idem_complete(..., attempt), for callers that kept only
    the attempt: a row purged and claimed again is attempt 1 again)."""
    if fence is not None:
        if tenant_id is None:
            return ("SELECT %s.idem_platform_fail_fenced(%%s, %%s, %%s::jsonb, %%s, %%s::interval)"
                    if failure else
                    "SELECT %s.idem_platform_complete_fenced(%%s, %%s, %%s::jsonb, %%s::interval)") % schema
        return ("SELECT %s.idem_fail_fenced(%%s, %%s, %%s, %%s::jsonb, %%s, %%s::interval)" if failure
                else "SELECT %s.idem_complete_fenced(%%s, %%s, %%s, %%s::jsonb, %%s::interval)") % schema
    if tenant_id is None:
        return ("SELECT %s.idem_platform_fail(%%s, %%s::jsonb, %%s, %%s::interval, %%s)" if failure
                else "SELECT %s.idem_platform_complete(%%s, %%s::jsonb, %%s::interval, %%s)") % schema
    return ("SELECT %s.idem_fail(%%s, %%s, %%s::jsonb, %%s, %%s::interval, %%s)" if failure
            else "SELECT %s.idem_complete(%%s, %%s, %%s::jsonb, %%s::interval, %%s)") % schema


def fenced_params(tenant_id, key, text, failure, retention, attempt, fence):
    p = [key] if tenant_id is None else [tenant_id, key]
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
    run_class = Lease

    def __init__(self, runner, conn, tenant_id, scope, run_id, request, lease_ms=None,
                 delivery_count=0):
        super().__init__(runner, conn, tenant_id, scope, run_id, request,
                         delivery_count=delivery_count)
        lease_ms = runner.lease_ms if lease_ms is None else int(lease_ms)
        if not (0 < lease_ms <= 2147483647):
            raise IdemError("argument", "lease_ms must be positive")
        self.lease_ms = lease_ms
        self.run.lease_ms = lease_ms

    # step 3b: the claim, committed alone, with its lease given explicitly
    def _claim(self):
        run, conn = self.run, self.conn
        if _session_ended(conn):
            raise IdemError("connection", "connection lost before the claim was sent "
                            "(nothing committed)")
        try:
            with conn.pipeline():
                if conn.autocommit:
                    conn.execute("BEGIN")
                self._set_max_attempts()
                cur = conn.execute(_claim_sql(self.st.schema, run.tenant_id),
                                   self._key_params() +
                                   [run.fingerprint, "%d milliseconds" % self.lease_ms])
                conn.execute("COMMIT")
        except psycopg.Error as e:
            if self._broken():
                # the claim may have committed: the key then answers busy
                # until its lease ends, and a redelivery takes it over
                raise IdemError("connection", "connection lost while the lease-mode claim "
                                "was in flight (if it committed, the key is busy until its "
                                "lease ends): %s" % str(e).strip()) from e
            self._pg_error(e, "idem_claim")
        decision, attempt, outcome, ms, fence = cur.fetchone()
        if decision == "claimed":
            run.claimed = True
            run.attempt = attempt
            run.fence = fence
            return
        self._claim_decided(decision, attempt, outcome, ms)

    def __exit__(self, et, ev, tb):
        run = self.run
        if not run.claimed:
            return super().__exit__(et, ev, tb)
        try:
            return self._settle(et, ev)
        finally:
            if self.own_marker and run.status in (None, FAILED_RETRYABLE):
                self._drop_marker()

    def _settle(self, et, ev):
        run, conn = self.run, self.conn
        if et is not None and not issubclass(et, Exception):
            return False        # KeyboardInterrupt...: the lease ends it
        failure, suppress = _failure_of(run, et, ev)
        if et is None and run.deferred:
            return False        # completed later, by its fence
        ts = conn.info.transaction_status
        if ts == TransactionStatus.INERROR:
            conn.rollback()
            if et is None:
                raise IdemError("handler", "the block left the connection's transaction in "
                                "error: rolled back, nothing recorded (the lease ends it)")
        if failure is None:
            try:
                text = _outcome_text({} if run.outcome is None else run.outcome, "the outcome")
            except IdemError:
                if ts == TransactionStatus.INTRANS:
                    conn.rollback()
                raise
        else:
            try:
                text = _outcome_text(failure[0], "the failure detail")
            except IdemError:
                if et is None or suppress:
                    raise
                text = _outcome_text({"error": et.__name__}, "the failure detail")
        if _session_ended(conn):
            raise IdemError("connection", "connection lost before the completion was sent "
                            "(nothing recorded; the lease ends it)")
        # one round trip: the fenced completion and COMMIT (with whatever the
        # block left open on this connection)
        try:
            with conn.pipeline():
                if conn.info.transaction_status == TransactionStatus.IDLE and conn.autocommit:
                    conn.execute("BEGIN")
                conn.execute(_fenced_sql(self.st.schema, run.tenant_id, failure, run.fence),
                             fenced_params(run.tenant_id, run.key, text, failure,
                                           self.r.retention, run.attempt, run.fence))
                conn.execute("COMMIT")
        except psycopg.Error as e:
            if self._broken():
                raise CommitUnknown("connection lost while the completion's COMMIT was in "
                                    "flight: redeliver, the ledger decides (%s)"
                                    % str(e).strip()) from e
            raise _completion_error(conn, e) from e
        run.source = SOURCE_HANDLER
        run.outcome = json.loads(text)
        if failure is None:
            run.status = APPLIED
        else:
            run.status = FAILED_RETRYABLE if failure[1] else FAILED_PERMANENT
        if run.status != FAILED_RETRYABLE:
            self.own_marker = False     # left for the worker's copy
        return suppress


def _completion_error(conn, e):
    """A refused completion: roll back, and say why."""
    try:
        conn.rollback()
    except psycopg.Error:
        pass
    state = getattr(e.diag, "sqlstate", None)
    if state == "55000":
        return LeaseLost(str(e).strip())
    return IdemError("server", "completing the lease: %s" % str(e).strip(), state)


def settle(runner, conn, tenant_id, scope, run_id, attempt, fence, outcome=None, failure=None):
    """runner.complete / runner.fail: the fenced statement in the
    connection's transaction (committed by itself on an autocommit
    connection; else the caller commits)."""
    if (attempt is None) == (fence is None):
        raise IdemError("argument", "give the claim's fence (or, for callers that kept "
                        "only its attempt, attempt), not both")
    st = runner._state(conn)
    if tenant_id is not None:
        tenant_id = int(tenant_id)
    try:
        key = idem_key(scope, run_id)
    except (TypeError, ValueError) as e:
        raise IdemError("argument", str(e)) from None
    if failure is None:
        text = _outcome_text({} if outcome is None else outcome, "the outcome")
    else:
        text = _outcome_text(failure[0], "the failure detail")
    try:
        conn.execute(_fenced_sql(st.schema, tenant_id, failure, fence),
                     fenced_params(tenant_id, key, text, failure, runner.retention, attempt,
                                   fence))
    except psycopg.Error as e:
        if conn.broken or conn.closed:
            if conn.autocommit:
                raise CommitUnknown("connection lost while the completion was in flight: "
                                    "look the key up (%s)" % str(e).strip()) from e
            raise IdemError("connection", "connection lost (the transaction with the "
                            "completion did not commit): %s" % str(e).strip()) from e
        state = getattr(e.diag, "sqlstate", None)
        if state == "55000":
            raise LeaseLost(str(e).strip()) from e
        raise IdemError("server", str(e).strip(), state) from e
