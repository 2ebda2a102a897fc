"""Whole-value collectives: broadcast, scatter, gather and all-gather of complete typed values.

Transport only: payload bits and metadata arrive exactly as sent. Nothing is added,
concatenated, aligned or rescaled. Sequence positions are group-rank order; ``src``/``dst``
are global ranks that must belong to ``group``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, cast

import torch.distributed as dist

from fhelium.core import KEY_TYPES, Ciphertext, CompressedPlaintext, DenseKey, Plaintext, SecretKey
from fhelium.distributed._collective_common import (
    ControlExchange,
    GroupInfo,
    agree,
    agree_on_allocation,
    allocation_error,
    check_identical_layouts,
    describe_or_error,
    exchange_control,
    group_info,
    rank_body,
    root_error,
    type_error,
)
from fhelium.distributed._staging import PointToPointBatch, PreparedAllGather, PreparedBroadcast
from fhelium.distributed._state import local_device
from fhelium.distributed._transfer import (
    Descriptor,
    DescriptorError,
    TensorDescriptor,
    allocate_value,
    check_receive_total,
    decode_descriptor,
    payload_bytes,
    payload_leaves,
    rebuild,
)

#: The value type a typed collective moves (Ciphertext, Plaintext, a key, ...).
V = TypeVar("V")


def decode_for_receivers(
    exchange: ControlExchange, sender_group_rank: int, receivers: Sequence[int], index: int | None = None
) -> Descriptor:
    """Validate a sender's descriptor and that every receiver can allocate it."""
    body = exchange.body_of(sender_group_rank)["descriptor"]
    raw = body if index is None else body[index]
    descriptor = decode_descriptor(raw)
    specs = (descriptor.tensor,) if isinstance(descriptor, TensorDescriptor) else descriptor.tensors
    if any(spec.device_type == "cuda" for spec in specs):
        for receiver in receivers:
            if exchange.body_of(receiver)["device_type"] != "cuda":
                raise DescriptorError(
                    f"group rank {sender_group_rank} sends CUDA tensors but receiving group rank "
                    f"{receiver} has no CUDA device; move the value to CPU before sending"
                )
    return descriptor


# -- broadcast ------------------------------------------------------------------------------


def broadcast_value(
    value_or_none: V | None,
    *,
    accepts: tuple[type[V], ...],
    src: int,
    info: GroupInfo,
    operation: str,
    source_error: str | None = None,
) -> V:
    """Source returns its own object; every other rank returns a fresh copy on its local device."""

    def describe_source() -> tuple[dict[str, Any] | None, str | None]:
        error = source_error or type_error(value_or_none, accepts, f"source rank {src}")
        return (None, error) if error is not None else describe_or_error(value_or_none)

    exchange, is_source = _exchange_from_source(
        value_or_none, describe_source, src=src, info=info, operation=operation
    )
    if info.size == 1:
        return cast(V, value_or_none)  # the only rank is the source, checked above
    root = info.group_rank_of(src)
    assert root is not None  # the exchange refused non-members
    others = [r for r in range(info.size) if r != root]
    received = agree(info, operation, lambda: decode_for_receivers(exchange, root, others))

    def prepare() -> tuple[Any, list[PreparedBroadcast]]:
        if is_source:
            return value_or_none, [
                PreparedBroadcast.source(leaf, info) for leaf in payload_leaves(value_or_none)
            ]
        result, leaves = allocate_value(received, local_device())
        return result, [PreparedBroadcast.receiver(leaf, info) for leaf in leaves]

    result, transfers = agree_on_allocation(info, operation, prepare)
    for transfer in transfers:
        transfer.run(src_global=src, info=info, operation=operation)
    return cast(V, result)


def _exchange_from_source(
    given: object,
    describe_source: Callable[[], tuple[dict[str, Any] | list[dict[str, Any]] | None, str | None]],
    *,
    src: int,
    info: GroupInfo,
    operation: str,
    refusal: str | None = None,
) -> tuple[ControlExchange, bool]:
    """The control exchange of a collective rooted at ``src``, and whether this rank is the source.

    The root argument is checked, then ``refusal`` (a caller's own validation, on any rank); the source
    describes its payload (``describe_source`` returns the body for the exchange or an error); every other
    rank must have given None.
    """
    error = root_error(info, "src", src)
    is_source = error is None and info.global_rank == src
    error = error or refusal
    body: dict[str, Any] | list[dict[str, Any]] | None = None
    if error is None:
        if is_source:
            body, error = describe_source()
        elif given is not None:
            error = f"non-source rank {info.global_rank} must supply None; got {type(given).__name__}"
    exchange = exchange_control(
        info, operation, arguments={"src": _plain(src)}, error=error, body=rank_body(body)
    )
    return exchange, is_source


def _plain(argument: object) -> object:
    """JSON-safe form of a root argument, so that a bad one reaches the error exchange."""
    return argument if type(argument) is int else repr(argument)


# -- scatter --------------------------------------------------------------------------------


def scatter_values(
    values_or_none: Sequence[V] | None,
    *,
    accepts: tuple[type[V], ...],
    src: int,
    info: GroupInfo,
    operation: str,
    refusal: str | None = None,
) -> V:
    """Group rank ``i`` receives ``values[i]``; the source keeps its own element (no copy).

    ``refusal`` lets a caller that prepared ``values`` report its own validation failure, on any rank
    (a non-source rank's wrong arguments too), before the exchange.
    """

    def describe_source() -> tuple[list[dict[str, Any]] | None, str | None]:
        error = _scatter_source_error(values_or_none, accepts, info)
        if error is not None:
            return None, error
        assert values_or_none is not None
        descriptors = []
        for position, item in enumerate(values_or_none):
            encoded, error = describe_or_error(item)
            if error is not None:
                return None, f"values[{position}]: {error}"
            assert encoded is not None
            descriptors.append(encoded)
        return descriptors, None

    exchange, is_source = _exchange_from_source(
        values_or_none, describe_source, src=src, info=info, operation=operation, refusal=refusal
    )
    root = info.group_rank_of(src)
    assert root is not None and (not is_source or values_or_none is not None)
    if info.size == 1:
        return values_or_none[0]  # type: ignore[index]  # the source check guaranteed one value
    received = agree(
        info,
        operation,
        lambda: [decode_for_receivers(exchange, root, [r], index=r) for r in range(info.size)],
    )

    def prepare() -> tuple[Any, PointToPointBatch]:
        batch = PointToPointBatch(info)
        if is_source:
            assert values_or_none is not None
            for group_rank, item in enumerate(values_or_none):
                if group_rank == root:
                    continue
                for tag, leaf in enumerate(payload_leaves(item)):
                    batch.send(leaf, info.global_rank_of(group_rank), tag)
            return values_or_none[root], batch
        result, leaves = allocate_value(received[info.group_rank], local_device())
        for tag, leaf in enumerate(leaves):
            batch.receive(leaf, src, tag)
        return result, batch

    result, batch = agree_on_allocation(info, operation, prepare)
    batch.run(operation, "payload scatter")
    return cast(V, result)


def _scatter_source_error(values: object, accepts: tuple[type, ...], info: GroupInfo) -> str | None:
    if values is None or isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        return f"source rank {info.global_rank} must supply a sequence of values, one per group rank"
    if len(values) != info.size:
        return (
            f"source must supply exactly one value per group rank: got {len(values)} for group size "
            f"{info.size}"
        )
    for position, item in enumerate(values):
        error = type_error(item, accepts, f"source values[{position}]")
        if error is not None:
            return error
    return None


# -- gather / all-gather --------------------------------------------------------------------


def gather_values(
    value: V,
    *,
    accepts: tuple[type[V], ...],
    dst: int,
    info: GroupInfo,
    operation: str,
    layout_check: Callable[[list[Descriptor]], None] | None = None,
) -> list[V] | None:
    """``dst`` gets every rank's value in group-rank order (its own entry is its own object).

    ``layout_check`` sees every rank's descriptor on every rank, before any payload moves.
    """
    error = root_error(info, "dst", dst) or type_error(value, accepts, f"rank {info.global_rank}")
    descriptor = None
    if error is None:
        descriptor, error = describe_or_error(value)
    exchange = exchange_control(
        info, operation, arguments={"dst": _plain(dst)}, error=error, body=rank_body(descriptor)
    )
    if info.size == 1:
        if layout_check is not None:
            agree(
                info, operation, lambda: layout_check([decode_descriptor(exchange.body_of(0)["descriptor"])])
            )
        return [value]
    root = info.group_rank_of(dst)
    assert root is not None

    def check() -> list[Descriptor]:
        descriptors = [decode_for_receivers(exchange, r, [root]) for r in range(info.size)]
        if layout_check is not None:
            layout_check(descriptors)
        check_receive_total(
            sum(payload_bytes(d) for r, d in enumerate(descriptors) if r != root),
            f"dst (global rank {dst}), receiving {info.size - 1} values,",
        )
        return descriptors

    received = agree(info, operation, check)

    def prepare() -> tuple[list[Any] | None, PointToPointBatch]:
        batch = PointToPointBatch(info)
        if info.global_rank != dst:
            for tag, leaf in enumerate(payload_leaves(value)):
                batch.send(leaf, dst, tag)
            return None, batch
        results: list[Any] = []
        for group_rank, descriptor_of_rank in enumerate(received):
            if group_rank == root:
                results.append(value)
                continue
            item, leaves = allocate_value(descriptor_of_rank, local_device())
            for tag, leaf in enumerate(leaves):
                batch.receive(leaf, info.global_rank_of(group_rank), tag)
            results.append(item)
        return results, batch

    gathered, batch = agree_on_allocation(info, operation, prepare)
    batch.run(operation, "payload gather")
    return gathered


def all_gather_values(value: V, *, accepts: tuple[type[V], ...], info: GroupInfo, operation: str) -> list[V]:
    """Every rank gets fresh copies of every rank's value (identical layouts required)."""
    error = type_error(value, accepts, f"rank {info.global_rank}")
    descriptor = None
    if error is None:
        descriptor, error = describe_or_error(value)
    # Layouts must be identical, so this rank's own value sizes what it receives: it allocates
    # before the control exchange and reports a failure there (no second exchange needed).
    prepared: list[PreparedAllGather] | None = None
    if error is None:
        try:
            leaves = payload_leaves(value)
            check_receive_total(
                info.size * sum(leaf.numel() * leaf.element_size() for leaf in leaves),
                f"every rank, receiving {info.size} values,",
            )
            prepared = [PreparedAllGather.allocate(leaf, info) for leaf in leaves]
        except DescriptorError as problem:
            error = str(problem)
        except (RuntimeError, MemoryError, ValueError) as problem:
            error = allocation_error(problem)
    try:
        exchange = exchange_control(info, operation, arguments={}, error=error, body=rank_body(descriptor))
        common = agree(info, operation, lambda: _common_layout(exchange, operation, info))
    except BaseException:
        prepared = None  # the traceback keeps this frame: release the receive storage now
        raise
    assert prepared is not None
    gathered = [leaf.run(info=info, operation=operation) for leaf in prepared]
    return [rebuild(common, tuple(per_leaf[r] for per_leaf in gathered)) for r in range(info.size)]


def _common_layout(exchange: ControlExchange, operation: str, info: GroupInfo) -> Descriptor:
    descriptor = check_identical_layouts(exchange, operation)
    decode_for_receivers(exchange, 0, range(info.size))
    return descriptor


# -- public typed wrappers ------------------------------------------------------------------

_SHAREABLE_KEYS: tuple[type, ...] = tuple(kind for kind in KEY_TYPES if kind is not SecretKey)


class TypedBroadcast(Protocol[V]):
    """``broadcast_value`` for one value type: what ``broadcast_ciphertext`` and its kin are."""

    def __call__(self, value_or_none: V | None, *, src: int = 0, group: dist.ProcessGroup | None = None) -> V:
        """Broadcast one complete value from global rank ``src`` (other ranks pass None)."""
        ...


class TypedAllGather(Protocol[V]):
    """``all_gather_values`` for one value type: what ``all_gather_ciphertexts`` and its kin are."""

    def __call__(self, value: V, *, group: dist.ProcessGroup | None = None) -> list[V]:
        """Every rank gets fresh copies of every rank's value, in group-rank order."""
        ...


def _named(function: Callable[..., object], operation: str, doc: str) -> None:
    function.__name__ = function.__qualname__ = operation
    function.__doc__ = doc


def typed_broadcast(kind: type[V], operation: str) -> TypedBroadcast[V]:
    """The public broadcast of ``kind`` values, named ``operation`` (its name in errors and traces)."""

    def broadcast(value_or_none: V | None, *, src: int = 0, group: dist.ProcessGroup | None = None) -> V:
        info = group_info(group)
        return broadcast_value(value_or_none, accepts=(kind,), src=src, info=info, operation=operation)

    doc = f"Broadcast one complete {kind.__name__} from global rank ``src`` (other ranks pass None)."
    _named(broadcast, operation, doc)
    return broadcast


def typed_all_gather(kind: type[V], operation: str) -> TypedAllGather[V]:
    """The public all-gather of ``kind`` values, named ``operation``."""

    def all_gather(value: V, *, group: dist.ProcessGroup | None = None) -> list[V]:
        return all_gather_values(value, accepts=(kind,), info=group_info(group), operation=operation)

    doc = f"Every rank gets fresh copies of every rank's {kind.__name__}, in group-rank order."
    _named(all_gather, operation, doc)
    return all_gather


broadcast_ciphertext = typed_broadcast(Ciphertext, "broadcast_ciphertext")
broadcast_plaintext = typed_broadcast(Plaintext, "broadcast_plaintext")
broadcast_compressed_plaintext = typed_broadcast(CompressedPlaintext, "broadcast_compressed_plaintext")
all_gather_ciphertexts = typed_all_gather(Ciphertext, "all_gather_ciphertexts")
all_gather_plaintexts = typed_all_gather(Plaintext, "all_gather_plaintexts")
all_gather_compressed_plaintexts = typed_all_gather(CompressedPlaintext, "all_gather_compressed_plaintexts")


def broadcast_key(
    key_or_none: DenseKey | None,
    *,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    allow_secret_key: bool = False,
) -> DenseKey:
    """Broadcast a public or evaluation key; a SecretKey only with ``allow_secret_key=True``.

    Refusing secret keys by default keeps an accidental broadcast from leaking the decryption
    key to every rank of the group.
    """
    accepts = (*_SHAREABLE_KEYS, SecretKey) if allow_secret_key else _SHAREABLE_KEYS
    refusal = None
    if type(key_or_none) is SecretKey and not allow_secret_key:
        refusal = "refusing to broadcast a SecretKey; pass allow_secret_key=True if every rank may decrypt"
    return broadcast_value(
        key_or_none,
        accepts=accepts,
        src=src,
        info=group_info(group),
        operation="broadcast_key",
        source_error=refusal,
    )


def scatter_ciphertexts(
    values_or_none: Sequence[Ciphertext] | None, *, src: int = 0, group: dist.ProcessGroup | None = None
) -> Ciphertext:
    """Group rank ``i`` receives complete ciphertext ``values[i]`` (no slicing, no copy at the source)."""
    return scatter_values(
        values_or_none,
        accepts=(Ciphertext,),
        src=src,
        info=group_info(group),
        operation="scatter_ciphertexts",
    )


def gather_ciphertexts(
    value: Ciphertext, *, dst: int = 0, group: dist.ProcessGroup | None = None
) -> list[Ciphertext] | None:
    """``dst`` receives every rank's ciphertext in group-rank order; others get None."""
    info = group_info(group)
    return gather_values(value, accepts=(Ciphertext,), dst=dst, info=info, operation="gather_ciphertexts")
