"""The start credential, never the salt (issue 13, point 6), against a real `flodld serve`.

`POST /start` from a caller that is not a local CLI takes the start credential
HMAC-SHA256(salt, "flodld/start/v2" NUL run_id), which `flodld serve` logs for the operator; the session salt
(join token) is refused there and never appears in a log line or an HTTP answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest

from flodld.wire.salt import new_salt, salt_from_hex

from .agents import join
from .daemon_proc import start_daemon
from .starthttp import START, arm_and_finish, credential, raw, stop

pytestmark = pytest.mark.multiproc


async def test_the_start_credential_arms_the_salt_does_not_and_the_salt_is_never_shown() -> None:
    token = new_salt().hex()
    expected = credential(token)
    daemon = await start_daemon("--ranks", "1", "--token", token, "--start", "manual", "--window", "20")
    try:
        agent = await join(daemon.port, salt_from_hex(token), "a")
        answers = [await raw(daemon.port, "GET", path) for path in ("/", "/state.json", "/metrics", "/nope")]
        # A caller that is not a local CLI (no X-Flodld-Start) must prove itself; the salt is refused.
        for presented in ({"Authorization": f"Bearer {token}"}, {"Authorization": f"Bearer {token.upper()}"}):
            status, _, body = await raw(daemon.port, "POST", "/start", presented)
            answers.append((status, {}, body))
            assert (status, json.loads(body)["code"]) == (403, "join_token")
        status, _, body = await raw(daemon.port, "POST", f"/start?token={token}")
        assert (status, json.loads(body)["code"]) == (403, "join_token")
        answers.append((status, {}, body))
        await arm_and_finish(daemon, agent, {"Authorization": f"Bearer {expected}"})
    finally:
        daemon.kill()
    for _, fields, body in answers:
        assert token not in body.decode().lower() and token not in json.dumps(fields).lower()
    log = daemon.log.decode(errors="replace")
    assert f"event=start_credential value={expected}" in log  # what the operator is shown
    assert token not in log.lower()  # the salt itself is never logged


async def test_an_auto_window_has_no_start_credential_line() -> None:
    token = new_salt().hex()
    daemon = await start_daemon("--ranks", "1", "--token", token)
    await stop(daemon)
    assert b"event=start_credential" not in daemon.log and token.encode() not in daemon.log


async def test_a_wrong_credential_from_the_controller_host_is_refused_not_ignored() -> None:
    """Issue 29, point 7: on loopback no credential is needed, but one that is given is checked."""
    token = new_salt().hex()
    daemon = await start_daemon("--ranks", "1", "--token", token, "--start", "manual", "--window", "20")
    try:
        agent = await join(daemon.port, salt_from_hex(token), "a")  # quorum met: only the start is missing
        unset = ("FDL_ENV", "FDL_START_TOKEN", "FDL_JOIN_TOKEN")
        env = {k: v for k, v in os.environ.items() if k not in unset}
        wrong = credential(token, "another-run")  # well formed, a real credential, not this run's
        fdl = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fdl.main", "start", "--addr", f"127.0.0.1:{daemon.port}", "--token", wrong,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip
        _, err = await asyncio.wait_for(fdl.communicate(), 60)
        assert fdl.returncode == 1, err
        assert b"403" in err and b"not this run's" in err, err
        _, _, body = await raw(daemon.port, "GET", "/state.json")
        assert json.loads(body)["phase"] == "staging"  # not armed
        # The same from curl with the CLI header, and the join token itself, are refused too.
        for presented in (wrong, token):
            status, _, body = await raw(
                daemon.port, "POST", "/start", {**START, "Authorization": f"Bearer {presented}"}
            )
            code = json.loads(body)["code"]
            assert (status, code) == (403, "bad_token" if presented == wrong else "join_token"), body
        await arm_and_finish(daemon, agent, START)  # no credential at all: the local CLI arms it
    finally:
        daemon.kill()
    assert "event=start_refused code=bad_token" in daemon.log.decode(errors="replace")
