"""`fdl start` never sends the join token, sends X-Flodld-Start, and derives the start credential
(issue 13, points 6 and 12), as a real process against a recording HTTP server.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import subprocess
import sys

import pytest

JOIN_TOKEN = "00112233445566778899aabbccddeeff"
RUN_ID = "svc-7"
CREDENTIAL = hmac.new(
    bytes.fromhex(JOIN_TOKEN), b"flodld/start/v2\x00" + RUN_ID.encode(), hashlib.sha256
).hexdigest()


def _fdl(*args: str, env: dict[str, str] | None = None, stdin: str = "") -> subprocess.CompletedProcess[str]:
    merged = {
        k: v for k, v in os.environ.items() if k not in ("FDL_ENV", "FDL_START_TOKEN", "FDL_JOIN_TOKEN")
    }
    return subprocess.run(
        [sys.executable, "-m", "fdl.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**merged, **(env or {})},
        input=stdin,
    )


@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_join_token_is_refused_before_anything_is_sent(
    recorder: tuple[int, list[tuple[str, dict[str, str]]]], how: str
) -> None:
    port, seen = recorder
    if how == "flag":
        result = _fdl("start", "--addr", f"127.0.0.1:{port}", "--token", JOIN_TOKEN.upper())
    else:
        result = _fdl("start", "--addr", f"127.0.0.1:{port}", env={"FDL_START_TOKEN": JOIN_TOKEN})
    assert result.returncode == 2, result.stderr
    assert seen == []  # the run's master key never went over the wire
    assert "join token" in result.stderr and "--derive-credential" in result.stderr
    assert JOIN_TOKEN not in result.stderr.lower()


def test_the_credential_travels_in_the_authorization_header_with_the_start_header(
    recorder: tuple[int, list[tuple[str, dict[str, str]]]],
) -> None:
    port, seen = recorder
    result = _fdl("start", "--addr", f"127.0.0.1:{port}", "--token", CREDENTIAL)
    assert result.returncode == 0, result.stderr
    [(path, headers)] = seen
    assert path == "/start" and headers["Authorization"] == f"Bearer {CREDENTIAL}"
    assert headers["X-Flodld-Start"] == "1"


def test_derive_credential_reads_the_join_token_from_stdin_or_the_environment() -> None:
    from_stdin = _fdl("start", "--derive-credential", "--run-id", RUN_ID, stdin=JOIN_TOKEN + "\n")
    assert (from_stdin.returncode, from_stdin.stdout.strip()) == (0, CREDENTIAL), from_stdin.stderr
    from_env = _fdl(
        "start", "--derive-credential", "--run-id", RUN_ID, env={"FDL_JOIN_TOKEN": JOIN_TOKEN.upper()}
    )
    assert (from_env.returncode, from_env.stdout.strip()) == (0, CREDENTIAL), from_env.stderr
    bad = _fdl("start", "--derive-credential", "--run-id", RUN_ID, stdin="not-hex\n")
    assert bad.returncode == 2 and "32" in bad.stderr


def test_derive_credential_is_per_run_and_without_a_run_id_or_a_controller_says_what_to_pass() -> None:
    other = _fdl("start", "--derive-credential", "--run-id", "svc-8", stdin=JOIN_TOKEN + "\n")
    assert other.returncode == 0 and other.stdout.strip() not in ("", CREDENTIAL), other.stderr
    with socket.socket() as unused:  # a port nothing listens on: no state.json to read the run id from
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
        lost = _fdl("start", "--derive-credential", "--addr", f"127.0.0.1:{port}", stdin=JOIN_TOKEN + "\n")
    assert lost.returncode == 1 and lost.stdout == "", lost.stdout
    assert "per run" in lost.stderr and "--run-id" in lost.stderr and JOIN_TOKEN not in lost.stderr.lower()
