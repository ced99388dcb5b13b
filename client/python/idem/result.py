"""A run's result as its caller receives it: the statuses and sources (the
C client's idem_status_name), the Run, and what a block's end records (its
outcome as jsonb text, or its failure).  A leaf under the forms: it knows
the request and outcome rules (canonical.py, cache.py's OUTCOME_MAX) and
talks to no server."""
import hashlib
import json

from . import cache
from .canonical import RequestError, canonical_json, idem_key
from .errors import Failure, IdemError

# Statuses (the C client's idem_status_name) and sources.
APPLIED = "applied"
REPLAYED = "replayed"
BUSY = "busy"
MISMATCH = "mismatch"
FAILED_PERMANENT = "failed_permanent"
FAILED_RETRYABLE = "failed_retryable"
SOURCE_HANDLER = "handler"
SOURCE_VALKEY = "valkey"
SOURCE_POSTGRES = "postgres"


class Run:
    """One run: what the block sees (``claimed``, ``attempt``, ``request``)
    and, once decided, the result (``status``, ``source``, ``outcome``,
    ``retry_after``)."""

    def __init__(self, tenant_id, scope, run_id, request_text, key, fp):
        self.tenant_id = tenant_id
        self.scope = scope
        self.run_id = run_id
        self.request = request_text         # canonical JSON text
        self.key = key
        self.fingerprint = fp
        self.status = None
        self.source = None
        self.attempt = None
        self.outcome = None
        self.retry_after_ms = None
        self.valkey_used = False
        self.claimed = False
        self.first = None                   # first_sql's rows, once claimed
        self.first_error = None             # or its error (the transaction is in error)
        self.error = None                   # the exception a batch step recorded
        self._failure = None                # (detail, retryable) from fail()

    @property
    def retry_after(self):
        """Seconds to wait before redelivering (busy), else None."""
        return None if self.retry_after_ms is None else self.retry_after_ms / 1000.0

    @property
    def done(self):
        """applied or replayed: the effect is in the ledger; ack."""
        return self.status in (APPLIED, REPLAYED)

    def fail(self, detail=None, retryable=False):
        """Inside the block: record a failure instead of completing (the
        block's statements are rolled back to the savepoint)."""
        if not self.claimed:
            raise IdemError("state", "fail() on a run that was not claimed")
        self._failure = ({} if detail is None else detail, bool(retryable))

    def __repr__(self):
        return "Run(status=%r, source=%r, attempt=%r, outcome=%r, retry_after_ms=%r)" % (
            self.status, self.source, self.attempt, self.outcome, self.retry_after_ms)


def _make_run(cls, tenant_id, scope, run_id, request):
    """A Run (or subclass) for one delivery: its key, canonical request and
    fingerprint."""
    if tenant_id is not None:
        tenant_id = int(tenant_id)
    try:
        text = canonical_json(request)
    except RequestError as e:
        raise IdemError("request", "request: %s" % e) from None
    try:
        key = idem_key(scope, run_id)
    except (TypeError, ValueError) as e:
        raise IdemError("argument", str(e)) from None
    return cls(tenant_id, scope, run_id, text, key, hashlib.sha256(text.encode("utf-8")).digest())


def _result_from_cache(run, e):
    """run replayed (or failed_permanent) from e, a trusted terminal value
    read from Valkey (the C client's idemc_result_from_cache).  False, run
    untouched, if its outcome is not JSON."""
    try:
        outcome = json.loads(e.outcome.decode("utf-8"))
    except ValueError:
        return False
    run.outcome = outcome
    run.status = REPLAYED if e.kind == cache.COMPLETED else FAILED_PERMANENT
    run.source = SOURCE_VALKEY
    run.attempt = e.attempt
    return True


def _failure_of(run, et, ev):
    """What a block that ended with exception type et (None: none) records:
    (failure, suppress), failure (detail, retryable) or None (complete).
    A Failure raised in the block is recorded and suppressed (as
    run.fail(detail)); any other exception is recorded as retryable and
    propagates."""
    if et is not None and issubclass(et, Failure):
        return (ev.detail, ev.retryable), True
    if et is not None:
        return ({"error": et.__name__, "message": str(ev)[:1000]}, True), False
    return run._failure, False


def _outcome_text(outcome, what):
    try:
        text = canonical_json(outcome)
    except RequestError as e:
        raise IdemError("outcome", "%s is not valid JSON: %s" % (what, e)) from None
    if not text.startswith("{") or len(text.encode("utf-8")) > cache.OUTCOME_MAX:
        raise IdemError("outcome", "%s must be a JSON object of at most %d bytes as jsonb text"
                        % (what, cache.OUTCOME_MAX))
    return text
