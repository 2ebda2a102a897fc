"""CKKS operation latency and batched throughput, with ratios against SEAL.

Run: ``.venv/bin/python bench/ckks_ops.py`` (options: ``--rings 13,14,15 --batches 8,32 --runs 3``;
``--quick`` = N=2^14 only, batch 8, 3 runs; ``--clock cpu`` times process CPU instead of wall;
``--compile`` runs the NTT stages through torch.compile, the opt-in accelerator;
``--thread-split`` with ``--threads 2 --clock cpu`` and ``OMP_WAIT_POLICY=PASSIVE`` adds each batched op's CPU
time on the calling thread and on the whole process, which shows how the work splits between the
threads even where a loaded machine makes two-thread wall time meaningless). The NTT and
mul_mod dispatch level (``FHELIUM_NATIVE_LEVEL=ifma|dq|avx2|scalar|torch``; default the best this CPU
runs, see fhelium.native) is printed in the header; the ``row NTT`` line is one forward NTT per
residue row (a [limbs, N] polynomial, or B of them, divided by the row count).

Shapes: N=2^14 and 2^15 with 5 Q limbs (4 x 40-bit scale primes + 48-bit base, 50-bit special
prime; SEAL's shape is [60,40,40,40,40,60]), N=2^13 with 3 Q limbs (the security table allows no
more), scale 2^40, one thread. Each figure is the minimum wall time over ``--runs`` repetitions
(the machine is shared; the minimum is the least disturbed sample), in ms. Batched rows time one
call on a batch of B ciphertexts and report per-ciphertext ms and ciphertexts/s.

If TenSEAL is importable (``pip install .[anchors]``) its raw SEAL API (``tenseal.sealapi``) is
timed on the same parameters in the same run and ratios ours/SEAL are printed (the row NTT's SEAL
figure is ``Evaluator.transform_to_ntt_inplace`` on a ciphertext, per residue row). Otherwise the ratios
use the reference SEAL figures from the issue (measured on this machine in another run, single
thread, N=2^14, 5 limbs) and are labelled as such.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from fhelium.engine import CkksEngine, Preset

REFERENCE_SEAL_MS = {  # issue text: SEAL, single thread, N=2^14, 5 limbs, measured on this machine
    "encode+encrypt": 10.0,
    "decrypt+decode": 3.3,
    "add": 0.20,
    "multiply+relin+rescale": 11.3,
    "multiply_plain+rescale": 2.25,
    "rotate": 8.1,
    "row NTT (forward)": 0.2,  # issue 15: SEAL's implied per-row NTT cost (not in TenSEAL's API)
}
PRESETS = {
    13: Preset.SLOTS4096_SCALE40_DEPTH2,
    14: Preset.SLOTS8192_SCALE40_DEPTH4,
    15: Preset.SLOTS16384_SCALE40_DEPTH4,
}
SEAL_SHAPES = {13: [60, 40, 40, 60], 14: [60, 40, 40, 40, 40, 60], 15: [60, 40, 40, 40, 40, 60]}


CLOCK: Callable[[], float] = time.perf_counter


def best_ms(operation: Callable[[], object], runs: int) -> float:
    operation()  # warm caches and tables
    best = float("inf")
    for _ in range(runs):
        start = CLOCK()
        operation()
        best = min(best, CLOCK() - start)
    return best * 1e3


def fhelium_operations(engine: CkksEngine, batch: int) -> dict[str, Callable[[], object]]:
    keys = engine.generate_keys(rotation_steps=(1,))
    shape = (batch,) if batch else ()
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(*shape, engine.slot_count, generator=generator, dtype=torch.float64) * 2 - 1
    ct = engine.encode_encrypt(x, keys.public)
    plain = engine.encode(x)
    relin, rotation = keys.relin(), keys.rotation(1)
    ids = engine.q_ids_at(0)
    residues = torch.stack(
        [torch.randint(0, engine.moduli[i], (*shape, engine.ring_degree), generator=generator) for i in ids],
        dim=-2,
    )
    return {
        "encode+encrypt": lambda: engine.encode_encrypt(x, keys.public),
        "decrypt+decode": lambda: engine.decrypt_decode(ct, keys.secret),
        "add": lambda: engine.add(ct, ct),
        "multiply+relin+rescale": lambda: engine.rescale(engine.relinearize(engine.multiply(ct, ct), relin)),
        "multiply_plain+rescale": lambda: engine.rescale(engine.multiply_plain(ct, plain)),
        "rotate": lambda: engine.rotate(ct, rotation),
        # per residue row: divided by the row count in ``row_scaled``
        "row NTT (forward)": lambda: engine.ntt.forward(residues, ids),
    }


ROW_SCALED = "row NTT (forward)"


def thread_split_ms(operation: Callable[[], object], runs: int) -> tuple[float, float]:
    """(CPU ms of the calling thread, CPU ms of the whole process) for one call, each the minimum
    over ``runs``: with several torch threads and ``OMP_WAIT_POLICY=PASSIVE`` (waiting threads
    sleep), how the work splits between the calling thread and the pool, which a loaded machine
    does not distort the way it distorts wall time.
    """
    operation()
    calling = total = float("inf")
    for _ in range(runs):
        thread_start, process_start = time.thread_time(), time.process_time()
        operation()
        calling = min(calling, time.thread_time() - thread_start)
        total = min(total, time.process_time() - process_start)
    return calling * 1e3, total * 1e3


def ntt_rows(engine: CkksEngine, batch: int) -> int:
    return max(1, batch) * len(engine.q_ids_at(0))


def seal_operations(log_n: int) -> tuple[dict[str, Callable[[], object]], Callable[[int], float]] | None:
    """SEAL's raw API through TenSEAL (the operations, and a timer of SEAL's forward NTT in ms per
    residue row), or None when TenSEAL is not importable.
    """
    try:
        from tenseal import sealapi  # type: ignore[import-untyped,import-not-found,unused-ignore]  # optional [anchors] extra
    except ImportError:
        return None
    n = 1 << log_n
    parameters = sealapi.EncryptionParameters(sealapi.SCHEME_TYPE.CKKS)
    parameters.set_poly_modulus_degree(n)
    parameters.set_coeff_modulus(sealapi.CoeffModulus.Create(n, SEAL_SHAPES[log_n]))
    context = sealapi.SEALContext(parameters, True, sealapi.SEC_LEVEL_TYPE.TC128)
    keygen = sealapi.KeyGenerator(context)
    public, relin, galois = sealapi.PublicKey(), sealapi.RelinKeys(), sealapi.GaloisKeys()
    keygen.create_public_key(public)
    keygen.create_relin_keys(relin)
    keygen.create_galois_keys(galois)
    encoder, evaluator = sealapi.CKKSEncoder(context), sealapi.Evaluator(context)
    encryptor, decryptor = sealapi.Encryptor(context, public), sealapi.Decryptor(context, keygen.secret_key())
    values = [0.5] * (n // 2)
    scale = 2.0**40

    def encode_encrypt() -> Any:  # noqa: ANN401  a SEAL Ciphertext (tenseal.sealapi has no types)
        plain, cipher = sealapi.Plaintext(), sealapi.Ciphertext()
        encoder.encode(values, scale, plain)
        encryptor.encrypt(plain, cipher)
        return cipher

    ct = encode_encrypt()
    plain = sealapi.Plaintext()
    encoder.encode(values, scale, plain)

    def decrypt_decode() -> object:
        out = sealapi.Plaintext()
        decryptor.decrypt(ct, out)
        return encoder.decode_double(out)

    def add() -> object:
        out = sealapi.Ciphertext()
        evaluator.add(ct, ct, out)
        return out

    def multiply() -> object:
        out = sealapi.Ciphertext()
        evaluator.multiply(ct, ct, out)
        evaluator.relinearize_inplace(out, relin)
        evaluator.rescale_to_next_inplace(out)
        return out

    def multiply_plain() -> object:
        out = sealapi.Ciphertext()
        evaluator.multiply_plain(ct, plain, out)
        evaluator.rescale_to_next_inplace(out)
        return out

    def rotate() -> object:
        out = sealapi.Ciphertext()
        evaluator.rotate_vector(ct, 1, galois, out)
        return out

    def row_ntt_ms(runs: int) -> float:
        """SEAL's forward NTT (Evaluator.transform_to_ntt_inplace on a fresh ciphertext: 2 polynomials
        of coeff_modulus_size rows each), per row; the inverse that prepares each sample is not timed.
        """
        cipher = encode_encrypt()
        rows = cipher.size() * cipher.coeff_modulus_size()
        best = float("inf")
        for _ in range(runs + 1):  # the first sample warms the tables
            evaluator.transform_from_ntt_inplace(cipher)
            start = CLOCK()
            evaluator.transform_to_ntt_inplace(cipher)
            best = min(best, CLOCK() - start)
        return float(best * 1e3 / rows)

    operations: dict[str, Callable[[], object]] = {
        "encode+encrypt": encode_encrypt,
        "decrypt+decode": decrypt_decode,
        "add": add,
        "multiply+relin+rescale": multiply,
        "multiply_plain+rescale": multiply_plain,
        "rotate": rotate,
    }
    return operations, row_ntt_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rings", default="13,14,15", help="log2 N values")
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--thread-split",
        action="store_true",
        help="also print, per batched op, the CPU time of the calling thread and of the process "
        "(use with --threads 2 --clock cpu and OMP_WAIT_POLICY=PASSIVE, so SEAL is timed in CPU time too): "
        "a load-independent view of the split",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="opt-in torch.compile of the NTT stages (first call compiles for 20-60 s; not in the timings)",
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu = process CPU time: steadier than wall time on a shared, overloaded machine",
    )
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    rings = [14] if args.quick else [int(v) for v in args.rings.split(",")]
    batches = [8] if args.quick else [int(v) for v in args.batches.split(",")]
    runs = 3 if args.quick else args.runs
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), {args.clock} clock, "
        f"{'compiled' if args.compile else 'eager'} NTT stages, native dispatch level "
        f"{CkksEngine(Preset.TOY_N1024, compile_kernels=args.compile).ntt.native_level}, load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )

    for log_n in rings:
        engine = CkksEngine(PRESETS[log_n], rng_seed=1, compile_kernels=args.compile)
        limbs = len(engine.q_ids_at(0))
        print(f"\n== N=2^{log_n}, {limbs} Q limbs, scale 2^40 ({PRESETS[log_n].value})")
        start = time.perf_counter()
        engine.generate_keys(rotation_steps=(1,))
        print(
            "keygen (secret, public, relinearization, 1 rotation key): "
            f"{(time.perf_counter() - start) * 1e3:.0f} ms"
        )

        single = {name: best_ms(op, runs) for name, op in fhelium_operations(engine, 0).items()}
        single[ROW_SCALED] /= ntt_rows(engine, 0)
        seal_api = seal_operations(log_n)
        if seal_api is not None:
            seal_ops, seal_row_ntt = seal_api
            seal = {name: best_ms(op, runs) for name, op in seal_ops.items()}
            seal[ROW_SCALED] = seal_row_ntt(max(runs, 5))
            seal_label = "SEAL (TenSEAL sealapi, this run)"
        elif log_n == 14:
            seal = REFERENCE_SEAL_MS
            seal_label = "SEAL reference figures from the issue (another run; TenSEAL not importable)"
        else:
            seal = {}
            seal_label = "no SEAL figure (TenSEAL not importable; reference figures exist for N=2^14 only)"
        batched = {}
        for batch in batches:
            operations = fhelium_operations(engine, batch)
            batched[batch] = {name: best_ms(op, max(1, runs // 2)) / batch for name, op in operations.items()}
            batched[batch][ROW_SCALED] *= batch / ntt_rows(engine, batch)

        header = f"{'operation':24s} {'single ms':>10s}"
        for batch in batches:
            header += f" {'B=' + str(batch) + ' ms/ct':>12s} {'ct/s':>8s}"
        header += f" {'SEAL ms':>8s} {'single/SEAL':>11s} {'batched/SEAL':>12s}"
        print(header)
        for name, ms in single.items():
            line = f"{name:24s} {ms:10.2f}"
            for batch in batches:
                per = batched[batch][name]
                line += f" {per:12.2f} {1e3 / per:8.0f}"
            if name not in seal and name in REFERENCE_SEAL_MS and log_n == 14:
                seal = {**seal, name: REFERENCE_SEAL_MS[name]}  # the figure, labelled below
            if name in seal:
                best_batched = min(batched[b][name] for b in batches)
                line += f" {seal[name]:8.2f} {ms / seal[name]:10.2f}x {best_batched / seal[name]:11.2f}x"
            print(line)
        print(f"SEAL column: {seal_label}")
        if args.thread_split:
            print(
                f"thread split, B={batches[0]}, {args.threads} thread(s), CPU ms per ciphertext (row NTT: "
                f"per row), min of {runs}; est. = the larger share, vs SEAL = SEAL's single-thread ms / est."
            )
            operations = fhelium_operations(engine, batches[0])
            for name, op in operations.items():
                divisor = ntt_rows(engine, batches[0]) if name == ROW_SCALED else batches[0]
                calling, total = (v / divisor for v in thread_split_ms(op, runs))
                estimate = max(calling, total - calling)
                versus = f" vs SEAL {seal[name] / estimate:4.1f}x" if name in seal else ""
                print(
                    f"  {name:24s} calling {calling:7.3f}  total {total:7.3f}  "
                    f"calling share {calling / total:4.2f}  est. {estimate:7.3f}{versus}"
                )
        row_seal = (
            "SEAL's transform_to_ntt per row, this run"
            if seal_api is not None
            else "the issue's implied per-row cost"
        )
        print(
            f"{ROW_SCALED}: ms per residue row (ct/s column: rows/s), NTT dispatch level "
            f"{engine.ntt.native_level}; its SEAL figure: {row_seal}"
        )


if __name__ == "__main__":
    main()
