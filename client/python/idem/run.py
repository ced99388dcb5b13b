"""One run in the runner's transaction (Runner.run, call and the
decorator): the Valkey gate and its marker (step 2), the autocommit
lookup (3a), the claim (3b), the block, and the completion or failure
committed with the effect.  apply.py and lease.py subclass it for their
own step 3b; the Runner (runner.py) hands it its Valkey client and the
session's state."""
import binascii
import json
import os
import time
from types import TracebackType
from typing import Any, List, NoReturn, Optional, Sequence, Tuple, Type

import psycopg
from psycopg.pq import TransactionStatus

from . import cache, resp
from .emit import run_statement as emit_run_statement
from .core import RunnerCore
from .errors import CommitUnknown, IdemError
from .pg import (DURABLE_SQL, MAX_ATTEMPTS_SQL, Conn, Statement, _as_is, _check_conn, _exec, _one,
                 _pipeline, _raise_ending, _raise_pg_error, _send,
                 _session_ended, _simple, _values, caught_timeout, server_state_error,
                 sqlstate_of)
from .result import (APPLIED, BUSY, FAILED_PERMANENT, FAILED_RETRYABLE, MISMATCH,
                     REPLAYED, SOURCE_HANDLER, SOURCE_POSTGRES, SOURCE_VALKEY, Failure,
                     FailureSpec, Run, _failure_of, _json_object, _make_run, _recorded_ending,
                     _result_from_cache)
from .trust import _ConnState, _wall_ms

# The gate's answer: (decided, valkey_silent, mismatch_hint, marker_busy).
Gate = Tuple[bool, bool, bool, bool]
# What a block's end does (_RunContext._ending): (rollback, error,
# failure, text, suppress).
Ending = Tuple[bool, Optional[IdemError], Optional[FailureSpec], Optional[str], bool]


# A context's session state before it is entered: a session of none.
_UNENTERED = _ConnState(0)

WHOSE_TX = "the run's transaction is the effect's, begun and committed by the runner"
_IDLE = TransactionStatus.IDLE
_Connection = psycopg.Connection
# _gate_direct's answer for a replay it decided; and what it calls
_REPLAYED: Gate = tuple([True, False, False, False])   # type: ignore[assignment]
_hexlify = binascii.hexlify
_unhex = binascii.unhexlify
_match = cache._VALUE.match
_INT32_MAX, _EXPIRES_MAX, _OUTCOME_MAX = cache.INT32_MAX, cache.EXPIRES_MAX, cache.OUTCOME_MAX
_monotonic = time.monotonic
_time = time.time
_urandom = os.urandom
# Markers' tokens in hex (16 random bytes each), drawn 64 at a time; a
# forked child draws its own.
_tokens: List[bytes] = []
os.register_at_fork(after_in_child=_tokens.clear)


def _token() -> bytes:
    """A fresh marker token in hex."""
    try:
        return _tokens.pop()
    except IndexError:
        pool = _hexlify(_urandom(16 * 64))
        _tokens.extend([pool[i:i + 32] for i in range(32, len(pool), 32)])
        return pool[:32]

# How long another run's marker answers its duplicates "busy" from Valkey
# alone; after that the claim decides (a dead runner's marker).
MARKER_CHEAP_MS = 1000


def _caught_timeout_failure(conn: Any) -> Optional[FailureSpec]:
    """A block that caught a timeout's cancel (statement_timeout's,
    lock_timeout's) and ended without an answer, its transaction in error:
    the effect cannot commit, and it is the attempt it would be had the
    block let the cancel propagate, a retryable failure with {"sqlstate",
    "message"} (the C runner's rule), so that max_attempts ends a block
    that overruns on every delivery.  None if its error was another."""
    timeout = caught_timeout(conn)
    if timeout is None:
        return None
    return {"sqlstate": timeout[0], "message": timeout[1]}, True


class _RunContext:
    """``with runner.run(...) as run:`` (Runner.run): the gate and the
    claim on entry, the completion or failure, and COMMIT, on exit."""
    run_class: Type[Run] = Run
    asynchronous = False        # the connection is an AsyncConnection (idem.aio)
    # until the gate makes them: the cache key, our marker, whether it is
    # ours to release; whether the run's transaction is open
    ckey = b""
    marker = b""
    packed = b""        # the gate's commands in RESP (_marker)
    own_marker = False
    tx_open = False
    st = _UNENTERED     # the session's, once entered
    # the block's first statement and its parameters, if given
    first_sql: Optional[str] = None
    first_params: Optional[Sequence[Any]] = None

    def __init__(self, runner: RunnerCore, conn: Conn, tenant_id: Optional[int], scope: str,
                 run_id: str, request: Any, *, delivery_count: int = 0,
                 first_sql: Optional[str] = None,
                 first_params: Optional[Sequence[Any]] = None, durable: bool = False) -> None:
        if type(conn) is not _Connection or self.asynchronous:
            _check_conn(conn, self.asynchronous)
        self.r = runner
        self.conn = conn
        self.durable = bool(durable)
        dc = delivery_count if type(delivery_count) is int else \
            -1 if delivery_count is None else int(delivery_count)
        if dc < 0:
            raise IdemError("argument", "delivery_count must be 0 (unknown) or positive")
        self.delivery_count = dc
        if first_sql is not None:
            if not isinstance(first_sql, str) or not first_sql.strip():
                raise IdemError("argument", "first_sql must be a non-empty statement")
            self.first_sql = first_sql
            self.first_params = first_params
        self.run = _make_run(self.run_class, tenant_id, scope, run_id, request)

    # -- SQL --
    def _sql(self, name: str) -> str:
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

    def _key_params(self) -> List[Any]:
        k = self.run.key
        return [k] if self.run.tenant_id is None else [self.run.tenant_id, k]

    def _decide(self, status: str, source: str, attempt: Optional[int] = None,
                outcome_text: Optional[str] = None) -> None:
        run = self.run
        run.status, run.source = status, source
        if attempt is not None:
            run.attempt = attempt
        if outcome_text is not None:
            run.outcome = json.loads(outcome_text)

    def _broken(self) -> bool:
        return self.conn.broken or self.conn.closed

    def _pg_error(self, e: psycopg.Error, what: str) -> NoReturn:
        """An error from a statement: roll back what can be, release the marker."""
        self._drop_marker()
        _raise_pg_error(self.conn, e, what)

    def _drop_marker(self) -> None:
        if self.own_marker:
            self.own_marker = False
            self.r._release(self.ckey, self.marker)

    # -- step 2: the gate --
    def _marker(self, st: _ConnState, current: int) -> bytes:
        """Our marker (ckey, marker), from the session's learnt state
        (its key prefix and the current secret's Signer), and the gate's
        two commands in RESP to send it."""
        run = self.run
        lease_ms = self.r.lease_ms
        self.ckey = ckey = st.key_prefix(run.tenant_id) + _hexlify(run.key)
        self.marker = marker = st.signers[current].sign(ckey, cache.marker_rest(
            current, int(_time() * 1000) + lease_ms, _token()))
        return st.gate_of(lease_ms).pack(ckey, marker)

    def _gate_marker(self) -> Optional[Gate]:
        """Before the gate: its answer if there is no asking Valkey, else
        None, our marker made (ckey, marker, packed: _marker)."""
        r, st = self.r, self.st
        if not r._valkey_ok():
            return False, r.valkey is not None, False, False
        current = st.current
        if st.keyspace is None or current is None or st.owner_suspect:
            return False, False, False, False
        self.packed = self._marker(st, current)
        return None

    def _gate(self) -> Gate:
        """Returns (decided, valkey_silent, mismatch_hint, marker_busy)."""
        early = self._gate_marker()
        if early is not None:
            return early
        return self._gate_answer(self.r._round_trip(self._gate_commands, (self.packed, 2)))

    def _gate_direct(self) -> Optional[Gate]:
        """_gate, flattened for the common case: a plain Valkey on the
        runner's own connection (resp.Direct, made by an earlier round
        trip), and a session that knows its cache.  The same bytes on the
        wire; a verified terminal value of the same request is decided
        here (_REPLAYED), anything else by _gate_answer from the same
        replies.  None: not the common case, _gate decides."""
        r, st = self.r, self.st
        direct = r._direct
        current = st.current
        if direct is None or current is None or st.keyspace is None or st.owner_suspect or \
                direct.client is not r.valkey or not r._cluster_checked or \
                (r._rest_until and r._rest_until > _monotonic()):
            return None
        packed = self._marker(st, current)
        try:
            replies: Optional[List[Any]] = direct.exchange(packed, 2)
        except Exception as e:
            r._round_trip_failed(e)
            replies = None
        if replies is None:
            return self._gate_answer(replies)
        value, owner = replies
        # trust.judge_one and cache.parse, verify, for a terminal value
        # (cache._VALUE's groups: mac, key id, three marker groups, kind,
        # attempt, expiry, fingerprint, outcome), _result_from_cache
        health = r._health
        m = None if type(value) is not bytes or owner != st.owner_token or \
            type(owner) is not bytes or health.said is not None or \
            health.owner_bad_since is not None else _match(value)
        if m is None:
            return self._gate_answer(replies)
        mac, key_id, _, _, kind, attempt_text, expires, fp, outcome = m.groups()
        if kind is None:
            return self._gate_answer(replies)       # a marker
        run = self.run
        signer = st.signers.get(int(key_id))
        attempt, expires_ms = int(attempt_text), int(expires)
        if signer is None or attempt > _INT32_MAX or expires_ms > _EXPIRES_MAX or \
                len(outcome) > _OUTCOME_MAX or _unhex(fp) != run.fingerprint or \
                expires_ms <= int(_time() * 1000) or not signer.verifies(self.ckey, value, mac):
            return self._gate_answer(replies)
        try:
            run.outcome = _json_object(outcome.decode("utf-8"))
        except ValueError:
            return self._gate_answer(replies)
        st.owner_relearnt = False
        run.valkey_used = True
        run.status = REPLAYED if kind == b"c" else FAILED_PERMANENT
        run.source = SOURCE_VALKEY
        run.attempt = attempt
        r.stats["replayed_from_valkey"] += 1
        return _REPLAYED

    def _gate_commands(self, pipe: Any) -> Any:
        """The gate's one round trip: our marker, set unless the key holds
        a value (which it answers), and the epoch's owner key (on a cluster
        each node's share is sent before any reply is read).  get=True:
        redis-py then returns SET's reply as it is."""
        pipe.execute_command("SET", self.ckey, self.marker, "NX", "PX", str(self.r.lease_ms),
                             "GET", get=True)
        pipe.execute_command("GET", self.st.owner_key)
        return pipe

    def _gate_answer(self, replies: Optional[List[Any]]) -> Gate:
        """The gate's answer from what SET ... GET and the owner key's GET
        read (None: Valkey failed)."""
        r, run = self.r, self.run
        if replies is not None and isinstance(replies[0], Exception):
            r._valkey_failed(replies[0])
            replies = None
        if replies is None:
            # down, slow, or an error reply (WRONGTYPE, a server older than
            # 7.0): nothing usable; PostgreSQL decides, lookup first
            return False, True, False, False
        value, owner = replies
        run.valkey_used = True
        own = value is None or value == self.marker     # absent: our marker is set
        # the owner key did not hold the server's token: nothing read here
        # is trusted, PostgreSQL decides (lookup first); our marker is ours
        # all the same, and released as usual
        held, entry = self.st.judge_one(owner, self.ckey, None if own else value,
                                        r.lease_ms, r.stats)
        r._health.answered()
        r._health.owner(held, owner, self.st.owner_key)    # another Valkey: told, rested
        if own:
            self.own_marker = True
            return False, False, False, False
        if not held:
            return False, True, False, False
        if entry is None:
            return False, False, False, False
        if entry.kind == cache.MARKER:
            # honoured until its MACed deadline (judge bounded it by our
            # own lease + 1 s); busy from Valkey alone for the marker's
            # first second only (its age: our lease minus what is left of
            # it); after that the claim decides, so a runner killed
            # mid-handler (PostgreSQL rolled its claim back) does not keep
            # the key busy for the rest of its lease.  The C runner's
            # IDEM_MARKER_CHEAP_MS.
            left = entry.expires_ms - _wall_ms()
            if r.lease_ms - left >= MARKER_CHEAP_MS:
                return False, False, False, False
            self._decide(BUSY, SOURCE_VALKEY)
            run._busy_for(left)
            return True, False, False, True
        if entry.fingerprint != run.fingerprint:
            return False, False, True, False    # a hint: PostgreSQL confirms
        if not _result_from_cache(run, entry):
            r.stats["cache_rejected"] += 1
            return False, False, False, False
        r.stats["replayed_from_valkey"] += 1
        return True, False, False, False

    # -- step 3a: a lookup outside any transaction (a durable run's: in
    # one of its own, with DURABLE_SQL) --
    def _lookup(self) -> bool:
        run = self.run
        try:
            if self.durable:
                row = self._committed_alone(self._sql("lookup"),
                                            [run.fingerprint] + self._key_params()).fetchone()
            else:
                row = _exec(self.conn, self._sql("lookup"),
                            [run.fingerprint] + self._key_params()).fetchone()
                self.r._end_tx(self.conn)
        except psycopg.Error as e:
            if self._lookup_refused(e):
                self.conn.rollback()
                return False
            self._pg_error(e, "idem_lookup")
        return self._lookup_answer(row)

    def _lookup_refused(self, e: psycopg.Error) -> bool:
        """idem_lookup not granted (or absent): the claim decides, from now
        on directly (the caller rolls back); else an error."""
        if not self._broken() and sqlstate_of(e) in ("42501", "42883"):
            self.r.lookup_first = False
            return True
        return False

    def _lookup_answer(self, row: Optional[Tuple[Any, ...]]) -> bool:
        """Decided by idem_lookup's row?"""
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
    def _settings(self) -> List[Statement]:
        """What the run's transaction sets first: the runner's
        max_attempts, and a durable run's synchronous_commit."""
        stmts: List[Statement] = []
        if self.r.max_attempts is not None:
            stmts.append((MAX_ATTEMPTS_SQL, [str(self.r.max_attempts)]))
        if self.durable:
            stmts.append((DURABLE_SQL, None))
        return stmts

    def _set_settings(self) -> None:
        """In the claim's transaction (pipelined): _settings."""
        for sql, params in self._settings():
            _exec(self.conn, sql, params)

    def _alone(self, sql: str, params: List[Any]) -> List[Statement]:
        """One statement in a transaction of its own, with the run's
        settings: one round trip (the statement is the last but one)."""
        stmts: List[Statement] = [("BEGIN", None)] if self.conn.autocommit else []
        return stmts + self._settings() + [(sql, params), ("COMMIT", None)]

    def _committed_alone(self, sql: str, params: List[Any]) -> "psycopg.Cursor[Tuple[Any, ...]]":
        """_alone's round trip: the statement's cursor."""
        cur: "psycopg.Cursor[Tuple[Any, ...]]" = _send(self.conn, self._alone(sql, params),
                                                       _as_is)[-2]
        return cur

    def _claim_params(self) -> List[Any]:
        return self._key_params() + [self.run.fingerprint, "%d milliseconds" % self.r.lease_ms]

    def _first_failed(self, e: psycopg.Error, first: Any, cur: Any) -> bool:
        """Is e the block's first statement's own error, the claim having
        answered?  Then it is the block's to handle when the key is ours
        (the transaction is in error)."""
        if first is None or self._broken() or cur is None or cur.pgresult is None or \
                cur.pgresult.status != psycopg.pq.ExecStatus.TUPLES_OK:
            return False
        self.run.first_error = e
        return True

    def _claimed(self, row: Tuple[Any, ...], first_rows: Optional[List[Any]]) -> bool:
        """The claim's answer: ours (claimed), or decided otherwise."""
        decision, attempt, outcome, ms = row
        if decision == "claimed":
            self.run.claimed = True
            self.run.attempt = attempt
            if self.run.first_error is None:
                self.run.first = first_rows
            return True
        self._claim_decided(decision, attempt, outcome, ms)
        return False

    def _claim_statements(self) -> List[Statement]:
        """BEGIN (psycopg's, autocommit off: _simple), the run's
        settings, the claim, the handler's savepoint (harmless when
        the key is not ours: COMMIT follows)."""
        stmts: List[Statement] = [("BEGIN", None)] if self.conn.autocommit else []
        return stmts + self._settings() + [(self._sql("claim"), self._claim_params()),
                                           ("SAVEPOINT idem_handler", None)]

    def _claim_row(self, values: List[Optional[str]]) -> Tuple[Any, ...]:
        """The claim's row from its text (_values)."""
        decision, attempt, outcome, ms = values
        return (decision, None if attempt is None else int(attempt), outcome,
                None if ms is None else int(ms))

    def _claim(self) -> None:
        if self.first_sql is not None or self.conn.pgconn.pipeline_status:
            # the caller's statement, or the caller's pipeline: pipelined
            return self._claim_with_first()
        # one round trip, one simple query: _claim_statements
        conn = self.conn
        try:
            self.tx_open = True
            res = _simple(conn, self._claim_statements())[-2]
            if self._claimed(self._claim_row(_values(conn, res)), None):
                return
            conn.commit()
            self.tx_open = False
        except psycopg.Error as e:
            self.tx_open = False
            self._pg_error(e, "idem_claim")

    def _claim_with_first(self) -> None:
        run, conn = self.run, self.conn
        first: "Optional[psycopg.Cursor[Any]]" = None
        cur: "Optional[psycopg.Cursor[Tuple[Any, ...]]]" = None
        try:
            # one round trip: BEGIN, the claim, the handler's savepoint
            # (harmless when the key is not ours: COMMIT follows), and the
            # block's first statement if it gave one (rolled back to the
            # savepoint when the key is not ours)
            try:
                with _pipeline(conn):
                    if conn.autocommit:
                        _exec(conn, "BEGIN")
                    self.tx_open = True
                    self._set_settings()
                    cur = _exec(conn, self._sql("claim"), self._claim_params())
                    _exec(conn, "SAVEPOINT idem_handler")
                    if self.first_sql is not None:
                        # the caller's statement, in the caller's row factory;
                        # unprepared too (safe behind a transaction pooler)
                        first = conn.cursor()
                        first.execute(self.first_sql, self.first_params, prepare=False)
            except psycopg.Error as e:
                if not self._first_failed(e, first, cur):
                    raise
            assert cur is not None
            row = _one(cur)
            first_rows = None
            if first is not None and run.first_error is None and row[0] == "claimed":
                first_rows = first.fetchall() if first.description is not None else []
            if self._claimed(row, first_rows):
                return
            if first is not None:
                with _pipeline(conn):
                    _exec(conn, "ROLLBACK TO SAVEPOINT idem_handler")
                    _exec(conn, "COMMIT")
            else:
                conn.commit()
            self.tx_open = False
        except psycopg.Error as e:
            self.tx_open = False
            self._pg_error(e, "idem_claim")

    def _claim_decided(self, decision: str, attempt: Optional[int], outcome: Optional[str],
                       ms: Optional[int]) -> None:
        """A decision of idem_claim other than claimed."""
        run = self.run
        if decision in ("completed", "failed_permanent"):
            # a terminal row: the claim queued a copy that overwrites our marker
            self.own_marker = False
            self._decide(REPLAYED if decision == "completed" else FAILED_PERMANENT,
                         SOURCE_POSTGRES, attempt, outcome)
        elif decision == "busy":
            self._decide(BUSY, SOURCE_POSTGRES, attempt)
            run._busy_for(ms)
        elif decision == "mismatch":
            self._decide(MISMATCH, SOURCE_POSTGRES, attempt)
        else:
            raise IdemError("protocol", "unknown decision %r" % decision)

    def _entering(self) -> bool:
        """Counted; skip the gate?  A first delivery (delivery_count 1): no
        run can have committed this key, so the gate could only answer
        "absent"; the claim decides."""
        r = self.r
        stats = r.stats
        stats["runs"] += 1
        if self.delivery_count == 1 and r.valkey is not None:
            stats["gate_skipped_first"] += 1
            return True
        return False

    def _after_gate(self, gate: Gate) -> str:
        """What follows the gate: "done", "lookup" (a committed run's
        marker: replay or mismatch now), "lookup_or_claim" or "claim"."""
        decided, silent, hint, marker_busy = gate
        lookup = self.r.lookup_first
        if decided:
            return "lookup" if marker_busy and lookup else "done"
        return "lookup_or_claim" if (silent or hint) and lookup else "claim"

    def _keeps_marker(self) -> bool:
        """Our marker stays for a claimed run, and for a terminal row whose
        copy will overwrite it; otherwise it goes."""
        run = self.run
        return run.claimed or run.status in (REPLAYED, FAILED_PERMANENT)

    def __enter__(self) -> Run:
        r, conn = self.r, self.conn
        skip_gate = self._entering()
        st = r._conns.get(conn)
        pgconn = conn.pgconn
        if st is None or not st.schema or pgconn.transaction_status != _IDLE or \
                st.backend_pid != pgconn.backend_pid or r._wants_learning(st):
            st = r._idle_state(conn, WHOSE_TX)
        self.st = st
        try:
            if skip_gate:
                gate: Gate = (False,) * 4
            else:
                direct = self._gate_direct() if type(self) is _RunContext else None
                if direct is _REPLAYED:
                    return self.run         # replayed: the value held, our marker unset
                gate = self._gate() if direct is None else direct
            step = self._after_gate(gate)
            if step == "lookup":
                self._lookup()
            elif step == "claim" or (step == "lookup_or_claim" and not self._lookup()):
                self._claim()
        except BaseException:
            self._drop_marker()
            raise
        if not self._keeps_marker():
            self._drop_marker()     # no terminal row: our marker goes
        return self.run

    def _unclaimed_exit(self, et: Optional[Type[BaseException]]) -> Tuple[bool, Optional[IdemError]]:
        """The end of a block whose run was not claimed: (rollback, error).
        A block that used the connection anyway is rolled back."""
        if self.conn.pgconn.transaction_status in (TransactionStatus.IDLE,
                                                   TransactionStatus.UNKNOWN):
            return False, None
        return True, None if et is not None else IdemError(
            "state", "the block ran statements on a run that was not claimed (check "
            "run.claimed): rolled back")

    def __exit__(self, et: Optional[Type[BaseException]], ev: Optional[BaseException],
                 tb: Optional[TracebackType]) -> bool:
        if not self.run.claimed:
            if type(self) is _RunContext and self.conn.pgconn.transaction_status == _IDLE:
                return False        # _unclaimed_exit's common case
            rollback, err = self._unclaimed_exit(et)
            if rollback:
                self.conn.rollback()
            if err is not None:
                raise err
            return False
        try:
            return self._finish(et, ev)
        finally:
            if self.own_marker:
                self._drop_marker()

    def _ending(self, et: Optional[Type[BaseException]], ev: Optional[BaseException]) -> Ending:
        """What the end of a claimed run's block does, decided before any
        I/O: (rollback, error, failure, text, suppress).  With an error:
        roll back if asked, raise it.  Without, and text None: roll back if
        asked, let the block's exception propagate.  Else complete (failure
        None) or fail with text, commit, and return suppress."""
        run, conn = self.run, self.conn
        ts = conn.info.transaction_status
        if et is not None and not issubclass(et, Exception):
            # KeyboardInterrupt, SystemExit...: nothing recorded
            return not self._broken() and ts != TransactionStatus.IDLE, None, None, None, False
        if self._broken():
            return False, IdemError("connection", "connection lost during the run (nothing "
                                    "committed)"), None, None, False
        if not isinstance(ev, Failure) and server_state_error(ev) is not None:
            # a serialization failure, a deadlock, an operator's cancel...:
            # the server's state, not the block's answer (idem_apply's rule).
            # Not an attempt: rolled back, nothing recorded, raised again.
            return ts != TransactionStatus.IDLE, None, None, None, False
        if ts == TransactionStatus.IDLE:
            return False, IdemError(
                "handler_ended_tx", "the block ended the runner's transaction (COMMIT or "
                "ROLLBACK): its effect may have committed without its idempotency key"), \
                None, None, False
        failure, suppress = _failure_of(run, et, ev)
        if et is None and ts == TransactionStatus.INERROR and failure is None:
            failure = _caught_timeout_failure(conn)
            if failure is None:
                return True, IdemError("handler", "the block left the transaction in error (a "
                                       "failed statement it caught): rolled back, nothing "
                                       "recorded"), None, None, False
        failure, text = _recorded_ending(run, failure, et, suppress)
        return False, None, failure, text, suppress

    def _ending_statements(self, failure: Optional[FailureSpec], text: str) -> List[Statement]:
        """The last round trip: end the savepoint, complete or fail, COMMIT
        (in the same query: conn.commit() would be a round trip more)."""
        retention = self.r.retention
        if failure is None:
            # the block's messages (run.emit), while the claim is open
            return [("RELEASE SAVEPOINT idem_handler", None)] + \
                emit_run_statement(self.st.schema, self.run.tenant_id, self.run.key,
                                   self.run._emits) + \
                [(self._sql("complete"), self._key_params() + [text, retention]),
                 ("COMMIT", None)]
        return [("ROLLBACK TO SAVEPOINT idem_handler", None),
                (self._sql("fail"), self._key_params() + [text, failure[1], retention]),
                ("COMMIT", None)]

    def _ending_failed(self, e: psycopg.Error) -> Tuple[bool, IdemError]:
        """The last round trip failed: (rollback, what to raise)."""
        if self._broken():
            # COMMIT was handed to the connection with the rest
            return False, CommitUnknown(
                "connection lost while COMMIT was in flight: the effect and its key committed "
                "together or not at all; redeliver, the ledger decides (%s)" % str(e).strip())
        if sqlstate_of(e) == "3B001":
            return True, IdemError("handler_ended_tx", "the block released the runner's savepoint")
        return True, IdemError("server", "completing the run: %s" % str(e).strip(),
                               sqlstate_of(e))

    def _ended(self, failure: Optional[FailureSpec], text: str) -> None:
        """Committed: the run's result."""
        run = self.run
        run.source = SOURCE_HANDLER
        run.status = APPLIED if failure is None else \
            FAILED_RETRYABLE if failure[1] else FAILED_PERMANENT
        run.outcome = json.loads(text)
        if run.status != FAILED_RETRYABLE:
            self.own_marker = False     # left for the worker's copy of the row

    # A session the server ended while the block ran (pg_terminate_backend, a
    # restart) is seen before the last round trip is sent: nothing committed.
    lost_before_end = "connection lost during the run (nothing committed)"

    def _finish(self, et: Optional[Type[BaseException]], ev: Optional[BaseException]) -> bool:
        """The end of a claimed run's block: _ending's plan carried out."""
        conn = self.conn
        rollback, err, failure, text, suppress = self._ending(et, ev)
        if rollback:
            conn.rollback()
        if text is None:
            _raise_ending(err, ev)
            return False
        if _session_ended(conn):
            raise IdemError("connection", self.lost_before_end)
        _send(conn, self._ending_statements(failure, text), self._ending_failed,
              simple=not conn.pgconn.pipeline_status)
        self._ended(failure, text)
        return suppress
