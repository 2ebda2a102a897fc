"""Which freed slots heal in, and under what name (flodld/agent/heal.py)."""

from __future__ import annotations

from flodld.agent.heal import HEALS, HEALS_WINDOW_SECS, BurstLimit, Heal, NoHeal, SlotHeals
from flodld.wire.messages import MAX_HOST_CHARS


def test_each_healed_slot_walks_in_under_a_fresh_name() -> None:
    heals = SlotHeals("gpu-7")
    assert heals.freed("cpu:1", 0.0) == Heal("gpu-7+1", "cpu:1")
    assert heals.freed("cpu:1", 1.0) == Heal("gpu-7+2", "cpu:1")  # the same slot failing again: a new name
    assert heals.freed("cpu:0", 2.0) == Heal("gpu-7+3", "cpu:0")


def test_a_slot_that_keeps_failing_stays_empty_past_the_burst_and_heals_again_later() -> None:
    heals = SlotHeals("h")
    for at in range(HEALS):
        assert isinstance(heals.freed("cpu:0", float(at)), Heal)
    refused = heals.freed("cpu:0", 10.0)
    assert isinstance(refused, NoHeal) and f"{HEALS} slots healed within" in refused.reason, refused
    assert heals.freed("cpu:0", HEALS_WINDOW_SECS + 0.5) == Heal(f"h+{HEALS + 1}", "cpu:0")


def test_no_slot_heals_once_closed() -> None:
    heals = SlotHeals("h")
    heals.close("the host's own run ended")
    heals.close("a later reason")  # the first reason stays
    assert heals.freed("cpu:0", 0.0) == NoHeal("cpu:0", "the host's own run ended")


def test_a_healed_name_fits_the_host_name_bound() -> None:
    (heal,) = [SlotHeals("x" * MAX_HOST_CHARS).freed("cpu", 0.0)]
    assert isinstance(heal, Heal) and len(heal.host) == MAX_HOST_CHARS and heal.host.endswith("+1")


def test_the_burst_limit_slides() -> None:
    burst = BurstLimit(2, 10.0)
    assert [burst.allow(t) for t in (0.0, 1.0, 2.0, 9.9, 10.0, 11.0, 11.5)] == [
        True, True, False, False, True, True, False
    ]  # fmt: skip
