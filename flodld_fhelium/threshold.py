"""Encrypted mean with no key holder: threshold (N-out-of-N) CKKS on both roads of a flodld run.

Every rank holds a share of the secret key (fhelium.multiparty): the public key is built jointly
from a committed common seed, every rank encrypts its update under it, only the ciphertexts' c1
components are summed, and every rank publishes c0_i + h_i (its own c0, a one-time pad, folded into
its flooded decryption share of the c1 sum); the sum of those decrypts the sum on **every** rank.
Both roads run this fused protocol (``ThresholdSession.aggregate``), and on both every rank checks the
c1 sum it was handed (the same on every rank, and the sum of every rank's c1, by a random projection)
before it publishes anything, and the summed contributions before it decodes: an aggregator that
substitutes, drops, replays or scales ciphertexts, or answers ranks differently, is refused, naming
the round (docs/security.md, "Threshold aggregation"). Key shares, c1 sums and contributions move as
residues:
- relay road: the compiled Program (flodld_fhelium/encrypted_mean.mlir) sums the c1 components (each rank
  hands it its ciphertext with c0 zeroed), deposited at the host relay and folded by the relays and
  the controller with the keyless modular fold (``modular:<q,...>``), then the contributions are
  folded the same way; the seed commitments, reveals and sum checks ride the rendezvous store;
- process-group road: slice k of the rows is summed and decoded on rank k and the decoded slots are
  all-gathered (half the bytes of the unfused exchange, see docs/fhelium-multiparty.md). With
  ``--lower`` the lowered Program sums the c1 components, as on the relay road.

No party, and no coalition short of all other ranks, can decrypt an individual update; the
controller and the relays see residues and the final sum only (docs/tutorial-encrypted-aggregation.md).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fhelium.core import Ciphertext
from fhelium.multiparty import THRESHOLD_AGGREGATION, MultipartyError, ThresholdParameters
from fhelium.multiparty.channel import ProcessGroupChannel, ShareChannel
from fhelium.multiparty.distributed import ThresholdSession
from fhelium.multiparty.keygen import key_fingerprint
from flodld_fhelium.aggregation import (
    DEFAULT_ERROR_BOUND,
    PROGRAM_PATH,
    Outcome,
    Timings,
    expected_mean,
    link_program,
    make_update,
    refuse_differing_records,
)
from flodld_fhelium.errors import AggregationError, MissingSharesAggregationError, WorldChangedError
from flodld_fhelium.relay import DEFAULT_SHARE_TIMEOUT_S, RelayShareChannel, RelayTransport
from flodld_fhelium.transport import Transport

DESCRIPTOR_VERSION = 1
Say = Callable[[str], None]


def share_channel(transport: Transport, *, session: str, timeout_s: float) -> ShareChannel:
    if isinstance(transport, RelayTransport):
        return RelayShareChannel(transport, session=session, timeout_s=timeout_s)
    return ProcessGroupChannel(session=session, timeout_s=timeout_s)


def threshold_descriptor(session: ThresholdSession, *, values: int, transport: str) -> dict[str, Any]:
    engine = session.engine
    parameters = session.party.parameters
    return {
        "version": DESCRIPTOR_VERSION,
        "keys": "threshold",
        "threshold": session.threshold,
        "ring_degree": engine.ring_degree,
        "moduli": list(engine.moduli),
        "message_scale_bits": parameters.message_scale_bits,
        "smudging_sigma_log2": round(float(torch.tensor(parameters.smudging_sigma).log2()), 6),
        "values": values,
        "transport": transport,
        "program_sha256": hashlib.sha256(PROGRAM_PATH.read_text().encode()).hexdigest(),
    }


def check_threshold_descriptors(records: Sequence[dict[str, Any]]) -> None:
    """Refuse (identically on every rank) when any rank's descriptor differs from rank 0's.

    There is no key holder here.
    """
    refuse_differing_records(
        records,
        reference_rank=0,
        reference_label="rank 0",
        what="threshold aggregation parameters",
        arguments="--values, --keys, --threshold",
    )


def _gather_records(channel: ShareChannel, tag: str, record: dict[str, Any]) -> list[dict[str, Any]]:
    import json

    blobs = channel.all_gather_bytes(tag, json.dumps(record, sort_keys=True).encode())
    out = []
    for rank, blob in enumerate(blobs):
        value = json.loads(blob.decode())
        if not isinstance(value, dict):
            raise AggregationError(f"rank {rank} sent a {tag} record that is not a JSON object")
        out.append(value)
    return out


@dataclass
class _MeanRun:
    """What each road to the mean takes: the session, this rank's rows ``[rows, slots]``, the timings,
    the audit hook, the hook before decryption and the progress line. ``nbytes``: this rank's
    ciphertext bytes, counted by ``count``.
    """

    session: ThresholdSession
    rows: torch.Tensor
    timings: Timings
    record: Callable[[str, torch.Tensor], None]
    before_decrypt: Callable[[], None] | None
    say: Say
    nbytes: int = 0

    def count(self, name: str, tensor: torch.Tensor) -> None:
        """``record``, counting the bytes of this rank's ciphertexts on the way."""
        if name == "ciphertext":
            self.nbytes += tensor.numel() * tensor.element_size()
        self.record(name, tensor)

    def aggregate(self) -> tuple[torch.Tensor, float]:
        """``session.aggregate`` of the rows with ``count`` as its audit, timed as the "aggregate" phase."""
        started = time.perf_counter()
        total = self.session.aggregate(self.rows, record=self.count, before_contribution=self.before_decrypt)
        return total, self.timings.measure("aggregate", started)


def _fused_mean(run: _MeanRun, world: int) -> tuple[torch.Tensor, int]:
    """The process-group road's fused protocol (``ThresholdSession.aggregate``): encrypt, sum only the
    c1 components, publish c0_i + h_i, decode one slice per rank, all-gather the decoded slots.
    Returns the flat mean and this rank's ciphertext bytes.
    """
    try:
        total, elapsed = run.aggregate()
    except RuntimeError as error:
        raise WorldChangedError(
            f"the threshold aggregation failed, a rank probably left mid-run: {error}"
        ) from error
    run.say(
        f"fused threshold aggregation over {world} rank(s) via process-group in {elapsed:.2f}s: "
        f"{run.rows.size(0)} ciphertexts ({run.nbytes / 2**20:.1f} MiB) encrypted, c1 summed, "
        f"collective decryption from {world} decryption shares"
    )
    return total.reshape(-1) / world, run.nbytes


def _program_mean(run: _MeanRun, transport: Transport, values: int, lower: bool) -> tuple[torch.Tensor, int]:
    """The relay road (and ``--lower``): the fused protocol with the compiled Program as the c1 sum.

    ``ThresholdSession.aggregate`` hands the Program this rank's ciphertext with c0 zeroed (c0 is
    the rank's one-time pad and never leaves it), the Program's all_reduce_add_ciphertext sums it
    through the relays and the controller (or the process group), and the session checks the
    returned c1 sum against every rank's c1 before any rank publishes c0_i + h_i; the summed
    contributions are checked the same way before decoding. No decryption share is ever made for a
    ciphertext the fold returned. Returns the flat mean and this rank's ciphertext bytes.
    """
    session, rows, timings, say = run.session, run.rows, run.timings, run.say
    world = transport.world_size
    nbytes = 0
    executable: Any = None

    def sum_c1(c1_only: Ciphertext) -> torch.Tensor:
        nonlocal nbytes, executable
        nbytes = c1_only.data.numel() * c1_only.data.element_size()
        executable = link_program(transport, session.engine, lower=lower, reserve=nbytes)
        audit("c1_ciphertext", c1_only.data)
        started = time.perf_counter()
        try:
            (total,) = executable.run(c1_only)
        except AggregationError:
            raise
        except RuntimeError as error:
            raise WorldChangedError(
                f"the all-reduce failed, a rank probably left mid-run: {error}"
            ) from error
        elapsed = timings.measure("all_reduce", started)
        audit("sum", total.data)
        say(
            f"all_reduce_add_ciphertext over {world} rank(s) via {transport.name} in {elapsed:.2f}s "
            "(c1 components only; c0 stays on each rank)"
        )
        summed: torch.Tensor = total.data[1]
        return summed

    started = time.perf_counter()

    def audit(name: str, tensor: torch.Tensor) -> None:
        nonlocal started
        run.record(name, tensor)
        if name == "ciphertext":  # aggregate has just encrypted this rank's rows
            elapsed = timings.measure("encrypt", started)
            say(
                f"encrypted {values} values into {rows.size(0)} ciphertexts "
                f"({tensor.numel() * tensor.element_size() / 2**20:.1f} MiB) in {elapsed:.2f}s"
            )
        elif name == "sum":
            started = time.perf_counter()  # the decryption's time starts once the c1 sum is back

    try:
        total = session.aggregate(rows, record=audit, before_contribution=run.before_decrypt, sum_c1=sum_c1)
    except RuntimeError as error:
        raise WorldChangedError(
            f"the threshold aggregation failed, a rank probably left mid-run: {error}"
        ) from error
    elapsed = timings.measure("decrypt", started)
    say(
        f"collective decryption from {world} decryption shares in {elapsed:.2f}s (fused: c0_i + h_i for "
        "the checked c1 sum; the summed contributions checked before decoding)"
    )
    return total.reshape(-1) / world, nbytes


def _surviving_mean(run: _MeanRun) -> tuple[torch.Tensor, int]:
    """t-out-of-N keys, either road: ``ThresholdSession.aggregate`` sums whole ciphertexts among the ranks
    still there and any t of them decrypt (fhelium.multiparty.dropout). Returns the flat mean over the
    contributors (``session.contributors``) and this rank's ciphertext bytes.
    """
    session = run.session
    total, elapsed = run.aggregate()
    covered = session.contributors
    run.say(
        f"t-out-of-N aggregation (threshold {session.threshold}) in {elapsed:.2f}s: the mean covers the "
        f"inputs of rank(s) {covered} ({len(covered)} of {session.channel.world_size}); decrypted by rank(s) "
        f"{session.alive}"
    )
    return total.reshape(-1) / len(covered), run.nbytes


def aggregate_mean_threshold(
    transport: Transport,
    *,
    values: int,
    seed: int = 2026,
    bound: float = DEFAULT_ERROR_BOUND,
    lower: bool = False,
    parameters: ThresholdParameters = THRESHOLD_AGGREGATION,
    session_id: str = "encrypted-mean",
    share_timeout_s: float = DEFAULT_SHARE_TIMEOUT_S,
    say: Say = lambda message: None,
    before_decrypt: Callable[[], None] | None = None,
    audit: Callable[[str, torch.Tensor], None] | None = None,
    threshold: int | None = None,
) -> Outcome:
    """The threshold workload on this rank: every rank ends with the mean and checks it itself.

    ``threshold`` t: t-out-of-N keys (dealt over the transport); the mean is over the ranks whose inputs
    the sum covers (said, and checked against those ranks' updates), and up to N − t ranks may leave.

    Raises AggregationError subclasses (MissingSharesAggregationError when a rank's share never came).
    """

    def record(name: str, tensor: torch.Tensor) -> None:
        if audit is not None:
            audit(name, tensor)

    rank, world = transport.rank, transport.world_size
    timings = Timings()
    channel = share_channel(transport, session=session_id, timeout_s=share_timeout_s)
    session = ThresholdSession(channel, parameters, session=session_id, threshold=threshold)
    if audit is not None:
        session.dealing_audit = lambda receiver, point: record(f"shamir_point_for_{receiver}", point)
    engine = session.engine
    try:
        started = time.perf_counter()
        check_threshold_descriptors(
            _gather_records(
                channel, "descriptor", threshold_descriptor(session, values=values, transport=transport.name)
            )
        )
        timings.measure("handshake", started)
        say(
            f"descriptor handshake ok: N={engine.ring_degree}, moduli {list(engine.moduli)}, {values} "
            f"values, threshold keys (scale 2^{parameters.message_scale_bits}, flooding sigma 2^57)"
        )

        started = time.perf_counter()
        public = session.generate_public_key()
        secret = session.shamir_share if threshold is not None else session.party.secret
        secret = secret.data if secret is not None and not isinstance(secret, torch.Tensor) else secret
        assert secret is not None and session.key_share is not None
        record("secret_share", secret)
        record("public_key_share", session.key_share.data)
        timings.measure("keys", started)
        say(
            f"collective public key ({key_fingerprint(public)[:16]}) from {world} key shares, agreed by "
            "every rank; no rank holds the secret key"
        )
        if threshold is not None:
            say(
                f"t-out-of-N keys: threshold {threshold} of {world}, Shamir points dealt sealed to each "
                f"rank's dealing key (transcript {str(session.dealing_fingerprint)[:16]}, agreed by every "
                "rank)"
            )

        started = time.perf_counter()
        update = make_update(rank, values, seed)
        headroom = parameters.headroom(tuple(engine.moduli))
        largest = float(update.abs().max()) if update.numel() else 0.0
        if largest * world >= headroom:
            raise AggregationError(
                f"|update| reaches {largest:.3g}; summed over {world} ranks it may exceed the {headroom:.0f} "
                "a slot holds: scale the updates down (e.g. clip them)"
            )
        slots = engine.slot_count
        rows = max(1, -(-values // slots))
        padded = torch.zeros(rows * slots, dtype=torch.float64)
        padded[:values] = update.double()
        record("update", update)
        run = _MeanRun(session, padded.view(rows, slots), timings, record, before_decrypt, say)
        if threshold is not None:
            mean, nbytes = _surviving_mean(run)
        elif not isinstance(transport, RelayTransport) and not lower:
            mean, nbytes = _fused_mean(run, world)
        else:
            mean, nbytes = _program_mean(run, transport, values, lower)
        mean = mean[:values]
    except MultipartyError as error:
        if getattr(error, "missing", None) is not None:
            raise MissingSharesAggregationError(str(error)) from error
        raise AggregationError(str(error)) from error

    if threshold is not None:
        truth = torch.stack([make_update(r, values, seed).double() for r in session.contributors]).mean(dim=0)
    else:
        truth = expected_mean(world, values, seed)
    max_error = float((mean - truth).abs().max())
    ok = max_error <= bound
    return Outcome(rank, world, values, max_error, bound, ok, timings, nbytes, True)


__all__ = [
    "DEFAULT_SHARE_TIMEOUT_S",
    "MissingSharesAggregationError",
    "RelayShareChannel",
    "aggregate_mean_threshold",
    "check_threshold_descriptors",
    "share_channel",
    "threshold_descriptor",
]
