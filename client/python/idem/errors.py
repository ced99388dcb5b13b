"""The IdemError family: the run could not be decided.  Each has
``retryable``: whether redelivering the message may succeed.  A leaf:
every module of the package raises these, and nothing here imports
another.  The decorator's answers other than an outcome (Busy, Mismatch)
and Failure, which carry a Run, are result.py's."""
from typing import Optional

# Codes whose cause a redelivery does not change: a bug, a bad message or
# the setup (dead-letter or alert, do not requeue for ever).
_PERMANENT_CODES = frozenset(("request", "argument", "outcome", "handler", "handler_ended_tx",
                              "state", "protocol", "valkey_cluster", "not_installed"))
# SQLSTATE classes of a server error that a redelivery meets again:
# feature not supported, data, integrity, authorization, no such database
# or schema, syntax or access rule, a program limit, PL/pgSQL's RAISE.
_PERMANENT_CLASSES = ("0A", "22", "23", "28", "3D", "3F", "42", "54", "P0")


class IdemError(Exception):
    """The run could not be decided.  ``code`` says why, ``sqlstate`` is
    PostgreSQL's (code ``server``), ``retryable`` whether to redeliver:

    ``connection`` (lost before COMMIT was sent: nothing committed),
    ``commit_unknown`` (CommitUnknown), ``lease_lost`` (LeaseLost) and
    ``server`` errors of a transient class are retryable; ``request`` (not
    JSON jsonb accepts), ``argument`` (a missing or malformed argument, an
    id among them), ``outcome`` (not a JSON object of at most 4096 bytes:
    rolled back), ``handler`` (the block left the transaction in error),
    ``handler_ended_tx`` (the block committed or rolled back the runner's
    transaction), ``state`` (the connection was not idle, or the block
    wrote on a run that was not claimed), ``not_installed`` (no idem
    extension in the database), ``valkey_cluster`` and ``protocol`` are
    not, nor ``server`` errors of classes 0A, 22, 23, 28, 3D, 3F, 42, 54
    and P0."""

    def __init__(self, code: str, message: str, sqlstate: Optional[str] = None) -> None:
        super().__init__(message)
        self.code = code
        self.sqlstate = sqlstate

    @property
    def retryable(self) -> bool:
        """Whether redelivering the message may succeed."""
        if self.code in _PERMANENT_CODES:
            return False
        if self.code == "server" and self.sqlstate is not None:
            return self.sqlstate[:2] not in _PERMANENT_CLASSES
        return True


class CommitUnknown(IdemError):
    """The connection was lost after COMMIT was sent: the effect and its key
    committed together or not at all, and which is unknown.  Redeliver: the
    ledger decides (a replay if it committed)."""

    def __init__(self, message: str) -> None:
        super().__init__("commit_unknown", message)


class ValkeyClusterNotSupported(IdemError):
    """A plain redis.Redis client of a Valkey Cluster node."""

    def __init__(self, message: str) -> None:
        super().__init__("valkey_cluster", message)
