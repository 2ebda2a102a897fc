"""Real agents (and their relay and rank children) against an in-process controller, for fault tests.

Every process a test starts carries FLODL_TEST_MARK in its environment, inherited by all descendants,
so the test can find (and assert the absence of) every process of the run through /proc.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flodld.agent.spec import AgentSpec
from flodld.config.join import JoinConfig
from flodld.controller.attachplane import attach_data_plane
from flodld.controller.options import ControllerOptions
from flodld.controller.run import Controller
from tests.agent_proc import start_agent

PROGRAM = Path(__file__).with_name("fault_program.py")
MARK = "FLODL_TEST_MARK"
FAST_ENV = {"FLODL_NET_TIMEOUT_SCALE": "0.2", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@dataclass
class MarkedProcess:
    pid: int
    environ: dict[str, str]
    cmdline: bytes


def marked_processes(mark: str) -> list[MarkedProcess]:
    """Every live process whose environment carries FLODL_TEST_MARK=mark (zombies excluded)."""
    found = []
    needle = f"{MARK}={mark}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/environ").read_bytes()
            if needle not in raw:
                continue
            status = Path(f"/proc/{entry}/status").read_text()
            if "\nState:\tZ" in status:
                continue
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        environ = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
        found.append(MarkedProcess(int(entry), environ, cmdline))
    return found


@dataclass
class AgentProcess:
    host: str
    process: asyncio.subprocess.Process
    lines: list[str] = field(default_factory=list)
    reader: asyncio.Task[None] | None = None

    async def collect(self) -> None:
        assert self.process.stdout is not None
        async for line in self.process.stdout:
            self.lines.append(line.decode(errors="replace"))

    @property
    def output(self) -> str:
        return "".join(self.lines)

    async def wait_for(self, fragment: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while fragment not in self.output:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.host}: no {fragment!r} within {timeout}s:\n{self.output[-3000:]}")
            if self.process.returncode is not None and fragment not in self.output:
                await asyncio.sleep(0.1)
                if fragment not in self.output:
                    raise AssertionError(
                        f"{self.host} exited {self.process.returncode}:\n{self.output[-3000:]}"
                    )
            await asyncio.sleep(0.05)


@dataclass
class Run:
    controller: Controller
    port: int
    mark: str
    agents: list[AgentProcess] = field(default_factory=list)

    async def spawn_agent(
        self,
        host: str,
        ranks: int = 1,
        *,
        wrapper: tuple[str, ...] = (),
        controller_host: str = "127.0.0.1",
        program: Path = PROGRAM,
        **env: str,
    ) -> AgentProcess:
        """Start `program` (default: the fault program) in agent role; `wrapper` prefixes the command (e.g.
        `ip netns exec NS`).
        """
        spec = AgentSpec(
            host=host,
            controller_host=controller_host,
            controller_port=self.port,
            salt_hex=self.controller.salt_hex,
            devices=[f"cpu:{ranks}" if ranks > 1 else "cpu"],
            averaging=self.controller.options.averaging,
            grace_secs=2.0,
        )
        environ = {**os.environ, **FAST_ENV, **env, MARK: self.mark}
        process = await start_agent(program, spec, environ, *wrapper)
        agent = AgentProcess(host, process)
        agent.reader = asyncio.get_running_loop().create_task(agent.collect())
        self.agents.append(agent)
        return agent

    def processes(self) -> list[MarkedProcess]:
        return marked_processes(self.mark)

    def find(self, **environ: str) -> MarkedProcess:
        matches = [p for p in self.processes() if all(p.environ.get(k) == v for k, v in environ.items())]
        assert len(matches) == 1, (environ, [(p.pid, p.cmdline) for p in matches])
        return matches[0]

    async def until_no_processes(self, bound: float) -> float:
        """Seconds until no marked process is left; AssertionError naming the survivors after `bound`."""
        begun = time.monotonic()
        while True:
            alive = self.processes()
            if not alive:
                return time.monotonic() - begun
            if time.monotonic() - begun > bound:
                raise AssertionError(f"orphans after {bound}s: {[(p.pid, p.cmdline[:120]) for p in alive]}")
            await asyncio.sleep(0.1)

    def state(self) -> dict[str, Any]:
        body = self.controller.state_json()
        assert body is not None
        return body


def fault_options(**overrides: object) -> ControllerOptions:
    values: dict[str, Any] = {
        "bind_host": "127.0.0.1",
        "port": 0,
        "tick_interval": 0.02,
        "run_id": "fault-run",
        "capacity": 2,
        "magic_deadline": 2.0,
        "handshake_timeout": 2.0,
        "averaging": "cpu_sync",
        "join": JoinConfig(join_timeout=60, target_ranks=2, min_rank_start=2),
        "env": {"OMP_NUM_THREADS": "1", "FLODL_NET_TIMEOUT_SCALE": "0.2"},
    }
    values.update(overrides)
    return ControllerOptions.model_validate(values)


@asynccontextmanager
async def fault_run(options: ControllerOptions | None = None) -> AsyncIterator[Run]:
    controller = Controller(options or fault_options())
    attach_data_plane(controller)
    _, port = await controller.start()
    run = Run(controller, port, uuid.uuid4().hex)
    try:
        yield run
    finally:
        for agent in run.agents:
            if agent.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    agent.process.kill()
                await agent.process.wait()
            if agent.reader is not None:
                agent.reader.cancel()
        for leftover in run.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(leftover.pid, signal.SIGKILL)
        await controller.close()
