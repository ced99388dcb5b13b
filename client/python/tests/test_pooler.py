"""The runner behind a transaction pooler, with psycopg's defaults: Debian's
pgbouncer in transaction mode with 2 server connections for 5 clients
(test/python/run.sh starts it in front of the test server), so that each
transaction may land on another server connection than the last.  The
runner's own statements must not depend on the connection's prepare
settings (psycopg prepares a statement run 5 times, prepare_threshold's
default): a named statement prepared on one server connection is missing
on the next (26000) or meets another client's (42P05), and the run's
transaction is then cut in two."""
import asyncio
import os
import random
import threading
import time
import unittest

import psycopg

import idem
from idem.aio import AsyncRunner
import test_server
from test_server import VPORT, admin, effects, uid

BOUNCER_DSN = os.environ.get("IDEM_PGBOUNCER_DSN", "")
BOUNCER_LOG = os.environ.get("IDEM_PGBOUNCER_LOG", "")
PG_LOG = os.environ.get("IDEM_PG_LOG", "")

CLIENTS = 5             # the fifth's Valkey is down: idem_lookup first
KEYS = 60
FORMS = ("run", "call", "apply", "lease", "batch")


def setUpModule():
    if not BOUNCER_DSN:
        raise unittest.SkipTest("no pgbouncer (IDEM_PGBOUNCER_DSN)")
    test_server.setUpModule()
    with admin() as a:
        a.execute("""
            CREATE OR REPLACE FUNCTION pooled_effect(args jsonb) RETURNS jsonb LANGUAGE sql AS $$
                INSERT INTO effects (scope, id, node) VALUES (args->>'scope', args->>'id', 'sql')
                RETURNING jsonb_build_object('id', id) $$""")


def log_size(path):
    return os.path.getsize(path) if path and os.path.exists(path) else 0


def log_lines_since(path, offset, words):
    """The lines of the log written after offset that hold one of words."""
    if not path or not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        f.seek(offset)
        text = f.read().decode("utf-8", "replace")
    return [line for line in text.splitlines() if any(w in line for w in words)]


class TransactionPooler(unittest.TestCase):
    def test_runner_through_pgbouncer_with_psycopg_defaults(self):
        """through pgbouncer in transaction mode (2 server connections, 5 clients, one with Valkey down) with psycopg's default prepare_threshold: run, call, apply, lease and batch, each key's effect once, no error in PostgreSQL's or pgbouncer's log"""
        scope = uid("pooled")
        runner = idem.Runner(("127.0.0.1", VPORT), lease=10)
        down = idem.Runner(("127.0.0.1", test_server.free_port()), lease=10)
        pg_at, bouncer_at = log_size(PG_LOG), log_size(BOUNCER_LOG)
        lease_effects = {}
        lock = threading.Lock()
        errors = []
        counts = {"busy": 0, "replayed": 0}

        def deliver(runner, conn, form, ids):
            """One delivery of ids (one, or three for a batch); the ids not
            yet decided (busy): redelivered."""
            req = {"n": 1}
            if form == "run":
                i = ids[0]
                with runner.run(conn, 1, scope, i, req, first_sql=(
                        "INSERT INTO effects (scope, id, node) VALUES (%s, %s, 'run')"),
                        first_params=[scope, i]) as run:
                    if run.claimed:
                        run.outcome = {"id": i}
                runs = [run]
            elif form == "call":
                def handler(c, run):
                    # the block's own statement: unprepared, as behind any
                    # transaction pooler (the runner cannot choose for it)
                    c.execute("INSERT INTO effects (scope, id, node) VALUES (%s, %s, 'call')",
                              [scope, run.run_id], prepare=False)
                    return {"id": run.run_id}
                runs = [runner.call(conn, 1, scope, ids[0], req, handler)]
            elif form == "apply":
                runs = [runner.apply(conn, 1, scope, ids[0], req, "pooled_effect(jsonb)",
                                     args={"scope": scope, "id": ids[0]})]
            elif form == "lease":
                with runner.lease(conn, 1, scope, ids[0], req) as lease:
                    if lease.claimed:
                        with lock:          # the effect outside PostgreSQL
                            lease_effects[ids[0]] = lease_effects.get(ids[0], 0) + 1
                        lease.outcome = {"id": ids[0]}
                runs = [lease]
            else:
                with runner.batch(conn, [(1, scope, i, req) for i in ids]) as batch:
                    for run in batch.claimed:
                        conn.execute("INSERT INTO effects (scope, id, node) VALUES (%s, %s, 'b')",
                                     [scope, run.run_id], prepare=False)
                        run.outcome = {"id": run.run_id}
                runs = batch.runs
            left = []
            for run in runs:
                if run.status == idem.BUSY:
                    counts["busy"] += 1
                    left.append(run.run_id)
                elif run.status == idem.REPLAYED:
                    counts["replayed"] += 1
                elif run.status != idem.APPLIED:
                    raise AssertionError("%s: %s" % (run.run_id, run))
            return left

        def client(k, barrier):
            conn = psycopg.connect(BOUNCER_DSN, autocommit=k % 2 == 1)   # psycopg's defaults
            barrier.wait()
            rnd = random.Random(k)
            work = []
            for n in range(0, KEYS, 3):
                form = FORMS[(n // 3) % len(FORMS)]
                ids = ["%s-%d" % (form, n + j) for j in range(3)]
                work += [(form, ids)] if form == "batch" else [(form, [i]) for i in ids]
            rnd.shuffle(work)
            try:
                for form, ids in work:
                    for _ in range(200):
                        try:
                            ids = deliver(down if k == 4 else runner, conn, form, ids)
                        except Exception as e:      # noqa: BLE001 -- counted below
                            with lock:
                                errors.append("%s %s: %r" % (form, ids, e))
                            if conn.broken or conn.closed:
                                conn = psycopg.connect(BOUNCER_DSN, autocommit=k % 2 == 1)
                        if not ids:
                            break
                        time.sleep(0.01)
            finally:
                conn.close()

        barrier = threading.Barrier(CLIENTS)
        threads = [threading.Thread(target=client, args=(k, barrier)) for k in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(0.5)     # the servers' logs
        self.assertEqual(errors, [], "%d errors" % len(errors))
        with admin() as a:
            rows = dict(a.execute("SELECT id, count(*) FROM effects WHERE scope = %s GROUP BY id",
                                  [scope]).fetchall())
            statuses = a.execute(
                "SELECT k.status, count(*) FROM idempotency_keys k JOIN unnest(%s::text[]) i "
                "ON k.tenant_id = 1 AND k.idempotency_key = idem_key(%s, i) GROUP BY 1",
                [[form_id for form_id in rows] + list(lease_effects), scope]).fetchall()
        doubled = {i: c for i, c in list(rows.items()) + list(lease_effects.items()) if c != 1}
        self.assertEqual(doubled, {}, "effects done more than once")
        self.assertEqual(len(rows) + len(lease_effects), KEYS)
        self.assertEqual(dict(statuses), {"completed": KEYS})
        self.assertGreater(counts["replayed"], 0)   # each key was delivered by every client
        self.assertEqual(effects(scope), KEYS - len(lease_effects))
        pg_errors = log_lines_since(PG_LOG, pg_at, ("ERROR:", "FATAL:"))
        self.assertEqual(pg_errors, [], "PostgreSQL's log")
        bouncer_errors = log_lines_since(BOUNCER_LOG, bouncer_at, (" ERROR ", " WARNING "))
        self.assertEqual(bouncer_errors, [], "pgbouncer's log")

    def test_async_runner_through_pgbouncer(self):
        """the asyncio runner through the same pgbouncer with psycopg's defaults: 3 AsyncConnections deliver the same 30 keys (run, apply, batch), each effect once, no error in PostgreSQL's or pgbouncer's log"""
        scope = uid("apooled")
        pg_at, bouncer_at = log_size(PG_LOG), log_size(BOUNCER_LOG)

        async def client(runner, k):
            conn = await psycopg.AsyncConnection.connect(BOUNCER_DSN, autocommit=k == 1)
            try:
                for _ in range(2):
                    for n in range(0, 30, 3):
                        ids = ["%d" % (n + j) for j in range(3)]
                        for _ in range(200):
                            runs = []
                            if n % 9 == 0:
                                for i in ids:
                                    async with runner.run(conn, 1, scope, i, {}) as run:
                                        if run.claimed:
                                            await conn.execute(
                                                "INSERT INTO effects (scope, id) VALUES (%s, %s)",
                                                [scope, i], prepare=False)
                                    runs.append(run)
                            elif n % 9 == 3:
                                for i in ids:
                                    runs.append(await runner.apply(
                                        conn, 1, scope, i, {}, "pooled_effect(jsonb)",
                                        args={"scope": scope, "id": i}))
                            else:
                                async with runner.batch(conn, [(1, scope, i, {}) for i in ids]) as b:
                                    for run in b:
                                        await conn.execute(
                                            "INSERT INTO effects (scope, id) VALUES (%s, %s)",
                                            [scope, run.run_id], prepare=False)
                                runs = b.runs
                            ids = [r.run_id for r in runs if r.status == idem.BUSY]
                            if not ids:
                                break
                            await asyncio.sleep(0.01)
            finally:
                await conn.close()

        async def main():
            async with AsyncRunner(("127.0.0.1", VPORT), lease=10) as runner:
                await asyncio.gather(*(client(runner, k) for k in range(3)))
        asyncio.run(main())
        time.sleep(0.5)
        with admin() as a:
            counts = dict(a.execute("SELECT id, count(*) FROM effects WHERE scope = %s GROUP BY id",
                                    [scope]).fetchall())
        self.assertEqual(counts, {"%d" % i: 1 for i in range(30)})
        self.assertEqual(log_lines_since(PG_LOG, pg_at, ("ERROR:", "FATAL:")), [],
                         "PostgreSQL's log")
        self.assertEqual(log_lines_since(BOUNCER_LOG, bouncer_at, (" ERROR ", " WARNING ")), [],
                         "pgbouncer's log")
