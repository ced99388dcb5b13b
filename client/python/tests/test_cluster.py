"""The Python runner on a Valkey Cluster: each key routed to its slot's
master (redis-py's RedisCluster), with a server whose worker copies into
the same cluster (test/python/run.sh starts both)."""
import logging
import os
import signal
import subprocess
import sys
import time
import unittest

import psycopg
import redis
from redis.cluster import RedisCluster

import idem
from idem import cache

DSN = os.environ.get("IDEM_PG_CLUSTER_DSN")
PORT = os.environ.get("IDEM_VALKEY_CLUSTER_PORT")


def admin():
    return psycopg.connect(DSN, autocommit=True)


class _ClusterCase(unittest.TestCase):
    """What the cluster tests share (no test of its own)."""
    @classmethod
    def setUpClass(cls):
        end = time.time() + 60
        while True:
            try:
                with admin() as c:
                    cls.keyspace = c.execute("SELECT idem_cache_keyspace()").fetchone()[0]
                break
            except psycopg.errors.ObjectNotInPrerequisiteState:
                if time.time() > end:
                    raise
                time.sleep(0.2)
        cls.vc = RedisCluster(host="127.0.0.1", port=int(PORT), socket_timeout=2)

    def setUp(self):
        self.runner = idem.Runner(("127.0.0.1", int(PORT)), lease=5)
        self.conn = psycopg.connect(DSN)
        self.scope = "cl-%d-%s" % (os.getpid(), self._testMethodName)

    def tearDown(self):
        self.conn.close()

    def go(self, id, request, conn=None):
        conn = conn or self.conn
        with self.runner.run(conn, 1, self.scope, id, request) as run:
            if run.claimed:
                conn.execute("INSERT INTO effects (scope, id) VALUES (%s, %s)", [self.scope, id])
                run.outcome = {"id": id}
        return run

    def ckey(self, id):
        return cache.cache_key(self.keyspace, 1, idem.idem_key(self.scope, id))

    def wait_copy(self, id):
        end = time.time() + 15
        while time.time() < end:
            v = self.vc.get(self.ckey(id))
            e = cache.parse(v) if v is not None else None
            if e is not None and e.kind != cache.MARKER:
                return e
            time.sleep(0.02)
        raise AssertionError("no copy of %s" % id)


@unittest.skipUnless(DSN and PORT, "no Valkey Cluster (IDEM_PG_CLUSTER_DSN, IDEM_VALKEY_CLUSTER_PORT)")
class Cluster(_ClusterCase):

    def test_routed_by_slot(self):
        """(host, port) of a cluster node: each key goes to its slot's master; the worker's copies replay from the cluster"""
        ids = ["k%d" % i for i in range(24)]
        for id in ids:
            self.assertEqual(self.go(id, {"n": id}).status, "applied")
        self.assertIsInstance(self.runner.valkey, RedisCluster)
        masters = {self.vc.get_node_from_key(self.ckey(id)).name for id in ids}
        self.assertGreaterEqual(len(masters), 2, "the keys span several masters")
        for id in ids:
            self.wait_copy(id)
        for id in ids:
            run = self.go(id, {"n": id})
            self.assertEqual((run.status, run.source, run.outcome), ("replayed", "valkey", {"id": id}))
        self.assertEqual(self.go(ids[0], {"n": "other"}).status, "mismatch")
        with admin() as c:
            n = c.execute("SELECT count(*), count(DISTINCT id) FROM effects WHERE scope = %s",
                          [self.scope]).fetchone()
        self.assertEqual(n, (24, 24))

    def test_busy_and_compare_and_delete(self):
        """on the cluster: a held key is busy from its marker; a retryable failure deletes its marker (EVALSHA routed by key)"""
        other = psycopg.connect(DSN)
        try:
            with self.runner.run(self.conn, 1, self.scope, "b", {}) as run:
                self.assertTrue(run.claimed)
                dup = self.go("b", {}, conn=other)
                self.assertEqual((dup.status, dup.source), ("busy", "valkey"))
            self.assertEqual(run.status, "applied")
        finally:
            other.close()
        with self.assertRaises(RuntimeError):
            with self.runner.run(self.conn, 1, self.scope, "r", {}) as run:
                self.assertTrue(run.claimed)
                self.assertIsNotNone(self.vc.get(self.ckey("r")))     # our marker
                raise RuntimeError("retry me")
        self.assertEqual(run.status, "failed_retryable")
        self.assertIsNone(self.vc.get(self.ckey("r")))

    def test_async_runner_on_the_cluster(self):
        """the asyncio runner given (host, port) of a cluster node: routed by slot (redis.asyncio's RedisCluster), busy from the marker, a retryable failure's marker deleted, the worker's copies replayed"""
        import asyncio
        from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
        from idem.aio import AsyncRunner
        ids = ["a%d" % i for i in range(12)]

        async def deliver(runner, conn, id):
            async with runner.run(conn, 1, self.scope, id, {"n": id}) as run:
                if run.claimed:
                    await conn.execute("INSERT INTO effects (scope, id) VALUES (%s, %s)",
                                       [self.scope, id])
                    run.outcome = {"id": id}
            return run

        async def main(replay):
            runner = AsyncRunner(("127.0.0.1", int(PORT)), lease=5)
            conn = await psycopg.AsyncConnection.connect(DSN)
            other = await psycopg.AsyncConnection.connect(DSN)
            try:
                runs = [await deliver(runner, conn, id) for id in ids]
                self.assertIsInstance(runner.valkey, AsyncRedisCluster)
                if replay:
                    return [(r.status, r.source) for r in runs]
                async with runner.run(conn, 1, self.scope, "ab", {}) as run:
                    dup = await deliver(runner, other, "ab")
                    self.assertEqual((dup.status, dup.source), ("busy", "valkey"))
                with self.assertRaises(RuntimeError):
                    async with runner.run(conn, 1, self.scope, "ar", {}) as run:
                        self.assertIsNotNone(self.vc.get(self.ckey("ar")))     # our marker
                        raise RuntimeError("retry me")
                self.assertEqual(run.status, "failed_retryable")
                self.assertIsNone(self.vc.get(self.ckey("ar")))
                return [(r.status, r.source) for r in runs]
            finally:
                await conn.close()
                await other.close()
                await runner.aclose()
        self.assertEqual(asyncio.run(main(False)), [("applied", "handler")] * len(ids))
        for id in ids:
            self.wait_copy(id)
        self.assertEqual(asyncio.run(main(True)), [("replayed", "valkey")] * len(ids))
        self.assertGreaterEqual(len({self.vc.get_node_from_key(self.ckey(id)).name
                                     for id in ids}), 2, "the keys span several masters")

    def test_no_stderr_noise_when_a_master_lost_the_script(self):
        """on the cluster, sync and asyncio: masters that lost the compare-and-delete script (SCRIPT FLUSH, as after a restart or a failover) print nothing on stderr (no redis-py "No matching script" traceback); every marker is still deleted"""
        # one id per master at least, for each runner and each round
        masters = {n.name for n in self.vc.get_primaries()}
        ids = {}
        for prefix in ("s", "t", "a", "b"):
            chosen, seen = [], set()
            for i in range(1000):
                node = self.vc.get_node_from_key(self.ckey("%s%d" % (prefix, i))).name
                if node not in seen:
                    seen.add(node)
                    chosen.append("%s%d" % (prefix, i))
                if seen == masters:
                    break
            ids[prefix] = chosen
        code = """
import asyncio, os, sys, psycopg, idem
from redis.cluster import RedisCluster
from idem.aio import AsyncRunner
port, scope, ids = int(os.environ["VP"]), os.environ["SCOPE"], os.environ["IDS"].split(";")
vc = RedisCluster(host="127.0.0.1", port=port)
vc.script_flush()
runner = idem.Runner(("127.0.0.1", port), lease=5)
assert vc.script_exists(runner._cad.sha) == [True], "loaded on every master at first contact"
conn = psycopg.connect(os.environ["DSN"])
def retryable(group):
    for id in group.split(","):
        try:
            with runner.run(conn, 1, scope, id, {}) as run:
                assert run.claimed, id
                raise RuntimeError("retry me")
        except RuntimeError:
            pass
        assert run.status == "failed_retryable", (id, run)
retryable(ids[0])
vc.script_flush()               # every master forgets it again
retryable(ids[1])
async def aretryable(runner, conn, group):
    for id in group.split(","):
        try:
            async with runner.run(conn, 1, scope, id, {}) as run:
                assert run.claimed, id
                raise RuntimeError("retry me")
        except RuntimeError:
            pass
        assert run.status == "failed_retryable", (id, run)
async def main():
    runner = AsyncRunner(("127.0.0.1", port), lease=5)
    conn = await psycopg.AsyncConnection.connect(os.environ["DSN"])
    vc.script_flush()
    await aretryable(runner, conn, ids[2])
    vc.script_flush()
    await aretryable(runner, conn, ids[3])
    await conn.close()
    await runner.aclose()
asyncio.run(main())
print(runner.stats["valkey_errors"])
"""
        env = dict(os.environ, DSN=DSN, VP=PORT, SCOPE=self.scope,
                   IDS=";".join(",".join(ids[p]) for p in ("s", "t", "a", "b")))
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=120)
        self.maxDiff = None
        self.assertEqual((p.returncode, p.stdout.strip(), p.stderr), (0, "0", ""))
        for group in ids.values():
            self.assertEqual(len(group), len(masters))
            for id in group:
                self.assertIsNone(self.vc.get(self.ckey(id)), id)     # the marker deleted


@unittest.skipUnless(DSN and PORT, "no Valkey Cluster (IDEM_PG_CLUSTER_DSN, IDEM_VALKEY_CLUSTER_PORT)")
class ClusterFaults(_ClusterCase):
    """After Cluster's tests (the loader sorts the classes): faults that
    change the cluster's map."""

    def node(self, cnode):
        """A plain client of one cluster node."""
        return redis.Redis(host=cnode.host, port=cnode.port, socket_timeout=5)

    def key_on(self, prefix, master=None):
        """A fresh id whose key lives on master (any master: None)."""
        for i in range(1000):
            id = "%s%d" % (prefix, i)
            if master is None or self.vc.get_node_from_key(self.ckey(id)).name == master.name:
                return id
        raise AssertionError("no key on %s" % master.name)

    def wait_cluster_ok(self):
        end = time.time() + 30
        while time.time() < end:
            try:
                if all(self.node(n).cluster("INFO")["cluster_state"] == "ok"
                       for n in self.vc.get_nodes()):
                    return
            except redis.exceptions.RedisError:
                pass
            time.sleep(0.1)
        raise AssertionError("the cluster is not ok again")

    def test_redis_py_logs_nothing_of_ours(self):
        """redis-py's RedisCluster logs nothing while the runner's own commands meet a slot in migration (ASK), a slot moved (MOVED, the runner's map stale) and a master stopped (timeouts): every run decided, each effect once, the stopped master told once through the idem logger and given up at once, and Valkey used again after the rest"""
        records = []

        class Keep(logging.Handler):
            def emit(self, record):
                records.append("%s %s: %s%s" % (record.name, record.levelname,
                                                 record.getMessage(),
                                                 " (with a traceback)" if record.exc_info else ""))
        keep = Keep(logging.WARNING)
        loggers = [logging.getLogger("redis"), logging.getLogger("idem")]
        for log in loggers:
            log.addHandler(keep)
        try:
            self.migrate_and_stop(records)
        finally:
            for log in loggers:
                log.removeHandler(keep)
        self.assertEqual([r for r in records if not r.startswith("idem")], [])

    def migrate_and_stop(self, records):
        self.go(self.key_on("w"), {})                   # the runner knows the map now
        masters = self.vc.get_primaries()
        src = self.vc.get_node_from_key(self.ckey(self.key_on("m")))
        dst = [m for m in masters if m.name != src.name][0]
        src_c, dst_c = self.node(src), self.node(dst)
        src_id, dst_id = src_c.execute_command("CLUSTER MYID"), dst_c.execute_command("CLUSTER MYID")
        ids = []
        # ASK: the slot of a new key migrating from src to dst
        id = self.key_on("m")
        slot = self.vc.keyslot(self.ckey(id))
        dst_c.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
        src_c.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
        try:
            ids.append(id)
            self.assertEqual(self.go(id, {}).status, "applied")
        finally:
            # the slot's keys to dst, then the slot
            for k in src_c.execute_command("CLUSTER GETKEYSINSLOT", slot, 1000):
                src_c.execute_command("MIGRATE", dst.host, dst.port, k, 0, 5000, "REPLACE")
            for m in masters:
                self.node(m).execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
        # MOVED: the runner's map says src
        self.assertEqual(self.go(id, {}).status, "replayed")
        # a master stopped (SIGSTOP): its keys time out, PostgreSQL decides
        victim = self.vc.get_node_from_key(self.ckey(self.key_on("v")))
        pid = int(self.node(victim).info("server")["process_id"])
        id = self.key_on("v", victim)
        ids.append(id)
        os.kill(pid, signal.SIGSTOP)
        try:
            began = time.monotonic()
            run = self.go(id, {})
            took = time.monotonic() - began
        finally:
            os.kill(pid, signal.SIGCONT)
        print("# a run on a stopped master's slot: decided in %.2f s (valkey_timeout 0.2 s)" % took)
        self.assertEqual((run.status, run.valkey_used), ("applied", False))
        self.assertEqual(len([r for r in records if r.startswith("idem WARNING")]), 1, records)
        self.wait_cluster_ok()
        # after the rest, the map read again: that master's slots through Valkey again
        time.sleep(1.1)
        id = self.key_on("after", victim)
        ids.append(id)
        run = self.go(id, {})
        self.assertEqual((run.status, run.valkey_used), ("applied", True))
        with admin() as c:
            n = c.execute("SELECT count(*), count(DISTINCT id) FROM effects WHERE scope = %s",
                          [self.scope]).fetchone()
        self.assertEqual(n, (len(ids) + 1, len(ids) + 1))


if __name__ == "__main__":
    unittest.main()
