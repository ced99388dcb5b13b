"""Runner.check: the start-up check, as libpq's PQping (the C client's
idem_runner_check).  In the order a run needs them: PostgreSQL answers on
the connection (one round trip, timed), the idem extension is installed
there (its version), the role may read the cache keyspace and secrets,
Valkey answers (AUTH accepted), and the epoch owner key there holds the
token the server names (one GET, timed): the same Valkey the server's
worker writes to.  The first problem is the report's status.

The steps are written once (_steps, a generator that yields each
statement or Valkey command it needs) and driven once (_drive): by check
for a Runner, each step done at once, and by acheck for an AsyncRunner,
each awaited."""
import time
from typing import Any, Awaitable, Callable, Generator, Optional, Tuple

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row

from . import cache
from .errors import IdemError
from .cluster import quiet
from .health import AUTH, DOWN, classify, describe
from .pg import _exec

OK = "ok"
PG_UNREACHABLE = "pg_unreachable"
NO_EXTENSION = "no_extension"
CACHE_UNAVAILABLE = "cache_unavailable"
VALKEY_UNREACHABLE = "valkey_unreachable"
VALKEY_AUTH = "valkey_auth"
VALKEY_REFUSED = "valkey_refused"
VALKEY_NOT_SERVERS = "valkey_not_servers"


class Check:
    """What Runner.check found: ``status`` (``"ok"`` or the first problem:
    ``pg_unreachable``, ``no_extension``, ``cache_unavailable``,
    ``valkey_unreachable``, ``valkey_auth``, ``valkey_refused``,
    ``valkey_not_servers``, the C client's names), ``message`` (that
    problem in words), ``extension_version``, ``pg_rtt`` and ``valkey_rtt``
    (one round trip, in seconds; None if not measured), ``valkey_configured``,
    ``valkey_ok`` (it answered, AUTH accepted), ``valkey_owner_ok`` (its owner
    key holds the server's token).  True when all is well."""

    def __init__(self) -> None:
        self.status = OK
        self.message = ""
        self.extension_version: Optional[str] = None
        self.pg_rtt: Optional[float] = None
        self.valkey_configured = False
        self.valkey_ok = False
        self.valkey_owner_ok = False
        self.valkey_rtt: Optional[float] = None

    def __bool__(self) -> bool:
        return self.status == OK

    def __repr__(self) -> str:
        return "Check(%s%s)" % (self.status, ": " + self.message if self.message else "")

    def _problem(self, status: str, message: str) -> "Check":
        self.status, self.message = status, message
        return self


# What a step asks its driver to do: ("one"|"all", sql) a statement's first
# row or all rows; ("end", None) end the transaction; ("rollback", None);
# ("schema", None) the extension's schema (the runner's session state);
# ("cluster", None) the first-contact check; ("get", key) a Valkey GET.
Step = Tuple[str, Any]
EXTVERSION_SQL = "SELECT extversion FROM pg_catalog.pg_extension WHERE extname = 'idem'"


def _steps(runner: Any, conn: Any) -> Generator[Step, Any, Check]:
    c = Check()
    if conn.closed or conn.broken:
        return c._problem(PG_UNREACHABLE, "the PostgreSQL connection is closed")
    if conn.info.transaction_status != TransactionStatus.IDLE:
        raise IdemError("state", "the connection must be idle (no transaction open): the check")
    try:
        t = time.perf_counter()
        row = yield ("one", EXTVERSION_SQL)
        c.pg_rtt = time.perf_counter() - t
        yield ("end", None)
    except psycopg.Error as e:
        if conn.closed or conn.broken:
            return c._problem(PG_UNREACHABLE, "PostgreSQL connection lost: %s" % str(e).strip())
        yield ("rollback", None)
        return c._problem(NO_EXTENSION, "reading the idem extension's version failed: %s"
                          % str(e).strip())
    if row is None:
        return c._problem(NO_EXTENSION, "the extension idem is not installed in this "
                          "database (CREATE EXTENSION idem)")
    c.extension_version = row[0]
    if runner.valkey is None:
        return c
    c.valkey_configured = True

    # what the server says the cache is, read now
    try:
        schema = yield ("schema", None)
        ks = (yield ("one", "SELECT %s.idem_cache_keyspace()" % schema))[0]
        rows = yield ("all", "SELECT s.owner_key, s.owner_token FROM "
                      "%s.idem_cache_secrets() AS s WHERE s.is_current" % schema)
        yield ("end", None)
    except psycopg.Error as e:
        if conn.closed or conn.broken:
            return c._problem(PG_UNREACHABLE, "PostgreSQL connection lost: %s" % str(e).strip())
        yield ("rollback", None)
        sqlstate = getattr(e.diag, "sqlstate", None)
        hint = {"42501": " (GRANT EXECUTE on idem_cache_keyspace() and idem_cache_secrets() "
                         "to the role)",
                "42883": " (ALTER EXTENSION idem UPDATE)",
                "55000": " (not ready: asked again a second later)"}.get(sqlstate or "", "")
        return c._problem(CACHE_UNAVAILABLE, "the server gives no Valkey cache: %s %s%s"
                          % (sqlstate, str(e).strip(), hint))
    if ks is None or len(rows) != 1 or not cache.owner_ok(ks, rows[0][0], rows[0][1]):
        return c._problem(CACHE_UNAVAILABLE, "the server's Valkey cache is not ready (its "
                          "worker has not taken the cache epoch over)")
    owner_key, token = rows[0]

    # Valkey, and the same Valkey as the server's worker
    try:
        yield ("cluster", None)
        t = time.perf_counter()
        value = yield ("get", owner_key)
        c.valkey_rtt = time.perf_counter() - t
    except IdemError:
        raise
    except Exception as e:
        kind = classify(e)
        status = VALKEY_AUTH if kind == AUTH else VALKEY_UNREACHABLE if kind == DOWN \
            else VALKEY_REFUSED
        return c._problem(status, "%s: %s" % (runner._health.where(), describe(kind, e)))
    c.valkey_ok = True
    if value != token.encode("ascii"):
        return c._problem(VALKEY_NOT_SERVERS,
                          "%s is not the server's: its epoch owner key %s has %s, not the "
                          "token idem_cache_secrets() names (point the runner at the Valkey "
                          "the server's worker writes to, idem.valkey_host and "
                          "idem.valkey_port; or that worker has not reached it yet)"
                          % (runner._health.where(), owner_key,
                             "no value" if value is None else "another value"))
    c.valkey_owner_ok = True
    # all well: a rest for another Valkey is over
    runner._health.owner_bad_since = None
    runner._rest_until = 0.0
    return c


def _do(runner: Any, conn: Any, step: Step) -> Any:
    what, arg = step
    if what in ("one", "all"):
        cur = _exec(conn, arg)
        return cur.fetchone() if what == "one" else cur.fetchall()
    if what == "end":
        return runner._end_tx(conn)
    if what == "rollback":
        try:
            conn.rollback()
        except psycopg.Error:
            pass
        return None
    if what == "schema":
        return runner._state(conn).schema
    if what == "cluster":
        return runner._check_cluster()
    with quiet():
        return runner.valkey.get(arg)


async def _ado(runner: Any, conn: Any, step: Step) -> Any:
    what, arg = step
    if what in ("one", "all"):
        # as pg._exec: unnamed, rows as tuples whatever the connection's factory
        cur = conn.cursor(row_factory=tuple_row)
        await cur.execute(arg, prepare=False)
        return await (cur.fetchone() if what == "one" else cur.fetchall())
    if what == "end":
        return await runner._aend_tx(conn)
    if what == "rollback":
        try:
            await conn.rollback()
        except psycopg.Error:
            pass
        return None
    if what == "schema":
        return (await runner._astate(conn)).schema
    if what == "cluster":
        return await runner._acheck_cluster()
    return await runner.valkey.get(arg)


async def _drive(steps: Generator[Step, Any, Check],
                 do: Callable[[Step], Awaitable[Any]]) -> Check:
    """Each step done by do, its answer (or its exception) sent back into
    the steps: their Check."""
    try:
        step = next(steps)
        while True:
            try:
                answer = await do(step)
            except Exception as e:
                step = steps.throw(e)
            else:
                step = steps.send(answer)
    except StopIteration as stop:
        result: Check = stop.value
        return result


def check(runner: Any, conn: Any) -> Check:
    """Runner.check: _drive with _do, which never suspends, so that the
    coroutine ends at its first send, with no event loop."""
    async def do(step: Step) -> Any:
        return _do(runner, conn, step)
    driven = _drive(_steps(runner, conn), do)
    try:
        driven.send(None)
    except StopIteration as stop:
        result: Check = stop.value
        return result
    driven.close()
    raise AssertionError("a step of the synchronous check suspended")


async def acheck(runner: Any, conn: Any) -> Check:
    """AsyncRunner.check: the same steps, each awaited."""
    return await _drive(_steps(runner, conn), lambda step: _ado(runner, conn, step))
