"""The relay's log on a clean exit: ranks that leave (EOF, or a reset from a socket closed with unread
bytes) end their legs without a line each at INFO; a leg cut in the middle of a frame still says so.

Real relay and data plane (test_averaging_modes.Plane); ranks are blocking clients in this process.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

from flodld.relay.listener import leg_end_level
from flodld.wire.errors import WireError

from .test_averaging_modes import Plane


def _wait_for(condition: object, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def _relay_lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "flodld.relay" and r.levelno == level]


def test_ranks_that_leave_cleanly_log_no_leg_lines_at_info(
    caplog: pytest.LogCaptureFixture,
) -> None:
    plane = Plane()
    try:
        with caplog.at_level(logging.DEBUG, logger="flodld.relay"):
            clients = {rank: plane.client(rank) for rank in (0, 1)}
            for client in clients.values():
                client.deposit([torch.ones(4)])
            for client in clients.values():
                client.wait_round(0, timeout=30)
            for client in clients.values():
                client.close()
            _wait_for(lambda: plane.relay.gone == {0, 1})
    finally:
        plane.close()
    info = _relay_lines(caplog, logging.INFO)
    assert not [line for line in info if "leg closed" in line], info
    debug = _relay_lines(caplog, logging.DEBUG)
    assert len([line for line in debug if "leg closed" in line]) >= 2, debug


def test_a_leg_that_ends_as_a_leaving_rank_ends_is_debug_and_anything_else_info() -> None:
    # What a rank's exit looks like from the relay: EOF, or a reset when it left unread bytes behind
    # (`make demo` printed "[Errno 104] Connection reset by peer" per rank).
    assert leg_end_level(EOFError("peer closed the connection")) == logging.DEBUG
    assert leg_end_level(ConnectionResetError(104, "Connection reset by peer")) == logging.DEBUG
    assert leg_end_level(BrokenPipeError(32, "Broken pipe")) == logging.DEBUG
    # A frame cut in half or a wire error says something about the rank or the wire: kept.
    assert leg_end_level(WireError("truncated")) == logging.INFO
    assert leg_end_level(TimeoutError()) == logging.INFO
