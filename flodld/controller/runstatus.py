"""The run's status source: state.json, the status page, /metrics, the run record and `POST /start`.

What the HTTP app (`StatusSource`, flodld/controller/status/source.py), `fdl status` and the Service read of a
run. state.json comes from a `StateCache` (one build per change and per 200 ms, encoded once for all readers);
member rows are encoded again only when their member, ranks or link state changed.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Mapping
from typing import Any, Final

from flodld.controller.runparts import StatusRun
from flodld.controller.status.http import NO_STATE
from flodld.controller.status.metrics import ControllerCounters, RunSeries, render_prometheus
from flodld.controller.status.page import render_page
from flodld.controller.status.snapshot import (
    DEFAULT_MEMBERS,
    CachedState,
    MemberRange,
    MemberRows,
    RenderBudget,
    StateCache,
)
from flodld.controller.status.source import HttpAnswer
from flodld.controller.status.summary import summarised
from flodld.membership.ledger import Member
from flodld.membership.snapshot import LinkState, RankExit, RootCause, RunRecord
from flodld.membership.switch import Armed, forbidden, token_matches
from flodld.membership.window import JoinWindow, MemberView

log = logging.getLogger("flodld.controller")

STRAGGLERS_SHOWN: Final = 5
"""The slowest ranks state.json `stragglers` lists."""

_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


def render_status(build: CachedState) -> bytes:
    """The status page for one build (its default member page)."""
    return render_page(build.page_data(DEFAULT_MEMBERS)).encode()


class RunStatus:
    """`run`'s status: the `StatusSource` of its HTTP app (the Controller hands each call on to it)."""

    def __init__(self, run: StatusRun) -> None:
        self.run = run
        self.render_budget = RenderBudget(on_refused=self.count_busy)
        self.state_cache = StateCache(self._build_state, self.state_version, budget=self.render_budget)
        # host -> (member, ranks, link, its state.json row): a row is encoded again only when one changed.
        self._rows: dict[str, tuple[Member, tuple[int, ...], LinkState, bytes]] = {}
        self.row_encodes = 0

    def state_version(self) -> tuple[int, bool] | None:
        """Changes whenever state.json would (countdowns and connection counts aside): the cache's key."""
        if self.run.window is None:
            return None
        return self.run.window.generation, self.run.result is not None

    def state_json(self, members: MemberRange = DEFAULT_MEMBERS) -> dict[str, Any] | None:
        """state.json as data: cached (see `StateCache`) and shared between readers; do not change it."""
        return self.state_cache.data(members)

    def state_body(self, members: MemberRange = DEFAULT_MEMBERS, source: str | None = None) -> bytes | None:
        """state.json as the JSON text every reader of this build gets; work past the cache is charged to
        `source` (`RenderRefused` past the render budget).
        """
        return self.state_cache.body(members, source)

    def status_html(self, source: str | None = None) -> bytes:
        """The status page, rendered once per build (charged like `state_body`)."""
        return self.state_cache.derived("status", render_status, source)  # type: ignore[no-any-return]

    def count_busy(self) -> None:
        self.run.counters.dropped["http_busy"] += 1

    def _build_state(self, members: MemberRange) -> dict[str, Any] | None:
        """One build for every page: the fields, and the members as `MemberRows` (rows encoded on demand
        from the member list as it stands now, each row once per content).
        """
        del members
        window = self.run.window
        if window is None:
            return None
        state = window.state(self.run.clock(), (0, 0))
        view = window.member_view()
        state["members"] = MemberRows(len(view.members), functools.partial(self._member_rows, window, view))
        connections = {
            "by_channel": dict(sorted(self.run.counters.connections.items())),
            "dropped": dict(sorted(self.run.counters.dropped.items())),
        }
        state["connections"] = connections
        stragglers = self.run.run_metrics.slowest(STRAGGLERS_SHOWN)
        if stragglers:  # only runs that fold across hosts time their ranks
            state["stragglers"] = stragglers
        heartbeats = self.run.run_metrics.heartbeats()
        if heartbeats is not None:
            state["heartbeats"] = heartbeats
        attempt = self.run.options.attempt_state()
        if attempt is not None:
            state["attempt"] = attempt.model_dump(mode="json")
        # Drops are also listed among the refusals with a prefix, as before `connections` existed.
        for reason, count in connections["dropped"].items():
            state["refused"][f"connection_{reason}"] = count
        return summarised(state)

    def _member_rows(self, window: JoinWindow, view: MemberView, begin: int, end: int) -> list[bytes]:
        """Rows `begin` to `end` of `view` as state.json text, each encoded only if its member, ranks or link
        state changed since it was last encoded.
        """
        rows, encoded = self._rows, []
        if len(rows) > 2 * len(view.members) + 64:  # hosts that left: forget their rows
            rows.clear()
        for member in view.members[begin:end]:
            ranks, link = view.ranks(member), view.links.get(member.host, LinkState.OPEN)
            known = rows.get(member.host)
            if known is not None and known[0] is member and known[1] == ranks and known[2] is link:
                encoded.append(known[3])
                continue
            row = _ENCODE(window.member_row(member, ranks, link)).encode()
            self.row_encodes += 1
            rows[member.host] = (member, ranks, link, row)
            encoded.append(row)
        return encoded

    def root_cause(self) -> RootCause | None:
        """The run's first observed rank failure so far (None: no rank failed on its own)."""
        state = self.run.window.root_cause.state() if self.run.window is not None else None
        return RootCause.model_validate(state) if state is not None else None

    def run_record(self) -> RunRecord:
        """This run's entry in the service history (call once the run has its verdict)."""
        result = self.run.result
        assert result is not None, "the run has no verdict yet"
        window = self.run.window
        world = window.world if window is not None else None
        exits = sorted(window.rank_exits.items()) if window is not None else []
        ended = self.run.ended_at if self.run.ended_at is not None else time.time()
        return RunRecord(
            run_id=self.run.run_id,
            verdict=result.verdict,
            reason=result.reason,
            started_at=self.run.started_at if self.run.started_at is not None else ended,
            formed_at=self.run.formed_at,
            ended_at=ended,
            ranks=world.world_size if world is not None else 0,
            hosts=list(world.hosts[: DEFAULT_MEMBERS[1]]) if world is not None else [],
            host_count=len(world.hosts) if world is not None else 0,
            rank_exits=[RankExit(rank=rank, code=code) for rank, code in exits],
            root_cause=result.root_cause,
            attempt=self.run.options.attempt_state(),
            joins=[join.state() for _, join in sorted(window.joins.items())] if window is not None else [],
        )

    def window_refusals(self) -> Mapping[str, int]:
        """Join refusals the run's ledger counted (the port-level ones are in `counters.refusals`)."""
        return self.run.window.ledger.refused_counts if self.run.window is not None else {}

    def metrics_text(
        self, *, runs: Mapping[str, int] | None = None, past_refusals: Mapping[str, int] | None = None
    ) -> str:
        """`runs` (finished runs by verdict) and `past_refusals` (earlier runs' ledgers): from the Service."""
        refusals = self.run.counters.refusals.copy()
        refusals.update(past_refusals or {})
        joined_ranks = joined_hosts = admitted_hosts = admitted_ranks = lost_ranks = 0
        if self.run.window is not None:
            ledger = self.run.window.ledger
            refusals.update(ledger.refused_counts)
            # The ledger's running totals (after formation it holds exactly the world): no O(members)
            # snapshot.
            joined_ranks, joined_hosts = ledger.joined_ranks, ledger.member_count
            admitted_hosts, admitted_ranks = ledger.admitted_hosts, ledger.admitted_ranks
            lost_ranks = len(self.run.window.failed_ranks())
        view = ControllerCounters(**{**vars(self.run.counters), "refusals": refusals})
        run = RunSeries(
            run_id=self.run.run_id,
            restarts=self.run.options.restart_count,
            max_restarts=self.run.options.max_restarts,
            admitted_hosts=admitted_hosts,
            admitted_ranks=admitted_ranks,
            lost_ranks=lost_ranks,
            data=self.run.run_metrics,
        )
        return render_prometheus(
            view,
            phase=self.run.phase.value if self.run.phase else None,
            joined_ranks=joined_ranks,
            joined_hosts=joined_hosts,
            run_id=self.run.run_id,
            runs=runs,
            run=run,
        )

    def request_start(self, *, local: bool, token: str | None) -> HttpAnswer:
        """POST /start: switch, mode, credential, state, then the window's own rules, in that order."""
        if not self.run.options.start_switch:
            return _refusal(
                409, "no_start_switch", "no start switch this run (no join window with a start mode)"
            )
        if self.run.policy.start.value == "auto":
            return _refusal(
                409,
                "auto_mode",
                "start mode is auto — the window closes on target/expiry; set controller.join.start: manual "
                "(or hybrid) to hold for an operator start",
            )
        if not local and not token_matches(token, self.run.start_credential):
            if token_matches(token, self.run.salt_hex):
                # The join token is the run's master key: say so, never accept it here.
                log.warning(
                    "event=start_refused code=join_token detail='the join token (session salt) was presented "
                    "as the start credential; if it crossed a network, treat it as exposed and rotate it'"
                )
                return _refusal(
                    403,
                    "join_token",
                    "start refused: that is the join token, not the start credential "
                    "(`fdl start --derive-credential` computes it); if it crossed a network, rotate it",
                )
            refused = forbidden()
            code = "bad_token" if token else "missing_token"
            log.warning("event=start_refused code=%s", code)
            return _refusal(refused.http_status, code, refused.reason)
        if self.run.window is None:
            return _refusal(503, "no_state", NO_STATE)
        decision = self.run.window.arm_start(self.run.clock())
        if not isinstance(decision, Armed):
            log.info("event=start_refused code=%s reason=%r", decision.code, decision.reason)
            return _refusal(decision.http_status, decision.code, decision.reason)
        self.state_cache.clear()
        if not decision.already:
            log.info("event=start_armed joined_ranks=%d quorum=%d", decision.joined_ranks, decision.quorum)
        self.run.settle()
        return HttpAnswer(
            200,
            {
                "armed": True,
                "joined_ranks": decision.joined_ranks,
                "min_rank_start": decision.quorum,
                "already_armed": decision.already,
            },
        )


def _refusal(status: int, code: str, reason: str) -> HttpAnswer:
    return HttpAnswer(status, {"error": reason, "code": code})
