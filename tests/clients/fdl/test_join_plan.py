"""`fdl join` flag resolution over the fdl.yml `join:` block, and the persist backoff schedule."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from fdl import join as join_command

from flodld import api
from tests.clients.fdl.join_args import parse, project

TOKEN = "0123456789abcdef0123456789abcdef"


def test_a_bare_fdl_join_takes_everything_from_the_join_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(join_command.TOKEN_ENV, raising=False)
    directory = project(
        tmp_path,
        (
            "join:\n  address: 10.1.2.3:4000\n"
            f"  token: {TOKEN}\n  program: {tmp_path / 'train.py'}\n"
            "  args: ['--epochs', '3']\n  host: box-7\n  devices: ['cpu:2']\n  persist: true\n"
        ),
    )
    plan = join_command.resolve_plan(parse("--project", str(directory)))
    # The agent is flodld's own process; the program is what it starts as each rank.
    assert plan.command == [sys.executable, "-m", "flodld.agent"]
    assert plan.spec.program == [sys.executable, str(tmp_path / "train.py"), "--epochs", "3"]
    assert (plan.spec.controller_host, plan.spec.controller_port) == ("10.1.2.3", 4000)
    assert plan.spec.salt_hex == TOKEN and plan.spec.host == "box-7" and plan.spec.devices == ["cpu:2"]
    assert plan.persist


def test_flags_win_over_the_block_and_an_empty_tail_clears_its_args(tmp_path: Path) -> None:
    directory = project(
        tmp_path,
        f"join:\n  address: 10.1.2.3:4000\n  program: {tmp_path / 'train.py'}\n"
        "  args: ['--epochs', '3']\n  devices: all\n",
    )
    args = parse("127.0.0.1:5555", "--project", str(directory), "--host", "me", "--devices", "cpu:3", "--")
    plan = join_command.resolve_plan(args)
    assert (plan.spec.controller_host, plan.spec.controller_port) == ("127.0.0.1", 5555)
    assert (
        plan.spec.program is not None
        and plan.spec.program[2:] == []
        and plan.spec.devices == ["cpu:3"]
        and plan.spec.host == "me"
    )
    assert not plan.persist


def test_token_from_stdin_and_bad_input_are_usage_errors(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    args = parse("--project", str(tmp_path), "--bin", str(tmp_path / "train.py"), "--token", "-")
    assert join_command.resolve_plan(args, stdin_token=TOKEN.upper() + "\n").spec.salt_hex == TOKEN
    with pytest.raises(join_command.UsageError, match="32 hex characters"):
        join_command.resolve_plan(parse("--project", str(tmp_path), "--bin", "x.py", "--token", "abc"))
    with pytest.raises(join_command.UsageError, match=r"pass --bin PROGRAM or set join\.program"):
        join_command.resolve_plan(parse("--project", str(tmp_path)))
    with pytest.raises(join_command.UsageError, match="not found"):
        join_command.resolve_plan(parse("--project", str(tmp_path), "--bin", str(tmp_path / "missing.py")))


def test_persist_backs_off_5_s_doubling_to_60_and_stops_on_a_permanent_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _persist_plan(tmp_path)
    codes = iter([1, 1, 1, 1, 1, 1, 1, 2])  # dials that never formed a world
    monkeypatch.setattr(join_command, "attempt", lambda _plan, *_: next(codes))
    _no_spare(monkeypatch)
    sleeps: list[float] = []
    assert join_command.join_loop(plan, sleep=sleeps.append, clock=lambda: 0.0) == 2
    assert sleeps == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0, 60.0]


def test_persist_back_off_resets_after_every_run_that_formed_done_or_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _persist_plan(tmp_path)
    # (exit code, whether the world formed): idle dials, a short run that formed and finished, idle dials,
    # a formed run that failed (exit 1), idle dials, then a permanent failure. Every attempt takes 0 s.
    attempts = iter([(1, False), (1, False), (1, False), (0, True), (1, False), (1, False), (1, True),
                     (1, False), (2, False)])  # fmt: skip
    marks: list[str] = []

    def attempt(marked: join_command.JoinPlan, *_: object) -> int:
        code, formed = next(attempts)
        assert marked.spec.formed_file is not None and marked.spec.host == plan.spec.host
        marks.append(marked.spec.formed_file)
        if formed:  # what the agent does once its world has formed
            Path(marked.spec.formed_file).write_text("run-1\n")
        return code

    monkeypatch.setattr(join_command, "attempt", attempt)
    _no_spare(monkeypatch)
    sleeps: list[float] = []
    assert join_command.join_loop(plan, sleep=sleeps.append, clock=lambda: 0.0) == 2
    # After the formed run that failed (exit 1: it ended for this host, maybe not for the run): at once.
    assert sleeps == [5.0, 10.0, 20.0, 5.0, 10.0, 20.0, 0.1, 0.2]
    assert len(set(marks)) == 1 and not Path(marks[0]).exists()  # one mark, gone with the loop


class _IdleAgent:
    """A spare agent for loops whose attempts are scripted: it waits, and is stopped with the loop."""

    def poll(self) -> int | None:
        return None

    def kill(self) -> None:
        pass

    def wait(self) -> int:
        return -9


def _no_spare(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spare agents (started ahead of each next attempt) cost nothing where the attempts are scripted."""
    monkeypatch.setattr(join_command, "start_agent", lambda _plan: _IdleAgent())


def _persist_plan(tmp_path: Path, *flags: str) -> join_command.JoinPlan:
    """`fdl join --persist` of an empty train.py in `tmp_path`, with `flags`."""
    (tmp_path / "train.py").write_text("")
    return join_command.resolve_plan(
        parse("--project", str(tmp_path), "--bin", str(tmp_path / "train.py"), "--persist", *flags)
    )


def _unscaled_persist_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> join_command.JoinPlan:
    """A --persist plan whose back-off is in plain seconds (no FLODL_NET_TIMEOUT_SCALE)."""
    monkeypatch.delenv("FLODL_NET_TIMEOUT_SCALE", raising=False)
    return _persist_plan(tmp_path)


def _clocked_loop(
    plan: join_command.JoinPlan,
    monkeypatch: pytest.MonkeyPatch,
    attempts: list[tuple[int, str | None, float]],
) -> list[float]:
    """Run the persist loop over `attempts` (exit code, what the agent writes to its mark file or None,
    seconds it lasted) on an injected clock that the attempts and the back-off advance; the back-offs slept.
    The last attempt must end the loop (exit 2).
    """
    remaining = iter(attempts)
    now = [1000.0]

    def attempt(marked: join_command.JoinPlan, *_: object) -> int:
        code, mark, lasted = next(remaining)
        assert marked.spec.formed_file is not None
        if mark is not None:  # what the agent does once its world has formed (and, marked, left it)
            Path(marked.spec.formed_file).write_text(mark)
        now[0] += lasted
        return code

    monkeypatch.setattr(join_command, "attempt", attempt)
    _no_spare(monkeypatch)
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        now[0] += seconds

    assert join_command.join_loop(plan, sleep=sleep, clock=lambda: now[0]) == 2
    return sleeps


def test_persist_back_off_resets_after_a_run_that_lasted_more_than_2_minutes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _unscaled_persist_plan(tmp_path, monkeypatch)
    # (exit code, seconds the attempt lasted): three quick failures, a 121 s run, a quick failure, a 120 s
    # run (not more than 2 minutes: no reset), then a permanent failure.
    attempts = [(1, 0.0), (1, 1.0), (1, 2.0), (0, 121.0), (1, 1.0), (0, 120.0), (2, 0.0)]
    sleeps = _clocked_loop(plan, monkeypatch, [(code, None, lasted) for code, lasted in attempts])
    assert sleeps == [5.0, 10.0, 20.0, 5.0, 10.0, 20.0]


def test_persist_dials_again_at_once_after_a_formed_run_ended_for_this_host_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _unscaled_persist_plan(tmp_path, monkeypatch)
    formed, left = "run-1\n", f"run-1\n{api.LEFT_RUN_MARK}\n"
    # (exit code, mark, seconds): a 30 s run this host left with exit 1 (its agent killed, its link lost),
    # two failed dials, a formed 30 s run that finished (exit 0: the usual 5 s), a 20 s run whose agent
    # lost every rank (exit 0, marked), then four formed runs lost one after another, then a permanent
    # failure.
    sleeps = _clocked_loop(plan, monkeypatch, [
        (1, formed, 30.0), (1, None, 0.0), (1, None, 0.0), (0, formed, 30.0), (0, left, 20.0),
        (1, formed, 3.0), (1, formed, 3.0), (1, formed, 3.0), (1, formed, 3.0), (2, None, 0.0),
    ])  # fmt: skip
    # At once after the loss, doubling from there; 5 s after the finished run; at once after the host left
    # its run and after the next two losses (the first quick re-dial is over a minute old by then); the
    # fourth and fifth quick ones within a minute are refused: the usual 5 s after a formed run.
    assert sleeps == [0.1, 0.2, 0.4, 5.0, 0.1, 0.1, 0.1, 5.0, 5.0]


@pytest.mark.parametrize(
    ("block", "flags", "kept"),
    [
        ("  persist: true\n", [], True),
        ("  persist: true\n", ["--no-fork-server"], False),
        ("  persist: true\n  fork_server: false\n", [], False),
        ("", [], False),  # one attempt: nothing to fork twice
        ("", ["--persist"], True),
    ],
)
def test_a_persist_loop_keeps_a_fork_server_unless_told_not_to(
    tmp_path: Path, block: str, flags: list[str], kept: bool
) -> None:
    directory = project(tmp_path, f"join:\n  program: {tmp_path / 'train.py'}\n  devices: ['cpu:2']\n{block}")
    assert join_command.resolve_plan(parse("--project", str(directory), *flags)).fork_server is kept


def test_the_loops_agents_are_told_its_fork_server_which_ends_with_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _persist_plan(tmp_path, "--devices", "cpu:2")
    seen: list[str | None] = []

    def attempt(marked: join_command.JoinPlan, *_: object) -> int:
        seen.append(marked.fork_server_path)
        assert marked.fork_server_path is not None and Path(marked.fork_server_path).is_socket()
        return 2 if len(seen) == 2 else 1

    monkeypatch.setattr(join_command, "attempt", attempt)
    _no_spare(monkeypatch)
    assert join_command.join_loop(plan, sleep=lambda _: None, clock=lambda: 0.0) == 2
    assert len(seen) == 2 and seen[0] == seen[1]  # one server for every attempt of the loop
    assert seen[0] is not None and not Path(seen[0]).exists()  # gone with the loop


def test_an_attempt_hands_the_fork_server_to_its_agent_in_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _persist_plan(tmp_path)
    script = "import os, sys; sys.exit(3 if os.environ.get('FLODL_FORK_SERVER') == '/run/fs' else 4)"
    from dataclasses import replace

    marked = replace(plan, command=[sys.executable, "-c", script], fork_server_path="/run/fs")
    assert join_command.attempt(marked) == 3


# A stand-in agent (a real process): it notes its start, takes its spec from stdin as an agent does, notes
# that; the first one marks its world formed and stays until the loop has started the next attempt's agent.
STANDIN_AGENT = """
import json, os, sys, time
log = sys.argv[1]
def note(word):
    with open(log, "a") as file:
        file.write(f"{os.getpid()} {word}\\n")
def count(word):
    with open(log) as file:
        return sum(line.split()[1] == word for line in file)
note("started " + os.environ[sys.argv[2]])
spec = json.loads(bytes.fromhex(sys.stdin.readline().strip()))
note("spec " + spec["host"] + (" token-in-env" if sys.argv[3] in os.environ else ""))
if count("spec") == 1:
    open(spec["formed_file"], "w").write("run-1\\n")
    deadline = time.monotonic() + 20
    while count("started") < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    sys.exit(1)
sys.exit(2)
"""


def _standin_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[join_command.JoinPlan, Path]:
    from dataclasses import replace

    monkeypatch.setenv(join_command.TOKEN_ENV, TOKEN)  # never handed on to an agent's environment
    log = tmp_path / "agents.log"
    script = tmp_path / "standin.py"
    script.write_text(STANDIN_AGENT)
    plan = _unscaled_persist_plan(tmp_path, monkeypatch)
    command = [sys.executable, str(script), str(log), api.AGENT_ENV, join_command.TOKEN_ENV]
    return replace(plan, command=command, fork_server=False), log


def _notes(log: Path) -> list[tuple[int, str]]:
    return [(int(pid), rest) for pid, rest in (line.split(" ", 1) for line in log.read_text().splitlines())]


def test_a_persist_loop_starts_the_next_attempts_agent_while_a_run_trains_and_hands_it_the_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan, log = _standin_plan(tmp_path, monkeypatch)
    started_by_sleep: list[int] = []

    def sleep(seconds: float) -> None:
        started_by_sleep.append(sum(rest.startswith("started") for _, rest in _notes(log)))

    assert join_command.join_loop(plan, sleep=sleep, clock=time.monotonic) == 2
    notes = _notes(log)
    first, second = notes[0][0], notes[2][0]
    # The second agent started while the first one's run trained (after its world formed), waited for
    # its spec on stdin through the back-off, and dialed with it; neither saw the token in its environment.
    assert notes == [
        (first, f"started {api.SPEC_ON_STDIN}"), (first, f"spec {plan.spec.host}"),
        (second, f"started {api.SPEC_ON_STDIN}"), (second, f"spec {plan.spec.host}"),
    ]  # fmt: skip
    assert first != second and started_by_sleep == [2]


def test_a_persist_loop_stopped_during_its_back_off_stops_its_spare_agent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan, log = _standin_plan(tmp_path, monkeypatch)
    spares: list[int] = []

    def sleep(seconds: float) -> None:  # SIGTERM arrives during the back-off
        spares.extend(pid for pid, rest in _notes(log)[2:] if rest.startswith("started"))
        raise join_command.Stopped(signal.SIGTERM)

    with pytest.raises(join_command.Stopped):
        join_command.join_loop(plan, sleep=sleep, clock=time.monotonic)
    assert len(spares) == 1
    with pytest.raises(ProcessLookupError):  # killed and reaped: no agent outlives its loop
        os.kill(spares[0], 0)
    assert [rest for _, rest in _notes(log)].count(f"spec {plan.spec.host}") == 1  # the spare never dialed
