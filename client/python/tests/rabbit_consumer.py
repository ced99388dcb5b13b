"""A RabbitMQ consumer for test_rabbitmq: each message's effect, one row in
effects, through the Python runner; acks only what the ledger decided.

    python3 rabbit_consumer.py QUEUE SCOPE

Environment: IDEM_PG_DSN, IDEM_VALKEY_PORT, IDEM_RABBITMQ_PORT; with
IDEM_RABBIT_DELIVERY_COUNT=1, a delivery RabbitMQ has not flagged
redelivered runs as a first delivery (delivery_count 1: no gate)."""
import os
import random
import sys
import time

import pika
import psycopg

import idem

queue, scope = sys.argv[1], sys.argv[2]
first_flag = os.environ.get("IDEM_RABBIT_DELIVERY_COUNT") == "1"
runner = idem.Runner(("127.0.0.1", int(os.environ["IDEM_VALKEY_PORT"])), lease=2)
conn = psycopg.connect(os.environ["IDEM_PG_DSN"])
mq = pika.BlockingConnection(pika.ConnectionParameters(
    host="127.0.0.1", port=int(os.environ["IDEM_RABBITMQ_PORT"])))
ch = mq.channel()
ch.basic_qos(prefetch_count=4)


def on_message(ch, method, props, body):
    global conn
    run_id = props.message_id
    try:
        with runner.run(conn, 1, scope, run_id, body,
                        delivery_count=1 if first_flag and not method.redelivered else 0) as run:
            if run.claimed:
                conn.execute("INSERT INTO effects (scope, id, node) VALUES (%s, %s, %s)",
                             [scope, run_id, "pid %d" % os.getpid()])
                time.sleep(random.uniform(0.02, 0.15))  # a handler takes a while: SIGKILL lands here
                run.outcome = {"by": os.getpid()}
    except idem.IdemError:
        if conn.broken or conn.closed:
            conn = psycopg.connect(os.environ["IDEM_PG_DSN"])
        ch.basic_nack(method.delivery_tag, requeue=True)
        return
    if run.status == idem.BUSY:
        time.sleep(min(run.retry_after, 0.1))
        ch.basic_nack(method.delivery_tag, requeue=True)
    elif run.status == idem.FAILED_RETRYABLE:
        ch.basic_nack(method.delivery_tag, requeue=True)
    else:                                   # applied, replayed, mismatch, failed_permanent
        if run.status == idem.MISMATCH:
            print("mismatch %s" % run_id, flush=True)
        ch.basic_ack(method.delivery_tag)


ch.basic_consume(queue=queue, on_message_callback=on_message)
print("ready", flush=True)
ch.start_consuming()
