"""What a runner trusts of Valkey, per PostgreSQL session: the keyspace,
secrets and history epoch owner it learnt there (Runner._state learns
them), what a value read from Valkey is worth (_ConnState.judge, for the
gate and a batch's cached read alike: the C client's trust.c), and the
wall clock a value's deadline is read against."""
import time
from typing import Any, Dict, List, Optional, Tuple

from . import cache, resp


def _wall_ms() -> int:
    return int(time.time() * 1000)


class _ConnState:
    """What a runner knows about one PostgreSQL session."""

    def __init__(self, backend_pid: int) -> None:
        self.backend_pid = backend_pid
        self.schema = ""             # quoted; "" until learnt
        self.keyspace: Optional[str] = None    # None: no cache on this connection
        self.secrets: Dict[int, bytes] = {}
        self.current: Optional[int] = None
        # made from the above once, for every gate of the session (run.py):
        # each secret's cache.Signer by key id, each tenant's key prefix
        # (cache.key_prefix), the gate's RESP with the runner's lease
        self.signers: Dict[int, cache.Signer] = {}
        self.prefixes: Dict[Optional[int], bytes] = {}
        self.gate: Optional[resp.Gate] = None
        self.learnt: Optional[float] = None    # monotonic time of the last learning
        self.refresh_wanted = False
        # the history epoch's owner key and the token it holds while the
        # server owns the epoch: read with every lookup, a value counts only
        # if it still holds the token
        self.owner_key: Optional[bytes] = None
        self.owner_token: Optional[bytes] = None
        self.owner_suspect = False  # it did not: no cache until learnt
        self.owner_relearnt = False  # learnt at once after a mismatch, and
        # no check passed since: the next learning waits the second

    def start_learning(self) -> None:
        """A learning begins (Runner._learn): it is the last one from now."""
        self.learnt = time.monotonic()
        self.refresh_wanted = False
        self.owner_relearnt = self.owner_suspect
        self.owner_suspect = False

    def forget(self, retry_soon: bool) -> None:
        """No cache on this session (until learnt again, in a second if
        retry_soon)."""
        self.keyspace, self.secrets, self.current = None, {}, None
        self.signers, self.prefixes, self.gate = {}, {}, None
        self.refresh_wanted = retry_soon

    def adopt(self, keyspace: Optional[str], rows: List[Tuple[Any, ...]]) -> None:
        """What idem_cache_keyspace() and idem_cache_secrets() answered:
        the secrets that are well formed, the current one's owner key and
        token, usable only with the keyspace of the same epoch."""
        secrets: Dict[int, bytes] = {}
        current: Optional[int] = None
        owner: Tuple[Optional[str], Optional[str]] = (None, None)
        for key_id, secret, is_current, owner_key, owner_token in rows:
            if key_id is None or secret is None or not (0 < key_id <= cache.KEY_ID_MAX) \
                    or len(secret) != cache.MAC_LEN:
                continue
            secrets[key_id] = bytes(secret)
            if is_current:
                current, owner = key_id, (owner_key, owner_token)
        if keyspace is None or current is None:
            self.forget(retry_soon=False)
            return
        if owner[0] is None or owner[1] is None or not cache.owner_ok(keyspace, owner[0], owner[1]):
            # not taken over yet, or the keyspace is of another epoch: soon
            self.forget(retry_soon=True)
            return
        self.keyspace, self.secrets, self.current = keyspace, secrets, current
        self.owner_key, self.owner_token = owner[0].encode("ascii"), owner[1].encode("ascii")
        self.signers = {k: cache.signer_of(v) for k, v in secrets.items()}
        self.prefixes, self.gate = {}, None

    def key_prefix(self, tenant_id: Optional[int]) -> bytes:
        """cache.key_prefix in this session's keyspace (learnt), kept."""
        p = self.prefixes.get(tenant_id)
        if p is None:
            assert self.keyspace is not None
            p = cache.key_prefix(self.keyspace, tenant_id)
            if len(self.prefixes) >= 1024:
                self.prefixes.clear()
            self.prefixes[tenant_id] = p
        return p

    def gate_of(self, lease_ms: int) -> resp.Gate:
        """The gate's RESP (resp.Gate) with lease_ms and the owner key, kept."""
        g = self.gate
        if g is None or g.lease_ms != lease_ms:
            g = self.gate = resp.Gate(lease_ms, self.owner_key or b"")
        return g

    def judge(self, owner: Any, reads: List[Tuple[bytes, Any]], lease_ms: int,
              stats: Dict[str, int]) -> Tuple[bool, List[Optional[cache.Entry]]]:
        """What one round trip read from Valkey is worth.  owner: the reply
        to the GET of the epoch's owner key sent with it; reads: [(cache
        key, value)], a value that is not bytes (absent, an error reply,
        our own marker) having nothing to judge.  Returns (held, entries):
        whether the owner key held the server's token, and for each read
        its cache.Entry when trusted and current, else None (PostgreSQL
        decides).

        The owner key did not hold the token: nothing read is trusted and
        the runner learns again (Runner._state); if the key held another
        value (a newer epoch retired it, another server took it over), no
        cache until then; if nothing (Valkey lost it and the server's
        worker sets it again, or its node did not answer), later lookups
        check it as usual.  It did: a learning made at once after a
        mismatch is spent (owner_relearnt), so the next mismatch is learnt
        at once too.

        A value is trusted when it parses, its key id is known (an unknown
        one: learn again, perhaps rotated) and its MAC verifies; else it is
        counted in stats["cache_rejected"].  Current: a terminal value
        before its deadline, a marker before its MACed deadline and no
        further than our lease_ms + 1 s of skew (a farther one is counted
        too); Valkey's TTL is never consulted."""
        if not self._held(owner, stats):
            return False, [None] * len(reads)
        now = _wall_ms()
        return True, [self._check(key, value, lease_ms, now, stats) for key, value in reads]

    def judge_one(self, owner: Any, key: bytes, value: Any, lease_ms: int,
                  stats: Dict[str, int]) -> Tuple[bool, Optional[cache.Entry]]:
        """judge for one read (the gate's): (held, entry)."""
        if not self._held(owner, stats):
            return False, None
        return True, self._check(key, value, lease_ms, _wall_ms(), stats)

    def _held(self, owner: Any, stats: Dict[str, int]) -> bool:
        """Did the owner key hold the server's token?  (judge)"""
        if owner != self.owner_token:
            self.refresh_wanted = True
            if isinstance(owner, bytes):
                self.owner_suspect = True
            stats["owner_mismatches"] += 1
            return False
        self.owner_relearnt = False
        return True

    def _check(self, key: bytes, value: Any, lease_ms: int, now: int,
               stats: Dict[str, int]) -> Optional[cache.Entry]:
        if not isinstance(value, bytes):
            return None
        e = cache.parse(value)
        if e is not None and e.key_id not in self.secrets:
            self.refresh_wanted = True      # perhaps rotated: re-learn
            e = None
        if e is None or not cache.verify(self.secrets, key, value, e):
            stats["cache_rejected"] += 1
            return None
        if e.kind == cache.MARKER and e.expires_ms > now + lease_ms + 1000:
            stats["cache_rejected"] += 1    # never busy past a lease: ours bounds it
            return None
        return e if e.expires_ms > now else None
