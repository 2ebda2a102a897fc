"""The guardrailed join sshd recipe against a real OpenSSH sshd on loopback.

The join key may forward to the controller port and nothing else: no shell, no command,
no forward to any other port.
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from flodld.fanout.sshd_recipe import JoinSshdRecipe, RecipeError
from tests.flodld.fanout.joinuser import join_user
from tests.hosts.conftest import free_port as _free_port
from tests.hosts.conftest import wait_port as _wait_port

pytestmark = pytest.mark.sshd


def _ssh_base(listen: int, key: Path) -> list[str]:
    return [
        "ssh", "-i", str(key), "-p", str(listen),
        "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
        "-o", "IdentitiesOnly=yes", "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=10",
    ]  # fmt: skip


def _through_forward(listen: int, key: Path, target_port: int) -> bytes:
    local = _free_port()
    forward = subprocess.Popen(
        [*_ssh_base(listen, key), "-N", "-o", "ExitOnForwardFailure=yes",
         "-L", f"127.0.0.1:{local}:127.0.0.1:{target_port}", f"{join_user()}@127.0.0.1"],
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait_port(local)
        with socket.create_connection(("127.0.0.1", local), timeout=5) as sock:
            sock.sendall(b"hello")
            try:
                return sock.recv(1024)
            except (ConnectionResetError, TimeoutError):
                return b""
    finally:
        forward.terminate()
        try:
            forward.wait(timeout=10)
        except subprocess.TimeoutExpired:
            forward.kill()
            forward.wait(timeout=10)


def test_join_key_forwards_to_the_controller_port(join_sshd: tuple[int, Path, int, int]) -> None:
    listen, key, allowed, _ = join_sshd
    assert _through_forward(listen, key, allowed) == b"echo:hello"


def test_join_key_cannot_forward_anywhere_else(join_sshd: tuple[int, Path, int, int]) -> None:
    listen, key, _, forbidden = join_sshd
    assert _through_forward(listen, key, forbidden) == b""


def test_join_key_cannot_run_a_command_or_open_a_shell(
    join_sshd: tuple[int, Path, int, int], tmp_path: Path
) -> None:
    listen, key, _, _ = join_sshd
    marker = tmp_path / "pwned"
    target = f"{join_user()}@127.0.0.1"
    command = subprocess.run(
        [*_ssh_base(listen, key), target, f"touch {marker}; echo ran-it"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert command.returncode != 0
    assert "ran-it" not in command.stdout
    assert not marker.exists()
    shell = subprocess.run(
        [*_ssh_base(listen, key), "-tt", target],
        input="echo shell-open\nexit\n", capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert shell.returncode != 0
    assert "shell-open" not in shell.stdout.replace("echo shell-open", "")


def test_recipe_text_carries_both_layers() -> None:
    recipe = JoinSshdRecipe(controller_port=1337, listen_port=2222, public_keys=("ssh-ed25519 AAAAC3Nza k",))
    line = recipe.authorized_keys().strip()
    assert line.startswith(
        'restrict,port-forwarding,permitopen="127.0.0.1:1337",command="/usr/sbin/nologin" '
    )
    block = recipe.match_block()
    assert "Match User flodl-join" in block and "PermitOpen 127.0.0.1:1337" in block
    assert "ForceCommand /usr/sbin/nologin" in block and "AllowTcpForwarding local" in block


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"controller_port": 0}, "controller_port must be in 1..65535"),
        ({"listen_port": 70000}, "listen_port must be in 1..65535"),
        ({"public_keys": ("not a key",)}, "not an OpenSSH public key line"),
    ],
)
def test_recipe_rejects_bad_input(kwargs: dict[str, object], fragment: str) -> None:
    args: dict[str, object] = {"controller_port": 1337, "listen_port": 2222, "public_keys": ()}
    args.update(kwargs)
    with pytest.raises(RecipeError, match=fragment):
        JoinSshdRecipe(**args)  # type: ignore[arg-type]  # deliberately wrong input
