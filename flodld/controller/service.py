"""`flodld serve` as a long-running service: one port for the daemon's life, one run after another.

What lives as long as the daemon lives here: the listening port and its mux (with the pre-admission
gate, the pre-authentication budget and the counters), the HTTP app, the run history, the run
counts, and the config in force. What lives for one run lives in the `Controller` the Service builds
for it: the join window and its ledger, the session salt (fresh per run unless
`controller.join.token` is configured), the run id, the rendezvous store, the data plane. The
Controller registers its join/rendezvous (and, once formed, data/control) handlers on the shared
mux; when it closes they come off again and the next run's go on.

`assemble_controller` is the one place a Controller is put together (options, phase listener, data
plane): `flodld serve`, `fdl run` and the SSH fan-out all use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from flodld.controller.attachplane import attach_data_plane
from flodld.controller.driver import PhaseListener
from flodld.controller.historyfile import HistoryFile
from flodld.controller.join import HostLink
from flodld.controller.mux import PortMux
from flodld.controller.options import ControllerOptions
from flodld.controller.run import Controller, serve_http
from flodld.controller.runparts import RunResult
from flodld.controller.runport import own_mux
from flodld.controller.runstatus import render_status
from flodld.controller.servicehistory import ServiceHistory
from flodld.controller.status.http import NO_STATE
from flodld.controller.status.metrics import ControllerCounters, render_prometheus
from flodld.controller.status.snapshot import DEFAULT_MEMBERS, MemberRange, RenderBudget, StateCache
from flodld.controller.status.source import HttpAnswer
from flodld.controller.status.summary import summarised
from flodld.membership.history import record_run
from flodld.membership.phase import Phase
from flodld.membership.snapshot import EarlierAttempt, RunRecord, ServiceState
from flodld.membership.supervisor import keeps_links, next_attempt

log = logging.getLogger("flodld.controller")

_HEX_RUN = re.compile(r"[0-9a-fA-F]{16,}")

OptionsLoader = Callable[[], ControllerOptions]


def assemble_controller(
    options: ControllerOptions,
    *,
    on_phase: PhaseListener | None = None,
    data_plane: bool = True,
    salt: bytes | None = None,
    mux: PortMux | None = None,
    address: tuple[str, int] | None = None,
) -> Controller:
    """A Controller for one run with its phase listener and (for CPU averaging) its data plane attached."""
    controller = Controller(options, salt=salt, mux=mux, address=address)
    if on_phase is not None:
        controller.on_phase(on_phase)
    if data_plane:
        attach_data_plane(controller)  # relays of CPU averaging modes dial DATA/CONTROL on this port
    return controller


class Service:
    """Hosts runs on one port until `stop()`; `once=True` hosts exactly one (`flodld serve --once`).

    `load` re-reads the configuration (SIGHUP, `reload()`); the new options apply from the next window.
    """

    def __init__(
        self,
        options: ControllerOptions,
        *,
        load: OptionsLoader | None = None,
        config_path: str | None = None,
        on_phase: PhaseListener | None = None,
        once: bool = False,
        history_file: HistoryFile | None = None,
    ) -> None:
        self.options = options
        self._load = load
        self._config_path = config_path
        self._on_phase = on_phase
        self.once = once
        self.counters = ControllerCounters()
        self.mux = own_mux(options, self.counters)
        self.address: tuple[str, int] | None = None
        self.controller: Controller | None = None  # the run state.json shows: the current run, or the last
        self.runs: Counter[str] = Counter()
        self.runs_started = 0
        self.config_loaded_at = time.time()
        self.config_error: str | None = None
        self._runner: web.AppRunner | None = None
        self._past_refusals: Counter[str] = Counter()
        self._stopping: str | None = None
        self._wake = asyncio.Event()
        self._next_window_at: float | None = None
        self._changes = 0  # bumped when the service part of state.json changes (with the run's own version)
        self._history_json: list[dict[str, Any]] | None = None
        # history_file None: the history lives in memory only (no state directory)
        self.past = ServiceHistory(history_file, options.history_runs, on_change=self._changed)
        self.render_budget = RenderBudget(on_refused=self._count_busy)
        self.state_cache = StateCache(
            self._build_state, self._state_version, depends_on=self._run_clears, budget=self.render_budget
        )

    @property
    def history(self) -> deque[RunRecord]:
        """The finished runs, newest first (`ServiceHistory`)."""
        return self.past.records

    # --- lifecycle -----------------------------------------------------------------------------

    async def listen(self) -> tuple[str, int]:
        """Bind the port and serve HTTP (state.json answers 503 until the first window opens)."""
        if self.address is not None:
            return self.address
        await self.past.load()
        self._runner = await serve_http(self, self.mux, self.counters)
        try:
            self.address = await self.mux.start(self.options.effective_bind_host, self.options.port)
        except BaseException:
            await self._runner.cleanup()
            self._runner = None
            raise
        log.info(
            "event=listening bind=%s port=%d mode=%s",
            self.address[0],
            self.address[1],
            "once" if self.once else "service",
        )
        return self.address

    async def serve(self) -> RunResult | None:
        """Host runs until `stop()` (or, with `once`, one run); returns the last run's result.

        PolicyError/ValueError from the first run's options propagate (bad config at start); a later
        run's options come from a reload that was already checked.
        """
        address = await self.listen()
        result: RunResult | None = None
        try:
            restart_count = 0  # this attempt's number within its job (flodld serve --max-restarts)
            earlier: list[EarlierAttempt] = []  # the job's failed attempts so far, with their causes
            kept: list[HostLink] = []  # still linked after the failed attempt's Reform (docs/restarts.md)
            while self._stopping is None:
                options = self.options.model_copy(
                    update={
                        "run_id": self._run_id(self.options),
                        "restart_count": restart_count,
                        "max_restarts": self.options.join.max_restarts,
                        "earlier_attempts": tuple(earlier),
                    }
                )
                controller = assemble_controller(
                    options, on_phase=self._on_phase, mux=self.mux, address=address
                )
                # A failure with restarts left keeps its links: Reform instead of Abort (not when stopping).
                controller.keep_links = keeps_links(restart_count, options.max_restarts)
                self.runs_started += 1
                try:
                    await controller.start()
                except BaseException:
                    _close_links(kept)
                    await controller.close()
                    raise
                if kept:  # the re-formation window: the hosts still linked are re-admitted at once
                    readmitted = controller.adopt(kept)
                    log.info("event=reformation_window kept=%d readmitted=%d", len(kept), len(readmitted))
                    kept = []
                if self.controller is not None:  # its ledger's refusals stay counted in /metrics
                    self._past_refusals.update(self.controller.window_refusals())
                self.controller = controller
                self._next_window_at = None
                self._changed()
                log.info(
                    "event=ready bind=%s port=%d run_id=%s run=%d admission=%s",
                    address[0],
                    address[1],
                    controller.run_id,
                    self.runs_started,
                    controller.policy.trust.value,
                )
                if self._stopping is not None:  # a signal raced the window open
                    controller.keep_links = False
                    controller.abort(self._stopping)
                result = await controller.wait()
                kept = controller.take_kept_links()
                await controller.close()
                self._record(controller, result)
                following = next_attempt(
                    restart_count, options.max_restarts, ok=result.ok, stopping=self._stopping is not None
                )
                if following is not None:  # a fresh world at once: new run id, salt, store namespace
                    log.warning(
                        "event=restarting attempt=%d max_attempts=%d after=%r",
                        following + 1,
                        options.max_restarts + 1,
                        result.reason,
                    )
                    earlier.append(EarlierAttempt.of(controller.run_record(), restart_count + 1))
                    restart_count = following
                    continue
                _close_links(kept)  # no attempt follows: the hosts kept for one end with it
                restart_count, earlier, kept = 0, [], []
                if self.once or self._stopping is not None:
                    break
                await self._pause(options.between_runs_secs)
        finally:
            await self.close()
        return result

    def _run_id(self, options: ControllerOptions) -> str:
        """A fresh run id per run: the configured one as a prefix under the service, else random."""
        if options.run_id is None:
            return secrets.token_hex(8)
        return options.run_id if self.once else f"{options.run_id}-{self.runs_started + 1}"

    async def _pause(self, seconds: float) -> None:
        if seconds <= 0:
            return
        self._next_window_at = time.monotonic() + seconds
        self._changed()
        log.info("event=between_runs pause_secs=%g", seconds)
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)

    def _record(self, controller: Controller, result: RunResult) -> None:
        record = controller.run_record()
        record_run(self.history, record)  # one entry per run: a restart's attempt replaces the one before
        self._changed()
        self.past.save()
        self.runs[result.verdict.value] += 1
        log.log(
            logging.INFO if result.ok else logging.WARNING,
            "event=run_ended run_id=%s verdict=%s ranks=%d hosts=%d reason=%r",
            record.run_id,
            result.verdict.value,
            record.ranks,
            len(record.hosts),
            result.reason,
        )

    def stop(self, reason: str) -> None:
        """Abort the current run (Abort down every link) and end the service once it is recorded."""
        if self._stopping is not None:
            return
        self._stopping = reason
        self._wake.set()
        if self.controller is not None and self.controller.result is None:
            self.controller.keep_links = False  # a stop ends the hosts too: Abort, never Reform
            self.controller.abort(reason)

    def reload(self) -> bool:
        """Re-read the config; it applies from the next window. A config that no longer loads keeps the
        old one in force, logs why and shows it in state.json (`service.config_error`).
        """
        if self._load is None:
            log.warning("event=reload_skipped reason='no --config to re-read'")
            return False
        try:
            options = self._load()
            Controller(options)  # the policy checks, as at start
        except Exception as error:  # any failure keeps the running config
            # state.json is readable by whoever reaches the port: no hex run that could be (part of) a token.
            self.config_error = _HEX_RUN.sub("<redacted>", f"{type(error).__name__}: {error}")[:2000]
            self._changed()
            log.error(
                "event=reload_failed config=%s error=%r action='keeping the previous config'",
                self._config_path,
                self.config_error,
            )
            return False
        if self.address is not None and (
            options.port not in (0, self.address[1])
            or options.effective_bind_host != self.options.effective_bind_host
        ):
            log.warning(
                "event=reload_partial detail='port and bind stay as bound until a restart' port=%d bind=%s",
                self.address[1],
                self.options.effective_bind_host,
            )
            options = options.model_copy(
                update={
                    "port": self.options.port,
                    "bind_host": self.options.bind_host,
                    "loopback_bind": self.options.loopback_bind,
                }
            )
        self.options = options
        self._changed()
        self.config_error = None
        self.config_loaded_at = time.time()
        self.past.resize(options.history_runs)
        log.info("event=reloaded config=%s applies=next_window", self._config_path)
        return True

    async def close(self) -> None:
        """Close the port and every connection still on it (HTTP included)."""
        if self.controller is not None:
            await self.controller.close()
        await self.mux.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.past.flush()  # the last run's record reaches the disk before the daemon exits

    # --- StatusSource (the HTTP app) ----------------------------------------------------------

    def _changed(self) -> None:
        """The service part of state.json changed (a run began or ended, a reload): show it at once."""
        self._changes += 1
        self._history_json = None
        self.state_cache.clear()

    def _run_clears(self) -> int:
        return self.controller.state_cache.clears if self.controller is not None else 0

    def _state_version(self) -> object:
        controller = self.controller
        return self._changes, id(controller), controller.state_version() if controller is not None else None

    def state_json(self, members: MemberRange = DEFAULT_MEMBERS) -> dict[str, Any] | None:
        """state.json as data: cached and shared between readers (see `StateCache`); do not change it."""
        return self.state_cache.data(members)

    def state_body(self, members: MemberRange = DEFAULT_MEMBERS, source: str | None = None) -> bytes | None:
        """As `Controller.state_body`, with the service's part."""
        return self.state_cache.body(members, source)

    def status_html(self, source: str | None = None) -> bytes:
        """The status page, rendered once per build (charged like `state_body`)."""
        return self.state_cache.derived("status", render_status, source)  # type: ignore[no-any-return]

    def _count_busy(self) -> None:
        self.counters.dropped["http_busy"] += 1

    def _build_state(self, members: MemberRange) -> dict[str, Any] | None:
        """The run's build (its `MemberRows` shared: every page is cut from this one build) and the service's
        part.
        """
        del members
        controller = self.controller
        shared = controller.state_cache.head() if controller is not None else None
        if shared is None or self.once:
            return shared
        state = dict(shared)  # the run's build is shared with its own readers: add to a copy
        between = controller is not None and controller.result is not None
        remaining = None
        if between and self._next_window_at is not None:
            remaining = max(0.0, self._next_window_at - time.monotonic())
        service = ServiceState(
            runs_started=self.runs_started,
            runs=dict(self.runs),
            between_runs=between,
            next_window_in_secs=remaining,
            config=self._config_path,
            config_loaded_at=self.config_loaded_at,
            config_error=self.config_error,
            history_limit=self.history.maxlen or 0,
            history_file=str(self.past.file.path) if self.past.file is not None else None,
            history_error=self.past.error,
        )
        if (
            self._history_json is None
        ):  # up to history_runs records of up to 500 hosts: dumped once per change
            self._history_json = [record.model_dump(mode="json") for record in self.history]
        state["history"] = self._history_json
        state["service"] = service.model_dump(mode="json")
        return summarised(state)  # worded again: the service's part is in the headline too

    def metrics_text(self) -> str:
        runs = None if self.once else {v.value: self.runs[v.value] for v in (Phase.DONE, Phase.FAILED)}
        if self.controller is None:
            return render_prometheus(self.counters, phase=None, joined_ranks=0, joined_hosts=0, runs=runs)
        # Earlier runs' ledger refusals stay counted: Prometheus counters never go down across runs.
        return self.controller.metrics_text(runs=runs, past_refusals=self._past_refusals)

    def request_start(self, *, local: bool, token: str | None) -> HttpAnswer:
        controller = self.controller
        if controller is None or controller.result is not None:
            return HttpAnswer(
                503,
                {
                    "error": NO_STATE
                    if controller is None
                    else "between runs: the next join window is not open yet",
                    "code": "no_window",
                },
            )
        return controller.request_start(local=local, token=token)


def _close_links(links: list[HostLink]) -> None:
    for link in links:
        link.stream.close()


def history_record(entry: Mapping[str, Any]) -> RunRecord:
    """A history entry of state.json back as a RunRecord (for clients and tests)."""
    return RunRecord.model_validate(dict(entry))
