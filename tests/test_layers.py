"""The layer table of docs/architecture.md, enforced on the source.

Three rules, each checked on every import of every product module (function-level and
TYPE_CHECKING imports included, and module names written as strings for `importlib`, e.g. a
registry that loads `fhelium.multiparty.values` by name):

1. **Sans-io cores stay pure.** The modules in `SANS_IO` import none of `FORBIDDEN_IN_SANS_IO`
   (sockets, event loops, threads, clocks, processes), neither themselves nor through any module of
   ours they import, at any depth. Time is an argument; bytes come in and go out as values.
2. **flodld and fhelium stay apart.** No module of one imports the other, and neither imports the
   bridge (`flodld_fhelium`, the one package that imports both: the relay-backed group, the Backend
   implementation that sums ciphertexts through the relays, the share channel). Outside the packages,
   in `bench/` and `clients/`, a script that needs both takes one of them through the bridge; only
   rank programs (`examples/`, a user's training script) import both directly, as any user may.
3. **Imports point down.** Each area (a top-level subpackage such as `flodld.controller`) sits in one
   layer of `LAYERS`; it may import its own area and areas of lower layers only. The few edges that go
   sideways or up on purpose are in `ALLOWED_EDGES`, each with its reason, and a test checks that each
   is still used (a stale exception would let the next violation of its shape in unseen).

A failure names the rule, the importing file and line, and what to do.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flodld", "fhelium")
BRIDGE = "flodld_fhelium"  # the one package that imports both (rule 2)
SCRIPTS = ("bench", "clients")  # outside the packages: they import both only through the bridge

# Rule 1: modules (or packages: every module under them) that do no I/O and read no clock.
SANS_IO = (
    "flodld.wire",
    "flodld.membership",
    "flodld.fold",
    "flodld.config",
    "flodld.agent.supervision",
    "flodld.controller.roundledger",
    "flodld.controller.status.summary",  # and the row wordings it uses: `fdl status` loads them
    "flodld.controller.status.wording",
    "flodld.fanout.sshd_recipe",
    "fhelium.distributed._schedule",
)
FORBIDDEN_IN_SANS_IO = ("asyncio", "socket", "selectors", "threading", "time", "subprocess", "uvloop")

# Rule 3: layers from the top down; an area may import areas of the layers below its own.
LAYERS: tuple[tuple[str, ...], ...] = (
    # the public faces: the package roots re-export, `python -m flodld` starts the daemon
    ("flodld_fhelium",),  # the bridge: above both packages, which never import it (rule 2)
    ("flodld", "flodld.__main__", "flodld.api", "fhelium", "fhelium.tools"),
    ("flodld.fanout",),  # SSH fan-out drives agents (and, for cluster_run, the controller)
    ("flodld.launcher",),  # dispatches the worker roles by environment
    ("flodld.controller", "flodld.agent", "flodld.probe"),  # shells
    ("flodld.relay", "flodld.rank"),  # worker shells the agent spawns and configures
    ("flodld.net", "flodld.membership", "flodld.fold"),  # socket adapters; sans-io cores
    ("flodld.config",),
    ("flodld.wire",),  # frames and messages: imports nothing of flodld
    ("fhelium.multiparty",),
    ("fhelium.backend",),
    ("fhelium.compile",),
    ("fhelium.distributed", "fhelium.ir"),
    ("fhelium.serialization",),
    ("fhelium.engine",),
    ("fhelium.native",),
    ("fhelium.core",),
)

# (importing area, imported area) -> why this edge may go sideways or up.
ALLOWED_EDGES: dict[tuple[str, str], str] = {
    ("flodld.agent", "flodld.launcher"): (
        "the agent starts its relay and ranks as `python -m flodld.launcher[.rank]` processes: module names "
        "in a command line (flodld/agent/spawn.py), which this test reads as it reads importlib strings; "
        "nothing of the launcher is imported"
    ),
}


@dataclass(frozen=True)
class Edge:
    file: str
    line: int
    source: str  # the importing module
    target: str  # the imported module (a submodule when the imported name is one)
    by_name: bool = False  # written as a string for importlib


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


@cache
def own_modules() -> dict[str, Path]:
    return {
        module_name(path): path
        for package in (*PACKAGES, BRIDGE)
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def resolve(module: str, name: str | None) -> str:
    """`from a.b import c`: `a.b.c` when that is a module of ours, else `a.b`."""
    if name is not None and f"{module}.{name}" in own_modules():
        return f"{module}.{name}"
    return module


MODULE_STRING = re.compile(r"(?:flodld_fhelium|flodld|fhelium)(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def edges_of(path: Path, text: str | None = None) -> Iterator[Edge]:
    """Every import in the file at any depth, relative ones made absolute.

    Plus module names written as string constants that name one of our modules (importlib tables).
    """
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    rel = str(path.relative_to(ROOT))
    source = path.read_text() if text is None else text
    for node in ast.walk(ast.parse(source, filename=rel)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Edge(rel, node.lineno, me, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            for alias in node.names:
                yield Edge(rel, node.lineno, me, resolve(module, alias.name))
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and MODULE_STRING.fullmatch(node.value)
            and node.value in own_modules()
            and node.value != me
        ):
            yield Edge(rel, node.lineno, me, node.value, by_name=True)


@cache
def all_edges() -> tuple[Edge, ...]:
    return tuple(edge for path in own_modules().values() for edge in edges_of(path))


def area(module: str) -> str:
    """`flodld.controller.run` -> `flodld.controller`; a package root or third-party module -> itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] in PACKAGES and len(parts) > 1 else parts[0]


def layer_of(area_name: str) -> int:
    for index, layer in enumerate(LAYERS):
        if area_name in layer:
            return index
    raise AssertionError(
        f"area {area_name} is in no layer of tests/test_layers.py LAYERS: place it in the layer table "
        "(and in docs/architecture.md's map)"
    )


def describe(edge: Edge) -> str:
    how = f"names {edge.target!r} for importlib" if edge.by_name else f"imports {edge.target}"
    return f"{edge.file}:{edge.line}: {edge.source} {how}"


# --- rule 1 -------------------------------------------------------------------------------------


def is_sans_io(module: str) -> bool:
    return any(module == core or module.startswith(core + ".") for core in SANS_IO)


def forbidden_reached(start: str, edges: tuple[Edge, ...]) -> list[tuple[list[str], Edge]]:
    """Each forbidden module reachable from `start` through our own modules, with the path to it."""
    by_source: dict[str, list[Edge]] = {}
    for edge in edges:
        by_source.setdefault(edge.source, []).append(edge)
    known = set(own_modules()) | set(by_source)
    found: list[tuple[list[str], Edge]] = []
    seen = {start}
    stack: list[tuple[str, list[str]]] = [(start, [start])]
    while stack:
        module, path = stack.pop()
        for edge in by_source.get(module, ()):
            if edge.target.split(".")[0] in FORBIDDEN_IN_SANS_IO:
                found.append((path, edge))
            # follow our own modules, and the subpackage __init__ files an import runs on the way
            parts = edge.target.split(".")
            for depth in range(2, len(parts) + 1):
                inner = ".".join(parts[:depth])
                if inner in known and inner not in seen:
                    seen.add(inner)
                    stack.append((inner, [*path, inner]))
    return found


def sans_io_violations(edges: tuple[Edge, ...]) -> list[str]:
    wrong = []
    for module in sorted(set(own_modules()) | {edge.source for edge in edges}):
        if not is_sans_io(module):
            continue
        for path, edge in forbidden_reached(module, edges):
            via = f" (reached through {' -> '.join(path)})" if len(path) > 1 else ""
            wrong.append(f"{describe(edge)}{via}")
    return sorted(set(wrong))


def test_sans_io_cores_import_no_sockets_loops_threads_clocks_or_processes() -> None:
    wrong = sans_io_violations(all_edges())
    assert not wrong, (
        "rule 1 (sans-io cores stay pure, docs/architecture.md): these sans-io modules reach "
        f"{', '.join(FORBIDDEN_IN_SANS_IO)}; move the I/O into a shell (flodld/net, the controller, "
        "agent, relay or rank) and pass time and bytes in as arguments:\n" + "\n".join(wrong)
    )


# --- rule 2 -------------------------------------------------------------------------------------


def package_of(module: str) -> str:
    return module.split(".")[0]


def cross_package_imports(edges: tuple[Edge, ...]) -> list[str]:
    """Each import of fhelium by flodld or of flodld by fhelium, and of the bridge by either."""
    return [
        describe(edge)
        for edge in edges
        if package_of(edge.source) in PACKAGES
        and package_of(edge.target) in (*PACKAGES, BRIDGE)
        and package_of(edge.target) != package_of(edge.source)
    ]


def test_flodld_and_fhelium_never_import_each_other() -> None:
    wrong = cross_package_imports(all_edges())
    assert not wrong, (
        "rule 2 (flodld and fhelium stay apart, docs/architecture.md): they meet only in a rank program "
        f"or the bridge ({BRIDGE}/) outside both packages, and neither imports the bridge; move the code "
        f"that needs both into {BRIDGE}:\n" + "\n".join(wrong)
    )


def script_edges() -> tuple[Edge, ...]:
    """The imports of every file under SCRIPTS (their module names are paths, e.g. `bench.relay`)."""
    return tuple(
        edge for top in SCRIPTS for path in sorted((ROOT / top).rglob("*.py")) for edge in edges_of(path)
    )


def scripts_importing_both(edges: tuple[Edge, ...]) -> list[str]:
    """Each file outside the packages that imports both flodld and fhelium directly."""
    reached: dict[str, set[str]] = {}
    for edge in edges:
        if package_of(edge.source) not in (*PACKAGES, BRIDGE) and package_of(edge.target) in PACKAGES:
            reached.setdefault(edge.file, set()).add(package_of(edge.target))
    return sorted(file for file, packages in reached.items() if packages == set(PACKAGES))


def test_only_the_bridge_imports_both_packages() -> None:
    assert BRIDGE in {package_of(edge.source) for edge in all_edges()}
    both_in_bridge = {
        package_of(edge.target) for edge in all_edges() if package_of(edge.source) == BRIDGE
    } & set(PACKAGES)
    assert both_in_bridge == set(PACKAGES), both_in_bridge
    wrong = scripts_importing_both(script_edges())
    assert not wrong, (
        f"rule 2: outside the packages, only the bridge ({BRIDGE}) imports both flodld and fhelium; "
        f"these files in {', '.join(SCRIPTS)} import both directly: take what needs both from "
        f"{BRIDGE} (or move it there):\n" + "\n".join(wrong)
    )


# --- rule 3 -------------------------------------------------------------------------------------


def upward_edges(edges: tuple[Edge, ...]) -> list[Edge]:
    wrong = []
    for edge in edges:
        package = edge.target.split(".")[0]
        if package not in PACKAGES or package != edge.source.split(".")[0]:
            continue  # third-party, or rule 2's business
        source, target = area(edge.source), area(edge.target)
        if source == target:
            continue
        if layer_of(target) <= layer_of(source):
            wrong.append(edge)
    return wrong


def test_imports_point_down_the_layer_table() -> None:
    wrong = [
        describe(edge)
        for edge in upward_edges(all_edges())
        if (area(edge.source), area(edge.target)) not in ALLOWED_EDGES
    ]
    assert not wrong, (
        "rule 3 (imports point down the layer table of tests/test_layers.py / docs/architecture.md): "
        "these imports go sideways or up; move the shared piece down to a layer both can import, or, "
        "if the edge is right, add it to ALLOWED_EDGES with its reason:\n" + "\n".join(wrong)
    )


def test_every_allowed_edge_is_still_used() -> None:
    used = {(area(edge.source), area(edge.target)) for edge in upward_edges(all_edges())}
    assert set(ALLOWED_EDGES) <= used, sorted(set(ALLOWED_EDGES) - used)


def test_every_area_has_a_layer() -> None:
    for module in own_modules():
        layer_of(area(module))


# --- the checker itself -------------------------------------------------------------------------


def probe_edges(place: str, source: str) -> tuple[Edge, ...]:
    """The edges of `source` as though it were the file `place`, with every real module's edges."""
    path = ROOT / place
    probe = tuple(edges_of(path, source))
    me = module_name(path)
    return tuple(edge for edge in all_edges() if edge.source != me) + probe


def test_import_asyncio_in_a_wire_module_breaks_rule_one() -> None:
    frames = (ROOT / "flodld/wire/frames.py").read_text()
    edges = probe_edges("flodld/wire/frames.py", frames + "\nimport asyncio\n")
    assert any("flodld/wire/frames.py" in line and "asyncio" in line for line in sans_io_violations(edges))


def test_a_clock_reached_through_another_module_breaks_rule_one() -> None:
    """A sans-io module importing a helper that reads the clock is as impure as reading it itself."""
    edges = probe_edges("flodld/wire/probe_helper.py", "import time\n") + tuple(
        edges_of(ROOT / "flodld/membership/probe_core.py", "from flodld.wire.probe_helper import clock\n")
    )
    wrong = sans_io_violations(edges)
    assert any("flodld.membership.probe_core -> flodld.wire.probe_helper" in line for line in wrong)


def test_import_fhelium_in_the_controller_breaks_rule_two() -> None:
    edges = probe_edges("flodld/controller/probe_module.py", "def f():\n    import fhelium\n")
    assert cross_package_imports(edges) == [
        "flodld/controller/probe_module.py:2: flodld.controller.probe_module imports fhelium"
    ]


def test_import_the_bridge_in_fhelium_breaks_rule_two() -> None:
    edges = probe_edges("fhelium/backend/probe_module.py", "from flodld_fhelium.relay import RelayGroup\n")
    assert cross_package_imports(edges) == [
        "fhelium/backend/probe_module.py:1: fhelium.backend.probe_module imports flodld_fhelium.relay"
    ]


def test_the_bridge_may_import_both_packages() -> None:
    source = "import flodld.rank\nfrom fhelium.backend import BoundResource\n"
    edges = probe_edges("flodld_fhelium/probe_module.py", source)
    assert not [line for line in cross_package_imports(edges) if "probe_module" in line]
    assert not [edge for edge in upward_edges(edges) if edge.source == "flodld_fhelium.probe_module"]


def test_a_bench_script_importing_both_packages_breaks_rule_two() -> None:
    both = tuple(edges_of(ROOT / "bench/probe.py", "import flodld\nfrom fhelium.engine import CkksEngine\n"))
    through_bridge = tuple(
        edges_of(ROOT / "bench/probe2.py", "import flodld\nfrom flodld_fhelium.cli import report\n")
    )
    assert scripts_importing_both(both + through_bridge) == ["bench/probe.py"]


def test_a_module_named_for_importlib_counts_as_an_import() -> None:
    edges = probe_edges("fhelium/core/probe_module.py", 'TABLE = {"Share": "fhelium.multiparty.values"}\n')
    wrong = [describe(edge) for edge in upward_edges(edges) if edge.source == "fhelium.core.probe_module"]
    named = "names 'fhelium.multiparty.values' for importlib"
    assert wrong == [f"fhelium/core/probe_module.py:1: fhelium.core.probe_module {named}"]


def test_an_upward_import_breaks_rule_three() -> None:
    edges = probe_edges("flodld/wire/probe_module.py", "from flodld.controller import run\n")
    assert [describe(edge) for edge in upward_edges(edges) if edge.source == "flodld.wire.probe_module"] == [
        "flodld/wire/probe_module.py:1: flodld.wire.probe_module imports flodld.controller.run"
    ]


def test_the_layer_table_names_only_areas_that_exist() -> None:
    areas = {area(module) for module in own_modules()}
    listed = {name for layer in LAYERS for name in layer}
    assert listed <= areas, sorted(listed - areas)
    assert importlib.util.find_spec("flodld.wire") is not None
