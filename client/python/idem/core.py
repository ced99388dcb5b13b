"""What a form (one run, a SQL handler, lease mode, a batch) uses of its
runner: the options, the counters, and the steps on Valkey and on the
session that the runner owns.  A Protocol, which Runner and AsyncRunner
satisfy: the forms type their runner with it and import nothing above
them (runner.py imports the forms)."""
import datetime
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

import weakref

from . import resp
from .health import Health
from .pg import Conn
from .trust import _ConnState


class RunnerCore(Protocol):
    """The runner as its forms see it (runner.Runner has each member's
    description)."""
    valkey: Any
    lease_ms: int
    max_attempts: Optional[int]
    retention: Optional[datetime.timedelta]
    lookup_first: bool
    stats: Dict[str, int]
    _health: Health
    # what one run's replay reads directly (_RunContext._gate_direct)
    _conns: "weakref.WeakKeyDictionary[Conn, _ConnState]"
    _direct: Optional[resp.Direct]
    _cluster_checked: bool
    _rest_until: float

    def _wants_learning(self, st: _ConnState) -> bool: ...

    def _round_trip_failed(self, e: Exception) -> None: ...

    def _valkey_ok(self) -> bool: ...

    def _valkey_failed(self, e: BaseException) -> None: ...

    def _round_trip(self, fill: Callable[[Any], Any],
                    packed: Optional[Tuple[bytes, int]] = None) -> Optional[List[Any]]: ...

    def _release(self, ckey: bytes, marker: bytes) -> None: ...

    def _end_tx(self, conn: Conn) -> None: ...

    def _state(self, conn: Conn) -> _ConnState: ...

    def _idle_state(self, conn: Conn, whose: str) -> _ConnState: ...
