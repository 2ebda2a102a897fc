"""The shipped unit files pass `systemd-analyze verify` (with paths pointed at this checkout)."""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require_binary

UNITS_DIR = Path(__file__).resolve().parents[2] / "systemd"
UNITS = sorted(p.name for p in UNITS_DIR.glob("*.service"))


def _localise(text: str, tmp: Path) -> str:
    """Point install paths at executables that exist here; verify refuses missing binaries."""
    venv_bin = Path(sys.executable).parent
    text = text.replace("/opt/flodld/.venv/bin/", f"{venv_bin}/")
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    return text.replace("/usr/sbin/sshd", sshd)


def test_units_exist() -> None:
    assert {"flodld.service", "fdl-join.service", "fdl-join-sshd@.service"} <= set(UNITS)


@pytest.mark.parametrize("unit", UNITS)
def test_unit_passes_systemd_analyze_verify(unit: str, tmp_path: Path) -> None:
    analyze = require_binary("systemd_analyze", "systemd-analyze")
    if "@" in unit:
        require_binary("sshd", "sshd", search_sbin=True)
    name = unit.replace("@.service", "@2222.service")
    target = tmp_path / name
    target.write_text(_localise((UNITS_DIR / unit).read_text(), tmp_path))
    result = subprocess.run([analyze, "verify", str(target)], capture_output=True, text=True, timeout=60)
    problems = [
        line for line in (result.stdout + result.stderr).splitlines() if name in line or "error" in line
    ]
    assert result.returncode == 0 and not problems, result.stdout + result.stderr


def _service_section(unit: str) -> configparser.SectionProxy:
    """The [Service] section of UNIT as systemd reads it (keys case-sensitive)."""
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive in units
    parser.read(UNITS_DIR / unit)
    return parser["Service"]


def test_controller_unit_is_notify_and_hardened() -> None:
    service = _service_section("flodld.service")
    assert service["Type"] == "notify"
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes"}.items():
        assert service[key] == value


def test_join_unit_never_restarts_on_permanent_errors() -> None:
    service = _service_section("fdl-join.service")
    assert service["Restart"] == "always"
    assert service["RestartPreventExitStatus"] == "2"
    assert "--persist" in service["ExecStart"]


def test_controller_unit_is_a_service_that_reloads_and_never_restart_loops_on_bad_config() -> None:
    service = _service_section("flodld.service")
    assert service["RestartPreventExitStatus"] == "2"  # flodld serve exits 2 on bad configuration
    assert service["Restart"] == "on-failure"  # SIGTERM exits 0: a stop is not a failure
    assert "-HUP" in service["ExecReload"] and "$MAINPID" in service["ExecReload"]
    assert int(service["LimitNOFILE"]) >= 4096
    assert "--once" not in service["ExecStart"]


_SIZE_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _bytes(value: str) -> int:
    """A systemd size (`512M`, `8G`, a plain byte count) as bytes; anything else (infinity, %) fails."""
    found = re.fullmatch(r"(\d+)([KMGT]?)", value.strip(), re.IGNORECASE)
    assert found is not None, f"not a fixed size: {value!r}"
    return int(found.group(1)) * _SIZE_SUFFIX[found.group(2).upper()]


def test_controller_unit_bounds_memory_and_tasks_so_a_leak_restarts_it_not_the_host() -> None:
    """Issue 29, point 9: finite MemoryMax/TasksMax, roomy enough for a 10,000-host run."""
    service = _service_section("flodld.service")
    memory = _bytes(service["MemoryMax"])
    assert 1 << 30 <= memory <= 64 << 30  # at least 1 GiB (10,000 linked hosts take about 240 MiB), finite
    tasks = service["TasksMax"]
    assert tasks.isdigit() and 256 <= int(tasks) <= 16384, tasks  # the daemon runs a handful of threads
    assert service["Restart"] == "on-failure"  # an OOM kill is a failure: the service comes back
    # The documented drop-in an operator uses to raise them names the same keys.
    operations = (UNITS_DIR.parent / "docs" / "operations.md").read_text()
    assert "systemctl edit flodld" in operations
    assert f"MemoryMax={service['MemoryMax']}" in operations and f"TasksMax={tasks}" in operations
