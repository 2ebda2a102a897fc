"""fhelium.native: every dispatch level bit-identical to the pure-torch reference.

Skips where the extension cannot be built, and fails there under FHELIUM_REQUIRE_NATIVE=1 (CI).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fhelium import native
from fhelium.engine.modular import mul_mod
from fhelium.engine.ntt import NegacyclicNtt
from fhelium.engine.primes import ntt_primes, primitive_root_of_unity
from fhelium.native import build as native_build

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module", autouse=True)
def _native_available() -> None:
    available = native.load()
    if not available:
        if os.environ.get(native.REQUIRE_ENVIRONMENT_VARIABLE) == "1":
            pytest.fail("FHELIUM_REQUIRE_NATIVE=1 but the native extension is unavailable")
        pytest.skip("fhelium native extension unavailable (no C++ compiler?)")


def _levels() -> list[str]:
    return list(native.supported_levels()) or ["scalar"]


def _moduli(n: int, limbs: int) -> list[int]:
    # the engine's mix of prime sizes: 50-bit (IFMA's limit), 40-bit and 30-bit
    bits = [50, 40, 30]
    per = {b: sum(1 for i in range(limbs) if bits[i % 3] == b) for b in bits}
    by_bits = {b: ntt_primes(b, n, count) for b, count in per.items() if count}
    return [by_bits[bits[i % 3]][i // 3] for i in range(limbs)]


def _random(moduli: list[int], n: int, batch: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, q, (*batch, 1, n), generator=generator) for q in moduli]
    return torch.cat(rows, dim=-2)


def _native_and_reference(
    n: int, moduli: list[int]
) -> tuple[tuple[torch.Tensor, torch.Tensor], NegacyclicNtt]:
    roots = [primitive_root_of_unity(2 * n, q) for q in moduli]
    return native.ntt_tables(moduli, roots, n), NegacyclicNtt(n, moduli, torch.device("cpu"), native=False)


@pytest.mark.parametrize("level", _levels())
@pytest.mark.parametrize(
    ("log_n", "limbs", "batch"), [(10, 1, ()), (11, 3, (2,)), (12, 4, (3,)), (13, 2, (2, 2)), (14, 5, ())]
)
def test_forward_and_inverse_are_bit_identical_to_the_torch_reference(
    level: str, log_n: int, limbs: int, batch: tuple[int, ...]
) -> None:
    n = 1 << log_n
    moduli = _moduli(n, limbs)
    (q, tables), reference = _native_and_reference(n, moduli)
    ids = tuple(range(limbs))
    x = _random(moduli, n, batch, seed=log_n * 10 + limbs)
    expected = reference.forward(x, ids)
    forward = native.ntt_forward(x, q, tables, level)
    assert forward.shape == x.shape
    assert torch.equal(forward, expected)
    evaluations = _random(moduli, n, batch, seed=log_n * 10 + limbs + 1)
    assert torch.equal(native.ntt_inverse(evaluations, q, tables, level), reference.inverse(evaluations, ids))
    assert torch.equal(native.ntt_inverse(forward, q, tables, level), x)


@pytest.mark.parametrize("level", _levels())
@pytest.mark.parametrize(
    ("log_n", "limbs"),
    [(3, 1), (4, 17), (5, 2), (6, 3), (7, 4), (8, 5), (9, 6), (10, 7), (11, 17), (12, 8), (13, 3), (14, 17)],
)
def test_every_ring_degree_and_limb_count(
    level: str, log_n: int, limbs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """N = 8 ... 2^14 with 1 ... 17 limbs of the engine's prime sizes (50, 40, 30 bits: every level's
    vector rows), the extremes 0 and q - 1 in every row.
    """
    n = 1 << log_n
    moduli = _moduli(n, limbs)
    (q, tables), reference = _native_and_reference(n, moduli)
    ids = tuple(range(limbs))
    x = _random(moduli, n, (), seed=log_n * 100 + limbs)
    x[:, 0] = 0
    x[:, -1] = q - 1
    expected = reference.forward(x, ids)
    forward = native.ntt_forward(x, q, tables, level)
    assert torch.equal(forward, expected)
    assert torch.equal(native.ntt_inverse(expected, q, tables, level), x)
    y = _random(moduli, n, (), seed=log_n * 100 + limbs + 1)
    column = q.view(-1, 1)
    with monkeypatch.context() as patch:
        patch.setenv(native.LEVEL_ENVIRONMENT_VARIABLE, "torch")
        expected_product = mul_mod(x, y, column, 1.0 / column.double())
    assert torch.equal(native.mul_mod(x, y, column, level=level), expected_product)


@pytest.mark.parametrize("level", _levels())
def test_extreme_residues_and_small_rings(level: str) -> None:
    for n in (2, 4, 8, 16, 32, 64):
        moduli = _moduli(n, 3)
        (q, tables), reference = _native_and_reference(n, moduli)
        column = torch.tensor(moduli).unsqueeze(-1)
        for x in (
            torch.zeros(3, n, dtype=torch.int64),
            (column - 1).expand(3, n).clone(),
            _random(moduli, n, (4,), n),
        ):
            expected = reference.forward(x, (0, 1, 2))
            assert torch.equal(native.ntt_forward(x, q, tables, level), expected)
            assert torch.equal(native.ntt_inverse(expected, q, tables, level), x)


@pytest.mark.parametrize("level", _levels())
@pytest.mark.parametrize("log_n", [4, 5, 12, 14])
def test_every_prime_size_with_extreme_inputs(level: str, log_n: int) -> None:
    """The AVX2 level leaves sums unreduced for as many stages as each prime's bounds allow (every
    stage's sums reduced at 50 bits, every few at 45-49, none at 40): one row of each size, with
    inputs that push the lazy values hardest (all q - 1, alternating q - 1 and 0, q - 1 and 1).
    """
    n = 1 << log_n
    moduli = [ntt_primes(bits, n, 1)[0] for bits in (50, 49, 48, 47, 46, 45, 44, 40, 35, 30, 20)]
    (q, tables), reference = _native_and_reference(n, moduli)
    ids = tuple(range(len(moduli)))
    column = q.view(-1, 1)
    top = (column - 1).expand(len(moduli), n)
    index = torch.arange(n)
    for x in (top.clone(), torch.where(index % 2 == 0, top, 0), torch.where(index < n // 2, top, 1)):
        expected = reference.forward(x, ids)
        assert torch.equal(native.ntt_forward(x, q, tables, level), expected)
        assert torch.equal(native.ntt_inverse(expected, q, tables, level), x)
        assert torch.equal(native.ntt_inverse(x, q, tables, level), reference.inverse(x, ids))


@pytest.mark.parametrize("level", _levels())
def test_entry_t_is_the_evaluation_at_an_odd_power_of_psi(level: str) -> None:
    n = 16
    prime = ntt_primes(50, n, 1)[0]
    psi = primitive_root_of_unity(2 * n, prime)
    q, tables = native.ntt_tables([prime], [psi], n)
    a = [random.Random(5).randrange(prime) for _ in range(n)]
    evaluated = native.ntt_forward(torch.tensor([a]), q, tables, level)[0].tolist()
    assert evaluated == [
        sum(c * pow(psi, (2 * t + 1) * i, prime) for i, c in enumerate(a)) % prime for t in range(n)
    ]


@pytest.mark.parametrize("level", _levels())
def test_primes_above_the_ifma_bound_match_the_big_integer_evaluation(level: str) -> None:
    """61-bit primes (above IFMA's 2^50; the IFMA level runs such rows at the DQ level, whose 64-bit
    Shoup products take any q < 2^62), including the extreme residue q - 1.
    """
    n = 64
    primes = ntt_primes(61, n, 2)
    roots = [primitive_root_of_unity(2 * n, p) for p in primes]
    q, tables = native.ntt_tables(primes, roots, n)
    rng = random.Random(61)
    rows = [[rng.randrange(p) for _ in range(n)] for p in primes]
    rows[1][:4] = [primes[1] - 1] * 4
    x = torch.tensor(rows)
    evaluated = native.ntt_forward(x, q, tables, level).tolist()
    for r, (p, psi) in enumerate(zip(primes, roots, strict=True)):
        assert evaluated[r] == [
            sum(c * pow(psi, (2 * t + 1) * i, p) for i, c in enumerate(rows[r])) % p for t in range(n)
        ]
    assert torch.equal(native.ntt_inverse(torch.tensor(evaluated), q, tables, level), x)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_levels_are_ordered_and_checked_against_the_cpu() -> None:
    supported = native.supported_levels()
    assert supported == native.LEVELS[: len(supported)]  # each level needs the CPU of the one below
    assert native.LEVELS == ("scalar", "avx2", "dq", "ifma")
    assert [native.LEVEL_CODES[name] for name in native.LEVELS] == [0, 1, 2, 3]
    flags = _cpu_flags()
    if {"avx2", "fma"} <= flags:  # every AVX2 server CPU (and every AVX-512 one) runs the AVX2 level
        assert "avx2" in supported
    if flags and "avx512f" not in flags:  # no AVX-512: AVX2 is the best level, chosen by default
        assert supported[-1] == ("avx2" if {"avx2", "fma"} <= flags else "scalar")
    x = torch.zeros(1, 16, dtype=torch.int64)
    q = torch.tensor([ntt_primes(30, 16, 1)[0]])
    for name in native.LEVELS[len(supported) :]:  # a level this CPU lacks is refused, never run
        with pytest.raises(RuntimeError, match="this CPU lacks"):
            torch.ops.fhelium.mul_mod(x, x, q, native.LEVEL_CODES[name])
    with pytest.raises(RuntimeError, match="unknown dispatch level"):
        torch.ops.fhelium.mul_mod(x, x, q, 7)


def _fake_build(cache: Path, digest: str, age_s: float, *, lock: bool = False) -> Path:
    directory = cache / f"torch2.13.0_cpu-py311-{digest}"
    directory.mkdir(parents=True)
    (directory / f"fhelium_native_{digest}.so").write_bytes(b"")
    if lock:
        (directory / "lock").write_bytes(b"")
    when = time.time() - age_s
    os.utime(directory, (when, when))
    return directory


def test_pruning_removes_only_builds_unused_for_a_day(tmp_path: Path) -> None:
    day = native.STALE_AFTER_S
    current = _fake_build(tmp_path, "0123456789abcdef", 100)
    stale = _fake_build(tmp_path, "1111111111111111", day + 1000)
    recent = _fake_build(tmp_path, "4444444444444444", 2000)  # e.g. a CI run on another commit
    newer = _fake_build(tmp_path, "2222222222222222", 10)
    building = _fake_build(tmp_path, "3333333333333333", day + 1000, lock=True)  # cpp_extension's lock
    unrelated = tmp_path / "notes"
    unrelated.mkdir()
    os.utime(unrelated, (0, 0))
    assert native.prune_stale_builds(current) == [stale]
    assert all(path.exists() for path in (current, recent, newer, building, unrelated))
    assert not stale.exists()
    assert native.prune_stale_builds(current) == []  # idempotent
    assert native.prune_stale_builds(current, unused_for_s=0) == [recent]
    assert native.prune_stale_builds(tmp_path / "torch-py-missing") == []  # no current build: nothing


def test_loading_marks_the_build_used(tmp_path: Path) -> None:
    """A process that only loads the cached library refreshes its directory, so another checkout's
    new build does not count it stale while it is in use.
    """
    directory = native.build_directory()
    assert directory.exists()
    os.utime(directory, (0, 0))
    script = "from fhelium import native; assert native.load()"
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", script], env=environment, check=True, timeout=300)
    assert directory.stat().st_mtime > time.time() - 600


def test_the_cache_key_covers_the_included_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = native.build_directory()
    assert before.parent == native.cache_root() and all(path.exists() for path in native.INCLUDES)
    edited = tmp_path / native.INCLUDES[0].name
    edited.write_bytes(native.INCLUDES[0].read_bytes() + b"// edited\n")
    monkeypatch.setattr(native_build, "INCLUDES", (edited,))  # where build_directory() reads it
    assert native.build_directory() != before and native.build_directory().parent == before.parent


def test_the_cache_key_covers_where_the_sources_are(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Byte-identical sources in another checkout get a build of their own: cpp_extension's build file names
    the sources' paths, so a shared directory was recompiled (~13 s) whenever another checkout had loaded it.
    """
    before = native.build_directory()
    copies = []
    for source in (*native_build.SOURCES, *native.INCLUDES):
        copy = tmp_path / "csrc" / source.name
        copy.parent.mkdir(exist_ok=True)
        copy.write_bytes(source.read_bytes())
        copies.append(copy)
    monkeypatch.setattr(native_build, "SOURCES", tuple(copies[: len(native_build.SOURCES)]))
    monkeypatch.setattr(native_build, "INCLUDES", tuple(copies[len(native_build.SOURCES) :]))
    assert native.build_directory() != before and native.build_directory().parent == before.parent


@pytest.mark.parametrize("level", _levels())
def test_non_contiguous_inputs(level: str) -> None:
    n = 1024
    moduli = _moduli(n, 3)
    (q, tables), reference = _native_and_reference(n, moduli)
    wide = _random(moduli, 2 * n, (2,), seed=9)  # residues of the smaller primes are still < q per row
    wide = torch.remainder(wide, torch.tensor(moduli).unsqueeze(-1))
    strided = wide[..., ::2]  # stride 2 along N
    assert not strided.is_contiguous()
    assert torch.equal(
        native.ntt_forward(strided, q, tables, level), reference.forward(strided.contiguous(), (0, 1, 2))
    )
    batch_last = (
        _random(moduli, n, (4,), seed=10).transpose(0, 1).contiguous().transpose(0, 1)
    )  # [4, 3, n] view
    assert not batch_last.is_contiguous()
    assert torch.equal(
        native.ntt_inverse(batch_last, q, tables, level),
        reference.inverse(batch_last.contiguous(), (0, 1, 2)),
    )


def test_levels_agree_with_each_other_on_a_batch() -> None:
    n = 1 << 12
    moduli = _moduli(n, 6)
    q, tables = native.ntt_tables(moduli, [primitive_root_of_unity(2 * n, p) for p in moduli], n)
    x = _random(moduli, n, (8,), seed=11)
    results = [native.ntt_forward(x, q, tables, level) for level in _levels()]
    assert all(torch.equal(results[0], other) for other in results[1:])


def test_the_engine_ntt_uses_native_ops_and_matches_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(native.LEVEL_ENVIRONMENT_VARIABLE, raising=False)
    n = 1 << 11
    moduli = _moduli(n, 4)
    with_native = NegacyclicNtt(n, moduli, torch.device("cpu"))
    reference = NegacyclicNtt(n, moduli, torch.device("cpu"), native=False)
    assert with_native.native_level == native.level() != "torch"
    assert reference.native_level == "torch"
    x = _random(moduli, n, (2,), seed=12)
    for ids in ((0, 1, 2, 3), (1, 2), (3, 0, 2), (2,)):
        rows = x[..., list(ids), :]
        assert torch.equal(with_native.forward(rows, ids), reference.forward(rows, ids))
        assert torch.equal(with_native.inverse(rows, ids), reference.inverse(rows, ids))


@pytest.mark.parametrize(
    "shapes", [((3, 64), (3, 64), (3, 1)), ((2, 1, 3, 64), (4, 3, 64), (3, 1)), ((3, 64), (64,), (3, 1))]
)
def test_mul_mod_and_mul_add_mod_match_the_reference(
    shapes: tuple[tuple[int, ...], ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    def reference(a: torch.Tensor, b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        with monkeypatch.context() as patch:
            patch.setenv(native.LEVEL_ENVIRONMENT_VARIABLE, "torch")  # the pure-torch mul_mod
            return mul_mod(a, b, q, 1.0 / q.double())

    moduli = _moduli(64, 3)
    q = torch.tensor(moduli).view(3, 1)
    generator = torch.Generator().manual_seed(13)

    def residues(shape: tuple[int, ...]) -> torch.Tensor:  # shape [..., 3, 64]: row r below moduli[r]
        return torch.remainder(torch.randint(0, 1 << 62, shape, generator=generator), q)

    a, b = (
        residues(shapes[0]),
        torch.remainder(torch.randint(0, 1 << 62, shapes[1], generator=generator), min(moduli)),
    )
    c = residues(shapes[0])
    expected = reference(a, b, q)
    assert torch.equal(native.mul_mod(a, b, q), expected)
    assert torch.equal(native.mul_add_mod(a, b, c, q), torch.remainder(expected + c, q))
    # non-contiguous operands and the extremes q - 1
    top = (q - 1).expand(3, 64)
    assert torch.equal(native.mul_mod(top, top.t().contiguous().t(), q), reference(top, top, q))
    # the engine's mul_mod runs the native op unless FHELIUM_NATIVE_LEVEL=torch
    assert torch.equal(mul_mod(a, b, q, 1.0 / q.double()), expected)


@pytest.mark.parametrize("level", _levels())
def test_mul_mod_beyond_the_vector_lanes_follows_the_reference_formula(
    level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A modulus above 2^50 or operands not below q (outside the binary64 lanes of the AVX2 level)
    take the reference's formula: the same bits as the torch path at every level.
    """
    q = torch.tensor([[(1 << 61) - 1], [(1 << 40) - 87], [(1 << 50) - 27]])
    generator = torch.Generator().manual_seed(17)
    a = torch.randint(0, 1 << 50, (3, 64), generator=generator)
    b = torch.randint(0, 1 << 50, (3, 64), generator=generator)
    a[2] %= q[2]
    b[2] %= q[2]
    b[2, 5] = q[2, 0]  # one lane at q itself: its four take the scalar formula, the rest stay vector
    with monkeypatch.context() as patch:
        patch.setenv(native.LEVEL_ENVIRONMENT_VARIABLE, "torch")
        expected = mul_mod(a, b, q, 1.0 / q.double())
    assert torch.equal(native.mul_mod(a, b, q, level=level), expected)


def test_ops_have_fake_implementations() -> None:
    n = 64
    moduli = _moduli(n, 2)
    q, tables = native.ntt_tables(moduli, [primitive_root_of_unity(2 * n, p) for p in moduli], n)
    x = _random(moduli, n, (2,), seed=14)
    level = native.LEVEL_CODES[native.supported_levels()[-1]]
    torch.library.opcheck(torch.ops.fhelium.ntt_forward.default, (x, q, tables, level))
    torch.library.opcheck(torch.ops.fhelium.ntt_inverse.default, (x, q, tables, level))
    column = q.view(2, 1)
    torch.library.opcheck(torch.ops.fhelium.mul_mod.default, (x, x, column))
    torch.library.opcheck(torch.ops.fhelium.mul_add_mod.default, (x, x, x, column))


def test_level_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.LEVEL_ENVIRONMENT_VARIABLE, "torch")
    assert native.level() == "torch"
    assert NegacyclicNtt(16, _moduli(16, 1), torch.device("cpu")).native_level == "torch"
    monkeypatch.setenv(native.LEVEL_ENVIRONMENT_VARIABLE, "scalar")
    assert native.level() == "scalar"
    assert NegacyclicNtt(16, _moduli(16, 1), torch.device("cpu")).native_level == "scalar"
    monkeypatch.setenv(native.LEVEL_ENVIRONMENT_VARIABLE, "avx9000")
    with pytest.raises(ValueError, match="FHELIUM_NATIVE_LEVEL"):
        native.level()


def _run_without_compiler(tmp_path: Path, *, require: bool) -> subprocess.CompletedProcess[str]:
    environment = {
        **os.environ,
        "CXX": "/bin/false",  # every compile fails
        native.CACHE_ENVIRONMENT_VARIABLE: str(tmp_path / "cache"),  # nothing cached there
        native.REQUIRE_ENVIRONMENT_VARIABLE: "1" if require else "0",
        "PYTHONPATH": str(ROOT),
    }
    environment.pop(native.LEVEL_ENVIRONMENT_VARIABLE, None)
    script = (
        "import warnings, torch\nwarnings.simplefilter('always')\nfrom fhelium.engine.ntt import "
        "NegacyclicNtt\nfrom fhelium.engine.primes import ntt_primes\nwith "
        "warnings.catch_warnings(record=True) as caught:\n    ntt = NegacyclicNtt(16, ntt_primes(30, 16, "
        "1), torch.device('cpu'))\n    NegacyclicNtt(16, ntt_primes(30, 16, 1), torch.device('cpu'))\nx = "
        "torch.arange(16).view(1, 16)\nassert torch.equal(ntt.inverse(ntt.forward(x, (0,)), (0,)), "
        "x)\nprint(ntt.native_level, len([w for w in caught if 'native kernels unavailable' in "
        "str(w.message)]))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=300
    )


def test_without_a_compiler_the_torch_path_runs_with_one_warning(tmp_path: Path) -> None:
    result = _run_without_compiler(tmp_path, require=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["torch", "1"]


def test_require_native_turns_the_fallback_into_an_error(tmp_path: Path) -> None:
    result = _run_without_compiler(tmp_path, require=True)
    assert result.returncode != 0
    assert "NativeUnavailableError" in result.stderr and "FHELIUM_REQUIRE_NATIVE=1" in result.stderr


@pytest.mark.parametrize(
    ("rows", "bits", "n"),
    [(1, 50, 64), (3, 50, 600), (4, 50, 512), (9, 40, 1030), (130, 50, 256), (7, 61, 64), (13, 62, 64)],
)
def test_project_rows_is_the_exact_projection_for_every_prime_size_and_row_count(
    rows: int, bits: int, n: int
) -> None:
    # Σ_r w[r, l]·x[r, l, n] mod q_l against Python's big integers: rows not a multiple of the kernel's four,
    # coefficient counts not a multiple of its block, primes up to 62 bits (the accumulator is folded back
    # below q every few rows there), and the extremes q - 1
    q = [(1 << bits) - 57, (1 << (bits - 1)) + 3]
    generator = torch.Generator().manual_seed(rows * 1000 + bits)
    moduli = torch.tensor(q)
    x = torch.remainder(torch.randint(0, 1 << 62, (rows, 2, n), generator=generator), moduli.view(1, 2, 1))
    w = torch.remainder(torch.randint(0, 1 << 62, (rows, 2), generator=generator), moduli.view(1, 2))
    x[0, :, :3] = (moduli - 1).view(2, 1)
    w[0] = moduli - 1
    out = native.project_rows(x, w, moduli)
    for limb, prime in enumerate(q):
        weights = [int(v) for v in w[:, limb]]
        expected = [
            sum(weights[r] * int(x[r, limb, k]) for r in range(rows)) % prime for k in range(n)
        ]
        assert out[limb].tolist() == expected, (limb, prime)


def test_the_sum_checks_projection_is_the_native_kernel_and_matches_the_torch_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fhelium.multiparty.sumcheck import project, projection_weights

    moduli = torch.tensor(_moduli(1024, 3)).view(3, 1)
    x = _random([int(q) for q in moduli.view(-1)], 1024, (37,), seed=5)
    weights = projection_weights(b"\x01" * 32, moduli, 37)
    native_result = project(x, weights, moduli, 1.0 / moduli.double())
    monkeypatch.setenv(native.LEVEL_ENVIRONMENT_VARIABLE, "torch")  # the pure-torch path
    assert torch.equal(project(x, weights, moduli, 1.0 / moduli.double()), native_result)


@pytest.mark.parametrize(("rows", "n"), [(1, 64), (5, 600), (8, 1030)])
def test_project_rows_checked_is_the_projection_and_flags_any_residue_out_of_range(rows: int, n: int) -> None:
    # the sum checks' one pass: the same projection as project_rows, and "in range" false as soon as a
    # single residue of any row, limb or coefficient is at or above its prime, or negative
    q = [(1 << 50) - 27, (1 << 40) + 15]
    moduli = torch.tensor(q)
    generator = torch.Generator().manual_seed(rows * 7 + n)
    x = torch.remainder(torch.randint(0, 1 << 62, (rows, 2, n), generator=generator), moduli.view(1, 2, 1))
    w = torch.remainder(torch.randint(0, 1 << 62, (rows, 2), generator=generator), moduli.view(1, 2))
    x[-1, 1, -1] = q[1] - 1  # the largest residue in range
    projection, in_range = native.project_rows_checked(x, w, moduli)
    assert in_range is True
    assert torch.equal(projection, native.project_rows(x, w, moduli))
    for row, limb, k, value in [
        (0, 0, 0, q[0]),
        (rows - 1, 1, n - 1, q[1]),
        (rows // 2, 1, n // 2, q[0]),  # in range of the other limb's prime only
        (rows - 1, 0, 3, -1),
        (0, 1, n - 1, (1 << 63) - 1),
    ]:
        changed = x.clone()
        changed[row, limb, k] = value
        assert native.project_rows_checked(changed, w, moduli)[1] is False, (row, limb, k, value)


def test_the_sum_checks_fused_range_check_agrees_with_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from fhelium.multiparty.sumcheck import out_of_range, project_checked, projection_weights

    moduli = torch.tensor(_moduli(1024, 3)).view(3, 1)
    x = _random([int(q) for q in moduli.view(-1)], 1024, (9,), seed=11)
    weights = projection_weights(b"\x02" * 32, moduli, 9)
    lifted = x.clone()
    lifted[4, 2, 100] += int(moduli[2])  # congruent, out of range
    for residues, bad in ((x, False), (lifted, True)):
        projection, flagged = project_checked(residues, weights, moduli, 1.0 / moduli.double())
        assert flagged is bad and out_of_range(residues, moduli) is bad
        with monkeypatch.context() as patch:
            patch.setenv(native.LEVEL_ENVIRONMENT_VARIABLE, "torch")  # the two-pass torch path
            reference, reference_flag = project_checked(residues, weights, moduli, 1.0 / moduli.double())
        assert reference_flag is bad
        assert torch.equal(reference, projection)
