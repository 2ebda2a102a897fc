"""Chunked folding equals the unchunked fold bit for bit: float sums in fixed order, the modular fold exactly.

The reference is the bundle fold (`identity`, `add` in member order, `finish`) on whole tensors; the
chunked path is the barrier fed chunk by chunk, in shuffled arrival order, at chunk sizes that do and do
not divide the tensors, through one level (a relay) and two (relays, then the controller).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Hashable, Sequence
from typing import Any, TypeVar

import pytest
import torch

from flodld.fold import base, chunks
from flodld.fold.barrier import ChunkResult, RoundBarrier, RoundError
from flodld.fold.base import Bundle, FoldError, fold_from_spec
from flodld.fold.chunks import Assembly, Layout, split_parts
from flodld.fold.codec import CodecError, encode_bundle_parts
from flodld.wire.data import TensorSpec

Member = TypeVar("Member", bound=Hashable)
MODULI = (1073479681, 1072496641, 97)


def float_bundle(rank: int) -> Bundle:
    generator = torch.Generator().manual_seed(1000 + rank)
    return (
        torch.randn(1031, generator=generator) * 1e3,  # prime length: no chunk size divides it
        torch.randn(7, 13, dtype=torch.float64, generator=generator),
        torch.randn(
            333, dtype=torch.float16, generator=generator
        ),  # odd bytes: later tensors start unaligned
        torch.empty(0, 4),
        torch.tensor(float(rank) / 3.0),  # a scalar
        torch.randn(2, 2, 129, generator=generator).to(torch.bfloat16),
    )


def modular_bundle(rank: int) -> Bundle:
    generator = torch.Generator().manual_seed(2000 + rank)
    limbs = [torch.randint(0, q, (2, 1, 77), generator=generator) for q in MODULI]
    return (
        torch.cat(limbs, dim=1),
        torch.cat([torch.randint(0, q, (1, 1, 5), generator=generator) for q in MODULI], 1),
    )


def reference(spec: str, deposits: list[Bundle], weights: list[float]) -> Bundle:
    fold = fold_from_spec(spec)
    accumulator = fold.identity(deposits[0])
    for deposit in deposits:  # member order
        accumulator = fold.add(accumulator, deposit)
    return fold.finish(accumulator, sum(weights))


def chunks_of(deposit: Bundle, chunk_bytes: int) -> tuple[list[TensorSpec], list[tuple[int, memoryview]]]:
    specs, parts = encode_bundle_parts(deposit)
    ranges = Layout(specs).ranges(chunk_bytes)
    pieces = [
        (offset, memoryview(bytearray(b"".join(bytes(view) for view in views))))
        for (offset, _), views in zip(ranges, split_parts(parts, ranges), strict=True)
    ]
    return specs, pieces


def fold_chunked(
    barrier: RoundBarrier[Member],
    spec: str,
    deposits: dict[Member, Bundle],
    weights: dict[Member, float],
    chunk_bytes: int,
    seed: int,
) -> list[ChunkResult[Member]]:
    """Feed every member's chunks, interleaved in a shuffled order (each member's own chunks in order)."""
    queues = {member: chunks_of(deposit, chunk_bytes) for member, deposit in deposits.items()}
    cursor = dict.fromkeys(deposits, 0)
    shuffle = random.Random(seed)
    results: list[ChunkResult[Member]] = []
    while any(cursor[member] < len(queues[member][1]) for member in deposits):
        member = shuffle.choice([m for m in deposits if cursor[m] < len(queues[m][1])])
        specs, pieces = queues[member]
        offset, data = pieces[cursor[member]]
        cursor[member] += 1
        results += barrier.contribute_chunk(member, barrier.round, spec, specs, offset, data, weights[member])
    return results


def assemble(results: Sequence[ChunkResult[Any]], *, finish: bool) -> Bundle:
    assembly = Assembly(results[0].specs)
    done = False
    for result in results:
        if finish:
            result.finish()
        done = assembly.add(result.offset, memoryview(b"".join(bytes(view) for view in result.byte_views())))
    assert done and results[-1].last
    return assembly.tensors


def assert_bitwise_equal(got: Bundle, want: Bundle) -> None:
    assert len(got) == len(want)
    for index, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape, index
        assert (
            mine.contiguous().view(-1).view(torch.uint8).tolist()
            == theirs.contiguous().view(-1).view(torch.uint8).tolist()
        ), index


CHUNK_SIZES = [64, 100, 1000, 4099, 1 << 20]


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("chunk_bytes", CHUNK_SIZES)
@pytest.mark.parametrize("spec", ["mean", "sum", "modular:" + ",".join(map(str, MODULI))])
def test_one_level_chunked_fold_equals_the_unchunked_fold_bit_for_bit(
    spec: str, chunk_bytes: int, ranks: int
) -> None:
    make = modular_bundle if spec.startswith("modular") else float_bundle
    deposits = {rank: make(rank) for rank in range(ranks)}
    weights = {rank: 1.0 + rank for rank in range(ranks)}
    want = reference(spec, [deposits[r] for r in range(ranks)], [weights[r] for r in range(ranks)])
    barrier: RoundBarrier[int] = RoundBarrier(range(ranks))
    for round_number in range(2):  # the second round reuses the accumulator
        results = fold_chunked(barrier, spec, deposits, weights, chunk_bytes, seed=round_number * 7 + ranks)
        assert [r.round for r in results] == [round_number] * len(results)
        assert all(r.weight == sum(weights.values()) and r.contributors == set(deposits) for r in results)
        assert_bitwise_equal(assemble(results, finish=True), want)


def aligned_bundle(rank: int) -> Bundle:
    """Tensors that lie side by side in one buffer on their element boundaries: float32 runs across
    tensors, then a float64 and a float16 one (a run ends where the dtype changes).
    """
    generator = torch.Generator().manual_seed(3000 + rank)
    return (
        torch.randn(1031, generator=generator),
        torch.randn(7, 13, generator=generator) * 1e3,
        torch.randn(3, generator=generator),
        torch.randn(1, generator=generator),  # 1031 + 91 + 3 + 1 float32s: the float64 starts at byte 4504
        torch.randn(5, 5, dtype=torch.float64, generator=generator),
        torch.randn(33, dtype=torch.float16, generator=generator),
    )


@pytest.mark.parametrize("chunk_bytes", [64, 1000, 4099, 1 << 20])
@pytest.mark.parametrize("spec", ["mean", "sum"])
def test_an_elementwise_fold_folds_runs_of_one_dtype_bit_for_bit_as_piece_by_piece(
    spec: str, chunk_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    deposits = {rank: aligned_bundle(rank) for rank in range(3)}
    weights = {rank: 1.0 + rank for rank in range(3)}
    want = reference(spec, [deposits[r] for r in range(3)], [weights[r] for r in range(3)])
    by_runs: RoundBarrier[int] = RoundBarrier(range(3))
    for round_number in range(2):
        results = fold_chunked(by_runs, spec, deposits, weights, chunk_bytes, seed=round_number)
        assert all(result.runs is not None and result.flat is not None for result in results)
        assert isinstance(results[0].tensors, chunks.FlatBundle)
        if chunk_bytes == 1 << 20:  # one chunk: a run per dtype
            dtypes = [run.dtype for run in results[0].runs or ()]
            assert dtypes == [torch.float32, torch.float64, torch.float16]
        assert_bitwise_equal(assemble(results, finish=True), want)
    monkeypatch.setattr(base._FloatSum, "elementwise", False)
    by_pieces: RoundBarrier[int] = RoundBarrier(range(3))
    results = fold_chunked(by_pieces, spec, deposits, weights, chunk_bytes, seed=0)
    assert all(result.runs is None for result in results)
    assert_bitwise_equal(assemble(results, finish=True), want)


@pytest.mark.parametrize("chunk_bytes", CHUNK_SIZES)
@pytest.mark.parametrize("spec", ["mean", "modular:" + ",".join(map(str, MODULI))])
def test_two_level_chunked_fold_equals_the_same_tree_unchunked(spec: str, chunk_bytes: int) -> None:
    """Relays fold their ranks and pass each chunk up as it completes; the controller folds hosts."""
    make = modular_bundle if spec.startswith("modular") else float_bundle
    hosts = {"a": [0, 1], "b": [2], "c": [3, 4]}
    deposits = {rank: make(rank) for rank in range(5)}
    fold = fold_from_spec(spec)
    partials = []
    for ranks in hosts.values():
        partial = fold.identity(deposits[ranks[0]])
        for rank in ranks:
            partial = fold.add(partial, deposits[rank])
        partials.append(partial)
    total = fold.identity(partials[0])
    for partial in partials:  # host order
        total = fold.add(total, partial)
    want = fold.finish(total, 5.0)
    world: RoundBarrier[str] = RoundBarrier(hosts)
    shuffle = random.Random(3)
    relays: dict[str, RoundBarrier[int]] = {host: RoundBarrier(ranks) for host, ranks in hosts.items()}
    streams = {
        host: chunks_of_results(relays[host], spec, {r: deposits[r] for r in ranks}, chunk_bytes)
        for host, ranks in hosts.items()
    }
    top: list[ChunkResult[str]] = []
    while any(streams.values()):
        host = shuffle.choice([h for h, pending in streams.items() if pending])
        result = streams[host].pop(0)
        data = memoryview(bytearray(b"".join(bytes(v) for v in result[3])))
        top += world.contribute_chunk(host, 0, spec, result[0], result[1], data, result[2])
    assert_bitwise_equal(assemble(top, finish=True), want)


Shipped = tuple[tuple[TensorSpec, ...], int, float, list[bytes]]


def chunks_of_results(
    barrier: RoundBarrier[int], spec: str, deposits: dict[int, Bundle], chunk_bytes: int
) -> list[Shipped]:
    out = fold_chunked(barrier, spec, deposits, dict.fromkeys(deposits, 1.0), chunk_bytes, seed=len(deposits))
    return [(r.specs, r.offset, r.weight, [bytes(v) for v in r.byte_views()]) for r in out]


def test_a_chunk_folds_only_when_the_members_before_it_in_the_fixed_order_have_arrived() -> None:
    barrier: RoundBarrier[int] = RoundBarrier([0, 1, 2])
    specs, pieces = chunks_of((torch.arange(64, dtype=torch.float32),), 64)
    released: list[int] = []
    assert len(pieces) == 4
    for member in (2, 1):
        release = functools.partial(released.append, member)
        assert barrier.contribute_chunk(member, 0, "sum", specs, 0, pieces[0][1], 1.0, release) == []
    assert released == []  # rank 0 folds first: both wait
    done = barrier.contribute_chunk(0, 0, "sum", specs, 0, pieces[0][1], 1.0, lambda: released.append(0))
    assert released == [0, 1, 2] and [(r.offset, r.length, r.last) for r in done] == [(0, 64, False)]


def test_a_member_that_leaves_mid_deposit_is_in_the_chunks_it_sent_and_out_of_the_rest() -> None:
    barrier: RoundBarrier[int] = RoundBarrier([0, 1])
    specs, zero = chunks_of((torch.zeros(32),), 64)
    _, ones = chunks_of((torch.ones(32),), 64)
    out = barrier.contribute_chunk(0, 0, "mean", specs, 0, ones[0][1], 1.0)
    out += barrier.contribute_chunk(1, 0, "mean", specs, 0, zero[0][1], 1.0)
    out += barrier.leave(1)
    out += barrier.contribute_chunk(0, 0, "mean", specs, 64, ones[1][1], 1.0)
    assert [(r.offset, r.weight, sorted(r.contributors), r.last) for r in out] == [
        (0, 2.0, [0, 1], False),
        (64, 1.0, [0], True),
    ]
    mean = assemble(out, finish=True)[0]
    assert torch.equal(mean, torch.cat([torch.full((16,), 0.5), torch.ones(16)]))


def test_a_host_whose_rank_left_mid_deposit_sends_later_chunks_with_less_weight_and_is_folded() -> None:
    """Two levels: a relay's rank 1 leaves after its first chunk, so the host's partial weighs 2 in chunk 0
    and 1 in chunk 1; the controller's barrier (`weights_may_drop`) folds both, and every element is the
    mean of the deposits that reached it. A host weight that rises within a round is still refused.
    """
    relay: RoundBarrier[int] = RoundBarrier([0, 1])
    specs, threes = chunks_of((torch.full((32,), 3.0),), 64)
    _, ones = chunks_of((torch.ones(32),), 64)
    partials = relay.contribute_chunk(0, 0, "mean", specs, 0, threes[0][1], 1.0)
    partials += relay.contribute_chunk(1, 0, "mean", specs, 0, ones[0][1], 1.0)
    partials += relay.leave(1)
    partials += relay.contribute_chunk(0, 0, "mean", specs, 64, threes[1][1], 1.0)
    assert [partial.weight for partial in partials] == [2.0, 1.0]
    controller: RoundBarrier[str] = RoundBarrier(["host-a"], weights_may_drop=True)
    out = []
    for partial in partials:
        data = memoryview(bytearray(b"".join(bytes(view) for view in partial.byte_views())))
        out += controller.contribute_chunk("host-a", 0, "mean", specs, partial.offset, data, partial.weight)
    mean = assemble(out, finish=True)[0]
    assert torch.equal(mean, torch.cat([torch.full((16,), 2.0), torch.full((16,), 3.0)]))
    rising: RoundBarrier[str] = RoundBarrier(["host-a"], weights_may_drop=True)
    rising.contribute_chunk("host-a", 0, "mean", specs, 0, ones[0][1], 1.0)
    with pytest.raises(RoundError, match="changed its weight"):
        rising.contribute_chunk("host-a", 0, "mean", specs, 64, ones[1][1], 2.0)


def test_chunk_refusals_name_the_rule() -> None:
    barrier: RoundBarrier[int] = RoundBarrier([0, 1])
    specs, pieces = chunks_of((torch.zeros(32),), 64)
    with pytest.raises(RoundError, match="expected byte 0"):
        barrier.contribute_chunk(0, 0, "sum", specs, 64, pieces[1][1], 1.0)
    barrier.contribute_chunk(0, 0, "sum", specs, 0, pieces[0][1], 1.0)
    with pytest.raises(FoldError, match="same chunk size"):
        barrier.contribute_chunk(1, 0, "sum", specs, 0, memoryview(bytearray(32)), 1.0)
    with pytest.raises(CodecError, match="element boundaries"):
        RoundBarrier([0]).contribute_chunk(0, 0, "sum", specs, 0, memoryview(bytearray(62)), 1.0)
    with pytest.raises(RoundError, match="changed its weight"):
        barrier.contribute_chunk(0, 0, "sum", specs, 64, pieces[1][1], 2.0)
    other, _ = chunks_of((torch.zeros(31),), 64)
    with pytest.raises(FoldError, match="shape"):
        barrier.contribute_chunk(1, 0, "sum", other, 0, pieces[0][1], 1.0)
    # A refused chunk leaves nothing behind: the round goes on as if it never came.
    barrier.contribute_chunk(1, 0, "sum", specs, 0, pieces[0][1], 1.0)


def test_a_modular_chunk_with_a_residue_out_of_its_limbs_range_is_refused_on_arrival() -> None:
    barrier: RoundBarrier[int] = RoundBarrier([0, 1])
    bad = torch.zeros(1, 2, 8, dtype=torch.int64)
    bad[0, 1, 5] = 101  # limb 1's modulus
    specs, pieces = chunks_of((bad,), 128)
    barrier.contribute_chunk(
        0,
        0,
        "modular:97,101",
        specs,
        0,
        chunks_of((torch.zeros(1, 2, 8, dtype=torch.int64),), 128)[1][0][1],
        1.0,
    )
    with pytest.raises(FoldError, match=r"outside \[0, q\)"):
        barrier.contribute_chunk(1, 0, "modular:97,101", specs, 0, pieces[0][1], 1.0)
    good = chunks_of((torch.ones(1, 2, 8, dtype=torch.int64),), 128)[1][0][1]
    (result,) = barrier.contribute_chunk(1, 0, "modular:97,101", specs, 0, good, 1.0)
    assert torch.equal(result.tensors[0], torch.ones(1, 2, 8, dtype=torch.int64))


def test_the_accumulator_is_reused_round_after_round() -> None:
    barrier: RoundBarrier[int] = RoundBarrier([0])
    specs, pieces = chunks_of((torch.ones(8),), 64)
    first = barrier.contribute_chunk(0, 0, "sum", specs, 0, pieces[0][1], 1.0)
    second = barrier.contribute_chunk(0, 1, "sum", specs, 0, pieces[0][1], 1.0)
    assert first[0].tensors[0].data_ptr() == second[0].tensors[0].data_ptr()
    assert torch.equal(second[0].tensors[0], torch.ones(8))


def test_layout_ranges_end_on_element_boundaries_and_cover_every_byte() -> None:
    specs, _ = encode_bundle_parts(float_bundle(0))
    layout = Layout(specs)
    for chunk_bytes in (8, 13, 100, 4099):
        ranges = layout.ranges(chunk_bytes)
        assert sum(length for _, length in ranges) == layout.total
        assert all(layout.pieces(offset, length) for offset, length in ranges)
        assert all(0 < length <= chunk_bytes for _, length in ranges)


def test_a_layout_holds_exactly_the_schemas_equal_to_its_own() -> None:
    specs, _ = encode_bundle_parts(float_bundle(0))
    layout = Layout(specs)
    assert set(TensorSpec.model_fields) == {"dtype", "shape"}, "Layout.holds compares these fields only"
    same = [TensorSpec.model_validate(spec.model_dump()) for spec in specs]
    assert layout.holds(same) and layout.holds(tuple(same))
    other_dtype = [*specs[:-1], TensorSpec(dtype="float64", shape=list(specs[-1].shape))]
    other_shape = [*specs[:-1], TensorSpec(dtype=specs[-1].dtype, shape=[*specs[-1].shape, 1])]
    for other in (other_dtype, other_shape, specs[:-1], [*specs, specs[0]], []):
        assert not layout.holds(other) and tuple(other) != layout.specs


def test_a_layout_keeps_its_chunks_pieces_up_to_a_bound_and_refuses_a_bad_chunk_every_time() -> None:
    specs, _ = encode_bundle_parts(float_bundle(0))
    layout = Layout(specs)
    offset, length = layout.ranges(13)[1]
    kept = layout.chunk_pieces(offset, length)
    assert kept == tuple(layout.pieces(offset, length)) and layout.chunk_pieces(offset, length) is kept
    for _ in range(2):
        with pytest.raises(CodecError):
            layout.chunk_pieces(1, 4)  # splits an element: never kept, refused again
    for start in range(0, 1031 * 4, 4):  # the float32 tensor first in the bundle, element by element
        layout.chunk_pieces(start, 4)
    assert len(layout._pieces) <= chunks.PIECES_KEPT


@pytest.mark.parametrize(
    "chunk_bytes", [40, 64, 128, 200], ids=["part-rows", "one-row", "two-rows", "rows-and-part"]
)
@pytest.mark.parametrize("bad", [101, -1, 2**62], ids=["q-of-limb-1", "negative", "huge"])
def test_every_chunk_shape_refuses_a_residue_outside_its_limbs_range(chunk_bytes: int, bad: int) -> None:
    value = torch.zeros(2, 2, 8, dtype=torch.int64)
    value[1, 1, 5] = bad  # limb 1 (q = 101) of the second component
    specs, pieces = chunks_of((value,), chunk_bytes)
    barrier: RoundBarrier[int] = RoundBarrier([0])
    with pytest.raises(FoldError, match=r"outside \[0, q\)"):
        for offset, data in pieces:
            barrier.contribute_chunk(0, 0, "modular:97,101", specs, offset, data, 1.0)
    value[1, 1, 5] = 100  # q - 1 is fine
    specs, pieces = chunks_of((value,), chunk_bytes)
    fresh: RoundBarrier[int] = RoundBarrier([0])
    results = [
        r
        for offset, data in pieces
        for r in fresh.contribute_chunk(0, 0, "modular:97,101", specs, offset, data, 1.0)
    ]
    assert torch.equal(assemble(results, finish=True)[0], value)


def test_the_modular_slice_fold_is_exact_up_to_the_largest_modulus() -> None:
    moduli = [2**62 - 57, 3]
    spec = "modular:" + ",".join(map(str, moduli))
    generator = torch.Generator().manual_seed(7)
    deposits: dict[int, Bundle] = {
        rank: (
            torch.cat(
                [torch.randint(max(0, q - 1000), q, (4, 1, 33), generator=generator) for q in moduli], dim=1
            ),
        )
        for rank in range(3)
    }
    want = reference(spec, [deposits[rank] for rank in range(3)], [1.0] * 3)
    exact = [
        sum(int(deposits[rank][0][0, limb, 0]) for rank in range(3)) % q for limb, q in enumerate(moduli)
    ]
    assert [int(want[0][0, limb, 0]) for limb in range(2)] == exact
    for chunk_bytes in (64, 136, 1000):
        barrier: RoundBarrier[int] = RoundBarrier(range(3))
        results = fold_chunked(
            barrier, spec, deposits, dict.fromkeys(range(3), 1.0), chunk_bytes, seed=chunk_bytes
        )
        assert_bitwise_equal(assemble(results, finish=True), want)


def test_two_accumulators_alternate_so_a_round_never_overwrites_the_one_before() -> None:
    """The controller's case: round r + 1 folds while round r's value may still be waiting to be sent."""
    barrier: RoundBarrier[int] = RoundBarrier([0], accumulators=2)
    specs, pieces = chunks_of((torch.ones(8),), 64)
    results = [
        barrier.contribute_chunk(0, number, "sum", specs, 0, pieces[0][1], 1.0)[0] for number in range(4)
    ]
    pointers = [result.tensors[0].data_ptr() for result in results]
    assert pointers[0] != pointers[1] and pointers[0] == pointers[2] and pointers[1] == pointers[3]
    with pytest.raises(ValueError, match="1 or 2"):
        RoundBarrier([0], accumulators=3)


class _NumpyMean:
    """A plugin fold whose `identity` needs real memory (numpy cannot read meta tensors)."""

    spec = "numpymean"

    def identity(self, like: Bundle) -> Bundle:
        return tuple(torch.from_numpy(tensor.numpy() * 0) for tensor in like)

    def __getattr__(self, name: str) -> Any:  # noqa: ANN401  # the rest of the mean fold, unchanged
        return getattr(fold_from_spec("mean"), name)


@pytest.mark.parametrize("accumulators", [1, 2])
def test_schemas_that_change_round_by_round_fold_exactly_in_uninitialised_accumulators(
    accumulators: int,
) -> None:
    """A new accumulator is not zero-filled (each chunk is zeroed as its first member folds), so what the
    memory held before never reaches a result; a plugin whose identity cannot take meta tensors works.
    """
    from flodld.fold.base import register_fold

    register_fold("numpymean", lambda params: _NumpyMean())
    barrier: RoundBarrier[int] = RoundBarrier(range(3), accumulators=accumulators)
    def schema(number: int, rank: int) -> Bundle:
        whole = float_bundle(rank)
        return (whole, whole[:2], (whole[0] * 7,))[number % 3]

    for number in range(6):
        deposits = {rank: schema(number, rank) for rank in range(3)}
        spec = "numpymean" if number == 4 else "mean"
        results = fold_chunked(barrier, spec, deposits, dict.fromkeys(range(3), 1.0), 1000, seed=number)
        want = reference("mean", [deposits[rank] for rank in range(3)], [1.0] * 3)
        assert_bitwise_equal(assemble(results, finish=True), want)
        # Scribble over what this round leaves behind: a later round that reused it unzeroed would show it.
        for tensor in results[0].tensors:
            if tensor.numel():
                tensor.view(-1).view(torch.uint8).fill_(0x7F)


@pytest.mark.parametrize("spec", ["mean", "sum", "modular:" + ",".join(map(str, MODULI))])
def test_a_chunk_starts_in_one_pass_exactly_as_from_zero(spec: str) -> None:
    """The chunk's first member starts it with `start_slice` (no zero pass, no add, no reduction), and the
    result is bit for bit the zero start's: over whatever the reused accumulator held, -0.0 becoming +0.0
    in the float folds as `0 + x` does, and every residue kept as it is.
    """
    modular = spec.startswith("modular")
    make = modular_bundle if modular else float_bundle
    deposits = {rank: make(rank) for rank in range(2)}
    if not modular:  # negative zeros, in both deposits (so the sum is -0.0 + -0.0 after a -0.0 start)
        for rank in range(2):
            deposits[rank][0][::5] = -0.0
    weights = {0: 1.0, 1: 2.0}
    want = reference(spec, [deposits[0], deposits[1]], [1.0, 2.0])
    fold = fold_from_spec(spec)
    calls: list[str] = []

    class Recording:
        """The real fold, with its slice methods counted."""

        spec = "recorded"

        def __getattr__(self, name: str) -> Any:  # noqa: ANN401
            attribute = getattr(fold, name)
            if name in ("start_slice", "add_slice"):

                def counted(*args: Any) -> None:  # noqa: ANN401
                    calls.append(name)
                    attribute(*args)

                return counted
            return attribute

    from flodld.fold.base import register_fold

    register_fold("recorded", lambda params: Recording())
    barrier: RoundBarrier[int] = RoundBarrier(range(2))
    for number in range(2):
        calls.clear()
        results = fold_chunked(barrier, "recorded", deposits, weights, 100, seed=number)
        assert_bitwise_equal(assemble(results, finish=True), want)
        pieces = sum(len(result.pieces) for result in results)
        assert calls.count("start_slice") == pieces and calls.count("add_slice") == pieces
        for tensor in results[0].tensors:  # what the next round's starts must not see
            if tensor.numel():
                tensor.view(-1).view(torch.uint8).fill_(0x7F)


def test_a_plugin_fold_without_start_slice_is_started_from_zero() -> None:
    """A fold that lacks the optional `start_slice` is zeroed and added to, exactly as before."""
    mean = fold_from_spec("mean")

    class Plain:
        spec = "plainmean"
        identity = mean.identity
        add = mean.add
        finish = mean.finish
        check_slice = mean.check_slice
        add_slice = mean.add_slice
        finish_slice = mean.finish_slice

    from flodld.fold.base import register_fold

    register_fold("plainmean", lambda params: Plain())
    assert not hasattr(Plain(), "start_slice")
    deposits = {rank: float_bundle(rank) for rank in range(3)}
    want = reference("mean", [deposits[rank] for rank in range(3)], [1.0] * 3)
    barrier: RoundBarrier[int] = RoundBarrier(range(3))
    for number in range(2):
        ones = dict.fromkeys(range(3), 1.0)
        results = fold_chunked(barrier, "plainmean", deposits, ones, 1000, seed=number)
        assert_bitwise_equal(assemble(results, finish=True), want)
        for tensor in results[0].tensors:
            if tensor.numel():
                tensor.view(-1).view(torch.uint8).fill_(0x7F)


def test_a_layout_lies_within_a_byte_buffer_it_fits_and_nowhere_else() -> None:
    specs, parts = encode_bundle_parts([torch.arange(6, dtype=torch.int64).view(2, 3), torch.ones(3)])
    layout = Layout(specs)
    buffer = torch.zeros(layout.total + 8, dtype=torch.uint8)
    tensors = layout.within(buffer)
    assert tensors is not None
    assert [(t.dtype, tuple(t.shape)) for t in tensors] == [(torch.int64, (2, 3)), (torch.float32, (3,))]
    assembly = Assembly(specs, lambda _: tensors)
    assert assembly.add(0, memoryview(b"".join(bytes(part) for part in parts)))
    assert assembly.tensors is tensors
    assert torch.equal(tensors[0], torch.arange(6).view(2, 3)) and torch.equal(tensors[1], torch.ones(3))
    assert bytes(buffer[: layout.total].numpy()) == b"".join(bytes(part) for part in parts)
    assert layout.within(torch.zeros(layout.total - 1, dtype=torch.uint8)) is None  # too small
    assert layout.within(torch.zeros(layout.total, dtype=torch.int8)) is None  # not bytes
    odd, _ = encode_bundle_parts([torch.ones(1, dtype=torch.float16), torch.ones(1, dtype=torch.int64)])
    assert Layout(odd).within(torch.zeros(64, dtype=torch.uint8)) is None  # int64 at byte 2


@pytest.mark.parametrize("spec", ["mean", "modular:" + ",".join(map(str, MODULI))])
def test_a_prepared_barrier_folds_its_next_new_accumulator_in_the_prepared_memory_bit_for_bit(
    spec: str,
) -> None:
    def aligned(rank: int) -> Bundle:  # every tensor on its element boundary (float_bundle's are not)
        generator = torch.Generator().manual_seed(3000 + rank)
        return (torch.randn(7, 13, dtype=torch.float64, generator=generator), torch.randn(1031) * 1e3)

    make = modular_bundle if spec.startswith("modular") else aligned
    deposits = {rank: make(rank) for rank in range(2)}
    weights = {0: 1.0, 1: 3.0}
    total = Layout(encode_bundle_parts(list(deposits[0]))[0]).total
    plain: RoundBarrier[int] = RoundBarrier(range(2))
    prepared: RoundBarrier[int] = RoundBarrier(range(2))
    prepared.prepare(total + 100)
    spare = prepared.accumulators.spare.buffer
    assert spare is not None
    prepared.prepare(total)  # already big enough: the same memory
    assert prepared.accumulators.spare.buffer is spare
    want = fold_chunked(plain, spec, deposits, weights, 100, seed=1)
    got = fold_chunked(prepared, spec, deposits, weights, 100, seed=1)
    assert_bitwise_equal(assemble(got, finish=True), assemble(want, finish=True))
    assert got[0].tensors[0].untyped_storage().data_ptr() == spare.untyped_storage().data_ptr()
    assert prepared.accumulators.spare.buffer is None  # taken once: a later new accumulator is fresh memory
    # Too big a spare for the round (more than twice its bytes) stays for a bigger round.
    small: RoundBarrier[int] = RoundBarrier(range(2))
    small.prepare(4 * total)
    fold_chunked(small, spec, deposits, weights, 100, seed=2)
    assert (
        small.accumulators.spare.buffer is not None and small.accumulators.spare.buffer.numel() == 4 * total
    )
    # A schema whose tensors cannot lie in it on their element boundaries gets fresh memory too.
    unaligned: RoundBarrier[int] = RoundBarrier(range(2))
    floats = {rank: float_bundle(rank) for rank in range(2)}
    unaligned.prepare(Layout(encode_bundle_parts(list(floats[0]))[0]).total)
    fold_chunked(unaligned, "mean", floats, weights, 100, seed=3)
    assert unaligned.accumulators.spare.buffer is not None
