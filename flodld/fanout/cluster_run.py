"""`fdl @cluster run` with remote workers: controller embedded, local agents, fan-out agents.

Order: probe `local_devices: all` hosts (capacity must be known before the window opens),
start the controller, start local agents as subprocesses and remote agents over SSH, then
supervise. An agent that exits before the world forms aborts the window naming its host; on
any exit (done, failure, Ctrl-C, SIGTERM) every agent is stopped before this returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from flodld.agent.spawn import agent_command
from flodld.agent.spec import AGENT_ENV, AgentSpec, encode_spec
from flodld.config.models import ClusterConfig
from flodld.controller.options import ControllerOptions
from flodld.controller.service import assemble_controller
from flodld.fanout.launcher import AgentExit, FanOut, FanOutError, plan_agent, probe_device_count, workdir_for
from flodld.membership.rootcause import root_cause_lines
from flodld.wire.salt import OPEN_ADMISSION_KEY

if TYPE_CHECKING:
    from flodld.controller.run import Controller

EXIT_DONE, EXIT_FAILED = 0, 1
# Forwarded to remote agents so a scaled-down test or a slow link behaves the same on every host.
PASSED_VARIABLES = ("FLODL_NET_TIMEOUT_SCALE",)


def has_remote_workers(cluster: ClusterConfig) -> bool:
    return any(not worker.is_local(cluster.controller.host) for worker in cluster.workers)


def _print_line(host: str, line: str) -> None:
    print(f"[{host}] {line}", flush=True)


async def probe_all_devices(cluster: ClusterConfig, local_cwd: str) -> dict[str, int]:
    """Device counts of every `local_devices: all` worker; remote ones over SSH, in parallel."""
    counts: dict[str, int] = {}
    remote = []
    for host in cluster.hosts_to_probe:
        worker = cluster.worker(host)
        assert worker is not None
        if worker.is_local(cluster.controller.host):
            import torch  # only to count local CUDA devices: `fdl` itself never loads torch

            counts[host] = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if counts[host] == 0:
                raise FanOutError(
                    host, "local_devices: all found no CUDA device; list CPU ranks (e.g. [cpu:2])"
                )
        else:
            remote.append(worker)
    found = await asyncio.gather(
        *(probe_device_count(w, workdir_for(w, cluster.controller, local_cwd)) for w in remote)
    )
    counts.update({worker.host: count for worker, count in zip(remote, found, strict=True)})
    return counts


async def run_cluster_job(
    program: str,
    args: Sequence[str],
    cluster: ClusterConfig,
    *,
    port: int | None = None,
    say: Callable[[str], None] = lambda message: print(f"fdl run: {message}", file=sys.stderr, flush=True),
    on_output: Callable[[str, str], None] = _print_line,
    environ: Mapping[str, str] | None = None,
    grace_s: int = 10,
) -> int:
    """Run `program args` on every worker of `cluster`; returns 0 when the run is done, else 1."""
    env = dict(os.environ if environ is None else environ)
    local_cwd = os.getcwd()
    try:
        probed = await probe_all_devices(cluster, local_cwd)
    except FanOutError as error:
        say(f"run FAILED before the window opened: {error}")
        return EXIT_FAILED
    # preshared: every agent this launcher starts gets the salt over its own channel (SSH stdin, or the
    # environment of a local child), so a loopback bind (all workers tunneled) never opens admission:
    # a local user on a worker host cannot join through the -R forward without the salt.
    overrides: dict[str, Any] = {"preshared": True} if port is None else {"preshared": True, "port": port}
    options = ControllerOptions.from_cluster(cluster, probed=probed, **overrides)
    controller = assemble_controller(
        options, on_phase=lambda phase, reason: say(phase.value + (f" — {reason}" if reason else ""))
    )
    try:
        bind, bound_port = await controller.start()
    except OSError as error:
        await controller.close()
        say(
            f"run FAILED: the controller cannot listen on {options.effective_bind_host}:{options.port} "
            f"({error}); free the port or set cluster.controller.port"
        )
        return EXIT_FAILED
    # Always the salt, unless the operator set open_admission explicitly (then the join key is public,
    # the controller warns, and agents receive the salt in Accept like any joiner).
    salt_hex = controller.salt_hex if controller.join_key != OPEN_ADMISSION_KEY else None
    local = [w for w in cluster.workers if w.is_local(cluster.controller.host)]
    remote = [w for w in cluster.workers if not w.is_local(cluster.controller.host)]
    say(f"controller bound to {bind}:{bound_port} (run {controller.run_id}); window for {options.capacity} "
        f"rank(s); {len(local)} local agent(s), {len(remote)} fan-out agent(s) "
        f"({sum(w.tunnel for w in remote)} tunneled)")  # fmt: skip
    passed = {name: env[name] for name in PASSED_VARIABLES if name in env}
    plans = [plan_agent(w, cluster, program=program, args=args, controller_port=bound_port, salt_hex=salt_hex,
                        extra_env=passed, local_cwd=local_cwd) for w in remote]  # fmt: skip
    fanout = FanOut(plans, on_output=on_output, grace_s=grace_s)
    local_agents: dict[str, asyncio.subprocess.Process] = {}
    try:
        for worker in local:
            spec = AgentSpec(
                host=worker.host, controller_host="127.0.0.1", controller_port=bound_port, salt_hex=salt_hex,
                devices=list(worker.local_devices) if worker.local_devices != "all" else ["all"],
                averaging=options.averaging, cluster_env=True, host_env=worker.rank_env() or None,
                program=[sys.executable, program, *args],
            )  # fmt: skip
            local_agents[worker.host] = await asyncio.create_subprocess_exec(
                *agent_command(), env={**env, **worker.env, AGENT_ENV: encode_spec(spec)},
                stdin=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
        try:
            await fanout.start()
        except FanOutError as error:
            say(str(error))
            await controller.stop(f"{error} — aborting before formation")
        return await _supervise(controller, fanout, local_agents, say)
    finally:
        await fanout.stop()
        for process in local_agents.values():
            if process.returncode is None:
                process.terminate()
                try:
                    await asyncio.wait_for(process.wait(), grace_s + 5)
                except TimeoutError:
                    process.kill()
                    await process.wait()
        await controller.close()


async def _supervise(
    controller: Controller,
    fanout: FanOut,
    local_agents: dict[str, asyncio.subprocess.Process],
    say: Callable[[str], None],
) -> int:
    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, interrupted.set)
    exits: asyncio.Queue[AgentExit] = fanout.exits
    watchers = [asyncio.ensure_future(_relay_exit(host, p, exits)) for host, p in local_agents.items()]
    result_task = asyncio.ensure_future(controller.wait())
    interrupt_task = asyncio.ensure_future(interrupted.wait())
    total = len(local_agents) + len(fanout.agents)
    exited = 0
    try:
        while not result_task.done():
            exit_task = asyncio.ensure_future(exits.get())
            done, _ = await asyncio.wait({result_task, interrupt_task, exit_task},
                                         return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            if exit_task not in done:
                exit_task.cancel()
            if interrupt_task in done:
                say("interrupted; aborting the run and stopping every agent")
                await controller.stop("interrupted by the operator (fdl run)")
                break
            if exit_task in done:
                gone = exit_task.result()
                exited += 1
                window = controller.window
                if gone.lost and not result_task.done():
                    say(f"SSH session to host {gone.host!r} lost (keepalives unanswered); aborting the run")
                    await controller.stop(f"SSH session to host {gone.host!r} was lost")
                elif window is not None and window.world is None and not result_task.done():
                    say(f"agent on host {gone.host!r} exited with code {gone.code} before the world formed")
                    await controller.stop(f"agent on host {gone.host!r} exited with code {gone.code} "
                                          "before the world formed")  # fmt: skip
                elif exited >= total and not result_task.done():
                    try:
                        await asyncio.wait_for(asyncio.shield(result_task), 10.0)
                    except TimeoutError:
                        await controller.stop("every agent exited but the run did not conclude")
        result = await result_task
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        interrupt_task.cancel()
        for watcher in watchers:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
    if result.ok:
        say(f"run done: {result.reason}")
        return EXIT_DONE
    if result.root_cause is not None:  # the first observed failure, across hosts
        for line in root_cause_lines(result.root_cause.model_dump()):
            say(line)
        say(f"run FAILED: {result.reason}; root cause: {result.root_cause.summary}")
    else:
        say(f"run FAILED: {result.reason}")
    return EXIT_FAILED


async def _relay_exit(
    host: str, process: asyncio.subprocess.Process, exits: asyncio.Queue[AgentExit]
) -> None:
    exits.put_nowait(AgentExit(host, await process.wait()))
