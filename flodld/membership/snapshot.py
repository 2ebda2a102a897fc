"""`state.json`: the run's membership state as served on the controller port.

Built at `now`, so the countdowns are live rather than frozen at the last event (the controller caches
one build per state change and per interval, see flodld/controller/status/snapshot.py). `members` is one page
(by default the first `DEFAULT_MEMBER_PAGE` hosts in admission order; `?members=A..B` or `?members=all`
asks for others) and `members_page` says which; `member_counts` summarizes every member. It never
carries the salt or the token. `docs/state-schema.json` is `state_schema()`; regenerate it with
`python -m flodld.membership docs/state-schema.json`.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from flodld.membership.phase import Phase
from flodld.membership.policy import StartMode

DEFAULT_MEMBER_PAGE = 500
"""Hosts listed in `members` when the reader asks for no page (the status page renders as many)."""


class LinkState(StrEnum):
    """A member's join link: `open`, closed cleanly after its ranks reported (`closed`), or `lost`."""

    OPEN = "open"
    CLOSED = "closed"
    LOST = "lost"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MemberState(_Model):
    """One admitted host."""

    host: str
    ranks: list[int]
    devices: list[str]
    device_labels: list[str]
    variant: str
    joined_at_secs: float = Field(description="Seconds after the window opened.")
    link: LinkState


class MembersPage(_Model):
    """Which members `members` lists: indexes `start` (inclusive) to `stop` (exclusive) in admission order."""

    start: int = Field(ge=0)
    stop: int = Field(ge=0)
    total: int = Field(ge=0, description="Every member (equal to joined_hosts).")


class MemberCounts(_Model):
    """Every member summarized, whatever page `members` lists."""

    by_link: dict[str, int] = Field(
        default_factory=dict, description="Hosts by join-link state (open / closed / lost)."
    )
    by_variant: dict[str, int] = Field(default_factory=dict, description="Hosts by build variant.")
    by_vendor: dict[str, int] = Field(
        default_factory=dict, description="Hosts by device type (cpu, cuda, ...)."
    )


class RankExit(_Model):
    """A rank's exit code as its agent reported it (negative: killed by that signal)."""

    rank: int
    code: int


class RankLossState(_Model):
    """A rank the run lost and survived (docs/elastic-averaging.md), or one of those that failed it."""

    rank: int
    host: str
    cause: str = Field(description="How it was lost: its exit, a heartbeat silence, its host's loss.")
    round: int | None = Field(
        default=None, description="The averaging round in progress when it was lost (null: none, or unknown)."
    )
    at_secs: float = Field(description="When, in seconds since the window opened.")


class RankJoinState(_Model):
    """A rank that walked in during training (docs/elastic-averaging.md, "Growth and healing")."""

    rank: int = Field(description="Its fresh rank id (a lost rank's id is never reused).")
    host: str
    round: int | None = Field(
        default=None, description="The averaging round it entered in (null: its relay has not entered yet)."
    )
    at_secs: float = Field(description="When it was admitted, in seconds since the window opened.")


class StragglerState(_Model):
    """A rank whose deposits reach the controller's fold late (`RunMetrics`)."""

    rank: int
    mean_delay_secs: float = Field(
        description="Mean seconds after its round opened that its deposit arrived."
    )
    last_delay_secs: float = Field(description="The same, in the last round it was timed in.")
    rounds: int = Field(description="Rounds timed.")
    skipped: int = Field(
        0,
        description="Rounds that closed without its deposit: late past the run's straggler_timeout "
        "(cpu_cadence/cpu_async); it stayed a member, and its late deposit was dropped.",
    )


class HeartbeatState(_Model):
    """How the run's heartbeats fare against its liveness timeout (`RunMetrics.heartbeats`)."""

    timeout_secs: float = Field(description="A rank silent this long is declared dead.")
    interval_secs: float = Field(description="How often ranks (and the controller) send a heartbeat.")
    longest_gap_secs: float = Field(
        description="The longest silence between two heartbeats of one rank that spoke again: the margin "
        "under the timeout on this machine (size the timeout well above it)."
    )
    longest_gap_rank: int


class RootCause(_Model):
    """The run's first observed failure, across hosts (flodld/membership/rootcause.py has the rules): the
    earliest non-zero rank exit that was not a consequence of our own teardown (a rank the agent TERMed
    after a sibling failed, or after the controller's Abort, is never the root cause).
    """

    host: str
    rank: int
    code: int = Field(description="The exit code (negative: killed by that signal).")
    exit: str = Field(description="'exit code N' or 'signal N'.")
    failed_at: float = Field(
        description="Unix seconds, the agent's clock: when the rank raised (its error file was written or "
        "its traceback began), else when its process ended."
    )
    error: str | None = Field(
        default=None,
        description="The exception the rank's `@record` wrote to its TORCHELASTIC_ERROR_FILE "
        "(null without one).",
    )
    tail: list[str] = Field(
        default_factory=list,
        description="The rank's last output lines (stdout and stderr as forwarded; at most 40 lines and "
        "4 KiB, the run's secrets replaced by <redacted>).",
    )
    summary: str = Field(description="One line: rank, host, exit and the exception's first line.")
    failed_ranks: int = Field(default=0, description="Non-zero rank exits reported so far.")
    consequences: int = Field(
        default=0, description="Of those, exits that followed a host's teardown (never a root cause)."
    )


class ConnectionCounts(_Model):
    """What the controller port has seen, below the join protocol: routed connections and dropped ones."""

    by_channel: dict[str, int] = Field(
        default_factory=dict,
        description="Connections routed since the port opened, by channel "
        "(join, http, rendezvous, data, control).",
    )
    dropped: dict[str, int] = Field(
        default_factory=dict,
        description="Connections dropped without a join decision, by reason (unknown_magic, deadline, flood, "
        "eof_before_magic, http_lifetime, ...).",
    )


class EarlierAttempt(_Model):
    """A failed attempt of the same run (a restart followed it)."""

    number: int = Field(description="Its attempt number, 1 first.")
    run_id: str = Field(description="Its run id (each attempt is a fresh world with its own).")
    cause: str = Field(description="Why it failed (its verdict's sentence).")
    hosts: list[str] = Field(description="Its world's hosts, in rank order (the first 500).")

    @classmethod
    def of(cls, record: RunRecord, number: int) -> EarlierAttempt:
        """Attempt `number` (1 first) as its finished run's record describes it."""
        return cls(number=number, run_id=record.run_id, cause=record.reason, hosts=record.hosts)


class AttemptState(_Model):
    """Where this run stands among its restarts (`--max-restarts`, controller.join.max_restarts)."""

    number: int = Field(description="This attempt's number, 1 first (TORCHELASTIC_RESTART_COUNT + 1).")
    max_attempts: int = Field(description="The most attempts the run may make (1 + max_restarts).")
    earlier: list[EarlierAttempt] = Field(
        default_factory=list, description="The attempts before this one, oldest first, each with its cause."
    )


class RunRecord(_Model):
    """One finished run in the `flodld serve` history. Times are unix seconds."""

    run_id: str
    verdict: Phase = Field(description="done or failed.")
    reason: str = Field(description="The verdict's sentence (a SIGTERM abort names the signal).")
    started_at: float = Field(description="When the run's join window opened.")
    formed_at: float | None = Field(description="When the world formed; null if it never did.")
    ended_at: float = Field(description="When the run reached its verdict.")
    ranks: int = Field(description="World size (0 if the world never formed).")
    hosts: list[str] = Field(
        description="The formed world's hosts, in rank order (in state.json: the first "
        f"{DEFAULT_MEMBER_PAGE}; `host_count` has them all)."
    )
    host_count: int | None = Field(
        default=None, description="How many hosts the world had (null: count `hosts`)."
    )
    rank_exits: list[RankExit] = Field(description="Exit codes the agents reported.")
    root_cause: RootCause | None = Field(
        default=None, description="The first observed failure (null: no rank failed on its own)."
    )
    heartbeats: HeartbeatState | None = Field(
        default=None,
        description="CPU averaging across hosts: the liveness timeout and heartbeat interval, and the "
        "longest gap a live rank's heartbeats left (absent before a rank was heard twice).",
    )
    attempt: AttemptState | None = Field(
        default=None, description="The run's attempt and the earlier ones (null: no restarts configured)."
    )
    joins: list[RankJoinState] = Field(
        default_factory=list,
        description="Ranks that walked in during training (state.json `joins`; empty without growth).",
    )


class ServiceState(_Model):
    """The long-running daemon around the runs (`flodld serve` without --once)."""

    runs_started: int = Field(description="Runs (join windows) opened since the daemon started.")
    runs: dict[str, int] = Field(description="Finished runs by verdict since the daemon started.")
    between_runs: bool = Field(description="The last run has ended and the next window is not open yet.")
    next_window_in_secs: float | None = Field(
        description="Between runs: seconds until the next window opens."
    )
    config: str | None = Field(
        description="The config file the daemon (re)loads on SIGHUP; null without --config."
    )
    config_loaded_at: float = Field(description="Unix seconds of the last successful (re)load.")
    config_error: str | None = Field(
        description="Why the last SIGHUP reload failed (the previous config stays in force); "
        "null when it loaded."
    )
    history_limit: int = Field(
        description="How many finished runs `history` keeps (controller.history_runs)."
    )
    history_file: str | None = Field(
        default=None,
        description="Where the history is kept across restarts (`--state-dir` or systemd's "
        "`StateDirectory=`); null: in memory only.",
    )
    history_error: str | None = Field(
        default=None,
        description="Why the history file was not (fully) read or written: damaged lines skipped, a "
        "newer flodld's file, a failed write; null when all is well.",
    )


class StatusSummary(_Model):
    """state.json's headline in words, as the status page, its script and `fdl status` show it (one pure
    summariser words it: flodld/controller/status/summary.py).
    """

    note: str = Field(description="The phase's gloss (a staging window past its clock is held: fdl start).")
    ranks: str = Field(description="Ranks joined, hosts, quorum and target in one line.")
    window: str = Field(description="The window's clock: `42s left`, or `closed`.")
    cap: str = Field(description="The hard cap's clock: `3m 05s left`, or `closed`.")
    start: str = Field(description="The start switch: its mode; armed, startable, waiting or closed.")
    start_go: bool = Field(description="`fdl start` would arm, or has: the page marks the switch.")
    attempts: list[str] = Field(
        description="With restarts configured: `attempt N of at most M`, then each earlier attempt and its "
        "cause; empty without restarts."
    )
    service: str = Field(description="`flodld serve`: its runs, and whether it is between runs; else empty.")
    history: list[list[str]] | None = Field(
        default=None,
        description="`flodld serve`: the newest 50 finished runs in words, a row each (run, verdict, ended, "
        "formed, duration, ranks, hosts, rank exits, reason); null for a single run.",
    )


class StateSnapshot(_Model):
    """What `GET /state.json` answers."""

    phase: Phase
    reason: str = Field(description="Why the run is in this phase (the verdict's sentence).")
    run_id: str
    controller: str = Field(description="The controller's address as host:port.")
    joined_ranks: int
    joined_hosts: int
    quorum: int
    target: int | None
    window_remaining_secs: float | None = Field(
        description="Seconds until the window expires; null once it has expired or the window has closed."
    )
    cap_remaining_secs: float | None = Field(
        description="Seconds until the hard cap; null once it has passed or the window has closed."
    )
    start_mode: StartMode
    start_armed: bool
    startable: bool = Field(description="Open window, manual/hybrid, quorum met: `fdl start` would arm.")
    members: list[MemberState] = Field(
        description=f"One page of hosts in admission order: the first {DEFAULT_MEMBER_PAGE} unless "
        "`?members=A..B` (inclusive indexes) or `?members=all` asked for others; `members_page` says which."
    )
    members_page: MembersPage | None = Field(
        default=None,
        description="Which members `members` lists (absent from older controllers: all of them).",
    )
    member_counts: MemberCounts | None = Field(
        default=None, description="Every member counted by link state, variant and device type."
    )
    missing: list[str] = Field(description="Configured workers that have not joined.")
    refused: dict[str, int] = Field(description="Refused join attempts by reason code.")
    rank_exits: list[RankExit]
    root_cause: RootCause | None = Field(
        default=None,
        description="The first observed rank failure across hosts, with its exception and output tail; null "
        "while no rank failed on its own.",
    )
    losses: list[RankLossState] = Field(
        default_factory=list,
        description="Every rank lost, in rank order: host, cause and round (a run with a tolerance goes on "
        "without them and ends `done (degraded: …)`).",
    )
    joins: list[RankJoinState] = Field(
        default_factory=list,
        description="Every rank that walked in during training (controller.join.elastic_max_ranks), in rank "
        "order: host, the round it entered in, and when it was admitted.",
    )
    stragglers: list[StragglerState] = Field(
        default_factory=list,
        description="CPU averaging across hosts: the 5 ranks whose deposits reach the controller's fold "
        "latest on average, the slowest first, with the rounds that closed without each (`skipped`, "
        "straggler_timeout; the most skipped first) (absent before any round was folded across hosts; a "
        "world of "
        "one host folds its rounds at its relay).",
    )
    attempt: AttemptState | None = Field(
        default=None,
        description="With restarts configured: this attempt (n of at most N) and each earlier attempt's "
        "cause and hosts; absent or null without restarts.",
    )
    connections: ConnectionCounts = Field(
        default_factory=ConnectionCounts,
        description="Port-level connection counts; drops also appear in `refused` as `connection_<reason>` "
        "(kept for compatibility).",
    )
    history: list[RunRecord] | None = Field(
        default=None,
        description="`flodld serve` only: the last finished runs, newest first (absent for a single run).",
    )
    service: ServiceState | None = Field(
        default=None, description="`flodld serve` only: the daemon around the runs (absent for a single run)."
    )
    summary: StatusSummary | None = Field(
        default=None,
        description="The headline in words (absent from older controllers): what the page and `fdl status` "
        "show.",
    )


def state_schema() -> dict[str, Any]:
    """The JSON schema of `state.json`."""
    return StateSnapshot.model_json_schema()


def render_state_schema() -> str:
    """`state_schema()` as the text stored in docs/state-schema.json."""
    return json.dumps(state_schema(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
