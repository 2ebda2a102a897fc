"""fhelium's native CPU kernels: torch ops in the ``fhelium`` namespace (``torch.ops.fhelium``).

The C++ source (``csrc/fhelium_native.cpp``) is compiled on first use with the machine's C++
compiler against the torch already installed (``torch.utils.cpp_extension.load``: no build
isolation, no download, no ``-march``), into a cache directory keyed by the torch version, the
Python version and a hash of the source and flags; ``make venv`` builds it once during set-up.
Later processes only load the cached library (and mark it used). After compiling a new build, the
cache's other builds not used for a day (``STALE_AFTER_S``) and not being built are removed.

Dispatch levels (``FHELIUM_NATIVE_LEVEL``): ``ifma`` (AVX-512 IFMA52, chosen by default where the
CPU has it), ``dq`` (AVX-512 DQ without IFMA: the scalar level's 64-bit Shoup products in 8 lanes;
the default on AVX-512 CPUs without IFMA), ``avx2`` (AVX2 + FMA, the default without AVX-512:
4 lanes of residues held as binary64 integers, exact through FMA; rows need every q < 2^50, else
they run at ``scalar``), ``scalar`` (portable ``unsigned __int128`` Shoup arithmetic) and
``torch`` (do not use the native ops: the pure-torch reference path in ``fhelium.engine``). Every
native level is bit-identical to the torch reference. Where the extension cannot be built the
engine falls back to the torch path with one warning; ``FHELIUM_REQUIRE_NATIVE=1`` turns that into
an error (CI).
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

LEVEL_ENVIRONMENT_VARIABLE = "FHELIUM_NATIVE_LEVEL"
REQUIRE_ENVIRONMENT_VARIABLE = "FHELIUM_REQUIRE_NATIVE"
CACHE_ENVIRONMENT_VARIABLE = "FHELIUM_NATIVE_CACHE"
LEVELS = ("scalar", "avx2", "dq", "ifma")
LEVEL_CODES = {"scalar": 0, "avx2": 1, "dq": 2, "ifma": 3}
SOURCES = (Path(__file__).parent / "csrc" / "fhelium_native.cpp",)
# included by the sources: part of the cache key, not compiled on their own (named .cpp so that
# the package data pattern csrc/*.cpp ships them)
INCLUDES = (
    Path(__file__).parent / "csrc" / "ntt_avx512.inc.cpp",
    Path(__file__).parent / "csrc" / "ntt_avx2.inc.cpp",
)
# -fopenmp only compiles at::parallel_for's inline OpenMP region; nothing links an OpenMP runtime of
# its own: the GOMP symbols resolve to the one libtorch_cpu already loaded (torch's thread pool).
# -ffp-contract=off: every binary64 multiply and add is rounded separately, as torch's elementwise ops
# round them (the flooding-noise sampler's bit-identity with its reference depends on it)
CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off")
# a cached build not loaded for this long before a new one was compiled is removed then
STALE_AFTER_S = 24 * 3600.0


class NativeUnavailableError(RuntimeError):
    """The native extension could not be built or loaded (and FHELIUM_REQUIRE_NATIVE=1 is set)."""


_lock = threading.Lock()
_state: dict[str, bool | str] = {}


def _source_hash() -> str:
    digest = hashlib.sha256()
    for source in (*SOURCES, *INCLUDES):
        digest.update(source.read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    """The cache holding one build directory per key (``FHELIUM_NATIVE_CACHE`` overrides it)."""
    root = os.environ.get(CACHE_ENVIRONMENT_VARIABLE)
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fhelium" / "native"


def build_directory() -> Path:
    """Where the compiled library lives: keyed by torch version, Python version and source hash."""
    key = f"torch{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}-{_source_hash()}"
    return cache_root() / key.replace("+", "_")


def _is_build_directory(path: Path) -> bool:
    """A directory this module created: named torch<version>-py<version>-<16 hex digits>."""
    name = path.name
    digest = name.rsplit("-", 1)[-1]
    return (
        path.is_dir()
        and not path.is_symlink()
        and name.startswith("torch")
        and "-py" in name
        and len(digest) == 16
        and all(c in "0123456789abcdef" for c in digest)
    )


def prune_stale_builds(current: Path | None = None, *, unused_for_s: float = STALE_AFTER_S) -> list[Path]:
    """Remove the cache's other build directories that were last used (loading one touches it) more
    than ``unused_for_s`` before ``current`` (default: this process's ``build_directory()``); the
    engine runs this after it compiled a new build. Kept: the current key; builds used recently
    (another checkout or interpreter sharing the cache, e.g. a CI run on another commit, may still
    load them); a build in progress (cpp_extension's ``lock`` file); anything not named like a
    build. Returns what was removed; a directory that cannot be removed is left in place.
    """
    import shutil

    current = build_directory() if current is None else current
    try:
        current_time = current.stat().st_mtime
        entries = list(current.parent.iterdir())
    except OSError:
        return []
    removed = []
    for entry in entries:
        if entry.name == current.name or not _is_build_directory(entry) or (entry / "lock").exists():
            continue
        try:
            stale = entry.stat().st_mtime < current_time - unused_for_s
        except OSError:
            continue
        if stale:
            shutil.rmtree(entry, ignore_errors=True)
            if not entry.exists():
                removed.append(entry)
    return removed


def _ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH: add the venv's (pip package ``ninja``) if it is not there."""
    candidates = [Path(sys.executable).parent]
    try:
        import ninja

        candidates.insert(0, Path(ninja.BIN_DIR))
    except ImportError:
        pass
    path = os.environ.get("PATH", "")
    for directory in candidates:
        if (directory / "ninja").exists() and str(directory) not in path.split(os.pathsep):
            os.environ["PATH"] = f"{directory}{os.pathsep}{path}" if path else str(directory)
            return


def _build_and_load(verbose: bool = False) -> None:
    from torch.utils import cpp_extension

    _ninja_on_path()
    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    compiled = not (directory / f"fhelium_native_{_source_hash()}.so").exists()
    cpp_extension.load(
        name=f"fhelium_native_{_source_hash()}",
        sources=[str(source) for source in SOURCES],
        extra_cflags=list(CFLAGS),
        extra_include_paths=sorted({str(include.parent) for include in INCLUDES}),
        build_directory=str(directory),
        is_python_module=False,
        verbose=verbose,
    )
    _register_fakes()
    try:
        os.utime(directory)  # last used now: a build that other processes still load is never stale
    except OSError:
        pass
    if compiled:
        prune_stale_builds(directory)


def _register_fakes() -> None:
    """Meta/fake implementations, so the ops trace under torch.compile and FakeTensorMode."""

    def mul_mod_fake(a: torch.Tensor, b: torch.Tensor, q: torch.Tensor, level: int = 0) -> torch.Tensor:
        shape = torch.broadcast_shapes(a.shape, b.shape, q.shape)  # type: ignore[no-untyped-call]
        return torch.empty(shape, dtype=a.dtype, device=a.device)

    def in_place_fake(a: torch.Tensor, b: torch.Tensor, q: torch.Tensor, level: int = 0) -> None:
        return None

    def mul_add_mod_fake(
        a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, q: torch.Tensor, level: int = 0
    ) -> torch.Tensor:
        shape = torch.broadcast_shapes(a.shape, b.shape, c.shape, q.shape)  # type: ignore[no-untyped-call]
        return torch.empty(shape, dtype=a.dtype, device=a.device)

    def tables_fake(moduli: torch.Tensor, roots: torch.Tensor, n: int) -> torch.Tensor:
        return torch.empty((moduli.shape[0], 4, n), dtype=torch.int64, device=moduli.device)

    torch.library.register_fake("fhelium::mul_mod")(mul_mod_fake)
    torch.library.register_fake("fhelium::mul_add_mod")(mul_add_mod_fake)
    torch.library.register_fake("fhelium::add_mod")(mul_mod_fake)
    torch.library.register_fake("fhelium::sub_mod")(mul_mod_fake)
    torch.library.register_fake("fhelium::add_mod_")(in_place_fake)
    torch.library.register_fake("fhelium::sub_mod_")(in_place_fake)
    torch.library.register_fake("fhelium::ntt_tables")(tables_fake)

    def small_ntt_fake(
        x: torch.Tensor, moduli: torch.Tensor, tables: torch.Tensor, level: int
    ) -> torch.Tensor:
        return torch.empty((*x.shape[:-1], moduli.shape[0], x.shape[-1]), dtype=x.dtype, device=x.device)

    def permute_last_fake(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return torch.empty((*x.shape[:-1], index.shape[0]), dtype=x.dtype, device=x.device)

    torch.library.register_fake("fhelium::small_ntt")(small_ntt_fake)
    torch.library.register_fake("fhelium::signed_ntt")(small_ntt_fake)

    def smudging_noise_fake(
        words: torch.Tensor, constants: torch.Tensor, shift: int, high: float, low: float, level: int
    ) -> torch.Tensor:
        return torch.empty((words.shape[0] // 2,), dtype=words.dtype, device=words.device)

    torch.library.register_fake("fhelium::smudging_noise")(smudging_noise_fake)
    torch.library.register_fake("fhelium::permute_last")(permute_last_fake)

    # The other ops' results have a shape computed from their first tensor, and its dtype and device.
    def shaped_like_first(shape: Callable[[torch.Size], Sequence[int]]) -> Callable[..., torch.Tensor]:
        def fake(first: torch.Tensor, *operands: object) -> torch.Tensor:
            return torch.empty(tuple(shape(first.shape)), dtype=first.dtype, device=first.device)

        return fake

    def one_limb_fewer(x: torch.Size) -> Sequence[int]:
        return (*x[:-2], x[-2] - 1, x[-1])

    result_shapes: dict[str, Callable[[torch.Size], Sequence[int]]] = {
        "ntt_forward": lambda x: x,
        "ntt_inverse": lambda x: x,
        "divide_round": one_limb_fewer,
        "mod_down": one_limb_fewer,
        "decompose": lambda x: (x[-2], *x[:-2], x[-2] + 1, x[-1]),
        "key_switch": lambda x: (2, *x),
        "key_switch_lifted": lambda lifted: (2, *lifted[1:-2], lifted[-2] - 1, lifted[-1]),
        "tensor_product": lambda a: (3, *a[1:]),
    }
    for name, shape in result_shapes.items():
        torch.library.register_fake(f"fhelium::{name}")(shaped_like_first(shape))


def requested_level() -> str:
    """The level named by ``FHELIUM_NATIVE_LEVEL`` (``auto`` when unset)."""
    value = os.environ.get(LEVEL_ENVIRONMENT_VARIABLE, "").strip().lower() or "auto"
    if value not in ("auto", "torch", *LEVELS):
        raise ValueError(
            f"{LEVEL_ENVIRONMENT_VARIABLE}={value!r}: expected one of auto, torch, {', '.join(LEVELS)}"
        )
    return value


def load(*, verbose: bool = False) -> bool:
    """Build (first time) and load the extension; True when the ops are available.

    A failure warns once and returns False, or raises ``NativeUnavailableError`` when
    ``FHELIUM_REQUIRE_NATIVE=1``. The result is remembered for the process.
    """
    with _lock:
        if "loaded" not in _state:
            try:
                _build_and_load(verbose)
                _state["loaded"] = True
            except Exception as error:  # a compiler error, a missing compiler or ninja: fall back
                _state["loaded"] = False
                _state["error"] = f"{type(error).__name__}: {error}"
                if os.environ.get(REQUIRE_ENVIRONMENT_VARIABLE) != "1":
                    warnings.warn(
                        "fhelium native kernels unavailable, using the pure-torch path "
                        f"({str(_state['error'])[:2000]})",
                        RuntimeWarning,
                        stacklevel=2,
                    )
        loaded = bool(_state["loaded"])
    if not loaded and os.environ.get(REQUIRE_ENVIRONMENT_VARIABLE) == "1":
        raise NativeUnavailableError(
            f"{REQUIRE_ENVIRONMENT_VARIABLE}=1 but the native extension failed: {_state['error']}"
        )
    return loaded


def supported_levels() -> tuple[str, ...]:
    """Native levels this CPU can run (empty when the extension is unavailable)."""
    if not load():
        return ()
    best = int(torch.ops.fhelium.best_level())
    return tuple(name for name in LEVELS if LEVEL_CODES[name] <= best)


def level() -> str:
    """The level the engine uses now: ``FHELIUM_NATIVE_LEVEL`` if set, else the best supported,
    ``torch`` when the extension is unavailable.
    """
    wanted = requested_level()
    if wanted == "torch":
        return "torch"
    available = supported_levels()
    if not available:
        return "torch"
    if wanted == "auto":
        return available[-1]
    if wanted not in available:
        raise NativeUnavailableError(
            f"{LEVEL_ENVIRONMENT_VARIABLE}={wanted} but this CPU supports only {available}"
        )
    return wanted


def ntt_tables(
    moduli: Sequence[int], roots: Sequence[int], ring_degree: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(moduli ``[rows]``, tables ``[rows, 4, N]``) for the native NTT; ``roots`` are the ψ per prime."""
    q = torch.tensor(list(moduli), dtype=torch.int64)
    tables = torch.ops.fhelium.ntt_tables(q, torch.tensor(list(roots), dtype=torch.int64), ring_degree)
    return q, tables


def ntt_forward(x: torch.Tensor, moduli: torch.Tensor, tables: torch.Tensor, level: str) -> torch.Tensor:
    result: torch.Tensor = torch.ops.fhelium.ntt_forward(x, moduli, tables, LEVEL_CODES[level])
    return result


def ntt_inverse(x: torch.Tensor, moduli: torch.Tensor, tables: torch.Tensor, level: str) -> torch.Tensor:
    result: torch.Tensor = torch.ops.fhelium.ntt_inverse(x, moduli, tables, LEVEL_CODES[level])
    return result


def elementwise_level() -> str:
    """``level()`` for the elementwise ops, remembered per value of ``FHELIUM_NATIVE_LEVEL`` (they are
    called often, on small tensors too).
    """
    key = f"level:{os.environ.get(LEVEL_ENVIRONMENT_VARIABLE, '')}"
    cached = _state.get(key)
    if not isinstance(cached, str):
        cached = level()
        _state[key] = cached
    return cached


def _code(chosen: str | None) -> int:
    name = elementwise_level() if chosen is None else chosen
    return LEVEL_CODES.get(name, 0)


def mul_mod(a: torch.Tensor, b: torch.Tensor, q: torch.Tensor, level: str | None = None) -> torch.Tensor:
    """(a·b) mod q elementwise with broadcasting, a, b in [0, q) (same result as the torch reference).

    ``level``: ``scalar``, ``avx2`` (4 binary64 lanes where a, b < q < 2^50) or ``dq``/``ifma`` (8 lanes of
    AVX-512 DQ at both); None: ``elementwise_level()``.
    """
    result: torch.Tensor = torch.ops.fhelium.mul_mod(a, b, q, _code(level))
    return result


def mul_add_mod(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, q: torch.Tensor, level: str | None = None
) -> torch.Tensor:
    """(a·b + c) mod q elementwise with broadcasting, a, b, c in [0, q)."""
    result: torch.Tensor = torch.ops.fhelium.mul_add_mod(a, b, c, q, _code(level))
    return result


def add_mod(a: torch.Tensor, b: torch.Tensor, q: torch.Tensor, level: str | None = None) -> torch.Tensor:
    """(a + b) mod q elementwise with broadcasting, a, b in [0, q) (the torch reference's formula)."""
    result: torch.Tensor = torch.ops.fhelium.add_mod(a, b, q, _code(level))
    return result


def sub_mod(a: torch.Tensor, b: torch.Tensor, q: torch.Tensor, level: str | None = None) -> torch.Tensor:
    """(a − b) mod q elementwise with broadcasting, a, b in [0, q)."""
    result: torch.Tensor = torch.ops.fhelium.sub_mod(a, b, q, _code(level))
    return result


def add_mod_(a: torch.Tensor, b: torch.Tensor, q: torch.Tensor, level: str | None = None) -> torch.Tensor:
    """In place ``a = (a + b) mod q`` (a may be a strided view; b and q broadcast to a)."""
    torch.ops.fhelium.add_mod_(a, b, q, _code(level))
    return a


def sub_mod_(a: torch.Tensor, b: torch.Tensor, q: torch.Tensor, level: str | None = None) -> torch.Tensor:
    """In place ``a = (a − b) mod q``."""
    torch.ops.fhelium.sub_mod_(a, b, q, _code(level))
    return a


def divide_round(
    x: torch.Tensor, moduli: torch.Tensor, tables: torch.Tensor, drop: int, *, ntt: bool, level: str
) -> torch.Tensor:
    """``[..., R, N]`` → ``[..., R-1, N]``: round(x / q_drop) over the other R-1 primes (row ``drop``
    removed; 0 is a rescale, R-1 a ModDown). ``ntt``: x is in (and the result stays in) the NTT domain.
    """
    result: torch.Tensor = torch.ops.fhelium.divide_round(x, moduli, tables, drop, ntt, LEVEL_CODES[level])
    return result


def mod_down(
    values: torch.Tensor,
    addend: torch.Tensor | None,
    divided: torch.Tensor | None,
    moduli: torch.Tensor,
    tables: torch.Tensor,
    level: str,
    message: torch.Tensor | None = None,
    message_factors: torch.Tensor | None = None,
) -> torch.Tensor:
    """ModDown with encryption's extra terms: NTT ``values [..., L+1, N]`` over ``moduli`` (L Q primes,
    then P) → round((values + divided) / P) + addend over the Q primes, NTT domain. ``addend``:
    coefficient-domain residues ``[..., L, N]``; ``divided``: small signed integers ``[..., 1, N]``.
    ``message`` (with ``message_factors`` ``[R, L]``, residues in [0, q_i)): R rows of signed integers
    ``[..., R, N]`` with |x| < 2^62 (moduli above 2^28), added to the addend as Σ_r x_r·f_ri mod q_i.
    ``addend`` and ``message`` may also be shaped like ``values[0]``: then they go into the first
    component only (encryption's c0).
    """
    result: torch.Tensor = torch.ops.fhelium.mod_down(
        values, addend, divided, moduli, tables, LEVEL_CODES[level], message, message_factors
    )
    return result


def small_ntt(x: torch.Tensor, moduli: torch.Tensor, tables: torch.Tensor, level: str) -> torch.Tensor:
    """Small signed integers ``[..., N]`` (|x| < every q) → their residues' NTT ``[..., rows, N]``
    (sampling to NTT in one call: the residue is taken inside the transform's first pass).
    """
    result: torch.Tensor = torch.ops.fhelium.small_ntt(x, moduli, tables, LEVEL_CODES[level])
    return result


def signed_ntt(x: torch.Tensor, moduli: torch.Tensor, tables: torch.Tensor, level: str) -> torch.Tensor:
    """Signed integers ``[..., N]`` with |x| < 2^62 (moduli above 2^28) → their residues' NTT
    ``[..., rows, N]``: ``small_ntt`` for values wider than the primes (the flooding noise), the residue
    exact (the same as the reference's ``reduce_signed``: a residue in [0, q) is unique).
    """
    result: torch.Tensor = torch.ops.fhelium.signed_ntt(x, moduli, tables, LEVEL_CODES[level])
    return result


def permute_last(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x.index_select(-1, index)`` for int64 CPU tensors in one native pass (Galois automorphisms)."""
    result: torch.Tensor = torch.ops.fhelium.permute_last(x, index)
    return result


def tensor_product(
    a: torch.Tensor, b: torch.Tensor, moduli: torch.Tensor, level: str | None = None
) -> torch.Tensor:
    """NTT-domain ciphertexts ``[2, ..., L, N]`` → ``[3, ..., L, N]`` = (a0·b0, a0·b1 + a1·b0, a1·b1)
    mod q, limb r modulo ``moduli[r]``, in one pass.
    """
    result: torch.Tensor = torch.ops.fhelium.tensor_product(a, b, moduli, _code(level))
    return result


def decompose(x: torch.Tensor, moduli: torch.Tensor, tables: torch.Tensor, level: str) -> torch.Tensor:
    """NTT ``[..., L, N]`` over ``moduli[:L]`` → ``[L, ..., L+1, N]``: digit j (the centered coefficients
    of row j) lifted to every prime of ``moduli`` (the L Q primes, then P), NTT domain.
    """
    result: torch.Tensor = torch.ops.fhelium.decompose(x, moduli, tables, LEVEL_CODES[level])
    return result


def key_switch(
    x: torch.Tensor,
    key: torch.Tensor,
    key_digits: torch.Tensor,
    key_rows: torch.Tensor,
    moduli: torch.Tensor,
    tables: torch.Tensor,
    level: str,
) -> torch.Tensor:
    """Hybrid key switching in one call: NTT ``x [..., L, N]`` over ``moduli[:L]`` (``moduli`` = the L Q
    primes, then P) → ``[2, ..., L, N]`` = ModDown(Σ_j NTT(lift(digit_j))·key[key_digits[j], :, key_rows]).
    """
    result: torch.Tensor = torch.ops.fhelium.key_switch(
        x, key, key_digits, key_rows, moduli, tables, LEVEL_CODES[level]
    )
    return result


def key_switch_lifted(
    lifted: torch.Tensor,
    key: torch.Tensor,
    key_digits: torch.Tensor,
    key_rows: torch.Tensor,
    moduli: torch.Tensor,
    tables: torch.Tensor,
    level: str,
) -> torch.Tensor:
    """``key_switch`` from already decomposed digits ``[L, ..., L+1, N]`` (see ``decompose``)."""
    result: torch.Tensor = torch.ops.fhelium.key_switch_lifted(
        lifted, key, key_digits, key_rows, moduli, tables, LEVEL_CODES[level]
    )
    return result


def smudging_noise(
    words: torch.Tensor,
    constants: torch.Tensor,
    shift_bits: int,
    high_sigma: float,
    low_sigma: float,
    level: str | None = None,
) -> torch.Tensor:
    """Flooding noise ``[count]`` from ``2·count`` 63-bit keystream words: the same bits as the reference
    ``fhelium.multiparty.noise.smudging_noise_from_words`` (whose module builds ``constants``).
    ``level``: ``scalar`` or ``avx2`` (the scalar loop), ``dq``/``ifma`` (the loop compiled for AVX-512);
    None: ``elementwise_level()``.
    """
    if not load():
        raise NativeUnavailableError(f"the native extension is unavailable: {_state.get('error')}")
    result: torch.Tensor = torch.ops.fhelium.smudging_noise(
        words, constants, shift_bits, high_sigma, low_sigma, _code(level)
    )
    return result


__all__ = [
    "LEVELS",
    "NativeUnavailableError",
    "add_mod",
    "add_mod_",
    "build_directory",
    "cache_root",
    "decompose",
    "divide_round",
    "elementwise_level",
    "key_switch",
    "key_switch_lifted",
    "level",
    "load",
    "mod_down",
    "mul_add_mod",
    "mul_mod",
    "ntt_forward",
    "ntt_inverse",
    "ntt_tables",
    "permute_last",
    "prune_stale_builds",
    "requested_level",
    "signed_ntt",
    "small_ntt",
    "smudging_noise",
    "sub_mod",
    "sub_mod_",
    "supported_levels",
    "tensor_product",
]
