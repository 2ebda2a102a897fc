"""`flodld serve` as a real process: trust follows the address actually bound (issue 13, point 4).

`--tunnel-only` with a network `--bind` is refused (exit 2, naming both flags and the fix); a
tunneled roster on a network bind needs the salt; open admission on a network bind happens only
when asked for, with a warning naming the address.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from flodld.wire.errors import WireError
from flodld.wire.salt import OPEN_ADMISSION_KEY

from .agents import join
from .daemon_proc import start_daemon
from .starthttp import raw, serve_exit, stop

pytestmark = pytest.mark.multiproc


async def test_tunnel_only_with_a_network_bind_exits_two_naming_both_flags_and_the_fix() -> None:
    code, err = await serve_exit("--tunnel-only", "--discovery", "--min-ranks", "1", "--bind", "0.0.0.0")
    assert code == 2, f"flodld served a tunnel_only window on 0.0.0.0 (exit {code}): {err[-2000:]}"
    assert "--tunnel-only" in err and "--bind" in err and "0.0.0.0" in err
    assert (
        "127.0.0.1" in err and "--token" in err
    )  # the fixes: bind loopback, or drop tunnel_only for a token
    assert "event=listening" not in err  # refused before the port was ever opened


async def test_tunnel_only_on_a_loopback_hostname_is_open_through_the_tunnel() -> None:
    daemon = await start_daemon(
        "--tunnel-only", "--discovery", "--min-ranks", "1", "--bind", "localhost", "--window", "20"
    )
    try:
        agent = await join(daemon.port, OPEN_ADMISSION_KEY, "walk-in", open_admission=True)
        assert agent.accepted.ranks == [0]
        await agent.stream.aclose()
    finally:
        await stop(daemon)
    assert b"open_admission_warning" not in daemon.log  # loopback: reachability through sshd is the check


async def test_a_tunneled_roster_on_a_network_bind_needs_the_salt(tmp_path: Path) -> None:
    config = tmp_path / "fdl.yml"
    config.write_text(
        "cluster:\n  controller:\n    host: 127.0.0.1\n    port: 1400\n    join: {join_timeout: 20}\n"
        "  workers:\n    - host: node-a\n      path: /srv\n      tunnel: true\n      local_devices: [cpu]\n"
    )
    # Every remote worker is tunneled (the intent: loopback), but --bind 0.0.0.0 is what is bound
    # (start_daemon passes --port 0 over the config's port).
    daemon = await start_daemon("--config", str(config), "--bind", "0.0.0.0")
    try:
        with pytest.raises((EOFError, WireError, ConnectionError)):
            await join(daemon.port, OPEN_ADMISSION_KEY, "node-a", open_admission=True)
        _, _, body = await raw(daemon.port, "GET", "/state.json")
        state = json.loads(body)
        assert state["joined_ranks"] == 0 and state["refused"]["bad_tag"] == 1
    finally:
        await stop(daemon)
    assert b"admission=pre-shared" in daemon.log and b"admission=open" not in daemon.log


async def test_open_admission_on_a_network_bind_is_explicit_and_warned_naming_the_address() -> None:
    daemon = await start_daemon(
        "--open-admission", "--discovery", "--min-ranks", "1", "--bind", "0.0.0.0", "--window", "20"
    )
    try:
        await asyncio.sleep(0.2)  # the warning follows the listening line
        agent = await join(daemon.port, OPEN_ADMISSION_KEY, "walk-in", open_admission=True)
        assert agent.accepted.salt_hex is not None  # what open admission means, asked for explicitly
        await agent.stream.aclose()
    finally:
        await stop(daemon)
    log = daemon.log.decode(errors="replace")
    warning = next(line for line in log.splitlines() if "event=open_admission_warning" in line)
    assert "bind=0.0.0.0" in warning and "NOT loopback" in warning
