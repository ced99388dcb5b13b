"""asyncio: the runner for psycopg.AsyncConnection and redis.asyncio, with
the synchronous runner's forms (run, call, the decorator, apply, lease,
complete and fail, batch, cached) and its protocol, byte for byte.

What each step decides is the synchronous forms' own code (the methods
of _RunContext, _ApplyContext, _LeaseContext, Batch, _ConnState and
Runner that send nothing); this module only awaits what they send.  The runner's
state (the sessions it learnt, its Valkey rest, its counters) is one
event loop's: share an AsyncRunner between tasks of that loop, and a
connection between runs one at a time."""
import contextlib
import functools
from types import TracebackType
from typing import (Any, AsyncIterator, Awaitable, Callable, Iterable, List, Optional, Tuple,
                    Type, TypeVar, cast)

import psycopg
from psycopg import generators
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row

from .check import Check, acheck
from .apply import _ApplyContext
from .batch import Batch, cache_answers, cache_keys, cache_reads
from .errors import IdemError, ValkeyClusterNotSupported
from .lease import Lease, _LeaseContext, settle_failed, settle_statement
from .pg import (MAX_ATTEMPTS_SQL, Statement, _as_is, _check_conn, _pg_error_of, _raise_ending,
                 _session_ended, _simple_results, _simple_text, _values)
from .release import AsyncRelease
from .result import Failure, FailureSpec, Run, _make_run
from .run import Gate, _RunContext
from .runner import (CLUSTER_REFUSED, KEYSPACE_SQL, SCHEMA_SQL, SECRETS_SQL, Item,
                     Runner, _check_idle, _KeyOf, _ms, _outcome_or_raise)
from .trust import _ConnState

AConn = psycopg.AsyncConnection[Any]
ACursor = psycopg.AsyncCursor[Tuple[Any, ...]]
AF = TypeVar("AF", bound=Callable[..., Awaitable[Any]])


async def _aexec(conn: AConn, query: str, params: Optional[List[Any]] = None) -> ACursor:
    """One of the runner's statements: unnamed, rows as tuples (pg._exec)."""
    cur = conn.cursor(row_factory=tuple_row)
    await cur.execute(query, params, prepare=False)
    return cur


async def _afetch_one(cur: ACursor) -> Tuple[Any, ...]:
    row = await cur.fetchone()
    if row is None:
        raise IdemError("protocol", "a statement of the runner returned no row")
    return row


@contextlib.asynccontextmanager
async def _apipeline(conn: AConn) -> AsyncIterator[None]:
    """conn.pipeline(), quiet after an error (pg._pipeline)."""
    cm = conn.pipeline()
    await cm.__aenter__()
    try:
        yield
    except BaseException:
        try:
            await cm.__aexit__(None, None, None)
        except Exception:
            pass            # what follows the first error: "pipeline aborted"
        raise
    await cm.__aexit__(None, None, None)


async def _asimple(conn: AConn, statements: List[Statement]) -> List[Any]:
    """statements in one simple-protocol query (pg._simple)."""
    query = _simple_text(conn, statements)
    pgconn = conn.pgconn
    async with conn.lock:
        pgconn.send_query(query)
        results: List[Any] = await conn.wait(generators.execute(pgconn))
    return _simple_results(conn, results)


async def _arollback(conn: AConn) -> None:
    try:
        await conn.rollback()
    except psycopg.Error:
        pass


async def _asend(conn: AConn, statements: List[Statement],
                 failed: Callable[[psycopg.Error], Tuple[bool, IdemError]],
                 simple: bool = False) -> List[Any]:
    """statements in one round trip (pg._send): their cursors, or simple,
    their results."""
    try:
        if simple:
            return await _asimple(conn, statements)
        async with _apipeline(conn):
            return [await _aexec(conn, sql, params) for sql, params in statements]
    except psycopg.Error as e:
        rollback, err = failed(e)
        if rollback:
            await _arollback(conn)
        raise err from e


async def _aclose_client(client: Any) -> None:
    """Close a redis.asyncio client (a Redis or a RedisCluster) and its
    connections (aclose since redis-py 5, close before)."""
    close = getattr(client, "aclose", None) or client.close
    await close()


class AsyncRunner(Runner):
    """The runner for asyncio: ``valkey`` is ``(host, port)`` (a Valkey,
    or any node of a Valkey Cluster), a ``redis.asyncio`` client, or None;
    the options are the synchronous Runner's.  Each form takes a
    ``psycopg.AsyncConnection``.

    ``await runner.aclose()`` (or ``async with AsyncRunner(...) as
    runner:``) closes the Valkey connections the runner made from
    ``(host, port)``, in the event loop that used them (a client given is
    the caller's to close).  Left open, redis.asyncio closes them when
    they are garbage collected, possibly after their event loop ended
    ("Event loop is closed" on stderr)."""

    async def aclose(self) -> None:
        """Close the Valkey connections the runner made (Runner.close).  A
        run after it connects again."""
        for client in self._own_clients:
            await _aclose_client(client)

    async def __aenter__(self) -> "AsyncRunner":
        return self

    async def __aexit__(self, et: Optional[Type[BaseException]], ev: Optional[BaseException],
                        tb: Optional[TracebackType]) -> None:
        await self.aclose()

    def close(self) -> None:
        """Refused: ``await runner.aclose()``."""
        raise IdemError("state", "an AsyncRunner is closed by await runner.aclose() (or "
                        "async with AsyncRunner(...) as runner:)")

    def __enter__(self) -> "AsyncRunner":
        raise IdemError("state", "an AsyncRunner is entered by async with")

    def _client(self, host: str, port: int) -> Any:
        """Runner._client, redis.asyncio's."""
        import redis.asyncio
        return redis.asyncio.Redis(host=host, port=port, socket_timeout=self._timeout,
                                   socket_connect_timeout=self._timeout)

    def _release_of(self, client: Any) -> Any:
        return AsyncRelease(client)

    def _first_contact(self) -> None:
        """Nothing at construction: the first round trip checks, awaited
        (_acheck_cluster)."""

    async def check(self, conn: Any) -> Check:  # type: ignore[override]
        """Runner.check, awaited: ``await runner.check(conn)`` on an idle
        ``psycopg.AsyncConnection``."""
        return await acheck(self, conn)

    # ---- Valkey ----
    async def _acheck_cluster(self) -> None:
        """On first contact: is this a Valkey Cluster node?  Then route by
        key with redis.asyncio's RedisCluster (given (host, port)), or
        refuse a plain client of one node (Runner._check_cluster)."""
        if self._cluster_checked:
            return
        from redis.asyncio.cluster import RedisCluster
        if not isinstance(self.valkey, RedisCluster):
            info = await self.valkey.info("cluster")
            if int(info.get("cluster_enabled", 0)) == 1:
                if self._seed is None:
                    raise ValkeyClusterNotSupported(CLUSTER_REFUSED)
                cluster = RedisCluster(host=self._seed[0], port=self._seed[1],
                                       socket_timeout=self._timeout,
                                       socket_connect_timeout=self._timeout)
                self._cad = self._release_of(cluster)
                seed, self.valkey = self.valkey, cluster
                self._own_clients = [cluster]
                await _aclose_client(seed)      # the seed node's plain client, ours
        self._cluster_checked = True

    async def _around_trip(self, fill: Callable[[Any], Any]) -> Optional[List[Any]]:
        """Runner._round_trip."""
        try:
            await self._acheck_cluster()
            return list(await fill(self.valkey.pipeline(transaction=False)).execute(
                raise_on_error=False))
        except Exception as e:
            self._round_trip_failed(e)
            return None

    async def _arelease(self, ckey: bytes, marker: bytes) -> None:
        """Compare-and-delete our marker (Runner._release)."""
        if not self._valkey_ok():
            return
        try:
            await self._cad(keys=[ckey], args=[marker])
        except Exception as e:
            self._valkey_failed(e)

    # ---- PostgreSQL: what the server says about its cache ----
    async def _aend_tx(self, conn: AConn) -> None:
        status = conn.info.transaction_status
        if status == TransactionStatus.INTRANS:
            await conn.commit()
        elif status != TransactionStatus.IDLE:
            await conn.rollback()

    async def _astate(self, conn: AConn) -> _ConnState:
        """Runner._state."""
        st = self._conn_state(conn)
        if not st.schema:
            row = None
            if self.schema is None:
                row = await (await _aexec(conn, SCHEMA_SQL)).fetchone()
                await self._aend_tx(conn)
            st.schema = self._schema_of(conn, row)
        if self._wants_learning(st):
            st.start_learning()
            try:
                row = await (await _aexec(conn, KEYSPACE_SQL % st.schema)).fetchone()
                rows = await (await _aexec(conn, SECRETS_SQL % st.schema)).fetchall()
                await self._aend_tx(conn)
            except psycopg.Error as e:
                if conn.broken or conn.closed:
                    raise IdemError("connection", "connection lost: %s" % e) from e
                await self._aend_tx(conn)
                self._learning_refused(st, e)
                return st
            st.adopt(None if row is None else row[0], rows)
        return st

    async def _aidle_state(self, conn: AConn, whose: str) -> _ConnState:
        """Runner._idle_state."""
        _check_idle(conn, whose)
        return await self._alearnt_state(conn)

    async def _alearnt_state(self, conn: AConn) -> _ConnState:
        """_astate, a server error raised as an IdemError (rolled back)."""
        try:
            return await self._astate(conn)
        except psycopg.Error as e:
            err = _pg_error_of(conn, e, "learning the schema")
            if err.code == "server":
                await _arollback(conn)
            raise err from e

    # ---- the forms ----
    def run(self, conn: Any, tenant_id: Optional[int], scope: str,  # type: ignore[override]
            run_id: str, request: Any, *, delivery_count: int = 0,
            first_sql: Optional[str] = None,
            first_params: Optional[List[Any]] = None,
            durable: bool = False) -> "_AsyncRunContext":
        """``async with runner.run(conn, ...) as run:`` (Runner.run)."""
        _check_conn(conn, True)
        return _AsyncRunContext(self, conn, tenant_id, scope, run_id, request,
                                delivery_count=delivery_count, first_sql=first_sql,
                                first_params=first_params, durable=durable)

    async def call(self, conn: Any, tenant_id: Optional[int], scope: str,  # type: ignore[override]
                   run_id: str, request: Any, handler: Callable[[Any, Run], Awaitable[Any]], *,
                   delivery_count: int = 0, first_sql: Optional[str] = None,
                   first_params: Optional[List[Any]] = None, durable: bool = False) -> Run:
        """``await handler(conn, run)`` at most once per key (Runner.call)."""
        async with self.run(conn, tenant_id, scope, run_id, request,
                            delivery_count=delivery_count, first_sql=first_sql,
                            first_params=first_params, durable=durable) as run:
            if run.claimed:
                try:
                    out = await handler(conn, run)
                except Failure as f:
                    run.fail(f.detail, retryable=f.retryable)
                else:
                    run.outcome = {} if out is None else out
        return run

    def idempotent(self, scope: str, *, run_id: Any, request: Any = None,
                   tenant: Any = None, delivery_count: Any = None) -> Callable[[AF], AF]:
        """The decorator (Runner.idempotent) for ``async def fn(conn, ...)``."""
        def deco(fn: AF) -> AF:
            key_of = _KeyOf(fn, run_id, request, tenant, delivery_count)

            @functools.wraps(fn)
            async def wrapper(conn: Any, *args: Any, **kwargs: Any) -> Any:
                ten, rid, req, dc = key_of(args, kwargs)

                async def handler(c: Any, r: Run) -> Any:
                    return await fn(c, *args, **kwargs)
                return _outcome_or_raise(await self.call(conn, ten, scope, rid, req, handler,
                                                         delivery_count=dc))
            return cast(AF, wrapper)
        return deco

    async def apply(self, conn: Any, tenant_id: Optional[int], scope: str,  # type: ignore[override]
                    run_id: str, request: Any, sql_handler: str, *, args: Any = None,
                    delivery_count: int = 0, durable: bool = False) -> Run:
        """Runner.apply."""
        _check_conn(conn, True)
        async with _AsyncApplyContext(self, conn, tenant_id, scope, run_id, request, sql_handler,
                                      args=args, delivery_count=delivery_count,
                                      durable=durable) as run:
            pass
        return run

    def lease(self, conn: Any, tenant_id: Optional[int], scope: str,
              run_id: str, request: Any, *, lease: Optional[float] = None,
              delivery_count: int = 0) -> "_AsyncLeaseContext":
        """``async with runner.lease(conn, ...) as lease:`` (Runner.lease)."""
        _check_conn(conn, True)
        return _AsyncLeaseContext(self, conn, tenant_id, scope, run_id, request,
                                  lease_ms=None if lease is None else _ms(lease, "lease"),
                                  delivery_count=delivery_count)

    async def complete(self, conn: Any, tenant_id: Optional[int],  # type: ignore[override]
                       scope: str, run_id: str, outcome: Any = None, *,
                       fence: Optional[int] = None, attempt: Optional[int] = None) -> str:
        """Runner.complete."""
        return await self._asettle(conn, tenant_id, scope, run_id, attempt, outcome, None, fence)

    async def fail(self, conn: Any, tenant_id: Optional[int], scope: str,  # type: ignore[override]
                   run_id: str, detail: Any = None, *, fence: Optional[int] = None,
                   attempt: Optional[int] = None, retryable: bool = False) -> str:
        """Runner.fail."""
        return await self._asettle(conn, tenant_id, scope, run_id, attempt, None,
                            ({} if detail is None else detail, retryable), fence)

    async def _asettle(self, conn: Any, tenant_id: Optional[int], scope: str, run_id: str,
                       attempt: Optional[int], outcome: Any, failure: Optional[FailureSpec],
                       fence: Optional[int] = None) -> str:
        _check_conn(conn, True)
        st = await self._alearnt_state(conn)
        sql, params, status = settle_statement(self, st, tenant_id, scope, run_id, attempt,
                                               outcome, failure, fence)
        try:
            await _aexec(conn, sql, params)
        except psycopg.Error as e:
            raise settle_failed(conn, e) from e
        return status

    def batch(self, conn: Any, items: Iterable[Item]) -> "AsyncBatch":
        """``async with runner.batch(conn, items) as batch:`` (Runner.batch)."""
        _check_conn(conn, True)
        return AsyncBatch(self, conn, items)

    async def cached(self, conn: Any, tenant_id: Optional[int],  # type: ignore[override]
                     scope: str, run_id: str, request: Any) -> Optional[Run]:
        """Runner.cached."""
        return (await self.cached_many(conn, [(tenant_id, scope, run_id, request)]))[0]

    async def cached_many(self, conn: Any,  # type: ignore[override]
                          items: Iterable[Item]) -> List[Optional[Run]]:
        """Runner.cached_many."""
        _check_conn(conn, True)
        runs = [_make_run(Run, *item) for item in items]
        st = await self._aidle_state(conn, "the runner reads the keyspace and secrets on it "
                                     "when it has not yet")
        await self._afrom_cache(st, runs)
        return [run if run.status is not None else None for run in runs]

    async def _afrom_cache(self, st: _ConnState, runs: List[Run]) -> int:
        """batch.from_cache."""
        ckeys = cache_keys(self, st, runs)
        if not ckeys:
            return 0
        values = await self._around_trip(lambda pipe: cache_reads(pipe, st, ckeys))
        return 0 if values is None else cache_answers(self, st, runs, ckeys, values)


class _AsyncRunContext(_RunContext):
    """``async with runner.run(...) as run:``: _RunContext's decisions,
    awaited."""
    r: AsyncRunner
    conn: Any
    asynchronous = True

    async def _adrop_marker(self) -> None:
        if self.own_marker:
            self.own_marker = False
            await self.r._arelease(self.ckey, self.marker)

    async def _apg_error(self, e: psycopg.Error, what: str) -> None:
        await self._adrop_marker()
        err = _pg_error_of(self.conn, e, what)
        if err.code == "server":
            await _arollback(self.conn)
        raise err from e

    async def _agate(self) -> Gate:
        early = self._gate_marker()
        if early is not None:
            return early
        return self._gate_answer(await self.r._around_trip(self._gate_commands))

    async def _alookup(self) -> bool:
        row = None
        try:
            params = [self.run.fingerprint] + self._key_params()
            if self.durable:
                row = await (await self._acommitted_alone(self._sql("lookup"), params)).fetchone()
            else:
                cur = await _aexec(self.conn, self._sql("lookup"), params)
                row = await cur.fetchone()
                await self.r._aend_tx(self.conn)
        except psycopg.Error as e:
            if self._lookup_refused(e):
                await self.conn.rollback()
                return False
            await self._apg_error(e, "idem_lookup")
        return self._lookup_answer(row)

    async def _aset_settings(self) -> None:
        for sql, params in self._settings():
            await _aexec(self.conn, sql, params)

    async def _acommitted_alone(self, sql: str, params: List[Any]) -> ACursor:
        """_RunContext._committed_alone."""
        cur: ACursor = (await _asend(self.conn, self._alone(sql, params), _as_is))[-2]
        return cur

    async def _aclaim(self) -> None:
        """_RunContext._claim."""
        conn = self.conn
        if self.first_sql is not None or conn.pgconn.pipeline_status:
            return await self._aclaim_with_first()
        try:
            self.tx_open = True
            res = (await _asimple(conn, self._claim_statements()))[-2]
            if self._claimed(self._claim_row(_values(conn, res)), None):
                return
            await conn.commit()
            self.tx_open = False
        except psycopg.Error as e:
            self.tx_open = False
            await self._apg_error(e, "idem_claim")

    async def _aclaim_with_first(self) -> None:
        run, conn = self.run, self.conn
        first: Any = None
        cur: Optional[ACursor] = None
        try:
            try:
                async with _apipeline(conn):
                    if conn.autocommit:
                        await _aexec(conn, "BEGIN")
                    self.tx_open = True
                    await self._aset_settings()
                    cur = await _aexec(conn, self._sql("claim"), self._claim_params())
                    await _aexec(conn, "SAVEPOINT idem_handler")
                    if self.first_sql is not None:
                        first = conn.cursor()
                        await first.execute(self.first_sql, self.first_params, prepare=False)
            except psycopg.Error as e:
                if not self._first_failed(e, first, cur):
                    raise
            assert cur is not None
            row = await _afetch_one(cur)
            first_rows = None
            if first is not None and run.first_error is None and row[0] == "claimed":
                first_rows = await first.fetchall() if first.description is not None else []
            if self._claimed(row, first_rows):
                return
            if first is not None:
                async with _apipeline(conn):
                    await _aexec(conn, "ROLLBACK TO SAVEPOINT idem_handler")
                    await _aexec(conn, "COMMIT")
            else:
                await conn.commit()
            self.tx_open = False
        except psycopg.Error as e:
            self.tx_open = False
            await self._apg_error(e, "idem_claim")

    async def __aenter__(self) -> Run:
        skip_gate = self._entering()
        self.st = await self.r._aidle_state(self.conn, "the run's transaction is the effect's, "
                                            "begun and committed by the runner")
        try:
            step = self._after_gate((False,) * 4 if skip_gate else await self._agate())
            if step == "lookup":
                await self._alookup()
            elif step == "claim" or (step == "lookup_or_claim" and not await self._alookup()):
                await self._aclaim()
        except BaseException:
            await self._adrop_marker()
            raise
        if not self._keeps_marker():
            await self._adrop_marker()
        return self.run

    async def __aexit__(self, et: Optional[Type[BaseException]], ev: Optional[BaseException],
                        tb: Optional[TracebackType]) -> bool:
        if not self.run.claimed:
            rollback, err = self._unclaimed_exit(et)
            if rollback:
                await self.conn.rollback()
            if err is not None:
                raise err
            return False
        try:
            return await self._afinish(et, ev)
        finally:
            await self._adrop_marker()

    async def _afinish(self, et: Optional[Type[BaseException]],
                       ev: Optional[BaseException]) -> bool:
        conn = self.conn
        rollback, err, failure, text, suppress = self._ending(et, ev)
        if rollback:
            await conn.rollback()
        if text is None:
            _raise_ending(err, ev)
            return False
        if _session_ended(conn):
            raise IdemError("connection", self.lost_before_end)
        await _asend(conn, self._ending_statements(failure, text), self._ending_failed,
                     simple=not conn.pgconn.pipeline_status)
        self._ended(failure, text)
        return suppress


class _AsyncApplyContext(_AsyncRunContext, _ApplyContext):
    """runner.apply: the gate, then one idem_apply statement."""

    async def _aclaim(self) -> None:
        conn = self.conn
        if _session_ended(conn):
            await self._adrop_marker()
            raise IdemError("connection", "connection lost before idem_apply was sent "
                            "(nothing committed)")
        try:
            if conn.autocommit and not self._settings():
                cur = await _aexec(conn, self._apply_sql(), self._apply_params())
            else:
                cur = await self._acommitted_alone(self._apply_sql(), self._apply_params())
        except psycopg.Error as e:
            err = self._apply_failed(e)
            if err is None:
                await self._apg_error(e, "idem_apply")
                raise       # not reached: _apg_error raises
            if err.code != "commit_unknown":
                await self._adrop_marker()
            raise err from e
        self._applied(await _afetch_one(cur))


class _AsyncLeaseContext(_AsyncRunContext, _LeaseContext):
    """runner.lease: the claim committed alone; after the block the
    fenced completion."""

    async def _aclaim(self) -> None:
        conn = self.conn
        if _session_ended(conn):
            raise IdemError("connection", "connection lost before the claim was sent "
                            "(nothing committed)")
        try:
            cur = await self._acommitted_alone(self._sql("claim"), self._claim_params())
        except psycopg.Error as e:
            err = self._lease_claim_failed(e)
            if err is not None:
                raise err from e
            await self._apg_error(e, "idem_claim")
        self._claimed(await _afetch_one(cur), None)

    async def __aenter__(self) -> Lease:
        await super().__aenter__()
        return self.lease

    async def __aexit__(self, et: Optional[Type[BaseException]], ev: Optional[BaseException],
                        tb: Optional[TracebackType]) -> bool:
        if not self.run.claimed:
            return await super().__aexit__(et, ev, tb)
        try:
            return await self._afinish(et, ev)
        finally:
            if self._drops_marker():
                await self._adrop_marker()


class AsyncBatch(Batch):
    """``async with runner.batch(conn, items) as batch:`` (Batch), and
    ``async with batch.step(run):``."""
    r: AsyncRunner
    conn: Any
    asynchronous = True

    async def __aenter__(self) -> "AsyncBatch":
        r, conn = self.r, self.conn
        r.stats["runs"] += len(self.runs)
        self.st = await r._aidle_state(conn, "the batch's transaction is begun and committed "
                                       "by the runner")
        await r._afrom_cache(self.st, self.runs)
        pending = [run for run in self.runs if run.status is None]
        if not pending:
            return self
        try:
            async with _apipeline(conn):
                if conn.autocommit:
                    await _aexec(conn, "BEGIN")
                self.tx_open = True
                if r.max_attempts is not None:
                    await _aexec(conn, MAX_ATTEMPTS_SQL, [str(r.max_attempts)])
                curs = [(g, await _aexec(conn, sql, params))
                        for g, sql, params in self._claim_statements(pending)]
                await _aexec(conn, "SAVEPOINT idem_batch")
            for group, cur in curs:
                self._claims_answered(group, await cur.fetchall())
            if not any(run.claimed for run in pending):
                await conn.commit()
                self.tx_open = False
        except psycopg.Error as e:
            self.tx_open = False
            for run in pending:
                run.claimed = False
            err = _pg_error_of(conn, e, "idem_claim_many")
            if err.code == "server":
                await _arollback(conn)
            raise err from e
        return self

    @contextlib.asynccontextmanager
    async def step(self, run: Run) -> AsyncIterator[Run]:  # type: ignore[override]
        """Batch.step."""
        conn = self.conn
        if not run.claimed:
            raise IdemError("state", "step() on a run that was not claimed")
        await _aexec(conn, "SAVEPOINT idem_step")
        try:
            yield run
        except Exception as e:
            if not self._step_failed(run, e):
                raise
            await _aexec(conn, "ROLLBACK TO SAVEPOINT idem_step")
        else:
            await _aexec(conn, self._step_ended(run))

    async def __aexit__(self, et: Optional[Type[BaseException]], ev: Optional[BaseException],
                        tb: Optional[TracebackType]) -> bool:
        conn = self.conn
        rollback, err, closing = self._exiting(et, ev)
        if rollback:
            await conn.rollback()
        if closing is None:
            _raise_ending(err, ev)
            return False
        if _session_ended(conn):
            raise IdemError("connection", "connection lost during the batch (nothing committed)")
        await _asend(conn, self._closing_statements(closing), self._closing_failed)
        self._closed(closing)
        return closing[3]


__all__ = ["AsyncRunner", "AsyncBatch"]
