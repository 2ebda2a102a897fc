"""The run's window driver: it opens the JoinWindow, moves its clock, acts on each phase, keeps the verdict.

A timer task re-evaluates the window every `tick_interval`; every other window call is followed by
`settle()`, which acts on the phase at once: forming ships WorldFormed to every host (`WorldShipper`),
each phase change is announced (the log, then every `on_phase` listener: a broken one is logged, never
fatal), and a terminal phase ends the run: the run's links get Abort or Reform (the run's `finish`),
then the verdict is written (`RunResult`, with the first observed rank failure) and `wait()` returns. A
background task (formation, finishing, a walk-in's WorldFormed) that crashes fails the run with its
reason: never a silent stall.

`WindowDriver` works for the Controller (controller/run.py), which it sees as a `DriverRun` (runparts.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from flodld.controller.runparts import DriverRun, RunResult
from flodld.controller.shipper import ABORT_TIMEOUT_SECS, WorldShipper
from flodld.controller.status.snapshot import StateCache
from flodld.membership.phase import TERMINAL_PHASES, Phase
from flodld.membership.policy import TrustMode
from flodld.membership.window import JoinWindow

log = logging.getLogger("flodld.controller")  # the Controller's log: the run's phases read in one place

PhaseListener = Callable[[Phase, str], object]


class WindowDriver:
    """Drives one run's window from `open()` until the verdict (`result`, `wait()`)."""

    def __init__(self, run: DriverRun, *, shipper: WorldShipper, state_cache: StateCache) -> None:
        self.run = run
        self.shipper = shipper
        self.state_cache = state_cache  # cleared at each phase change: it shows at once
        self.result: RunResult | None = None
        self._done = asyncio.Event()
        self._finishing = False
        self._last_phase: Phase | None = None
        self._listeners: list[PhaseListener] = []
        self._timer: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()

    def on_phase(self, listener: PhaseListener) -> None:
        self._listeners.append(listener)

    async def wait(self) -> RunResult:
        await self._done.wait()
        assert self.result is not None
        return self.result

    def open(self) -> None:
        """Open the run's window on its bound address and start the timer (inside the event loop)."""
        run, policy = self.run, self.run.policy
        assert run.address is not None
        run.window = JoinWindow(
            policy,
            run.options.roster,
            run.clock(),
            run_id=run.run_id,
            controller=_host_port(run.options.advertised_host, run.address[1]),
            tolerance=run.options.tolerance,
            tolerance_percent=run.options.tolerance_percent,
            declared=run.options.declared_ranks,
            elastic_max_ranks=run.options.join.elastic_max_ranks if run.options.growable else None,
        )
        run.started_at = time.time()
        log.info(
            "event=window_open quorum=%d target=%s window_secs=%g cap_secs=%g start=%s admission=%s",
            policy.quorum,
            policy.target,
            policy.window_secs,
            policy.cap_secs,
            policy.start.value,
            "pre-shared" if policy.trust is TrustMode.PRESHARED else "open",
        )
        self.announce()
        self._timer = asyncio.get_running_loop().create_task(self._drive())

    async def stop(self) -> None:
        """Cancel the timer and let the background sends finish (each within the abort timeout)."""
        if self._timer is not None:
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
        for task in list(self._background):
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(task, ABORT_TIMEOUT_SECS)

    async def _drive(self) -> None:
        # Events settle the window when they happen (hellos: once per loop turn); this loop moves the clock.
        while self.result is None:
            assert self.run.window is not None
            self.run.window.tick(self.run.clock())
            self.settle()
            self.run.storm_log.tick()
            await asyncio.sleep(self.run.options.tick_interval)

    def settle(self) -> None:
        """Act on the window's phase: form and ship, or conclude."""
        window = self.run.window
        assert window is not None
        if window.phase is Phase.FORMING and window.world is None:
            world = window.form(self.run.clock())
            self.run.formed_at = time.time()
            self.run.storm_log.flush()
            log.info(
                "event=world_formed world_size=%d hosts=%d reason=%r",
                world.world_size,
                len(world.hosts),
                window.reason,
            )
            self.spawn(self.shipper.ship(world))
        self.announce()
        if window.phase in TERMINAL_PHASES and not self._finishing:
            self._finishing = True
            self.spawn(self._finish(window.phase, window.final_reason))

    def announce(self, passed: Phase | None = None, why: str = "") -> None:
        """Tell the log and listeners about a new phase (`passed`: one the window went through)."""
        window = self.run.window
        phase = passed or (window.phase if window is not None else None)
        if phase is None or phase is self._last_phase:
            return
        self._last_phase = phase
        self.state_cache.clear()  # a phase change shows at once; member churn at most once per interval
        reason = why or (window.reason if window is not None else "")
        log.info("event=phase phase=%s reason=%r", phase.value, reason)
        for listener in self._listeners:
            try:
                listener(phase, reason)
            except Exception:  # a broken observer must not break admission or formation
                log.exception("event=phase_listener_failed phase=%s", phase.value)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` in the background: waited for at `stop()`, and a crash fails the run."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(self._background_ended)

    def _background_ended(self, task: asyncio.Task[None]) -> None:
        """A formation or finishing task that crashed fails the run with the reason: never a silent stall."""
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        log.error(
            "event=internal_error task=%s error=%r",
            task.get_coro().__qualname__,  # type: ignore[union-attr]
            error,
            exc_info=error,
        )
        if self.result is None:
            if self._finishing:  # _finish itself died: conclude without it
                self.conclude(RunResult(Phase.FAILED, f"internal error while finishing the run: {error!r}"))
            else:
                self.run.abort(f"internal error: {type(error).__name__}: {error}")

    async def _finish(self, phase: Phase, reason: str) -> None:
        await self.run.end_links(phase, reason)
        self.conclude(RunResult(phase, reason))

    def conclude(self, result: RunResult) -> None:
        """Write the verdict (once), with the run's root cause when it has one; `wait()` returns it."""
        if self.result is None:
            cause = self.run.root_cause()
            if cause is not None and result.root_cause is None:
                result = RunResult(result.verdict, result.reason, cause)
                log.error("event=root_cause %s", cause.summary)
            self.run.storm_log.flush()
            self.result = result
            self.run.ended_at = time.time()
            self._done.set()


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
