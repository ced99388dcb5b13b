"""The stream consumer (``idem.Consumer``, and ``idem.consume.AsyncConsumer``
for redis.asyncio and the AsyncRunner): a Valkey stream of idem_emit's
messages (entries ``id <message id> body <message>``) read with a
consumer group, each message run through the runner with its id as the run
id and its body as the request, acknowledged (XACK) only once its run is
settled.  The C client's idem_consumer_poll follows the same rules:

* settled, acknowledged: applied, replayed, failed_permanent, and mismatch
  (the id came with another body: the ledger's answer stands for good);
* not acknowledged, so redelivered: busy, failed_retryable, and every error
  (the server's state, a connection lost, a commit whose outcome is
  unknown).  An entry left pending comes back once it has been idle
  ``claim_idle`` seconds (XAUTOCLAIM, by this consumer or another of the
  group), which also takes over the entries of a consumer that died;
* malformed (no id or body field, an id that is not UTF-8, a body that is
  not JSON): logged to the "idem" logger (and ``notice``), copied to the
  ``dead_letter`` stream if one is given, and acknowledged: it can never
  succeed.

The group is created from the stream's start (``XGROUP CREATE ... 0
MKSTREAM``) when missing, so nothing published before the first consumer
is lost.  A new entry runs with delivery_count 1 (the Valkey gate
skipped: the claim decides), a taken-over one with 2.

Durable before acknowledged: an XACK removes the entry from the group's
pending list for good, so each run is durable (the runner's ``durable``:
its transaction sets synchronous_commit to at least on, locally,
whatever the connection's).  Every answer acknowledged has then survived
a crash of the server once the run returns: applied or failed_permanent
by this run (its COMMIT flushed, and waited for the synchronous standbys,
as with on); replayed, failed_permanent or mismatch read from another
transaction's row, perhaps committed with off and not flushed (the
server answers once that commit is as durable as the asking
transaction's would be: on flushes it first); replayed from Valkey (the
server's worker copies a result only once its commit is flushed and on
the standbys idem waits for).  The setting is one more statement in the
round trip that begins the run's transaction; with on, the default, it
costs nothing more.  A flush per round instead (one transaction with an
xid, committed with on, before the round's XACK) would save flushes only
for a connection set to off, cost every consumer a round trip per round,
and prove nothing after a reconnect: a commit lost with the old
connection is not in the new server's WAL to flush.

Consumer and AsyncConsumer share their steps (_Base: each poll is one
generator of steps, driven by _drive or _adrive).  A step is a callable
the driver calls; AsyncConsumer's return awaitables, which its driver
awaits (Consumer's none: _drive is _adrive run without an event loop); an
exception a step raises is raised at its yield."""
import asyncio
import inspect
import json
import logging
import time
from typing import Any, Callable, Dict, Generator, List, Optional, Tuple

from .canonical import RequestError, canonical_json, idem_key
from .errors import IdemError
from .result import APPLIED, FAILED_PERMANENT, MISMATCH, REPLAYED, Failure, Run

log = logging.getLogger("idem")

SETTLED = (APPLIED, REPLAYED, FAILED_PERMANENT, MISMATCH)

# An entry as read: (entry id, {field: value}) with bytes or str, or None.
Entry = Tuple[Any, Any]


def _text(v: Any) -> Optional[str]:
    """A field's name or value as str (redis-py gives bytes unless
    decode_responses), or None when it is not UTF-8."""
    if isinstance(v, (bytes, bytearray)):
        try:
            return bytes(v).decode("utf-8")
        except UnicodeDecodeError:
            return None
    return v if isinstance(v, str) else None


def parse_entry(fields: Any, scope: str) -> Tuple[Optional[str], Optional[str], Optional[str]]:
    """(message id, body text, None), or (id or None, body or None, why it
    is malformed)."""
    if not isinstance(fields, dict):
        return None, None, "the entry has no fields"
    named = {}
    for k, v in fields.items():
        name = _text(k)
        if name in ("id", "body") and name not in named:
            named[name] = v
    if "id" not in named:
        return None, None, "no id field"
    if "body" not in named:
        return _text(named["id"]), None, "no body field"
    mid, body = _text(named["id"]), _text(named["body"])
    if not mid or "\x00" in mid:
        return None, body, "the id is empty or not UTF-8"
    try:
        idem_key(scope, mid)
    except (TypeError, ValueError):
        return None, body, "the id is not acceptable as a run id"
    if body is None:
        return mid, None, "the body is not UTF-8"
    try:
        canonical_json(body)
    except RequestError:
        return mid, body, "the body is not JSON"
    return mid, body, None


def _entries(reply: Any) -> List[Entry]:
    """The entries of XREADGROUP's or XAUTOCLAIM's parsed reply."""
    if not reply:
        return []
    if isinstance(reply, dict):             # RESP3: {stream: [entries]}
        return [e for es in reply.values() for e in (es[0] if es and isinstance(es[0], list)
                                                      else es)]
    return [e for _, es in reply for e in es]


# A poll's steps: each yields callables (the I/O), and is sent their results.
Steps = Generator[Callable[[], Any], Any, Any]


async def _adrive(steps: Steps) -> Any:
    """Run steps, calling each callable they yield and awaiting what it
    returns if that is awaitable; their return value."""
    try:
        step = next(steps)
        while True:
            try:
                value = step()
                if inspect.isawaitable(value):
                    value = await value
            except Exception as e:
                step = steps.throw(e)
            else:
                step = steps.send(value)
    except StopIteration as done:
        return done.value


def _drive(steps: Steps) -> Any:
    """_adrive for steps whose callables return nothing awaitable: it never
    suspends, so one send runs it to its end."""
    coro = _adrive(steps)
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("a step of a synchronous consumer returned an awaitable")


class _Base:
    """What both consumers share: their options, the rules, the counters,
    and a poll's steps."""

    def __init__(self, runner: Any, conn: Any, valkey: Any, *, stream: str, group: str,
                 consumer: str, scope: str, handler: Any = None, tenant: Optional[int] = None,
                 sql_handler: Optional[str] = None, count: int = 10, block: float = 1.0,
                 claim_idle: float = 30.0, dead_letter: Optional[str] = None,
                 notice: Optional[Callable[[str], None]] = None,
                 settled: Optional[Callable[[str, Any, bool], None]] = None) -> None:
        for name, v in (("stream", stream), ("group", group), ("consumer", consumer),
                        ("scope", scope)):
            if not isinstance(v, str) or not v:
                raise IdemError("argument", "%s must be a non-empty str" % name)
        if (handler is None) == (sql_handler is None):
            raise IdemError("argument", "give a handler or a sql_handler (one of them)")
        if not (1 <= int(count) <= 10000):
            raise IdemError("argument", "count must be 1 to 10000")
        if block <= 0 or claim_idle <= 0:
            raise IdemError("argument", "block and claim_idle are positive durations in seconds")
        self.runner, self.valkey = runner, valkey
        self._conn = conn
        self.conn: Any = None
        self.stream, self.group, self.consumer, self.scope = stream, group, consumer, scope
        self.handler, self.sql_handler, self.tenant = handler, sql_handler, tenant
        self.count = int(count)
        self.block_ms = max(1, int(block * 1000))
        self.claim_idle_ms = max(1, int(claim_idle * 1000))
        self.dead_letter = dead_letter
        self.notice, self.on_settled = notice, settled
        self.own_client = isinstance(valkey, tuple)     # made here: close() closes it
        self.group_ready = False
        self.next_claim = 0.0
        self.cursor = "0-0"
        self.stats = {"read": 0, "claimed": 0, "acked": 0, "left_pending": 0,
                      "malformed": 0, "dead_lettered": 0, "valkey_errors": 0}

    def _pause(self) -> Any:
        """Wait ``block`` (after Valkey failed): the consumer's own sleep."""
        raise NotImplementedError

    def _tell(self, message: str) -> None:
        log.warning("%s", message)
        if self.notice is not None:
            self.notice(message)

    def _malformed_fields(self, eid: Any, mid: Optional[str], body: Optional[str],
                          why: str) -> Dict[str, Any]:
        self.stats["malformed"] += 1
        self._tell("stream %s, entry %s: malformed (%s): %s" % (
            self.stream, _text(eid), why,
            "dead-lettered and acknowledged" if self.dead_letter else "acknowledged"))
        fields: Dict[str, Any] = {"stream": self.stream, "entry": eid, "reason": why}
        if mid is not None:
            fields["id"] = mid
        if body is not None:
            fields["body"] = body
        return fields

    def _read(self, eid: Any, fields: Any) -> Tuple[Optional[str], Optional[str],
                                                     Optional[Dict[str, Any]]]:
        """An entry read: (message id, body, None) to run, or (None, None,
        the dead-letter fields) when it is malformed (told already)."""
        self.stats["read"] += 1
        mid, body, why = parse_entry(fields, self.scope)
        if why is None and mid is not None and body is not None:
            return mid, body, None
        return None, None, self._malformed_fields(eid, mid, body, why or "malformed")

    def _judged(self, mid: str, run: Optional[Run], error: Optional[BaseException]) -> bool:
        """Acknowledge?  Told to ``settled`` (the run or the exception)."""
        ok = run is not None and error is None and run.status in SETTLED
        if not ok:
            self.stats["left_pending"] += 1
            if error is not None and not isinstance(error, (IdemError, Failure)):
                self._tell("stream %s, message %s: the handler raised %s: left pending"
                           % (self.stream, mid, type(error).__name__))
        if self.on_settled is not None:
            self.on_settled(mid, run if error is None else error, ok)
        return ok

    def _claim_due(self) -> bool:
        return time.monotonic() >= self.next_claim

    def _claimed(self, reply: Any) -> List[Entry]:
        """XAUTOCLAIM's entries; the cursor and the next claim's time set."""
        nxt = _text(reply[0]) if reply else None
        self.cursor = nxt if nxt else "0-0"
        self.next_claim = 0.0 if self.cursor != "0-0" else \
            time.monotonic() + self.claim_idle_ms / 2000.0
        es = [e for e in (reply[1] if reply and len(reply) > 1 else []) if e and e[0] is not None]
        self.stats["claimed"] += len(es)
        return es

    def _lost(self, e: BaseException, what: str) -> None:
        self.stats["valkey_errors"] += 1
        if "NOGROUP" in str(e):
            self.group_ready = False
        self._tell("stream %s: %s failed: %s" % (self.stream, what, e))

    # ---- a poll's steps ----
    def _connection_steps(self) -> Steps:
        """The consumer's connection, made again (``conn`` a factory) when
        lost."""
        c = self.conn
        if c is None or c.closed or c.broken:
            if not callable(self._conn) or hasattr(self._conn, "execute"):
                c = self._conn
            else:
                c = yield self._conn
            self.conn = c
        return c

    def _group_steps(self) -> Steps:
        if self.group_ready:
            return
        try:
            yield lambda: self.valkey.xgroup_create(self.stream, self.group, id="0",
                                                    mkstream=True)
        except Exception as e:
            if "BUSYGROUP" not in str(e):
                raise
        self.group_ready = True

    def _run_steps(self, eid: Any, fields: Any, first: bool, ack: List[Any]) -> Steps:
        """One entry: run (durable), or dead-lettered when malformed; its
        id added to ack when settled."""
        mid, body, dead = self._read(eid, fields)
        if mid is None or body is None:
            if self.dead_letter:
                try:
                    yield lambda: self.valkey.xadd(self.dead_letter, dead)
                except Exception as e:
                    self._lost(e, "the dead-letter XADD")
                    self.stats["left_pending"] += 1
                    return
                self.stats["dead_lettered"] += 1
            ack.append(eid)
            return
        run: Optional[Run] = None
        error: Optional[BaseException] = None
        dc = 1 if first else 2
        try:
            conn = yield from self._connection_steps()
            if self.sql_handler is not None:
                sql_handler = self.sql_handler
                run = yield lambda: self.runner.apply(conn, self.tenant, self.scope, mid, body,
                                                      sql_handler, delivery_count=dc,
                                                      durable=True)
            else:
                message = json.loads(body)
                handler = self.handler
                run = yield lambda: self.runner.call(
                    conn, self.tenant, self.scope, mid, body,
                    lambda c, r: handler(c, r, message), delivery_count=dc, durable=True)
        except Exception as e:
            error = e
        if self._judged(mid, run, error):
            ack.append(eid)

    def _ack_steps(self, ack: List[Any]) -> Steps:
        """The round's settled entries acknowledged in one XACK."""
        if not ack:
            return
        try:
            yield lambda: self.valkey.xack(self.stream, self.group, *ack)
            self.stats["acked"] += len(ack)
        except Exception as e:
            self.stats["left_pending"] += len(ack)     # they come back: replayed
            self._lost(e, "XACK")

    def _poll_steps(self) -> Steps:
        ack: List[Any] = []
        try:
            yield from self._group_steps()
            if self._claim_due():
                es = self._claimed((yield lambda: self.valkey.xautoclaim(
                    self.stream, self.group, self.consumer, self.claim_idle_ms,
                    self.cursor, count=self.count)))
                for eid, fields in es:
                    yield from self._run_steps(eid, fields, False, ack)
                yield from self._ack_steps(ack)
                ack = []
                if es:
                    return len(es)
            es = _entries((yield lambda: self.valkey.xreadgroup(
                self.group, self.consumer, {self.stream: ">"}, count=self.count,
                block=self.block_ms)))
        except Exception as e:
            self._lost(e, "reading")
            yield from self._ack_steps(ack)
            yield self._pause
            return -1
        for eid, fields in es:
            yield from self._run_steps(eid, fields, True, ack)
        yield from self._ack_steps(ack)
        return len(es)


class Consumer(_Base):
    """``idem.Consumer(runner, conn, valkey, stream=..., group=...,
    consumer=..., scope=..., handler=...)`` then ``consumer.poll()`` in a
    loop (or ``consumer.run(stop)``).

    ``handler(conn, run, message)`` does the effect on ``conn`` in the
    run's transaction and returns the outcome (``runner.call``'s rules;
    ``run.emit`` to pass messages on); ``message`` is the body, parsed.
    Or ``sql_handler``: a SQL function run by idem_apply.  ``conn``: a
    psycopg connection, or a callable that makes one (called again when
    the connection is lost).  ``valkey``: a ``redis.Redis`` or
    ``RedisCluster`` whose socket timeout exceeds ``block``, or
    ``(host, port)``.  ``tenant``: the runs' tenant (None: the platform
    ledger).  ``settled(message_id, run_or_exception, acked)`` is told
    each run's end."""

    def __init__(self, runner: Any, conn: Any, valkey: Any, **kw: Any) -> None:
        super().__init__(runner, conn, valkey, **kw)
        if isinstance(valkey, tuple):
            import redis
            self.valkey = redis.Redis(host=valkey[0], port=int(valkey[1]),
                                      socket_timeout=self.block_ms / 1000.0 + 5,
                                      socket_connect_timeout=1)
            if int(self.valkey.info("cluster").get("cluster_enabled", 0)) == 1:
                from redis.cluster import RedisCluster
                from .runner import _close_client
                _close_client(self.valkey)      # the seed node's
                self.valkey = RedisCluster(host=valkey[0], port=int(valkey[1]),
                                           socket_timeout=self.block_ms / 1000.0 + 5)

    def _pause(self) -> None:
        time.sleep(self.block_ms / 1000.0)

    def poll(self) -> int:
        """One round: the entries idle for claim_idle taken over (at most
        every claim_idle / 2), else a read of new ones waiting up to
        ``block``; each run, the settled ones acknowledged in one XACK.
        How many entries ran; -1 when Valkey failed (after waiting
        ``block``, so that a loop of polls does not spin)."""
        n: int = _drive(self._poll_steps())
        return n

    def run(self, stop: Any) -> None:
        """poll() until ``stop`` (a threading.Event) is set."""
        while not stop.is_set():
            self.poll()

    def close(self) -> None:
        """Close the Valkey client made from ``(host, port)`` (a client
        given is the caller's)."""
        if self.own_client:
            from .runner import _close_client
            _close_client(self.valkey)


class AsyncConsumer(_Base):
    """Consumer for redis.asyncio and idem.aio.AsyncRunner: ``await
    consumer.poll()``; ``handler`` is ``async def handler(conn, run,
    message)``; ``conn`` a psycopg AsyncConnection or an async callable
    that makes one."""

    def __init__(self, runner: Any, conn: Any, valkey: Any, **kw: Any) -> None:
        super().__init__(runner, conn, valkey, **kw)
        if isinstance(valkey, tuple):
            import redis.asyncio
            self.valkey = redis.asyncio.Redis(host=valkey[0], port=int(valkey[1]),
                                              socket_timeout=self.block_ms / 1000.0 + 5,
                                              socket_connect_timeout=1)

    def _pause(self) -> Any:
        return asyncio.sleep(self.block_ms / 1000.0)

    async def poll(self) -> int:
        """Consumer.poll, awaited."""
        n: int = await _adrive(self._poll_steps())
        return n

    async def run(self, stop: "asyncio.Event") -> None:
        """poll() until ``stop`` is set."""
        while not stop.is_set():
            await self.poll()

    async def close(self) -> None:
        """Consumer.close, awaited."""
        if self.own_client:
            from .aio import _aclose_client
            await _aclose_client(self.valkey)
