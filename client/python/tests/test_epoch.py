"""A runner connected before the server's history epoch changed does not
replay from the old epoch (test/python/run.sh starts the servers).  Runs
last: removing ledger rows gives the whole server a new epoch."""
import time
import unittest

import psycopg

import idem
from test_server import (VPORT, admin, connect, ckey, effect, effects, keyspace,  # noqa: F401
                         setUpModule, uid, valkey, wait_copy)


def new_keyspace(old, timeout=30):
    """The keyspace once the worker has taken a new epoch over."""
    end = time.time() + timeout
    while time.time() < end:
        try:
            ks = keyspace()
            if ks != old:
                return ks
        except psycopg.errors.ObjectNotInPrerequisiteState:
            pass
        time.sleep(0.05)
    raise AssertionError("no new cache epoch after %d s" % timeout)


class EpochRetired(unittest.TestCase):
    def deliver(self, runner, conn, scope, id):
        with runner.run(conn, 1, scope, id, {"x": 1}) as run:
            if run.claimed:
                effect(conn, run)
        return run

    def test_runner_connected_before_rows_removed(self):
        """a runner that stays connected, learnt long ago (secrets_max_age 1 h), does not replay a deleted row from the old epoch"""
        scope, id = "py.epoch", uid("e")
        runner = idem.Runner(("127.0.0.1", VPORT), secrets_max_age=3600)
        conn = connect()
        try:
            run = self.deliver(runner, conn, scope, id)
            self.assertEqual(run.status, idem.APPLIED)
            wait_copy(ckey(1, scope, id))
            run = self.deliver(runner, conn, scope, id)
            self.assertEqual((run.status, run.source), (idem.REPLAYED, idem.SOURCE_VALKEY),
                             "before: the redelivery replays from Valkey")
            old = keyspace()
            owner = old[:old.rindex(".")] + ":owner"
            with admin() as c:
                c.execute("DELETE FROM idempotency_keys WHERE idempotency_key = idem_key(%s, %s)",
                          [scope, id])
            new_keyspace(old)
            self.assertTrue((valkey().get(owner) or b"").startswith(b"retired "),
                            "the old epoch's owner key is retired")
            run = self.deliver(runner, conn, scope, id)
            self.assertEqual((run.status, run.source), (idem.APPLIED, idem.SOURCE_HANDLER),
                             "the same connection applies the deleted row's message again")
            self.assertEqual(effects(scope, id), 2)
            self.assertGreaterEqual(runner.stats["owner_mismatches"], 1)
            # it has learnt the new epoch: the cache works again
            wait_copy(ckey(1, scope, id))
            run = self.deliver(runner, conn, scope, id)
            self.assertEqual((run.status, run.source), (idem.REPLAYED, idem.SOURCE_VALKEY),
                             "after learning the new epoch, replays come from Valkey again")
        finally:
            conn.close()


if __name__ == "__main__":
    unittest.main()
