"""The agent's spec (hex JSON in FLODL_INTERNAL_AGENT_JSON) and the resolution of its devices.

The spec rides the environment, never argv, because it may carry the pre-shared salt: any local
user can read another process's command line through `ps`. A launcher that starts the agent before
it knows the spec (`fdl run` starts its local agents while its controller comes up, so the agent's
imports overlap the controller's) sets the variable to `-` and writes the hex spec as one line on
the agent's stdin once it is known; the salt then never sits in the agent's environment at all.
"""

from __future__ import annotations

import os
import sys
from typing import IO, Annotated, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flodld.agent.ranklogs import RankLogSpec
from flodld.config.fields import AveragingMode
from flodld.config.rolespec import SpecError, decode_hex_json, encode_spec
from flodld.wire.salt import SaltHex

AGENT_ENV: Final = "FLODL_INTERNAL_AGENT_JSON"
SPEC_ON_STDIN: Final = "-"  # AGENT_ENV's value when the spec arrives as one line on stdin
LEFT_RUN_MARK: Final = "left"  # the formed file's second line: the host lost every rank, the run goes on
MAX_SPEC_LINE: Final = 1 << 20  # a spec is a few KiB of hex; anything longer is not one

__all__ = [
    "AGENT_ENV",
    "LEFT_RUN_MARK",
    "MAX_SPEC_LINE",
    "SPEC_ON_STDIN",
    "AgentSpec",
    "DeviceError",
    "SpecError",
    "agent_spec_from_env",
    "decode_agent_spec",
    "device_label",
    "encode_spec",
    "parse_device_list",
    "resolve_devices",
]


class AgentSpec(BaseModel):
    """What an agent needs to join: where the controller is, who this host is, what it offers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: Annotated[str, Field(min_length=1, max_length=253)]
    controller_host: Annotated[str, Field(min_length=1, max_length=253)]
    controller_port: Annotated[int, Field(ge=1, le=65535)]
    salt_hex: SaltHex | None = None
    devices: Annotated[list[str], Field(max_length=4096)] | None = None
    run_id: Annotated[str, Field(max_length=128)] | None = None
    averaging: AveragingMode | None = None
    connect_attempts: Annotated[int, Field(ge=1)] | None = None
    grace_secs: Annotated[float, Field(gt=0)] = 5.0
    # True only when the operator's own launcher started this agent (fan-out): the controller's
    # `env` is then the operator's and applies unfiltered. False (walk-ins, and any spec that does
    # not say) filters it through flodld.agent.envpolicy.
    # (Unset fields stay out of the encoded spec: None, not False or [].)
    cluster_env: bool | None = None
    accept_env: (
        Annotated[
            list[Annotated[str, Field(max_length=256, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]],
            Field(max_length=4096),
        ]
        | None
    ) = None
    # This worker's own rank environment from the operator's fdl.yml (`workers[].env`, and
    # NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME from `nccl_socket_ifname`): set only by the operator's
    # launcher, applied over the controller's cluster-scope `env` (WorkerConfig.rank_env).
    host_env: (
        Annotated[
            dict[Annotated[str, Field(max_length=256, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")], str],
            Field(max_length=4096),
        ]
        | None
    ) = None
    # The rank's command line (interpreter, program, arguments): the agent (`python -m flodld.agent`)
    # starts exactly this once per rank, so the user's program only ever runs as a rank. None: the
    # agent is itself the user's program (which called exit_if_worker_role()) and re-enters it.
    program: (
        Annotated[list[Annotated[str, Field(max_length=65536)]], Field(min_length=1, max_length=4096)] | None
    ) = None
    # A file the agent writes the run id to once its world has formed: `fdl join --persist` resets its
    # back-off after a run that formed, however it ended (the exit code alone cannot say so); a second
    # line, LEFT_RUN_MARK, when the host lost every rank and the run may go on without it.
    formed_file: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    # Per-rank log files (--log-dir/--redirects/--tee, or fdl.yml `logs:`): this host's own setting, set
    # by the launcher on this host (fdl run, fdl join), never by the controller (flodld.agent.ranklogs).
    logs: RankLogSpec | None = None


def decode_agent_spec(text: str) -> AgentSpec:
    return AgentSpec.model_validate(decode_hex_json(text, AGENT_ENV))


def agent_spec_from_env(stdin: IO[str] | None = None) -> AgentSpec:
    """The spec from AGENT_ENV, or from one line of `stdin` (default sys.stdin) when AGENT_ENV is `-`."""
    text = os.environ.get(AGENT_ENV)
    if text is None:
        raise SpecError(f"{AGENT_ENV} is not set; the agent role needs its spec there")
    if text == SPEC_ON_STDIN:
        line = (stdin or sys.stdin).readline(MAX_SPEC_LINE + 1)
        if not line.endswith("\n"):
            raise SpecError(
                f"{AGENT_ENV}={SPEC_ON_STDIN}: stdin "
                + ("ended before the spec line did (the launcher went away)" if len(line) <= MAX_SPEC_LINE
                   else f"sent a line over {MAX_SPEC_LINE} bytes, which is no spec")
            )  # fmt: skip
        text = line.strip()
    try:
        return decode_agent_spec(text)
    except ValidationError as error:
        raise SpecError(f"{AGENT_ENV} holds an invalid agent spec: {error}") from None


class DeviceError(ValueError):
    """A device list cannot be resolved; the message names the entry and the accepted forms."""


_DEVICE_FORMS = (
    "accepted forms: 'cpu' (one CPU rank), 'cpu:N' (N CPU ranks), 'cuda:I' or 'I' (CUDA device I), 'all'"
)


def parse_device_list(text: str) -> list[str]:
    """Split a `--devices` value ('cpu:4', '0,1', 'cpu,cpu', 'all') into entries."""
    entries = [part.strip() for part in text.split(",") if part.strip()]
    if not entries:
        raise DeviceError(f"--devices {text!r} names no device; {_DEVICE_FORMS}")
    return entries


def resolve_devices(requested: list[str] | None, *, cuda_count: int | None = None) -> list[str]:
    """Indexed torch device names, one per rank: ['cpu:0', 'cpu:1'] or ['cuda:0', 'cuda:3'].

    Absent: every CUDA device, else one CPU rank. `cuda_count` is probed through torch when None.
    """

    def cuda_devices() -> int:
        if cuda_count is not None:
            return cuda_count
        import torch  # only when GPUs are asked for: the agent is a light process, no torch otherwise

        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    if not requested:
        count = cuda_devices()
        return [f"cuda:{index}" for index in range(count)] if count else ["cpu:0"]
    resolved: list[str] = []
    cpu_ranks = 0
    for entry in requested:
        name = entry.strip().lower()
        if name == "cpu":
            resolved.append(f"cpu:{cpu_ranks}")
            cpu_ranks += 1
        elif name.startswith("cpu:"):
            count = _integer(name[4:], entry)
            if count < 1:
                raise DeviceError(f"device entry {entry!r} asks for {count} CPU ranks; ask for at least 1")
            resolved.extend(f"cpu:{cpu_ranks + index}" for index in range(count))
            cpu_ranks += count
        elif name == "all":
            count = cuda_devices()
            if not count:
                raise DeviceError(
                    "device entry 'all' found no CUDA device; offer CPU ranks with 'cpu:N' instead"
                )
            resolved.extend(f"cuda:{index}" for index in range(count))
        else:
            index = _integer(name[5:] if name.startswith("cuda:") else name, entry)
            count = cuda_devices()
            if index >= count:
                raise DeviceError(
                    f"device entry {entry!r}: this host has {count} CUDA device(s); {_DEVICE_FORMS}"
                )
            resolved.append(f"cuda:{index}")
    duplicates = {device for device in resolved if resolved.count(device) > 1}
    if duplicates:
        raise DeviceError(
            f"devices {sorted(duplicates)} are listed more than once; each device runs one rank"
        )
    return resolved


def _integer(text: str, entry: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise DeviceError(f"device entry {entry!r} is not understood; {_DEVICE_FORMS}") from None


def device_label(device: str) -> str:
    """A human label for the roster: the GPU's name, or 'CPU'."""
    if device.startswith("cuda:"):
        import torch  # only for a GPU's name: the agent is a light process, no torch otherwise

        try:
            return str(torch.cuda.get_device_name(int(device[5:])))[:256]
        except (RuntimeError, AssertionError):
            return device
    return "CPU"
