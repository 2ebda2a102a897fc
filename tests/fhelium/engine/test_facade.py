"""CkksEngine is a facade: every operation is a plain function of the engine in its capability module."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import torch

from fhelium.core import Ciphertext
from fhelium.engine import CkksEngine, Preset
from fhelium.engine.base import EngineBase
from fhelium.engine.operations import EngineOperations

PUBLIC_OPERATIONS = {
    "fhelium.engine.keygen": (
        "generate_secret_key generate_public_key generate_relinearization_key generate_rotation_key "
        "generate_conjugation_key generate_keys"
    ),
    "fhelium.engine.encryption": (
        "encode decode encrypt encrypt_integers encode_encrypt encrypt_symmetric encrypt_seeded "
        "expand_seeded uniform_from_seed decrypt decrypt_decode"
    ),
    "fhelium.engine.keyswitch": "relinearize rotate rotate_many rotate_by_step conjugate",
    "fhelium.engine.evaluation": (
        "add add_ sub sub_ negate negate_ sum sum_batch add_plain sub_plain multiply_plain multiply square "
        "rescale mod_switch mod_switch_plain to_ntt to_coefficient"
    ),
}


def test_every_public_operation_is_bound_from_its_capability_module() -> None:
    own = {name for name in vars(CkksEngine) if not name.startswith("__")}
    public = {name for name in own if not name.startswith("_")}
    assert public == {name for names in PUBLIC_OPERATIONS.values() for name in names.split()}
    for module, names in PUBLIC_OPERATIONS.items():
        for name in names.split():
            function = vars(CkksEngine)[name]
            assert inspect.isfunction(function) and function.__module__ == module, name
            assert next(iter(inspect.signature(function).parameters)) == "engine"
    # nothing but bound functions: the state and the checks are EngineBase's
    assert all(inspect.isfunction(vars(CkksEngine)[name]) for name in own)
    assert not set(own) & set(vars(EngineBase))


def test_operations_reach_each_other_through_the_engine_so_overrides_apply() -> None:
    calls: list[str] = []

    class Recording(CkksEngine):
        def encode(self, *args: object, **kwargs: object) -> object:  # type: ignore[override]  # records, then defers
            calls.append("encode")
            return super().encode(*args, **kwargs)  # type: ignore[arg-type]  # forwarded as given

    engine = Recording(Preset.TOY_N1024, rng_seed=5)
    keys = engine.generate_keys(relinearization=False)
    value = engine.encode_encrypt(torch.zeros(4), keys.public)
    assert isinstance(value, Ciphertext) and calls == ["encode"]


def test_operation_modules_reach_the_engine_through_engine_operations_not_the_facade() -> None:
    # EngineOperations is a declaration for the type checker: at run time it adds nothing to EngineBase
    assert not {name for name in vars(EngineOperations) if not name.startswith("__")}
    assert CkksEngine.__mro__[1:3] == (EngineOperations, EngineBase)
    for module in [*PUBLIC_OPERATIONS, "fhelium.engine.kernels"]:
        tree = ast.parse(Path(importlib.import_module(module).__file__ or "").read_text())
        imported = {
            (node.module, alias.name)
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
        }
        assert ("fhelium.engine.operations", "EngineOperations") in imported, module
        assert not {(source, name) for source, name in imported if "fhelium.engine.engine" in (source, name)}
        assert "CkksEngine" not in {name for _, name in imported}, module


def test_every_declared_operation_is_bound_with_the_declared_parameters() -> None:
    tree = ast.parse(Path(inspect.getfile(EngineOperations)).read_text())
    declared = {
        node.name: [arg.arg for arg in (*node.args.args, *node.args.kwonlyargs)]
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
    }
    assert declared
    for name, parameters in declared.items():
        function = vars(CkksEngine)[name]
        assert list(inspect.signature(function).parameters) == ["engine", *parameters[1:]], name
