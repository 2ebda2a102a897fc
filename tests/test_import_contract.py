"""The import contract of docs/dev/contracts.md, checked on the source (an import-linter in `ast`).

1. `clients/` uses flodld's public API only: it imports `flodld.api` and nothing else under `flodld`,
   and every `api.NAME` it touches is in `flodld.api.__all__`.
2. `flodld.api` re-exports each name unchanged from the module that defines it.
3. No product module (flodld, fhelium, the bridge flodld_fhelium, clients, bench, examples) imports a
   private name (`_x`) or from a private module (`a._b`) of another area. An area is a top-level
   subpackage (`flodld.controller`, `fhelium.backend`, `flodld_fhelium.relay`), a top-level module
   (`flodld.probe`) or one script; third-party packages (torch) count too. The exceptions are listed
   below, each with its reason. Tests are not checked: they test a package's private helpers on purpose.
4. A name taken from another area's package is in that package's `__all__` (or is a submodule).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from flodld import api

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("flodld", "fhelium", "flodld_fhelium", "clients", "bench", "examples")
OWN_PACKAGES = ("flodld", "fhelium", "flodld_fhelium", "fdl")

# (importing file, imported module, imported name or None) -> why it may cross the line.
ALLOWED_PRIVATE_IMPORTS: dict[tuple[str, str, str | None], str] = {
    ("fhelium/engine/compiled.py", "torch.fx.experimental._config", None): (
        "the opt-in torch.compile path sets backed_size_oblivious/use_duck_shape, which torch offers "
        "only in this private config module; nothing else in fhelium needs it"
    ),
}


@dataclass(frozen=True)
class Imported:
    file: str  # relative to the repository root
    line: int
    module: str  # absolute
    name: str | None  # None for `import a.b`


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "clients":
        parts = parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def area(dotted: str) -> str:
    """`flodld.controller.run` -> `flodld.controller`; a script or third-party module -> its first part."""
    parts = dotted.split(".")
    return ".".join(parts[:2]) if parts[0] in OWN_PACKAGES else parts[0]


def is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def product_files() -> Iterator[Path]:
    for top in PRODUCT:
        yield from sorted((ROOT / top).rglob("*.py"))


def imports_of(path: Path, text: str | None = None) -> Iterator[Imported]:
    """Every import in the file (or in `text`, as though it were that file), at any depth:
    function-level and TYPE_CHECKING imports included, relative ones made absolute.
    """
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    rel = str(path.relative_to(ROOT))
    source = path.read_text() if text is None else text
    for node in ast.walk(ast.parse(source, filename=rel)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Imported(rel, node.lineno, alias.name, None)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            for alias in node.names:
                yield Imported(rel, node.lineno, module, alias.name)


def crosses(imported: Imported, importer: str) -> bool:
    """A private module or name, imported from outside its area."""
    target = imported.module + (f".{imported.name}" if imported.name else "")
    private = any(is_private(part) for part in imported.module.split(".")) or (
        imported.name is not None and is_private(imported.name)
    )
    return private and area(target) != area(importer)


def private_crossings() -> list[Imported]:
    return [
        imported
        for path in product_files()
        for imported in imports_of(path)
        if crosses(imported, module_name(path))
    ]


def test_no_private_name_crosses_an_area() -> None:
    crossings = private_crossings()
    unexplained = [
        f"{i.file}:{i.line}: from {i.module} import {i.name}"
        if i.name
        else f"{i.file}:{i.line}: import {i.module}"
        for i in crossings
        if (i.file, i.module, i.name) not in ALLOWED_PRIVATE_IMPORTS
    ]
    assert not unexplained, (
        "private names imported across areas (make the name public where it is defined, or add an "
        "exception with its reason to ALLOWED_PRIVATE_IMPORTS):\n" + "\n".join(unexplained)
    )


def test_every_listed_exception_is_still_needed() -> None:
    """A stale exception would let the next violation of the same shape in unseen."""
    seen = {(i.file, i.module, i.name) for i in private_crossings()}
    assert set(ALLOWED_PRIVATE_IMPORTS) <= seen, sorted(set(ALLOWED_PRIVATE_IMPORTS) - seen)


def test_the_checker_sees_each_form_of_crossing() -> None:
    """Guards the checker itself: function-level, `import a._b`, relative and same-area imports."""
    source = (
        "import torch._C\n"
        "import os.path\n"
        "def f():\n"
        "    from flodld.wire.frames import _aead\n"
        "    from ._sibling import helper\n"
        "    from .. import _fold_helper\n"
        "    from flodld.controller._tables import _table\n"
    )
    placed = ROOT / "flodld" / "controller" / "probe_module.py"
    found = [
        (i.module, i.name) for i in imports_of(placed, source) if crosses(i, "flodld.controller.probe_module")
    ]
    assert found == [("torch._C", None), ("flodld.wire.frames", "_aead"), ("flodld", "_fold_helper")]


def outside_all(imported: Imported, importer: str) -> bool:
    """A name taken from another area's package (one with `__all__`) that is neither in it nor a submodule."""
    if imported.name is None or imported.module.split(".")[0] not in ("flodld", "fhelium"):
        return False
    if area(f"{imported.module}.{imported.name}") == area(importer):
        return False
    package = importlib.import_module(imported.module)
    public = getattr(package, "__all__", None)
    if not hasattr(package, "__path__") or public is None or imported.name in public:
        return False
    return importlib.util.find_spec(f"{imported.module}.{imported.name}") is None


def test_names_taken_from_another_areas_package_are_in_its_all() -> None:
    outside = [
        f"{imported.file}:{imported.line}: from {imported.module} import {imported.name}"
        for path in product_files()
        for imported in imports_of(path)
        if outside_all(imported, module_name(path))
    ]
    assert not outside, "names missing from their package's __all__:\n" + "\n".join(outside)


def test_the_all_check_sees_a_name_outside_all() -> None:
    """`annotations` sits in fhelium.compile's namespace (a __future__ import) but not in its __all__."""
    placed = ROOT / "fhelium" / "backend" / "probe_module.py"
    source = (
        "from fhelium.compile import annotations, Pipeline, passes\nfrom fhelium.compile import _pipeline\n"
    )
    found = [i.name for i in imports_of(placed, source) if outside_all(i, "fhelium.backend.probe_module")]
    assert found == ["annotations"]


def client_files() -> list[Path]:
    return sorted((ROOT / "clients").rglob("*.py"))


def test_clients_import_only_flodld_api() -> None:
    wrong = []
    for path in client_files():
        for imported in imports_of(path):
            if area(imported.module) == "flodld" or imported.module.startswith("flodld."):
                allowed = (imported.module == "flodld" and imported.name == "api") or (
                    imported.module == "flodld.api"
                    and (imported.name is None or imported.name in api.__all__)
                )
                if not allowed:
                    wrong.append(f"{imported.file}:{imported.line}: {imported.module} {imported.name or ''}")
    assert not wrong, "clients/ may import flodld.api only (add what it needs there):\n" + "\n".join(wrong)


def test_clients_use_only_public_api_names() -> None:
    used: dict[str, list[str]] = {}
    for path in client_files():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "api"
            ):
                used.setdefault(node.attr, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert used, "the client reaches flodld through `api.NAME`"
    unknown = {name: where for name, where in used.items() if name not in api.__all__}
    assert not unknown, f"names not in flodld.api.__all__: {unknown}"


def _type_checking_imports() -> dict[str, str]:
    """The names flodld/api.py imports under `if TYPE_CHECKING:`, with their modules."""
    tree = ast.parse((ROOT / "flodld" / "api.py").read_text())
    names: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for statement in node.body:
                assert isinstance(statement, ast.ImportFrom) and statement.module is not None
                for alias in statement.names:
                    assert alias.asname is None, alias.asname
                    names[alias.name] = statement.module
    return names


def test_api_all_matches_what_type_checkers_see() -> None:
    assert sorted(_type_checking_imports()) == sorted(api.__all__)
    assert len(set(api.__all__)) == len(api.__all__)


@pytest.mark.parametrize("name", sorted(_type_checking_imports()))
def test_api_name_is_the_defining_modules_object(name: str) -> None:
    module = importlib.import_module(_type_checking_imports()[name])
    assert getattr(api, name) is getattr(module, name)


def test_api_refuses_an_unknown_name() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Controller'"):
        _ = api.Controller  # typed `object` by api.__getattr__; it raises for a name it does not have
    assert "load_config" in dir(api)
