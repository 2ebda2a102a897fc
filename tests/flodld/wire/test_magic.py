"""Channel magics: the exact bytes on the wire and prefix routing."""

from __future__ import annotations

import pytest

from flodld.wire.magic import CHANNEL_MAGICS, HTTP_PREFIXES, Channel, channel_for_prefix, magic_prefix


@pytest.mark.parametrize(
    ("channel", "wire"),
    [
        (Channel.RENDEZVOUS, b"\xe0\x17\x0d\xf1"),
        (Channel.DATA, b"\xe1\x17\x0d\xf1"),
        (Channel.CONTROL, b"\xe2\x17\x0d\xf1"),
        (Channel.JOIN, b"\xe3\x17\x0d\xf1"),
    ],
)
def test_magic_is_little_endian_u32_and_routes_back(channel: Channel, wire: bytes) -> None:
    assert magic_prefix(channel) == wire
    assert channel_for_prefix(wire) is channel


@pytest.mark.parametrize("prefix", HTTP_PREFIXES)
def test_http_request_lines_route_to_http(prefix: bytes) -> None:
    assert channel_for_prefix(prefix) is Channel.HTTP


def test_http_has_no_magic() -> None:
    with pytest.raises(ValueError, match="HTTP"):
        magic_prefix(Channel.HTTP)


@pytest.mark.parametrize("prefix", [b"\xe4\x17\x0d\xf1", b"\xf1\x0d\x17\xe0", b"PUT ", b"get ", bytes(4)])
def test_unknown_prefixes_route_nowhere(prefix: bytes) -> None:
    assert channel_for_prefix(prefix) is None


@pytest.mark.parametrize("prefix", [b"", b"GET", b"GET /"])
def test_prefix_must_be_four_bytes(prefix: bytes) -> None:
    with pytest.raises(ValueError, match="exactly 4 bytes"):
        channel_for_prefix(prefix)


def test_every_framed_channel_has_a_distinct_magic() -> None:
    assert set(CHANNEL_MAGICS) == set(Channel) - {Channel.HTTP}
    assert len(set(CHANNEL_MAGICS.values())) == len(CHANNEL_MAGICS)
