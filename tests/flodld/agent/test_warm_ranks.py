"""Warm ranks (flodld.rank.warm): a rank process that loaded torch before its world formed becomes the rank
exactly as a cold start would (argv, environment, stdin, the salt claimed), or is not used at all.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from flodld.agent.spawn import rank_command, spawn_warm, warm_environment, warm_handoff_argv
from flodld.agent.warmpool import WarmPool
from flodld.rank import env as rank_env
from flodld.rank.warm import (
    MAX_HANDOFF_BYTES,
    WARM_ENV,
    HandoffError,
    decode_handoff,
    encode_handoff,
    startup_differences,
    warm_count,
)

SCRIPT = """
import json, os, sys
print(json.dumps({
    "argv": sys.argv,
    "orig_argv": sys.orig_argv,
    "mark": os.environ.get("WARM_TEST_MARK"),
    "salt": os.environ.get("FLODL_INTERNAL_SALT"),
    "omp": os.environ.get("OMP_NUM_THREADS"),
    "stdin": sys.stdin.read(),
    "torch_loaded_before_script": "torch" in sys.modules,
    "path0": sys.path[0],
    "cmdline": open("/proc/self/cmdline", "rb").read().decode(errors="replace"),
}), flush=True)
"""


# --- the hand-off codec (pure) -------------------------------------------------------------------------


def test_a_handoff_round_trips_argv_and_environment() -> None:
    line = encode_handoff(["train.py", "--lr", "0.1"], {"RANK": "1", "A": "x=y"})
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode_handoff(line) == (["train.py", "--lr", "0.1"], {"RANK": "1", "A": "x=y"})


@pytest.mark.parametrize(
    ("line", "names"),
    [
        (b"not json\n", "not JSON"),
        (b'{"argv": ["a"]}\n', "exactly the keys"),
        (b'{"argv": [], "env": {}}\n', "non-empty list"),
        (b'{"argv": ["a", 3], "env": {}}\n', "non-empty list"),
        (b'{"argv": ["a"], "env": {"A=B": "1"}}\n', "variable names"),
        (b'{"argv": ["a"], "env": {"A": 1}}\n', "variable names"),
        (b'{"argv": ["a"], "env": {"A": "x\\u0000y"}}\n', "no NUL"),
        (b"[1, 2]\n", "exactly the keys"),
    ],
)
def test_a_malformed_handoff_is_refused_naming_what_is_wrong(line: bytes, names: str) -> None:
    with pytest.raises(HandoffError, match=names):
        decode_handoff(line)


def test_an_oversized_handoff_is_refused_before_parsing() -> None:
    with pytest.raises(HandoffError, match="cap"):
        encode_handoff(["a"], {"BIG": "x" * MAX_HANDOFF_BYTES})
    with pytest.raises(HandoffError, match="cap"):
        decode_handoff(b"{" + b" " * MAX_HANDOFF_BYTES + b"}\n")


def test_the_warm_count_is_a_bounded_decimal() -> None:
    assert warm_count({}) == 0
    assert warm_count({WARM_ENV: "4"}) == 4
    for bad in ("-1", "x", "65", " 2"):
        with pytest.raises(ValueError, match=WARM_ENV):
            warm_count({WARM_ENV: bad})


def test_only_startup_variables_decide_whether_a_warm_rank_fits() -> None:
    warm = {"OMP_NUM_THREADS": "1", "PYTHONPATH": "/a", "HOME": "/root"}
    assert startup_differences(warm, {**warm, "RANK": "3", "HOME": "/elsewhere"}) == []
    assert startup_differences(warm, {**warm, "OMP_NUM_THREADS": "2"}) == ["OMP_NUM_THREADS"]
    other = {"OMP_NUM_THREADS": "1", "LD_PRELOAD": "x.so"}
    assert startup_differences(warm, other) == ["LD_PRELOAD", "PYTHONPATH"]


def test_a_warm_rank_fits_python_scripts_started_by_this_interpreter_only() -> None:
    assert warm_handoff_argv(rank_command([sys.executable, "train.py", "1"])) == ["train.py", "1"]
    assert warm_handoff_argv(rank_command(["/other/python", "train.py"])) is None
    assert warm_handoff_argv(rank_command(["./a.out", "x"])) is None


def test_a_warm_environment_carries_no_identity_or_secret() -> None:
    parent = {"PATH": "/bin", rank_env.SALT: "ab", "RANK": "0", "MASTER_PORT": "1", WARM_ENV: "2"}
    env = warm_environment(parent, local_world_size=2)
    assert env["PATH"] == "/bin"
    assert not {rank_env.SALT, "RANK", "MASTER_PORT", WARM_ENV} & set(env)
    assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))


# --- real processes ------------------------------------------------------------------------------------


def _rank_env(warm_env: dict[str, str], **extra: str) -> dict[str, str]:
    return {**warm_env, "WARM_TEST_MARK": "handed-over", rank_env.SALT: "00" * 16, **extra}


async def _output(process: asyncio.subprocess.Process) -> tuple[int, dict[str, object]]:
    assert process.stdout is not None
    out = await asyncio.wait_for(process.stdout.read(), 120)
    code = await asyncio.wait_for(process.wait(), 30)
    return code, json.loads(out.decode().strip().splitlines()[-1])


async def test_a_warm_rank_becomes_the_rank_as_a_cold_start_would(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    pool = await WarmPool.start(1, os.environ)
    said: list[str] = []
    try:
        env = _rank_env(warm_environment(os.environ, local_world_size=1))
        process = await pool.take(rank_command([sys.executable, str(script), "a", "--b"]), env, said.append)
        assert process is not None, said
        code, seen = await _output(process)
    finally:
        await pool.close()
    assert code == 0 and said == []
    assert seen["argv"] == [str(script), "a", "--b"]
    assert "--warm" in seen["orig_argv"]  # type: ignore[operator]
    assert seen["mark"] == "handed-over"  # the handed environment replaced the one it started with
    assert seen["salt"] is None  # claimed before the script runs, as on a cold start
    assert "00" * 16 not in str(seen["cmdline"])  # the salt rode the pipe, never argv
    assert seen["stdin"] == ""  # /dev/null, as for a cold rank
    assert seen["torch_loaded_before_script"] is True
    assert seen["path0"] == str(tmp_path)


async def test_a_warm_rank_whose_startup_environment_differs_is_stopped_and_not_used(tmp_path: Path) -> None:
    pool = await WarmPool.start(1, os.environ)
    warm_process = pool._ready[0][0]
    said: list[str] = []
    try:
        env = _rank_env(warm_environment(os.environ, local_world_size=1), OMP_NUM_THREADS="97")
        taken = await pool.take(rank_command([sys.executable, str(tmp_path / "x.py")]), env, said.append)
    finally:
        await pool.close()
    assert taken is None
    assert said == ["warm rank not used, starting the rank cold: start-up variables differ (OMP_NUM_THREADS)"]
    assert warm_process.returncode is not None  # stopped, not left waiting


async def test_a_warm_rank_never_handed_over_ends_quietly_at_eof() -> None:
    process = await spawn_warm(warm_environment(os.environ, local_world_size=1))
    assert process.stdin is not None
    process.stdin.close()
    assert process.stdout is not None
    out = await asyncio.wait_for(process.stdout.read(), 120)
    assert await asyncio.wait_for(process.wait(), 30) == 0
    assert out == b""


async def test_unused_warm_ranks_are_killed_when_the_pool_closes() -> None:
    pool = await WarmPool.start(2, os.environ)
    processes = [process for process, _ in pool._ready]
    await pool.close()
    assert all(process.returncode is not None for process in processes)
    assert len(pool) == 0
