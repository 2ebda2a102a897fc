"""`fdl join [HOST:PORT] [--token HEX] [--bin PROGRAM] [--host NAME] [--devices LIST] [--persist] -- ARGS`.

Starts an agent (flodld's own process) against that controller: it joins the window, receives the
formed world and starts its relay and one PROGRAM rank per device. PROGRAM needs no flodld import: a
stock torchrun script (`init_process_group()` over env://) runs as is. Every flag defaults from the
top-level `join:` block of fdl.yml, so a golden image can boot into a bare `fdl join`. The token may
also come from the FDL_JOIN_TOKEN environment variable or from stdin (`--token -`), keeping it out
of `ps`.

Exit codes: 0 the run finished, 1 transient failure (dial again later), 2 permanent (bad token, no token for
a controller that checks credentials, bad config, incompatible build) — for systemd's
RestartPreventExitStatus=2. With --persist it never gives up on transient failures: it backs off 5 s
doubling to 60 s and dials again (the backoff resets after a run whose world formed, and after an attempt
that lasted longer than 2 minutes); after a run that ended for this host alone (its agent killed or its link
lost: exit 1 once formed; or every rank lost, which the agent marks), it dials again after 0.1 s, doubling
from there, since the run may go on and admit it back (at most 3 such quick re-dials a minute: a host that
keeps losing its runs backs off as usual). Each next attempt's agent is started ahead, once the current
attempt's world forms, and waits for its spec on stdin, so a re-dial pays no interpreter start-up; the spec
(with the token) always reaches the agent on that pipe, never in its environment. SIGTERM ends the loop, also
during the back-off, and stops that spare agent. A persist loop
of CPU ranks (--devices cpu:N) keeps a fork server that loads torch once and forks each attempt's ranks
(--no-fork-server, or join.fork_server: false, starts them cold; docs/elastic-averaging.md).

The controller's `env:` is filtered: a walk-in applies thread counts (OMP_NUM_THREADS, ...), NCCL_*/GLOO_*
tuning (not plugins, files, paths or addresses) and torch debug knobs, plus the names --accept-env (or
join.accept_env) lists; any other name refuses the run on this host (exit 2) naming the variables. Under
open admission (no token) it applies no controller env at all.

--log-dir DIR with -r/--redirects and -t/--tee (torchrun's, as under `fdl run`; default: the `logs:` block
of fdl.yml) keeps each rank's output in DIR/RUN/attempt_N/HOST/rank_R/{stdout,stderr}.log on this box:
the directory is this walk-in's own choice, never the controller's. `fdl logs` reads them.

With --ssh [USER@]HOST[:PORT] [--identity KEY] every attempt brings up its own `ssh -N -L` forward
(OpenSSH, BatchMode: never a password prompt) and dials through it; the address is then the
controller as seen from that host (default 127.0.0.1:1337). A refused key exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from fdl.cli import Command
from fdl.logs import add_log_options, resolve_logs
from fdl.progargs import add_rest, program_command, reparse
from flodld import api

EXIT_DONE, EXIT_TRANSIENT, EXIT_PERMANENT = 0, 1, 2
BACKOFF_INITIAL_SECS = 5.0
BACKOFF_MAX_SECS = 60.0
BACKOFF_RESET_AFTER_SECS = 120.0
# A run this host was part of for a while ended for it alone (its agent killed, its link lost, its ranks
# lost) while the run may still be training and admitting walk-ins: every second away is a second the run
# trains without it, so the loop dials again at once, backing off from there if that dial fails.
REDIAL_AFTER_LOSS_SECS = 0.1
# ... but a host that keeps losing its runs is crash-looping, not unlucky: past this many quick re-dials in
# this many seconds, it backs off as usual (systemd's StartLimitBurst, for the same reason).
QUICK_REDIALS = 3
QUICK_REDIALS_WINDOW_SECS = 60.0
TOKEN_ENV = "FDL_JOIN_TOKEN"


def configure_parser(parser: argparse.ArgumentParser) -> None:
    _add_options(parser)
    controller = "the controller (default: join.address or 127.0.0.1:1337), then -- and PROGRAM's arguments"
    add_rest(parser, metavar="[HOST[:PORT]] [-- ARGS]", help=controller)


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--token", default=None, help=f"the run's join token (32 hex); '-' reads stdin; or set {TOKEN_ENV}"
    )
    parser.add_argument(
        "--bin", dest="program", default=None, help="the training program (default: join.program)"
    )
    parser.add_argument(
        "--host", default=None, help="this worker's roster name (default: FLODL_HOST_NAME or hostname)"
    )
    parser.add_argument(
        "--devices", default=None, help="'cpu:4', '0,1', 'cpu,cpu' or 'all' (default: join.devices)"
    )
    parser.add_argument("--persist", action="store_true", default=None, help="re-dial forever with backoff")
    parser.add_argument(
        "--no-fork-server",
        dest="fork_server",
        action="store_false",
        default=None,
        help="with --persist, start every rank cold instead of forking it from a process that loaded torch "
        "once (default: join.fork_server)",
    )
    parser.add_argument("--project", default=".", help="directory holding fdl.yml (default: .)")
    parser.add_argument(
        "--ssh",
        default=None,
        metavar="[USER@]HOST[:PORT]",
        help="dial through a fresh `ssh -L` forward via this host; the address is then the "
        "controller as seen from it (default 127.0.0.1:1337)",
    )
    parser.add_argument("--identity", default=None, metavar="KEY", help="private key for --ssh (ssh -i)")
    parser.add_argument(
        "--accept-env",
        dest="accept_env",
        action="append",
        default=None,
        metavar="NAME[,NAME]",
        help="apply these variables of the controller's env too (besides thread counts and "
        "NCCL_/GLOO_ tuning); any other name the controller sets refuses the run",
    )
    add_log_options(parser)


def say(message: str) -> None:
    sys.stderr.write(f"fdl join: {message}\n")
    sys.stderr.flush()


class UsageError(ValueError):
    """Bad flags or config: permanent (exit 2)."""


@dataclass(frozen=True)
class JoinPlan:
    command: list[str]
    spec: api.AgentSpec
    persist: bool
    ssh: api.SshEndpoint | None = None  # --ssh: every attempt dials through its own fresh forward
    fork_server: bool = False  # --persist keeps a fork server for its agents' CPU ranks
    fork_server_path: str | None = None  # its socket, once started (join_loop)


def resolve_plan(args: argparse.Namespace, stdin_token: str | None = None) -> JoinPlan:
    """Merge flags over the fdl.yml `join:` block; UsageError names the problem and the fix."""
    env_name = getattr(args, "env", None) or os.environ.get("FDL_ENV") or None
    logs_block: api.LogsConfig | None = None
    try:
        project = api.load_config(args.project, env_name)
        block, logs_block = project.join or api.WalkInConfig(), project.logs
    except api.ConfigNotFoundError:
        block = api.WalkInConfig()
    except api.ConfigError as error:
        raise UsageError(f"fdl.yml: {error}") from None
    try:
        host, port = api.parse_address(args.controller) if args.controller else block.controller_endpoint()
    except ValueError as error:
        raise UsageError(f"controller address: {error}") from None
    token = args.token if args.token not in (None, "-") else None
    if args.token == "-":
        token = (stdin_token if stdin_token is not None else sys.stdin.readline()).strip()
    token = token or os.environ.get(TOKEN_ENV) or block.token
    if token is not None:
        try:
            token = bytes.fromhex(token.strip()).hex()
        except ValueError:
            raise UsageError("--token must be 32 hex characters (the run's controller.join.token)") from None
        if len(token) != 32:
            raise UsageError(f"--token must be 32 hex characters (16 bytes), got {len(token)}")
    program = args.program or block.program
    if program is None:
        raise UsageError("no program to run: pass --bin PROGRAM or set join.program in fdl.yml")
    # A present `--` (even with nothing after it) replaces the block's args.
    user_args = list(block.args) if args.program_args is None else list(args.program_args)
    try:
        command = program_command(program, user_args)
    except FileNotFoundError as error:
        raise UsageError(f"{error} — point --bin (or join.program in fdl.yml) at it") from None
    devices: list[str] | None
    if args.devices is not None:
        try:
            devices = api.parse_device_list(args.devices)
        except api.DeviceError as error:
            raise UsageError(str(error)) from None
    else:
        devices = None if block.devices == "all" else list(block.devices)
    if devices == ["all"]:
        devices = None
    name = (
        args.host or block.host or os.environ.get("FLODL_HOST_NAME") or socket.gethostname() or "unknown-host"
    )
    try:
        accept_env = api.parse_accept_env([*block.accept_env, *(getattr(args, "accept_env", None) or ())])
    except ValueError as error:
        raise UsageError(str(error)) from None
    try:  # this walk-in's own directory, never the controller's: the log dir is made and checked here
        logs = resolve_logs(
            log_dir=getattr(args, "log_dir", None), redirects=getattr(args, "redirects", None),
            tee=getattr(args, "tee", None), block=logs_block, say=say,
        )  # fmt: skip
    except ValueError as error:
        raise UsageError(str(error)) from None
    spec = api.AgentSpec(
        host=name,
        controller_host=host,
        controller_port=port,
        salt_hex=token,
        devices=devices,
        accept_env=list(accept_env) or None,
        program=command,
        logs=logs,
    )
    # The agent is flodld's own process; PROGRAM starts only as its ranks (a stock torchrun script works).
    persist = bool(args.persist) or block.persist
    fork_server = persist and (block.fork_server if getattr(args, "fork_server", None) is None else False)
    return JoinPlan(api.agent_command(), spec, persist, _ssh_endpoint(args, block), fork_server)


def _ssh_endpoint(args: argparse.Namespace, block: api.WalkInConfig) -> api.SshEndpoint | None:
    """`--ssh`/`--identity` over the `join.ssh` block; None when neither asks for a forward."""
    ssh = block.ssh
    identity = getattr(args, "identity", None) or (ssh.identity_file if ssh is not None else None)
    options = tuple(ssh.options) if ssh is not None else ()
    try:
        if getattr(args, "ssh", None):
            return api.SshEndpoint.parse(args.ssh, identity_file=identity, options=options)
        if ssh is not None and ssh.target is not None:
            return api.SshEndpoint.parse(ssh.target, port=ssh.port, user=ssh.user, identity_file=identity,
                                     options=options)  # fmt: skip
    except api.SshConfigError as error:
        raise UsageError(f"--ssh: {error}") from None
    if getattr(args, "identity", None):
        raise UsageError("--identity only applies with --ssh (or a join.ssh block in fdl.yml)")
    return None


# What OpenSSH (BatchMode) prints when it cannot vouch for the server's host key.
HOST_KEY_FAILURES = ("Host key verification failed", "REMOTE HOST IDENTIFICATION HAS CHANGED")


def host_key_remedy(ssh: api.SshEndpoint) -> str:
    """What to do about a host key ssh would not accept; the fix is the operator's, never a retry."""
    return (
        f"the host key of {ssh.host} (port {ssh.port}) is unknown to ssh, or changed: check its fingerprint, "
        f"then add it (`ssh-keyscan -p {ssh.port} {ssh.host} >> ~/.ssh/known_hosts`), or trust it on first "
        "use with StrictHostKeyChecking=accept-new in join.ssh.options"
    )


def _attempt_through_ssh(plan: JoinPlan, agent: Agent | None, spare: SpareAgent | None) -> int:
    """One attempt through a fresh forward; the agent dials its local end, which it then hands on."""
    assert plan.ssh is not None
    remote = (plan.spec.controller_host, plan.spec.controller_port)
    try:
        forward = api.open_forward(plan.ssh, remote)
    except api.ForwardError as error:
        say(str(error))
        if agent is not None:  # never told its spec: it is the loop's to stop
            _stop_agent(agent)
        if any(sign in str(error) for sign in HOST_KEY_FAILURES):
            say(host_key_remedy(plan.ssh))
            return EXIT_PERMANENT  # only the operator can vouch for a host key: re-dialing never will
        # A refused key stays refused; a dead network may come back.
        return EXIT_PERMANENT if "Permission denied" in str(error) else EXIT_TRANSIENT
    say(f"forward 127.0.0.1:{forward.local_port} -> {remote[0]}:{remote[1]} via {plan.ssh.label}")
    spec = plan.spec.model_copy(
        update={"controller_host": "127.0.0.1", "controller_port": forward.local_port}
    )
    try:
        return attempt(replace(plan, spec=spec, ssh=None), agent, spare)
    finally:
        forward.close()


Agent = subprocess.Popen[bytes]  # an agent process
FORMED_POLL_SECS = 0.5  # how often a running attempt looks for its formed mark (to start the spare agent)


def start_agent(plan: JoinPlan) -> Agent:
    """Start an agent for `plan`'s loop; it imports flodld and meets the fork server, then waits for its spec
    as one line on stdin (`attempt` sends it). Nothing secret is in its argv or environment: the token rides
    in the spec, on the pipe. OSError when the command cannot start.
    """
    env = {**os.environ, api.AGENT_ENV: api.SPEC_ON_STDIN, "FLODL_HOST_NAME": plan.spec.host}
    env.pop(TOKEN_ENV, None)
    if plan.fork_server_path is not None:
        env[api.FORK_SERVER_ENV] = plan.fork_server_path
    return subprocess.Popen(plan.command, env=env, stdin=subprocess.PIPE)


def _stop_agent(agent: Agent) -> None:
    agent.kill()
    agent.wait()


class SpareAgent:
    """A persist loop's next agent, started ahead of need: once an attempt's world has formed (and before a
    back-off), the loop starts the agent its next attempt will use, so that a host which loses its run (its
    agent killed, its link cut, its ranks lost) dials back without paying an interpreter's start and
    flodld's imports, which take a loaded machine half a second or more, while the run trains without it.
    """

    def __init__(self, plan: JoinPlan) -> None:
        self.plan = plan
        self.agent: Agent | None = None

    def fill(self) -> None:
        """Start the spare unless one is running (a failure to start is left to the attempt to report)."""
        if self.agent is None or self.agent.poll() is not None:
            self.agent = None
            with contextlib.suppress(OSError):
                self.agent = start_agent(self.plan)

    def take(self) -> Agent | None:
        """The running spare, now the caller's; None when there is none."""
        agent, self.agent = self.agent, None
        if agent is not None and agent.poll() is not None:
            return None  # it died waiting (its own words are on stderr): the attempt starts afresh
        return agent

    def close(self) -> None:
        if self.agent is not None:
            _stop_agent(self.agent)
            self.agent = None


def attempt(plan: JoinPlan, agent: Agent | None = None, spare: SpareAgent | None = None) -> int:
    """Run the program once in agent role; its exit code (0 done, 1 transient, 2 permanent). `agent` is one
    started ahead (`start_agent`) that waits for its spec; `spare` is filled once this attempt's world forms.
    """
    if plan.ssh is not None:
        return _attempt_through_ssh(plan, agent, spare)
    try:
        child = agent if agent is not None else start_agent(plan)
    except OSError as error:
        say(f"run {plan.command[0]}: {error}")
        return EXIT_PERMANENT
    assert child.stdin is not None
    with contextlib.suppress(OSError):  # it exited before reading its spec: its exit code says why
        child.stdin.write(api.encode_spec(plan.spec).encode() + b"\n")
        child.stdin.close()

    def forward(signum: int, _frame: object) -> None:
        # The agent tears its children down on TERM; then this loop stops instead of re-dialing.
        child.send_signal(signum)
        raise Stopped(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        return _wait(child, plan, spare)
    except KeyboardInterrupt:
        child.send_signal(signal.SIGINT)
        child.wait()
        raise
    except Stopped:
        child.wait()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def _wait(child: Agent, plan: JoinPlan, spare: SpareAgent | None) -> int:
    """The agent's exit code; meanwhile, once its world has formed, the spare is started."""
    formed = Path(plan.spec.formed_file) if spare is not None and plan.spec.formed_file else None
    while formed is not None:
        try:
            return child.wait(timeout=FORMED_POLL_SECS)
        except subprocess.TimeoutExpired:
            if formed.exists():
                assert spare is not None
                spare.fill()
                formed = None
    return child.wait()


class Stopped(Exception):
    """fdl join received SIGTERM: the agent was told, and the loop ends."""


def _stop(signum: int, _frame: object) -> None:
    raise Stopped(signum)


def join_loop(
    plan: JoinPlan,
    *,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Attempt until done (or forever with --persist); the back-off resets after a run that formed.

    Every attempt's agent writes a mark file once its world forms, so a fleet of persist walk-ins is
    re-armed 5 s after any run, done or failed, instead of at the doubled back-off of its idle dials.
    """
    backoff = api.scaled(BACKOFF_INITIAL_SECS)
    quick = api.BurstLimit(QUICK_REDIALS, api.scaled(QUICK_REDIALS_WINDOW_SECS))
    with tempfile.TemporaryDirectory(prefix="fdl-join-") as marks, _fork_server(plan, marks) as forks:
        mark = Path(marks) / "formed"
        marked = replace(plan, spec=plan.spec.model_copy(update={"formed_file": str(mark)}),
                         fork_server_path=forks.path if forks is not None else None)  # fmt: skip
        spare = SpareAgent(marked) if plan.persist else None
        try:
            while True:
                mark.unlink(missing_ok=True)
                started = clock()
                code = attempt(marked, spare.take() if spare is not None else None, spare)
                if code == EXIT_PERMANENT:
                    if plan.persist:
                        say("not re-dialing — retrying cannot fix this (exit 2)")
                    return EXIT_PERMANENT
                if spare is None:
                    return EXIT_TRANSIENT if code not in (EXIT_DONE, EXIT_TRANSIENT) else code
                spare.fill()  # its start-up overlaps the back-off
                backoff = _redial(mark, code, clock() - started, backoff, quick, clock)
                sleep(backoff)
                backoff = min(backoff * 2, api.scaled(BACKOFF_MAX_SECS))
        finally:
            if spare is not None:
                spare.close()


def _redial(mark: Path, code: int, lasted: float, backoff: float, quick: api.BurstLimit,
            clock: Callable[[], float]) -> float:  # fmt: skip
    """The back-off before the next dial after an attempt that ended with `code` (said on stderr)."""
    formed = mark.exists()
    left = formed and code == EXIT_DONE and api.LEFT_RUN_MARK in _lines(mark)
    if formed and (code != EXIT_DONE or left) and quick.allow(clock()):
        backoff = api.scaled(REDIAL_AFTER_LOSS_SECS)
    elif formed or lasted > api.scaled(BACKOFF_RESET_AFTER_SECS):
        backoff = api.scaled(BACKOFF_INITIAL_SECS)
    outcome = "run finished" if code == EXIT_DONE else f"agent exited with code {code}"
    if formed and code != EXIT_DONE:
        outcome = f"run ended (agent exit code {code})"
    elif left:
        outcome = "run went on without this host (every rank lost)"
    say(f"{outcome} after {lasted:.0f}s; re-dialing in {backoff:g}s (--persist)")
    return backoff


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").split()
    except OSError:
        return []


@contextlib.contextmanager
def _fork_server(plan: JoinPlan, directory: str) -> Iterator[api.HostForkServer | None]:
    """The fork server of a persist loop (in its private `directory`), stopped when the loop ends; None
    when not asked for, or when this host's ranks are not CPU ranks named up front (they start cold).
    """
    forks = None
    if plan.fork_server:
        try:
            forks = api.HostForkServer.start(plan.spec.devices, directory, os.environ, drop=(TOKEN_ENV,))
            devices = plan.spec.devices
            if forks is None and devices:
                say(f"fork server not started, ranks start cold: devices {devices} are not all CPU ranks")
            elif forks is None:
                say("fork server not started, ranks start cold: name this host's CPU ranks (--devices cpu:N)")
        except OSError as error:
            say(f"fork server not started, ranks start cold: {error}")
    try:
        yield forks
    finally:
        if forks is not None:
            forks.close()


def main(args: argparse.Namespace) -> int:
    try:
        args.program_args = reparse(args, _add_options, lambda p: p.add_argument("controller", nargs="?"))
        plan = resolve_plan(args)
    except UsageError as error:
        say(str(error))
        return EXIT_PERMANENT
    say(
        f"joining {plan.spec.controller_host}:{plan.spec.controller_port} as {plan.spec.host!r}"
        + (" (persist)" if plan.persist else "")
    )
    # SIGTERM between attempts (the back-off) ends the loop with a word, as it does during one.
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        return join_loop(plan)
    except KeyboardInterrupt:
        say("stopped")
        return EXIT_TRANSIENT
    except Stopped as stopped:
        say(f"stopped ({signal.Signals(stopped.args[0]).name}); not re-dialing")
        return EXIT_TRANSIENT
    finally:
        signal.signal(signal.SIGTERM, previous)


COMMAND = Command(
    "join", "walk in: run a program in agent role against a controller", __doc__, configure_parser, main
)

if __name__ == "__main__":
    sys.exit(COMMAND.standalone())
