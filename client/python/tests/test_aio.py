"""idem.aio.AsyncRunner against the real servers (test/python/run.sh starts
them): psycopg.AsyncConnection and redis.asyncio, every form, the same
protocol as the synchronous runner (each replays what the other
applied, from Valkey), and an asyncio consumer of redelivered messages
with every effect exactly once."""
import asyncio
import os
import random
import subprocess
import sys
import unittest

import psycopg

import idem
from idem import cache
from idem.aio import AsyncRunner
import test_server
from test_forms import ledger
from test_server import DSN, VPORT, ckey, connect, effects, secrets, uid, valkey, wait_copy


def setUpModule():
    test_server.setUpModule()
    with test_server.admin() as a:
        a.execute("""
            CREATE OR REPLACE FUNCTION aio_charge(args jsonb) RETURNS jsonb LANGUAGE sql AS $$
                INSERT INTO effects (scope, id, node) VALUES (args->>'scope', args->>'id', 'sql')
                RETURNING jsonb_build_object('charged', args->'amount') $$""")


async def aconnect(**kw):
    return await psycopg.AsyncConnection.connect(DSN, **kw)


async def aeffect(conn, run, node="aio"):
    await conn.execute("INSERT INTO effects (scope, id, node) VALUES (%s, %s, %s)",
                       [run.scope, run.run_id, node], prepare=False)
    run.outcome = {"done": run.run_id, "attempt": run.attempt}


class AsyncForms(unittest.TestCase):
    def test_every_form(self):
        """AsyncRunner: run (applied, replayed from Valkey, busy, mismatch), call, the decorator (a missing id refused), apply, lease with a deferred completion, batch with steps, cached; each effect once"""
        scope = uid("aio")

        async def main():
            runner = AsyncRunner(("127.0.0.1", VPORT), lease=5)
            conn = await aconnect()
            other = await aconnect(autocommit=True)
            try:
                async with runner.run(conn, 1, scope, "r1", {"a": 1}) as run:
                    self.assertEqual((run.claimed, run.attempt), (True, 1))
                    # meanwhile another delivery is busy (the gate's marker)
                    async with runner.run(other, 1, scope, "r1", {"a": 1}) as dup:
                        self.assertFalse(dup.claimed)
                    self.assertEqual(dup.status, "busy")
                    self.assertTrue(0 < dup.retry_after <= 5)
                    await aeffect(conn, run)
                self.assertEqual((run.status, run.source), ("applied", "handler"))
                await asyncio.get_running_loop().run_in_executor(
                    None, wait_copy, ckey(1, scope, "r1"))
                async with runner.run(other, 1, scope, "r1", {"a": 1}) as run:
                    pass
                self.assertEqual((run.status, run.source, run.outcome),
                                 ("replayed", "valkey", {"done": "r1", "attempt": 1}))
                async with runner.run(conn, 1, scope, "r1", {"a": 2}) as run:
                    pass
                self.assertEqual(run.status, "mismatch")
                self.assertEqual((await runner.cached(conn, 1, scope, "r1", {"a": 1})).status,
                                 "replayed")

                async def handler(c, r):
                    await aeffect(c, r)
                    return {"by": "call"}
                run = await runner.call(conn, None, scope, "c1", {}, handler)
                self.assertEqual((run.status, run.outcome), ("applied", {"by": "call"}))

                @runner.idempotent(scope, run_id="msg_id", request="body", tenant=1)
                async def charge(c, msg_id, body):
                    await c.execute("INSERT INTO effects (scope, id) VALUES (%s, %s)",
                                    [scope, str(msg_id)])
                    return {"charged": body["amount"]}
                self.assertEqual(await charge(conn, 7, {"amount": 3}), {"charged": 3})
                self.assertEqual(await charge(conn, "7", {"amount": 3}), {"charged": 3})
                with self.assertRaises(idem.Mismatch):
                    await charge(conn, 7, {"amount": 4})
                with self.assertRaises(idem.IdemError) as cm:
                    await charge(conn, None, {"amount": 3})
                self.assertEqual(cm.exception.code, "argument")

                run = await runner.apply(conn, 1, scope, "a1", {}, "aio_charge(jsonb)",
                                         args={"scope": scope, "id": "a1", "amount": 5})
                self.assertEqual((run.status, run.outcome), ("applied", {"charged": 5}))
                run = await runner.apply(other, 1, scope, "a1", {}, "aio_charge(jsonb)")
                self.assertEqual(run.status, "replayed")

                async with runner.lease(conn, 1, scope, "l1", {}, lease=10) as lease:
                    self.assertEqual((lease.claimed, lease.duration), (True, 10.0))
                    lease.defer()
                self.assertEqual(ledger(1, scope, "l1")[:2], ("processing", 1))
                await runner.complete(other, 1, scope, "l1", {"sent": True}, fence=lease.fence)
                self.assertEqual(ledger(1, scope, "l1")[:2], ("completed", 1))
                async with runner.lease(conn, 1, scope, "l2", {}) as lease:
                    lease.outcome = {"sent": 2}
                self.assertEqual(lease.status, "applied")

                items = [(1, scope, "b%d" % i, {"i": i}) for i in range(3)] + \
                    [(1, scope, "r1", {"a": 1})]
                async with runner.batch(conn, items) as batch:
                    for run in batch.claimed:
                        async with batch.step(run):
                            if run.run_id == "b1":
                                raise idem.PermanentFailure({"reason": "no"})
                            await aeffect(conn, run)
                self.assertEqual([r.status for r in batch.runs],
                                 ["applied", "failed_permanent", "applied", "replayed"])
                # the synchronous runner refuses an AsyncConnection, and this one a Connection
                with self.assertRaises(idem.IdemError):
                    idem.Runner(None).run(conn, 1, scope, "x", {})
                sync_conn = connect()
                try:
                    with self.assertRaises(idem.IdemError):
                        runner.run(sync_conn, 1, scope, "x", {})
                finally:
                    sync_conn.close()
            finally:
                await conn.close()
                await other.close()
                await runner.aclose()
        asyncio.run(main())
        for id, want in (("r1", 1), ("c1", 1), ("7", 1), ("a1", 1), ("b0", 1), ("b1", 0),
                         ("b2", 1)):
            self.assertEqual(effects(scope, id), want, id)

    def test_close(self):
        """async with AsyncRunner((host, port)) closes the Valkey connections it made when the block ends, in their event loop (left open, redis.asyncio closed them when collected, after their loop had ended: "Event loop is closed" on stderr); a client given stays the caller's; with idem.Runner(...) closes the synchronous runner's"""
        import gc
        import redis.asyncio
        scope = uid("aio-close")

        def connected(client):
            pool = client.connection_pool
            return [c for c in list(pool._available_connections) + list(pool._in_use_connections)
                    if c.is_connected]

        async def main():
            given = redis.asyncio.Redis(host="127.0.0.1", port=VPORT)
            conn = await aconnect()
            try:
                async with AsyncRunner(("127.0.0.1", VPORT), lease=5) as runner:
                    async with runner.run(conn, 1, scope, "r1", {}) as run:
                        await aeffect(conn, run)
                    made = runner.valkey
                    self.assertNotEqual(connected(made), [])
                async with AsyncRunner(given, lease=5) as runner:
                    async with runner.run(conn, 1, scope, "r2", {}) as run:
                        await aeffect(conn, run)
                self.assertEqual(connected(made), [])
                self.assertNotEqual(connected(given), [])
                with self.assertRaises(idem.IdemError):
                    runner.close()              # awaited: aclose()
            finally:
                await conn.close()
                await given.close()

        async def collect():
            told = []
            asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: told.append(ctx))
            gc.collect()
            for _ in range(5):
                await asyncio.sleep(0.01)
            gc.collect()
            return [ctx.get("message") for ctx in told]
        asyncio.run(main())
        self.assertEqual(asyncio.run(collect()), [])
        self.assertEqual((effects(scope, "r1"), effects(scope, "r2")), (1, 1))
        with idem.Runner(("127.0.0.1", VPORT), lease=5) as runner:
            sc = connect()
            try:
                for _ in range(2):      # applied, then replayed through its own connection
                    with runner.run(sc, 1, scope, "s1", {}) as run:
                        if run.claimed:
                            test_server.effect(sc, run)
                    wait_copy(ckey(1, scope, "s1"))
            finally:
                sc.close()
            self.assertEqual((run.status, run.source), ("replayed", "valkey"))
            self.assertTrue(runner._direct.idle)
            direct = runner._direct
        self.assertEqual((direct.idle, runner._direct), ([], None))
        self.assertEqual([c for c in runner.valkey.connection_pool._available_connections
                          if c._sock is not None], [])

    def test_same_protocol_as_the_sync_runner(self):
        """the same protocol: the async runner's marker verifies with the server's secret; each runner replays from Valkey what the other applied"""
        scope = uid("aio-proto")
        sync_runner = idem.Runner(("127.0.0.1", VPORT), lease=5)

        async def main():
            runner = AsyncRunner(("127.0.0.1", VPORT), lease=5)
            conn = await aconnect()
            try:
                async with runner.run(conn, 1, scope, "p1", {"x": 1}) as run:
                    key = ckey(1, scope, "p1")
                    value = valkey().get(key)
                    e = cache.parse(value)
                    self.assertEqual(e.kind, cache.MARKER)
                    self.assertTrue(cache.verify(secrets()[0], key, value, e))
                    await aeffect(conn, run)
                await asyncio.get_running_loop().run_in_executor(None, wait_copy, key)
                sc = connect()
                try:
                    with sync_runner.run(sc, 1, scope, "p1", {"x": 1}) as srun:
                        pass
                    self.assertEqual((srun.status, srun.source), ("replayed", "valkey"))
                    with sync_runner.run(sc, 1, scope, "p2", {"x": 2}) as srun:
                        test_server.effect(sc, srun)
                finally:
                    sc.close()
                await asyncio.get_running_loop().run_in_executor(
                    None, wait_copy, ckey(1, scope, "p2"))
                async with runner.run(conn, 1, scope, "p2", {"x": 2}) as run:
                    pass
                self.assertEqual((run.status, run.source), ("replayed", "valkey"))
            finally:
                await conn.close()
                await runner.aclose()
        asyncio.run(main())
        sync_runner.close()

    def test_unstorable_outcome(self):
        """async: an outcome over 4096 bytes fails the attempt retryably (54000), its effect rolled back; max_attempts=2 ends it as failed_permanent; a non-object fails permanently (22023); a deferred lease completed with one is recorded the same way"""
        scope = uid("aio-big")

        async def main():
            runner = AsyncRunner(("127.0.0.1", VPORT), lease=5, max_attempts=2)
            conn = await aconnect()
            got = []
            try:
                for _ in range(3):
                    async with runner.run(conn, 1, scope, "b1", {}) as run:
                        if run.claimed:
                            await aeffect(conn, run)
                            run.outcome = {"blob": "x" * 5000}
                    got.append((run.status, run.attempt, run.outcome["sqlstate"]))
                async with runner.run(conn, 1, scope, "b2", {}) as run:
                    await aeffect(conn, run)
                    run.outcome = [1]
                got.append((run.status, run.attempt, run.outcome["sqlstate"]))
                async with runner.lease(conn, 1, scope, "d1", {}) as lease:
                    lease.defer()
                status = await runner.complete(conn, 1, scope, "d1", {"blob": "x" * 5000},
                                               fence=lease.fence)
                await conn.commit()     # in the connection's transaction: the caller commits
                got.append((status, lease.attempt, ledger(1, scope, "d1")[2]["sqlstate"]))
            finally:
                await conn.close()
                await runner.aclose()
            return got
        self.assertEqual(asyncio.run(main()),
                         [("failed_retryable", 1, "54000"), ("failed_retryable", 2, "54000"),
                          ("failed_permanent", 2, "54000"), ("failed_permanent", 1, "22023"),
                          ("failed_retryable", 1, "54000")])
        self.assertEqual(effects(scope), 0)
        self.assertEqual(ledger(1, scope, "b1")[0], "failed_permanent")

    def test_server_state_and_valkey_down(self):
        """async: a serialization failure in the block is raised and not recorded, its marker deleted (EVALSHA); with Valkey down PostgreSQL decides (applied, then replayed)"""
        scope = uid("aio-state")

        async def main():
            runner = AsyncRunner(("127.0.0.1", VPORT), lease=5)
            down = AsyncRunner(("127.0.0.1", test_server.free_port()), lease=5)
            conn = await aconnect()
            await conn.execute("SET default_transaction_isolation = 'repeatable read'")
            await conn.commit()
            try:
                with self.assertRaises(psycopg.errors.SerializationFailure):
                    async with runner.run(conn, 1, scope, "s1", {}) as run:
                        await aeffect(conn, run)
                        with test_server.admin() as a:
                            a.execute("UPDATE contended SET v = v + 1 WHERE id = 1")
                        await conn.execute("UPDATE contended SET v = v + 1 WHERE id = 1")
                self.assertIsNone(ledger(1, scope, "s1"))
                self.assertIsNone(valkey().get(ckey(1, scope, "s1")))   # our marker deleted
                for want in ("applied", "replayed"):
                    async with down.run(conn, 1, scope, "s1", {}) as run:
                        if run.claimed:
                            await aeffect(conn, run)
                    self.assertEqual((run.status, run.valkey_used), (want, False))
            finally:
                await conn.close()
                await runner.aclose()
                await down.aclose()
        with test_server.admin() as a:
            a.execute("CREATE TABLE IF NOT EXISTS contended (id int PRIMARY KEY, v int NOT NULL)")
            a.execute("INSERT INTO contended VALUES (1, 0), (2, 0) ON CONFLICT DO NOTHING")
        asyncio.run(main())
        self.assertEqual(effects(scope, "s1"), 1)


    def test_cancels(self):
        """async: an operator's cancel (pg_cancel_backend) in the block is raised and not recorded; statement_timeout's cancel is an attempt, recorded failed_retryable, and max_attempts=2 ends it"""
        scope = uid("aio-cancel")

        async def main():
            runner = AsyncRunner(("127.0.0.1", VPORT), lease=5, max_attempts=2)
            conn = await aconnect()
            got = []
            try:
                with self.assertRaises(psycopg.errors.QueryCanceled):
                    async with runner.run(conn, 1, scope, "c1", {}) as run:
                        await aeffect(conn, run)
                        await conn.execute("SELECT pg_cancel_backend(pg_backend_pid()), "
                                           "pg_sleep(2)")
                got.append(ledger(1, scope, "c1"))
                for _ in range(3):
                    try:
                        async with runner.run(conn, 1, scope, "t1", {}) as run:
                            if run.claimed:
                                await aeffect(conn, run)
                                await conn.execute("SET LOCAL statement_timeout = '50ms'")
                                await conn.execute("SELECT pg_sleep(2)")
                    except psycopg.errors.QueryCanceled:
                        pass
                    got.append(ledger(1, scope, "t1")[:2])
            finally:
                await conn.close()
                await runner.aclose()
            return got
        self.assertEqual(asyncio.run(main()),
                         [None, ("failed_retryable", 1), ("failed_retryable", 2),
                          ("failed_permanent", 2)])
        self.assertEqual(effects(scope), 0)


class AsyncConsumer(unittest.TestCase):
    def test_asyncio_consumer_exactly_once(self):
        """an asyncio consumer: 4 tasks, each with its own AsyncConnection, take 60 messages (20 published twice) from an asyncio.Queue and requeue busy ones after their retry_after: every effect exactly once"""
        scope = uid("aio-consumer")

        async def main():
            runner = AsyncRunner(("127.0.0.1", VPORT), lease=5)
            queue = asyncio.Queue()
            ids = ["m%d" % i for i in range(40)]
            twice = set(random.Random(7).sample(ids, 20))
            # a duplicate right behind its original: two tasks take them at once
            messages = [m for i in ids for m in ([i, i] if i in twice else [i])]
            for m in messages:
                queue.put_nowait((m, 1))
            statuses = []

            async def consumer(k):
                conn = await aconnect(autocommit=k % 2 == 0)
                try:
                    while True:
                        try:
                            msg, count = queue.get_nowait()
                        except asyncio.QueueEmpty:
                            return
                        async with runner.run(conn, 1, scope, msg, {"m": msg},
                                              delivery_count=count) as run:
                            if run.claimed:
                                await aeffect(conn, run)
                                await asyncio.sleep(0.02)
                        statuses.append(run.status)
                        if run.status == "busy":
                            await asyncio.sleep(min(run.retry_after, 0.05))
                            queue.put_nowait((msg, count + 1))     # redelivered
                finally:
                    await conn.close()
            await asyncio.gather(*(consumer(k) for k in range(4)))
            await runner.aclose()
            return ids, statuses
        ids, statuses = asyncio.run(main())
        for m in ids:
            self.assertEqual(effects(scope, m), 1, m)
        self.assertEqual(statuses.count("applied"), len(ids))
        self.assertEqual(len(statuses), 60 + statuses.count("busy"))
        print("# asyncio consumer: %d deliveries, %d busy, %d replayed"
              % (len(statuses), statuses.count("busy"), statuses.count("replayed")))


class AioPika(unittest.TestCase):
    def test_aio_pika_consumers(self):
        """RabbitMQ and aio-pika: 3 asyncio consumers take 120 messages (30 published twice), ack what the ledger decided and requeue busy ones: every effect exactly once"""
        port = os.environ.get("IDEM_RABBITMQ_PORT")
        try:
            import aio_pika
        except ImportError:
            self.skipTest("no aio-pika (python3-aio-pika)")
        if not port:
            self.skipTest("no RabbitMQ (IDEM_RABBITMQ_PORT)")
        queue = scope = uid("aio-pika")
        ids = ["p%d" % i for i in range(120)]
        sends = ids + random.Random(11).sample(ids, 30)
        random.Random(12).shuffle(sends)
        url = "amqp://guest:guest@127.0.0.1:%s/" % port

        async def main():
            mq = await aio_pika.connect(url)
            ch = await mq.channel()
            await ch.declare_queue(queue, durable=True)
            for i in sends:
                await ch.default_exchange.publish(
                    aio_pika.Message(b'{"amount": 1}', message_id=i), routing_key=queue)
            await mq.close()
            runner = AsyncRunner(("127.0.0.1", VPORT), lease=5)
            acked = []

            async def consumer(k):
                mq = await aio_pika.connect(url)
                conn = await aconnect(autocommit=k == 0)
                try:
                    ch = await mq.channel()
                    q = await ch.declare_queue(queue, durable=True)
                    while len(acked) < len(sends):
                        msg = await q.get(no_ack=False, fail=False)
                        if msg is None:
                            await asyncio.sleep(0.02)
                            continue
                        async with runner.run(conn, 1, scope, msg.message_id, msg.body,
                                              delivery_count=0 if msg.redelivered else 1) as run:
                            if run.claimed:
                                await aeffect(conn, run)
                        if run.status == "busy":
                            await asyncio.sleep(min(run.retry_after, 0.05))
                            await msg.nack(requeue=True)
                        else:
                            await msg.ack()
                            acked.append(run.status)
                finally:
                    await conn.close()
                    await mq.close()
            try:
                await asyncio.wait_for(asyncio.gather(*(consumer(k) for k in range(3))), 120)
            finally:
                await runner.aclose()
            return acked
        acked = asyncio.run(main())
        self.assertEqual(sorted(set(acked)), ["applied", "replayed"])
        self.assertEqual(acked.count("applied"), len(ids))
        for i in ids:
            self.assertEqual(effects(scope, i), 1, i)


class Readme(unittest.TestCase):
    def test_readme_asyncio_example(self):
        """the package README's asyncio example runs as written"""
        path = os.environ.get("IDEM_PACKAGE_README")
        if not path or not os.path.exists(path):
            self.skipTest("no README")
        blocks = [b.split("```", 1)[0] for b in open(path).read().split("```python\n")[1:]]
        code = [b for b in blocks if "from idem.aio import AsyncRunner" in b][0]
        with test_server.admin() as a:
            a.execute("CREATE TABLE IF NOT EXISTS payments (run_id text, amount numeric)")
        env = dict(os.environ, IDEM_DSN=DSN, VALKEY_PORT=str(VPORT))
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=60)
        self.assertEqual((p.returncode, p.stderr), (0, ""), p.stdout)
        self.assertEqual([line.split()[0] for line in p.stdout.splitlines()],
                         ["applied", "replayed"])


if __name__ == "__main__":
    unittest.main()
