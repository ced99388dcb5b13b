"""What the Python runner says about a Valkey that is wrong (health.py), and
Runner.check (check.py), against real servers: the test's PostgreSQL and
Valkey (test/python/run.sh), and a second Valkey with requirepass started
here on a free loopback port and always stopped."""
import asyncio
import logging
import os
import socket
import subprocess
import time
import unittest

import psycopg
import redis

import idem
import idem.aio
from test_server import free_port

DSN = os.environ.get("IDEM_PG_DSN", "")
VPORT = int(os.environ.get("IDEM_VALKEY_PORT", "0"))
VSERVER = os.environ.get("IDEM_VALKEY_SERVER_BIN", "valkey-server")
PASSWORD = "idem-health-secret"


class Heard(logging.Handler):
    """The records of the "idem" logger."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)

    def messages(self, *words):
        return [r.getMessage() for r in self.records
                if all(w in r.getMessage() for w in words)]


class Base(unittest.TestCase):
    other = None
    other_port = 0

    @classmethod
    def setUpClass(cls):
        cls.other_port = free_port()
        cls.other = subprocess.Popen(
            [VSERVER, "--port", str(cls.other_port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", "/tmp", "--requirepass", PASSWORD],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.time() + 10
        while time.time() < end:
            try:
                socket.create_connection(("127.0.0.1", cls.other_port), 0.2).close()
                break
            except OSError:
                time.sleep(0.02)

    @classmethod
    def tearDownClass(cls):
        if cls.other is not None:
            cls.other.kill()
            cls.other.wait()

    def setUp(self):
        self.heard = Heard()
        self.log = logging.getLogger("idem")
        self.log.addHandler(self.heard)
        self.log.setLevel(logging.DEBUG)
        self.conn = psycopg.connect(DSN)
        self.seq = 0

    def tearDown(self):
        self.log.removeHandler(self.heard)
        self.conn.close()

    def client(self, port, password=None):
        return redis.Redis(host="127.0.0.1", port=port, password=password,
                           socket_timeout=0.3, socket_connect_timeout=0.3)

    def runs_apply(self, runner, n, tag):
        for _ in range(n):
            self.seq += 1
            rid = "%s-%d-%d-%f" % (tag, os.getpid(), self.seq, time.time())
            with runner.run(self.conn, 1, "health.py", rid, {}) as run:
                if run.claimed:
                    run.outcome = {"done": True}
            self.assertEqual(run.status, idem.APPLIED)


class TestValkeyHealth(Base):
    def test_wrong_password(self):
        """redis.Redis(password=<wrong>): told once (WRONGPASS), counted, rested"""
        r = idem.Runner(self.client(self.other_port, "wrong"))
        self.runs_apply(r, 5, "wrongpass")
        told = self.heard.messages("WRONGPASS", "running on PostgreSQL only")
        self.assertEqual(len(self.heard.records), 1, [x.getMessage() for x in self.heard.records])
        self.assertEqual(len(told), 1)
        self.assertEqual(r.stats["valkey_auth_failures"], 1)
        self.assertEqual(r.stats["valkey_errors"], 1)

    def test_no_password(self):
        """no password where one is wanted (NOAUTH): told once, counted, rested"""
        r = idem.Runner(self.client(self.other_port))
        self.runs_apply(r, 5, "noauth")
        self.assertEqual(len(self.heard.messages("NOAUTH", "password")), 1,
                         [x.getMessage() for x in self.heard.records])
        self.assertEqual(r.stats["valkey_auth_failures"], 1)

    def test_down(self):
        """Valkey down: told once with the reason, counted once, rested; after
        valkey_retry tried again and counted, not told again within a minute"""
        # The rest outlasts five runs on a loaded machine (a load of 30 made
        # 0.5 s too short: the fifth run tried Valkey again).
        r = idem.Runner(("127.0.0.1", free_port()), valkey_retry=3.0)
        self.runs_apply(r, 5, "down")
        self.assertEqual(len(self.heard.messages("refused", "running on PostgreSQL only")), 1,
                         [x.getMessage() for x in self.heard.records])
        self.assertEqual(r.stats["valkey_errors"], 1)
        time.sleep(3.1)
        self.runs_apply(r, 1, "down")
        self.assertEqual(r.stats["valkey_errors"], 2)
        self.assertEqual(len(self.heard.records), 1)
        self.assertEqual(r.stats["notices"], 1)

    def test_answers_again(self):
        """Valkey down, then started: told when it answers again"""
        port = free_port()
        r = idem.Runner(("127.0.0.1", port), valkey_retry=0.2)
        self.runs_apply(r, 1, "again")
        self.assertEqual(len(self.heard.messages("refused")), 1)
        p = subprocess.Popen([VSERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", "/tmp"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            end = time.time() + 10
            while not self.heard.messages("answers again") and time.time() < end:
                time.sleep(0.25)
                self.runs_apply(r, 1, "again")
        finally:
            p.kill()
            p.wait()
        again = [x for x in self.heard.records if "answers again" in x.getMessage()]
        self.assertEqual(len(again), 1, [x.getMessage() for x in self.heard.records])
        self.assertEqual(again[0].levelno, logging.INFO)

    def test_not_the_servers(self):
        """another Valkey than the server's: told within the grace, counted,
        and rested (no marker written meanwhile)"""
        other = self.client(self.other_port, PASSWORD)
        r = idem.Runner(self.client(self.other_port, PASSWORD))
        start = time.time()
        while not self.heard.records and time.time() - start < 8:
            self.runs_apply(r, 1, "other")
            time.sleep(0.1)
        told = self.heard.messages("is not the server's", "owner key")
        self.assertEqual(len(told), 1, [x.getMessage() for x in self.heard.records])
        self.assertEqual(r.stats["valkey_not_servers"], 1)
        self.assertGreaterEqual(r.stats["owner_mismatches"], 2)
        size = other.dbsize()
        self.runs_apply(r, 5, "other")
        self.assertEqual(other.dbsize(), size, "a resting runner wrote markers there")
        self.assertEqual(len(self.heard.records), 1)

    def test_check(self):
        """Runner.check: all well, and each problem with its status"""
        ok = idem.Runner(("127.0.0.1", VPORT)).check(self.conn)
        self.assertTrue(ok, ok)
        self.assertTrue(ok.valkey_ok and ok.valkey_owner_ok)
        self.assertGreater(ok.pg_rtt, 0)
        self.assertGreater(ok.valkey_rtt, 0)
        ver = self.conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'idem'").fetchone()[0]
        self.conn.commit()
        self.assertEqual(ok.extension_version, ver)
        self.assertEqual(idem.Runner(None).check(self.conn).status, "ok")
        for valkey, status, word in [
                (("127.0.0.1", free_port()), "valkey_unreachable", "refused"),
                (self.client(self.other_port, "wrong"), "valkey_auth", "WRONGPASS"),
                (self.client(self.other_port), "valkey_auth", "NOAUTH"),
                (self.client(self.other_port, PASSWORD), "valkey_not_servers", "owner key")]:
            c = idem.Runner(valkey).check(self.conn)
            self.assertFalse(c)
            self.assertEqual(c.status, status, c)
            self.assertIn(word, c.message)
        with psycopg.connect(DSN, autocommit=True) as a:
            if a.execute("SELECT count(*) FROM pg_database WHERE datname = 'idem_py_noext'").fetchone()[0] == 0:
                a.execute("CREATE DATABASE idem_py_noext")
        dsn = psycopg.conninfo.make_conninfo(DSN, dbname="idem_py_noext")
        with psycopg.connect(dsn) as c2:
            c = idem.Runner(("127.0.0.1", VPORT)).check(c2)
        self.assertEqual(c.status, "no_extension", c)
        self.assertIn("CREATE EXTENSION", c.message)

    def test_check_async(self):
        """AsyncRunner.check, awaited: all well, a wrong password, another Valkey"""
        import redis.asyncio

        async def go(valkey):
            conn = await psycopg.AsyncConnection.connect(DSN)
            runner = idem.aio.AsyncRunner(valkey)
            try:
                return await runner.check(conn)
            finally:
                await conn.close()
                await runner.aclose()
                if not isinstance(valkey, tuple):
                    await valkey.close()        # a client given is ours

        ok = asyncio.run(go(("127.0.0.1", VPORT)))
        self.assertTrue(ok, ok)
        self.assertTrue(ok.valkey_owner_ok and ok.extension_version)
        bad = asyncio.run(go(redis.asyncio.Redis(port=self.other_port, password="wrong")))
        self.assertEqual(bad.status, "valkey_auth", bad)
        other = asyncio.run(go(redis.asyncio.Redis(port=self.other_port, password=PASSWORD)))
        self.assertEqual(other.status, "valkey_not_servers", other)


if __name__ == "__main__":
    unittest.main()
