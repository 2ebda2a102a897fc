"""Fake (meta) implementations of the ``torch.ops.fhelium`` ops: the shapes, dtypes and devices of
their results without running them, so that the ops trace under ``torch.compile`` and FakeTensorMode.
``build`` registers them once the library is loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def register() -> None:
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

    def project_rows_fake(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return torch.empty(x.shape[1:], dtype=x.dtype, device=x.device)

    torch.library.register_fake("fhelium::project_rows")(project_rows_fake)

    def project_rows_checked_fake(
        x: torch.Tensor, w: torch.Tensor, q: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return project_rows_fake(x, w, q), torch.empty((), dtype=torch.bool, device=x.device)

    torch.library.register_fake("fhelium::project_rows_checked")(project_rows_checked_fake)

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
