"""The gated idempotency runner: the Valkey gate and replay cache in front,
PostgreSQL with the idem extension as the truth, the handler's effect in the
application's transaction.  The protocol is the C client's (client/README.md,
"One run, and its round trips" and "What the client trusts").

The top of the package: the Runner owns the Valkey client and what it
learnt of each PostgreSQL session, and offers the forms as its methods:
one run (run.py), a SQL handler (apply.py), lease mode (lease.py) and
batches (batch.py).  They see the runner through core.py's RunnerCore
and stand on result.py, errors.py, pg.py and trust.py, which import
nothing above them."""
import datetime
import functools
import inspect
import threading
import time
import uuid
import weakref
from types import TracebackType
from typing import (Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Type,
                    TypeVar, Union, cast)

import psycopg
import psycopg.sql
from psycopg.pq import TransactionStatus

from . import resp
from .apply import _ApplyContext
from .batch import Batch, cached_many
from .lease import _LeaseContext, settle
from .pg import Conn, _exec, _raise_pg_error, sqlstate_of
from .run import _RunContext
from .trust import _ConnState
from .health import Health
from . import cluster as valkey_cluster
from .check import Check, check as _check
# Defined below this module and importable from here as before (idem.runner
# was once the whole runner): the statuses, sources, Run and exceptions.
from .errors import CommitUnknown, IdemError, ValkeyClusterNotSupported
from .result import (APPLIED, BUSY, FAILED_PERMANENT, FAILED_RETRYABLE, MISMATCH,
                     REPLAYED, SOURCE_HANDLER, SOURCE_POSTGRES, SOURCE_VALKEY, Busy, Failure,
                     Mismatch, NotApplied, PermanentFailure, RetryableFailure, Run)
from .release import CAD_SCRIPT, Release, load as _load_release
from .run import MARKER_CHEAP_MS

F = TypeVar("F", bound=Callable[..., Any])
Item = Tuple[Optional[int], str, str, Any]

# What a runner learns of a session: the extension's schema, and the
# cache's keyspace and secrets (the epoch's owner key and token with them).
SCHEMA_SQL = ("SELECT quote_ident(n.nspname) FROM pg_catalog.pg_extension e "
              "JOIN pg_catalog.pg_namespace n ON n.oid = e.extnamespace "
              "WHERE e.extname = 'idem'")
KEYSPACE_SQL = "SELECT %s.idem_cache_keyspace()"
SECRETS_SQL = ("SELECT s.key_id, s.secret, s.is_current, s.owner_key, s.owner_token "
               "FROM %s.idem_cache_secrets() AS s")


def _ms(seconds: float, what: str, zero: bool = False) -> int:
    """A duration given in seconds, as the protocol's milliseconds."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise IdemError("argument", "%s is a duration in seconds (int or float), not %r"
                        % (what, seconds))
    ms = int(round(seconds * 1000))
    if not ((0 if zero else 1) <= ms <= 2147483647):
        raise IdemError("argument", "%s must be %s and at most 2147483.647 seconds"
                        % (what, "0 or more" if zero else "at least 0.001 seconds"))
    return ms


def _id_text(value: Any, what: str) -> str:
    """How the decorator turns an id into the key's text: a str as it is,
    an int in decimal (so 12 and "12" are one key), a UUID in its
    canonical form; None, an empty text and anything else are refused."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, int) and not isinstance(value, bool):
        text = str(value)
    elif isinstance(value, uuid.UUID):
        text = str(value)
    elif value is None:
        raise IdemError("argument", "%s is missing (None): a message without an id cannot be "
                        "made idempotent" % what)
    else:
        raise IdemError("argument", "%s must be a str, an int or a UUID, not %s (convert it "
                        "yourself, so that each message has one text)" % (what, type(value).__name__))
    if not text:
        raise IdemError("argument", "%s is empty: a message without an id cannot be made "
                        "idempotent" % what)
    return text


class _KeyOf:
    """The decorator's reading of a call: (tenant, run id as text,
    request, delivery count) from the arguments after conn, each spec a
    parameter name of fn, a callable of those arguments, or (tenant) a
    value."""

    def __init__(self, fn: Callable[..., Any], run_id: Any, request: Any, tenant: Any,
                 delivery_count: Any) -> None:
        self.sig = inspect.signature(fn)
        self.run_id, self.request, self.tenant = run_id, request, tenant
        self.delivery_count = delivery_count
        self.what = "the run id (%s)" % (run_id if isinstance(run_id, str) else "run_id=")

    def _pick(self, spec: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any],
              default: Any = None) -> Any:
        if callable(spec):
            return spec(*args, **kwargs)
        if isinstance(spec, str):
            bound = self.sig.bind(None, *args, **kwargs)
            bound.apply_defaults()
            return bound.arguments[spec]
        return spec if spec is not None else default

    def __call__(self, args: Tuple[Any, ...],
                 kwargs: Dict[str, Any]) -> Tuple[Any, str, Any, int]:
        rid = _id_text(self._pick(self.run_id, args, kwargs), self.what)
        req = self._pick(self.request, args, kwargs, default=args[0] if args else None)
        dc = self._pick(self.delivery_count, args, kwargs, default=0) \
            if self.delivery_count else 0
        return self._pick(self.tenant, args, kwargs), rid, req, dc or 0


def _check_idle(conn: Any, whose: str) -> None:
    """A form that begins and commits its own transaction (whose, say
    which) is given an idle connection, or raises."""
    if conn.info.transaction_status != TransactionStatus.IDLE:
        raise IdemError("state", "the connection must be idle (no transaction open): " + whose)


def _outcome_or_raise(run: Run) -> Any:
    """What a decorated function answers: the outcome (applied or
    replayed), else an exception saying why not."""
    if run.status in (APPLIED, REPLAYED):
        return run.outcome
    if run.status == BUSY:
        raise Busy(run, "busy: retry after %.3f s" % (run.retry_after or 0.0))
    if run.status == MISMATCH:
        raise Mismatch(run, "the key was used with another request")
    if run.status == FAILED_PERMANENT:
        raise PermanentFailure(run.outcome, result=run)
    raise RetryableFailure(run.outcome, result=run)


#: The longest re-learn bound a runner uses, in ms: secrets_max_age 0 and
#: anything longer are capped (IDEM_SECRETS_MAX_AGE_MAX_MS in the C client).
SECRETS_MAX_AGE_MAX_MS = 60000


def relearn_bound_ms(ms: int) -> int:
    """The re-learn bound a runner uses for secrets_max_age (in ms): the
    maximum for 0 or anything above it, as given from 1 ms to it.  It is the
    last line of defence: while the server cannot reach Valkey to retire a
    history epoch it left, a runner that learnt that epoch trusts it until
    it learns again."""
    if ms == 0 or ms > SECRETS_MAX_AGE_MAX_MS:
        return SECRETS_MAX_AGE_MAX_MS
    return ms


def _close_client(client: Any) -> None:
    """Close the connections of a redis-py client (a Redis or a
    RedisCluster): redis-py 4's close() leaves its pools' connections
    open."""
    from redis.cluster import RedisCluster
    nodes = [n.redis_connection for n in client.get_nodes()] \
        if isinstance(client, RedisCluster) else [client]
    for c in nodes:
        if c is not None:
            c.connection_pool.disconnect()
    client.close()


# A plain client of one node of a Valkey Cluster.
CLUSTER_REFUSED = ("this Valkey is a cluster node (cluster_enabled:1) and the client given "
                   "speaks to one node: pass (host, port) or a cluster client, so that each "
                   "key goes to its slot's master")


class Runner:
    """A gated idempotency runner.

    ``valkey``: ``(host, port)``, a ``redis.Redis`` or
    ``redis.cluster.RedisCluster`` client, or None for PostgreSQL only.
    Valkey may be down: the runner then decides on PostgreSQL alone and
    leaves Valkey alone for ``valkey_retry_ms``.  ``(host, port)`` of a
    Valkey Cluster node is routed by slot (RedisCluster, seeded there); a
    plain ``redis.Redis`` client of a cluster node is refused
    (ValkeyClusterNotSupported).

    A runner may be shared by threads; each run uses the connection it is
    given, which must not be used by another thread meanwhile.

    ``close()`` (or ``with idem.Runner(...) as runner:``) closes the
    Valkey connections the runner made; a client given is the caller's.
    """

    def __init__(self, valkey: Any = None, *, lease: float = 30.0,
                 retention: Optional[float] = None, lookup_first: bool = True,
                 secrets_max_age: float = 5.0, valkey_timeout: float = 0.2,
                 valkey_retry: float = 1.0, schema: Optional[str] = None,
                 notice: Optional[Callable[[str], None]] = None,
                 max_attempts: Optional[int] = None) -> None:
        # durations are seconds (int or float); the protocol's are milliseconds
        self.lease_ms = _ms(lease, "lease")
        if max_attempts is not None and not (0 <= int(max_attempts) <= 2147483647):
            raise IdemError("argument", "max_attempts must be None, 0 (no limit) or positive")
        # None: the session's idem.max_attempts; else SET LOCAL in each claim
        self.max_attempts = None if max_attempts is None else int(max_attempts)
        # None: the server's idem.retention; else an interval parameter
        self.retention = None if retention is None else \
            datetime.timedelta(milliseconds=_ms(retention, "retention"))
        self.lookup_first = lookup_first
        self.secrets_max_age_ms = relearn_bound_ms(
            _ms(secrets_max_age, "secrets_max_age", zero=True))
        valkey_timeout_ms = _ms(valkey_timeout, "valkey_timeout")
        self.valkey_retry_ms = _ms(valkey_retry, "valkey_retry", zero=True)
        self.schema = schema
        self.notice = notice
        self._lock = threading.Lock()
        self._conns: "weakref.WeakKeyDictionary[Conn, _ConnState]" = weakref.WeakKeyDictionary()
        self._rest_until = 0.0
        self._cluster_checked = False
        self._is_cluster = False        # a RedisCluster: cluster.execute's round trips
        self._refresh_map = False       # its slot map read again before the next
        self._cad: Any = None
        self.stats = {"runs": 0, "cache_rejected": 0, "valkey_errors": 0,
                      "replayed_from_valkey": 0, "gate_skipped_first": 0,
                      "owner_mismatches": 0, "valkey_auth_failures": 0,
                      "valkey_not_servers": 0, "notices": 0}
        self._health = Health(self)
        self._seed = None                   # (host, port): ours to route if a cluster
        self._timeout = valkey_timeout_ms / 1000.0
        self.valkey: Any = None     # a redis.Redis or RedisCluster client, or None
        # the clients made from (host, port): ours to close
        self._own_clients: List[Any] = []
        if isinstance(valkey, tuple):
            host, port = valkey
            self._seed = (host, int(port))
            valkey = self._client(host, int(port))
            self._own_clients.append(valkey)
        if valkey is not None:
            self.valkey = valkey
            self._cad = self._release_of(valkey)
            self._first_contact()

    # ---- Valkey ----
    def _client(self, host: str, port: int) -> Any:
        """The client of a Valkey given as (host, port)."""
        import redis
        return redis.Redis(host=host, port=port, socket_timeout=self._timeout,
                           socket_connect_timeout=self._timeout)

    def _release_of(self, client: Any) -> Any:
        """The compare-and-delete of our marker on client."""
        from redis.cluster import RedisCluster
        return Release(client, valkey_cluster.execute if isinstance(client, RedisCluster)
                       else None)

    def _first_contact(self) -> None:
        """At construction: a plain client of a cluster node is refused;
        a Valkey down, or refusing AUTH, is told now (as the C runner does
        at open), rested, and checked again on a later contact."""
        try:
            self._check_cluster()
        except ValkeyClusterNotSupported:
            raise
        except Exception as e:
            self._valkey_failed(e)

    def _check_cluster(self) -> None:
        """On first contact: is this a Valkey Cluster node?  Then route by
        key with redis-py's RedisCluster (given (host, port), or a
        RedisCluster), or refuse a plain client of one node."""
        if self._cluster_checked:
            return
        with valkey_cluster.quiet():
            self._route()

    def _route(self) -> None:
        """_check_cluster's work, the first time."""
        from redis.cluster import RedisCluster
        if isinstance(self.valkey, RedisCluster):
            _load_release(self.valkey)
            self._is_cluster = True
            self._cluster_checked = True
            return
        info = self.valkey.info("cluster")
        if int(info.get("cluster_enabled", 0)) == 1:
            if self._seed is None:
                raise ValkeyClusterNotSupported(CLUSTER_REFUSED)
            with self._lock:
                if not isinstance(self.valkey, RedisCluster):
                    # every command touches one key: no hash tags, no cross-slot
                    cluster = RedisCluster(host=self._seed[0], port=self._seed[1],
                                           socket_timeout=self._timeout,
                                           socket_connect_timeout=self._timeout,
                                           cluster_error_retry_attempts=1)
                    self._cad = self._release_of(cluster)
                    seed, self.valkey = self.valkey, cluster
                    self._own_clients = [cluster]
                    _close_client(seed)     # the seed node's plain client, ours
        _load_release(self.valkey)
        self._is_cluster = isinstance(self.valkey, RedisCluster)
        self._cluster_checked = True

    def close(self) -> None:
        """Close the Valkey connections the runner made: its client made
        from ``(host, port)`` and its own direct connections (a client
        given is the caller's to close).  A run after it connects again."""
        direct, self._direct = self._direct, None
        if direct is not None:
            direct.close()
        for client in self._own_clients:
            _close_client(client)

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, et: Optional[Type[BaseException]], ev: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.close()

    def _valkey_ok(self) -> bool:
        return self.valkey is not None and time.monotonic() >= self._rest_until

    def _valkey_failed(self, e: BaseException) -> None:
        """Valkey failed (down, AUTH refused or wanted, an error reply):
        counted, told to the "idem" logger, and rested (health.py)."""
        self._health.failed(e)

    # the runner's own connections to a plain Valkey (resp.Direct), made
    # on the first packed round trip to it
    _direct: Optional[resp.Direct] = None

    def _round_trip(self, fill: Callable[[Any], Any],
                    packed: Optional[Tuple[bytes, int]] = None) -> Optional[List[Any]]:
        """One pipelined round trip to Valkey, fill(pipe) queueing its
        commands: the replies (an error reply among them as an exception),
        or None when Valkey failed (counted, and rested: PostgreSQL
        decides).  packed: the same commands in RESP and their count, sent
        as they are on a plain client, on a connection of the runner's own
        (resp.Direct)."""
        try:
            self._check_cluster()
            if packed is not None and resp.plain(self.valkey):
                direct = self._direct
                if direct is None or direct.client is not self.valkey:
                    direct = self._direct = resp.Direct(self.valkey)
                return direct.exchange(packed[0], packed[1])
            pipe = fill(self.valkey.pipeline(transaction=False))
            if self._is_cluster:
                if self._refresh_map:
                    self._refresh_map = False
                    valkey_cluster.refresh(self.valkey)
                return valkey_cluster.execute(pipe)
            return list(pipe.execute(raise_on_error=False))
        except Exception as e:
            self._refresh_map = self._is_cluster    # a failover may have moved its slots
            self._round_trip_failed(e)
            return None

    def _round_trip_failed(self, e: Exception) -> None:
        """Valkey failed (down, slow, an error): counted and rested; a
        refused cluster client is raised."""
        if isinstance(e, ValkeyClusterNotSupported):
            raise e
        self._valkey_failed(e)

    def _release(self, ckey: bytes, marker: bytes) -> None:
        """Compare-and-delete our marker (never GET then DEL)."""
        if not self._valkey_ok():
            return
        try:
            self._cad(keys=[ckey], args=[marker])
        except Exception as e:
            self._refresh_map = self._is_cluster
            self._valkey_failed(e)

    # ---- PostgreSQL: what the server says about its cache ----
    def _end_tx(self, conn: Conn) -> None:
        if conn.info.transaction_status != TransactionStatus.IDLE:
            if conn.info.transaction_status == TransactionStatus.INTRANS:
                conn.commit()
            else:
                conn.rollback()

    def _conn_state(self, conn: Any) -> _ConnState:
        """What the runner knows of conn's session (new if the session is)."""
        pid = conn.pgconn.backend_pid
        st = self._conns.get(conn)
        if st is not None and st.backend_pid == pid:
            return st
        with self._lock:
            st = self._conns.get(conn)
            if st is None or st.backend_pid != pid:
                st = _ConnState(pid)
                self._conns[conn] = st
        return st

    def _schema_of(self, conn: Any, row: Optional[Tuple[Any, ...]]) -> str:
        """The extension's schema, quoted: the runner's, or SCHEMA_SQL's row."""
        if self.schema is not None:
            return psycopg.sql.Identifier(self.schema).as_string(conn)
        if row is None:
            raise IdemError("not_installed", "the idem extension is not installed in "
                            "database %r: CREATE EXTENSION idem" % conn.info.dbname)
        return str(row[0])

    def _wants_learning(self, st: _ConnState) -> bool:
        """Learn the keyspace and secrets now?  When the session is new, a
        second after an unknown key id, a 55000 or an owner key that did
        not hold the server's token, and at least every secrets_max_age."""
        if self.valkey is None:
            return False
        if st.learnt is None:
            return True
        age = (time.monotonic() - st.learnt) * 1000
        return (st.refresh_wanted and (age >= 1000 or (st.owner_suspect and
                                                       not st.owner_relearnt))) or \
            (st.keyspace is not None and age >= self.secrets_max_age_ms)

    def _learning_refused(self, st: _ConnState, e: psycopg.Error) -> None:
        """The server would not say (55000: not ready, recovery, or the
        worker has not yet taken its cache epoch over in Valkey, or no
        preloading: ask again in a second)."""
        sqlstate = sqlstate_of(e)
        st.forget(retry_soon=sqlstate == "55000")
        self._health.cache_off("no Valkey cache on this connection (%s %s): PostgreSQL decides"
                               % (sqlstate, str(e).strip()))

    def _state(self, conn: Conn) -> _ConnState:
        """The session's state, learning the schema and (with Valkey) the
        keyspace and secrets when _wants_learning says."""
        st = self._conn_state(conn)
        if not st.schema:
            row = None
            if self.schema is None:
                row = _exec(conn, SCHEMA_SQL).fetchone()
                self._end_tx(conn)
            st.schema = self._schema_of(conn, row)
        if self._wants_learning(st):
            self._learn(conn, st)
        return st

    def _idle_state(self, conn: Conn, whose: str) -> _ConnState:
        """The session's state for a form that begins and commits its own
        transaction (whose, say which): conn must be idle."""
        _check_idle(conn, whose)
        try:
            return self._state(conn)
        except psycopg.Error as e:
            _raise_pg_error(conn, e, "learning the schema")

    def _learn(self, conn: Conn, st: _ConnState) -> None:
        st.start_learning()
        try:
            row = _exec(conn, KEYSPACE_SQL % st.schema).fetchone()
            rows = _exec(conn, SECRETS_SQL % st.schema).fetchall()
            self._end_tx(conn)
        except psycopg.Error as e:
            if conn.broken or conn.closed:
                raise IdemError("connection", "connection lost: %s" % e) from e
            self._end_tx(conn)
            self._learning_refused(st, e)
            return
        st.adopt(None if row is None else row[0], rows)

    def check(self, conn: "psycopg.Connection[Any]") -> Check:
        """The start-up check, as libpq's PQping: PostgreSQL answers on
        ``conn`` (idle), the idem extension is installed (its version), the
        role may read the cache keyspace and secrets, Valkey answers (AUTH
        accepted), and its epoch owner key holds the token the server
        names (the same Valkey as the server's worker), with each server's
        round trip time.  Returns a Check (false when something is wrong:
        ``status`` and ``message`` say what); raises nothing for what it
        finds."""
        return _check(self, conn)

    # ---- the run ----
    def run(self, conn: Conn, tenant_id: Optional[int], scope: str, run_id: str,
            request: Any, *, delivery_count: int = 0, first_sql: Optional[str] = None,
            first_params: Optional[Sequence[Any]] = None, durable: bool = False) -> _RunContext:
        """A context manager: ``with runner.run(conn, 42, "billing.charge",
        run_id, request) as run:`` then ``if run.claimed:`` do the effect on
        ``conn`` and set ``run.outcome``.  See the package README.

        ``delivery_count``: how many times the queue has delivered the
        message, this one included (0: unknown); 1 skips the Valkey gate.
        ``first_sql`` (with ``first_params``): the block's first statement,
        sent with the claim; its rows are ``run.first`` (None unless
        claimed).  ``durable``: the run's transaction sets
        synchronous_commit to at least on, locally, whatever the session's:
        its answer (applied, failed, or replayed from PostgreSQL) survives
        a crash of the server once returned, so the message may be
        acknowledged; the stream consumers' runs are durable."""
        return _RunContext(self, conn, tenant_id, scope, run_id, request,
                           delivery_count=delivery_count, first_sql=first_sql,
                           first_params=first_params, durable=durable)

    def call(self, conn: Conn, tenant_id: Optional[int], scope: str, run_id: str,
             request: Any, handler: Callable[[Conn, Run], Any], *, delivery_count: int = 0,
             first_sql: Optional[str] = None,
             first_params: Optional[Sequence[Any]] = None, durable: bool = False) -> Run:
        """Run ``handler(conn, run)`` at most once per key, in the run's
        transaction; it returns the outcome (a dict; None means {}) or
        raises PermanentFailure / RetryableFailure to record a failure.
        Returns the Run (status, source, outcome...).  Any other exception
        is recorded as a retryable failure and propagates (one of the
        server's state, a serialization failure say, is not recorded)."""
        with self.run(conn, tenant_id, scope, run_id, request, delivery_count=delivery_count,
                      first_sql=first_sql, first_params=first_params, durable=durable) as run:
            if run.claimed:
                try:
                    out = handler(conn, run)
                except Failure as f:
                    run.fail(f.detail, retryable=f.retryable)
                else:
                    run.outcome = {} if out is None else out
        return run

    def idempotent(self, scope: str, *, run_id: Union[str, Callable[..., Any]],
                   request: Union[None, str, Callable[..., Any]] = None,
                   tenant: Union[None, int, str, Callable[..., Any]] = None,
                   delivery_count: Union[None, str, Callable[..., Any]] = None
                   ) -> Callable[[F], F]:
        """A decorator for ``fn(conn, *args, **kwargs)``: the outcome of its
        one run is returned to every delivery (applied or replayed).

        ``run_id``, ``request`` and ``tenant`` are each a parameter name of
        ``fn`` or a callable taking fn's arguments after ``conn``; ``tenant``
        may also be an int, or None for the platform ledger; ``request``
        None is the first argument after ``conn``.  The id becomes the
        key's text: a str as it is, an int in decimal (12 and "12" are one
        key), a UUID in its canonical form; None, an empty text or another
        type raise IdemError("argument") before anything is claimed.
        Other answers raise: Busy (``retry_after``), Mismatch,
        PermanentFailure and RetryableFailure (``detail``: recorded now or
        replayed), and the IdemError family (CommitUnknown...).
        ``delivery_count``, a parameter name or callable too, is the
        queue's delivery count (see ``run``)."""
        def deco(fn: F) -> F:
            key_of = _KeyOf(fn, run_id, request, tenant, delivery_count)

            @functools.wraps(fn)
            def wrapper(conn: Conn, *args: Any, **kwargs: Any) -> Any:
                ten, rid, req, dc = key_of(args, kwargs)
                return _outcome_or_raise(self.call(conn, ten, scope, rid, req,
                                                   lambda c, r: fn(c, *args, **kwargs),
                                                   delivery_count=dc))
            return cast(F, wrapper)
        return deco

    # ---- the forms beyond one run in the runner's transaction ----
    def apply(self, conn: Conn, tenant_id: Optional[int], scope: str, run_id: str,
              request: Any, sql_handler: str, *, args: Any = None,
              delivery_count: int = 0, durable: bool = False) -> Run:
        """The effect is the SQL function ``sql_handler`` (regprocedure
        text, ``"charge(jsonb)"``: ``(args jsonb) RETURNS jsonb``, the
        outcome), run by the extension's idem_apply: claim, effect and
        completion are one statement, one round trip, committed by
        itself.  ``args`` (JSON) is passed to it; None: the request.
        Returns the Run; an error the function raises is recorded as a
        failure (failed_permanent or failed_retryable, its sqlstate and
        message as the detail).  ``durable``: as for ``run``."""
        with _ApplyContext(self, conn, tenant_id, scope, run_id, request, sql_handler,
                           args=args, delivery_count=delivery_count, durable=durable) as run:
            pass
        return run

    def lease(self, conn: Conn, tenant_id: Optional[int], scope: str, run_id: str,
              request: Any, *, lease: Optional[float] = None,
              delivery_count: int = 0) -> _LeaseContext:
        """Lease mode, for an effect outside PostgreSQL: ``with
        runner.lease(conn, ...) as lease:`` then ``if lease.claimed:`` do
        the effect and set ``lease.outcome``.  The claim commits alone
        with a lease of ``lease`` seconds (default: the runner's); after
        the block the completion, fenced by ``lease.fence``, commits in
        a transaction of its own (LeaseLost if another claim took the
        key over).  ``lease.defer()`` leaves the completion to
        ``runner.complete``."""
        return _LeaseContext(self, conn, tenant_id, scope, run_id, request,
                             lease_ms=None if lease is None else _ms(lease, "lease"),
                             delivery_count=delivery_count)

    def complete(self, conn: Conn, tenant_id: Optional[int], scope: str, run_id: str,
                 outcome: Any = None, *, fence: Optional[int] = None,
                 attempt: Optional[int] = None) -> str:
        """Complete a key claimed in lease mode, fenced by the claim's
        ``fence`` (``lease.fence``), in the connection's transaction (it
        commits by itself on an autocommit connection).  LeaseLost if
        another claim took the key over.  ``attempt`` instead of ``fence``
        is the older, weaker fence: once the claim's row is purged, the
        key's next claim is attempt 1 again.  Returns the status recorded:
        ``applied``, or, for an outcome the ledger cannot store (not a
        JSON object, over 4096 bytes), the failure a lease's block
        records for it (``failed_permanent`` 22023, ``failed_retryable``
        54000)."""
        return settle(self, conn, tenant_id, scope, run_id, attempt, outcome=outcome, fence=fence)

    def fail(self, conn: Conn, tenant_id: Optional[int], scope: str, run_id: str,
             detail: Any = None, *, fence: Optional[int] = None,
             attempt: Optional[int] = None, retryable: bool = False) -> str:
        """Fail a key claimed in lease mode, as ``complete``: returns the
        status recorded (``failed_retryable`` or ``failed_permanent``)."""
        return settle(self, conn, tenant_id, scope, run_id, attempt,
               failure=({} if detail is None else detail, retryable), fence=fence)

    def batch(self, conn: Conn, items: Iterable[Item]) -> Batch:
        """Many deliveries at once: ``items`` are (tenant, scope, run_id,
        request).  ``with runner.batch(conn, items) as batch:`` then, for
        each run of ``batch.claimed``, the effect on ``conn`` and
        ``run.outcome``; every Run is in ``batch.runs`` (in order) with its
        status after the block.  Valkey answers what it can in one
        pipelined GET, one idem_claim_many claims the rest, one round trip
        completes, fails and commits."""
        return Batch(self, conn, items)

    def cached(self, conn: Conn, tenant_id: Optional[int], scope: str, run_id: str,
               request: Any) -> Optional[Run]:
        """Valkey alone (one GET, no marker, no transaction): the Run,
        replayed or failed_permanent, when the cache holds this key's
        verified result for the same request; else None (PostgreSQL
        decides)."""
        return self.cached_many(conn, [(tenant_id, scope, run_id, request)])[0]

    def cached_many(self, conn: Conn, items: Iterable[Item]) -> List[Optional[Run]]:
        """``cached`` for many (tenant, scope, run_id, request) in one
        pipelined round trip (one per node on a cluster): a list of Run or
        None, in order."""
        return cached_many(self, conn, items)
