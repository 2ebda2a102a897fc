"""Which freed slots heal in, and under what name (flodld/agent/heal.py)."""

from __future__ import annotations

import pytest

from flodld.agent.heal import HEALS, HEALS_WINDOW_SECS, BurstLimit, SlotHeals, SlotStaysEmpty
from flodld.wire.messages import MAX_HOST_CHARS


def test_each_healed_slot_walks_in_under_a_fresh_name() -> None:
    heals = SlotHeals("gpu-7")
    # the same slot failing again walks in under the next name, as does another slot
    assert [heals.freed(at) for at in (0.0, 1.0, 2.0)] == ["gpu-7+1", "gpu-7+2", "gpu-7+3"]


def test_a_slot_that_keeps_failing_stays_empty_past_the_burst_and_heals_again_later() -> None:
    heals = SlotHeals("h")
    for at in range(HEALS):
        heals.freed(float(at))
    with pytest.raises(SlotStaysEmpty, match=f"{HEALS} slots healed within"):
        heals.freed(10.0)
    assert heals.freed(HEALS_WINDOW_SECS + 0.5) == f"h+{HEALS + 1}"


def test_no_slot_heals_once_closed() -> None:
    heals = SlotHeals("h")
    heals.close("the host's own run ended")
    heals.close("a later reason")  # the first reason stays
    with pytest.raises(SlotStaysEmpty, match=r"^the host's own run ended$"):
        heals.freed(0.0)


def test_a_healed_name_fits_the_host_name_bound() -> None:
    name = SlotHeals("x" * MAX_HOST_CHARS).freed(0.0)
    assert len(name) == MAX_HOST_CHARS and name.endswith("+1")


def test_the_burst_limit_slides() -> None:
    burst = BurstLimit(2, 10.0)
    assert [burst.allow(t) for t in (0.0, 1.0, 2.0, 9.9, 10.0, 11.0, 11.5)] == [
        True, True, False, False, True, True, False
    ]  # fmt: skip
