"""The join sshd recipe (issue 13, point 13): one key string is one restricted line; the dedicated
sshd admits only the join user, never root, and runs unprivileged (the recipe and the unit).
"""

from __future__ import annotations

import configparser
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from flodld.fanout.sshd_recipe import JoinSshdRecipe, RecipeError
from tests.conftest import require_binary
from tests.flodld.fanout.joinuser import as_join_user, door_directory, hand_to_join_user, join_user

REPO = Path(__file__).resolve().parents[3]
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKJ/PXxZW7tY+eQ1wB2i1SnUHdCdKX2IKkdAMhsNdZyj walker@host"
OTHER = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOtherKeyOtherKeyOtherKeyOtherKeyOtherKey00 attacker"


@pytest.mark.parametrize(
    "smuggled",
    [
        f"{KEY}\n{OTHER}",  # a second, unrestricted authorized_keys line
        f"{KEY}\r\n{OTHER}",
        f"{KEY}\n\n{OTHER}\n",
        f"{KEY} comment\x00{OTHER}",
        f"{KEY}\x0b{OTHER}",
        f'command="/bin/sh" {KEY}',  # an option prefix of its own
    ],
)
def test_a_key_string_never_yields_a_second_authorized_keys_line(smuggled: str) -> None:
    with pytest.raises(RecipeError):
        JoinSshdRecipe(controller_port=1337, listen_port=2222, public_keys=(smuggled,))
    recipe = JoinSshdRecipe(controller_port=1337, listen_port=2222, public_keys=(KEY,))
    with pytest.raises(RecipeError):
        recipe.authorized_key_line(smuggled)


def test_every_authorized_keys_line_is_restricted_and_one_per_key() -> None:
    recipe = JoinSshdRecipe(controller_port=1337, listen_port=2222, public_keys=(KEY + "\n", f"  {OTHER}  "))
    lines = recipe.authorized_keys().splitlines()
    assert len(lines) == 2
    prefix = 'restrict,port-forwarding,permitopen="127.0.0.1:1337",command="/usr/sbin/nologin" '
    assert lines == [prefix + KEY, prefix + OTHER]


@pytest.mark.parametrize("user", ["root", "Bad User", "x\nMatch all", ""])
def test_the_join_user_is_an_unprivileged_account_name(user: str) -> None:
    with pytest.raises(RecipeError, match="join_user"):
        JoinSshdRecipe(controller_port=1337, listen_port=2222, public_keys=(KEY,), join_user=user)


def test_the_dedicated_config_admits_the_join_user_only_and_never_root(tmp_path: Path) -> None:
    recipe = JoinSshdRecipe(controller_port=1337, listen_port=2222, public_keys=(KEY,), join_user="walkers")
    config = recipe.dedicated_config(tmp_path).splitlines()
    assert "AllowUsers walkers" in config and "PermitRootLogin no" in config
    # Global options: before any Match block (there is none), so they bind every connection.
    assert not any(line.startswith("Match") for line in config)


def test_the_join_sshd_unit_runs_sshd_unprivileged() -> None:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive in units
    parser.read(REPO / "systemd" / "fdl-join-sshd@.service")
    service = parser["Service"]
    assert service.get("User") not in (None, "", "root", "0")
    assert service["CapabilityBoundingSet"] == "" and service["NoNewPrivileges"] == "yes"
    assert "/usr/sbin/sshd -D" in service["ExecStart"] and "PidFile=none" in service["ExecStart"]


def _echo_server() -> int:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"echo:" + conn.recv(64))

    threading.Thread(target=serve, daemon=True).start()
    return int(server.getsockname()[1])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ssh(port: int, key: Path, *args: str) -> list[str]:
    return ["ssh", "-i", str(key), "-p", str(port), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
            "-o", "UserKnownHostsFile=/dev/null", "-o", "IdentitiesOnly=yes", "-o", "LogLevel=ERROR",
            "-o", "ConnectTimeout=10", *args]  # fmt: skip


@pytest.mark.sshd
@pytest.mark.timeout(120)
def test_an_unprivileged_door_forwards_for_the_join_user_and_refuses_root(tmp_path: Path) -> None:
    sshd = require_binary("sshd", "sshd", search_sbin=True)
    keygen = require_binary("sshd", "ssh-keygen")
    require_binary("sshd", "ssh")
    user = join_user()
    key = tmp_path / "walker"
    subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    door = door_directory()
    listen, controller = _free_port(), _echo_server()
    recipe = JoinSshdRecipe(controller_port=controller, listen_port=listen,
                            public_keys=(Path(f"{key}.pub").read_text(),), join_user=user)  # fmt: skip
    recipe.write(door)
    subprocess.run(recipe.host_key_command(door), check=True)
    hand_to_join_user(door, user)
    check = subprocess.run(as_join_user([sshd, "-t", "-f", str(door / "sshd_config")], user),
                           capture_output=True, text=True)  # fmt: skip
    assert check.returncode == 0, check.stderr
    log = tmp_path / "sshd.log"
    with log.open("w") as sink:
        argv = as_join_user([sshd, "-D", "-e", "-f", str(door / "sshd_config")], user)
        proc = subprocess.Popen(argv, stderr=sink)
    try:
        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                socket.create_connection(("127.0.0.1", listen), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        local = _free_port()
        forward = subprocess.Popen(_ssh(listen, key, "-N", "-o", "ExitOnForwardFailure=yes", "-L",
                                        f"127.0.0.1:{local}:127.0.0.1:{controller}", f"{user}@127.0.0.1"),
                                   stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            reply = b""
            end = time.monotonic() + 15
            while not reply and time.monotonic() < end:
                try:
                    with socket.create_connection(("127.0.0.1", local), timeout=5) as sock:
                        sock.sendall(b"hi")
                        reply = sock.recv(64)
                except OSError:
                    time.sleep(0.1)
            assert reply == b"echo:hi", log.read_text()
        finally:
            forward.terminate()
            forward.wait(timeout=10)
        if user != "root":
            refused = subprocess.run(
                _ssh(listen, key, "root@127.0.0.1", "true"), capture_output=True, text=True, timeout=30
            )
            assert refused.returncode != 0
        ps = subprocess.run(["ps", "-o", "user=", "-p", str(proc.pid)], capture_output=True, text=True)
        assert ps.stdout.strip() not in ("root", "0")  # the door's sshd is not root
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(door, ignore_errors=True)
    if user != "root":
        assert "root" in log.read_text()  # sshd logged the refused root login
