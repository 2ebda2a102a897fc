"""The start credential is per run (issue 29, point 4): a service that keeps its salt from run to run (a
configured `controller.join.token`) still gives every run its own credential, so one seen for run 1 arms
nothing later; `fdl start --derive-credential` reads the run id from the controller's state.json.
"""

from __future__ import annotations

import asyncio
import os
import sys

from flodld.config.join import JoinConfig
from flodld.controller.service import Service
from flodld.wire.salt import new_salt, salt_to_hex

from .agents import http, join, options
from .starthttp import credential
from .test_service import until_window


async def _derive(port: int, token: str) -> tuple[int | None, str, str]:
    """`fdl start --derive-credential --addr 127.0.0.1:PORT` with the join token on stdin."""
    env = {k: v for k, v in os.environ.items() if k not in ("FDL_ENV", "FDL_START_TOKEN", "FDL_JOIN_TOKEN")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fdl.main", "start", "--derive-credential", "--addr", f"127.0.0.1:{port}",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=env,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate((token + "\n").encode()), 60)
    return proc.returncode, out.decode().strip(), err.decode()


async def test_the_credential_of_run_1_is_refused_in_run_2_of_the_same_service() -> None:
    token = salt_to_hex(new_salt())
    service = Service(options(
        capacity=1, averaging="nccl_sync", run_id="svc",
        join=JoinConfig(join_timeout=30, min_rank_start=1, start="manual", token=token),
    ))  # fmt: skip
    _, port = await service.listen()
    serving = asyncio.ensure_future(service.serve())
    try:
        seen: list[str] = []
        for number in (1, 2):
            await until_window(service, number)
            assert service.controller is not None
            run_id = service.controller.run_id
            agent = await join(port, bytes.fromhex(token), "a")  # quorum met: only the start is missing
            current = service.controller.start_credential  # what this run logs for the operator
            for old in seen:  # every credential of an earlier run (the service's salt has not changed)
                status, body = await http(port, "POST", "/start", {"Authorization": f"Bearer {old}"})
                assert (status, body.get("code")) == (403, "bad_token"), body
                _, state = await http(port, "GET", "/state.json")
                assert state["phase"] == "staging"  # not armed
            status, body = await http(port, "POST", "/start", {"Authorization": f"Bearer {current}"})
            assert status == 200 and body["armed"] is True, body
            await agent.world()
            # The operator off the controller host derives the same value from the join token and the run id
            # that state.json shows.
            derived = await _derive(port, token)
            assert derived[:2] == (0, current) and current == credential(token, run_id), derived
            assert f"run {run_id}" in derived[2] and token not in derived[2].lower()
            await agent.leave()
            seen.append(current)
        assert seen[0] != seen[1]
    finally:
        service.stop("test over")
        await asyncio.wait_for(serving, 10)
