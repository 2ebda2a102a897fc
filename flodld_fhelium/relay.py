"""Transport (b), through flodld's relays: the tunnel-friendly CPU path.

Ciphertext limbs are deposited at this host's relay and folded per host and across hosts by
flodld's keyless modular fold (``modular:<q,...>``: moduli only); small records go through the
controller's rendezvous store. `RelayGroup` is the `world` resource, `RelayCiphertextAllReduce` the
Backend implementation of ``fhelium_dist.all_reduce_add_ciphertext`` that sums through it, and
`RelayShareChannel` the threshold protocol's share channel. Nothing here ever hands the relays or
the controller a secret key, a key share or a plaintext update.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from fhelium.core import PublicKey
from fhelium.engine import CkksEngine
from fhelium.multiparty.channel import (
    EXCHANGES,
    MemberLostError,
    gather_from_store,
    member_arrivals,
    missing_error,
)
from fhelium.multiparty.encoding import reduce_sum_
from fhelium.multiparty.errors import MissingSharesError
from fhelium.multiparty.keygen import MAX_KEY_SHARE_BYTES
from flodld_fhelium.errors import AggregationError, KeyMismatchError, WorldChangedError
from flodld_fhelium.transport import KEY_HOLDER, decode_record, encode_record

if TYPE_CHECKING:  # the backend (and xDSL) load only when a Program is linked
    from fhelium.backend import BoundResource, OperationInvocation, ResourceRequirement

__all__ = [
    "DEFAULT_SHARE_TIMEOUT_S",
    "RELAY_IMPLEMENTATION",
    "RelayCiphertextAllReduce",
    "RelayGroup",
    "RelayShareChannel",
    "RelayTransport",
]

RELAY_IMPLEMENTATION = "flodld-relay-ciphertext-all-reduce"
DEFAULT_SHARE_TIMEOUT_S = 120.0


class RelayGroup:
    """The `world` resource of transport (b): a modular all-reduce through this host's relay."""

    def __init__(self, rank: int, world_size: int, *, timeout: float | None = None) -> None:
        from flodld.rank.relay_client import relay_client

        self.rank = rank
        self.world_size = world_size
        self.client = relay_client()
        self.timeout = timeout
        self.rounds = 0
        self.bytes_sent = 0

    def reserve(self, nbytes: int) -> bool:
        """Make the relay road ready for all-reduces of up to `nbytes` per rank before the timed part
        (`RelayClient.reserve`: the same-host shared-memory region and the result's memory).
        """
        return self.client.reserve(nbytes)

    def all_reduce_modular(self, value: torch.Tensor, moduli: Sequence[int]) -> torch.Tensor:
        """Every rank's `value` (residues `[..., limb, N]`) summed modulo `moduli[limb]` by the relays."""
        fold = "modular:" + ",".join(str(modulus) for modulus in moduli)
        from flodld.rank.relay_client import RelayClientError

        try:
            round_number = self.client.deposit([value.contiguous()], fold=fold)
            self.bytes_sent += value.numel() * value.element_size()
            (total,) = self.client.wait_round(round_number, self.timeout)
        except (RelayClientError, OSError) as error:
            raise WorldChangedError(f"the relay data plane dropped this rank mid-run: {error}") from error
        latest = self.client.latest
        if latest is None or latest[0].round != round_number:
            raise WorldChangedError(
                f"the relay answered round {round_number} out of order; the data plane was reset"
            )
        contributors = sorted(latest[0].contributors)
        if contributors != list(range(self.world_size)):
            missing = sorted(set(range(self.world_size)) - set(contributors))
            raise WorldChangedError(
                f"the world changed mid-run: round {round_number} folded ranks {contributors} but the world "
                f"has {self.world_size} (rank(s) {missing} left); the partial sum cannot be decrypted into "
                "the mean. Restart the run once every rank is back"
            )
        self.rounds += 1
        return total


class RelayCiphertextAllReduce:
    """`fhelium_dist.all_reduce_add_ciphertext` through flodld's relays: the fold sees moduli only."""

    name = RELAY_IMPLEMENTATION

    def __init__(self, engine: CkksEngine) -> None:
        from xdsl.ir import Operation

        from fhelium.ir.dialects import distributed as dist_dialect

        self.operation_types: tuple[type[Operation], ...] = (dist_dialect.AllReduceAddCiphertextOp,)
        self.engine = engine

    def resource_requirements(self, invocation: OperationInvocation) -> tuple[ResourceRequirement, ...]:
        return ()

    def execute(
        self,
        invocation: OperationInvocation,
        inputs: tuple[torch.Tensor, ...],
        resources: tuple[BoundResource, ...],
    ) -> tuple[torch.Tensor, ...]:
        from fhelium.backend.rns.operations import operand_prime_ids

        (value,) = inputs
        groups = [resource.value for resource in resources if isinstance(resource.value, RelayGroup)]
        if not groups:
            raise AggregationError(
                f"{invocation.operation_name} on the relay needs the 'world' bound to a RelayGroup"
            )
        prime_ids = operand_prime_ids(invocation.operand_types[0], int(value.size(-2)))
        return (groups[0].all_reduce_modular(value, self.engine.moduli_for(prime_ids)),)


class RelayTransport:
    """Transport (b): ciphertexts through the relays, records through the rendezvous store."""

    name = "relay"

    def __init__(self, *, store_timeout: float = 300.0) -> None:
        from datetime import timedelta

        from flodld.rank.env import read_rank_environment
        from flodld.rank.store import ControllerStore

        env = read_rank_environment()
        if env.relay_port is None:
            raise AggregationError(
                "the relay transport needs a CPU averaging mode (cpu_sync/cpu_cadence/cpu_async): this host "
                "has no relay; use --transport process-group or set controller.averaging to a cpu_* mode"
            )
        self.rank = env.rank
        self.world_size = env.world_size
        self.store = ControllerStore.for_rank(env, timeout=timedelta(seconds=store_timeout))
        self.group = RelayGroup(env.rank, env.world_size)
        # One tiny round first: the relay and the controller load their fold machinery on the first
        # deposit, which would otherwise be billed to the aggregation's timing.
        self.group.all_reduce_modular(torch.zeros(1, 1, dtype=torch.int64), [2])
        self.group.rounds = self.group.bytes_sent = 0

    def reserve(self, nbytes: int) -> bool:
        """Ready the relay road for an all-reduce of `nbytes` per rank (call outside the timed phases)."""
        return self.group.reserve(nbytes)

    def _key(self, tag: str, rank: int) -> str:
        return f"fhelium-aggregation/{tag}/{rank}"

    def all_gather_record(self, tag: str, record: dict[str, Any]) -> list[dict[str, Any]]:
        self.store.set(self._key(tag, self.rank), encode_record(record))
        try:
            return [
                decode_record(self.store.get(self._key(tag, rank)), rank) for rank in range(self.world_size)
            ]
        except TimeoutError as error:
            raise WorldChangedError(
                f"not every rank published its {tag!r} record in time: {error}"
            ) from error

    def broadcast_public_key(self, key: PublicKey | None, engine: CkksEngine) -> PublicKey:
        from fhelium.serialization import value_from_bytes, value_to_bytes

        name = self._key("public-key", KEY_HOLDER)
        if key is not None:
            self.store.set(name, value_to_bytes(key, engine=engine))
            return key
        received = value_from_bytes(self.store.get(name), engine=engine, expected_type="PublicKey")
        if not isinstance(received, PublicKey):
            raise KeyMismatchError(f"the key holder published a {type(received).__name__}, not a PublicKey")
        return received

    def world_binding(self, engine: CkksEngine) -> tuple[Any, list[Any]]:
        from fhelium.backend import BoundResource, default_registry

        registry = default_registry(specialized_ciphertext_add=False)
        registry.register(RelayCiphertextAllReduce(engine))
        return registry, [
            BoundResource("world", "process-group", self.group),
            BoundResource("rns", "rns-moduli", engine),
        ]

    def broadcast_mean(self, mean: torch.Tensor | None, count: int) -> torch.Tensor | None:
        # The decrypted mean stays with the key holder: sending it back would show the controller a plaintext.
        return mean


class RelayShareChannel:
    """Share exchange over flodld: records through the rendezvous store, residues through the relays."""

    def __init__(
        self, transport: RelayTransport, *, session: str, timeout_s: float = DEFAULT_SHARE_TIMEOUT_S
    ) -> None:
        self.transport = transport
        self.rank = transport.rank
        self.world_size = transport.world_size
        self.session = session
        self.timeout_s = timeout_s
        self.bytes_sent = 0
        # t-out-of-N: once a relay round failed (a rank left), sums among members go through the store
        self.relay_failed = False

    def all_gather_bytes(self, tag: str, data: bytes, max_bytes: int = MAX_KEY_SHARE_BYTES) -> list[bytes]:
        store = self.transport.store
        prefix = f"fhelium-threshold/{self.session}/{tag}"
        store.set(f"{prefix}/{self.rank}", data)
        self.bytes_sent += len(data)
        keys = [f"{prefix}/{rank}" for rank in range(self.world_size)]
        try:
            store.wait(keys, timedelta(seconds=self.timeout_s))
        except Exception as error:  # bounded: name whoever never published
            pending = [rank for rank, key in enumerate(keys) if not store.check([key])]
            if not pending:
                raise WorldChangedError(
                    f"the rendezvous store failed during the {tag!r} exchange: {error}"
                ) from error
            raise missing_error(tag, self.world_size, pending, self.timeout_s) from error
        records = [store.get(f"{prefix}/{rank}") for rank in range(self.world_size)]
        for rank, record in enumerate(records):
            if len(record) > max_bytes:
                raise AggregationError(
                    f"rank {rank} published a {len(record)}-byte {tag!r} record (cap {max_bytes})"
                )
        return records

    def all_reduce_residues(self, tag: str, residues: torch.Tensor, moduli: Sequence[int]) -> torch.Tensor:
        """The per-limb modular sum, folded by the relays and the controller (who see residues only)."""
        from flodld.rank.relay_client import RelayClientError

        group = self.transport.group
        fold = "modular:" + ",".join(str(modulus) for modulus in moduli)
        try:
            round_number = group.client.deposit([residues.contiguous()], fold=fold)
            self.bytes_sent += residues.numel() * residues.element_size()
            (total,) = group.client.wait_round(round_number, self.timeout_s)
        except TimeoutError as error:
            raise missing_error(tag, self.world_size, [], self.timeout_s) from error
        except (RelayClientError, OSError) as error:
            raise WorldChangedError(
                f"the relay data plane dropped this rank during {EXCHANGES.get(tag, tag)}: {error}"
            ) from error
        latest = group.client.latest
        contributors = (
            sorted(latest[0].contributors) if latest is not None and latest[0].round == round_number else []
        )
        if contributors != list(range(self.world_size)):
            missing = sorted(set(range(self.world_size)) - set(contributors))
            raise missing_error(tag, self.world_size, missing, None)
        return total

    # ------------------------------------------------------------------ members (t-out-of-N)
    def gather_members(
        self, tag: str, data: bytes, members: Sequence[int], max_bytes: int = MAX_KEY_SHARE_BYTES
    ) -> dict[int, bytes]:
        """The records of the ``members`` that published one within ``timeout_s``, through the store."""
        if len(data) > max_bytes:
            raise AggregationError(f"a {tag!r} record of {len(data)} bytes exceeds the {max_bytes}-byte cap")
        self.bytes_sent += len(data)
        return gather_from_store(
            self.transport.store, f"fhelium-threshold/{self.session}/members/{tag}", self.rank, data, members,
            self.timeout_s, max_bytes,
        )

    def prepare_members(self, members: Sequence[int]) -> None:
        """Nothing to form: the relays fold the whole world, the store serves any subset."""

    def sum_members(
        self, tag: str, residues: torch.Tensor, moduli: Sequence[int], members: Sequence[int]
    ) -> torch.Tensor:
        """The per-limb modular sum among ``members``: the relays' fold while the whole world is there
        and no relay round has failed, else each member's residues through the rendezvous store (every
        member adds them up itself; the controller sees the same residues as with the fold), deleted
        once every member has read them (the store's byte budget, 256 MiB by default, bounds one
        exchange: members × residue bytes).
        """
        members = sorted(members)
        descriptor = f"{list(residues.shape)}/{[str(q) for q in moduli]}".encode()
        arrived = member_arrivals(self.gather_members, tag, descriptor, members, self.timeout_s)
        if any(other != descriptor for other in arrived.values()):
            raise AggregationError(f"the {tag!r} exchange was refused: ranks describe different payloads")
        if members == list(range(self.world_size)) and not self.relay_failed:
            try:
                return self.all_reduce_residues(tag, residues, moduli)
            except (MissingSharesError, WorldChangedError) as error:
                self.relay_failed = True
                raise MemberLostError(f"the relay round of {tag!r} failed: {error}") from error
        blob = residues.contiguous().cpu().numpy().tobytes()
        records = self.gather_members(f"{tag}/residues", blob, members, max_bytes=len(blob))
        missing = [rank for rank in members if rank not in records or len(records[rank]) != len(blob)]
        if missing:
            raise MemberLostError(f"rank(s) {missing} published no residues for {tag!r}", missing)
        total = torch.zeros(residues.shape, dtype=torch.int64)
        for rank in members:
            total += torch.frombuffer(bytearray(records[rank]), dtype=torch.int64).view(residues.shape)
        del records
        # once every member has read them, this rank's residues leave the controller's store (its
        # byte budget would otherwise fill with every round's ciphertexts)
        self.gather_members(f"{tag}/read", b"", members)
        self.transport.store.delete_key(f"fhelium-threshold/{self.session}/members/{tag}/residues/{self.rank}")
        q = torch.tensor(list(moduli), dtype=torch.int64).reshape(-1, 1)
        return reduce_sum_(total, q, len(members)).to(residues.device)
