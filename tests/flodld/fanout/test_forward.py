"""The `ssh -L` command line of `fdl join --ssh` (pure) and failures that need no sshd.

The squatting tests run a stand-in for `ssh` (a script that, like ssh, binds the -L port only after a
while: ssh first connects and authenticates) and a real local listener that takes the port first.
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from flodld.fanout.forward import ForwardError, forward_command, forward_owner, open_forward, parse_ssh_target
from flodld.fanout.ssh import SshConfigError
from tests.conftest import require_binary


def test_forward_never_prompts_and_pins_the_local_end_to_loopback() -> None:
    endpoint = parse_ssh_target(
        "walker@gate.example:2222", "/keys/join", ("StrictHostKeyChecking=accept-new",)
    )
    argv = forward_command(endpoint, 40001, ("127.0.0.1", 1337))
    assert argv[:3] == ["ssh", "-N", "-T"]
    joined = " ".join(argv)
    for fragment in ("BatchMode=yes", "ExitOnForwardFailure=yes", "-p 2222", "-l walker", "-i /keys/join",
                     "IdentitiesOnly=yes", "StrictHostKeyChecking=accept-new",
                     "-L 127.0.0.1:40001:127.0.0.1:1337"):  # fmt: skip
        assert fragment in joined
    assert argv[-2:] == ["--", "gate.example"]


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


def test_a_host_that_looks_like_an_option_runs_no_command(tmp_path: Path) -> None:
    """`-oProxyCommand=...` as the ssh host is refused (and would follow `--`), never run by ssh."""
    require_binary("sshd", "ssh")
    marker = tmp_path / "ran"
    with pytest.raises((SshConfigError, ForwardError)):
        open_forward(parse_ssh_target(f"-oProxyCommand=touch {marker}"), ("127.0.0.1", 1337), timeout=5)
    assert not marker.exists(), "ssh read the host as an option and ran its ProxyCommand"


FAKE_SSH = """#!{python}
import os, socket, sys, time
argv = sys.argv[1:]
port = int(argv[argv.index("-L") + 1].split(":")[1])
with open(os.environ["FAKE_SSH_STARTED"], "w") as handle:
    handle.write(str(port))
go = os.environ.get("FAKE_SSH_GO")
while go and not os.path.exists(go):  # "connecting and authenticating"
    time.sleep(0.01)
sock = socket.socket()
try:
    sock.bind(("127.0.0.1", port))
except OSError:
    print(f"bind [127.0.0.1]:{{port}}: Address already in use", file=sys.stderr)
    print("Could not request local forwarding.", file=sys.stderr)
    sys.exit(255)
sock.listen()
time.sleep(600)
"""


def _fake_ssh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, gated: bool) -> tuple[str, Path, Path]:
    binary = tmp_path / "ssh"
    binary.write_text(FAKE_SSH.format(python=sys.executable))
    binary.chmod(0o755)
    started, go = tmp_path / "started", tmp_path / "go"
    monkeypatch.setenv("FAKE_SSH_STARTED", str(started))
    if gated:
        monkeypatch.setenv("FAKE_SSH_GO", str(go))
    else:
        monkeypatch.delenv("FAKE_SSH_GO", raising=False)
    return str(binary), started, go


def _wait_for(path: Path, timeout: float = 20.0) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.01)
    raise AssertionError(f"{path} never written")


@pytest.mark.parametrize("squat_on", ["127.0.0.1", "0.0.0.0"])
def test_a_local_listener_that_takes_the_forward_port_first_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, squat_on: str
) -> None:
    """Another local process binds the chosen port before ssh does: the join must not dial it."""
    binary, started, go = _fake_ssh(tmp_path, monkeypatch, gated=True)
    endpoint = parse_ssh_target("gate", options=("StrictHostKeyChecking=no",))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        attempt = pool.submit(open_forward, endpoint, ("127.0.0.1", 1337), ssh_binary=binary, timeout=20)
        port = int(_wait_for(started))
        squatter = socket.socket()
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            squatter.bind((squat_on, port))
            squatter.listen()
            go.write_text("go")  # ssh now tries to bind and fails, as the real one would
            try:
                forward = attempt.result(timeout=30)
            except ForwardError as error:
                message = str(error)
            else:
                forward.close()
                raise AssertionError(
                    f"open_forward returned a forward on port {port}, which a squatter holds"
                )
            assert "REFUSING" in message and str(port) in message and "not this join's own ssh" in message
            squatter.setblocking(False)
            with pytest.raises(BlockingIOError):
                squatter.accept()  # nothing was dialed
        finally:
            squatter.close()


def test_the_forward_of_its_own_ssh_is_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    binary, _, _ = _fake_ssh(tmp_path, monkeypatch, gated=False)
    forward = open_forward(parse_ssh_target("gate"), ("127.0.0.1", 1337), ssh_binary=binary, timeout=20)
    try:
        assert forward.alive
        assert forward_owner(forward.local_port, forward.process.pid) == "ssh"
        assert forward_owner(forward.local_port, os.getpid()) == "foreign"  # not this session's socket
    finally:
        forward.close()
