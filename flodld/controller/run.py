"""The Controller: one run on one port. It owns the JoinWindow and everything that acts on it.

Standalone (`fdl run`, `flodld serve --once`) it binds the port itself; under `flodld serve` the
`Service` (controller/service.py) owns the port, the mux and the HTTP app for the daemon's whole
life and hands each run's Controller the mux: the Controller then only registers its join and
rendezvous handlers on it for the run, and `close()` takes them off again.

All window calls happen on the event loop thread, synchronously, so an admission and its Accept
write are never interleaved with another admission: ranks stay contiguous without a lock. A
timer task re-evaluates the verdict every `tick_interval`; a hello is decided at once but the
verdict after it is evaluated once per event-loop turn (a storm of hellos costs one evaluation
per turn, and the window still closes at the hello that reaches the target); other events
settle at once. When the window forms, WorldFormed goes to every host in admission order (each
carries only that host's part: O(hosts) bytes in all); a failure to build or send it fails the
run with the reason. When the run ends, failed runs send Abort down every open link.

state.json comes from a `StateCache` (one build per change and per 200 ms, encoded once for all
readers); join and refusal log lines go through a `StormLog` (coalesced past a burst).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import json
import logging
import secrets
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import web

from flodld.config.models import ClusterConfig
from flodld.controller.addresses import CleartextWarner, is_loopback_address
from flodld.controller.http import NO_STATE, HttpRefusalLog, build_app
from flodld.controller.join import CHANNEL as JOIN_CHANNEL
from flodld.controller.join import HostLink, JoinProtocol, JoinRun
from flodld.controller.metrics import ControllerCounters, RunMetrics, RunSeries, render_prometheus
from flodld.controller.mux import ChannelHandler, ChannelProtocolFactory, PortMux, PreAdmissionGate
from flodld.controller.options import ControllerOptions
from flodld.controller.page import render_page
from flodld.controller.snapshot import (
    DEFAULT_MEMBERS,
    CachedState,
    MemberRange,
    MemberRows,
    RenderBudget,
    StateCache,
    StormLog,
)
from flodld.controller.source import HttpAnswer, StatusSource
from flodld.controller.store import StoreService
from flodld.membership.ledger import Member, Refused, World
from flodld.membership.phase import TERMINAL_PHASES, Phase
from flodld.membership.policy import PolicyError, TrustMode, WindowPolicy, derive_policy, is_loopback_literal
from flodld.membership.rootcause import Failure
from flodld.membership.snapshot import LinkState, RankExit, RootCause, RunRecord
from flodld.membership.switch import Armed, forbidden, start_credential, token_matches
from flodld.membership.window import JoinWindow, LinkOutcome, MemberView
from flodld.wire.errors import WireError
from flodld.wire.hostkey import join_host_key
from flodld.wire.join import (
    Abort,
    Accept,
    Hello,
    KillRank,
    RankExited,
    Reject,
    RelaySpec,
    WorldEnvelope,
    WorldFormed,
)
from flodld.wire.magic import Channel
from flodld.wire.salt import OPEN_ADMISSION_KEY, new_salt, salt_from_hex, salt_to_hex

log = logging.getLogger("flodld.controller")

SHIP_TIMEOUT_SECS = 30.0
ABORT_TIMEOUT_SECS = 5.0
REPORT_GRACE_SECS = 1.5  # after a failure's Abort: the hosts' time to report their ranks' exits (scaled)
# How long a one-run controller keeps answering after its verdict when someone polled it over HTTP:
# longer than `fdl status --watch`'s default 1 s interval, so the watcher's next poll shows the verdict.
VERDICT_LINGER_SECS = 2.0
SHIP_CHUNK_HOSTS = 256  # WorldFormed writes per event-loop turn: HTTP and links are served in between

PhaseListener = Callable[[Phase, str], object]


@dataclass(frozen=True)
class RunChannel:
    """How a run serves one channel of the controller port: its handler, bound to the run."""

    handler: Callable[[Controller], ChannelHandler] | None = None
    hold_gate: bool = False
    """The handler releases the peer's pre-admission slot itself (`PortMux.register`)."""
    protocol: Callable[[Controller], ChannelProtocolFactory] | None = None
    """Served by a protocol per connection instead of a handler (`PortMux.register_protocol`: the protocol
    holds and releases the slot)."""


def _join_protocol(run: Controller) -> ChannelProtocolFactory:
    join_run: JoinRun = run  # the join channel knows the run only through this protocol

    def factory(mux: PortMux, peer: str) -> JoinProtocol:
        return JoinProtocol(join_run, mux, peer)

    return factory


def _store_handler(run: Controller) -> ChannelHandler:
    return run.store.handle


RUN_CHANNELS: Final[Mapping[Channel, RunChannel]] = {
    # The join handshake keeps the peer's gate slot until the window decided its hello.
    # Served by a protocol per connection (no stream, task or coroutine while the handshake is in flight).
    Channel.JOIN: RunChannel(protocol=_join_protocol),
    Channel.RENDEZVOUS: RunChannel(_store_handler),
}
"""The channels a run serves from `listen()` on, whoever bound the port. Channels that exist only once
the world formed (the data plane's DATA/CONTROL) come through `Controller.register_channels`."""


_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


def render_status(build: CachedState) -> bytes:
    """The status page for one build (its default member page)."""
    return render_page(build.page_data(DEFAULT_MEMBERS)).encode()


@dataclass(frozen=True)
class RunResult:
    """How the run ended: `verdict` is done or failed; `reason` is the window's sentence."""

    verdict: Phase
    reason: str
    root_cause: RootCause | None = None  # the first observed rank failure (flodld/membership/rootcause.py)

    @property
    def ok(self) -> bool:
        return self.verdict is Phase.DONE


async def serve_http(source: StatusSource, mux: PortMux, counters: ControllerCounters) -> web.AppRunner:
    """The port's HTTP side: `source`'s app, set up and handed to `mux` (which starts listening), each
    malformed request a counted warning (`HttpRefusalLog`). The caller cleans the runner up.

    A source with `state_body` (the cached bytes) also lets the mux answer a plain `GET /state.json` itself,
    from those same bytes, without aiohttp (`flodld.controller.fastget`).
    """
    runner = web.AppRunner(
        build_app(source), access_log=None, handle_signals=False, logger=HttpRefusalLog(counters.dropped)
    )
    await runner.setup()
    mux.set_http(runner.server, state_body=getattr(source, "state_body", None))
    return runner


STRAGGLERS_SHOWN: Final = 5
"""The slowest ranks state.json `stragglers` lists."""


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
        self.policy = self._derive_policy(configured if _is_ip_literal(configured) else None)
        if options.join.token is not None:
            self.salt = salt_from_hex(options.join.token)
        else:
            self.salt = salt if salt is not None else new_salt()
        self.run_id = options.run_id or secrets.token_hex(8)
        self.clock = clock
        self._borrowed = mux is not None
        self._bound = address
        self.counters = mux.counters if mux is not None else ControllerCounters()
        self.mux = mux or PortMux(
            self.counters,
            magic_deadline=options.magic_deadline,
            http_lifetime=options.http_lifetime,
            gate=PreAdmissionGate(options.max_pending_per_peer, exempt_loopback=not options.limit_loopback),
            warner=CleartextWarner("controller"),
            link_keepalive=options.link_keepalive_secs * options.timeout_scale,
        )
        self.store = StoreService(self.run_id, self.salt, self.counters)
        self.run_metrics = RunMetrics()  # the data plane's tally of this run (/metrics)
        # The averaging round in progress (the data plane sets it when it is built): named with each loss.
        self.round_in_progress: Callable[[int], int | None] = lambda rank: None
        self.window: JoinWindow | None = None
        self.address: tuple[str, int] | None = None
        self._links: dict[str, HostLink] = {}
        self._channels: set[Channel] = set()  # on the mux for this run; taken off at close()
        self._runner: web.AppRunner | None = None
        self._driver: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._result: RunResult | None = None
        self._done = asyncio.Event()
        self._finishing = False
        self._last_phase: Phase | None = None
        self._phase_listeners: list[PhaseListener] = []
        self._settle_pending = False
        self.storm_log = StormLog(log)
        self.render_budget = RenderBudget(on_refused=self._count_busy)
        self.state_cache = StateCache(self._build_state, self.state_version, budget=self.render_budget)
        # host -> (member, ranks, link, its state.json row): a row is encoded again only when one changed.
        self._rows: dict[str, tuple[Member, tuple[int, ...], LinkState, bytes]] = {}
        self.row_encodes = 0
        # Wall-clock (unix seconds) milestones for the run's history record.
        self.started_at: float | None = None
        self.formed_at: float | None = None
        self.ended_at: float | None = None

    def _derive_policy(self, bound_address: str | None) -> WindowPolicy:
        options = self.options
        return derive_policy(
            options.join, capacity=options.capacity, loopback_bind=options.wants_loopback,
            averaging=options.averaging, bound_address=bound_address, preshared=options.preshared,
        )

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
        return self._result

    def register_channels(self, handlers: Mapping[Channel, ChannelHandler]) -> None:
        """Serve each channel (DATA, CONTROL) with its `handler(reader, writer)` until the run closes; the
        magic is already consumed.
        """
        for channel in handlers:
            if channel in RUN_CHANNELS or channel is Channel.HTTP:
                raise ValueError(f"the {channel.value} channel is served by the controller itself")
        for channel, handler in handlers.items():
            self._serve(channel, handler)

    def _serve(self, channel: Channel, handler: ChannelHandler, *, hold_gate: bool = False) -> None:
        self.mux.register(channel, handler, hold_gate=hold_gate)
        self._channels.add(channel)

    def _serve_run_channels(self) -> None:
        for channel, spec in RUN_CHANNELS.items():
            if spec.protocol is not None:
                self.mux.register_protocol(channel, spec.protocol(self))
                self._channels.add(channel)
            else:
                assert spec.handler is not None
                self._serve(channel, spec.handler(self), hold_gate=spec.hold_gate)

    def host_key(self, host: str) -> bytes | None:
        """The key derived at `host`'s admission (flodld.wire.hostkey); None without a live join link."""
        link = self._links.get(host)
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

    def on_phase(self, listener: PhaseListener) -> None:
        """Call `listener(phase, reason)` on every phase change (the daemon feeds systemd STATUS=)."""
        self._phase_listeners.append(listener)

    async def listen(self) -> tuple[str, int]:
        """Bind the port and serve HTTP; the window is not open yet (state.json answers 503)."""
        if self.address is not None:
            return self.address
        if self._borrowed:
            return self._listen_on_borrowed_port()
        self._runner = await serve_http(self, self.mux, self.counters)
        self._serve_run_channels()
        address = await self.mux.start(self.options.effective_bind_host, self.options.port)
        try:
            # Trust follows the addresses the sockets really have (a hostname may resolve anywhere, and to
            # several addresses: one that is not loopback decides).
            hosts = self.mux.bound_hosts() or [address[0]]
            self.policy = self._derive_policy(
                next((h for h in hosts if not is_loopback_literal(h)), hosts[0])
            )
        except PolicyError:
            await self.mux.close()
            await self._runner.cleanup()
            self._runner = None
            raise
        self.address = address
        log.info("event=listening bind=%s port=%d run_id=%s", address[0], address[1], self.run_id)
        self._log_admission()
        return self.address

    def _log_admission(self) -> None:
        assert self.address is not None
        if self.policy.warning:
            log.warning(
                "event=open_admission_warning bind=%s detail=%r", self.address[0], self.policy.warning
            )
        if self.options.start_switch and self.policy.start.value != "auto":
            log.info(
                "event=start_credential value=%s run_id=%s use='fdl start --token <value>' (not the join "
                "token; equal to `fdl start --derive-credential` fed the join token; for this run only)",
                self.start_credential,
                self.run_id,
            )

    def _listen_on_borrowed_port(self) -> tuple[str, int]:
        """Under the Service: the port is bound already.

        Derive trust from it and serve this run's channels.
        """
        assert self._bound is not None
        hosts = self.mux.bound_hosts() or [self._bound[0]]
        self.policy = self._derive_policy(next((h for h in hosts if not is_loopback_literal(h)), hosts[0]))
        self._serve_run_channels()
        self.address = self._bound
        log.info(
            "event=run_listening bind=%s port=%d run_id=%s", self.address[0], self.address[1], self.run_id
        )
        self._log_admission()
        return self.address

    async def start(self) -> tuple[str, int]:
        """Listen, open the join window and start the timer; returns the bound (host, port)."""
        address = await self.listen()
        if self.window is None:
            self._open_window()
            self._driver = asyncio.get_running_loop().create_task(self._drive())
        return address

    async def wait(self) -> RunResult:
        """Until the run is done or failed. The port stays up; call `close()` (or `stop`) after."""
        await self._done.wait()
        assert self._result is not None
        return self._result

    async def linger_for_readers(self, seconds: float = VERDICT_LINGER_SECS) -> None:
        """Before `close()` of a one-run controller: if anyone read the state over HTTP during the run
        (`fdl status --watch`, the status page), keep answering `seconds` more so its next poll sees the
        verdict instead of a closed port. Nobody polled: returns at once.
        """
        if self.counters.connections[Channel.HTTP.value]:
            await asyncio.sleep(seconds)

    def abort(self, reason: str) -> None:
        """Fail the run now (Abort goes down every link); `wait()` returns once they are sent."""
        if self._result is not None:
            return
        if self.window is None:
            self._conclude(RunResult(Phase.FAILED, reason))
        else:
            self.window.abort(reason, self.clock())
            self._settle()

    async def stop(self, reason: str) -> RunResult:
        """Abort the run unless it already ended, wait for the Aborts to go out, then close the port."""
        self.abort(reason)
        await self._done.wait()
        await self.close()
        assert self._result is not None
        return self._result

    async def close(self) -> None:
        """Stop listening and end every connection (HTTP included). On a borrowed port: take this run's
        handlers off the mux and close its remaining join links; the port and the mux stay up.
        """
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
        for task in list(self._background):
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(task, ABORT_TIMEOUT_SECS)
        if self._borrowed:
            for channel in sorted(self._channels):
                self.mux.unregister(channel)
            self._channels.clear()
            for link in list(self._links.values()):
                link.stream.close()
            return
        await self.mux.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # --- the window ----------------------------------------------------------------------------

    def _open_window(self) -> None:
        assert self.address is not None
        controller = _host_port(self.options.advertised_host, self.address[1])
        self.window = JoinWindow(
            self.policy,
            self.options.roster,
            self.clock(),
            run_id=self.run_id,
            controller=controller,
            tolerance=self.options.tolerance,
            tolerance_percent=self.options.tolerance_percent,
            declared=self.options.declared_ranks,
        )
        self.started_at = time.time()
        p = self.policy
        log.info(
            "event=window_open quorum=%d target=%s window_secs=%g cap_secs=%g start=%s admission=%s",
            p.quorum,
            p.target,
            p.window_secs,
            p.cap_secs,
            p.start.value,
            "pre-shared" if p.trust is TrustMode.PRESHARED else "open",
        )
        self._announce()

    async def _drive(self) -> None:
        # Events settle the window when they happen (hellos: once per loop turn); this loop moves the clock.
        while self._result is None:
            assert self.window is not None
            self.window.tick(self.clock())
            self._settle()
            self.storm_log.tick()
            await asyncio.sleep(self.options.tick_interval)

    def _settle_this_turn(self) -> None:
        """Evaluate the verdict once at the end of this event-loop turn, however many hellos it admitted."""
        if not self._settle_pending:
            self._settle_pending = True
            asyncio.get_running_loop().call_soon(self._turn_settle)

    def _turn_settle(self) -> None:
        self._settle_pending = False
        window = self.window
        if window is None or self._result is not None:
            return
        window.tick(self.clock())
        self._settle()

    def _settle(self) -> None:
        """Act on the window's phase: form and ship, or conclude. Call after every window call."""
        window = self.window
        assert window is not None
        if window.phase is Phase.FORMING and window.world is None:
            world = window.form(self.clock())
            self.formed_at = time.time()
            self.storm_log.flush()
            log.info(
                "event=world_formed world_size=%d hosts=%d reason=%r",
                world.world_size,
                len(world.hosts),
                window.reason,
            )
            self._spawn(self._ship(world))
        self._announce()
        if window.phase in TERMINAL_PHASES and not self._finishing:
            self._finishing = True
            self._spawn(self._finish(window.phase, window.final_reason))

    def _announce(self, passed: Phase | None = None, why: str = "") -> None:
        """Tell the log and listeners about a new phase (`passed`: one the window went through)."""
        phase = passed or self.phase
        if phase is None or phase is self._last_phase:
            return
        self._last_phase = phase
        self.state_cache.clear()  # a phase change shows at once; member churn at most once per interval
        reason = why or (self.window.reason if self.window is not None else "")
        log.info("event=phase phase=%s reason=%r", phase.value, reason)
        for listener in self._phase_listeners:
            try:
                listener(phase, reason)
            except Exception:  # a broken observer must not break admission or formation
                log.exception("event=phase_listener_failed phase=%s", phase.value)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(self._background_ended)

    def _background_ended(self, task: asyncio.Task[None]) -> None:
        """A formation or finishing task that crashed fails the run with the reason: never a silent stall."""
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        log.error(
            "event=internal_error task=%s error=%r",
            task.get_coro().__qualname__,  # type: ignore[union-attr]
            error,
            exc_info=error,
        )
        if self._result is None:
            if self._finishing:  # _finish itself died: conclude without it
                self._conclude(RunResult(Phase.FAILED, f"internal error while finishing the run: {error!r}"))
            else:
                self.abort(f"internal error: {type(error).__name__}: {error}")

    # --- called by the join handler -----------------------------------------------------------

    def refuse(self, peer: str, code: str, reason: str) -> None:
        """Count and log a join attempt refused before it reached the ledger."""
        if self.window is not None:
            self.window.ledger.refuse(code, reason)
        else:
            self.counters.refusals[code] += 1
        self.storm_log.event(
            "join_refused",
            logging.WARNING,
            "event=join_refused peer=%s code=%s reason=%r",
            peer,
            code,
            reason,
            detail=lambda: f"peer={peer} code={code}",
        )

    def admit(self, hello: Hello, link: HostLink) -> Accept | Reject:
        """Decide a hello and, on admission, queue the Accept on the link in the same step."""
        window = self.window
        if window is None:
            self.refuse(link.peer, "window_not_open", "the join window is not open yet")
            return Reject(
                code="window_not_open", reason="the join window is not open yet; dial again shortly"
            )
        now = self.clock()
        outcome = window.hello(hello, now, evaluate=False)
        if isinstance(outcome, Refused):
            code = outcome.code
            self.storm_log.event(
                "join_refused",
                logging.WARNING,
                "event=join_refused peer=%s host=%s code=%s reason=%r",
                link.peer,
                hello.host,
                code,
                outcome.reason,
                detail=lambda: f"peer={link.peer} host={hello.host} code={code}",
            )
            self._settle_this_turn()
            return Reject(code=outcome.code, reason=outcome.reason[:1024])
        open_admission = self.policy.trust is TrustMode.OPEN
        accept = Accept(
            ranks=list(outcome.ranks),
            salt_hex=self.salt_hex if open_admission else None,
            formation_wait_secs=window.formation_wait_secs(now),
            run_id=self.run_id,
        )
        link.host_key = join_host_key(self.salt, host=hello.host, run_id=self.run_id, conn=link.stream.conn)
        link.stream.send_nowait(accept)
        self.counters.frame_out(JOIN_CHANNEL, 0)
        if open_admission:
            link.stream.rekey(self.salt)
        self._links[hello.host] = link
        joined = window.ledger.joined_ranks
        self.storm_log.event(
            "joined",
            logging.INFO,
            "event=joined host=%s peer=%s ranks=%s devices=%d variant=%s joined_ranks=%d target=%s quorum=%d",
            hello.host,
            link.peer,
            list(outcome.ranks),
            len(hello.devices),
            hello.variant,
            joined,
            self.policy.target,
            self.policy.quorum,
            detail=lambda: f"host={hello.host} joined_ranks={joined}",
        )
        self._settle_this_turn()
        return accept

    def rank_exited(self, link: HostLink, rank: int, code: int, report: RankExited | None = None) -> None:
        window = self.window
        if window is None or window.world is None or rank not in window.world.ranks.get(link.host, ()):
            log.warning(
                "event=rank_exit_ignored host=%s rank=%d code=%d reason=not this host's rank in a formed "
                "world",
                link.host,
                rank,
                code,
            )
            return
        if code:
            log.warning("event=rank_exited host=%s rank=%d code=%d", link.host, rank, code)
        else:  # clean exits of a large world arrive as a storm: coalesced past a burst
            self.storm_log.event(
                "rank_exited",
                logging.INFO,
                "event=rank_exited host=%s rank=%d code=%d",
                link.host,
                rank,
                code,
                detail=lambda: f"host={link.host} rank={rank}",
            )
        decided = window.phase in TERMINAL_PHASES
        failure = None
        if code:
            # The agent's clock at the exit orders failures across hosts; an older agent's report is
            # stamped at receipt.
            at = report.failed_at if report is not None and report.failed_at is not None else time.time()
            failure = Failure(
                host=link.host,
                rank=rank,
                code=code,
                failed_at=at,
                torn_down=report.torn_down if report is not None else False,
                error=report.error if report is not None else None,
                tail=report.tail if report is not None else None,
            )
        # After the verdict: recorded for state.json (and the root cause) only.
        window.rank_exited(rank, code, self.clock(), failure=failure, in_round=self.round_in_progress(rank))
        if not decided:
            self._settle()

    def rank_round(self, rank: int, in_round: int) -> None:
        """The data plane learned the round `rank` left in from its relay: a loss recorded with an estimate
        is corrected (state.json `losses`, the degraded verdict).
        """
        window = self.window
        if window is not None:
            window.correct_loss_round(rank, in_round)

    @property
    def survives_rank_loss(self) -> bool:
        """The run averages through the relays and tolerates losses: a rank can be lost without its host
        (the relays fold it out of the rounds; docs/elastic-averaging.md).
        """
        return self.options.cpu_averaging and self.tolerance > 0

    @property
    def tolerance(self) -> int:
        """Rank failures the run survives: the configured count, or once the world formed, its share of it."""
        window = self.window
        return window.tolerance if window is not None and window.world is not None else self.options.tolerance

    def rank_lost(self, rank: int, why: str) -> None:
        """A subsystem (the data plane's liveness) declared `rank` dead. In a run that survives a rank's loss
        only the rank is lost: it counts as failed, and its agent is told to dump its stack and kill it
        (KillRank). Otherwise its host counts as lost, so its unreported ranks fail the run beyond the
        tolerance, and the reason names the host.
        """
        window = self.window
        if window is None or window.world is None or window.phase in TERMINAL_PHASES:
            return
        host = next((h for h, ranks in window.world.ranks.items() if rank in ranks), None)
        if host is None:
            log.warning("event=rank_lost_ignored rank=%d reason=not in the formed world", rank)
            return
        if rank in window.rank_exits:
            return  # it already reported its exit; the silence is the exit
        log.warning("event=rank_lost host=%s rank=%d why=%r", host, rank, why)
        if self.survives_rank_loss:
            window.rank_declared_dead(rank, self.clock(), why=why, in_round=self.round_in_progress(rank))
            link = self._links.get(host)
            if link is not None and not link.closed.is_set() and window.phase not in TERMINAL_PHASES:
                try:
                    link.stream.send_nowait(KillRank(rank=rank, reason=why[:1024]))
                    self.counters.frame_out(JOIN_CHANNEL, 0)
                except (OSError, WireError) as error:
                    log.warning("event=kill_rank_unsent host=%s rank=%d error=%r", host, rank, str(error))
        else:
            self._estimate_loss_rounds(window, host)
            window.host_closed(host, self.clock(), lost=True, why=why)
        self._settle()

    def _estimate_loss_rounds(self, window: JoinWindow, host: str) -> None:
        """Before a host may be lost: the round each of its unreported ranks was in, as the data plane
        estimates it (its relay, gone with it, cannot say), for the losses the window then records.
        """
        world = window.world
        if world is None or window.phase in TERMINAL_PHASES:
            return
        for rank in world.ranks.get(host, ()):
            if rank not in window.rank_exits and rank not in window.losses:
                in_round = self.round_in_progress(rank)
                if in_round is not None:
                    window.correct_loss_round(rank, in_round)

    def link_closed(self, link: HostLink, why: str, *, lost: bool = False) -> None:
        """The host's join link ended (`lost`: it broke rather than closed cleanly). The window decides what
        that means (`JoinWindow.link_ended`); this logs it and acts on the phase.
        """
        if link.closed.is_set():
            return
        link.closed.set()
        if self._links.get(link.host) is link:
            del self._links[link.host]
        window = self.window
        if window is None:
            return
        self._estimate_loss_rounds(window, link.host)
        ended = window.link_ended(link.host, self.clock(), clean=not lost, why=why)
        if ended.outcome is LinkOutcome.IGNORED:
            if window.phase not in TERMINAL_PHASES:
                self._settle()
            return
        if ended.outcome is LinkOutcome.RETURNED:
            log.warning(
                "event=host_left_before_formation host=%s peer=%s ranks_returned=%s why=%r",
                link.host,
                link.peer,
                list(ended.ranks),
                ended.why,
            )
        elif ended.outcome is LinkOutcome.LOST:
            log.warning("event=host_link_closed host=%s lost=%s why=%r", link.host, True, ended.why)
        else:
            self.storm_log.event(
                "host_link_closed",
                logging.INFO,
                "event=host_link_closed host=%s lost=%s why=%r",
                link.host,
                False,
                ended.why,
                detail=lambda: f"host={link.host}",
            )
        self._settle()

    # --- formation and the end ----------------------------------------------------------------

    def _controller_host_for(self, link: HostLink) -> str:
        """The controller address as that host sees it: its tunnel's loopback end, or the advertised host."""
        if link.host in self.options.tunneled_hosts or _is_loopback(link.peer):
            return link.local_address if _is_loopback(link.local_address) else "127.0.0.1"
        return self.options.advertised_host

    def _envelope_template(self, world: World) -> WorldEnvelope:
        """The parts every host's envelope shares (the env included), validated once. Each envelope is O(1)
        in the world's size: no host list.
        """
        assert self.address is not None
        first = world.hosts[0]
        return WorldEnvelope(
            run_id=self.run_id,
            world_size=world.world_size,
            ranks=list(world.ranks[first]),
            local_world_size=len(world.ranks[first]),
            controller_host=self.options.advertised_host,
            controller_port=self.address[1],
            averaging=self.options.averaging,
            backend=self.options.backend,
            env=dict(self.options.env),
            restart_count=self.options.restart_count,
            max_restarts=self.options.max_restarts,
        )

    def _envelope(self, template: WorldEnvelope, world: World, host: str, link: HostLink) -> WorldEnvelope:
        """`host`'s envelope: the template with only already-checked fields swapped."""
        ranks = list(world.ranks[host])
        return template.model_copy(
            update={
                "ranks": ranks,
                "local_world_size": len(ranks),
                "controller_host": self._controller_host_for(link),
            }
        )

    def _relay_spec(self) -> RelaySpec | None:
        if not self.options.cpu_averaging:
            return None
        assert self.address is not None
        port = self.address[1]
        return RelaySpec(
            data_port=port,
            control_port=port,
            fold=self.options.fold,
            cadence=self.options.cadence,
            tolerance=self.tolerance,
            straggler_timeout=self.options.straggler_timeout,
        )

    async def _ship(self, world: World) -> None:
        """WorldFormed to every host in admission order, then training (or failure for lost hosts).

        A WorldFormed that cannot be built or encoded fails the run with the reason (never a stall in
        `forming`); a host whose link is gone by now is that host's loss, as on any write failure.
        """
        sent: list[HostLink] = []
        try:
            relay = self._relay_spec()
            template = self._envelope_template(world) if world.hosts else None
            for index, host in enumerate(world.hosts):
                if index and index % SHIP_CHUNK_HOSTS == 0:
                    await asyncio.sleep(0)  # a world of 10,000 hosts must not hold the loop for seconds
                link = self._links.get(host)
                if link is None or link.closed.is_set():
                    continue
                assert template is not None
                # model_construct: the envelope is already checked (see _envelope_template).
                message = WorldFormed.model_construct(
                    envelope=self._envelope(template, world, host, link), relay=relay
                )
                try:
                    link.stream.send_nowait(message)
                except (ConnectionError, OSError) as error:
                    self.link_closed(link, f"WorldFormed write failed ({error!r})", lost=True)
                    continue
                self.counters.frame_out(JOIN_CHANNEL, 0)
                sent.append(link)
        except Exception as error:  # a bug or a limit: say so in the verdict, never sit in forming
            log.exception("event=world_formed_build_failed hosts=%d", len(world.hosts))
            self.abort(
                f"formation failed: could not build WorldFormed for {len(world.hosts)} host(s) "
                f"({type(error).__name__}: {error})"[:1024]
            )
            return
        # A WorldFormed is a few hundred bytes: almost every write went out at once. Only links with bytes
        # still buffered need a drain (a task each), not all 10,000.
        backed_up = [link for link in sent if _write_buffered(link)]
        results = await asyncio.gather(
            *(asyncio.wait_for(link.stream.drain(), SHIP_TIMEOUT_SECS) for link in backed_up),
            return_exceptions=True,
        )
        for link, outcome in zip(backed_up, results, strict=True):
            if isinstance(outcome, BaseException):
                log.warning("event=world_formed_write_failed host=%s error=%r", link.host, outcome)
                self.link_closed(link, f"WorldFormed write failed ({outcome!r})", lost=True)
        window = self.window
        assert window is not None
        if window.phase is Phase.FORMING:
            window.artifacts_shipped(self.clock())
            log.info("event=artifacts_shipped hosts=%d", len(sent))
            # The window may pass through training at once (every link already closed): say so anyway.
            self._announce(Phase.TRAINING, "world formed, artifacts shipped")
        self._settle()

    async def _finish(self, phase: Phase, reason: str) -> None:
        links = [link for link in self._links.values() if not link.closed.is_set()]
        if phase is Phase.FAILED:
            log.error("event=run_failed reason=%r hosts_aborted=%d", reason, len(links))
            await asyncio.gather(*(self._abort_link(link, reason) for link in links), return_exceptions=True)
            # The hosts tear down and report how their ranks ended: the culprit's report may arrive after a
            # victim's (which decided the verdict), so the root cause waits for them, bounded.
            await self._await_reports(links)
        else:
            log.info("event=run_done reason=%r", reason)
        self._conclude(RunResult(phase, reason))

    async def _abort_link(self, link: HostLink, reason: str) -> None:
        try:
            link.stream.send_nowait(Abort(reason=reason[:1024]))
            self.counters.frame_out(JOIN_CHANNEL, 0)
            await asyncio.wait_for(link.stream.drain(), ABORT_TIMEOUT_SECS)
        except BaseException:
            link.stream.close()
            raise

    async def _await_reports(self, links: list[HostLink]) -> None:
        """Until every aborted host closed its link (its ranks reported) or `REPORT_GRACE_SECS` passed; then
        close what is left.
        """
        waits = [asyncio.ensure_future(link.closed.wait()) for link in links if not link.closed.is_set()]
        if waits:
            await asyncio.wait(waits, timeout=REPORT_GRACE_SECS * self.options.timeout_scale)
            for wait in waits:
                wait.cancel()
        for link in links:
            link.stream.close()

    def _conclude(self, result: RunResult) -> None:
        if self._result is None:
            cause = self.root_cause()
            if cause is not None and result.root_cause is None:
                result = RunResult(result.verdict, result.reason, cause)
                log.error("event=root_cause %s", cause.summary)
            self.storm_log.flush()
            self._result = result
            self.ended_at = time.time()
            self._done.set()

    # --- StatusSource (the HTTP app) ----------------------------------------------------------

    def state_version(self) -> tuple[int, bool] | None:
        """Changes whenever state.json would (countdowns and connection counts aside): the cache's key."""
        if self.window is None:
            return None
        return self.window.generation, self._result is not None

    def state_json(self, members: MemberRange = DEFAULT_MEMBERS) -> dict[str, Any] | None:
        """state.json as data: cached (see `StateCache`) and shared between readers; do not change it."""
        return self.state_cache.data(members)

    def state_body(self, members: MemberRange = DEFAULT_MEMBERS, source: str | None = None) -> bytes | None:
        """state.json as the JSON text every reader of this build gets; work past the cache is charged to
        `source` (`RenderRefused` past the render budget).
        """
        return self.state_cache.body(members, source)

    def status_html(self, source: str | None = None) -> bytes:
        """The status page, rendered once per build (charged like `state_body`)."""
        return self.state_cache.derived("status", render_status, source)  # type: ignore[no-any-return]

    def _count_busy(self) -> None:
        self.counters.dropped["http_busy"] += 1

    def _build_state(self, members: MemberRange) -> dict[str, Any] | None:
        """One build for every page: the fields, and the members as `MemberRows` (rows encoded on demand
        from the member list as it stands now, each row once per content).
        """
        del members
        window = self.window
        if window is None:
            return None
        state = window.state(self.clock(), (0, 0))
        view = window.member_view()
        state["members"] = MemberRows(len(view.members), functools.partial(self._member_rows, window, view))
        connections = {
            "by_channel": dict(sorted(self.counters.connections.items())),
            "dropped": dict(sorted(self.counters.dropped.items())),
        }
        state["connections"] = connections
        stragglers = self.run_metrics.slowest(STRAGGLERS_SHOWN)
        if stragglers:  # only runs that fold across hosts time their ranks
            state["stragglers"] = stragglers
        attempt = self.options.attempt_state()
        if attempt is not None:
            state["attempt"] = attempt.model_dump(mode="json")
        # Drops are also listed among the refusals with a prefix, as before `connections` existed.
        for reason, count in connections["dropped"].items():
            state["refused"][f"connection_{reason}"] = count
        return state

    def _member_rows(self, window: JoinWindow, view: MemberView, begin: int, end: int) -> list[bytes]:
        """Rows `begin` to `end` of `view` as state.json text, each encoded only if its member, ranks or link
        state changed since it was last encoded.
        """
        rows, encoded = self._rows, []
        if len(rows) > 2 * len(view.members) + 64:  # hosts that left: forget their rows
            rows.clear()
        for member in view.members[begin:end]:
            ranks, link = view.ranks(member), view.links.get(member.host, LinkState.OPEN)
            known = rows.get(member.host)
            if known is not None and known[0] is member and known[1] == ranks and known[2] is link:
                encoded.append(known[3])
                continue
            row = _ENCODE(window.member_row(member, ranks, link)).encode()
            self.row_encodes += 1
            rows[member.host] = (member, ranks, link, row)
            encoded.append(row)
        return encoded

    def root_cause(self) -> RootCause | None:
        """The run's first observed rank failure so far (None: no rank failed on its own)."""
        state = self.window.root_cause.state() if self.window is not None else None
        return RootCause.model_validate(state) if state is not None else None

    def run_record(self) -> RunRecord:
        """This run's entry in the service history (call once the run has its verdict)."""
        result = self._result
        assert result is not None, "the run has no verdict yet"
        window = self.window
        world = window.world if window is not None else None
        exits = sorted(window.rank_exits.items()) if window is not None else []
        ended = self.ended_at if self.ended_at is not None else time.time()
        return RunRecord(
            run_id=self.run_id,
            verdict=result.verdict,
            reason=result.reason,
            started_at=self.started_at if self.started_at is not None else ended,
            formed_at=self.formed_at,
            ended_at=ended,
            ranks=world.world_size if world is not None else 0,
            hosts=list(world.hosts[: DEFAULT_MEMBERS[1]]) if world is not None else [],
            host_count=len(world.hosts) if world is not None else 0,
            rank_exits=[RankExit(rank=rank, code=code) for rank, code in exits],
            root_cause=result.root_cause,
            attempt=self.options.attempt_state(),
        )

    def window_refusals(self) -> Mapping[str, int]:
        """Join refusals the run's ledger counted (the port-level ones are in `counters.refusals`)."""
        return self.window.ledger.refused_counts if self.window is not None else {}

    def metrics_text(
        self, *, runs: Mapping[str, int] | None = None, past_refusals: Mapping[str, int] | None = None
    ) -> str:
        """`runs` (finished runs by verdict) and `past_refusals` (earlier runs' ledgers): from the Service."""
        refusals = self.counters.refusals.copy()
        refusals.update(past_refusals or {})
        joined_ranks = joined_hosts = admitted_hosts = admitted_ranks = lost_ranks = 0
        if self.window is not None:
            ledger = self.window.ledger
            refusals.update(ledger.refused_counts)
            # The ledger's running totals (after formation it holds exactly the world): no O(members)
            # snapshot.
            joined_ranks, joined_hosts = ledger.joined_ranks, ledger.member_count
            admitted_hosts, admitted_ranks = ledger.admitted_hosts, ledger.admitted_ranks
            lost_ranks = len(self.window.failed_ranks())
        view = ControllerCounters(**{**vars(self.counters), "refusals": refusals})
        run = RunSeries(
            run_id=self.run_id,
            restarts=self.options.restart_count,
            max_restarts=self.options.max_restarts,
            admitted_hosts=admitted_hosts,
            admitted_ranks=admitted_ranks,
            lost_ranks=lost_ranks,
            data=self.run_metrics,
        )
        return render_prometheus(
            view,
            phase=self.phase.value if self.phase else None,
            joined_ranks=joined_ranks,
            joined_hosts=joined_hosts,
            run_id=self.run_id,
            runs=runs,
            run=run,
        )

    def request_start(self, *, local: bool, token: str | None) -> HttpAnswer:
        """POST /start: switch, mode, credential, state, then the window's own rules, in that order."""
        if not self.options.start_switch:
            return _refusal(
                409, "no_start_switch", "no start switch this run (no join window with a start mode)"
            )
        if self.policy.start.value == "auto":
            return _refusal(
                409,
                "auto_mode",
                "start mode is auto — the window closes on target/expiry; set controller.join.start: manual "
                "(or hybrid) to hold for an operator start",
            )
        if not local and not token_matches(token, self.start_credential):
            if token_matches(token, self.salt_hex):
                # The join token is the run's master key: say so, never accept it here.
                log.warning(
                    "event=start_refused code=join_token detail='the join token (session salt) was presented "
                    "as the start credential; if it crossed a network, treat it as exposed and rotate it'"
                )
                return _refusal(
                    403,
                    "join_token",
                    "start refused: that is the join token, not the start credential "
                    "(`fdl start --derive-credential` computes it); if it crossed a network, rotate it",
                )
            refused = forbidden()
            code = "bad_token" if token else "missing_token"
            log.warning("event=start_refused code=%s", code)
            return _refusal(refused.http_status, code, refused.reason)
        if self.window is None:
            return _refusal(503, "no_state", NO_STATE)
        decision = self.window.arm_start(self.clock())
        if not isinstance(decision, Armed):
            log.info("event=start_refused code=%s reason=%r", decision.code, decision.reason)
            return _refusal(decision.http_status, decision.code, decision.reason)
        self.state_cache.clear()
        if not decision.already:
            log.info("event=start_armed joined_ranks=%d quorum=%d", decision.joined_ranks, decision.quorum)
        self._settle()
        return HttpAnswer(
            200,
            {
                "armed": True,
                "joined_ranks": decision.joined_ranks,
                "min_rank_start": decision.quorum,
                "already_armed": decision.already,
            },
        )


# Asked twice per host at formation; a world's links come from few addresses (bounded: a world from many
# distinct addresses only cycles the cache).
_is_loopback = functools.lru_cache(maxsize=4096)(is_loopback_address)


def _write_buffered(link: HostLink) -> bool:
    """Whether bytes written to the link still wait in its transport (unknown: assume so)."""
    return link.stream.write_buffered()


def _is_ip_literal(address: str) -> bool:
    try:
        ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    return True


def _refusal(status: int, code: str, reason: str) -> HttpAnswer:
    return HttpAnswer(status, {"error": reason, "code": code})


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
