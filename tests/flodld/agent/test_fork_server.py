"""The fork server (flodld.launcher.forkserver, flodld.agent.forkserver): a rank forked from a process that
loaded torch once runs exactly as a cold start would (argv, environment, stdio, its own session, its exit
code), never outlives the agent that asked for it or the server, and is refused where a fork would not be
the same rank (start-up variables, GPU devices, a program that is not a Python script).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flodld.agent.forkserver import ForkedRank, ForkServer, HostForkServer
from flodld.agent.spawn import rank_command
from flodld.rank.warm import (
    FIRST_PASSED_FD,
    MAX_REPLY_BYTES,
    Exited,
    Forked,
    ForkReply,
    ForkReplyError,
    ForkRequest,
    Ready,
    Refused,
    decode_reply,
    encode_fork_request,
    encode_reply,
)

SCRIPT = """
import json, os, sys, time
optimizer_imports = None
if "torch" in sys.modules:  # forked: what a training rank's first optimizer would still import
    before = set(sys.modules)
    import torch
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
    optimizer_imports = sorted(set(sys.modules) - before)
print(json.dumps({
    "optimizer_imports": optimizer_imports,
    "argv": sys.argv,
    "mark": os.environ.get("FORK_TEST_MARK"),
    "server_only": os.environ.get("FORK_TEST_SERVER_ONLY"),
    "salt": os.environ.get("FLODL_INTERNAL_SALT"),
    "omp": os.environ.get("OMP_NUM_THREADS"),
    "stdin": sys.stdin.read(),
    "torch_loaded_before_script": "torch" in sys.modules,
    "own_session": os.getsid(0) == os.getpid(),
    "parent": os.getppid(),
    "path0": sys.path[0],
}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if os.environ.get("FORK_TEST_SLEEP"):
    time.sleep(float(os.environ["FORK_TEST_SLEEP"]))
sys.exit(int(os.environ.get("FORK_TEST_CODE", "0")))
"""


# --- the reply codec (pure) ----------------------------------------------------------------------------


REPLIES: list[ForkReply] = [Ready({"OMP_NUM_THREADS": "1"}), Forked(41), Refused("why"), Exited(41, -9)]


@pytest.mark.parametrize("reply", REPLIES)
def test_every_reply_round_trips(reply: ForkReply) -> None:
    assert decode_reply(encode_reply(reply)) == reply


@pytest.mark.parametrize(
    ("packet", "names"),
    [
        (b"not json", "not JSON"),
        (b'{"kind": "spawned", "pid": 1}', "unknown kind"),
        (b'{"kind": "forked"}', "exactly the fields"),
        (b'{"kind": "forked", "pid": 1, "extra": 2}', "exactly the fields"),
        (b'{"kind": "forked", "pid": true}', "exactly the fields"),
        (b'{"kind": "exited", "pid": 1, "code": "9"}', "exactly the fields"),
        (b'{"kind": "ready", "startup": {"A": 1}}', "names to strings"),
        (b'["forked", 1]', "unknown kind"),
        (b"x" * (MAX_REPLY_BYTES + 1), "cap"),
    ],
)
def test_a_malformed_reply_is_refused_naming_what_is_wrong(packet: bytes, names: str) -> None:
    with pytest.raises(ForkReplyError, match=names):
        decode_reply(packet)


# --- a real server ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostForkServer]:
    directory = tmp_path_factory.mktemp("forks")
    directory.chmod(0o700)
    environ = {**os.environ, "FORK_TEST_SERVER_ONLY": "server", "FDL_JOIN_TOKEN": "secret"}
    environ.pop("OMP_NUM_THREADS", None)
    forks = HostForkServer.start(["cpu:2"], str(directory), environ, drop=("FDL_JOIN_TOKEN",))
    assert forks is not None
    yield forks
    forks.close()


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("script") / "rank.py"
    path.write_text(SCRIPT)
    return path


def _rank_env(startup: dict[str, str], **extra: str) -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", ""), "FORK_TEST_MARK": "mine", **startup}
    env.update(extra)
    return env


async def _take(
    server: HostForkServer,
    argv: list[str],
    env: dict[str, str],
    *,
    device: str = "cpu:0",
    split: bool = False,
) -> tuple[ForkServer, ForkedRank | None, list[str]]:
    said: list[str] = []
    forks = await ForkServer.connect(server.path, said.append)
    assert forks is not None, said
    return forks, await forks.take(argv, env, device=device, split_stderr=split, say=said.append), said


def test_a_forked_rank_runs_the_script_as_a_cold_start_would(server: HostForkServer, script: Path) -> None:
    async def main() -> tuple[dict[str, object], bytes, bytes, int, dict[str, str]]:
        probe = await ForkServer.connect(server.path, print)
        assert probe is not None
        startup = await probe.startup()
        probe.close()
        argv = rank_command([sys.executable, str(script), "--lr", "0.1"])
        env = _rank_env(startup, FORK_TEST_CODE="3", RANK="5")
        forks, rank, said = await _take(server, argv, env, split=True)
        assert rank is not None, said
        assert said == [f"rank 5 forked by this host's fork server (pid {rank.pid})"]
        assert rank.stdout is not None and rank.stderr is not None
        out, err = await rank.stdout.read(), await rank.stderr.read()
        code = await rank.wait()
        forks.close()
        return json.loads(out), out, err, code, startup

    seen, _, err, code, startup = asyncio.run(main())
    assert code == 3  # its exit code, as the agent reads a child's
    assert seen["argv"] == [str(script), "--lr", "0.1"]
    assert seen["mark"] == "mine"  # exactly the rank's environment ...
    assert seen["server_only"] is None  # ... nothing of the server's
    assert seen["omp"] == startup["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))
    assert seen["stdin"] == ""  # /dev/null, as for a cold rank
    assert seen["torch_loaded_before_script"] is True  # the point: torch came with the fork
    assert seen["optimizer_imports"] == []  # ... and what the first optimizer loads lazily (torch._dynamo)
    assert seen["own_session"] is True  # its process group is its pid: the agent's teardown reaches its tree
    assert seen["parent"] == server.process.pid
    assert seen["path0"] == str(script.parent)
    assert err == b"to stderr\n"  # split streams, as per-rank log files want


def test_the_server_holds_no_join_token(server: HostForkServer) -> None:
    environ = Path(f"/proc/{server.process.pid}/environ").read_bytes().split(b"\0")
    assert b"FDL_JOIN_TOKEN=secret" not in environ
    assert b"FORK_TEST_SERVER_ONLY=server" in environ


def test_ranks_of_an_agent_that_dies_are_killed_others_live_on(server: HostForkServer, script: Path) -> None:
    """A killed agent's connection closes; the server kills its ranks, not another agent's."""
    code = f"""
import asyncio, os, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[3])!r})
from flodld.agent.forkserver import ForkServer
from flodld.agent.spawn import rank_command
async def main():
    forks = await ForkServer.connect({server.path!r}, print)
    env = {{"PATH": os.environ["PATH"], "FORK_TEST_SLEEP": "60", **(await forks.startup())}}
    rank = await forks.take(rank_command([sys.executable, {str(script)!r}]), env, device="cpu:0",
                            split_stderr=False, say=lambda _: None)
    print(rank.pid, flush=True)
    await asyncio.sleep(60)
asyncio.run(main())
"""

    async def other_agent() -> tuple[ForkServer, ForkedRank]:
        forks = await ForkServer.connect(server.path, print)
        assert forks is not None
        rank = await forks.take(
            rank_command([sys.executable, str(script)]),
            _rank_env(await forks.startup(), FORK_TEST_SLEEP="60"),
            device="cpu:0",
            split_stderr=False,
            say=print,
        )
        assert rank is not None
        return forks, rank

    async def main() -> None:
        forks, survivor = await other_agent()
        agent = await asyncio.create_subprocess_exec(sys.executable, "-c", code, stdout=subprocess.PIPE)
        assert agent.stdout is not None
        line = await asyncio.wait_for(agent.stdout.readline(), 60)
        doomed = int(line)
        assert _alive(doomed)
        agent.kill()  # SIGKILL: no cleanup of its own
        await agent.wait()
        await _until(lambda: not _alive(doomed), 10)
        assert survivor.returncode is None and _alive(survivor.pid)  # another agent's rank is untouched
        forks.close()  # and it goes once its own agent's connection closes
        await _until(lambda: not _alive(survivor.pid), 10)

    asyncio.run(main())


def test_stopping_the_server_kills_its_ranks_and_the_agent_hears_so(tmp_path: Path, script: Path) -> None:
    tmp_path.chmod(0o700)
    host = HostForkServer.start(["cpu"], str(tmp_path), os.environ)
    assert host is not None

    async def main() -> int:
        probe = await ForkServer.connect(host.path, print)
        assert probe is not None
        env = _rank_env(await probe.startup(), FORK_TEST_SLEEP="60")
        probe.close()
        forks, rank, said = await _take(host, rank_command([sys.executable, str(script)]), env)
        assert rank is not None, said
        await asyncio.to_thread(host.close)
        code = await asyncio.wait_for(rank.wait(), 10)
        assert not _alive(rank.pid)
        forks.close()
        return code

    assert asyncio.run(main()) == -signal.SIGKILL


@pytest.mark.parametrize(
    ("program", "device", "extra", "why"),
    [
        ("script", "cpu:0", {"OMP_NUM_THREADS": "7"}, "start-up variables differ (OMP_NUM_THREADS)"),
        ("script", "cuda:0", {}, "device cuda:0 is not a CPU"),
        ("binary", "cpu:0", {}, "the program is not a Python script"),
        ("script", "cpu:0", {"HUGE": "x" * (200 << 10)}, "over"),
    ],
)
def test_a_rank_that_a_fork_would_not_reproduce_starts_cold_with_a_word(
    server: HostForkServer, script: Path, program: str, device: str, extra: dict[str, str], why: str
) -> None:
    async def main() -> tuple[ForkedRank | None, list[str], int]:
        probe = await ForkServer.connect(server.path, print)
        assert probe is not None
        startup = await probe.startup()
        probe.close()
        argv = rank_command([sys.executable, str(script)] if program == "script" else ["/bin/true"])
        forks, rank, said = await _take(server, argv, _rank_env(startup, **extra), device=device)
        used = forks.used
        forks.close()
        return rank, said, used

    rank, said, used = asyncio.run(main())
    assert rank is None and used == 0
    assert len(said) == 1 and re.match(r"rank \S+ not forked by the fork server, starting it cold", said[0])
    assert why in said[0]


def test_a_fork_server_is_only_kept_for_cpu_ranks_named_up_front(tmp_path: Path) -> None:
    for devices in (None, ["0", "1"], ["all"]):
        assert HostForkServer.start(devices, str(tmp_path), os.environ) is None


def test_an_agent_without_a_reachable_server_says_so(tmp_path: Path) -> None:
    said: list[str] = []
    assert asyncio.run(ForkServer.connect(str(tmp_path / "none"), said.append)) is None
    assert len(said) == 1 and "ranks start cold" in said[0]


def test_a_request_without_descriptors_or_not_a_handoff_is_refused(server: HostForkServer) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(30)
        sock.connect(server.path)
        assert isinstance(decode_reply(sock.recv(MAX_REPLY_BYTES)), Ready)
        sock.send(b'{"argv": ["x.py"], "env": {}}\n')  # no stdout descriptor
        refusal = decode_reply(sock.recv(MAX_REPLY_BYTES))
        assert isinstance(refusal, Refused) and "keys argv, env, passed, streams" in refusal.reason
        read, write = os.pipe()
        socket.send_fds(sock, [b"not a hand-off\n"], [write])
        os.close(write)
        refused = decode_reply(sock.recv(MAX_REPLY_BYTES))
        assert isinstance(refused, Refused) and "not JSON" in refused.reason
        assert os.read(read, 1) == b""  # the server closed its copy of the descriptor
        os.close(read)


_SYSTEM_PYTHON = "/usr/bin/python3"
_RAW_CLIENT = """
import socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
sock.settimeout(30)
sock.connect(sys.argv[1])
print("reply=" + sock.recv(65536).hex())
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or not os.access(_SYSTEM_PYTHON, os.X_OK),
    reason="needs root, setpriv and /usr/bin/python3 to be another uid",
)
def test_a_connection_from_another_uid_is_closed_unanswered(tmp_path: Path) -> None:
    """The socket's directory keeps other users out; opened up, the peer credentials still do."""
    from tests.flodld.fanout.joinuser import as_join_user, door_directory, join_user

    directory = door_directory()  # reachable by the other user, unlike a real server's
    host = HostForkServer.start(["cpu"], str(directory), os.environ)
    assert host is not None
    try:
        os.chmod(host.path, 0o777)
        result = subprocess.run(
            as_join_user([_SYSTEM_PYTHON, "-c", _RAW_CLIENT, host.path], join_user()),
            capture_output=True, text=True, timeout=60, cwd="/",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "reply=", result.stdout  # closed without a word
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:  # this uid is answered
            sock.settimeout(30)
            sock.connect(host.path)
            assert isinstance(decode_reply(sock.recv(MAX_REPLY_BYTES)), Ready)
    finally:
        host.close()
        shutil.rmtree(directory, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


async def _until(condition: object, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]  # a callable
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


PASSED_SCRIPT = """
import os, socket, stat, sys
mode = os.fstat(3).st_mode
sock = socket.socket(fileno=3)
print(stat.S_ISSOCK(mode), sock.getsockname()[1], os.get_inheritable(3), flush=True)
"""


def test_a_passed_descriptor_is_found_at_the_first_passed_fd(server: HostForkServer, tmp_path: Path) -> None:
    """The relay's rank listener, as its spec names it (FIRST_PASSED_FD), whatever number it had here."""
    script = tmp_path / "passed.py"
    script.write_text(PASSED_SCRIPT)
    listener = socket.create_server(("127.0.0.1", 0))

    async def main() -> str:
        forks = await ForkServer.connect(server.path, print)
        assert forks is not None
        request = ForkRequest([str(script)], _rank_env(await forks.startup()))
        child = await forks._fork(request, [listener.fileno()])
        assert child.stdout is not None
        out = (await child.stdout.read()).decode()
        assert await child.wait() == 0, out
        forks.close()
        return out

    try:
        assert FIRST_PASSED_FD == 3
        assert asyncio.run(main()).split() == ["True", str(listener.getsockname()[1]), "True"]
    finally:
        listener.close()


def test_a_request_whose_descriptors_do_not_match_its_layout_is_refused(server: HostForkServer) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(30)
        sock.connect(server.path)
        assert isinstance(decode_reply(sock.recv(MAX_REPLY_BYTES)), Ready)
        read, write = os.pipe()
        request = encode_fork_request(ForkRequest(["x.py"], {}, streams=1, passed=1))
        socket.send_fds(sock, [request], [write])  # the passed descriptor is missing
        os.close(write)
        refused = decode_reply(sock.recv(MAX_REPLY_BYTES))
        assert isinstance(refused, Refused) and "came with 1 descriptor" in refused.reason
        assert os.read(read, 1) == b""
        os.close(read)


def test_a_rank_has_its_own_group_once_the_agent_hears_of_it(server: HostForkServer, script: Path) -> None:
    """The agent's teardown (SIGKILL to the rank's process group, its pid) right after the fork reaches it."""

    async def main() -> list[int]:
        forks = await ForkServer.connect(server.path, print)
        assert forks is not None
        env = _rank_env(await forks.startup(), FORK_TEST_SLEEP="60")
        codes = []
        for _ in range(5):
            rank = await forks.take(rank_command([sys.executable, str(script)]), env, device="cpu:0",
                                    split_stderr=False, say=lambda _: None)  # fmt: skip
            assert rank is not None
            os.killpg(rank.pid, signal.SIGKILL)  # what the agent's signal_group does
            codes.append(await asyncio.wait_for(rank.wait(), 30))
        forks.close()
        return codes

    assert asyncio.run(main()) == [-signal.SIGKILL] * 5
