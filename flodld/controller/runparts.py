"""What each of the run's parts asks of the run it serves (the Controller, flodld/controller/run.py, is one).

`Admissions` (admission.py), `RankLosses` (losses.py), `WorldShipper` (shipper.py), `RunPort` (runport.py),
`RunStatus` (runstatus.py) and `WindowDriver` (driver.py) each hold the run they work for and call on it,
through its own protocol here only, so none of them imports run.py (which imports them all). The Controller
satisfies every one structurally; mypy checks that where run.py builds each part with `self`. The shared
views (`RunView`, `RunMilestones`, `RunCore`) are declared once and each part's protocol adds its own. How a
run ends, `RunResult`, lives here too: the parts read it and the driver writes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from flodld.controller.join import HostLink, JoinRun
from flodld.controller.mux import PortMux
from flodld.controller.options import ControllerOptions
from flodld.controller.status.metrics import ControllerCounters, RunMetrics
from flodld.controller.status.snapshot import StormLog
from flodld.controller.status.source import StatusSource
from flodld.controller.store import StoreService
from flodld.membership.phase import Phase
from flodld.membership.policy import WindowPolicy
from flodld.membership.snapshot import RootCause
from flodld.membership.window import JoinWindow


@dataclass(frozen=True)
class RunResult:
    """How the run ended: `verdict` is done or failed; `reason` is the window's sentence."""

    verdict: Phase
    reason: str
    root_cause: RootCause | None = None  # the first observed rank failure (flodld/membership/rootcause.py)

    @property
    def ok(self) -> bool:
        return self.verdict is Phase.DONE


class RunView(Protocol):
    """What every part may read of the run: its options and id, the trust policy, the live host links and the
    storm log.
    """

    @property
    def options(self) -> ControllerOptions: ...

    @property
    def run_id(self) -> str: ...

    @property
    def policy(self) -> WindowPolicy: ...

    @property
    def links(self) -> dict[str, HostLink]: ...

    @property
    def storm_log(self) -> StormLog: ...


class RunMilestones(Protocol):
    """When the run started, formed its world and ended (None before each); `WindowDriver` stamps them."""

    @property
    def started_at(self) -> float | None: ...

    @property
    def formed_at(self) -> float | None: ...

    @property
    def ended_at(self) -> float | None: ...


class RunCore(RunView, Protocol):
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
    def salt(self) -> bytes: ...

    @property
    def salt_hex(self) -> str: ...

    @property
    def result(self) -> RunResult | None: ...

    def walk_in(self, host: str, ranks: tuple[int, ...], rides: str | None = None) -> None:
        """A host walked into the training run: its relay (or its ride on `rides`'s relay) is expected and
        its WorldFormed goes out.
        """


class LossRun(RunCore, Protocol):
    """What `RankLosses` (losses.py) asks of the run."""

    @property
    def round_in_progress(self) -> Callable[[int], int | None]: ...


class ShipperRun(RunCore, Protocol):
    """What `WorldShipper` (shipper.py) asks of the run."""

    @property
    def address(self) -> tuple[str, int] | None: ...

    @property
    def tolerance(self) -> int: ...

    @property
    def kept(self) -> dict[str, HostLink]: ...  # hosts that answered this attempt's Reform (restarts)

    def link_closed(self, link: HostLink, why: str, *, lost: bool = False) -> None: ...

    def abort(self, reason: str) -> None: ...

    def announce(self, passed: Phase | None = None, why: str = "") -> None: ...


class PortRun(JoinRun, StatusSource, RunView, Protocol):
    """What `RunPort` (runport.py) asks of the run: the join channel's and the HTTP app's view of it, and the
    port's own. `listen()` sets `policy` (trust from the bound address) and `address`.
    """

    policy: WindowPolicy
    address: tuple[str, int] | None

    @property
    def mux(self) -> PortMux: ...

    @property
    def store(self) -> StoreService: ...

    @property
    def start_credential(self) -> str: ...


class StatusRun(RunMilestones, RunCore, Protocol):
    """What `RunStatus` (runstatus.py) asks of the run."""

    @property
    def run_metrics(self) -> RunMetrics: ...

    @property
    def result(self) -> RunResult | None: ...

    @property
    def phase(self) -> Phase | None: ...

    @property
    def salt_hex(self) -> str: ...

    @property
    def start_credential(self) -> str: ...


class DriverRun(RunMilestones, RunView, Protocol):
    """What `WindowDriver` (driver.py) asks of the run: it opens the window and stamps the milestones."""

    window: JoinWindow | None
    started_at: float | None
    formed_at: float | None
    ended_at: float | None

    @property
    def address(self) -> tuple[str, int] | None: ...

    @property
    def clock(self) -> Callable[[], float]: ...

    def root_cause(self) -> RootCause | None: ...

    def abort(self, reason: str) -> None: ...

    async def end_links(self, phase: Phase, reason: str) -> None:
        """A terminal phase: Abort (or, for a restart that keeps the links, Reform) down every live link."""
