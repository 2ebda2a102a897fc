from __future__ import annotations

import pytest
import torch

from flodld.fold.barrier import RoundBarrier, RoundError
from flodld.fold.base import (
    FoldError,
    MeanFold,
    ModularFold,
    fold_from_spec,
    register_fold,
)


def bundle(*values: float) -> tuple[torch.Tensor, ...]:
    return (torch.tensor(values, dtype=torch.float32), torch.full((2, 2), values[0]))


def test_mean_fold_divides_the_sum_by_the_total_weight() -> None:
    fold = MeanFold()
    accumulator = fold.identity(bundle(0.0, 0.0))
    accumulator = fold.add(accumulator, bundle(1.0, 2.0))
    accumulator = fold.add(accumulator, bundle(3.0, 6.0))
    result = fold.finish(accumulator, 2.0)
    assert torch.equal(result[0], torch.tensor([2.0, 4.0]))
    assert torch.equal(result[1], torch.full((2, 2), 2.0))


def test_fold_refuses_a_schema_change_with_the_offending_tensor_named() -> None:
    fold = MeanFold()
    accumulator = fold.identity(bundle(0.0, 0.0))
    with pytest.raises(FoldError, match=r"tensor 0 has shape \(3,\)"):
        fold.add(accumulator, (torch.zeros(3), torch.zeros(2, 2)))
    with pytest.raises(FoldError, match="dtype"):
        fold.add(accumulator, (torch.zeros(2, dtype=torch.float64), torch.zeros(2, 2)))
    with pytest.raises(FoldError, match="carries 1 tensor"):
        fold.add(accumulator, (torch.zeros(2),))


def test_modular_fold_adds_per_limb_modulo_that_limbs_prime() -> None:
    moduli = [97, 101]
    fold = fold_from_spec("modular:97,101")
    assert isinstance(fold, ModularFold)
    assert fold.spec == "modular:97,101"
    first = torch.tensor([[[90, 5], [100, 0]]], dtype=torch.int64)  # [component, limb, N]
    second = torch.tensor([[[10, 96], [3, 100]]], dtype=torch.int64)
    accumulator = fold.add(fold.identity((first,)), (first,))
    accumulator = fold.add(accumulator, (second,))
    result = fold.finish(accumulator, 2.0)[0]
    expected = torch.stack([(first[0, i] + second[0, i]) % q for i, q in enumerate(moduli)]).unsqueeze(0)
    assert torch.equal(result, expected)
    assert torch.equal(result, torch.tensor([[[3, 4], [2, 100]]]))


def test_modular_fold_rejects_floats_and_a_limb_count_that_does_not_match_the_moduli() -> None:
    fold = ModularFold([97, 101])
    with pytest.raises(FoldError, match="needs int64"):
        fold.identity((torch.zeros(2, 4),))
    with pytest.raises(FoldError, match="2 limb"):
        fold.identity((torch.zeros(3, 4, dtype=torch.int64),))


def test_unknown_fold_spec_lists_the_known_ones_and_plugins_can_register() -> None:
    with pytest.raises(FoldError, match=r"unknown fold 'median'.*mean"):
        fold_from_spec("median")
    register_fold("meanplugin", lambda params: MeanFold())
    assert isinstance(fold_from_spec("meanplugin"), MeanFold)


def test_barrier_completes_when_every_live_member_deposited() -> None:
    barrier: RoundBarrier[int] = RoundBarrier([0, 1, 2])
    assert barrier.contribute(0, 0, "mean", bundle(1.0, 1.0), 1.0) is None
    assert barrier.contribute(2, 0, "mean", bundle(2.0, 2.0), 1.0) is None
    assert barrier.waiting_for == {1}
    result = barrier.contribute(1, 0, "mean", bundle(3.0, 3.0), 1.0)
    assert result is not None
    assert result.round == 0 and result.weight == 3.0 and result.contributors == {0, 1, 2}
    assert torch.equal(result.tensors[0], torch.tensor([6.0, 6.0]))
    assert barrier.round == 1 and barrier.waiting_for == {0, 1, 2}


def test_barrier_rejects_a_double_deposit() -> None:
    barrier: RoundBarrier[int] = RoundBarrier([0, 1])
    barrier.contribute(0, 0, "mean", bundle(1.0, 1.0), 1.0)
    with pytest.raises(RoundError, match="deposited twice"):
        barrier.contribute(0, 0, "mean", bundle(1.0, 1.0), 1.0)


def test_a_member_that_leaves_is_folded_out_and_can_complete_the_round() -> None:
    barrier: RoundBarrier[int] = RoundBarrier([0, 1, 2])
    barrier.contribute(0, 0, "mean", bundle(4.0, 4.0), 1.0)
    barrier.contribute(1, 0, "mean", bundle(2.0, 2.0), 1.0)
    result = barrier.remove(2)
    assert result is not None and result.contributors == {0, 1} and result.weight == 2.0
    assert barrier.live == {0, 1}
    with pytest.raises(RoundError, match="after it left"):
        barrier.contribute(2, 1, "mean", bundle(1.0, 1.0), 1.0)


def test_barrier_rejects_wrong_round_unknown_member_and_mixed_folds() -> None:
    barrier: RoundBarrier[str] = RoundBarrier(["a", "b"])
    with pytest.raises(RoundError, match="round 3 but the barrier is at round 0"):
        barrier.contribute("a", 3, "mean", bundle(1.0, 1.0), 1.0)
    with pytest.raises(RoundError, match="not a member"):
        barrier.contribute("c", 0, "mean", bundle(1.0, 1.0), 1.0)
    barrier.contribute("a", 0, "mean", bundle(1.0, 1.0), 1.0)
    with pytest.raises(FoldError, match="folds with 'sum'"):
        barrier.contribute("b", 0, "sum", bundle(1.0, 1.0), 1.0)


def test_two_level_fold_equals_the_flat_mean() -> None:
    deposits = {rank: bundle(float(rank), float(rank * 10)) for rank in range(4)}
    hosts = {"h0": [0, 1], "h1": [2, 3]}
    world: RoundBarrier[str] = RoundBarrier(hosts)
    final = None
    for host, ranks in hosts.items():
        relay: RoundBarrier[int] = RoundBarrier(ranks)
        partial = None
        for rank in ranks:
            partial = relay.contribute(rank, 0, "mean", deposits[rank], 1.0)
        assert partial is not None
        final = world.contribute(host, 0, partial.fold_spec, partial.tensors, partial.weight)
    assert final is not None
    mean = MeanFold().finish(final.tensors, final.weight)
    assert torch.allclose(mean[0], torch.tensor([1.5, 15.0]))


def test_bundle_codec_round_trips_every_supported_dtype_and_empty_tensors() -> None:
    from flodld.fold.codec import decode_bundle, encode_bundle

    tensors = (
        torch.arange(6, dtype=torch.float32).reshape(2, 3),
        torch.tensor([1.5], dtype=torch.bfloat16),
        torch.tensor([[2**40, -3]], dtype=torch.int64),
        torch.empty(0, 4),
        torch.tensor(7.0, dtype=torch.float64),
    )
    specs, tail = encode_bundle(tensors)
    decoded = decode_bundle(specs, tail)
    assert len(decoded) == len(tensors)
    for original, copy in zip(tensors, decoded, strict=True):
        assert copy.dtype == original.dtype and torch.equal(copy, original)


def test_bundle_codec_refuses_headers_that_do_not_account_for_the_bytes() -> None:
    from flodld.fold.codec import CodecError, decode_bundle, encode_bundle

    specs, tail = encode_bundle((torch.zeros(4),))
    with pytest.raises(CodecError, match="describe 16 bytes but the frame carries 12"):
        decode_bundle(specs, tail[:12])
    with pytest.raises(CodecError, match=r"dtype torch\.complex64"):
        encode_bundle((torch.zeros(2, dtype=torch.complex64),))


def test_liveness_declares_silent_ranks_once_including_ones_never_heard() -> None:
    from flodld.fold.liveness import Liveness

    liveness = Liveness([0, 1, 2], timeout=5.0, now=100.0)
    liveness.heard(0, 104.0)
    liveness.forget(2)
    assert liveness.expire(104.9) == []
    assert liveness.expire(105.5) == [1]
    assert liveness.expire(108.0) == []
    assert liveness.expire(109.5) == [0]
    assert liveness.tracked == frozenset()


def test_liveness_gives_ranks_never_heard_the_startup_grace_and_heard_ones_the_timeout() -> None:
    from flodld.fold.liveness import Liveness

    liveness = Liveness([0, 1, 2], timeout=5.0, now=100.0, startup=30.0)
    liveness.heard(0, 101.0)
    assert liveness.expire_with_limits(110.0) == [(0, 5.0)]  # heard once, then silent past the timeout
    assert liveness.expire(129.0) == []  # 1 and 2 are still starting
    liveness.heard(1, 129.0)
    assert liveness.expire_with_limits(131.0) == [(2, 30.0)]
    assert liveness.expire(134.5) == [1]
    with pytest.raises(ValueError, match="startup grace must be >= the timeout"):
        Liveness([0], timeout=5.0, now=0.0, startup=1.0)


def test_liveness_reports_the_silence_each_heartbeat_ends_and_its_next_deadline() -> None:
    from flodld.fold.liveness import Liveness

    liveness = Liveness([0, 1], timeout=2.0, now=100.0, startup=10.0)
    assert liveness.next_expiry() == 110.0  # nobody heard yet: the startup grace
    assert liveness.heard(0, 101.0) is None  # a first heartbeat ends no gap between heartbeats
    assert liveness.next_expiry() == 103.0  # heard: the timeout from its last heartbeat
    assert liveness.heard(0, 101.25) == pytest.approx(0.25)
    assert liveness.heard(0, 101.25) == 0.0
    assert liveness.heard(7, 101.5) is None  # not tracked
    assert liveness.expire(103.3) == [0]
    assert liveness.next_expiry() == 110.0
    liveness.forget(1)
    assert liveness.next_expiry() is None
