"""An agent that dials a controller at a public address warns that its links are cleartext (issue 13, 14)."""

from __future__ import annotations

import secrets
import socket

import pytest

from flodld.agent.join import build_hello, cleartext_warning, join_world
from flodld.agent.spec import AgentSpec
from flodld.config.join import JoinConfig
from flodld.controller.addresses import is_private_address
from flodld.controller.options import ControllerOptions
from flodld.controller.run import Controller


@pytest.mark.parametrize("peer", ["127.0.0.1", "::1", "10.1.2.3", "192.168.0.7", "172.20.0.1", "100.64.0.9",
                                  "fd00::5", "fe80::1%eth0", "::ffff:127.0.0.1"])  # fmt: skip
def test_private_and_loopback_controllers_are_quiet(peer: str) -> None:
    assert cleartext_warning(peer, "c:1337", pre_shared=True) is None


@pytest.mark.parametrize("peer", ["8.8.8.8", "2001:4860::8888", "192.0.2.2"])
def test_a_public_controller_is_warned_about(peer: str) -> None:
    warning = cleartext_warning(peer, "ctl.example:1337", pre_shared=True)
    assert warning is not None and "CLEARTEXT" in warning and peer in warning and "fdl join --ssh" in warning
    open_warning = cleartext_warning(peer, "ctl.example:1337", pre_shared=False)
    assert open_warning is not None and "session salt" in open_warning


def _public_local_address() -> str | None:
    """A local IPv4 address that flodld counts as public (a documentation or real public address), if any."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("198.51.100.1", 9))  # no packet is sent: this only picks the source address
        except OSError:
            return None
        address = str(probe.getsockname()[0])
    return None if is_private_address(address) else address


async def test_a_real_join_to_a_public_address_warns_and_a_loopback_one_does_not() -> None:
    token = secrets.token_hex(16)
    public = _public_local_address()
    for address in ["127.0.0.1", *([public] if public else [])]:
        controller = Controller(ControllerOptions(
            advertised_host=address, bind_host=address, port=0, averaging="cpu_sync",
            join=JoinConfig(discovery=True, min_rank_start=1, target_ranks=1, token=token),
        ))  # fmt: skip
        _, port = await controller.start()
        warnings: list[str] = []
        try:
            agent = AgentSpec(host="walker", controller_host=address, controller_port=port, salt_hex=token,
                              devices=["cpu"], connect_attempts=3)  # fmt: skip
            joined = await join_world(agent, build_hello(agent, ["cpu:0"]), warn=warnings.append)
            await joined.stream.aclose()
        finally:
            await controller.stop("test over")
        if address == "127.0.0.1":
            assert warnings == []
        else:
            assert len(warnings) == 1 and "CLEARTEXT" in warnings[0] and address in warnings[0], warnings
    if public is None:
        pytest.skip("no local address outside private space to dial; the public case ran as a pure test only")
