"""What a developer meets without reading every paragraph, against the real
servers (test/python/run.sh starts them): errors that are the server's
state inside a block (a serialization failure, a deadlock, an operator's
cancel) are not attempts, a timeout's cancel is; the decorator refuses a message without an
id; any row factory works; every error says whether to redeliver;
nothing on stderr after a server error."""
import asyncio
import dataclasses
import os
import subprocess
import sys
import threading
import time
import unittest

import psycopg
from psycopg.rows import class_row, dict_row, namedtuple_row

import idem
import test_server
from idem.aio import AsyncRunner
from test_forms import ledger
from test_server import DSN, VPORT, admin, ckey, connect, effect, effects, uid, valkey


def setUpModule():
    test_server.setUpModule()
    with admin() as a:
        a.execute("CREATE TABLE IF NOT EXISTS contended (id int PRIMARY KEY, v int NOT NULL)")
        a.execute("INSERT INTO contended VALUES (1, 0), (2, 0) ON CONFLICT DO NOTHING")
        a.execute("""
            CREATE OR REPLACE FUNCTION py_rows_charge(args jsonb) RETURNS jsonb LANGUAGE sql AS $$
                INSERT INTO effects (scope, id, node) VALUES (args->>'scope', args->>'id', 'sql')
                RETURNING jsonb_build_object('id', id) $$""")


class ServerState(unittest.TestCase):
    """Errors of classes 40, 53, 57, 58 and XX escaping the block are the
    server's state, as idem_apply treats them: raised again, nothing
    recorded, the marker released, no attempt counted."""

    def setUp(self):
        self.runner = idem.Runner(("127.0.0.1", VPORT), lease=5, max_attempts=2)
        self.scope = uid("state")
        self.conn = connect()
        # REPEATABLE READ: the run's snapshot is the claim's
        self.conn.execute("SET default_transaction_isolation = 'repeatable read'")
        self.conn.commit()

    def tearDown(self):
        self.conn.close()

    def conflict(self):
        """In the block: a row another transaction updated after our
        snapshot, updated here too: a real 40001."""
        with admin() as a:
            a.execute("UPDATE contended SET v = v + 1 WHERE id = 1")
        self.conn.execute("UPDATE contended SET v = v + 1 WHERE id = 1")

    def test_serialization_failures_are_not_attempts(self):
        """two serialization failures (40001) in a run's block with max_attempts=2: raised, nothing recorded, the marker gone; the third delivery applies as attempt 1"""
        for _ in range(2):
            with self.assertRaises(psycopg.errors.SerializationFailure):
                with self.runner.run(self.conn, 1, self.scope, "s1", {"a": 1}) as run:
                    self.assertEqual((run.claimed, run.attempt), (True, 1))
                    effect(self.conn, run)
                    self.conflict()
            self.assertIsNone(run.status)
            self.assertIsNone(ledger(1, self.scope, "s1"))
            self.assertIsNone(valkey().get(ckey(1, self.scope, "s1")))
        with self.runner.run(self.conn, 1, self.scope, "s1", {"a": 1}) as run:
            self.assertEqual((run.claimed, run.attempt), (True, 1))
            effect(self.conn, run)
        self.assertEqual(run.status, "applied")
        self.assertEqual(effects(self.scope, "s1"), 1)

    def test_deadlock_in_a_handler(self):
        """a deadlock (40P01) in call's handler: raised, nothing recorded, the next delivery is attempt 1"""
        other = connect()
        locked, waiting = threading.Event(), threading.Event()

        def handler(conn, run):
            conn.execute("UPDATE contended SET v = v + 1 WHERE id = 1")
            locked.set()
            waiting.wait(10)
            # waits for row 2 first: this backend's deadlock check runs first
            conn.execute("UPDATE contended SET v = v + 1 WHERE id = 2")
            return {}

        def holder():
            locked.wait(10)
            other.execute("UPDATE contended SET v = v + 1 WHERE id = 2")
            waiting.set()
            time.sleep(0.3)
            try:
                other.execute("UPDATE contended SET v = v + 1 WHERE id = 1")
            finally:
                other.rollback()
        t = threading.Thread(target=holder)
        t.start()
        try:
            with self.assertRaises(psycopg.errors.DeadlockDetected):
                self.runner.call(self.conn, 1, self.scope, "d1", {}, handler)
        finally:
            t.join()
            other.close()
        self.assertIsNone(ledger(1, self.scope, "d1"))
        run = self.runner.call(self.conn, 1, self.scope, "d1", {}, lambda c, r: {"ok": r.attempt})
        self.assertEqual((run.status, run.outcome), ("applied", {"ok": 1}))

    def test_cancelled_statement_decorator_lease_and_batch(self):
        """an operator's cancel (57014, pg_cancel_backend) in a decorated function or a lease block, and a serialization failure in a batch step: raised, nothing recorded"""
        @self.runner.idempotent(self.scope, run_id="msg_id", request="body", tenant=1)
        def cancelled(conn, msg_id, body):
            conn.execute("SELECT pg_cancel_backend(pg_backend_pid()), pg_sleep(2)")
            return {}
        with self.assertRaises(psycopg.errors.QueryCanceled):
            cancelled(self.conn, "c1", {})
        self.assertIsNone(ledger(1, self.scope, "c1"))
        # lease mode: the claim has committed; the lease, not a failure, ends it
        with self.assertRaises(psycopg.errors.QueryCanceled):
            with self.runner.lease(self.conn, 1, self.scope, "c2", {}) as lease:
                self.assertTrue(lease.claimed)
                try:
                    self.conn.execute("SELECT pg_cancel_backend(pg_backend_pid()), pg_sleep(2)")
                finally:
                    self.conn.rollback()
        self.assertEqual(ledger(1, self.scope, "c2")[:2], ("processing", 1))
        items = [(1, self.scope, "b%d" % i, {}) for i in range(3)]
        with self.assertRaises(psycopg.errors.SerializationFailure):
            with self.runner.batch(self.conn, items) as batch:
                for run in batch.claimed:
                    with batch.step(run):
                        effect(self.conn, run)
                        if run.run_id == "b1":
                            self.conflict()
        for i in range(3):
            self.assertIsNone(ledger(1, self.scope, "b%d" % i))
        self.assertEqual(effects(self.scope), 0)


    def test_timeouts_are_attempts(self):
        """statement_timeout's cancel (57014) and lock_timeout's (55P03) in a decorated function, a lease block and a batch step: each an attempt, recorded failed_retryable; max_attempts=2 ends them (the third delivery answers failed_permanent, the block not run)"""
        calls = []

        @self.runner.idempotent(self.scope, run_id="msg_id", request="body", tenant=1)
        def slow(conn, msg_id, body):
            calls.append(msg_id)
            conn.execute("SET LOCAL statement_timeout = '50ms'")
            conn.execute("SELECT pg_sleep(2)")
            return {}

        @self.runner.idempotent(self.scope, run_id="msg_id", request="body", tenant=1)
        def locked(conn, msg_id, body):
            calls.append(msg_id)
            conn.execute("SET LOCAL lock_timeout = '50ms'")
            conn.execute("UPDATE contended SET v = v + 1 WHERE id = 2")
            return {}
        holder = connect()
        try:
            holder.execute("SELECT v FROM contended WHERE id = 2 FOR UPDATE")
            for fn, id, exc, state in ((slow, "t1", psycopg.errors.QueryCanceled, "57014"),
                                       (locked, "t2", psycopg.errors.LockNotAvailable, "55P03")):
                for attempt in (1, 2):
                    with self.assertRaises(exc):
                        fn(self.conn, id, {})
                    got = ledger(1, self.scope, id)
                    self.assertEqual(got[:2], ("failed_retryable", attempt), id)
                    self.assertEqual(got[2]["error"], exc.__name__)
                with self.assertRaises(idem.PermanentFailure):
                    fn(self.conn, id, {})
                self.assertEqual(ledger(1, self.scope, id)[:2], ("failed_permanent", 2))
            self.assertEqual(calls, ["t1", "t1", "t2", "t2"])
            # lease mode: the fenced failure is recorded
            with self.assertRaises(psycopg.errors.QueryCanceled):
                with self.runner.lease(self.conn, 1, self.scope, "t3", {}) as lease:
                    self.conn.execute("SET statement_timeout = '50ms'")
                    try:
                        self.conn.execute("SELECT pg_sleep(2)")
                    finally:
                        self.conn.rollback()    # the SET with it
            self.assertEqual(ledger(1, self.scope, "t3")[:2], ("failed_retryable", 1))
            # a batch step: its run fails, the batch goes on
            with self.runner.batch(self.conn, [(1, self.scope, "t4", {}),
                                               (1, self.scope, "t5", {})]) as batch:
                for run in batch.claimed:
                    with batch.step(run):
                        effect(self.conn, run)
                        if run.run_id == "t4":
                            self.conn.execute("SET LOCAL statement_timeout = '50ms'")
                            self.conn.execute("SELECT pg_sleep(2)")
            self.assertEqual([r.status for r in batch.runs], ["failed_retryable", "applied"])
            self.assertEqual(ledger(1, self.scope, "t4")[:2], ("failed_retryable", 1))
            self.assertEqual(effects(self.scope, "t4"), 0)
        finally:
            holder.close()

    def test_caught_timeouts_are_attempts(self):
        """statement_timeout's and lock_timeout's cancels caught by a decorated function (or a lease block) that then returns: its transaction is aborted, so it is the same attempt, recorded failed_retryable with the server's sqlstate and message, and max_attempts=2 ends it; another error caught is still the block's mistake, nothing recorded"""
        calls = []

        @self.runner.idempotent(self.scope, run_id="msg_id", request="body", tenant=1)
        def swallows(conn, msg_id, body):
            calls.append(msg_id)
            try:
                if msg_id == "s2":
                    conn.execute("SET LOCAL lock_timeout = '50ms'")
                    conn.execute("UPDATE contended SET v = v + 1 WHERE id = 2")
                elif msg_id == "s3":
                    conn.execute("SELECT 1 / 0")
                else:
                    conn.execute("SET LOCAL statement_timeout = '50ms'")
                    conn.execute("SELECT pg_sleep(2)")
            except (psycopg.errors.QueryCanceled, psycopg.errors.LockNotAvailable,
                    psycopg.errors.DivisionByZero):
                pass                    # caught: "best effort"
            return {"done": True}
        holder = connect()
        try:
            holder.execute("SELECT v FROM contended WHERE id = 2 FOR UPDATE")
            for id, state, message in (
                    ("s1", "57014", "canceling statement due to statement timeout"),
                    ("s2", "55P03", "canceling statement due to lock timeout")):
                for attempt in (1, 2):
                    with self.assertRaises(idem.RetryableFailure) as cm:
                        swallows(self.conn, id, {})
                    self.assertEqual(cm.exception.detail, {"sqlstate": state, "message": message})
                    self.assertEqual(ledger(1, self.scope, id)[:2], ("failed_retryable", attempt))
                with self.assertRaises(idem.PermanentFailure):
                    swallows(self.conn, id, {})
                self.assertEqual(ledger(1, self.scope, id)[:3],
                                 ("failed_permanent", 2, {"sqlstate": state, "message": message}))
            self.assertEqual(calls, ["s1", "s1", "s2", "s2"])
            with self.assertRaises(idem.IdemError) as cm:
                swallows(self.conn, "s3", {})
            self.assertEqual((cm.exception.code, ledger(1, self.scope, "s3")), ("handler", None))
            # lease mode: the fenced failure is recorded
            with self.runner.lease(self.conn, 1, self.scope, "s4", {}) as lease:
                self.conn.execute("SET LOCAL statement_timeout = '50ms'")
                try:
                    self.conn.execute("SELECT pg_sleep(2)")
                except psycopg.errors.QueryCanceled:
                    lease.outcome = {"sent": "maybe"}
            self.assertEqual((lease.status, ledger(1, self.scope, "s4")[:2]),
                             ("failed_retryable", ("failed_retryable", 1)))
            self.assertEqual(self.conn.info.transaction_status, psycopg.pq.TransactionStatus.IDLE)
        finally:
            holder.close()


class DecoratorIds(unittest.TestCase):
    def test_missing_or_empty_id_refused(self):
        """the decorator refuses a None or empty id (IdemError "argument", not retryable) before anything is claimed; 12 and "12" are one key"""
        runner = idem.Runner(("127.0.0.1", VPORT), lease=5)
        scope = uid("ids")
        calls = []

        @runner.idempotent(scope, run_id="msg_id", request="body", tenant=1)
        def handle(conn, msg_id, body):
            calls.append(msg_id)
            conn.execute("INSERT INTO effects (scope, id) VALUES (%s, %s)", [scope, str(msg_id)])
            return {"n": len(calls)}

        conn = connect()
        try:
            for bad in (None, "", 1.5, b"12"):
                with self.assertRaises(idem.IdemError, msg=repr(bad)) as cm:
                    handle(conn, bad, {"a": 1})
                self.assertEqual((cm.exception.code, cm.exception.retryable), ("argument", False))
            self.assertEqual(calls, [])
            self.assertEqual(effects(scope), 0)
            self.assertEqual(handle(conn, 12, {"a": 1}), {"n": 1})
            self.assertEqual(handle(conn, "12", {"a": 1}), {"n": 1})   # replayed
            self.assertEqual(calls, [12])
        finally:
            conn.close()


@dataclasses.dataclass
class Point:
    x: int
    y: int


class RowFactories(unittest.TestCase):
    def test_any_row_factory(self):
        """a connection with dict_row, namedtuple_row or class_row: run, first_sql, apply, lease, batch, cached, the lookup and the start-up check (both runners) all work; the block's rows are in its factory"""
        runner = idem.Runner(("127.0.0.1", VPORT), lease=5)
        down = idem.Runner(("127.0.0.1", test_server.free_port()), lease=5)  # lookup first
        for name, factory, want in (("dict", dict_row, {"x": 1, "y": 2}),
                                    ("namedtuple", namedtuple_row, (1, 2)),
                                    ("class", class_row(Point), Point(1, 2))):
            scope = uid("rows-" + name)
            conn = connect(row_factory=factory)
            try:
                with runner.run(conn, 1, scope, "r1", {"a": 1},
                                first_sql="SELECT 1 AS x, 2 AS y") as run:
                    self.assertEqual(run.first, [want])
                    self.assertEqual(conn.execute("SELECT 1 AS x, 2 AS y").fetchone(), want)
                    effect(conn, run)
                self.assertEqual(run.status, "applied", name)
                with down.run(conn, 1, scope, "r1", {"a": 1}) as run:
                    pass                    # Valkey down: idem_lookup answers
                self.assertEqual((run.status, run.source), ("replayed", "postgres"), name)
                run = runner.apply(conn, 1, scope, "a1", {}, "py_rows_charge(jsonb)",
                                   args={"scope": scope, "id": "a1"})
                self.assertEqual(run.status, "applied", name)
                with runner.lease(conn, 1, scope, "l1", {}) as lease:
                    lease.outcome = {"sent": True}
                self.assertEqual(lease.status, "applied", name)
                with runner.batch(conn, [(1, scope, "b1", {}), (None, scope, "b2", {})]) as b:
                    for run in b:
                        effect(conn, run)
                self.assertEqual([r.status for r in b.runs], ["applied", "applied"], name)
                test_server.wait_copy(ckey(1, scope, "r1"))
                self.assertEqual(runner.cached(conn, 1, scope, "r1", {"a": 1}).status, "replayed")
                check = runner.check(conn)
                self.assertTrue(check, (name, check))
            finally:
                conn.close()

            async def acheck():
                aconn = await psycopg.AsyncConnection.connect(DSN, row_factory=factory)
                try:
                    async with AsyncRunner(("127.0.0.1", VPORT)) as arunner:
                        return await arunner.check(aconn)
                finally:
                    await aconn.close()
            check = asyncio.run(acheck())
            self.assertTrue(check, (name, check))


class Errors(unittest.TestCase):
    def test_codes_say_whether_to_retry(self):
        """IdemError.retryable: an unknown tenant (23503) and an extension not installed (not_installed) are not retryable; a lost connection is; Busy is, Mismatch is not; an AsyncConnection is refused (argument)"""
        runner = idem.Runner(("127.0.0.1", VPORT), lease=5)
        scope = uid("codes")
        conn = connect()
        try:
            with self.assertRaises(idem.IdemError) as cm:
                runner.call(conn, 999, scope, "e1", {}, lambda c, r: {})
            self.assertEqual((cm.exception.code, cm.exception.sqlstate, cm.exception.retryable),
                             ("server", "23503", False))
            with self.assertRaises(idem.IdemError) as cm:
                with runner.run(conn, 1, scope, "e2", {}) as run:
                    with admin() as a:
                        a.execute("SELECT pg_terminate_backend(%s)", [conn.info.backend_pid])
                    time.sleep(0.2)
            self.assertEqual((cm.exception.code, cm.exception.retryable), ("connection", True))
        finally:
            conn.close()
        with admin() as a:
            if a.execute("SELECT count(*) FROM pg_database WHERE datname = 'py_noidem'").fetchone()[0] == 0:
                a.execute("CREATE DATABASE py_noidem")
        bare = psycopg.connect(DSN.replace("dbname=postgres", "dbname=py_noidem"))
        try:
            for form in (lambda: runner.run(bare, 1, scope, "n1", {}).__enter__(),
                         lambda: runner.apply(bare, 1, scope, "n1", {}, "f(jsonb)"),
                         lambda: runner.batch(bare, [(1, scope, "n1", {})]).__enter__(),
                         lambda: runner.complete(bare, 1, scope, "n1", {}, attempt=1)):
                with self.assertRaises(idem.IdemError) as cm:
                    form()
                self.assertEqual((cm.exception.code, cm.exception.retryable),
                                 ("not_installed", False))
                self.assertIn("CREATE EXTENSION idem", str(cm.exception))
        finally:
            bare.close()
        # the runner is synchronous: an AsyncConnection is refused, clearly
        async def with_async_connection():
            aconn = await psycopg.AsyncConnection.connect(DSN)
            try:
                with self.assertRaises(idem.IdemError) as cm:
                    runner.run(aconn, 1, scope, "x1", {})
                self.assertEqual(cm.exception.code, "argument")
                self.assertIn("synchronous", str(cm.exception))
            finally:
                await aconn.close()
        asyncio.run(with_async_connection())
        self.assertTrue(idem.Busy.retryable)
        self.assertFalse(idem.Mismatch.retryable)
        self.assertTrue(idem.CommitUnknown("x").retryable)

    def test_no_stderr_noise_on_server_errors(self):
        """server errors inside the runner's pipelines (an unknown tenant, in every form) print nothing on stderr (no psycopg "pipeline aborted" warning)"""
        code = """
import os, psycopg, idem
runner = idem.Runner(("127.0.0.1", int(os.environ["VP"])), max_attempts=3)
for autocommit in (False, True):
    conn = psycopg.connect(os.environ["DSN"], autocommit=autocommit)
    for i in range(10):
        for form in ("run", "lease", "apply", "batch"):
            try:
                if form == "run":
                    with runner.run(conn, 999, "noise", "n%d" % i, {}) as run:
                        pass
                elif form == "lease":
                    with runner.lease(conn, 999, "noise", "n%d" % i, {}) as lease:
                        pass
                elif form == "apply":
                    runner.apply(conn, 999, "noise", "n%d" % i, {}, "py_rows_charge(jsonb)")
                else:
                    with runner.batch(conn, [(999, "noise", "n%d" % i, {})]) as batch:
                        pass
            except idem.IdemError as e:
                assert e.sqlstate == "23503", e
            else:
                raise AssertionError(form + ": no error")
print("done")
"""
        env = dict(os.environ, DSN=DSN, VP=str(VPORT))
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=120)
        self.assertEqual((p.returncode, p.stdout.strip(), p.stderr), (0, "done", ""))


if __name__ == "__main__":
    unittest.main()
