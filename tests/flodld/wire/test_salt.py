"""Session salts: generation, hex round trip, and errors that say what is wrong."""

from __future__ import annotations

import pytest

from flodld.wire.salt import OPEN_ADMISSION_KEY, SALT_BYTES, SaltError, new_salt, salt_from_hex, salt_to_hex


def test_new_salts_are_sixteen_random_bytes() -> None:
    salts = {new_salt() for _ in range(8)}
    assert len(salts) == 8
    assert all(len(salt) == SALT_BYTES and salt != bytes(SALT_BYTES) for salt in salts)


def test_hex_round_trip_is_lowercase_and_tolerates_case_and_whitespace() -> None:
    salt = bytes(range(0xF0, 0x100))
    assert salt_to_hex(salt) == "f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff"
    assert salt_from_hex("  F0F1F2F3F4F5F6F7F8F9FAFBFCFDFEFF\n") == salt


@pytest.mark.parametrize(("text", "fragment"), [("abc", "got 3"), ("ab" * 17, "got 34"), ("", "got 0")])
def test_wrong_length_names_the_expected_length(text: str, fragment: str) -> None:
    with pytest.raises(SaltError, match="must be 32 hex characters") as caught:
        salt_from_hex(text)
    assert fragment in str(caught.value)


def test_bad_character_is_named_with_its_position() -> None:
    with pytest.raises(SaltError, match=r"'g' at position 5"):
        salt_from_hex("00000g" + "0" * 26)


def test_salt_to_hex_refuses_wrong_sizes() -> None:
    with pytest.raises(SaltError, match="16 bytes, got 3"):
        salt_to_hex(b"abc")


def test_open_admission_key_is_public_zeroes() -> None:
    assert bytes(16) == OPEN_ADMISSION_KEY
