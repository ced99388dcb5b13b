"""Two psycopg 3 clients through a transaction pooler: do their statements mix?

    pooled_clients.py CONNINFO [default]

Client "a" claims and completes its keys, client "b" claims and fails its
own (retryably), each in its own connection and thread, with statements of
the same parameter types (so that one client's prepared statement, run on
the other's behalf, would succeed silently).  The connections are made as
the README's "Connection poolers" says, psycopg.connect(conninfo,
prepare_threshold=None), unless "default" is given (psycopg's own default:
named prepared statements after five executions).  Then every key must
have ended as its own client asked: a's completed with a's outcome, b's
failed_retryable with b's detail.  Prints TAP lines; exit status 1 when a
key ended otherwise or a statement failed.
"""
import sys
import threading

import psycopg

CONNINFO = sys.argv[1]
USE_DEFAULT = len(sys.argv) > 2 and sys.argv[2] == "default"
N = 300
TENANT = 1
CLAIM = ("SELECT decision FROM idem_claim(%s, idem_key(%s, %s),"
         " idem_fingerprint(%s::jsonb))")
FINISH = {
    "a": "SELECT idem_complete(%s, idem_key(%s, %s), %s::jsonb)",
    "b": "SELECT idem_fail(%s, idem_key(%s, %s), %s::jsonb, true)",
}
errors = {"a": [], "b": []}


def connect():
    if USE_DEFAULT:
        return psycopg.connect(CONNINFO)
    return psycopg.connect(CONNINFO, prepare_threshold=None)


def client(who, barrier):
    scope = "pooled." + who
    conn = connect()
    barrier.wait()
    try:
        for i in range(N):
            body = '{"by": "%s", "i": %d}' % (who, i)
            try:
                with conn.transaction():
                    d = conn.execute(CLAIM, (TENANT, scope, str(i), body)).fetchone()[0]
                    if d != "claimed":
                        raise RuntimeError("claim of %s %d: %s" % (scope, i, d))
                    conn.execute(FINISH[who], (TENANT, scope, str(i), body))
            except Exception as e:  # noqa: BLE001 -- reported below
                errors[who].append("%d: %s" % (i, str(e).splitlines()[0]))
    finally:
        conn.close()


def main():
    barrier = threading.Barrier(2)
    threads = [threading.Thread(target=client, args=(w, barrier)) for w in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Read the ledger directly through the pooler, one plain query.
    with psycopg.connect(CONNINFO, prepare_threshold=None) as conn:
        rows = conn.execute(
            "SELECT s.scope, s.i, k.status, k.outcome->>'by'"
            "  FROM (SELECT w AS scope, i FROM unnest(ARRAY['pooled.a', 'pooled.b']) w,"
            "        generate_series(0, %s - 1) i) s"
            "  LEFT JOIN idempotency_keys k ON k.tenant_id = %s"
            "   AND k.idempotency_key = idem_key(s.scope, s.i::text)", (N, TENANT)).fetchall()
    want = {"pooled.a": ("completed", "a"), "pooled.b": ("failed_retryable", "b")}
    wrong = [r for r in rows if (r[2], r[3]) != want[r[0]]]
    rc = 0
    n = 0
    for who in "ab":
        n += 1
        if errors[who]:
            rc = 1
            print("not ok %d - client %s: %d of %d transactions failed (first: %s)"
                  % (n, who, len(errors[who]), N, errors[who][0]))
        else:
            print("ok %d - client %s: %d transactions, none failed" % (n, who, N))
    n += 1
    if wrong:
        rc = 1
        print("not ok %d - every key ended as its own client asked: %d of %d did not"
              " (first: %s %s is %s by %s)" % (n, len(wrong), len(rows), *wrong[0]))
    else:
        print("ok %d - every key ended as its own client asked (%d keys: a's completed"
              " by a, b's failed_retryable by b)" % (n, len(rows)))
    print("1..%d" % n)
    return rc


if __name__ == "__main__":
    sys.exit(main())
