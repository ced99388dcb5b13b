"""A round trip to one Valkey, packed by hand: the gate's two commands
(run.py) on a connection of the runner's own (Direct), without redis-py's
pool checkout, pipeline object and response parsing (most of a replay's
CPU).  The bytes on the wire are the ones redis-py's pipeline sends; a
Valkey Cluster keeps redis-py's routing (Runner._round_trip).

Direct's connections are redis-py's: made by the client's connection
class with its pool's settings (host or socket path, TLS, AUTH, database,
timeouts), connected by redis-py (its errors and messages), then read by
hiredis's reader, or by Reader below without python3-hiredis.  A plain
TCP or Unix socket waits with the kernel's timeouts (SO_RCVTIMEO,
SO_SNDTIMEO) instead of a poll before each call.  Each connection is used
by one thread at a time: idle ones wait in a list (list.pop and append are
atomic), and a forked child drops the parent's."""
import os
import socket
import struct
import weakref
from typing import Any, Callable, List, Optional, Tuple

_Redis: Optional[type] = None       # redis.Redis, imported on first use


def plain(client: Any) -> bool:
    """Is client a plain redis.Redis (not a cluster client)?"""
    global _Redis
    if _Redis is None:
        from redis import Redis
        _Redis = Redis
    return isinstance(client, _Redis)


def _bulk(a: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(a), a)


def pack(*args: bytes) -> bytes:
    """One command in RESP: an array of bulk strings."""
    return b"*%d\r\n" % len(args) + b"".join([_bulk(a) for a in args])


class Gate:
    """The gate's two commands (run.py) with one lease and owner key, as
    pack prints them: SET key marker NX PX lease_ms GET, and GET
    owner_key.  What is the same for every run is packed once."""
    __slots__ = ("lease_ms", "owner_key", "tail")

    def __init__(self, lease_ms: int, owner_key: bytes) -> None:
        self.lease_ms, self.owner_key = lease_ms, owner_key
        # after SET's key and marker
        self.tail = b"".join([_bulk(a) for a in (b"NX", b"PX", b"%d" % lease_ms, b"GET")]) + \
            pack(b"GET", owner_key)

    def pack(self, key: bytes, marker: bytes) -> bytes:
        """The two commands for key and marker."""
        return b"*7\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n%s" % (
            len(key), key, len(marker), marker, self.tail)


class Reader:
    """RESP2 replies from bytes fed in, as hiredis.Reader gives them
    (python3-hiredis absent): gets() is the next whole reply or False;
    bulk and simple strings as bytes, nil as None, integers, arrays as
    lists, an error reply as reply_error(text)."""

    def __init__(self, reply_error: Callable[[str], Any], protocol_error: type) -> None:
        self.buf = b""
        self.reply_error = reply_error
        self.protocol_error = protocol_error

    def feed(self, data: Any, start: int = 0, end: Optional[int] = None) -> None:
        self.buf += bytes(data[start:end])

    def gets(self) -> Any:
        try:
            value, pos = self._one(0)
        except _Short:
            return False
        self.buf = self.buf[pos:]
        return value

    def _line(self, pos: int) -> Tuple[bytes, int]:
        end = self.buf.find(b"\r\n", pos)
        if end < 0:
            raise _Short()
        return self.buf[pos:end], end + 2

    def _int(self, text: bytes) -> int:
        try:
            return int(text)
        except ValueError:
            raise self.protocol_error("Protocol error: %r is not a length" % text) from None

    def _one(self, pos: int) -> Tuple[Any, int]:
        line, pos = self._line(pos)
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            n = self._int(rest)
            if n < 0:
                return None, pos
            if len(self.buf) < pos + n + 2:
                raise _Short()
            return self.buf[pos:pos + n], pos + n + 2
        if kind == b"+":
            return rest, pos
        if kind == b"-":
            return self.reply_error(rest.decode("utf-8", "replace")), pos
        if kind == b":":
            return self._int(rest), pos
        if kind == b"*":
            n = self._int(rest)
            if n < 0:
                return None, pos
            items = []
            for _ in range(n):
                item, pos = self._one(pos)
                items.append(item)
            return items, pos
        raise self.protocol_error("Protocol Error: %r" % line[:32])


class _Short(Exception):
    """The reply is not whole yet."""


class _Lost(Exception):
    """A connection kept idle was found closed before any reply came
    (Valkey restarted, or closed it): tried once more on a new one."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


_directs: "weakref.WeakSet[Direct]" = weakref.WeakSet()


def _after_fork() -> None:
    """In a forked child: the parent's connections are not ours (redis-py
    closes them there without shutting them down)."""
    for d in list(_directs):
        d.idle = []


os.register_at_fork(after_in_child=_after_fork)


class Direct:
    """The runner's own connections to the plain Valkey of client (a
    redis.Redis), for its packed round trips."""

    def __init__(self, client: Any) -> None:
        import redis.exceptions as rex
        from redis.connection import BaseParser
        self.client = client
        pool = client.connection_pool
        self._make: Callable[[], Any] = lambda: pool.connection_class(**pool.connection_kwargs)
        self._rex = rex
        self._reply_error = BaseParser().parse_error
        try:
            import hiredis  # type: ignore[import]
            self._reader: Callable[[], Any] = lambda: hiredis.Reader(
                protocolError=rex.InvalidResponse, replyError=self._reply_error)
        except ImportError:
            self._reader = lambda: Reader(self._reply_error, rex.InvalidResponse)
        self.idle: List[_Conn] = []
        _directs.add(self)

    def exchange(self, packed: bytes, replies: int) -> List[Any]:
        """Send packed (that many commands) and read their replies, an
        error reply as its exception (as a pipeline's
        execute(raise_on_error=False)), values undecoded.  On any other
        failure the connection is closed (a reply may be unread) and the
        failure raised as redis-py raises it."""
        try:
            c = self.idle.pop()
        except IndexError:
            c = _Conn(self)
        try:
            out = c.exchange(packed, replies)
        except _Lost:
            c.close()
            c = _Conn(self)
            try:
                out = c.exchange(packed, replies)
            except _Lost as e:
                c.close()
                raise e.error from None
            except BaseException:
                c.close()
                raise
        except BaseException:
            c.close()
            raise
        self.idle.append(c)
        return out

    def close(self) -> None:
        """Close the idle connections (a later exchange opens another)."""
        idle, self.idle = self.idle, []
        for c in idle:
            c.close()


class _Conn:
    """One connection of Direct's, connected on creation."""
    __slots__ = ("rc", "sock", "reader", "buf", "fresh", "where", "rex")

    def __init__(self, d: Direct) -> None:
        self.rex = d._rex
        self.rc = d._make()
        self.rc.connect()           # redis-py's: AUTH, SELECT..., its errors
        self.sock: socket.socket = self.rc._sock
        self.fresh = True
        self.where = "%s:%s" % (getattr(self.rc, "host", "?"), getattr(self.rc, "port", "?")) \
            if hasattr(self.rc, "host") else str(getattr(self.rc, "path", "connection"))
        t = self.rc.socket_timeout
        if type(self.sock) is socket.socket and t is not None and t > 0:
            tv = struct.pack("@ll", int(t), int((t - int(t)) * 1e6))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            self.sock.settimeout(None)
        self.reader = d._reader()
        self.buf = bytearray(65536)

    def close(self) -> None:
        try:
            self.rc.disconnect()
        except Exception:
            pass

    def exchange(self, packed: bytes, replies: int) -> List[Any]:
        sock, reader = self.sock, self.reader
        fresh, self.fresh = self.fresh, False
        try:
            sock.sendall(packed)
        except (socket.timeout, BlockingIOError):
            raise self.rex.TimeoutError("Timeout writing to socket") from None
        except OSError as e:
            err = self.rex.ConnectionError("Error %s while writing to socket. %s." % (
                e.errno, e.strerror))
            raise err if fresh else _Lost(err) from None
        out: List[Any] = []
        got = False
        while True:
            try:
                n = sock.recv_into(self.buf)
            except (socket.timeout, BlockingIOError):
                raise self.rex.TimeoutError("Timeout reading from %s" % self.where) from None
            except OSError as e:
                err = self.rex.ConnectionError("Error while reading from %s : %s" % (
                    self.where, e.args))
                raise err if fresh or got else _Lost(err) from None
            if n == 0:
                err = self.rex.ConnectionError("Connection closed by server.")
                raise err if fresh or got else _Lost(err)
            got = True
            reader.feed(self.buf, 0, n)
            r = reader.gets()
            while r is not False:       # False: not whole yet, read more
                if type(r) is not bytes and r is not None:
                    self._check(r)
                out.append(r)
                if len(out) == replies:
                    return out
                r = reader.gets()

    def _check(self, r: Any) -> None:
        """A reply other than a value: raised if an error redis-py raises
        (NOAUTH, LOADING...), not if an error reply a pipeline returns."""
        if isinstance(r, self.rex.RedisError) and not isinstance(r, self.rex.ResponseError):
            raise r
