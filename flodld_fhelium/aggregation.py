"""Encrypted aggregation across ranks with one key holder: the workload examples/encrypted_mean.py runs
with ``--keys single``, and bench/aggregate.py times.

Two transports carry the same compiled Program (flodld_fhelium/encrypted_mean.mlir):
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
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fhelium.core import Ciphertext, PublicKey, SecretKey
from fhelium.engine import CkksEngine
from fhelium.engine.parameters import CkksParameters
from flodld_fhelium.errors import (
    AggregationError,
    KeyMismatchError,
    ParameterMismatchError,
    WorldChangedError,
)
from flodld_fhelium.relay import RelayTransport
from flodld_fhelium.transport import KEY_HOLDER, Transport

if TYPE_CHECKING:  # the backend (and xDSL) load only when a Program is linked
    from fhelium.backend import ProgramExecutable

__all__ = [
    "AGGREGATION_PARAMETERS",
    "DEFAULT_ERROR_BOUND",
    "DESCRIPTOR_VERSION",
    "PROGRAM_PATH",
    "Outcome",
    "Say",
    "Timings",
    "aggregate_mean",
    "check_descriptors",
    "check_key_fingerprints",
    "decrypt_mean",
    "descriptor",
    "encrypt_update",
    "expected_mean",
    "headroom",
    "key_fingerprint",
    "link_program",
    "make_update",
    "refuse_differing_records",
]

PROGRAM_PATH = Path(__file__).with_name("encrypted_mean.mlir")
DESCRIPTOR_VERSION = 1
# N = 2^13 (4096 slots), one 50-bit Q prime and a 50-bit special prime: 100 bits of Q·P, far
# inside the 218-bit limit for 128-bit security at this ring. Scale 2^41 gives ~5e-9 absolute
# precision and leaves |sum of the world's values| < q/2 / scale = 2^8 of headroom per slot
# (updates in [-1, 1] from up to 255 ranks; encrypt_update refuses anything that could wrap).
AGGREGATION_PARAMETERS = CkksParameters(
    log_ring_degree=13, scale_bits=41, scale_prime_bits=(), base_prime_bits=50, special_prime_bits=50
)
DEFAULT_ERROR_BOUND = 1e-5


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
