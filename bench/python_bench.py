"""bench/python.sh's client: one mode, N client processes, S seconds; prints
"MODE CLIENTS OPS_PER_S" and "cpu MODE CLIENTS US_PER_OP" (the clients'
own user + system CPU per operation).

    python3 python_bench.py fill DSN VALKEY_PORT
    python3 python_bench.py MODE CLIENTS SECONDS DSN VALKEY_PORT

Modes (the replay modes read the keys "fill" completed, tenant 1):
  valkey-replay   the runner (runner.run), answered by Valkey
  raw-get         redis-py GET of the same keys' values
  pg-replay       the runner with Valkey configured but down: idem_lookup
  pg-select       psycopg, a prepared SELECT of the same ledger rows
  run-new         the runner on new keys, the effect one transfers row
  run-new-first   the same flagged as first deliveries (delivery_count 1)
  apply-new       the runner with the effect as a SQL handler (runner.apply)
  hand-new        the same handler written by hand with psycopg on the seed's
                  table (hand_keys): INSERT ... ON CONFLICT DO NOTHING, the
                  effect, UPDATE, in one transaction
"""
import multiprocessing
import os
import socket
import sys
import time

import psycopg
import redis

import idem
from idem import cache

SCOPE = "bench.python"
NKEYS = 1000


def replay_id(i):
    return "replay-%d" % i


def fill(dsn, vport):
    runner = idem.Runner(("127.0.0.1", vport))
    conn = psycopg.connect(dsn)
    conn.execute("""CREATE OR REPLACE FUNCTION py_transfer(args jsonb) RETURNS jsonb
        LANGUAGE plpgsql AS $$
        DECLARE tid bigint;
        BEGIN
          INSERT INTO transfers (tenant_id, amount)
          VALUES ((args->>'tenant')::bigint, (args->>'amount')::bigint) RETURNING id INTO tid;
          RETURN jsonb_build_object('transfer_id', tid);
        END $$""")
    conn.commit()
    for i in range(NKEYS):
        with runner.run(conn, 1, SCOPE, replay_id(i), {"amount": i}) as run:
            if run.claimed:
                effect(conn, 1, i)
                run.outcome = {"n": i}
    # until the worker's copies are all in Valkey
    v = redis.Redis(port=vport)
    ks = conn.execute("SELECT idem_cache_keyspace()").fetchone()[0]
    conn.commit()
    keys = [cache.cache_key(ks, 1, idem.idem_key(SCOPE, replay_id(i))) for i in range(NKEYS)]
    end = time.time() + 60
    while time.time() < end:
        vals = v.mget(keys)
        if all(x is not None and cache.parse(x) is not None and cache.parse(x).kind == "c"
               for x in vals):
            return 0
        time.sleep(0.2)
    print("the worker's copies did not all arrive", file=sys.stderr)
    return 1


def effect(conn, tenant, amount):
    return conn.execute("INSERT INTO transfers (tenant_id, amount) VALUES (%s, %s) RETURNING id",
                        [tenant, amount]).fetchone()[0]


def dead_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def setup(mode, dsn, vport):
    """What one client process holds: returns op(i)."""
    conn = psycopg.connect(dsn, autocommit=True)
    if mode in ("valkey-replay", "run-new", "run-new-first", "apply-new"):
        runner = idem.Runner(("127.0.0.1", vport))
    elif mode == "pg-replay":
        runner = idem.Runner(("127.0.0.1", dead_port()), valkey_timeout=0.2)
    tag = "%d-%d" % (os.getpid(), int(time.time() * 1000))

    if mode in ("valkey-replay", "pg-replay"):
        want = idem.SOURCE_VALKEY if mode == "valkey-replay" else idem.SOURCE_POSTGRES

        def op(i):
            n = i % NKEYS
            with runner.run(conn, 1, SCOPE, replay_id(n), {"amount": n}) as run:
                pass
            if run.source != want or run.status != idem.REPLAYED:
                raise SystemExit("%s: a %s from %s" % (mode, run.status, run.source))
        return op
    if mode == "raw-get":
        v = redis.Redis(port=vport)
        ks = conn.execute("SELECT idem_cache_keyspace()").fetchone()[0]
        keys = [cache.cache_key(ks, 1, idem.idem_key(SCOPE, replay_id(n))) for n in range(NKEYS)]

        def op(i):
            if v.get(keys[i % NKEYS]) is None:
                raise SystemExit("raw-get: no value")
        return op
    if mode == "pg-select":
        def op(i):
            n = i % NKEYS
            row = conn.execute("SELECT status, outcome FROM idempotency_keys "
                               "WHERE tenant_id = %s AND idempotency_key = %s",
                               [1, idem.idem_key(SCOPE, replay_id(n))], prepare=True).fetchone()
            if row is None:
                raise SystemExit("pg-select: no row")
        return op
    if mode in ("run-new", "run-new-first"):
        first = 1 if mode == "run-new-first" else 0

        def op(i):
            t = 1 + i % 100
            with runner.run(conn, t, SCOPE, "new-%s-%d" % (tag, i), {"amount": i},
                            delivery_count=first) as run:
                if run.claimed:
                    run.outcome = {"transfer_id": effect(conn, t, i)}
            if run.status != idem.APPLIED:
                raise SystemExit("%s: %s" % (mode, run.status))
        return op
    if mode == "apply-new":
        def op(i):
            t = 1 + i % 100
            run = runner.apply(conn, t, SCOPE, "apply-%s-%d" % (tag, i), {"amount": i},
                               "py_transfer(jsonb)", args={"tenant": t, "amount": i})
            if run.status != idem.APPLIED:
                raise SystemExit("apply-new: %s" % run.status)
        return op
    if mode == "hand-new":
        # What a user writes without idem, with psycopg, on the seed's table:
        # the key and fingerprint hashed as idem hashes them (in Python).
        def op(i):
            t = 1 + i % 100
            key = idem.idem_key(SCOPE, "hand-%s-%d" % (tag, i))
            fp = idem.fingerprint({"amount": i})
            with conn.transaction():
                cur = conn.execute(
                    "INSERT INTO hand_keys (tenant_id, idempotency_key, request_fingerprint, expires_at) "
                    "VALUES (%s, %s, %s, now() + interval '30 seconds') "
                    "ON CONFLICT (tenant_id, idempotency_key) DO NOTHING", [t, key, fp], prepare=True)
                if cur.rowcount == 0:
                    row = conn.execute("SELECT status, outcome, request_fingerprint FROM hand_keys "
                                       "WHERE tenant_id = %s AND idempotency_key = %s",
                                       [t, key], prepare=True).fetchone()
                    raise SystemExit("hand-new: a duplicate %r" % (row[0],))
                tid = effect(conn, t, i)
                conn.execute("UPDATE hand_keys SET status = 'completed', "
                             "outcome = jsonb_build_object('transfer_id', %s::bigint), "
                             "expires_at = now() + interval '1 day', updated_at = clock_timestamp() "
                             "WHERE tenant_id = %s AND idempotency_key = %s", [tid, t, key],
                             prepare=True)
        return op
    raise SystemExit("unknown mode %s" % mode)


def client(mode, dsn, vport, seconds, start, out):
    op = setup(mode, dsn, vport)
    op(0)                                   # warm: connections, learning
    start.wait()
    t0 = os.times()
    end = time.monotonic() + seconds
    n = 1
    while time.monotonic() < end:
        op(n)
        n += 1
    t1 = os.times()
    out.put((n - 1, (t1.user - t0.user) + (t1.system - t0.system)))


def main(argv):
    if argv[0] == "fill":
        return fill(argv[1], int(argv[2]))
    mode, clients, seconds, dsn, vport = argv[0], int(argv[1]), float(argv[2]), argv[3], int(argv[4])
    ctx = multiprocessing.get_context("fork")
    start = ctx.Barrier(clients + 1, timeout=120)
    out = ctx.Queue()
    procs = [ctx.Process(target=client, args=(mode, dsn, vport, seconds, start, out))
             for _ in range(clients)]
    for p in procs:
        p.start()
    start.wait()
    results = [out.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        return 1
    ops = sum(r[0] for r in results)
    cpu = sum(r[1] for r in results)
    print("%s %d %.0f" % (mode, clients, ops / seconds))
    print("cpu %s %d %.1f" % (mode, clients, 1e6 * cpu / max(ops, 1)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
