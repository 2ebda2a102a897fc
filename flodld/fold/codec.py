"""Bundle ⇄ (TensorSpec list, tail bytes): tensors as raw little-endian bytes behind a typed header.

Decoding checks that the specs account for exactly the tail's length before building any tensor,
so a lying header cannot make us allocate or read past what was already capped and received, and
that every shape is one torch can describe: a zero-element tensor carries no bytes, but huge other
dimensions (`[0] + [2**40-1]*7`) would overflow torch's stride arithmetic, so the product of the
non-zero dimensions is capped too. Every refusal is a `CodecError`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import torch

from flodld.fold.base import Bundle
from flodld.wire.data import MAX_TENSORS_PER_FRAME, TensorSpec

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
}
_WIRE_DTYPES = {dtype: name for name, dtype in TORCH_DTYPES.items()}

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("flodld's tensor codec assumes a little-endian host")


# The product of a shape's non-zero dimensions: far beyond any tensor that fits a frame, far below
# where torch's int64 stride and storage arithmetic overflows.
MAX_SHAPE_SPAN = 2**48


class CodecError(ValueError):
    """Tensor header and bytes disagree, or a tensor cannot travel; the message says which."""


def check_shape(index: int, spec: TensorSpec) -> None:
    # At most MAX_TENSOR_DIMS dimensions below 2**40 each (the TensorSpec model): the product stays small.
    if math.prod(max(dimension, 1) for dimension in spec.shape) > MAX_SHAPE_SPAN:
        raise CodecError(
            f"tensor {index} has shape {spec.shape}: its non-zero dimensions multiply past {MAX_SHAPE_SPAN} "
            "(torch cannot describe it even with zero elements); send a smaller shape"
        )


def encode_bundle_parts(tensors: Sequence[torch.Tensor]) -> tuple[list[TensorSpec], list[memoryview]]:
    """Specs and one byte view per tensor of CPU, contiguous versions of `tensors`, without copying
    tensors that already are: pass the views as a frame's scatter tail (`FrameConnection.send_frame`).

    The views share memory with the tensors: send them before the tensors change.
    """
    if len(tensors) > MAX_TENSORS_PER_FRAME:
        raise CodecError(
            f"{len(tensors)} tensors in one deposit; at most {MAX_TENSORS_PER_FRAME} are allowed"
        )
    specs: list[TensorSpec] = []
    parts: list[memoryview] = []
    for index, tensor in enumerate(tensors):
        name = _WIRE_DTYPES.get(tensor.dtype)
        if name is None:
            raise CodecError(f"tensor {index} has dtype {tensor.dtype}; supported: {', '.join(TORCH_DTYPES)}")
        flat = tensor.detach().to("cpu").contiguous()
        specs.append(TensorSpec(dtype=name, shape=list(flat.shape)))  # type: ignore[arg-type]  # name is a TensorDtype
        if flat.numel():
            parts.append(memoryview(flat.reshape(-1).view(torch.uint8).numpy()).cast("B"))  # type: ignore[arg-type]
    return specs, parts


def encode_bundle(tensors: Sequence[torch.Tensor]) -> tuple[list[TensorSpec], bytes]:
    """Specs and concatenated bytes of CPU copies of `tensors` (detached, contiguous)."""
    specs, parts = encode_bundle_parts(tensors)
    return specs, b"".join(parts)


def decode_bundle(specs: Sequence[TensorSpec], tail: bytes | bytearray | memoryview) -> Bundle:
    """Tensors described by `specs`, built over the bytes in `tail` (CodecError if they disagree).

    A writable `tail` (a frame's `tail_view`, decrypted into a buffer of its own) is used in place:
    the tensors share its memory, with no copy. A read-only one (`bytes`) is copied first.
    """
    for index, spec in enumerate(specs):
        check_shape(index, spec)
    view = memoryview(tail).cast("B")
    expected = sum(spec.nbytes() for spec in specs)
    if expected != view.nbytes:
        raise CodecError(f"tensor headers describe {expected} bytes but the frame carries {view.nbytes}")
    if view.readonly and expected:
        view = memoryview(bytearray(view))
    tensors: list[torch.Tensor] = []
    offset = 0
    for index, spec in enumerate(specs):
        size = spec.nbytes()
        dtype = TORCH_DTYPES[spec.dtype]
        try:
            if size:
                raw = torch.frombuffer(view, dtype=torch.uint8, count=size, offset=offset)
                tensors.append(raw.view(dtype).reshape(list(spec.shape)))
            else:
                tensors.append(torch.empty(spec.shape, dtype=dtype))
        except (RuntimeError, ValueError, OverflowError) as error:  # torch's own refusal, as ours
            raise CodecError(f"tensor {index} ({spec.dtype} {spec.shape}) cannot be built: {error}") from None
        offset += size
    return tuple(tensors)
