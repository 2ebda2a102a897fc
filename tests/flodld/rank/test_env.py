"""The rank's environment: the session salt leaves os.environ at once (issue 13, point 14).

A real agent starts a real rank; the rank's program shells out, and the child must not inherit
FLODL_INTERNAL_SALT, while the rank itself still reads the salt.
"""

from __future__ import annotations

import json
import os
import secrets

import pytest

from flodld.rank import env as rank_env
from tests.flodld.agent.test_walk_in_env import run_agent

pytestmark = pytest.mark.multiproc


def _reported(output: str, tag: str) -> str:
    lines = [line.split(tag + " ", 1)[1] for line in output.splitlines() if tag + " " in line]
    assert len(lines) == 1, output
    return str(json.loads(lines[0]))


async def test_a_subprocess_of_the_training_program_does_not_inherit_the_salt() -> None:
    token = secrets.token_hex(16)
    code, output, _ = await run_agent({}, token=token)
    assert code == 0, output
    assert _reported(output, "CHILD-SALT") == "", f"a subprocess of the rank inherited the salt\n{output}"
    assert _reported(output, "RANK-SALT") == token, output  # the rank itself still has it


def test_reading_the_rank_environment_claims_the_salt(monkeypatch: pytest.MonkeyPatch) -> None:
    salt = secrets.token_hex(16)
    monkeypatch.setattr(rank_env, "_claimed_salt_hex", None)
    for name, value in {rank_env.RANK: "0", rank_env.WORLD_SIZE: "1", rank_env.LOCAL_RANK: "0",
                        rank_env.LOCAL_WORLD_SIZE: "1", rank_env.CONTROLLER: "127.0.0.1:9",
                        rank_env.SALT: salt}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    assert rank_env.read_rank_environment().salt.hex() == salt
    assert rank_env.SALT not in os.environ
    assert rank_env.read_rank_environment().salt.hex() == salt  # read again: still there
    # An explicit mapping is read as given and left alone.
    given = {**os.environ, rank_env.SALT: "ab" * 16}
    assert rank_env.read_rank_environment(given).salt.hex() == "ab" * 16
    assert given[rank_env.SALT] == "ab" * 16
