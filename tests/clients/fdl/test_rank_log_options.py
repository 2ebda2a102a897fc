"""`--log-dir`, `-r/--redirects`, `-t/--tee` on `fdl run` and `fdl join` (issue 33, point 2): torchrun's
syntax, fdl.yml's `logs:` block under the flags, the directory made (0700) and checked before anything
starts. run_job and the walk-in loop are recorders here; tests/e2e/test_rank_logs.py runs the real thing.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest
from fdl import join as join_command
from fdl import run as run_command
from fdl.main import main as fdl_main

from flodld import api
from tests.clients.fdl.join_args import parse, project


@pytest.fixture
def program(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # no fdl.yml here: the embedded default
    for name in ("FDL_ENV", "FDL_JOIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "train.py"
    path.write_text("raise SystemExit('must not run')\n")
    return path


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []

    async def run_job(command: list[str], cluster: object, **options: object) -> int:
        calls.append({"command": command, "cluster": cluster, **options})
        return 0

    monkeypatch.setattr(run_command, "run_job", run_job)
    return calls


@pytest.mark.parametrize(
    ("words", "redirects", "tee"),
    [
        (["--redirects", "3"], "3", "0"),
        (["-r", "3"], "3", "0"),
        (["-r3"], "3", "0"),  # argparse's attached short value: PROGRAM is still found after it
        (["--tee=3"], "0", "3"),
        (["-t", "0:3,1:2"], "0", "0:3,1:2"),
        (["--redirects", "0:1", "--tee", "1:2"], "0:1", "1:2"),
        (["--log_dir", "{d}", "--redirects", "1"], "1", "0"),  # torchrun's underscore spelling
    ],
)
def test_run_passes_the_log_spec_to_the_agents(
    program: Path, started: list[dict[str, Any]], tmp_path: Path, words: list[str], redirects: str, tee: str
) -> None:
    logs = tmp_path / "logs" / "deep"
    words = [word.replace("{d}", str(logs)) for word in words]
    if "--log_dir" not in words:
        words = ["--log-dir", str(logs), *words]
    assert fdl_main(["run", "--nproc-per-node", "2", *words, str(program), "-r", "9"]) == 0
    (call,) = started
    assert call["logs"] == api.RankLogSpec(dir=str(logs), redirects=redirects, tee=tee)
    assert call["command"][-2:] == ["-r", "9"]  # after PROGRAM, -r is the program's
    assert stat.S_IMODE(logs.stat().st_mode) == 0o700 and stat.S_IMODE(logs.parent.stat().st_mode) == 0o700


def test_run_without_log_flags_writes_nothing(program: Path, started: list[dict[str, Any]]) -> None:
    assert fdl_main(["run", str(program)]) == 0
    assert started[0]["logs"] is None


def test_log_dir_alone_writes_no_file_and_says_so(
    program: Path, started: list[dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert fdl_main(["run", "--log-dir", str(tmp_path / "l"), str(program)]) == 0
    assert started[0]["logs"] is None
    assert (
        "without --redirects/--tee writes no rank file (as torchrun): add --tee 3" in capsys.readouterr().err
    )


def test_tee_without_a_log_dir_goes_to_a_new_temporary_directory_it_names(
    program: Path, started: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert fdl_main(["run", "--tee", "3", str(program)]) == 0
    logs = started[0]["logs"]
    assert logs is not None and Path(logs.dir).is_dir() and Path(logs.dir).name.startswith("fdl-logs-")
    assert f"rank logs go to the new directory {logs.dir}" in capsys.readouterr().err
    Path(logs.dir).rmdir()


def test_the_logs_block_of_fdl_yml_applies_under_the_flags(
    program: Path, started: list[dict[str, Any]], tmp_path: Path
) -> None:
    (tmp_path / "fdl.yml").write_text(f"logs:\n  dir: {tmp_path / 'cfg'}\n  tee: 3\n  max_file_mb: 2\n")
    assert fdl_main(["run", str(program)]) == 0
    assert fdl_main(["run", "--redirects", "2", "--tee", "1", str(program)]) == 0
    assert [call["logs"] for call in started] == [
        api.RankLogSpec(dir=str(tmp_path / "cfg"), tee="3", max_file_bytes=2 << 20),
        api.RankLogSpec(dir=str(tmp_path / "cfg"), redirects="2", tee="1", max_file_bytes=2 << 20),
    ]


def test_a_log_dir_that_cannot_be_made_is_refused_before_anything_starts(
    program: Path, started: list[dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert fdl_main(["run", "--log-dir", str(blocker / "logs"), "--redirects", "3", str(program)]) == 2
    assert f"log directory {blocker / 'logs'} cannot be created" in capsys.readouterr().err
    assert not started


def test_join_takes_the_same_flags_and_its_own_logs_block(tmp_path: Path) -> None:
    directory = project(
        tmp_path, f"join:\n  program: {tmp_path / 'train.py'}\nlogs:\n  dir: {tmp_path / 'cfg'}\n"
    )
    plan = join_command.resolve_plan(parse("--project", str(directory), "-t", "0:1,1:3"))
    assert plan.spec.logs == api.RankLogSpec(dir=str(tmp_path / "cfg"), tee="0:1,1:3")
    plan = join_command.resolve_plan(
        parse("--project", str(directory), "--log-dir", str(tmp_path / "x"), "-r", "3")
    )
    assert plan.spec.logs == api.RankLogSpec(dir=str(tmp_path / "x"), redirects="3")
    assert join_command.resolve_plan(parse("--project", str(directory))).spec.logs is None
    with pytest.raises(join_command.UsageError, match=r"--redirects '0:7' is not understood"):
        join_command.resolve_plan(parse("--project", str(directory), "-r", "0:7"))


def test_a_torchrun_walk_in_writes_its_logs_on_its_own_side(
    program: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plans: list[join_command.JoinPlan] = []

    def join_loop(plan: join_command.JoinPlan) -> int:
        plans.append(plan)
        return 0

    monkeypatch.setattr(join_command, "join_loop", join_loop)
    monkeypatch.setenv("FDL_JOIN_TOKEN", "ab" * 16)
    words = ["--rdzv-endpoint", "10.0.0.5:4000", "--log-dir", str(tmp_path / "w"), "--tee", "3"]
    assert fdl_main(["run", "--nproc-per-node", "2", *words, str(program)]) == 0
    (plan,) = plans
    assert plan.spec.logs == api.RankLogSpec(dir=str(tmp_path / "w"), tee="3")
