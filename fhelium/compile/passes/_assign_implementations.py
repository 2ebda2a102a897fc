"""Record which Backend implementation executes each operation, as an IR attribute.

The assignment is a hard constraint for the Backend. Operations that already carry one keep it, and
operations inside opaque region owners are never touched.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Self

from xdsl.dialects.builtin import StringAttr

from fhelium.compile._pipeline import Pass, PassResult, PassStats
from fhelium.compile.passes._operation_transforms import program_operations
from fhelium.ir import EXECUTION_IMPLEMENTATION_ATTRIBUTE, Program


@dataclass(frozen=True)
class AssignImplementationsPass(Pass):
    """Set `fhelium.execution.implementation` from an operation-name -> implementation-name map."""

    name: ClassVar[str] = "assign-implementations"

    assignments: Mapping[str, str] = field(default_factory=dict[str, str])

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> Self:
        # Every option is an assignment: assign-implementations{fhelium_ckks.add=torch-rns-add}
        return cls(assignments=dict(options))

    def run(self, program: Program) -> PassResult:
        matched = transformed = skipped = 0
        for op in program_operations(program):
            implementation = self.assignments.get(op.name)
            if implementation is None:
                continue
            matched += 1
            if EXECUTION_IMPLEMENTATION_ATTRIBUTE in op.attributes:
                skipped += 1
                continue
            op.attributes[EXECUTION_IMPLEMENTATION_ATTRIBUTE] = StringAttr(implementation)
            transformed += 1
        return PassResult(program, PassStats(matched=matched, transformed=transformed, skipped=skipped))
