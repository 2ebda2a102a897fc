"""The sum checks' secret challenge (fhelium.multiparty.challenge): agreement, rounds, verdicts."""

from __future__ import annotations

import pytest
import torch

from fhelium.multiparty import challenge
from fhelium.multiparty.dealing import DealingIdentity, Recipient
from fhelium.multiparty.sumcheck import project

Q = torch.tensor([[1125899905744897], [1125899906629633]], dtype=torch.int64)
N = 64
SESSION, COMMON = "s", b"\x07" * 32


def _agree(
    world: int, seeds_of: dict[int, dict[int, bytes]] | None = None
) -> tuple[list[bytes], list[bytes]]:
    """Every rank's (confirmation, key) after sealing and opening: ``seeds_of[dealer]`` overrides what
    a dealer seals to each receiver (an equivocating dealer).
    """
    identities = [DealingIdentity.generate() for _ in range(world)]
    keys = [identity.public_bytes for identity in identities]
    own = [challenge.fresh_seed() for _ in range(world)]
    records = [
        challenge.seal_seed(
            identities[dealer],
            (seeds_of or {}).get(dealer, dict.fromkeys(range(world), own[dealer])),
            keys,
            dealer=dealer,
            session=SESSION,
            common_seed=COMMON,
        )
        for dealer in range(world)
    ]
    confirmations, agreed = [], []
    for receiver in range(world):
        seeds = [
            own[receiver] if dealer == receiver else challenge.open_seed(
                Recipient(identities[receiver], receiver, keys), records[dealer], dealer=dealer,
                session=SESSION, common_seed=COMMON,
            )
            for dealer in range(world)
        ]
        confirmations.append(challenge.confirmation(SESSION, COMMON, keys, seeds))
        agreed.append(challenge.challenge_key(SESSION, COMMON, keys, seeds))
    return confirmations, agreed


def test_every_rank_derives_the_same_key_and_its_confirmations_agree() -> None:
    confirmations, keys = _agree(4)
    assert len(set(keys)) == 1 and len(keys[0]) == 32
    for rank in range(4):
        challenge.check_confirmations(rank, confirmations)


def test_a_dealer_sealing_different_seeds_to_different_ranks_is_named_on_every_rank() -> None:
    confirmations, keys = _agree(3, {2: {0: b"\x01" * 32, 1: b"\x02" * 32}})
    assert len(set(keys)) > 1  # without the confirmations the ranks would go on with different keys
    for rank in range(3):
        with pytest.raises(challenge.ChallengeKeyError, match=r"rank\(s\) \[2\] sealed different") as caught:
            challenge.check_confirmations(rank, confirmations)
        assert caught.value.ranks == [2]


def test_a_sealed_seed_opens_only_for_its_receiver_in_its_session_and_key_generation() -> None:
    identities = [DealingIdentity.generate() for _ in range(3)]
    keys = [identity.public_bytes for identity in identities]
    seed = challenge.fresh_seed()
    record = challenge.seal_seed(
        identities[0], dict.fromkeys(range(3), seed), keys, dealer=0, session=SESSION, common_seed=COMMON
    )
    assert seed not in record  # the transport carries no seed in the clear
    common = {"dealer": 0, "session": SESSION, "common_seed": COMMON}
    receiver = Recipient(identities[2], 2, keys)
    assert challenge.open_seed(receiver, record, **common) == seed  # type: ignore[arg-type]
    tampered = bytearray(record)
    tampered[-1] ^= 1
    attempts = [
        (receiver, bytes(tampered), common),  # altered
        (Recipient(identities[1], 2, keys), record, common),  # another rank's key
        (receiver, record, {**common, "session": "t"}),  # another session
        (receiver, record, {**common, "common_seed": b"\x08" * 32}),  # key gen
        (receiver, record[:-1], common),  # truncated
    ]
    for recipient, blob, kwargs in attempts:
        with pytest.raises(challenge.ChallengeKeyError, match="rank 0") as caught:
            challenge.open_seed(recipient, blob, **kwargs)  # type: ignore[arg-type]
        assert caught.value.ranks == [0]


def _challenge(key: bytes, round_number: int, rank: int, world: int = 3, what: str = "ciphertext-c1",
               rows: tuple[int, ...] = (4, 3)) -> challenge.RoundChallenge:
    return challenge.round_challenge(
        key, session=SESSION, round_number=round_number, what=what, rank=rank, world=world, moduli=Q,
        part_rows=list(rows), ring_degree=N,
    )


def test_the_masks_add_up_to_the_total_and_every_round_and_exchange_draws_fresh_values() -> None:
    key = bytes(range(32))
    world = 3
    drawn = [_challenge(key, 1, rank, world) for rank in range(world)]
    assert all(torch.equal(d.weights[0], drawn[0].weights[0]) for d in drawn)  # shared multipliers
    total = torch.remainder(sum(d.mask for d in drawn), Q)
    assert torch.equal(total, drawn[0].total_mask)
    for d in drawn:
        assert d.weights[0].shape == (4, 2, 1) and d.weights[1].shape == (3, 2, 1)
        assert d.mask.shape == (2, 2, 1) and d.flag.shape == (2, 2, 1) and d.coefficients.shape == (2, N)
        assert bool((d.flag > 0).all()) and bool((d.flag < Q).all()) and bool((d.mask < Q).all())
    others = [
        _challenge(key, 2, 0), _challenge(key, 1, 0, what="decryption-contributions"),
        _challenge(bytes(32), 1, 0), _challenge(key, 1, 0, world=4),
    ]
    for other in others:
        assert not torch.equal(other.weights[0], drawn[0].weights[0])
        assert not torch.equal(other.total_mask, drawn[0].total_mask)
    assert not torch.equal(drawn[0].weights[0][:3], drawn[0].weights[1])  # per slice


def _round(
    key: bytes, round_number: int, inputs: list[torch.Tensor], flagged: frozenset[int] = frozenset()
) -> tuple[challenge.RoundChallenge, torch.Tensor]:
    """(rank 0's challenge, the honest fold's sum of every rank's masked projection) for one slice."""
    world = len(inputs)
    drawn = [_challenge(key, round_number, rank, world, rows=(inputs[0].size(0),)) for rank in range(world)]
    q_inverse = 1.0 / Q.double()
    masked = [
        challenge.masked(
            [challenge.compress(project(x, d.weights[0], Q, q_inverse), d.coefficients, Q)], d, Q,
            flagged=rank in flagged,
        )
        for rank, (x, d) in enumerate(zip(inputs, drawn, strict=True))
    ]
    return drawn[0], torch.remainder(sum(masked), Q)


def _verdict(drawn: challenge.RoundChallenge, summed: torch.Tensor, held: torch.Tensor, world: int) -> int:
    projected = project(held, drawn.weights[0], Q, 1.0 / Q.double())
    projection = challenge.compress(projected, drawn.coefficients, Q)
    return challenge.sum_verdict(projection, summed[0], drawn.total_mask[0], drawn.flag[0], Q, world)


def _kernel(weights: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    delta = torch.zeros_like(like)
    for limb, modulus in enumerate(int(m) for m in Q.reshape(-1)):
        w0, w1 = int(weights[0, limb, 0]), int(weights[1, limb, 0])
        delta[0, limb], delta[1, limb] = 1, (-w0 * pow(w1, -1, modulus)) % modulus
    return delta


def test_a_fold_that_learned_the_previous_rounds_challenge_gains_nothing() -> None:
    """A sum forged to pass round 1's check (plus a difference its multipliers project to 0) passes
    round 1's check and is refused in round 2, whose multipliers and masks are fresh; the honest sum
    passes, a flagged contribution is counted, and a subset sum is refused.
    """
    key = challenge.fresh_seed()
    generator = torch.Generator().manual_seed(3)
    inputs = [torch.randint(0, 1 << 49, (4, 2, N), generator=generator) for _ in range(3)]
    honest = torch.remainder(sum(inputs), Q)
    first, summed_first = _round(key, 1, inputs)
    forged = torch.remainder(honest + _kernel(first.weights[0], honest), Q)
    assert _verdict(first, summed_first, honest, 3) == 0
    assert _verdict(first, summed_first, forged, 3) == 0  # the forgery is valid against round 1's challenge
    second, summed_second = _round(key, 2, inputs)
    assert _verdict(second, summed_second, honest, 3) == 0
    assert _verdict(second, summed_second, forged, 3) == challenge.NOT_THE_SUM
    subset = torch.remainder(honest - inputs[1], Q)
    assert _verdict(second, summed_second, subset, 3) == challenge.NOT_THE_SUM
    flagged, summed_flagged = _round(key, 2, inputs, frozenset({1, 2}))
    assert _verdict(flagged, summed_flagged, honest, 3) == 2

    # the fold's view of a round's projections: every rank's masked projection is uniform to it; all of
    # them but one, or their sum less nothing, do not give the projection of anything
    assert not torch.equal(summed_second[0], project(honest, second.weights[0], Q, 1.0 / Q.double()))


def test_compressing_a_projection_is_exact_modulo_each_prime() -> None:
    """The second stage sums 8192 products below 2^50 in chunks: the result is the exact modular sum."""
    generator = torch.Generator().manual_seed(5)
    q = torch.tensor([[1125899905744897], [1125899906629633]], dtype=torch.int64)
    projection = torch.remainder(torch.randint(0, 1 << 62, (2, 8192), generator=generator), q)
    coefficients = torch.remainder(torch.randint(0, 1 << 62, (2, 8192), generator=generator), q)
    expected = [
        sum(int(a) * int(b) for a, b in zip(projection[limb], coefficients[limb], strict=True)) % int(q[limb])
        for limb in range(2)
    ]
    assert challenge.compress(projection, coefficients, q).reshape(-1).tolist() == expected


def test_a_record_of_the_wrong_length_or_a_replaced_own_key_is_refused_naming_the_dealer() -> None:
    identities = [DealingIdentity.generate() for _ in range(3)]
    keys = [identity.public_bytes for identity in identities]
    common = {"session": SESSION, "common_seed": COMMON}
    record = challenge.seal_seed(identities[0], {1: b"a" * 32, 2: b"a" * 32}, keys, dealer=0, **common)  # type: ignore[arg-type]
    short = r"rank 0's record is 119 bytes; expected 120"
    with pytest.raises(challenge.ChallengeKeyError, match=short) as error:
        challenge.open_seed(Recipient(identities[1], 1, keys), record[:-1], dealer=0, **common)  # type: ignore[arg-type]
    assert error.value.ranks == [0]
    with pytest.raises(challenge.ChallengeKeyError, match="own public key was replaced"):
        challenge.seal_seed(identities[1], {1: b"a" * 32, 2: b"a" * 32}, keys, dealer=0, **common)  # type: ignore[arg-type]
