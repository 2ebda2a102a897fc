"""Fan-out: one supervised agent per remote worker over SSH, dialing back into the join window.

The plan for each worker (where, which interpreter, which argv, which secret environment) is
pure and built by `plan_agent`; `FanOut` owns the SSH sessions. Conventions, also in
docs/multi-host.md:

* workdir: the worker's `path`, else the controller's `path`, else the launcher's own working
  directory (the same checkout layout on every host).
* interpreter: `<workdir>/.venv/bin/python` when `arch` is absent; `<workdir>/<arch>/bin/python`
  for a relative `arch`, `<arch>/bin/python` for an absolute one (an `arch` is a Python
  environment on that host, one per torch build/variant).
* `docker: SERVICE`: the agent runs as `docker compose run --rm -T -e NAME... SERVICE python ...`
  from the workdir; `-e NAME` without a value makes compose copy the value from its own
  environment, so secrets still never appear in argv. With `arch`, `<arch>/bin/python` inside
  the container. Tunnels need `network_mode: host` on that service.
* the agent runs as `<interpreter> -m flodld.agent` (flodld's own process); the spec's `program`
  (`<interpreter> PROGRAM ARGS`) is what it starts as each rank.
* secrets: the agent spec (with the session salt) and the worker's `env:` travel as KEY=VALUE
  lines on the session's stdin (`flodld.fanout.ssh.SUPERVISOR`), never in argv.
* `tunnel: true`: a remote forward from a port the worker's sshd picks on its 127.0.0.1 to the
  controller's port; the agent's spec names that loopback end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
import shlex
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from flodld.agent.spawn import agent_command
from flodld.agent.spec import AGENT_ENV, AgentSpec, encode_spec
from flodld.config.models import ClusterConfig, ControllerConfig, WorkerConfig
from flodld.fanout.ssh import RemoteAgent, SshEndpoint, run_remote, start_remote_agent

OutputSink = Callable[[str, str], None]
DEVICE_COUNT_SNIPPET = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"


class FanOutError(RuntimeError):
    """A worker could not be reached or started; the message names the host."""

    def __init__(self, host: str, message: str) -> None:
        super().__init__(f"fan-out to host {host!r}: {message}")
        self.host = host


def endpoint_for(worker: WorkerConfig) -> SshEndpoint:
    """The worker's `ssh:` block as an endpoint; the worker's host when there is none."""
    ssh = worker.ssh
    if ssh is None:
        return SshEndpoint.parse(worker.host)
    return SshEndpoint.parse(ssh.target or worker.host, port=ssh.port, user=ssh.user,
                             identity_file=ssh.identity_file, options=tuple(ssh.options))  # fmt: skip


def workdir_for(worker: WorkerConfig, controller: ControllerConfig, local_cwd: str) -> str:
    return worker.path or controller.path or local_cwd


def interpreter_for(worker: WorkerConfig, workdir: str) -> str:
    """The Python that runs the agent on that host (see the module docstring for the mapping)."""
    if worker.docker is not None:
        return posixpath.join(worker.arch, "bin", "python") if worker.arch else "python"
    if worker.arch is None:
        return posixpath.join(workdir, ".venv", "bin", "python")
    return posixpath.join(workdir, worker.arch, "bin", "python")


def wrap_command(worker: WorkerConfig, command: Sequence[str], env_names: Sequence[str]) -> list[str]:
    """`command` as it runs on the host: bare, or inside the worker's compose service."""
    if worker.docker is None:
        return list(command)
    passed = [part for name in env_names for part in ("-e", name)]
    return ["docker", "compose", "run", "--rm", "-T", *passed, worker.docker, *command]


@dataclass(frozen=True)
class AgentPlan:
    """Everything needed to start one worker's agent; `secret_env` fills in a tunnel's port."""

    host: str
    endpoint: SshEndpoint
    workdir: str
    argv: tuple[str, ...]
    spec: AgentSpec
    tunnel: bool
    controller_port: int
    worker_env: Mapping[str, str] = field(default_factory=dict)

    def secret_env(self, forwarded_port: int | None) -> dict[str, str]:
        spec = self.spec
        if self.tunnel:
            if forwarded_port is None:
                raise FanOutError(self.host, "tunnel: true but the session has no remote forward")
            spec = spec.model_copy(update={"controller_host": "127.0.0.1", "controller_port": forwarded_port})
        return {**self.worker_env, AGENT_ENV: encode_spec(spec)}


def plan_agent(
    worker: WorkerConfig,
    cluster: ClusterConfig,
    *,
    program: str,
    args: Sequence[str],
    controller_port: int,
    salt_hex: str | None,
    extra_env: Mapping[str, str] | None = None,
    local_cwd: str | None = None,
) -> AgentPlan:
    """The pure plan for one remote worker (`extra_env` rides along with the worker's `env:`)."""
    controller = cluster.controller
    workdir = workdir_for(worker, controller, local_cwd or os.getcwd())
    worker_env = {**(extra_env or {}), **worker.env}
    python = interpreter_for(worker, workdir)
    # The agent is flodld's own process (`python -m flodld.agent`); the program starts only as its ranks.
    argv = wrap_command(worker, agent_command(python), [*worker_env, AGENT_ENV])
    devices = list(worker.local_devices) if worker.local_devices != "all" else ["all"]
    spec = AgentSpec(
        host=worker.host, controller_host=controller.host, controller_port=controller_port, salt_hex=salt_hex,
        devices=devices, averaging=controller.averaging, cluster_env=True,
        host_env=worker.rank_env() or None, program=[python, program, *args],
    )  # fmt: skip
    return AgentPlan(
        host=worker.host,
        endpoint=endpoint_for(worker),
        workdir=workdir,
        argv=tuple(argv),
        spec=spec,
        tunnel=worker.tunnel,
        controller_port=controller_port,
        worker_env=worker_env,
    )


def device_count_command(worker: WorkerConfig, workdir: str) -> str:
    """Shell command printing the host's CUDA device count, run where the agent would run."""
    command = wrap_command(worker, [interpreter_for(worker, workdir), "-c", DEVICE_COUNT_SNIPPET], [])
    return f"cd {shlex.quote(workdir)} && " + " ".join(shlex.quote(part) for part in command)


async def probe_device_count(worker: WorkerConfig, workdir: str, *, timeout: float = 120.0) -> int:
    """`local_devices: all` at dispatch: count the host's CUDA devices over SSH (0 is an error)."""
    try:
        code, out, err = await run_remote(endpoint_for(worker), device_count_command(worker, workdir),
                                          timeout=timeout)  # fmt: skip
    except (ConnectionError, TimeoutError) as exc:
        raise FanOutError(worker.host, f"probing local_devices: all failed: {exc}") from exc
    last = out.strip().splitlines()[-1:] or [""]
    if code != 0 or not last[0].isdigit():
        raise FanOutError(
            worker.host, f"probing local_devices: all failed (exit {code}): {err.strip()[-400:]}"
        )
    count = int(last[0])
    if count == 0:
        raise FanOutError(
            worker.host, "local_devices: all found no CUDA device; list CPU ranks (e.g. [cpu:2])"
        )
    return count


@dataclass(frozen=True)
class AgentExit:
    host: str
    code: int
    lost: bool = False  # the SSH session died (keepalives), so the remote side is tearing down


class FanOut:
    """The remote agents of one attempt: start them together, learn of exits, stop them all.

    Each agent's end is reported once, to `on_exit` (else the `exits` queue), whether it ended by
    itself, its session was lost, or `stop()` closed it.
    """

    def __init__(
        self,
        plans: Sequence[AgentPlan],
        *,
        on_output: OutputSink | None = None,
        grace_s: int = 10,
        on_exit: Callable[[AgentExit], None] | None = None,
    ) -> None:
        self.plans = list(plans)
        self.on_output = on_output
        self.grace_s = grace_s
        self.agents: dict[str, RemoteAgent] = {}
        self.failed: dict[str, FanOutError] = {}  # the hosts whose agent could not be started, and why
        self.exits: asyncio.Queue[AgentExit] = asyncio.Queue()
        self.on_exit = on_exit if on_exit is not None else self.exits.put_nowait
        self._watchers: dict[str, asyncio.Task[None]] = {}  # by host: each agent's end, to `on_exit`
        self._reported: set[str] = set()  # hosts whose end this fan-out has reported to `on_exit`
        self.watch_grace_s = 5.0  # at stop(), how long a closed session's end may take to come back

    async def start(self, *, keep_started: bool = False) -> None:
        """Start every agent; if any fails, stop those already started and raise the first FanOutError
        (`failed` names every host that could not be started). With `keep_started` (a restart, where a host
        that cannot be reached is left out: docs/restarts.md) the others keep running and nothing is raised.
        """
        results = await asyncio.gather(
            *(self._start_one(plan) for plan in self.plans), return_exceptions=True
        )
        for plan, result in zip(self.plans, results, strict=True):
            if isinstance(result, FanOutError):
                self.failed[plan.host] = result
            elif isinstance(result, BaseException):
                raise result
        if self.failed and not keep_started:
            await self.stop()
            raise next(iter(self.failed.values()))

    async def _start_one(self, plan: AgentPlan) -> None:
        forward = (0, plan.controller_port) if plan.tunnel else None
        sink = self.on_output

        def labelled(_target: str, line: str) -> None:  # name lines by worker, not by ssh target
            if sink is not None:
                sink(plan.host, line)

        try:
            agent = await start_remote_agent(
                plan.endpoint, workdir=plan.workdir, argv=plan.argv, secret_env=plan.secret_env,
                remote_forward=forward, on_output=labelled, grace_s=self.grace_s,
            )  # fmt: skip
        except Exception as exc:  # a boundary: whatever went wrong, the operator needs the host's name
            raise FanOutError(plan.host, str(exc) or type(exc).__name__) from exc
        self.adopt(plan.host, agent)

    def adopt(self, host: str, agent: RemoteAgent) -> None:
        """`agent` (started, or handed over) is now this fan-out's: its end goes to `on_exit`."""
        self.agents[host] = agent
        self._reported.discard(host)
        self._watchers[host] = asyncio.create_task(self._watch(host, agent))

    async def _watch(self, host: str, agent: RemoteAgent) -> None:
        code = await agent.wait()
        self._report(host, AgentExit(host, code, lost=agent.lost))

    def _report(self, host: str, gone: AgentExit) -> None:
        if host in self._reported or self.agents.get(host) is None:
            return  # reported already, or handed over (the fan-out it went to reports it)
        self._reported.add(host)
        self.on_exit(gone)

    @property
    def running(self) -> int:
        return sum(1 for agent in self.agents.values() if agent.process.exit_status is None)

    def hand_over(self, hosts: Collection[str], to: FanOut) -> None:
        """The sessions of `hosts` (agents kept linked across a restart, docs/restarts.md) go on as `to`'s:
        their ends are reported to its `on_exit` and its `stop()` closes them; this fan-out forgets them.
        """
        for host in hosts:
            agent = self.agents.pop(host, None)
            watcher = self._watchers.pop(host, None)
            if watcher is not None:
                watcher.cancel()  # its end is `to`'s to report (a cancelled wait leaves the output pump be)
            if agent is not None:
                to.adopt(host, agent)

    async def stop(self, keep: Collection[str] = ()) -> None:
        """Close every session but those of `keep` (agents kept linked across a restart, which go on): the
        remote supervisors TERM, then KILL, their agents' groups; each end is reported. A watcher still
        waiting after its session closed is cancelled and its agent reported with its exit status, or 255
        (as ssh says) where none came back: whoever waits on `on_exit` never waits in vain.
        """
        stopping = {host: agent for host, agent in self.agents.items() if host not in keep}
        await asyncio.gather(*(agent.stop(timeout=self.grace_s + 5.0) for agent in stopping.values()))
        watchers = [self._watchers[host] for host in stopping if host in self._watchers]
        if watchers:
            await asyncio.wait(watchers, timeout=self.watch_grace_s)
        for watcher in watchers:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        for host, agent in stopping.items():
            status = agent.process.exit_status
            self._report(host, AgentExit(host, status if status is not None else 255))
