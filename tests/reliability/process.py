"""`flodld serve` as a real subprocess on 127.0.0.1, with the numbers an operator would watch (RSS, fds)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from flodld.wire.salt import new_salt, salt_to_hex
from tests.serve import listening_port, serve_argv


def write_config(directory: Path, token: str, *, target: int = 8, window: float = 60, start: str = "auto",
                 min_ranks: int = 1) -> Path:
    """A discovery cluster config carrying the token in the file (never on a command line)."""
    target_line = f"      target_ranks: {target}\n" if start != "manual" else ""
    path = directory / "fdl.yml"
    path.write_text(
        "cluster:\n  controller:\n    host: 127.0.0.1\n    join:\n      discovery: true\n      "
        f"min_rank_start: {min_ranks}\n{target_line}      join_timeout: {window}\n      start: {start}\n     "
        f" token: {token}\n  workers: []\n"
    )
    return path


class DaemonProcess:
    """One `python -m flodld serve` child; stderr is collected for the whole life of the process."""

    def __init__(
        self,
        directory: Path,
        *,
        token: str | None = None,
        port: int = 0,
        extra: tuple[str, ...] = (),
        **config: object,
    ) -> None:
        self.token = token or salt_to_hex(new_salt())
        self.config = write_config(directory, self.token, **config)  # type: ignore[arg-type]
        self.argv = serve_argv(*extra, config=self.config, port=port)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "FLODL_NET_TIMEOUT_SCALE": "0.2"}
        self.proc = subprocess.Popen(
            self.argv,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            env=env,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._port_found = threading.Event()
        self.port = 0
        self._reader = threading.Thread(target=self._collect, daemon=True)
        self._reader.start()
        if not self._port_found.wait(20):
            self.kill()
            raise RuntimeError("flodld serve did not report its port within 20s:\n" + self.log)

    def _collect(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            port = listening_port(line)
            if port is not None and not self._port_found.is_set():
                self.port = port
                self._port_found.set()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def terminate(self, timeout: float = 10) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout)
        self._reader.join(5)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._reader.join(5)

    def wait_for_line(self, fragment: str, timeout: float = 10) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if fragment in line:
                    return line
            time.sleep(0.02)
        raise TimeoutError(f"no log line with {fragment!r} within {timeout}s:\n{self.log[-3000:]}")


def raise_fd_limit(wanted: int) -> None:
    """Lift the soft RLIMIT_NOFILE to `wanted` (within the hard limit) for this process and its children."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(max(soft, wanted), hard if hard != resource.RLIM_INFINITY else wanted)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
