"""CkksEngine is a facade: every operation is a plain function of the engine in its capability module."""

from __future__ import annotations

import inspect

import torch

from fhelium.core import Ciphertext
from fhelium.engine import CkksEngine, Preset
from fhelium.engine.base import EngineBase

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
