"""How ranks talk during an aggregation: the `Transport` protocol, its control records, and
transport (a), the torch process group. Transport (b), the relays, is `flodld_fhelium.relay`.

Small records (descriptors, key fingerprints, verdicts) are JSON objects capped at
`MAX_RECORD_BYTES` before they are sent and before they are parsed.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import torch

from fhelium.core import PublicKey
from fhelium.engine import CkksEngine
from flodld_fhelium.errors import AggregationError, KeyMismatchError, WorldChangedError

__all__ = [
    "KEY_HOLDER",
    "MAX_RECORD_BYTES",
    "ProcessGroupTransport",
    "Transport",
    "decode_record",
    "encode_record",
]

KEY_HOLDER = 0
MAX_RECORD_BYTES = 64 * 1024


class Transport(Protocol):
    name: str
    rank: int
    world_size: int

    def all_gather_record(self, tag: str, record: dict[str, Any]) -> list[dict[str, Any]]: ...

    def broadcast_public_key(self, key: PublicKey | None, engine: CkksEngine) -> PublicKey: ...

    def world_binding(self, engine: CkksEngine) -> tuple[Any, list[Any]]: ...

    def broadcast_mean(self, mean: torch.Tensor | None, count: int) -> torch.Tensor | None: ...


def encode_record(record: dict[str, Any]) -> bytes:
    data = json.dumps(record, sort_keys=True).encode()
    if len(data) > MAX_RECORD_BYTES:
        raise AggregationError(
            f"a control record of {len(data)} bytes exceeds the {MAX_RECORD_BYTES}-byte cap"
        )
    return data


def decode_record(data: bytes, rank: int) -> dict[str, Any]:
    if len(data) > MAX_RECORD_BYTES:
        raise AggregationError(
            f"rank {rank} sent a control record of {len(data)} bytes (cap {MAX_RECORD_BYTES})"
        )
    value = json.loads(data.decode())
    if not isinstance(value, dict):
        raise AggregationError(f"rank {rank} sent a control record that is not a JSON object")
    return value


class ProcessGroupTransport:
    """Transport (a): torch.distributed (gloo on CPU, NCCL on GPUs) through the controller rendezvous."""

    name = "process-group"

    def __init__(self) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise AggregationError("the process-group transport needs an initialised torch.distributed group")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def all_gather_record(self, tag: str, record: dict[str, Any]) -> list[dict[str, Any]]:
        import torch.distributed as dist

        data = encode_record({"tag": tag, **record})
        padded = torch.zeros(MAX_RECORD_BYTES + 8, dtype=torch.uint8)
        padded[:8] = torch.tensor(list(len(data).to_bytes(8, "little")), dtype=torch.uint8)
        padded[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        try:
            dist.all_gather(gathered, padded)
        except RuntimeError as error:
            raise WorldChangedError(f"a rank left during the {tag!r} exchange: {error}") from error
        records = []
        for rank, raw in enumerate(gathered):
            length = int.from_bytes(bytes(raw[:8].tolist()), "little")
            if length > MAX_RECORD_BYTES:
                raise AggregationError(
                    f"rank {rank} announced a {length}-byte record (cap {MAX_RECORD_BYTES})"
                )
            record_out = decode_record(bytes(raw[8 : 8 + length].tolist()), rank)
            record_out.pop("tag", None)
            records.append(record_out)
        return records

    def broadcast_public_key(self, key: PublicKey | None, engine: CkksEngine) -> PublicKey:
        import fhelium.distributed as fdist

        received = fdist.broadcast_key(key, src=KEY_HOLDER)
        if not isinstance(received, PublicKey):
            raise KeyMismatchError(f"the key holder broadcast a {type(received).__name__}, not a PublicKey")
        return received

    def world_binding(self, engine: CkksEngine) -> tuple[Any, list[Any]]:
        from fhelium.backend import BoundResource, default_registry
        from fhelium.backend.distributed import bind_process_group

        return default_registry(), [bind_process_group(), BoundResource("rns", "rns-moduli", engine)]

    def broadcast_mean(self, mean: torch.Tensor | None, count: int) -> torch.Tensor | None:
        import torch.distributed as dist

        out = mean.clone() if mean is not None else torch.empty(count, dtype=torch.float64)
        dist.broadcast(out, src=KEY_HOLDER)
        return out
