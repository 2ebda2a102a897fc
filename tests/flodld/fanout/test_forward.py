"""The `ssh -L` command line of `fdl join --ssh` (pure) and failures that need no sshd."""

from __future__ import annotations

import pytest

from flodld.fanout.forward import ForwardError, forward_command, open_forward, parse_ssh_target
from tests.conftest import require_binary


def test_forward_never_prompts_and_pins_the_local_end_to_loopback() -> None:
    endpoint = parse_ssh_target("walker@gate.example:2222", "/keys/join", ("StrictHostKeyChecking=accept-new",))
    argv = forward_command(endpoint, 40001, ("127.0.0.1", 1337))
    assert argv[:3] == ["ssh", "-N", "-T"]
    joined = " ".join(argv)
    for fragment in ("BatchMode=yes", "ExitOnForwardFailure=yes", "-p 2222", "-l walker", "-i /keys/join",
                     "IdentitiesOnly=yes", "StrictHostKeyChecking=accept-new",
                     "-L 127.0.0.1:40001:127.0.0.1:1337"):  # fmt: skip
        assert fragment in joined
    assert argv[-1] == "gate.example"


def test_a_config_cannot_turn_password_prompts_back_on() -> None:
    endpoint = parse_ssh_target("gate", options=("BatchMode=no",))
    argv = forward_command(endpoint, 40002, ("10.0.0.5", 1337))
    assert "BatchMode=no" not in argv and "BatchMode=yes" in argv


def test_ipv6_controller_address_is_bracketed() -> None:
    argv = forward_command(parse_ssh_target("gate"), 40003, ("fd00::1", 1337))
    assert "127.0.0.1:40003:[fd00::1]:1337" in argv


def test_unreachable_ssh_host_fails_with_ssh_s_reason() -> None:
    require_binary("sshd", "ssh")
    # Port 1 on loopback refuses at once; BatchMode keeps ssh from ever waiting on a prompt.
    endpoint = parse_ssh_target("127.0.0.1:1", options=("StrictHostKeyChecking=no",))
    with pytest.raises(ForwardError, match="Connection refused"):
        open_forward(endpoint, ("127.0.0.1", 1337), timeout=10)
