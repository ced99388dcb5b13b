"""The Python runner against a real PostgreSQL with idem preloaded and a
real Valkey (test/python/run.sh starts both and sets the environment)."""
import json
import os
import random
import signal
import socket
import sys
import subprocess
import threading
import time
import traceback
import unittest

import psycopg
import redis

import idem
from idem import cache

DSN = os.environ.get("IDEM_PG_DSN", "")
VPORT = int(os.environ.get("IDEM_VALKEY_PORT", "0"))
VDIR = os.environ.get("IDEM_VALKEY_DIR", "")
VSERVER = os.environ.get("IDEM_VALKEY_SERVER_BIN", "valkey-server")
RUN_ONCE = os.environ.get("IDEM_RUN_ONCE")


def connect(**kw):
    return psycopg.connect(DSN, **kw)


def admin():
    return psycopg.connect(DSN, autocommit=True)


def valkey():
    return redis.Redis(host="127.0.0.1", port=VPORT, socket_timeout=2)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def effects(scope, id=None):
    with admin() as c:
        if id is None:
            return c.execute("SELECT count(*) FROM effects WHERE scope = %s", [scope]).fetchone()[0]
        return c.execute("SELECT count(*) FROM effects WHERE scope = %s AND id = %s",
                         [scope, id]).fetchone()[0]


def keyspace():
    with admin() as c:
        return c.execute("SELECT idem_cache_keyspace()").fetchone()[0]


def ckey(tenant, scope, id):
    return cache.cache_key(keyspace(), tenant, idem.idem_key(scope, id))


def secrets():
    with admin() as c:
        rows = c.execute("SELECT key_id, secret, is_current FROM idem_cache_secrets()").fetchall()
    return {r[0]: bytes(r[1]) for r in rows}, [r[0] for r in rows if r[2]][0]


def wait_copy(key, timeout=10):
    """Until the worker's copy (a terminal value) is in Valkey."""
    v = valkey()
    end = time.time() + timeout
    while time.time() < end:
        val = v.get(key)
        if val is not None:
            e = cache.parse(val)
            if e is not None and e.kind != cache.MARKER:
                return e
        time.sleep(0.02)
    raise AssertionError("no copy of %r in Valkey after %d s" % (key, timeout))


def effect(conn, run, node="py"):
    """The test's effect: one row in effects, in the run's transaction."""
    conn.execute("INSERT INTO effects (scope, id, node) VALUES (%s, %s, %s)",
                 [run.scope, run.run_id, node])
    run.outcome = {"done": run.run_id, "attempt": run.attempt}


def setUpModule():
    # The keyspace is refused (55000) until the worker has taken its cache
    # epoch over in Valkey: wait for it, as a runner would.
    end = time.time() + 60
    while True:
        try:
            keyspace()
            return
        except psycopg.errors.ObjectNotInPrerequisiteState:
            if time.time() > end:
                raise
            time.sleep(0.2)


_n = [0]


def uid(prefix="id"):
    _n[0] += 1
    return "%s-%d-%d" % (prefix, os.getpid(), _n[0])


class TurnCounter:
    """A TCP proxy that counts round trips: each time the client sends
    after the server has answered is one turn."""

    def __init__(self, host, port):
        self.turns = 0
        self.answered = True
        self.lock = threading.Lock()
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4)
        self.port = self.listener.getsockname()[1]
        self.target = (host, port)
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            try:
                c, _ = self.listener.accept()
            except OSError:
                return
            u = socket.create_connection(self.target)
            threading.Thread(target=self.pump, args=(c, u, True), daemon=True).start()
            threading.Thread(target=self.pump, args=(u, c, False), daemon=True).start()

    def pump(self, src, dst, from_client):
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                for x in (src, dst):
                    try:
                        x.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                return
            with self.lock:
                if from_client and self.answered:
                    self.turns += 1
                self.answered = not from_client
            dst.sendall(data)

    def close(self):
        self.listener.close()


class Corpus(unittest.TestCase):
    def test_digests_equal_sql(self):
        """Python's idem_key, canonical text and fingerprint equal SQL's on a generated corpus of 2000 documents"""
        rnd = random.Random(30)
        strings = ["", "a", "é", "\u00e0a", "z", "aa", "\U0001F600", "\\", '"', "\n\t\b\f\r",
                   "\x01\x1f\x7f", "/", "\u2028", "ключ", "日本", " ", "a b"]
        numbers = ["0", "-0", "0.0", "-0.000", "1", "-1", "12", "1.5", "-1.50", "1e3", "1E+3",
                   "1e-3", "-1.25e-7", "123.456e2", "123.456e-2", "0e10", "0.00e-3",
                   "9007199254740993", "-9223372036854775809", "1e100", "1.000000000000000001",
                   "3.14159265358979323846264338327950288", "1e-300", "-4.2E+11", "100e-2",
                   "12345678901234567890.0987654321"]

        def s(x):
            return json.dumps(x, ensure_ascii=rnd.random() < 0.5)

        def gen(depth):
            r = rnd.random()
            if depth > 5 or r < 0.35:
                return rnd.choice([s(rnd.choice(strings)), rnd.choice(numbers), "true", "false",
                                   "null", str(rnd.randint(-10**6, 10**6)),
                                   repr(rnd.uniform(-1e6, 1e6))])
            if r < 0.65:
                return "[" + ",".join(gen(depth + 1) for _ in range(rnd.randint(0, 4))) + "]"
            keys = [rnd.choice(strings + ["k%d" % rnd.randint(0, 9)]) for _ in range(rnd.randint(0, 5))]
            if keys and rnd.random() < 0.3:
                keys.append(keys[0])        # a duplicate key
            ws = rnd.choice(["", " ", "\n  "])
            return "{" + ws + ("," + ws).join(s(k) + ws + ":" + ws + gen(depth + 1)
                                               for k in keys) + ws + "}"

        docs = [gen(0) for _ in range(1950)]
        docs += ["[" * d + "1" + "]" * d for d in (50, 200, 500)]
        docs += ['{"a": %s}' % n for n in numbers]
        docs += ['"\\ud83d\\ude00\\u00e9\\u0001\\"\\\\\\/"', '{"b": 1, "a": [1, 2.50, "x"]}']
        pairs = [(rnd.choice(strings + ["scope.x"]), rnd.choice(strings + [str(i)]))
                 for i in range(300)] + [("ab", "c"), ("a", "bc"), ("", "")]
        with admin() as c:
            rows = c.execute("SELECT d::jsonb::text, idem_fingerprint(d::jsonb) "
                             "FROM unnest(%s::text[]) WITH ORDINALITY AS u(d, o) ORDER BY o",
                             [docs]).fetchall()
            keys = c.execute("SELECT idem_key(s, i) FROM unnest(%s::text[], %s::text[]) "
                             "WITH ORDINALITY AS u(s, i, o) ORDER BY o",
                             [[p[0] for p in pairs], [p[1] for p in pairs]]).fetchall()
        for d, (text, fp) in zip(docs, rows):
            self.assertEqual(idem.canonical_json(d), text, d[:200])
            self.assertEqual(idem.fingerprint(d), bytes(fp), d[:200])
        for (sc, i), (k,) in zip(pairs, keys):
            self.assertEqual(idem.idem_key(sc, i), bytes(k), (sc, i))


    def test_limits_agree_with_sql(self):
        """at numeric's limits and on refused escapes, Python accepts and refuses what jsonb does, with the same text"""
        cases = ["1e131071", "1e131072", "9e131071", "1e-16383", "1e-16384", "0e-16383",
                 "0e-16384", "0e1073741822", "0e1073741823", "1e1073741822", "1.5e-16382",
                 "0.1e-16383", "10e-16384", "0e-1073741822", "1e-1073741822", "-0e-5",
                 '"\\ud800\\u0041"', '{"a\\u0000": 1}', '"\\udc00"', "[1,]", "[01]",
                 '"\\u00e9\\ud83d\\ude00"', "1E400", "-1.0e-400"]
        with admin() as c:
            for t in cases:
                try:
                    with c.transaction():
                        want = c.execute("SELECT %s::jsonb::text", [t]).fetchone()[0]
                except psycopg.Error:
                    want = None
                try:
                    got = idem.canonical_json(t)
                except idem.RequestError:
                    got = None
                self.assertEqual(got, want, t)


class RunnerTests(unittest.TestCase):
    def setUp(self):
        self.runner = idem.Runner(("127.0.0.1", VPORT), lease=5)
        self.conn = connect()
        self.scope = uid("scope")

    def tearDown(self):
        self.conn.close()

    def go(self, id, request, conn=None, runner=None, tenant=1):
        conn = conn or self.conn
        with (runner or self.runner).run(conn, tenant, self.scope, id, request) as run:
            if run.claimed:
                effect(conn, run)
        return run

    def test_literals(self):
        """outcomes and failure details with quotes, backslashes, dollar quotes and SJIS's 0x5c trail bytes, sent as literals in the runner's simple queries: recorded and replayed exactly, with standard_conforming_strings off too"""
        nasty = {"q": "'; DROP TABLE effects; --", "b": "\\' \\\\ \\x41 E'", "d": "$$ $a$",
                 "nl": "a\nb\tc\u0001"}
        for options, encoding, text in (("", "UTF8", "é€😀"),
                                        ("-c standard_conforming_strings=off", "UTF8", "é€😀"),
                                        ("-c standard_conforming_strings=off", "SJIS", "ソ表能"),
                                        ("", "LATIN1", "é")):
            conn = connect(autocommit=True, options=options)
            try:
                conn.execute("SET client_encoding = '%s'" % encoding)
                out = dict(nasty, u=text)
                id = "lit-%s-%s" % (encoding, bool(options))
                with self.runner.run(conn, 1, self.scope, id, {"x": 1}) as run:
                    if run.claimed:
                        run.outcome = out
                self.assertEqual((run.status, run.outcome), ("applied", out))
                with self.runner.run(conn, 1, self.scope, id + "-f", {"x": 1}) as run:
                    if run.claimed:
                        run.fail(out)
                self.assertEqual((run.status, run.outcome), ("failed_permanent", out))
                for key in (id, id + "-f"):
                    row = conn.execute("SELECT outcome::text FROM idempotency_keys WHERE "
                                       "tenant_id = 1 AND idempotency_key = idem_key(%s, %s)",
                                       [self.scope, key]).fetchone()
                    self.assertEqual(json.loads(row[0]), out, (encoding, options))
                wait_copy(ckey(1, self.scope, id))
                with self.runner.run(conn, 1, self.scope, id, {"x": 1}) as run:
                    pass
                self.assertEqual((run.status, run.source, run.outcome), ("replayed", "valkey", out))
            finally:
                conn.close()

    def test_applied_then_replayed_from_valkey(self):
        """applied once, then replayed from Valkey after the worker's copy, without a PostgreSQL round trip"""
        run = self.go("r1", {"amount": 5})
        self.assertEqual((run.status, run.source, run.attempt), ("applied", "handler", 1))
        self.assertEqual(run.outcome, {"done": "r1", "attempt": 1})
        e = wait_copy(ckey(1, self.scope, "r1"))
        self.assertEqual((e.kind, e.fingerprint), ("c", idem.fingerprint({"amount": 5})))
        # the same request in another text: same fingerprint, replayed from Valkey
        run2 = self.go("r1", ' {"amount":5}')
        self.assertEqual((run2.status, run2.source, run2.outcome),
                         ("replayed", "valkey", {"done": "r1", "attempt": 1}))
        self.assertEqual(effects(self.scope, "r1"), 1)
        # a replay from Valkey sends nothing to PostgreSQL: it works on a
        # connection whose backend is gone
        with admin() as a:
            a.execute("SELECT pg_terminate_backend(%s)", [self.conn.info.backend_pid])
        run3 = self.go("r1", {"amount": 5})
        self.assertEqual((run3.status, run3.source), ("replayed", "valkey"))

    def test_gate_connection_closed_while_idle(self):
        """the gate's Valkey connection closed by Valkey while idle (CLIENT KILL, its idle timeout, a restart): the next run takes a new one at once, answered by Valkey, no failure counted"""
        self.go("ci1", {"a": 1})
        wait_copy(ckey(1, self.scope, "ci1"))
        self.assertEqual(self.go("ci1", {"a": 1}).source, "valkey")
        v = valkey()
        idle = list(self.runner._direct.idle)
        self.assertTrue(idle)
        for c in idle:
            v.execute_command("CLIENT", "KILL", "ADDR", "%s:%d" % c.sock.getsockname()[:2])
        time.sleep(0.05)
        for _ in range(2):
            run = self.go("ci1", {"a": 1})
            self.assertEqual((run.status, run.source), ("replayed", "valkey"))
        self.assertEqual((self.runner.stats["valkey_errors"], self.runner.stats["notices"]), (0, 0))
        self.assertEqual(effects(self.scope, "ci1"), 1)

    def test_gate_with_and_without_hiredis(self):
        """the gate's replies read by hiredis, and by the package's own reader when python3-hiredis cannot be imported: applied, replayed from Valkey, and an error reply (WRONGTYPE) counted while PostgreSQL decides"""
        from idem import resp
        for blocked in (False, True):
            saved = sys.modules.get("hiredis")
            if blocked:
                sys.modules["hiredis"] = None       # import hiredis: ImportError
            try:
                runner = idem.Runner(("127.0.0.1", VPORT), lease=5)
                id = "hr-%s" % blocked
                self.assertEqual(self.go(id, {"a": 1}, runner=runner).status, "applied")
                wait_copy(ckey(1, self.scope, id))
                run = self.go(id, {"a": 1}, runner=runner)
                self.assertEqual((run.status, run.source), ("replayed", "valkey"))
                self.assertEqual(isinstance(runner._direct.idle[0].reader, resp.Reader), blocked)
                valkey().rpush(ckey(1, self.scope, id + "-list"), "x")
                run = self.go(id + "-list", {"a": 1}, runner=runner)
                self.assertEqual((run.status, run.source), ("applied", "handler"))
                self.assertEqual(runner.stats["valkey_errors"], 1)
                run = self.go(id, {"a": 1}, runner=runner)   # not rested: an error reply
                self.assertEqual((run.status, run.source), ("replayed", "valkey"))
            finally:
                if saved is not None:
                    sys.modules["hiredis"] = saved
                else:
                    sys.modules.pop("hiredis", None)

    def test_autocommit_connection_and_platform_ledger(self):
        """an autocommit connection works the same; the platform ledger (tenant None) too"""
        conn = connect(autocommit=True)
        try:
            run = self.go("p1", {"x": 1}, conn=conn, tenant=None)
            self.assertEqual(run.status, "applied")
            self.assertEqual(conn.info.transaction_status, psycopg.pq.TransactionStatus.IDLE)
            wait_copy(ckey(None, self.scope, "p1"))
            self.assertEqual(self.go("p1", {"x": 1}, conn=conn, tenant=None).source, "valkey")
            self.assertEqual(self.go("p1", {"x": 1}, tenant=2).status, "applied")  # another ledger row
        finally:
            conn.close()
        self.assertEqual(effects(self.scope, "p1"), 2)

    def test_replay_from_postgres_after_flush(self):
        """Valkey flushed: the replay comes from PostgreSQL, and the worker copies the row again"""
        self.go("f1", {"a": 1})
        k = ckey(1, self.scope, "f1")
        wait_copy(k)
        valkey().flushall()
        run = self.go("f1", {"a": 1})
        self.assertEqual((run.status, run.source), ("replayed", "postgres"))
        wait_copy(k)
        self.assertEqual(self.go("f1", {"a": 1}).source, "valkey")
        self.assertEqual(effects(self.scope, "f1"), 1)

    def test_busy(self):
        """a duplicate while the first run holds the key: busy from Valkey's marker, with a retry-after within the lease; then a replay"""
        other = connect()
        try:
            with self.runner.run(self.conn, 1, self.scope, "b1", {"a": 1}) as run:
                self.assertTrue(run.claimed)
                effect(self.conn, run)
                dup = self.go("b1", {"a": 1}, conn=other)
                self.assertEqual((dup.status, dup.source), ("busy", "valkey"))
                self.assertTrue(0 < dup.retry_after <= 5, dup.retry_after)
                # PostgreSQL alone says busy too (the claim never waits)
                pg_only = idem.Runner(None)
                dup2 = self.go("b1", {"a": 1}, conn=other, runner=pg_only)
                self.assertEqual((dup2.status, dup2.source), ("busy", "postgres"))
                self.assertTrue(0 < dup2.retry_after <= 1, dup2.retry_after)
            self.assertEqual(run.status, "applied")
            # the marker is still there until the worker's copy: the lookup answers
            again = self.go("b1", {"a": 1}, conn=other)
            self.assertEqual(again.status, "replayed")
        finally:
            other.close()
        self.assertEqual(effects(self.scope, "b1"), 1)

    def test_mismatch(self):
        """another request under a used key: mismatch, hinted by Valkey and confirmed in PostgreSQL; a forged hint is ignored"""
        self.go("m1", {"a": 1})
        k = ckey(1, self.scope, "m1")
        wait_copy(k)
        run = self.go("m1", {"a": 2})
        self.assertEqual((run.status, run.source), ("mismatch", "postgres"))
        self.assertEqual(self.go("m1", {"a": 1}).status, "replayed")
        # a value with a MAC that does not verify, claiming another fingerprint: ignored
        sec, cur = secrets()
        forged = cache.encode_terminal(b"\x00" * 32, cur, k, "c", 1, int(time.time() * 1000) + 60000,
                                       b"\x01" * 32, '{"forged": true}')
        valkey().set(k, forged)
        before = self.runner.stats["cache_rejected"]
        run = self.go("m1", {"a": 1})
        self.assertEqual((run.status, run.source, run.outcome["done"]), ("replayed", "postgres", "m1"))
        self.assertEqual(self.runner.stats["cache_rejected"], before + 1)
        self.assertEqual(effects(self.scope, "m1"), 1)

    def test_marker_rules(self):
        """markers: honoured until their MACed deadline, within our lease + 1 s, and in their first second only; a bad MAC is ignored"""
        sec, cur = secrets()
        v = valkey()
        # Deadlines from now, when each marker is set: a marker's age is
        # what the rules look at, and the cases before it may take a
        # second on a loaded machine.
        cases = [("k-long", sec[cur], 5000 + 1500, "applied"),    # beyond lease + 1 s
                 ("k-past", sec[cur], -10, "applied"),            # expired
                 ("k-badmac", b"\x07" * 32, 4800, "applied"),     # not the server's secret
                 # 2 s old (lease 5 s, 3 s left): no claim holds the key
                 # (its runner died), so the claim decides: applied
                 ("k-old", sec[cur], 3000, "applied"),
                 ("k-ok", sec[cur], 4800, "busy")]               # 0.2 s old
        for id, secret, ahead, want in cases:
            k = ckey(1, self.scope, id)
            deadline = int(time.time() * 1000) + ahead
            v.set(k, cache.encode_marker(secret, cur, k, deadline, os.urandom(16)), px=60000)
            run = self.go(id, {"a": 1})
            self.assertEqual(run.status, want, id)
            if want == "busy":
                self.assertTrue(4 < run.retry_after <= 4.8, run.retry_after)

    def test_killed_runner_marker(self):
        """a runner process killed by SIGKILL mid-handler: its redelivery 1.2 s later is applied, not busy for the rest of the lease"""
        code = """
import os, sys, time, psycopg, idem
r = idem.Runner(("127.0.0.1", int(os.environ["VP"])), lease=30)
c = psycopg.connect(os.environ["IDEM_PG_DSN"])
with r.run(c, 1, sys.argv[1], "kill1", {"a": 1}) as run:
    assert run.claimed, run.status
    print("claimed", flush=True)
    time.sleep(60)
"""
        env = dict(os.environ, VP=str(VPORT),
                   PYTHONPATH=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
        p = subprocess.Popen([sys.executable, "-c", code, self.scope], env=env,
                             stdout=subprocess.PIPE, text=True)
        try:
            self.assertEqual(p.stdout.readline().strip(), "claimed")
            # while it lives: busy (from its marker in the first second, then
            # from the claim)
            self.assertEqual(self.go("kill1", {"a": 1}).status, "busy")
            p.kill()
            p.wait()
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        # its marker (lease 30 s) is still in Valkey
        self.assertIsNotNone(valkey().get(ckey(1, self.scope, "kill1")))
        # redeliveries through a runner with the killed one's lease (a marker
        # further than our own lease + 1 s would be ignored anyway)
        same_lease = idem.Runner(("127.0.0.1", VPORT), lease=30)
        deadline = time.time() + 10
        while True:
            time.sleep(1.2)
            run = self.go("kill1", {"a": 1}, runner=same_lease)
            # the killed backend's rollback may take a moment to be seen
            if run.status != "busy" or time.time() > deadline:
                break
        self.assertEqual(run.status, "applied")
        self.assertEqual(effects(self.scope, "kill1"), 1)

    def test_failures(self):
        """a block that raises records a retryable failure (attempt + 1 next) and propagates; run.fail() or raising idem.PermanentFailure records a permanent one, replayed"""
        with self.assertRaises(ZeroDivisionError):
            with self.runner.run(self.conn, 1, self.scope, "x1", {"a": 1}) as run:
                effect(self.conn, run)
                1 / 0
        self.assertEqual((run.status, run.outcome["error"]), ("failed_retryable", "ZeroDivisionError"))
        self.assertIsNone(valkey().get(ckey(1, self.scope, "x1")))    # marker deleted
        with self.runner.run(self.conn, 1, self.scope, "x1", {"a": 1}) as run:
            self.assertEqual((run.claimed, run.attempt), (True, 2))
            run.fail({"reason": "card declined"})
        self.assertEqual((run.status, run.outcome), ("failed_permanent", {"reason": "card declined"}))
        wait_copy(ckey(1, self.scope, "x1"))
        run = self.go("x1", {"a": 1})
        self.assertEqual((run.status, run.source, run.outcome),
                         ("failed_permanent", "valkey", {"reason": "card declined"}))
        self.assertEqual(effects(self.scope, "x1"), 0)
        # raising idem.RetryableFailure / PermanentFailure in the block: recorded, not propagated
        with self.runner.run(self.conn, 1, self.scope, "x2", {}) as run:
            effect(self.conn, run)
            raise idem.RetryableFailure({"reason": "try later"})
        self.assertEqual((run.status, run.outcome), ("failed_retryable", {"reason": "try later"}))
        with self.runner.run(self.conn, 1, self.scope, "x2", {}) as run:
            self.assertEqual(run.attempt, 2)
            raise idem.PermanentFailure({"reason": "no"})
        self.assertEqual((run.status, run.outcome), ("failed_permanent", {"reason": "no"}))
        self.assertEqual(effects(self.scope, "x2"), 0)

    def test_bad_outcome_and_misuse(self):
        """a non-object outcome fails the attempt (rolled back to the savepoint); a server error rolls back; a block that commits, writes on an unclaimed run, or a connection already in a transaction, is refused"""
        with self.runner.run(self.conn, 1, self.scope, "o1", {}) as run:
            effect(self.conn, run)
            run.outcome = [1, 2]
        self.assertEqual((run.status, run.outcome["sqlstate"]), ("failed_permanent", "22023"))
        self.assertEqual(effects(self.scope, "o1"), 0)
        with self.assertRaises(idem.IdemError) as cm:
            with self.runner.run(self.conn, 1, self.scope, "o2", {}) as run:
                effect(self.conn, run)
                self.conn.commit()
        self.assertEqual(cm.exception.code, "handler_ended_tx")
        self.go("o3", {})
        with self.assertRaises(idem.IdemError) as cm:
            with self.runner.run(self.conn, 1, self.scope, "o3", {}) as run:
                effect(self.conn, run)      # no run.claimed check: refused, rolled back
        self.assertEqual(cm.exception.code, "state")
        self.assertEqual(effects(self.scope, "o3"), 1)
        with self.assertRaises(idem.IdemError) as cm:
            self.go("o4", "{not json")
        self.assertEqual(cm.exception.code, "request")
        # a server error (an unknown tenant): rolled back, the connection usable, both modes
        for autocommit in (False, True):
            conn = connect(autocommit=autocommit)
            try:
                with self.assertRaises(idem.IdemError) as cm:
                    self.go("o5", {}, conn=conn, tenant=999)
                self.assertEqual((cm.exception.code, cm.exception.sqlstate), ("server", "23503"))
                self.assertIsNone(valkey().get(ckey(999, self.scope, "o5")))   # marker deleted
                self.assertEqual(self.go("o5", {}, conn=conn).status, "applied" if not autocommit
                                 else "replayed")
                # a connection inside a transaction of its own is refused
                conn.execute("BEGIN" if autocommit else "SELECT 1")
                with self.assertRaises(idem.IdemError) as cm:
                    self.go("o6", {}, conn=conn)
                self.assertEqual(cm.exception.code, "state")
                conn.rollback()
            finally:
                conn.close()

    def test_backend_terminated_mid_run(self):
        """the backend terminated mid-run: an error saying nothing committed, the marker deleted, the redelivery applies once"""
        with self.assertRaises(idem.IdemError) as cm:
            with self.runner.run(self.conn, 1, self.scope, "t1", {"a": 1}) as run:
                with admin() as a:
                    a.execute("SELECT pg_terminate_backend(%s)", [self.conn.info.backend_pid])
                time.sleep(0.1)
                effect(self.conn, run)
        self.assertEqual(cm.exception.code, "connection")
        self.assertNotIsInstance(cm.exception, idem.CommitUnknown)
        self.assertIsNone(valkey().get(ckey(1, self.scope, "t1")))
        self.conn = connect()
        run = self.go("t1", {"a": 1})
        self.assertEqual((run.status, run.attempt), ("applied", 1))
        self.assertEqual(effects(self.scope, "t1"), 1)

    def test_backend_terminated_while_block_idle(self):
        """the backend terminated while the block ran without touching the connection: seen before COMMIT is sent, so not commit-unknown"""
        with self.assertRaises(idem.IdemError) as cm:
            with self.runner.run(self.conn, 1, self.scope, "t2", {"a": 1}) as run:
                self.assertTrue(run.claimed)
                with admin() as a:
                    a.execute("SELECT pg_terminate_backend(%s)", [self.conn.info.backend_pid])
                time.sleep(0.3)
                run.outcome = {"sent": "an email, say"}
        self.assertEqual(cm.exception.code, "connection")
        self.assertNotIsInstance(cm.exception, idem.CommitUnknown)
        self.assertIsNone(valkey().get(ckey(1, self.scope, "t2")))
        self.conn = connect()
        self.assertEqual(self.go("t2", {"a": 1}).status, "applied")

    def test_round_trips(self):
        """round trips to PostgreSQL, counted by a proxy: applied 2 (claim; complete with COMMIT), without autocommit too (psycopg's BEGIN goes with the claim), a replay from Valkey 0"""
        host, port = "127.0.0.1", int(psycopg.conninfo.conninfo_to_dict(DSN)["port"])
        proxy = TurnCounter(host, port)
        try:
            for autocommit, want in ((True, 2), (False, 2)):
                conn = psycopg.connect(DSN.replace("port=%d" % port, "port=%d" % proxy.port),
                                       autocommit=autocommit)
                try:
                    id = "rt-%s" % autocommit
                    self.go(id + "-0", {}, conn=conn)       # learns the schema and secrets
                    time.sleep(0.1)
                    turns = proxy.turns
                    with self.runner.run(conn, 1, self.scope, id, {}) as run:
                        pass                                # an effect elsewhere: no statement
                    self.assertEqual(run.status, "applied")
                    time.sleep(0.1)
                    self.assertEqual(proxy.turns - turns, want, "autocommit %s" % autocommit)
                    wait_copy(ckey(1, self.scope, id))
                    turns = proxy.turns
                    run = self.go(id, {}, conn=conn)
                    self.assertEqual((run.status, run.source), ("replayed", "valkey"))
                    time.sleep(0.1)
                    self.assertEqual(proxy.turns - turns, 0)
                finally:
                    conn.close()
        finally:
            proxy.close()

    def test_commit_unknown(self):
        """the backend terminated while COMMIT runs (a deferred trigger): CommitUnknown, and the redelivery finds what the ledger holds"""
        with admin() as a:
            a.execute("""
                CREATE TABLE IF NOT EXISTS slow_commit (id text);
                CREATE OR REPLACE FUNCTION slow_commit_wait() RETURNS trigger LANGUAGE plpgsql
                    AS $$ BEGIN PERFORM pg_sleep(2); RETURN NULL; END $$;
                DROP TRIGGER IF EXISTS slow_commit_wait ON slow_commit;
                CREATE CONSTRAINT TRIGGER slow_commit_wait AFTER INSERT ON slow_commit
                    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit_wait();
            """)
        pid = self.conn.info.backend_pid

        def terminate_during_commit():
            with admin() as a:
                for _ in range(100):
                    time.sleep(0.05)
                    # COMMIT runs the deferred trigger: pg_sleep shows the backend in it
                    if a.execute("SELECT query ~ 'COMMIT' OR wait_event = 'PgSleep' "
                                 "FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone() == (True,):
                        a.execute("SELECT pg_terminate_backend(%s)", [pid])
                        return
        t = threading.Thread(target=terminate_during_commit)
        with self.assertRaises(idem.CommitUnknown):
            with self.runner.run(self.conn, 1, self.scope, "u1", {"a": 1}) as run:
                effect(self.conn, run)
                self.conn.execute("INSERT INTO slow_commit VALUES ('u1')")
                t.start()
        t.join()
        self.conn = connect()
        run = self.go("u1", {"a": 1})
        self.assertIn(run.status, ("applied", "replayed"))
        self.assertEqual(effects(self.scope, "u1"), 1)

    def test_valkey_down(self):
        """Valkey down: PostgreSQL decides alone (applied, replayed, mismatch), then Valkey is used again once back"""
        dead = idem.Runner(("127.0.0.1", free_port()), lease=5, valkey_retry=0.2)
        run = self.go("d1", {"a": 1}, runner=dead)
        self.assertEqual((run.status, run.valkey_used), ("applied", False))
        run = self.go("d1", {"a": 1}, runner=dead)
        self.assertEqual((run.status, run.source), ("replayed", "postgres"))
        self.assertEqual(self.go("d1", {"a": 2}, runner=dead).status, "mismatch")
        # the real Valkey killed and restarted (empty) under a live runner
        self.go("d2", {"a": 1})
        pid = int(open(os.path.join(VDIR, "valkey.pid")).read())
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        run = self.go("d2", {"a": 1})
        self.assertEqual((run.status, run.source), ("replayed", "postgres"))
        self.assertEqual(self.go("d3", {"a": 1}).status, "applied")
        subprocess.run([VSERVER, "--port", str(VPORT), "--bind", "127.0.0.1", "--save", "",
                        "--appendonly", "no", "--dir", os.path.join(VDIR, "valkey"),
                        "--daemonize", "yes", "--pidfile", os.path.join(VDIR, "valkey.pid"),
                        "--logfile", os.path.join(VDIR, "valkey.log")], check=True)
        end = time.time() + 20
        while time.time() < end:
            time.sleep(0.3)
            try:
                # a fresh Valkey: the worker takes a new epoch over, the
                # runner learns it again (55000 meanwhile: PostgreSQL only)
                if self.go("d3", {"a": 1}).source == "valkey":
                    break
            except Exception:
                pass
            self.conn.close()
            self.conn = connect()
        else:
            self.fail("the runner never used Valkey again")
        for id in ("d1", "d2", "d3"):
            self.assertEqual(effects(self.scope, id), 1, id)

    def test_cluster_refused(self):
        """a plain redis.Redis client of a Valkey Cluster node is refused when the runner is made"""
        port = free_port()
        d = os.path.join(VDIR, "cluster%d" % port)
        os.makedirs(d)
        p = subprocess.Popen([VSERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--cluster-enabled", "yes", "--dir", d,
                              "--cluster-port", str(free_port())],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            r = redis.Redis(port=port)
            for _ in range(100):
                try:
                    r.ping()
                    break
                except redis.exceptions.ConnectionError:
                    time.sleep(0.05)
            with self.assertRaises(idem.ValkeyClusterNotSupported):
                idem.Runner(redis.Redis(port=port))
        finally:
            p.kill()
            p.wait()

    def test_decorator(self):
        """the decorator: the outcome on every delivery; Busy, Mismatch and PermanentFailure raised"""
        calls = []

        @self.runner.idempotent(self.scope, run_id="msg_id", request="body", tenant=1)
        def charge(conn, msg_id, body):
            calls.append(msg_id)
            conn.execute("INSERT INTO effects (scope, id) VALUES (%s, %s)", [self.scope, msg_id])
            if body.get("declined"):
                raise idem.PermanentFailure({"reason": "declined"})
            return {"charged": body["amount"]}

        self.assertEqual(charge(self.conn, "d1", {"amount": 5}), {"charged": 5})
        self.assertEqual(charge(self.conn, msg_id="d1", body={"amount": 5}), {"charged": 5})
        with self.assertRaises(idem.Mismatch):
            charge(self.conn, "d1", {"amount": 6})
        with self.assertRaises(idem.PermanentFailure) as cm:
            charge(self.conn, "d2", {"amount": 1, "declined": True})
        self.assertEqual(cm.exception.detail, {"reason": "declined"})
        with self.assertRaises(idem.PermanentFailure):
            charge(self.conn, "d2", {"amount": 1, "declined": True})
        other = connect()
        try:
            with self.runner.run(other, 1, self.scope, "d3", {"amount": 1}) as run:
                with self.assertRaises(idem.Busy) as cm:
                    charge(self.conn, "d3", {"amount": 1})
                self.assertGreater(cm.exception.retry_after, 0)
                effect(other, run)
        finally:
            other.close()
        self.assertEqual(calls, ["d1", "d2"])
        self.assertEqual(effects(self.scope), 2)    # d1 and d3; d2 rolled back


class Learning(unittest.TestCase):
    FAKE = """
        CREATE SCHEMA IF NOT EXISTS fake55;
        CREATE TABLE IF NOT EXISTS fake55.ready (ok boolean);
        INSERT INTO fake55.ready VALUES (false);
        CREATE OR REPLACE FUNCTION fake55.idem_cache_keyspace() RETURNS text LANGUAGE plpgsql AS $$
        BEGIN
            IF NOT (SELECT bool_and(ok) FROM fake55.ready) THEN
                RAISE EXCEPTION 'the worker has not taken the cache epoch over yet'
                    USING ERRCODE = '55000';
            END IF;
            RETURN public.idem_cache_keyspace();
        END $$;
        DROP FUNCTION IF EXISTS fake55.idem_cache_secrets();
        CREATE FUNCTION fake55.idem_cache_secrets(OUT key_id integer, OUT secret bytea,
            OUT is_current boolean, OUT owner_key text, OUT owner_token text)
            RETURNS SETOF record LANGUAGE sql
            AS $$ SELECT * FROM public.idem_cache_secrets() $$;
        CREATE OR REPLACE FUNCTION fake55.idem_claim(bigint, bytea, bytea, interval)
            RETURNS public.idem_claim_result LANGUAGE sql
            AS $$ SELECT * FROM public.idem_claim($1, $2, $3, $4) $$;
        CREATE OR REPLACE FUNCTION fake55.idem_complete(bigint, bytea, jsonb, interval)
            RETURNS void LANGUAGE sql AS $$ SELECT public.idem_complete($1, $2, $3, $4) $$;
        CREATE OR REPLACE FUNCTION fake55.idem_lookup(bigint, bytea, OUT status text,
            OUT attempt integer, OUT outcome jsonb, OUT fingerprint bytea, OUT expires_at timestamptz)
            RETURNS SETOF record LANGUAGE sql AS $$ SELECT * FROM public.idem_lookup($1, $2) $$;
    """

    def test_not_ready_55000(self):
        """while idem_cache_keyspace() answers 55000 the runner runs on PostgreSQL alone, and asks again a second later"""
        with admin() as a:
            a.execute(self.FAKE)
        notices = []
        runner = idem.Runner(("127.0.0.1", VPORT), schema="fake55", notice=notices.append)
        conn = connect()
        scope = uid("ready")
        try:
            def go(id):
                with runner.run(conn, 1, scope, id, {}) as run:
                    if run.claimed:
                        effect(conn, run)
                return run
            run = go("n1")
            refused = time.monotonic()
            self.assertEqual((run.status, run.valkey_used), ("applied", False))
            self.assertTrue(any("55000" in n for n in notices), notices)
            # No marker was set (the worker's copy of the result may be there already).
            self.assertNotRegex(valkey().get(ckey(1, scope, "n1")) or b"",
                                rb"^idem2 [0-9a-f]{64} [0-9]+ p ")
            with admin() as a:
                a.execute("UPDATE fake55.ready SET ok = true")
            began = time.monotonic()
            while True:
                run = go("n1")
                self.assertEqual(run.status, "replayed")
                if run.valkey_used:
                    break
                self.assertLess(time.monotonic() - began, 3, "never asked again")
                time.sleep(0.1)
            # Not at once: a second after the refusal (timed from the refusal,
            # as the UPDATE alone may take a second on a loaded machine).
            self.assertGreater(time.monotonic() - refused, 0.5)
        finally:
            conn.close()
        self.assertEqual(effects(scope, "n1"), 1)

    def test_secret_rotation(self):
        """a value under a newly rotated secret: ignored until the runner learns again (a second later), then replayed from Valkey"""
        runner = idem.Runner(("127.0.0.1", VPORT))
        conn = connect()
        scope = uid("rot")
        try:
            def go(id):
                with runner.run(conn, 1, scope, id, {}) as run:
                    if run.claimed:
                        effect(conn, run)
                return run
            go("warm")                              # learns the secrets now
            with admin() as a:
                new_id = a.execute("SELECT idem_rotate_cache_secret()").fetchone()[0]
            with runner.run(conn, 1, scope, "s1", {}) as run:
                effect(conn, run)
            self.assertEqual(run.status, "applied")
            e = wait_copy(ckey(1, scope, "s1"))
            self.assertEqual(e.key_id, new_id)
            before = runner.stats["cache_rejected"]
            run = go("s1")
            if run.source == "postgres":            # not learnt yet: an unknown key id
                self.assertEqual(runner.stats["cache_rejected"], before + 1)
                time.sleep(1.1)
                wait_copy(ckey(1, scope, "s1"))
                run = go("s1")
            self.assertEqual((run.status, run.source), ("replayed", "valkey"))
        finally:
            conn.close()


class MixedFleet(unittest.TestCase):
    def fleet(self, faults):
        if not RUN_ONCE:
            self.skipTest("idem_run_once was not built")
        scope = uid("fleet")
        ids = ["m%d" % i for i in range(300 if faults else 120)]
        # the same request, three texts: the C runners get one, Python a
        # dict or another text of it (exponent, duplicate key)
        c_request = '{"amount": 1.5, "currency": "EUR", "tags": ["a", "b"]}'
        py_request = {"tags": ["a", "b"], "currency": "EUR", "amount": 1.5}
        py_request_text = '{"currency":"EUR","tags":["a","b"],"amount":15e-1, "amount":15E-1}'
        results = []
        crashes = []
        lock = threading.Lock()
        stop = threading.Event()

        def c_worker(seed):
            order = ids * 2
            random.Random(seed).shuffle(order)
            try:
                p = subprocess.run([RUN_ONCE, DSN, str(VPORT), "1", scope, "-", c_request],
                                   input="\n".join(order) + "\n", capture_output=True, text=True,
                                   timeout=300)
            except BaseException:
                # a thread's exception would only be printed: the test must see it
                with lock:
                    crashes.append("C runner %d: %s" % (seed, traceback.format_exc()))
                return
            with lock:
                results.extend(("c", l.split(" ", 1)[0]) for l in p.stdout.splitlines())

        def py_worker(seed):
            order = ids * 2
            random.Random(seed).shuffle(order)
            runner = idem.Runner(("127.0.0.1", VPORT), lease=5)
            conn = connect()
            try:
                py_deliver(runner, conn, order)
            except BaseException:
                with lock:
                    crashes.append("Python runner %d: %s" % (seed, traceback.format_exc()))

        def py_deliver(runner, conn, order):
            try:
                for n, id in enumerate(order):
                    req = py_request if n % 2 else py_request_text
                    while True:
                        try:
                            with runner.run(conn, 1, scope, id, req) as run:
                                if run.claimed:
                                    conn.execute("INSERT INTO effects (scope, id, node) "
                                                 "VALUES (%s, %s, 'py')", [scope, id])
                                    run.outcome = {"node": "py"}
                        except idem.IdemError as e:
                            # a terminated backend, commit unknown: redeliver
                            with lock:
                                results.append(("py-error", e.code))
                            if conn.broken or conn.closed:
                                conn = connect()
                            continue
                        if run.status != "busy":
                            break
                        time.sleep(min(run.retry_after, 0.05))
                    with lock:
                        results.append(("py", run.status))
            finally:
                conn.close()

        def chaos():
            v = valkey()
            n = 0
            while not stop.wait(0.05):
                n += 1
                try:
                    if n % 3 == 0:
                        v.flushall()
                    else:
                        with admin() as a:
                            a.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                      "WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() "
                                      "AND datname = current_database() ORDER BY random() LIMIT 1")
                except Exception:
                    pass

        threads = [threading.Thread(target=c_worker, args=(1,)), threading.Thread(target=c_worker, args=(2,)),
                   threading.Thread(target=py_worker, args=(3,)), threading.Thread(target=py_worker, args=(4,))]
        for t in threads:
            t.start()
        if faults:
            ct = threading.Thread(target=chaos)
            ct.start()
        for t in threads:
            t.join()
        stop.set()
        if faults:
            ct.join()
        self.assertEqual(crashes, [])
        statuses = [s for _, s in results]
        self.assertNotIn("mismatch", statuses)
        if not faults:
            self.assertNotIn("error", statuses)
            self.assertNotIn("py-error", [w for w, _ in results])
        self.assertEqual(len([r for r in results if r[0] == "py"]), 4 * len(ids))
        with admin() as c:
            rows = c.execute("SELECT id, count(*) FROM effects WHERE scope = %s GROUP BY id",
                             [scope]).fetchall()
            nodes = c.execute("SELECT count(DISTINCT node) FROM effects WHERE scope = %s",
                              [scope]).fetchone()[0]
        self.assertEqual(sorted(r[0] for r in rows), sorted(ids))
        self.assertEqual([r for r in rows if r[1] != 1], [])
        self.assertEqual(nodes, 2, "both runners applied some")
        # afterwards the C runner replays what either side applied: no mismatch
        for id in ids[:10]:
            p = subprocess.run([RUN_ONCE, DSN, str(VPORT), "1", scope, id, c_request],
                               capture_output=True, text=True, timeout=30)
            self.assertTrue(p.stdout.startswith("replayed"), p.stdout + p.stderr)
        return results

    def test_c_and_python_on_the_same_keys(self):
        """a mixed fleet: 2 C runners and 2 Python runners on the same 120 keys, duplicates and reordering: every effect once, no mismatch"""
        self.fleet(faults=False)

    def test_c_and_python_under_faults(self):
        """the mixed fleet on 300 keys while Valkey is flushed or a backend terminated every 0.05 s: every effect once, no mismatch"""
        results = self.fleet(faults=True)
        print("# mixed fleet under faults: %d C errors, %d Python redeliveries after an error"
              % (sum(1 for w, s in results if w == "c" and s == "error"),
                 sum(1 for w, _ in results if w == "py-error")))


class Readme(unittest.TestCase):
    def test_readme_example(self):
        """the package README's example runs as written"""
        path = os.environ.get("IDEM_PACKAGE_README")
        if not path or not os.path.exists(path):
            self.skipTest("no README")
        text = open(path).read()
        code = text.split("```python\n", 1)[1].split("```", 1)[0]
        env = dict(os.environ, IDEM_DSN=DSN, VALKEY_PORT=str(VPORT))
        p = subprocess.run([sys.executable, "-c", code],
                           env=env, capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("applied", p.stdout)
        self.assertIn("replayed", p.stdout)


if __name__ == "__main__":
    unittest.main()
