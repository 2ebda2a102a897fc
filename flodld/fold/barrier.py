"""The round barrier: who still owes a deposit this round, and the running fold of those who paid.

Used twice with the same rules: by a relay over its local ranks, and by the controller over
hosts (a host frame is a partial fold). A deposit arrives as one or more chunks (`flodld.fold.chunks`);
each chunk is folded and handed on as soon as every live member's chunk at that offset is in, so a
large bundle is pipelined through the hops instead of stored and forwarded whole. Rules:

- every chunk folds its members in one fixed order (sorted members), whatever order they arrive in: a
  chunk that arrives early waits (the caller's buffer is released once it is folded), so the float sums
  are the same bit for bit at every chunk size and every arrival order;
- a chunk is complete when every live member has folded it; chunks are handed on in offset order, and
  the round completes with its last chunk; the result is the partial sum and summed weight per chunk
  (`finish_slice` is the top-level caller's job);
- a member that leaves is folded out: chunks it had sent stay in the round, the rest stop waiting for
  it (a member that leaves in the middle of its deposit is in the chunks that arrived and out of the
  others: every element is the weighted sum of the deposits that reached it, and each chunk's weight
  and contributors say whose);
- depositing twice in one round, after leaving, or for another round number, a chunk out of order, a
  different schema, fold or weight within a round, or chunk boundaries that differ between members
  is an error (the caller's peer is broken, and the message says so). With `weights_may_drop` (the
  controller, whose members are hosts) a member's weight may fall from one chunk to the next, never
  rise: a host's chunk is a partial fold, and a rank that left its relay mid-deposit is in the host's
  early chunks and out of the later ones;
- a live member may be skipped for the round in progress only (`skip`: a straggler past the run's
  `straggler_timeout`, flodld.fold.straggler decides when): the round is folded out of it as if it had
  left, but it stays a member, and the round closes even when a chunk then has no contributor at all
  (that chunk is never handed on; the hop above skips this member for it in turn). Its chunks of a
  round it was skipped in, arriving after, are late: dropped (released at once, counted in
  `late_chunks`), never folded into another round.

The accumulator is allocated once per schema and fold, and reused round after round.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

from flodld.fold.accumulators import Accumulators
from flodld.fold.base import Bundle, Fold, FoldError, fold_from_spec
from flodld.fold.chunks import FlatBundle, Layout, Piece, Run, byte_views, held, run_bytes, run_view
from flodld.fold.codec import encode_bundle
from flodld.fold.late import SkippedRounds
from flodld.fold.ordered import OrderedChunk
from flodld.wire.data import TensorSpec

Member = TypeVar("Member", bound=Hashable)
Release = Callable[[], None]


class ChunkMessage(Protocol):
    """What a chunk's message says about it (`Deposit` and `HostFrame` both do)."""

    @property
    def round(self) -> int: ...
    @property
    def fold(self) -> str: ...
    @property
    def tensors(self) -> Sequence[TensorSpec]: ...
    @property
    def offset(self) -> int: ...
    @property
    def weight(self) -> float: ...


class RoundError(ValueError):
    """A contribution breaks the barrier's rules; the message names the member and the rule."""


@dataclass(frozen=True)
class RoundResult(Generic[Member]):
    """A completed round: partial sum, total weight, and who is in it (`contribute`'s whole-bundle view).

    `tensors` is the barrier's accumulator: valid until the barrier folds the next round.
    """

    round: int
    fold_spec: str
    tensors: Bundle
    weight: float
    contributors: frozenset[Member]


@dataclass(frozen=True)
class ChunkResult(Generic[Member]):
    """A completed chunk: the partial sum of bytes [offset, offset + length) of the round's bundle.

    `pieces` locate it in `tensors` (the accumulator; `byte_views()` for a frame's tail): valid until the
    barrier folds the same chunk of the next round. `last` marks the round's final chunk.
    """

    round: int
    fold: Fold
    specs: tuple[TensorSpec, ...]
    offset: int
    length: int
    tensors: Bundle
    pieces: tuple[Piece, ...]
    weight: float
    contributors: frozenset[Member]
    last: bool
    runs: tuple[Run, ...] | None = None  # when its elementwise fold folded runs of `flat`, the tensors' bytes
    flat: torch.Tensor | None = None

    @property
    def fold_spec(self) -> str:
        return self.fold.spec

    def byte_views(self) -> list[memoryview]:
        if self.runs is not None and self.flat is not None:
            return run_bytes(self.flat, self.runs)
        return byte_views(self.tensors, self.pieces)

    def finish(self) -> None:
        """Apply the fold's `finish_slice` to this chunk in place (the top-level hop does, once)."""
        if self.runs is not None and self.flat is not None:
            for run in self.runs:
                self.fold.finish_slice(run_view(self.flat, run), self.weight, run.span)
            return
        for piece in self.pieces:
            self.fold.finish_slice(held(self.tensors, piece), self.weight, piece.span)


class RoundBarrier(Generic[Member]):
    """Sans-io barrier that folds contributions chunk by chunk into reused accumulators.

    `accumulators` (1 or 2) is how many rounds' values may be in use at once. The top-level hop sends a
    finished chunk to several peers, and a peer that has the whole round may deposit the next one while a
    send to a slower peer still waits to read the chunk: with 2, round r + 1 folds into the other
    accumulator, and round r + 2 cannot start before every peer had all of round r (its deposits wait
    for round r + 1, which waits for every peer's deposit, which waits for round r).
    """

    def __init__(
        self,
        members: Iterable[Member],
        *,
        first_round: int = 0,
        accumulators: int = 1,
        weights_may_drop: bool = False,
    ) -> None:
        self._live: set[Member] = set(members)
        if not self._live:
            raise RoundError("a round barrier needs at least one member")
        self.accumulators = Accumulators(accumulators)
        self._gone: set[Member] = set()
        # Rounds each live member was skipped in and has not deposited past yet: its chunks of those
        # rounds are late (dropped).
        self._skipped_rounds: SkippedRounds[Member] = SkippedRounds()
        self.late_chunks = 0  # chunks dropped as late (their round closed without their member)
        self.skips = 0  # deposits skipped (member-rounds)
        self._weights_may_drop = weights_may_drop
        self.round = first_round
        self._last_layout: Layout | None = None  # the layout of the last round that started
        self._reset()

    def _reset(self) -> None:
        self._fold: Fold | None = None
        self._layout: Layout | None = None
        self._accumulator: Bundle = ()
        self._order: list[Member] = []
        self._next: dict[Member, int] = {}  # each member's next chunk offset
        self._weights: dict[Member, float] = {}
        self._paid: set[Member] = set()  # every chunk sent
        self._skipped: set[Member] = set()  # skipped for this round only (`skip`)
        self._chunks: dict[int, OrderedChunk[Member]] = {}
        self._emitted = 0  # bytes handed on
        self._touched = False

    @property
    def live(self) -> frozenset[Member]:
        return frozenset(self._live)

    @property
    def waiting_for(self) -> frozenset[Member]:
        """Live members that still owe (some of) this round (and were not skipped in it)."""
        return frozenset(self._live - self._paid - self._skipped)

    @property
    def started(self) -> bool:
        """Whether a chunk of the round in progress has been taken."""
        return self._fold is not None

    # --- growth (docs/elastic-averaging.md, "Growth and healing") ------------------------------

    def admit(self, member: Member) -> None:
        """A member that enters at this round boundary: the round in progress must not have started (its
        fold order is fixed when its first chunk is taken). A member that left may enter again (a host
        that walked in under its old name); a live one is an error.
        """
        if self.started:
            raise RoundError(
                f"{member!r} cannot enter round {self.round}: it has started (members enter at a boundary)"
            )
        if member in self._live:
            raise RoundError(f"{member!r} is a member already")
        self._gone.discard(member)
        self._live.add(member)

    def begin_at(self, round_number: int) -> None:
        """Number the next round `round_number` (a walk-in's relay: its first round is the one it entered
        at); only before any chunk of the round in progress was taken, and never backwards.
        """
        if self.started or round_number < self.round:
            raise RoundError(
                f"cannot move the barrier from round {self.round} to {round_number}"
                + (" (it has started)" if self.started else "")
            )
        self.round = round_number

    # --- chunks -----------------------------------------------------------------------------

    def contribute_message(
        self, member: Member, message: ChunkMessage, data: memoryview, release: Release | None = None
    ) -> list[ChunkResult[Member]]:
        """`contribute_chunk` with the round, fold, schema, offset and weight a chunk's message carries
        (a rank's `Deposit` at the relay, a relay's `HostFrame` at the controller).
        """
        return self.contribute_chunk(
            member,
            message.round,
            message.fold,
            message.tensors,
            message.offset,
            data,
            message.weight,
            release,
        )

    def contribute_chunk(
        self,
        member: Member,
        round_number: int,
        fold_spec: str,
        specs: Sequence[TensorSpec],
        offset: int,
        data: memoryview,
        weight: float,
        release: Release | None = None,
    ) -> list[ChunkResult[Member]]:
        """Take one chunk of `member`'s deposit (bytes `data` at `offset`); returns the chunks it completes.

        `data` must stay untouched until `release` is called (at once when the chunk folds now, later
        when it waits for a member before it in the fold order); a writable view is used in place.
        On an error nothing of this chunk is kept and `release` is not called. A late chunk (of a round
        `member` was skipped in) is dropped: `release` is called at once, nothing is returned.
        """
        if self._is_late(member, round_number):
            self.late_chunks += 1
            if release is not None:
                release()
            return []
        self._check_member(member, round_number, weight)
        data = memoryview(data).cast("B")
        if self._fold is None or self._layout is None:
            fold: Fold = fold_from_spec(fold_spec)
            layout = self._layout_of(specs)
        else:
            fold, layout = self._fold, self._layout
            if fold_spec != fold.spec:
                raise FoldError(
                    f"{member!r} folds with {fold_spec!r} but round {self.round} folds with {fold.spec!r}"
                )
            if not layout.holds(specs):
                raise FoldError(
                    f"{member!r} deposits a schema that differs from round {self.round}'s: "
                    + _diff(specs, layout.specs)
                )
        expected = self._next.get(member, 0)
        if offset != expected:
            raise RoundError(
                f"{member!r} sent the chunk at byte {offset} of round {self.round}; expected byte {expected}"
            )
        held = self._weights.get(member)
        if held is not None and (weight > held if self._weights_may_drop else weight != held):
            raise RoundError(
                f"{member!r} changed its weight within round {self.round} ({self._weights[member]} -> "
                f"{weight})"
            )
        chunk = self._chunks.get(offset)
        if chunk is None:
            chunk = OrderedChunk(length=data.nbytes, pieces=layout.chunk_pieces(offset, data.nbytes))
        elif chunk.length != data.nbytes:
            raise FoldError(
                f"{member!r} sent {data.nbytes} bytes at offset {offset} but its peers sent {chunk.length}: "
                "every member must split a deposit at the same chunk size"
            )
        if data.readonly and data.nbytes:
            data = memoryview(bytearray(data))
        accumulator = (
            self.accumulators.for_round(self.round, fold, layout) if self._fold is None else self._accumulator
        )
        # An elementwise fold into an accumulator laid out in one buffer folds runs of one dtype, not pieces.
        elementwise = getattr(fold, "elementwise", False) is True  # its slices ignore spans: `_FloatSum`
        flat = accumulator.flat if elementwise and isinstance(accumulator, FlatBundle) else None
        runs = layout.chunk_runs(offset, data.nbytes) if flat is not None else None
        slices: tuple[Piece | Run, ...] = runs if runs is not None else chunk.pieces
        incoming = layout.incoming(data, slices)
        for piece, tensor in zip(slices, incoming, strict=True):
            fold.check_slice(tensor, piece.span)
        # Accepted: from here on the chunk is the round's.
        self._skipped_rounds.deposits(member, round_number)
        if self._fold is None:
            self._start(fold, layout, accumulator)
        assert self._layout is not None
        self._chunks[offset] = chunk
        chunk.runs, chunk.flat = runs, flat  # alike for every member: the round's fold and accumulator
        self._weights[member] = weight
        self._next[member] = offset + data.nbytes
        if self._next[member] == self._layout.total:
            self._paid.add(member)
        chunk.parked[member] = (incoming, weight, release)
        self._drain(chunk)
        return self._emit()

    def leave(self, member: Member) -> list[ChunkResult[Member]]:
        """Fold a member out (EOF, declared dead); returns the chunks that completed without it."""
        if member not in self._live:
            return []
        self._live.discard(member)
        self._gone.add(member)
        self._skipped_rounds.forget(member)
        round_number = self.round
        results: list[ChunkResult[Member]] = []
        if self._fold is not None:
            for chunk in self._chunks.values():
                self._drain(chunk)
            results = self._emit()
        if self.round == round_number and self._skipped and not self.waiting_for:
            self._close_without_value()  # the rest of the round was skipped
        return results

    def skip(self, members: Iterable[Member]) -> list[ChunkResult[Member]]:
        """Fold live `members` out of the round in progress only (stragglers); they stay members.

        Returns the chunks that complete without them. The round then closes as soon as no member it still
        waits for owes a chunk, even if some chunk got no contributor (never handed on; a round nobody
        deposited in closes with no result at all). Their later chunks of this round are late (dropped).
        """
        chosen = [member for member in members if member in self._live and member not in self._paid]
        chosen = [member for member in chosen if member not in self._skipped]
        if not chosen:
            return []
        round_number = self.round
        for member in chosen:
            self._skipped.add(member)
            self._skipped_rounds.skipped(member, round_number)
            self.skips += 1
        results: list[ChunkResult[Member]] = []
        if self._fold is not None:
            for chunk in self._chunks.values():
                self._drain(chunk)
            results = self._emit()
        if self.round == round_number and not self.waiting_for:
            self._close_without_value()
        return results

    def _close_without_value(self) -> None:
        """End the round in progress whose remaining chunks nobody can fold (every owing member skipped)."""
        for chunk in self._chunks.values():
            for _, _, release in chunk.parked.values():  # pragma: no cover - parked only behind a live member
                if release is not None:
                    release()
        self.round += 1
        self._reset()

    def _is_late(self, member: Member, round_number: int) -> bool:
        if round_number > self.round or member not in self._live:
            return False
        if round_number == self.round:
            return member in self._skipped
        return self._skipped_rounds.was_skipped(member, round_number)

    def _check_member(self, member: Member, round_number: int, weight: float) -> None:
        if member in self._gone:
            raise RoundError(f"{member!r} contributed after it left the round")
        if member not in self._live:
            raise RoundError(
                f"{member!r} is not a member of this round (members: {sorted(map(repr, self._live))})"
            )
        if member in self._paid:
            raise RoundError(
                f"{member!r} deposited twice in round {self.round} (a double deposit is an error)"
            )
        if round_number != self.round:
            raise RoundError(
                f"{member!r} deposited for round {round_number} but the barrier is at round {self.round}"
            )
        if not weight >= 0 or weight == float("inf"):
            raise RoundError(f"{member!r} deposited weight {weight}; weights must be finite and >= 0")

    def prepare(self, nbytes: int) -> None:
        """Fault in `nbytes` of memory now for the next accumulator this barrier has to make (the first
        round of a new schema whose bundle is at least half of it): a fresh accumulator's pages would
        otherwise be faulted in one by one while its round's first member is folded in. A relay calls this
        when a rank's shared-memory region tells it the size of the rounds to come.
        """
        self.accumulators.prepare(nbytes)

    def _layout_of(self, specs: Sequence[TensorSpec]) -> Layout:
        """The layout of a round's schema: the last round's (and its chunks' pieces) when it is the same."""
        last = self._last_layout
        return last if last is not None and last.holds(specs) else Layout(specs)

    def _start(self, fold: Fold, layout: Layout, accumulator: Bundle) -> None:
        self.accumulators.keep(self.round, fold, layout, accumulator)
        self._fold, self._layout, self._accumulator = fold, layout, accumulator
        self._last_layout = layout
        self._order = _fixed_order(self._live)

    def _drain(self, chunk: OrderedChunk[Member]) -> None:
        """Fold the chunk's parked contributions in the fixed order, as far as they have arrived."""
        assert self._fold is not None
        chunk.drain(self._fold, self._accumulator, self._order, self._coming)

    def _coming(self, member: Member) -> bool:
        return member in self._live and member not in self._skipped

    def _emit(self) -> list[ChunkResult[Member]]:
        assert self._fold is not None and self._layout is not None
        results: list[ChunkResult[Member]] = []
        while True:
            chunk = self._chunks.get(self._emitted)
            if chunk is None or not chunk.complete:
                return results
            if not chunk.folded:  # every member left before sending it: no value to hand on
                return results
            end = self._emitted + chunk.length
            last = end == self._layout.total
            results.append(
                ChunkResult(
                    round=self.round,
                    fold=self._fold,
                    specs=self._layout.specs,
                    offset=self._emitted,
                    length=chunk.length,
                    tensors=self._accumulator,
                    pieces=chunk.pieces,
                    runs=chunk.runs,
                    flat=chunk.flat,
                    weight=chunk.weight,
                    contributors=frozenset(chunk.folded),
                    last=last,
                )
            )
            del self._chunks[self._emitted]
            self._emitted = end
            if last:
                self.round += 1
                self._reset()
                return results

    # --- whole bundles ----------------------------------------------------------------------

    def contribute(
        self, member: Member, round_number: int, fold_spec: str, tensors: Bundle, weight: float
    ) -> RoundResult[Member] | None:
        """Fold one whole-bundle contribution (one chunk); returns the result when it completes the round."""
        specs, tail = encode_bundle(tensors)
        data = memoryview(bytearray(tail))
        return self._whole(self.contribute_chunk(member, round_number, fold_spec, specs, 0, data, weight))

    def remove(self, member: Member) -> RoundResult[Member] | None:
        """Fold a member out (EOF, declared dead); returns a result if that was all the round awaited."""
        return self._whole(self.leave(member))

    @staticmethod
    def _whole(results: list[ChunkResult[Member]]) -> RoundResult[Member] | None:
        for result in results:
            if result.last:
                return RoundResult(
                    round=result.round,
                    fold_spec=result.fold_spec,
                    tensors=result.tensors,
                    weight=result.weight,
                    contributors=result.contributors,
                )
        return None


def _fixed_order(members: Iterable[Member]) -> list[Member]:
    try:
        return sorted(members)  # type: ignore[type-var]  # ranks and host names sort
    except TypeError:
        return sorted(members, key=repr)


def _diff(got: Sequence[TensorSpec], want: Sequence[TensorSpec]) -> str:
    if len(got) != len(want):
        return f"it carries {len(got)} tensor(s) but this round folds {len(want)}"
    for index, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        if mine.shape != theirs.shape:
            return f"tensor {index} has shape {tuple(mine.shape)} but this round folds {tuple(theirs.shape)}"
        if mine.dtype != theirs.dtype:
            return f"tensor {index} has dtype {mine.dtype} but this round folds {theirs.dtype}"
    return "the tensor specs differ"  # pragma: no cover
