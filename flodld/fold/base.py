"""Folds: how deposits of tensors combine into one value, without knowing where they came from.

A fold sees bundles (tuples of tensors with one fixed schema per round). `add` accumulates a
bundle into an accumulator, `finish` turns the accumulated sum and the summed weight into the
value that is broadcast. The relay and the controller both fold (host frames are partial folds),
so `add` must be associative and commutative, and `finish` is applied exactly once, at the top.

A ciphertext fold only needs the moduli of its limbs: modular addition per limb is the whole
aggregation, and no key is ever involved.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

Bundle = tuple[torch.Tensor, ...]

FOLD_THREADS_ENV = "FLODL_FOLD_THREADS"


def use_fold_threads(environ: dict[str, str] | None = None) -> int:
    """Set torch's intra-op threads for a process that folds on its event loop (relay, controller).

    Folds are memory-bound element-wise adds: extra threads buy little, and on a host whose cores are
    busy (the ranks train there) OpenMP's spinning threads made a 1 MiB add take milliseconds instead
    of tens of microseconds. Default 1; `FLODL_FOLD_THREADS=N` overrides. Returns the count set.
    """
    import os

    raw = (environ if environ is not None else os.environ).get(FOLD_THREADS_ENV, "1")
    try:
        threads = max(1, int(raw))
    except ValueError:
        raise ValueError(f"{FOLD_THREADS_ENV}={raw!r} is not a positive integer") from None
    torch.set_num_threads(threads)
    return threads


class FoldError(ValueError):
    """Deposits do not fit together (schema, dtype, or fold mismatch); the message names both sides."""


@dataclass(frozen=True)
class Span:
    """Where a 1-D slice of a chunk lies: tensor `index` of the bundle, of `shape`, elements from `start`."""

    index: int
    shape: tuple[int, ...]
    start: int


class Fold(Protocol):
    """The pluggable reduction. `spec` names it on the wire so every hop rebuilds the same fold.

    Every fold is a sum (associative, commutative, neutral element zero): `identity` returns zeros.
    The relay and the controller fold chunk by chunk through the slice methods, on flat 1-D slices
    (`Span` says which elements of which tensor); the bundle methods are the same fold on whole bundles.
    A fold with `elementwise = True` promises its slice methods ignore the span: it may be handed a
    slice that runs across tensors of one dtype (with the span of its first part).
    """

    @property
    def spec(self) -> str: ...

    def identity(self, like: Bundle) -> Bundle:
        """The neutral accumulator with the schema of `like` (new tensors: never `like`'s own)."""
        ...

    def add(self, accumulator: Bundle, value: Bundle) -> Bundle:
        """`accumulator + value`; may update `accumulator` in place and return it.

        Must not keep references to `value`'s tensors: they are built over the buffer of the frame
        they arrived in, which the relay and the controller reuse for the next frame.
        """
        ...

    def finish(self, accumulator: Bundle, weight: float) -> Bundle:
        """The broadcast value from the total sum and the total weight."""
        ...

    def check_slice(self, incoming: torch.Tensor, span: Span) -> None:
        """Refuse (FoldError) a slice that `add_slice` must not fold; called when it arrives."""
        ...

    def add_slice(self, held: torch.Tensor, incoming: torch.Tensor, span: Span) -> None:
        """`held += incoming` in place, for an `incoming` that passed `check_slice` (keeps no reference)."""
        ...

    def finish_slice(self, held: torch.Tensor, weight: float, span: Span) -> None:
        """`finish` on a slice, in place: element for element the same as `finish` on the whole bundle."""
        ...


class StartsSlices(Protocol):
    """A fold that can start a slice in one pass: the optional `start_slice` (the barrier looks it up).

    `start_slice(held, incoming, span)` must leave in `held` exactly what zeroing it and then
    `add_slice(held, incoming, span)` would, whatever `held` held before; it writes `held` once instead
    of a zero pass, an add and (for the modular fold) a reduction. A plugin fold without it is started
    by `held.zero_()` and `add_slice`.
    """

    def start_slice(self, held: torch.Tensor, incoming: torch.Tensor, span: Span) -> None: ...


def check_same_schema(accumulator: Bundle, value: Bundle) -> None:
    """Refuse a bundle whose tensor count, shapes or dtypes differ from the accumulator's."""
    if len(accumulator) != len(value):
        raise FoldError(f"deposit carries {len(value)} tensor(s) but this round folds {len(accumulator)}")
    for index, (held, incoming) in enumerate(zip(accumulator, value, strict=True)):
        if held.shape != incoming.shape:
            raise FoldError(
                f"tensor {index} has shape {tuple(incoming.shape)} but this round folds {tuple(held.shape)}"
            )
        if held.dtype != incoming.dtype:
            raise FoldError(f"tensor {index} has dtype {incoming.dtype} but this round folds {held.dtype}")


class _FloatSum:
    """Element-wise sum of floating tensors (shared by the mean and sum folds)."""

    # Its slice methods act element by element and ignore the span: a round barrier folds a chunk's
    # consecutive slices of one dtype as one (flodld.fold.chunks.Run) where its accumulator allows.
    elementwise = True

    def identity(self, like: Bundle) -> Bundle:
        for index, tensor in enumerate(like):
            if not tensor.is_floating_point():
                raise FoldError(
                    f"tensor {index} has dtype {tensor.dtype}; the {self.spec} fold needs floating tensors "
                    "(use the modular fold for integer ciphertexts)"
                )
        return tuple(torch.zeros_like(tensor) for tensor in like)

    def add(self, accumulator: Bundle, value: Bundle) -> Bundle:
        check_same_schema(accumulator, value)
        for held, incoming in zip(accumulator, value, strict=True):
            held.add_(incoming)
        return accumulator

    def check_slice(self, incoming: torch.Tensor, span: Span) -> None:
        return None  # the schema (floating dtypes) was checked by `identity`

    def add_slice(self, held: torch.Tensor, incoming: torch.Tensor, span: Span) -> None:
        held.add_(incoming)

    def start_slice(self, held: torch.Tensor, incoming: torch.Tensor, span: Span) -> None:
        # 0 + incoming, computed (not copied): bit for bit the zero start's sum, -0.0 becoming +0.0
        # as it does there. One read and one write, like a copy.
        torch.add(incoming, 0.0, out=held)

    def finish_slice(self, held: torch.Tensor, weight: float, span: Span) -> None:
        return None

    @property
    def spec(self) -> str:
        raise NotImplementedError


class MeanFold(_FloatSum):
    """Weighted mean: Σ deposits / Σ weights (each deposit is the weight-scaled value)."""

    @property
    def spec(self) -> str:
        return "mean"

    def finish(self, accumulator: Bundle, weight: float) -> Bundle:
        if weight <= 0:
            raise FoldError("cannot average a round whose total weight is zero (every deposit had weight 0)")
        # In place: the accumulator is this round's own (never a deposit's memory), and dividing in
        # place spares a fresh tensor per round (bit for bit the same quotient as `tensor / weight`).
        return tuple(tensor.div_(weight) for tensor in accumulator)

    def finish_slice(self, held: torch.Tensor, weight: float, span: Span) -> None:
        if weight <= 0:
            raise FoldError("cannot average a round whose total weight is zero (every deposit had weight 0)")
        held.div_(weight)


class SumFold(_FloatSum):
    """Plain element-wise sum; weights are carried but ignored."""

    @property
    def spec(self) -> str:
        return "sum"

    def finish(self, accumulator: Bundle, weight: float) -> Bundle:
        return accumulator


class ModularFold:
    """Per-limb modular addition of integer tensors shaped `[..., limb, N]`.

    `moduli[i]` is the prime of limb i; the result is the modular sum (the decryptor divides
    by the count if it wants a mean, since division is not defined on residues without a key).
    """

    def __init__(self, moduli: Sequence[int]) -> None:
        if not moduli:
            raise FoldError("the modular fold needs at least one modulus, e.g. 'modular:1073479681'")
        for modulus in moduli:
            if not 2 <= modulus < 2**62:
                raise FoldError(f"modulus {modulus} is out of range; moduli must lie in [2, 2**62)")
        self.moduli = tuple(moduli)
        self._column = torch.tensor(self.moduli, dtype=torch.int64).unsqueeze(-1)
        self._spare: torch.Tensor | None = None  # `_scratch`

    @property
    def spec(self) -> str:
        return "modular:" + ",".join(str(modulus) for modulus in self.moduli)

    def identity(self, like: Bundle) -> Bundle:
        for index, tensor in enumerate(like):
            self._check_layout(index, tensor)
        return tuple(torch.zeros_like(tensor) for tensor in like)

    def add(self, accumulator: Bundle, value: Bundle) -> Bundle:
        check_same_schema(accumulator, value)
        for index, incoming in enumerate(value):
            self._check_residues(index, incoming)
        for held, incoming in zip(accumulator, value, strict=True):
            held.add_(incoming)
            # Residues are in [0, q) with q < 2**62 (checked above), so the sum of two never
            # overflows int64 before reduction.
            torch.remainder(held, self._column, out=held)
        return accumulator

    def _check_residues(self, index: int, tensor: torch.Tensor) -> None:
        """Refuse values outside [0, q) per limb: out-of-range input would wrap int64 or skew the sum."""
        if tensor.numel() == 0:
            return
        self._check_layout(index, tensor)
        if bool((tensor < 0).any()) or bool((tensor >= self._column).any()):
            raise FoldError(
                f"tensor {index} holds residues outside [0, q) for its limb's modulus q {list(self.moduli)}; "
                "reduce every residue modulo its limb's prime before depositing"
            )

    def _check_layout(self, index: int, tensor: torch.Tensor) -> None:
        """Refuse a tensor that is not int64 `[..., limb, N]` with one limb per modulus."""
        if tensor.dtype != torch.int64:
            raise FoldError(f"tensor {index} has dtype {tensor.dtype}; the modular fold needs int64")
        self._check_limbs(index, tuple(tensor.shape))

    def _check_limbs(self, index: int, shape: tuple[int, ...]) -> None:
        if len(shape) < 2 or shape[-2] != len(self.moduli):
            raise FoldError(
                f"tensor {index} has shape {shape}; the modular fold needs [..., limb, N] "
                f"with {len(self.moduli)} limb(s), one per modulus"
            )

    def finish(self, accumulator: Bundle, weight: float) -> Bundle:
        return accumulator

    # --- slices: a flat run of elements of a `[..., limb, N]` tensor; element e lies in limb (e // N) % L

    def _slice_moduli(self, span: Span, count: int) -> list[tuple[int, int, torch.Tensor]]:
        """(begin, end, modulus column) per run of the slice: whole rows of N share a column of moduli."""
        self._check_limbs(span.index, span.shape)
        width, limbs = span.shape[-1], len(self.moduli)
        runs: list[tuple[int, int, torch.Tensor]] = []
        position, end = span.start, span.start + count
        while position < end:
            row = position // width
            if position % width or end - position < width:  # a partial row: one modulus
                stop = min(end, (row + 1) * width)
                runs.append((position - span.start, stop - span.start, self._column[row % limbs]))
            else:  # whole rows, each with its limb's modulus
                rows = (end - position) // width
                column = self._column[(torch.arange(row, row + rows) % limbs)]
                stop = position + rows * width
                runs.append((position - span.start, stop - span.start, column))
            position = stop
        return runs

    def check_slice(self, incoming: torch.Tensor, span: Span) -> None:
        if incoming.dtype != torch.int64:
            raise FoldError(f"tensor {span.index} has dtype {incoming.dtype}; the modular fold needs int64")
        for begin, end, modulus in self._slice_moduli(span, incoming.numel()):
            part = incoming[begin:end]
            if modulus.dim() == 2:  # whole rows: the extremes of each row against its limb's prime
                low, high = torch.aminmax(part.view(modulus.shape[0], -1), dim=1)
                bounds = modulus[:, 0]
            else:
                low, high = torch.aminmax(part)
                bounds = modulus
            if bool((low < 0).any()) or bool((high >= bounds).any()):
                raise FoldError(
                    f"tensor {span.index} holds residues outside [0, q) for its limb's modulus q "
                    f"{list(self.moduli)}; reduce every residue modulo its limb's prime before depositing"
                )

    def add_slice(self, held: torch.Tensor, incoming: torch.Tensor, span: Span) -> None:
        held.add_(incoming)  # residues in [0, q), q < 2**62: the sum of two never overflows int64
        for begin, end, modulus in self._slice_moduli(span, held.numel()):
            part = held[begin:end]
            if modulus.dim() == 2:
                part = part.view(modulus.shape[0], -1)
            # The sum lies in [0, 2q): subtract q, and add it back where that went negative (the sign bit
            # spread by an arithmetic shift, masked with q). Exactly the remainder, without a division.
            part.sub_(modulus)
            negative = self._scratch(part)
            torch.bitwise_right_shift(part, 63, out=negative)
            negative.bitwise_and_(modulus)
            part.add_(negative)

    def _scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A reused int64 buffer shaped as `like` (a reduction's sign mask): no allocation per chunk."""
        count = like.numel()
        if self._spare is None or self._spare.numel() < count:
            self._spare = torch.empty(count, dtype=torch.int64)
        return self._spare[:count].view(like.shape)

    def start_slice(self, held: torch.Tensor, incoming: torch.Tensor, span: Span) -> None:
        # Residues already in [0, q) (`check_slice`): 0 + x needs no reduction, so it is a copy.
        held.copy_(incoming)

    def finish_slice(self, held: torch.Tensor, weight: float, span: Span) -> None:
        return None


FoldFactory = Callable[[str], Fold]

_REGISTRY: dict[str, FoldFactory] = {}


def register_fold(name: str, factory: FoldFactory) -> None:
    """Make `name` or `name:params` specs build folds through `factory(params)`."""
    if not name or ":" in name:
        raise ValueError(f"fold name {name!r} must be non-empty and contain no ':'")
    _REGISTRY[name] = factory


def _modular_from_params(params: str) -> Fold:
    try:
        moduli = [int(part) for part in params.split(",") if part.strip()]
    except ValueError as error:
        raise FoldError(
            f"modular fold parameters must be comma-separated integers, got {params!r}"
        ) from error
    return ModularFold(moduli)


def fold_from_spec(spec: str) -> Fold:
    """Build the fold a wire spec names: 'mean', 'sum', 'modular:q0,q1,…' or a registered plugin."""
    name, _, params = spec.partition(":")
    factory = _REGISTRY.get(name)
    if factory is None:
        known = ", ".join(sorted(_REGISTRY))
        raise FoldError(f"unknown fold {name!r}; known folds: {known}")
    return factory(params)


register_fold("mean", lambda params: MeanFold())
register_fold("sum", lambda params: SumFold())
register_fold("modular", _modular_from_params)
