"""What a reader asking for a different `?members=A..B` each time, or `/status` over and over, costs the
controller: controller CPU per request before issue 29 (a build and an encoding per page; a render per
status request) and now (pages spliced from one build's encoded rows; one render per build).

    .venv/bin/python bench/state_pages.py [--hosts 400] [--label-bytes 230] [--requests 400] [--rounds 5]

In process, no sockets: a controller's window with `--hosts` members of 8 devices, each device label
`--label-bytes` long (the issue measured 36.8 ms per range request at 400 hosts with large labels). "before"
runs what the old cache ran on every miss (the window's dict for the page, then one `json.dumps`) and the
old status handler (`render_page` per request); "after" asks the controller (`state_body`,
`status_html`) with its cache holding one build. Per round: CPU µs per request (process time), both ways.
Last lines: the medians and their ratio (before over after). Counts, not timings, are what the tests
assert (`tests/flodld/controller/test_state_render_cost.py`); this shows the size of the difference.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from flodld.config.fields import AveragingMode
from flodld.config.join import JoinConfig
from flodld.controller.options import ControllerOptions
from flodld.controller.run import Controller
from flodld.controller.status.page import render_page
from flodld.membership.policy import derive_policy
from flodld.membership.window import JoinWindow
from flodld.wire.join import JOIN_PROTOCOL_VERSION, Hello

NOW = 5.0


def _controller(hosts: int, label_bytes: int) -> Controller:
    capacity = 8 * hosts + 8
    options = ControllerOptions.model_validate({"bind_host": "127.0.0.1", "port": 0, "capacity": capacity})
    controller = Controller(options, clock=lambda: NOW)
    policy = derive_policy(
        JoinConfig(), capacity=capacity, loopback_bind=True, averaging=AveragingMode.CPU_SYNC
    )
    window = JoinWindow(policy, [], 0.0, run_id="bench", controller="127.0.0.1:1")
    for i in range(hosts):
        labels = [(f"GPU {d} of host {i} " + "L" * label_bytes)[:256] for d in range(8)]
        hello = Hello(
            host=f"host-{i:05d}", devices=[f"cuda:{d}" for d in range(8)], device_labels=labels,
            variant="cu128", torch_version="2.13.0", protocol_version=JOIN_PROTOCOL_VERSION,
        )  # fmt: skip
        window.hello(hello, 0.5 + i / 1000)
    controller.window = window
    controller.state_cache.interval = controller.state_cache.max_age = 3600.0  # one build for the bench
    return controller


def _old_page(controller: Controller, members: tuple[int, int]) -> bytes:
    """What a miss cost before: the page's dict (`window.state`) and one encoding of it."""
    assert controller.window is not None
    state: dict[str, Any] = controller.window.state(NOW, members)
    state["connections"] = {"by_channel": {}, "dropped": {}}
    return json.dumps(state, separators=(",", ":")).encode()


def _per_request_us(work: list[Any], call: Any) -> float:  # noqa: ANN401  a request's arguments, its call
    begun = time.process_time()
    for item in work:
        call(item)
    return (time.process_time() - begun) / len(work) * 1e6


def _round(
    controller: Controller,
    work: list[tuple[int, int]],
    ranges: dict[str, list[float]],
    status: dict[str, list[float]],
) -> None:
    """One round: the distinct ranges and the status requests, the old way and the controller's."""
    ranges["before"].append(_per_request_us(work, lambda m: _old_page(controller, m)))
    ranges["after"].append(_per_request_us(work, lambda m: controller.state_body(m, "192.0.2.1")))
    polls = list(range(max(1, len(work) // 10)))
    status["before"].append(_per_request_us(polls, lambda _: render_page(controller.state_json())))
    status["after"].append(_per_request_us(polls, lambda _: controller.status_html("192.0.2.1")))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hosts", type=int, default=400)
    parser.add_argument("--label-bytes", type=int, default=230, help="at most 230 (labels are <= 256)")
    parser.add_argument("--requests", type=int, default=400, help="distinct ranges (and status requests)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(29)
    ranges: dict[str, list[float]] = {"before": [], "after": []}
    status: dict[str, list[float]] = {"before": [], "after": []}
    for round_ in range(args.rounds):
        work = []
        for _ in range(args.requests):
            start = rng.randrange(args.hosts)
            work.append((start, rng.randrange(start, args.hosts) + 1))
        _round(_controller(args.hosts, args.label_bytes), work, ranges, status)
        print(
            f"round {round_}: distinct ranges {ranges['before'][-1]:9.1f} -> {ranges['after'][-1]:7.1f} "
            f"µs/request; /status {status['before'][-1]:9.1f} -> {status['after'][-1]:7.1f} µs/request"
        )
    for name, series in (("distinct ?members ranges", ranges), ("/status", status)):
        before, after = statistics.median(series["before"]), statistics.median(series["after"])
        print(
            f"{name}: before {before:.1f} µs ({min(series['before']):.1f}-{max(series['before']):.1f}), "
            f"after {after:.1f} µs ({min(series['after']):.1f}-{max(series['after']):.1f}); "
            f"before/after {before / after:.1f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
