"""Fan-out SSH sessions against an in-process asyncssh server running real local processes."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import asyncssh
import pytest

from flodld.fanout.ssh import (
    SshConfigError,
    SshEndpoint,
    run_remote,
    secret_env_block,
    start_remote_agent,
    supervised_command,
)
from tests.e2e.harness import pid_alive
from tests.flodld.fanout.sshserver import start_local_ssh_server

SECRET = "f00dfeedf00dfeedf00dfeedf00dfeed"
CHILD_SCRIPT = """
import os, subprocess, sys, time
out = sys.argv[1]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
with open(out, "w") as f:
    f.write(f"{os.getpid()} {child.pid} {os.environ.get('FLODL_TEST_SECRET', '')}")
time.sleep(120)
"""


def _cmdline(pid: int) -> str:
    """A process's command line, or "" when it exited while we looked."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""


async def _wait_file(path: Path, timeout: float = 20.0) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and path.read_text().count(" ") >= 2:
            return path.read_text()
        await asyncio.sleep(0.05)
    raise AssertionError(f"{path} never written")


async def _wait_dead(pids: list[int], timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not any(pid_alive(p) for p in pids):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"processes still alive: {[p for p in pids if pid_alive(p)]}")


def _endpoint(port: int, key: Path, **extra: object) -> SshEndpoint:
    return SshEndpoint(host="127.0.0.1", port=port, identity_file=str(key),
                       options=("StrictHostKeyChecking=no",), **extra)  # type: ignore[arg-type]  # fmt: skip


async def _start(tmp_path: Path) -> tuple[object, Path, object]:
    server = await start_local_ssh_server(tmp_path)
    script = tmp_path / "agent.py"
    script.write_text(CHILD_SCRIPT)
    out = tmp_path / "agent.out"
    agent = await start_remote_agent(
        _endpoint(server.port, server.client_key_path),
        workdir=str(tmp_path), argv=[sys.executable, str(script), str(out)],
        secret_env={"FLODL_TEST_SECRET": SECRET}, grace_s=2,
    )  # fmt: skip
    return server, out, agent


async def test_agent_gets_secret_env_never_argv_and_stop_kills_its_tree(tmp_path: Path) -> None:
    server, out, agent = await _start(tmp_path)
    pid_text, child_text, secret = (await _wait_file(out)).split()
    assert secret == SECRET
    pids = [int(pid_text), int(child_text)]
    for pid in pids:
        assert SECRET not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    assert not any(SECRET in _cmdline(int(p)) for p in os.listdir("/proc") if p.isdigit())
    await agent.stop()  # type: ignore[attr-defined]
    await _wait_dead(pids)
    server.close()  # type: ignore[attr-defined]


async def test_lost_session_tears_the_remote_tree_down(tmp_path: Path) -> None:
    server, out, agent = await _start(tmp_path)
    pids = [int(x) for x in (await _wait_file(out)).split()[:2]]
    agent.conn.abort()  # type: ignore[attr-defined]  # the network dies: no orderly close
    await _wait_dead(pids)
    server.close()  # type: ignore[attr-defined]


async def test_exit_code_and_output_of_the_remote_program_come_back(tmp_path: Path) -> None:
    server = await start_local_ssh_server(tmp_path)
    lines: list[str] = []
    agent = await start_remote_agent(
        _endpoint(server.port, server.client_key_path), workdir=str(tmp_path),
        argv=[sys.executable, "-c", "import sys; print('bye'); sys.exit(3)"], secret_env={},
        on_output=lambda host, line: lines.append(line),
    )  # fmt: skip
    assert await agent.wait() == 3
    assert lines == ["bye"]
    await agent.stop()
    server.close()


async def test_bad_workdir_names_the_host_and_exits_2(tmp_path: Path) -> None:
    server = await start_local_ssh_server(tmp_path)
    seen: list[str] = []
    agent = await start_remote_agent(
        _endpoint(server.port, server.client_key_path), workdir="/no/such/dir",
        argv=["true"], secret_env={}, on_output=lambda host, line: seen.append(line),
    )  # fmt: skip
    assert await agent.wait() == 2
    assert any("cannot cd to /no/such/dir" in line for line in seen)
    await agent.stop()
    server.close()


async def test_proxy_jump_reaches_the_target_through_the_bastion(tmp_path: Path) -> None:
    # One server plays bastion and target: the log proves the target was reached through a
    # direct-tcpip channel opened on the bastion, i.e. the jump was really taken.
    server = await start_local_ssh_server(tmp_path)
    endpoint = SshEndpoint(
        host="127.0.0.1", port=server.port, identity_file=str(server.client_key_path),
        options=("StrictHostKeyChecking=no", f"ProxyJump=127.0.0.1:{server.port}"),
    )  # fmt: skip
    code, out, _ = await run_remote(endpoint, "echo through-the-jump")
    assert code == 0 and out.strip() == "through-the-jump"
    assert f"direct 127.0.0.1:{server.port}" in server.log
    server.close()


async def test_remote_forward_carries_connections_back(tmp_path: Path) -> None:
    server = await start_local_ssh_server(tmp_path)
    lines: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"controller:" + await reader.read(100))
        await writer.drain()
        writer.close()

    controller = await asyncio.start_server(handle, "127.0.0.1", 0)
    controller_port = controller.sockets[0].getsockname()[1]
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        listen_port = probe.getsockname()[1]
    client = (
        "import socket,sys; s=socket.create_connection(('127.0.0.1', int(sys.argv[1]))); "
        "s.sendall(b'hi'); print(s.recv(100).decode())"
    )
    agent = await start_remote_agent(
        _endpoint(server.port, server.client_key_path), workdir=str(tmp_path),
        argv=[sys.executable, "-c", client, str(listen_port)], secret_env={},
        remote_forward=(listen_port, controller_port), on_output=lambda host, line: lines.append(line),
    )  # fmt: skip
    assert await agent.wait() == 0
    assert lines == ["controller:hi"]
    assert f"remote-forward 127.0.0.1:{listen_port}" in server.log
    await agent.stop()
    controller.close()
    server.close()


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("node-a", ("node-a", 22, None)),
        ("ubuntu@node-b:2222", ("node-b", 2222, "ubuntu")),
        ("me@[fe80::1]:2200", ("fe80::1", 2200, "me")),
        ("[::1]", ("::1", 22, None)),
    ],
)
def test_target_parsing(target: str, expected: tuple[str, int, str | None]) -> None:
    endpoint = SshEndpoint.parse(target)
    assert (endpoint.host, endpoint.port, endpoint.user) == expected


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"host": ""}, "ssh target is empty"),
        ({"host": "h", "port": 0}, "ssh port must be in 1..65535"),
        ({"host": "h", "options": ("ForwardAgent=yes",)}, "unsupported ssh option 'ForwardAgent'"),
        ({"host": "h", "options": ("StrictHostKeyChecking=maybe",)}, "StrictHostKeyChecking must be"),
        ({"host": "h", "options": ("ProxyJump=",)}, "needs a value"),
        ({"host": "-oProxyCommand=touch /tmp/pwned"}, "ssh would read it as an option"),
        ({"host": "h", "user": "-F/tmp/evil_config"}, "ssh would read it as an option"),
        ({"host": "h", "options": ("ProxyJump=ok,-oProxyCommand=x",)}, "ssh would read it as an option"),
        ({"host": "h\n-oProxyCommand=x"}, "control character"),
    ],
)
def test_bad_ssh_settings_are_named(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(SshConfigError, match=fragment):
        SshEndpoint(**kwargs)  # type: ignore[arg-type]  # deliberately wrong input


def test_secrets_never_enter_the_command_line() -> None:
    command = supervised_command("/srv/flodl", ["python", "train.py", "--lr", "0.1"])
    assert "train.py" in command and SECRET not in command
    block = secret_env_block({"FLODL_INTERNAL_AGENT_JSON": SECRET})
    assert block == f"FLODL_INTERNAL_AGENT_JSON={SECRET}\n\n"
    with pytest.raises(SshConfigError, match="cannot be sent over stdin"):
        secret_env_block({"A": "multi\nline"})


def test_the_supervisor_tears_its_tree_down_on_stdin_eof_with_hangup_and_term_ignored(tmp_path: Path) -> None:
    """A shell started with HUP and TERM ignored (under `nohup`, say) cannot trap them.

    The stdin watcher must end the agent's group itself. It used to signal the shell with HUP, which
    such a shell never acted on, so the tree outlived its launcher (CI caught it under nohup).
    """
    import subprocess

    out = tmp_path / "agent.out"
    script = tmp_path / "agent.py"
    script.write_text(CHILD_SCRIPT)
    command = supervised_command(str(tmp_path), [sys.executable, str(script), str(out)], grace_s=1)

    def ignore_hangup_and_term() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    shell = subprocess.Popen(
        ["bash", "-c", command], stdin=subprocess.PIPE, preexec_fn=ignore_hangup_and_term
    )
    try:
        assert shell.stdin is not None
        shell.stdin.write(secret_env_block({"FLODL_TEST_SECRET": SECRET}).encode())
        shell.stdin.flush()
        end = time.monotonic() + 20
        while not (out.exists() and out.read_text().count(" ") >= 2) and time.monotonic() < end:
            time.sleep(0.05)
        pids = [int(x) for x in out.read_text().split()[:2]]
        shell.stdin.close()  # the launcher is gone
        shell.wait(15)
        end = time.monotonic() + 15
        while any(pid_alive(p) for p in pids) and time.monotonic() < end:
            time.sleep(0.05)
        alive = [p for p in pids if pid_alive(p)]
        assert not alive, f"processes still alive: {alive}"
    finally:
        if shell.poll() is None:
            shell.kill()


def test_sigterm_constant_is_what_the_supervisor_reports() -> None:
    assert 128 + signal.SIGTERM == 143


async def test_strict_host_key_checking_refuses_an_unknown_host(tmp_path: Path) -> None:
    server = await start_local_ssh_server(tmp_path)
    known = tmp_path / "known_hosts"
    known.write_text("")
    endpoint = SshEndpoint(host="127.0.0.1", port=server.port, identity_file=str(server.client_key_path),
                           options=("StrictHostKeyChecking=yes", f"UserKnownHostsFile={known}"))  # fmt: skip
    try:
        with pytest.raises(ConnectionError, match=f"ssh 127.0.0.1:{server.port}"):
            await run_remote(endpoint, "true")
    finally:
        server.close()


async def test_accept_new_remembers_the_key_and_then_refuses_a_changed_one(tmp_path: Path) -> None:
    server = await start_local_ssh_server(tmp_path)
    known = tmp_path / "known_hosts"
    accept_new = SshEndpoint(
        host="127.0.0.1",
        port=server.port,
        identity_file=str(server.client_key_path),
        options=("StrictHostKeyChecking=accept-new", f"UserKnownHostsFile={known}"),
    )
    strict = SshEndpoint(host="127.0.0.1", port=server.port, identity_file=str(server.client_key_path),
                         options=("StrictHostKeyChecking=yes", f"UserKnownHostsFile={known}"))  # fmt: skip
    try:
        assert (await run_remote(accept_new, "echo first"))[1].strip() == "first"
        assert known.read_text().startswith(f"[127.0.0.1]:{server.port} ssh-ed25519 ")
        assert (await run_remote(strict, "echo again"))[1].strip() == "again"
    finally:
        server.close()
    impostor = await start_local_ssh_server(tmp_path, name="impostor")  # new host key, same address book
    moved = SshEndpoint(
        host="127.0.0.1",
        port=impostor.port,
        identity_file=str(impostor.client_key_path),
        options=("StrictHostKeyChecking=accept-new", f"UserKnownHostsFile={known}"),
    )
    known.write_text(known.read_text().replace(f"[127.0.0.1]:{server.port}", f"[127.0.0.1]:{impostor.port}"))
    try:
        with pytest.raises(ConnectionError):
            await run_remote(moved, "true")
    finally:
        impostor.close()


async def _server_key(tmp_path: Path, port: int, client_key: Path) -> str:
    """The test server's host key as a known_hosts key field ('ssh-ed25519 AAAA...'), learned once."""
    scratch = tmp_path / "scratch_known_hosts"
    learn = SshEndpoint(
        host="127.0.0.1",
        port=port,
        identity_file=str(client_key),
        options=("StrictHostKeyChecking=accept-new", f"UserKnownHostsFile={scratch}"),
    )
    await run_remote(learn, "true")
    return scratch.read_text().split(None, 1)[1].strip()


def _accept_new(port: int, key: Path, known: Path) -> SshEndpoint:
    return SshEndpoint(
        host="127.0.0.1",
        port=port,
        identity_file=str(key),
        options=("StrictHostKeyChecking=accept-new", f"UserKnownHostsFile={known}"),
    )


async def test_accept_new_refuses_a_revoked_host_key(tmp_path: Path) -> None:
    """A key under `@revoked` is refused, never accepted (and remembered) as a new host's key."""
    server = await start_local_ssh_server(tmp_path)
    try:
        key = await _server_key(tmp_path, server.port, server.client_key_path)
        known = tmp_path / "known_hosts"
        known.write_text(f"@revoked [127.0.0.1]:{server.port} {key}\n")
        with pytest.raises(ConnectionError, match="revoked"):
            await run_remote(_accept_new(server.port, server.client_key_path, known), "true")
        assert known.read_text() == f"@revoked [127.0.0.1]:{server.port} {key}\n"
        # The same key revoked for every host (`@revoked *`) is refused too.
        known.write_text(f"@revoked * {key}\n")
        with pytest.raises(ConnectionError, match="revoked"):
            await run_remote(_accept_new(server.port, server.client_key_path, known), "true")
    finally:
        server.close()


async def test_accept_new_treats_a_host_under_a_cert_authority_as_known(tmp_path: Path) -> None:
    """A host matched by `@cert-authority` is known: a plain key the CA did not sign is refused."""
    server = await start_local_ssh_server(tmp_path)
    ca = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    known = tmp_path / "known_hosts"
    known.write_text(f"@cert-authority [127.0.0.1]:{server.port} {ca}\n")
    try:
        with pytest.raises(ConnectionError, match="host key"):
            await run_remote(_accept_new(server.port, server.client_key_path, known), "true")
        assert known.read_text() == f"@cert-authority [127.0.0.1]:{server.port} {ca}\n"
    finally:
        server.close()


async def test_accept_new_still_takes_a_new_host_beside_revoked_and_ca_lines_for_others(
    tmp_path: Path,
) -> None:
    server = await start_local_ssh_server(tmp_path)
    other = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    known = tmp_path / "known_hosts"
    known.write_text(f"@revoked * {other}\n@cert-authority *.example.org {other}\n")
    try:
        assert (await run_remote(_accept_new(server.port, server.client_key_path, known), "echo hi"))[
            1
        ].strip() == "hi"
        assert f"[127.0.0.1]:{server.port} ssh-ed25519 " in known.read_text()
    finally:
        server.close()
