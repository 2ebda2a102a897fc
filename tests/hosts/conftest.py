"""Fixtures for tests against a real OpenSSH sshd: a guardrailed join sshd on loopback."""

from __future__ import annotations

import socket
import socketserver
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from flodld.fanout.sshd_recipe import JoinSshdRecipe
from tests.conftest import require_binary
from tests.flodld.fanout.joinuser import as_join_user, door_directory, hand_to_join_user, join_user


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_port(port: int, deadline_s: float = 10.0, host: str = "127.0.0.1") -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"port {host}:{port} never opened")


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        data = self.request.recv(1024)
        self.request.sendall(b"echo:" + data)


@pytest.fixture
def echo_servers() -> Iterator[tuple[int, int]]:
    servers = [socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo) for _ in range(2)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield servers[0].server_address[1], servers[1].server_address[1]
    for server in servers:
        server.shutdown()
        server.server_close()


@dataclass(frozen=True)
class JoinSshd:
    listen: int
    key: Path


def start_join_sshd(tmp_path: Path, controller_port: int) -> tuple[JoinSshd, subprocess.Popen[str]]:
    """A dedicated, guardrailed sshd (the recipe) whose join key may reach `controller_port` only."""
    sshd = require_binary("sshd", "sshd", search_sbin=True)
    keygen = require_binary("sshd", "ssh-keygen")
    require_binary("sshd", "ssh")
    client_key = tmp_path / "join_key"
    subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(client_key)], check=True)
    listen = free_port()
    user = join_user()  # the door runs as the join user, never root (issue 13 point 13)
    recipe = JoinSshdRecipe(
        controller_port=controller_port, listen_port=listen,
        public_keys=((tmp_path / "join_key.pub").read_text(),), join_user=user,
    )  # fmt: skip
    sshd_dir = door_directory()
    recipe.write(sshd_dir)
    subprocess.run(recipe.host_key_command(sshd_dir), check=True)
    hand_to_join_user(sshd_dir, user)
    with (tmp_path / "sshd.log").open("w") as log:  # a file, not a pipe nobody drains
        proc = subprocess.Popen(as_join_user([sshd, "-D", "-e", "-f", str(sshd_dir / "sshd_config")], user),
                                stderr=log, text=True)  # fmt: skip
    try:
        wait_port(listen)
    except BaseException:
        proc.terminate()
        proc.wait(timeout=10)
        raise
    return JoinSshd(listen, client_key), proc


@pytest.fixture
def join_sshd(tmp_path: Path, echo_servers: tuple[int, int]) -> Iterator[tuple[int, Path, int, int]]:
    allowed, forbidden = echo_servers
    sshd, proc = start_join_sshd(tmp_path, allowed)
    try:
        yield sshd.listen, sshd.key, allowed, forbidden
    finally:
        proc.terminate()
        proc.wait(timeout=10)
