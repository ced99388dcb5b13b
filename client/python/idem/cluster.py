"""redis-py's RedisCluster as the synchronous runner uses it: a pipeline's
replies, with MOVED and ASK followed here, and redis-py's cluster logger
kept quiet meanwhile.  A leaf: it imports nothing of the package.

redis-py 4.3 (Debian 12's) follows a pipeline's redirections by sending
each redirected command alone, and logs every MOVED, ASK, timeout and
refused connection on the way with a traceback (log.exception: on stderr
when the application has not set logging up); alone, an ASK of a command
with options (the gate's SET ... GET) fails in its ASKING.  A node that
does not answer is retried five times, 0.25 s apart, before it is given
up.  So the runner sends its pipelines with redirections off
(execute): a MOVED refreshes the slot map and the command is sent again,
an ASK is sent again to its node after ASKING, once each; a node that
failed is the runner's Valkey failure (counted, told once, rested), and
the map is read again before the next round trip (refresh)."""
import contextlib
import logging
import threading
from typing import Any, Iterator, List

_quiet = threading.local()


class _QuietWhileOurs(logging.Filter):
    """Drops the records of redis-py's cluster logger while this thread
    runs one of the runner's own commands (quiet)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(_quiet, "on", False)


logging.getLogger("redis.cluster").addFilter(_QuietWhileOurs())


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The runner's own commands to a Valkey Cluster run inside: redis-py's
    cluster logger says nothing in this thread meanwhile."""
    was = getattr(_quiet, "on", False)
    _quiet.on = True
    try:
        yield
    finally:
        _quiet.on = was


def refresh(cluster: Any) -> None:
    """Read the slot map again (after a node failed: a failover may have
    moved its slots)."""
    with quiet():
        cluster.nodes_manager.initialize()


def execute(pipe: Any) -> List[Any]:
    """The replies of a RedisCluster pipeline's commands (an error reply
    as its exception), MOVED and ASK followed once; a node that failed is
    raised (ConnectionError, TimeoutError)."""
    from redis.exceptions import AskError, ConnectionError, MovedError, TimeoutError
    stack = list(pipe.command_stack)
    with quiet():
        try:
            replies = list(pipe.send_cluster_commands(stack, raise_on_error=False,
                                                      allow_redirections=False))
            moved = [i for i, r in enumerate(replies) if isinstance(r, MovedError)]
            if moved:
                # the slot moved (a migration ended, a failover): the map
                # again, then those commands again, to their slots' masters
                pipe.nodes_manager.initialize()
                again = pipe.send_cluster_commands([stack[i] for i in moved],
                                                   raise_on_error=False, allow_redirections=False)
                for i, r in zip(moved, again):
                    replies[i] = r
        finally:
            pipe.reset()
        for i, r in enumerate(replies):
            if isinstance(r, AskError):
                # the slot is migrating and the key is on the node it names
                node = pipe.get_node(host=r.host, port=r.port)
                if node is None:
                    pipe.nodes_manager.initialize()
                    continue
                p = pipe.get_redis_connection(node).pipeline(transaction=False)
                p.execute_command("ASKING")
                p.execute_command(*stack[i].args, **stack[i].options)
                replies[i] = p.execute(raise_on_error=False)[1]
        for r in replies:
            if isinstance(r, (ConnectionError, TimeoutError)):
                raise r
    return replies
