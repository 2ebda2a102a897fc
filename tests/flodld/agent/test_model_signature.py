"""Issue 33, point 8: the agent's hello carries a model signature (SHA-256 of the Python file its ranks
run), so the ledger's `model_mismatch` check fires for real agents: a walk-in with another version of
the program is refused, naming both signatures and the fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import sys
from pathlib import Path

import pytest

from flodld.agent.join import build_hello, program_signature
from flodld.agent.spec import AgentSpec
from flodld.membership.ledger import Admitted, Ledger, Refused
from tests.flodld.controller.test_service_daemon import eventually_state
from tests.flodld.membership.helpers import policy
from tests.reliability.process import DaemonProcess

TRAIN_V1 = "import time\nprint('train v1')\ntime.sleep(60)\n"
TRAIN_V2 = "import time\nprint('train v2: a wider layer')\ntime.sleep(60)\n"


def _spec(host: str, program: list[str] | None) -> AgentSpec:
    return AgentSpec(host=host, controller_host="127.0.0.1", controller_port=1337, program=program)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_the_signature_is_the_program_files_digest_whatever_its_path_or_arguments(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "train.py").write_text(TRAIN_V1)
    (tmp_path / "b" / "copy.py").write_text(TRAIN_V1)
    one = program_signature([sys.executable, str(tmp_path / "a" / "train.py"), "--data", "/x"])
    other = program_signature(["/usr/bin/python3", str(tmp_path / "b" / "copy.py"), "--data", "/y"])
    assert one == other == _sha(TRAIN_V1)
    assert program_signature([sys.executable, "-m", "some.module"]) is None
    assert program_signature(["/usr/bin/true"]) is None
    assert program_signature([sys.executable, str(tmp_path / "missing.py")]) is None
    (tmp_path / "dir.py").mkdir()
    assert program_signature([sys.executable, str(tmp_path / "dir.py")]) is None


def test_a_hello_carries_it_and_the_ledger_refuses_another_version_naming_both_and_the_fix(
    tmp_path: Path,
) -> None:
    old, new, same = tmp_path / "old.py", tmp_path / "new.py", tmp_path / "same.py"
    old.write_text(TRAIN_V1)
    new.write_text(TRAIN_V2)
    same.write_text(TRAIN_V1)
    hello_a = build_hello(_spec("a", [sys.executable, str(old)]), ["cpu:0"])
    assert hello_a.model_sig == _sha(TRAIN_V1)
    ledger = Ledger(policy(capacity=3))
    assert isinstance(ledger.admit(hello_a, 0.0), Admitted)
    assert isinstance(
        ledger.admit(build_hello(_spec("c", [sys.executable, str(same)]), ["cpu:0"]), 0.0), Admitted
    )
    refused = ledger.admit(build_hello(_spec("b", [sys.executable, str(new)]), ["cpu:0"]), 0.0)
    assert isinstance(refused, Refused) and refused.code == "model_mismatch"
    assert _sha(TRAIN_V2)[:8] in refused.reason and _sha(TRAIN_V1)[:8] in refused.reason
    assert (
        "'b'" in refused.reason
        and "sha256sum" in refused.reason
        and "same file on every host" in refused.reason
    )


@pytest.mark.multiproc
@pytest.mark.timeout(300)
async def test_a_walk_in_with_another_program_version_is_refused_by_a_real_daemon(tmp_path: Path) -> None:
    (tmp_path / "v1").mkdir()
    (tmp_path / "v2").mkdir()
    old, new = tmp_path / "v1" / "train.py", tmp_path / "v2" / "train.py"
    old.write_text(TRAIN_V1)
    new.write_text(TRAIN_V2)
    daemon = DaemonProcess(tmp_path, target=2, min_ranks=2)
    env = {**os.environ, "FDL_JOIN_TOKEN": daemon.token, "FLODL_NET_TIMEOUT_SCALE": "0.2"}

    async def walk_in(host: str, program: Path) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fdl.main", "join", f"127.0.0.1:{daemon.port}", "--bin", str(program),
            "--host", host, "--devices", "cpu", env=env, cwd=program.parent,  # no fdl.yml there
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    first = await walk_in("walk-a", old)
    try:
        try:
            await eventually_state(
                daemon.port, lambda s: [m["host"] for m in s["members"]] == ["walk-a"], timeout=90
            )
        except AssertionError as error:
            out = await stop_group(first)
            raise AssertionError(
                f"{error}\nwalk-a:\n{out.decode(errors='replace')}\ndaemon:\n{daemon.log[-4000:]}"
            ) from None
        second = await walk_in("walk-b", new)
        try:
            out, _ = await asyncio.wait_for(second.communicate(), 90)
        except TimeoutError:
            out = await stop_group(second)
            raise AssertionError(
                f"walk-b did not finish:\n{out.decode(errors='replace')}\ndaemon:\n{daemon.log[-4000:]}"
            ) from None
        text = out.decode(errors="replace")
        assert second.returncode == 2, text  # permanent: dialing again cannot fix a different program
        assert "model mismatch" in text and _sha(TRAIN_V2)[:8] in text and _sha(TRAIN_V1)[:8] in text, text
        assert "sha256sum" in text, text
        body = await eventually_state(daemon.port, lambda s: s["refused"].get("model_mismatch") == 1)
        assert [m["host"] for m in body["members"]] == ["walk-a"]
    finally:
        await stop_group(first)
        daemon.kill()


async def stop_group(proc: asyncio.subprocess.Process) -> bytes:
    """SIGTERM to the walk-in's process group (fdl join and its agent), SIGKILL if it outlives 20 s;
    what it printed (empty once read before).
    """
    if proc.stdout is None or proc.stdout.at_eof():
        return b""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 20)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = await asyncio.wait_for(proc.communicate(), 10)
    return out
