"""One run in the runner's transaction (Runner.run, call and the
decorator): the Valkey gate and its marker (step 2), the autocommit
lookup (3a), the claim (3b), the block, and the completion or failure
committed with the effect.  apply.py and lease.py subclass it for their
own step 3b; the Runner (runner.py) hands it its Valkey client and the
session's state."""
import json
import os

import psycopg
from psycopg.pq import TransactionStatus

from . import cache
from .errors import CommitUnknown, IdemError, ValkeyClusterNotSupported
from .pg import _raise_pg_error, _session_ended
from .result import (APPLIED, BUSY, FAILED_PERMANENT, FAILED_RETRYABLE, MISMATCH,
                     REPLAYED, SOURCE_HANDLER, SOURCE_POSTGRES, SOURCE_VALKEY, Run,
                     _failure_of, _make_run, _outcome_text, _result_from_cache)
from .trust import _wall_ms

# How long another run's marker answers its duplicates "busy" from Valkey
# alone; after that the claim decides (a dead runner's marker).
MARKER_CHEAP_MS = 1000


class _RunContext:
    run_class = Run

    def __init__(self, runner, conn, tenant_id, scope, run_id, request, *,
                 delivery_count=0, first_sql=None, first_params=None):
        self.r = runner
        self.conn = conn
        if delivery_count is None or int(delivery_count) < 0:
            raise IdemError("argument", "delivery_count must be 0 (unknown) or positive")
        self.delivery_count = int(delivery_count)
        if first_sql is not None and (not isinstance(first_sql, str) or not first_sql.strip()):
            raise IdemError("argument", "first_sql must be a non-empty statement")
        self.first_sql = first_sql
        self.first_params = first_params
        self.run = _make_run(self.run_class, tenant_id, scope, run_id, request)
        self.ckey = None
        self.marker = None
        self.own_marker = False
        self.tx_open = False
        self.st = None

    # -- SQL --
    def _sql(self, name):
        s = self.st.schema
        plat = self.run.tenant_id is None
        ms = "floor(extract(epoch FROM %s.expires_at - clock_timestamp()) * 1000)::bigint"
        if name == "claim":
            return ("SELECT c.decision, c.attempt, c.outcome::text, " + ms % "c" +
                    (" FROM %s.idem_platform_claim(%%s, %%s, %%s::interval) AS c" if plat else
                     " FROM %s.idem_claim(%%s, %%s, %%s, %%s::interval) AS c") % s)
        if name == "lookup":
            return ("SELECT l.status, l.attempt, l.outcome::text, l.fingerprint = %s, " + ms % "l" +
                    (" FROM %s.idem_platform_lookup(%%s) AS l" if plat else
                     " FROM %s.idem_lookup(%%s, %%s) AS l") % s)
        if name == "complete":
            return ("SELECT %s.idem_platform_complete(%%s, %%s::jsonb, %%s::interval)" if plat else
                    "SELECT %s.idem_complete(%%s, %%s, %%s::jsonb, %%s::interval)") % s
        if name == "fail":
            return ("SELECT %s.idem_platform_fail(%%s, %%s::jsonb, %%s, %%s::interval)" if plat else
                    "SELECT %s.idem_fail(%%s, %%s, %%s::jsonb, %%s, %%s::interval)") % s
        raise KeyError(name)

    def _key_params(self):
        k = self.run.key
        return [k] if self.run.tenant_id is None else [self.run.tenant_id, k]

    def _decide(self, status, source, attempt=None, outcome_text=None):
        run = self.run
        run.status, run.source = status, source
        if attempt is not None:
            run.attempt = attempt
        if outcome_text is not None:
            run.outcome = json.loads(outcome_text)

    def _broken(self):
        return self.conn.broken or self.conn.closed

    def _pg_error(self, e, what):
        """An error from a statement: roll back what can be, release the marker."""
        self._drop_marker()
        _raise_pg_error(self.conn, e, what)

    def _drop_marker(self):
        if self.own_marker:
            self.own_marker = False
            self.r._release(self.ckey, self.marker)

    # -- step 2: the gate --
    def _gate(self):
        """Returns (decided, valkey_silent, mismatch_hint, marker_busy)."""
        r, run = self.r, self.run
        if not r._valkey_ok():
            return False, r.valkey is not None, False, False
        if self.st.keyspace is None or self.st.owner_suspect:
            return False, False, False, False
        self.ckey = cache.cache_key(self.st.keyspace, run.tenant_id, run.key)
        self.marker = cache.encode_marker(self.st.secrets[self.st.current], self.st.current,
                                          self.ckey, _wall_ms() + r.lease_ms, os.urandom(16))
        try:
            r._check_cluster()
            # one round trip: the gate, and the epoch's owner key (on a
            # cluster each node's share is sent before any reply is read);
            # get=True: redis-py then returns SET's reply as it is
            pipe = r.valkey.pipeline(transaction=False)
            pipe.execute_command("SET", self.ckey, self.marker, "NX", "PX",
                                 str(r.lease_ms), "GET", get=True)
            pipe.execute_command("GET", self.st.owner_key)
            value, owner = pipe.execute(raise_on_error=False)
            if isinstance(value, Exception):
                raise value
        except ValkeyClusterNotSupported:
            raise
        except Exception as e:
            # down, slow, or an error reply (WRONGTYPE, a server older than
            # 7.0): nothing usable; PostgreSQL decides, lookup first
            r._valkey_failed(e)
            return False, True, False, False
        run.valkey_used = True
        own = value is None or value == self.marker     # absent: our marker is set
        # the owner key did not hold the server's token: nothing read here
        # is trusted, PostgreSQL decides (lookup first); our marker is ours
        # all the same, and released as usual
        held, (e,) = self.st.judge(owner, [(self.ckey, None if own else value)],
                                   r.lease_ms, r.stats)
        r._health.answered()
        r._health.owner(held, owner, self.st.owner_key)    # another Valkey: told, rested
        if own:
            self.own_marker = True
            return False, False, False, False
        if not held:
            return False, True, False, False
        if e is None:
            return False, False, False, False
        if e.kind == cache.MARKER:
            # honoured until its MACed deadline (judge bounded it by our
            # own lease + 1 s); busy from Valkey alone for the marker's
            # first second only (its age: our lease minus what is left of
            # it); after that the claim decides, so a runner killed
            # mid-handler (PostgreSQL rolled its claim back) does not keep
            # the key busy for the rest of its lease.  The C runner's
            # IDEM_MARKER_CHEAP_MS.
            left = e.expires_ms - _wall_ms()
            if r.lease_ms - left >= MARKER_CHEAP_MS:
                return False, False, False, False
            self._decide(BUSY, SOURCE_VALKEY)
            run.retry_after_ms = max(1, left)
            return True, False, False, True
        if e.fingerprint != run.fingerprint:
            return False, False, True, False    # a hint: PostgreSQL confirms
        if not _result_from_cache(run, e):
            r.stats["cache_rejected"] += 1
            return False, False, False, False
        r.stats["replayed_from_valkey"] += 1
        return True, False, False, False

    # -- step 3a: a lookup outside any transaction --
    def _lookup(self):
        run = self.run
        try:
            row = self.conn.execute(self._sql("lookup"),
                                    [run.fingerprint] + self._key_params()).fetchone()
            self.r._end_tx(self.conn)
        except psycopg.Error as e:
            if not self._broken() and getattr(e.diag, "sqlstate", None) in ("42501", "42883"):
                # not granted (or absent): the claim decides, from now on directly
                self.conn.rollback()
                self.r.lookup_first = False
                return False
            self._pg_error(e, "idem_lookup")
        if row is None or row[0] is None or row[3] is None:
            return False
        status, attempt, outcome, same = row[0], row[1], row[2], row[3]
        if status not in ("completed", "failed_permanent"):
            return False
        if not same:
            self._decide(MISMATCH, SOURCE_POSTGRES, attempt)
        else:
            self._decide(REPLAYED if status == "completed" else FAILED_PERMANENT,
                         SOURCE_POSTGRES, attempt, outcome)
        return True

    # -- step 3b: the claim --
    def _set_max_attempts(self):
        """In the claim's transaction (pipelined): the runner's max_attempts."""
        if self.r.max_attempts is not None:
            self.conn.execute("SELECT pg_catalog.set_config('idem.max_attempts', %s, true)",
                              [str(self.r.max_attempts)])

    def _claim(self):
        run, conn = self.run, self.conn
        first = None
        try:
            # one round trip: BEGIN, the claim, the handler's savepoint
            # (harmless when the key is not ours: COMMIT follows), and the
            # block's first statement if it gave one (rolled back to the
            # savepoint when the key is not ours)
            try:
                with conn.pipeline():
                    if conn.autocommit:
                        conn.execute("BEGIN")
                    self.tx_open = True
                    self._set_max_attempts()
                    cur = conn.execute(self._sql("claim"), self._key_params() +
                                       [run.fingerprint, "%d milliseconds" % self.r.lease_ms])
                    conn.execute("SAVEPOINT idem_handler")
                    if self.first_sql is not None:
                        first = conn.execute(self.first_sql, self.first_params)
            except psycopg.Error as e:
                # the first statement's own error is the block's to handle
                # when the key is ours (the transaction is then in error)
                if first is None or self._broken() or cur.pgresult is None or \
                        cur.pgresult.status != psycopg.pq.ExecStatus.TUPLES_OK:
                    raise
                run.first_error = e
            decision, attempt, outcome, ms = cur.fetchone()
            if decision == "claimed":
                run.claimed = True
                run.attempt = attempt
                if first is not None and run.first_error is None:
                    run.first = first.fetchall() if first.description is not None else []
                return
            if first is not None:
                with conn.pipeline():
                    conn.execute("ROLLBACK TO SAVEPOINT idem_handler")
                    conn.execute("COMMIT")
            else:
                conn.commit()
            self.tx_open = False
        except psycopg.Error as e:
            self.tx_open = False
            self._pg_error(e, "idem_claim")
        self._claim_decided(decision, attempt, outcome, ms)

    def _claim_decided(self, decision, attempt, outcome, ms):
        """A decision of idem_claim other than claimed."""
        run = self.run
        if decision in ("completed", "failed_permanent"):
            # a terminal row: the claim queued a copy that overwrites our marker
            self.own_marker = False
            self._decide(REPLAYED if decision == "completed" else FAILED_PERMANENT,
                         SOURCE_POSTGRES, attempt, outcome)
        elif decision == "busy":
            self._decide(BUSY, SOURCE_POSTGRES, attempt)
            run.retry_after_ms = max(1, ms or 1)
        elif decision == "mismatch":
            self._decide(MISMATCH, SOURCE_POSTGRES, attempt)
        else:
            raise IdemError("protocol", "unknown decision %r" % decision)

    def __enter__(self):
        r, conn, run = self.r, self.conn, self.run
        r.stats["runs"] += 1
        self.st = r._idle_state(conn, "the run's transaction is the effect's, begun and "
                                "committed by the runner")
        try:
            # a first delivery (delivery_count 1): no run can have committed
            # this key, so the gate could only answer "absent"; the claim decides
            skip_gate = self.delivery_count == 1 and r.valkey is not None
            r.stats["gate_skipped_first"] += skip_gate
            decided, silent, hint, marker_busy = (False,) * 4 if skip_gate else self._gate()
            if decided:
                if marker_busy and r.lookup_first:
                    self._lookup()      # a committed run's marker: replay or mismatch now
            elif (silent or hint) and r.lookup_first and self._lookup():
                pass
            else:
                self._claim()
        except BaseException:
            self._drop_marker()
            raise
        if not run.claimed and run.status not in (REPLAYED, FAILED_PERMANENT):
            self._drop_marker()     # no terminal row: our marker goes
        return run

    def __exit__(self, et, ev, tb):
        run, conn = self.run, self.conn
        if not run.claimed:
            if conn.info.transaction_status not in (TransactionStatus.IDLE, TransactionStatus.UNKNOWN):
                # the block used the connection although nothing was claimed
                conn.rollback()
                if et is None:
                    raise IdemError("state", "the block ran statements on a run that was not "
                                    "claimed (check run.claimed): rolled back")
            return False
        try:
            return self._finish(et, ev)
        finally:
            if self.own_marker:
                self._drop_marker()

    def _finish(self, et, ev):
        run, conn = self.run, self.conn
        ts = conn.info.transaction_status
        if et is not None and not issubclass(et, Exception):
            # KeyboardInterrupt, SystemExit...: nothing recorded
            if not self._broken() and ts != TransactionStatus.IDLE:
                conn.rollback()
            return False
        if self._broken():
            err = IdemError("connection", "connection lost during the run (nothing committed)")
            if et is not None:
                raise err from ev
            raise err
        if ts == TransactionStatus.IDLE:
            self._drop_marker()
            raise IdemError("handler_ended_tx",
                            "the block ended the runner's transaction (COMMIT or ROLLBACK): its "
                            "effect may have committed without its idempotency key")
        failure, suppress = _failure_of(run, et, ev)
        if et is None and ts == TransactionStatus.INERROR and failure is None:
            conn.rollback()
            raise IdemError("handler", "the block left the transaction in error (a failed "
                            "statement it caught): rolled back, nothing recorded")
        # the outcome (or detail) is checked before anything is sent
        if failure is None:
            try:
                text = _outcome_text({} if run.outcome is None else run.outcome, "the outcome")
            except IdemError:
                conn.rollback()
                raise
        else:
            detail, retryable = failure
            try:
                text = _outcome_text(detail, "the failure detail")
            except IdemError:
                if et is None or suppress:
                    conn.rollback()
                    raise
                text = _outcome_text({"error": et.__name__}, "the failure detail")
        # A session the server ended while the block ran (pg_terminate_backend,
        # a restart) is seen now, before COMMIT is sent: nothing committed.
        if _session_ended(conn):
            raise IdemError("connection", "connection lost during the run (nothing committed)")
        # one round trip: end the savepoint, complete or fail, COMMIT (a
        # statement of the pipeline: conn.commit() would sync once more)
        try:
            with conn.pipeline():
                if failure is None:
                    conn.execute("RELEASE SAVEPOINT idem_handler")
                    conn.execute(self._sql("complete"), self._key_params() + [text, self.r.retention])
                else:
                    conn.execute("ROLLBACK TO SAVEPOINT idem_handler")
                    conn.execute(self._sql("fail"), self._key_params() + [text, retryable,
                                                                          self.r.retention])
                conn.execute("COMMIT")
        except psycopg.Error as e:
            if self._broken():
                # COMMIT was handed to the connection with the rest
                raise CommitUnknown("connection lost while COMMIT was in flight: the effect "
                                    "and its key committed together or not at all; redeliver, "
                                    "the ledger decides (%s)" % str(e).strip()) from e
            if e.diag.sqlstate == "3B001":
                conn.rollback()
                self._drop_marker()
                raise IdemError("handler_ended_tx",
                                "the block released the runner's savepoint") from e
            self._pg_error(e, "completing the run")
        run.source = SOURCE_HANDLER
        if failure is None:
            run.status = APPLIED
            run.outcome = json.loads(text)
        else:
            run.status = FAILED_RETRYABLE if failure[1] else FAILED_PERMANENT
            run.outcome = json.loads(text)
        if run.status != FAILED_RETRYABLE:
            self.own_marker = False     # left for the worker's copy of the row
        return suppress
