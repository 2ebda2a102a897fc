"""t-out-of-N (Shamir re-sharing) in process: any t parties decrypt, t-1 give noise."""

from __future__ import annotations

import itertools

import pytest
import torch

from fhelium.engine import modular as mod
from fhelium.multiparty import MissingSharesError, ThresholdParty
from fhelium.multiparty.shamir import activate, deal, receive


def test_any_t_of_n_parties_decrypt_and_fewer_give_noise() -> None:
    torch.set_num_threads(1)
    parties, threshold = 5, 3
    members = [ThresholdParty(rank, parties, session="t", rng_seed=300 + rank) for rank in range(parties)]
    commitments = [m.commit_seed() for m in members]
    reveals = [m.reveal_seed() for m in members]
    seed = members[0].combine_seed(commitments, reveals)
    public = members[0].combine_public_key([m.key_share(seed) for m in members], seed)
    dealt = [deal(m, threshold) for m in members]
    shamir = [receive(m, {dealer: dealt[dealer][m.party] for dealer in range(parties)}) for m in members]
    updates = [torch.rand(1, 4096, generator=torch.Generator().manual_seed(r), dtype=torch.float64) * 2 - 1
               for r in range(parties)]
    engine = members[0].engine
    total = engine.sum([m.encrypt(u, public) for m, u in zip(members, updates, strict=True)])
    truth = sum(updates)
    q = engine._mod(total.prime_ids).q

    def decrypt_with(active: tuple[int, ...]) -> torch.Tensor:
        summed = None
        for j in active:
            activate(members[j], shamir[j], active, threshold)
            share = members[j].decryption_share(total).data
            summed = share if summed is None else mod.add_mod(summed, share, q)
        assert summed is not None
        return members[active[0]].combine_decryption(total, summed).real

    for active in itertools.combinations(range(parties), threshold):
        assert float((decrypt_with(active) - truth).abs().max()) < 1e-5, active
    # t-1 parties cannot even activate; their raw Shamir-based shares sum to noise
    with pytest.raises(MissingSharesError, match=r"needs 3 of 5 parties; only 2 are active"):
        activate(members[0], shamir[0], (0, 1), threshold)
    activate(members[0], shamir[0], (0, 1, 2), threshold)
    activate(members[1], shamir[1], (0, 1, 2), threshold)
    partial = mod.add_mod(members[0].decryption_share(total).data, members[1].decryption_share(total).data, q)
    garbage = members[0].combine_decryption(total, partial).real
    assert float((garbage - truth).abs().mean()) > 100
