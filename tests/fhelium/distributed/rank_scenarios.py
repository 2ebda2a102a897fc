"""Scenarios run inside every spawned rank (see rank_main.py); each asserts on its own rank.

A scenario runs on the default group and on a subgroup whose members are not a prefix of the
world (so group ranks, global ranks and local ranks all differ), and returns JSON-able data
that the pytest side compares across ranks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from fhelium_dist_values import (
    ciphertext,
    compressed_sparse,
    engine_residues,
    keys,
    plaintext_rns,
    plaintext_slots,
    same_value,
    secret_key,
    toy_engine,
)

import fhelium.distributed as fdist
from fhelium.core import Ciphertext, PublicKey, SecretKey
from fhelium.distributed import CollectiveArgumentError, CollectiveFailure, ReductionTrace
from fhelium.distributed._collective_common import group_info
from fhelium.distributed._value_collectives import broadcast_value
from fhelium.engine import CkksEngine


@dataclass(frozen=True)
class GroupCase:
    label: str
    group: fdist.ProcessGroup | None
    members: tuple[int, ...]  # global ranks in group-rank order


def subgroup_members(world_size: int) -> tuple[int, ...] | None:
    """Members that make global rank != group rank (and, for 5, non-contiguous)."""
    return {1: None, 2: (1,), 3: (1, 2), 4: (1, 3), 5: (1, 3, 4)}.get(world_size, tuple(range(1, world_size)))


@dataclass
class RankContext:
    rank: int
    world: int
    timeout_s: float
    all_cases: list[GroupCase]
    engine: CkksEngine

    @classmethod
    def create(cls, timeout_s: float) -> RankContext:
        rank, world = fdist.get_rank(), fdist.get_world_size()
        cases = [GroupCase("default", None, tuple(range(world)))]
        members = subgroup_members(world)
        if members is not None:
            # new_group is itself collective: every rank calls it, members or not.
            cases.append(GroupCase("subgroup", fdist.new_group(list(members)), members))
        return cls(rank, world, timeout_s, cases, toy_engine(seed=1000 + rank))

    def cases(self) -> list[GroupCase]:
        return [case for case in self.all_cases if self.rank in case.members]


def expect_group_error(call: Callable[[], object], *fragments: str) -> str:
    try:
        call()
    except CollectiveArgumentError as error:
        text = str(error)
        missing = [f for f in fragments if f not in text]
        assert not missing, f"error lacks {missing}: {text}"
        return text
    raise AssertionError(f"expected CollectiveArgumentError containing {fragments}")


# -- identity --------------------------------------------------------------------------------


def identity(ctx: RankContext) -> dict[str, Any]:
    default_group = fdist.group.WORLD
    fdist.init()  # a second init (e.g. after a flodld rank created the group) changes nothing
    assert fdist.group.WORLD is default_group
    out: dict[str, Any] = {
        "global_rank": fdist.get_rank(),
        "world_size": fdist.get_world_size(),
        "local_rank": fdist.local_rank(),
        "device": str(fdist.local_device()),
        "backend": str(fdist.get_backend()),
    }
    for case in ctx.cases():
        out[case.label] = {
            "group_rank": fdist.get_rank(case.group),
            "size": fdist.get_world_size(case.group),
            "global_of_group_rank_0": case.members[0]
            if case.group is None
            else fdist.get_global_rank(case.group, 0),
        }
    return out


# -- whole-value collectives -----------------------------------------------------------------


def _broadcast_cases() -> list[tuple[str, Callable[..., Any], Callable[[], Any]]]:
    wide = ciphertext(11, batch=(2,), prime_ids=(0, 1, 2, 3, 4, 5))
    cases: list[tuple[str, Callable[..., Any], Callable[[], Any]]] = [
        ("ciphertext", fdist.broadcast_ciphertext, lambda: ciphertext(10, batch=(2, 3), depth=2)),
        # a non-contiguous source: the sender packs it, the source object stays untouched
        ("ciphertext-limb-view", fdist.broadcast_ciphertext, lambda: wide.slice_limbs(1, 4)),
        ("plaintext-slots", fdist.broadcast_plaintext, lambda: plaintext_slots(12)),
        ("plaintext-rns", fdist.broadcast_plaintext, lambda: plaintext_rns(13)),
        ("compressed-sparse", fdist.broadcast_compressed_plaintext, lambda: compressed_sparse(14)),
    ]
    for index, key in enumerate(keys(15)):
        cases.append((f"key-{type(key).__name__}", fdist.broadcast_key, partial(_key, index)))
    return cases


def _key(index: int) -> object:
    return keys(15)[index]


def broadcast_values(ctx: RankContext) -> dict[str, int]:
    return {"received": sum(_broadcast_values_on(ctx, case) for case in ctx.cases())}


def _broadcast_values_on(ctx: RankContext, case: GroupCase) -> int:
    received = 0
    src = case.members[-1]  # a global rank; its group rank differs on the subgroup
    for name, broadcast, make in _broadcast_cases():
        expected = make()
        mine = make() if ctx.rank == src else None
        before = None if mine is None else [t.clone() for t in mine._resident_tensors]
        result = broadcast(mine, src=src, group=case.group)
        if ctx.rank == src:
            assert result is mine, name
            assert all(torch.equal(a, b) for a, b in zip(before or [], mine._resident_tensors, strict=True))
        else:
            assert same_value(result, expected), f"{name} differs after broadcast on {case.label}"
            assert result.device == torch.device("cpu")
            assert all(t.is_contiguous() for t in result._resident_tensors)
            received += 1
    # A raw tensor travels under its own descriptor kind; a strided source is packed.
    grid = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    raw = broadcast_value(
        grid.t() if ctx.rank == src else None,
        accepts=(torch.Tensor,),
        src=src,
        info=group_info(case.group),
        operation="broadcast_tensor",
    )
    assert torch.equal(raw, grid.t()) and raw.dtype == torch.float64
    secret = secret_key(16)
    expect_group_error(
        lambda: fdist.broadcast_key(secret if ctx.rank == src else None, src=src, group=case.group),
        "refusing to broadcast a SecretKey",
    )
    shared = fdist.broadcast_key(
        secret if ctx.rank == src else None, src=src, group=case.group, allow_secret_key=True
    )
    assert same_value(shared, secret)
    return received


def broadcast_errors(ctx: RankContext) -> dict[str, list[str]]:
    return {case.label: _broadcast_errors_on(ctx, case) for case in ctx.cases()}


def _broadcast_errors_on(ctx: RankContext, case: GroupCase) -> list[str]:
    size, group = len(case.members), case.group
    src = case.members[0]
    value = ciphertext(20)
    texts = []
    if size > 1:
        texts.append(
            expect_group_error(
                lambda: fdist.broadcast_ciphertext(value, src=src, group=group), "must supply None"
            )
        )
    wrong_type = plaintext_slots(1) if ctx.rank == src else None
    texts.append(
        expect_group_error(
            # deliberately a Plaintext: the collective's own type check is under test
            lambda: fdist.broadcast_ciphertext(wrong_type, src=src, group=group),  # type: ignore[arg-type]
            "must supply Ciphertext",
            "got Plaintext",
        )
    )
    outsider = 0 if group is not None else ctx.world
    texts.append(
        expect_group_error(
            lambda: fdist.broadcast_ciphertext(None, src=outsider, group=group),
            f"src={outsider}",
            "not a member",
        )
    )
    if size > 1:
        # Ranks disagree on the root: each believes itself (or another) to be the source.
        my_src = case.members[0] if fdist.get_rank(group) == 0 else case.members[-1]
        mine = value if ctx.rank == my_src else None
        texts.append(
            expect_group_error(
                lambda: fdist.broadcast_ciphertext(mine, src=my_src, group=group), "passed", "'src'"
            )
        )
    # The group is still usable after every refusal.
    result = fdist.broadcast_ciphertext(value if ctx.rank == src else None, src=src, group=group)
    assert same_value(result, value)
    return texts


def scatter_gather(ctx: RankContext) -> None:
    for case in ctx.cases():
        _scatter_gather_on(ctx, case)


def _scatter_gather_on(ctx: RankContext, case: GroupCase) -> None:
    size, group = len(case.members), case.group
    group_rank = fdist.get_rank(group)
    src = dst = case.members[-1]
    values = [ciphertext(100 + i, batch=(2,)) for i in range(size)] if ctx.rank == src else None
    mine = fdist.scatter_ciphertexts(values, src=src, group=group)
    if values is not None:
        assert mine is values[group_rank]
    assert same_value(mine, ciphertext(100 + group_rank, batch=(2,)))

    own = ciphertext(200 + ctx.rank)
    gathered = fdist.gather_ciphertexts(own, dst=dst, group=group)
    if ctx.rank == dst:
        assert gathered is not None and len(gathered) == size
        assert gathered[group_rank] is own
        for index, member in enumerate(case.members):
            assert same_value(gathered[index], ciphertext(200 + member)), f"position {index}"
    else:
        assert gathered is None

    everyone = fdist.all_gather_ciphertexts(own, group=group)
    assert len(everyone) == size
    assert all(same_value(v, ciphertext(200 + m)) for v, m in zip(everyone, case.members, strict=True))
    plaintexts = fdist.all_gather_plaintexts(plaintext_slots(300 + ctx.rank), group=group)
    assert all(same_value(v, plaintext_slots(300 + m)) for v, m in zip(plaintexts, case.members, strict=True))
    compressed = fdist.all_gather_compressed_plaintexts(compressed_sparse(400 + ctx.rank), group=group)
    assert all(
        same_value(v, compressed_sparse(400 + m)) for v, m in zip(compressed, case.members, strict=True)
    )


def layout_mismatch(ctx: RankContext) -> dict[str, list[str]]:
    return {case.label: _layout_mismatch_on(ctx, case) for case in ctx.cases() if len(case.members) > 1}


def _layout_mismatch_on(ctx: RankContext, case: GroupCase) -> list[str]:
    size, group, first = len(case.members), case.group, case.members[0]
    last = fdist.get_rank(group) == size - 1
    odd_scale = ciphertext(1, scale=2.0**41 if last else 2.0**40)
    odd_type = plaintext_slots(1) if last else ciphertext(1)
    too_many = [ciphertext(1)] * (size + 1) if ctx.rank == first else None
    odd_batch = ciphertext(1, batch=(2,) if last else ())
    other_engine = toy_engine(log_ring_degree=5) if last else ctx.engine

    def different_collectives() -> object:
        if last:
            return fdist.all_gather_ciphertexts(ciphertext(1), group=group)
        return fdist.gather_ciphertexts(ciphertext(1), dst=first, group=group)

    texts = [
        expect_group_error(
            lambda: fdist.all_gather_ciphertexts(odd_scale, group=group),
            "identical",
            "scale",
            f"group rank {size - 1}",
        ),
        expect_group_error(
            # deliberately a Plaintext on the last rank: the collective's own type check is under test
            lambda: fdist.gather_ciphertexts(odd_type, dst=first, group=group),  # type: ignore[arg-type]
            "must supply Ciphertext",
        ),
        expect_group_error(
            lambda: fdist.scatter_ciphertexts(too_many, src=first, group=group),
            "exactly one value per group rank",
        ),
        expect_group_error(
            lambda: fdist.reduce_ciphertext(odd_batch, dst=first, engine=ctx.engine, group=group),
            "identical",
            "tensors",
        ),
        # An engine for another ring would fail inside the tree; it is caught up front instead.
        expect_group_error(
            lambda: fdist.all_reduce_ciphertext(ciphertext(1), engine=other_engine, group=group),
            "engine.add_ cannot add this ciphertext",
            f"group rank {size - 1}",
        ),
        # The SUM schedule is refused on every rank where a partial sum could wrap int64.
        expect_group_error(
            lambda: fdist.all_reduce_ciphertext(ciphertext(1), engine=WideModuli(ctx.engine), group=group,
                                                algorithm="sum"),
            "algorithm='sum' is not exact here",
            "could wrap int64",
            "group rank 0",
        ),
        expect_group_error(
            lambda: fdist.all_reduce_ciphertext(ciphertext(1), engine=ctx.engine, group=group,
                                                algorithm="bogus"),  # type: ignore[arg-type]
            "algorithm must be one of auto, tree, sum; got 'bogus'",
        ),
        expect_group_error(
            lambda: fdist.all_reduce_ciphertext(ciphertext(1), engine=ctx.engine, group=group,
                                                algorithm="tree" if last else "sum"),
            f"group rank {size - 1} passed {{'algorithm': 'tree', 'schedule': 'tree'}}",
        ),
        # A rank calling a different collective is reported, not left hanging.
        expect_group_error(
            different_collectives,
            "called all_gather_ciphertexts while group rank 0 called gather_ciphertexts",
        ),
    ]
    assert len(fdist.all_gather_ciphertexts(ciphertext(1), group=group)) == size
    # Where SUM could wrap, "auto" keeps the tree and the result is still the modular sum.
    value, trace = ciphertext(2), ReductionTrace()
    fdist.all_reduce_ciphertext(value, engine=WideModuli(ctx.engine), group=group, trace=trace)
    assert trace.algorithm == "tree" and trace.final_broadcasts == 1, vars(trace)
    return texts


class WideModuli:
    """An adder that reports 63-bit moduli: two of them already wrap an int64 sum."""

    def __init__(self, engine: CkksEngine) -> None:
        self.engine = engine

    def add_(self, lhs: Ciphertext, rhs: Ciphertext) -> Ciphertext:
        return self.engine.add_(lhs, rhs)

    def residue_moduli(self, value: Ciphertext) -> list[int]:
        return [2**63 - 25] * value.limb_count


# -- limb partition --------------------------------------------------------------------------


def limb_ranges_for(size: int) -> list[tuple[int, int]]:
    """Unequal, consecutive, starting after row 0 (a partial cover of a 7-limb source)."""
    ranges, start = [], 1
    for index in range(size):
        length = 2 if index % 2 == 1 and start + 2 + (size - index - 1) <= 7 else 1
        ranges.append((start, start + length))
        start += length
    return ranges


def limbs(ctx: RankContext) -> None:
    for case in ctx.cases():
        _limbs_on(ctx, case)


def _limbs_on(ctx: RankContext, case: GroupCase) -> None:
    size, group = len(case.members), case.group
    group_rank = fdist.get_rank(group)
    src, dst = case.members[0], case.members[-1]
    source = ciphertext(500, batch=(2,), prime_ids=tuple(range(7)), depth=0)
    ranges = limb_ranges_for(size)
    is_src = ctx.rank == src
    shard = fdist.scatter_ciphertext_limbs(
        source if is_src else None, limb_ranges=ranges if is_src else None, src=src, group=group
    )
    start, stop = ranges[group_rank]
    assert same_value(shard, source.slice_limbs(start, stop))
    if is_src:  # the source keeps a storage-sharing view
        assert shard.data.untyped_storage().data_ptr() == source.data.untyped_storage().data_ptr()
    else:
        assert shard.data.is_contiguous()

    joined = fdist.gather_ciphertext_limbs(shard, dst=dst, group=group)
    if ctx.rank == dst:
        assert joined is not None
        assert same_value(joined, source.slice_limbs(ranges[0][0], ranges[-1][1]))
    else:
        assert joined is None
    if size == 1:
        return

    overlapping = [(0, 1)] * size
    expect_group_error(
        lambda: fdist.scatter_ciphertext_limbs(
            source if is_src else None, limb_ranges=overlapping if is_src else None, src=src, group=group
        ),
        "consecutive",
    )
    expect_group_error(
        lambda: fdist.scatter_ciphertext_limbs(source, limb_ranges=ranges, src=src, group=group),
        "must supply None for value and limb_ranges",
    )
    gap = ciphertext(501, batch=(2,), prime_ids=(2 * group_rank,), depth=0)
    expect_group_error(lambda: fdist.gather_ciphertext_limbs(gap, dst=dst, group=group), "adjacent")
    wrong_scale = (
        shard if group_rank == 0 else Ciphertext(shard.data, shard.depth, shard.scale * 2, shard.prime_ids)
    )
    expect_group_error(
        lambda: fdist.gather_ciphertext_limbs(wrong_scale, dst=dst, group=group),
        "different logical ciphertexts",
        "scale",
    )


# -- additive semantics ----------------------------------------------------------------------


def _rank_input(ctx: RankContext, global_rank: int, prime_ids: Sequence[int]) -> torch.Tensor:
    return engine_residues(ctx.engine, (2, 2, len(prime_ids), 16), prime_ids, seed=700 + global_rank)


def _python_modular_sum(ctx: RankContext, members: Sequence[int], prime_ids: Sequence[int]) -> torch.Tensor:
    moduli = ctx.engine.moduli_for(prime_ids)
    inputs = [_rank_input(ctx, m, prime_ids).tolist() for m in members]
    shape = (2, 2, len(prime_ids), 16)
    total = [[[[0] * 16 for _ in prime_ids] for _ in range(2)] for _ in range(2)]
    for tensor in inputs:
        for c in range(2):
            for b in range(2):
                for limb, modulus in enumerate(moduli):
                    row = total[c][b][limb]
                    for i in range(16):
                        row[i] = (row[i] + tensor[c][b][limb][i]) % modulus
    result: torch.Tensor = torch.tensor(total, dtype=torch.int64).reshape(shape)
    return result


def reductions(ctx: RankContext) -> dict[str, Any]:
    out: dict[str, Any] = {}
    prime_ids = (1, 2, 3)
    for case in ctx.cases():
        size, group = len(case.members), case.group
        expected = _python_modular_sum(ctx, case.members, prime_ids)

        dst = case.members[-1]
        value = Ciphertext(_rank_input(ctx, ctx.rank, prime_ids), 0, 2.0**40, prime_ids)
        reduce_trace = ReductionTrace()
        fdist.reduce_ciphertext(value, dst=dst, engine=ctx.engine, group=group, trace=reduce_trace)
        if ctx.rank == dst:
            assert torch.equal(value.data, expected), "reduce_ciphertext differs from the Python modular sum"

        # all-reduce into a non-contiguous limb view of a wider ciphertext, with every schedule
        schedules: dict[str, dict[str, Any]] = {}
        for algorithm in ("tree", "sum", "auto"):
            wide_ids = (0, 1, 2, 3, 4)
            wide = Ciphertext(
                engine_residues(ctx.engine, (2, 2, 5, 16), wide_ids, seed=900), 0, 2.0**40, wide_ids
            )
            view = wide.slice_limbs(1, 4)
            view.data.copy_(_rank_input(ctx, ctx.rank, prime_ids))
            outside_before = wide.data[..., [0, 4], :].clone()
            data_object, strides = view.data, view.data.stride()
            assert not view.data.is_contiguous()
            trace = ReductionTrace()
            fdist.all_reduce_ciphertext(
                view, engine=ctx.engine, group=group, trace=trace, algorithm=algorithm
            )
            assert view.data is data_object and view.data.stride() == strides
            assert torch.equal(view.data, expected), (
                f"all_reduce_ciphertext ({algorithm}) differs from the Python modular sum"
            )
            assert torch.equal(wide.data[..., [0, 4], :], outside_before), "storage outside the view changed"
            schedules[algorithm] = vars(trace)
        all_trace = schedules["tree"]
        out[case.label] = {
            "size": size,
            "group_rank": fdist.get_rank(group),
            "root_group_rank": size - 1,
            "reduce": vars(reduce_trace),
            "all_reduce": all_trace,
            "all_reduce_sum": schedules["sum"],
            "all_reduce_auto": schedules["auto"],
        }
    return out


def _slot_values(global_rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1200 + global_rank)
    return (torch.rand(8, generator=generator, dtype=torch.float64) * 2 - 1) * (global_rank + 1)


def encrypted_sum(ctx: RankContext) -> dict[str, float]:
    return {case.label: _encrypted_sum_on(ctx, case) for case in ctx.cases()}


def _encrypted_sum_on(ctx: RankContext, case: GroupCase) -> float:
    """Each rank encrypts its own vector; after all_reduce_ciphertext every rank decrypts the sum."""
    root, engine = case.members[0], ctx.engine
    secret = engine.generate_secret_key() if ctx.rank == root else None
    public = engine.generate_public_key(secret) if secret is not None else None
    shared_public = fdist.broadcast_key(public, src=root, group=case.group)
    assert isinstance(shared_public, PublicKey)
    value = engine.encrypt(engine.encode(_slot_values(ctx.rank)), shared_public)
    fdist.all_reduce_ciphertext(value, engine=engine, group=case.group)
    # Tests only: every rank checks its own copy of the sum.
    shared_secret = fdist.broadcast_key(secret, src=root, group=case.group, allow_secret_key=True)
    assert isinstance(shared_secret, SecretKey)
    decoded = engine.decrypt_decode(value, shared_secret).real
    expected = sum((_slot_values(member) for member in case.members), torch.zeros(8, dtype=torch.float64))
    error = float((decoded - expected).abs().max())
    assert error < 1e-5 * len(case.members), f"decrypted sum is off by {error}"
    return error


def raw_sum_is_not_modular(ctx: RankContext) -> dict[str, int]:
    """The counter-example behind the typed reduction: ReduceOp.SUM adds machine integers."""
    payload = torch.tensor([2**62], dtype=torch.int64, device=fdist.local_device())
    fdist.all_reduce(payload, op=fdist.ReduceOp.SUM)
    return {"raw": int(payload.item()), "python": ctx.world * 2**62}


# -- CUDA paths (run by test_distributed_cuda_paths.py where GPUs exist) --------------------------------


def cuda_values(ctx: RankContext) -> None:
    """CUDA-described values land on each rank's own GPU; CPU-described ones stay on CPU."""
    device = fdist.local_device()
    assert device.type == "cuda", f"expected a CUDA rank, got {device}"
    src = 0
    sent = ciphertext(30, batch=(2,)).to(device)
    got = fdist.broadcast_ciphertext(sent if ctx.rank == src else None, src=src)
    assert got.device == device and same_value(got.cpu(), ciphertext(30, batch=(2,)))
    stays_cpu = fdist.broadcast_ciphertext(ciphertext(31) if ctx.rank == src else None, src=src)
    assert stays_cpu.device == torch.device("cpu") and same_value(stays_cpu, ciphertext(31))

    engine = toy_engine(seed=1000 + ctx.rank, device=device)
    prime_ids = (1, 2, 3)
    value = Ciphertext(_rank_input(ctx, ctx.rank, prime_ids).to(device), 0, 2.0**40, prime_ids)
    fdist.all_reduce_ciphertext(value, engine=engine)
    members = tuple(range(ctx.world))
    assert value.device == device
    assert torch.equal(value.data.cpu(), _python_modular_sum(ctx, members, prime_ids))

    source = ciphertext(500, batch=(2,), prime_ids=tuple(range(7)), depth=0).to(device)
    ranges = limb_ranges_for(ctx.world)
    shard = fdist.scatter_ciphertext_limbs(
        source if ctx.rank == src else None, limb_ranges=ranges if ctx.rank == src else None, src=src
    )
    assert shard.device == device
    start, stop = ranges[ctx.rank]
    assert same_value(shard.cpu(), source.cpu().slice_limbs(start, stop))

    everyone = fdist.all_gather_ciphertexts(ciphertext(40 + ctx.rank).to(device))
    assert all(v.device == device for v in everyone)
    assert all(same_value(v.cpu(), ciphertext(40 + r)) for r, v in enumerate(everyone))


# -- failure paths ---------------------------------------------------------------------------


def peer_skips_collective(ctx: RankContext) -> dict[str, Any]:
    """Rank 2 never enters the broadcast: the others fail within the timeout, with a diagnosis."""
    if ctx.rank == 2:
        time.sleep(ctx.timeout_s + 2)
        return {"skipped": True}
    started = time.monotonic()
    try:
        fdist.broadcast_ciphertext(ciphertext(1) if ctx.rank == 0 else None, src=0)
    except CollectiveFailure as error:
        return {"elapsed": time.monotonic() - started, "message": str(error)}
    raise AssertionError("broadcast completed although rank 2 never called it")


# -- hostile descriptors and allocation failures (issue 13, points 10 and 11) ---------------
#
# A peer's descriptor is untrusted: a forged one must be refused on every rank before anyone
# allocates, and a receive allocation that fails on one rank must fail the collective on every
# rank (never leave the peers waiting in the payload phase). Each scenario ends with an honest
# collective, which proves the group is still in step.

_HUGE = 2**40 - 1


# What the typed collectives call to describe a value: (descriptor, None) or (None, why not).
Describe = Callable[[object], tuple[dict[str, Any] | None, str | None]]


def _forging(
    ctx: RankContext, forgers: Sequence[int], forge: Callable[[dict[str, Any]], None]
) -> Describe:
    """On ``forgers``, make the typed collectives announce a doctored descriptor (a hostile peer)."""
    from fhelium.distributed import _value_collectives

    # describe_or_error is a private import there (not re-exported), so patch the module's namespace
    namespace = vars(_value_collectives)
    honest: Describe = namespace["describe_or_error"]
    if ctx.rank not in forgers:
        return honest

    def forged(value: object) -> tuple[dict[str, Any] | None, str | None]:
        descriptor, _ = honest(value)
        assert descriptor is not None
        forge(descriptor)
        return descriptor, None

    namespace["describe_or_error"] = forged
    return honest


def _restore(honest: Describe) -> None:
    from fhelium.distributed import _value_collectives

    vars(_value_collectives)["describe_or_error"] = honest


def _still_in_step(ctx: RankContext) -> None:
    gathered = fdist.gather_ciphertexts(ciphertext(70 + ctx.rank), dst=0)
    if ctx.rank == 0:
        assert gathered is not None and all(same_value(v, ciphertext(70 + r)) for r, v in enumerate(gathered))
    everyone = fdist.all_gather_ciphertexts(ciphertext(80 + ctx.rank))
    assert all(same_value(v, ciphertext(80 + r)) for r, v in enumerate(everyone))


def _group_error(call: Callable[[], object]) -> str:
    """The CollectiveArgumentError text ``call`` raises (anything else fails the scenario)."""
    try:
        call()
    except CollectiveArgumentError as error:
        return str(error)
    raise AssertionError("the collective completed although it had to be refused")


def zero_element_descriptor(ctx: RankContext) -> dict[str, str]:
    """Rank 1 declares a zero-element ciphertext with huge extents (torch's strides overflow)."""

    def forge(descriptor: dict[str, Any]) -> None:
        descriptor["tensors"][0]["shape"] = [2, 0, *([_HUGE] * 5), 3, 16]

    out: dict[str, str] = {}
    honest = _forging(ctx, [1], forge)
    try:
        out["gather"] = _group_error(lambda: fdist.gather_ciphertexts(ciphertext(1), dst=0))
        out["broadcast"] = _group_error(
            lambda: fdist.broadcast_ciphertext(ciphertext(1) if ctx.rank == 1 else None, src=1)
        )
    finally:
        _restore(honest)
    _still_in_step(ctx)
    return out


def gather_total_cap(ctx: RankContext) -> dict[str, str]:
    """Ranks 1 and 2 each declare ~36 GiB (under the per-value cap): dst must not allocate ~72 GiB."""

    def forge(descriptor: dict[str, Any]) -> None:
        descriptor["tensors"][0]["shape"] = [2, 50_000_000, 3, 16]

    honest = _forging(ctx, [1, 2], forge)
    try:
        message = _group_error(lambda: fdist.gather_ciphertexts(ciphertext(2), dst=0))
    finally:
        _restore(honest)
    _still_in_step(ctx)
    return {"gather": message}


def all_gather_total_cap(ctx: RankContext) -> dict[str, str]:
    """With the total cap at 2 KiB, an all-gather of 3 x 768 bytes is refused, a gather of 2 x 768 not."""
    from fhelium.distributed import _transfer

    saved = _transfer.MAX_RECEIVE_BYTES
    _transfer.MAX_RECEIVE_BYTES = 2048
    try:
        message = _group_error(lambda: fdist.all_gather_ciphertexts(ciphertext(3 + ctx.rank)))
        gathered = fdist.gather_ciphertexts(ciphertext(3 + ctx.rank), dst=0)
        assert (gathered is not None) == (ctx.rank == 0)
    finally:
        _transfer.MAX_RECEIVE_BYTES = saved
    _still_in_step(ctx)
    return {"all_gather": message}


_BIG_BATCH = 136_534  # x 2 components x 3 limbs x 16 x 8 bytes: 105 MB per ciphertext


def _big_ciphertext(batch: int = _BIG_BATCH) -> Ciphertext:
    return Ciphertext(torch.zeros((2, batch, 3, 16), dtype=torch.int64), 1, 2.0**40, (1, 2, 3))


def _address_space_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _with_headroom(limited: bool, headroom: int, call: Callable[[], object]) -> str:
    """Run ``call`` with this process's address space capped ``headroom`` bytes above its size."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if limited:
        resource.setrlimit(resource.RLIMIT_AS, (_address_space_bytes() + headroom, hard))
    try:
        return _group_error(call)
    finally:
        if limited:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _gather_beyond_headroom(ctx: RankContext) -> str:
    """The dst (rank 0) fits the first 105 MB value in its headroom, not the second."""
    mine = _big_ciphertext() if ctx.rank != 0 else ciphertext(5)
    return _with_headroom(ctx.rank == 0, 160 << 20, lambda: fdist.gather_ciphertexts(mine, dst=0))


def _broadcast_beyond_headroom(ctx: RankContext) -> str:
    """Rank 2 cannot allocate the source's 105 MB value."""
    source = _big_ciphertext() if ctx.rank == 0 else None
    return _with_headroom(ctx.rank == 2, 48 << 20, lambda: fdist.broadcast_ciphertext(source, src=0))


def _all_gather_beyond_headroom(ctx: RankContext) -> str:
    """Rank 1 cannot allocate three copies of the common 35 MB layout."""
    own = _big_ciphertext(_BIG_BATCH // 3)
    return _with_headroom(ctx.rank == 1, 48 << 20, lambda: fdist.all_gather_ciphertexts(own))


def allocation_failure(ctx: RankContext) -> dict[str, str]:
    """A real allocation failure on one receiving rank fails the collective on every rank."""
    out = {
        "gather": _gather_beyond_headroom(ctx),
        "broadcast": _broadcast_beyond_headroom(ctx),
        "all_gather": _all_gather_beyond_headroom(ctx),
    }
    _still_in_step(ctx)
    return out


SCENARIOS: list[tuple[str, Callable[[RankContext], Any]]] = [
    ("identity", identity),
    ("broadcast_values", broadcast_values),
    ("broadcast_errors", broadcast_errors),
    ("scatter_gather", scatter_gather),
    ("layout_mismatch", layout_mismatch),
    ("limbs", limbs),
    ("reductions", reductions),
    ("encrypted_sum", encrypted_sum),
    ("raw_sum_is_not_modular", raw_sum_is_not_modular),
]

SUITES: dict[str, list[tuple[str, Callable[[RankContext], Any]]]] = {
    "main": SCENARIOS,
    "failure": [("peer_skips_collective", peer_skips_collective)],
    "cuda": [("identity", identity), ("cuda_values", cuda_values)],
    "limits": [
        ("zero_element_descriptor", zero_element_descriptor),
        ("gather_total_cap", gather_total_cap),
        ("all_gather_total_cap", all_gather_total_cap),
        ("allocation_failure", allocation_failure),
    ],
}
