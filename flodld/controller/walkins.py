"""Growth at the data plane: a host admitted during training (a walk-in) enters the averaging at a round
boundary (docs/elastic-averaging.md, "Growth and healing").

A walk-in's ranks are expected (`expect`) when its host is admitted; they enter once every one of them is
ready (`rank_connected`, told by RankConnected: the rank waits in its first averaging call, so the members
never wait in a round for a walk-in's start-up) and the relay's DATA channel is up, at the first round not
started. Its relay gets an
Entry (round, epoch, members) and then the last round's result (`last_result`: the accumulator holds it
until the round after next starts, which waits for the walk-in's deposit), in chunks of the run's chunk
size: the bytes every member received. The epoch is the ranks' own count of membership changes, replayed
here from each round's contributors.

A healed slot's rank that rides a relay already in the averaging (Hello.rides; docs/elastic-averaging.md,
"Slots heal in place") is expected under that relay's host and enters the same way, alone: its Entry names
it (`Entry.ranks`) and the relay admits it to its own fold at the round the Entry names. It enters only at
the end of a round (`round_closed`), where the Entry reaches the relay before the round's last result
chunk: none of the relay's ranks can have deposited for the next round yet, so the relay's fold is at that
boundary too (a rank deposits round r + 1 only once it holds round r).

`WalkIns` holds that bookkeeping for the data plane (controller/dataplane.py), which tells it each round's
end (`round_closed`) and each rank's departure (`left_before_entry`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from flodld.controller.status.metrics import RunMetrics
from flodld.net.stream import FramedStream
from flodld.wire.data import Broadcast, Entry
from flodld.wire.errors import WireError

if TYPE_CHECKING:
    from flodld.fold.barrier import ChunkResult, RoundBarrier

# The data plane's log: a walk-in's progress reads among the plane's other events.
log = logging.getLogger("flodld.controller.dataplane")

RanksEntered = Callable[[tuple[int, ...], int], None]


class WalkIns:
    """Walk-ins waiting to enter the averaging, and the state a walk-in gets when it enters."""

    def __init__(
        self,
        data_relays: Mapping[str, FramedStream],
        live_ranks: dict[str, set[int]],
        *,
        metrics: RunMetrics,
        chunk_env: Mapping[str, str] | None = None,
    ) -> None:
        self.data_relays = data_relays  # the plane's relays on DATA, by host
        self.live_ranks = live_ranks  # the plane's: a walk-in's ranks go live there when it enters
        self.metrics = metrics
        self.chunk_env = dict(chunk_env or {})  # FLODL_CHUNK_BYTES as the ranks read it (a walk-in's state)
        self.entering: dict[str, set[int]] = {}  # host -> its ranks still expected
        self._connected: dict[str, set[int]] = {}  # host -> its ranks ready to enter so far
        self.on_entered: RanksEntered | None = None
        self._last_result: ChunkResult[str] | None = None
        self._members_seen = self._members()  # as the ranks count epochs
        self._epoch = 0
        self._riders: set[int] = set()  # expected ranks that ride a relay in the averaging

    def riders_of(self, host: str) -> list[int]:
        """`host`'s riders still expected (they can enter only while the relay's own ranks average)."""
        return sorted(self.entering.get(host, set()) & self._riders)

    def expect(self, host: str, ranks: Sequence[int], *, riders: bool = False) -> None:
        """`ranks` will enter through `host`'s relay: a walk-in's (an earlier incarnation's ranks still
        expected are forgotten), or `riders` of a relay in the averaging (added to any expected already).
        """
        if riders:
            self.entering.setdefault(host, set()).update(ranks)
            self._connected.setdefault(host, set())
            self._riders.update(ranks)
        else:
            self.entering[host] = set(ranks)
            self._connected[host] = set()

    def rank_connected(self, host: str, rank: int) -> bool:
        """A walk-in's rank is ready to enter (RankConnected); True when that completes its host (it may
        enter now).
        """
        pending = self.entering.get(host)
        if pending is None or rank not in pending:
            return False  # not a walk-in's rank waiting to enter (one gone already, or a late word)
        self._connected.setdefault(host, set()).add(rank)
        if pending <= self._connected[host]:
            log.info("event=walk_in_ready host=%s ranks=%s", host, sorted(pending))
            return True
        return False

    def left_before_entry(self, host: str, rank: int) -> bool:
        """`rank` left: True when it was a walk-in's rank that had not entered yet (forgotten here)."""
        pending = self.entering.get(host)
        if pending is None or rank not in pending:
            return False
        pending.discard(rank)
        self._riders.discard(rank)
        if not pending:
            del self.entering[host]
            self._connected.pop(host, None)
        return True

    def round_closed(
        self, result: ChunkResult[str], contributors: set[int], barrier: RoundBarrier[str] | None
    ) -> list[FramedStream]:
        """The last chunk of `result`'s round is done: it becomes the state walk-ins get, and those ready
        enter the next round (Entry and state sealed now, before any await). Returns the streams to drain.
        """
        self._last_result = result
        members = tuple(sorted(contributors))
        if members and members != self._members_seen:  # the ranks' own epoch count, replayed here
            self._epoch += 1
            self._members_seen = members
        return self._enter(barrier, result.round + 1, round_end=True)

    def at_boundary(self, barrier: RoundBarrier[str] | None) -> list[FramedStream]:
        """Walk-ins whose ranks are all connected enter now if the world is at a round boundary whose state
        is at hand (no round started; the last round's result still held), else at the end of the round in
        progress. Returns the streams to drain.
        """
        if barrier is None:
            next_round = 0  # nothing folded here yet: it enters the first round, with no state
        elif barrier.started:
            return []
        else:
            next_round = barrier.round
            last = self._last_result
            if next_round > 0 and (last is None or last.round != next_round - 1):
                return []  # the round before closed without a value: no state to hand over yet
        return self._enter(barrier, next_round)

    def _members(self) -> tuple[int, ...]:
        return tuple(sorted(set().union(*self.live_ranks.values())))

    @staticmethod
    async def drain(streams: list[FramedStream]) -> None:
        for stream in streams:
            try:
                await stream.drain()
            except (OSError, WireError, TimeoutError) as error:
                log.warning("event=walk_in_state_unsent error=%r", str(error))

    def _enter(
        self, barrier: RoundBarrier[str] | None, round_number: int, *, round_end: bool = False
    ) -> list[FramedStream]:
        entered = self._enter_now(barrier, round_number, round_end=round_end)
        sealed = [self._seal_entry(host, round_number, riders) for host, riders in entered]
        return [stream for stream in sealed if stream is not None]

    def _enter_now(
        self, barrier: RoundBarrier[str] | None, round_number: int, *, round_end: bool
    ) -> list[tuple[str, list[int]]]:
        """Let every walk-in whose relay's DATA channel is up into the averaging from `round_number`, the
        round that has not started (the caller is at its boundary; `round_end`: the round before has just
        closed, its last chunk not sent yet). Riders of a relay in the averaging enter only at a round's
        end. Returns the hosts that entered, each with its riders (empty: a walk-in host, all its ranks).
        """
        ready = [host for host in sorted(self.entering) if self._may_enter(host, round_end)]
        if not ready:
            return []
        if barrier is not None and (barrier.started or barrier.round != round_number):
            return []  # past the boundary already: the next one
        entered = []
        for host in ready:
            ranks = self.entering.pop(host)
            self._connected.pop(host, None)
            riders = sorted(ranks & self._riders)
            self._riders -= ranks
            if barrier is not None and not riders:
                barrier.admit(host)
            self.live_ranks.setdefault(host, set()).update(ranks)
            entered.append((host, riders))
            log.info("event=walk_in_entered host=%s ranks=%s round=%d riders=%s", host, sorted(ranks),
                     round_number, bool(riders))  # fmt: skip
            if self.on_entered is not None:
                self.on_entered(tuple(sorted(ranks)), round_number)
        return entered

    def _may_enter(self, host: str, round_end: bool) -> bool:
        """Whether `host`'s expected ranks are all connected through its seated relay and may enter now: a
        walk-in host at any boundary; riders only at a round's end, and only while their relay's own ranks
        average (its fold has stopped otherwise).
        """
        if host not in self.data_relays or not self.entering[host] <= self._connected.get(host, set()):
            return False
        return not self.riders_of(host) or (round_end and bool(self.live_ranks.get(host)))

    def _seal_entry(self, host: str, round_number: int, riders: list[int]) -> FramedStream | None:
        """Entry to a walk-in's relay, then (when a round was completed before) that round's result: the
        finished accumulator in chunks of the run's chunk size, the bytes every member received. Sealed
        here, without an await: no broadcast can come between them, and the accumulator may be reused as
        soon as this returns (by a round the walk-in is skipped in, under a straggler timeout). Returns the
        stream to drain.
        """
        stream = self.data_relays.get(host)
        if stream is None:
            return None
        members = self._members()
        epoch = self._epoch + (members != self._members_seen)
        last = self._last_result if round_number > 0 else None
        state = last is not None and last.round == round_number - 1
        try:
            entry = Entry(round=round_number, epoch=epoch, members=list(members), state=state, ranks=riders)
            stream.send_nowait(entry)
            if state:
                assert last is not None
                from flodld.fold.chunks import Layout, byte_views, chunk_bytes_from_env  # torch: in by now

                layout = Layout(last.specs)
                chunk_bytes = max(chunk_bytes_from_env(self.chunk_env), max(layout.itemsizes, default=1))
                contributors = sorted(self._members_seen)
                for offset, length in layout.ranges(chunk_bytes):
                    chunk = Broadcast(
                        round=last.round,
                        fold=last.fold_spec,
                        weight=last.weight,
                        contributors=contributors,
                        tensors=list(last.specs),
                        offset=offset,
                    )
                    stream.send_nowait(chunk, byte_views(last.tensors, layout.pieces(offset, length)))
                    self.metrics.sent(length)
        except (OSError, WireError) as error:
            log.warning("event=walk_in_state_unsent host=%s error=%r", host, str(error))
            return None
        return stream
