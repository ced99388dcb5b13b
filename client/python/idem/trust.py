"""What a runner trusts of Valkey, per PostgreSQL session: the keyspace,
secrets and history epoch owner it learnt there (Runner._state learns
them; the gate and a batch's cached read check each value against them),
and the wall clock a value's deadline is read against."""
import time


def _wall_ms():
    return int(time.time() * 1000)


class _ConnState:
    """What a runner knows about one PostgreSQL session."""

    def __init__(self, backend_pid):
        self.backend_pid = backend_pid
        self.schema = None
        self.keyspace = None        # None: no cache on this connection
        self.secrets = {}
        self.current = None
        self.learnt = None          # monotonic time of the last learning
        self.refresh_wanted = False
        # the history epoch's owner key and the token it holds while the
        # server owns the epoch: read with every lookup, a value counts only
        # if it still holds the token
        self.owner_key = None
        self.owner_token = None
        self.owner_suspect = False  # it did not: no cache until learnt
        self.owner_relearnt = False  # learnt at once after a mismatch, and
        # no check passed since: the next learning waits the second

