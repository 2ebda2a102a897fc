"""fhelium IR: xDSL dialects for rank-local distributed CKKS Programs.

A Program describes what ONE rank does; it reads its group rank at launch. See docs/fhelium-ir.md.
"""

from __future__ import annotations

from fhelium.ir._catalog import (
    EXECUTION_IMPLEMENTATION_ATTRIBUTE,
    REGISTERED_DIALECTS,
    UPSTREAM_DIALECTS,
    create_dialect_context,
    is_terminator,
    operation_name,
    registered_dialect_names,
)
from fhelium.ir._program import Program, ProgramError
from fhelium.ir.dialects._common import OpenStateType

__all__ = [
    "EXECUTION_IMPLEMENTATION_ATTRIBUTE",
    "REGISTERED_DIALECTS",
    "UPSTREAM_DIALECTS",
    "OpenStateType",
    "Program",
    "ProgramError",
    "create_dialect_context",
    "is_terminator",
    "operation_name",
    "registered_dialect_names",
]
