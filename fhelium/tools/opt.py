"""fhelium-opt: parse a `.mlir` Program, run named passes, print the result (in the style of xdsl-opt).

    python -m fhelium.tools.opt examples/ir_allreduce.mlir -p lower-specialized-collectives
    PASSES='check-collective-uniformity,lower-specialized-collectives{lower_ciphertext_add=false}'
    python -m fhelium.tools.opt in.mlir -p "$PASSES"

Diagnostics go to stderr; any error diagnostic makes the exit status 1. Exit status 2 means the
input or the pass list was invalid.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from fhelium.compile import Pass, PassError, Pipeline, create_pass, pass_names
from fhelium.ir import Program, ProgramError

_PASS_SPEC = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*(?:\{([^}]*)\})?\s*(?:,|$)")


def parse_pipeline(spec: str) -> list[Pass]:
    """`a,b{key=value key2=value2}` -> passes. Options are space- or comma-free `key=value` pairs."""
    passes: list[Pass] = []
    position = 0
    spec = spec.strip()
    while position < len(spec):
        match = _PASS_SPEC.match(spec, position)
        if match is None or match.end() == position:
            raise PassError(f"cannot parse pass pipeline at character {position}: {spec[position:]!r}")
        name, raw_options = match.group(1), match.group(2) or ""
        options: dict[str, str] = {}
        for item in raw_options.split():
            key, equals, value = item.partition("=")
            if not equals or not key:
                raise PassError(f"pass {name!r} option {item!r} must look like key=value")
            options[key] = value
        passes.append(create_pass(name, options))
        position = match.end()
    return passes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fhelium-opt", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("input", nargs="?", default="-", help="input .mlir file ('-' for stdin)")
    parser.add_argument("-p", "--passes", default="", help="comma-separated pass pipeline")
    parser.add_argument("-o", "--output", default="-", help="output file ('-' for stdout)")
    parser.add_argument("--print-op-generic", action="store_true", help="print generic operation syntax")
    parser.add_argument("--list-passes", action="store_true", help="print the registered pass names and exit")
    args = parser.parse_args(argv)

    if args.list_passes:
        print("\n".join(pass_names()))
        return 0
    try:
        if args.input == "-":
            program = Program.parse(sys.stdin.read(), source_name="<stdin>")
        else:
            program = Program.load(args.input)
        passes = parse_pipeline(args.passes)
        result, reports = Pipeline(passes).run(program)
    except (ProgramError, PassError, OSError) as error:
        print(f"fhelium-opt: error: {error}", file=sys.stderr)
        return 2
    failed = False
    for each, report in zip(passes, reports, strict=True):
        for diagnostic in report.diagnostics:
            print(f"{each.name}: {diagnostic}", file=sys.stderr)
            failed = failed or diagnostic.severity == "error"
    text = result.to_text(generic=args.print_op_generic)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text, encoding="utf-8")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
