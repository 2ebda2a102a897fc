"""`fdl join` against a controller that checks credentials, without a token: exit 2 with the hint, also under
--persist (a refusal that re-dialing cannot fix must not loop forever).
"""

from __future__ import annotations

import asyncio
import secrets
import sys
from pathlib import Path

from flodld.config.join import JoinConfig
from flodld.controller.options import ControllerOptions
from flodld.controller.run import Controller
from tests.e2e.harness import REPO, child_env

PROGRAM = "import sys, flodld\nsys.exit(flodld.run(lambda: 0, init_process_group=False))\n"


async def fdl_join(*words: str, cwd: Path, timeout: float, scale: str = "0.2") -> tuple[int, str]:
    env = child_env(PYTHONPATH=f"{REPO}:{REPO / 'clients'}", FLODL_NET_TIMEOUT_SCALE=scale)
    env.pop("FDL_JOIN_TOKEN", None)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fdl.main", "join", *words, cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        process.kill()
        out, _ = await process.communicate()
        raise AssertionError(f"fdl join still running after {timeout}s:\n{out.decode()[-3000:]}") from None
    assert process.returncode is not None
    return process.returncode, out.decode()


async def test_a_join_without_a_token_refused_by_a_credential_checked_controller_exits_2(
    tmp_path: Path,
) -> None:
    (tmp_path / "walk.py").write_text(PROGRAM)
    controller = Controller(
        ControllerOptions(
            advertised_host="127.0.0.1",
            port=0,
            bind_host="127.0.0.1",
            averaging="cpu_sync",
            join=JoinConfig(discovery=True, min_rank_start=1, target_ranks=1, token=secrets.token_hex(16)),
        )
    )
    _, port = await controller.start()
    try:
        code, output = await fdl_join(
            f"127.0.0.1:{port}", "--bin", "walk.py", "--devices", "cpu", "--persist", cwd=tmp_path, timeout=40
        )
    finally:
        await controller.stop("test over")
    assert code == 2, output
    assert "--token" in output and "FDL_JOIN_TOKEN" in output, output
    assert "not re-dialing" in output, output


async def test_fdl_join_ssh_with_a_refused_key_exits_2_even_under_persist(tmp_path: Path) -> None:
    import asyncssh

    from tests.conftest import require_binary
    from tests.flodld.fanout.sshserver import start_local_ssh_server

    require_binary("ssh", "ssh")
    server = await start_local_ssh_server(tmp_path)
    stranger = tmp_path / "stranger_key"  # a key the server does not authorize
    asyncssh.generate_private_key("ssh-ed25519").write_private_key(str(stranger))
    stranger.chmod(0o600)
    (tmp_path / "walk.py").write_text(PROGRAM)
    (tmp_path / "fdl.yml").write_text(
        "join:\n  ssh:\n    target: 127.0.0.1\n"
        f"    port: {server.port}\n    options: [StrictHostKeyChecking=accept-new, "
        f"UserKnownHostsFile={tmp_path / 'known_hosts'}]\n"
    )
    try:
        code, output = await fdl_join("127.0.0.1:1337", "--bin", "walk.py", "--devices", "cpu", "--persist",
                                      "--identity", str(stranger), cwd=tmp_path, timeout=60)  # fmt: skip
    finally:
        server.close()
    assert code == 2, output
    assert "Permission denied" in output and "not re-dialing" in output, output


async def test_fdl_join_ssh_to_an_unknown_host_key_exits_2_with_the_remedy_even_under_persist(
    tmp_path: Path,
) -> None:
    from tests.conftest import require_binary
    from tests.flodld.fanout.sshserver import start_local_ssh_server

    require_binary("ssh", "ssh")
    server = await start_local_ssh_server(tmp_path)
    (tmp_path / "known_hosts").write_text("")  # the server's key is known nowhere
    (tmp_path / "walk.py").write_text(PROGRAM)
    (tmp_path / "fdl.yml").write_text(
        "join:\n  ssh:\n    target: 127.0.0.1\n"
        f"    port: {server.port}\n    options: [StrictHostKeyChecking=yes, "
        f"UserKnownHostsFile={tmp_path / 'known_hosts'}]\n"
    )
    try:
        code, output = await fdl_join("127.0.0.1:1337", "--bin", "walk.py", "--devices", "cpu", "--persist",
                                      "--identity", str(server.client_key_path), cwd=tmp_path,
                                      timeout=60)  # fmt: skip
    finally:
        server.close()
    assert code == 2, output
    assert "Host key verification failed" in output, output
    assert f"ssh-keyscan -p {server.port} 127.0.0.1 >> ~/.ssh/known_hosts" in output, output
    assert "StrictHostKeyChecking=accept-new" in output and "not re-dialing" in output, output


async def test_fdl_join_to_a_port_where_nothing_listens_says_it_keeps_dialing(tmp_path: Path) -> None:
    import socket

    (tmp_path / "walk.py").write_text(PROGRAM)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    # the smallest scale: nothing answers, so no handshake is bounded by it; the dialing lasts 3 s, not 6
    code, output = await fdl_join(f"127.0.0.1:{port}", "--bin", "walk.py", "--devices", "cpu", cwd=tmp_path,
                                  timeout=60, scale="0.1")  # fmt: skip
    assert code == 1, output
    said = output.index(f"connect to 127.0.0.1:{port} failed (ConnectionRefusedError")
    assert "retrying every 0.5s for up to 2s more — is a controller listening there" in output, output
    assert said < output.index("failed after 6 attempts"), output  # said while dialing, not at the end
