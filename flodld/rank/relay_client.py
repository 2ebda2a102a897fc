"""The rank's side of the relay: deposits for CPU averaging, heartbeats, and the controller watch.

Two loopback legs to the host's relay, each an authenticated framed channel:
- data: `Deposit` up in chunks of `FLODL_CHUNK_BYTES` (default 4 MiB; the relay folds and forwards each
  chunk as it arrives), `Broadcast` chunks down (a reader thread assembles them and keeps each round's
  result for the `wait_round` of that round, checked against the deposit's shapes and dtypes);
- control: `Heartbeat` up every interval, `CoordinatorHeartbeat`/`Shutdown` down.
Same-host shared memory (`FLODL_SHM`, default auto; docs/protocol.md "Shared memory"): the rank offers
its relay a memory region over the data leg (`ShmOffer`), copies each deposit chunk into it and sends a
small `ShmDeposit`; the relay folds from the region and writes the round's result back over it
(`ShmResult`). The region is reused round after round, so a deposit made before the previous round's
result has been copied out goes framed (the Averager's modes never do that). When the region cannot be
used the rank logs why once and goes on framed (FLODL_SHM=on makes that an error). `reserve(nbytes)`
readies the region (and the next result's memory) ahead of a big round, outside a timed part.
If the control leg closes, or stays silent for the liveness timeout, the controller is gone and
this process exits (code 1) rather than hang forever inside a collective.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from collections.abc import Sequence

import torch

from flodld.fold.base import Bundle
from flodld.fold.chunks import Layout, Prefaulted, chunk_bytes_from_env, split_parts
from flodld.fold.codec import decode_bundle, encode_bundle_parts
from flodld.net.blocking import BlockingChannel
from flodld.net.shm import OwnedRegion, ShmError, shm_mode
from flodld.net.timeouts import scaled
from flodld.rank.env import RankEnvironment
from flodld.rank.results import ChunkedResult, Membership, Result, ResultError, RoundResults
from flodld.wire import data as wire
from flodld.wire.control import CoordinatorHeartbeat, Heartbeat, Shutdown
from flodld.wire.errors import WireError
from flodld.wire.frames import Frame
from flodld.wire.magic import Channel

# The relay may still be starting when a rank dials; its listener already queues the connection.
CONNECT_TIMEOUT_SECS = 30.0
LOST_CONTROLLER_EXIT_CODE = 1
STACK_DUMP_GRACE_SECS = 0.5  # what a lost-controller exit waits for a stack dump in flight (see `_lost`)
log = logging.getLogger("flodld.rank")


class RelayClientError(RuntimeError):
    """The data plane refused a deposit or went away; the message says why."""


def _open_leg(env: RankEnvironment, channel: Channel) -> BlockingChannel:
    assert env.relay_port is not None
    timeout = scaled(CONNECT_TIMEOUT_SECS)
    leg = BlockingChannel.connect("127.0.0.1", env.relay_port, channel, env.salt, timeout=timeout)
    leg.send(wire.RankHello(rank=env.rank))
    reply = leg.recv(timeout).message()
    if not isinstance(reply, wire.HelloAck):
        leg.close()
        raise RelayClientError(f"relay refused rank {env.rank} on the {channel} leg: {reply!r}")
    return leg


def _exit_now(message: str, code: int) -> None:
    """Leave immediately: the main thread may be blocked in a collective that will never return."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


class RelayClient:
    """One per rank process; `deposit` and `wait_round` are called from the training thread."""

    def __init__(self, env: RankEnvironment) -> None:
        self.env = env
        self.data = _open_leg(env, Channel.DATA)
        self.control = _open_leg(env, Channel.CONTROL)
        self.step = 0
        self.next_round = 0
        self._rounds = RoundResults(env.rank, env.world_size)  # under `_changed`
        self._error: str | None = None
        self.refused = 0
        self.chunk_bytes = chunk_bytes_from_env()
        self._assembling = ChunkedResult(self._take_spare)  # the reader thread's
        self._changed = threading.Condition()
        self.shm_mode = shm_mode()
        # Per deposit: whether to use the region (bench/relay.py turns it off to time the framed road).
        self.use_shm = self.shm_mode != "off"
        self.region: OwnedRegion | None = None
        self._shm_reply: wire.ShmAccepted | wire.ShmRefused | None = None
        self._spare = Prefaulted()  # result memory made ready by `reserve`
        self._closing = False
        self._closed = threading.Event()  # set by close(): a lost-controller exit in its grace stands down
        # A walk-in (docs/elastic-averaging.md, "Growth and healing"): its relay's Entry names its first
        # round and its membership, and the last averaged result follows; its first deposit waits for both.
        self._entry: wire.Entry | None = None
        self._entered = not env.walk_in
        self._said_ready = False  # RankReady sent (a walk-in, at its first wait for the entry)
        self._entry_state: Bundle | None = None
        # A first sign of life now, not one interval later: the controller's liveness holds a rank never
        # heard from to the long startup grace, and a rank that stops early must be declared dead in time.
        self.control.send(Heartbeat(rank=env.rank, step=self.step))
        for target, name in (
            (self._read_data, "data"),
            (self._watch_control, "control"),
            (self._beat, "heartbeat"),
        ):
            threading.Thread(target=target, name=f"flodld-relay-{name}", daemon=True).start()

    # --- training thread -------------------------------------------------------------------

    def deposit(
        self, tensors: Sequence[torch.Tensor], *, weight: float = 1.0, fold: str | None = None
    ) -> int:
        """Send this rank's contribution to the next round; returns the round number, which `wait_round`
        takes the result of (kept until then). The data plane takes round r + 1 from a rank only once
        round r is complete, so a caller that may have a round out first waits for it (`wait_arrived`, as
        `flodld.rank.averaging` does).
        """
        spec = fold or self.env.fold
        scaled = (
            [tensor * weight for tensor in tensors] if spec == "mean" and weight != 1.0 else list(tensors)
        )
        specs, parts = encode_bundle_parts(scaled)
        layout = Layout(specs)
        if not self._entered and self._region_free(self.next_round - 1):
            self._region_of(layout.total)  # offered before the entry: its round waits for nothing else
        self._await_entry(None)
        ranges = layout.ranges(self.chunk_bytes)
        round_number = self.next_round
        region = self._region_for(layout.total, round_number)
        for (offset, length), tail in zip(ranges, split_parts(parts, ranges), strict=True):
            if region is not None:
                region.write(offset, tail)
                self.data.send(
                    wire.ShmDeposit(
                        round=round_number,
                        fold=spec,
                        weight=weight,
                        tensors=specs,
                        offset=offset,
                        length=length,
                    )
                )
            else:
                self.data.send(
                    wire.Deposit(round=round_number, fold=spec, weight=weight, tensors=specs, offset=offset),
                    tail,
                )
        with self._changed:
            self._rounds.deposited[round_number] = tuple(specs)
        self.next_round += 1
        return round_number

    def _region_for(self, total: int, round_number: int) -> OwnedRegion | None:
        """The region this deposit goes through, or None (framed). The relay writes each round's result
        over the deposit it folded, so a deposit made before this rank's previous round is back goes
        framed and leaves the region alone (the Averager's modes never do that: they wait, or deposit only
        once their last round is back).
        """
        return self._region_of(total) if self._region_free(round_number - 1) else None

    def _region_free(self, last_round: int) -> bool:
        """Whether the region may take a deposit now: the road is on and this rank's results up to
        `last_round` are back (copied out of the region).
        """
        if not self.use_shm or self.shm_mode == "off":
            return False
        with self._changed:
            if self._error is not None:
                raise RelayClientError(self._error)
            return self.latest_completed_round() >= last_round

    def _region_of(self, total: int) -> OwnedRegion | None:
        """A region of at least `total` bundle bytes: the current one, or a new one offered and accepted
        (the old one is closed: call only when every result read from it has been copied out).
        """
        if self.region is not None and self.region.capacity >= total:
            return self.region
        try:
            region = OwnedRegion(total)
        except (ShmError, OSError) as error:
            self._without_shm(f"no memory region: {error}")
            return None
        with self._changed:
            self._shm_reply = None
        self.data.send(wire.ShmOffer(pid=os.getpid(), fd=region.fd, size=region.size, tag=region.tag.hex()))
        with self._changed:
            self._changed.wait_for(
                lambda: self._shm_reply is not None or self._error is not None, scaled(CONNECT_TIMEOUT_SECS)
            )
            reply, error_text = self._shm_reply, self._error
        if not isinstance(reply, wire.ShmAccepted):
            region.close()
            if error_text is not None:
                raise RelayClientError(error_text)
            why = reply.reason if isinstance(reply, wire.ShmRefused) else "the relay did not answer the offer"
            self._without_shm(f"the relay refused the region: {why}")
            return None
        if self.region is not None:
            self.region.close()
        self.region = region
        return region

    def reserve(self, nbytes: int) -> bool:
        """Make the shared-memory road ready now for rounds of up to `nbytes` bundle bytes, so that the
        first such round does not pay for it: the region is created, faulted in, offered and accepted here,
        and memory for that round's result is faulted in too (the first result of at least half `nbytes`
        is assembled into it). For a program that knows its round size before the timed part (a warm-up).

        Called from the training thread, like `deposit`. True when a region of that size is ready; False
        when the road is off or refused (`FLODL_SHM`: the refusal is logged once, or raised under `on`), or
        when a result of this rank's is still out (the region then stays as it is).
        """
        if nbytes < 0:
            raise ValueError(f"cannot reserve {nbytes} bytes")
        if not self._region_free(self.next_round - 1) or self._region_of(nbytes) is None:
            return False
        spare = Prefaulted(nbytes)  # the pages faulted in now, not while the round's result is copied out
        with self._changed:
            self._spare = spare
        return True

    def _take_spare(self, layout: Layout) -> Bundle | None:
        """The reserved result memory as this layout's tensors, when it is the round it was reserved for."""
        with self._changed:
            return self._spare.take(layout)

    def _without_shm(self, reason: str) -> None:
        """Framed from now on, said once (FLODL_SHM=on: an error instead)."""
        if self.shm_mode == "on":
            raise RelayClientError(f"FLODL_SHM=on but shared memory with the relay is unavailable: {reason}")
        self.shm_mode = "off"
        log.warning(
            "flodld rank %d: shared memory with the relay is unavailable (%s); deposits go framed "
            "(set FLODL_SHM=off to silence this)",
            self.env.rank,
            reason,
        )

    def wait_round(self, round_number: int, timeout: float | None = None) -> Bundle:
        """Block until the broadcast of `round_number` arrives, and take it (each result is taken once).

        RelayClientError when the result's tensors are not the shapes and dtypes this rank deposited for
        that round: another round's tensors are never handed back in its place.
        """
        with self._changed:
            ok = self._changed.wait_for(
                lambda: round_number in self._rounds.kept or self._error is not None, timeout
            )
            if self._error is not None:
                raise RelayClientError(self._error)
            if not ok:
                raise TimeoutError(f"no broadcast for round {round_number} within {timeout}s")
            try:
                tensors = self._rounds.take(round_number)
            except ResultError as error:
                raise RelayClientError(str(error)) from None
        self.step += 1
        return tensors

    def wait_arrived(self, round_number: int, timeout: float | None = None) -> None:
        """Block until the results of every round up to `round_number` are in (kept for `wait_round`)."""
        with self._changed:
            ok = self._changed.wait_for(
                lambda: self._rounds.arrived >= round_number or self._error is not None, timeout
            )
            if self._error is not None:
                raise RelayClientError(self._error)
            if not ok:
                raise TimeoutError(f"no broadcast for round {round_number} within {timeout}s")

    @property
    def membership(self) -> Membership:
        """Who averaged in the last completed round (every rank of the world before the first; a walk-in,
        before its first round: the members expected in it, itself included, once it has entered).
        """
        self._await_entry(None)
        with self._changed:
            return self._rounds.membership

    @property
    def latest(self) -> tuple[Result, Bundle] | None:
        """The newest result of any round, for diagnostics (which round, who contributed): never a call's
        value, which `wait_round` takes by its round number.
        """
        with self._changed:
            return self._rounds.latest

    def _await_entry(self, timeout: float | None) -> None:
        """A walk-in: say it is ready (RankReady, once), then block until its relay handed over the Entry
        and the state (at once for the others). The controller lets the host in only once each of its ranks
        is ready, so the members never wait in a round for a walk-in's start-up.
        """
        if self._entered:
            return
        with self._changed:
            say, self._said_ready = not self._said_ready, True
        if say:
            self.data.send(wire.RankReady())
        with self._changed:
            ok = self._changed.wait_for(lambda: self._entered or self._error is not None, timeout)
            if self._error is not None:
                raise RelayClientError(self._error)
            if not ok:
                raise TimeoutError(f"rank {self.env.rank} did not enter the averaging within {timeout}s")

    def entry_state(self, timeout: float | None = None) -> Bundle | None:
        """A walk-in's starting point: the last averaged result of the run it entered (the same bytes every
        member received for that round), taken once; None on a rank of the formed world, when no round
        had completed before it entered, or once taken. Blocks until the walk-in has entered.
        """
        self._await_entry(timeout)
        with self._changed:
            state, self._entry_state = self._entry_state, None
            return state

    @property
    def entry(self) -> wire.Entry | None:
        """The Entry a walk-in's relay handed over (its first round, membership); None on other ranks."""
        with self._changed:
            return self._entry

    def latest_completed_round(self) -> int:
        """The newest round whose result is in (every earlier one is in too); -1 before the first."""
        with self._changed:
            return self._rounds.arrived

    def close(self) -> None:
        self._closing = True
        self._closed.set()
        self.data.close()
        self.control.close()
        if self.region is not None:
            self.region.close()
            self.region = None

    # --- background threads ----------------------------------------------------------------

    def _read_data(self) -> None:
        """Keep the broadcasts; however this thread ends, waiters are woken with the reason (never hang)."""
        reason = "the data leg reader stopped"
        try:
            while True:
                frame = self.data.recv()
                message = frame.message()
                if isinstance(message, wire.Entry):
                    self._enter(message)
                elif not self._entered and isinstance(message, wire.Broadcast):
                    self._take_state(message, frame)
                elif isinstance(message, wire.Broadcast | wire.ShmResult):
                    done = self._assemble(message, frame)
                    if done is None:
                        continue
                    with self._changed:
                        self._rounds.arrive(*done, self.next_round)
                        self._changed.notify_all()
                elif isinstance(message, wire.ShmAccepted | wire.ShmRefused):
                    with self._changed:
                        self._shm_reply = message
                        self._changed.notify_all()
                elif isinstance(message, wire.DataPlaneError):
                    reason = f"the data plane refused this rank: {message.reason}"
                    return
        except (EOFError, OSError, WireError) as error:
            reason = f"the relay closed the data leg ({error})"
        except Exception as error:  # a frame that does not decode (CodecError, a bad message): refuse it
            self.refused += 1
            reason = f"the relay sent a data frame this rank cannot decode ({type(error).__name__}: {error})"
            self.data.close()
        finally:
            self._fail(reason)

    def _enter(self, entry: wire.Entry) -> None:
        """The relay let this walk-in in: its rounds start at `entry.round` (the state, if any, follows)."""
        if not self.env.walk_in or self._entry is not None:
            raise ValueError("an Entry to a rank that did not walk in, or a second one")
        with self._changed:
            self._entry = entry
            self.next_round = entry.round
            self._rounds.enter(entry)
            if not entry.state:
                self._entered = True
            self._changed.notify_all()

    def _take_state(self, message: wire.Broadcast, frame: Frame) -> None:
        """A chunk of the walk-in's state (round `entry.round - 1`); whole, the walk-in has entered."""
        entry = self._entry
        if entry is None or not entry.state or message.round != entry.round - 1:
            raise ValueError(f"a broadcast of round {message.round} before this walk-in entered")
        done = self._assemble(message, frame)
        if done is None:
            return
        with self._changed:
            self._entry_state = done[1]
            self._entered = True
            self._changed.notify_all()

    def _assemble(self, message: Result, frame: Frame) -> tuple[Result, Bundle] | None:
        """The round's value once its last chunk is in (an unchunked broadcast: at once, without a copy;
        a chunk in the region: copied out of it).
        """
        if isinstance(message, wire.ShmResult):
            if self.region is None:
                raise ValueError(f"a shared-memory result of round {message.round} without a region")
            view = self.region.data(message.offset, message.length)
        else:
            view = frame.tail_view
            if message.offset == 0 and view.nbytes == sum(spec.nbytes() for spec in message.tensors):
                self._assembling.reset()
                return message, decode_bundle(message.tensors, view)
        tensors = self._assembling.add(message, view)
        if not isinstance(message, wire.ShmResult):
            self.data.conn.recycle(frame)  # copied into the round's tensors: its buffer is free
        return None if tensors is None else (message, tensors)

    def _fail(self, reason: str) -> None:
        with self._changed:
            self._error = self._error or reason
            self._changed.notify_all()

    def _watch_control(self) -> None:
        while True:
            try:
                message = self.control.recv(self.env.liveness_timeout).message()
            except TimeoutError:
                self._lost(f"no word from the controller for {self.env.liveness_timeout:g}s")
                return
            except (EOFError, OSError, WireError) as error:
                self._lost(f"control leg closed ({error})")
                return
            if isinstance(message, Shutdown):
                _exit_now(f"flodld rank {self.env.rank}: shutdown from the controller: {message.reason}", 1)
            elif not isinstance(message, CoordinatorHeartbeat):
                continue

    def _lost(self, why: str) -> None:
        if self._closing:
            return
        # A rank declared dead was stopped: its agent sends the stack-dump signal, then CONT, and the relay
        # has closed its legs. On CONT this thread sees the closed leg at once while faulthandler's C handler
        # writes every thread's stack; exiting now would cut that dump short (seen in CI under load). The
        # dump takes well under this; a rank that really lost its controller leaves this much later.
        # A client closed meanwhile is being shut down by its owner: no exit then.
        if self._closed.wait(STACK_DUMP_GRACE_SECS):
            return
        _exit_now(
            f"flodld rank {self.env.rank}: lost the controller ({why}); exiting instead of hanging",
            LOST_CONTROLLER_EXIT_CODE,
        )

    def _beat(self) -> None:
        stop = threading.Event()
        while not stop.wait(self.env.heartbeat_interval):
            try:
                self.control.send(Heartbeat(rank=self.env.rank, step=self.step))
            except (OSError, WireError):
                return


_client: RelayClient | None = None
_client_lock = threading.Lock()


def connect_relay(env: RankEnvironment) -> RelayClient:
    """Open (once per process) the legs to this host's relay."""
    global _client
    with _client_lock:
        if _client is None:
            _client = RelayClient(env)
            # The legs close when the program is done, not when the process ends: the heartbeat thread stops
            # as interpreter finalization begins, and tearing torch down can take longer than a short
            # liveness timeout, which would declare a rank that finished dead. A closed leg is a clean leave.
            # (atexit runs last what registers first: a launcher's handlers registered later run before.)
            atexit.register(_client.close)
        return _client


def relay_client() -> RelayClient:
    """The process's relay client; init_process_group() opens it when the host has a relay."""
    if _client is None:
        from flodld.rank.env import in_flodld_rank, read_rank_environment

        if not in_flodld_rank():
            raise RelayClientError(
                "CPU averaging needs a flodld rank (start the program with `fdl run` or `fdl join`)"
            )
        env = read_rank_environment()
        if env.relay_port is None:
            raise RelayClientError(
                "this host has no relay (the run's averaging mode does not use the CPU data plane)"
            )
        return connect_relay(env)
    return _client
