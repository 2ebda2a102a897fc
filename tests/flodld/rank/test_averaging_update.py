"""cpu_async's update rule (`flodld.rank.averaging.elastic_update`), as docs/user-guide.md states it:
x <- x + alpha * (avg_r - x_r), x_r being what the rank deposited for round r.
"""

from __future__ import annotations

import pytest
import torch

from flodld.rank.averaging import DEFAULT_ASYNC_ALPHA, elastic_update


def test_the_update_is_x_plus_alpha_times_average_minus_deposit() -> None:
    current = (torch.tensor([5.0, -1.0]), torch.tensor([[2.0]]))
    deposited = (torch.tensor([4.0, 0.0]), torch.tensor([[1.0]]))
    average = (torch.tensor([2.0, 2.0]), torch.tensor([[3.0]]))
    updated = elastic_update(current, deposited, average, 0.25)
    assert updated[0].tolist() == [5.0 + 0.25 * (2.0 - 4.0), -1.0 + 0.25 * (2.0 - 0.0)]
    assert updated[1].tolist() == [[2.0 + 0.25 * (3.0 - 1.0)]]
    # Pure: the inputs are untouched.
    assert current[0].tolist() == [5.0, -1.0] and deposited[0].tolist() == [4.0, 0.0]
    assert DEFAULT_ASYNC_ALPHA == 0.5


def test_local_progress_made_while_the_round_travelled_is_kept() -> None:
    deposited = (torch.tensor([1.0, 1.0]),)
    average = (torch.tensor([3.0, -1.0]),)
    progress = torch.tensor([0.5, -0.25])  # the local steps taken since the deposit
    current = (deposited[0] + progress,)
    # alpha 1: the deposited part becomes the average, the progress stays on top of it.
    assert elastic_update(current, deposited, average, 1.0)[0].tolist() == (average[0] + progress).tolist()
    # Any alpha: the same progress on top of the deposit pulled alpha of the way to the average.
    for alpha in (0.25, 0.5):
        expected = deposited[0] + alpha * (average[0] - deposited[0]) + progress
        assert torch.allclose(elastic_update(current, deposited, average, alpha)[0], expected)


def test_equal_weight_ranks_keep_their_mean_and_their_spread_shrinks_by_one_minus_alpha() -> None:
    deposits = [torch.tensor([1.0, 4.0]), torch.tensor([3.0, -2.0]), torch.tensor([8.0, 1.0])]
    average = torch.stack(deposits).mean(0)
    updated = [elastic_update((x,), (x,), (average,), 0.5)[0] for x in deposits]  # no local steps
    assert torch.allclose(torch.stack(updated).mean(0), average)
    for before, after in zip(deposits, updated, strict=True):
        assert torch.allclose(after - average, 0.5 * (before - average))


def test_the_result_keeps_the_current_tensors_device_and_dtype_and_records_no_gradient() -> None:
    parameter = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))
    (updated,) = elastic_update((parameter,), (torch.tensor([1.0, 2.0]),), (torch.tensor([3.0, 2.0]),), 0.5)
    assert updated.dtype == torch.float64 and updated.device == parameter.device
    assert updated.tolist() == [2.0, 2.0]
    assert not updated.requires_grad and updated.grad_fn is None


@pytest.mark.parametrize(
    ("current", "deposited", "average", "alpha", "message"),
    [
        ([torch.ones(2)], [torch.ones(2)], [torch.ones(2)], 0.0, r"alpha must be in \(0, 1\], got 0.0"),
        ([torch.ones(2)], [torch.ones(2)], [torch.ones(2)], 1.5, r"alpha must be in \(0, 1\], got 1.5"),
        ([torch.ones(2)], [torch.ones(2)], [torch.ones(2)], float("nan"), r"alpha must be in \(0, 1\]"),
        ([torch.ones(2)], [], [torch.ones(2)], 0.5, "current 1, deposited 0, average 1"),
        ([torch.ones(2)], [torch.ones(3)], [torch.ones(2)], 0.5, r"tensor 0: .*deposited \(3,\)"),
        (
            [torch.ones(2, dtype=torch.long)],
            [torch.ones(2, dtype=torch.long)],
            [torch.ones(2, dtype=torch.long)],
            0.5,
            "tensor 0 is torch.int64: the elastic update needs floating tensors",
        ),
    ],
)
def test_bad_bundles_are_refused_naming_what_is_wrong(
    current: list[torch.Tensor],
    deposited: list[torch.Tensor],
    average: list[torch.Tensor],
    alpha: float,
    message: str,
) -> None:
    with pytest.raises(ValueError, match=message):
        elastic_update(current, deposited, average, alpha)
