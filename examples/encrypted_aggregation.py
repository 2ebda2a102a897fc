"""Encrypted aggregation across ranks: the pieces examples/encrypted_mean.py and bench/aggregate.py share.

Two transports carry the same compiled Program (examples/encrypted_mean.mlir):
- `ProcessGroupTransport` (a): a torch process group (gloo/NCCL through the controller rendezvous);
  the key travels with fhelium's typed `broadcast_key`, the sum with `all_reduce_ciphertext`.
- `RelayTransport` (b): the tunnel-friendly CPU path. Ciphertext limbs go through the per-host
  relays to the controller, which folds them with `ModularFold` (moduli only). Small records
  (descriptors, the public key, the verdict) go through the controller's rendezvous store.
  Nothing here ever hands the relays or the controller a secret key or a plaintext update.

The parameter set is chosen for aggregation only (no multiplication): one 50-bit Q prime, so a
ciphertext is 2 limb rows of N residues and addition never needs a rescale.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from fhelium.core import Ciphertext, PublicKey, SecretKey
from fhelium.engine import CkksEngine
from fhelium.engine.parameters import CkksParameters

if TYPE_CHECKING:  # the backend (and xDSL) load only when a Program is linked
    from fhelium.backend import BoundResource, OperationInvocation, ProgramExecutable, ResourceRequirement

PROGRAM_PATH = Path(__file__).with_name("encrypted_mean.mlir")
DESCRIPTOR_VERSION = 1
KEY_HOLDER = 0
MAX_RECORD_BYTES = 64 * 1024
RELAY_IMPLEMENTATION = "flodld-relay-ciphertext-all-reduce"

# N = 2^13 (4096 slots), one 50-bit Q prime and a 50-bit special prime: 100 bits of Q·P, far
# inside the 218-bit limit for 128-bit security at this ring. Scale 2^41 gives ~5e-9 absolute
# precision and leaves |sum of the world's values| < q/2 / scale = 2^8 of headroom per slot
# (updates in [-1, 1] from up to 255 ranks; encrypt_update refuses anything that could wrap).
AGGREGATION_PARAMETERS = CkksParameters(
    log_ring_degree=13, scale_bits=41, scale_prime_bits=(), base_prime_bits=50, special_prime_bits=50
)
DEFAULT_ERROR_BOUND = 1e-5


class AggregationError(RuntimeError):
    """The encrypted aggregation cannot go on; the message says what differed and how to fix it."""


class ParameterMismatchError(AggregationError):
    """Ranks disagree on CKKS parameters or workload shape (found by the descriptor handshake)."""


class KeyMismatchError(AggregationError):
    """A rank encrypts under a public key other than the key holder's."""


class WorldChangedError(AggregationError):
    """A rank left (or the membership changed) while the aggregation was in flight."""


# --------------------------------------------------------------------------- the workload's data


def make_update(rank: int, count: int, seed: int) -> torch.Tensor:
    """A rank's local update (float32, model-like); deterministic so every rank can verify the mean."""
    generator = torch.Generator().manual_seed(seed * 100_003 + rank)
    return torch.rand(count, generator=generator, dtype=torch.float32) * 2 - 1


def expected_mean(world_size: int, count: int, seed: int) -> torch.Tensor:
    """The plaintext mean of every rank's update, in float64: the demo's oracle, never sent anywhere."""
    total = torch.zeros(count, dtype=torch.float64)
    for rank in range(world_size):
        total += make_update(rank, count, seed).double()
    return total / world_size


def headroom(engine: CkksEngine) -> float:
    """Largest |sum| a slot can hold before the centred residue wraps around the last Q prime."""
    return engine.moduli_for(engine.q_ids_at(0))[-1] / 2 / engine.default_scale


def encrypt_update(
    engine: CkksEngine, update: torch.Tensor, public: PublicKey, *, world_size: int = 1
) -> Ciphertext:
    """One batched ciphertext `[2, batch, limb, N]` holding `update` in consecutive slot rows."""
    largest = float(update.abs().max()) if update.numel() else 0.0
    if largest * world_size >= headroom(engine):
        raise AggregationError(
            f"|update| reaches {largest:.3g}; summed over {world_size} rank(s) it may exceed the "
            f"{headroom(engine):.0f} a slot holds at scale 2^{math.log2(engine.default_scale):.0f}: scale "
            "the updates down (e.g. clip them) or use parameters with a larger Q prime or a smaller scale"
        )
    slots = engine.slot_count
    rows = max(1, -(-update.numel() // slots))
    padded = torch.zeros(rows * slots, dtype=torch.float64)
    padded[: update.numel()] = update.double()
    return engine.encode_encrypt(padded.view(rows, slots), public)


def decrypt_mean(
    engine: CkksEngine, total: Ciphertext, secret: SecretKey, count: int, world_size: int
) -> torch.Tensor:
    """Decrypt the world's sum and divide by the world size (only the key holder can)."""
    slots = engine.decrypt_decode(total, secret).real
    return slots.reshape(-1)[:count] / world_size


# --------------------------------------------------------------------------- descriptor handshake


def descriptor(engine: CkksEngine, *, values: int, transport: str, program: str) -> dict[str, Any]:
    """Everything ranks must agree on before a single ciphertext is added."""
    return {
        "version": DESCRIPTOR_VERSION,
        "ring_degree": engine.ring_degree,
        "moduli": list(engine.moduli),
        "scale": engine.default_scale,
        "values": values,
        "transport": transport,
        "program_sha256": hashlib.sha256(program.encode()).hexdigest(),
    }


def check_descriptors(records: Sequence[dict[str, Any]]) -> None:
    """Refuse (identically on every rank) when any rank's descriptor differs from the key holder's."""
    refuse_differing_records(
        records,
        reference_rank=KEY_HOLDER,
        reference_label="key holder",
        what="aggregation parameters",
        arguments="--values, parameters",
    )


def refuse_differing_records(
    records: Sequence[dict[str, Any]], *, reference_rank: int, reference_label: str, what: str, arguments: str
) -> None:
    """ParameterMismatchError naming every field in which a rank's record differs from `reference_rank`'s."""
    reference = records[reference_rank]
    problems = []
    for rank, record in enumerate(records):
        differing = sorted(
            name for name in reference.keys() | record.keys() if reference.get(name) != record.get(name)
        )
        if differing:
            detail = ", ".join(
                f"{name}={record.get(name)!r} ({reference_label}: {reference.get(name)!r})"
                for name in differing
            )
            problems.append(f"rank {rank}: {detail}")
    if problems:
        raise ParameterMismatchError(
            f"ranks disagree on the {what}: "
            + "; ".join(problems)
            + f". Start every rank with the same program version and arguments ({arguments})."
        )


def key_fingerprint(public: PublicKey) -> str:
    return hashlib.sha256(public.data.contiguous().numpy().tobytes()).hexdigest()


def check_key_fingerprints(fingerprints: Sequence[str]) -> None:
    reference = fingerprints[KEY_HOLDER]
    wrong = [rank for rank, print_ in enumerate(fingerprints) if print_ != reference]
    if wrong:
        raise KeyMismatchError(
            f"rank(s) {wrong} would encrypt under public key(s) {[fingerprints[r][:16] for r in wrong]}, "
            f"but the key holder (rank {KEY_HOLDER}) holds {reference[:16]}; every rank must use the key the "
            "key holder broadcast, or the sum cannot be decrypted"
        )


# --------------------------------------------------------------------------- transports


class Transport(Protocol):
    name: str
    rank: int
    world_size: int

    def all_gather_record(self, tag: str, record: dict[str, Any]) -> list[dict[str, Any]]: ...

    def broadcast_public_key(self, key: PublicKey | None, engine: CkksEngine) -> PublicKey: ...

    def world_binding(self, engine: CkksEngine) -> tuple[Any, list[Any]]: ...

    def broadcast_mean(self, mean: torch.Tensor | None, count: int) -> torch.Tensor | None: ...


def _encode_record(record: dict[str, Any]) -> bytes:
    data = json.dumps(record, sort_keys=True).encode()
    if len(data) > MAX_RECORD_BYTES:
        raise AggregationError(
            f"a control record of {len(data)} bytes exceeds the {MAX_RECORD_BYTES}-byte cap"
        )
    return data


def _decode_record(data: bytes, rank: int) -> dict[str, Any]:
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

        data = _encode_record({"tag": tag, **record})
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
            record_out = _decode_record(bytes(raw[8 : 8 + length].tolist()), rank)
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
        self.store = ControllerStore(
            env.controller_host,
            env.controller_port,
            env.salt,
            env.run_id,
            rank=env.rank,
            timeout=timedelta(seconds=store_timeout),
        )
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
        self.store.set(self._key(tag, self.rank), _encode_record(record))
        try:
            return [
                _decode_record(self.store.get(self._key(tag, rank)), rank) for rank in range(self.world_size)
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


# --------------------------------------------------------------------------- the workload


@dataclass
class Timings:
    phases: dict[str, float] = field(default_factory=dict)

    def measure(self, name: str, started: float) -> float:
        elapsed = time.perf_counter() - started
        self.phases[name] = self.phases.get(name, 0.0) + elapsed
        return elapsed


@dataclass
class Outcome:
    rank: int
    world_size: int
    values: int
    max_error: float
    bound: float
    ok: bool
    timings: Timings
    ciphertext_bytes: int
    checked_locally: bool


Say = Callable[[str], None]


def link_program(
    transport: Transport, engine: CkksEngine, *, lower: bool, reserve: int = 0
) -> ProgramExecutable:
    """The Program linked to the transport's world. `reserve`: bytes per rank of the all-reduce to come,
    readied now on the relay road (`RelayTransport.reserve`) so that the timed all-reduce does not set up
    the shared-memory region.
    """
    from fhelium.backend import OperationBackend
    from fhelium.compile import Pipeline
    from fhelium.compile.passes import LowerSpecializedCollectivesPass
    from fhelium.ir import Program

    program = Program.load(PROGRAM_PATH)
    if lower:
        if transport.name == "relay":
            raise AggregationError(
                "--lower needs the process-group transport: the generic all_reduce runs a combine region on "
                "every rank, while the relay path folds on the controller, which only adds residues"
            )
        program, _ = Pipeline([LowerSpecializedCollectivesPass()]).run(program)
    registry, resources = transport.world_binding(engine)
    if reserve and isinstance(transport, RelayTransport):
        transport.reserve(reserve)
    return OperationBackend(registry, resources).link(program)


def aggregate_mean(
    transport: Transport,
    *,
    values: int,
    seed: int = 2026,
    bound: float = DEFAULT_ERROR_BOUND,
    lower: bool = False,
    parameters: CkksParameters = AGGREGATION_PARAMETERS,
    say: Say = lambda message: None,
    public_key_hook: Callable[[PublicKey, CkksEngine], PublicKey] | None = None,
    before_reduce: Callable[[], None] | None = None,
    audit: Callable[[str, torch.Tensor], None] | None = None,
) -> Outcome:
    """The whole workload on this rank; raises AggregationError subclasses on handshake/world failures.

    The hooks exist so tests can play a misbehaving rank (wrong key, leaving mid-run) on the real path,
    and `audit(name, tensor)` lets a test compare what crossed the controller with what the ranks held.
    """

    def record(name: str, tensor: torch.Tensor) -> None:
        if audit is not None:
            audit(name, tensor)

    rank, world = transport.rank, transport.world_size
    timings = Timings()
    engine = CkksEngine(parameters)

    started = time.perf_counter()
    check_descriptors(
        transport.all_gather_record(
            "descriptor",
            descriptor(engine, values=values, transport=transport.name, program=PROGRAM_PATH.read_text()),
        )
    )
    timings.measure("handshake", started)
    say(f"descriptor handshake ok: N={engine.ring_degree}, moduli {list(engine.moduli)}, {values} values")

    started = time.perf_counter()
    secret = None
    public: PublicKey | None = None
    if rank == KEY_HOLDER:
        secret = engine.generate_secret_key()
        public = engine.generate_public_key(secret)
        record("secret_key", secret.data)
    # Addition needs no evaluation key (no relinearisation or rotation): only the public key travels.
    public = transport.broadcast_public_key(public, engine)
    if public_key_hook is not None:
        public = public_key_hook(public, engine)
    check_key_fingerprints(
        [record["key"] for record in transport.all_gather_record("key", {"key": key_fingerprint(public)})]
    )
    timings.measure("keys", started)
    say(f"public key from rank {KEY_HOLDER} ({key_fingerprint(public)[:16]}) checked on every rank")

    started = time.perf_counter()
    update = make_update(rank, values, seed)
    ciphertext = encrypt_update(engine, update, public, world_size=world)
    record("update", update)
    record("ciphertext", ciphertext.data)
    elapsed = timings.measure("encrypt", started)
    nbytes = ciphertext.data.numel() * ciphertext.data.element_size()
    say(
        f"encrypted {values} values into {ciphertext.data.shape[1]} ciphertexts ({nbytes / 2**20:.1f} MiB) "
        f"in {elapsed:.2f}s"
    )

    executable = link_program(transport, engine, lower=lower, reserve=nbytes)
    if before_reduce is not None:
        before_reduce()
    started = time.perf_counter()
    try:
        (total,) = executable.run(ciphertext)
    except AggregationError:
        raise
    except RuntimeError as error:
        raise WorldChangedError(f"the all-reduce failed, a rank probably left mid-run: {error}") from error
    elapsed = timings.measure("all_reduce", started)
    record("sum", total.data)
    say(f"all_reduce_add_ciphertext over {world} rank(s) via {transport.name} in {elapsed:.2f}s")

    mean: torch.Tensor | None = None
    if secret is not None:
        started = time.perf_counter()
        mean = decrypt_mean(engine, total, secret, values, world)
        timings.measure("decrypt", started)
    truth = expected_mean(world, values, seed)
    error_here = float((mean - truth).abs().max()) if mean is not None else float("nan")
    shared = transport.broadcast_mean(mean, values)
    checked_locally = shared is not None
    if shared is not None:
        error_here = float((shared - truth).abs().max())
    verdicts = transport.all_gather_record("verdict", {"max_error": error_here if checked_locally else None})
    key_holder_error = verdicts[KEY_HOLDER]["max_error"]
    max_error = error_here if checked_locally else float(key_holder_error)
    ok = max_error <= bound
    return Outcome(rank, world, values, max_error, bound, ok, timings, nbytes, checked_locally)
