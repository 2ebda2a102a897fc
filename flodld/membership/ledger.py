"""The admission ledger: who joined, in what order, with which ranks, and who was turned away.

Rules:
- Checks run in one fixed order (`ADMISSION_CHECKS`); the first that fails refuses the hello with a
  stable reason code and a sentence saying what differs and how to fix it. Refusals burn no rank ids.
- Ranks are contiguous in admission order: each member's ranks follow the previous member's. Retracting a
  member shifts every later member down, so the ranks stay contiguous with no holes.
- Cohort references (vendor, dataset, run id, NCCL, model) come from the ledger's configuration when given,
  otherwise from the earliest current member that carries one, so a retracted member pins nothing.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from flodld.membership.policy import MAX_WORLD_RANKS, WindowPolicy
from flodld.wire.join import JOIN_PROTOCOL_VERSION, Hello

SUPPORTED_PROTOCOL_VERSION = JOIN_PROTOCOL_VERSION
MAX_RANKS_PER_HOST = 256


@dataclass(frozen=True)
class Member:
    """One admitted host, as its hello described it; `joined_at` is the controller's `now` at admission."""

    host: str
    devices: tuple[str, ...]
    device_labels: tuple[str, ...]
    variant: str
    torch_version: str
    joined_at: float
    dataset_sig: str | None = None
    run_id: str | None = None
    nccl_version: str | None = None
    model_sig: str | None = None

    @property
    def vendor(self) -> str:
        return device_vendor(self.devices[0])


@dataclass(frozen=True)
class Admitted:
    member: Member
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Refused:
    code: str
    reason: str


@dataclass(frozen=True)
class World:
    """The world: hosts in admission order, each with contiguous global ranks at formation (a host of a
    grown world that was lost and walked in again holds its lost ranks and its fresh ones, two ranges).
    """

    members: tuple[Member, ...]
    ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)

    # Cached: the world is frozen, and these are read per rank exit and per envelope.
    @cached_property
    def hosts(self) -> tuple[str, ...]:
        return tuple(m.host for m in self.members)

    @cached_property
    def world_size(self) -> int:
        return sum(len(r) for r in self.ranks.values())


def device_vendor(device: str) -> str:
    """The device type of `"cuda:1"` / `"cpu:0"` / `"cpu"`: everything before the colon."""
    return device.split(":", 1)[0].strip().lower()


def nccl_major_minor(version: str) -> tuple[int, int] | None:
    """`"2.27.5"` -> (2, 27); None when the text is not `major.minor[...]`."""
    parts = version.strip().split(".")
    if len(parts) < 2 or not (parts[0].isdigit() and parts[1].isdigit()):
        return None
    return int(parts[0]), int(parts[1])


def _short(sig: str) -> str:
    return sig[:8] + "…"


class Ledger:
    """Admits hellos into contiguous rank ranges; the controller's shell serializes the calls."""

    def __init__(
        self,
        policy: WindowPolicy,
        roster: Sequence[str] = (),
        *,
        dataset_sig: str | None = None,
        model_sig: str | None = None,
        run_id: str | None = None,
        protocol_version: int = SUPPORTED_PROTOCOL_VERSION,
        max_world_ranks: int = MAX_WORLD_RANKS,
        declared: Mapping[str, int] | None = None,
    ) -> None:
        if not 1 <= max_world_ranks <= MAX_WORLD_RANKS:
            raise ValueError(f"max_world_ranks must be in 1..{MAX_WORLD_RANKS}, got {max_world_ranks}")
        self.policy = policy
        self.max_world_ranks = max_world_ranks
        self.roster: tuple[str, ...] = tuple(roster)
        # Roster host -> the rank count its `local_devices` declares (capacity counts that many, so a
        # host offering more would push the world past the target); hosts with `all` are absent.
        self.declared: dict[str, int] = dict(declared or {})
        self.protocol_version = protocol_version
        self._configured: dict[str, str | None] = {
            "dataset_sig": dataset_sig,
            "model_sig": model_sig,
            "run_id": run_id,
        }
        # Admission order is the dict's insertion order; `_first_rank` and `_joined_ranks` are running
        # indexes so admission and per-member rank look-ups stay O(1) in a storm of thousands of hellos.
        self._members: dict[str, Member] = {}
        self._first_rank: dict[str, int] = {}
        self._joined_ranks = 0
        self._roster_set = frozenset(self.roster)
        self.refused_counts: Counter[str] = Counter()
        # Admissions ever made (retracted members included): they only go up (/metrics).
        self.admitted_hosts = 0
        self.admitted_ranks = 0
        # Running summaries for state.json (`member_counts`), and a counter of every change it shows.
        self.variant_counts: Counter[str] = Counter()
        self.vendor_counts: Counter[str] = Counter()
        self.generation = 0
        self.closed = False

    # --- queries -------------------------------------------------------------------------------

    @property
    def members(self) -> tuple[Member, ...]:
        return tuple(self._members.values())

    def members_slice(self, start: int, stop: int) -> list[Member]:
        """Members `start` (inclusive) to `stop` (exclusive) in admission order: O(stop), not O(members)."""
        return list(itertools.islice(self._members.values(), start, stop))

    @property
    def member_count(self) -> int:
        return len(self._members)

    @property
    def first_member(self) -> Member | None:
        return next(iter(self._members.values()), None)

    @property
    def joined_ranks(self) -> int:
        return self._joined_ranks

    def first_ranks(self) -> dict[str, int]:
        """Each member's first rank as it stands now (a copy, O(members) at C speed): with `members`, a view
        of the ranks that later admissions and retractions do not change.
        """
        return dict(self._first_rank)

    def ranks_of(self, host: str) -> tuple[int, ...]:
        """The host's current ranks; they shift down when an earlier member is retracted."""
        member = self._members.get(host)
        if member is None:
            raise KeyError(f"host {host!r} is not a member of this run")
        start = self._first_rank[host]
        return tuple(range(start, start + len(member.devices)))

    def member(self, host: str) -> Member | None:
        return self._members.get(host)

    def in_roster(self, host: str) -> bool:
        return host in self._roster_set

    # --- transitions ---------------------------------------------------------------------------

    def admit(self, hello: Hello, now: float) -> Admitted | Refused:
        """Run every check in order; on success append the host and hand out the next ranks."""
        return self._admit(hello, now, ADMISSION_CHECKS)

    def admit_walk_in(self, hello: Hello, now: float) -> Admitted | Refused:
        """After formation, in a run that grows (flodld.membership.growth decided it may): every check but
        the window's and the duplicate name's, then the next ranks (fresh ids: never a retracted or lost
        one's). A host of the formed world walking in again keeps its place in the member order, its new
        ranks are the fresh ones (`ranks_of`).
        """
        previous = self._members.get(hello.host)
        outcome = self._admit(hello, now, WALK_IN_CHECKS)
        if previous is not None and isinstance(outcome, Admitted):
            self._count(previous, -1)
        return outcome

    def _admit(
        self, hello: Hello, now: float, checks: tuple[AdmissionCheck, ...]
    ) -> Admitted | Refused:
        for check in checks:
            refusal = check(self, hello)
            if refusal is not None:
                self.refused_counts[refusal.code] += 1
                self.generation += 1
                return refusal
        member = Member(
            host=hello.host,
            devices=tuple(hello.devices),
            device_labels=tuple(hello.device_labels),
            variant=hello.variant,
            torch_version=hello.torch_version,
            joined_at=now,
            dataset_sig=hello.dataset_sig,
            run_id=hello.run_id,
            nccl_version=hello.nccl_version,
            model_sig=hello.model_sig,
        )
        self._members[member.host] = member
        self._first_rank[member.host] = self._joined_ranks
        self._joined_ranks += len(member.devices)
        self.admitted_hosts += 1
        self.admitted_ranks += len(member.devices)
        self._count(member, 1)
        return Admitted(member, self.ranks_of(member.host))

    def refuse(self, code: str, reason: str) -> Refused:
        """Record a refusal decided outside the ledger's own checks (e.g. a bad first frame)."""
        self.refused_counts[code] += 1
        self.generation += 1
        return Refused(code, reason)

    def retract(self, host: str) -> tuple[int, ...]:
        """Remove a member before formation and return the ranks it held; later members shift down."""
        if self.closed:
            raise ValueError(
                f"cannot retract {host!r}: the world is frozen (ranks are final after formation)"
            )
        ranks = self.ranks_of(host)
        self._count(self._members.pop(host), -1)
        self._reindex()
        return ranks

    def _count(self, member: Member, step: int) -> None:
        self.generation += 1
        for counter, key in ((self.variant_counts, member.variant), (self.vendor_counts, member.vendor)):
            counter[key] += step
            if counter[key] <= 0:
                del counter[key]

    def _reindex(self) -> None:
        """Recompute every member's first rank after a retraction (O(members), rare)."""
        self._first_rank.clear()
        start = 0
        for host, member in self._members.items():
            self._first_rank[host] = start
            start += len(member.devices)
        self._joined_ranks = start

    def close(self) -> None:
        """Stop admitting; later hellos are refused with `window_closed`."""
        self.closed = True

    def freeze(self) -> World:
        """Close the ledger and return the final world (admission order, contiguous ranks)."""
        self.closed = True
        members = self.members
        return World(members, {m.host: self.ranks_of(m.host) for m in members})

    # --- cohort references -----------------------------------------------------------------------

    def reference(self, attribute: str) -> tuple[str, str] | None:
        """(value, who set it) for a cohort-wide attribute, or None while nobody has set one."""
        configured = self._configured.get(attribute)
        if configured is not None:
            return configured, "the controller"
        for member in self._members.values():
            value = getattr(member, attribute)
            if value is not None:
                return str(value), repr(member.host)
        return None


# --- the checks, in admission order ---------------------------------------------------------------


def _window_open(ledger: Ledger, hello: Hello) -> Refused | None:
    if ledger.closed:
        return Refused(
            "window_closed", f"host {hello.host!r}: the join window is closed; wait for the next run"
        )
    return None


def _protocol_version(ledger: Ledger, hello: Hello) -> Refused | None:
    if hello.protocol_version != ledger.protocol_version:
        return Refused(
            "protocol_version",
            f"host {hello.host!r} speaks join protocol version {hello.protocol_version}, this controller "
            f"speaks {ledger.protocol_version}; run the same flodld release on both sides",
        )
    return None


def _duplicate_host(ledger: Ledger, hello: Hello) -> Refused | None:
    if ledger.member(hello.host) is not None:
        return Refused(
            "duplicate_host",
            f"host {hello.host!r} already joined this run (a stale worker from a previous launch, or two "
            "workers sharing one host name); give each worker a distinct --host",
        )
    return None


def _roster(ledger: Ledger, hello: Hello) -> Refused | None:
    policy = ledger.policy
    if not ledger.roster or policy.admits_walk_ins or ledger.in_roster(hello.host):
        return None
    return Refused(
        "unknown_host",
        f"host {hello.host!r} is not in the configured workers ({', '.join(ledger.roster)}) and the window "
        f"does not wait for walk-ins (target {policy.target}, capacity {policy.capacity}); raise "
        "controller.join.target_ranks above capacity, or set discovery: true",
    )


def _device_list(ledger: Ledger, hello: Hello) -> Refused | None:
    if not hello.devices:
        return Refused(
            "empty_devices",
            f"host {hello.host!r} offered no devices (a worker with no ranks cannot train); offer at least "
            "one",
        )
    if len(hello.devices) > MAX_RANKS_PER_HOST:
        return Refused(
            "too_many_devices",
            f"host {hello.host!r} offered {len(hello.devices)} devices, over the per-host cap "
            f"{MAX_RANKS_PER_HOST}",
        )
    # Duplicate device names and empty host names never get here: the Hello model refuses them.
    return None


def _declared_devices(ledger: Ledger, hello: Hello) -> Refused | None:
    declared = ledger.declared.get(hello.host)
    if declared is None or len(hello.devices) <= declared:
        return None
    return Refused(
        "declared_devices",
        f"host {hello.host!r} is declared with {declared} rank(s) in the configured workers (local_devices) "
        f"and offers {len(hello.devices)} devices; scope the offer to {declared} (fdl join --devices), or "
        f"list {len(hello.devices)} devices in its local_devices",
    )


def _world_limit(ledger: Ledger, hello: Hello) -> Refused | None:
    if ledger.joined_ranks + len(hello.devices) <= ledger.max_world_ranks:
        return None
    return Refused(
        "world_full",
        f"host {hello.host!r} offers {len(hello.devices)} rank(s) and the world already holds "
        f"{ledger.joined_ranks} of at most {ledger.max_world_ranks}; this run cannot take more ranks",
    )


def _vendor_mix(ledger: Ledger, hello: Hello) -> Refused | None:
    vendors = sorted({device_vendor(d) for d in hello.devices})
    if len(vendors) > 1:
        return Refused(
            "vendor_mix",
            f"host {hello.host!r} offers a mix of {' and '.join(vendors)} devices; one host's ranks must all "
            "use one device type — scope the offer with --devices",
        )
    first = ledger.first_member
    if first is not None and first.vendor != vendors[0]:
        return Refused(
            "vendor_mix",
            f"this run's cohort is {first.vendor} (seeded by {first.host!r}) and {hello.host!r} offers "
            f"{vendors[0]}; a mixed cohort cannot form one communicator — use a one-vendor fleet",
        )
    return None


def _dataset(ledger: Ledger, hello: Hello) -> Refused | None:
    return _same_signature(
        ledger,
        hello,
        "dataset_sig",
        "dataset_mismatch",
        "dataset signature mismatch",
        "the worker was built against a different dataset shard layout",
    )


def _run_id(ledger: Ledger, hello: Hello) -> Refused | None:
    return _same_signature(
        ledger,
        hello,
        "run_id",
        "run_id_mismatch",
        "run identity mismatch",
        "a publish landed between the fetches; the stale side picks the new run up on its next dial",
    )


def _nccl(ledger: Ledger, hello: Hello) -> Refused | None:
    if hello.nccl_version is None:
        return None
    offered = nccl_major_minor(hello.nccl_version)
    if offered is None:
        return Refused(
            "nccl_skew",
            f"host {hello.host!r} reports NCCL version {hello.nccl_version!r}, expected major.minor[.patch]",
        )
    reference = ledger.reference("nccl_version")
    if reference is None:
        return None
    expected = nccl_major_minor(reference[0])
    if expected is not None and expected != offered:
        return Refused(
            "nccl_skew",
            f"NCCL version skew: this cohort loads {expected[0]}.{expected[1]}.x (set by {reference[1]}) and "
            f"{hello.host!r} loads {offered[0]}.{offered[1]}.x — NCCL refuses its handshake across "
            "major.minor skew; install the same torch build (and its nvidia-nccl wheel) on every host — "
            "`fdl probe` on each host (or `fdl @cluster probe`) shows the versions",
        )
    return None


def _model(ledger: Ledger, hello: Hello) -> Refused | None:
    return _same_signature(
        ledger,
        hello,
        "model_sig",
        "model_mismatch",
        "model mismatch",
        "the hosts run different versions of the program (the model signature is the SHA-256 of the "
        "Python file the ranks run); put the same file on every host — `sha256sum PROGRAM` on each host "
        "shows which copy differs — then join again",
    )


def _same_signature(
    ledger: Ledger, hello: Hello, attribute: str, code: str, what: str, why: str
) -> Refused | None:
    offered = getattr(hello, attribute)
    if offered is None:
        return None
    reference = ledger.reference(attribute)
    if reference is None or reference[0] == offered:
        return None
    return Refused(
        code,
        f"{what}: {hello.host!r} has {_short(offered)}, the run has {_short(reference[0])} "
        f"(set by {reference[1]}) — {why}",
    )


AdmissionCheck = Callable[[Ledger, Hello], Refused | None]

ADMISSION_CHECKS: tuple[AdmissionCheck, ...] = (
    _window_open,
    _protocol_version,
    _duplicate_host,
    _roster,
    _device_list,
    _declared_devices,
    _world_limit,
    _vendor_mix,
    _dataset,
    _run_id,
    _nccl,
    _model,
)

WALK_IN_CHECKS: tuple[AdmissionCheck, ...] = tuple(
    check for check in ADMISSION_CHECKS if check not in (_window_open, _duplicate_host)
)
"""A walk-in during training (flodld.membership.growth): the window is closed and a returning host's name is
taken, both decided there."""
