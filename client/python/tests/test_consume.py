"""The stream consumer (idem.Consumer, idem.AsyncConsumer) and run.emit,
against a real PostgreSQL with idem and a real Valkey.  The tests are the
stream's producer: they XADD entries in the published format (``id <message
id> body <message>``), as the server's worker does.  Each test checks what
the servers hold: effects counted in the table, entries pending or
acknowledged in the group."""
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import unittest

import psycopg
import redis

import idem
from idem import emit as emit_mod
from idem.consume import parse_entry
import test_server
from test_server import DSN, VPORT, admin, connect, effects, uid


def setUpModule():
    test_server.setUpModule()


def xadd(v, stream, mid, body):
    return v.xadd(stream, {"id": mid, "body": body if isinstance(body, str) else json.dumps(body)})


def pending(v, stream, group):
    """How many entries of the group are delivered and not acknowledged."""
    return v.xpending(stream, group)["pending"]


def effect(conn, run, message):
    conn.execute("INSERT INTO effects (scope, id, node) VALUES (%s, %s, 'consumer')",
                 [run.scope, run.run_id])
    return {"got": message.get("n")}


def has_emit():
    with admin() as a:
        return a.execute("SELECT to_regproc('idem_emit') IS NOT NULL").fetchone()[0]


class Units(unittest.TestCase):
    def test_parse_entry(self):
        """an entry's id and body are read as the published format has them; anything else is malformed"""
        self.assertEqual(parse_entry({b"id": b"k-1", b"body": b'{"a": 1}'}, "s"), ("k-1", '{"a": 1}', None))
        self.assertEqual(parse_entry({"id": "k-1", "body": "[1]"}, "s"), ("k-1", "[1]", None))
        self.assertEqual(parse_entry({b"body": b"{}"}, "s")[2], "no id field")
        self.assertEqual(parse_entry({b"id": b"k"}, "s")[2], "no body field")
        self.assertEqual(parse_entry({b"id": b"\xff", b"body": b"{}"}, "s")[2],
                         "the id is empty or not UTF-8")
        self.assertEqual(parse_entry({b"id": b"k", b"body": b"{nope"}, "s")[2], "the body is not JSON")
        self.assertEqual(parse_entry(None, "s")[2], "the entry has no fields")

    def test_emit_array(self):
        """run.emit's messages become one JSON array naming each run's key, in order"""
        k = bytes(range(32))
        text = emit_mod.array_text([(k, "a\"b", '{"x": 1}'), (k, "s", "[]")])
        self.assertEqual(json.loads(text), [["a\"b", {"x": 1}, k.hex()], ["s", [], k.hex()]])
        self.assertIsNone(emit_mod.array_text([]))
        self.assertEqual(emit_mod.message_id(k, 3), k.hex() + "-3")
        self.assertRaises(idem.IdemError, emit_mod.check, "", {})
        self.assertRaises(idem.IdemError, emit_mod.check, "s", float("nan"))

    def test_emit_needs_a_claim(self):
        """run.emit is refused outside a claimed run, and in lease mode"""
        from idem.result import _make_run
        from idem.lease import Lease
        run = _make_run(idem.Run, 1, "s", "r", {})
        self.assertRaises(idem.IdemError, run.emit, "s", {})
        run.claimed = True
        self.assertEqual(run.emit("s", {"a": 1}), run.key.hex() + "-1")
        self.assertEqual(run.emit("t", "[2]"), run.key.hex() + "-2")
        lease = _make_run(Lease, 1, "s", "r", {})
        lease.claimed = True
        with self.assertRaises(idem.IdemError) as cm:
            lease.emit("s", {})
        self.assertIn("lease mode", str(cm.exception))


class Base(unittest.TestCase):
    def setUp(self):
        self.v = redis.Redis(host="127.0.0.1", port=VPORT, socket_timeout=5)
        self.runner = idem.Runner(("127.0.0.1", VPORT), lease=5)
        self.scope = uid("consume")
        self.stream = uid("stream")
        self.conn = connect()

    def tearDown(self):
        self.conn.close()

    def consumer(self, name="c1", **kw):
        kw.setdefault("handler", effect)
        kw.setdefault("claim_idle", 0.3)
        kw.setdefault("block", 0.1)
        return idem.Consumer(self.runner, self.conn, ("127.0.0.1", VPORT), stream=self.stream,
                             group="g", consumer=name, scope=self.scope, tenant=1, **kw)

    def drain(self, c, until, timeout=15):
        end = time.time() + timeout
        while not until():
            self.assertLess(time.time(), end, "not drained in %d s: %r" % (timeout, c.stats))
            c.poll()

    def drain_async(self, handler, acked, before=lambda: None, options="", **kw):
        """An AsyncConsumer (AsyncRunner, redis.asyncio) polled until it
        has acknowledged ``acked`` entries; before() first."""
        import redis.asyncio
        from idem.aio import AsyncRunner

        async def main():
            conn = await psycopg.AsyncConnection.connect(DSN, **({"options": options}
                                                                 if options else {}))
            runner = AsyncRunner(redis.asyncio.Redis(host="127.0.0.1", port=VPORT), lease=5)
            c = idem.AsyncConsumer(runner, conn, ("127.0.0.1", VPORT), stream=self.stream,
                                   group="g", consumer="ac", scope=self.scope, tenant=1,
                                   handler=handler, block=0.1, **kw)
            before()
            end = time.time() + 15
            while c.stats["acked"] < acked:
                self.assertLess(time.time(), end, repr(c.stats))
                await c.poll()
            await c.close()
            await runner.valkey.close()
            await conn.close()
        asyncio.run(main())


class Sync(Base):
    def test_each_message_once(self):
        """messages are applied once each, duplicates of an id (a republished message) once, and every entry acknowledged"""
        for i in range(20):
            xadd(self.v, self.stream, "m%d" % i, {"n": i})
        for i in range(0, 20, 3):
            xadd(self.v, self.stream, "m%d" % i, {"n": i})      # the publisher's repeat
        c = self.consumer()
        self.drain(c, lambda: c.stats["acked"] == 27)
        self.assertEqual(effects(self.scope), 20)
        for i in range(20):
            self.assertEqual(effects(self.scope, "m%d" % i), 1)
        self.assertEqual(pending(self.v, self.stream, "g"), 0)

    def test_group_from_the_start(self):
        """the group is created from the stream's first entry: what was published before the first consumer is consumed"""
        xadd(self.v, self.stream, "early", {"n": 1})
        c = self.consumer()
        self.drain(c, lambda: c.stats["acked"] == 1)
        self.assertEqual(effects(self.scope, "early"), 1)

    def test_retryable_redelivered(self):
        """a retryable failure is not acknowledged: the entry comes back after claim_idle and is applied once"""
        tries = []

        def flaky(conn, run, message):
            tries.append(run.attempt)
            if len(tries) == 1:
                raise idem.RetryableFailure({"why": "later"})
            return effect(conn, run, message)
        xadd(self.v, self.stream, "r1", {"n": 1})
        c = self.consumer(handler=flaky)
        c.poll()
        self.assertEqual(tries, [1])
        self.assertEqual(pending(self.v, self.stream, "g"), 1)     # left pending
        self.drain(c, lambda: c.stats["acked"] == 1)
        self.assertEqual(tries, [1, 2])
        self.assertEqual(effects(self.scope, "r1"), 1)
        self.assertEqual(pending(self.v, self.stream, "g"), 0)

    def test_error_not_acked(self):
        """an exception of the handler (recorded retryable) and a server-state error are not acknowledged"""
        def boom(conn, run, message):
            if message.get("kind") == "deadlock":
                conn.execute("DO $$ BEGIN RAISE EXCEPTION 'x' USING ERRCODE = '40P01'; END $$")
            raise KeyError("no")
        xadd(self.v, self.stream, "e1", {"n": 1})
        xadd(self.v, self.stream, "e2", {"kind": "deadlock"})
        seen = []
        c = self.consumer(handler=boom, claim_idle=60, settled=lambda m, r, a: seen.append((m, a)))
        c.poll()
        self.assertEqual(sorted(seen), [("e1", False), ("e2", False)])
        self.assertEqual(pending(self.v, self.stream, "g"), 2)
        self.assertEqual(c.stats["acked"], 0)

    def test_permanent_and_mismatch_acked(self):
        """a permanent failure and a mismatch (the id with another body) are settled: acknowledged"""
        def perm(conn, run, message):
            if message.get("bad"):
                raise idem.PermanentFailure({"why": "never"})
            return effect(conn, run, message)
        xadd(self.v, self.stream, "p1", {"bad": True})
        xadd(self.v, self.stream, "p2", {"n": 2})
        xadd(self.v, self.stream, "p2", {"n": 3})       # same id, another body
        got = {}
        c = self.consumer(handler=perm, settled=lambda m, r, a: got.setdefault(m, []).append((r.status, a)))
        self.drain(c, lambda: c.stats["acked"] == 3)
        self.assertEqual(got["p1"], [("failed_permanent", True)])
        self.assertEqual(got["p2"], [("applied", True), ("mismatch", True)])
        self.assertEqual(effects(self.scope), 1)

    def test_malformed(self):
        """a malformed entry is told, dead-lettered with its fields and why, and acknowledged"""
        told = []
        self.v.xadd(self.stream, {"body": "{}"})
        self.v.xadd(self.stream, {"id": "x1", "body": "{not json"})
        xadd(self.v, self.stream, "ok1", {"n": 1})
        c = self.consumer(dead_letter=self.stream + ".dead", notice=told.append)
        self.drain(c, lambda: c.stats["acked"] == 3)
        self.assertEqual(c.stats["malformed"], 2)
        dead = self.v.xrange(self.stream + ".dead")
        self.assertEqual([f[b"reason"] for _, f in dead], [b"no id field", b"the body is not JSON"])
        self.assertEqual(dead[1][1][b"id"], b"x1")
        self.assertEqual(dead[1][1][b"body"], b"{not json")
        self.assertEqual(len(told), 2)
        self.assertEqual(effects(self.scope), 1)

    def child(self, name, mode):
        """A consumer process: 'hang' sleeps in the handler after its
        effect; 'die_after_commit' exits when its first run is settled,
        before the XACK."""
        code = r"""
import os, sys, time, json, idem, psycopg
dsn, port, stream, scope, name, mode = sys.argv[1:]
def h(conn, run, message):
    conn.execute("INSERT INTO effects (scope, id, node) VALUES (%s, %s, 'child')", [run.scope, run.run_id])
    if mode == 'hang':
        print('in', flush=True)
        time.sleep(60)
    return {}
def settled(m, r, acked):
    if mode == 'die_after_commit':
        print('settled', r.status, flush=True)
        os._exit(9)
runner = idem.Runner(('127.0.0.1', int(port)), lease=5)
c = idem.Consumer(runner, psycopg.connect(dsn), ('127.0.0.1', int(port)), stream=stream, group='g',
                  consumer=name, scope=scope, tenant=1, handler=h, block=0.1, claim_idle=60,
                  settled=settled)
while True:
    c.poll()
"""
        return subprocess.Popen([sys.executable, "-c", code, DSN, str(VPORT), self.stream,
                                 self.scope, name, mode], stdout=subprocess.PIPE, text=True,
                                env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))

    def test_killed_mid_message(self):
        """a consumer SIGKILLed mid-message: XAUTOCLAIM hands its entry to another, whose run applies it once"""
        xadd(self.v, self.stream, "k1", {"n": 1})
        p = self.child("dying", "hang")
        try:
            self.assertEqual(p.stdout.readline().strip(), "in")
            self.assertEqual(self.v.xpending(self.stream, "g")["consumers"][0]["name"], b"dying")
        finally:
            p.kill()
            p.wait()
        c = self.consumer("heir", claim_idle=0.5)
        self.drain(c, lambda: c.stats["acked"] == 1)
        self.assertEqual(c.stats["claimed"], 1)
        self.assertEqual(effects(self.scope, "k1"), 1)
        self.assertEqual(pending(self.v, self.stream, "g"), 0)

    def test_killed_after_commit(self):
        """a consumer killed after its run committed, before its XACK: the entry taken over is replayed, not applied again"""
        xadd(self.v, self.stream, "k2", {"n": 1})
        p = self.child("dying2", "die_after_commit")
        self.assertEqual(p.stdout.readline().strip(), "settled applied")
        p.wait()
        self.assertEqual(pending(self.v, self.stream, "g"), 1)
        got = []
        c = self.consumer("heir2", claim_idle=0.5, settled=lambda m, r, a: got.append(r.status))
        self.drain(c, lambda: c.stats["acked"] == 1)
        self.assertEqual(got, ["replayed"])
        self.assertEqual(effects(self.scope, "k2"), 1)

    def test_valkey_flushed(self):
        """the group is made again when Valkey lost the stream (a restart without persistence, FLUSHALL): the next entries are consumed"""
        xadd(self.v, self.stream, "f1", {"n": 1})
        c = self.consumer()
        self.drain(c, lambda: c.stats["acked"] == 1)
        self.v.delete(self.stream)
        self.assertEqual(c.poll(), -1)
        xadd(self.v, self.stream, "f2", {"n": 2})
        self.drain(c, lambda: c.stats["acked"] == 2)
        self.assertEqual(effects(self.scope), 2)


CRASH = os.environ.get("IDEM_PG_CRASH")


def long_wal_cycle():
    """A 10 s WAL-writer cycle that starts now: an asynchronous commit,
    then wal_writer_delay = 10s reloaded (and wal_writer_flush_after = 0:
    what it writes, it flushes, so that the flush position shows it); once
    the WAL writer has written that commit out it sleeps 10 s (not
    hibernating: it just did work), so that an asynchronous commit made
    meanwhile is in shared memory only."""
    with admin() as a:
        a.execute("SET client_min_messages = warning")
        a.execute("CREATE TABLE IF NOT EXISTS crash_marks (id text)")     # on: flushed
        a.execute("SET synchronous_commit = off")
        a.execute("INSERT INTO crash_marks VALUES ('cycle')")
        lsn = a.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0]
        a.execute("ALTER SYSTEM SET wal_writer_delay = '10s'")
        a.execute("ALTER SYSTEM SET wal_writer_flush_after = 0")
        a.execute("SELECT pg_reload_conf()")
        end = time.time() + 5
        while not a.execute("SELECT pg_current_wal_flush_lsn() >= %s::pg_lsn",
                            [str(lsn)]).fetchone()[0]:
            if time.time() > end:
                raise AssertionError("the WAL writer did not write a commit out within 5 s")
            time.sleep(0.01)


def crash():
    """An asynchronous commit (it must be lost), then kill -9 of every
    process of the server and its start; the WAL writer's cycle reset.
    Whether that commit was lost: the crash did lose what was not written
    out."""
    with admin() as a:
        a.execute("SET synchronous_commit = off")
        a.execute("INSERT INTO crash_marks VALUES ('lost')")
    subprocess.run([CRASH], check=True)
    test_server.setUpModule()       # the worker's epoch again
    with admin() as a:
        a.execute("ALTER SYSTEM RESET wal_writer_delay")
        a.execute("ALTER SYSTEM RESET wal_writer_flush_after")
        a.execute("SELECT pg_reload_conf()")
        lost = a.execute("SELECT count(*) = 0 FROM crash_marks WHERE id = 'lost'").fetchone()[0]
        a.execute("DELETE FROM crash_marks")
    return lost


@unittest.skipUnless(CRASH, "no command that crashes the server (IDEM_PG_CRASH)")
class Crash(Base):
    """A consumer whose connection has synchronous_commit = off
    acknowledges an entry, and the server is killed (-9) right after the
    XACK: its run must be there after the restart (or the entry still
    pending)."""

    def setUp(self):
        super().setUp()
        self.conn.close()
        self.conn = connect(options="-c synchronous_commit=off")

    def survives(self, mid, got, status):
        lost = crash()
        self.assertTrue(lost, "an asynchronous commit just before the crash was kept: "
                        "the crash proved nothing")
        self.assertEqual(got, [status])
        self.assertTrue(effects(self.scope, mid) == 1 or pending(self.v, self.stream, "g") == 1,
                        "the run of an acknowledged entry was lost in the crash")

    def test_applied(self):
        """a run applied on a connection with synchronous_commit = off, acknowledged, then a crash of the server: the run survives"""
        got = []
        c = self.consumer(settled=lambda m, r, a: got.append(r.status))
        long_wal_cycle()
        xadd(self.v, self.stream, "d1", {"n": 1})
        self.drain(c, lambda: c.stats["acked"] == 1)
        self.survives("d1", got, "applied")

    def test_replayed(self):
        """a replay of a row another session committed with synchronous_commit = off (not written out yet), acknowledged, then a crash: the row survives"""
        got = []
        c = self.consumer(settled=lambda m, r, a: got.append(r.status))
        long_wal_cycle()
        self.runner.call(self.conn, 1, self.scope, "d2", json.dumps({"n": 2}),
                         lambda conn, run: effect(conn, run, {"n": 2}))
        xadd(self.v, self.stream, "d2", {"n": 2})
        self.drain(c, lambda: c.stats["acked"] == 1)
        self.survives("d2", got, "replayed")

    def test_async_applied(self):
        """the asyncio consumer: a run applied with synchronous_commit = off, acknowledged, then a crash: the run survives"""
        got = []

        async def handler(conn, run, message):
            await conn.execute("INSERT INTO effects (scope, id, node) VALUES (%s, %s, 'aio')",
                               [run.scope, run.run_id])
            return {}

        def before():
            long_wal_cycle()
            xadd(self.v, self.stream, "d3", {"n": 3})
        self.drain_async(handler, 1, before, options="-c synchronous_commit=off",
                         settled=lambda m, r, a: got.append(r.status))
        self.survives("d3", got, "applied")


class Async(Base):
    def test_async_consumer(self):
        """the asyncio consumer: each message once, duplicates once, a retryable failure redelivered"""
        tries = []

        async def handler(conn, run, message):
            tries.append(run.run_id)
            if run.run_id == "a0" and tries.count("a0") == 1:
                raise idem.RetryableFailure({})
            await conn.execute("INSERT INTO effects (scope, id, node) VALUES (%s, %s, 'aio')",
                               [run.scope, run.run_id])
            return {}

        for i in range(5):
            xadd(self.v, self.stream, "a%d" % i, {"n": i})
        xadd(self.v, self.stream, "a3", {"n": 3})
        self.drain_async(handler, 6, claim_idle=0.3)
        self.assertEqual(effects(self.scope), 5)
        self.assertEqual(tries.count("a0"), 2)
        self.assertEqual(pending(self.v, self.stream, "g"), 0)


@unittest.skipUnless(DSN and has_emit() if DSN else False,
                     "idem_emit is not in this extension yet")
class Emit(Base):
    def published(self, stream, n, timeout=15):
        end = time.time() + timeout
        while True:
            got = self.v.xrange(stream)
            if len(got) >= n or time.time() > end:
                return [(f[b"id"].decode(), json.loads(f[b"body"])) for _, f in got]
            time.sleep(0.05)

    def test_emit_published_once_committed(self):
        """run.emit: the messages of a committed run are published with ids <key>-1, <key>-2; a failed run's never"""
        out = self.stream + ".out"

        def h(conn, run, message):
            run.emit(out, {"n": message["n"], "i": 1})
            run.emit(out, {"n": message["n"], "i": 2})
            if message.get("fail"):
                raise idem.PermanentFailure({})
            return effect(conn, run, message)
        r1 = self.runner.call(self.conn, 1, self.scope, "e1", {"n": 1, "fail": True},
                              lambda c, r: h(c, r, {"n": 1, "fail": True}))
        self.assertEqual(r1.status, "failed_permanent")
        r2 = self.runner.call(self.conn, 1, self.scope, "e2", {"n": 2}, lambda c, r: h(c, r, {"n": 2}))
        self.assertEqual(r2.status, "applied")
        key = idem.idem_key(self.scope, "e2").hex()
        got = self.published(out, 2)
        self.assertEqual(got, [(key + "-1", {"n": 2, "i": 1}), (key + "-2", {"n": 2, "i": 2})])

    def test_batch_and_asyncio_emit(self):
        """run.emit in a batch (each run's messages under its own key, a failed step's dropped) and in the asyncio runner"""
        out = self.stream + ".batch"
        items = [(1, self.scope, "b%d" % i, {"i": i}) for i in range(3)]
        with self.runner.batch(self.conn, items) as batch:
            for run in batch.claimed:
                with batch.step(run):
                    run.emit(out, {"from": run.run_id})
                    if run.run_id == "b1":
                        raise idem.PermanentFailure({})
        self.assertEqual([r.status for r in batch.runs], ["applied", "failed_permanent", "applied"])
        import redis.asyncio
        from idem.aio import AsyncRunner

        async def main():
            conn = await psycopg.AsyncConnection.connect(DSN)
            runner = AsyncRunner(redis.asyncio.Redis(host="127.0.0.1", port=VPORT), lease=5)

            async def h(c, run):
                run.emit(out, {"from": run.run_id})
                return {}
            r = await runner.call(conn, 1, self.scope, "a1", {}, h)
            await runner.valkey.close()
            await conn.close()
            return r.status
        self.assertEqual(asyncio.run(main()), "applied")
        got = self.published(out, 3)
        want = [(idem.idem_key(self.scope, rid).hex() + "-1", {"from": rid}) for rid in ("b0", "b2", "a1")]
        self.assertEqual(sorted(got), sorted(want))

    def test_pipeline_end_to_end(self):
        """emit in stage 1, the worker publishes, a consumer applies in stage 2: each effect once in each stage"""
        out = self.stream + ".out"

        def stage1(conn, run):
            effect(conn, run, {})
            run.emit(out, {"from": run.run_id})
            return {}
        for i in range(10):
            self.runner.call(self.conn, 1, self.scope, "s%d" % i, {"i": i}, stage1)
            self.runner.call(self.conn, 1, self.scope, "s%d" % i, {"i": i}, stage1)  # redelivered
        scope2 = self.scope + ".2"
        c2 = idem.Consumer(self.runner, connect(), ("127.0.0.1", VPORT), stream=out, group="g2",
                           consumer="c", scope=scope2, tenant=1, handler=effect, block=0.1)
        self.drain(c2, lambda: effects(scope2) == 10)
        self.assertEqual(effects(self.scope), 10)
        self.assertEqual(pending(self.v, out, "g2"), 0)

    def test_pipeline_under_chaos(self):
        """end to end under chaos: 40 runs emit, 3 consumers SIGKILLed mid-work and restarted, their backends terminated; each stage-2 effect once"""
        out = self.stream + ".chaos"
        scope2 = self.scope + ".2"

        def stage1(conn, run):
            effect(conn, run, {})
            run.emit(out, {"from": run.run_id})
            return {}
        for i in range(40):
            self.runner.call(self.conn, 1, self.scope, "c%d" % i, {"i": i}, stage1)
            if i % 5 == 0:
                self.runner.call(self.conn, 1, self.scope, "c%d" % i, {"i": i}, stage1)
        # a consumer that says when it has started, and works slowly enough
        # (3 entries a read, acknowledged together) to be killed mid-run
        # and between a commit and its XACK
        code = r"""
import random, sys, time, idem, psycopg
dsn, port, stream, scope = sys.argv[1:]
def h(conn, run, message):
    conn.execute("INSERT INTO effects (scope, id, node) VALUES (%s, %s, 'chaos')", [run.scope, run.run_id])
    time.sleep(0.05 + random.random() * 0.1)
    return {}
runner = idem.Runner(('127.0.0.1', int(port)), lease=5)
c = idem.Consumer(runner, lambda: psycopg.connect(dsn, application_name='idem-consume-chaos'),
                  ('127.0.0.1', int(port)), stream=stream, group='g', consumer='w%d' % random.randrange(1 << 30),
                  scope=scope, tenant=1, handler=h, block=0.1, claim_idle=0.5, count=3)
c.poll()
print('ready', flush=True)
while True:
    c.poll()
"""
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))

        def spawn():
            p = subprocess.Popen([sys.executable, "-c", code, DSN, str(VPORT), out, scope2],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 text=True)
            p.ready = threading.Event()
            threading.Thread(target=lambda: p.stdout.readline() and p.ready.set(),
                             daemon=True).start()
            return p
        procs = [spawn() for _ in range(3)]
        kills = terminated = 0
        rnd = random.Random(7)
        try:
            end = time.time() + 40
            while (effects(scope2) < 30 or kills < 8) and time.time() < end:
                time.sleep(0.4)
                ready = [i for i, p in enumerate(procs) if p.ready.is_set()]
                if ready:
                    i = rnd.choice(ready)
                    procs[i].kill()
                    procs[i].wait()
                    procs[i] = spawn()
                    kills += 1
                with admin() as a:
                    terminated += a.execute(
                        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE application_name = 'idem-consume-chaos' AND random() < 0.3").fetchone()[0]
        finally:
            for p in procs:
                p.kill()
                p.wait()
        by_children = effects(scope2)
        c = idem.Consumer(self.runner, connect(), ("127.0.0.1", VPORT), stream=out, group="g",
                          consumer="last", scope=scope2, tenant=1, handler=effect, block=0.1,
                          claim_idle=0.5)
        end = time.time() + 30
        while True:
            c.poll()
            if effects(scope2) >= 40 and pending(self.v, out, "g") == 0:
                break
            self.assertLess(time.time(), end, "not drained: %r" % c.stats)
        with admin() as a:
            n, distinct = a.execute("SELECT count(*), count(DISTINCT id) FROM effects WHERE scope = %s",
                                    [scope2]).fetchone()
        why = "kills %d, backends terminated %d, %d applied before the last consumer" % (
            kills, terminated, by_children)
        self.assertGreaterEqual(kills, 5, why)
        self.assertEqual((n, distinct), (40, 40), why)
        self.assertEqual(effects(self.scope), 40)

    def test_readme_example(self):
        """the package README's emit and consume example runs as written"""
        path = os.environ.get("IDEM_PACKAGE_README")
        if not path or not os.path.exists(path):
            self.skipTest("no README")
        blocks = [b.split("```", 1)[0] for b in open(path).read().split("```python\n")[1:]]
        code = [b for b in blocks if "idem.Consumer(" in b][0]
        env = dict(os.environ, IDEM_DSN=DSN, VALKEY_PORT=str(VPORT))
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("notices: 3", p.stdout)


CLUSTER_DSN = os.environ.get("IDEM_PG_CLUSTER_DSN")
CLUSTER_PORT = os.environ.get("IDEM_VALKEY_CLUSTER_PORT")


@unittest.skipUnless(CLUSTER_DSN and CLUSTER_PORT,
                     "no Valkey Cluster (IDEM_PG_CLUSTER_DSN, IDEM_VALKEY_CLUSTER_PORT)")
class Cluster(unittest.TestCase):
    def test_cluster_consumer(self):
        """on a Valkey Cluster, (host, port) routes the consumer by the stream's slot: each message once, all acknowledged"""
        from redis.cluster import RedisCluster
        v = RedisCluster(host="127.0.0.1", port=int(CLUSTER_PORT), socket_timeout=5)
        scope, stream = uid("cconsume"), uid("cstream")
        for i in range(10):
            xadd(v, stream, "m%d" % i, {"n": i})
        xadd(v, stream, "m3", {"n": 3})
        runner = idem.Runner(("127.0.0.1", int(CLUSTER_PORT)), lease=5)
        conn = psycopg.connect(CLUSTER_DSN)
        c = idem.Consumer(runner, conn, ("127.0.0.1", int(CLUSTER_PORT)), stream=stream,
                          group="g", consumer="c1", scope=scope, tenant=1, handler=effect,
                          block=0.1)
        self.assertIsInstance(c.valkey, RedisCluster)
        end = time.time() + 15
        while c.stats["acked"] < 11:
            self.assertLess(time.time(), end, repr(c.stats))
            c.poll()
        with psycopg.connect(CLUSTER_DSN, autocommit=True) as a:
            n, d = a.execute("SELECT count(*), count(DISTINCT id) FROM effects WHERE scope = %s",
                             [scope]).fetchone()
        self.assertEqual((n, d), (10, 10))
        self.assertEqual(v.xpending(stream, "g")["pending"], 0)
        c.close()
        conn.close()
