"""What a runner says about its Valkey, and when it gives up on one (the C
client's health.c).

A Valkey that does not answer, refuses AUTH (WRONGPASS) or wants a password
(NOAUTH) makes the runner rest: PostgreSQL alone decides for
``valkey_retry``.  An epoch owner key that has not held the server's
token for OWNER_GRACE_S in a row, the node answering, means this is not the
Valkey the server's worker writes to (or that worker cannot reach it): the
runner rests as for a Valkey that is down.  Each problem is counted in
``runner.stats`` and told, with its reason, to the ``idem`` logger (and the
runner's ``notice`` callback): at once, then at most once every
NOTICE_REPEAT_S while it lasts, and once when Valkey answers again."""
import logging
import threading
import time
from typing import Any, Callable, Dict, Optional

logger = logging.getLogger("idem")

# a problem that lasts is told again at most this often
NOTICE_REPEAT_S = 60.0
# longer than the server's worker takes to set its owner key again after
# Valkey lost it (it checks every second)
OWNER_GRACE_S = 3.0

DOWN = "down"
AUTH = "auth"
REPLY = "reply"
NOT_SERVERS = "not_servers"


def classify(e: BaseException) -> str:
    """What a Valkey exception says: AUTH (refused or wanted), DOWN (no
    connection, no answer in time), or REPLY (an error reply: WRONGTYPE, a
    server older than 7.0 refusing SET NX GET)."""
    import redis
    text = str(e)
    if isinstance(e, redis.exceptions.AuthenticationError) or \
            any(w in text for w in ("WRONGPASS", "NOAUTH", "invalid password",
                                    "invalid username-password",
                                    "without any password configured")):
        return AUTH
    if isinstance(e, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                      redis.exceptions.RedisClusterException, redis.exceptions.ClusterError,
                      OSError)):
        return DOWN
    return REPLY


def describe(kind: str, e: BaseException) -> str:
    """The reason, with what to change."""
    import redis
    text = str(e).strip() or type(e).__name__
    if kind == AUTH and isinstance(e, redis.exceptions.AuthenticationError):
        return "%s (NOAUTH: it wants a password: give the client one)" % text
    if kind == AUTH:
        return "AUTH refused: %s (check the client's password)" % text
    if kind == DOWN:
        return "no answer: %s" % text
    return "an error reply: %s" % text


class Health:
    """One per runner; shared by its threads."""

    def __init__(self, runner: Any) -> None:
        self.r = runner
        self._lock = threading.Lock()
        self.said: Optional[str] = None         # the problem told, not yet over
        self.told_at: Dict[str, float] = {}
        self.untold: Dict[str, int] = {}
        self.owner_bad_since: Optional[float] = None
        self.owner_bad_last = 0.0

    def where(self) -> str:
        seed = getattr(self.r, "_seed", None)
        if seed is not None:
            return "Valkey at %s:%d" % seed
        try:
            kw = self.r.valkey.connection_pool.connection_kwargs
            return "Valkey at %s:%s" % (kw.get("host"), kw.get("port"))
        except AttributeError:
            return "Valkey"

    def _emit(self, level: int, message: str) -> None:
        self.r.stats["notices"] += 1
        logger.log(level, "%s", message)
        notice: Optional[Callable[[str], Any]] = self.r.notice
        if notice is not None:
            notice(message)

    def _tell(self, kind: str, why: str, rests: bool, sep: str = ": ") -> None:
        now = time.monotonic()
        with self._lock:
            at = self.told_at.get(kind)
            if at is not None and now - at < NOTICE_REPEAT_S:
                self.untold[kind] = self.untold.get(kind, 0) + 1
                return
            more = self.untold.get(kind, 0)
            self.told_at[kind] = now
            self.untold[kind] = 0
            if rests:
                self.said = kind
        tail = (": running on PostgreSQL only, Valkey is tried again in %g s"
                % (self.r.valkey_retry_ms / 1000.0)) if rests else ": PostgreSQL decides"
        if more:
            tail += " (%d more time%s since the last notice)" % (more, "" if more == 1 else "s")
        self._emit(logging.WARNING, "%s%s%s%s" % (self.where(), sep, why, tail))

    def cache_off(self, why: str) -> None:
        """The server gives this session no cache (a grant missing, not
        ready): told at most once a minute."""
        now = time.monotonic()
        with self._lock:
            at = self.told_at.get("cache")
            if at is not None and now - at < NOTICE_REPEAT_S:
                return
            self.told_at["cache"] = now
        self._emit(logging.WARNING, why)

    def failed(self, e: BaseException) -> None:
        """An exchange with Valkey failed with e: counted, told, and (down,
        AUTH) rested."""
        kind = classify(e)
        self.r.stats["valkey_errors"] += 1
        if kind == AUTH:
            self.r.stats["valkey_auth_failures"] += 1
        rests = kind in (DOWN, AUTH)
        if rests:
            self.r._rest_until = time.monotonic() + self.r.valkey_retry_ms / 1000.0
        self._tell(kind, describe(kind, e), rests)

    def answered(self) -> None:
        """Valkey answered: a connection problem told is over."""
        if self.said in (DOWN, AUTH):
            self._over()

    def _over(self) -> None:
        with self._lock:
            said, self.said = self.said, None
        if said is not None:
            self._emit(logging.INFO, "%s answers again%s: the runner uses the cache again" % (
                self.where(), " with the server's epoch owner token" if said == NOT_SERVERS else ""))

    def owner(self, held: bool, value: Any, owner_key: Any) -> None:
        """The owner check of a lookup: held, or the reply to the GET of the
        owner key (None: absent; bytes: another token; an exception: no
        answer, told as a failure)."""
        if held:
            self.owner_bad_since = None
            if self.said == NOT_SERVERS:
                self._over()
            return
        if isinstance(value, Exception):
            return
        now = time.monotonic()
        retry = self.r.valkey_retry_ms / 1000.0
        with self._lock:
            if self.owner_bad_since is None or now - self.owner_bad_last > OWNER_GRACE_S + retry:
                self.owner_bad_since = now
            self.owner_bad_last = now
            lasted = now - self.owner_bad_since
        if lasted < OWNER_GRACE_S:
            return
        self.r.stats["valkey_not_servers"] += 1
        self.r._rest_until = now + retry
        key = owner_key.decode("ascii", "replace") if isinstance(owner_key, bytes) else owner_key
        self._tell(NOT_SERVERS,
                   "is not the server's: its epoch owner key %s has %s, not the token "
                   "idem_cache_secrets() names, for %.1f s (point the runner at the Valkey "
                   "the server's worker writes to, idem.valkey_host and idem.valkey_port; "
                   "or that worker cannot reach it)"
                   % (key, "no value" if value is None else "another value",
                      lasted), True, " ")
