"""Distributed Compile passes."""

from __future__ import annotations

from fhelium.compile.passes.distributed._collective_uniformity import CheckCollectiveUniformityPass
from fhelium.compile.passes.distributed._lower_specialized_collectives import (
    LowerSpecializedCollectivesPass,
    generic_add_all_reduce,
)

__all__ = ["CheckCollectiveUniformityPass", "LowerSpecializedCollectivesPass", "generic_add_all_reduce"]
