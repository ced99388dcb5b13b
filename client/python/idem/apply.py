"""A run whose effect is a SQL function: the extension's idem_apply claims
the key, calls the function as the effect in a subtransaction, and
completes or fails the key, in one statement that commits by itself (the C
runner's idem_run_options.sql_handler).  The gate in front is the one
run's (run.py); this module owns only step 3b's one statement and the
rules for what its failures prove."""
import json
from typing import Any, List, Optional, Tuple

import psycopg

from .canonical import RequestError, canonical_json
from . import cache
from .core import RunnerCore
from .errors import CommitUnknown, IdemError
from .pg import Conn, _exec, _one, _session_ended, sqlstate_of
from .result import APPLIED, FAILED_PERMANENT, FAILED_RETRYABLE, SOURCE_HANDLER
from .run import _RunContext


# An ERROR (not FATAL) of these classes, received before the connection was
# lost, proves that the statement's transaction rolled back: no pooler makes
# them up (client/README.md, "Commit unknown").
_ROLLBACK_CLASSES = ("22", "23", "40", "42", "54", "55", "P0")
_ROLLBACK_STATES = ("25P02", "26000", "3B001")


def proves_rollback(e: BaseException) -> bool:
    """Does this psycopg error prove that its transaction rolled back?"""
    diag = getattr(e, "diag", None)
    state = getattr(diag, "sqlstate", None) or ""
    severity = getattr(diag, "severity_nonlocalized", None) or getattr(diag, "severity", None)
    if severity != "ERROR" or len(state) != 5 or state == "40003":
        return False
    return state[:2] in _ROLLBACK_CLASSES or state in _ROLLBACK_STATES


class _ApplyContext(_RunContext):
    """A run with a SQL handler: the gate, then (unless it decided) one
    idem_apply statement instead of the claim and a block."""

    def __init__(self, runner: RunnerCore, conn: Conn, tenant_id: Optional[int], scope: str,
                 run_id: str, request: Any, sql_handler: str, args: Any = None,
                 delivery_count: int = 0, durable: bool = False) -> None:
        super().__init__(runner, conn, tenant_id, scope, run_id, request,
                         delivery_count=delivery_count, durable=durable)
        if not isinstance(sql_handler, str) or not sql_handler.strip():
            raise IdemError("argument", "sql_handler must name a function, as regprocedure "
                            "text: \"charge(jsonb)\"")
        self.sql_handler = sql_handler
        if args is None:
            self.args_text = self.run.request
        else:
            try:
                self.args_text = canonical_json(args)
            except RequestError as e:
                raise IdemError("argument", "args: %s" % e) from None

    def _apply_sql(self) -> str:
        s = self.st.schema
        cols = ("SELECT a.decision, a.attempt, a.outcome::text, "
                "floor(extract(epoch FROM a.expires_at - clock_timestamp()) * 1000)::bigint, a.ran ")
        if self.run.tenant_id is None:
            return cols + ("FROM %s.idem_platform_apply(%%s, %%s, %%s::regprocedure, %%s::jsonb, "
                           "%%s::interval) AS a" % s)
        return cols + ("FROM %s.idem_apply(%%s, %%s, %%s, %%s::regprocedure, %%s::jsonb, "
                       "%%s::interval) AS a" % s)

    def _apply_params(self) -> List[Any]:
        return self._key_params() + [self.run.fingerprint, self.sql_handler, self.args_text,
                                     self.r.retention]

    def _apply_failed(self, e: psycopg.Error) -> Optional[IdemError]:
        """idem_apply's statement failed and the connection is lost: what
        to raise (None: not lost, a statement error)."""
        if not self._broken():
            return None
        if proves_rollback(e):
            return IdemError("server", "idem_apply failed (rolled back, nothing committed), "
                             "then the connection was lost: %s" % str(e).strip(), sqlstate_of(e))
        return CommitUnknown("connection lost after idem_apply was sent: whether it committed "
                             "is unknown; redeliver, the ledger decides (%s)" % str(e).strip())

    def _applied(self, row: Tuple[Any, ...]) -> None:
        """idem_apply's answer."""
        run = self.run
        decision, attempt, outcome, ms, ran = row
        run.attempt = attempt
        if decision in ("applied", "failed_retryable") or \
                (decision == "failed_permanent" and ran):
            if outcome is None or not outcome.startswith("{") or \
                    len(outcome.encode("utf-8")) > cache.OUTCOME_MAX:
                raise IdemError("protocol", "idem_apply returned an outcome that is not a JSON "
                                "object of at most %d bytes" % cache.OUTCOME_MAX)
            run.status = {"applied": APPLIED, "failed_retryable": FAILED_RETRYABLE,
                          "failed_permanent": FAILED_PERMANENT}[decision]
            run.source = SOURCE_HANDLER
            run.outcome = json.loads(outcome)
            if decision != "failed_retryable":
                self.own_marker = False     # a terminal row: the worker's copy follows
            return
        self._claim_decided(decision, attempt, outcome, ms)

    # step 3b: instead of the claim, the whole run in one statement
    def _claim(self) -> None:
        conn = self.conn
        if _session_ended(conn):
            self._drop_marker()
            raise IdemError("connection", "connection lost before idem_apply was sent "
                            "(nothing committed)")
        # one statement, one round trip; with settings (SET LOCAL) or
        # autocommit off, BEGIN, the settings, idem_apply and COMMIT are
        # still one round trip (pipelined)
        try:
            if conn.autocommit and not self._settings():
                cur = _exec(conn, self._apply_sql(), self._apply_params())
            else:
                cur = self._committed_alone(self._apply_sql(), self._apply_params())
        except psycopg.Error as e:
            err = self._apply_failed(e)
            if err is None:
                self._pg_error(e, "idem_apply")
            if not isinstance(err, CommitUnknown):
                self._drop_marker()
            raise err from e
        self._applied(_one(cur))
