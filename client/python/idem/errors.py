"""What the package raises: the IdemError family (the run could not be
decided: redeliver), the decorator's answers other than an outcome
(NotApplied: Busy, Mismatch), and Failure, which a handler raises to
record a failure.  A leaf: every form (runner.py, apply.py, lease.py,
batch.py) raises these, and nothing here imports another module of the
package."""
import json


class IdemError(Exception):
    """The run could not be decided; redeliver.  ``code`` says why:
    ``request`` (not JSON jsonb accepts), ``outcome`` (not a JSON object of
    at most 4096 bytes: rolled back), ``connection`` (the PostgreSQL
    connection was lost before COMMIT was sent: nothing committed),
    ``server`` (an error from PostgreSQL, ``sqlstate``; rolled back),
    ``handler`` (the block left the transaction in error), ``handler_ended_tx``
    (the block committed or rolled back the runner's transaction), ``state``
    (the connection was not idle when the run began)."""

    def __init__(self, code, message, sqlstate=None):
        super().__init__(message)
        self.code = code
        self.sqlstate = sqlstate


class CommitUnknown(IdemError):
    """The connection was lost after COMMIT was sent: the effect and its key
    committed together or not at all, and which is unknown.  Redeliver: the
    ledger decides (a replay if it committed)."""

    def __init__(self, message):
        super().__init__("commit_unknown", message)


class ValkeyClusterNotSupported(IdemError):
    def __init__(self, message):
        super().__init__("valkey_cluster", message)


# What a decorated function raises when it did not return an outcome.
class NotApplied(Exception):
    """Base of the decorator's answers other than an outcome; ``result``
    is the Run."""

    def __init__(self, result, message):
        super().__init__(message)
        self.result = result


class Busy(NotApplied):
    """Another delivery holds the key: retry after ``retry_after`` seconds."""

    @property
    def retry_after(self):
        return self.result.retry_after


class Mismatch(NotApplied):
    """The key was used with another request."""


class Failure(Exception):
    """Raise from a handler to record a failure with ``detail`` (a JSON
    object); the decorator raises its subclasses for recorded failures."""
    retryable = False

    def __init__(self, detail=None, result=None):
        super().__init__(json.dumps(detail) if detail is not None else "")
        self.detail = {} if detail is None else detail
        self.result = result


class PermanentFailure(Failure):
    """Recorded as failed_permanent: replayed to every later delivery."""
    retryable = False


class RetryableFailure(Failure):
    """Recorded as failed_retryable: the next delivery runs attempt + 1."""
    retryable = True
