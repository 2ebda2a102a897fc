"""fhelium.native's coarse CKKS kernels (key switching, decompose, ModDown, rescale, add/sub) are
bit-identical to the engine's pure-torch reference at every dispatch level.

Each case builds a reference engine under ``FHELIUM_NATIVE_LEVEL=torch`` and a native one at the
level under test with the same parameters, then runs the engine's own steps on random residues.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import pytest
import torch

from fhelium import native
from fhelium.core import Ciphertext, FheliumValueError, RelinearizationKey
from fhelium.engine import CkksEngine, CkksParameters, KeySet
from fhelium.engine.primes import primitive_root_of_unity


@pytest.fixture(scope="module", autouse=True)
def _native_available() -> None:
    if not native.load():
        if os.environ.get(native.REQUIRE_ENVIRONMENT_VARIABLE) == "1":
            pytest.fail("FHELIUM_REQUIRE_NATIVE=1 but the native extension is unavailable")
        pytest.skip("fhelium native extension unavailable (no C++ compiler?)")


def _levels() -> list[str]:
    return list(native.supported_levels()) or ["scalar"]


def _parameters(log_n: int, scale: tuple[int, ...], base: int, special: int) -> CkksParameters:
    return CkksParameters(
        log_ring_degree=log_n,
        scale_bits=min(scale) if scale else 20,
        scale_prime_bits=scale,
        base_prime_bits=base,
        special_prime_bits=special,
        enforce_security=False,
    )


# N, limb counts and prime sizes: 50-bit primes (IFMA's limit) in Q and P, 17 Q limbs (past the
# IFMA inner product's 15 digits: its scalar fallback), N = 8 (too small for IFMA blocks)
CASES = {
    "n8": _parameters(3, (20,), 25, 30),
    "n64-17limbs": _parameters(6, (30,) * 16, 40, 50),
    "n1024": _parameters(10, (30, 30), 40, 50),
    "n2048-50bit": _parameters(11, (40, 40, 40), 50, 50),
    "n16384": _parameters(14, (40,) * 4, 48, 50),
}


@pytest.fixture(params=_levels())
def level(request: pytest.FixtureRequest) -> str:
    """Each native level this CPU runs (at least `scalar`)."""
    return str(request.param)


@pytest.fixture
def engines(case: str, level: str, monkeypatch: pytest.MonkeyPatch) -> tuple[CkksEngine, CkksEngine]:
    """(the torch reference, the engine at LEVEL) over CASES[CASE], seeded alike (CASE: parametrize it)."""
    return _engines(CASES[case], level, monkeypatch)


@contextmanager
def _torch_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Within: FHELIUM_NATIVE_LEVEL=torch (the reference path); the level before it is back after."""
    with monkeypatch.context() as patch:
        patch.setenv(native.LEVEL_ENVIRONMENT_VARIABLE, "torch")
        yield


def _engines(
    parameters: CkksParameters, level: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[CkksEngine, CkksEngine]:
    monkeypatch.setenv(native.LEVEL_ENVIRONMENT_VARIABLE, "torch")
    reference = CkksEngine(parameters, rng_seed=5)
    monkeypatch.setenv(native.LEVEL_ENVIRONMENT_VARIABLE, level)
    engine = CkksEngine(parameters, rng_seed=5)
    assert reference.ntt.native_level == "torch" and engine.ntt.native_level == level
    return reference, engine


def _residues(engine: CkksEngine, ids: tuple[int, ...], batch: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    rows = [
        torch.randint(0, engine.moduli[i], (*batch, 1, engine.ring_degree), generator=generator) for i in ids
    ]
    return torch.cat(rows, dim=-2)


class _KeySwitchStep(NamedTuple):
    ids: tuple[int, ...]
    batch: tuple[int, ...]
    poly: torch.Tensor
    values: torch.Tensor  # over the Q limbs of `ids` and P
    switched: torch.Tensor  # the torch reference's _key_switch, _decompose, _inner_product and _mod_down
    lifted: torch.Tensor
    inner: torch.Tensor
    down: torch.Tensor


@functools.cache
def _torch_key_switching(case: str) -> tuple[RelinearizationKey, list[_KeySwitchStep]]:
    """The torch reference's relinearization key and, at depths 0, 1 and the last, its inputs and results
    over CASES[CASE] (seed 5, as `engines` seeds it): the same at every level, so made once per case. Call
    it on the torch path.
    """
    reference = CkksEngine(CASES[case], rng_seed=5)
    assert reference.ntt.native_level == "torch"
    secret = reference.generate_secret_key()
    key = reference.generate_relinearization_key(secret)
    steps = []
    depths = sorted({0, 1, reference.parameters.max_depth})
    for depth, batch in zip(depths, [(2,), (), (2, 2)], strict=False):
        ids = reference.q_ids_at(depth)
        qp_ids = (*ids, reference.special_prime_id)
        poly = _residues(reference, ids, batch, seed=depth + 1)
        values = _residues(reference, qp_ids, (2, *batch), seed=depth + 11)
        switched = reference._key_switch(poly, ids, key)
        lifted = reference._decompose(poly, ids)
        inner = reference._inner_product(lifted, ids, key)
        down = reference._mod_down(values, ids)
        steps.append(_KeySwitchStep(ids, batch, poly, values, switched, lifted, inner, down))
    return key, steps


@pytest.mark.parametrize("case", list(CASES))
def test_key_switching_and_mod_down_are_bit_identical(
    case: str, engines: tuple[CkksEngine, CkksEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, engine = engines
    with _torch_path(monkeypatch):
        key, steps = _torch_key_switching(case)
    for ids, batch, poly, values, expected_switch, expected_lifted, expected_inner, expected_down in steps:
        switched = engine._key_switch(poly, ids, key)
        assert switched.shape == (2, *batch, len(ids), engine.ring_degree)
        assert torch.equal(switched, expected_switch)
        lifted = engine._decompose(poly, ids)
        assert torch.equal(lifted, expected_lifted)
        assert torch.equal(engine._inner_product(lifted, ids, key), expected_inner)
        assert torch.equal(engine._mod_down(values, ids), expected_down)
        # non-contiguous input: every other entry of an interleaved copy (stride 2 along N)
        strided = torch.stack((poly, torch.zeros_like(poly)), dim=-1).flatten(-2)[..., ::2]
        assert not strided.is_contiguous()
        assert torch.equal(engine._key_switch(strided, ids, key), expected_switch)


@pytest.mark.parametrize("case", ["n8", "n1024", "n2048-50bit", "n16384"])
def test_rescale_is_bit_identical_in_both_domains(
    engines: tuple[CkksEngine, CkksEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    reference, engine = engines
    for depth, batch in ((0, (3,)), (reference.parameters.max_depth - 1, ())):
        ids = reference.q_ids_at(depth)
        data = _residues(reference, ids, (2, *batch), seed=depth + 21)
        for domain in ("ntt", "coefficient"):
            ct = Ciphertext(data, depth, 2.0**20, ids, domain)
            with _torch_path(monkeypatch):
                expected = reference.rescale(ct)
            result = engine.rescale(ct)
            assert result.prime_ids == expected.prime_ids and result.scale == expected.scale
            assert torch.equal(result.data, expected.data)


class _Rotations(NamedTuple):
    keys: KeySet
    x: torch.Tensor
    ct: Ciphertext
    expected: list[torch.Tensor]  # multiply-relinearize-rescale, rotate by 1, conjugate, rotate_many(1, -3)


@functools.cache
def _torch_rotations(case: str) -> _Rotations:
    """The torch reference's keys, input, ciphertext and results over CASES[CASE] (seed 5, as `engines`
    seeds it): the same at every level, so made once per case. Call it on the torch path.
    """
    reference = CkksEngine(CASES[case], rng_seed=5)
    assert reference.ntt.native_level == "torch"
    keys = reference.generate_keys(rotation_steps=(1, -3), conjugation=True)
    assert keys.conjugation is not None
    x = torch.rand(3, reference.slot_count, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ct = reference.encode_encrypt(x, keys.public)
    expected = [
        reference.rescale(reference.relinearize(reference.multiply(ct, ct), keys.relin())).data,
        reference.rotate(ct, keys.rotation(1)).data,
        reference.conjugate(ct, keys.conjugation).data,
        *(c.data for c in reference.rotate_many(ct, [keys.rotation(1), keys.rotation(-3)])),
    ]
    return _Rotations(keys, x, ct, expected)


@pytest.mark.parametrize("case", ["n2048-50bit", "n16384"])
def test_rotate_multiply_and_rotate_many_match_the_torch_engine(
    case: str, engines: tuple[CkksEngine, CkksEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    # at N=2^14 a batch of 3 is three groups on the torch path, one native call (chunked inside)
    _, engine = engines
    with _torch_path(monkeypatch):
        keys, x, ct, expected = _torch_rotations(case)
    assert keys.conjugation is not None
    results = [
        engine.rescale(engine.relinearize(engine.multiply(ct, ct), keys.relin())).data,
        engine.rotate(ct, keys.rotation(1)).data,
        engine.conjugate(ct, keys.conjugation).data,
        *(c.data for c in engine.rotate_many(ct, [keys.rotation(1), keys.rotation(-3)])),
    ]
    for got, want in zip(results, expected, strict=True):
        assert torch.equal(got, want)
    # and the values decrypt: x^2 after the native multiply, x rolled by one after the rotation
    decoded = engine.decode(
        engine.decrypt(engine.rescale(engine.relinearize(engine.multiply(ct, ct), keys.relin())), keys.secret)
    )
    assert torch.allclose(decoded.real, x**2, atol=1e-4)


class _KeySwitchOperands(NamedTuple):
    q: torch.Tensor
    tables: torch.Tensor
    x: torch.Tensor  # BATCH polynomials over the Q limbs
    key: torch.Tensor  # one (2, QP, N) key part per Q limb
    digits: torch.Tensor
    rows: torch.Tensor
    generator: torch.Generator  # for more residues after these


def _key_switch_operands(parameters: CkksParameters, batch: int, seed: int) -> _KeySwitchOperands:
    """NTT tables over every modulus of PARAMETERS (Q then P) and random residues for one key switch."""
    n, moduli = 1 << parameters.log_ring_degree, list(parameters.moduli)
    q, tables = native.ntt_tables(moduli, [primitive_root_of_unity(2 * n, p) for p in moduli], n)
    generator = torch.Generator().manual_seed(seed)
    column, limbs = q.view(-1, 1), len(moduli) - 1
    x = torch.remainder(torch.randint(0, 1 << 62, (batch, limbs, n), generator=generator), column[:limbs])
    key = torch.remainder(torch.randint(0, 1 << 62, (limbs, 2, len(moduli), n), generator=generator), column)
    return _KeySwitchOperands(q, tables, x, key, torch.arange(limbs), torch.arange(len(moduli)), generator)


def test_levels_agree_on_a_batch_of_key_switches() -> None:
    q, tables, x, key, digits, rows, _ = _key_switch_operands(_parameters(12, (40,) * 4, 48, 50), 4, seed=31)
    results = [native.key_switch(x, key, digits, rows, q, tables, level) for level in _levels()]
    assert all(torch.equal(results[0], other) for other in results[1:])


def test_rns_ops_have_fake_implementations() -> None:
    n = 64
    q, tables, x, key, digits, rows, generator = _key_switch_operands(_parameters(6, (30, 30), 40, 50), 2, 32)
    column = q.view(-1, 1)
    level = native.LEVEL_CODES[_levels()[-1]]
    ops = torch.ops.fhelium
    torch.library.opcheck(ops.key_switch.default, (x, key, digits, rows, q, tables, level))
    lifted = ops.decompose.default(x, q, tables, level)
    torch.library.opcheck(ops.decompose.default, (x, q, tables, level))
    torch.library.opcheck(ops.key_switch_lifted.default, (lifted, key, digits, rows, q, tables, level))
    values = torch.remainder(torch.randint(0, 1 << 62, (2, 4, n), generator=generator), column)
    torch.library.opcheck(ops.divide_round.default, (values, q, tables, 3, True, level))
    # mod_down with encryption's terms: the addend and a message (times factors) in c0 only
    values = torch.remainder(torch.randint(0, 1 << 62, (2, 2, q.numel(), n), generator=generator), column)
    limbs = q.numel() - 1
    addend = torch.remainder(torch.randint(0, 1 << 62, (2, limbs, n), generator=generator), column[:-1])
    divided = torch.randint(-40, 41, (2, 2, 1, n), generator=generator)
    message = torch.randint(-(1 << 61), 1 << 61, (2, 2, n), generator=generator)
    factors = torch.remainder(torch.tensor([[1 << 44] * limbs, [1] * limbs]), q[:-1])
    torch.library.opcheck(ops.mod_down.default, (values, addend, divided, q, tables, level, message, factors))
    torch.library.opcheck(
        ops.divide_round.default, (x, q[:3].contiguous(), tables[:3].contiguous(), 0, False, level)
    )


@pytest.mark.parametrize("case", ["n8", "n1024", "n2048-50bit", "n16384"])
def test_encryption_mod_down_and_encrypt_are_bit_identical(
    engines: tuple[CkksEngine, CkksEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    reference, engine = engines
    for depth, batch in ((0, (2,)), (reference.parameters.max_depth, ())):
        ids = reference.q_ids_at(depth)
        qp_ids = (*ids, reference.special_prime_id)
        values = _residues(reference, qp_ids, (2, *batch), seed=depth + 41)
        addend = _residues(reference, ids, (2, *batch), seed=depth + 42)
        generator = torch.Generator().manual_seed(depth + 43)
        divided = torch.randint(-40, 41, (2, *batch, 1, reference.ring_degree), generator=generator)
        for extra in ((addend, None), (None, divided), (addend, divided)):
            with _torch_path(monkeypatch):
                expected = reference._mod_down(values, ids, *extra)
            assert torch.equal(engine._mod_down(values, ids, *extra), expected)
    # the whole public-key encryption, from the same seeded randomness, both plaintext domains
    with _torch_path(monkeypatch):
        keys = reference.generate_keys(relinearization=False)
    native_keys = engine.generate_keys(relinearization=False)  # the same draws from the same seed
    assert torch.equal(native_keys.public.data, keys.public.data)
    x = torch.rand(3, reference.slot_count, dtype=torch.float64, generator=torch.Generator().manual_seed(44))
    for domain in ("coefficient", "ntt"):
        with _torch_path(monkeypatch):
            expected_ct = reference.encrypt(reference.encode(x, domain=domain), keys.public)
        ct = engine.encrypt(engine.encode(x, domain=domain), native_keys.public)
        assert torch.equal(ct.data, expected_ct.data)


class _IntegerEncryptions(NamedTuple):
    x: torch.Tensor
    expected: torch.Tensor  # encrypt(the residues x·multiplier mod q) by the torch reference
    torch_ct: torch.Tensor  # the torch reference's encrypt_integers(x, multiplier=multiplier)


@functools.cache
def _torch_integer_encryptions(case: str) -> tuple[_IntegerEncryptions, ...]:
    """The torch reference's side of the encrypt_integers test over CASES[CASE], for each batch and
    multiplier in turn (x from one generator, each engine fresh with seed 5, as `_engines` makes them):
    the same at every level, so made once per case. Call it on the torch path.
    """
    generator = torch.Generator().manual_seed(45)
    made = []
    for batch in ((), (3,), (2, 2)):
        for multiplier in (1, 1 << 44, 3**40):
            reference = CkksEngine(CASES[case], rng_seed=5)
            plain_reference = CkksEngine(CASES[case], rng_seed=5)
            assert reference.ntt.native_level == plain_reference.ntt.native_level == "torch"
            n, ids = reference.ring_degree, reference.q_ids_at(0)
            x = torch.randint(-(1 << 62) + 1, 1 << 62, (*batch, n), generator=generator)
            x.view(-1)[:4] = torch.tensor([(1 << 62) - 1, -(1 << 62) + 1, 0, -1])  # the range's edges
            q = plain_reference._mod(ids).q
            factors = torch.tensor([[multiplier % p] for p in plain_reference.moduli_for(ids)])
            residues = reference_mul(torch.remainder(x.unsqueeze(-2), q), factors, q)
            plaintext = plain_reference.encode(torch.zeros(*batch, 1), domain="coefficient")
            public = plain_reference.generate_keys(relinearization=False).public
            expected = plain_reference.encrypt(plaintext.with_tensor(residues), public)
            public = reference.generate_keys(relinearization=False).public
            torch_ct = reference.encrypt_integers(x, public, scale=2.0**20, multiplier=multiplier)
            made.append(_IntegerEncryptions(x, expected.data, torch_ct.data))
    return tuple(made)


@pytest.mark.parametrize("case", ["n64-17limbs", "n1024", "n2048-50bit"])
def test_encrypt_integers_is_encrypt_of_their_residues_bit_for_bit(
    case: str, level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """encrypt_integers(x, multiplier=f) == encrypt(the residues x·f mod q) from the same draws, at
    every level: native (the residues taken inside ModDown, the addend in c0 only) and torch.
    """
    with _torch_path(monkeypatch):
        references = iter(_torch_integer_encryptions(case))
    for _batch in ((), (3,), (2, 2)):
        for multiplier in (1, 1 << 44, 3**40):
            x, expected, torch_ct = next(references)
            _, engine = _engines(CASES[case], level, monkeypatch)
            n, ids = engine.ring_degree, engine.q_ids_at(0)
            native_public = engine.generate_keys(relinearization=False).public
            ct = engine.encrypt_integers(x, native_public, scale=2.0**20, multiplier=multiplier)
            assert torch.equal(torch_ct, expected)
            assert torch.equal(ct.data, expected)
            assert ct.scale == 2.0**20 and ct.prime_ids == ids
    with pytest.raises(FheliumValueError, match="2\\^62"):
        engine.encrypt_integers(torch.full((n,), 1 << 62), native_public, scale=1.0)


def reference_mul(a: torch.Tensor, b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(a·b) mod q exactly (Python integers): the residues an encryption must hold."""
    rows = [
        [[int(x) * int(b[i, 0]) % int(q[i, 0]) for x in row] for i, row in enumerate(poly)]
        for poly in a.reshape(-1, *a.shape[-2:]).tolist()
    ]
    return torch.tensor(rows, dtype=torch.int64).view(a.shape)


def test_mod_down_refuses_a_message_beyond_2_62() -> None:
    parameters = _parameters(6, (30, 30), 40, 50)
    n, moduli = 64, list(parameters.moduli)
    q, tables = native.ntt_tables(moduli, [primitive_root_of_unity(2 * n, p) for p in moduli], n)
    values = torch.zeros(2, 2, len(moduli), n, dtype=torch.int64)
    addend = torch.zeros(2, len(moduli) - 1, n, dtype=torch.int64)
    message = torch.zeros(2, 1, n, dtype=torch.int64)
    factors = torch.ones(1, len(moduli) - 1, dtype=torch.int64)
    for level in _levels():
        native.mod_down(values, addend, None, q, tables, level, message=message, message_factors=factors)
        message[1, 0, 5] = 1 << 62
        with pytest.raises(RuntimeError, match="2\\^62"):
            native.mod_down(values, addend, None, q, tables, level, message=message, message_factors=factors)
        message[1, 0, 5] = 0


def _torch_reference(
    monkeypatch: pytest.MonkeyPatch, function: object, *arguments: torch.Tensor
) -> torch.Tensor:
    with _torch_path(monkeypatch):
        result = function(*arguments)  # type: ignore[operator]
    assert isinstance(result, torch.Tensor)
    return result


@pytest.mark.parametrize("level", _levels())
@pytest.mark.parametrize(
    "shapes",
    [
        ((3, 64), (3, 64)),
        ((2, 1, 3, 67), (4, 3, 67)),
        ((3, 64), (64,)),
        ((2, 3, 16), (1, 1, 1)),
        ((5, 3, 1000), (5, 3, 1000)),
    ],
)
def test_elementwise_ops_are_bit_identical(
    shapes: tuple[tuple[int, ...], ...], level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fhelium.engine import modular as mod

    moduli = [(1 << 50) - 27, (1 << 40) - 87, (1 << 30) - 35]
    q = torch.tensor(moduli).view(3, 1)
    generator = torch.Generator().manual_seed(51)

    def residues(shape: tuple[int, ...]) -> torch.Tensor:
        x = torch.randint(0, 1 << 62, shape, generator=generator)
        return (
            torch.remainder(x, q) if len(shape) >= 2 and shape[-2] == 3 else torch.remainder(x, min(moduli))
        )

    a, b = residues(shapes[0]), residues(shapes[1])
    a.view(-1)[:3] = 0  # the extremes 0 and q - 1 among random entries
    b.view(-1)[-3:] = torch.remainder(torch.tensor(moduli[-1] - 1), min(moduli))
    # torch.broadcast_shapes has no annotations (fhelium/native/fakes.py silences the same call)
    c = residues(torch.broadcast_shapes(shapes[0], shapes[1]))  # type: ignore[no-untyped-call]
    operations = {
        "add": (native.add_mod, mod.add_mod, (a, b, q)),
        "sub": (native.sub_mod, mod.sub_mod, (a, b, q)),
        "mul": (native.mul_mod, lambda x, y, m: mod.mul_mod(x, y, m, 1.0 / m.double()), (a, b, q)),
    }
    for name, (ours, reference, arguments) in operations.items():
        expected = _torch_reference(monkeypatch, reference, *arguments)
        assert torch.equal(ours(*arguments, level=level), expected), name
    product = _torch_reference(monkeypatch, lambda x, y, m: mod.mul_mod(x, y, m, 1.0 / m.double()), a, b, q)
    assert torch.equal(
        native.mul_add_mod(a, b, c, q, level=level), _torch_reference(monkeypatch, mod.add_mod, product, c, q)
    )
    # in place on a strided view (every other limb-row entry), b broadcast into it
    if a.shape == torch.broadcast_shapes(a.shape, b.shape):  # type: ignore[no-untyped-call]  # as above
        for ours_, reference_ in ((native.add_mod_, mod.add_mod_), (native.sub_mod_, mod.sub_mod_)):
            wide = torch.stack((a, torch.full_like(a, 7)), dim=-1)
            expected_wide = wide.clone()
            _torch_reference(monkeypatch, reference_, expected_wide[..., 0], b, q)
            ours_(wide[..., 0], b, q, level=level)
            assert torch.equal(wide, expected_wide)


def test_the_engine_modular_functions_use_the_native_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    from fhelium.engine import modular as mod

    monkeypatch.delenv(native.LEVEL_ENVIRONMENT_VARIABLE, raising=False)
    calls: list[str] = []

    def recording(name: str, original: Callable[..., object]) -> Callable[..., object]:
        def record(*args: object, **kwargs: object) -> object:
            calls.append(name)
            return original(*args, **kwargs)

        return record

    for name in ("add_mod", "sub_mod", "add_mod_", "sub_mod_", "mul_mod"):
        monkeypatch.setattr(native, name, recording(name, getattr(native, name)))
    q = torch.tensor([[97], [193]])
    x = torch.tensor([[5, 96], [0, 192]])
    assert mod.add_mod(x, x, q).tolist() == [[10, 95], [0, 191]]
    assert mod.sub_mod(x, x.flip(-1), q).tolist() == [[6, 91], [1, 192]]
    assert mod.mul_mod(x, x, q, 1.0 / q.double()).tolist() == [[25, 1], [0, 1]]
    mod.add_mod_(x, x, q)
    mod.sub_mod_(x, x, q)
    assert x.tolist() == [[0, 0], [0, 0]]
    assert calls == ["add_mod", "sub_mod", "mul_mod", "add_mod_", "sub_mod_"]


def test_elementwise_ops_have_fake_implementations() -> None:
    q = torch.tensor([[97], [193]])
    x = torch.tensor([[5, 96, 3], [0, 192, 7]])
    level = native.LEVEL_CODES[_levels()[-1]]
    ops = torch.ops.fhelium
    for op in (ops.add_mod, ops.sub_mod, ops.mul_mod):
        torch.library.opcheck(op.default, (x, x, q, level))
    torch.library.opcheck(ops.mul_add_mod.default, (x, x, x, q, level))
    for op in (ops.add_mod_, ops.sub_mod_):
        torch.library.opcheck(op.default, (x.clone(), x, q, level))


@pytest.mark.parametrize("case", ["n8", "n1024", "n16384"])
def test_sampling_to_ntt_is_bit_identical(
    engines: tuple[CkksEngine, CkksEngine], level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference, engine = engines
    generator = torch.Generator().manual_seed(61)
    ids = tuple(range(len(reference.moduli)))
    small = torch.randint(-20, 21, (3, 2, reference.ring_degree), generator=generator)
    small[0, 0, :2] = torch.tensor([-(min(reference.moduli) - 1), min(reference.moduli) - 1])  # the extremes
    for values, prime_ids in (
        (small, ids),
        (small[:, 1], ids[1:3]),
        (small.transpose(0, 1), (ids[-1], ids[0])),
    ):
        with _torch_path(monkeypatch):
            expected = reference._small_ntt(values, prime_ids)
        assert torch.equal(engine._small_ntt(values, prime_ids), expected)
    q, tables = engine.ntt._native_tables(ids)
    torch.library.opcheck(torch.ops.fhelium.small_ntt.default, (small, q, tables, native.LEVEL_CODES[level]))


def test_permute_last_is_index_select() -> None:
    generator = torch.Generator().manual_seed(71)
    x = torch.randint(0, 1 << 50, (2, 3, 5, 64), generator=generator)
    index = torch.randperm(64, generator=generator)
    for value in (x, x.transpose(0, 2), x[..., ::2].contiguous()):
        picked = index[: value.size(-1)] % value.size(-1)
        assert torch.equal(native.permute_last(value, picked), value.index_select(-1, picked))
    with pytest.raises(RuntimeError, match="out of range"):
        native.permute_last(x, torch.tensor([0, 64]))
    torch.library.opcheck(torch.ops.fhelium.permute_last.default, (x, index))


@pytest.mark.parametrize("case", ["n8", "n2048-50bit", "n16384"])
def test_tensor_product_is_bit_identical(
    engines: tuple[CkksEngine, CkksEngine], level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference, engine = engines
    ids = reference.q_ids_at(0)
    lhs_data = _residues(reference, ids, (2, 3), seed=81)
    rhs_data = _residues(reference, ids, (2, 3), seed=82)
    column = torch.tensor(reference.moduli_for(ids)).unsqueeze(-1)
    lhs_data[0, 0] = column - 1  # extremes: q - 1 times q - 1, and zeros
    rhs_data[1, 0] = column - 1
    rhs_data[0, 1] = 0
    lhs = Ciphertext(lhs_data, 0, 2.0**20, ids, "ntt")
    rhs = Ciphertext(rhs_data.transpose(-1, -2).contiguous().transpose(-1, -2), 0, 2.0**20, ids, "ntt")
    assert not rhs.data.is_contiguous()
    with _torch_path(monkeypatch):
        expected = reference.multiply(lhs, rhs)
    result = engine.multiply(lhs, rhs)
    assert torch.equal(result.data, expected.data) and result.scale == expected.scale
    moduli = engine.ntt._native_tables(ids)[0]
    torch.library.opcheck(
        torch.ops.fhelium.tensor_product.default, (lhs_data, rhs_data, moduli, native.LEVEL_CODES[level])
    )
