"""The Controller: one run on one port. It owns the JoinWindow and coordinates everything that acts on it.

Standalone (`fdl run`, `flodld serve --once`) it binds the port itself; under `flodld serve` the
`Service` (controller/service.py) owns the port, the mux and the HTTP app for the daemon's whole
life and hands each run's Controller the mux: the Controller then only registers its join and
rendezvous handlers on it for the run, and `close()` takes them off again.

The Controller is the run's lifecycle (listen, start, wait, abort, close), the keeper of its join links
(restarts that keep them: Reform, `take_kept_links`, `adopt`) and the face its parts and the Service see.
Its jobs each have a collaborator:

- `WindowDriver` (driver.py): opens the window, re-evaluates it every `tick_interval`, settles events at
  once (`settle`), announces each phase change, and writes the verdict (`RunResult`);
- `Admissions` (admission.py): the join channel's refusals and admissions (hellos settle once per turn);
- `RankLosses` (losses.py): rank exits, ranks declared dead, link ends, and the tolerance they count against;
- `WorldShipper` (shipper.py): WorldFormed to every host at formation, Abort down every link at a failure;
- `RunPort` (runport.py): its channels (`RUN_CHANNELS`), its HTTP app, binding, trust from the address;
- `RunStatus` (runstatus.py): state.json, the page, /metrics, the run record and `POST /start`.

The join channel sees the Controller as `JoinRun`, the HTTP app as a `StatusSource`: it hands each of
those calls on to its collaborator. Join and refusal log lines go through a `StormLog` (coalesced past a
burst).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

from flodld.config.models import ClusterConfig
from flodld.controller.admission import Admissions
from flodld.controller.driver import PhaseListener, WindowDriver
from flodld.controller.join import HostLink, JoinProtocol
from flodld.controller.losses import RankLosses
from flodld.controller.mux import ChannelHandler, PortMux
from flodld.controller.options import ControllerOptions
from flodld.controller.runparts import RunResult
from flodld.controller.runport import RUN_CHANNELS as RUN_CHANNELS
from flodld.controller.runport import VERDICT_LINGER_SECS, RunPort, is_ip_literal, own_mux
from flodld.controller.runport import RunChannel as RunChannel
from flodld.controller.runport import serve_http as serve_http
from flodld.controller.runstatus import RunStatus
from flodld.controller.shipper import WorldShipper
from flodld.controller.status.metrics import ControllerCounters, RunMetrics
from flodld.controller.status.snapshot import DEFAULT_MEMBERS, MemberRange, StormLog
from flodld.controller.status.source import HttpAnswer
from flodld.controller.store import StoreService
from flodld.membership.phase import Phase
from flodld.membership.policy import TrustMode
from flodld.membership.snapshot import RootCause, RunRecord
from flodld.membership.switch import start_credential
from flodld.membership.window import JoinWindow
from flodld.wire.join import Accept, Hello, RankExited, Reject
from flodld.wire.magic import Channel
from flodld.wire.salt import OPEN_ADMISSION_KEY, new_salt, salt_from_hex, salt_to_hex

log = logging.getLogger("flodld.controller")


class Controller:
    """Programmatic API: `await start()`, then `await wait()`; `await stop(reason)` aborts."""

    def __init__(
        self,
        config: ClusterConfig | ControllerOptions,
        *,
        salt: bytes | None = None,
        probed: Mapping[str, int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        mux: PortMux | None = None,
        address: tuple[str, int] | None = None,
    ) -> None:
        """`mux` and `address`: a port someone else bound and keeps (the Service); both or neither."""
        if (mux is None) != (address is None):
            raise ValueError("a borrowed mux comes with the address it is bound to")
        self.options = config if isinstance(config, ControllerOptions) else ControllerOptions.from_cluster(
            config, probed=probed
        )
        options = self.options
        # Checked now with the configured bind when it is an IP literal (a contradiction fails before the
        # port is touched), and again in `listen()` with the address the socket really has.
        configured = options.effective_bind_host
        self.port = RunPort(self, borrowed=mux is not None, bound=address)
        self.policy = self.port.policy_for(configured if is_ip_literal(configured) else None)
        if options.join.token is not None:
            self.salt = salt_from_hex(options.join.token)
        else:
            self.salt = salt if salt is not None else new_salt()
        self.run_id = options.run_id or secrets.token_hex(8)
        self.clock = clock
        self.counters = mux.counters if mux is not None else ControllerCounters()
        self.mux = mux or own_mux(options, self.counters)
        self.store = StoreService(self.run_id, self.salt, self.counters)
        self.run_metrics = RunMetrics()  # the data plane's tally of this run (/metrics)
        # The averaging round in progress (the data plane sets it when it is built): named with each loss.
        self.round_in_progress: Callable[[int], int | None] = lambda rank: None
        # Growth (docs/elastic-averaging.md): the data plane expects a walk-in's relay (set when it is built).
        self.expect_walk_in: Callable[[str, tuple[int, ...], str | None], str | None] = (
            lambda host, ranks, rides: None
        )
        self.window: JoinWindow | None = None
        self.address: tuple[str, int] | None = None
        self.links: dict[str, HostLink] = {}
        # Restarts that keep the join links (docs/restarts.md): with `keep_links` a failure sends Reform
        # instead of Abort, and the hosts that answer Stopped wait in `kept` for the next attempt
        # (`take_kept_links`).
        self.keep_links = False
        self.kept: dict[str, HostLink] = {}
        self._reforming: set[str] = set()
        self._reform_progress = asyncio.Event()  # set at each Stopped: the Reform wait looks again
        self.storm_log = StormLog(log)
        self.admissions = Admissions(self)
        self.losses = RankLosses(self)
        self.shipper = WorldShipper(self)
        self.status = RunStatus(self)
        self.state_cache = self.status.state_cache
        self.render_budget = self.status.render_budget
        self.driver = WindowDriver(self, shipper=self.shipper, state_cache=self.state_cache)
        # Wall-clock (unix seconds) milestones for the run's history record.
        self.started_at: float | None = None
        self.formed_at: float | None = None
        self.ended_at: float | None = None

    # --- public API ----------------------------------------------------------------------------

    @property
    def salt_hex(self) -> str:
        """The session salt: the run's master key. Never the start credential, never on the HTTP surface."""
        return salt_to_hex(self.salt)

    @property
    def start_credential(self) -> str:
        """What `POST /start` accepts from a caller that is not a local CLI: derived from the salt (not it)
        and this run's id, so no other run accepts it.
        """
        return start_credential(self.salt, self.run_id)

    @property
    def join_key(self) -> bytes:
        """The key of pre-admission join frames: the salt, or the public key under open admission."""
        return self.salt if self.policy.trust is TrustMode.PRESHARED else OPEN_ADMISSION_KEY

    @property
    def phase(self) -> Phase | None:
        return self.window.phase if self.window is not None else None

    @property
    def result(self) -> RunResult | None:
        return self.driver.result

    def host_key(self, host: str) -> bytes | None:
        """The key derived at `host`'s admission (flodld.wire.hostkey); None without a live join link."""
        link = self.links.get(host)
        return link.host_key if link is not None and link.host_key else None

    # --- JoinRun (the join channel) -----------------------------------------------------------

    @property
    def advertised_host(self) -> str:
        return self.options.advertised_host

    @property
    def handshake_timeout(self) -> float:
        return self.options.handshake_timeout

    @functools.cached_property
    def link_keepalive_secs(self) -> float:
        """Once per run (it was read per admission: an env lookup and a parse each time)."""
        return self.options.link_keepalive_secs * self.options.timeout_scale

    def release_gate(self, peer: str) -> None:
        self.mux.release_gate(peer)

    def refuse(self, peer: str, code: str, reason: str) -> None:
        self.admissions.refuse(peer, code, reason)

    def admit(self, hello: Hello, link: HostLink) -> Accept | Reject:
        return self.admissions.admit(hello, link)

    def rank_exited(self, link: HostLink, rank: int, code: int, report: RankExited | None = None) -> None:
        self.losses.rank_exited(link, rank, code, report)

    def link_closed(self, link: HostLink, why: str, *, lost: bool = False) -> None:
        self.losses.link_closed(link, why, lost=lost)

    def walk_in(self, host: str, ranks: tuple[int, ...], rides: str | None = None) -> None:
        """A host walked into the training run (its Accept is on the link): the data plane expects its relay
        (or its ranks on the relay of `rides`, a healed slot's host, when it can take them), and its
        WorldFormed goes out now.
        """
        log.info("event=walk_in host=%s ranks=%s", host, list(ranks))
        riding = self.expect_walk_in(host, ranks, rides)
        self.driver.spawn(self.shipper.ship_walk_in(host, rides=riding))

    def ranks_entered(self, ranks: tuple[int, ...], in_round: int) -> None:
        """The data plane let a walk-in's ranks into the averaging at `in_round` (state.json `joins`)."""
        log.info("event=ranks_entered ranks=%s round=%d", list(ranks), in_round)
        if self.window is not None:
            self.window.entered(ranks, in_round)

    def host_stopped(self, link: HostLink) -> None:
        """A host answered this attempt's Reform: off this run's links, kept for the next attempt."""
        if link.host not in self._reforming or self.links.get(link.host) is not link:
            return
        self._reforming.discard(link.host)
        del self.links[link.host]
        self.kept[link.host] = link
        log.info("event=host_kept host=%s peer=%s", link.host, link.peer)
        self._reform_progress.set()

    # --- restarts that keep the links ------------------------------------------------------------

    def take_kept_links(self) -> list[HostLink]:
        """The hosts still linked after this failed attempt's Reform (theirs to hand to the next attempt's
        `adopt`, or to close); this run forgets them.
        """
        kept = [link for link in self.kept.values() if not link.closed.is_set()]
        self.kept.clear()
        return kept

    def adopt(self, links: list[HostLink]) -> list[str]:
        """Re-admit hosts kept linked from the attempt before into this attempt's window, at once, with the
        hellos they first sent; the hosts re-admitted (a link that ended meanwhile, or a host the window
        refuses now, is closed and left out).
        """
        assert self.window is not None, "adopt() after start(): the window must be open"
        admitted: list[str] = []
        for old in links:
            stream = old.stream
            link = stream.hand_over(self) if isinstance(stream, JoinProtocol) else None
            if link is None or link.hello is None:
                old.stream.close()
                continue
            outcome = self.admissions.admit(link.hello, link, kept=True)
            if isinstance(outcome, Reject):
                with contextlib.suppress(ConnectionError, OSError):
                    stream.send_nowait(outcome)
                stream.close()
                continue
            admitted.append(link.host)
        log.info("event=hosts_readmitted hosts=%d of=%d", len(admitted), len(links))
        return admitted

    # --- RankLosses: a subsystem's lost rank, the shipper's tolerance ----------------------------

    def rank_lost(self, rank: int, why: str) -> None:
        self.losses.rank_lost(rank, why)

    @property
    def tolerance(self) -> int:
        return self.losses.tolerance

    # --- StatusSource and the Service's reads (RunStatus) ---------------------------------------

    def state_version(self) -> tuple[int, bool] | None:
        return self.status.state_version()

    def state_json(self, members: MemberRange = DEFAULT_MEMBERS) -> dict[str, Any] | None:
        return self.status.state_json(members)

    def state_body(self, members: MemberRange = DEFAULT_MEMBERS, source: str | None = None) -> bytes | None:
        return self.status.state_body(members, source)

    def status_html(self, source: str | None = None) -> bytes:
        return self.status.status_html(source)

    def root_cause(self) -> RootCause | None:
        return self.status.root_cause()

    def run_record(self) -> RunRecord:
        return self.status.run_record()

    def window_refusals(self) -> Mapping[str, int]:
        return self.status.window_refusals()

    def metrics_text(
        self, *, runs: Mapping[str, int] | None = None, past_refusals: Mapping[str, int] | None = None
    ) -> str:
        return self.status.metrics_text(runs=runs, past_refusals=past_refusals)

    def request_start(self, *, local: bool, token: str | None) -> HttpAnswer:
        return self.status.request_start(local=local, token=token)

    # --- lifecycle ------------------------------------------------------------------------------

    def on_phase(self, listener: PhaseListener) -> None:
        """Call `listener(phase, reason)` on every phase change (the daemon feeds systemd STATUS=)."""
        self.driver.on_phase(listener)

    async def listen(self) -> tuple[str, int]:
        """Bind the port (or take the Service's) and serve; the window is not open yet (state.json: 503)."""
        return await self.port.listen()

    def register_channels(self, handlers: Mapping[Channel, ChannelHandler]) -> None:
        """Serve each channel (DATA, CONTROL) with its `handler(reader, writer)` until the run closes."""
        self.port.register_channels(handlers)

    async def start(self) -> tuple[str, int]:
        """Listen, open the join window and start the timer; returns the bound (host, port)."""
        address = await self.listen()
        if self.window is None:
            self.driver.open()
        return address

    async def wait(self) -> RunResult:
        """Until the run is done or failed. The port stays up; call `close()` (or `stop`) after."""
        return await self.driver.wait()

    async def linger_for_readers(self, seconds: float = VERDICT_LINGER_SECS) -> None:
        """Before `close()` of a one-run controller: see `RunPort.linger_for_readers`."""
        await self.port.linger_for_readers(seconds)

    def abort(self, reason: str) -> None:
        """Fail the run now (Abort goes down every link); `wait()` returns once they are sent."""
        if self.driver.result is not None:
            return
        if self.window is None:
            self.driver.conclude(RunResult(Phase.FAILED, reason))
        else:
            self.window.abort(reason, self.clock())
            self.settle()

    async def stop(self, reason: str) -> RunResult:
        """Abort the run unless it already ended, wait for the Aborts to go out, then close the port."""
        self.abort(reason)
        result = await self.driver.wait()
        await self.close()
        return result

    async def close(self) -> None:
        """Stop listening and end every connection (HTTP included). On a borrowed port: take this run's
        handlers off the mux and close its remaining join links; the port and the mux stay up.
        """
        await self.driver.stop()
        await self.port.close()

    async def release_port(self) -> tuple[PortMux, tuple[str, int]]:
        """Close this run but keep its port listening, the kept links on it, for the next attempt's
        Controller (`Controller(options, mux=..., address=...)`, then `take_over_port()`); returns the mux
        and the address.
        """
        assert self.address is not None, "release_port() after start()"
        await self.driver.stop()
        await self.port.release()
        return self.mux, self.address

    async def take_over_port(self) -> None:
        """This run owns the port `release_port()` lent it: it serves HTTP, and closes the port at close()."""
        await self.port.take_over()

    # --- the window (WindowDriver) ----------------------------------------------------------------

    def settle(self) -> None:
        """Act on the window's phase: form and ship, or conclude. Call after every window call."""
        self.driver.settle()

    def announce(self, passed: Phase | None = None, why: str = "") -> None:
        """Tell the log and listeners about a new phase (`passed`: one the window went through)."""
        self.driver.announce(passed, why)

    async def end_links(self, phase: Phase, reason: str) -> None:
        """The run ended (WindowDriver, before the verdict): a failure sends Abort down every live link, or
        Reform where a restart keeps the links (the hosts that answer wait in `kept`).
        """
        links = [link for link in self.links.values() if not link.closed.is_set()]
        if phase is Phase.FAILED and self.keep_links:
            log.error("event=run_failed reason=%r hosts_reformed=%d", reason, len(links))
            self._reforming = {link.host for link in links}
            await self.shipper.reform(links, reason, self._reform_progress)
            self._reforming.clear()
        elif phase is Phase.FAILED:
            log.error("event=run_failed reason=%r hosts_aborted=%d", reason, len(links))
            await self.shipper.abort(links, reason)
        else:
            log.info("event=run_done reason=%r", reason)
