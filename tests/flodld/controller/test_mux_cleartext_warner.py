"""Issue 13 point 14: the mux's cleartext warner remembers a bounded number of addresses."""

from __future__ import annotations

import logging

import pytest

from flodld.controller.addresses import MAX_WARNED_ADDRESSES, CleartextWarner


def _public(index: int) -> str:
    return f"8.{index // 65536 % 256}.{index // 256 % 256}.{index % 256}"


def test_a_flood_of_distinct_public_addresses_keeps_the_warner_bounded() -> None:
    warner = CleartextWarner("controller", logging.getLogger("test.warner.quiet"))
    for index in range(MAX_WARNED_ADDRESSES * 5):
        warner.check(_public(index))
    assert len(warner) == MAX_WARNED_ADDRESSES


def test_each_address_is_warned_once_while_remembered_and_the_oldest_is_forgotten(
    caplog: pytest.LogCaptureFixture,
) -> None:
    warner = CleartextWarner("controller", logging.getLogger("test.warner"), limit=2)
    with caplog.at_level(logging.WARNING, logger="test.warner"):
        assert warner.check("8.8.8.8") and not warner.check("8.8.8.8")
        assert warner.check("1.1.1.1")
        assert warner.check("9.9.9.9")  # forgets 8.8.8.8, the oldest
        assert len(warner) == 2
        assert warner.check("8.8.8.8")  # warned again once it was forgotten
        assert not warner.check("10.0.0.1")  # private: never warned, never remembered
    assert len(caplog.records) == 4


def test_a_limit_below_one_is_refused() -> None:
    with pytest.raises(ValueError):
        CleartextWarner(limit=0)
