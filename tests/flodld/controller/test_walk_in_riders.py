"""Riders at the controller (flodld/controller/walkins.py; docs/elastic-averaging.md, "Slots heal in place"):
a healed slot's rank riding a relay already in the averaging enters alone, and only at a round's end.

At the end of a round its Entry reaches the relay before the round's last result chunk, so none of the
relay's ranks can have deposited the next round: the relay's fold is at the same boundary. A boundary found
idle (no round started here) gives no such guarantee (the relay's ranks may be depositing already), so a
rider waits there, where a walk-in host, whose relay folds nothing before its Entry, enters at once.
"""

from __future__ import annotations

from typing import Any

import torch

from flodld.controller.status.metrics import RunMetrics
from flodld.controller.walkins import WalkIns
from flodld.fold.barrier import ChunkResult, RoundBarrier
from flodld.wire.data import Broadcast, Entry
from flodld.wire.messages import Message
from tests.flodld.fold.test_fold_chunks import chunks_of


class _Stream:
    def __init__(self) -> None:
        self.sent: list[Message] = []

    def send_nowait(self, message: Message, tail: Any = b"") -> None:  # noqa: ANN401
        self.sent.append(message)


def _round(barrier: RoundBarrier[str], number: int) -> ChunkResult[str]:
    """Hosts a and b deposit round `number`: its (one, last) chunk."""
    results = []
    for host, value in (("a", 1.0), ("b", 3.0)):
        specs, data = chunks_of((torch.full((4,), value),), 1 << 20)
        results += barrier.contribute_chunk(host, number, "mean", specs, 0, data[0][1], 1.0)
    (last,) = results
    assert last.last
    last.finish()
    return last


def test_a_rider_enters_alone_at_the_end_of_a_round_never_at_a_boundary_found_idle() -> None:
    streams = {"a": _Stream(), "b": _Stream()}
    live = {"a": {0, 1}, "b": {2}}
    walk_ins = WalkIns(streams, live, metrics=RunMetrics())  # type: ignore[arg-type]
    entered: list[tuple[tuple[int, ...], int]] = []
    walk_ins.on_entered = lambda ranks, number: entered.append((ranks, number))
    barrier: RoundBarrier[str] = RoundBarrier(["a", "b"])
    walk_ins.round_closed(_round(barrier, 0), {0, 1, 2}, barrier)
    walk_ins.expect("a", [3], riders=True)  # a's slot healed: rank 3 rides a's relay
    assert walk_ins.rank_connected("a", 3)
    assert walk_ins.at_boundary(barrier) == [] and live["a"] == {0, 1}  # idle boundary: it waits
    drained = walk_ins.round_closed(_round(barrier, 1), {0, 1, 2}, barrier)
    assert drained == [streams["a"]] and entered == [((3,), 2)]  # type: ignore[comparison-overlap]
    assert live == {"a": {0, 1, 3}, "b": {2}} and barrier.live == frozenset({"a", "b"})
    entry, *state = streams["a"].sent
    assert isinstance(entry, Entry)
    assert (entry.round, entry.ranks, entry.members, entry.state) == (2, [3], [0, 1, 2, 3], True)
    assert [type(chunk) for chunk in state] == [Broadcast] and state[0].round == 1  # type: ignore[attr-defined]
    assert streams["b"].sent == []


def test_a_walk_in_host_still_enters_at_a_boundary_found_idle() -> None:
    streams = {"a": _Stream(), "b": _Stream(), "c": _Stream()}
    live = {"a": {0, 1}, "b": {2}}
    walk_ins = WalkIns(streams, live, metrics=RunMetrics())  # type: ignore[arg-type]
    barrier: RoundBarrier[str] = RoundBarrier(["a", "b"])
    walk_ins.round_closed(_round(barrier, 0), {0, 1, 2}, barrier)
    walk_ins.expect("c", [3])
    assert walk_ins.rank_connected("c", 3)
    assert walk_ins.at_boundary(barrier) == [streams["c"]]  # type: ignore[comparison-overlap]
    entry = streams["c"].sent[0]
    assert isinstance(entry, Entry) and (entry.round, entry.ranks) == (1, [])  # every rank of host c
    assert barrier.live == frozenset({"a", "b", "c"}) and live["c"] == {3}


def test_riders_of_a_relay_whose_own_ranks_are_gone_never_enter_it() -> None:
    """A relay whose own ranks all left has stopped folding: its riders still expected are not let in (the
    data plane folds them out, `riders_of` names them), while a walk-in host beside them still enters.
    """
    streams = {"a": _Stream(), "b": _Stream(), "c": _Stream()}
    live = {"a": {0, 1}, "b": {2}}
    walk_ins = WalkIns(streams, live, metrics=RunMetrics())  # type: ignore[arg-type]
    barrier: RoundBarrier[str] = RoundBarrier(["a", "b"])
    walk_ins.round_closed(_round(barrier, 0), {0, 1, 2}, barrier)
    walk_ins.expect("a", [3], riders=True)
    walk_ins.expect("c", [4])
    assert walk_ins.rank_connected("a", 3) and walk_ins.rank_connected("c", 4)
    live["a"].clear()  # ranks 0 and 1 left
    barrier.leave("a")
    assert walk_ins.riders_of("a") == [3] and walk_ins.riders_of("c") == []
    drained = walk_ins.at_boundary(barrier)
    assert drained == [streams["c"]] and streams["a"].sent == []  # type: ignore[comparison-overlap]
    assert walk_ins.left_before_entry("a", 3) and walk_ins.riders_of("a") == []
