"""One rank of a real gloo world with t-out-of-N keys (driven by test_t_of_n.py).

argv: scenario, threshold, timeout_s. The rendezvous store is hosted by the test process (so any rank,
rank 0 included, can be killed). Scenarios:
- "mean": keys, then two aggregation rounds;
- "kill:<rank>:<phase>": <rank> SIGKILLs itself at <phase>: "keys" (during dealing: after publishing its
  dealing key), "before" (after the keys, before contributing), "after" (its input is in the checked sum,
  before its decryption share), "mid" (after publishing its decryption share's arrival, before the sum);
  "kill:<a>,<b>:<phase>" kills several;
- "observe": keys, recording every record of the dealing as the transport carried it, then checks the
  wire against this rank's points (reports what it found);
- "decrypt": keys, ``decrypt(assume_identical=True)`` (refused), then one aggregation round;
- "pinned:<rank>": long-term dealing keys from $TOFN_PINS_DIR, all pinned; <rank> presents another key;
- "malicious:<attack>": two rounds over a fold that answers the ciphertext sum with an attack
  ("substitute": the victim's ciphertext, "subset": all but the victim's, "scaled", "negated", "split":
  rank 0 the sum, the others the sum plus the victim's, "replay": round 2 gets round 1's sum).
Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fhelium.multiparty.channel import MAX_RECORD_BYTES, ProcessGroupChannel
from fhelium.multiparty.distributed import ThresholdSession

COUNT = 4096 + 100  # two ciphertext rows


def update(rank: int, round_number: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7919 + rank + 100 * round_number)
    return torch.rand(COUNT, generator=generator, dtype=torch.float64) * 2 - 1


def padded(rank: int, round_number: int) -> torch.Tensor:
    out = torch.zeros(2 * 4096, dtype=torch.float64)
    out[:COUNT] = update(rank, round_number)
    return out.view(2, 4096)


def die(rank: int, phase: str) -> None:
    print(json.dumps({"rank": rank, "killed": phase}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class ObservedChannel(ProcessGroupChannel):
    """The process group with every all-gathered record kept as the transport carried it."""

    def __init__(self, **kwargs: Any) -> None:  # noqa: ANN401
        super().__init__(**kwargs)
        self.wire: dict[str, list[bytes]] = {}

    def all_gather_bytes(self, tag: str, data: bytes, max_bytes: int = MAX_RECORD_BYTES) -> list[bytes]:
        records = super().all_gather_bytes(tag, data, max_bytes)
        self.wire[tag] = records
        return records


class MaliciousMembers(ProcessGroupChannel):
    """The aggregator answering the ciphertext sum as it likes (the victim is rank 1)."""

    def __init__(self, attack: str, **kwargs: Any) -> None:  # noqa: ANN401
        super().__init__(**kwargs)
        self.attack = attack
        self.previous: torch.Tensor | None = None

    def start_sum_members(
        self, tag: str, residues: torch.Tensor, moduli: Sequence[int], members: Sequence[int]
    ) -> Callable[[], torch.Tensor]:  # sum_members goes through here too
        finish = super().start_sum_members(tag, residues, moduli, members)
        if not tag.startswith("ciphertext:"):
            return finish
        return lambda: self._answer(finish(), residues, moduli, members)

    def _answer(
        self, honest: torch.Tensor, residues: torch.Tensor, moduli: Sequence[int], members: Sequence[int]
    ) -> torch.Tensor:
        q = torch.tensor([int(m) for m in moduli], dtype=torch.int64).reshape(-1, 1)
        inputs = [torch.empty_like(residues) for _ in range(self.world_size)]
        dist.all_gather(inputs, residues.contiguous(), group=self._members_group(members))
        victim = inputs[1]
        previous, self.previous = self.previous, honest
        if self.attack == "replay":  # round 2 gets round 1's (honest) sum
            return previous.clone() if previous is not None else honest
        if self.attack == "substitute":
            return victim.clone()
        if self.attack == "subset":
            return torch.remainder(honest - victim, q)
        if self.attack == "scaled":
            return torch.remainder(2 * honest, q)
        if self.attack == "negated":
            return torch.remainder(-honest, q)
        if self.attack == "split":
            return honest if self.rank == 0 else torch.remainder(honest + victim, q)
        return honest


def _session(
    kind: str, rest: str, rank: int, threshold: int, timeout_s: float, store: Any  # noqa: ANN401
) -> tuple[ProcessGroupChannel, ThresholdSession]:
    channel: ProcessGroupChannel
    if kind == "observe":
        channel = ObservedChannel(session="tofn", timeout_s=timeout_s, store=store)
    elif kind == "malicious":
        channel = MaliciousMembers(rest, session="tofn", timeout_s=timeout_s, store=store)
    else:
        channel = ProcessGroupChannel(session="tofn", timeout_s=timeout_s, store=store)
    identity, pins = None, None
    if kind == "pinned":  # every rank's long-term key is pinned; rank <rest> presents another key
        from fhelium.multiparty.dealing import DealingIdentity

        folder = os.environ["TOFN_PINS_DIR"]
        with open(os.path.join(folder, "pins.json"), encoding="utf-8") as file:
            pins = {int(k): v for k, v in json.load(file).items()}
        own = DealingIdentity.load(os.path.join(folder, f"key{rank}"))
        identity = DealingIdentity.generate() if rank == int(rest) else own
    session = ThresholdSession(
        channel, session="tofn", threshold=threshold, dealing_identity=identity, dealing_pins=pins
    )
    return channel, session


def _rounds(
    session: ThresholdSession, count: int, rank: int, victim: bool, phase: str
) -> list[dict[str, Any]]:
    """``count`` aggregation rounds; a victim SIGKILLs itself at ``phase`` of the first."""
    rounds: list[dict[str, Any]] = []
    for round_number in range(1, count + 1):
        if victim and phase == "before":
            die(rank, phase)

        def hook() -> None:
            if victim and phase == "after":
                die(rank, phase)

        def audit(name: str, _: torch.Tensor) -> None:
            if victim and phase == "mid" and name == "decryption_share":
                die(rank, phase)

        try:
            total = session.aggregate(padded(rank, round_number), before_contribution=hook, record=audit)
            covered = session.contributors
            truth = sum(update(r, round_number) for r in covered)
            error = float((total.reshape(-1)[:COUNT] - truth).abs().max())
            rounds.append({"ok": True, "contributors": covered, "max_error": error})
        except Exception as error:  # report every failure as data
            rounds.append({
                "ok": False, "error": type(error).__name__, "message": str(error),
                "missing": getattr(error, "missing", None), "trace": traceback.format_exc(),
            })
    return rounds


def main() -> int:
    scenario, threshold, timeout_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timedelta(seconds=60)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    kind, _, rest = scenario.partition(":")
    victims: list[int] = []
    phase = ""
    if kind == "kill":
        who, _, phase = rest.partition(":")
        victims = [int(r) for r in who.split(",")]
    result: dict[str, Any] = {"rank": rank}
    started = time.monotonic()
    try:
        channel, session = _session(kind, rest, rank, threshold, timeout_s, store)
        if rank in victims and phase == "keys":
            honest_gather = channel.all_gather_bytes

            def gather_then_die(tag: str, data: bytes, max_bytes: int = MAX_RECORD_BYTES) -> list[bytes]:
                if tag == "shamir-points":
                    die(rank, phase)
                return honest_gather(tag, data, max_bytes)

            channel.all_gather_bytes = gather_then_die  # type: ignore[method-assign]
        dealt: dict[int, torch.Tensor] = {}
        if kind == "observe":
            from fhelium.multiparty import shamir

            honest_deal = shamir.deal

            def deal_and_keep(party: Any, t: int) -> dict[int, torch.Tensor]:  # noqa: ANN401
                points = honest_deal(party, t)
                dealt.update({k: v.clone() for k, v in points.items()})
                return points

            shamir.deal = deal_and_keep  # type: ignore[assignment]
        session.generate_public_key()
        result["fingerprint"] = session.dealing_fingerprint
        if kind == "observe":
            result.update(_observe(session, channel, dealt))  # type: ignore[arg-type]
            return _finish(result, started, store)
        if kind == "decrypt":  # t-out-of-N keys refuse decrypt, even with the opt-in
            try:
                session.decrypt(session.encrypt(padded(0, 1)), assume_identical=True)
                result.update(decrypt="returned")
            except Exception as error:
                result.update(decrypt=type(error).__name__, decrypt_message=str(error))
        rounds = _rounds(session, 2 if kind in ("mean", "malicious") else 1, rank, rank in victims, phase)
        result.update(ok=True, rounds=rounds, decrypted_rows=session.party.decrypted_rows)
    except Exception as error:  # report every failure as data
        result.update(ok=False, error=type(error).__name__, message=str(error), trace=traceback.format_exc())
    return _finish(result, started, store)


def _observe(
    session: ThresholdSession, channel: ObservedChannel, dealt: dict[int, torch.Tensor]
) -> dict[str, Any]:
    """What an observer of the transport could do with the dealing: find this rank's points, open them."""
    from fhelium.multiparty import dealing

    wire = b"".join(b"".join(records) for records in channel.wire.values())
    rank, world = channel.rank, channel.world_size
    found, chunks = 0, 0
    for receiver, point in dealt.items():
        if receiver == rank:
            continue
        raw = point.contiguous().cpu().numpy().tobytes()
        for offset in range(0, len(raw) - 32, 4096):
            chunks += 1
            found += raw[offset : offset + 32] in wire
    keys = channel.wire["dealing-keys"]
    dealer = (rank + 1) % world
    record = channel.wire["shamir-points"][dealer]
    common = dict(session=session.party.session, seed=session.common_seed, threshold=session.threshold or 0,
                  moduli=session.engine.moduli, ring_degree=session.engine.ring_degree)
    attempts = {}
    for name, identity, receiver in (
        ("outsider", dealing.DealingIdentity.generate(), rank),  # a key the controller could make
        ("another_rank", session.dealing_identity, (rank + 2) % world),  # this rank opening a third's point
        ("receiver", session.dealing_identity, rank),  # its own: must open
    ):
        assert identity is not None
        try:
            recipient = dealing.Recipient(identity, receiver, keys)
            dealing.open_point(recipient, record, dealer=dealer, **common)  # type: ignore[arg-type]
            attempts[name] = "opened"
        except dealing.DealingError as error:
            attempts[name] = str(error)
    return {
        "ok": True,
        "chunks_on_wire": found,
        "chunks": chunks,
        "record_bytes": [len(r) for r in channel.wire["shamir-points"]],
        "point_bytes": dealing.point_bytes(len(session.engine.moduli), session.engine.ring_degree),
        "attempts": attempts,
    }


def _finish(result: dict[str, Any], started: float, store: Any) -> int:  # noqa: ANN401
    result["seconds"] = time.monotonic() - started
    print(json.dumps(result), flush=True)
    os._exit(0)  # no destroy_process_group: a departed peer would make it wait


if __name__ == "__main__":
    sys.exit(main())
