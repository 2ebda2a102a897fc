"""WireError: stable codes and readable sentences."""

from __future__ import annotations

import pytest

from flodld.wire.errors import WIRE_ERROR_CODES, WireError


def test_codes_are_the_documented_set() -> None:
    assert {
        "bad_magic", "bad_version", "too_large", "bad_tag", "replay",
        "handshake", "unknown_kind", "bad_payload", "truncated", "closed",
    } == WIRE_ERROR_CODES  # fmt: skip


def test_message_carries_detail_and_code() -> None:
    error = WireError("replay", "seq 3, expected 4")
    assert error.code == "replay"
    assert str(error) == "seq 3, expected 4 [replay]"


@pytest.mark.parametrize("code", sorted(WIRE_ERROR_CODES))
def test_every_code_has_a_default_sentence(code: str) -> None:
    error = WireError(code)  # type: ignore[arg-type]  # iterating the Literal's values as plain str
    assert len(error.detail) > 20 and str(error).endswith(f"[{code}]")


def test_unknown_code_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="unknown wire error code 'nope'"):
        WireError("nope")  # type: ignore[arg-type]  # deliberately invalid
