"""Builders shared by the membership tests: a real `Hello` and a real derived policy."""

from __future__ import annotations

from typing import Any

from flodld.config.fields import AveragingMode
from flodld.config.join import JoinConfig
from flodld.membership.phase import Phase
from flodld.membership.policy import WindowPolicy, derive_policy
from flodld.membership.window import JoinWindow
from flodld.wire.join import JOIN_PROTOCOL_VERSION as PROTOCOL_VERSION
from flodld.wire.join import Hello

SIG_A = "a" * 64
SIG_B = "b" * 64


def hello(host: str, devices: int | list[str] = 1, **fields: object) -> Hello:
    """A valid hello from `host` offering `devices` CPU devices (or the given device names)."""
    names = [f"cpu:{i}" for i in range(devices)] if isinstance(devices, int) else devices
    values: dict[str, Any] = {
        "host": host,
        "devices": names,
        "device_labels": [],
        "variant": "cpu",
        "torch_version": "2.13.0",
        "protocol_version": PROTOCOL_VERSION,
    }
    values.update(fields)
    return Hello(**values)


def policy(
    capacity: int = 2,
    *,
    loopback_bind: bool = False,
    averaging: AveragingMode = AveragingMode.CPU_SYNC,
    **knobs: Any,  # noqa: ANN401  the `controller.join` knobs, passed on to JoinConfig
) -> WindowPolicy:
    """The policy `derive_policy` makes from these `controller.join:` knobs."""
    return derive_policy(
        JoinConfig(**knobs), capacity=capacity, loopback_bind=loopback_bind, averaging=averaging
    )


def phase_of(window: JoinWindow) -> Phase:
    """The window's phase read afresh: mypy keeps `window.phase` narrowed by an earlier assert across the
    calls that move it on, so a second assert on the same attribute would look unreachable.
    """
    return window.phase
