"""Wiring a controller's run to its data plane (flodld/controller/dataplane.py): `attach_data_plane` builds
the `DataPlane` when the world forms (CPU averaging only), with the timeouts the run's env gives, registers
its DATA and CONTROL channels with the controller's mux, and closes it when the run ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING

from flodld.controller.dataplane import DataPlane
from flodld.controller.rankwatch import (
    DEFAULT_ELASTIC_LIVENESS_TIMEOUT_SECS,
    DEFAULT_HEARTBEAT_INTERVAL_SECS,
    DEFAULT_LIVENESS_STARTUP_SECS,
    DEFAULT_LIVENESS_TIMEOUT_SECS,
)
from flodld.wire.magic import Channel

if TYPE_CHECKING:
    from flodld.controller.run import Controller


def attach_data_plane(controller: Controller, *, environ: Mapping[str, str] | None = None) -> None:
    """Serve DATA/CONTROL for `controller`'s run: built when the world forms, shut down when it ends.

    Timeouts come from FLODL_LIVENESS_TIMEOUT_SECS / FLODL_HEARTBEAT_INTERVAL_SECS in the run's env
    (the same values the ranks read), else the environment, scaled by FLODL_NET_TIMEOUT_SCALE; a rank
    never heard from gets FLODL_LIVENESS_STARTUP_SECS (120 s, scaled, at least the timeout) to start.
    A rank declared dead goes to `controller.rank_lost`: its host is lost and the run fails beyond
    the tolerance, the reason naming rank and silence. A run that survives a rank's loss
    (`controller.losses.survives_rank_loss`) declares a silent rank dead after 5 s by default instead of 30 s.
    """
    import os

    from flodld.membership.phase import TERMINAL_PHASES
    from flodld.net.timeouts import scaled

    source = {**(environ if environ is not None else os.environ), **controller.options.env}

    def seconds(name: str, default: float) -> float:
        raw = source.get(name)
        try:
            value = float(raw) if raw else default
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
        return value if name == "FLODL_HEARTBEAT_INTERVAL_SECS" else scaled(value)

    # Read (and refused if malformed) now; which default applies is known once the world formed (a
    # tolerance given as a share of the world is a count only then).
    timeouts = {
        elastic: seconds("FLODL_LIVENESS_TIMEOUT_SECS", default)
        for elastic, default in (
            (False, DEFAULT_LIVENESS_TIMEOUT_SECS),
            (True, DEFAULT_ELASTIC_LIVENESS_TIMEOUT_SECS),
        )
    }
    startup_secs = seconds("FLODL_LIVENESS_STARTUP_SECS", DEFAULT_LIVENESS_STARTUP_SECS)
    interval = seconds("FLODL_HEARTBEAT_INTERVAL_SECS", DEFAULT_HEARTBEAT_INTERVAL_SECS)
    planes: list[DataPlane] = []

    def on_phase(phase: object, reason: str) -> None:
        window = controller.window
        if (
            not planes
            and window is not None
            and window.world is not None
            and controller.options.cpu_averaging
        ):
            liveness = timeouts[controller.losses.survives_rank_loss]
            startup = max(liveness, startup_secs)
            plane = DataPlane(
                controller.salt,
                dict(window.world.ranks),
                host_key=controller.host_key,
                refusals=controller.counters.dropped,
                liveness_timeout=liveness,
                startup_timeout=startup,
                heartbeat_interval=interval,
                on_rank_dead=controller.rank_lost,  # a silent rank fails the run beyond the tolerance
                metrics=controller.run_metrics,
                straggler_timeout=controller.options.straggler_timeout,
                growable=controller.options.growable,
                chunk_env={key: source[key] for key in ("FLODL_CHUNK_BYTES",) if key in source},
            )
            controller.register_channels(
                {Channel.DATA: plane.handle_data, Channel.CONTROL: plane.handle_control}
            )
            plane.start()
            planes.append(plane)
            controller.round_in_progress = plane.round_in_progress
            plane.on_rank_round = controller.losses.rank_round
            controller.expect_walk_in = plane.expect
            plane.walk_ins.on_entered = controller.ranks_entered
        if planes and phase in TERMINAL_PHASES:
            task = asyncio.get_running_loop().create_task(planes[0].close())
            _closing.add(task)
            task.add_done_callback(_closing.discard)

    controller.on_phase(on_phase)


_closing: set[asyncio.Task[None]] = set()
