"""The Pass base (an xDSL ModulePass with stats), results, and the pipeline over a cloned Program."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Self, get_type_hints

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass

from fhelium.ir import Program, ProgramError


class PassError(ValueError):
    """A pass refused the Program or produced an invalid one."""


@dataclass(frozen=True)
class PassStats:
    """What a pass saw and did; `transformed + skipped <= matched` always holds."""

    matched: int = 0
    transformed: int = 0
    inserted: int = 0
    removed: int = 0
    skipped: int = 0

    def __post_init__(self) -> None:
        if self.transformed + self.skipped > self.matched:
            raise PassError(
                f"invalid PassStats: transformed ({self.transformed}) + skipped ({self.skipped}) "
                f"exceeds matched ({self.matched})"
            )


@dataclass(frozen=True)
class Diagnostic:
    """A finding about one operation. `severity` is "error", "warning" or "note"."""

    severity: str
    message: str
    operation: str = ""

    def __str__(self) -> str:
        where = f" [{self.operation}]" if self.operation else ""
        return f"{self.severity}: {self.message}{where}"


@dataclass(frozen=True)
class PassResult:
    program: Program
    stats: PassStats = field(default_factory=PassStats)
    diagnostics: tuple[Diagnostic, ...] = ()

    @property
    def errors(self) -> tuple[Diagnostic, ...]:
        return tuple(d for d in self.diagnostics if d.severity == "error")


@dataclass(frozen=True)
class Pass(ModulePass):
    """A Program transformation or analysis: an xDSL `ModulePass` that also reports what it did.

    Subclasses are frozen dataclasses that spell their name once (`name = "my-pass"`, a ClassVar)
    and declare their options as fields, as xDSL passes do; `run` may mutate `program` in place and
    returns it with stats and diagnostics. `apply` makes every fhelium pass usable in an xDSL
    `PassPipeline` as well: there an error diagnostic raises `PassError`.
    """

    name: ClassVar[str]

    @abstractmethod
    def run(self, program: Program) -> PassResult: ...

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        result = self.run(Program(op, verify=False))
        if result.program.module is not op:
            raise PassError(f"pass {self.name!r} must rewrite the module in place to run as an xDSL pass")
        if result.errors:
            raise PassError(f"pass {self.name!r}: " + "; ".join(str(error) for error in result.errors))

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> Self:
        """Build from `key=value` strings (the command line); keys are the dataclass's fields.

        A field typed `bool` takes true/false (also 1/0, yes/no), `int` a decimal, `str` the text.
        A pass whose options are not fixed fields (assign-implementations) overrides this.
        """
        known = {f.name: f for f in fields(cls) if f.init}
        unknown = sorted(set(options) - set(known))
        if unknown:
            allowed = ", ".join(known) or "none"
            raise PassError(f"pass {cls.name!r} has no option(s) {', '.join(unknown)}; allowed: {allowed}")
        hints = get_type_hints(cls)
        values: dict[str, Any] = {}
        for key, raw in options.items():
            kind = hints[key]
            if kind is bool:
                values[key] = _parse_bool(cls.name, key, raw)
            elif kind is int:
                try:
                    values[key] = int(raw)
                except ValueError:
                    raise PassError(f"pass {cls.name!r} option {key}={raw!r} must be an integer") from None
            elif kind is str:
                values[key] = raw
            else:
                raise PassError(f"pass {cls.name!r} option {key} cannot be given on the command line")
        return cls(**values)


def _parse_bool(pass_name: str, key: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise PassError(f"pass {pass_name!r} option {key}={value!r} must be true or false")


class Pipeline:
    """Runs passes in order on one clone of the input, verifying after every pass."""

    def __init__(self, passes: Sequence[Pass]) -> None:
        self.passes = tuple(passes)

    def run(self, program: Program) -> tuple[Program, tuple[PassResult, ...]]:
        current = program.clone()
        results: list[PassResult] = []
        for each in self.passes:
            result = each.run(current)
            try:
                result.program.verify()
            except ProgramError as error:
                raise PassError(f"pass {each.name!r} produced an invalid Program: {error}") from error
            results.append(result)
            current = result.program
        return current, tuple(results)
