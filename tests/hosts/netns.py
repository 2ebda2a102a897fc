"""A small lab of "hosts" made of network namespaces: one controller box, N workers, each with sshd.

Topology: worker i (1-based) hangs off the controller box on its own veth pair, 10.250.i.1 on
the controller side and 10.250.i.2 (interface `fdl0`) on the worker; the controller box forwards
between them so ranks on different workers reach each other. Only addresses inside these
namespaces are used. Everything is torn down by `close()`, also after a failure.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import prepare_sshd_privsep, require_capability

WORKER_IFNAME = "fdl0"
SSHD_PORT = 2200


def require_netns() -> None:
    """Skip (fail under FLODLD_REQUIRE_NETNS=1) unless namespaces can be made here: root and iproute2."""
    available = os.geteuid() == 0 and shutil.which("ip") is not None
    require_capability("netns", available, "needs root and iproute2")


def ip(*args: str) -> None:
    """Run one `ip` command; raises on failure."""
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


def worker_address(index: int) -> str:
    return f"10.250.{index}.2"


def controller_address(index: int = 1) -> str:
    return f"10.250.{index}.1"


@dataclass
class Lab:
    root: Path
    workers: int
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    namespaces: list[str] = field(default_factory=list)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    client_key: Path | None = None

    @property
    def controller_ns(self) -> str:
        return f"fdl{self.tag}c"

    def worker_ns(self, index: int) -> str:
        return f"fdl{self.tag}w{index}"

    def build(self) -> None:
        ip("netns", "add", self.controller_ns)
        self.namespaces.append(self.controller_ns)
        ip("-n", self.controller_ns, "link", "set", "lo", "up")
        subprocess.run(["ip", "netns", "exec", self.controller_ns, "sysctl", "-qw", "net.ipv4.ip_forward=1"],
                       check=True)  # fmt: skip
        for index in range(1, self.workers + 1):
            ns = self.worker_ns(index)
            ip("netns", "add", ns)
            self.namespaces.append(ns)
            ip("link", "add", "name", f"c{index}", "netns", self.controller_ns, "type", "veth",
                "peer", "name", WORKER_IFNAME, "netns", ns)  # fmt: skip
            ip("-n", self.controller_ns, "addr", "add", f"{controller_address(index)}/24", "dev", f"c{index}")
            ip("-n", ns, "addr", "add", f"{worker_address(index)}/24", "dev", WORKER_IFNAME)
            for where, dev in ((self.controller_ns, f"c{index}"), (ns, WORKER_IFNAME), (ns, "lo")):
                ip("-n", where, "link", "set", dev, "up")
            ip("-n", ns, "route", "add", "10.250.0.0/16", "via", controller_address(index))

    def exec_argv(self, ns: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, *argv]

    def spawn(self, ns: str, argv: list[str], *, log: Path, cwd: Path | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:  # fmt: skip
        with log.open("wb") as handle:
            process = subprocess.Popen(
                self.exec_argv(ns, argv),
                stdout=handle,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=cwd,
                env=env,
                start_new_session=True,
            )
        self.processes.append(process)
        return process

    def worker_processes(self) -> list[int]:
        """PIDs in the workers' network namespaces other than sshd's: what a run started on the worker hosts
        (agents, relays, ranks, whatever they spawned). Found by namespace, not by command line: agents and
        relays run as `python -m flodld…` and name no test path.
        """
        found: list[int] = []
        for index in range(1, self.workers + 1):
            listed = subprocess.run(
                ["ip", "netns", "pids", self.worker_ns(index)], capture_output=True, text=True
            )
            for pid in listed.stdout.split():
                try:
                    comm = Path(f"/proc/{pid}/comm").read_text().strip()
                except OSError:
                    continue
                if not comm.startswith("sshd"):
                    found.append(int(pid))
        return found

    def start_worker_sshd(self, index: int, sshd: str, keygen: str) -> None:
        """A root sshd on worker_address(index):SSHD_PORT accepting the lab's client key."""
        directory = self.root / f"sshd{index}"
        directory.mkdir()
        if self.client_key is None:
            self.client_key = self.root / "client_key"
            subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(self.client_key)], check=True)
        (directory / "authorized_keys").write_text(Path(f"{self.client_key}.pub").read_text())
        subprocess.run(
            [keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(directory / "host_key")], check=True
        )
        (directory / "sshd_config").write_text(
            f"Port {SSHD_PORT}\nListenAddress {worker_address(index)}\nHostKey {directory / 'host_key'}\n"
            f"PidFile {directory / 'sshd.pid'}\nAuthorizedKeysFile {directory / 'authorized_keys'}\n"
            "StrictModes no\nUsePAM no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "PermitRootLogin prohibit-password\nAllowTcpForwarding yes\nLogLevel VERBOSE\n"
            "ClientAliveInterval 1\nClientAliveCountMax 3\n"  # a dead launcher is noticed within seconds
        )
        prepare_sshd_privsep()
        self.spawn(self.worker_ns(index), [sshd, "-D", "-e", "-f", str(directory / "sshd_config")],
                   log=directory / "sshd.log")  # fmt: skip
        self.wait_listening(self.worker_ns(index), worker_address(index), SSHD_PORT)

    def wait_listening(self, ns: str, host: str, port: int, timeout: float = 15.0) -> None:
        probe = f"import socket; socket.create_connection(({host!r}, {port}), timeout=1).close()"
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if (
                subprocess.run(
                    self.exec_argv(ns, [sys.executable, "-c", probe]), capture_output=True
                ).returncode
                == 0
            ):
                return
            time.sleep(0.2)
        raise AssertionError(f"{host}:{port} never listened in {ns}")

    def close(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGTERM)
        for process in reversed(self.processes):
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.clear()


def processes_mentioning(marker: str) -> list[int]:
    """PIDs (all namespaces share the PID space here) whose command line mentions `marker`."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                found.append(int(pid))
        except OSError:
            continue
    return found


def kill_leftovers(marker: str) -> None:
    """Last-resort cleanup of processes this test started (found by its unique path)."""
    for pid in processes_mentioning(marker):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def far_namespace(prefix: str, subnet: int, *, public: bool = False) -> Iterator[tuple[str, str, str]]:
    """One namespace behind a veth pair: yields (namespace, host-side veth, host-side address).

    The far end is 10.<subnet>.<x>.2 inside the namespace (with `public`, 198.18.<x>.2: the
    benchmarking range, outside every private range flodld knows, so it stands for a public peer
    whatever this machine's own addresses are); names and addresses carry this process's pid so
    concurrent runs do not collide. Whatever a failed run left running in the namespace is killed
    on the way out. Skips as require_netns does where namespaces cannot be made.
    """
    require_netns()
    tag = f"{os.getpid() % 100000}"
    namespace, near, far = f"{prefix}{tag}", f"v{prefix[-2:]}n{tag}", f"v{prefix[-2:]}f{tag}"
    third = os.getpid() % 200 + 20
    net = f"198.18.{third}" if public else f"10.{subnet}.{third}"
    near_address, far_address = f"{net}.1", f"{net}.2"
    ip("netns", "add", namespace)
    try:
        ip("link", "add", near, "type", "veth", "peer", "name", far)
        ip("link", "set", far, "netns", namespace)
        ip("addr", "add", f"{near_address}/30", "dev", near)
        ip("link", "set", near, "up")
        ip("netns", "exec", namespace, "ip", "addr", "add", f"{far_address}/30", "dev", far)
        ip("netns", "exec", namespace, "ip", "link", "set", far, "up")
        ip("netns", "exec", namespace, "ip", "link", "set", "lo", "up")
        yield namespace, near, near_address
    finally:
        pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=10)
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "link", "del", near], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=10)
