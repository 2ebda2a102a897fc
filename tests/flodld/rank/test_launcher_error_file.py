"""`python -m flodld.launcher.rank SCRIPT.py`: an exception that ends the script is written to
TORCHELASTIC_ERROR_FILE as torch's `@record` would, unless `@record` already wrote it; exits are not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from flodld.agent.tail import read_error_file


def _run(script: str, tmp_path: Path, error_file: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "script.py"
    path.write_text(script)
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)}
    env.pop("RANK", None)
    return subprocess.run(
        [sys.executable, "-m", "flodld.launcher.rank", str(path)],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_an_exception_that_ends_the_script_is_recorded_with_its_message(tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"
    done = _run("raise ValueError('bad shard 7')\n", tmp_path, error_file)
    assert done.returncode == 1 and "ValueError: bad shard 7" in done.stderr  # the traceback as before
    recorded = read_error_file(error_file)
    assert recorded is not None and recorded.message == "ValueError: bad shard 7"
    extra = json.loads(error_file.read_text())["message"]["extraInfo"]
    assert "Traceback (most recent call last)" in extra["py_callstack"] and extra["timestamp"].isdigit()


def test_a_file_the_scripts_own_record_wrote_is_kept(tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"
    error_file.write_text(json.dumps({"message": {"message": "RuntimeError: from @record"}}))
    _run("raise ValueError('later')\n", tmp_path, error_file)
    recorded = read_error_file(error_file)
    assert recorded is not None and recorded.message == "RuntimeError: from @record"


def test_an_exit_is_not_an_exception(tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"
    assert _run("import sys\nsys.exit(3)\n", tmp_path, error_file).returncode == 3
    assert not error_file.exists()
