"""`fdl config check [FILE] [--env X]`: every problem as file:line:column: key, exit 2; clean: exit 0 and one
summary line of the roster and the window. Run through the real `fdl` entry point as a subprocess.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def fdl(*args: str, cwd: Path, stdin: str = "") -> subprocess.CompletedProcess[str]:
    import os

    env = {k: v for k, v in os.environ.items() if k != "FDL_ENV"}
    env["PYTHONPATH"] = f"{REPO}:{REPO / 'clients'}"
    return subprocess.run([sys.executable, "-m", "fdl.main", *args], cwd=cwd, env=env, input=stdin,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


GOOD = """\
cluster:
  controller:
    host: 10.0.0.1
    join: {min_rank_start: 2, join_timeout: 60}
  workers:
    - {host: node-a, path: /srv/p, local_devices: [cpu:2]}
    - {host: node-b, path: /srv/p, local_devices: [cpu]}
"""


def test_a_clean_project_exits_0_with_one_line_naming_roster_and_window(tmp_path: Path) -> None:
    (tmp_path / "fdl.yml").write_text(GOOD)
    done = fdl("config", "check", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout
    assert lines[0].startswith("fdl.yml: OK")
    assert "node-a (2 rank(s)), node-b (1 rank(s)), capacity 3" in lines[0]
    assert "quorum 2 ranks, target 3, window 60s" in lines[0]


def test_problems_print_as_file_line_key_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "fdl.yml").write_text(GOOD.replace("host: 10.0.0.1", "host: 10.0.0.1\n    prot: 1")
                                      .replace("[cpu]", "[gpu1]"))  # fmt: skip
    done = fdl("config", "check", cwd=tmp_path)
    assert done.returncode == 2
    problems = done.stderr.splitlines()
    assert problems[0].startswith(
        "fdl.yml:4:5: cluster.controller.prot: unknown key 'prot'; did you mean 'port'?"
    )
    assert problems[1].startswith("fdl.yml:8:52: cluster.workers[1].local_devices[0]: 'gpu1' is not a device")
    assert problems[-1] == "fdl config check: 2 problem(s)"
    assert done.stdout == ""


def test_window_contradictions_are_problems_at_the_join_line(tmp_path: Path) -> None:
    (tmp_path / "fdl.yml").write_text(GOOD.replace("{min_rank_start: 2, join_timeout: 60}",
                                                   "{start: manual, target_ranks: 2}"))  # fmt: skip
    done = fdl("config", "check", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.splitlines()[0].startswith(
        "fdl.yml:4:5: cluster.controller.join: start: manual and target_ranks contradict"
    ), done.stderr


def test_a_named_file_takes_its_overlay_from_next_to_it(tmp_path: Path) -> None:
    configs = tmp_path / "etc"
    configs.mkdir()
    (configs / "other.yml").write_text(GOOD)
    (configs / "other.x.yml").write_text("cluster:\n  controller:\n    join: {min_rank_start: 9}\n")
    done = fdl("--env", "x", "config", "check", str(configs / "other.yml"), cwd=tmp_path)
    assert done.returncode == 2, done.stdout
    assert "other.x.yml:3:5: cluster.controller.join: min_rank_start (9) is above" in done.stderr, done.stderr
    done = fdl("config", "check", str(configs / "other.yml"), "--env", "nope", cwd=tmp_path)
    assert done.returncode == 2 and "other.nope.yml (the overlay of other.yml) does not exist" in done.stderr


def test_stdin_is_checked_as_one_document(tmp_path: Path) -> None:
    done = fdl("config", "check", "-", cwd=tmp_path, stdin=GOOD)
    assert done.returncode == 0 and done.stdout.startswith("<stdin>: OK"), done.stderr
    done = fdl("config", "check", "-", cwd=tmp_path, stdin="cluster: [1]\n")
    assert done.returncode == 2 and done.stderr.startswith("<stdin>:1:1: cluster: expected a mapping"), (
        done.stderr
    )


def test_no_configuration_is_a_problem(tmp_path: Path) -> None:
    done = fdl("config", "check", cwd=tmp_path)
    assert done.returncode == 2 and "no fdl.yml in" in done.stderr
