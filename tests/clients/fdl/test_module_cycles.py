"""The fdl client's modules import one another without a cycle (function-level imports included).

A cycle makes import order matter and hides where a helper belongs: `fdl.join` once took its
PROGRAM parsing from `fdl.run`, which imported `fdl.join` back inside a function; both now take it
from `fdl.progargs`.
"""

from __future__ import annotations

import ast
from pathlib import Path

CLIENT = Path(__file__).resolve().parents[3] / "clients" / "fdl"


def module_of(path: Path) -> str:
    return "fdl" if path.name == "__init__.py" else f"fdl.{path.stem}"


def imports_between_fdl_modules(source: str) -> set[str]:
    """The fdl modules `source` imports, at any depth: `import fdl.x`, `from fdl.x import y`,
    `from fdl import x` (x a module).
    """
    modules = {module_of(path) for path in CLIENT.glob("*.py")}
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.module.startswith("fdl"):
            if node.module in modules and node.module != "fdl":
                found.add(node.module)
            found |= {f"fdl.{alias.name}" for alias in node.names if f"fdl.{alias.name}" in modules}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first walk, each as the path that closes it."""
    found: list[list[str]] = []
    done: set[str] = set()

    def walk(module: str, path: list[str]) -> None:
        for target in sorted(graph.get(module, ())):
            if target in path:
                found.append([*path[path.index(target) :], target])
            elif target not in done:
                walk(target, [*path, target])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            walk(module, [module])
    return found


def test_the_fdl_modules_import_one_another_without_a_cycle() -> None:
    graph = {
        module_of(path): imports_between_fdl_modules(path.read_text()) - {module_of(path)}
        for path in sorted(CLIENT.glob("*.py"))
    }
    assert "fdl.progargs" in graph["fdl.join"] and "fdl.progargs" in graph["fdl.run"]
    assert not cycles(graph), (
        f"import cycles among the fdl modules (move the shared piece down): {cycles(graph)}"
    )


def test_the_checker_sees_a_cycle_through_a_function_level_import() -> None:
    run = "from fdl.progargs import reparse\ndef walk_in():\n    from fdl import join\n"
    join = "from fdl.run import reparse\n"
    graph = {"fdl.run": imports_between_fdl_modules(run), "fdl.join": imports_between_fdl_modules(join)}
    assert graph == {"fdl.run": {"fdl.progargs", "fdl.join"}, "fdl.join": {"fdl.run"}}
    assert cycles(graph) == [["fdl.join", "fdl.run", "fdl.join"]]
