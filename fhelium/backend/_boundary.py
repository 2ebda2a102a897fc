"""Program-boundary adapters: public fhelium values <-> tensor leaves.

Inside a Program every ciphertext, plaintext or key is just its tensor payload. At the entry the
declared type state is checked against the value, and at the exit values are rebuilt from the result
type state, borrowing what the state does not say (scale, prime ids) from an input of the same type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from xdsl.dialects.builtin import FloatAttr, IndexType, IntegerType
from xdsl.ir import Attribute

from fhelium.backend.resources import BoundResource
from fhelium.core import Ciphertext, DenseKey, Plaintext
from fhelium.ir import OpenStateType
from fhelium.ir.dialects.ckks import CiphertextType, PlaintextType


class BoundaryError(TypeError):
    """An entry argument or result does not match the Program's declared type."""


def _check_state(position: str, declared: OpenStateType, value: Ciphertext | Plaintext) -> None:
    checks: list[tuple[str, Any, Any]] = [
        ("depth", declared.state_int("depth"), value.depth),
        ("basis", declared.state_str("basis"), value.modulus_basis),
        ("domain", declared.state_str("domain"), value.polynomial_domain),
    ]
    prime_ids = declared.state_ints("prime_ids")
    checks.append(("prime_ids", prime_ids, tuple(value.prime_ids)))
    if isinstance(value, Ciphertext):
        checks.append(("components", declared.state_int("components"), value.component_count))
    for key, expected, actual in checks:
        if expected is not None and expected != actual:
            raise BoundaryError(f"{position}: declared {key} = {expected!r} but the value has {actual!r}")


def to_payload(position: str, declared: Attribute, value: object) -> object:
    """Decompose one entry argument into what the interpreter carries (tensor, scalar, resource)."""
    if isinstance(value, BoundResource):
        return value
    if isinstance(declared, CiphertextType):
        if not isinstance(value, Ciphertext):
            raise BoundaryError(
                f"{position}: expected a Ciphertext for {declared}, got {type(value).__name__}"
            )
        _check_state(position, declared, value)
        return value.data
    if isinstance(declared, PlaintextType):
        if not isinstance(value, Plaintext):
            raise BoundaryError(
                f"{position}: expected a Plaintext for {declared}, got {type(value).__name__}"
            )
        _check_state(position, declared, value)
        payload = value.data if value.data is not None else value.message
        return payload
    if isinstance(value, DenseKey):
        return value.data
    if isinstance(declared, IndexType | IntegerType):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return int(value.item())
        if not isinstance(value, int):
            raise BoundaryError(f"{position}: expected an integer for {declared}, got {type(value).__name__}")
        return value
    if isinstance(value, torch.Tensor | int | float | bool):
        return value
    raise BoundaryError(f"{position}: cannot pass a {type(value).__name__} into a Program")


def _template(declared: Attribute, inputs: Sequence[tuple[Attribute, object]], kind: type) -> object:
    for input_type, value in inputs:
        if isinstance(value, kind) and input_type == declared:
            return value
    for _, value in inputs:
        if isinstance(value, kind):
            return value
    return None


def _state_scale(declared: OpenStateType) -> float | None:
    scale = declared.state_value("scale")
    if isinstance(scale, FloatAttr):
        return float(scale.value.data)
    if scale is None:
        return None
    return float(declared.state_int("scale") or 0)


def from_payload(
    position: str, declared: Attribute, payload: object, inputs: Sequence[tuple[Attribute, object]]
) -> object:
    """Rebuild a public value for one result from its payload and declared type."""
    if isinstance(declared, CiphertextType):
        if not isinstance(payload, torch.Tensor):
            raise BoundaryError(
                f"{position}: a ciphertext result must be a tensor, got {type(payload).__name__}"
            )
        template = _template(declared, inputs, Ciphertext)
        scale = _state_scale(declared)
        prime_ids = declared.state_ints("prime_ids")
        if template is None and (scale is None or prime_ids is None):
            raise BoundaryError(
                f"{position}: cannot rebuild a Ciphertext for {declared}: no Ciphertext input to borrow "
                "scale/prime_ids from; declare scale and prime_ids in the type state"
            )
        depth = declared.state_int("depth")
        fields: dict[str, Any] = {}
        if template is not None:
            fields = {f.name: getattr(template, f.name) for f in dataclasses.fields(Ciphertext)}
        fields["data"] = payload
        if depth is not None:
            fields["depth"] = depth
        if scale is not None:
            fields["scale"] = scale
        if prime_ids is not None:
            fields["prime_ids"] = prime_ids
        basis = declared.state_str("basis")
        if basis is not None:
            fields["modulus_basis"] = basis
        domain = declared.state_str("domain")
        if domain is not None:
            fields["polynomial_domain"] = domain
        return Ciphertext(**fields)
    if isinstance(declared, IndexType | IntegerType) and isinstance(payload, torch.Tensor):
        return int(payload.item())
    return payload
