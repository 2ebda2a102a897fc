"""Built-in Compile passes (importing this package registers them by name)."""

from __future__ import annotations

from fhelium.compile.passes._assign_implementations import AssignImplementationsPass
from fhelium.compile.passes._expand_ckks_subtract import ExpandCiphertextSubtractPass
from fhelium.compile.passes._operation_transforms import (
    KNOWN_REGION_OWNERS,
    program_operations,
    program_operations_and_known_region_owners,
)
from fhelium.compile.passes.distributed import (
    CheckCollectiveUniformityPass,
    LowerSpecializedCollectivesPass,
)

__all__ = [
    "KNOWN_REGION_OWNERS",
    "AssignImplementationsPass",
    "CheckCollectiveUniformityPass",
    "ExpandCiphertextSubtractPass",
    "LowerSpecializedCollectivesPass",
    "program_operations",
    "program_operations_and_known_region_owners",
]
