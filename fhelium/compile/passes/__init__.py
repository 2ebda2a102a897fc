"""Built-in Compile passes. A new one is a `Pass` subclass in its own module, listed in BUILTIN_PASSES."""

from __future__ import annotations

from fhelium.compile._pipeline import Pass
from fhelium.compile.passes._assign_implementations import AssignImplementationsPass
from fhelium.compile.passes._expand_ckks_subtract import ExpandCiphertextSubtractPass
from fhelium.compile.passes._operation_transforms import (
    KNOWN_REGION_OWNERS,
    is_traversed,
    program_operations,
    program_operations_and_known_region_owners,
)
from fhelium.compile.passes.distributed import (
    CheckCollectiveUniformityPass,
    LowerSpecializedCollectivesPass,
)

#: The passes fhelium-opt and `create_pass` know by name (`register_pass` adds one at run time).
BUILTIN_PASSES: tuple[type[Pass], ...] = (
    AssignImplementationsPass,
    CheckCollectiveUniformityPass,
    ExpandCiphertextSubtractPass,
    LowerSpecializedCollectivesPass,
)

__all__ = [
    "BUILTIN_PASSES",
    "KNOWN_REGION_OWNERS",
    "AssignImplementationsPass",
    "CheckCollectiveUniformityPass",
    "ExpandCiphertextSubtractPass",
    "LowerSpecializedCollectivesPass",
    "is_traversed",
    "program_operations",
    "program_operations_and_known_region_owners",
]
