"""The run's side of the controller port: the channels it serves, its HTTP app, binding and the trust policy.

Standalone (`fdl run`, `flodld serve --once`) a run binds the port itself; under `flodld serve` the `Service`
owns the port and the mux for the daemon's whole life, and a run only registers its channels
(`RUN_CHANNELS`, then the data plane's through `register_channels`) on it, taking them off at `close()`.
Trust follows the addresses the sockets really have (`policy_for`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

from aiohttp import web

from flodld.controller.addresses import CleartextWarner
from flodld.controller.join import JoinProtocol, JoinRun
from flodld.controller.mux import ChannelHandler, ChannelProtocolFactory, PortMux, PreAdmissionGate
from flodld.controller.options import ControllerOptions
from flodld.controller.runparts import PortRun
from flodld.controller.status.http import HttpRefusalLog, build_app
from flodld.controller.status.metrics import ControllerCounters
from flodld.controller.status.source import StatusSource
from flodld.membership.policy import PolicyError, WindowPolicy, derive_policy, is_loopback_literal
from flodld.wire.magic import Channel

log = logging.getLogger("flodld.controller")

# How long a one-run controller keeps answering after its verdict when someone polled it over HTTP:
# longer than `fdl status --watch`'s default 1 s interval, so the watcher's next poll shows the verdict.
VERDICT_LINGER_SECS = 2.0


@dataclass(frozen=True)
class RunChannel:
    """How a run serves one channel of the controller port: its handler, bound to the run."""

    handler: Callable[[PortRun], ChannelHandler] | None = None
    hold_gate: bool = False
    """The handler releases the peer's pre-admission slot itself (`PortMux.register`)."""
    protocol: Callable[[PortRun], ChannelProtocolFactory] | None = None
    """Served by a protocol per connection instead of a handler (`PortMux.register_protocol`: the protocol
    holds and releases the slot)."""


def _join_protocol(run: PortRun) -> ChannelProtocolFactory:
    join_run: JoinRun = run  # the join channel knows the run only through this protocol

    def factory(mux: PortMux, peer: str) -> JoinProtocol:
        return JoinProtocol(join_run, mux, peer)

    return factory


def _store_handler(run: PortRun) -> ChannelHandler:
    return run.store.handle


RUN_CHANNELS: Final[Mapping[Channel, RunChannel]] = {
    # The join handshake keeps the peer's gate slot until the window decided its hello.
    # Served by a protocol per connection (no stream, task or coroutine while the handshake is in flight).
    Channel.JOIN: RunChannel(protocol=_join_protocol),
    Channel.RENDEZVOUS: RunChannel(_store_handler),
}
"""The channels a run serves from `listen()` on, whoever bound the port. Channels that exist only once
the world formed (the data plane's DATA/CONTROL) come through `Controller.register_channels`."""


async def serve_http(source: StatusSource, mux: PortMux, counters: ControllerCounters) -> web.AppRunner:
    """The port's HTTP side: `source`'s app, set up and handed to `mux` (which starts listening), each
    malformed request a counted warning (`HttpRefusalLog`). The caller cleans the runner up.

    A source with `state_body` (the cached bytes) also lets the mux answer a plain `GET /state.json` itself,
    from those same bytes, without aiohttp (`flodld.controller.status.fastget`).
    """
    runner = web.AppRunner(
        build_app(source), access_log=None, handle_signals=False, logger=HttpRefusalLog(counters.dropped)
    )
    await runner.setup()
    mux.set_http(runner.server, state_body=getattr(source, "state_body", None))
    return runner


class RunPort:
    """Where `run` listens: bound here (`borrowed` False) or lent at `bound` by the Service."""

    def __init__(self, run: PortRun, *, borrowed: bool, bound: tuple[str, int] | None) -> None:
        self.run = run
        self._borrowed = borrowed
        self._bound = bound
        self._channels: set[Channel] = set()  # on the mux for this run; taken off at close()
        self._runner: web.AppRunner | None = None
        self._owns = not borrowed  # closes the mux at close(): bound here, or taken over (`take_over`)

    def policy_for(self, bound_address: str | None) -> WindowPolicy:
        options = self.run.options
        return derive_policy(
            options.join, capacity=options.capacity, loopback_bind=options.wants_loopback,
            averaging=options.averaging, bound_address=bound_address, preshared=options.preshared,
        )

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
        self.run.mux.register(channel, handler, hold_gate=hold_gate)
        self._channels.add(channel)

    def _serve_run_channels(self) -> None:
        for channel, spec in RUN_CHANNELS.items():
            if spec.protocol is not None:
                self.run.mux.register_protocol(channel, spec.protocol(self.run))
                self._channels.add(channel)
            else:
                assert spec.handler is not None
                self._serve(channel, spec.handler(self.run), hold_gate=spec.hold_gate)

    async def listen(self) -> tuple[str, int]:
        """Bind the port and serve HTTP; the window is not open yet (state.json answers 503)."""
        if self.run.address is not None:
            return self.run.address
        if self._borrowed:
            return self._listen_on_borrowed_port()
        self._runner = await serve_http(self.run, self.run.mux, self.run.counters)
        self._serve_run_channels()
        address = await self.run.mux.start(self.run.options.effective_bind_host, self.run.options.port)
        try:
            # Trust follows the addresses the sockets really have (a hostname may resolve anywhere, and to
            # several addresses: one that is not loopback decides).
            hosts = self.run.mux.bound_hosts() or [address[0]]
            self.run.policy = self.policy_for(
                next((h for h in hosts if not is_loopback_literal(h)), hosts[0])
            )
        except PolicyError:
            await self.run.mux.close()
            await self._runner.cleanup()
            self._runner = None
            raise
        self.run.address = address
        log.info("event=listening bind=%s port=%d run_id=%s", address[0], address[1], self.run.run_id)
        self._log_admission()
        return self.run.address

    def _log_admission(self) -> None:
        assert self.run.address is not None
        if self.run.policy.warning:
            log.warning(
                "event=open_admission_warning bind=%s detail=%r", self.run.address[0], self.run.policy.warning
            )
        if self.run.options.start_switch and self.run.policy.start.value != "auto":
            log.info(
                "event=start_credential value=%s run_id=%s use='fdl start --token <value>' (not the join "
                "token; equal to `fdl start --derive-credential` fed the join token; for this run only)",
                self.run.start_credential,
                self.run.run_id,
            )

    def _listen_on_borrowed_port(self) -> tuple[str, int]:
        """Under the Service: the port is bound already.

        Derive trust from it and serve this run's channels.
        """
        assert self._bound is not None
        hosts = self.run.mux.bound_hosts() or [self._bound[0]]
        self.run.policy = self.policy_for(next((h for h in hosts if not is_loopback_literal(h)), hosts[0]))
        self._serve_run_channels()
        address = self.run.address = self._bound
        log.info("event=run_listening bind=%s port=%d run_id=%s", address[0], address[1], self.run.run_id)
        self._log_admission()
        return address

    async def linger_for_readers(self, seconds: float = VERDICT_LINGER_SECS) -> None:
        """Before `close()` of a one-run controller: if someone read the state over HTTP in the last
        `seconds` (`fdl status --watch`, the status page), keep answering until `seconds` after that read,
        so a poller's next poll sees the verdict instead of a closed port. Nobody polled, or the last read
        was longer ago than a poller's interval: returns at once (no run pays the linger for one early look).
        """
        last = self.run.counters.last_http_at
        if last is not None:
            remaining = last + seconds - asyncio.get_running_loop().time()
            if remaining > 0:
                await asyncio.sleep(remaining)

    async def release(self) -> None:
        """Hand the port on (a restart that keeps the links, docs/restarts.md): this run's handlers and HTTP
        app come off the mux and its remaining join links are closed, but the port keeps listening; the next
        run borrows the mux and `take_over`s it.
        """
        for channel in sorted(self._channels):
            self.run.mux.unregister(channel)
        self._channels.clear()
        for link in list(self.run.links.values()):
            link.stream.close()
        if self._runner is not None:
            self.run.mux.set_http(None)
            await self._runner.cleanup()
            self._runner = None
        self._owns = False

    async def take_over(self) -> None:
        """A run on a port released by the run before it: serve HTTP from this run and close the port at
        `close()`, as if bound here.
        """
        if self._runner is None:
            self._runner = await serve_http(self.run, self.run.mux, self.run.counters)
        self._owns = True

    async def close(self) -> None:
        """Stop listening and end every connection (HTTP included). On a borrowed port: take this run's
        handlers off the mux and close its remaining join links; the port and the mux stay up.
        """
        if not self._owns:
            for channel in sorted(self._channels):
                self.run.mux.unregister(channel)
            self._channels.clear()
            for link in list(self.run.links.values()):
                link.stream.close()
            return
        await self.run.mux.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def own_mux(options: ControllerOptions, counters: ControllerCounters) -> PortMux:
    """The mux of a port the run binds itself."""
    return PortMux(
        counters,
        magic_deadline=options.magic_deadline,
        http_lifetime=options.http_lifetime,
        gate=PreAdmissionGate(options.max_pending_per_peer, exempt_loopback=not options.limit_loopback),
        warner=CleartextWarner("controller"),
        link_keepalive=options.link_keepalive_secs * options.timeout_scale,
    )


def is_ip_literal(address: str) -> bool:
    try:
        ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    return True
