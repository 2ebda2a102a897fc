"""Negacyclic number-theoretic transform over many residue rows at once.

Forward: twist by ψ^j (ψ a primitive 2N-th root), then a radix-2 Stockham (autosort) cyclic NTT
with ω = ψ². Every stage reads two contiguous halves and writes one contiguous interleaved
tensor, so all elementwise kernels run on dense memory with precomputed per-stage twiddles
expanded to ``[rows, N/2]``. The output is in natural order: entry t is the polynomial
evaluated at ψ^(2t+1). The inverse runs the same stages with ω⁻¹ and folds N⁻¹ into the
untwist by ψ^-j.

That torch code is the reference and the fallback: on CPU the transform runs through the native
ops of ``fhelium.native`` (Harvey/Shoup butterflies, scalar or AVX-512 IFMA), which are
bit-identical to it, whenever the extension is available and ``FHELIUM_NATIVE_LEVEL`` is not
``torch``.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from fhelium import native as _native
from fhelium.engine.compiled import compile_kernel, compile_requested
from fhelium.engine.modular import fold_signed_, mul_mod, mul_mod_shoup_signed, normalize_signed
from fhelium.engine.primes import primitive_root_of_unity

CACHE_BLOCK_RESIDUES = 1 << 17
COMPILED_BLOCK_FACTOR = 8
ROW_TABLE_CACHE_SIZE = 16


def _stage(
    x: torch.Tensor, w: torch.Tensor, w_over_q: torch.Tensor, q: torch.Tensor, stride: int
) -> torch.Tensor:
    """One Stockham stage: halves (a, b) → interleave(fold(a + b), (a − b)·w) in blocks of ``stride``."""
    half = x.size(-1) // 2
    a, b = x[..., :half], x[..., half:]
    total = fold_signed_(a + b, q)
    difference = mul_mod_shoup_signed(a - b, w, w_over_q, q)
    shape = (*x.shape[:-1], half // stride, 1, stride)
    return torch.cat((total.view(shape), difference.view(shape)), dim=-2).view(x.shape)


def _stage_fusable(
    x: torch.Tensor, w: torch.Tensor, w_over_q: torch.Tensor, q: torch.Tensor, stride: int
) -> torch.Tensor:
    """``_stage`` written out of place, so that inductor fuses it into one loop (same results)."""
    half = x.size(-1) // 2
    a, b = x[..., :half], x[..., half:]
    q = q.view(-1)[:, None]  # a literal 1, so shape-generic tracing still sees a broadcast
    total = a + b
    total = total - torch.sign(total) * q
    difference = a - b
    estimate = torch.round(difference.double() * w_over_q).long()
    difference = difference * w - estimate * q
    shape = (*x.shape[:-1], half // stride, 1, stride)
    return torch.cat((total.view(shape), difference.view(shape)), dim=-2).view(x.shape)


def _two_stages_fusable(
    x: torch.Tensor,
    w: torch.Tensor,
    w_over_q: torch.Tensor,
    next_w: torch.Tensor,
    next_w_over_q: torch.Tensor,
    q: torch.Tensor,
    stride: int,
) -> torch.Tensor:
    """Two consecutive stages in one compiled call: half the calls, one less pass to memory."""
    return _stage_fusable(_stage_fusable(x, w, w_over_q, q, stride), next_w, next_w_over_q, q, 2 * stride)


@functools.cache
def _compiled_stage() -> Callable[..., torch.Tensor]:
    """The stage compiled once per process (opt-in; the first call compiles for 5-60 s)."""
    return compile_kernel(_stage_fusable)


@functools.cache
def _compiled_two_stages() -> Callable[..., torch.Tensor]:
    return compile_kernel(_two_stages_fusable)


def _powers(base: torch.Tensor, count: int, q: torch.Tensor) -> torch.Tensor:
    """``[rows, count]`` exact powers base^k mod q (k < count, a power of two) by doubling."""
    q_inverse = 1.0 / q.double()
    powers = torch.ones_like(q)
    step = base.clone()
    while powers.size(-1) < count:
        powers = torch.cat((powers, mul_mod(powers, step.expand_as(powers), q, q_inverse)), dim=-1)
        step = mul_mod(step, step, q, q_inverse)
    return powers


class _RowTables:
    """Twist and per-stage twiddle tables for an ordered set of primes, ready to broadcast.

    Stage s of the Stockham transform multiplies block p by ω^(p·2^s), repeated 2^s times to
    a dense ``[rows, N/2]`` table; since ω = ψ², that is ψ^(p·2^(s+1)), a strided slice of the
    twist table.
    """

    def __init__(
        self,
        q: torch.Tensor,
        twist: torch.Tensor,
        untwist: torch.Tensor,
        forward: list[torch.Tensor],
        inverse: list[torch.Tensor],
    ) -> None:
        self.q = q
        q_float = q.double()
        self.twist = twist
        self.twist_over_q = twist.double() / q_float
        self.untwist = untwist
        self.untwist_over_q = untwist.double() / q_float
        self.forward = forward
        self.forward_over_q = [w.double() / q_float for w in forward]
        self.inverse = inverse
        self.inverse_over_q = [w.double() / q_float for w in inverse]

    @classmethod
    def build(cls, moduli: Sequence[int], n: int, device: torch.device) -> _RowTables:
        q = torch.tensor(list(moduli), dtype=torch.int64, device=device).unsqueeze(-1)
        psi = [primitive_root_of_unity(2 * n, prime) for prime in moduli]

        def column(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device).unsqueeze(-1)

        twist = _powers(column(psi), n, q)
        inverse_powers = _powers(
            column([pow(r, -1, prime) for r, prime in zip(psi, moduli, strict=True)]), n, q
        )
        n_inverse = column([pow(n, -1, prime) for prime in moduli])
        untwist = mul_mod(inverse_powers, n_inverse.expand_as(inverse_powers), q, 1.0 / q.double())
        forward, inverse = [], []
        stride = 1
        while stride < n:
            forward.append(twist[:, :: 2 * stride].repeat_interleave(stride, dim=-1).contiguous())
            inverse.append(inverse_powers[:, :: 2 * stride].repeat_interleave(stride, dim=-1).contiguous())
            stride *= 2
        return cls(q, twist, untwist, forward, inverse)

    def select(self, rows: slice | torch.Tensor) -> _RowTables:
        """Tables for a subset of rows: views for a contiguous slice, copies for an index."""

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t[rows] if isinstance(rows, slice) else t.index_select(0, rows)

        selected = _RowTables.__new__(_RowTables)
        for name, value in vars(self).items():
            setattr(selected, name, [pick(t) for t in value] if isinstance(value, list) else pick(value))
        return selected


class NegacyclicNtt:
    """Forward/inverse negacyclic NTT for a fixed ring degree and a catalogue of primes."""

    def __init__(
        self,
        ring_degree: int,
        moduli: Sequence[int],
        device: torch.device,
        *,
        compiled: bool | None = None,
        native: bool | None = None,
    ) -> None:
        """``compiled``: run the butterfly stages through ``torch.compile`` (opt-in accelerator;
        None reads the environment variable ``FHELIUM_COMPILE=1``). Eager is the default and
        the tested reference; both give bit-identical results.

        ``native``: use the native ops (``fhelium.native``) — None: on a CPU device, when the
        torch stages are not compiled, the extension is available and ``FHELIUM_NATIVE_LEVEL``
        is not ``torch``; True: require them; False: the pure-torch path. ``native_level`` says
        which ran (``torch``, ``scalar`` or ``ifma``).
        """
        self.compiled = compile_requested(compiled)
        # fused (compiled) stages make 1-2 passes instead of ~14, so cache blocking matters less
        # than the per-call overhead (~50 µs) that more groups cost
        self.block_residues = CACHE_BLOCK_RESIDUES * (COMPILED_BLOCK_FACTOR if self.compiled else 1)
        self.ring_degree = ring_degree
        self.moduli = tuple(moduli)
        self.device = device
        self._row_cache: OrderedDict[tuple[int, ...], _RowTables] = OrderedDict()
        self.native_level = self._choose_native_level(native)
        self._native_cache: OrderedDict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        if self.native_level != "torch":
            roots = [primitive_root_of_unity(2 * ring_degree, prime) for prime in self.moduli]
            self._native_all = _native.ntt_tables(self.moduli, roots, ring_degree)

    def _choose_native_level(self, native: bool | None) -> str:
        if native is False:
            return "torch"
        if native is None and (self.device.type != "cpu" or self.compiled):
            return "torch"
        if native and self.device.type != "cpu":
            raise ValueError(f"the native NTT runs on CPU tensors only, not {self.device}")
        level = _native.level()
        if native and level == "torch":
            raise _native.NativeUnavailableError("native=True but the native NTT is unavailable or disabled")
        return level

    @functools.cached_property
    def _all(self) -> _RowTables:
        """Tables of the torch path, built on first use (not at all while the native ops run)."""
        return _RowTables.build(self.moduli, self.ring_degree, self.device)

    def _native_tables(self, prime_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(moduli, tables) of the native op for ``prime_ids``.

        Views for consecutive ids, else a cached copy.
        """
        key = tuple(prime_ids)
        cached = self._native_cache.get(key)
        if cached is not None:
            self._native_cache.move_to_end(key)
            return cached
        q, tables = self._native_all
        if key == tuple(range(key[0], key[0] + len(key))):
            cached = (q[key[0] : key[0] + len(key)], tables[key[0] : key[0] + len(key)])
        else:
            index = torch.tensor(key, dtype=torch.int64)
            cached = (q.index_select(0, index), tables.index_select(0, index))
        self._native_cache[key] = cached
        if len(self._native_cache) > ROW_TABLE_CACHE_SIZE:
            self._native_cache.popitem(last=False)
        return cached

    def tables(self, prime_ids: Sequence[int]) -> _RowTables:
        """Row tables for ``prime_ids``: views when the ids are consecutive, else a cached copy.

        Copies are kept in a small LRU so that large rings (stage tables of N/2 per row and
        stage) do not accumulate one full copy per prime subset ever used.
        """
        key = tuple(prime_ids)
        cached = self._row_cache.get(key)
        if cached is not None:
            self._row_cache.move_to_end(key)
            return cached
        # compiled stages get copies: a table view's storage offset would be one more guard
        if not self.compiled and key == tuple(range(key[0], key[0] + len(key))):
            cached = self._all.select(slice(key[0], key[0] + len(key)))
        else:
            cached = self._all.select(torch.tensor(key, dtype=torch.int64, device=self.device))
        self._row_cache[key] = cached
        if len(self._row_cache) > ROW_TABLE_CACHE_SIZE:
            self._row_cache.popitem(last=False)
        return cached

    def _stages(self, x: torch.Tensor, tables: _RowTables, *, inverse: bool) -> torch.Tensor:
        """Radix-2 Stockham stages on signed lazy residues: inputs and outputs in [-q, q]."""
        n = self.ring_degree
        q = tables.q
        twiddles = tables.inverse if inverse else tables.forward
        twiddles_over_q = tables.inverse_over_q if inverse else tables.forward_over_q
        # one leading axis whatever the batch shape, so a compiled stage sees a single rank
        shape = x.shape
        x = x.reshape(-1, shape[-2], n)
        stride, index = 1, 0
        if self.compiled:
            # pairs of stages per call measured 15 % faster than one (docs/fhelium-performance.md)
            pair = _compiled_two_stages()
            while index + 1 < len(twiddles):
                x = pair(
                    x,
                    twiddles[index],
                    twiddles_over_q[index],
                    twiddles[index + 1],
                    twiddles_over_q[index + 1],
                    q,
                    stride,
                )
                stride, index = stride * 4, index + 2
        stage = _compiled_stage() if self.compiled else _stage
        for w, w_over_q in zip(twiddles[index:], twiddles_over_q[index:], strict=True):
            x = stage(x, w, w_over_q, q, stride)
            stride *= 2
        return x.view(shape)

    def _forward_block(self, x: torch.Tensor, tables: _RowTables) -> torch.Tensor:
        twisted = mul_mod_shoup_signed(x.clone(), tables.twist, tables.twist_over_q, tables.q)
        return normalize_signed(self._stages(twisted, tables, inverse=False), tables.q)

    def _inverse_block(self, x: torch.Tensor, tables: _RowTables) -> torch.Tensor:
        y = self._stages(x, tables, inverse=True)
        return normalize_signed(
            mul_mod_shoup_signed(y, tables.untwist, tables.untwist_over_q, tables.q), tables.q
        )

    def _blocked(
        self, x: torch.Tensor, tables: _RowTables, block: Callable[[torch.Tensor, _RowTables], torch.Tensor]
    ) -> torch.Tensor:
        """Run ``block`` on cache-sized groups of leading entries (about 2**17 residues each).

        Each stage streams ~13 elementwise passes over its input; keeping a group in L2
        measured ~1.6x faster than one pass over a large batch (docs/fhelium-performance.md).
        """
        rows_size = x.size(-2) * x.size(-1)
        leading = x.numel() // rows_size
        per_group = max(1, self.block_residues // rows_size)
        if leading <= per_group:
            return block(x, tables)
        flat = x.reshape(leading, x.size(-2), x.size(-1))
        out = torch.empty_like(flat)
        for start in range(0, leading, per_group):
            out[start : start + per_group] = block(flat[start : start + per_group], tables)
        return out.view(x.shape)

    def forward(self, x: torch.Tensor, prime_ids: Sequence[int]) -> torch.Tensor:
        """Coefficients ``[..., rows, N]`` (in [0, q)) → evaluations at ψ^(2t+1), natural order."""
        if self.native_level != "torch":
            return _native.ntt_forward(x, *self._native_tables(prime_ids), self.native_level)
        return self._blocked(x, self.tables(prime_ids), self._forward_block)

    def inverse(self, x: torch.Tensor, prime_ids: Sequence[int]) -> torch.Tensor:
        """Evaluations ``[..., rows, N]`` (in [0, q)) → coefficients in [0, q)."""
        if self.native_level != "torch":
            return _native.ntt_inverse(x, *self._native_tables(prime_ids), self.native_level)
        return self._blocked(x, self.tables(prime_ids), self._inverse_block)
