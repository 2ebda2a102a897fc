"""Running fdl commands as real subprocesses and watching their output."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROGRAMS = Path(__file__).resolve().parent / "programs"
EXAMPLES = REPO / "examples"


def child_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}
    for name in (
        "FLODL_INTERNAL_AGENT_JSON",
        "FLODL_INTERNAL_RELAY_JSON",
        "FDL_ENV",
        "RANK",
        "FLODL_CONTROLLER",
    ):
        env.pop(name, None)
    return env


class Fdl:
    """An `fdl <command>` subprocess whose combined output is collected line by line."""

    def __init__(
        self, command: str, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
    ) -> None:
        argv = [sys.executable, "-m", "fdl.main", command, *args]
        self.process = subprocess.Popen(
            argv,
            cwd=cwd or REPO,
            env=env or child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def output(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 120.0, count: int = 1) -> list[re.Match[str]]:
        """Block until `count` lines match `pattern`; AssertionError with the output otherwise."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = [m for m in (regex.search(line) for line in self.lines) if m]
                if len(found) >= count:
                    return found[:count]
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.process.poll() is not None and not self._pump_alive()):
                    raise AssertionError(
                        f"no {count}x {pattern!r} in output:\n" + "\n".join(self.lines[-80:])
                    )
                self._changed.wait(min(remaining, 0.5))

    def _pump_alive(self) -> bool:
        return (
            self.process.stdout is not None and not self.process.stdout.closed and self.process.poll() is None
        )

    def wait(self, timeout: float = 180.0) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"fdl did not finish within {timeout}s:\n{self.output[-6000:]}") from None

    def signal(self, signum: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signum)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def write_discovery_project(
    directory: Path, port: int, token: str, ranks: int, *, join_timeout: float = 120
) -> Path:
    """An fdl.yml whose window is roster-free (walk-ins only) and forms at `ranks` ranks; its directory."""
    (directory / "fdl.yml").write_text(
        "cluster:\n"
        "  controller:\n"
        "    host: 127.0.0.1\n"
        f"    port: {port}\n"
        "    averaging: cpu_sync\n"
        "    backend: gloo\n"
        "    join:\n"
        "      discovery: true\n"
        f"      min_rank_start: {ranks}\n"
        f"      target_ranks: {ranks}\n"
        f"      join_timeout: {join_timeout}\n"
        f"      token: {token}\n"
        "  workers: []\n"
    )
    return directory
