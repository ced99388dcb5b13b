"""A run's result as its caller receives it: the statuses and sources (the
C client's idem_status_name), the Run, the decorator's answers other than
an outcome (NotApplied: Busy, Mismatch; PermanentFailure and
RetryableFailure) and Failure, which a handler raises, and what a block's
end records (its outcome as jsonb text, or its failure).  A leaf under
the forms: it knows the request and outcome rules (canonical.py,
cache.py's OUTCOME_MAX) and talks to no server."""
import hashlib
import json
from typing import Any, List, Optional, Tuple, Type, TypeVar

from . import cache
from .canonical import RequestError, canonical_json, idem_key
from .emit import check as emit_check, message_id as emit_message_id
from .errors import IdemError

R = TypeVar("R", bound="Run")
# A recorded failure: (detail, retryable).
FailureSpec = Tuple[Any, bool]

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
    # until decided (class defaults: a run sets only what it learns)
    status: Optional[str] = None
    source: Optional[str] = None
    attempt: Optional[int] = None
    outcome: Any = None
    retry_after: Optional[float] = None     # seconds to wait before redelivering (busy)
    valkey_used = False
    claimed = False
    first: Optional[List[Any]] = None       # first_sql's rows, once claimed
    first_error: Optional[BaseException] = None  # or its error (the transaction is in error)
    error: Optional[BaseException] = None   # the exception a batch step recorded
    _failure: Optional[FailureSpec] = None  # (detail, retryable) from fail()

    def __init__(self, tenant_id: Optional[int], scope: str, run_id: str, request_text: str,
                 key: bytes, fp: bytes) -> None:
        self.tenant_id = tenant_id
        self.scope = scope
        self.run_id = run_id
        self.request = request_text         # canonical JSON text
        self.key = key
        self.fingerprint = fp
        self._emits: List[Tuple[bytes, str, str]] = []  # emit(): (key, stream, message text)

    def _busy_for(self, ms: Optional[int]) -> None:
        """Busy for ms more milliseconds (at least one)."""
        self.retry_after = max(1, ms or 1) / 1000.0

    @property
    def done(self) -> bool:
        """applied or replayed: the effect is in the ledger; ack."""
        return self.status in (APPLIED, REPLAYED)

    def fail(self, detail: Any = None, retryable: bool = False) -> None:
        """Inside the block: record a failure instead of completing (the
        block's statements are rolled back to the savepoint)."""
        if not self.claimed:
            raise IdemError("state", "fail() on a run that was not claimed")
        self._failure = ({} if detail is None else detail, bool(retryable))

    #: Why this form cannot emit (lease mode), or None.
    emit_refused: Optional[str] = None

    def emit(self, stream: str, message: Any) -> str:
        """Inside the block: an outgoing message for the Valkey stream
        ``stream`` (``message``: JSON text, or a value json.dumps takes),
        recorded by the extension's idem_emit with the completion, so it
        leaves when, and only when, the effect commits (a failure emits
        nothing).  Returns the id it gets, ``<key in hex>-<n>`` (n: 1, 2,
        ... this run's emits in order; do not also call idem_emit in SQL in
        the same run).  The server's worker publishes it as ``XADD stream *
        id <id> body <message>``, at least once, the same id on a repeat."""
        if self.emit_refused is not None:
            raise IdemError("state", self.emit_refused)
        if not self.claimed:
            raise IdemError("state", "emit() on a run that was not claimed")
        stream, text = emit_check(stream, message)
        self._emits.append((self.key, stream, text))
        return emit_message_id(self.key, len(self._emits))

    def __repr__(self) -> str:
        return "Run(status=%r, source=%r, attempt=%r, outcome=%r, retry_after=%r)" % (
            self.status, self.source, self.attempt, self.outcome, self.retry_after)


# What a decorated function raises when it did not return an outcome, and
# what a handler raises to record a failure.
class NotApplied(Exception):
    """Base of the decorator's answers other than an outcome; ``result``
    is the Run."""
    retryable = False

    def __init__(self, result: Run, message: str) -> None:
        super().__init__(message)
        self.result = result


class Busy(NotApplied):
    """Another delivery holds the key: retry after ``retry_after`` seconds."""
    retryable = True

    @property
    def retry_after(self) -> Optional[float]:
        return self.result.retry_after


class Mismatch(NotApplied):
    """The key was used with another request."""
    retryable = False


class Failure(Exception):
    """Raise from a handler to record a failure with ``detail`` (a JSON
    object); the decorator raises its subclasses for recorded failures."""
    retryable = False

    def __init__(self, detail: Any = None, result: Optional[Run] = None) -> None:
        super().__init__(json.dumps(detail) if detail is not None else "")
        self.detail = {} if detail is None else detail
        self.result = result


class PermanentFailure(Failure):
    """Recorded as failed_permanent: replayed to every later delivery."""
    retryable = False


class RetryableFailure(Failure):
    """Recorded as failed_retryable: the next delivery runs attempt + 1."""
    retryable = True


def _make_run(cls: Type[R], tenant_id: Any, scope: str, run_id: str, request: Any) -> R:
    """A Run (or subclass) for one delivery: its key, canonical request and
    fingerprint."""
    if tenant_id is not None and type(tenant_id) is not int:
        try:
            tenant_id = int(tenant_id)
        except (TypeError, ValueError):
            raise IdemError("argument", "the tenant must be an int (None: the platform "
                            "ledger), not %r" % (tenant_id,)) from None
    try:
        text = canonical_json(request)
    except RequestError as e:
        raise IdemError("request", "request: %s" % e) from None
    try:
        key = idem_key(scope, run_id)
    except (TypeError, ValueError) as e:
        raise IdemError("argument", str(e)) from None
    return cls(tenant_id, scope, run_id, text, key, hashlib.sha256(text.encode("utf-8")).digest())


_scan = json.JSONDecoder().scan_once     # type: ignore[attr-defined]


def _json_object(text: str) -> Any:
    """json.loads(text), for the outcome text of a value read from Valkey
    (jsonb's, no space around it): the decoder's scanner straight, and
    json.loads for anything else (its answer or its error)."""
    try:
        value, end = _scan(text, 0)
    except StopIteration:
        return json.loads(text)
    return value if end == len(text) else json.loads(text)


def _result_from_cache(run: Run, e: cache.Entry) -> bool:
    """run replayed (or failed_permanent) from e, a trusted terminal value
    read from Valkey (the C client's idemc_result_from_cache).  False, run
    untouched, if its outcome is not JSON."""
    try:
        outcome = _json_object((e.outcome or b"").decode("utf-8"))
    except ValueError:
        return False
    run.outcome = outcome
    run.status = REPLAYED if e.kind == cache.COMPLETED else FAILED_PERMANENT
    run.source = SOURCE_VALKEY
    run.attempt = e.attempt
    return True


def _failure_of(run: Any, et: Optional[Type[BaseException]],
                ev: Optional[BaseException]) -> Tuple[Optional[FailureSpec], bool]:
    """What a block that ended with exception type et (None: none) records:
    (failure, suppress), failure (detail, retryable) or None (complete).
    A Failure raised in the block is recorded and suppressed (as
    run.fail(detail)); any other exception is recorded as retryable and
    propagates."""
    if isinstance(ev, Failure):
        return (ev.detail, ev.retryable), True
    if et is not None:
        return ({"error": et.__name__, "message": str(ev)[:1000]}, True), False
    return run._failure, False


def _stored(value: Any, what: str, retryable: bool) -> Tuple[Optional[FailureSpec], str]:
    """(None, value's jsonb text) when value can be stored as an outcome;
    else (the failure the attempt records instead, its text), as
    idem_apply does: (detail, retryable) with detail {"sqlstate",
    "message"}, 22023 (not a JSON object, NUL in a text: permanent) or
    54000 (too long: retryable unless the handler's failure was not)."""
    try:
        text: Optional[str] = canonical_json(value)
    except RequestError:
        text = None
    if text is not None and text.startswith("{"):
        n = len(text.encode("utf-8"))
        if n <= cache.OUTCOME_MAX:
            return None, text
        bad: FailureSpec = ({"sqlstate": "54000",
                             "message": "%s is %d bytes as JSON text, over the limit of %d bytes"
                             % (what, n, cache.OUTCOME_MAX)}, retryable)
    else:
        bad = ({"sqlstate": "22023", "message": "%s must be a JSON object" % what}, False)
    return bad, canonical_json(bad[0])


def _recorded(outcome: Any, failure: Optional[FailureSpec]) -> Tuple[Optional[FailureSpec], str]:
    """What completing with outcome (failure None) or failing with failure
    records: (failure, text).  An outcome or failure detail that cannot
    be stored fails the attempt instead (_stored), so that
    idem.max_attempts ends a handler that always returns one; the failure
    given is returned as it is when it can be stored."""
    if failure is None:
        return _stored({} if outcome is None else outcome, "handler outcome", True)
    bad, text = _stored(failure[0], "failure detail", failure[1])
    return (failure if bad is None else bad), text


def _recorded_ending(run: Run, failure: Optional[FailureSpec], et: Optional[Type[BaseException]],
                     suppress: bool) -> Tuple[Optional[FailureSpec], str]:
    """What the end of a runner's block records: (failure, text), as
    _recorded; a propagating exception's detail that cannot be stored
    falls back to its type name."""
    recorded, text = _recorded(run.outcome, failure)
    if failure is not None and recorded is not failure and et is not None and not suppress:
        return failure, _outcome_text({"error": et.__name__}, "the failure detail")
    return recorded, text


def _outcome_text(outcome: Any, what: str) -> str:
    try:
        text = canonical_json(outcome)
    except RequestError as e:
        raise IdemError("outcome", "%s is not valid JSON: %s" % (what, e)) from None
    if not text.startswith("{") or len(text.encode("utf-8")) > cache.OUTCOME_MAX:
        raise IdemError("outcome", "%s must be a JSON object of at most %d bytes as jsonb text"
                        % (what, cache.OUTCOME_MAX))
    return text
