#!/usr/bin/env python3
"""bench/outbox_bench.py: the parts of bench/outbox.sh that talk to
PostgreSQL and Valkey directly (psycopg 3 and redis-py).

  setup PG                      the schema: ob_plain / ob_emit / ob_hand and
                                the hand-written outbox table hand_outbox
  publisher PG VKPORT BATCH POLL_MS MODE [drain]
                                the hand-written polling publisher: SELECT
                                ... FOR UPDATE SKIP LOCKED LIMIT BATCH,
                                XADD each row (MODE pipe: one pipeline,
                                one: one round trip each), DELETE, COMMIT;
                                sleeps POLL_MS when it found nothing.  With
                                drain: stops when the table is empty and
                                prints '<messages> <seconds>' from its first
                                read to the empty table; with OB_READY set,
                                creates that file once connected
  idem-drain PG                 waits for idem's publisher to start on a
                                backlog, then prints '<messages> <seconds>'
                                from its first XADD (idem_stats().published
                                moves) to an empty outbox
  reader VKPORT STREAM SECONDS  reads STREAM from its end (XREAD BLOCK) until
                                a second passes without a message after the
                                first (or SECONDS without any), stamps each
                                arrival on this machine's clock, and prints
                                '<messages> <p50 ms> <p99 ms> <max ms> <dups>'
                                of arrival - the message's "at" (the
                                clock_timestamp() of the emit, just before
                                COMMIT)
"""
import os
import sys
import time

import psycopg
import redis

SETUP = r"""
CREATE TABLE IF NOT EXISTS ob_effects (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id bigint NOT NULL,
    amount bigint NOT NULL
);
-- The hand-written outbox, as teams write it: a table written in the
-- effect's transaction, drained by a polling publisher.
CREATE TABLE IF NOT EXISTS hand_outbox (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    stream text NOT NULL,
    message jsonb NOT NULL
);
"""

# The three runs differ in one statement only, after the effect: none, the
# idem_emit, or the INSERT into the hand-written outbox (the message stamped
# with the time, just before COMMIT).
RUN = r"""
CREATE OR REPLACE FUNCTION ob_%s(t bigint, run bigint, amt bigint) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
  k  bytea := idem_key('bench.outbox', run::text);
  c  idem_claim_result;
  tid bigint;
BEGIN
  c := idem_claim(t, k, idem_fingerprint(jsonb_build_object('amount', amt)));
  IF c.decision <> 'claimed' THEN RETURN c.decision; END IF;
  INSERT INTO ob_effects (tenant_id, amount) VALUES (t, amt) RETURNING id INTO tid;
  %s
  PERFORM idem_complete(t, k, jsonb_build_object('transfer_id', tid));
  RETURN 'applied';
END $$;
"""
MESSAGE = ("jsonb_build_object('transfer_id', tid, 'amount', amt,"
           " 'at', extract(epoch FROM clock_timestamp()))")
RUNS = {
    "plain": "",
    "emit": "PERFORM idem_emit('bench.idem', %s);" % MESSAGE,
    "hand": "INSERT INTO hand_outbox (stream, message) VALUES ('bench.hand', %s);" % MESSAGE,
}


def setup(pg):
    with psycopg.connect(pg, autocommit=True) as conn:
        conn.execute(SETUP)
        for name, extra in RUNS.items():
            conn.execute(RUN % (name, extra))


def publisher(pg, vkport, batch, poll_ms, mode, drain=False):
    vk = redis.Redis(host="127.0.0.1", port=int(vkport))
    batch = int(batch)
    poll = int(poll_ms) / 1000.0
    n = 0
    t0 = None
    with psycopg.connect(pg) as conn:
        cur = conn.cursor()
        vk.ping()
        if os.environ.get("OB_READY"):
            open(os.environ["OB_READY"], "w").close()
        while True:
            with conn.transaction():
                rows = cur.execute(
                    "SELECT id, stream, message::text FROM hand_outbox"
                    " ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED",
                    (batch,)).fetchall()
                if rows:
                    if t0 is None:
                        t0 = time.monotonic()
                    if mode == "pipe":
                        pipe = vk.pipeline(transaction=False)
                        for rid, stream, msg in rows:
                            pipe.xadd(stream, {"id": rid, "body": msg})
                        pipe.execute()
                    else:
                        for rid, stream, msg in rows:
                            vk.xadd(stream, {"id": rid, "body": msg})
                    cur.execute("DELETE FROM hand_outbox WHERE id = ANY(%s)",
                                ([r[0] for r in rows],))
                    n += len(rows)
            if not rows:
                if drain and t0 is not None:
                    print(n, time.monotonic() - t0)
                    return
                time.sleep(poll)


def idem_drain(pg):
    with psycopg.connect(pg, autocommit=True) as conn:
        def stats():
            return conn.execute(
                "SELECT published, outbox_waiting FROM idem_stats()").fetchone()
        p0, _ = stats()
        deadline = time.monotonic() + 120
        while True:
            p, w = stats()
            if p > p0 or time.monotonic() > deadline:
                break
            time.sleep(0.001)
        t0 = time.monotonic()
        pfirst = p
        while w > 0 and time.monotonic() < deadline:
            time.sleep(0.002)
            p, w = stats()
        print(p - pfirst, time.monotonic() - t0)


def reader(vkport, stream, seconds):
    import json
    vk = redis.Redis(host="127.0.0.1", port=int(vkport))
    last = "$"
    lags = []
    seen = set()
    dups = 0
    start = time.time()
    while True:
        got = vk.xread({stream: last}, count=1000, block=1000)
        now = time.time()
        if not got:
            # one second without a message after the first: the load ended
            if seen or now - start > float(seconds):
                break
            continue
        for _, entries in got:
            for eid, fields in entries:
                last = eid
                mid = fields[b"id"]
                if mid in seen:
                    dups += 1
                    continue
                seen.add(mid)
                lags.append((now - json.loads(fields[b"body"])["at"]) * 1000.0)
    lags.sort()
    if not lags:
        print("0 0 0 0", dups)
        return

    def pct(p):
        return lags[min(len(lags) - 1, int(p * len(lags)))]
    print(len(lags), "%.2f %.2f %.2f" % (pct(0.50), pct(0.99), lags[-1]), dups)


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "setup":
        setup(sys.argv[2])
    elif cmd == "publisher":
        publisher(*sys.argv[2:7], drain=len(sys.argv) > 7 and sys.argv[7] == "drain")
    elif cmd == "idem-drain":
        idem_drain(sys.argv[2])
    elif cmd == "reader":
        reader(*sys.argv[2:5])
    else:
        sys.exit("outbox_bench.py: unknown command " + cmd)
