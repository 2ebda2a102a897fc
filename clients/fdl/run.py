"""`fdl run [OPTIONS] PROGRAM [ARGS...]`: the main job on this machine, controller embedded.

As with torchrun, every word after PROGRAM is PROGRAM's: `fdl run train.py 1 5 --batch_size 4 --port 29999`
gives train.py all six words and fdl's options only come before PROGRAM. (A `--` right after PROGRAM, the
older spelling `fdl run PROGRAM -- ARGS`, is dropped; write `-- --` to pass a literal `--`.)

With no `cluster:` block in the project's fdl.yml (the embedded default) it starts a controller
in-process on 127.0.0.1 (free port) and one local agent that joins over loopback, with one rank per
GPU (backend nccl) when this host has a GPU, else `--ranks N` CPU ranks (default 2, backend gloo).
The first progress line says which.

Choosing the ranks of the embedded default (three spellings of one choice; when several are given
they must agree, else exit 2):
  --devices SPEC          as `fdl join --devices`: 'all' (every GPU; --ranks CPU ranks when there is
                          none), '0,1' or 'cuda:1' (those GPUs), 'cpu:N' (N CPU ranks), 'cpu,cpu'
  --nproc-per-node N|gpu|cpu  torchrun's spelling: N ranks (the first N GPUs, or N CPU ranks on a
                          host without GPU), gpu (every GPU; an error without one), cpu (one CPU
                          rank per core)
  --ranks N               N CPU ranks
Ranks on GPUs only use backend nccl; any CPU rank makes it gloo.

With a cluster block (`fdl @cluster run`), the overlay's controller settings are used and local
workers get a local agent; remote workers walk in with `fdl join`. Progress lines go to stderr;
the exit code is the run's verdict (0 done, 1 failed, 2 bad usage).

torchrun's flags, so that a torchrun command line ports by renaming the command:
  -m/--module, --no-python, --run-path   as torchrun: PROGRAM is a module (`python -m`), an executable run
                          as is, or a Python file whatever its name
  --standalone            the embedded default (what fdl run does anyway)
  --nnodes N|MIN:MAX      one host: accepted. Several: only with a cluster: block (walk-ins make the
                          hosts) and --nproc-per-node N, as the join window's quorum MIN x N and
                          target MAX x N ranks (controller.join.min_rank_start/target_ranks)
  --max-restarts N        re-form a failed attempt as a fresh world up to N times (ranks see
                          TORCHELASTIC_RESTART_COUNT; default controller.join.max_restarts, else 0)
  --rdzv-endpoint HOST:PORT, or --master-addr HOST [--master-port PORT] with --node-rank >= 1:
                          walk in to the controller there instead (as `fdl join HOST:PORT`; the token
                          from FDL_JOIN_TOKEN or the fdl.yml join: block); rank flags size this host
  --rdzv-conf join_timeout=SECS   the join window's length (controller.join.join_timeout)
  --rdzv-backend c10d|static, --rdzv-id, --master-addr/--master-port on node 0, --node-rank 0,
  --monitor-interval, --start-method spawn   accepted; they have nothing to set here (a line says so)
  --local-ranks-filter R[,R]  show only these ranks' output lines (the embedded default's one host: its
                          local ranks); the controller's and agents' lines still show
  --log-dir DIR, -r/--redirects N, -t/--tee N   as torchrun: per-rank stdout.log/stderr.log under
                          DIR/RUN/attempt_N/HOST/rank_R/; --redirects keeps the streams it names off the
                          terminal, --tee shows them too; N is 0-3 (none, stdout, stderr, both) or per local
                          rank (0:3,1:2). Default from fdl.yml's logs: block. Read them with `fdl logs`.
Any other torchrun flag is refused with the flodld equivalent.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from fdl import join
from fdl.cli import Command
from fdl.logs import add_log_options, config_logs, resolve_logs
from fdl.progargs import add_rest, program_command
from fdl.runplan import DEFAULT_CPU_RANKS as DEFAULT_CPU_RANKS
from fdl.runplan import GPU_DRIVER_NODES as GPU_DRIVER_NODES
from fdl.runplan import LocalRanks as LocalRanks
from fdl.runplan import add_rank_options, choose_local_ranks, plan_run, project_cluster
from fdl.runplan import cuda_device_count as cuda_device_count
from fdl.runplan import embedded_cluster as embedded_cluster
from fdl.runplan import local_devices_counts as local_devices_counts
from fdl.runshell import RUN_ACTIONS as RUN_ACTIONS
from fdl.runshell import run_job, say
from fdl.torchrun import TorchrunPlan, add_torchrun_options, torchrun_plan
from flodld import api

EXIT_DONE, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _add_options(parser: argparse.ArgumentParser) -> None:
    add_rank_options(parser)
    parser.add_argument("--port", type=int, default=None, help="controller port (default: a free one)")
    parser.add_argument("--project", default=".", help="directory holding fdl.yml (default: .)")
    add_log_options(parser)
    add_torchrun_options(parser)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    _add_options(parser)
    program = "the training program (a .py file or an executable), then every word after it (as torchrun)"
    add_rest(parser, metavar="PROGRAM [ARGS...]", help=program)


NO_VALUE_FLAGS = frozenset({
    "-h", "--help", "-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path",
    "--standalone",
})  # fmt: skip
"""The options of fdl run that take no value; any other before PROGRAM takes one (or `--opt=value`)."""


def program_start(words: list[str]) -> int:
    """Where PROGRAM is in the words after `run` (len(words) when there is none): the first word that is
    neither an option nor an option's value, or the `--` that ends the options.
    """
    index = 0
    while index < len(words):
        word = words[index]
        if word == "--" or not word.startswith("-") or word == "-":
            return index
        attached = len(word) > 2 and word[1] != "-"  # a short flag with its value: -r3, -t0:3
        index += 1 if word in NO_VALUE_FLAGS or "=" in word or attached else 2
    return len(words)


def split_program(rest: list[str]) -> tuple[str | None, list[str]]:
    """(PROGRAM, its arguments) from what follows fdl run's options: as torchrun, every word after PROGRAM
    is PROGRAM's. A `--` before PROGRAM ends the options; one right after PROGRAM is dropped (the older
    spelling `fdl run PROGRAM -- ARGS`). None when no program was given.
    """
    words = list(rest)
    if words[:1] == ["--"]:
        words.pop(0)
    if not words:
        return None, []
    arguments = words[1:]
    return words[0], arguments[1:] if arguments[:1] == ["--"] else arguments


@dataclass(frozen=True)
class Launch:
    """How each rank starts PROGRAM: a module (-m), an executable as is (--no-python), a Python file
    (--run-path, or a name ending in .py), else an executable looked up on PATH.
    """

    program: str
    args: tuple[str, ...] = ()
    module: bool = False
    no_python: bool = False
    run_path: bool = False

    def command(self) -> list[str]:
        """The rank's command line; FileNotFoundError (exit 2) when PROGRAM cannot be found."""
        if self.module:
            return [sys.executable, "-m", self.program, *self.args]
        if self.run_path:
            if not Path(self.program).is_file():
                raise FileNotFoundError(f"program {self.program!r} not found (relative to {os.getcwd()})")
            return [sys.executable, self.program, *self.args]
        if self.no_python:
            if not Path(self.program).is_file() and shutil.which(self.program) is None:
                raise FileNotFoundError(f"program {self.program!r} is neither a file nor on PATH")
            return [self.program if os.sep in self.program else (shutil.which(self.program) or self.program),
                    *self.args]  # fmt: skip
        return program_command(self.program, list(self.args))




def main(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="fdl run: controller: %(message)s")
    try:
        program, program_args = split_program(list(args.rest))
        if program is None:
            raise ValueError("no program given: fdl run [OPTIONS] PROGRAM [ARGS...]")
        args.program = program
        torchrun = torchrun_plan(args)
        bounds = _window_bounds(args, torchrun)
        launch = Launch(program, tuple(program_args), args.module, args.no_python, args.run_path)
        command = launch.command()
        if torchrun.walk_in is not None:
            return _walk_in(args, torchrun, command)
        cluster, plan = plan_run(args)
        logs = resolve_logs(
            log_dir=args.log_dir, redirects=args.redirects, tee=args.tee,
            block=config_logs(args.project, getattr(args, "env", None)), say=say,
        )  # fmt: skip
        if bounds is not None:
            update: dict[str, object] = {"min_rank_start": bounds[0], "target_ranks": bounds[1]}
            plan += f"; --nnodes: quorum {bounds[0]}, target {bounds[1]} rank(s)"
            if grows(cluster):  # an elastic CPU-averaging run: walk-ins heal it up to MAX
                update["elastic_max_ranks"] = bounds[1]
                plan += f", walk-ins during training up to {bounds[1]}"
            join = cluster.controller.join.model_copy(update=update)
            controller = cluster.controller.model_copy(update={"join": join})
            cluster = cluster.model_copy(update={"controller": controller})
    except (FileNotFoundError, ValueError) as error:
        say(str(error))
        return EXIT_USAGE
    for note in torchrun.notes:
        say(note)
    say(f"starting {plan}")
    # Plain asyncio: the controller's mux checks for asyncio.Transport, which uvloop's transports are not.
    if any(not worker.is_local(cluster.controller.host) for worker in cluster.workers):
        if launch.module or launch.no_python or launch.run_path or torchrun.rank_filter is not None:
            say(
                "-m/--no-python/--run-path/--local-ranks-filter: not yet with remote workers (the fan-out "
                "starts PROGRAM by name and prints every rank)"
            )
            return EXIT_USAGE
        if logs is not None:
            say(
                "--log-dir/--redirects/--tee (logs: in fdl.yml): not yet with remote workers (the fan-out "
                "prints every rank); walk them in with `fdl join --log-dir DIR` instead, or drop the flags"
            )
            return EXIT_USAGE
        # cluster_run loads asyncssh: only when there is a remote worker.
        fanout = api.run_cluster_job(
            program, program_args, cluster, port=args.port, max_restarts=torchrun.max_restarts
        )
        return asyncio.run(fanout)
    job = run_job(
        command,
        cluster,
        port=args.port,
        join_timeout=torchrun.join_timeout,
        rank_filter=torchrun.rank_filter,
        max_restarts=torchrun.max_restarts,
        logs=logs,
    )
    return asyncio.run(job)


def grows(cluster: api.ClusterConfig) -> bool:
    """Whether `--nnodes MIN:MAX` also bounds growth during training (controller.join.elastic_max_ranks):
    an elastic run, i.e. a CPU averaging mode with a tolerance (docs/elastic-averaging.md, "Growth and
    healing"). A run of process groups cannot take a member mid-run: its MAX only sizes the window.
    """
    controller = cluster.controller
    elastic = controller.tolerance_percent is not None or (controller.tolerance_count or 0) > 0
    return controller.averaging.is_cpu and elastic and controller.join.elastic_max_ranks is None


def _window_bounds(args: argparse.Namespace, torchrun: TorchrunPlan) -> tuple[int, int] | None:
    """--nnodes MIN:MAX over more than one host, as the window's quorum and target in ranks (MIN and MAX
    times --nproc-per-node N, torchrun's ranks per host); only with a cluster: block, whose walk-ins
    make the hosts. None when --nnodes allows one host. ValueError (exit 2) says what is missing.
    """
    if torchrun.nnodes is None:
        return None
    low, high = torchrun.nnodes
    if project_cluster(args) is None:
        raise ValueError(
            f"--nnodes {low}:{high}: fdl run's embedded controller serves this host only. For a world of "
            "several hosts give fdl.yml a cluster: block (controller.join.discovery and a token), run "
            "`fdl @cluster run --nnodes MIN:MAX --nproc-per-node N PROGRAM` here and `fdl join HOST:PORT "
            "--bin PROGRAM` (or fdl run --rdzv-endpoint HOST:PORT PROGRAM) on the others"
        )
    per_host = (args.nproc_per_node or "").strip()
    if not per_host.isdigit() or int(per_host) < 1:
        raise ValueError(
            f"--nnodes {low}:{high} counts hosts and the join window counts ranks: give --nproc-per-node N "
            "(ranks per host, a number) to make the bounds MIN x N and MAX x N ranks, or set "
            "controller.join.min_rank_start/target_ranks in fdl.yml"
        )
    args.nproc_per_node = None  # it sized the bounds; the cluster: block's workers list their own ranks
    return low * int(per_host), high * int(per_host)


def _walk_in(args: argparse.Namespace, torchrun: TorchrunPlan, command: list[str]) -> int:
    """--rdzv-endpoint (or --master-addr with --node-rank >= 1): run as `fdl join HOST:PORT` would, the
    rank flags sizing this host and PROGRAM (as -m/--no-python/--run-path say) as the ranks' command.
    """
    assert torchrun.walk_in is not None
    host, port = torchrun.walk_in
    if args.port is not None or torchrun.join_timeout is not None:
        say("--port and --rdzv-conf set an embedded controller's; walking in, they are the controller's own")
        return EXIT_USAGE
    devices = None
    if any(getattr(args, name, None) is not None for name in ("devices", "nproc_per_node", "ranks")):
        local = choose_local_ranks(devices=args.devices, nproc_per_node=args.nproc_per_node, ranks=args.ranks)
        devices = ",".join(local.entries)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    walk = argparse.Namespace(
        project=args.project, env=getattr(args, "env", None), controller=address, token=None,
        program=sys.executable,  # checked by fdl join; the ranks' command is `command`, set below
        program_args=[], devices=devices, host=None, persist=None, ssh=None, identity=None, accept_env=None,
        log_dir=args.log_dir, redirects=args.redirects, tee=args.tee,
    )  # fmt: skip
    try:
        plan = join.resolve_plan(walk)
    except join.UsageError as error:
        say(str(error))
        return EXIT_USAGE
    plan = dataclasses.replace(plan, spec=plan.spec.model_copy(update={"program": command}))
    for note in torchrun.notes:
        say(note)
    say(f"walking in to the controller at {host}:{port} (as fdl join)")
    try:
        return join.join_loop(plan)
    except (KeyboardInterrupt, join.Stopped):
        say("stopped")
        return join.EXIT_TRANSIENT


COMMAND = Command("run", "run a program on every rank (controller embedded)", __doc__, configure_parser, main)

if __name__ == "__main__":
    sys.exit(COMMAND.standalone())
