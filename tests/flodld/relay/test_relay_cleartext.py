"""Issue 13 point 14 / issue 21: a relay dialing a public controller warns; its upstreams are encrypted now,
so the warning names what their secrecy rests on (the salt) and what stays cleartext (gloo/NCCL).
"""

from __future__ import annotations

import logging

import pytest

from flodld.relay.upstream import warn_if_public


@pytest.mark.parametrize("peer", ["8.8.8.8", "2001:4860:4860::8888", "::ffff:1.1.1.1"])
def test_a_public_controller_gets_a_loud_warning(peer: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="flodld.relay"):
        assert warn_if_public(peer, "ctl.example:29500") is True
    [record] = caplog.records
    text = record.getMessage()
    assert "encrypted" in text and "open admission" in text and "gloo/NCCL" in text and peer in text
    assert "ctl.example:29500" in record.getMessage()


@pytest.mark.parametrize(
    "peer", ["127.0.0.1", "::1", "10.1.2.3", "192.168.1.5", "172.16.0.9", "100.64.0.1", "fd00::1"]
)
def test_loopback_and_private_controllers_do_not_warn(peer: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="flodld.relay"):
        assert warn_if_public(peer, "ctl:1") is False
    assert caplog.records == []
