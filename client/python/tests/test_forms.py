"""The runner's other forms against a real PostgreSQL with idem preloaded and
a real Valkey: a SQL handler run by idem_apply (runner.apply), lease mode
(runner.lease, runner.complete), batches (runner.batch, runner.cached_many),
delivery_count, first_sql and max_attempts.  Each test checks what the
servers hold: effects counted in the table, statuses in the ledger."""
import os
import subprocess
import sys
import threading
import time
import unittest

import psycopg

import idem
from idem import cache
import test_server
from test_server import VPORT, admin, ckey, connect, effect, effects, uid, valkey, wait_copy


def setUpModule():
    test_server.setUpModule()
    with admin() as a:
        a.execute("""
            CREATE OR REPLACE FUNCTION py_charge(args jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
            BEGIN
              IF args ? 'raise' THEN
                RAISE EXCEPTION 'refused' USING ERRCODE = args->>'raise';
              END IF;
              IF args ? 'sleep' THEN PERFORM pg_sleep((args->>'sleep')::float8); END IF;
              INSERT INTO effects (scope, id, node) VALUES (args->>'scope', args->>'id', 'sql');
              RETURN jsonb_build_object('charged', args->'amount');
            END $$""")


def ledger(tenant, scope, id):
    """(status, attempt, outcome) of the key in the ledger, or None."""
    with admin() as a:
        if tenant is None:
            row = a.execute("SELECT status, attempt, outcome FROM idem_platform_lookup(idem_key(%s, %s))",
                            [scope, id]).fetchone()
        else:
            row = a.execute("SELECT status, attempt, outcome FROM idem_lookup(%s, idem_key(%s, %s))",
                            [tenant, scope, id]).fetchone()
    return None if row is None or row[0] is None else tuple(row)


def hold(scope, id, tenant=1):
    """Another transaction that claims the key and keeps it: (conn, release)."""
    c = connect()
    c.execute("SELECT idem_claim(%s, idem_key(%s, %s), idem_fingerprint('{}'))", [tenant, scope, id])
    return c


class Base(unittest.TestCase):
    def setUp(self):
        self.runner = idem.Runner(("127.0.0.1", VPORT), lease=5)
        self.conn = connect()
        self.scope = uid("forms")

    def tearDown(self):
        self.conn.close()


class Apply(Base):
    def req(self, id, **kw):
        return dict({"scope": self.scope, "id": id, "amount": 5}, **kw)

    def apply(self, id, request=None, **kw):
        return self.runner.apply(kw.pop("conn", self.conn), kw.pop("tenant", 1), self.scope, id,
                                 request if request is not None else self.req(id),
                                 "py_charge(jsonb)", **kw)

    def test_applied_replayed_mismatch(self):
        """apply: one statement applies the SQL handler once; replayed from Valkey after the copy and from PostgreSQL after a flush; another request is a mismatch"""
        run = self.apply("a1")
        self.assertEqual((run.status, run.source, run.attempt, run.outcome),
                         ("applied", "handler", 1, {"charged": 5}))
        self.assertEqual(self.conn.info.transaction_status, psycopg.pq.TransactionStatus.IDLE)
        wait_copy(ckey(1, self.scope, "a1"))
        run = self.apply("a1")
        self.assertEqual((run.status, run.source, run.outcome), ("replayed", "valkey", {"charged": 5}))
        valkey().flushall()
        run = self.apply("a1")
        self.assertEqual((run.status, run.source, run.outcome), ("replayed", "postgres", {"charged": 5}))
        run = self.apply("a1", self.req("a1", amount=6))
        self.assertEqual((run.status, run.source), ("mismatch", "postgres"))
        self.assertEqual(effects(self.scope, "a1"), 1)
        self.assertEqual(ledger(1, self.scope, "a1")[:2], ("completed", 1))

    def test_failures_recorded(self):
        """apply: RAISE P0001 is recorded failed_permanent (replayed), another SQLSTATE failed_retryable, then attempt 2 applies; args replace the request"""
        run = self.apply("f1", self.req("f1", **{"raise": "P0001"}))
        self.assertEqual((run.status, run.source, run.outcome["sqlstate"]),
                         ("failed_permanent", "handler", "P0001"))
        run = self.apply("f1", self.req("f1", **{"raise": "P0001"}))
        self.assertEqual((run.status, run.source), ("failed_permanent", "postgres"))
        run = self.apply("f2", self.req("f2"), args=self.req("f2", **{"raise": "P0002"}))
        self.assertEqual((run.status, run.attempt, run.outcome["sqlstate"]),
                         ("failed_retryable", 1, "P0002"))
        self.assertEqual(ledger(1, self.scope, "f2")[:2], ("failed_retryable", 1))
        run = self.apply("f2", self.req("f2"))      # the request again: args = the request
        self.assertEqual((run.status, run.attempt, run.outcome), ("applied", 2, {"charged": 5}))
        self.assertEqual((effects(self.scope, "f1"), effects(self.scope, "f2")), (0, 1))

    def test_busy_platform_autocommit_off(self):
        """apply: busy while another transaction holds the key; the platform ledger; a connection with autocommit on"""
        holder = hold(self.scope, "b1")
        try:
            run = self.apply("b1")
            self.assertEqual(run.status, "busy")
            self.assertGreater(run.retry_after, 0)
        finally:
            holder.rollback()
            holder.close()
        self.assertEqual(self.apply("b1").status, "applied")
        auto = connect(autocommit=True)
        try:
            run = self.apply("p1", conn=auto, tenant=None)
            self.assertEqual((run.status, ledger(None, self.scope, "p1")[0]), ("applied", "completed"))
        finally:
            auto.close()
        self.assertEqual((effects(self.scope, "b1"), effects(self.scope, "p1")), (1, 1))

    def test_concurrent_deliveries(self):
        """apply: 6 threads deliver 20 keys each, in their own order: every effect exactly once, every delivery applied, replayed or busy"""
        ids = ["c%d" % i for i in range(20)]
        seen, errors = [], []

        def worker(n):
            conn = connect()
            try:
                for id in (ids if n % 2 else ids[::-1]):
                    seen.append(self.apply(id, conn=conn).status)
            except Exception as e:     # reported below
                errors.append(e)
            finally:
                conn.close()
        threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])
        self.assertEqual(set(seen) - {"applied", "replayed", "busy"}, set())
        self.assertEqual(seen.count("applied"), 20)
        self.assertEqual(effects(self.scope), 20)

    def test_commit_unknown(self):
        """apply: the backend terminated while idem_apply runs: CommitUnknown (never "nothing committed"), and the redelivery applies once"""
        pid = self.conn.info.backend_pid

        def terminate():
            with admin() as a:
                for _ in range(100):
                    time.sleep(0.05)
                    if a.execute("SELECT wait_event = 'PgSleep' FROM pg_stat_activity WHERE pid = %s",
                                 [pid]).fetchone() == (True,):
                        a.execute("SELECT pg_terminate_backend(%s)", [pid])
                        return
        t = threading.Thread(target=terminate)
        t.start()
        with self.assertRaises(idem.CommitUnknown):
            self.apply("u1", self.req("u1"), args=self.req("u1", sleep=3))
        t.join()
        self.conn = connect()
        self.assertEqual(self.apply("u1").status, "applied")
        self.assertEqual(effects(self.scope, "u1"), 1)


class Options(Base):
    def test_unstorable_outcome(self):
        """a handler outcome that is not a JSON object, or over 4096 bytes: the attempt fails as in idem_apply (22023 permanent, 54000 retryable), its effect rolled back; max_attempts=2 ends an always-oversize one"""
        calls = []

        def handler(conn, run):
            calls.append(run.attempt)
            effect(conn, run)
            return [1, 2] if run.run_id == "u1" else {"blob": "x" * 5000}
        r = self.runner.call(self.conn, 1, self.scope, "u1", {}, handler)
        self.assertEqual((r.status, r.attempt, r.outcome),
                         ("failed_permanent", 1, {"sqlstate": "22023",
                                                  "message": "handler outcome must be a JSON object"}))
        self.assertEqual(ledger(1, self.scope, "u1")[0], "failed_permanent")
        runner = idem.Runner(("127.0.0.1", VPORT), lease=5, max_attempts=2)
        statuses = [runner.call(self.conn, 1, self.scope, "u2", {}, handler) for _ in range(3)]
        self.assertEqual([(r.status, r.attempt) for r in statuses],
                         [("failed_retryable", 1), ("failed_retryable", 2), ("failed_permanent", 2)])
        self.assertEqual(statuses[0].outcome,
                         {"sqlstate": "54000", "message": "handler outcome is 5012 bytes as JSON "
                          "text, over the limit of 4096 bytes"})
        self.assertEqual(calls, [1, 1, 2])
        self.assertEqual(effects(self.scope, "u1") + effects(self.scope, "u2"), 0)
        self.assertEqual(ledger(1, self.scope, "u2")[0], "failed_permanent")
        # a run's block that sets a bad outcome: the same
        with self.runner.run(self.conn, 1, self.scope, "u3", {}) as run:
            effect(self.conn, run)
            run.outcome = "text"
        self.assertEqual((run.status, run.outcome["sqlstate"]), ("failed_permanent", "22023"))
        self.assertEqual(effects(self.scope, "u3"), 0)

    def test_unstorable_outcome_lease_and_batch(self):
        """lease mode and batches: an outcome over 4096 bytes or not a JSON object fails the attempt as a run's does (54000 retryable, 22023 permanent), recorded; max_attempts=2 ends an always-oversize lease; a batch step's effect rolls back alone, outside a step the batch's do and its other runs fail retryably"""
        runner = idem.Runner(("127.0.0.1", VPORT), lease=5, max_attempts=2)
        got = []
        for _ in range(3):
            with runner.lease(self.conn, 1, self.scope, "l1", {}) as lease:
                if lease.claimed:
                    effect(self.conn, lease)    # left open: rolled back with the attempt
                    lease.outcome = {"blob": "x" * 5000}
            got.append((lease.status, lease.attempt, lease.outcome["sqlstate"]))
        self.assertEqual(got, [("failed_retryable", 1, "54000"), ("failed_retryable", 2, "54000"),
                               ("failed_permanent", 2, "54000")])
        self.assertEqual(ledger(1, self.scope, "l1")[:2], ("failed_permanent", 2))
        with self.runner.lease(self.conn, 1, self.scope, "l2", {}) as lease:
            lease.outcome = [1]
        self.assertEqual((lease.status, lease.outcome["sqlstate"]), ("failed_permanent", "22023"))
        self.assertEqual(ledger(1, self.scope, "l2")[0], "failed_permanent")
        # a step: that run's attempt fails, its effect rolled back; the batch goes on
        with self.runner.batch(self.conn, [(1, self.scope, "b1", {}),
                                           (1, self.scope, "b2", {})]) as batch:
            for run in batch.claimed:
                with batch.step(run):
                    effect(self.conn, run)
                    if run.run_id == "b1":
                        run.outcome = {"blob": "x" * 5000}
        self.assertEqual([(r.status, (r.outcome or {}).get("sqlstate")) for r in batch.runs],
                         [("failed_retryable", "54000"), ("applied", None)])
        self.assertEqual((effects(self.scope, "b1"), effects(self.scope, "b2")), (0, 1))
        self.assertEqual(ledger(1, self.scope, "b1")[:2], ("failed_retryable", 1))
        # outside a step: the batch's statements roll back, every run fails
        with self.runner.batch(self.conn, [(1, self.scope, "b3", {}),
                                           (1, self.scope, "b4", {})]) as batch:
            for run in batch.claimed:
                effect(self.conn, run)
                if run.run_id == "b3":
                    run.outcome = "text"
        self.assertEqual([(r.status, r.outcome["sqlstate"]) for r in batch.runs],
                         [("failed_permanent", "22023"), ("failed_retryable", "22023")])
        self.assertEqual(effects(self.scope, "b3") + effects(self.scope, "b4"), 0)
        self.assertEqual(ledger(1, self.scope, "b4")[:2], ("failed_retryable", 1))

    def test_unstorable_outcome_deferred(self):
        """a deferred lease settled by runner.complete / runner.fail with an outcome or detail the ledger cannot store (over 4096 bytes, not an object, a NUL in a text) records the failure a lease's block records (54000 retryable, 22023 permanent) and returns its status; max_attempts=2 ends an always-oversize one"""
        runner = idem.Runner(("127.0.0.1", VPORT), lease=5, max_attempts=2)
        got = []
        with admin() as a:          # autocommit: each settle commits by itself
            for _ in range(3):
                with runner.lease(self.conn, 1, self.scope, "d1", {}) as lease:
                    if lease.claimed:
                        lease.defer()
                if lease.claimed:
                    got.append((runner.complete(a, 1, self.scope, "d1", {"blob": "x" * 5000},
                                                fence=lease.fence),) + ledger(1, self.scope, "d1")[:2])
                else:
                    got.append((lease.status, lease.attempt))
            self.assertEqual(got, [("failed_retryable", "failed_retryable", 1),
                                   ("failed_retryable", "failed_retryable", 2),
                                   ("failed_permanent", 2)])
            self.assertEqual(ledger(1, self.scope, "d1")[2]["sqlstate"], "54000")
            for id, settle, sqlstate in (
                    ("d2", lambda l: runner.complete(a, 1, self.scope, "d2", [1], fence=l.fence),
                     "22023"),
                    ("d3", lambda l: runner.complete(a, 1, self.scope, "d3", {"t": "a\x00b"},
                                                     attempt=l.attempt), "22023"),
                    ("d4", lambda l: runner.fail(a, 1, self.scope, "d4", {"blob": "x" * 5000},
                                                 fence=l.fence, retryable=False), "54000"),
                    ("d5", lambda l: runner.fail(a, 1, self.scope, "d5", "text", fence=l.fence,
                                                 retryable=True), "22023")):
                with runner.lease(self.conn, 1, self.scope, id, {}) as lease:
                    lease.defer()
                self.assertEqual(settle(lease), "failed_permanent", id)
                row = ledger(1, self.scope, id)
                self.assertEqual((row[0], row[2]["sqlstate"]), ("failed_permanent", sqlstate), id)
            with runner.lease(self.conn, 1, self.scope, "d6", {}) as lease:
                lease.defer()
            self.assertEqual(runner.complete(a, 1, self.scope, "d6", {"ok": 1}, fence=lease.fence),
                             "applied")
            with runner.lease(self.conn, 1, self.scope, "d7", {}) as lease:
                lease.defer()
            self.assertEqual(runner.fail(a, 1, self.scope, "d7", {"no": 1}, fence=lease.fence,
                                         retryable=True), "failed_retryable")
        self.assertEqual(ledger(1, self.scope, "d7")[:3], ("failed_retryable", 1, {"no": 1}))

    def test_max_attempts(self):
        """max_attempts=2: two retryable failures, then the third delivery is failed_permanent with the last detail, without running the handler"""
        runner = idem.Runner(("127.0.0.1", VPORT), lease=5, max_attempts=2)
        calls = []

        def handler(conn, run):
            calls.append(run.attempt)
            effect(conn, run)
            raise idem.RetryableFailure({"try": run.attempt})
        statuses = [runner.call(self.conn, 1, self.scope, "m1", {}, handler) for _ in range(4)]
        self.assertEqual([(r.status, r.attempt) for r in statuses],
                         [("failed_retryable", 1), ("failed_retryable", 2),
                          ("failed_permanent", 2), ("failed_permanent", 2)])
        self.assertEqual(statuses[2].outcome, {"try": 2})
        self.assertEqual(calls, [1, 2])
        self.assertEqual(effects(self.scope, "m1"), 0)         # rolled back each time
        self.assertEqual(ledger(1, self.scope, "m1")[0], "failed_permanent")
        # without the option the session's setting (0: no limit) holds
        for _ in range(2):
            self.runner.call(self.conn, 1, self.scope, "m2", {}, handler)
        other = self.runner.call(self.conn, 1, self.scope, "m2", {}, handler)
        self.assertEqual((other.status, other.attempt), ("failed_retryable", 3))
        # and with idem_apply
        for _ in range(2):
            runner.apply(self.conn, 1, self.scope, "m3", {"raise": "P0002"}, "py_charge(jsonb)")
        run = runner.apply(self.conn, 1, self.scope, "m3", {"raise": "P0002"}, "py_charge(jsonb)")
        self.assertEqual((run.status, run.source, run.attempt), ("failed_permanent", "postgres", 2))

    def test_delivery_count(self):
        """delivery_count 1 skips the gate (no marker, the claim decides) and is still exactly once for a duplicate flagged 1; the decorator takes it from an argument"""
        v = valkey()
        k = ckey(1, self.scope, "d1")
        with self.runner.run(self.conn, 1, self.scope, "d1", {}, delivery_count=1) as run:
            self.assertTrue(run.claimed)
            self.assertIsNone(v.get(k))             # no marker set
            effect(self.conn, run)
        self.assertEqual((run.status, run.valkey_used), ("applied", False))
        self.assertEqual(self.runner.stats["gate_skipped_first"], 1)
        wait_copy(k)
        dup = self.runner.call(self.conn, 1, self.scope, "d1", {}, effect, delivery_count=1)
        self.assertEqual((dup.status, dup.source), ("replayed", "postgres"))
        dup = self.runner.call(self.conn, 1, self.scope, "d1", {}, effect, delivery_count=2)
        self.assertEqual((dup.status, dup.source), ("replayed", "valkey"))
        with self.assertRaises(idem.IdemError):
            self.runner.run(self.conn, 1, self.scope, "d1", {}, delivery_count=-1)

        @self.runner.idempotent(self.scope, run_id="msg_id", request="body", tenant=1,
                                delivery_count="count")
        def consume(conn, msg_id, body, count):
            conn.execute("INSERT INTO effects (scope, id) VALUES (%s, %s)", [self.scope, msg_id])
            return {"ok": msg_id}
        self.assertEqual(consume(self.conn, "d2", {}, 1), {"ok": "d2"})
        self.assertEqual(consume(self.conn, "d2", {}, 2), {"ok": "d2"})
        self.assertEqual(self.runner.stats["gate_skipped_first"], 3)
        self.assertEqual((effects(self.scope, "d1"), effects(self.scope, "d2")), (1, 1))

    def test_first_sql(self):
        """first_sql is sent with the claim: its rows are run.first; when the key is not ours its effect is rolled back; a failed one is the block's to record"""
        sql = "INSERT INTO effects (scope, id, node) VALUES (%s, %s, 'first') RETURNING id"
        with self.runner.run(self.conn, 1, self.scope, "s1", {}, first_sql=sql,
                             first_params=[self.scope, "s1"]) as run:
            self.assertEqual(run.first, [("s1",)])
            run.outcome = {"id": run.first[0][0]}
        self.assertEqual((run.status, run.outcome), ("applied", {"id": "s1"}))
        wait_copy(ckey(1, self.scope, "s1"))
        valkey().flushall()     # the gate cannot answer: the claim does, with first_sql sent
        with self.runner.run(self.conn, 1, self.scope, "s1", {}, first_sql=sql,
                             first_params=[self.scope, "s1"]) as run:
            self.assertFalse(run.claimed)
        self.assertEqual((run.status, run.source, run.first), ("replayed", "postgres", None))
        self.assertEqual(effects(self.scope, "s1"), 1)
        with self.runner.run(self.conn, 1, self.scope, "s2", {}, first_sql="SELECT 1 / 0") as run:
            self.assertIsInstance(run.first_error, psycopg.errors.DivisionByZero)
            run.fail({"first": "failed"}, retryable=True)
        self.assertEqual((run.status, ledger(1, self.scope, "s2")[0]),
                         ("failed_retryable", "failed_retryable"))


    def test_fail_after_failed_statement(self):
        """a block whose statement failed (caught) and that calls run.fail() records the failure, its statements rolled back to the savepoint (as the C runner)"""
        with self.runner.run(self.conn, 1, self.scope, "e1", {}) as run:
            effect(self.conn, run)
            try:
                self.conn.execute("SELECT 1 / 0")
            except psycopg.errors.DivisionByZero:
                run.fail({"division": "by zero"}, retryable=False)
        self.assertEqual((run.status, run.outcome), ("failed_permanent", {"division": "by zero"}))
        self.assertEqual(ledger(1, self.scope, "e1")[0], "failed_permanent")
        self.assertEqual(effects(self.scope, "e1"), 0)


class LeaseMode(Base):
    def test_lease_completes_and_replays(self):
        """lease: the claim commits before the effect (another delivery is busy meanwhile), the completion after it; then replays"""
        other = connect()
        try:
            with self.runner.lease(self.conn, 1, self.scope, "l1", {"to": "a"}, lease=10) as lease:
                self.assertTrue(lease.claimed)
                self.assertEqual(ledger(1, self.scope, "l1")[0], "processing")     # committed
                self.assertEqual(self.conn.info.transaction_status,
                                 psycopg.pq.TransactionStatus.IDLE)
                dup = self.runner.call(other, 1, self.scope, "l1", {"to": "a"}, effect)
                self.assertEqual(dup.status, "busy")
                effect(other, lease)       # the effect: elsewhere (here: committed by another connection)
                other.commit()
                lease.outcome = {"sent": True}
        finally:
            other.close()
        self.assertEqual((lease.status, lease.attempt, lease.outcome), ("applied", 1, {"sent": True}))
        self.assertEqual(ledger(1, self.scope, "l1")[:3], ("completed", 1, {"sent": True}))
        with self.runner.lease(self.conn, 1, self.scope, "l1", {"to": "a"}) as again:
            self.assertFalse(again.claimed)
        self.assertEqual((again.status, again.outcome), ("replayed", {"sent": True}))
        self.assertEqual(effects(self.scope, "l1"), 1)

    def test_fence(self):
        """lease: a holder whose lease ended and whose key was taken over gets LeaseLost; the ledger keeps the later attempt's outcome"""
        other = connect()
        short = idem.Runner(("127.0.0.1", VPORT), lease=0.3)     # its marker's lease too
        try:
            with self.assertRaises(idem.LeaseLost):
                with short.lease(self.conn, 1, self.scope, "x1", {}) as slow:
                    self.assertEqual((slow.attempt, slow.duration), (1, 0.3))
                    time.sleep(0.6)     # the lease ends, and the marker with it
                    with self.runner.lease(other, 1, self.scope, "x1", {}, lease=10) as fast:
                        self.assertEqual((fast.claimed, fast.attempt), (True, 2))
                        fast.outcome = {"by": 2}
                    slow.outcome = {"by": 1}
        finally:
            other.close()
        self.assertEqual(fast.status, "applied")
        self.assertIsNone(slow.status)
        self.assertEqual(ledger(1, self.scope, "x1")[:3], ("completed", 2, {"by": 2}))

    def test_fence_survives_purge(self):
        """lease: the key taken over and failed retryably, that row purged, the key claimed again (attempt 1 again): the first holder still gets LeaseLost, by its fence"""
        short = idem.Runner(("127.0.0.1", VPORT), lease=0.3)
        brief = idem.Runner(("127.0.0.1", VPORT), lease=10, retention=0.001)
        with admin() as taker:
            taker.execute("SET idem.min_retention = 0")     # the floor, lowered for the test
            with self.assertRaises(idem.LeaseLost):
                with short.lease(self.conn, 1, self.scope, "x2", {}) as slow:
                    time.sleep(0.6)     # the lease ends, and the marker with it
                    with brief.lease(taker, 1, self.scope, "x2", {}) as second:
                        self.assertEqual(second.attempt, 2)
                        raise idem.RetryableFailure({"by": 2})
                    time.sleep(0.01)
                    self.assertGreater(taker.execute("SELECT idem_purge()").fetchone()[0], 0)
                    self.assertIsNone(ledger(1, self.scope, "x2"))
                    with self.runner.lease(taker, 1, self.scope, "x2", {}) as third:
                        self.assertEqual((third.claimed, third.attempt), (True, 1))
                        third.defer()
                    slow.outcome = {"by": 1}
            self.assertEqual(ledger(1, self.scope, "x2")[:2], ("processing", 1))
            self.runner.complete(taker, 1, self.scope, "x2", {"by": 3}, fence=third.fence)
        self.assertIsNone(slow.status)
        self.assertEqual(ledger(1, self.scope, "x2")[:3], ("completed", 1, {"by": 3}))

    def test_deferred_failure_and_exception(self):
        """lease: defer() then runner.complete(attempt=) from another connection; an exception in the block records failed_retryable and attempt 2 follows"""
        with self.runner.lease(self.conn, 1, self.scope, "y1", {}) as lease:
            lease.defer()
        self.assertIsNone(lease.status)
        self.assertEqual(ledger(1, self.scope, "y1")[0], "processing")
        with admin() as a:
            with self.assertRaises(idem.LeaseLost):
                self.runner.complete(a, 1, self.scope, "y1", {"late": 1}, attempt=2)
            with self.assertRaises(idem.LeaseLost):
                self.runner.complete(a, 1, self.scope, "y1", {"late": 1}, fence=lease.fence + 1)
            with self.assertRaises(idem.IdemError):
                self.runner.complete(a, 1, self.scope, "y1", {"late": 1})
            self.runner.complete(a, 1, self.scope, "y1", {"late": 1}, fence=lease.fence)
        self.assertEqual(ledger(1, self.scope, "y1")[:3], ("completed", 1, {"late": 1}))
        with self.assertRaises(ZeroDivisionError):
            with self.runner.lease(self.conn, 1, self.scope, "y2", {}) as lease:
                1 / 0
        self.assertEqual((lease.status, ledger(1, self.scope, "y2")[:2]),
                         ("failed_retryable", ("failed_retryable", 1)))
        with self.runner.lease(self.conn, None, self.scope, "y2", {}) as plat:
            raise idem.PermanentFailure({"no": 1})
        self.assertEqual(ledger(None, self.scope, "y2")[:3], ("failed_permanent", 1, {"no": 1}))
        with self.runner.lease(self.conn, 1, self.scope, "y2", {}) as lease:
            lease.outcome = {"ok": 2}
        self.assertEqual((lease.status, lease.attempt), ("applied", 2))
        self.assertEqual(plat.status, "failed_permanent")


class Batches(Base):
    def items(self, ids, tenant=1, request=None):
        return [(tenant, self.scope, id, {"id": id} if request is None else request) for id in ids]

    def test_batch_decisions(self):
        """batch: cached results from Valkey, busy, mismatch and new keys claimed in one statement; each effect exactly once, each status right"""
        with self.runner.batch(self.conn, self.items(["k1", "k2"])) as b:
            self.assertEqual([r.run_id for r in b.claimed], ["k1", "k2"])
            for run in b:
                effect(self.conn, run)
        self.assertEqual([r.status for r in b.runs], ["applied", "applied"])
        wait_copy(ckey(1, self.scope, "k1"))
        wait_copy(ckey(1, self.scope, "k2"))
        valkey().delete(ckey(1, self.scope, "k2"))
        holder = hold(self.scope, "k3")
        try:
            items = self.items(["k1", "k2", "k3", "k4", "k4"]) + \
                [(1, self.scope, "k1", {"id": "other"}), (None, self.scope, "k5", {})]
            with self.runner.batch(self.conn, items) as b:
                self.assertEqual([r.run_id for r in b.claimed], ["k4", "k5"])
                for run in b:
                    effect(self.conn, run)
        finally:
            holder.rollback()
            holder.close()
        self.assertEqual([(r.status, r.source) for r in b.runs],
                         [("replayed", "valkey"), ("replayed", "postgres"), ("busy", "postgres"),
                          ("applied", "handler"), ("busy", "postgres"), ("mismatch", "postgres"),
                          ("applied", "handler")])
        self.assertEqual([effects(self.scope, i) for i in ("k1", "k2", "k3", "k4", "k5")],
                         [1, 1, 0, 1, 1])
        self.assertEqual(ledger(None, self.scope, "k5")[0], "completed")

    def test_steps_and_block_failure(self):
        """batch: a step that raises rolls back only its own effect (failed_retryable, the others applied); an exception escaping the block fails every claimed run and propagates"""
        with self.runner.batch(self.conn, self.items(["s1", "s2", "s3"])) as b:
            for run in b:
                with b.step(run):
                    effect(self.conn, run)
                    if run.run_id == "s2":
                        raise ValueError("bad s2")
                    if run.run_id == "s3":
                        raise idem.PermanentFailure({"no": "s3"})
        self.assertEqual([r.status for r in b.runs], ["applied", "failed_retryable", "failed_permanent"])
        self.assertIsInstance(b.runs[1].error, ValueError)
        self.assertEqual([effects(self.scope, i) for i in ("s1", "s2", "s3")], [1, 0, 0])
        with self.assertRaises(RuntimeError):
            with self.runner.batch(self.conn, self.items(["s2", "s4"])) as b:
                for run in b:
                    effect(self.conn, run)
                raise RuntimeError("all of it")
        self.assertEqual([(r.status, r.attempt) for r in b.runs],
                         [("failed_retryable", 2), ("failed_retryable", 1)])
        self.assertEqual([effects(self.scope, i) for i in ("s2", "s4")], [0, 0])
        self.assertEqual(ledger(1, self.scope, "s4")[0], "failed_retryable")

    def test_concurrent_batches(self):
        """batch: 4 threads send overlapping batches of 10 keys until each key is decided: every effect exactly once, no error"""
        ids = ["c%d" % i for i in range(30)]
        errors = []

        def worker(n):
            conn = connect()
            todo = ids[n * 5:] + ids[:n * 5]
            try:
                while todo:
                    batch, todo = todo[:10], todo[10:]
                    with self.runner.batch(conn, self.items(batch)) as b:
                        for run in b:
                            effect(conn, run)
                    todo += [r.run_id for r in b.runs if r.status == "busy"]
            except Exception as e:     # reported below
                errors.append(e)
            finally:
                conn.close()
        threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])
        with admin() as a:
            counts = a.execute("SELECT id, count(*) FROM effects WHERE scope = %s GROUP BY id",
                               [self.scope]).fetchall()
        self.assertEqual(sorted(counts), sorted((i, 1) for i in ids))

    def test_cached_many(self):
        """cached_many: one pipelined GET decides verified results for the same request; a forged value, another request and a missing key are left to PostgreSQL"""
        with self.runner.batch(self.conn, self.items(["v1", "v2", "v3"])) as b:
            for run in b:
                effect(self.conn, run)
        for id in ("v1", "v2", "v3"):
            wait_copy(ckey(1, self.scope, id))
        v = valkey()
        forged = bytearray(v.get(ckey(1, self.scope, "v2")))
        forged[-2:-1] = b"9" if forged[-2:-1] != b"9" else b"8"
        v.set(ckey(1, self.scope, "v2"), bytes(forged))
        rejected = self.runner.stats["cache_rejected"]
        got = self.runner.cached_many(self.conn, self.items(["v1", "v2"]) +
                                      [(1, self.scope, "v3", {"id": "other"}),
                                       (1, self.scope, "v9", {"id": "v9"})])
        self.assertEqual((got[0].status, got[0].source, got[0].outcome["done"]),
                         ("replayed", "valkey", "v1"))
        self.assertEqual(got[1:], [None, None, None])
        self.assertEqual(self.runner.stats["cache_rejected"], rejected + 1)
        self.assertEqual(self.runner.cached(self.conn, 1, self.scope, "v1", {"id": "v1"}).status,
                         "replayed")
        self.assertEqual(self.conn.info.transaction_status, psycopg.pq.TransactionStatus.IDLE)
        self.assertIsInstance(cache.parse(bytes(forged)), cache.Entry)


    def test_owner_check_passed_in_a_batch(self):
        """cached_many: an owner check that passes in a batch spends the learning made at once after a mismatch (as at the gate), so the next mismatch is learnt again at once, not a second later"""
        runner = idem.Runner(("127.0.0.1", VPORT), lease=5, secrets_max_age=3600)
        with runner.batch(self.conn, self.items(["o1"])) as b:
            for run in b:
                effect(self.conn, run)
        wait_copy(ckey(1, self.scope, "o1"))

        def replayed():
            got = runner.cached_many(self.conn, self.items(["o1"]))[0]
            return got is not None and got.source == "valkey"
        self.assertTrue(replayed())
        st = runner._state(self.conn)
        for n in (1, 2):
            # the token the runner learnt made stale: the owner key holds
            # another value, as once the server's epoch was retired or taken
            # over (the real key is left alone: its worker watches it)
            st.owner_token = b"0" * len(st.owner_token)
            mismatches = runner.stats["owner_mismatches"]
            self.assertFalse(replayed(), "mismatch %d: nothing read is trusted" % n)
            self.assertEqual(runner.stats["owner_mismatches"], mismatches + 1)
            self.assertTrue(st.owner_suspect)
            # the next lookup learns at once (not a second later), the
            # batch's check passes: Valkey replays again
            self.assertTrue(replayed(), "mismatch %d: learnt again at once" % n)


class Readme(unittest.TestCase):
    def test_readme_forms_example(self):
        """the package README's second example (apply, delivery_count, lease, batch) runs as written"""
        path = os.environ.get("IDEM_PACKAGE_README")
        if not path or not os.path.exists(path):
            self.skipTest("no README")
        code = open(path).read().split("```python\n")[2].split("```", 1)[0]
        env = dict(os.environ, IDEM_DSN=test_server.DSN, VALKEY_PORT=str(VPORT))
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("apply: applied {'charged': 5}", p.stdout)
        self.assertIn("first delivery: applied", p.stdout)
        self.assertIn("lease: applied", p.stdout)
        self.assertIn("batch: ['failed_permanent', 'applied', 'applied', 'replayed']", p.stdout)


if __name__ == "__main__":
    unittest.main()
