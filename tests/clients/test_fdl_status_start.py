"""`fdl status` / `fdl start` as real processes against a live `flodld serve` on loopback."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from fdl.address import resolve_candidates
from fdl.main import split_env
from fdl.status import render, render_history

from flodld.membership.snapshot import StateSnapshot
from flodld.wire.salt import new_salt, salt_from_hex
from tests.clients.fdl_proc import fdl
from tests.flodld.controller.agents import join
from tests.flodld.controller.daemon_proc import start_daemon

pytestmark = pytest.mark.multiproc


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_status_pretty_and_json_against_a_live_daemon_then_start_arms_it(tmp_path: Path) -> None:
    token = new_salt().hex()
    daemon = await start_daemon(
        "--ranks", "2", "--token", token, "--start", "manual", "--window", "0.2", "--cap", "60"
    )
    addr = f"127.0.0.1:{daemon.port}"
    try:
        code, out, _ = await fdl("status", "--addr", addr)
        assert code == 0
        assert f"@ {addr} — waiting" in out and "ranks: 0 joined across 0 host(s)" in out
        assert "hosts: none joined yet" in out and "start: manual — waiting for quorum" in out
        agents = [
            await join(daemon.port, salt_from_hex(token), h, devices=d)
            for h, d in (("node-a", 1), ("node-b", 2))
        ]
        code, out, _ = await fdl("status", "--addr", addr)
        assert code == 0
        assert "— staging" in out and "ranks: 3 joined across 2 host(s) — quorum 2, no target" in out
        assert "start: manual — startable — fire with `fdl start`" in out  # the page's words (summary.py)
        assert "node-a  ranks 0  1× cpu:0  variant cpu  joined +" in out  # the page's words for a host
        assert "node-b  ranks 1–2  cpu:0, cpu:1  variant cpu  joined +" in out  # distinct devices listed
        code, out, _ = await fdl("status", "--json", "--addr", addr)
        served = StateSnapshot.model_validate(json.loads(out))
        assert code == 0 and served.joined_ranks == 3 and served.summary is not None
        assert served.summary.start == "manual — startable — fire with `fdl start`"
        code, _, err = await fdl("start", "--addr", addr, "--token", "00" * 32)
        # Loopback needs no credential (fdl start sends X-Flodld-Start), but one that is given is checked:
        # a wrong one is refused, not ignored (issue 29, point 7).
        assert code == 1 and "403" in err and "not this run's" in err, err
        code, _, err = await fdl("start", "--addr", addr)
        assert code == 0, err
        await asyncio.gather(*(a.world() for a in agents))
        code, _, err = await fdl("start", "--addr", addr)
        assert code == 1 and "start refused" in err and "window is not open" in err
        watch = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "fdl.main",
            "status",
            "--watch",
            "--interval",
            "0.1",
            "--addr",
            addr,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert watch.stdout is not None and watch.stderr is not None
        first = await asyncio.wait_for(watch.stdout.readline(), 30)
        assert b"training" in first
        for agent in agents:
            await agent.leave()
        out_b, err_b = await asyncio.wait_for(watch.communicate(), 30)
        out, err = first.decode() + out_b.decode(), err_b.decode()
        # The daemon exits when the run is done; --watch reports either the verdict or the closed port.
        assert watch.returncode == 0 and ("— done" in out or "the run has ended" in err), err
        assert await daemon.finish() == 0
    finally:
        daemon.kill()


async def test_status_with_nothing_listening_exits_one_with_an_explanation() -> None:
    code, _, err = await fdl("status", "--addr", f"127.0.0.1:{_free_port()}")
    assert code == 1 and "no run listening at" in err and "(--addr)" in err
    code, _, err = await fdl("start", "--addr", f"127.0.0.1:{_free_port()}")
    assert code == 1 and "start not armed" in err


async def test_overlay_selection_finds_the_controller_and_unknown_envs_are_listed(tmp_path: Path) -> None:
    daemon = await start_daemon("--ranks", "1")
    try:
        (tmp_path / "fdl.yml").write_text("{}\n")
        (tmp_path / "fdl.lab.yml").write_text(
            f"cluster:\n  controller:\n    host: 127.0.0.1\n    port: {daemon.port}\n"
            "  workers:\n    - host: localhost\n      local_devices: [cpu]\n"
        )
        for args, env in (
            (("@lab", "status"), None),
            (("--env", "lab", "status"), None),
            (("status", "--env", "lab"), None),
            (("status",), {"FDL_ENV": "lab"}),
            (("@lab", "status"), {"FDL_ENV": "nonexistent"}),  # the command line wins over FDL_ENV
        ):
            code, out, err = await fdl(*args, "--project", str(tmp_path), env=env)
            assert code == 0, (args, err)
            assert f"@ 127.0.0.1:{daemon.port} — waiting" in out
        code, _, err = await fdl("@nope", "status", "--project", str(tmp_path))
        assert code == 2 and "unknown environment 'nope'" in err and "available overlays: lab" in err
    finally:
        daemon.proc.terminate()
        await daemon.finish()


def test_bare_host_gets_the_default_port_and_ipv6_literals_parse() -> None:
    assert resolve_candidates("10.0.0.7", None, ".", "status").addresses == (("10.0.0.7", 1337),)
    assert resolve_candidates("[::1]:9000", None, ".", "status").addresses == (("::1", 9000),)


def test_without_an_overlay_the_projects_fdl_yml_names_the_controller(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "fdl.yml").write_text(
        "cluster:\n  controller: {host: 10.0.0.7, port: 1400}\n"
        "  workers:\n    - {host: 10.0.0.7, local_devices: [cpu]}\n"
    )
    found = resolve_candidates(None, None, tmp_path, "status")
    assert found.addresses == (("10.0.0.7", 1400), ("127.0.0.1", 1400))
    assert found.origin == "fdl.yml controller" and capsys.readouterr().err == ""
    # Port 0 (any free port) names nothing to dial; no fdl.yml, or one without a cluster: the default.
    (tmp_path / "fdl.yml").write_text(
        "cluster:\n  controller: {host: 127.0.0.1, port: 0}\n"
        "  workers:\n    - {host: 127.0.0.1, local_devices: [cpu]}\n"
    )
    assert resolve_candidates(None, None, tmp_path, "start").addresses == (("127.0.0.1", 1337),)
    (tmp_path / "fdl.yml").write_text("join: {address: 10.0.0.7}\n")
    assert resolve_candidates(None, None, tmp_path, "status").addresses == (("127.0.0.1", 1337),)
    assert resolve_candidates(None, None, tmp_path / "empty", "status").addresses == (("127.0.0.1", 1337),)


@pytest.mark.timeout(180)
def test_status_watch_under_fdl_run_finds_the_controller_in_fdl_yml_and_shows_the_verdict(
    tmp_path: Path,
) -> None:
    from tests.e2e.harness import Fdl

    port = _free_port()
    (tmp_path / "fdl.yml").write_text(
        f"cluster:\n  controller: {{host: 127.0.0.1, port: {port}}}\n"
        "  workers:\n    - {host: 127.0.0.1, local_devices: [cpu]}\n"
    )
    (tmp_path / "train.py").write_text("import time\ntime.sleep(3)\nprint('trained', flush=True)\n")
    run = Fdl("run", "train.py", cwd=tmp_path)
    try:
        run.wait_for(rf"controller on 127\.0\.0\.1:{port}", timeout=60)
        watch = Fdl("status", "--watch", "--interval", "1", cwd=tmp_path)  # no --addr, no overlay
        assert watch.wait(60) == 0, watch.output
        assert run.wait(60) == 0, run.output
    finally:
        run.kill()
    assert f"@ 127.0.0.1:{port} — " in watch.output, watch.output
    assert "— done" in watch.output, watch.output  # the verdict, not "the controller port closed"
    assert "port closed" not in watch.output, watch.output


def test_env_selector_rules() -> None:
    assert split_env(["@lab", "status", "--json"]) == ("lab", ["status", "--json"])
    assert split_env(["run", "x.py", "--env=lab", "--", "--env", "kept"]) == (
        "lab",
        ["run", "x.py", "--", "--env", "kept"],
    )
    assert split_env(["status", "@lab"]) == (None, ["status", "@lab"])  # @env only before the command


def test_host_lines_and_render_shapes() -> None:
    member = {"host": "g", "ranks": [4, 5, 6], "device_labels": ["cuda:0"] * 3, "variant": "cu12",
              "joined_at_secs": 7.9, "link": "lost"}  # fmt: skip
    lines = render({"phase": "training", "members": [member]}, "h:1").splitlines()
    assert "    g  ranks 4–6  3× cuda:0  variant cu12  joined +7s  link lost" in lines
    bare = render({"phase": "training", "members": [{"host": "b", "ranks": []}]}, "h:1").splitlines()
    assert "    b  ranks —  no devices listed  variant -  joined —" in bare
    text = render(
        {
            "phase": "failed",
            "run_id": "r",
            "joined_ranks": 0,
            "joined_hosts": 0,
            "quorum": 1,
            "target": None,
            "members": [],
            "reason": "quorum not met",
        },
        "h:1",
        colour=True,
    )
    assert "\033[31mfailed\033[0m" in text and "reason: quorum not met" in text


def test_status_shows_the_root_cause_under_the_reason_and_in_the_history() -> None:
    cause = {
        "host": "walk-a", "rank": 1, "code": 1, "exit": "exit code 1", "failed_at": 1_765_000_000.5,
        "error": "RuntimeError: boom", "tail": [f"line {i}" for i in range(40)],
        "summary": "rank 1 on host 'walk-a' (exit code 1): RuntimeError: boom",
        "failed_ranks": 3, "consequences": 1,
    }  # fmt: skip
    state = {
        "phase": "failed", "run_id": "r", "joined_ranks": 4, "joined_hosts": 2, "quorum": 4, "target": 4,
        "members": [], "reason": "1 of 4 ranks failed (ranks [2])", "root_cause": cause,
        "history": [{"run_id": "r0", "verdict": "failed", "reason": "x", "root_cause": cause}],
    }  # fmt: skip
    text = render(state, "h:1", colour=False)
    lines = text.splitlines()
    at = lines.index("  Root cause (first observed failure):")
    assert lines[at - 1] == "  reason: 1 of 4 ranks failed (ranks [2])"
    assert lines[at + 1] == "    rank 1 on host 'walk-a' (exit code 1): RuntimeError: boom"
    assert "    error: RuntimeError: boom" in lines
    assert "    | line 39" in lines and "    | line 19" not in lines  # the last 20 lines
    assert "(2 other failed rank exit(s) reported, 1 of them torn down by the teardown)" in text
    assert "previous run's root cause: rank 1 on host 'walk-a'" in text
    assert "x — root cause: rank 1 on host 'walk-a'" in render_history(state)


def test_start_sends_the_token_in_the_authorization_header_never_the_url(
    recorder: tuple[int, list[tuple[str, dict[str, str]]]],
) -> None:
    port, seen = recorder
    token = "00112233445566778899aabbccddeeff" * 2  # a start credential: 64 hex
    result = subprocess.run(
        [sys.executable, "-m", "fdl.main", "start", "--addr", f"127.0.0.1:{port}", "--token", token],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    sent = [(path, headers.get("Authorization"), headers.get("X-Flodld-Start")) for path, headers in seen]
    assert sent == [("/start", f"Bearer {token}", "1")]
