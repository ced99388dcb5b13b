"""The PostgreSQL connection as every form sees it: how the runner sends
its own statements (_exec, _pipeline), a statement's error (nothing
committed: the connection was lost, or the transaction is rolled back
here), an error that is the server's state rather than the block's answer,
and whether the server ended the session meanwhile.

The runner's statements are never named prepared statements, whatever the
connection's prepare_threshold, so they are safe behind a transaction
pooler (pgbouncer in transaction mode), where a named statement prepared
on one server connection meets another client's on the next; and their
rows are tuples, whatever the connection's row_factory."""
import contextlib
import datetime
from typing import Any, Callable, Iterator, List, NoReturn, Optional, Sequence, Tuple

import psycopg
from psycopg import generators
from psycopg.pq import Escaping, ExecStatus, TransactionStatus
from psycopg.rows import tuple_row

from .errors import IdemError

# SQLSTATE classes that are the server's state, not the block's answer
# (idem_apply's apply_error_is_servers): serialization failure and
# deadlock (40), insufficient resources (53), operator intervention (57:
# a shutdown, an operator's cancel), system errors (58), internal errors
# (XX).  Raised again, nothing recorded.
SERVER_STATE_CLASSES = ("40", "53", "57", "58", "XX")

# Of the cancels (57014), only an operator's (pg_cancel_backend, a client's
# cancel request) is the server's state: statement_timeout's is the block's
# attempt, recorded, so that idem.max_attempts ends a block that overruns
# on every delivery.  PostgreSQL tells them apart only by the message, in
# the session's lc_messages: this English text is compared, so with
# another language an operator's cancel counts as an attempt too (the C
# runner's rule; idem_apply compares the message's untranslated id).
OPERATOR_CANCEL_MESSAGE = "canceling statement due to user request"

# The runner's idem.max_attempts, for its claims' transactions.
MAX_ATTEMPTS_SQL = "SELECT pg_catalog.set_config('idem.max_attempts', %s, true)"

# A durable run's (durable=True): synchronous_commit at least on (remote_apply
# is kept) until its transaction ends, so that its commit, and a replay it is
# answered (the server's durable replays), survive a crash once answered.
DURABLE_SQL = ("SELECT pg_catalog.set_config('synchronous_commit', 'on', true) "
               "WHERE pg_catalog.current_setting('synchronous_commit') <> 'remote_apply'")

# The connection every form is given (any row factory).
Conn = psycopg.Connection[Any]

def _check_conn(conn: Any, asynchronous: bool = False) -> None:
    """idem.Runner takes a psycopg Connection, idem.aio.AsyncRunner an
    AsyncConnection."""
    if asynchronous:
        if not isinstance(conn, psycopg.AsyncConnection):
            raise IdemError("argument", "conn must be a psycopg.AsyncConnection, not %s "
                            "(idem.Runner is the synchronous runner)" % type(conn).__name__)
    elif not isinstance(conn, psycopg.Connection):
        raise IdemError("argument", "conn must be a psycopg.Connection, not %s%s"
                        % (type(conn).__name__,
                           " (the runner is synchronous: idem.aio.AsyncRunner takes an "
                           "AsyncConnection)" if isinstance(conn, psycopg.AsyncConnection)
                           else ""))


def _exec(conn: "psycopg.Connection[Any]", query: str,
          params: Optional[Sequence[Any]] = None) -> "psycopg.Cursor[Tuple[Any, ...]]":
    """One of the runner's statements: unnamed (prepare=False, one parse
    per execution, no extra round trip), rows as tuples."""
    cur = conn.cursor(row_factory=tuple_row)
    cur.execute(query, params, prepare=False)
    return cur


def _one(cur: "psycopg.Cursor[Tuple[Any, ...]]") -> Tuple[Any, ...]:
    """The one row a statement of the runner returns."""
    row = cur.fetchone()
    if row is None:
        raise IdemError("protocol", "a statement of the runner returned no row")
    return row


@contextlib.contextmanager
def _pipeline(conn: "psycopg.Connection[Any]") -> Iterator[None]:
    """conn.pipeline() whose end, after an error, stays quiet: psycopg
    would log "error ignored terminating ...: pipeline aborted" (a WARNING
    on stderr without a logging setup) for the statements after the first
    error, which is the one raised here."""
    cm = conn.pipeline()
    cm.__enter__()
    try:
        yield
    except BaseException:
        try:
            cm.__exit__(None, None, None)
        except Exception:
            pass            # what follows the first error: "pipeline aborted"
        raise
    cm.__exit__(None, None, None)


def sqlstate_of(e: BaseException) -> Optional[str]:
    """The SQLSTATE of a psycopg error, else None."""
    diag = getattr(e, "diag", None)
    state = getattr(diag, "sqlstate", None)
    return state if isinstance(state, str) else None


def server_state_error(e: Optional[BaseException]) -> Optional[BaseException]:
    """The psycopg error of a server-state class (SERVER_STATE_CLASSES, of
    the cancels an operator's only) that e is, or that e was raised from
    (its __cause__ or __context__ chain), else None."""
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, psycopg.Error):
            state = sqlstate_of(e)
            if state == "57014":
                if getattr(e.diag, "message_primary", None) == OPERATOR_CANCEL_MESSAGE:
                    return e
            elif state is not None and state[:2] in SERVER_STATE_CLASSES:
                return e
        e = e.__cause__ or e.__context__
        seen += 1
    return None


# What statement_timeout's (57014) and lock_timeout's (55P03) cancels say,
# in English (OPERATOR_CANCEL_MESSAGE's rule).
TIMEOUT_MESSAGES = (("canceling statement due to statement timeout", "57014"),
                    ("canceling statement due to lock timeout", "55P03"))


def caught_timeout(conn: Any) -> Optional[Tuple[str, str]]:
    """(sqlstate, message) of a timeout's cancel that a block caught, its
    transaction left in error: the connection's last error (libpq's
    PQerrorMessage, the only trace psycopg keeps of an error once the
    block has dropped it), when it is one; else None.  A block that sent
    more statements after it (each refused with 25P02) leaves no trace."""
    try:
        first = conn.pgconn.error_message.decode("utf-8", "replace").split("\n", 1)[0]
    except Exception:
        return None
    for message, state in TIMEOUT_MESSAGES:
        if first.endswith(message):
            return state, message
    return None


# A statement and its parameters.
Statement = Tuple[str, Optional[List[Any]]]


def _send(conn: "psycopg.Connection[Any]", statements: List[Statement],
          failed: Callable[[psycopg.Error], Tuple[bool, IdemError]], simple: bool = False
          ) -> List[Any]:
    """statements in one round trip, pipelined (their cursors) or, simple,
    as one simple query (_simple: their results).  After an error,
    failed(e) says whether to roll back, and what to raise."""
    try:
        if simple:
            return _simple(conn, statements)
        with _pipeline(conn):
            curs = [_exec(conn, sql, params) for sql, params in statements]
        return curs
    except psycopg.Error as e:
        rollback, err = failed(e)
        if rollback:
            try:
                conn.rollback()
            except psycopg.Error:
                pass
        raise err from e


def _literal(pgconn: Any, encoding: str, value: Any) -> str:
    """A parameter of the runner's own statements as SQL text: an int, a
    bool, None, a digest (bytes: hex, no backslash whatever
    standard_conforming_strings says), an interval (a timedelta of whole
    milliseconds) or a text, quoted by libpq for the connection's
    encoding (PQescapeLiteral)."""
    if value is None:
        return "NULL"
    if value is True or value is False:
        return "true" if value else "false"
    if isinstance(value, int):
        return "%d" % value
    if isinstance(value, bytes):
        return "decode('%s', 'hex')" % value.hex()
    if isinstance(value, datetime.timedelta):
        return "'%d milliseconds'" % (value // _MS)
    if isinstance(value, str):
        return Escaping(pgconn).escape_literal(value.encode(encoding)).decode(encoding)
    raise TypeError("no SQL literal for %s" % type(value).__name__)


_MS = datetime.timedelta(milliseconds=1)


def _begin(conn: Any) -> str:
    """The BEGIN psycopg sends before a statement on an idle connection
    with autocommit off: the connection's isolation level, read only and
    deferrable."""
    parts = ["BEGIN"]
    if conn.isolation_level is not None:
        parts.append("ISOLATION LEVEL " +
                     psycopg.IsolationLevel(conn.isolation_level).name.replace("_", " "))
    if conn.read_only is not None:
        parts.append("READ ONLY" if conn.read_only else "READ WRITE")
    if conn.deferrable is not None:
        parts.append("DEFERRABLE" if conn.deferrable else "NOT DEFERRABLE")
    return " ".join(parts)


def _simple_text(conn: Any, statements: List[Statement]) -> bytes:
    """statements as one simple-protocol query string, parameters as
    literals (_literal), in the connection's encoding; after psycopg's
    BEGIN (_begin) when it would send one (autocommit off, idle)."""
    pgconn = conn.pgconn
    encoding = conn.info.encoding
    texts = [sql if params is None else sql % tuple([_literal(pgconn, encoding, v) for v in params])
             for sql, params in statements]
    if not conn.autocommit and pgconn.transaction_status == TransactionStatus.IDLE:
        texts.insert(0, _begin(conn))
    return "; ".join(texts).encode(encoding)


def _simple(conn: "psycopg.Connection[Any]", statements: List[Statement]) -> List[Any]:
    """statements in one round trip as one simple-protocol query: no
    statement named or prepared (safe behind a transaction pooler) and no
    pipeline (psycopg's pipeline mode flushes and waits per statement).
    The statements run in a transaction block: begun by their first
    (BEGIN, or psycopg's BEGIN added here as psycopg adds it), or open
    already; never one implicit transaction of the query alone.  Those
    after an error do not run, and the error leaves the transaction
    aborted, for the caller to roll back.  Returns the results (psycopg's PGresult);
    the first error is raised as psycopg raises it."""
    query = _simple_text(conn, statements)
    pgconn = conn.pgconn
    with conn.lock:
        pgconn.send_query(query)
        results: List[Any] = conn.wait(generators.execute(pgconn))
    return _simple_results(conn, results)


def _simple_results(conn: Any, results: List[Any]) -> List[Any]:
    """A simple query's results (_simple), its first error raised."""
    for res in results:
        if res.status == ExecStatus.FATAL_ERROR:
            raise psycopg.errors.error_from_result(res, encoding=conn.info.encoding)
    return results


def _values(conn: Any, res: Any) -> List[Optional[str]]:
    """The one row of a simple query's result, as text (None for NULL)."""
    if res.ntuples != 1:
        raise IdemError("protocol", "a statement of the runner returned %d rows" % res.ntuples)
    encoding = conn.info.encoding
    out: List[Optional[str]] = []
    for i in range(res.nfields):
        v = res.get_value(0, i)
        out.append(None if v is None else v.decode(encoding))
    return out


def _as_is(e: psycopg.Error) -> Tuple[bool, IdemError]:
    """For _send: the statement's error itself, for the caller to judge."""
    raise e


def _raise_ending(err: Optional[IdemError], ev: Optional[BaseException]) -> None:
    """A block's end that records nothing: raise its error, if any (from
    the block's exception when the connection was lost under it)."""
    if err is None:
        return
    if ev is not None and err.code == "connection":
        raise err from ev
    raise err


def _pg_error_of(conn: Any, e: psycopg.Error, what: str) -> IdemError:
    """What a statement's error is: the connection lost, or an error of
    the server (the caller rolls back); nothing committed either way."""
    if conn.broken or conn.closed:
        return IdemError("connection", "%s: connection lost (nothing committed): %s" % (what, e))
    return IdemError("server", "%s: %s" % (what, str(e).strip()), sqlstate_of(e))


def _raise_pg_error(conn: "psycopg.Connection[Any]", e: psycopg.Error, what: str) -> NoReturn:
    """A statement's error: nothing committed (the connection lost, or the
    transaction rolled back here)."""
    err = _pg_error_of(conn, e, what)
    if err.code == "server":
        try:
            conn.rollback()
        except psycopg.Error:
            pass
    raise err from e


def _session_ended(conn: Any) -> bool:
    """Has the server ended this session (pg_terminate_backend, a restart)?
    Reads, without blocking, what it sent meanwhile (libpq reads the
    server's FATAL message, then its end of stream)."""
    for _ in range(2):
        try:
            conn.pgconn.consume_input()
        except psycopg.OperationalError:
            break
    return bool(conn.broken or conn.closed or conn.pgconn.status == psycopg.pq.ConnStatus.BAD)
