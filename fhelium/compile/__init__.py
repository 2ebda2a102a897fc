"""fhelium Compile: passes over rank-local Programs. See docs/fhelium-passes.md."""

from __future__ import annotations

from fhelium.compile._pipeline import (
    Diagnostic,
    Pass,
    PassError,
    PassResult,
    PassStats,
    Pipeline,
)
from fhelium.compile._registry import create_pass, pass_names, register_pass

__all__ = [
    "Diagnostic",
    "Pass",
    "PassError",
    "PassResult",
    "PassStats",
    "Pipeline",
    "create_pass",
    "pass_names",
    "register_pass",
]
