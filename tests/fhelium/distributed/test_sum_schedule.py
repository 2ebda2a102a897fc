"""When all_reduce_ciphertext may add with a raw SUM: the per-rank eligibility rules (no process group)."""

from __future__ import annotations

import torch
from fhelium_dist_values import toy_engine as make_toy_engine

from fhelium.core import Ciphertext
from fhelium.distributed._ciphertext_reduction import _choose_algorithm
from fhelium.engine import CkksEngine


class NoModuli:
    def add_(self, lhs: Ciphertext, rhs: Ciphertext) -> Ciphertext:
        return lhs


def value(engine: CkksEngine, dtype: torch.dtype = torch.int64) -> Ciphertext:
    ids = engine.q_ids_at(0)
    return Ciphertext(torch.zeros(2, len(ids), engine.ring_degree, dtype=dtype), 0, engine.default_scale, ids)


def test_auto_takes_sum_only_where_it_is_exact() -> None:
    toy_engine = make_toy_engine()
    ct = value(toy_engine)
    largest = max(toy_engine.residue_moduli(ct))
    fits = (2**63 - 1) // largest
    assert _choose_algorithm("auto", toy_engine, ct, 2) == ("sum", None)
    assert _choose_algorithm("auto", toy_engine, ct, fits) == ("sum", None)
    assert _choose_algorithm("auto", toy_engine, ct, fits + 1) == ("tree", None)
    assert _choose_algorithm("auto", toy_engine, ct, 1) == ("tree", None)  # nothing to add
    assert _choose_algorithm("auto", NoModuli(), ct, 2) == ("tree", None)
    assert _choose_algorithm("auto", toy_engine, value(toy_engine, torch.int32), 2) == ("tree", None)
    assert _choose_algorithm("tree", toy_engine, ct, 2) == ("tree", None)


def test_demanding_sum_where_it_is_not_exact_is_an_error_naming_why() -> None:
    toy_engine = make_toy_engine()
    ct = value(toy_engine)
    largest = max(toy_engine.residue_moduli(ct))
    schedule, error = _choose_algorithm("sum", toy_engine, ct, (2**63 - 1) // largest + 1)
    assert schedule == "sum" and error is not None and "could wrap int64" in error
    _, error = _choose_algorithm("sum", NoModuli(), ct, 2)
    assert error is not None and "does not offer residue_moduli" in error
    _, error = _choose_algorithm("sum", toy_engine, value(toy_engine, torch.int32), 2)
    assert error is not None and "torch.int32" in error
    _, error = _choose_algorithm("fastest", toy_engine, ct, 2)
    assert error == "algorithm must be one of auto, tree, sum; got 'fastest'"
