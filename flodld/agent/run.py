"""The agent's shell for one host: join, spawn the relay and one rank per device, supervise, report.

All decisions live in `flodld.agent.supervision`; this file owns processes, timers and the join link, and
turns decisions into those. The agent process (flodld/agent/host.py) runs one such shell for its host, and
one more per slot that heals in as a walk-in of its own; it owns the signals.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import tempfile
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import TypeVar, assert_never

from flodld.agent import envpolicy
from flodld.agent import supervision as sv
from flodld.agent.children import Child, exit_report, forward_output, say
from flodld.agent.exits import exit_event
from flodld.agent.forkserver import ForkServer
from flodld.agent.join import ExitClass, Joined, JoinFailed, build_hello, join_world, rejoin
from flodld.agent.ranklogs import RankLogSink, open_rank_sinks
from flodld.agent.spawn import (
    bind_relay_listener,
    rank_command,
    rank_environment,
    signal_group,
)
from flodld.agent.spec import LEFT_RUN_MARK, AgentSpec
from flodld.agent.starts import start_rank, start_relay
from flodld.agent.tail import ERROR_FILE_ENV, OutputTail, Scrubber
from flodld.agent.tcpstore import AgentStoreEndpoint, ControllerAddress, StoreRefused, node_rank
from flodld.agent.warmpool import WarmPool
from flodld.membership.switch import start_credential
from flodld.rank.env import STACK_DUMP_SIGNAL
from flodld.wire.errors import WireError
from flodld.wire.hostkey import join_host_key
from flodld.wire.join import Abort, Hello, KillRank, Reform, Stopped

STACK_GRACE_SECS = 1.0
"""How long a rank declared dead has to dump its stack (STACK_DUMP_SIGNAL, then CONT) before its KILL."""
WORD_WAIT_SECS = 10.0
"""How long a host that tore itself down waits for the controller's Reform or Abort before it closes its link
(only where a restart may follow: `flodld.agent.supervision.AwaitWord`)."""
LINGER_SECS = 5.0
"""How long the agent waits, its end of the join link closed, for the controller to close its own (it has
then read every report): a controller that has gone away costs at most this at the host's exit."""


T = TypeVar("T")


class AgentShell:
    def __init__(
        self,
        spec: AgentSpec,
        devices: list[str],
        warm: WarmPool | None = None,
        forks: ForkServer | None = None,
    ) -> None:
        self.spec = spec
        self.devices = devices
        self.forks = forks  # this host's fork server (fdl join --persist): ranks forked with torch loaded
        self.warm = warm  # ranks that loaded torch while this agent joined (flodld.rank.warm)
        self.warm_count = len(warm) if warm is not None else 0  # re-armed for each attempt on a kept link
        self.next_warm: asyncio.Task[WarmPool] | None = None  # the next attempt's, while this one trains
        self.events: asyncio.Queue[sv.Event] = asyncio.Queue()
        # Set by every event that tears the host down (abort, lost link, signal, the relay's exit): a wait
        # before the ranks start (GROUP_RANK in the store) gives way to it instead of holding the teardown.
        self.stopping = asyncio.Event()
        self.word = asyncio.Event()  # the controller's Abort or Reform came, the link dropped, or a signal
        self.reader: asyncio.Future[None] | None = None
        self.children: list[Child] = []
        self.forwarders: list[asyncio.Future[None]] = []
        self.watchers: list[asyncio.Future[None]] = []
        self.store_endpoint: AgentStoreEndpoint | None = None
        self.sinks: list[RankLogSink] = []
        self.forwarder_of: dict[int, asyncio.Future[None]] = {}  # by child (id), to drain a tail
        self.scrub = Scrubber()
        self.error_dir: str | None = None  # the ranks' error files (removed when the agent is done)
        self.reform: str | None = None  # a Reform's reason: this attempt ends, the link stays for the next
        self.run_id: str | None = None  # the run whose world formed for this shell (under way, or over)
        self.for_run: str | None = None  # a healed slot's shell serves only this run (its host's)
        self.left_run = False  # every rank was lost and the run went on (Finish.left_run)
        # Told a device whose rank failed or was declared dead while this host runs, in a run that grows
        # (flodld/agent/host.py heals the slot in as a walk-in of its own); None: the slot stays empty.
        self.on_free_slot: Callable[[str], None] | None = None
        self.relay: Child | None = None  # this shell's relay, once started
        self.relay_port: int | None = None  # where its ranks (and healed slots riding it) dial it
        self.rides: tuple[str, int] | None = None  # a healed slot's: the relay it asks to ride (Hello.rides)
        self.before_relay_stop: Callable[[], Awaitable[None]] | None = None  # its riders, once done

    async def run(self) -> int:
        say(
            f"host {self.spec.host!r} dialing controller "
            f"{self.spec.controller_host}:{self.spec.controller_port} "
            f"with {len(self.devices)} rank(s) (devices {self.devices}, admission: "
            f"{'pre-shared salt' if self.spec.salt_hex else 'open'})"
        )
        try:
            hello = build_hello(self.spec, self.devices)
            if self.rides is not None:
                hello = hello.model_copy(update={"rides": self.rides[0]})
            joined = await self._unless_stopping(join_world(self.spec, hello, warn=say))
        except JoinFailed as failure:
            say(str(failure))
            return failure.exit_class
        if joined is None:  # before formation only a signal stops the host; its event is the queue's first
            say(f"interrupted before the world formed ({self.events.get_nowait()})")
            return ExitClass.TRANSIENT
        try:
            return await self._serve_attempts(joined, hello)
        finally:
            if self.warm is not None:
                await self.warm.close()
            if self.next_warm is not None:
                self.next_warm.cancel()
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await (await self.next_warm).close()

    async def _serve_attempts(self, joined: Joined, hello: Hello) -> int:
        """Serve the formed world, and each next attempt this link is re-admitted to; the exit code."""
        while True:
            code = await self._serve_attempt(joined)
            if self.reform is None:
                return code
            # The attempt failed and the run restarts keeping this link (docs/restarts.md): this host's ranks
            # and relay are gone and reported, Stopped is sent; the next attempt re-admits it here.
            say(f"attempt stopped ({self.reform}); staying linked for the next attempt")
            self._reset()
            if self.next_warm is not None:  # started while the attempt trained: torch is loaded (or loading)
                with contextlib.suppress(OSError):
                    self.warm = await self.next_warm
                self.next_warm = None
            link = joined.stream
            try:
                rejoined = await self._unless_stopping(rejoin(link, self.spec, hello))
            except JoinFailed as failure:
                say(str(failure))
                return failure.exit_class
            if rejoined is None:
                link.close()
                say(f"interrupted while waiting for the next attempt ({self.events.get_nowait()})")
                return ExitClass.TRANSIENT
            joined = rejoined

    def _reset(self) -> None:
        """A fresh slate for the next attempt on the same link: no children, events or teardown left over."""
        self.events = asyncio.Queue()
        self.stopping = asyncio.Event()
        self.word = asyncio.Event()
        self.reader = None
        self.reform = None
        self.children, self.forwarders, self.watchers, self.sinks = [], [], [], []
        self.forwarder_of = {}
        self.store_endpoint = None
        self.error_dir = None
        self.scrub = Scrubber()

    async def _serve_attempt(self, joined: Joined) -> int:
        """One formed world: spawn this host's relay and ranks, supervise them, report; the exit code."""
        envelope = joined.formed.envelope
        self.run_id = envelope.run_id
        say(
            f"world formed: run {envelope.run_id}, world size {envelope.world_size}, this host's ranks "
            f"{envelope.ranks}; controller address {envelope.controller_host}:{envelope.controller_port}"
        )
        if self.for_run is not None and envelope.run_id != self.for_run:
            say(f"this healed slot was for run {self.for_run}, which is over; leaving run {envelope.run_id}")
            await joined.stream.aclose()  # no rank starts; the controller sees this host gone
            return ExitClass.TRANSIENT
        self._mark(envelope.run_id, first=True)
        if not self.spec.cluster_env:  # a walk-in applies only safe or accepted names (none: open admission)
            accepted = tuple(self.spec.accept_env or ())
            verdict = envpolicy.judge_controller_env(
                envelope.env, authenticated=self.spec.salt_hex is not None, accepted=accepted
            )
            notice = verdict.notice(f"{self.spec.controller_host}:{self.spec.controller_port}", accepted)
            if notice is not None:
                say(notice)
            if not verdict.ok:
                await joined.stream.aclose()  # no rank starts; the controller sees this host gone
                return ExitClass.PERMANENT
            joined.formed = joined.formed.model_copy(
                update={"envelope": envelope.model_copy(update={"env": verdict.apply})}
            )
        self.reader = asyncio.ensure_future(self._read_link(joined))  # an abort counts from now on
        try:
            await self._spawn_all(joined)
        except OSError as error:
            self.reader.cancel()
            say(f"spawn failed; terminating {len(self.children)} already-spawned child(ren): {error}")
            for child in self.children:
                signal_group(child.process, signal.SIGKILL)
            for sink in self.sinks:
                sink.close()
            if self.store_endpoint is not None:
                await self.store_endpoint.close()
            await joined.stream.aclose()
            return ExitClass.TRANSIENT
        if self.warm_count and envelope.restart_count < envelope.max_restarts:
            # The next attempt's warm ranks load torch while this one trains (its ranks are started: a warm
            # rank's own import no longer competes with theirs), so a restart that keeps this link hands its
            # ranks to processes that have torch loaded.
            self.next_warm = asyncio.ensure_future(WarmPool.start(self.warm_count, os.environ))
        return await self._supervise(joined)

    def _mark(self, line: str, *, first: bool = False) -> None:
        """A line for the process that started this agent (`fdl join`), when it asked: the run id once the
        world formed (`first`), then LEFT_RUN_MARK if the run may go on without this host.
        """
        if self.spec.formed_file is None:
            return
        try:
            with open(self.spec.formed_file, "w" if first else "a", encoding="utf-8") as mark:
                mark.write(line + "\n")
        except OSError as error:  # the run goes on; only the starter's back-off misses the news
            say(f"could not write the mark {self.spec.formed_file}: {error}")

    async def _spawn_all(self, joined: Joined) -> None:
        formed, envelope, host = joined.formed, joined.formed.envelope, self.spec.host
        argv = rank_command(self.spec.program)
        self.sinks, notice = open_rank_sinks(self.spec.logs, run=envelope.run_id, host=host,
                                             attempt=envelope.restart_count, ranks=envelope.ranks)
        if notice is not None:  # the sinks are open before any child starts
            say(notice)
        # torch's env:// rendezvous (a stock script) reaches the controller's store through this loopback
        # endpoint.
        self.store_endpoint = AgentStoreEndpoint(
            ControllerAddress(
                envelope.controller_host, envelope.controller_port, joined.salt, envelope.run_id
            ),
            say=say,
        )
        store_port = await self.store_endpoint.start()
        relay_port: int | None = None
        if formed.relay is not None and formed.relay.rides is not None:
            if self.rides is None or formed.relay.rides != self.rides[0]:
                raise OSError(f"the controller has this host ride host {formed.relay.rides!r}'s relay, "
                              f"which it did not ask for (asked: {self.rides})")  # fmt: skip
            relay_port = self.rides[1]
            say(f"its rank(s) ride host {formed.relay.rides!r}'s relay (no relay of its own)")
        elif formed.relay is not None:
            listener = bind_relay_listener()
            relay_port = listener.getsockname()[1]
            # The key this host's admission derived: the relay proves it on DATA and CONTROL (speaks only as
            # `host`).
            host_key = join_host_key(joined.salt, host=host, run_id=envelope.run_id, conn=joined.stream.conn)
            relay = await start_relay(self.forks, formed, host=host, salt=joined.salt, host_key=host_key,
                                      listener=listener, say=say)  # fmt: skip
            self.relay = Child("relay", relay, None)
            self.relay_port = relay_port
            self._adopt(self.relay, f"[{host}:relay] ")
        # After the relay started (it does not need it): a few store round trips in a world of several hosts,
        # given up as soon as the host is being torn down (its ranks then start only to be terminated).
        node = None
        walk_in = formed.relay is not None and formed.relay.walk_in
        if envelope.local_world_size < envelope.world_size and not walk_in:
            node = await self._unless_stopping(self._node_rank(joined))
        self.scrub = Scrubber(self._secrets(joined))
        self.error_dir = tempfile.mkdtemp(prefix="flodld-errors-")
        fold = formed.relay.fold if formed.relay is not None else "mean"
        cadence = formed.relay.cadence if formed.relay is not None else 1
        for local_rank, (rank, device) in enumerate(zip(envelope.ranks, self.devices, strict=True)):
            env = rank_environment(
                os.environ,
                envelope,
                local_rank=local_rank,
                device=device,
                salt=joined.salt,
                host=host,
                relay_port=relay_port,
                fold=fold,
                cadence=cadence,
                host_env=self.spec.host_env,
                store_port=store_port,
                node=node,
                walk_in=walk_in,
            )
            error_file = Path(self.error_dir) / f"rank-{rank}.json"
            env[ERROR_FILE_ENV] = str(error_file)  # torch's @record writes the rank's exception there
            sink = self.sinks[local_rank]
            process = await start_rank(self.warm, self.forks, argv, env, device=device,
                                       split_stderr=sink.splits_streams, say=say)  # fmt: skip
            child = Child(f"rank {rank}", process, rank, OutputTail(self.scrub), error_file)
            self._adopt(child, f"[{host}:{device}:r{rank}] ", sink)
        if self.warm is not None:
            await self.warm.close()  # the ones not needed go now
            self.warm = None  # a later attempt on this link starts its ranks cold

    def _secrets(self, joined: Joined) -> list[str]:
        """What must never leave this host in a rank's tail: the run's salt (the join token), the start
        credential and host key derived from it, and the values of secret-looking variables the ranks see.
        """
        envelope = joined.formed.envelope
        secrets = [joined.salt.hex(), self.spec.salt_hex or ""]
        secrets.append(start_credential(joined.salt, envelope.run_id))
        key = join_host_key(joined.salt, host=self.spec.host, run_id=envelope.run_id, conn=joined.stream.conn)
        secrets.append(key.hex())
        for env in (os.environ, envelope.env, self.spec.host_env or {}):
            secrets += Scrubber.secrets_in_env(env)
        return secrets

    async def _node_rank(self, joined: Joined) -> tuple[int, int] | None:
        """The GROUP_RANK/GROUP_WORLD_SIZE torchrun gives a host in a world of several.

        None, said, if unknown.
        """
        envelope = joined.formed.envelope
        address = ControllerAddress(
            envelope.controller_host, envelope.controller_port, joined.salt, envelope.run_id
        )
        try:
            return await node_rank(
                address,
                first_rank=envelope.ranks[0],
                local_size=envelope.local_world_size,
                world_size=envelope.world_size,
            )
        except (TimeoutError, StoreRefused, ConnectionError, OSError, WireError) as error:
            say(f"GROUP_RANK unknown, left out of the ranks' environment ({error!r})")
            return None

    async def _unless_stopping(self, work: Coroutine[object, object, T]) -> T | None:
        """`work`'s result, or None (work cancelled) once an event that tears the host down arrived."""
        task = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):  # abandoned: how it ends is moot
            await task
        return None

    def post(self, event: sv.Event) -> None:
        """Queue an event for the supervisor; one that tears the host down also sets `stopping`."""
        if isinstance(event, sv.AbortReceived | sv.LinkLost | sv.Interrupted | sv.RelayExit):
            self.stopping.set()
        if isinstance(event, sv.AbortReceived | sv.LinkLost | sv.Interrupted):
            self.word.set()
        self.events.put_nowait(event)

    def _adopt(self, child: Child, prefix: str, sink: RankLogSink | None = None) -> None:
        self.children.append(child)
        forwarder = asyncio.ensure_future(forward_output(child, prefix, sink))
        self.forwarders.append(forwarder)
        self.forwarder_of[id(child)] = forwarder
        self.watchers.append(asyncio.ensure_future(self._watch_exit(child)))

    async def _watch_exit(self, child: Child) -> None:
        self.post(await exit_event(child, self.forwarder_of.get(id(child)), self.scrub))

    async def _read_link(self, joined: Joined) -> None:
        try:
            while True:
                message = (await joined.stream.recv()).message()
                if isinstance(message, Abort):
                    self.post(sv.AbortReceived(message.reason))
                elif isinstance(message, Reform):  # torn down as at an Abort, then Stopped instead of a close
                    self.reform = message.reason
                    self.post(sv.AbortReceived(message.reason))
                    return  # nothing more comes before our Stopped: the next attempt's Accept is rejoin()'s
                elif isinstance(message, KillRank):
                    self.post(sv.RankDeclaredDead(message.rank, message.reason))
        except EOFError:
            self.post(sv.LinkLost("controller closed the join connection"))
        except (WireError, OSError) as error:
            self.post(sv.LinkLost(f"join connection error: {error}"))

    async def _supervise(self, joined: Joined) -> int:
        relay = joined.formed.relay
        supervisor = sv.Supervisor(
            self.spec.host,
            list(joined.formed.envelope.ranks),
            has_relay=relay is not None,
            own_relay=relay is None or relay.rides is None,
            tolerance=relay.tolerance if relay is not None else 0,
            may_restart=joined.formed.envelope.restart_count < joined.formed.envelope.max_restarts,
            grows=relay is not None and relay.grows,
        )
        reader = self.reader if self.reader is not None else asyncio.ensure_future(self._read_link(joined))
        self.reader = reader
        timers: list[asyncio.TimerHandle] = []  # the grace period, the stack dumps' graces
        actions = supervisor.start()
        try:
            while True:
                for action in actions:
                    exit_code = await self._carry_out(action, joined, supervisor, timers)
                    if exit_code is not None:
                        return exit_code
                event = await self.events.get()
                actions = supervisor.handle(event, now=asyncio.get_running_loop().time())
        finally:
            for timer in timers:
                timer.cancel()
            reader.cancel()
            await asyncio.gather(*self.forwarders, return_exceptions=True)
            for sink in self.sinks:
                sink.close()
            if self.store_endpoint is not None:
                await self.store_endpoint.close()
            if self.error_dir is not None:
                shutil.rmtree(self.error_dir, ignore_errors=True)

    async def _carry_out(
        self, action: sv.Action, joined: Joined, supervisor: sv.Supervisor, timers: list[asyncio.TimerHandle]
    ) -> int | None:
        """One action of the supervision table; the exit code once it says to finish, else None."""
        loop = asyncio.get_running_loop()
        match action:  # every Action kind, checked exhaustive by mypy (assert_never)
            case sv.ReportRankExit(rank, code, torn_down, detail, frees_slot):
                after = " (torn down)" if torn_down and code else ""
                say(f"rank {rank} exited with {sv.describe_exit(code)}{after}")
                with contextlib.suppress(OSError, WireError, TimeoutError, ValueError):
                    await joined.stream.send(exit_report(rank, code, torn_down, detail))
                if frees_slot and self.on_free_slot is not None:
                    self.on_free_slot(self.devices[joined.formed.envelope.ranks.index(rank)])
            case sv.TerminateRelay():
                if self.before_relay_stop is not None:
                    await self.before_relay_stop()  # healed slots riding it train on until they are done
                self._signal(lambda child: child.rank is None, signal.SIGTERM)
            case sv.TerminateAll(reason):
                say(
                    f"tearing down host {self.spec.host!r} ({reason}); "
                    f"terminating {supervisor.children_live} child(ren)"
                )
                self._signal(lambda child: True, signal.SIGTERM)
                grace = loop.call_later(self.spec.grace_secs, self.events.put_nowait, sv.GraceExpired())
                timers.append(grace)
            case sv.KillAll():
                say(f"grace period of {self.spec.grace_secs:g}s over; killing what is left")
                self._signal(lambda child: True, signal.SIGKILL)
            case sv.DumpStack(rank, reason):
                say(f"rank {rank} declared dead by the controller ({reason}); its Python stack:")
                self._dump_stack(rank)
                timers.append(
                    loop.call_later(STACK_GRACE_SECS, self.events.put_nowait, sv.StackGraceExpired(rank))
                )
            case sv.KillOne(rank):
                say(f"killing rank {rank} (declared dead)")
                self._signal(lambda child: child.rank == rank, signal.SIGKILL)
            case sv.AwaitWord():
                # This host's failure ends the attempt and a restart may follow: the controller's Reform (stay
                # linked) or Abort is on its way; `word` is set when either arrives, or the link drops.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.word.wait(), WORD_WAIT_SECS)
            case sv.CloseLink() if self.reform is not None:
                with contextlib.suppress(OSError, WireError, TimeoutError, ValueError):
                    await joined.stream.send(Stopped())
            case sv.CloseLink():
                await self._close_link(joined)
            case sv.Finish(exit_code, summary, left_run):
                say(summary)
                if left_run:
                    self.left_run = True
                    self._mark(LEFT_RUN_MARK)
                return exit_code
            case _:
                assert_never(action)
        return None

    async def _close_link(self, joined: Joined) -> None:
        """Half-close the join link, then wait (at most LINGER_SECS) for the controller to close its end,
        which it does once it has read everything before our end of stream: this host's last rank exits
        included. Over `fdl join --ssh` the forward is torn down as soon as this agent exits; closing at
        once let the ssh client die with those reports still in it (the run then failed: "host closed its
        join link with rank(s) [0, 1] unreported").
        """
        writer = joined.stream.writer
        with contextlib.suppress(OSError, RuntimeError):
            if writer.can_write_eof() and not writer.is_closing():
                writer.write_eof()
                reader = self.reader
                if reader is not None and not reader.done():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(reader), LINGER_SECS)
        await joined.stream.aclose()

    def _dump_stack(self, rank: int) -> None:
        """The stack-dump signal to the rank's own process (its faulthandler writes to its stderr, which the
        agent forwards and keeps in its tail), then CONT to its group: a stopped rank runs the handler.
        """
        for child in self.children:
            if child.rank == rank and child.process.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(child.process.pid, STACK_DUMP_SIGNAL)
                signal_group(child.process, signal.SIGCONT)

    def _signal(self, which: Callable[[Child], bool], signum: int) -> None:
        # Ranks first, relay last: a relay that stops first would make live ranks see their
        # data plane vanish and exit on their own, blurring why they ended.
        for child in sorted(self.children, key=lambda child: child.rank is None):
            if which(child) and child.process.returncode is None:
                signal_group(child.process, signum)
