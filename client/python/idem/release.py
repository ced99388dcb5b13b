"""Compare-and-delete of the runner's own marker (the C client's release:
EVALSHA, EVAL on NOSCRIPT), for the synchronous and the asyncio runner.
A leaf: it imports nothing of the package.

A Valkey without the script (a new node, a restart, a failover, SCRIPT
FLUSH) answers EVALSHA with NOSCRIPT; the runner then sends EVAL, which
runs the script and keeps it there.  The synchronous runner sends both
in a pipeline: redis-py's RedisCluster logs the error reply of a command
sent alone with a traceback (on stderr, when the application has not set
logging up), and a pipeline hands the reply back instead.  At first
contact (load) the script is loaded on every master, each through its
node's own client, which logs nothing: a release then takes one round
trip on each master from the first."""
import hashlib
from typing import Any, Callable, List, Optional

# KEYS[1] = key, ARGV[1] = our marker: delete it only if it is still ours.
# The same text as client/release.c, so the same SHA-1 for EVALSHA
# (tests/test_unit.py compares the two, and that SHA-1, byte for byte).
CAD_SCRIPT = ("if redis.call('GET', KEYS[1]) == ARGV[1] then\n"
              "  return redis.call('DEL', KEYS[1])\n"
              "end\n"
              "return 0\n")
CAD_SHA = hashlib.sha1(CAD_SCRIPT.encode("ascii")).hexdigest()


def load(client: Any) -> None:
    """SCRIPT LOAD on every master of ``client`` (a RedisCluster), or on
    its one Valkey.  Best effort: a master that missed it answers its
    first release NOSCRIPT, and EVAL follows."""
    from redis.cluster import RedisCluster
    nodes = client.get_primaries() if isinstance(client, RedisCluster) else [None]
    for node in nodes:
        try:
            (client if node is None else client.get_redis_connection(node)).script_load(
                CAD_SCRIPT)
        except Exception:
            pass        # down now: the gate's round trips say so


def _execute(pipe: Any) -> List[Any]:
    return list(pipe.execute(raise_on_error=False))


class Release:
    """The synchronous runner's compare-and-delete on ``client`` (a
    redis.Redis or RedisCluster): ``release(keys=[key], args=[marker])``
    answers 1 (deleted) or 0 (not ours), or raises the error."""
    sha = CAD_SHA

    def __init__(self, client: Any,
                 execute: Optional[Callable[[Any], List[Any]]] = None) -> None:
        """execute(pipe): its replies (the runner's for a RedisCluster);
        None: pipe.execute(raise_on_error=False)."""
        self.client = client
        self._execute = execute or _execute

    def __call__(self, keys: List[bytes], args: List[bytes]) -> Any:
        from redis.exceptions import NoScriptError
        reply = self._one("EVALSHA", self.sha, keys, args)
        if isinstance(reply, NoScriptError):
            reply = self._one("EVAL", CAD_SCRIPT, keys, args)
        if isinstance(reply, Exception):
            raise reply
        return reply

    def _one(self, command: str, script: str, keys: List[bytes], args: List[bytes]) -> Any:
        """One command in a pipeline of its own: its reply, an error reply
        as an exception, routed by key on a cluster."""
        pipe = self.client.pipeline(transaction=False)
        pipe.execute_command(command, script, len(keys), *keys, *args)
        return self._execute(pipe)[0]


class AsyncRelease:
    """The asyncio runner's (redis.asyncio, whose RedisCluster logs no
    error reply and, in redis-py 4.3, has no register_script)."""
    sha = CAD_SHA

    def __init__(self, client: Any) -> None:
        self.client = client

    async def __call__(self, keys: List[bytes], args: List[bytes]) -> Any:
        from redis.exceptions import NoScriptError
        try:
            return await self.client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await self.client.eval(CAD_SCRIPT, len(keys), *keys, *args)
