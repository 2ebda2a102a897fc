"""`fdl run --devices / --nproc-per-node / --ranks`: the embedded default's ranks on this host.

The choice is resolved by `choose_local_ranks` for a given GPU count (so a CPU machine checks the GPU
defaults too), by the real `fdl` entry point for exit codes and messages, and by real runs: CPU ranks
here, one rank per GPU over NCCL where a GPU is present (`gpu` marker; FLODLD_REQUIRE_GPU=1 fails
instead of skipping).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import pytest
from fdl import join as join_command
from fdl import run as run_command
from fdl import runplan
from fdl.main import main as fdl_main
from fdl.runplan import LocalRanks, choose_local_ranks, embedded_cluster

from flodld.agent.spec import DeviceError
from flodld.config import load_text
from flodld.controller.options import ControllerOptions
from tests.conftest import cuda_device_count
from tests.e2e.harness import EXAMPLES, Fdl, child_env

HERE = Path(__file__).resolve().parent
CLUSTER_BLOCK = (
    "cluster:\n  controller: {host: 127.0.0.1, port: 0}\n"
    "  workers:\n    - {host: 127.0.0.1, local_devices: [cpu]}\n"
)


def cpus(count: int) -> tuple[str, ...]:
    return tuple(f"cpu:{index}" for index in range(count))


def gpus(*indices: int) -> tuple[str, ...]:
    return tuple(f"cuda:{index}" for index in indices)


# --- the default -----------------------------------------------------------------------------------


def test_the_default_uses_every_gpu_over_nccl_when_the_host_has_one() -> None:
    local = choose_local_ranks(cuda_count=4)
    assert local.devices == gpus(0, 1, 2, 3) and local.backend == "nccl"
    assert (
        local.describe()
        == "4 GPU rank(s) on cuda:0, cuda:1, cuda:2, cuda:3, backend nccl (every GPU on this host)"
    )
    cluster = embedded_cluster(local)
    assert cluster.controller.backend.value == "nccl" and cluster.controller.host == "127.0.0.1"
    assert cluster.capacity() == 4
    assert cluster.workers[0].device_labels() == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]


def test_the_default_without_a_gpu_is_two_cpu_ranks_over_gloo() -> None:
    local = choose_local_ranks(cuda_count=0)
    assert local.devices == cpus(2) and local.backend == "gloo" and local.entries == ["cpu:2"]
    assert "2 CPU rank(s), backend gloo (no GPU on this host" in local.describe()
    cluster = embedded_cluster(local)
    assert cluster.controller.backend.value == "gloo" and cluster.capacity() == 2


def test_ranks_asks_for_cpu_ranks_even_on_a_gpu_host_and_the_line_names_the_gpus() -> None:
    local = choose_local_ranks(ranks=3, cuda_count=2)
    assert local.devices == cpus(3) and local.backend == "gloo"
    assert "this host has 2 GPU(s): --nproc-per-node gpu" in local.describe()


# --- --devices: the parser of `fdl join --devices` -------------------------------------------------


@pytest.mark.parametrize(("spec", "cuda_count", "devices", "backend"), [
    ("all", 2, gpus(0, 1), "nccl"),
    ("0,2", 4, gpus(0, 2), "nccl"),
    ("cuda:1", 2, gpus(1), "nccl"),
    ("cpu:3", 2, cpus(3), "gloo"),
    ("cpu,cpu", 0, cpus(2), "gloo"),
    ("all", 0, cpus(2), "gloo"),  # as `fdl join --devices all`: CPU ranks on a host without GPU
    ("cuda:1,cpu", 2, ("cuda:1", "cpu:0"), "gloo"),  # any CPU rank: gloo
])  # fmt: skip
def test_devices_takes_the_join_syntax(
    spec: str, cuda_count: int, devices: tuple[str, ...], backend: str
) -> None:
    local = choose_local_ranks(devices=spec, cuda_count=cuda_count)
    assert (local.devices, local.backend) == (devices, backend)
    assert local.reason == f"from --devices {spec}"
    embedded_cluster(local)  # a valid cluster: nccl only where every rank has a GPU


def test_devices_all_without_a_gpu_takes_its_count_from_ranks() -> None:
    assert choose_local_ranks(devices="all", ranks=3, cuda_count=0).devices == cpus(3)


def test_mixed_devices_become_one_worker_entry_list_the_agent_resolves_back() -> None:
    local = choose_local_ranks(devices="cpu,1,cpu", cuda_count=2)
    assert local.entries == ["cuda:1", "cpu:2"]
    assert sorted(embedded_cluster(local).workers[0].device_labels() or []) == ["cpu:0", "cpu:1", "cuda:1"]


def test_run_and_join_refuse_a_bad_device_list_with_the_same_message(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    parser = argparse.ArgumentParser()
    join_command.configure_parser(parser)
    args = parser.parse_args(
        ["--project", str(tmp_path), "--bin", str(tmp_path / "train.py"), "--devices", " , "]
    )
    args.controller, args.program_args = "127.0.0.1:1", None
    with pytest.raises(join_command.UsageError) as joined:
        join_command.resolve_plan(args)
    with pytest.raises(DeviceError) as ran:
        choose_local_ranks(devices=" , ", cuda_count=0)
    assert str(joined.value) == str(ran.value) and "names no device" in str(ran.value)


# --- --nproc-per-node: torchrun's spelling ---------------------------------------------------------


@pytest.mark.parametrize(("value", "cuda_count", "devices"), [
    ("gpu", 2, gpus(0, 1)),
    ("GPU", 1, gpus(0)),
    ("3", 4, gpus(0, 1, 2)),  # the first N GPUs
    ("3", 0, cpus(3)),  # N CPU ranks on a host without GPU
    ("cpu", 4, cpus(os.cpu_count() or 1)),  # torchrun's meaning: one per core
])  # fmt: skip
def test_nproc_per_node_takes_torchruns_values(value: str, cuda_count: int, devices: tuple[str, ...]) -> None:
    assert choose_local_ranks(nproc_per_node=value, cuda_count=cuda_count).devices == devices


@pytest.mark.parametrize(("kwargs", "cuda_count"), [
    ({"devices": "all", "nproc_per_node": "gpu"}, 2),
    ({"devices": "0,1", "nproc_per_node": "2"}, 2),
    ({"devices": "1,0", "nproc_per_node": "gpu"}, 2),
    ({"devices": "cpu:3", "ranks": 3}, 2),
    ({"nproc_per_node": "2", "ranks": 2}, 0),
    ({"devices": "all", "nproc_per_node": "3", "ranks": 3}, 0),
])  # fmt: skip
def test_flags_that_agree_are_accepted_and_named(kwargs: dict[str, object], cuda_count: int) -> None:
    local = choose_local_ranks(cuda_count=cuda_count, **kwargs)  # type: ignore[arg-type]  # table of flags
    assert local.reason.startswith("from --") and local.reason.count(" and ") == len(kwargs) - 1


@pytest.mark.parametrize(("kwargs", "cuda_count", "message"), [
    ({"nproc_per_node": "gpu"}, 0, "--nproc-per-node gpu: this host has no CUDA device"),
    ({"nproc_per_node": "5"}, 4, "--nproc-per-node 5: this host has 4 CUDA device(s)"),
    ({"nproc_per_node": "banana"}, 0, "--nproc-per-node 'banana' is not understood"),
    ({"nproc_per_node": "0"}, 0, "ask for at least 1 rank"),
    ({"ranks": 0}, 0, "--ranks 0 asks for 0 CPU ranks"),
    ({"devices": "cuda:0"}, 0, "this host has 0 CUDA device(s)"),
    ({"devices": "0,0"}, 2, "listed more than once"),
    ({"devices": "cpu:x"}, 0, "'cpu:x' is not understood"),
    ({"nproc_per_node": "2", "ranks": 3}, 0,
     "--nproc-per-node 2 asks for 2 CPU rank(s) but --ranks 3 asks for 3 CPU rank(s)"),
    ({"devices": "all", "ranks": 2}, 2,
     "--devices all asks for 2 GPU rank(s) on cuda:0, cuda:1 but --ranks 2 asks for 2 CPU rank(s)"),
    ({"devices": "0", "nproc_per_node": "gpu"}, 2, "--devices 0 asks for 1 GPU rank(s) on cuda:0 but"),
])  # fmt: skip
def test_bad_or_contradictory_flags_are_refused(
    kwargs: dict[str, object], cuda_count: int, message: str
) -> None:
    with pytest.raises(ValueError) as refused:
        choose_local_ranks(cuda_count=cuda_count, **kwargs)  # type: ignore[arg-type]  # table of flags
    assert message in str(refused.value)


# --- the command line: exit 2 and the message, before anything starts -------------------------------


@pytest.fixture
def program(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # no fdl.yml here: the embedded default
    monkeypatch.delenv("FDL_ENV", raising=False)
    path = tmp_path / "train.py"
    path.write_text("raise SystemExit('must not run')\n")
    return path


@pytest.mark.parametrize(("words", "message"), [
    (
        ["--devices", "cpu:3", "--ranks", "2"],
        "they are spellings of the same choice: give one, or make them agree",
    ),
    (["--nproc_per_node", "many"], "--nproc-per-node 'many' is not understood"),
    (["--devices", ","], "--devices ',' names no device"),
])  # fmt: skip
def test_fdl_run_exits_2_on_bad_rank_flags(
    program: Path, words: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert fdl_main(["run", *words, str(program)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("fdl run: ") and message in error and "starting" not in error


def test_rank_flags_after_the_program_are_the_programs(
    program: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # As under torchrun (issue 30): `--ranks 2 --nproc-per-node 3` after PROGRAM are PROGRAM's, not a
    # contradiction of fdl's; the run starts (here: run_job is replaced by a recorder).
    commands: list[list[str]] = []

    async def run_job(command: list[str], cluster: object, **options: object) -> int:
        commands.append(command)
        return 0

    monkeypatch.setattr(run_command, "run_job", run_job)
    words = ["--ranks", "2", "--nproc-per-node", "3", "--", "--epochs", "1"]
    assert fdl_main(["run", str(program), *words]) == 0
    assert commands == [[sys.executable, str(program), *words]]


def test_rank_flags_next_to_a_cluster_block_are_refused(
    program: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (program.parent / "fdl.yml").write_text(CLUSTER_BLOCK)
    assert fdl_main(["run", "--nproc-per-node", "1", str(program)]) == 2
    assert "--nproc-per-node only size the embedded default; this project's fdl.yml has a cluster: block" in (
        capsys.readouterr().err
    )


def test_help_shows_the_torchrun_alias(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        fdl_main(["run", "--help"])
    text = capsys.readouterr().out
    assert "--nproc-per-node N|gpu|cpu" in text and "--devices SPEC" in text


def test_gpu_asked_on_a_host_without_one_exits_2_naming_the_fix(program: Path) -> None:
    run = Fdl("run", "--nproc-per-node", "gpu", str(program), cwd=program.parent,
              env=child_env(CUDA_VISIBLE_DEVICES=""))  # fmt: skip
    assert run.wait(60) == 2, run.output
    assert "fdl run: --nproc-per-node gpu: this host has no CUDA device; use --nproc-per-node N" in run.output


# --- fdl probe: what fdl run would start --------------------------------------------------------------


def test_probe_reports_what_fdl_run_would_start(program: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert fdl_main(["probe", "--json", "--ranks", "3"]) == 0
    host = json.loads(capsys.readouterr().out)["hosts"][0]
    assert (
        host["facts"]["fdl_run"]
        == runplan.plan_run(
            argparse.Namespace(ranks=3, devices=None, nproc_per_node=None, project=".")
        )[1]
    )
    assert host["facts"]["fdl_run"].startswith(
        "the embedded default: 3 CPU rank(s), backend gloo (from --ranks 3"
    )
    assert fdl_main(["probe", "-v"]) == 0
    expected = LocalRanks.describe(choose_local_ranks())
    assert (
        f"[ok  ] fdl_run: `fdl run` would start the embedded default: {expected}" in capsys.readouterr().out
    )


def test_probe_fails_where_fdl_run_would_refuse(program: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert fdl_main(["probe", "--devices", "cpu:2", "--ranks", "3"]) == 1
    assert (
        "[FAIL] fdl_run: `fdl run` would refuse to start (exit 2): --devices cpu:2 asks for"
        in capsys.readouterr().out
    )
    (program.parent / "fdl.yml").write_text(CLUSTER_BLOCK)
    assert fdl_main(["probe", "-v"]) == 0
    assert (
        "`fdl run` would start the cluster: block of fdl.yml: 1 worker(s), 1 on this host"
        in capsys.readouterr().out
    )


# --- local_devices: all on a worker of this host -----------------------------------------------------

LOCAL_ALL_BLOCK = (
    "cluster:\n  controller: {host: 127.0.0.1, port: 0}\n"
    "  workers:\n    - {host: localhost, local_devices: all}\n"
)


def test_local_devices_all_here_is_counted_here_for_the_window() -> None:
    cluster = load_text(LOCAL_ALL_BLOCK, name="fdl.yml").cluster
    assert cluster is not None
    probed = runplan.local_devices_counts(cluster, cuda_count=3)
    assert probed == {"localhost": 3}
    assert ControllerOptions.from_cluster(cluster, probed=probed).capacity == 3


def test_local_devices_all_without_a_gpu_is_bad_usage_not_a_traceback(
    program: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runplan, "cuda_device_count", lambda: 0)
    (program.parent / "fdl.yml").write_text(LOCAL_ALL_BLOCK)
    assert fdl_main(["run", str(program)]) == 2
    assert (
        "fdl run: worker 'localhost' has local_devices: all, but this host has no CUDA device; "
        "list CPU ranks instead (e.g. local_devices: [cpu:2])" in capsys.readouterr().err
    )


@pytest.mark.gpu
@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_local_devices_all_runs_one_rank_per_gpu_of_this_host(tmp_path: Path) -> None:
    count = cuda_device_count()
    (tmp_path / "fdl.yml").write_text(LOCAL_ALL_BLOCK.replace("port: 0}", "port: 0, backend: nccl}"))
    run = Fdl("run", str(HERE / "gpu_allreduce.py"), cwd=tmp_path)
    assert run.wait(240) == 0, run.output
    assert f"window open for {count} rank(s)" in run.output
    assert len(re.findall(r"nccl all_reduce ok on cuda:0", run.output)) == count, run.output


# --- real runs -----------------------------------------------------------------------------------------


@pytest.mark.multiproc
def test_nproc_per_node_runs_that_many_cpu_ranks_on_a_host_without_gpu() -> None:
    run = Fdl(
        "run", "--nproc-per-node", "2", str(EXAMPLES / "allreduce.py"), env=child_env(CUDA_VISIBLE_DEVICES="")
    )
    assert run.wait() == 0, run.output
    assert (
        "fdl run: starting the embedded default: 2 CPU rank(s), backend gloo (from --nproc-per-node 2)"
        in run.output
    )
    assert len(re.findall(r"all_reduce ok \[3\.0, ", run.output)) == 2, run.output
    assert "fdl run: run done" in run.output


@pytest.mark.gpu
@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("words", [[], ["--nproc-per-node", "gpu"]], ids=["default", "nproc-per-node-gpu"])
def test_one_rank_per_gpu_all_reduces_over_nccl(words: list[str]) -> None:
    count = cuda_device_count()
    run = Fdl("run", *words, str(HERE / "gpu_allreduce.py"))
    assert run.wait(240) == 0, run.output
    listed = ", ".join(f"cuda:{index}" for index in range(count))
    assert (
        f"fdl run: starting the embedded default: {count} GPU rank(s) on {listed}, backend nccl" in run.output
    )
    done = re.findall(
        r"rank (\d+)/(\d+): nccl all_reduce ok on cuda:0 \(physical GPU (\d+), backend nccl\)", run.output
    )
    assert sorted(int(rank) for rank, _, _ in done) == list(range(count)), run.output
    assert {int(world) for _, world, _ in done} == {count}
    assert len({gpu for _, _, gpu in done}) == count  # one rank per GPU, each its own
    assert "fdl run: run done" in run.output


def test_without_a_gpu_driver_fdl_run_learns_it_has_no_gpu_without_importing_torch() -> None:
    import subprocess
    import sys

    from fdl.run import GPU_DRIVER_NODES

    if any(os.path.exists(node) for node in GPU_DRIVER_NODES):
        pytest.skip("this host has a GPU driver: torch is asked")
    probe = (
        "import sys; from fdl.run import cuda_device_count; "
        "print(cuda_device_count(), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["0", "False"]  # a second or more off every `fdl run` launch on a CPU host
