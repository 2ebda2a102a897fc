"""Modular ciphertext reduce and all-reduce.

Why not ``torch.distributed.all_reduce(data, op=ReduceOp.SUM)`` alone: every limb row lives
modulo its own prime, and a plain SUM adds signed machine integers. The sum of P residues in
``[0, q)`` is not reduced mod ``q`` (wrong for the next operation), and ``P * q`` wraps int64
for 62-bit primes (two ranks contributing ``2**62`` give ``-2**63``). So ``reduce_ciphertext``
runs a binomial tree in which each receiver gets one complete ciphertext and calls its
rank-local ``engine.add_``, which reduces per limb.

``all_reduce_ciphertext`` has two schedules. ``"tree"`` is that reduction to group rank 0
followed by a broadcast (three latency-bound steps with the control exchange). ``"sum"`` is one
raw SUM all-reduce followed by a per-limb remainder on every rank; it is exact when no partial
sum can wrap, i.e. when ``P * max(q) < 2**63`` (any world size below 8192 with our <= 50-bit
primes), and it needs the engine to say which moduli its ``add_`` reduces by (a
:class:`ResidueModuliAdder`: ``engine.residue_moduli``; the CKKS engine and the Backend's
Program-path adder both are one). ``"auto"`` (the default) takes ``"sum"`` when both hold and the
tree otherwise; the choice travels in the control exchange, so ranks that would choose
differently fail together before any payload moves.

Synchronous: these return ``None`` rather than a ``Work``; overlap would need a lifetime model
covering both the messages and the local modular additions.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast, runtime_checkable

import torch
import torch.distributed as dist

from fhelium.core import Ciphertext
from fhelium.distributed._collective_common import (
    GroupInfo,
    agree_on_layout,
    collective_phase,
    describe_or_error,
    group_info,
    root_error,
    type_error,
)
from fhelium.distributed._schedule import StepKind, binomial_reduce_rounds, reduce_steps
from fhelium.distributed._staging import (
    PointToPointBatch,
    broadcast_tensor,
    check_writable_destination,
    receive_slot,
)


class CiphertextAdder(Protocol):
    """The one engine method reductions need: modular per-limb ``lhs += rhs`` in lhs's storage."""

    def add_(self, lhs: Ciphertext, rhs: Ciphertext) -> object: ...


@runtime_checkable
class ResidueModuliAdder(CiphertextAdder, Protocol):
    """An adder that also names its moduli: ``residue_moduli(value)`` is the prime of each of
    ``value``'s limbs, promising that ``add_`` is canonical addition modulo them (results in
    ``[0, q)``). That enables the ``"sum"`` all-reduce schedule; a plain :class:`CiphertextAdder`
    gets the tree.
    """

    def residue_moduli(self, value: Ciphertext) -> Sequence[int]: ...


Algorithm = Literal["auto", "tree", "sum"]
ALGORITHMS: tuple[str, ...] = ("auto", "tree", "sum")
_INT64_LIMIT = 2**63


@dataclass
class ReductionTrace:
    """Per-rank counters of one reduction, for tests and diagnostics.

    Summed over ranks, ``messages_sent`` is ``P - 1``; ``schedule_rounds`` is ``ceil(log2 P)``
    and the root is active in every round; ``incoming_buffers`` is at most 1 per rank.
    """

    messages_sent: int = 0
    messages_received: int = 0
    rounds_active: int = 0
    schedule_rounds: int = 0
    incoming_buffers: int = 0
    additions: int = 0
    final_broadcasts: int = 0
    algorithm: str = "tree"
    sum_all_reduces: int = 0


def _validate(
    value: object,
    engine: object,
    info: GroupInfo,
    operation: str,
    arguments: dict[str, Any],
    root_name: str | None,
    refusal: str | None = None,
) -> None:
    error = refusal
    if error is None and root_name is not None:
        error = root_error(info, root_name, arguments[root_name])
    error = error or type_error(value, (Ciphertext,), f"rank {info.global_rank}")
    if error is None and not callable(getattr(engine, "add_", None)):
        error = f"engine must provide add_(lhs, rhs); got {type(engine).__name__}"
    descriptor = None
    if error is None:
        assert isinstance(value, Ciphertext)
        try:
            check_writable_destination(value.data, "the ciphertext's data")
        except ValueError as problem:
            error = str(problem)
    if error is None:
        descriptor, error = describe_or_error(value)
    if error is None:
        assert isinstance(value, Ciphertext)
        error = _engine_refusal(cast(CiphertextAdder, engine), value)  # add_ checked callable above
    agree_on_layout(info, operation, arguments=arguments, error=error, descriptor=descriptor)


# Engines already seen to add a given layout; the probe then costs nothing in a training loop.
_ACCEPTED_LAYOUTS: weakref.WeakKeyDictionary[Any, set[tuple[Any, ...]]] = weakref.WeakKeyDictionary()


def _engine_refusal(engine: CiphertextAdder, value: Ciphertext) -> str | None:
    """Try ``engine.add_`` on a one-limb, one-entry copy so an incompatible engine (other ring,
    primes, dtype or device) is reported through the control exchange instead of failing on
    one rank in the middle of the tree, where its peers would wait for it.
    """
    layout = (
        value.data.dtype,
        value.data.device,
        value.ring_dimension,
        value.component_count,
        value.prime_ids,
        value.depth,
        value.polynomial_domain,
        value.modulus_basis,
        value.residue_representation,
    )
    try:
        accepted = _ACCEPTED_LAYOUTS.setdefault(engine, set())
    except TypeError:  # an engine that cannot be weakly referenced is probed every time
        accepted = set()
    if layout in accepted:
        return None
    index = (slice(None), *([slice(0, 1)] * len(value.batch_shape)), slice(0, 1), slice(None))
    probe = Ciphertext(
        value.data[index].clone(),
        value.depth,
        value.scale,
        value.prime_ids[:1],
        value.polynomial_domain,
        value.modulus_basis,
        value.residue_representation,
    )
    try:
        engine.add_(probe, probe.clone())
    except Exception as error:  # any refusal, reported on every rank
        return f"engine.add_ cannot add this ciphertext: {type(error).__name__}: {error}"
    accepted.add(layout)
    return None


def _reduce_tree(
    value: Ciphertext,
    engine: CiphertextAdder,
    *,
    root: int,
    info: GroupInfo,
    operation: str,
    trace: ReductionTrace,
) -> None:
    trace.schedule_rounds = len(binomial_reduce_rounds(info.size))
    incoming: Ciphertext | None = None
    batch = PointToPointBatch(info)
    for step in reduce_steps(info.size, root, info.group_rank):
        peer = info.global_rank_of(step.peer)
        trace.rounds_active += 1
        if step.kind is StepKind.SEND:
            batch.send(value.data, peer, tag=step.round_index)
            batch.run(operation, f"tree round {step.round_index}: send to global rank {peer}")
            trace.messages_sent += 1
            return
        if incoming is None:
            # Contiguous (torch.empty, not empty_like) and reused for every round.
            incoming = value.with_data(
                torch.empty(value.data.shape, dtype=value.data.dtype, device=value.data.device)
            )
            trace.incoming_buffers += 1
        batch.receive(incoming.data, peer, tag=step.round_index)
        batch.run(operation, f"tree round {step.round_index}: receive from global rank {peer}")
        trace.messages_received += 1
        engine.add_(value, incoming)
        trace.additions += 1


def reduce_ciphertext(
    value: Ciphertext,
    *,
    dst: int = 0,
    engine: CiphertextAdder,
    group: dist.ProcessGroup | None = None,
    trace: ReductionTrace | None = None,
) -> None:
    """Leave the modular sum of every rank's ciphertext in ``dst``'s ``value`` (global rank).

    Other ranks' values are left holding partial sums. Layouts (type, metadata, shape, dtype,
    device type) must be identical on every rank; checked on all ranks before any payload.
    """
    info = group_info(group)
    operation = "reduce_ciphertext"
    _validate(value, engine, info, operation, {"dst": dst if type(dst) is int else repr(dst)}, "dst")
    root = info.group_rank_of(dst)
    assert root is not None
    _reduce_tree(value, engine, root=root, info=info, operation=operation, trace=trace or ReductionTrace())


def _sum_moduli(engine: object, value: object, size: int) -> tuple[list[int] | None, str]:
    """The limb moduli when the SUM schedule is exact here, else None and the reason."""
    if not isinstance(engine, ResidueModuliAdder) or not isinstance(value, Ciphertext):
        return None, "the engine does not offer residue_moduli(value) (not a ResidueModuliAdder)"
    moduli_of = engine.residue_moduli
    if not callable(moduli_of):
        return None, "the engine's residue_moduli is not callable"
    if value.data.dtype != torch.int64:
        return None, f"the residues are {value.data.dtype}; the SUM schedule adds in int64 only"
    try:
        moduli = [int(q) for q in moduli_of(value)]
    except Exception as error:  # reported through the control exchange like any refusal
        return None, f"engine.residue_moduli failed: {type(error).__name__}: {error}"
    if len(moduli) != value.limb_count:
        return None, f"engine.residue_moduli gave {len(moduli)} moduli for {value.limb_count} limbs"
    if not moduli or min(moduli) < 2 or size * max(moduli) >= _INT64_LIMIT:
        return None, f"{size} x the largest modulus ({max(moduli, default=0)}) could wrap int64"
    return moduli, ""


def _choose_algorithm(requested: object, engine: object, value: object, size: int) -> tuple[str, str | None]:
    """This rank's schedule and, when ``"sum"`` was demanded but is not exact here, the error."""
    if requested not in ALGORITHMS:
        return "tree", f"algorithm must be one of {', '.join(ALGORITHMS)}; got {requested!r}"
    if requested == "tree" or size == 1:
        return "tree", None
    moduli, why = _sum_moduli(engine, value, size)
    if moduli is not None:
        return "sum", None
    if requested == "sum":
        return "sum", f"algorithm='sum' is not exact here: {why}"
    return "tree", None


def _sum_and_reduce(value: Ciphertext, moduli: list[int], info: GroupInfo, operation: str) -> None:
    """One SUM all-reduce of the raw residues, then each limb back into [0, q)."""
    slot = receive_slot(value.data, info.transport_device, "the ciphertext's data")
    if slot.staged:
        slot.buffer.copy_(value.data)
    with collective_phase(info, operation, "payload sum all-reduce"):
        dist.all_reduce(slot.buffer, op=dist.ReduceOp.SUM, group=info.group)
    q = torch.tensor(moduli, dtype=slot.buffer.dtype, device=slot.buffer.device).reshape(-1, 1)
    torch.remainder(slot.buffer, q, out=slot.buffer)
    slot.finish()


def all_reduce_ciphertext(
    value: Ciphertext,
    *,
    engine: CiphertextAdder,
    group: dist.ProcessGroup | None = None,
    trace: ReductionTrace | None = None,
    algorithm: Algorithm = "auto",
) -> None:
    """Every rank's ``value`` becomes the modular sum (schedules: see the module docstring).

    The result is written into each rank's original ``value.data`` view (staged and copied back
    when the view is not contiguous), never replacing the tensor or touching storage outside it.
    """
    info = group_info(group)
    operation = "all_reduce_ciphertext"
    chosen, refusal = _choose_algorithm(algorithm, engine, value, info.size)
    arguments = {"algorithm": algorithm if type(algorithm) is str else repr(algorithm), "schedule": chosen}
    _validate(value, engine, info, operation, arguments, None, refusal)
    record = trace or ReductionTrace()
    record.algorithm = chosen
    if chosen == "sum":
        moduli, _ = _sum_moduli(engine, value, info.size)
        assert moduli is not None and isinstance(value, Ciphertext)
        _sum_and_reduce(value, moduli, info, operation)
        record.sum_all_reduces += 1
        return
    _reduce_tree(value, engine, root=0, info=info, operation=operation, trace=record)
    if info.size > 1:
        broadcast_tensor(value.data, src_global=info.global_rank_of(0), info=info, operation=operation)
        record.final_broadcasts += 1
