"""Building, caching and loading the native extension, and choosing its dispatch level.

The C++ source (``csrc/fhelium_native.cpp``, with the ``csrc/*.inc.cpp`` files it includes) is compiled
on first use with the machine's C++ compiler against the torch already installed
(``torch.utils.cpp_extension.load``: no build isolation, no download, no ``-march``), into a cache
directory keyed by the torch version, the Python version and a hash of the sources, the flags and
where the sources and torch are (one build per checkout and venv). Later processes only load the cached
library (and mark it used). After compiling a new build, the cache's
other builds not used for a day (``STALE_AFTER_S``) and not being built are removed.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import warnings
from pathlib import Path

import torch

from fhelium.native import fakes

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
    """The sources' and flags' hash, and where the sources and torch are: cpp_extension's build file names
    both paths, and ninja rebuilds when its command line changes, so two checkouts (or venvs) of the same
    sources sharing one build directory would recompile on every switch between them.
    """
    digest = hashlib.sha256()
    for source in (*SOURCES, *INCLUDES):
        digest.update(source.read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    for place in (*SOURCES, *INCLUDES, Path(torch.__file__)):
        digest.update(b"\0" + str(place.resolve().parent).encode())
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
    fakes.register()
    try:
        os.utime(directory)  # last used now: a build that other processes still load is never stale
    except OSError:
        pass
    if compiled:
        prune_stale_builds(directory)


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


def load_error() -> str | None:
    """Why the extension failed to build or load in this process (None when it loaded or was not tried)."""
    error = _state.get("error")
    return error if isinstance(error, str) else None


def code(chosen: str | None) -> int:
    """The op argument for a level name (None: ``elementwise_level()``)."""
    name = elementwise_level() if chosen is None else chosen
    return LEVEL_CODES.get(name, 0)
