"""Chunks of a bundle: where a bundle's bytes split, and which tensor elements a chunk holds.

A bundle's bytes are its tensors' bytes concatenated in order (what an unchunked frame's tail carries).
A chunk is the byte range [offset, offset + length) of them; it starts and ends on element boundaries,
so each chunk is a list of `Piece`s: runs of whole elements of one tensor. `Layout.ranges` splits at a
chunk size every sender uses alike (the receiving hop checks that members agree chunk by chunk).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from flodld.fold.base import Bundle, Span
from flodld.fold.codec import TORCH_DTYPES, CodecError, check_shape
from flodld.wire.data import TensorSpec

# Every chunk costs each hop a frame and each process a wake-up; on a busy host those, not the bytes,
# dominate below a few MiB (bench/relay.py, in alternation: 16 and 64 MiB rounds took 0.5-0.9x as long
# at 4 MiB as at 1 MiB). 4 MiB keeps a 16 MiB round pipelined in four chunks.
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
CHUNK_BYTES_ENV = "FLODL_CHUNK_BYTES"
MIN_CHUNK_BYTES = 64
# How many chunks' pieces a layout keeps (`Layout.chunk_pieces`): a round barrier reuses its layout round
# after round, and peers may split each round differently.
PIECES_KEPT = 1024


def chunk_bytes_from_env(environ: dict[str, str] | None = None) -> int:
    """The chunk size a rank splits its deposits at: `FLODL_CHUNK_BYTES`, default 4 MiB."""
    import os

    raw = (environ if environ is not None else os.environ).get(CHUNK_BYTES_ENV)
    if not raw:
        return DEFAULT_CHUNK_BYTES
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{CHUNK_BYTES_ENV}={raw!r} is not a whole number of bytes") from None
    if value < MIN_CHUNK_BYTES:
        raise ValueError(f"{CHUNK_BYTES_ENV}={value} is below the minimum of {MIN_CHUNK_BYTES} bytes")
    return value


@dataclass(frozen=True)
class Piece:
    """Elements [span.start, span.start + count) of tensor span.index, at `at` bytes into the chunk."""

    span: Span
    count: int
    at: int
    nbytes: int


@dataclass(frozen=True)
class Run:
    """Consecutive pieces of a chunk of one dtype, side by side in a bundle laid out in one buffer (a
    `FlatBundle`): bytes [at, at + nbytes) of the chunk, [start, start + nbytes) of the bundle. `span` is
    its first piece's (for an elementwise fold, which folds a run as one slice: `Layout.chunk_runs`).
    """

    dtype: torch.dtype
    span: Span
    at: int
    start: int
    nbytes: int


class FlatBundle(tuple[torch.Tensor, ...]):
    """A bundle whose tensors lie side by side in `flat` (1-D uint8) where their layout places them."""

    flat: torch.Tensor


class Layout:
    """The byte layout of a bundle schema (checked like `decode_bundle` checks it)."""

    def __init__(self, specs: Sequence[TensorSpec]) -> None:
        self.specs = tuple(specs)
        self.dtypes: list[torch.dtype] = []
        self.shapes: list[tuple[int, ...]] = []
        self.starts: list[int] = []
        self.itemsizes: list[int] = []
        offset = 0
        for index, spec in enumerate(self.specs):
            check_shape(index, spec)
            dtype = TORCH_DTYPES[spec.dtype]
            self.dtypes.append(dtype)
            self.shapes.append(tuple(spec.shape))
            self.starts.append(offset)
            self.itemsizes.append(dtype.itemsize)
            offset += spec.nbytes()
        self.total = offset
        self._fields = [(spec.dtype, spec.shape) for spec in self.specs]  # what `holds` compares
        self._pieces: dict[tuple[int, int], tuple[Piece, ...]] = {}  # `chunk_pieces`, chunk by chunk
        self._runs: dict[tuple[int, int], tuple[Run, ...]] = {}  # `chunk_runs`, likewise

    def holds(self, specs: Sequence[TensorSpec]) -> bool:
        """Whether `specs` is this layout's schema (`tuple(specs) == self.specs`, compared field by field:
        a TensorSpec is its dtype and shape, and this spares a model comparison per tensor per chunk).
        """
        return [(spec.dtype, spec.shape) for spec in specs] == self._fields

    def empty(self, device: str = "cpu") -> Bundle:
        """Uninitialised tensors of this schema (fresh memory; on "meta": shapes and dtypes only)."""
        return tuple(
            torch.empty(shape, dtype=dtype, device=device)
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )

    def within(self, buffer: torch.Tensor) -> Bundle | None:
        """Tensors of this schema over the bytes of `buffer` (1-D uint8, shared, not copied), or None when
        the bundle does not fit or a tensor would start off its element boundary.
        """
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < self.total:
            return None
        if any(start % itemsize for start, itemsize in zip(self.starts, self.itemsizes, strict=True)):
            return None
        parts = zip(self.starts, self.specs, self.dtypes, self.shapes, strict=True)
        tensors = FlatBundle(
            buffer[start : start + spec.nbytes()].view(dtype).view(shape)
            for start, spec, dtype, shape in parts
        )
        tensors.flat = buffer[: self.total]
        return tensors

    def empty_flat(self) -> Bundle:
        """`empty()` side by side in one buffer (a `FlatBundle`), or `empty()` where a tensor would start
        off its element boundary there.
        """
        tensors = self.within(torch.empty(self.total, dtype=torch.uint8))
        return tensors if tensors is not None else self.empty()

    def ranges(self, chunk_bytes: int) -> list[tuple[int, int]]:
        """(offset, length) of each chunk at about `chunk_bytes` each, ends moved back to element boundaries.

        A bundle with no bytes is one empty chunk.
        """
        if chunk_bytes < max(self.itemsizes, default=1):
            raise ValueError(f"a chunk of {chunk_bytes} bytes cannot hold one element of this bundle")
        if self.total == 0:
            return [(0, 0)]
        out: list[tuple[int, int]] = []
        begin = 0
        index = 0
        while begin < self.total:
            end = min(self.total, begin + chunk_bytes)
            while index + 1 < len(self.starts) and self.starts[index + 1] <= end:
                index += 1
            # Align `end` down to an element of the tensor it falls in (a tensor start is always aligned).
            while self.starts[index] > end:  # pragma: no cover - the walk above never overshoots
                index -= 1
            end -= (end - self.starts[index]) % self.itemsizes[index]
            if end <= begin:  # pragma: no cover - chunk_bytes >= every itemsize rules this out
                raise ValueError("chunk size too small for this bundle")
            out.append((begin, end - begin))
            begin = end
        return out

    def pieces(self, offset: int, length: int) -> list[Piece]:
        """The element runs of chunk [offset, offset + length); CodecError unless on element boundaries."""
        end = offset + length
        if offset < 0 or length < 0 or end > self.total:
            raise CodecError(f"chunk [{offset}, {end}) lies outside the bundle's {self.total} bytes")
        if length == 0 and self.total:
            raise CodecError(f"an empty chunk at offset {offset} of a bundle of {self.total} bytes")
        pieces: list[Piece] = []
        for index, start in enumerate(self.starts):
            size = self.total - start if index + 1 == len(self.starts) else self.starts[index + 1] - start
            lo, hi = max(offset, start), min(end, start + size)
            if lo >= hi:
                continue
            item = self.itemsizes[index]
            if (lo - start) % item or (hi - start) % item:
                raise CodecError(
                    f"chunk [{offset}, {end}) splits an element of tensor {index} "
                    f"({self.specs[index].dtype}); "
                    "chunks start and end on element boundaries"
                )
            span = Span(index=index, shape=self.shapes[index], start=(lo - start) // item)
            pieces.append(Piece(span=span, count=(hi - lo) // item, at=lo - offset, nbytes=hi - lo))
        return pieces

    def chunk_pieces(self, offset: int, length: int) -> tuple[Piece, ...]:
        """`pieces`, kept for the next rounds that split alike (at most `PIECES_KEPT` chunks' worth)."""
        pieces = self._pieces.get((offset, length))
        if pieces is None:
            pieces = tuple(self.pieces(offset, length))
            if len(self._pieces) >= PIECES_KEPT:
                self._pieces.clear()
            self._pieces[(offset, length)] = pieces
        return pieces

    def chunk_runs(self, offset: int, length: int) -> tuple[Run, ...]:
        """`chunk_pieces` joined into runs of one dtype (kept alike): what an elementwise fold folds."""
        runs = self._runs.get((offset, length))
        if runs is None:
            joined: list[Run] = []
            for piece in self.chunk_pieces(offset, length):
                dtype = self.dtypes[piece.span.index]
                if joined and joined[-1].dtype == dtype:
                    last = joined[-1]
                    joined[-1] = Run(dtype, last.span, last.at, last.start, last.nbytes + piece.nbytes)
                else:
                    joined.append(Run(dtype, piece.span, piece.at, offset + piece.at, piece.nbytes))
            runs = tuple(joined)
            if len(self._runs) >= PIECES_KEPT:
                self._runs.clear()
            self._runs[(offset, length)] = runs
        return runs

    def incoming(self, data: memoryview, pieces: Sequence[Piece | Run]) -> list[torch.Tensor]:
        """1-D tensors over `data` (a chunk's bytes, writable: shared, not copied) for each piece."""
        out: list[torch.Tensor] = []
        for piece in pieces:
            raw = torch.frombuffer(data, dtype=torch.uint8, count=piece.nbytes, offset=piece.at)
            out.append(raw.view(self.dtypes[piece.span.index]))
        return out


def run_view(flat: torch.Tensor, run: Run) -> torch.Tensor:
    """The 1-D slice of a `FlatBundle`'s buffer `flat` that `run` covers, as its dtype."""
    return flat[run.start : run.start + run.nbytes].view(run.dtype)


def run_bytes(flat: torch.Tensor, runs: Sequence[Run]) -> list[memoryview]:
    """Byte views (no copy) of the runs of `flat` (a `FlatBundle`'s buffer): a frame's scatter tail."""
    return [memoryview(flat[run.start : run.start + run.nbytes].numpy()) for run in runs]  # type: ignore[arg-type]


def held(tensors: Bundle, piece: Piece) -> torch.Tensor:
    """The 1-D slice of `tensors` (contiguous, this layout's schema) that `piece` covers."""
    return tensors[piece.span.index].view(-1)[piece.span.start : piece.span.start + piece.count]


def byte_views(tensors: Sequence[torch.Tensor], pieces: Sequence[Piece]) -> list[memoryview]:
    """Byte views (no copy) of the slices of `tensors` that `pieces` cover: a frame's scatter tail."""
    views: list[memoryview] = []
    for piece in pieces:
        if piece.nbytes:
            flat = held(tuple(tensors), piece).view(torch.uint8)
            views.append(memoryview(flat.numpy()).cast("B"))  # type: ignore[arg-type]
    return views


def split_parts(parts: Sequence[memoryview], ranges: Sequence[tuple[int, int]]) -> Iterator[list[memoryview]]:
    """Cut the scatter views of a bundle's bytes (`encode_bundle_parts`) into one view list per range."""
    index, inside = 0, 0
    for _, length in ranges:
        chunk: list[memoryview] = []
        left = length
        while left:
            part = parts[index]
            take = min(left, part.nbytes - inside)
            chunk.append(part[inside : inside + take])
            inside += take
            left -= take
            if inside == part.nbytes:
                index, inside = index + 1, 0
        yield chunk


class Prefaulted:
    """Memory faulted in ahead (every page touched now) for the next new bundle of about its size, so that
    bundle's pages are not faulted in one by one on a round's critical path. A bundle of at least half the
    memory takes it (`take`: its tensors over the memory, which is then no longer here); a smaller one, or
    one that does not fit, leaves it for a later one.
    """

    __slots__ = ("buffer",)

    def __init__(self, nbytes: int = 0) -> None:
        self.buffer: torch.Tensor | None = None
        if nbytes:
            self.fault_in(nbytes)

    def holds(self, nbytes: int) -> bool:
        return self.buffer is not None and self.buffer.numel() >= nbytes

    def fault_in(self, nbytes: int) -> None:
        """`nbytes` of fresh memory, in place of what was held (given up first)."""
        self.buffer = None
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        buffer.zero_()
        self.buffer = buffer

    def take(self, layout: Layout) -> Bundle | None:
        buffer = self.buffer
        if buffer is None or 2 * layout.total < buffer.numel():
            return None
        tensors = layout.within(buffer)
        if tensors is not None:
            self.buffer = None  # the bundle's now: never a second one's
        return tensors


class Assembly:
    """A bundle received chunk by chunk (in order): tensors of fresh memory, filled as chunks arrive.

    `memory(layout)`, when given, may offer this schema's tensors instead (e.g. `Prefaulted.take`: over a
    buffer already faulted in); None from it means fresh memory.
    """

    def __init__(
        self, specs: Sequence[TensorSpec], memory: Callable[[Layout], Bundle | None] | None = None
    ) -> None:
        self.layout = Layout(specs)
        tensors = memory(self.layout) if memory is not None else None
        self.tensors = self.layout.empty() if tensors is None else tensors
        self.filled = 0

    def add(self, offset: int, data: memoryview) -> bool:
        """Copy the chunk at `offset` in; True once every byte has arrived. CodecError out of order."""
        if offset != self.filled:
            raise CodecError(f"chunk at offset {offset} but {self.filled} bytes have arrived")
        view = memoryview(data).cast("B")
        pieces = self.layout.pieces(offset, view.nbytes)
        for piece, source in zip(pieces, self.layout.incoming(_writable(view), pieces), strict=True):
            held(self.tensors, piece).copy_(source)
        self.filled += view.nbytes
        return self.filled == self.layout.total


def _writable(view: memoryview) -> memoryview:
    return memoryview(bytearray(view)) if view.readonly and view.nbytes else view
