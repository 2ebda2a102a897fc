"""What each of the run's parts asks of the run it serves (the Controller, flodld/controller/run.py, is one).

`Admissions` (admission.py), `RankLosses` (losses.py), `WorldShipper` (shipper.py), `RunPort` (runport.py),
`RunStatus` (runstatus.py) and `WindowDriver` (driver.py) each hold the run they work for and call on it,
through its own protocol here only, so none of them imports run.py (which imports them all). The Controller
satisfies every one structurally; mypy checks that where run.py builds each part with `self`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from flodld.controller.join import HostLink, JoinRun
from flodld.controller.metrics import ControllerCounters, RunMetrics
from flodld.controller.mux import PortMux
from flodld.controller.options import ControllerOptions
from flodld.controller.snapshot import StormLog
from flodld.controller.source import StatusSource
from flodld.controller.store import StoreService
from flodld.membership.phase import Phase
from flodld.membership.policy import WindowPolicy
from flodld.membership.snapshot import RootCause
from flodld.membership.window import JoinWindow


class RunVerdict(Protocol):
    """How a run ended (the Controller's `RunResult`)."""

    @property
    def verdict(self) -> Phase: ...

    @property
    def reason(self) -> str: ...

    @property
    def root_cause(self) -> RootCause | None: ...


class RunCore(Protocol):
    """What the window's parts share: the window, the clock, the counters, and `settle()` after each call."""

    @property
    def window(self) -> JoinWindow | None: ...

    @property
    def counters(self) -> ControllerCounters: ...

    @property
    def clock(self) -> Callable[[], float]: ...

    def settle(self) -> None:
        """Act on the window's phase (form and ship, or conclude); called after every window call."""


class AdmissionRun(RunCore, Protocol):
    """What `Admissions` (admission.py) asks of the run."""

    @property
    def storm_log(self) -> StormLog: ...

    @property
    def policy(self) -> WindowPolicy: ...

    @property
    def salt(self) -> bytes: ...

    @property
    def salt_hex(self) -> str: ...

    @property
    def run_id(self) -> str: ...

    @property
    def links(self) -> dict[str, HostLink]: ...

    @property
    def result(self) -> RunVerdict | None: ...

    def walk_in(self, host: str, ranks: tuple[int, ...]) -> None:
        """A host walked into the training run: its relay is expected and its WorldFormed goes out."""


class LossRun(RunCore, Protocol):
    """What `RankLosses` (losses.py) asks of the run."""

    @property
    def storm_log(self) -> StormLog: ...

    @property
    def options(self) -> ControllerOptions: ...

    @property
    def links(self) -> dict[str, HostLink]: ...

    @property
    def round_in_progress(self) -> Callable[[int], int | None]: ...


class ShipperRun(RunCore, Protocol):
    """What `WorldShipper` (shipper.py) asks of the run."""

    @property
    def options(self) -> ControllerOptions: ...

    @property
    def address(self) -> tuple[str, int] | None: ...

    @property
    def run_id(self) -> str: ...

    @property
    def links(self) -> dict[str, HostLink]: ...

    @property
    def tolerance(self) -> int: ...

    @property
    def kept(self) -> dict[str, HostLink]: ...  # hosts that answered this attempt's Reform (restarts)

    def link_closed(self, link: HostLink, why: str, *, lost: bool = False) -> None: ...

    def abort(self, reason: str) -> None: ...

    def announce(self, passed: Phase | None = None, why: str = "") -> None: ...


class PortRun(JoinRun, StatusSource, Protocol):
    """What `RunPort` (runport.py) asks of the run: the join channel's and the HTTP app's view of it, and the
    port's own. `listen()` sets `policy` (trust from the bound address) and `address`.
    """

    policy: WindowPolicy
    address: tuple[str, int] | None

    @property
    def options(self) -> ControllerOptions: ...

    @property
    def mux(self) -> PortMux: ...

    @property
    def store(self) -> StoreService: ...

    @property
    def run_id(self) -> str: ...

    @property
    def links(self) -> dict[str, HostLink]: ...

    @property
    def start_credential(self) -> str: ...


class StatusRun(RunCore, Protocol):
    """What `RunStatus` (runstatus.py) asks of the run."""

    @property
    def options(self) -> ControllerOptions: ...

    @property
    def policy(self) -> WindowPolicy: ...

    @property
    def run_id(self) -> str: ...

    @property
    def run_metrics(self) -> RunMetrics: ...

    @property
    def result(self) -> RunVerdict | None: ...

    @property
    def phase(self) -> Phase | None: ...

    @property
    def salt_hex(self) -> str: ...

    @property
    def start_credential(self) -> str: ...

    @property
    def started_at(self) -> float | None: ...

    @property
    def formed_at(self) -> float | None: ...

    @property
    def ended_at(self) -> float | None: ...


class DriverRun(Protocol):
    """What `WindowDriver` (driver.py) asks of the run: it opens the window and stamps the milestones."""

    window: JoinWindow | None
    started_at: float | None
    formed_at: float | None
    ended_at: float | None

    @property
    def options(self) -> ControllerOptions: ...

    @property
    def policy(self) -> WindowPolicy: ...

    @property
    def run_id(self) -> str: ...

    @property
    def address(self) -> tuple[str, int] | None: ...

    @property
    def clock(self) -> Callable[[], float]: ...

    @property
    def storm_log(self) -> StormLog: ...

    def root_cause(self) -> RootCause | None: ...

    def abort(self, reason: str) -> None: ...

    async def end_links(self, phase: Phase, reason: str) -> None:
        """A terminal phase: Abort (or, for a restart that keeps the links, Reform) down every live link."""
