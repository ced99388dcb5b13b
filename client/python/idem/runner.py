"""The gated idempotency runner: the Valkey gate and replay cache in front,
PostgreSQL with the idem extension as the truth, the handler's effect in the
application's transaction.  The protocol is the C client's (client/README.md,
"One run, and its round trips" and "What the client trusts").

The top of the package: the Runner owns the Valkey client and what it
learnt of each PostgreSQL session, and offers the forms as its methods:
one run (run.py), a SQL handler (apply.py), lease mode (lease.py) and
batches (batch.py).  They stand on result.py, errors.py, pg.py and
trust.py, which import nothing above them."""
import functools
import inspect
from typing import Any
import threading
import time
import weakref

import psycopg
import psycopg.sql
from psycopg.pq import TransactionStatus

from . import cache
from .apply import _ApplyContext
from .batch import Batch, cached_many
from .lease import _LeaseContext, settle
from .pg import _raise_pg_error
from .run import _RunContext
from .trust import _ConnState
from .health import Health
from .check import Check, check as _check
# Defined below this module and importable from here as before (idem.runner
# was once the whole runner): the statuses, sources, Run and exceptions.
from .errors import (Busy, CommitUnknown, Failure, IdemError, Mismatch, NotApplied,
                     PermanentFailure, RetryableFailure, ValkeyClusterNotSupported)
from .result import (APPLIED, BUSY, FAILED_PERMANENT, FAILED_RETRYABLE, MISMATCH,
                     REPLAYED, SOURCE_HANDLER, SOURCE_POSTGRES, SOURCE_VALKEY, Run)
from .run import MARKER_CHEAP_MS

# KEYS[1] = key, ARGV[1] = our marker: delete it only if it is still ours.
# The same text as client/release.c, so the same SHA-1 for EVALSHA
# (tests/test_unit.py compares the two, and that SHA-1, byte for byte).
CAD_SCRIPT = ("if redis.call('GET', KEYS[1]) == ARGV[1] then\n"
              "  return redis.call('DEL', KEYS[1])\n"
              "end\n"
              "return 0\n")

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
                      "owner_mismatches": 0, "valkey_auth_failures": 0,
                      "valkey_not_servers": 0, "notices": 0}
        self._health = Health(self)
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
            except Exception as e:
                # down, or AUTH refused: told now (as the C runner does at
                # open), rested, checked again on a later contact
                self._valkey_failed(e)

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
        """Valkey failed (down, AUTH refused or wanted, an error reply):
        counted, told to the "idem" logger, and rested (health.py)."""
        self._health.failed(e)

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

    def _idle_state(self, conn, whose):
        """The session's state for a form that begins and commits its own
        transaction (whose, say which): conn must be idle."""
        if conn.info.transaction_status != TransactionStatus.IDLE:
            raise IdemError("state", "the connection must be idle (no transaction open): " + whose)
        try:
            return self._state(conn)
        except psycopg.Error as e:
            _raise_pg_error(conn, e, "learning the schema")

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
            self._health.cache_off("no Valkey cache on this connection (%s %s): PostgreSQL decides"
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
        return _LeaseContext(self, conn, tenant_id, scope, run_id, request,
                             lease_ms=lease_ms, delivery_count=delivery_count)

    def complete(self, conn, tenant_id, scope, run_id, outcome=None, *, attempt):
        """Complete a key claimed in lease mode, fenced by the claim's
        ``attempt``, in the connection's transaction (it commits by itself
        on an autocommit connection).  LeaseLost if a later attempt took
        the key over."""
        settle(self, conn, tenant_id, scope, run_id, attempt, outcome=outcome)

    def fail(self, conn, tenant_id, scope, run_id, detail=None, *, attempt, retryable=False):
        """Fail a key claimed in lease mode, as ``complete``."""
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
        return cached_many(self, conn, items)

