"""Transfer descriptors: what a receiver needs to allocate and rebuild a value, without tensors.

A descriptor is sent (as JSON, inside a control record) before any payload. Two kinds:

- ``"tensor"``: a raw ``torch.Tensor`` (shape, dtype, device type), outside the value registry;
- ``"fhelium_value"``: an exact fhelium value type, described through the serialization
  layer's ``ValueEnvelope`` (value schema version, non-tensor metadata, tensor names in
  payload order with shape/dtype/device type).

``TRANSFER_PROTOCOL_VERSION`` versions this wire shape; the durable value schema carries its
own version, so either can change without the other. Device *indices* are never sent: a
receiver allocates on its own rank-local device of the declared *type*.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fhelium.serialization.value import ValueEnvelope, validate_value_description

TRANSFER_PROTOCOL_VERSION = 1

# Caps checked before allocation: a descriptor is untrusted input from a peer.
MAX_TENSOR_DIMS = 16
MAX_TENSORS_PER_VALUE = 8
MAX_TRANSFER_BYTES = 64 * 1024**3
# What one rank may allocate to receive in one collective, summed over every value it receives
# (a gather's destination receives group size - 1 values; an all-gather allocates group size).
MAX_RECEIVE_BYTES = 64 * 1024**3

_DTYPES: dict[str, torch.dtype] = {
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "complex128": torch.complex128,
    "complex64": torch.complex64,
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}

DeviceType = Literal["cpu", "cuda"]
DtypeName = Literal[
    "int64", "int32", "int16", "int8", "uint8", "bool",
    "float64", "float32", "float16", "bfloat16", "complex128", "complex64",
]  # fmt: skip


class DescriptorError(ValueError):
    """A transfer descriptor is malformed, unsupported, or cannot be honoured on this rank."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class TensorSpec(_Model):
    """Shape, dtype and device type of one tensor leaf (never its device index or strides)."""

    shape: Annotated[tuple[Annotated[int, Field(ge=0)], ...], Field(max_length=MAX_TENSOR_DIMS)]
    dtype: DtypeName
    device_type: DeviceType

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _DTYPES[self.dtype].itemsize

    def check_layout(self, what: str) -> None:
        """Refuse a shape whose contiguous strides exceed the byte cap, even with zero elements.

        A zero-element tensor has no bytes, but torch still computes its strides from the other
        extents: ``[0] + [2**40 - 1] * 7`` overflows them (a RuntimeError in ``torch.empty``).
        Counting every extent as at least one bounds the strides by the cap as well.
        """
        span = _DTYPES[self.dtype].itemsize * math.prod(max(extent, 1) for extent in self.shape)
        if span > MAX_TRANSFER_BYTES:
            raise DescriptorError(
                f"{what} of shape {list(self.shape)} ({self.dtype}) spans over the {MAX_TRANSFER_BYTES}-byte "
                "cap (zero extents counted as one, as torch's strides count them)"
            )


class NamedTensorSpec(TensorSpec):
    name: Annotated[str, Field(min_length=1, max_length=64)]


class TensorDescriptor(_Model):
    protocol_version: int
    kind: Literal["tensor"]
    tensor: TensorSpec


class ValueDescriptor(_Model):
    protocol_version: int
    kind: Literal["fhelium_value"]
    value_schema_version: int
    value_type: Annotated[str, Field(min_length=1, max_length=64)]
    metadata: dict[str, Any]
    tensors: Annotated[tuple[NamedTensorSpec, ...], Field(min_length=1, max_length=MAX_TENSORS_PER_VALUE)]


Descriptor = TensorDescriptor | ValueDescriptor


def tensor_spec(tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(**_spec_fields(tensor))


def _spec_fields(tensor: torch.Tensor) -> dict[str, Any]:
    if tensor.layout is not torch.strided:
        raise DescriptorError(f"only dense strided tensors can be transferred; got layout {tensor.layout}")
    if tensor.device.type not in ("cpu", "cuda"):
        raise DescriptorError(f"only CPU and CUDA tensors can be transferred; got device {tensor.device}")
    if tensor.dtype not in _DTYPE_NAMES:
        raise DescriptorError(f"dtype {tensor.dtype} is not transferable; supported: {sorted(_DTYPES)}")
    return {
        "shape": tuple(int(extent) for extent in tensor.shape),
        "dtype": _DTYPE_NAMES[tensor.dtype],
        "device_type": tensor.device.type,
    }


def describe_tensor(tensor: torch.Tensor) -> TensorDescriptor:
    return TensorDescriptor(
        protocol_version=TRANSFER_PROTOCOL_VERSION, kind="tensor", tensor=tensor_spec(tensor)
    )


def describe_value(value: object) -> Descriptor:
    """Descriptor for a raw tensor or an exact fhelium value (subclasses are not registered)."""
    if isinstance(value, torch.Tensor):
        return describe_tensor(value)
    try:
        envelope = ValueEnvelope.from_value(value)
    except ValueError as error:
        raise DescriptorError(
            f"typed transfer supports torch.Tensor and exact fhelium values; got {type(value).__qualname__} "
            f"({error})"
        ) from None
    tensors = tuple(NamedTensorSpec(name=name, **_spec_fields(t)) for name, t in envelope.tensors.items())
    return ValueDescriptor(
        protocol_version=TRANSFER_PROTOCOL_VERSION,
        kind="fhelium_value",
        value_schema_version=envelope.schema_version,
        value_type=envelope.value_type,
        metadata=envelope.metadata,
        tensors=tensors,
    )


def encode_descriptor(descriptor: Descriptor) -> dict[str, Any]:
    """JSON-ready form (for a control record)."""
    return descriptor.model_dump(mode="json")


def decode_descriptor(data: object) -> Descriptor:
    """Parse and fully validate a descriptor received from a peer, before any allocation."""
    if not isinstance(data, dict):
        raise DescriptorError(f"transfer descriptor must be a JSON object; got {type(data).__name__}")
    version = data.get("protocol_version")
    if type(version) is not int or version != TRANSFER_PROTOCOL_VERSION:
        raise DescriptorError(
            f"unsupported transfer protocol version {version!r}; this rank speaks "
            f"{TRANSFER_PROTOCOL_VERSION} (all ranks must run the same fhelium version)"
        )
    kind = data.get("kind")
    model: type[TensorDescriptor] | type[ValueDescriptor]
    if kind == "tensor":
        model = TensorDescriptor
    elif kind == "fhelium_value":
        model = ValueDescriptor
    else:
        raise DescriptorError(
            f"unknown transfer descriptor kind {kind!r}; expected 'tensor' or 'fhelium_value'"
        )
    try:
        descriptor = model.model_validate_json(json.dumps(data))
    except ValidationError as error:
        raise DescriptorError(f"invalid {kind} transfer descriptor: {error}") from None
    for spec in _specs(descriptor):
        spec.check_layout(f"tensor {spec.name!r}" if isinstance(spec, NamedTensorSpec) else "the tensor")
    total = payload_bytes(descriptor)
    if total > MAX_TRANSFER_BYTES:
        raise DescriptorError(
            f"descriptor declares {total} payload bytes, over the {MAX_TRANSFER_BYTES}-byte cap"
        )
    if isinstance(descriptor, ValueDescriptor):
        try:
            validate_value_description(
                schema_version=descriptor.value_schema_version,
                value_type=descriptor.value_type,
                metadata=descriptor.metadata,
                tensor_names=[spec.name for spec in descriptor.tensors],
                tensor_metadata={
                    spec.name: {"shape": spec.shape, "dtype": spec.dtype} for spec in descriptor.tensors
                },
            )
        except ValueError as error:
            raise DescriptorError(f"invalid value description: {error}") from None
    return descriptor


def _specs(descriptor: Descriptor) -> tuple[TensorSpec, ...]:
    if isinstance(descriptor, TensorDescriptor):
        return (descriptor.tensor,)
    return descriptor.tensors


def payload_bytes(descriptor: Descriptor) -> int:
    """Bytes a receiver allocates for one value of this descriptor."""
    return sum(spec.nbytes for spec in _specs(descriptor))


def check_receive_total(total: int, who: str) -> None:
    """Refuse a collective that would make one rank allocate more than ``MAX_RECEIVE_BYTES``."""
    if total > MAX_RECEIVE_BYTES:
        raise DescriptorError(
            f"{who} would allocate {total} bytes in total to receive, over the {MAX_RECEIVE_BYTES}-byte "
            "cap on one collective; send fewer or smaller values per call"
        )


def allocation_device(spec: TensorSpec, local: torch.device) -> torch.device:
    """Where a receiver puts a leaf: CPU stays CPU; CUDA needs (and uses) the rank's CUDA device."""
    if spec.device_type == "cpu":
        return torch.device("cpu")
    if local.type != "cuda":
        raise DescriptorError(
            f"cannot receive a CUDA tensor on a rank whose local device is {local}; the sender's "
            "declared device type is kept, so move the value to CPU before sending or run this rank on CUDA"
        )
    return local


def allocate_leaves(descriptor: Descriptor, local: torch.device) -> tuple[torch.Tensor, ...]:
    """Fresh contiguous receive tensors for every leaf, in payload order."""
    return tuple(
        torch.empty(spec.shape, dtype=_DTYPES[spec.dtype], device=allocation_device(spec, local))
        for spec in _specs(descriptor)
    )


def payload_leaves(value: object) -> tuple[torch.Tensor, ...]:
    """The tensors a value sends, in the order its descriptor lists them."""
    if isinstance(value, torch.Tensor):
        return (value,)
    return tuple(ValueEnvelope.from_value(value).tensors.values())


def rebuild(descriptor: Descriptor, leaves: tuple[torch.Tensor, ...]) -> Any:  # noqa: ANN401  see the docstring
    """The typed value (or raw tensor) around received leaves, through the value schema.

    Its type is known only at run time, from the sender's descriptor; the collectives check it
    against the types their caller accepts.
    """
    if isinstance(descriptor, TensorDescriptor):
        (tensor,) = leaves
        return tensor
    tensors = {spec.name: leaf for spec, leaf in zip(descriptor.tensors, leaves, strict=True)}
    envelope = ValueEnvelope(
        descriptor.value_schema_version, descriptor.value_type, dict(descriptor.metadata), tensors
    )
    return envelope.to_value()


def allocate_value(descriptor: Descriptor, local: torch.device) -> tuple[Any, tuple[torch.Tensor, ...]]:
    """Allocate receive storage and rebuild the value around it; returns (value, leaves)."""
    leaves = allocate_leaves(descriptor, local)
    return rebuild(descriptor, leaves), leaves
