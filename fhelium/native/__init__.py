"""fhelium's native CPU kernels: torch ops in the ``fhelium`` namespace (``torch.ops.fhelium``).

Three modules, re-exported here (``fhelium.native.<name>`` is the public spelling):
``build`` compiles the C++ (``csrc/``) on first use against the installed torch, caches and loads it
and chooses the dispatch level; ``fakes`` registers the ops' fake implementations (for
``torch.compile`` and FakeTensorMode); ``ops`` holds the typed wrappers the engine calls.
``make venv`` builds the extension once during set-up (``python -m fhelium.native``).

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

from fhelium.native.build import (
    CACHE_ENVIRONMENT_VARIABLE,
    CFLAGS,
    INCLUDES,
    LEVEL_CODES,
    LEVEL_ENVIRONMENT_VARIABLE,
    LEVELS,
    REQUIRE_ENVIRONMENT_VARIABLE,
    SOURCES,
    STALE_AFTER_S,
    NativeUnavailableError,
    build_directory,
    cache_root,
    elementwise_level,
    level,
    load,
    prune_stale_builds,
    requested_level,
    supported_levels,
)
from fhelium.native.ops import (
    add_mod,
    add_mod_,
    decompose,
    divide_round,
    key_switch,
    mod_down,
    mul_add_mod,
    mul_mod,
    ntt_forward,
    ntt_inverse,
    ntt_tables,
    permute_last,
    project_rows,
    project_rows_checked,
    signed_ntt,
    small_ntt,
    smudging_noise,
    sub_mod,
    sub_mod_,
    tensor_product,
)

__all__ = [
    "CACHE_ENVIRONMENT_VARIABLE",
    "CFLAGS",
    "INCLUDES",
    "LEVELS",
    "LEVEL_CODES",
    "LEVEL_ENVIRONMENT_VARIABLE",
    "REQUIRE_ENVIRONMENT_VARIABLE",
    "SOURCES",
    "STALE_AFTER_S",
    "NativeUnavailableError",
    "add_mod",
    "add_mod_",
    "build_directory",
    "cache_root",
    "decompose",
    "divide_round",
    "elementwise_level",
    "key_switch",
    "level",
    "load",
    "mod_down",
    "mul_add_mod",
    "mul_mod",
    "ntt_forward",
    "ntt_inverse",
    "ntt_tables",
    "permute_last",
    "project_rows",
    "project_rows_checked",
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
