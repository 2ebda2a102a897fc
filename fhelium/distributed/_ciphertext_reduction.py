"""Modular ciphertext reduce and all-reduce over a binomial tree.

Why not ``torch.distributed.all_reduce(data, op=ReduceOp.SUM)``: every limb row lives modulo
its own prime, and a plain SUM adds signed machine integers. The sum of P residues in
``[0, q)`` is not reduced mod ``q`` (wrong for the next operation, and ``P * q`` wraps int64
for 62-bit primes, e.g. two ranks contributing ``2**62`` give ``-2**63``). So each receiver
gets one complete ciphertext and calls its rank-local ``engine.add_``, which reduces per limb.

Synchronous: these return ``None`` rather than a ``Work``; overlap would need a lifetime model
covering both the messages and the local modular additions.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from fhelium.core import Ciphertext
from fhelium.distributed._collective_common import (
    GroupInfo,
    PointToPointBatch,
    broadcast_tensor,
    check_writable_destination,
    exchange_control,
    group_info,
    root_error,
)
from fhelium.distributed._schedule import StepKind, binomial_reduce_rounds, reduce_steps
from fhelium.distributed._value_collectives import (
    agree,
    check_identical_layouts,
    describe_or_error,
    rank_body,
    type_error,
)


class CiphertextAdder(Protocol):
    """The one engine method reductions need: modular per-limb ``lhs += rhs`` in lhs's storage."""

    def add_(self, lhs: Ciphertext, rhs: Ciphertext) -> Any: ...


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


def _validate(
    value: object,
    engine: object,
    info: GroupInfo,
    operation: str,
    arguments: dict[str, Any],
    root_name: str | None,
) -> None:
    error = None
    if root_name is not None:
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
        error = _engine_refusal(engine, value)
    exchange = exchange_control(info, operation, arguments=arguments, error=error, body=rank_body(descriptor))
    agree(info, operation, lambda: check_identical_layouts(exchange, operation))


# Engines already seen to add a given layout; the probe then costs nothing in a training loop.
_ACCEPTED_LAYOUTS: weakref.WeakKeyDictionary[Any, set[tuple[Any, ...]]] = weakref.WeakKeyDictionary()


def _engine_refusal(engine: Any, value: Ciphertext) -> str | None:
    """Try ``engine.add_`` on a one-limb, one-entry copy so an incompatible engine (other ring,
    primes, dtype or device) is reported through the control exchange instead of failing on
    one rank in the middle of the tree, where its peers would wait for it."""
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


def all_reduce_ciphertext(
    value: Ciphertext,
    *,
    engine: CiphertextAdder,
    group: dist.ProcessGroup | None = None,
    trace: ReductionTrace | None = None,
) -> None:
    """Every rank's ``value`` becomes the modular sum: tree-reduce to group rank 0, then broadcast.

    The broadcast writes into each rank's original ``value.data`` view (staged and copied back
    when the view is not contiguous), never replacing the tensor or touching storage outside it.
    """
    info = group_info(group)
    operation = "all_reduce_ciphertext"
    _validate(value, engine, info, operation, {}, None)
    record = trace or ReductionTrace()
    _reduce_tree(value, engine, root=0, info=info, operation=operation, trace=record)
    if info.size > 1:
        broadcast_tensor(value.data, src_global=info.global_rank_of(0), info=info, operation=operation)
        record.final_broadcasts += 1
