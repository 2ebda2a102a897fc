"""Group/rank bookkeeping and the group-consistent control exchange (payload staging, step 4, is
`fhelium.distributed._staging`).

Every typed collective runs in the same order:

1. local validation, producing an error string or ``None`` (never raising yet);
2. :func:`exchange_control`: one all-gather of small JSON records, after which every rank
   knows every rank's error, operation name, root and descriptor, and either all ranks
   raise the same :class:`CollectiveArgumentError` or all proceed;
3. :func:`agree_on_allocation` where a rank receives storage sized by a peer's descriptor:
   every rank allocates (and packs) what its payload phase needs, then a second control
   exchange shares who failed, so an allocation failure raises the same error on every rank
   instead of leaving the peers waiting in the payload phase;
4. payload collectives through the staging helpers;
5. local compute.

No pickle: control records are JSON bytes carried in a ``uint8`` tensor, length-capped
before any buffer is allocated.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from fhelium.distributed._state import local_device
from fhelium.distributed._transfer import (
    Descriptor,
    DescriptorError,
    decode_descriptor,
    describe_value,
    encode_descriptor,
)

# A control record is a few hundred bytes (one descriptor); scatter sends one per rank.
CONTROL_SLOT_BYTES = 1024
MAX_CONTROL_BYTES = 4 * 1024 * 1024
_LENGTH_BYTES = 8

_T = TypeVar("_T")
# An allocator's message (a CUDA out-of-memory report runs to several hundred bytes) is cut here
# so that the allocation exchange stays within one control slot for small groups.
_ALLOCATION_MESSAGE_CHARS = 400

HANG_HINT = (
    "every rank of the group must call the same collectives in the same order with the same "
    "root; see docs/distributed.md, 'Diagnosing a hang'"
)


class CollectiveArgumentError(ValueError):
    """Raised identically on every group rank when any rank's arguments or descriptor are bad."""


class CollectiveFailure(RuntimeError):
    """A payload or control collective failed (peer gone, timeout); names the phase."""


@dataclass(frozen=True)
class GroupInfo:
    """The calling rank's view of one process group."""

    group: dist.ProcessGroup | None
    global_rank: int
    group_rank: int
    size: int
    global_ranks: tuple[int, ...]
    backend: str
    transport_device: torch.device

    def group_rank_of(self, global_rank: int) -> int | None:
        try:
            return self.global_ranks.index(global_rank)
        except ValueError:
            return None

    def global_rank_of(self, group_rank: int) -> int:
        return self.global_ranks[group_rank]

    def describe(self) -> str:
        return (
            f"global rank {self.global_rank}, group rank {self.group_rank} of {self.size}, "
            f"group members (global ranks) {list(self.global_ranks)}, backend {self.backend}"
        )


def group_info(group: dist.ProcessGroup | None) -> GroupInfo:
    """Resolve ``group`` (None = default group) for the calling rank."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "fhelium.distributed collective called before fhelium.distributed.init() or "
            "torch.distributed.init_process_group()"
        )
    group_rank = dist.get_rank(group)
    if group_rank < 0:
        raise RuntimeError(
            f"global rank {dist.get_rank()} is not a member of the process group it passed; only "
            "members may call a collective on a group"
        )
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    backend = str(dist.get_backend(group))
    transport = local_device() if backend == "nccl" else torch.device("cpu")
    return GroupInfo(
        group=group,
        global_rank=dist.get_rank(),
        group_rank=group_rank,
        size=len(ranks),
        global_ranks=ranks,
        backend=backend,
        transport_device=transport,
    )


def root_error(info: GroupInfo, name: str, global_rank: object) -> str | None:
    """Why ``global_rank`` cannot be the ``src``/``dst`` of a collective on this group, if so."""
    if type(global_rank) is not int:
        return f"{name} must be an int global rank; got {global_rank!r}"
    if info.group_rank_of(global_rank) is None:
        return (
            f"{name}={global_rank} is a global rank that is not a member of the process group "
            f"(members: {list(info.global_ranks)}); {name} is a global rank, not a group rank"
        )
    return None


@contextmanager
def collective_phase(info: GroupInfo, operation: str, phase: str) -> Iterator[None]:
    """Turn a transport failure into a :class:`CollectiveFailure` naming where it happened."""
    try:
        yield
    except (CollectiveArgumentError, CollectiveFailure):
        raise
    except RuntimeError as error:
        raise CollectiveFailure(
            f"{operation}: phase '{phase}' failed on {info.describe()}: {error}. {HANG_HINT}"
        ) from error


@dataclass(frozen=True)
class ControlRecord:
    """What one rank announces before the payload phase."""

    operation: str
    arguments: dict[str, Any]
    error: str | None
    body: Any = None

    def encode(self) -> bytes:
        return json.dumps(
            {
                "operation": self.operation,
                "arguments": self.arguments,
                "error": self.error,
                "body": self.body,
            },
            separators=(",", ":"),
            allow_nan=False,
        ).encode()

    @classmethod
    def decode(cls, raw: bytes) -> ControlRecord:
        data = json.loads(raw.decode())
        if not isinstance(data, dict) or set(data) != {"operation", "arguments", "error", "body"}:
            raise ValueError("malformed control record")
        return cls(data["operation"], data["arguments"], data["error"], data["body"])


@dataclass
class ControlExchange:
    """Outcome of :func:`exchange_control`: every rank's record, in group-rank order."""

    records: list[ControlRecord] = field(default_factory=list)

    def body_of(self, group_rank: int) -> Any:  # noqa: ANN401  a peer's JSON, unchecked; read it under agree()
        return self.records[group_rank].body


def _encode_bounded(record: ControlRecord) -> bytes:
    try:
        raw = record.encode()
    except (TypeError, ValueError) as error:
        raw = ControlRecord(
            record.operation, record.arguments, f"unencodable control record: {error}"
        ).encode()
    if len(raw) > MAX_CONTROL_BYTES:
        raw = ControlRecord(
            record.operation,
            record.arguments,
            f"control record of {len(raw)} bytes exceeds the {MAX_CONTROL_BYTES}-byte cap",
        ).encode()
    return raw


def _all_gather_bytes(raw: bytes, info: GroupInfo) -> list[bytes]:
    """All-gather variable-length byte strings; one collective when they fit a slot."""
    slot = CONTROL_SLOT_BYTES
    own = torch.zeros(slot, dtype=torch.uint8)
    view = own.numpy()
    view[:_LENGTH_BYTES] = np.frombuffer(len(raw).to_bytes(_LENGTH_BYTES, "little"), dtype=np.uint8)
    if len(raw) <= slot - _LENGTH_BYTES:
        view[_LENGTH_BYTES : _LENGTH_BYTES + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    gathered = [t.numpy() for t in _all_gather_uint8(own, info)]
    lengths = [int.from_bytes(t[:_LENGTH_BYTES].tobytes(), "little") for t in gathered]
    longest = max(lengths)
    if longest > MAX_CONTROL_BYTES:
        # Every rank sees the same lengths, so every rank raises here.
        raise CollectiveArgumentError(
            f"a control record of {longest} bytes exceeds the {MAX_CONTROL_BYTES}-byte cap"
        )
    if longest <= slot - _LENGTH_BYTES:
        return [
            t[_LENGTH_BYTES : _LENGTH_BYTES + n].tobytes() for t, n in zip(gathered, lengths, strict=True)
        ]
    wide = torch.zeros(longest, dtype=torch.uint8)
    wide.numpy()[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return [t.numpy()[:n].tobytes() for t, n in zip(_all_gather_uint8(wide, info), lengths, strict=True)]


def _all_gather_uint8(own: torch.Tensor, info: GroupInfo) -> list[torch.Tensor]:
    device = info.transport_device
    staged = own.to(device)
    outputs = [torch.empty_like(staged) for _ in range(info.size)]
    dist.all_gather(outputs, staged, group=info.group)
    return [t.cpu() for t in outputs]


def exchange_control(
    info: GroupInfo,
    operation: str,
    *,
    arguments: dict[str, Any],
    error: str | None,
    body: dict[str, Any] | None = None,
    stage: str = "argument validation",
) -> ControlExchange:
    """Share every rank's arguments, error and body; raise the same error on all ranks if needed.

    ``arguments`` must be equal on every rank (roots, operation options); a difference is
    reported as an error. ``error`` is this rank's local validation result. ``stage`` names
    the step in the raised message (and the phase of a transport failure).
    """
    record = ControlRecord(operation, arguments, error, body)
    if info.size == 1:
        if error is not None:
            raise CollectiveArgumentError(f"{operation}: {error}")
        return ControlExchange([record])
    raw = _encode_bounded(record)
    phase = "control exchange" if stage == "argument validation" else f"control exchange ({stage})"
    with collective_phase(info, operation, phase):
        gathered = _all_gather_bytes(raw, info)
    records: list[ControlRecord] = []
    problems: list[str] = []
    for group_rank, item in enumerate(gathered):
        try:
            records.append(ControlRecord.decode(item))
        except ValueError as decode_error:
            records.append(ControlRecord("?", {}, None))
            problems.append(f"group rank {group_rank}: undecodable control record ({decode_error})")
    problems.extend(_disagreements(records))
    problems.extend(
        f"group rank {group_rank} (global rank {info.global_rank_of(group_rank)}): {item.error}"
        for group_rank, item in enumerate(records)
        if item.error is not None
    )
    if problems:
        # Named after group rank 0's operation so that every rank raises the very same text.
        raise CollectiveArgumentError(f"{records[0].operation} {stage} failed: " + "; ".join(problems))
    return ControlExchange(records)


def allocation_error(problem: BaseException) -> str:
    """This rank's report of a failed allocation, short enough for a control record."""
    text = f"{type(problem).__name__}: {problem}"
    if len(text) > _ALLOCATION_MESSAGE_CHARS:
        text = text[: _ALLOCATION_MESSAGE_CHARS - 3] + "..."
    return f"cannot allocate receive storage ({text})"


def agree_on_allocation(info: GroupInfo, operation: str, prepare: Callable[[], _T]) -> _T:
    """Run ``prepare`` (every allocation and packing of this rank's payload phase), then agree.

    Every rank calls this, senders too (their packing may allocate). A second control exchange
    shares each rank's outcome, so if any rank could not allocate, every rank raises the same
    :class:`CollectiveArgumentError` and nobody enters the payload phase; the group stays usable.
    """
    prepared: _T | None = None
    error: str | None = None
    try:
        prepared = prepare()
    except (RuntimeError, MemoryError, ValueError) as problem:  # torch.OutOfMemoryError is a RuntimeError
        error = allocation_error(problem)
    try:
        exchange_control(
            info,
            operation,
            arguments={"stage": "receive allocation"},
            error=error,
            stage="receive allocation",
        )
    except BaseException:
        # The traceback keeps this frame alive: drop this rank's buffers before the error leaves.
        prepared = None
        raise
    assert error is None
    return prepared  # type: ignore[return-value]  # set whenever error is None


def _disagreements(records: Sequence[ControlRecord]) -> list[str]:
    reference = records[0]
    problems: list[str] = []
    for group_rank, item in enumerate(records[1:], start=1):
        if item.operation != reference.operation:
            problems.append(
                f"group rank {group_rank} called {item.operation} while group rank 0 called "
                f"{reference.operation}"
            )
        elif item.arguments != reference.arguments:
            problems.append(
                f"group rank {group_rank} passed {item.arguments} while group rank 0 passed "
                f"{reference.arguments}"
            )
    return problems


# ---------------------------------------------------------------------------------------
# Payload staging


def type_error(value: object, accepts: tuple[type, ...], role: str) -> str | None:
    """Exact-type check (subclasses have their own schema entries, so they are refused)."""
    if type(value) in accepts:
        return None
    names = " or ".join(t.__name__ for t in accepts)
    return f"{role} must supply {names}; got {type(value).__name__}"


def describe_or_error(value: object) -> tuple[dict[str, Any] | None, str | None]:
    """The JSON descriptor of ``value`` after the same validation a receiver will apply."""
    try:
        encoded = encode_descriptor(describe_value(value))
        decode_descriptor(encoded)
    except (DescriptorError, ValueError, TypeError) as error:
        return None, f"cannot describe {type(value).__name__} for transfer: {error}"
    return encoded, None


def rank_body(descriptor: dict[str, Any] | list[dict[str, Any]] | None) -> dict[str, Any]:
    """What every rank announces: its local device type, and its descriptor if it sends one."""
    return {"device_type": local_device().type, "descriptor": descriptor}


def agree(info: GroupInfo, operation: str, check: Callable[[], _T]) -> _T:
    """Run a check whose inputs every rank shares after the control exchange.

    Because the inputs are identical everywhere, a failure raises the same error on every
    rank without another round of communication.
    """
    try:
        return check()
    except CollectiveArgumentError:
        raise
    except (ValueError, KeyError, TypeError) as error:  # KeyError/TypeError: a malformed peer record
        raise CollectiveArgumentError(f"{operation} argument validation failed: {error}") from None


def check_identical_layouts(exchange: ControlExchange, operation: str) -> Descriptor:
    """Every rank's descriptor must equal group rank 0's (metadata, shapes, dtypes, device type)."""
    first = exchange.body_of(0)["descriptor"]
    differing = [
        group_rank
        for group_rank in range(1, len(exchange.records))
        if exchange.body_of(group_rank)["descriptor"] != first
    ]
    if differing:
        detail = "; ".join(
            f"group rank {r}: {_difference(first, exchange.body_of(r)['descriptor'])}" for r in differing
        )
        raise DescriptorError(
            f"{operation} requires identical value type, metadata, shapes, dtypes and device type on "
            f"every group rank; these differ from group rank 0 -> {detail}"
        )
    return decode_descriptor(first)


def agree_on_layout(
    info: GroupInfo,
    operation: str,
    *,
    arguments: dict[str, Any],
    error: str | None,
    descriptor: dict[str, Any] | None,
) -> Descriptor:
    """The control exchange of a collective whose ranks must hold identical layouts, and its check.

    Every rank announces ``descriptor`` (with its device type, :func:`rank_body`) and its local
    ``error`` in one :func:`exchange_control`; then :func:`check_identical_layouts` runs under
    :func:`agree`, so a mismatch raises the same error everywhere. Returns the common layout.
    """
    exchange = exchange_control(info, operation, arguments=arguments, error=error, body=rank_body(descriptor))
    return agree(info, operation, lambda: check_identical_layouts(exchange, operation))


def _difference(reference: dict[str, Any], other: dict[str, Any]) -> str:
    parts: list[str] = []
    for key in sorted(set(reference) | set(other)):
        if key == "metadata":
            ref_meta, other_meta = reference.get(key, {}), other.get(key, {})
            for name in sorted(set(ref_meta) | set(other_meta)):
                if ref_meta.get(name) != other_meta.get(name):
                    parts.append(f"{name}={other_meta.get(name)!r} vs {ref_meta.get(name)!r}")
        elif reference.get(key) != other.get(key):
            parts.append(f"{key}={other.get(key)!r} vs {reference.get(key)!r}")
    return ", ".join(parts) or "differs"
