"""Pass protocol, results, and the pipeline that runs passes over a cloned Program."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

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


@runtime_checkable
class Pass(Protocol):
    """A Program transformation or analysis. It may mutate `program` in place and return it."""

    @property
    def name(self) -> str: ...

    def run(self, program: Program) -> PassResult: ...


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


#: Passes known by name to the command-line tool; factories take `key=value` options as strings.
PassFactory = Callable[[dict[str, str]], Pass]
_PASS_FACTORIES: dict[str, PassFactory] = {}


def register_pass(name: str, factory: PassFactory) -> None:
    if name in _PASS_FACTORIES:
        raise ValueError(f"pass {name!r} is already registered")
    _PASS_FACTORIES[name] = factory


def pass_names() -> tuple[str, ...]:
    import fhelium.compile.passes  # noqa: F401  (registers the built-in passes)

    return tuple(sorted(_PASS_FACTORIES))


def create_pass(name: str, options: dict[str, str] | None = None) -> Pass:
    """Build a registered pass by name, e.g. `create_pass("lower-specialized-collectives")`."""
    import fhelium.compile.passes  # noqa: F401  (registers the built-in passes)

    try:
        factory = _PASS_FACTORIES[name]
    except KeyError:
        known = ", ".join(sorted(_PASS_FACTORIES))
        raise PassError(f"unknown pass {name!r}; known passes: {known}") from None
    return factory(options or {})


def parse_bool_option(pass_name: str, key: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise PassError(f"pass {pass_name!r} option {key}={value!r} must be true or false")


def reject_unknown_options(pass_name: str, options: dict[str, str], known: Sequence[str]) -> None:
    unknown = sorted(set(options) - set(known))
    if unknown:
        allowed = ", ".join(known) or "none"
        raise PassError(f"pass {pass_name!r} has no option(s) {', '.join(unknown)}; allowed: {allowed}")
