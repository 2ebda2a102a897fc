"""Limb-partition collectives: split one ciphertext's RNS rows across ranks, and join them back.

This is a different mathematics from reduction: each rank holds *different primes* of the
same logical ciphertext, and gather concatenates rows (no addition). Only limb-local
operations (add, pointwise multiply, row-wise NTT) are valid on a shard.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from fhelium.core import Ciphertext
from fhelium.distributed._collective_common import group_info, root_error
from fhelium.distributed._schedule import LimbRangeError, check_adjacent_prime_intervals, validate_limb_ranges
from fhelium.distributed._transfer import Descriptor, DescriptorError, ValueDescriptor
from fhelium.distributed._value_collectives import gather_values, scatter_values

# Metadata that must agree between shards of one logical ciphertext (prime_ids differ by design).
_SHARED_METADATA = ("depth", "scale", "polynomial_domain", "modulus_basis", "residue_representation")


def scatter_ciphertext_limbs(
    value_or_none: Ciphertext | None,
    *,
    limb_ranges: Sequence[tuple[int, int]] | None = None,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
) -> Ciphertext:
    """Give group rank ``i`` the limb rows ``limb_ranges[i]`` of the source ciphertext.

    ``limb_ranges`` index stored rows (not prime ids), one nonempty ``(start, stop)`` per group
    rank, consecutive in group-rank order; lengths may differ and the cover may be partial.
    The source's own result is a storage-sharing view (``slice_limbs``); others receive copies.
    """
    info = group_info(group)
    shards: list[Ciphertext] | None = None
    error: str | None = None
    if root_error(info, "src", src) is None:
        if info.global_rank == src:
            if type(value_or_none) is not Ciphertext or limb_ranges is None:
                error = (
                    f"source rank {src} must supply a Ciphertext and limb_ranges; got "
                    f"{type(value_or_none).__name__} and limb_ranges={limb_ranges!r}"
                )
            else:
                try:
                    ranges = validate_limb_ranges(
                        limb_ranges, limb_count=value_or_none.limb_count, world_size=info.size
                    )
                    shards = [value_or_none.slice_limbs(start, stop) for start, stop in ranges]
                except ValueError as problem:
                    error = str(problem)
        elif value_or_none is not None or limb_ranges is not None:
            error = (
                f"non-source rank {info.global_rank} must supply None for value and limb_ranges; the source "
                "alone chooses the partition"
            )
    return scatter_values(
        shards,
        accepts=(Ciphertext,),
        src=src,
        info=info,
        operation="scatter_ciphertext_limbs",
        refusal=error,
    )


def _check_limb_shards(descriptors: list[Descriptor]) -> None:
    """Shards must describe one logical ciphertext split along the limb axis, in rank order."""
    metas: list[ValueDescriptor] = []
    for group_rank, descriptor in enumerate(descriptors):
        if not isinstance(descriptor, ValueDescriptor) or descriptor.value_type != "Ciphertext":
            raise DescriptorError(f"group rank {group_rank} did not supply a Ciphertext shard")
        metas.append(descriptor)
    first = metas[0]
    first_shape = first.tensors[0].shape
    for group_rank, descriptor in enumerate(metas[1:], start=1):
        mismatches = [
            f"{name}={descriptor.metadata[name]!r} vs {first.metadata[name]!r}"
            for name in _SHARED_METADATA
            if descriptor.metadata[name] != first.metadata[name]
        ]
        spec = descriptor.tensors[0]
        if spec.shape[:-2] != first_shape[:-2]:
            mismatches.append(f"component/batch axes {spec.shape[:-2]} vs {first_shape[:-2]}")
        if spec.shape[-1] != first_shape[-1]:
            mismatches.append(f"ring dimension {spec.shape[-1]} vs {first_shape[-1]}")
        if spec.dtype != first.tensors[0].dtype or spec.device_type != first.tensors[0].device_type:
            mismatches.append(
                f"dtype/device type {spec.dtype}/{spec.device_type} vs "
                f"{first.tensors[0].dtype}/{first.tensors[0].device_type}"
            )
        if mismatches:
            raise DescriptorError(
                f"limb shards describe different logical ciphertexts: group rank {group_rank} differs "
                f"from group rank 0 in {', '.join(mismatches)}"
            )
    try:
        check_adjacent_prime_intervals([list(d.metadata["prime_ids"]) for d in metas])
    except LimbRangeError as error:
        raise DescriptorError(str(error)) from None


def gather_ciphertext_limbs(
    local_shard: Ciphertext, *, dst: int = 0, group: dist.ProcessGroup | None = None
) -> Ciphertext | None:
    """Concatenate every rank's limb shard, in group-rank order, into one ciphertext on ``dst``.

    Requires equal depth, scale, domain, basis, residue form, component and batch axes, and
    adjacent prime intervals; checked on every rank before any payload moves. No addition.
    """
    shards = gather_values(
        local_shard,
        accepts=(Ciphertext,),
        dst=dst,
        info=group_info(group),
        operation="gather_ciphertext_limbs",
        layout_check=_check_limb_shards,
    )
    if shards is None:
        return None
    if len(shards) == 1:
        only: Ciphertext = shards[0]
        return only
    first = shards[0]
    prime_ids = tuple(prime for shard in shards for prime in shard.prime_ids)
    data = torch.cat([shard.data for shard in shards], dim=-2)
    return Ciphertext(
        data,
        first.depth,
        first.scale,
        prime_ids,
        first.polynomial_domain,
        first.modulus_basis,
        first.residue_representation,
    )
