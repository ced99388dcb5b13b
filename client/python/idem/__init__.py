"""idem for Python: exactly-once effects over at-least-once delivery.

The Valkey gate and replay cache in front, PostgreSQL with the idem
extension as the truth, the handler's effect in the application's own
transaction on its own psycopg 3 connection.  See README.md.  The
asyncio runner, for psycopg.AsyncConnection and redis.asyncio, is
idem.aio.AsyncRunner.
"""
from .canonical import RequestError, canonical_json, fingerprint, idem_key
from .errors import CommitUnknown, IdemError, ValkeyClusterNotSupported
from .result import (APPLIED, BUSY, FAILED_PERMANENT, FAILED_RETRYABLE, MISMATCH,
                     REPLAYED, SOURCE_HANDLER, SOURCE_POSTGRES, SOURCE_VALKEY, Busy, Failure,
                     Mismatch, NotApplied, PermanentFailure, RetryableFailure, Run)
from .runner import Runner
from .lease import Lease, LeaseLost
from .batch import Batch
from .check import Check
from .consume import AsyncConsumer, Consumer

__version__ = "0.4.0"

__all__ = [
    "Runner", "Run", "Lease", "Batch", "Check", "Consumer", "AsyncConsumer", "LeaseLost", "IdemError", "CommitUnknown", "ValkeyClusterNotSupported",
    "NotApplied", "Busy", "Mismatch", "Failure", "PermanentFailure",
    "RetryableFailure", "RequestError", "canonical_json", "fingerprint",
    "idem_key", "APPLIED", "REPLAYED", "BUSY", "MISMATCH", "FAILED_PERMANENT",
    "FAILED_RETRYABLE", "SOURCE_HANDLER", "SOURCE_VALKEY", "SOURCE_POSTGRES",
]
