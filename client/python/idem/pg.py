"""The PostgreSQL connection as every form sees it: a statement's error
(nothing committed: the connection was lost, or the transaction is rolled
back here), and whether the server ended the session meanwhile."""
import psycopg

from .errors import IdemError


def _raise_pg_error(conn, e, what):
    """A statement's error: nothing committed (the connection lost, or the
    transaction rolled back here)."""
    if conn.broken or conn.closed:
        raise IdemError("connection", "%s: connection lost (nothing committed): %s"
                        % (what, e)) from e
    try:
        conn.rollback()
    except psycopg.Error:
        pass
    raise IdemError("server", "%s: %s" % (what, str(e).strip()),
                    getattr(e.diag, "sqlstate", None)) from e


def _session_ended(conn):
    """Has the server ended this session (pg_terminate_backend, a restart)?
    Reads, without blocking, what it sent meanwhile (libpq reads the
    server's FATAL message, then its end of stream)."""
    for _ in range(2):
        try:
            conn.pgconn.consume_input()
        except psycopg.OperationalError:
            break
    return conn.broken or conn.closed or conn.pgconn.status == psycopg.pq.ConnStatus.BAD
