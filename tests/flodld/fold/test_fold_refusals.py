"""Refusals of the fold layer: every bad header or value is a counted, typed refusal, never a crash."""

from __future__ import annotations

import pytest
import torch

from flodld.fold.base import FoldError, ModularFold
from flodld.fold.codec import CodecError, decode_bundle, encode_bundle
from flodld.wire.data import TensorSpec

HUGE_EMPTY_SHAPES = [
    [0] + [2**40 - 1] * 7,  # the shape from the report: zero elements, stride overflow in torch
    [2**40 - 1] * 7 + [0],
    [0, 2**40 - 1, 2**40 - 1],
]


@pytest.mark.parametrize("shape", HUGE_EMPTY_SHAPES, ids=["leading-zero", "trailing-zero", "two-huge"])
@pytest.mark.parametrize("dtype", ["float32", "int64", "bfloat16"])
def test_a_zero_element_tensor_with_huge_dimensions_is_a_codec_error(shape: list[int], dtype: str) -> None:
    spec = TensorSpec.model_validate({"dtype": dtype, "shape": shape})
    assert spec.nbytes() == 0
    with pytest.raises(CodecError, match="tensor 0"):
        decode_bundle([spec], b"")


def test_the_bad_tensor_is_named_among_good_ones() -> None:
    specs, tail = encode_bundle((torch.ones(3), torch.empty(0, 4)))
    bad = TensorSpec.model_validate({"dtype": "float32", "shape": HUGE_EMPTY_SHAPES[0]})
    with pytest.raises(CodecError, match="tensor 2"):
        decode_bundle([*specs, bad], tail)


def test_ordinary_zero_element_tensors_still_decode() -> None:
    tensors = (torch.empty(0, 4), torch.empty(3, 0, 2**20, dtype=torch.int64))
    specs, tail = encode_bundle(tensors)
    decoded = decode_bundle(specs, tail)
    assert [tuple(t.shape) for t in decoded] == [(0, 4), (3, 0, 2**20)]


# --- ModularFold range-checks residues --------------------------------------------------------------


def _fold_one(fold: ModularFold, value: torch.Tensor) -> torch.Tensor:
    accumulator = fold.add(fold.identity((value,)), (value,))
    return fold.finish(accumulator, 1.0)[0]


def test_residues_in_range_fold_including_q_minus_one() -> None:
    fold = ModularFold([97, 101])
    value = torch.tensor([[[96, 0], [100, 5]]], dtype=torch.int64)
    assert torch.equal(_fold_one(fold, value), value)


@pytest.mark.parametrize(
    "value",
    [
        [[[97, 0], [0, 0]]],  # == q of limb 0
        [[[0, 0], [0, 101]]],  # == q of limb 1
        [[[0, 0], [2**62, 0]]],  # far beyond
        [[[-1, 0], [0, 0]]],  # negative
        [[[2**63 - 1, 2**63 - 1], [2**63 - 1, 2**63 - 1]]],  # two of these would wrap int64
    ],
    ids=["q0", "q1", "huge", "negative", "int64-max"],
)
def test_a_residue_outside_its_limbs_range_is_refused(value: list[list[list[int]]]) -> None:
    fold = ModularFold([97, 101])
    with pytest.raises(FoldError, match=r"outside \[0, q\)"):
        _fold_one(fold, torch.tensor(value, dtype=torch.int64))


def test_an_out_of_range_second_contribution_leaves_the_accumulator_untouched() -> None:
    fold = ModularFold([97])
    good = torch.tensor([[5, 6]], dtype=torch.int64)
    accumulator = fold.add(fold.identity((good,)), (good,))
    with pytest.raises(FoldError):
        fold.add(accumulator, (torch.tensor([[97, 0]], dtype=torch.int64),))
    assert torch.equal(accumulator[0], good)
