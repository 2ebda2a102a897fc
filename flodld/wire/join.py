"""Join-channel messages (kinds 0x0101..): agent ⇄ controller admission and the formed world.

Sequence: agent → Hello; controller → Accept or Reject; later → WorldFormed or Abort; agent → RankExited
per rank child; the agent closing its side means the host is done. See docs/protocol.md.

`JOIN_PROTOCOL_VERSION` is what `Hello.protocol_version` carries: the version of these messages, independent
of the frame format's version (flodld/wire/frames.py). Version 2: `WorldEnvelope` no longer lists every host
of the world (O(world) bytes per host, O(world²) per formation, and capped at MAX_LIST_ITEMS hosts); the
roster is in state.json (`members`, paged). Version 3: `RelaySpec.tolerance` and `KillRank` (elastic
averaging, docs/elastic-averaging.md): a version 2 agent would refuse the first and drop its link on the
second, so it is refused at its Hello instead. Version 5: `RelaySpec.walk_in` (growth during training,
docs/elastic-averaging.md "Growth and healing"), which a version 4 agent would refuse, and `Reform` and
`Stopped` (a restart keeps the join links, docs/restarts.md), on the first of which a version 4 agent would
drop its link: either way it is refused at its Hello instead. Version 6: `RelaySpec.grows` (a run that admits
walk-ins during training: a rank lost on a host that keeps running heals in as a walk-in of its own,
flodld/agent/host.py), which a version 5 agent would refuse. Version 7: `Hello.rides` and `RelaySpec.rides`
(a healed slot's rank rides its host's relay, docs/elastic-averaging.md "Slots heal in place"), which a
version 6 controller would refuse.
"""

from __future__ import annotations

from typing import Annotated, Final

from pydantic import AfterValidator, Field, StringConstraints, field_validator, model_validator

from flodld.wire.messages import (
    MAX_LIST_ITEMS,
    MAX_TAIL_CHARS,
    MAX_TAIL_LINES,
    BoundedList,
    HexDigest,
    HostName,
    Message,
    Name,
    Port,
    Rank,
    Reason,
    ReasonCode,
    ShortText,
    WireModel,
    register,
)
from flodld.wire.salt import SaltHex

JOIN_PROTOCOL_VERSION: Final = 7
MAX_RESTARTS: Final = 1000  # the most restarts a run may be configured for (controller.join.max_restarts)

DeviceName = Annotated[
    str, StringConstraints(min_length=3, max_length=32, pattern=r"^[a-z][a-z0-9_]*:[0-9]{1,5}$")
]
"""A torch device with its index: "cpu:0", "cuda:1"."""

NcclVersion = Annotated[
    str, StringConstraints(max_length=32, pattern=r"^[0-9]{1,4}\.[0-9]{1,4}(\.[0-9]{1,4})?$")
]
"""Major.minor[.patch], e.g. "2.27"."""

EnvName = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("environment values cannot contain NUL characters")
    return value


EnvValue = Annotated[str, StringConstraints(max_length=16384), AfterValidator(_no_nul)]

Seconds = Annotated[float, Field(ge=0, le=10**9)]
ExitCode = Annotated[int, Field(ge=-128, le=255)]


def _bounded_lines(value: str) -> str:
    if value.count("\n") >= MAX_TAIL_LINES:
        raise ValueError(f"an output tail holds at most {MAX_TAIL_LINES} lines")
    return value


OutputTail = Annotated[str, StringConstraints(max_length=MAX_TAIL_CHARS), AfterValidator(_bounded_lines)]
"""A rank's last output lines, newline-separated: at most MAX_TAIL_LINES lines, MAX_TAIL_CHARS characters."""

UnixSeconds = Annotated[float, Field(ge=0, le=10**11)]


def _require_unique(values: list[str] | list[int], what: str) -> None:
    seen: set[str | int] = set()
    for value in values:
        if value in seen:
            raise ValueError(f"{what} lists {value!r} twice; each entry must be unique")
        seen.add(value)


@register(0x0101)
class Hello(Message):
    """The agent's admission request: who it is, what it brings, what it was built against."""

    host: HostName
    devices: BoundedList[DeviceName]
    device_labels: BoundedList[ShortText]
    variant: Name
    torch_version: Name
    protocol_version: Annotated[int, Field(ge=0, le=0xFFFF)]
    dataset_sig: HexDigest | None = None
    run_id: Name | None = None
    nccl_version: NcclVersion | None = None
    model_sig: HexDigest | None = None
    averaging: Name | None = None
    # A healed slot (flodld/agent/host.py) asks for its ranks to ride the relay of the host it healed in
    # from, named `HOST+N` after it: no relay of its own, one host less in every round. The controller
    # grants it (RelaySpec.rides) only for that host while its relay serves the run.
    rides: HostName | None = None

    @model_validator(mode="after")
    def _devices_consistent(self) -> Hello:
        _require_unique(self.devices, "devices")
        if self.rides is not None and not self.host.startswith(self.rides + "+"):
            raise ValueError(
                f"host {self.host!r} asks to ride host {self.rides!r}'s relay; only a healed slot of that "
                f"host, named {self.rides + '+N'!r}, may"
            )
        if self.device_labels and len(self.device_labels) != len(self.devices):
            raise ValueError(
                f"device_labels has {len(self.device_labels)} entries for {len(self.devices)} devices; "
                "send one label per device, or none"
            )
        return self


@register(0x0102)
class Accept(Message):
    """Admission granted: provisional ranks; `salt_hex` only under open admission."""

    ranks: BoundedList[Rank]
    salt_hex: SaltHex | None = None
    formation_wait_secs: Seconds
    run_id: Name

    @field_validator("ranks")
    @classmethod
    def _unique_ranks(cls, ranks: list[int]) -> list[int]:
        _require_unique(ranks, "ranks")
        return ranks


@register(0x0103)
class Reject(Message):
    """Admission refused, with a stable code and a sentence for the operator."""

    code: ReasonCode
    reason: Reason


class WorldEnvelope(WireModel):
    """What one host needs to start its ranks: its global ranks and the world around them.

    O(1) in the world's size (plus the run's env): no host list, so formation sends O(hosts) bytes in total
    and no world size is capped by a list bound.
    """

    run_id: Name
    world_size: Annotated[int, Field(ge=1, le=2**31)]
    ranks: BoundedList[Rank]
    local_world_size: Annotated[int, Field(ge=1, le=MAX_LIST_ITEMS)]
    controller_host: HostName
    controller_port: Port
    averaging: Name
    backend: Name
    env: Annotated[dict[EnvName, EnvValue], Field(max_length=MAX_LIST_ITEMS)]
    # The attempt this world is (0 first; a restart forms a fresh world with the next number) and the
    # run's bound: the ranks see them as TORCHELASTIC_RESTART_COUNT / TORCHELASTIC_MAX_RESTARTS.
    restart_count: Annotated[int, Field(ge=0, le=MAX_RESTARTS)] = 0
    max_restarts: Annotated[int, Field(ge=0, le=MAX_RESTARTS)] = 0

    @model_validator(mode="after")
    def _ranks_fit_the_world(self) -> WorldEnvelope:
        if not self.ranks:
            raise ValueError("ranks is empty; a host in the world runs at least one rank")
        first = self.ranks[0]
        if self.ranks != list(range(first, first + len(self.ranks))):
            raise ValueError(f"ranks {self.ranks} are not contiguous and ascending")
        if self.ranks[-1] >= self.world_size:
            raise ValueError(f"rank {self.ranks[-1]} does not fit a world of size {self.world_size}")
        if self.local_world_size != len(self.ranks):
            raise ValueError(f"local_world_size {self.local_world_size} != number of ranks {len(self.ranks)}")
        return self


class RelaySpec(WireModel):
    """Where this host's relay reaches the controller and how it folds."""

    data_port: Port
    control_port: Port
    fold: Name
    cadence: Annotated[int, Field(ge=1, le=2**31)]
    # Rank failures the run survives (docs/elastic-averaging.md): above 0 the agent keeps a failed rank's
    # host-mates running (the averaging folds the loss out) and the controller decides when too many failed.
    tolerance: Annotated[int, Field(ge=0, le=2**31)] = 0
    # cpu_cadence/cpu_async (docs/elastic-averaging.md): seconds after a round's first deposit before the
    # relay closes it without the local ranks still owing theirs (skipped for that round only); None: wait.
    straggler_timeout: Annotated[float, Field(gt=0, le=86_400)] | None = None
    # Growth (docs/elastic-averaging.md, "Growth and healing"): this host walked in while the run trained.
    # Its relay enters the averaging at a round boundary (the controller's Entry) and hands its ranks the
    # last averaged state before their first deposit.
    walk_in: bool = False
    # The run admits walk-ins during training (controller.join.elastic_max_ranks): the agent offers a slot it
    # lost a rank from (the rank failed or was declared dead, its host-mates run on) as a walk-in of its own,
    # `HOST+N` (flodld/agent/host.py), so the slot heals while the host keeps training.
    grows: bool = False
    # Granted to a healed slot that asked (Hello.rides): its ranks use that host's relay (the same agent's),
    # and no relay of this host's starts. None: the walk-in starts its own relay.
    rides: HostName | None = None


@register(0x0104)
class WorldFormed(Message):
    envelope: WorldEnvelope
    relay: RelaySpec | None = None


@register(0x0105)
class RankExited(Message):
    """A rank child exited; a negative code is the signal that killed it.

    The rest feeds the run's root cause (flodld/membership/rootcause.py): `failed_at` is the agent's wall
    clock when the rank failed (its error file written or its traceback begun, else its process's end);
    `torn_down` marks an exit that followed this host's teardown (the agent TERMed the rank: a consequence,
    never a root cause); `error` is the exception the rank's `@record` wrote to its TORCHELASTIC_ERROR_FILE;
    `tail` the rank's last output lines, secrets scrubbed by the agent.
    Older agents send none of them.
    """

    rank: Rank
    code: ExitCode
    failed_at: UnixSeconds | None = None
    torn_down: bool = False
    error: Reason | None = None
    tail: OutputTail | None = None


@register(0x0106)
class Abort(Message):
    reason: Reason


@register(0x0107)
class KillRank(Message):
    """The controller declared one of this host's ranks dead (silent past the heartbeat timeout) in a run
    that survives it: the agent has the rank dump its Python stack (faulthandler) and kills it. The rank's
    exit is reported as any other (RankExited), its output tail carrying the dump.
    """

    rank: Rank
    reason: Reason


@register(0x0108)
class Reform(Message):
    """The attempt failed and the run restarts (docs/restarts.md): the agent stops this attempt's ranks and
    relay as at an Abort, reports their exits, answers `Stopped` and stays linked. The next attempt re-admits
    it on this same link with an `Accept` (its `salt_hex` the next attempt's salt, sent under this one's keys:
    both sides rekey after it) and then its `WorldFormed`; a link closed or an `Abort` instead ends the host.
    """

    reason: Reason


@register(0x0109)
class Stopped(Message):
    """Agent → controller after a `Reform`: every rank and the relay of the attempt are gone (their exits
    reported first); the host waits on this link for the next attempt.
    """
