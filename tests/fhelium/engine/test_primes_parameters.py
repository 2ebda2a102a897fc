from __future__ import annotations

from functools import partial

import pytest
from pydantic import ValidationError

from fhelium.engine import CkksParameters, Preset, preset_parameters
from fhelium.engine.primes import is_prime, ntt_primes, primitive_root_of_unity


def test_is_prime_matches_trial_division() -> None:
    def trial(n: int) -> bool:
        return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))

    assert [n for n in range(3000) if is_prime(n)] == [n for n in range(3000) if trial(n)]
    assert not is_prime(3215031751)  # strong pseudoprime to bases 2, 3, 5, 7


@pytest.mark.parametrize(("bits", "n"), [(30, 1024), (40, 16384), (50, 65536)])
def test_ntt_primes_are_ntt_friendly_and_distinct(bits: int, n: int) -> None:
    primes = ntt_primes(bits, n, 4)
    assert len(set(primes)) == 4
    for q in primes:
        assert is_prime(q) and q % (2 * n) == 1 and q.bit_length() == bits
        psi = primitive_root_of_unity(2 * n, q)
        assert pow(psi, n, q) == q - 1


def test_presets_have_distinct_primes_and_pass_security() -> None:
    for preset in Preset:
        parameters = preset_parameters(preset)
        assert len(set(parameters.moduli)) == len(parameters.moduli)
        assert [q.bit_length() for q in parameters.moduli] == [
            *parameters.scale_prime_bits,
            parameters.base_prime_bits,
            parameters.special_prime_bits,
        ]


def test_security_check_names_the_limit_and_the_opt_out() -> None:
    too_wide_for_the_ring = partial(
        CkksParameters,
        log_ring_degree=10,
        scale_bits=30,
        scale_prime_bits=(30,),
        base_prime_bits=40,
        special_prime_bits=40,
    )
    with pytest.raises(
        ValidationError, match=r"exceeds the 128-bit security limit of 27 bits.*enforce_security=False"
    ):
        too_wide_for_the_ring()
    too_wide_for_the_ring(enforce_security=False)


@pytest.mark.parametrize(
    ("scale_prime_bits", "special_prime_bits", "message"),
    [
        ((60,), 50, "between 20 and 50 bits"),
        ((40,), 40, "special_prime_bits=40 must be at least the largest Q prime"),
    ],
)
def test_parameter_errors_are_specific(
    scale_prime_bits: tuple[int, ...], special_prime_bits: int, message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        CkksParameters(
            log_ring_degree=14,
            scale_bits=40,
            scale_prime_bits=scale_prime_bits,
            base_prime_bits=50,
            special_prime_bits=special_prime_bits,
        )


def test_an_unknown_preset_is_named() -> None:
    with pytest.raises(ValueError, match="unknown CKKS preset 'nope'"):
        preset_parameters("nope")
