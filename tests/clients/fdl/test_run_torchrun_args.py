"""`fdl run` takes a torchrun command line (issue 30, goal 3): every word after PROGRAM is PROGRAM's, and
torchrun's own flags are accepted where they map (-m, --no-python, --run-path, --standalone, --nnodes that
allows one host, --max-restarts N, --rdzv-conf join_timeout, --rdzv-endpoint / --master-addr with
--node-rank >= 1 as a walk-in) or refused naming the flodld equivalent. `run_job` and the walk-in loop are
replaced by recorders: these tests check what would start, not a run (tests/e2e/test_fdl_run.py runs one).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from fdl import join as join_command
from fdl import run as run_command
from fdl.main import main as fdl_main


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
    """What `fdl run` would start on the embedded default: run_job's arguments, one dict per call."""
    calls: list[dict[str, Any]] = []

    async def run_job(command: list[str], cluster: object, **options: object) -> int:
        calls.append({"command": command, "cluster": cluster, **options})
        return 0

    monkeypatch.setattr(run_command, "run_job", run_job)
    return calls


def test_every_word_after_the_program_is_the_programs(program: Path, started: list[dict[str, Any]]) -> None:
    words = ["1", "5", "--batch_size", "4", "--port", "29999", "--ranks", "1", "--env", "prod", "--"]
    assert fdl_main(["run", "--nproc-per-node", "2", str(program), *words]) == 0
    (call,) = started
    assert call["command"] == [sys.executable, str(program), *words]
    assert call["port"] is None  # fdl's port and world are untouched by the program's --port/--ranks
    assert [worker.local_devices for worker in call["cluster"].workers] == [("cpu:2",)]


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        (["-m", "pkg.train", "--lr", "1"], [sys.executable, "-m", "pkg.train", "--lr", "1"]),
        (["--module", "pkg.train"], [sys.executable, "-m", "pkg.train"]),
        (["--run-path", "{p}", "-x"], [sys.executable, "{p}", "-x"]),
        (["--no-python", "{p}", "-x"], ["{p}", "-x"]),
        (["{p}", "--", "--average"], [sys.executable, "{p}", "--average"]),  # the older `PROGRAM -- ARGS`
        (["--", "{p}", "--ranks", "3"], [sys.executable, "{p}", "--ranks", "3"]),
        (["{p}", "--", "--", "x"], [sys.executable, "{p}", "--", "x"]),
    ],
)  # fmt: skip
def test_torchruns_program_flags(
    program: Path, started: list[dict[str, Any]], words: list[str], expected: list[str]
) -> None:
    def fill(items: list[str]) -> list[str]:
        return [item.replace("{p}", str(program)) for item in items]

    assert fdl_main(["run", *fill(words)]) == 0
    assert started[0]["command"] == fill(expected)


@pytest.mark.parametrize(
    "words",
    [
        ["--standalone"],
        ["--nnodes", "1"],
        ["--nnodes=1:1"],
        ["--max-restarts", "0"],
        ["--max_restarts=0", "--nproc_per_node=2"],
        ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--rdzv-id", "job1"],
        ["--master-addr", "127.0.0.1", "--master-port", "29501", "--node-rank", "0"],
        ["--monitor-interval", "0.1", "--start-method", "spawn"],
    ],
)
def test_torchrun_flags_that_map_are_accepted_on_the_embedded_default(
    program: Path, started: list[dict[str, Any]], words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert fdl_main(["run", *words, str(program), "--epochs", "1"]) == 0, capsys.readouterr().err
    assert started[0]["command"] == [sys.executable, str(program), "--epochs", "1"]


def test_local_ranks_filter_reaches_the_run(program: Path, started: list[dict[str, Any]]) -> None:
    assert fdl_main(["run", "--local-ranks-filter", "0,2", "--nproc-per-node", "3", str(program)]) == 0
    assert started[0]["rank_filter"] == frozenset({0, 2})


DISCOVERY_BLOCK = (
    "cluster:\n  controller:\n    host: 127.0.0.1\n    port: 29400\n"
    "    join: {discovery: true, token: " + "cd" * 16 + "}\n"
    "  workers:\n    - {host: 127.0.0.1, local_devices: [cpu, cpu]}\n"
)


def test_nnodes_min_max_with_a_cluster_block_sets_the_windows_quorum_and_target(
    program: Path, started: list[dict[str, Any]]
) -> None:
    (program.parent / "fdl.yml").write_text(DISCOVERY_BLOCK)
    assert fdl_main(["run", "--nnodes", "2:4", "--nproc-per-node", "2", str(program), "--nnodes", "9"]) == 0
    (call,) = started
    join = call["cluster"].controller.join
    assert (join.min_rank_start, join.target_ranks) == (4, 8)  # hosts x ranks per host
    assert join.elastic_max_ranks is None  # no tolerance: not an elastic run, no growth
    assert call["command"] == [sys.executable, str(program), "--nnodes", "9"]


def test_nnodes_max_bounds_growth_in_an_elastic_cpu_averaging_run(
    program: Path, started: list[dict[str, Any]]
) -> None:
    """With a tolerance and a CPU averaging mode, MAX also bounds walk-ins during training
    (elastic_max_ranks); without a tolerance it sizes the window only (the test above: it stays unset).
    """
    elastic = DISCOVERY_BLOCK.replace("    join:", "    averaging: cpu_sync\n    tolerance: 1\n    join:")
    (program.parent / "fdl.yml").write_text(elastic)
    assert fdl_main(["run", "--nnodes", "2:4", "--nproc-per-node", "2", str(program)]) == 0
    (call,) = started
    join = call["cluster"].controller.join
    assert (join.min_rank_start, join.target_ranks, join.elastic_max_ranks) == (4, 8, 8)


def test_nnodes_over_one_host_with_a_cluster_block_needs_the_ranks_per_host(
    program: Path, started: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    (program.parent / "fdl.yml").write_text(DISCOVERY_BLOCK)
    assert fdl_main(["run", "--nnodes", "2:4", str(program)]) == 2
    assert "give --nproc-per-node N (ranks per host, a number)" in capsys.readouterr().err
    assert not started


def test_max_restarts_reaches_the_run_supervisor(program: Path, started: list[dict[str, Any]]) -> None:
    assert fdl_main(["run", "--max-restarts", "3", str(program)]) == 0
    assert started[0]["max_restarts"] == 3


def test_rdzv_conf_join_timeout_sets_the_join_window(program: Path, started: list[dict[str, Any]]) -> None:
    assert fdl_main(["run", "--rdzv-conf", "join_timeout=42", str(program)]) == 0
    assert started[0]["join_timeout"] == 42.0


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (["--max-restarts", "1001"], "--max-restarts 1001: give a count from 0 to 1000"),
        (["--max-restarts", "2", "--rdzv-endpoint", "10.0.0.1:1337"], "whose restarts are that controller's"),
        (["--nnodes", "2"], "give fdl.yml a cluster: block (controller.join.discovery and a token)"),
        (["--nnodes", "1:4"], "`fdl join HOST:PORT --bin PROGRAM`"),
        (["--nnodes", "x"], "--nnodes 'x' is not understood"),
        (["--rdzv-backend", "etcd"], "the rendezvous is flodld's controller"),
        (["--rdzv-conf", "last_call_timeout=5"], "fdl run takes only join_timeout=SECONDS"),
        (["--start-method", "fork"], "every rank is a fresh process"),
        (["-r", "4"], "--redirects '4' is not understood: give 0 (none), 1 (stdout), 2 (stderr) or 3"),
        (["--tee", "0-3"], "--tee '0-3' is not understood"),
        (["--local-ranks-filter", "0-1"], "'0-1': give rank numbers separated by commas"),
        (["--role", "trainer"], "FLODL_HOST_NAME"),
        (["--local-addr", "10.0.0.1"], "FLODL_HOST_NAME"),
        (["--node-rank", "1"], "give the controller's address (--master-addr or --rdzv-endpoint)"),
        (["-m", "--no-python"], "-m and --no-python exclude each other"),
    ],
)  # fmt: skip
def test_torchrun_flags_that_do_not_map_are_refused_naming_the_equivalent(
    program: Path,
    started: list[dict[str, Any]],
    words: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert fdl_main(["run", *words, str(program)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("fdl run: ") and message in error, error
    assert not started


@pytest.mark.parametrize(
    ("words", "address"),
    [
        (["--rdzv-endpoint", "10.0.0.5:4000"], ("10.0.0.5", 4000)),
        (["--rdzv_endpoint=ctl.example"], ("ctl.example", 1337)),
        (["--master-addr", "10.0.0.5", "--master-port", "5000", "--node-rank", "1", "--nnodes", "2"],
         ("10.0.0.5", 5000)),
    ],
)  # fmt: skip
def test_an_rdzv_endpoint_walks_in_to_that_controller_as_fdl_join(
    program: Path, monkeypatch: pytest.MonkeyPatch, words: list[str], address: tuple[str, int]
) -> None:
    plans: list[join_command.JoinPlan] = []
    def join_loop(plan: join_command.JoinPlan) -> int:
        plans.append(plan)
        return 0

    monkeypatch.setattr(join_command, "join_loop", join_loop)
    monkeypatch.setenv("FDL_JOIN_TOKEN", "ab" * 16)
    assert fdl_main(["run", "--nproc-per-node", "2", *words, "-m", "pkg.train", "--port", "1"]) == 0
    (plan,) = plans
    assert (plan.spec.controller_host, plan.spec.controller_port) == address
    assert plan.spec.program == [sys.executable, "-m", "pkg.train", "--port", "1"]
    assert plan.spec.devices == ["cpu:2"] and plan.spec.salt_hex == "ab" * 16


def test_help_lists_torchruns_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        fdl_main(["run", "--help"])
    text = capsys.readouterr().out
    assert "PROGRAM [ARGS...]" in text and "--rdzv-endpoint HOST:PORT" in text and "--max-restarts N" in text
