"""`Program`: one rank's module, with parsing, printing, verification and traversal helpers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from xdsl.dialects.builtin import ModuleOp
from xdsl.dialects.func import FuncOp
from xdsl.ir import Block, Operation
from xdsl.parser import Parser
from xdsl.printer import Printer
from xdsl.utils.exceptions import ParseError, VerifyException

from fhelium.ir._catalog import create_dialect_context, operation_name


def _first_unverified(module: ModuleOp) -> str | None:
    """The name of the first operation, in pre-order, that fails its own (non-nested) checks."""
    for op in module.walk():
        try:
            op.verify(verify_nested_ops=False)
        except VerifyException:
            return operation_name(op)
    return None


class ProgramError(ValueError):
    """A Program could not be parsed, verified, or does not have the requested shape."""


class Program:
    """A module holding the functions one rank executes. Verified on construction."""

    def __init__(self, module: ModuleOp, *, verify: bool = True) -> None:
        if not isinstance(module, ModuleOp):
            raise ProgramError(f"Program needs a builtin.module, got {type(module).__name__}")
        self.module = module
        if verify:
            self.verify()

    @classmethod
    def parse(cls, text: str, *, source_name: str = "<program>") -> Program:
        """Parse textual IR (generic or custom syntax) into a verified Program."""
        try:
            module = Parser(create_dialect_context(), text, source_name).parse_module()
        except ParseError as error:
            raise ProgramError(f"{source_name}: cannot parse IR: {error}") from error
        return cls(module)

    @classmethod
    def load(cls, path: str | Path) -> Program:
        path = Path(path)
        return cls.parse(path.read_text(encoding="utf-8"), source_name=str(path))

    def to_text(self, *, generic: bool = False) -> str:
        """Print the module; `Program.parse(p.to_text()).to_text() == p.to_text()` always holds."""
        from io import StringIO

        stream = StringIO()
        Printer(stream=stream, print_generic_format=generic).print_op(self.module)
        return stream.getvalue() + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_text(), encoding="utf-8")

    def verify(self) -> None:
        """Structural verification only (operand/result/attribute/region shapes).

        The error names the first operation (in pre-order) that does not verify, since xDSL's
        constraint messages ("attribute ... expected from variable 'T'") do not.
        """
        try:
            self.module.verify()
        except VerifyException as error:
            where = _first_unverified(self.module)
            prefix = f"{where}: " if where and not str(error).startswith(where) else ""
            raise ProgramError(f"Program verification failed: {prefix}{error}") from error

    def clone(self) -> Program:
        return Program(self.module.clone(), verify=False)

    def walk(self) -> Iterator[Operation]:
        """Every operation, nested ones included, in pre-order."""
        return self.module.walk()

    def functions(self) -> dict[str, FuncOp]:
        return {op.sym_name.data: op for op in self.module.ops if isinstance(op, FuncOp)}

    def function(self, name: str | None = None) -> FuncOp:
        """The function called `name`; without a name, the only function (or `main`)."""
        functions = self.functions()
        if name is None:
            if len(functions) == 1:
                return next(iter(functions.values()))
            name = "main"
        try:
            return functions[name]
        except KeyError:
            known = ", ".join(sorted(functions)) or "none"
            raise ProgramError(f"Program has no function @{name}; functions: {known}") from None

    def single_block(self, name: str | None = None) -> Block:
        """The body block of a function; arbitrary control-flow graphs are not supported."""
        function = self.function(name)
        blocks = list(function.body.blocks)
        if len(blocks) != 1:
            raise ProgramError(
                f"function @{function.sym_name.data} must have exactly one block, got {len(blocks)}; "
                "use scf.for/scf.if for control flow"
            )
        return blocks[0]
