"""t-out-of-N threshold decryption (Shamir re-sharing of the additive secret shares), in process.

After the N-out-of-N key generation every party i holds an additive share s_i of s = Σ s_i. For a
threshold t, party i deals f_i(x) = s_i + Σ_{k=1}^{t-1} r_ik·x^k with uniform r_ik in R_QP (purpose
``share``) and gives party j the point f_i(x_j), x_j = j + 1; party j's Shamir share is
sk_j = Σ_i f_i(x_j) = F(x_j) with F(0) = s. Any t parties T turn their Shamir shares into additive
ones, s'_j = λ_j·sk_j with the Lagrange coefficients λ_j = Π_{k∈T, k≠j} x_k / (x_k − x_j) (mod each
prime), so Σ_{j∈T} s'_j = s, and decrypt with the usual flooded decryption shares; fewer than t
shares give noise. As in Lattigo's t-out-of-N (Mouchet et al., PETS 2021, section 5), all arithmetic
is pointwise on the NTT-domain residues.

What is not here: the transport. The point f_i(x_j) is a secret for party j alone: across processes
``ThresholdSession(threshold=t)`` seals each point to its receiver's X25519 dealing key
(``fhelium.multiparty.dealing``) and ``fhelium.multiparty.dropout`` runs rounds that survive ranks
leaving.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from fhelium.engine import modular as mod
from fhelium.multiparty.protocol import MissingSharesError, MultipartyError, ThresholdParty
from fhelium.multiparty.values import SecretKeyShare


def evaluation_point(party: int) -> int:
    return party + 1


def deal(party: ThresholdParty, threshold: int) -> dict[int, torch.Tensor]:
    """Party ``party``'s points f_i(x_j) for every party j (residues over QP, NTT domain)."""
    if party.secret is None:
        raise MultipartyError("deal before key_share: this party holds no secret share")
    if not 1 <= threshold <= party.parties:
        raise MultipartyError(f"threshold must be in [1, {party.parties}]; got {threshold}")
    engine = party.engine
    ids = party.secret.prime_ids
    m = engine._mod(ids)
    coefficients = engine.random.stream("share").uniform_below(
        m.q.cpu(), (threshold - 1, len(ids), engine.ring_degree)
    ).to(engine.device)
    secret = party.secret.data
    moduli = engine.moduli_for(ids)
    points: dict[int, torch.Tensor] = {}
    for receiver in range(party.parties):
        if threshold == 1:
            points[receiver] = secret.clone()
            continue
        x = evaluation_point(receiver)
        point = torch.tensor([x % q for q in moduli], dtype=torch.int64, device=engine.device)
        point = point.unsqueeze(-1).expand_as(secret).contiguous()
        # Horner: f(x) = s + x·(r_1 + x·(r_2 + … + x·r_{t-1}))
        value = coefficients[threshold - 2].clone()
        for k in range(threshold - 3, -1, -1):
            value = mod.mul_mod(value, point, m.q, m.q_inverse)
            mod.add_mod_(value, coefficients[k], m.q)
        value = mod.mul_mod(value, point, m.q, m.q_inverse)
        mod.add_mod_(value, secret, m.q)
        points[receiver] = value
    return points


def receive(party: ThresholdParty, points: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """sk_j = Σ_i f_i(x_j) from every dealer's point for this party."""
    missing = sorted(set(range(party.parties)) - set(points))
    if missing:
        raise MissingSharesError(
            f"the Shamir share needs a point from every dealer; missing rank(s) {missing}", missing
        )
    engine = party.engine
    ids = tuple(range(len(engine.moduli)))
    q = engine._mod(ids).q
    total = points[0].clone()
    for dealer in range(1, party.parties):
        mod.add_mod_(total, points[dealer], q)
    return total


def lagrange_coefficients(active: Sequence[int], moduli: Sequence[int]) -> dict[int, list[int]]:
    """λ_j at 0 for the points of ``active`` parties, one residue per prime."""
    xs = {j: evaluation_point(j) for j in active}
    result: dict[int, list[int]] = {}
    for j in active:
        per_prime = []
        for q in moduli:
            numerator, denominator = 1, 1
            for k in active:
                if k != j:
                    numerator = numerator * xs[k] % q
                    denominator = denominator * (xs[k] - xs[j]) % q
            per_prime.append(numerator * pow(denominator, -1, q) % q)
        result[j] = per_prime
    return result


def activate(
    party: ThresholdParty, shamir_share: torch.Tensor, active: Sequence[int], threshold: int
) -> SecretKeyShare:
    """Make ``party.secret`` this party's additive share among ``active`` (λ_j·sk_j); returns it.

    Afterwards ``party.decryption_share`` works as in N-out-of-N, and the shares of exactly the
    ``active`` parties decrypt (``combine_decryption(..., parties=...)`` is not used: the caller
    sums the active parties' shares).
    """
    active = sorted(set(active))
    if party.party not in active:
        raise MultipartyError(f"party {party.party} is not among the active parties {active}")
    if len(active) < threshold:
        missing = sorted(set(range(party.parties)) - set(active))
        raise MissingSharesError(
            f"t-out-of-N decryption needs {threshold} of {party.parties} parties; only {len(active)} are "
            f"active (missing rank(s) {missing})",
            missing,
        )
    engine = party.engine
    ids = tuple(range(len(engine.moduli)))
    m = engine._mod(ids)
    coefficient = torch.tensor(
        lagrange_coefficients(active, engine.moduli_for(ids))[party.party],
        dtype=torch.int64,
        device=engine.device,
    ).unsqueeze(-1)
    data = mod.mul_mod(shamir_share, coefficient.expand_as(shamir_share).contiguous(), m.q, m.q_inverse)
    party.secret = SecretKeyShare(data, ids, party.party, party.parties)
    return party.secret


__all__ = ["activate", "deal", "evaluation_point", "lagrange_coefficients", "receive"]
