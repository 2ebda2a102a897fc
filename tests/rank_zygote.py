"""A zygote for rank processes: import torch (and the modules a rank script needs) once, then fork each rank.

A test that starts a world of real rank processes pays the torch import in every one of them (about 1.5 s of
CPU each: a three-rank world costs over 2 s on two cores before any rank does its work). The zygote pays it
once per test module: `Zygote(["fhelium.multiparty.distributed", ...], env)` starts `python rank_zygote.py
MODULE...`, which imports them (`module:function` also calls the function: `fhelium.native.build:load`
builds or loads the native kernels once, not in every rank at once) and then forks, on request, a child
that runs a rank script as `python SCRIPT ARGS` would (`__name__ == "__main__"`, `sys.argv`, the script's
folder first on `sys.path`), in its own session, with exactly the environment given, its stdin /dev/null
and its stdout and stderr in a log file. Each child is an ordinary process of its own (its own gloo
connections, store client, pid; SIGKILL ends it alone), as `tests/fhelium/distributed/rank_main.py` forks
its ranks; the randomness that matters (fhelium's keys and seeds) comes from the OS (`secrets`), which a
fork does not share.

Protocol: one JSON request per line on the zygote's stdin ({"script", "argv", "env", "log"}), one reply per
line on its stdout ({"pid"}). The zygote reaps its children and writes each one's exit status, as
`Popen.returncode` gives it (minus the signal for a signal), to `LOG.exit`. At EOF on stdin it SIGKILLs every
child still running and exits.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

ZYGOTE = Path(__file__).resolve()


class ForkedRank:
    """A rank forked by the zygote: its exit status comes from the zygote's `LOG.exit` file."""

    def __init__(self, pid: int, log: Path) -> None:
        self.pid, self.log = pid, log
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(FileNotFoundError, ValueError):
                self.returncode = int(Path(f"{self.log}.exit").read_text())
        return self.returncode

    def wait(self, timeout: float) -> int:
        """The exit status; `subprocess.TimeoutExpired` if it still runs after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.log), timeout)
            time.sleep(0.02)
        return code

    def kill(self) -> None:
        """SIGKILL its session (the rank and anything it started), unless it has exited already."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def collect_results(
    processes: Sequence[ForkedRank], scenario: str, timeout: float
) -> list[dict[str, Any]]:
    """Each rank's result, the last JSON line it printed, in rank order; every rank is killed afterwards
    (a rank that never finishes, or prints no result, fails the test naming it and the scenario).
    """
    results = []
    try:
        for rank, process in enumerate(processes):
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                world = len(processes)
                raise AssertionError(f"rank {rank} of {world} never finished (scenario {scenario})") from None
            output = process.output
            lines = [line for line in output.splitlines() if line.startswith("{")]
            assert lines, f"rank {rank} printed no result:\n{output[-3000:]}"
            results.append(json.loads(lines[-1]))
    finally:
        for process in processes:
            process.kill()
    return results


class Zygote:
    """The test side: start the zygote with `preload` imported, fork ranks from it, close it."""

    def __init__(self, preload: Sequence[str], env: Mapping[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(ZYGOTE), *preload],
            env=dict(env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.forked: list[ForkedRank] = []

    def spawn(self, script: Path, argv: Sequence[str], env: Mapping[str, str], log: Path) -> ForkedRank:
        assert self.process.stdin is not None and self.process.stdout is not None
        request = {"script": str(script), "argv": list(argv), "env": dict(env), "log": str(log)}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        reply = self.process.stdout.readline()
        if not reply:
            raise AssertionError(f"the rank zygote exited ({self.process.poll()}), forking no {script}")
        rank = ForkedRank(int(json.loads(reply)["pid"]), log)
        self.forked.append(rank)
        return rank

    def close(self) -> None:
        for rank in self.forked:
            rank.kill()
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


# The zygote itself -------------------------------------------------------------------------------------


def _run_child(request: dict[str, object]) -> None:
    """In the forked child: become `python SCRIPT ARGV` with the request's environment, then exit."""
    code = 1
    try:
        os.setsid()
        log = os.open(str(request["log"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(devnull)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        env = request["env"]
        assert isinstance(env, dict)
        os.environ.clear()
        os.environ.update(env)
        script = str(request["script"])
        argv = request["argv"]
        assert isinstance(argv, list)
        sys.argv = [script, *(str(a) for a in argv)]
        sys.path[0] = os.path.dirname(os.path.realpath(script))
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as done:
            if done.code is None or isinstance(done.code, int):
                code = done.code or 0
            else:
                print(done.code, file=sys.stderr)
    except BaseException:  # as an uncaught exception would end `python SCRIPT`: its traceback, exit 1
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reap(logs: dict[int, str], exited: Callable[[], Iterator[tuple[int, int]]]) -> None:
    for pid, code in exited():  # the product fork server's reap (exited_children): every ended child
        log = logs.pop(pid, None)
        if log is not None:
            Path(f"{log}.tmp").write_text(str(code))
            os.replace(f"{log}.tmp", f"{log}.exit")


def _serve() -> None:
    if sys.path and os.path.realpath(sys.path[0]) == str(ZYGOTE.parent):
        del sys.path[0]  # this file's folder, tests/: its tests/flodld would shadow the flodld package
    from flodld.launcher.forkserver import exited_children  # only now: the flodld package, not tests/flodld
    for entry in sys.argv[1:]:  # "module", or "module:function" to call once imported
        module, _, function = entry.partition(":")
        loaded = importlib.import_module(module)
        if function:
            getattr(loaded, function)()
    logs: dict[int, str] = {}
    stdin = sys.stdin.fileno()
    pending = b""
    while True:
        ready, _, _ = select.select([stdin], [], [], 0.02)
        _reap(logs, exited_children)
        if not ready:
            continue
        chunk = os.read(stdin, 1 << 16)
        if not chunk:
            break
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                _run_child(request)
            logs[pid] = str(request["log"])
            sys.stdout.write(json.dumps({"pid": pid}) + "\n")
            sys.stdout.flush()
    for pid in logs:  # the test side is gone: nothing it started outlives it
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


if __name__ == "__main__":
    _serve()
