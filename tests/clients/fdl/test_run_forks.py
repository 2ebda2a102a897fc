"""`fdl run`'s fork server: one for the local agents whose CPU ranks it can fork; others keep warm ranks."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from fdl import runshell

from flodld import api


def worker(host: str, devices: list[str] | str, **env: str) -> SimpleNamespace:
    return SimpleNamespace(host=host, local_devices=devices, env=env)


def test_one_server_serves_the_agents_whose_ranks_it_fits_and_ends_with_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = [sys.executable, "-c", "import os; print(os.environ.get('FLODL_FORK_SERVER'), "
             "os.environ.get('FLODL_AGENT_WARM_RANKS'))"]  # fmt: skip
    monkeypatch.setattr(api, "agent_command", lambda: probe)  # an agent that only reports
    script = [sys.executable, str(tmp_path / "train.py")]
    local = [
        worker("a", ["cpu:2"]),
        worker("b", ["cpu:2"], PROBE="x"),  # not a start-up variable: served
        worker("c", ["cpu:2"], OMP_NUM_THREADS="3"),  # read when torch loads: warm ranks instead
        worker("d", ["cpu"]),  # another rank count: warm ranks instead
        worker("e", "all"),  # GPUs, or unknown: neither
    ]
    forks = runshell._Forks(script, local)
    try:
        assert forks.server is not None and forks.ranks == 2
        assert [forks.serves(w, script) for w in local] == [True, True, False, False, False]
        agents = asyncio.run(_roles(script, local, forks))
        assert agents == [("path", None), ("path", None), (None, "2"), (None, "1"), (None, "0")]
        path = forks.server.path
        assert Path(path).is_socket()
    finally:
        forks.close()
    assert forks.server.process.returncode is not None and not Path(path).exists()


def test_no_server_for_a_program_that_is_not_a_python_script_or_gpu_ranks(tmp_path: Path) -> None:
    for command, local in (
        (["/bin/true"], [worker("a", ["cpu:2"])]),
        ([sys.executable, str(tmp_path / "train.py")], [worker("a", "all"), worker("b", ["0", "1"])]),
    ):
        forks = runshell._Forks(command, local)
        assert forks.server is None and forks.directory is None
        forks.close()


async def _roles(
    command: list[str], local: list[SimpleNamespace], forks: runshell._Forks
) -> list[tuple[str | None, str | None]]:
    """What each local agent is told: the fork server's path, or its warm rank count (it prints both)."""
    agents = await runshell._spawn_agents(command, local, frozenset(), forks)
    seen: list[tuple[str | None, str | None]] = []
    for agent in agents:
        assert agent.stdout is not None
        path, warm = (await agent.stdout.read()).decode().split()
        await agent.wait()
        assert forks.server is not None
        seen.append(("path" if path == forks.server.path else None if path == "None" else path,
                     None if warm == "None" else warm))  # fmt: skip
    return seen
