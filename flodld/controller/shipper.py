"""The WorldFormed shipper and the end's Abort fan-out: what the Controller sends down every join link.

When the window forms, WorldFormed goes to every host in admission order (each carries only that host's
part: O(hosts) bytes in all), `SHIP_CHUNK_HOSTS` writes per event-loop turn; a failure to build or send it
fails the run with the reason. When a run fails, Abort goes down every open link and the hosts get
`REPORT_GRACE_SECS` (scaled) to report how their ranks ended.
"""

from __future__ import annotations

import asyncio
import functools
import logging

from flodld.controller.addresses import is_loopback_address
from flodld.controller.join import CHANNEL as JOIN_CHANNEL
from flodld.controller.join import HostLink
from flodld.controller.runparts import ShipperRun
from flodld.membership.ledger import World
from flodld.membership.phase import Phase
from flodld.wire.join import Abort, Reform, RelaySpec, WorldEnvelope, WorldFormed

log = logging.getLogger("flodld.controller")

SHIP_TIMEOUT_SECS = 30.0
ABORT_TIMEOUT_SECS = 5.0
REFORM_STOP_SECS = 20.0  # after a Reform: the hosts' time to stop their ranks (TERM, KILL) and answer Stopped
REPORT_GRACE_SECS = 1.5  # after a failure's Abort: the hosts' time to report their ranks' exits (scaled)
SHIP_CHUNK_HOSTS = 256  # WorldFormed writes per event-loop turn: HTTP and links are served in between


class WorldShipper:
    """Builds and sends each host's WorldFormed for `run`, and its Aborts at a failed end."""

    def __init__(self, run: ShipperRun) -> None:
        self.run = run

    def _controller_host_for(self, link: HostLink) -> str:
        """The controller address as that host sees it: its tunnel's loopback end, or the advertised host."""
        if link.host in self.run.options.tunneled_hosts or _is_loopback(link.peer):
            return link.local_address if _is_loopback(link.local_address) else "127.0.0.1"
        return self.run.options.advertised_host

    def _envelope_template(self, world: World) -> WorldEnvelope:
        """The parts every host's envelope shares (the env included), validated once. Each envelope is O(1)
        in the world's size: no host list.
        """
        assert self.run.address is not None
        # ranks: a placeholder every envelope swaps for its host's own (`_envelope`, `ship_walk_in`); never a
        # host's rank list here, which in a grown world need not be contiguous (a host that walked in again
        # holds its lost ranks and its fresh ones)
        return WorldEnvelope(
            run_id=self.run.run_id,
            world_size=world.world_size,
            ranks=[0],
            local_world_size=1,
            controller_host=self.run.options.advertised_host,
            controller_port=self.run.address[1],
            averaging=self.run.options.averaging,
            backend=self.run.options.backend,
            env=dict(self.run.options.env),
            restart_count=self.run.options.restart_count,
            max_restarts=self.run.options.max_restarts,
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

    async def ship_walk_in(self, host: str, *, rides: str | None = None) -> None:
        """WorldFormed to a host that walked into the training run: its ranks (fresh ids), the world's id
        space as `world_size`, and a relay spec marked `walk_in` (its relay enters at a round boundary).
        A failed write is that host's loss, as at formation.
        """
        window = self.run.window
        link = self.run.links.get(host)
        if window is None or window.world is None or link is None or link.closed.is_set():
            return
        world = window.world
        relay = self._relay_spec()
        ranks = list(window.ledger.ranks_of(host))  # this incarnation's (a returning host's earlier are lost)
        envelope = self._envelope_template(world).model_copy(
            update={
                "ranks": ranks,
                "local_world_size": len(ranks),
                "controller_host": self._controller_host_for(link),
            }
        )
        walk_in = relay.model_copy(update={"walk_in": True, "rides": rides}) if relay is not None else None
        message = WorldFormed(envelope=envelope, relay=walk_in)
        try:
            link.stream.send_nowait(message)
            self.run.counters.frame_out(JOIN_CHANNEL, 0)
            await asyncio.wait_for(link.stream.drain(), SHIP_TIMEOUT_SECS)
        except (ConnectionError, OSError, TimeoutError) as error:
            self.run.link_closed(link, f"WorldFormed write failed ({error!r})", lost=True)
            return
        log.info("event=world_formed_walk_in host=%s ranks=%s", host, envelope.ranks)

    def _relay_spec(self) -> RelaySpec | None:
        if not self.run.options.cpu_averaging:
            return None
        assert self.run.address is not None
        port = self.run.address[1]
        return RelaySpec(
            data_port=port,
            control_port=port,
            fold=self.run.options.fold,
            cadence=self.run.options.cadence,
            tolerance=self.run.tolerance,
            straggler_timeout=self.run.options.straggler_timeout,
            grows=self.run.options.growable,
        )

    async def ship(self, world: World) -> None:
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
                link = self.run.links.get(host)
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
                    self.run.link_closed(link, f"WorldFormed write failed ({error!r})", lost=True)
                    continue
                self.run.counters.frame_out(JOIN_CHANNEL, 0)
                sent.append(link)
        except Exception as error:  # a bug or a limit: say so in the verdict, never sit in forming
            log.exception("event=world_formed_build_failed hosts=%d", len(world.hosts))
            self.run.abort(
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
                self.run.link_closed(link, f"WorldFormed write failed ({outcome!r})", lost=True)
        window = self.run.window
        assert window is not None
        if window.phase is Phase.FORMING:
            window.artifacts_shipped(self.run.clock())
            log.info("event=artifacts_shipped hosts=%d", len(sent))
            # The window may pass through training at once (every link already closed): say so anyway.
            self.run.announce(Phase.TRAINING, "world formed, artifacts shipped")
        self.run.settle()

    async def abort(self, links: list[HostLink], reason: str) -> None:
        """Abort down each of `links`, then wait for their hosts' reports (`_await_reports`)."""
        await asyncio.gather(*(self._abort_link(link, reason) for link in links), return_exceptions=True)
        # The hosts tear down and report how their ranks ended: the culprit's report may arrive after a
        # victim's (which decided the verdict), so the root cause waits for them, bounded.
        await self._await_reports(links)

    async def reform(self, links: list[HostLink], reason: str, progress: asyncio.Event) -> None:
        """Reform down each of `links` (a restart that keeps them, docs/restarts.md), then wait until each
        host answered Stopped (its ranks reported; `progress` is set at each) or its link ended, at most
        `REFORM_STOP_SECS` (scaled: an agent's teardown gives its ranks a grace period before the KILL); a
        host still silent is closed.
        """
        def settled() -> bool:
            return all(link.closed.is_set() or self.run.kept.get(link.host) is link for link in links)

        reform = Reform(reason=reason[:1024])
        await asyncio.gather(*(self._send_ending(link, reform) for link in links), return_exceptions=True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REFORM_STOP_SECS * self.run.options.timeout_scale
        waits = [asyncio.ensure_future(link.closed.wait()) for link in links if not link.closed.is_set()]
        try:
            while not settled() and (left := deadline - loop.time()) > 0:
                progress.clear()
                woken = asyncio.ensure_future(progress.wait())
                pending = [wait for wait in waits if not wait.done()]
                await asyncio.wait([woken, *pending], timeout=left, return_when=asyncio.FIRST_COMPLETED)
                woken.cancel()
        finally:
            for wait in waits:
                wait.cancel()
        for link in links:
            if self.run.kept.get(link.host) is not link:
                link.stream.close()

    async def _abort_link(self, link: HostLink, reason: str) -> None:
        await self._send_ending(link, Abort(reason=reason[:1024]))

    async def _send_ending(self, link: HostLink, message: Abort | Reform) -> None:
        """Send the attempt's end (Abort, or Reform when a restart keeps the link) and drain it; a link that
        cannot take it within the abort timeout is closed.
        """
        try:
            link.stream.send_nowait(message)
            self.run.counters.frame_out(JOIN_CHANNEL, 0)
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
            await asyncio.wait(waits, timeout=REPORT_GRACE_SECS * self.run.options.timeout_scale)
            for wait in waits:
                wait.cancel()
        for link in links:
            link.stream.close()


# Asked twice per host at formation; a world's links come from few addresses (bounded: a world from many
# distinct addresses only cycles the cache).
_is_loopback = functools.lru_cache(maxsize=4096)(is_loopback_address)


def _write_buffered(link: HostLink) -> bool:
    """Whether bytes written to the link still wait in its transport (unknown: assume so)."""
    return link.stream.write_buffered()
