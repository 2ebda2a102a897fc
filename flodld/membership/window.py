"""`JoinWindow`: the one object the controller's shell feeds with joins, clock ticks and exits.

It owns the ledger, the phase, the start switch and the post-formation bookkeeping (link states, rank
exits). Every method takes `now` (monotonic seconds) and returns what the shell must act on; nothing
here sleeps, reads a clock or touches a socket. Phase changes go through `phase.advance`, so the
lifecycle follows `TRANSITIONS` and never goes backwards.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from flodld.membership import windowstate
from flodld.membership.growth import RankJoin, growth_refusal
from flodld.membership.ledger import Admitted, Ledger, Member, Refused, World
from flodld.membership.lossbook import LossBook, RankLoss, describe_exit
from flodld.membership.phase import (
    TERMINAL_PHASES,
    WINDOW_PHASES,
    Event,
    Phase,
    TransitionError,
    advance,
    verdict,
)
from flodld.membership.policy import MAX_WORLD_RANKS, WindowPolicy
from flodld.membership.rootcause import Failure, RootCauseTracker
from flodld.membership.snapshot import DEFAULT_MEMBER_PAGE, LinkState, StateSnapshot
from flodld.membership.switch import Armed, StartRefused, arm
from flodld.membership.windowstate import MemberView as MemberView
from flodld.wire.join import Hello


class LinkOutcome(Enum):
    """What the end of a host's join link meant (`JoinWindow.link_ended`)."""

    IGNORED = "ignored"  # the run has its verdict, or the host is not in the formed world
    RETURNED = "returned"  # before formation: the host's ranks went back to the pool
    CLOSED = "closed"  # after formation: the host finished
    LOST = "lost"  # after formation: the host is lost, its unreported ranks count as failed


@dataclass(frozen=True)
class LinkEnded:
    """`JoinWindow.link_ended`'s decision, for the shell to log: `ranks` are the ranks that went back
    (RETURNED) or the host's unreported ones (CLOSED, LOST); `why` is the sentence the verdict names.
    """

    outcome: LinkOutcome
    ranks: tuple[int, ...] = ()
    why: str = ""


class JoinWindow:
    """The join window and the run lifecycle after it, as a pure state machine."""

    def __init__(
        self,
        policy: WindowPolicy,
        roster: Sequence[str],
        opened_at: float,
        *,
        run_id: str = "",
        controller: str = "",
        tolerance: int = 0,
        tolerance_percent: float | None = None,
        dataset_sig: str | None = None,
        model_sig: str | None = None,
        expected_run_id: str | None = None,
        max_world_ranks: int = MAX_WORLD_RANKS,
        declared: Mapping[str, int] | None = None,
        elastic_max_ranks: int | None = None,
    ) -> None:
        if tolerance < 0:
            raise ValueError(f"tolerance must be >= 0 (rank failures the run survives), got {tolerance}")
        self.policy = policy
        self.roster = tuple(roster)
        self.opened_at = opened_at
        self.run_id = run_id
        self.controller = controller
        self.tolerance = tolerance
        # A share of the world (floDl's max_failure): the count is fixed when the world forms.
        self.tolerance_percent = tolerance_percent
        self.ledger = Ledger(
            policy, self.roster, dataset_sig=dataset_sig, model_sig=model_sig, run_id=expected_run_id,
            max_world_ranks=max_world_ranks, declared=declared,
        )
        self.phase = Phase.WAITING
        self.reason = f"window open (quorum {policy.quorum} ranks)"
        self.start_armed = False
        self.world: World | None = None
        self.links: dict[str, LinkState] = {}
        self.rank_exits: dict[int, int] = {}
        self.root_cause = RootCauseTracker()  # the first observed failure across hosts
        # Running totals behind failed_ranks() and "every link closed", kept per event so that a world
        # of thousands of hosts reporting exits costs O(1) per report, not a scan of the world each.
        self._failed: set[int] = set()
        self._open_links = 0
        self._link_counts: Counter[str] = Counter()
        self._changes = 0  # with the ledger's generation: bumps whenever state.json would differ
        self._lost = LossBook()  # how each rank and host was lost (flodld/membership/lossbook.py)
        # Growth (flodld.membership.growth): the bound on live ranks a walk-in may take the run to (None: no
        # walk-ins after formation), the ranks that walked in (state.json `joins`), and the ranks of a host's
        # earlier incarnation once it walked in again (lost with it, never its new link's).
        self.elastic_max_ranks = elastic_max_ranks
        self.joins: dict[int, RankJoin] = {}
        self._retired: set[int] = set()
        self.formed_size = 0  # the world's rank count at formation: the deficit is counted against it
        self._healed = 0  # walked-in ranks that entered the averaging (len(healed_in()), kept per event)

    # --- the window --------------------------------------------------------------------------------

    def hello(self, hello: Hello, now: float, *, evaluate: bool = True) -> Admitted | Refused:
        """Admit or refuse a join; the verdict is re-evaluated before (clock) and after (target).

        `evaluate=False` (a storm: the shell calls `tick` once per event-loop turn instead) skips both
        evaluations unless they could decide something at this hello: before it, when the clock has
        reached the window's end; after it, when the target is reached (so the very next hello of the
        same turn is already refused, and the world never overshoots the target).
        """
        if self.world is not None and self.elastic_max_ranks is not None:
            return self.walk_in(hello, now)
        if evaluate or self.elapsed(now) >= self.policy.window_secs:
            self.tick(now)
        if self.phase not in WINDOW_PHASES:
            self.ledger.close()
        outcome = self.ledger.admit(hello, now)
        if isinstance(outcome, Admitted):
            target = self.policy.target
            if evaluate or (target is not None and self.ledger.joined_ranks >= target):
                self.tick(now)
        return outcome

    def walk_in(self, hello: Hello, now: float) -> Admitted | Refused:
        """A hello after formation in a run that grows: admitted with fresh ranks while the run trains and
        its live ranks stay within `elastic_max_ranks` (`growth_refusal` says why not). The shell ships the
        walk-in its WorldFormed; its ranks enter the averaging at the next round boundary (`entered`).
        """
        world = self.world
        assert world is not None
        refusal = growth_refusal(
            host=hello.host,
            phase=self.phase,
            bound=self.elastic_max_ranks,
            live_ranks=self.live_ranks(),
            offered=len(hello.devices),
            link=self.links.get(hello.host),
        )
        if refusal is not None:
            return self.ledger.refuse(refusal.code, refusal.reason)
        outcome = self.ledger.admit_walk_in(hello, now)
        if not isinstance(outcome, Admitted):
            return outcome
        ranks = dict(world.ranks)
        members = world.members
        if hello.host in ranks:  # a host of the formed world again: its earlier ranks stay lost
            self._retired.update(ranks[hello.host])
            ranks[hello.host] = ranks[hello.host] + outcome.ranks
            members = tuple(outcome.member if m.host == hello.host else m for m in members)
            self.world = World(members, ranks)
            self._set_link(hello.host, LinkState.OPEN)
        else:
            ranks[hello.host] = outcome.ranks
            self.world = World((*members, outcome.member), ranks)
            self.links[hello.host] = LinkState.OPEN
            self._open_links += 1
            self._link_counts[LinkState.OPEN.value] += 1
        for rank in outcome.ranks:
            self.joins[rank] = RankJoin(rank, hello.host, self.elapsed(now))
        self._changes += 1
        return outcome

    def entered(self, ranks: Sequence[int], in_round: int) -> None:
        """Walked-in `ranks` entered the averaging at `in_round` (their relay reached a round boundary)."""
        for rank in ranks:
            join = self.joins.get(rank)
            if join is not None and join.round is None:
                self.joins[rank] = replace(join, round=in_round)
                self._changes += 1
                self._healed += 1

    def healed_in(self) -> list[int]:
        """Walked-in ranks that entered the averaging (a walk-in counts once its ranks have entered)."""
        return sorted(rank for rank, join in self.joins.items() if join.round is not None)

    def missing_ranks(self) -> int:
        """The deficit the tolerance bounds: ranks lost and not made good by walk-ins that entered.

        Without growth (no `elastic_max_ranks`) nothing heals in: every loss of the run counts, as before.
        With it, live members below the formed world size: lost ranks (a walk-in's included) minus the
        walked-in ranks that entered, never below 0 (walk-ins beyond the losses grow the world).
        """
        if self.elastic_max_ranks is None:
            return len(self._failed)
        return max(0, len(self._failed) - self._healed)

    def live_ranks(self) -> int:
        """Ranks of the formed world (walk-ins included) not lost and not exited."""
        if self.world is None:
            return self.ledger.joined_ranks
        return self.world.world_size - len(set(self.rank_exits) | self._failed | self._retired)

    @property
    def generation(self) -> int:
        """A number that changes whenever the state (countdowns aside) changes: the snapshot cache's key."""
        return self._changes + self.ledger.generation

    def disconnect(self, host: str, now: float) -> tuple[int, ...]:
        """A member's link broke. Before formation its ranks go back (later members renumber); after it the
        host is `lost` (see `host_closed`).
        """
        if self.phase in WINDOW_PHASES:
            ranks = self.ledger.retract(host)
            self.tick(now)
            return ranks
        if self.world is None:
            ranks = self.ledger.ranks_of(host)
        else:  # a host that walked in again: its earlier ranks were lost before, only its current ones now
            ranks = tuple(r for r in self.world.ranks[host] if r not in self._retired)
        self.host_closed(host, now, lost=True)
        return ranks

    def arm_start(self, now: float) -> Armed | StartRefused:
        """The operator fired `fdl start`; on success the verdict forms at once if quorum holds."""
        self.tick(now)
        decision = arm(self.policy, self.phase, joined_ranks=self.ledger.joined_ranks, armed=self.start_armed)
        if isinstance(decision, Armed):
            self.start_armed = True
            self._changes += 1
            self.tick(now)
        return decision

    def tick(self, now: float) -> Phase:
        """Evaluate the verdict at `now` (call on every event and on a timer)."""
        if self.phase not in WINDOW_PHASES:
            return self.phase
        result = verdict(
            self.policy,
            self.phase,
            elapsed=self.elapsed(now),
            joined_ranks=self.ledger.joined_ranks,
            start_armed=self.start_armed,
        )
        if (result.phase, result.reason) != (self.phase, self.reason):
            self._changes += 1
        self.phase, self.reason = result.phase, result.reason
        if self.phase not in WINDOW_PHASES:
            self.ledger.close()
        return self.phase

    def form(self, now: float) -> World:
        """Freeze the world once the verdict said `forming`; idempotent."""
        del now  # formation time is the tick that decided it
        if self.world is not None:
            return self.world
        if self.phase is not Phase.FORMING:
            raise TransitionError(
                f"cannot form the world in phase {self.phase.value!r} (the verdict has not formed)"
            )
        self.world = self.ledger.freeze()
        self.formed_size = self.world.world_size
        if self.tolerance_percent is not None:
            # Rounded down, in integer arithmetic on the thousandths the config allows (no float edge).
            thousandths = round(self.tolerance_percent * 1000)
            self.tolerance = self.world.world_size * thousandths // 100_000
        self.links = {host: LinkState.OPEN for host in self.world.hosts}
        self._open_links = len(self.links)
        self._link_counts = Counter({LinkState.OPEN.value: len(self.links)})
        self._changes += 1
        return self.world

    # --- after formation ---------------------------------------------------------------------------

    def artifacts_shipped(self, now: float) -> Phase:
        """WorldFormed went out to every host: training starts."""
        if self.world is None:
            raise TransitionError(
                "artifacts shipped before form(): call form() when the verdict says forming"
            )
        self._apply(Event.ARTIFACTS_SHIPPED, "training")
        return self._settle_training(now)

    def host_closed(self, host: str, now: float, *, lost: bool = False, why: str = "") -> Phase:
        """A host's join link ended: its exit event. A clean EOF marks it `closed`; `lost=True` (the link
        broke: reset, write failure, bad frame, a silent rank) marks it `lost` and counts its unreported
        ranks as failed; `why`, if given, is named in the failure verdict.
        """
        if self.phase in WINDOW_PHASES:
            self.disconnect(host, now)
            return self.phase
        if self.phase is Phase.FORMING:
            self.form(now)  # the link ended between the verdict and the shell's form()
        if self.world is None:
            return self.phase  # the window failed before formation: nothing left to supervise
        if host not in self.links:
            raise KeyError(
                f"host {host!r} is not a member of the formed world ({', '.join(self.world.hosts)})"
            )
        self._set_link(host, LinkState.LOST if lost else LinkState.CLOSED)
        if lost and why:
            self._lost.host_lost(host, why, link=False)
        if lost:
            cause = f"lost with its host: {self.loss_reasons.get(host) or why or 'the host link broke'}"
            for rank in self._unreported(host):
                self.record_loss(rank, cause, now)
        return self._settle_training(now)

    def record_loss(self, rank: int, cause: str, now: float, *, in_round: int | None = None) -> None:
        """Note how `rank` was lost (the first cause stays): state.json `losses` and the verdict name it."""
        if self.world is None or rank in self.losses:
            return
        host = next((h for h, ranks in self.world.ranks.items() if rank in ranks), "?")
        self._changes += self._lost.record(rank, host, cause, self.elapsed(now), in_round)

    def correct_loss_round(self, rank: int, in_round: int) -> None:
        """The round `rank` was lost in, as its relay saw it: replaces the estimate a loss was recorded with
        (its exit report can arrive first), and is kept for a loss recorded later.
        """
        self._changes += self._lost.correct_round(rank, in_round)

    def rank_declared_dead(self, rank: int, now: float, *, why: str, in_round: int | None = None) -> Phase:
        """A rank silent past the heartbeat timeout, in a run that can lose a rank without its host (the
        averaging folds it out): the rank counts as failed, its host stays; beyond the tolerance the run
        fails. Its exit report, when the agent has killed it, changes nothing more.
        """
        if self.world is None or not 0 <= rank < self.world.world_size:
            raise ValueError(f"rank {rank} is not in the formed world (world size {self.world_size()})")
        if self.phase in TERMINAL_PHASES or rank in self.rank_exits:
            return self.phase
        self.record_loss(rank, f"declared dead: {why}", now, in_round=in_round)
        self._failed.add(rank)
        return self._settle_training(now)

    def link_ended(self, host: str, now: float, *, clean: bool, why: str) -> LinkEnded:
        """A host's join link ended: `clean` when the host closed it (EOF), not when it broke (reset, bad
        frame, failed write, keepalive). Before formation the host's ranks go back; after it the host is
        done, or lost when the link broke or closed with ranks unreported (an agent reports every rank's
        exit before it closes its link, so that is a dead agent: a SIGKILLed agent's kernel still sends
        a clean FIN). A lost host's `why` is named in `final_reason`.
        """
        if self.phase in TERMINAL_PHASES:
            return LinkEnded(LinkOutcome.IGNORED, why=why)
        if self.phase in WINDOW_PHASES:
            return LinkEnded(LinkOutcome.RETURNED, self.disconnect(host, now), why)
        if self.world is None or host not in self.world.ranks:
            return LinkEnded(LinkOutcome.IGNORED, why=why)
        unreported = self._unreported(host)
        if clean and unreported:
            why = f"{why} with rank(s) {list(unreported)} unreported"
        lost = not clean or bool(unreported)
        if lost:
            self._lost.host_lost(host, why, link=True)
        self.host_closed(host, now, lost=lost)
        return LinkEnded(LinkOutcome.LOST if lost else LinkOutcome.CLOSED, unreported, why)

    def rank_exited(
        self, rank: int, code: int, now: float, *, failure: Failure | None = None, in_round: int | None = None
    ) -> Phase:
        """A rank's exit code arrived; failures beyond the tolerance fail the run.

        After the verdict the code is still recorded (state.json then shows how every rank
        ended, e.g. the peers torn down after a failure), but the verdict no longer changes.
        `failure` (host, exit time, teardown mark, error, tail) feeds the root cause, after the verdict too:
        a culprit's report may arrive after a victim's (flodld/membership/rootcause.py).
        """
        if self.world is None or not 0 <= rank < self.world.world_size:
            raise ValueError(f"rank {rank} is not in the formed world (world size {self.world_size()})")
        self._changes += 1
        if failure is not None and rank not in self.rank_exits:
            self.root_cause.observe(failure)
        if self.phase in TERMINAL_PHASES:
            self.rank_exits.setdefault(rank, code)
            return self.phase
        self.rank_exits[rank] = code
        if code != 0:
            self._failed.add(rank)
            self.record_loss(rank, f"exited with {describe_exit(code)}", now, in_round=in_round)
        else:  # a clean exit counts as success, even from a host whose link was since lost
            self._failed.discard(rank)
        return self._settle_training(now)

    def abort(self, reason: str, now: float) -> Phase:
        """The controller gives up; the shell then sends Abort down every link."""
        del now
        if self.phase not in TERMINAL_PHASES:
            self._apply(Event.ABORTED, reason)
            self.ledger.close()
        return self.phase

    # --- queries -----------------------------------------------------------------------------------

    def elapsed(self, now: float) -> float:
        return now - self.opened_at

    def world_size(self) -> int:
        return self.world.world_size if self.world is not None else self.ledger.joined_ranks

    def formation_wait_secs(self, now: float) -> float:
        """How long a joiner should wait for WorldFormed: the rest of the hard cap."""
        return max(0.0, self.policy.cap_secs - self.elapsed(now))

    @property
    def final_reason(self) -> str:
        """The run's verdict sentence: `reason`, and after a failure the hosts whose join link was lost."""
        return self._lost.final_reason(self.reason, failed=self.phase is Phase.FAILED)

    @property
    def losses(self) -> Mapping[int, RankLoss]:
        """Rank -> how it was lost (the first cause only): state.json `losses`."""
        return self._lost.losses

    @property
    def loss_reasons(self) -> Mapping[str, str]:
        """Host -> why it was lost (the first cause only): named in the verdict, or in `final_reason`."""
        return self._lost.host_reasons

    def failed_ranks(self) -> list[int]:
        """Ranks that exited non-zero, plus ranks of lost hosts that never reported."""
        return sorted(self._failed)

    # --- state.json (flodld/membership/windowstate.py) ---------------------------------------------

    def snapshot(self, now: float, members: tuple[int, int] | None = None) -> StateSnapshot:
        """state.json at `now` as the model (`windowstate.snapshot`)."""
        return windowstate.snapshot(self, now, members)

    def state(self, now: float, members: tuple[int, int] = (0, DEFAULT_MEMBER_PAGE)) -> dict[str, Any]:
        """state.json at `now` as JSON-ready data, the page `members` of hosts (`windowstate.state`)."""
        return windowstate.state(self, now, members)

    def member_view(self) -> MemberView:
        """The members, their ranks and link states as they stand now (`windowstate.member_view`)."""
        return windowstate.member_view(self)

    def member_row(self, m: Member, ranks: Sequence[int], link: LinkState) -> dict[str, Any]:
        """One `members` entry of state.json (`windowstate.member_row`)."""
        return windowstate.member_row(self, m, ranks, link)

    @property
    def link_counts(self) -> Mapping[str, int]:
        """Formed hosts by link state (`LinkState` value -> count)."""
        return self._link_counts

    # --- internals ---------------------------------------------------------------------------------

    def _set_link(self, host: str, state: LinkState) -> None:
        """Change a host's link state, keeping the open-link count and the failed set in step."""
        previous = self.links[host]
        self.links[host] = state
        self._changes += 1
        self._link_counts[previous.value] -= 1
        if self._link_counts[previous.value] <= 0:
            del self._link_counts[previous.value]
        self._link_counts[state.value] += 1
        self._open_links += (state is LinkState.OPEN) - (previous is LinkState.OPEN)
        unreported = self._unreported(host)
        if state is LinkState.LOST:
            self._failed.update(unreported)
        elif previous is LinkState.LOST:
            self._failed.difference_update(unreported)

    def _unreported(self, host: str) -> tuple[int, ...]:
        """`host`'s ranks in the formed world that have not reported their exit."""
        assert self.world is not None
        return tuple(r for r in self.world.ranks[host] if r not in self.rank_exits and r not in self._retired)

    def _apply(self, event: Event, reason: str) -> None:
        self._changes += 1
        self.phase = advance(self.phase, event)
        self.reason = reason

    def _settle_training(self, now: float) -> Phase:
        """In training: fail beyond tolerance, finish when every link has closed."""
        del now
        if self.phase is not Phase.TRAINING:
            return self.phase
        if self.missing_ranks() > self.tolerance:
            failed = self.failed_ranks()
            causes = self._lost.host_causes()
            if self.elastic_max_ranks is None:
                count = f"{len(failed)} of {self.world_size()} ranks failed (ranks {failed})"
            else:
                healed = self.healed_in()
                which = f": ranks {healed}" if healed else ""
                count = (
                    f"{self.missing_ranks()} ranks missing of the {self.formed_size} formed ({len(failed)} "
                    f"lost: ranks {failed}, {len(healed)} healed in{which})"
                )
            self._apply(Event.RANKS_FAILED, f"{count}, over the tolerance of {self.tolerance}{causes}")
        elif self._open_links == 0:
            degraded = self._lost.degraded(self.failed_ranks(), self.healed_in(), self.joins)
            closed = "every host link closed"
            self._apply(Event.LINKS_CLOSED, f"{closed} (degraded: {degraded})" if degraded else closed)
        return self.phase
