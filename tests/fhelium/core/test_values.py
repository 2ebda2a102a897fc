from __future__ import annotations

import pytest
import torch

from fhelium.core import (
    Ciphertext,
    CompressedPlaintext,
    FheliumValueError,
    KeySwitchKey,
    Plaintext,
    PublicKey,
    RotationKey,
    SecretKey,
    ShapeMismatchError,
    ValueStateError,
)


def make_ct(components: int = 2, batch: tuple[int, ...] = (), limbs: int = 3, n: int = 8) -> Ciphertext:
    data = torch.arange(components * limbs * n * max(1, len(batch) and batch[0]), dtype=torch.int64)
    return Ciphertext(data.reshape(components, *batch, limbs, n), 0, 2.0**20, tuple(range(limbs)))


def test_ciphertext_derived_shape_facts() -> None:
    ct = make_ct(components=3, batch=(4,), limbs=3)
    assert (ct.component_count, ct.batch_shape, ct.limb_count, ct.ring_dimension) == (3, (4,), 3, 8)
    assert ct.is_batched and ct.batch_size == 4
    assert torch.equal(ct.c2, ct.data[2])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"depth": -1}, "depth must be a non-negative int"),
        ({"depth": True}, "depth must be a non-negative int"),
        ({"scale": 0.0}, "scale must be a positive finite float"),
        ({"scale": float("inf")}, "scale must be a positive finite float"),
        ({"scale": "1"}, "scale must be a positive finite float"),
        ({"prime_ids": (0, 2, 2)}, "strictly increasing"),
        ({"prime_ids": (0, 1)}, "limb axis has 3 rows but prime_ids names 2"),
        ({"polynomial_domain": "eval"}, "polynomial_domain must be one of"),
        ({"modulus_basis": "P"}, "modulus_basis must be one of"),
        ({"residue_representation": "montgomery"}, "Coefficient-domain Ciphertext cannot use Montgomery"),
    ],
)
def test_ciphertext_rejects_bad_metadata(kwargs: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {
        "data": torch.zeros(2, 3, 8, dtype=torch.int64),
        "depth": 0,
        "scale": 2.0**20,
        "prime_ids": (0, 1, 2),
    }
    fields.update(kwargs)
    with pytest.raises(FheliumValueError, match=message):
        Ciphertext(**fields)  # type: ignore[arg-type]  # deliberately wrong inputs


def test_ciphertext_rejects_bad_tensors() -> None:
    with pytest.raises(FheliumValueError, match="dtype int64 or int32"):
        Ciphertext(torch.zeros(2, 1, 8), 0, 1.0, (0,))
    with pytest.raises(FheliumValueError, match="component axis"):
        Ciphertext(torch.zeros(4, 1, 8, dtype=torch.int64), 0, 1.0, (0,))
    with pytest.raises(FheliumValueError, match="at least 3 dimensions"):
        Ciphertext(torch.zeros(2, 8, dtype=torch.int64), 0, 1.0, (0,))


def test_slice_limbs_is_a_view_with_matching_prime_ids() -> None:
    ct = make_ct(limbs=4)
    part = ct.slice_limbs(1, 3)
    assert part.prime_ids == (1, 2) and part.data.shape == (2, 2, 8)
    part.data.fill_(-7)
    assert bool((ct.data[:, 1:3] == -7).all()) and not bool((ct.data[:, 0] == -7).any())
    with pytest.raises(FheliumValueError, match="0 <= start < stop <= 4; got start=2, stop=2"):
        ct.slice_limbs(2, 2)


def test_with_data_aliases_and_clone_copies() -> None:
    ct = make_ct()
    assert ct.with_data(ct.data).data.data_ptr() == ct.data.data_ptr()
    copy = ct.clone()
    assert copy.data.data_ptr() != ct.data.data_ptr() and torch.equal(copy.data, ct.data)


def test_stack_select_unbind_batch_round_trip() -> None:
    a, b = make_ct(), make_ct()
    b.data.add_(1)
    stacked = Ciphertext.stack_batch([a, b])
    assert stacked.batch_shape == (2,)
    assert torch.equal(stacked.select_batch(1).data, b.data)
    assert [torch.equal(x.data, y.data) for x, y in zip(stacked.unbind_batch(), [a, b], strict=True)] == [
        True,
        True,
    ]
    other = Ciphertext(torch.zeros(2, 3, 16, dtype=torch.int64), 0, 2.0**20, (0, 1, 2))
    with pytest.raises(ShapeMismatchError, match=r"values\[1\]"):
        Ciphertext.stack_batch([a, other])


def test_assert_state_names_the_mismatch() -> None:
    ct = make_ct()
    with pytest.raises(ValueStateError, match="lhs must have polynomial_domain='ntt'; got 'coefficient'"):
        ct.assert_state(polynomial_domain="ntt", name="lhs")
    with pytest.raises(ValueStateError, match="must have 3 components; got 2"):
        ct.assert_state(components=3)


def test_replace_keeps_identity() -> None:
    ct, other = make_ct(), make_ct(limbs=2)
    same = ct.replace_(other)
    assert same is ct and ct.prime_ids == (0, 1)


def test_plaintext_representations() -> None:
    slots = Plaintext(torch.ones(4), 0, 2.0**10)
    assert slots.batch_shape == ()
    rns = Plaintext(
        None, 1, 2.0, torch.zeros(2, 3, 8, dtype=torch.int64), "rns", "ntt", "Q", "standard", (1, 2, 3)
    )
    assert rns.batch_shape == (2,)
    with pytest.raises(FheliumValueError, match="exactly one representation"):
        Plaintext(torch.ones(4), 0, 1.0, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(FheliumValueError, match="carries no"):
        Plaintext(torch.ones(4), 0, 1.0, prime_ids=(0,))
    with pytest.raises(FheliumValueError, match="float64"):
        Plaintext(None, 0, 1.0, torch.zeros(4, dtype=torch.int64), "approximate_coefficients")
    with pytest.raises(FheliumValueError, match="limb axis"):
        Plaintext(None, 0, 1.0, torch.zeros(3, 8, dtype=torch.int64), "rns", "ntt", "Q", "standard", (0, 1))


@pytest.mark.parametrize("layout", ["cyclic", "contiguous", "strided_sparse"])
def test_compressed_plaintext_round_trip(layout: str) -> None:
    pattern = torch.tensor([[3, 5], [7, 11]], dtype=torch.int64)
    if layout == "cyclic":
        full = pattern.repeat(1, 4)
    elif layout == "contiguous":
        full = pattern.repeat_interleave(4, dim=-1)
    else:
        full = torch.full((2, 8), 9, dtype=torch.int64)
        full[:, ::4] = pattern
    pt = Plaintext(None, 0, 1.0, full, "rns", "coefficient", "Q", "standard", (0, 1))
    packed = CompressedPlaintext.from_plaintext(pt, unique_count=2, compression_layout=layout)  # type: ignore[arg-type]  # literal from parametrize
    assert packed.unique_count == 2 and packed.repeat_count == 4
    assert torch.equal(packed.to_plaintext().tensor, full)


def test_compressed_plaintext_refuses_lossy_input() -> None:
    pt = Plaintext(None, 0, 1.0, torch.arange(8).reshape(1, 8), "rns", "coefficient", "Q", "standard", (0,))
    with pytest.raises(FheliumValueError, match="not exactly representable"):
        CompressedPlaintext.from_plaintext(pt, unique_count=2, compression_layout="cyclic")


def test_keys_layouts_and_rotation_canonicalisation() -> None:
    sk = SecretKey(torch.zeros(3, 8, dtype=torch.int64), (0, 1, 2))
    assert sk.modulus_basis == "QP" and sk.polynomial_domain == "ntt"
    pk = PublicKey(torch.zeros(2, 2, 8, dtype=torch.int64), (0, 1))
    assert pk.modulus_basis == "Q" and pk.k1.shape == (2, 8)
    ksk = KeySwitchKey(torch.zeros(2, 2, 3, 8, dtype=torch.int64), (0, 1, 2))
    assert ksk.digit_count == 2
    rot = RotationKey(torch.zeros(2, 2, 3, 8, dtype=torch.int64), (0, 1, 2), rotation_step=3)
    assert rot.rotation_step == -1  # 4 slots: 3 ≡ -1
    with pytest.raises(FheliumValueError, match=r"PublicKey data must have (at least )?3 dimensions"):
        PublicKey(torch.zeros(2, 8, dtype=torch.int64), (0, 1))


def test_device_and_nbytes() -> None:
    ct = make_ct()
    assert ct.device.type == "cpu" and ct.nbytes == 2 * 3 * 8 * 8
    assert ct.to("cpu") is ct
    assert ct.to("cpu", copy=True).data.data_ptr() != ct.data.data_ptr()


def test_pin_memory_pins_or_names_the_missing_runtime() -> None:
    ct = make_ct()
    assert not ct.is_pinned
    try:
        pinned = ct.pin_memory()
    except FheliumValueError as error:
        assert "Pinned host storage is unavailable" in str(error)
    else:
        assert pinned.is_pinned and torch.equal(pinned.data, ct.data)
