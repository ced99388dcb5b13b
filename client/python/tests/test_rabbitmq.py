"""Consumers on a real RabbitMQ, SIGKILLed mid-message: every effect once.

test/python/run.sh starts a throwaway broker (Debian's rabbitmq-server)
and sets IDEM_RABBITMQ_PORT."""
import os
import random
import signal
import subprocess
import sys
import threading
import time
import unittest

import pika
import psycopg

DSN = os.environ.get("IDEM_PG_DSN", "")
PORT = os.environ.get("IDEM_RABBITMQ_PORT")
HERE = os.path.dirname(os.path.abspath(__file__))


class RabbitMQ(unittest.TestCase):
    def test_sigkill_mid_message(self):
        """RabbitMQ, 3 consumers SIGKILLed mid-message (every 0.3 s, once consuming), 300 messages (60 published twice): every effect exactly once"""
        self.sigkill_mid_message("rmq-%d" % os.getpid(), {})

    def test_sigkill_first_deliveries(self):
        """RabbitMQ, the same with delivery_count 1 for deliveries not flagged redelivered (no gate; the 60 published twice are duplicates flagged 1): every effect exactly once"""
        self.sigkill_mid_message("rmq-first-%d" % os.getpid(), {"IDEM_RABBIT_DELIVERY_COUNT": "1"})

    def sigkill_mid_message(self, queue, extra_env):
        if not PORT:
            self.skipTest("no RabbitMQ (IDEM_RABBITMQ_PORT)")
        scope = queue
        mq = pika.BlockingConnection(pika.ConnectionParameters(host="127.0.0.1", port=int(PORT)))
        ch = mq.channel()
        ch.queue_declare(queue=queue, durable=True)
        ids = ["msg-%d" % i for i in range(300)]
        sends = ids + random.Random(5).sample(ids, 60)
        random.Random(6).shuffle(sends)
        for i in sends:
            ch.basic_publish("", queue, b'{"amount": %d, "to": "acct-7"}' % len(i),
                             pika.BasicProperties(message_id=i, delivery_mode=2))
        mq.close()

        env = dict(os.environ, IDEM_RABBITMQ_PORT=PORT, **extra_env)
        log = os.environ.get("IDEM_PG_LOG")
        log_from = os.path.getsize(log) if log else 0

        lines = []          # what every consumer printed

        class Consumer:
            def __init__(self):
                self.p = subprocess.Popen([sys.executable, os.path.join(HERE, "rabbit_consumer.py"),
                                           queue, scope], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True)
                self.ready_at = None
                self.reader = threading.Thread(target=self.read, daemon=True)
                self.reader.start()

            def read(self):
                for line in self.p.stdout:
                    lines.append(line)
                    if line.startswith("ready") and self.ready_at is None:
                        self.ready_at = time.time()

            def kill(self):
                self.p.send_signal(signal.SIGKILL)
                self.p.wait()
                self.reader.join(10)

        consumers = [Consumer() for _ in range(3)]
        kills = 0
        rnd = random.Random(7)

        def done():
            with psycopg.connect(DSN, autocommit=True) as c:
                n = c.execute("SELECT count(DISTINCT id) FROM effects WHERE scope = %s",
                              [scope]).fetchone()[0]
            if n < len(ids):
                return False
            probe = pika.BlockingConnection(pika.ConnectionParameters(host="127.0.0.1", port=int(PORT)))
            q = probe.channel().queue_declare(queue=queue, durable=True, passive=True)
            probe.close()
            return q.method.message_count == 0

        deadline = time.time() + 150
        try:
            while time.time() < deadline:
                time.sleep(0.3)
                # a victim that is consuming (it said "ready"; starting
                # Python, psycopg and pika takes seconds on a loaded
                # machine), so that kills land mid-message, where its
                # handler spends most of its time
                working = [i for i, c in enumerate(consumers)
                           if c.ready_at is not None and time.time() - c.ready_at > 0.2]
                if time.time() < deadline - 60 and kills < 40:
                    if not working:
                        continue
                    i = rnd.choice(working)
                    consumers[i].kill()
                    kills += 1
                    consumers[i] = Consumer()
                elif done():
                    break
        finally:
            for c in consumers:
                c.kill()
        self.assertTrue(done(), "not every message was consumed in time")
        self.assertNotIn("mismatch", "".join(lines))
        with psycopg.connect(DSN, autocommit=True) as c:
            rows = c.execute("SELECT id, count(*) FROM effects WHERE scope = %s GROUP BY id",
                             [scope]).fetchall()
            writers = c.execute("SELECT count(DISTINCT node) FROM effects WHERE scope = %s",
                                [scope]).fetchone()[0]
        self.assertEqual(sorted(r[0] for r in rows), sorted(ids))
        self.assertEqual([r for r in rows if r[1] != 1], [])
        self.assertGreaterEqual(kills, 10)
        if log:
            with open(log, "rb") as f:
                f.seek(log_from)
                mid = f.read().count(b"unexpected EOF on client connection with an open transaction")
            self.assertGreater(mid, 0, "no consumer was killed inside its transaction")
            print("# %d consumers killed, %d of them inside the run's transaction" % (kills, mid))
        self.assertGreater(writers, 3, "effects from consumers that were killed later")


if __name__ == "__main__":
    unittest.main()
