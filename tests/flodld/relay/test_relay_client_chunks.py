"""The rank's relay client deposits in chunks and assembles chunked broadcasts (real relay and data plane).

Ranks are threads with blocking clients (as in test_averaging_modes); the chunk size is small and does not
divide the tensors, and the bundle mixes dtypes, so every broadcast arrives as many chunks.
"""

from __future__ import annotations

import torch

from flodld.fold.base import fold_from_spec

from .test_averaging_modes import Plane, in_thread, plane  # noqa: F401  # the fixture

CHUNK_BYTES = 4099


def bundle(rank: int, step: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(10 * rank + step)
    return (
        torch.randn(5003, generator=generator),
        torch.randn(77, dtype=torch.float16, generator=generator),
        torch.randn(3, 333, dtype=torch.float64, generator=generator),
    )


def test_chunked_deposits_and_broadcasts_give_the_exact_mean_round_after_round(plane: Plane) -> None:  # noqa: F811
    clients = [plane.client(0), plane.client(1)]
    try:
        for client in clients:
            client.chunk_bytes = CHUNK_BYTES

        def rounds(rank: int) -> list[tuple[torch.Tensor, ...]]:
            client = clients[rank]
            return [client.wait_round(client.deposit(bundle(rank, step)), timeout=30) for step in range(3)]

        futures = [in_thread(lambda rank=rank: rounds(rank)) for rank in (0, 1)]
        results = [future.result(60) for future in futures]
        fold = fold_from_spec("mean")
        for step in range(3):
            total = fold.identity(bundle(0, step))
            for rank in (0, 1):  # rank order: the relay's fixed fold order
                total = fold.add(total, bundle(rank, step))
            want = fold.finish(total, 2.0)
            for rank in (0, 1):
                got = results[rank][step]  # type: ignore[index]
                for mine, theirs in zip(got, want, strict=True):
                    assert mine.dtype == theirs.dtype and torch.equal(
                        mine.view(torch.uint8), theirs.view(torch.uint8)
                    )
        assert clients[0].latest is not None and clients[0].latest[0].offset > 0  # the last of several chunks
    finally:
        for client in clients:
            client.close()
