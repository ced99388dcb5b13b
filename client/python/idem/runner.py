"""The gated idempotency runner: the Valkey gate and replay cache in front,
PostgreSQL with the idem extension as the truth, the handler's effect in the
application's transaction.  The protocol is the C client's (client/README.md,
"One run, and its round trips" and "What the client trusts")."""
import functools
import hashlib
import inspect
import json
import os
import threading
import time
import weakref

import psycopg
import psycopg.sql
from psycopg.pq import TransactionStatus

from . import cache
from .canonical import RequestError, canonical_json, idem_key

# Statuses (the C client's idem_status_name) and sources.
APPLIED = "applied"
REPLAYED = "replayed"
BUSY = "busy"
MISMATCH = "mismatch"
FAILED_PERMANENT = "failed_permanent"
FAILED_RETRYABLE = "failed_retryable"
SOURCE_HANDLER = "handler"
SOURCE_VALKEY = "valkey"
SOURCE_POSTGRES = "postgres"
# How long another run's marker answers its duplicates "busy" from Valkey
# alone; after that the claim decides (a dead runner's marker).
MARKER_CHEAP_MS = 1000

# KEYS[1] = key, ARGV[1] = our marker: delete it only if it is still ours.
# The same text as client/release.c, so the same SHA-1 for EVALSHA
# (tests/test_unit.py compares the two, and that SHA-1, byte for byte).
CAD_SCRIPT = ("if redis.call('GET', KEYS[1]) == ARGV[1] then\n"
              "  return redis.call('DEL', KEYS[1])\n"
              "end\n"
              "return 0\n")


class IdemError(Exception):
    """The run could not be decided; redeliver.  ``code`` says why:
    ``request`` (not JSON jsonb accepts), ``outcome`` (not a JSON object of
    at most 4096 bytes: rolled back), ``connection`` (the PostgreSQL
    connection was lost before COMMIT was sent: nothing committed),
    ``server`` (an error from PostgreSQL, ``sqlstate``; rolled back),
    ``handler`` (the block left the transaction in error), ``handler_ended_tx``
    (the block committed or rolled back the runner's transaction), ``state``
    (the connection was not idle when the run began)."""

    def __init__(self, code, message, sqlstate=None):
        super().__init__(message)
        self.code = code
        self.sqlstate = sqlstate


class CommitUnknown(IdemError):
    """The connection was lost after COMMIT was sent: the effect and its key
    committed together or not at all, and which is unknown.  Redeliver: the
    ledger decides (a replay if it committed)."""

    def __init__(self, message):
        super().__init__("commit_unknown", message)


class ValkeyClusterNotSupported(IdemError):
    def __init__(self, message):
        super().__init__("valkey_cluster", message)


# What a decorated function raises when it did not return an outcome.
class NotApplied(Exception):
    """Base of the decorator's answers other than an outcome; ``result``
    is the Run."""

    def __init__(self, result, message):
        super().__init__(message)
        self.result = result


class Busy(NotApplied):
    """Another delivery holds the key: retry after ``retry_after`` seconds."""

    @property
    def retry_after(self):
        return self.result.retry_after


class Mismatch(NotApplied):
    """The key was used with another request."""


class Failure(Exception):
    """Raise from a handler to record a failure with ``detail`` (a JSON
    object); the decorator raises its subclasses for recorded failures."""
    retryable = False

    def __init__(self, detail=None, result=None):
        super().__init__(json.dumps(detail) if detail is not None else "")
        self.detail = {} if detail is None else detail
        self.result = result


class PermanentFailure(Failure):
    """Recorded as failed_permanent: replayed to every later delivery."""
    retryable = False


class RetryableFailure(Failure):
    """Recorded as failed_retryable: the next delivery runs attempt + 1."""
    retryable = True


def _wall_ms():
    return int(time.time() * 1000)


class _ConnState:
    """What a runner knows about one PostgreSQL session."""

    def __init__(self, backend_pid):
        self.backend_pid = backend_pid
        self.schema = None
        self.keyspace = None        # None: no cache on this connection
        self.secrets = {}
        self.current = None
        self.learnt = None          # monotonic time of the last learning
        self.refresh_wanted = False
        # the history epoch's owner key and the token it holds while the
        # server owns the epoch: read with every lookup, a value counts only
        # if it still holds the token
        self.owner_key = None
        self.owner_token = None
        self.owner_suspect = False  # it did not: no cache until learnt
        self.owner_relearnt = False  # learnt at once after a mismatch, and
        # no check passed since: the next learning waits the second


class Run:
    """One run: what the block sees (``claimed``, ``attempt``, ``request``)
    and, once decided, the result (``status``, ``source``, ``outcome``,
    ``retry_after``)."""

    def __init__(self, tenant_id, scope, run_id, request_text, key, fp):
        self.tenant_id = tenant_id
        self.scope = scope
        self.run_id = run_id
        self.request = request_text         # canonical JSON text
        self.key = key
        self.fingerprint = fp
        self.status = None
        self.source = None
        self.attempt = None
        self.outcome = None
        self.retry_after_ms = None
        self.valkey_used = False
        self.claimed = False
        self.first = None                   # first_sql's rows, once claimed
        self.first_error = None             # or its error (the transaction is in error)
        self.error = None                   # the exception a batch step recorded
        self._failure = None                # (detail, retryable) from fail()

    @property
    def retry_after(self):
        """Seconds to wait before redelivering (busy), else None."""
        return None if self.retry_after_ms is None else self.retry_after_ms / 1000.0

    @property
    def done(self):
        """applied or replayed: the effect is in the ledger; ack."""
        return self.status in (APPLIED, REPLAYED)

    def fail(self, detail=None, retryable=False):
        """Inside the block: record a failure instead of completing (the
        block's statements are rolled back to the savepoint)."""
        if not self.claimed:
            raise IdemError("state", "fail() on a run that was not claimed")
        self._failure = ({} if detail is None else detail, bool(retryable))

    def __repr__(self):
        return "Run(status=%r, source=%r, attempt=%r, outcome=%r, retry_after_ms=%r)" % (
            self.status, self.source, self.attempt, self.outcome, self.retry_after_ms)


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
    """

    def __init__(self, valkey=None, *, lease_ms=30000, retention=None,
                 lookup_first=True, secrets_max_age_ms=5000,
                 valkey_timeout_ms=200, valkey_retry_ms=1000, schema=None,
                 notice=None, max_attempts=None):
        if not (0 < int(lease_ms) <= 2147483647):
            raise ValueError("lease_ms must be positive")
        if max_attempts is not None and not (0 <= int(max_attempts) <= 2147483647):
            raise ValueError("max_attempts must be None, 0 (no limit) or positive")
        self.lease_ms = int(lease_ms)
        # None: the session's idem.max_attempts; else SET LOCAL in each claim
        self.max_attempts = None if max_attempts is None else int(max_attempts)
        self.retention = retention          # interval text, None: idem.retention
        self.lookup_first = lookup_first
        self.secrets_max_age_ms = secrets_max_age_ms
        self.valkey_retry_ms = valkey_retry_ms
        self.schema = schema
        self.notice = notice
        self._lock = threading.Lock()
        self._conns = weakref.WeakKeyDictionary()
        self._rest_until = 0.0
        self._cluster_checked = False
        self._cad = None
        self.stats = {"runs": 0, "cache_rejected": 0, "valkey_errors": 0,
                      "replayed_from_valkey": 0, "gate_skipped_first": 0,
                      "owner_mismatches": 0}
        self._seed = None                   # (host, port): ours to route if a cluster
        self._timeout = valkey_timeout_ms / 1000.0
        if valkey is None:
            self.valkey = None
        elif isinstance(valkey, tuple):
            import redis
            host, port = valkey
            self._seed = (host, int(port))
            self.valkey = redis.Redis(host=host, port=int(port), socket_timeout=self._timeout,
                                      socket_connect_timeout=self._timeout)
        else:
            self.valkey = valkey
        if self.valkey is not None:
            self._cad = self.valkey.register_script(CAD_SCRIPT)
            try:
                self._check_cluster()
            except ValkeyClusterNotSupported:
                raise
            except Exception:
                pass            # down now: checked on first contact

    # ---- Valkey ----
    def _check_cluster(self):
        """On first contact: is this a Valkey Cluster node?  Then route by
        key with redis-py's RedisCluster (given (host, port), or a
        RedisCluster), or refuse a plain client of one node."""
        if self._cluster_checked:
            return
        from redis.cluster import RedisCluster
        if isinstance(self.valkey, RedisCluster):
            self._cluster_checked = True
            return
        info = self.valkey.info("cluster")
        if int(info.get("cluster_enabled", 0)) == 1:
            if self._seed is None:
                raise ValkeyClusterNotSupported(
                    "this Valkey is a cluster node (cluster_enabled:1) and the client given "
                    "speaks to one node: pass (host, port) or a redis.cluster.RedisCluster, "
                    "so that each key goes to its slot's master")
            with self._lock:
                if not isinstance(self.valkey, RedisCluster):
                    # every command touches one key: no hash tags, no cross-slot
                    cluster = RedisCluster(host=self._seed[0], port=self._seed[1],
                                           socket_timeout=self._timeout,
                                           socket_connect_timeout=self._timeout,
                                           cluster_error_retry_attempts=1)
                    self._cad = cluster.register_script(CAD_SCRIPT)
                    self.valkey = cluster
        self._cluster_checked = True

    def _valkey_ok(self):
        return self.valkey is not None and time.monotonic() >= self._rest_until

    def _valkey_failed(self, e):
        import redis
        self.stats["valkey_errors"] += 1
        if isinstance(e, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                          redis.exceptions.RedisClusterException, redis.exceptions.ClusterError,
                          OSError)):
            self._rest_until = time.monotonic() + self.valkey_retry_ms / 1000.0
            if self.notice:
                self.notice("Valkey unavailable (%s): running on PostgreSQL only for %d ms"
                            % (e, self.valkey_retry_ms))

    def _release(self, ckey, marker):
        """Compare-and-delete our marker (never GET then DEL)."""
        if not self._valkey_ok():
            return
        try:
            self._cad(keys=[ckey], args=[marker])
        except Exception as e:
            self._valkey_failed(e)

    # ---- PostgreSQL: what the server says about its cache ----
    def _end_tx(self, conn):
        if conn.info.transaction_status != TransactionStatus.IDLE:
            conn.commit() if conn.info.transaction_status == TransactionStatus.INTRANS \
                else conn.rollback()

    def _state(self, conn):
        """The session's state, learning the schema and (with Valkey) the
        keyspace and secrets when the session is new, a second after an
        unknown key id, a 55000 or an owner key that did not hold the
        server's token, and at least every secrets_max_age_ms."""
        pid = conn.info.backend_pid
        with self._lock:
            st = self._conns.get(conn)
        if st is None or st.backend_pid != pid:
            st = _ConnState(pid)
            with self._lock:
                self._conns[conn] = st
        if st.schema is None:
            if self.schema is not None:
                st.schema = psycopg.sql.Identifier(self.schema).as_string(conn)
            else:
                row = conn.execute(
                    "SELECT quote_ident(n.nspname) FROM pg_extension e "
                    "JOIN pg_namespace n ON n.oid = e.extnamespace "
                    "WHERE e.extname = 'idem'").fetchone()
                self._end_tx(conn)
                if row is None:
                    raise IdemError("server", "the idem extension is not installed in this database")
                st.schema = row[0]
        if self.valkey is None:
            return st
        now = time.monotonic()
        age = None if st.learnt is None else (now - st.learnt) * 1000
        if age is None or (st.refresh_wanted and (age >= 1000 or (
                st.owner_suspect and not st.owner_relearnt))) or \
                (st.keyspace is not None and self.secrets_max_age_ms and
                 age >= self.secrets_max_age_ms):
            self._learn(conn, st)
        return st

    def _learn(self, conn, st):
        st.learnt = time.monotonic()
        st.refresh_wanted = False
        st.owner_relearnt = st.owner_suspect
        st.owner_suspect = False
        try:
            ks = conn.execute("SELECT %s.idem_cache_keyspace()" % st.schema).fetchone()[0]
            rows = conn.execute("SELECT s.key_id, s.secret, s.is_current, s.owner_key, s.owner_token "
                                "FROM %s.idem_cache_secrets() AS s" % st.schema).fetchall()
            self._end_tx(conn)
        except psycopg.errors.Error as e:
            if conn.broken or conn.closed:
                raise IdemError("connection", "connection lost: %s" % e) from e
            self._end_tx(conn)
            sqlstate = getattr(e.diag, "sqlstate", None)
            st.keyspace, st.secrets, st.current = None, {}, None
            # 55000: not ready (recovery, or the worker has not yet taken its
            # cache epoch over in Valkey, or no preloading): ask again in a second
            st.refresh_wanted = sqlstate == "55000"
            if self.notice:
                self.notice("no Valkey cache on this connection (%s %s): PostgreSQL decides"
                            % (sqlstate, str(e).strip()))
            return
        secrets, current, owner = {}, None, None
        for key_id, secret, is_current, owner_key, owner_token in rows:
            if key_id is None or secret is None or not (0 < key_id <= cache.KEY_ID_MAX) \
                    or len(secret) != cache.MAC_LEN:
                continue
            secrets[key_id] = bytes(secret)
            if is_current:
                current, owner = key_id, (owner_key, owner_token)
        if ks is None or current is None:
            st.keyspace, st.secrets, st.current = None, {}, None
            return
        if not cache.owner_ok(ks, *owner):
            # not taken over yet, or the keyspace is of another epoch: soon
            st.keyspace, st.secrets, st.current = None, {}, None
            st.refresh_wanted = True
            return
        st.keyspace, st.secrets, st.current = ks, secrets, current
        st.owner_key, st.owner_token = owner[0].encode("ascii"), owner[1].encode("ascii")

    # ---- the run ----
    def run(self, conn, tenant_id, scope, run_id, request, *, delivery_count=0,
            first_sql=None, first_params=None):
        """A context manager: ``with runner.run(conn, 42, "billing.charge",
        run_id, request) as run:`` then ``if run.claimed:`` do the effect on
        ``conn`` and set ``run.outcome``.  See the package README.

        ``delivery_count``: how many times the queue has delivered the
        message, this one included (0: unknown); 1 skips the Valkey gate.
        ``first_sql`` (with ``first_params``): the block's first statement,
        sent with the claim; its rows are ``run.first`` (None unless
        claimed)."""
        return _RunContext(self, conn, tenant_id, scope, run_id, request,
                           delivery_count=delivery_count, first_sql=first_sql,
                           first_params=first_params)

    def call(self, conn, tenant_id, scope, run_id, request, handler, *,
             delivery_count=0, first_sql=None, first_params=None):
        """Run ``handler(conn, run)`` at most once per key, in the run's
        transaction; it returns the outcome (a dict; None means {}) or
        raises PermanentFailure / RetryableFailure to record a failure.
        Returns the Run (status, source, outcome...).  Any other exception
        is recorded as a retryable failure and propagates."""
        with self.run(conn, tenant_id, scope, run_id, request, delivery_count=delivery_count,
                      first_sql=first_sql, first_params=first_params) as run:
            if run.claimed:
                try:
                    out = handler(conn, run)
                except Failure as f:
                    run.fail(f.detail, retryable=f.retryable)
                else:
                    run.outcome = {} if out is None else out
        return run

    def idempotent(self, scope, *, run_id, request=None, tenant=None, delivery_count=None):
        """A decorator for ``fn(conn, *args, **kwargs)``: the outcome of its
        one run is returned to every delivery (applied or replayed).

        ``run_id``, ``request`` and ``tenant`` are each a parameter name of
        ``fn`` or a callable taking fn's arguments after ``conn``; ``tenant``
        may also be an int, or None for the platform ledger; ``request``
        None is the first argument after ``conn``.  Other answers raise:
        Busy (``retry_after``), Mismatch, PermanentFailure and
        RetryableFailure (``detail``: recorded now or replayed), and the
        IdemError family (CommitUnknown...).  ``delivery_count``, a
        parameter name or callable too, is the queue's delivery count (see
        ``run``)."""
        def deco(fn):
            sig = inspect.signature(fn)

            def pick(spec, args, kwargs, default=None):
                if callable(spec):
                    return spec(*args, **kwargs)
                if isinstance(spec, str):
                    bound = sig.bind(None, *args, **kwargs)
                    bound.apply_defaults()
                    return bound.arguments[spec]
                return spec if spec is not None else default

            @functools.wraps(fn)
            def wrapper(conn, *args, **kwargs):
                rid = pick(run_id, args, kwargs)
                req = pick(request, args, kwargs, default=args[0] if args else None)
                ten = pick(tenant, args, kwargs)
                dc = pick(delivery_count, args, kwargs, default=0) if delivery_count else 0
                run = self.call(conn, ten, scope, str(rid), req,
                                lambda c, r: fn(c, *args, **kwargs), delivery_count=dc or 0)
                if run.status in (APPLIED, REPLAYED):
                    return run.outcome
                if run.status == BUSY:
                    raise Busy(run, "busy: retry after %d ms" % run.retry_after_ms)
                if run.status == MISMATCH:
                    raise Mismatch(run, "the key was used with another request")
                if run.status == FAILED_PERMANENT:
                    raise PermanentFailure(run.outcome, result=run)
                raise RetryableFailure(run.outcome, result=run)
            return wrapper
        return deco

    # ---- the forms beyond one run in the runner's transaction ----
    def apply(self, conn, tenant_id, scope, run_id, request, sql_handler, *, args=None,
              delivery_count=0):
        """The effect is the SQL function ``sql_handler`` (regprocedure
        text, ``"charge(jsonb)"``: ``(args jsonb) RETURNS jsonb``, the
        outcome), run by the extension's idem_apply: claim, effect and
        completion are one statement, one round trip, committed by
        itself.  ``args`` (JSON) is passed to it; None: the request.
        Returns the Run; an error the function raises is recorded as a
        failure (failed_permanent or failed_retryable, its sqlstate and
        message as the detail)."""
        from .apply import _ApplyContext
        with _ApplyContext(self, conn, tenant_id, scope, run_id, request, sql_handler,
                           args=args, delivery_count=delivery_count) as run:
            pass
        return run

    def lease(self, conn, tenant_id, scope, run_id, request, *, lease_ms=None,
              delivery_count=0):
        """Lease mode, for an effect outside PostgreSQL: ``with
        runner.lease(conn, ...) as lease:`` then ``if lease.claimed:`` do
        the effect and set ``lease.outcome``.  The claim commits alone
        with a lease of ``lease_ms`` (default: the runner's); after the
        block the completion, fenced by ``lease.attempt``, commits in a
        transaction of its own (LeaseLost if a later attempt took the key
        over).  ``lease.defer()`` leaves the completion to
        ``runner.complete``."""
        from .lease import _LeaseContext
        return _LeaseContext(self, conn, tenant_id, scope, run_id, request,
                             lease_ms=lease_ms, delivery_count=delivery_count)

    def complete(self, conn, tenant_id, scope, run_id, outcome=None, *, attempt):
        """Complete a key claimed in lease mode, fenced by the claim's
        ``attempt``, in the connection's transaction (it commits by itself
        on an autocommit connection).  LeaseLost if a later attempt took
        the key over."""
        from .lease import settle
        settle(self, conn, tenant_id, scope, run_id, attempt, outcome=outcome)

    def fail(self, conn, tenant_id, scope, run_id, detail=None, *, attempt, retryable=False):
        """Fail a key claimed in lease mode, as ``complete``."""
        from .lease import settle
        settle(self, conn, tenant_id, scope, run_id, attempt,
               failure=({} if detail is None else detail, retryable))

    def batch(self, conn, items):
        """Many deliveries at once: ``items`` are (tenant, scope, run_id,
        request).  ``with runner.batch(conn, items) as batch:`` then, for
        each run of ``batch.claimed``, the effect on ``conn`` and
        ``run.outcome``; every Run is in ``batch.runs`` (in order) with its
        status after the block.  Valkey answers what it can in one
        pipelined GET, one idem_claim_many claims the rest, one round trip
        completes, fails and commits."""
        from .batch import Batch
        return Batch(self, conn, items)

    def cached(self, conn, tenant_id, scope, run_id, request):
        """Valkey alone (one GET, no marker, no transaction): the Run,
        replayed or failed_permanent, when the cache holds this key's
        verified result for the same request; else None (PostgreSQL
        decides)."""
        return self.cached_many(conn, [(tenant_id, scope, run_id, request)])[0]

    def cached_many(self, conn, items):
        """``cached`` for many (tenant, scope, run_id, request) in one
        pipelined round trip (one per node on a cluster): a list of Run or
        None, in order."""
        from .batch import cached_many
        return cached_many(self, conn, items)


def _make_run(cls, tenant_id, scope, run_id, request):
    """A Run (or subclass) for one delivery: its key, canonical request and
    fingerprint."""
    if tenant_id is not None:
        tenant_id = int(tenant_id)
    try:
        text = canonical_json(request)
    except RequestError as e:
        raise IdemError("request", "request: %s" % e) from None
    try:
        key = idem_key(scope, run_id)
    except (TypeError, ValueError) as e:
        raise IdemError("argument", str(e)) from None
    return cls(tenant_id, scope, run_id, text, key, hashlib.sha256(text.encode("utf-8")).digest())


def _failure_of(run, et, ev):
    """What a block that ended with exception type et (None: none) records:
    (failure, suppress), failure (detail, retryable) or None (complete).
    A Failure raised in the block is recorded and suppressed (as
    run.fail(detail)); any other exception is recorded as retryable and
    propagates."""
    if et is not None and issubclass(et, Failure):
        return (ev.detail, ev.retryable), True
    if et is not None:
        return ({"error": et.__name__, "message": str(ev)[:1000]}, True), False
    return run._failure, False


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


def _outcome_text(outcome, what):
    try:
        text = canonical_json(outcome)
    except RequestError as e:
        raise IdemError("outcome", "%s is not valid JSON: %s" % (what, e)) from None
    if not text.startswith("{") or len(text.encode("utf-8")) > cache.OUTCOME_MAX:
        raise IdemError("outcome", "%s must be a JSON object of at most %d bytes as jsonb text"
                        % (what, cache.OUTCOME_MAX))
    return text


class _RunContext:
    run_class = Run

    def __init__(self, runner, conn, tenant_id, scope, run_id, request, *,
                 delivery_count=0, first_sql=None, first_params=None):
        self.r = runner
        self.conn = conn
        if delivery_count is None or int(delivery_count) < 0:
            raise IdemError("argument", "delivery_count must be 0 (unknown) or positive")
        self.delivery_count = int(delivery_count)
        if first_sql is not None and (not isinstance(first_sql, str) or not first_sql.strip()):
            raise IdemError("argument", "first_sql must be a non-empty statement")
        self.first_sql = first_sql
        self.first_params = first_params
        self.run = _make_run(self.run_class, tenant_id, scope, run_id, request)
        self.ckey = None
        self.marker = None
        self.own_marker = False
        self.tx_open = False
        self.st = None

    # -- SQL --
    def _sql(self, name):
        s = self.st.schema
        plat = self.run.tenant_id is None
        ms = "floor(extract(epoch FROM %s.expires_at - clock_timestamp()) * 1000)::bigint"
        if name == "claim":
            return ("SELECT c.decision, c.attempt, c.outcome::text, " + ms % "c" +
                    (" FROM %s.idem_platform_claim(%%s, %%s, %%s::interval) AS c" if plat else
                     " FROM %s.idem_claim(%%s, %%s, %%s, %%s::interval) AS c") % s)
        if name == "lookup":
            return ("SELECT l.status, l.attempt, l.outcome::text, l.fingerprint = %s, " + ms % "l" +
                    (" FROM %s.idem_platform_lookup(%%s) AS l" if plat else
                     " FROM %s.idem_lookup(%%s, %%s) AS l") % s)
        if name == "complete":
            return ("SELECT %s.idem_platform_complete(%%s, %%s::jsonb, %%s::interval)" if plat else
                    "SELECT %s.idem_complete(%%s, %%s, %%s::jsonb, %%s::interval)") % s
        if name == "fail":
            return ("SELECT %s.idem_platform_fail(%%s, %%s::jsonb, %%s, %%s::interval)" if plat else
                    "SELECT %s.idem_fail(%%s, %%s, %%s::jsonb, %%s, %%s::interval)") % s
        raise KeyError(name)

    def _key_params(self):
        k = self.run.key
        return [k] if self.run.tenant_id is None else [self.run.tenant_id, k]

    def _decide(self, status, source, attempt=None, outcome_text=None):
        run = self.run
        run.status, run.source = status, source
        if attempt is not None:
            run.attempt = attempt
        if outcome_text is not None:
            run.outcome = json.loads(outcome_text)

    def _broken(self):
        return self.conn.broken or self.conn.closed

    def _pg_error(self, e, what):
        """An error from a statement: roll back what can be, release the marker."""
        self._drop_marker()
        _raise_pg_error(self.conn, e, what)

    def _drop_marker(self):
        if self.own_marker:
            self.own_marker = False
            self.r._release(self.ckey, self.marker)

    # -- step 2: the gate --
    def _gate(self):
        """Returns (decided, valkey_silent, mismatch_hint, marker_busy)."""
        r, run = self.r, self.run
        if not r._valkey_ok():
            return False, r.valkey is not None, False, False
        if self.st.keyspace is None or self.st.owner_suspect:
            return False, False, False, False
        self.ckey = cache.cache_key(self.st.keyspace, run.tenant_id, run.key)
        self.marker = cache.encode_marker(self.st.secrets[self.st.current], self.st.current,
                                          self.ckey, _wall_ms() + r.lease_ms, os.urandom(16))
        try:
            r._check_cluster()
            # one round trip: the gate, and the epoch's owner key (on a
            # cluster each node's share is sent before any reply is read);
            # get=True: redis-py then returns SET's reply as it is
            pipe = r.valkey.pipeline(transaction=False)
            pipe.execute_command("SET", self.ckey, self.marker, "NX", "PX",
                                 str(r.lease_ms), "GET", get=True)
            pipe.execute_command("GET", self.st.owner_key)
            value, owner = pipe.execute(raise_on_error=False)
            if isinstance(value, Exception):
                raise value
        except ValkeyClusterNotSupported:
            raise
        except Exception as e:
            # down, slow, or an error reply (WRONGTYPE, a server older than
            # 7.0): nothing usable; PostgreSQL decides, lookup first
            r._valkey_failed(e)
            return False, True, False, False
        run.valkey_used = True
        checked = owner == self.st.owner_token
        if checked:
            self.st.owner_relearnt = False
        else:
            # the owner key did not hold the server's token: nothing read
            # here is trusted, PostgreSQL decides (lookup first), and the
            # runner learns again; if it held another value (a newer epoch
            # retired it, or another server took it over) no cache until
            # then; if nothing (Valkey lost it, the server's worker sets it
            # again; or its node did not answer) later lookups check it
            self.st.refresh_wanted = True
            if isinstance(owner, bytes):
                self.st.owner_suspect = True
            r.stats["owner_mismatches"] += 1
        if value is None or value == self.marker:
            self.own_marker = True      # absent: our marker is set
            return False, False, False, False
        if not checked:
            return False, True, False, False
        e = cache.parse(value)
        if e is None:
            r.stats["cache_rejected"] += 1
            return False, False, False, False
        if e.key_id not in self.st.secrets:
            self.st.refresh_wanted = True       # perhaps rotated: re-learn
            r.stats["cache_rejected"] += 1
            return False, False, False, False
        if not cache.verify(self.st.secrets, self.ckey, value, e):
            r.stats["cache_rejected"] += 1
            return False, False, False, False
        now = _wall_ms()
        if e.kind == cache.MARKER:
            # honoured until its MACed deadline, and no further than our own
            # lease + 1 s; Valkey's TTL is never consulted
            if e.expires_ms <= now or e.expires_ms > now + r.lease_ms + 1000:
                if e.expires_ms > now:
                    r.stats["cache_rejected"] += 1
                return False, False, False, False
            # busy from Valkey alone for the marker's first second only
            # (its age: our lease minus what is left of it); after that the
            # claim decides, so a runner killed mid-handler (PostgreSQL
            # rolled its claim back) does not keep the key busy for the
            # rest of its lease.  The C runner's IDEM_MARKER_CHEAP_MS.
            if r.lease_ms - (e.expires_ms - now) >= MARKER_CHEAP_MS:
                return False, False, False, False
            self._decide(BUSY, SOURCE_VALKEY)
            run.retry_after_ms = max(1, e.expires_ms - now)
            return True, False, False, True
        if e.expires_ms <= now:
            return False, False, False, False
        if e.fingerprint != run.fingerprint:
            return False, False, True, False    # a hint: PostgreSQL confirms
        try:
            run.outcome = json.loads(e.outcome.decode("utf-8"))
        except ValueError:
            r.stats["cache_rejected"] += 1
            return False, False, False, False
        run.status = REPLAYED if e.kind == cache.COMPLETED else FAILED_PERMANENT
        run.source = SOURCE_VALKEY
        run.attempt = e.attempt
        r.stats["replayed_from_valkey"] += 1
        return True, False, False, False

    # -- step 3a: a lookup outside any transaction --
    def _lookup(self):
        run = self.run
        try:
            row = self.conn.execute(self._sql("lookup"),
                                    [run.fingerprint] + self._key_params()).fetchone()
            self.r._end_tx(self.conn)
        except psycopg.Error as e:
            if not self._broken() and getattr(e.diag, "sqlstate", None) in ("42501", "42883"):
                # not granted (or absent): the claim decides, from now on directly
                self.conn.rollback()
                self.r.lookup_first = False
                return False
            self._pg_error(e, "idem_lookup")
        if row is None or row[0] is None or row[3] is None:
            return False
        status, attempt, outcome, same = row[0], row[1], row[2], row[3]
        if status not in ("completed", "failed_permanent"):
            return False
        if not same:
            self._decide(MISMATCH, SOURCE_POSTGRES, attempt)
        else:
            self._decide(REPLAYED if status == "completed" else FAILED_PERMANENT,
                         SOURCE_POSTGRES, attempt, outcome)
        return True

    # -- step 3b: the claim --
    def _set_max_attempts(self):
        """In the claim's transaction (pipelined): the runner's max_attempts."""
        if self.r.max_attempts is not None:
            self.conn.execute("SELECT pg_catalog.set_config('idem.max_attempts', %s, true)",
                              [str(self.r.max_attempts)])

    def _claim(self):
        run, conn = self.run, self.conn
        first = None
        try:
            # one round trip: BEGIN, the claim, the handler's savepoint
            # (harmless when the key is not ours: COMMIT follows), and the
            # block's first statement if it gave one (rolled back to the
            # savepoint when the key is not ours)
            try:
                with conn.pipeline():
                    if conn.autocommit:
                        conn.execute("BEGIN")
                    self.tx_open = True
                    self._set_max_attempts()
                    cur = conn.execute(self._sql("claim"), self._key_params() +
                                       [run.fingerprint, "%d milliseconds" % self.r.lease_ms])
                    conn.execute("SAVEPOINT idem_handler")
                    if self.first_sql is not None:
                        first = conn.execute(self.first_sql, self.first_params)
            except psycopg.Error as e:
                # the first statement's own error is the block's to handle
                # when the key is ours (the transaction is then in error)
                if first is None or self._broken() or cur.pgresult is None or \
                        cur.pgresult.status != psycopg.pq.ExecStatus.TUPLES_OK:
                    raise
                run.first_error = e
            decision, attempt, outcome, ms = cur.fetchone()
            if decision == "claimed":
                run.claimed = True
                run.attempt = attempt
                if first is not None and run.first_error is None:
                    run.first = first.fetchall() if first.description is not None else []
                return
            if first is not None:
                with conn.pipeline():
                    conn.execute("ROLLBACK TO SAVEPOINT idem_handler")
                    conn.execute("COMMIT")
            else:
                conn.commit()
            self.tx_open = False
        except psycopg.Error as e:
            self.tx_open = False
            self._pg_error(e, "idem_claim")
        self._claim_decided(decision, attempt, outcome, ms)

    def _claim_decided(self, decision, attempt, outcome, ms):
        """A decision of idem_claim other than claimed."""
        run = self.run
        if decision in ("completed", "failed_permanent"):
            # a terminal row: the claim queued a copy that overwrites our marker
            self.own_marker = False
            self._decide(REPLAYED if decision == "completed" else FAILED_PERMANENT,
                         SOURCE_POSTGRES, attempt, outcome)
        elif decision == "busy":
            self._decide(BUSY, SOURCE_POSTGRES, attempt)
            run.retry_after_ms = max(1, ms or 1)
        elif decision == "mismatch":
            self._decide(MISMATCH, SOURCE_POSTGRES, attempt)
        else:
            raise IdemError("protocol", "unknown decision %r" % decision)

    def __enter__(self):
        r, conn, run = self.r, self.conn, self.run
        r.stats["runs"] += 1
        if conn.info.transaction_status != TransactionStatus.IDLE:
            raise IdemError("state", "the connection must be idle (no transaction open): "
                            "the run's transaction is the effect's, begun and committed by the runner")
        try:
            self.st = r._state(conn)
        except psycopg.Error as e:
            self._pg_error(e, "learning the schema")
        try:
            # a first delivery (delivery_count 1): no run can have committed
            # this key, so the gate could only answer "absent"; the claim decides
            skip_gate = self.delivery_count == 1 and r.valkey is not None
            r.stats["gate_skipped_first"] += skip_gate
            decided, silent, hint, marker_busy = (False,) * 4 if skip_gate else self._gate()
            if decided:
                if marker_busy and r.lookup_first:
                    self._lookup()      # a committed run's marker: replay or mismatch now
            elif (silent or hint) and r.lookup_first and self._lookup():
                pass
            else:
                self._claim()
        except BaseException:
            self._drop_marker()
            raise
        if not run.claimed and run.status not in (REPLAYED, FAILED_PERMANENT):
            self._drop_marker()     # no terminal row: our marker goes
        return run

    def __exit__(self, et, ev, tb):
        run, conn = self.run, self.conn
        if not run.claimed:
            if conn.info.transaction_status not in (TransactionStatus.IDLE, TransactionStatus.UNKNOWN):
                # the block used the connection although nothing was claimed
                conn.rollback()
                if et is None:
                    raise IdemError("state", "the block ran statements on a run that was not "
                                    "claimed (check run.claimed): rolled back")
            return False
        try:
            return self._finish(et, ev)
        finally:
            if self.own_marker:
                self._drop_marker()

    def _finish(self, et, ev):
        run, conn = self.run, self.conn
        ts = conn.info.transaction_status
        if et is not None and not issubclass(et, Exception):
            # KeyboardInterrupt, SystemExit...: nothing recorded
            if not self._broken() and ts != TransactionStatus.IDLE:
                conn.rollback()
            return False
        if self._broken():
            err = IdemError("connection", "connection lost during the run (nothing committed)")
            if et is not None:
                raise err from ev
            raise err
        if ts == TransactionStatus.IDLE:
            self._drop_marker()
            raise IdemError("handler_ended_tx",
                            "the block ended the runner's transaction (COMMIT or ROLLBACK): its "
                            "effect may have committed without its idempotency key")
        failure, suppress = _failure_of(run, et, ev)
        if et is None and ts == TransactionStatus.INERROR and failure is None:
            conn.rollback()
            raise IdemError("handler", "the block left the transaction in error (a failed "
                            "statement it caught): rolled back, nothing recorded")
        # the outcome (or detail) is checked before anything is sent
        if failure is None:
            try:
                text = _outcome_text({} if run.outcome is None else run.outcome, "the outcome")
            except IdemError:
                conn.rollback()
                raise
        else:
            detail, retryable = failure
            try:
                text = _outcome_text(detail, "the failure detail")
            except IdemError:
                if et is None or suppress:
                    conn.rollback()
                    raise
                text = _outcome_text({"error": et.__name__}, "the failure detail")
        # A session the server ended while the block ran (pg_terminate_backend,
        # a restart) is seen now, before COMMIT is sent: nothing committed.
        if _session_ended(conn):
            raise IdemError("connection", "connection lost during the run (nothing committed)")
        # one round trip: end the savepoint, complete or fail, COMMIT (a
        # statement of the pipeline: conn.commit() would sync once more)
        try:
            with conn.pipeline():
                if failure is None:
                    conn.execute("RELEASE SAVEPOINT idem_handler")
                    conn.execute(self._sql("complete"), self._key_params() + [text, self.r.retention])
                else:
                    conn.execute("ROLLBACK TO SAVEPOINT idem_handler")
                    conn.execute(self._sql("fail"), self._key_params() + [text, retryable,
                                                                          self.r.retention])
                conn.execute("COMMIT")
        except psycopg.Error as e:
            if self._broken():
                # COMMIT was handed to the connection with the rest
                raise CommitUnknown("connection lost while COMMIT was in flight: the effect "
                                    "and its key committed together or not at all; redeliver, "
                                    "the ledger decides (%s)" % str(e).strip()) from e
            if e.diag.sqlstate == "3B001":
                conn.rollback()
                self._drop_marker()
                raise IdemError("handler_ended_tx",
                                "the block released the runner's savepoint") from e
            self._pg_error(e, "completing the run")
        run.source = SOURCE_HANDLER
        if failure is None:
            run.status = APPLIED
            run.outcome = json.loads(text)
        else:
            run.status = FAILED_RETRYABLE if failure[1] else FAILED_PERMANENT
            run.outcome = json.loads(text)
        if run.status != FAILED_RETRYABLE:
            self.own_marker = False     # left for the worker's copy of the row
        return suppress
