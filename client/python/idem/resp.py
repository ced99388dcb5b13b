"""A round trip to one Valkey, packed by hand: the gate's two commands
(run.py) on a connection of a plain redis.Redis client's pool, without
redis-py's pipeline object (its packing, per-command bookkeeping and
response callbacks were most of a replay's CPU).  The bytes on the wire
are the ones redis-py's pipeline sends; a Valkey Cluster keeps redis-py's
routing (Runner._round_trip)."""
from typing import Any, List, Optional

_Redis: Optional[type] = None       # redis.Redis, imported on first use


def plain(client: Any) -> bool:
    """Is client a plain redis.Redis (not a cluster client)?"""
    global _Redis
    if _Redis is None:
        from redis import Redis
        _Redis = Redis
    return isinstance(client, _Redis)


def pack(*args: bytes) -> bytes:
    """One command in RESP: an array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def gate(key: bytes, marker: bytes, lease_ms: int, owner_key: bytes) -> bytes:
    """The gate's two commands (run.py), as pack would print them:
    SET key marker NX PX lease_ms GET, and GET owner_key."""
    lease = b"%d" % lease_ms
    return b"*7\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$2\r\nNX\r\n$2\r\nPX\r\n" \
        b"$%d\r\n%s\r\n$3\r\nGET\r\n*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (
            len(key), key, len(marker), marker, len(lease), lease, len(owner_key), owner_key)


def exchange(client: Any, packed: bytes, replies: int) -> List[Any]:
    """Send packed (that many commands) on one connection of client's
    pool and read their replies, an error reply as its exception (as a
    pipeline's execute(raise_on_error=False)); values undecoded.  On any
    other failure the connection is dropped (a reply may be unread) and
    the failure raised."""
    from redis.exceptions import ResponseError
    pool = client.connection_pool
    conn = pool.get_connection("SET")
    try:
        conn.send_packed_command([packed])
        out: List[Any] = []
        for _ in range(replies):
            try:
                out.append(conn.read_response(disable_decoding=True))
            except ResponseError as e:
                out.append(e)
        return out
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)
