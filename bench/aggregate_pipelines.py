"""What each rank of bench/aggregate.py times: the plaintext floor, our single-key and threshold pipelines and
the usual federated-learning pipeline (TenSEAL, or its shape on our engine), as that bench's docstring
describes them. Each returns its row: seconds, CPU seconds, max error of the mean, bytes sent, rounds.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from fhelium.core import Ciphertext, PublicKey, SecretKey
from fhelium.engine import CkksEngine
from fhelium.engine.parameters import CkksParameters
from flodld_fhelium.aggregation import AGGREGATION_PARAMETERS, decrypt_mean, encrypt_update, link_program
from flodld_fhelium.transport import KEY_HOLDER, ProcessGroupTransport

# TenSEAL's tutorial context: poly_modulus_degree 8192, coeff_mod_bit_sizes [60, 40, 40, 60], scale 2^40.
# Our kernels cap primes at 50 bits, so the 60-bit outer primes become 50-bit ones (same limb count).
TENSEAL_STYLE_PARAMETERS = CkksParameters(
    log_ring_degree=13, scale_bits=40, scale_prime_bits=(40, 40), base_prime_bits=50, special_prime_bits=50
)
_THRESHOLD_RUNS = itertools.count()


def timed_barrier() -> float:
    dist.barrier()
    return time.perf_counter()


def floor(update: torch.Tensor) -> float:
    best = math.inf
    for _ in range(3):
        buffer = update.clone()
        started = timed_barrier()
        dist.all_reduce(buffer)
        dist.barrier()
        best = min(best, time.perf_counter() - started)
    return best


def ours(rank: int, world: int, update: torch.Tensor, truth: torch.Tensor) -> dict[str, Any]:
    import fhelium.distributed as fdist

    engine = CkksEngine(AGGREGATION_PARAMETERS)
    transport = ProcessGroupTransport()
    executable = link_program(transport, engine, lower=False)
    started = timed_barrier()
    cpu_started = time.process_time()
    secret = engine.generate_secret_key() if rank == KEY_HOLDER else None
    public = fdist.broadcast_key(
        engine.generate_public_key(secret) if secret is not None else None, src=KEY_HOLDER
    )
    assert isinstance(public, PublicKey), f"the key holder broadcast a {type(public).__name__}"
    encrypt_started = time.perf_counter()
    ciphertext = encrypt_update(engine, update, public, world_size=world)
    encrypt_seconds = time.perf_counter() - encrypt_started
    (total,) = executable.run(ciphertext)
    mean = decrypt_mean(engine, total, secret, update.numel(), world) if secret is not None else None
    dist.barrier()
    elapsed = time.perf_counter() - started
    cpu_seconds = time.process_time() - cpu_started
    trace = fdist.ReductionTrace()
    fdist.all_reduce_ciphertext(ciphertext.clone(), engine=engine, trace=trace)
    nbytes = ciphertext.data.numel() * ciphertext.data.element_size()
    if trace.algorithm == "sum":
        # One gloo all-reduce, counted as a ring: 2(P-1)/P of the payload per rank in 2(P-1) steps.
        bytes_sent, rounds = 2 * (world - 1) * nbytes // world, 2 * (world - 1)
    else:
        # Tree messages, plus the final broadcast counted as the root sending one copy to every peer.
        bytes_sent = (
            trace.messages_sent + (world - 1) * (rank == KEY_HOLDER) * trace.final_broadcasts
        ) * nbytes
        rounds = trace.schedule_rounds + 1
    return {
        "seconds": elapsed,
        "cpu_seconds": cpu_seconds,
        "encrypt_seconds": encrypt_seconds,
        "error": float((mean - truth).abs().max()) if mean is not None else None,
        "bytes_sent": bytes_sent,
        "rounds": rounds,
    }


def aggregate(
    session: Any,  # noqa: ANN401  a ThresholdSession (imported lazily, as the pipelines do)
    values: torch.Tensor,
    sum_c1: Callable[[Ciphertext], torch.Tensor] | None,
    check_sums: bool,
) -> torch.Tensor:
    """``session.aggregate``, or with ``check_sums=False`` the same protocol trusting the fold: the
    baseline of ``--defence-ratio`` (what the sum checks cost), never a way to run aggregations.
    """
    if check_sums:
        summed: torch.Tensor = session.aggregate(values, sum_c1=sum_c1)
    else:
        summed = session._aggregate(
            values, record=None, before_contribution=None, sum_c1=sum_c1, check_sums=False
        )
    return summed


def threshold_program(
    rank: int, world: int, update: torch.Tensor, truth: torch.Tensor, check_sums: bool = True
) -> dict[str, Any]:
    from fhelium.multiparty.channel import ProcessGroupChannel
    from fhelium.multiparty.distributed import ThresholdSession

    # a fresh session name per repeat: the arrival marks of one repeat must not satisfy the next's waits
    name = f"bench-program-{next(_THRESHOLD_RUNS)}"
    channel = ProcessGroupChannel(session=name, timeout_s=600)
    session = ThresholdSession(channel, session=name)
    engine = session.engine
    executable = link_program(ProcessGroupTransport(), engine, lower=False)
    slots = engine.slot_count
    rows = max(1, -(-update.numel() // slots))
    padded = torch.zeros(rows * slots, dtype=torch.float64)
    padded[: update.numel()] = update.double()
    started = timed_barrier()
    cpu_started = time.process_time()
    session.generate_public_key()
    encrypt_seconds = 0.0
    encrypt = session.party.encrypt

    def timed_encrypt(values: torch.Tensor, public: PublicKey) -> Ciphertext:
        nonlocal encrypt_seconds
        encrypt_started = time.perf_counter()
        try:
            return encrypt(values, public)
        finally:
            encrypt_seconds += time.perf_counter() - encrypt_started

    def sum_c1(c1_only: Ciphertext) -> torch.Tensor:
        (total,) = executable.run(c1_only)
        summed: torch.Tensor = total.data[1]
        return summed

    # the flagship's relay road: the Program sums c1-only ciphertexts, the sums are checked, c0_i + h_i
    session.party.encrypt = timed_encrypt  # type: ignore[method-assign]
    aggregate_started, aggregate_cpu_started = time.perf_counter(), time.process_time()
    summed = aggregate(session, padded.view(rows, slots), sum_c1, check_sums)
    mean = summed.reshape(-1)[: update.numel()] / world
    dist.barrier()
    elapsed = time.perf_counter() - started
    cpu_seconds = time.process_time() - cpu_started
    aggregate_seconds = time.perf_counter() - aggregate_started
    aggregate_cpu_seconds = time.process_time() - aggregate_cpu_started
    # Three SUM all-reduces (key shares, the c1-only ciphertexts with their zeroed c0, the contributions),
    # each counted as a ring, plus six all_gathers: seed commitments, reveals, key share commitments and
    # key fingerprints (64 KiB records), the opened key shares (1 MiB records); the sum checks' records
    # (a digest and one [limbs, N] projection per rank and sum) are not counted.
    from fhelium.multiparty.channel import MAX_RECORD_BYTES
    from fhelium.multiparty.keygen import MAX_KEY_SHARE_BYTES

    residue_bytes = 3 * rows * engine.q_count * engine.ring_degree * 8
    residue_bytes += engine.ring_degree * len(engine.moduli) * 8
    record_bytes = (world - 1) * (4 * (MAX_RECORD_BYTES + 8) + MAX_KEY_SHARE_BYTES + 8)
    slot_bytes = 0  # every rank decodes every row (the blocking path, as on the relay road)
    return {
        "seconds": elapsed,
        "cpu_seconds": cpu_seconds,
        "encrypt_seconds": encrypt_seconds,
        "aggregate_seconds": aggregate_seconds,
        "aggregate_cpu_seconds": aggregate_cpu_seconds,
        "error": float((mean - truth).abs().max()),
        "bytes_sent": 2 * (world - 1) * residue_bytes // world + record_bytes + slot_bytes,
        "rounds": 3 * 2 * (world - 1) + 6 * (world - 1),
    }


def threshold(
    rank: int,
    world: int,
    update: torch.Tensor,
    truth: torch.Tensor,
    check_sums: bool = True,
    t_of_n: int | None = None,
) -> dict[str, Any]:
    from fhelium.multiparty.channel import ProcessGroupChannel
    from fhelium.multiparty.distributed import ThresholdSession

    # a fresh session name per repeat: the arrival marks of one repeat must not satisfy the next's waits
    name = f"bench-{next(_THRESHOLD_RUNS)}"
    channel = ProcessGroupChannel(session=name, timeout_s=600)
    session = ThresholdSession(channel, session=name, threshold=t_of_n)
    engine = session.engine
    slots = engine.slot_count
    rows = max(1, -(-update.numel() // slots))
    padded = torch.zeros(rows * slots, dtype=torch.float64)
    padded[: update.numel()] = update.double()
    started = timed_barrier()
    cpu_started = time.process_time()
    session.generate_public_key()
    encrypt_seconds = 0.0

    def timed(encrypt: Callable[[torch.Tensor, PublicKey], Ciphertext]) -> Callable[..., Ciphertext]:
        def timed_encrypt(values: torch.Tensor, public: PublicKey) -> Ciphertext:
            nonlocal encrypt_seconds
            encrypt_started = time.perf_counter()
            try:
                return encrypt(values, public)
            finally:
                encrypt_seconds += time.perf_counter() - encrypt_started

        return timed_encrypt

    # aggregate encrypts with encrypt_flooded (the flooding noise drawn with the encryption)
    session.party.encrypt = timed(session.party.encrypt)  # type: ignore[method-assign]
    session.party.encrypt_flooded = timed(session.party.encrypt_flooded)  # type: ignore[method-assign]
    aggregate_started, aggregate_cpu_started = time.perf_counter(), time.process_time()
    summed = aggregate(session, padded.view(rows, slots), None, check_sums)
    mean = summed.reshape(-1)[: update.numel()] / world
    dist.barrier()
    elapsed = time.perf_counter() - started
    cpu_seconds = time.process_time() - cpu_started
    aggregate_seconds = time.perf_counter() - aggregate_started
    aggregate_cpu_seconds = time.process_time() - aggregate_cpu_started
    # Two SUM all-reduces counted as rings: the key shares (QP) and the ciphertexts' c1 (Q); the
    # c0_i + h_i contributions, each slice reduced to the rank that decodes it (counted as each rank
    # sending the other ranks' slices); six all_gathers: seed commitments, reveals, key share
    # commitments and key fingerprints (64 KiB records), the opened key shares (1 MiB records) and
    # each rank's slice of the decoded real slots (float64).
    from fhelium.multiparty.channel import MAX_RECORD_BYTES
    from fhelium.multiparty.keygen import MAX_KEY_SHARE_BYTES

    limbs = engine.q_count
    per = -(-rows // world)
    c1_bytes = rows * limbs * engine.ring_degree * 8
    ring_bytes = c1_bytes + engine.ring_degree * len(engine.moduli) * 8
    own_rows = min((rank + 1) * per, rows) - min(rank * per, rows)
    contribution_bytes = (rows - own_rows) * limbs * engine.ring_degree * 8
    record_bytes = (world - 1) * (4 * (MAX_RECORD_BYTES + 8) + MAX_KEY_SHARE_BYTES + 8)
    slot_bytes = (world - 1) * per * slots * 8  # float64 slices, ring all_gather
    return {
        "seconds": elapsed,
        "cpu_seconds": cpu_seconds,
        "encrypt_seconds": encrypt_seconds,
        "aggregate_seconds": aggregate_seconds,
        "aggregate_cpu_seconds": aggregate_cpu_seconds,
        "error": float((mean - truth).abs().max()),
        "bytes_sent": 2 * (world - 1) * ring_bytes // world + contribution_bytes + record_bytes + slot_bytes,
        "rounds": 2 * 2 * (world - 1) + world + 6 * (world - 1),
    }


def _send_blob(blob: bytes, dst: int) -> None:
    dist.send(torch.tensor([len(blob)], dtype=torch.int64), dst)
    dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst)


def _recv_blob(src: int) -> bytes:
    length = torch.empty(1, dtype=torch.int64)
    dist.recv(length, src)
    data = torch.empty(int(length), dtype=torch.uint8)
    dist.recv(data, src)
    return data.numpy().tobytes()


def _pack(blobs: list[bytes]) -> bytes:
    """Length-prefixed concatenation (count, then size + bytes per blob)."""
    return len(blobs).to_bytes(8, "little") + b"".join(len(b).to_bytes(8, "little") + b for b in blobs)


def _through_server(
    rank: int, world: int, blob: bytes, server_sum: Callable[[Iterator[bytes]], bytes]
) -> tuple[bytes, int]:
    """The usual star: every client sends its blob to the server (co-located with client 0), which
    sums them as they arrive and sends the serialized sum back. Returns the sum and the bytes sent.
    """
    if rank != KEY_HOLDER:
        _send_blob(blob, KEY_HOLDER)
        return _recv_blob(KEY_HOLDER), len(blob)
    result = server_sum(itertools.chain([blob], (_recv_blob(peer) for peer in range(1, world))))
    for peer in range(1, world):
        _send_blob(result, peer)
    return result, len(blob) + (world - 1) * len(result)


def _star_row(
    started: float, cpu_started: float, mean: torch.Tensor, truth: torch.Tensor, sent: int
) -> dict[str, Any]:
    """The row of a usual (star) pipeline once its mean is decrypted: every rank passes a barrier first,
    so the time is the slowest rank's; two rounds (up to the server, back down).
    """
    dist.barrier()
    return {
        "seconds": time.perf_counter() - started,
        "cpu_seconds": time.process_time() - cpu_started,
        "error": float((mean - truth).abs().max()),
        "bytes_sent": sent,
        "rounds": 2,
    }


def usual_on_our_engine(rank: int, world: int, update: torch.Tensor, truth: torch.Tensor) -> dict[str, Any]:
    from fhelium.serialization import value_from_bytes, value_to_bytes

    engine = CkksEngine(TENSEAL_STYLE_PARAMETERS)
    started = timed_barrier()
    cpu_started = time.process_time()
    # TenSEAL clients share one context, secret key included; the server only gets the public part.
    if rank == KEY_HOLDER:
        secret = engine.generate_secret_key()
        context = [
            value_to_bytes(secret, engine=engine, allow_secret=True),
            value_to_bytes(engine.generate_public_key(secret), engine=engine),
        ]
        for peer in range(1, world):
            for blob in context:
                _send_blob(blob, peer)
    else:
        context = [_recv_blob(KEY_HOLDER) for _ in range(2)]
        received_secret = value_from_bytes(context[0], engine=engine)
        assert isinstance(received_secret, SecretKey)
        secret = received_secret
    public = value_from_bytes(context[1], engine=engine)
    assert isinstance(public, PublicKey)
    blob = value_to_bytes(encrypt_update(engine, update, public), engine=engine)

    def server_sum(blobs: Iterator[bytes]) -> bytes:
        total: Ciphertext | None = None
        for data in blobs:
            incoming = value_from_bytes(data, engine=engine)
            assert isinstance(incoming, Ciphertext)
            total = incoming if total is None else engine.add(total, incoming)
        assert total is not None
        return value_to_bytes(total, engine=engine)

    result, sent = _through_server(rank, world, blob, server_sum)
    summed = value_from_bytes(result, engine=engine)
    assert isinstance(summed, Ciphertext)
    mean = decrypt_mean(engine, summed, secret, update.numel(), world)
    return _star_row(started, cpu_started, mean, truth, sent)


def usual_with_tenseal(rank: int, world: int, update: torch.Tensor, truth: torch.Tensor) -> dict[str, Any]:
    import tenseal as ts

    started = timed_barrier()
    cpu_started = time.process_time()
    if rank == KEY_HOLDER:
        context = ts.context(
            ts.SCHEME_TYPE.CKKS, poly_modulus_degree=8192, coeff_mod_bit_sizes=[60, 40, 40, 60]
        )
        context.global_scale = 2**40
        shared = context.serialize(save_secret_key=True)
        for peer in range(1, world):
            _send_blob(shared, peer)
    else:
        context = ts.context_from(_recv_blob(KEY_HOLDER))
    chunks = torch.split(update.double(), 4096)
    blobs = [ts.ckks_vector(context, chunk.tolist()).serialize() for chunk in chunks]
    blob = _pack(blobs)

    def parse(data: bytes) -> list[Any]:
        count, offset, vectors = int.from_bytes(data[:8], "little"), 8, []
        for _ in range(count):
            size = int.from_bytes(data[offset : offset + 8], "little")
            vectors.append(ts.ckks_vector_from(context, data[offset + 8 : offset + 8 + size]))
            offset += 8 + size
        return vectors

    def server_sum(blobs: Iterator[bytes]) -> bytes:
        total: list[Any] | None = None
        for data in blobs:
            vectors = parse(data)
            total = vectors if total is None else [a + b for a, b in zip(total, vectors, strict=True)]
        assert total is not None
        return _pack([vector.serialize() for vector in total])

    result, sent = _through_server(rank, world, blob, server_sum)
    mean = (
        torch.tensor([x for vector in parse(result) for x in vector.decrypt()], dtype=torch.float64) / world
    )
    return _star_row(started, cpu_started, mean, truth, sent)
