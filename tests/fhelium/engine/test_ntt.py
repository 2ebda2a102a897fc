from __future__ import annotations

import random

import pytest
import torch
from ckks_bigint_reference import negacyclic_product

from fhelium.engine.modular import mul_mod
from fhelium.engine.ntt import NegacyclicNtt
from fhelium.engine.primes import ntt_primes, primitive_root_of_unity


def _setup(n: int) -> tuple[NegacyclicNtt, list[int]]:
    moduli = ntt_primes(50, n, 1) + ntt_primes(40, n, 1) + ntt_primes(30, n, 1)
    return NegacyclicNtt(n, moduli, torch.device("cpu")), moduli


def _random_rows(moduli: list[int], n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(q) for _ in range(n)] for q in moduli]


def test_round_trip_is_exact_with_batch_axes() -> None:
    n = 256
    ntt, moduli = _setup(n)
    ids = (0, 1, 2)
    x = torch.stack([torch.tensor(_random_rows(moduli, n, seed)) for seed in range(4)]).view(2, 2, 3, n)
    forward = ntt.forward(x, ids)
    assert not torch.equal(forward, x)
    assert torch.equal(ntt.inverse(forward, ids), x)


def test_pointwise_product_is_the_negacyclic_product() -> None:
    n = 32
    ntt, moduli = _setup(n)
    ids = (0, 1, 2)
    a, b = _random_rows(moduli, n, 1), _random_rows(moduli, n, 2)
    q = torch.tensor(moduli).unsqueeze(-1)
    product = mul_mod(
        ntt.forward(torch.tensor(a), ids), ntt.forward(torch.tensor(b), ids), q, 1.0 / q.double()
    )
    result = ntt.inverse(product, ids).tolist()
    for row, modulus in enumerate(moduli):
        assert result[row] == negacyclic_product(a[row], b[row], modulus)


def test_entry_t_is_the_evaluation_at_an_odd_power_of_psi() -> None:
    n = 16
    ntt, moduli = _setup(n)
    q = moduli[0]
    psi = primitive_root_of_unity(2 * n, q)
    a = _random_rows(moduli, n, 3)[0]
    evaluated = ntt.forward(torch.tensor([a]), (0,))[0].tolist()
    assert evaluated == [sum(c * pow(psi, (2 * t + 1) * i, q) for i, c in enumerate(a)) % q for t in range(n)]


def test_row_subsets_use_their_own_primes() -> None:
    n = 64
    ntt, moduli = _setup(n)
    rows = torch.tensor(_random_rows(moduli, n, 4))
    full = ntt.forward(rows, (0, 1, 2))
    assert torch.equal(ntt.forward(rows[1:], (1, 2)), full[1:])


@pytest.mark.slow
def test_compiled_stages_agree_with_big_integers_and_eager() -> None:
    """The opt-in torch.compile path: exact negacyclic products, bit-identical to eager."""
    n = 32
    moduli = ntt_primes(50, n, 1) + ntt_primes(40, n, 1) + ntt_primes(30, n, 1)
    compiled = NegacyclicNtt(n, moduli, torch.device("cpu"), compiled=True)
    eager = NegacyclicNtt(n, moduli, torch.device("cpu"), compiled=False)
    ids = (0, 1, 2)
    a, b = _random_rows(moduli, n, 5), _random_rows(moduli, n, 6)
    q = torch.tensor(moduli).unsqueeze(-1)
    forward_a = compiled.forward(torch.tensor(a), ids)
    assert torch.equal(forward_a, eager.forward(torch.tensor(a), ids))
    product = mul_mod(forward_a, compiled.forward(torch.tensor(b), ids), q, 1.0 / q.double())
    result = compiled.inverse(product, ids)
    assert torch.equal(result, eager.inverse(product, ids))
    for row, modulus in enumerate(moduli):
        assert result[row].tolist() == negacyclic_product(a[row], b[row], modulus)
    batch = torch.stack([torch.tensor(_random_rows(moduli, n, seed)) for seed in range(4)]).view(2, 2, 3, n)
    assert torch.equal(compiled.inverse(compiled.forward(batch, ids), ids), batch)
