"""One rank of a real gloo world running the threshold protocol (driven by test_distributed_threshold.py).

argv: scenario, timeout_s. Scenarios: "mean"; "aggregate" (the fused ThresholdSession.aggregate);
"aggregate-blocking" (aggregate over a channel with only the ShareChannel methods, as the relay's);
"aggregate-leave:<rank>" (aggregate, the rank leaves once the c1 sums are done, before its decryption
share); "aggregate-hook" / "aggregate-hook:<rank>" (aggregate with a before_contribution hook, which
records itself, or in which the rank leaves); "leave:<rank>" (leaves after encrypting); "shape:<rank>"
(decrypts one row fewer); "rogue-sum:<rank>" (adds another key share to the sum than it committed to);
"rogue-open:<rank>" (opens another key share than it committed to); "equivocate:<rank>" (seals a
different challenge seed to each other rank at key generation); "malicious:<attack>" /
"malicious-blocking:<attack>" (the fused aggregate, sliced or blocking, over a MaliciousFold: see there).
Prints one JSON line with the outcome.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import fhelium.distributed as fdist
from fhelium.multiparty.channel import MAX_RECORD_BYTES, ProcessGroupChannel
from fhelium.multiparty.distributed import ThresholdSession


def update(rank: int, count: int) -> torch.Tensor:
    return (
        torch.rand(count, generator=torch.Generator().manual_seed(7919 + rank), dtype=torch.float64) * 2 - 1
    )


def main() -> int:
    scenario, timeout_s = sys.argv[1], float(sys.argv[2])
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    leaver = int(scenario.split(":")[1]) if scenario.startswith("leave:") else None
    misshapen = int(scenario.split(":")[1]) if scenario.startswith("shape:") else None
    started = time.monotonic()
    result: dict[str, object] = {"rank": rank}
    try:
        channel = ProcessGroupChannel(session="test", timeout_s=timeout_s)
        session = ThresholdSession(channel, session="test")
        kind, _, target = scenario.partition(":")
        if kind in ("malicious", "malicious-blocking"):
            return _malicious(scenario, rank, world, timeout_s, result)
        if kind.startswith("rogue") and rank == int(target):
            honest_reduce, honest_gather = channel.all_reduce_residues, channel.all_gather_bytes

            def rogue_reduce(tag: str, residues: torch.Tensor, moduli: Sequence[int]) -> torch.Tensor:
                if kind == "rogue-sum" and tag == "public-key-shares":
                    residues = torch.remainder(residues + 1, torch.tensor(moduli).reshape(-1, 1))
                return honest_reduce(tag, residues, moduli)

            def rogue_gather(tag: str, data: bytes, max_bytes: int = MAX_RECORD_BYTES) -> list[bytes]:
                if kind == "rogue-open" and tag == "public-key-share-open":
                    data = data[:-8] + bytes(8)  # another last residue than committed
                return honest_gather(tag, data, max_bytes)

            channel.all_reduce_residues = rogue_reduce  # type: ignore[method-assign]
            channel.all_gather_bytes = rogue_gather  # type: ignore[method-assign]
        if kind == "equivocate" and rank == int(target):
            from fhelium.multiparty import challenge

            honest_seal = challenge.seal_seed

            def equivocating_seal(identity: Any, seeds: Any, keys: Any, **kwargs: Any) -> bytes:  # noqa: ANN401
                return honest_seal(identity, {r: bytes([r]) * 32 for r in seeds}, keys, **kwargs)

            challenge.seal_seed = equivocating_seal
        session.generate_public_key()
        if kind == "aggregate-blocking":
            session.channel = _BlockingChannel(channel)
        if kind in ("aggregate", "aggregate-leave", "aggregate-blocking", "aggregate-hook"):
            leaving = None if not target else int(target)
            return _aggregate(session, channel, rank, world, leaving, result, hook=kind == "aggregate-hook")
        count = 3 * 4096 + 100  # four ciphertext rows: decoded 2+2 (2 ranks), 2+2+0 (3), by every rank (5)
        rows = -(-count // 4096)
        padded = torch.zeros(rows * 4096, dtype=torch.float64)
        padded[:count] = update(rank, count)
        ct = session.encrypt(padded.view(rows, 4096))
        fdist.all_reduce_ciphertext(ct, engine=session.engine)
        if rank == leaver:
            print(json.dumps({"rank": rank, "left": True}), flush=True)
            os._exit(0)  # leaves after encrypting (and after the sum), before its decryption share
        if rank == misshapen:
            from fhelium.core import Ciphertext

            ct = Ciphertext(ct.data[:, :1].contiguous(), ct.depth, ct.scale, ct.prime_ids, "ntt")
        if kind == "decrypt-no-opt-in":
            session.decrypt(ct)
        mean = session.decrypt(ct, assume_identical=True).real.reshape(-1)[:count] / world
        truth = sum(update(r, count) for r in range(world)) / world
        result.update(ok=True, max_error=float((mean - truth).abs().max()))
    except Exception as error:  # report every failure as data
        result.update(ok=False, error=type(error).__name__, message=str(error), trace=traceback.format_exc())
    result["seconds"] = time.monotonic() - started
    print(json.dumps(result), flush=True)
    _hold_the_store_until_every_live_rank_finished(rank, world - (leaver is not None))
    os._exit(0)  # no destroy_process_group: a departed peer would make it wait


class _BlockingChannel:
    """The process-group channel with only the ShareChannel protocol's methods (like the relay's)."""

    def __init__(self, inner: ProcessGroupChannel) -> None:
        self.inner = inner
        self.rank, self.world_size = inner.rank, inner.world_size

    @property
    def bytes_sent(self) -> int:
        return self.inner.bytes_sent

    @bytes_sent.setter
    def bytes_sent(self, value: int) -> None:  # ShareChannel's bytes_sent is a settable attribute
        self.inner.bytes_sent = value

    def all_gather_bytes(self, tag: str, data: bytes, max_bytes: int = MAX_RECORD_BYTES) -> list[bytes]:
        return self.inner.all_gather_bytes(tag, data, max_bytes)

    def all_reduce_residues(self, tag: str, residues: torch.Tensor, moduli: Sequence[int]) -> torch.Tensor:
        return self.inner.all_reduce_residues(tag, residues, moduli)


def _aggregate(
    session: ThresholdSession,
    channel: ProcessGroupChannel,
    rank: int,
    world: int,
    leaver: int | None,
    result: dict[str, object],
    *,
    hook: bool = False,
) -> int:
    count = 4 * 4096 + 100  # five rows: slices 3+2 (2 ranks), 2+2+1 (3), 1+1+1+1+1 (5)
    rows = -(-count // 4096)
    padded = torch.zeros(rows * 4096, dtype=torch.float64)
    padded[:count] = update(rank, count)
    started = time.monotonic()
    seen: list[str] = []

    def before_contribution() -> None:
        if rank == leaver:
            print(json.dumps({"rank": rank, "left": True, "records": seen}), flush=True)
            os._exit(0)  # in the hook: every c1 sum is done, no contribution published
        seen.append("before_contribution")

    if rank == leaver and not hook:

        def leave(tag: str, residues: torch.Tensor, moduli: Sequence[int], dst: int) -> object:
            print(json.dumps({"rank": rank, "left": True}), flush=True)
            os._exit(0)  # every c1 sum is done: it encrypted and summed, and leaves before its share

        channel.start_reduce_residues = leave  # type: ignore[method-assign, assignment]
    try:
        total = session.aggregate(
            padded.view(rows, 4096),
            record=lambda name, _: seen.append(name),
            before_contribution=before_contribution if hook else None,
        )
        mean = total.reshape(-1)[:count] / world
        truth = sum(update(r, count) for r in range(world)) / world
        result.update(ok=True, max_error=float((mean - truth).abs().max()), records=seen)
    except Exception as error:  # report every failure as data
        result.update(ok=False, error=type(error).__name__, message=str(error), trace=traceback.format_exc())
    result["seconds"] = time.monotonic() - started
    print(json.dumps(result), flush=True)
    _hold_the_store_until_every_live_rank_finished(rank, world - (leaver is not None))
    os._exit(0)


VICTIM = 1
MALICIOUS_COUNT = 4 * 4096 + 100  # five rows: one slice per rank on the sliced path


class MaliciousFold(ProcessGroupChannel):
    """The aggregator as an attacker: it sees every rank's residues and answers each rank as it likes.

    Underneath, every residue exchange all-gathers the ranks' inputs over the real process group
    (what a fold sees); the answer each rank gets is chosen by ``attack`` (the victim is rank
    ``VICTIM``): "substitute" (the victim's c1 for the sum), "subset" (every c1 but the victim's),
    "scaled" (twice the sum), "negated" (minus the sum), "unreduced" (the sum plus q: congruent, out
    of range), "split" (rank 0 the sum, the others the sum
    plus the victim's c1), "replay" (round 1 honest, round 2 gets round 1's sum), "zero-replay"
    (round 1 gets 0, which would open every c0; round 2 gets this round's sum plus the victim's c1 of
    round 1), "tamper-sum" (honest c1 sums; each rank's summed contributions are the victim's alone).
    Attacks with a challenge the fold was handed (``leak(round, slice, rows)``: the multipliers of
    that slice in that round, as a test's backdoor): "learned-challenge" (in round 2, the sum plus a
    difference round 1's multipliers project to 0 in every slice of two rows or more: what a fold that
    learned the previous round's challenge would try), "current-challenge" (the same with round 2's
    own multipliers, what a fold colluding with a rank could do: the check cannot stop it).
    ``published`` keeps every contribution the ranks published, as the aggregator collected them.
    """

    def __init__(self, attack: str, **kwargs: Any) -> None:  # noqa: ANN401
        super().__init__(**kwargs)
        self.attack = attack
        self.round = 0
        self.slice = 0
        self.history: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.published: list[list[torch.Tensor]] = []
        self.leak: Callable[[int, int, int], torch.Tensor] | None = None

    def _answer(self, tag: str, residues: torch.Tensor, moduli: Sequence[int]) -> torch.Tensor:
        q = torch.tensor([int(m) for m in moduli], dtype=torch.int64).reshape(-1, 1)
        inputs = [torch.empty_like(residues) for _ in range(self.world_size)]
        fdist.all_gather(inputs, residues.contiguous())
        honest = torch.remainder(sum(inputs, torch.zeros_like(residues)), q)
        if tag == "decryption-contributions":
            self.published.append(inputs)
            return inputs[VICTIM].clone() if self.attack == "tamper-sum" else honest
        if tag != "ciphertext-c1":
            return honest
        victim, key = inputs[VICTIM], (self.round, self.slice)
        self.slice += 1
        self.history[key] = (honest, victim)
        attack = self.attack
        if attack == "substitute":
            return victim.clone()
        if attack == "subset":
            return torch.remainder(honest - victim, q)
        if attack == "scaled":
            return torch.remainder(2 * honest, q)
        if attack == "negated":
            return torch.remainder(-honest, q)
        if attack == "unreduced":  # congruent to the sum, but every residue lifted by its prime
            return honest + q
        if attack == "split":
            return honest if self.rank == 0 else torch.remainder(honest + victim, q)
        if attack == "replay" and self.round == 2:
            return self.history[(1, key[1])][0].clone()
        if attack == "zero-replay":
            if self.round == 1:
                return torch.zeros_like(honest)
            return torch.remainder(honest + self.history[(1, key[1])][1], q)
        if attack in ("learned-challenge", "current-challenge") and self.round == 2 and honest.size(0) > 1:
            assert self.leak is not None
            weights = self.leak(1 if attack == "learned-challenge" else 2, key[1], honest.size(0))
            return torch.remainder(honest + _kernel_difference(weights, honest, q), q)
        return honest

    def all_reduce_residues(self, tag: str, residues: torch.Tensor, moduli: Sequence[int]) -> torch.Tensor:
        return self._answer(tag, residues, moduli)

    def start_all_reduce_residues(
        self, tag: str, residues: torch.Tensor, moduli: Sequence[int]
    ) -> Callable[[], torch.Tensor]:
        answer = self._answer(tag, residues, moduli)
        return lambda: answer

    def start_reduce_residues(
        self, tag: str, residues: torch.Tensor, moduli: Sequence[int], dst: int
    ) -> Callable[[], torch.Tensor | None]:
        answer = self._answer(tag, residues, moduli)
        return lambda: answer if self.rank == dst else None


def _kernel_difference(weights: torch.Tensor, like: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """δ with Σ_r weights[r]·δ[r] = 0 mod q per limb and coefficient, δ ≠ 0: 1 in row 0, −w0/w1 in row 1."""
    delta = torch.zeros_like(like)
    for limb, modulus in enumerate(int(m) for m in q.reshape(-1)):
        w0, w1 = int(weights[0, limb, 0]), int(weights[1, limb, 0])
        delta[0, limb] = 1
        delta[1, limb] = (-w0 * pow(w1, -1, modulus)) % modulus
    return delta


def _malicious(scenario: str, rank: int, world: int, timeout_s: float, result: dict[str, object]) -> int:
    """Two aggregation rounds over a MaliciousFold; the aggregator then decodes what it collected.

    Reports each round's outcome on this rank and (the same on every rank: every rank's fold saw the
    same inputs) the aggregator's best decodes against the victim's update: the sum of every
    contribution it collected, the victim's contribution alone, and every rank's contributions with
    the victim's weighted twice; "published" counts the contributions it collected.
    """
    from fhelium.multiparty import THRESHOLD_AGGREGATION, decode_contributions

    kind, _, attack = scenario.partition(":")
    channel = MaliciousFold(attack, session="test", timeout_s=timeout_s)
    session = ThresholdSession(channel, session="test")
    session.generate_public_key()
    if kind == "malicious-blocking":
        session.channel = _BlockingChannel(channel)
    rows = -(-MALICIOUS_COUNT // 4096)

    def leak(round_number: int, part: int, part_rows: int) -> torch.Tensor:
        from fhelium.multiparty import sumcheck

        drawn = sumcheck.round_challenge(
            session.challenge_key, session.engine, "test", "ciphertext-c1", round_number, rank, world, (0, 1),
            [part_rows] * (part + 1),
        )
        return drawn.weights[part]

    channel.leak = leak
    rounds: list[dict[str, object]] = []
    for round_number in (1, 2):
        channel.round, channel.slice = round_number, 0
        padded = torch.zeros(rows * 4096, dtype=torch.float64)
        padded[:MALICIOUS_COUNT] = update(rank + 10 * round_number, MALICIOUS_COUNT)
        try:
            total = session.aggregate(padded.view(rows, 4096))
            truth = sum(update(r + 10 * round_number, MALICIOUS_COUNT) for r in range(world))
            error = float((total.reshape(-1)[:MALICIOUS_COUNT] - truth).abs().max())
            rounds.append({"ok": True, "max_error": error})
        except Exception as error:  # report every failure as data
            rounds.append({"ok": False, "error": type(error).__name__, "message": str(error)})
    engine, scale = session.engine, THRESHOLD_AGGREGATION.message_scale
    q = torch.tensor(engine.moduli_for((0, 1)), dtype=torch.int64).reshape(-1, 1)
    decodes: list[dict[str, float]] = []  # per round: what the aggregator decodes from that round
    # the published contributions, one list per exchange (a round, or a slice of one): rows stacked
    exchanges = len(channel.published) // 2
    for number in (1, 2):
        inputs_of_round = channel.published[(number - 1) * exchanges : number * exchanges]
        if not inputs_of_round:
            continue
        by_rank = [torch.cat([inputs[r] for inputs in inputs_of_round]) for r in range(world)]
        victim = update(VICTIM + 10 * number, MALICIOUS_COUNT)

        def error_of(summed: torch.Tensor, victim: torch.Tensor = victim) -> float:
            decoded = decode_contributions(engine, torch.remainder(summed, q), (0, 1), scale)
            return float((decoded.reshape(-1)[:MALICIOUS_COUNT] - victim).abs().max())

        everything = sum(by_rank, torch.zeros_like(by_rank[0]))
        decodes.append({
            "all": error_of(everything),
            "victim_alone": error_of(by_rank[VICTIM]),
            "victim_twice": error_of(everything + by_rank[VICTIM]),
            "all_but_victim": error_of(everything - by_rank[VICTIM]),
        })
    result.update(ok=True, rounds=rounds, decodes=decodes, published=len(channel.published))
    print(json.dumps(result), flush=True)
    _hold_the_store_until_every_live_rank_finished(rank, world)
    os._exit(0)


def _hold_the_store_until_every_live_rank_finished(rank: int, live: int) -> None:
    """Rank 0 hosts the TCPStore: it leaves only once every live rank has its outcome (bounded), so no rank
    still waiting on the store sees it vanish (a reset) instead of the protocol's own verdict.
    """
    try:
        store = dist.distributed_c10d._get_default_store()
        store.add("test/finished", 1)
        if rank != 0:
            return
        deadline = time.monotonic() + 60
        while store.add("test/finished", 0) < live and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # the store itself went away: nothing left to hold
        return


if __name__ == "__main__":
    sys.exit(main())
