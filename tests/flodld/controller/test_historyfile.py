"""The history file on a real disk: modes, atomic replacement, a crash's leftovers, damage, the lock."""

from __future__ import annotations

import logging
import stat
from pathlib import Path

import pytest

from flodld.controller.historyfile import (
    DAMAGED_NAME,
    HISTORY_NAME,
    TEMP_NAME,
    HistoryFile,
    StateDirError,
    state_dir_from,
)
from flodld.membership.history import HistoryVersionError, encode_history
from tests.flodld.membership.test_history import record


def opened(directory: Path, **kwargs: int) -> HistoryFile:
    file = HistoryFile(directory, **kwargs)
    file.open()
    return file


def test_created_private_and_read_back(tmp_path: Path) -> None:
    directory = tmp_path / "state" / "flodld"
    file = opened(directory)
    records = [record(n) for n in range(3, 0, -1)]
    file.save(records, 50)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE((directory / HISTORY_NAME).stat().st_mode) == 0o600
    assert not (directory / TEMP_NAME).exists()
    file.close()
    again = opened(directory)
    assert again.load(50).records == records
    again.close()


def test_a_second_daemon_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    first = opened(tmp_path)
    with pytest.raises(StateDirError, match="in use by another flodld serve"):
        opened(tmp_path)
    first.close()
    opened(tmp_path).close()  # released with the first


def test_an_unusable_directory_is_refused_with_the_fix(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StateDirError, match=r"cannot use the state directory .*--state-dir DIR"):
        opened(blocker / "sub")


def test_a_temp_file_left_by_a_crash_mid_write_is_removed_and_the_old_history_stands(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    file = opened(tmp_path)
    records = [record(2), record(1)]
    file.save(records, 50)
    file.close()
    # a write cut off before its rename: half a file under the temp name, the real file untouched
    half = encode_history([record(3), *records], limit_runs=50)
    (tmp_path / TEMP_NAME).write_bytes(half[: len(half) // 2])
    with caplog.at_level(logging.WARNING, logger="flodld.controller"):
        again = opened(tmp_path)
    assert not (tmp_path / TEMP_NAME).exists()
    assert "event=history_temp_removed" in caplog.text
    assert again.load(50).records == records
    again.close()


def test_a_damaged_file_keeps_its_intact_records_and_a_copy_of_itself(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    file = opened(tmp_path)
    records = [record(n) for n in range(3, 0, -1)]
    file.save(records, 50)
    damaged = (tmp_path / HISTORY_NAME).read_bytes()[:-25]  # truncated inside the oldest record
    (tmp_path / HISTORY_NAME).write_bytes(damaged)
    with caplog.at_level(logging.WARNING, logger="flodld.controller"):
        load = file.load(50)
    assert load.records == records[:2]
    assert "event=history_damaged" in caplog.text and str(tmp_path / HISTORY_NAME) in caplog.text
    assert (tmp_path / DAMAGED_NAME).read_bytes() == damaged
    assert file.load(50).records == records[:2] and file.load(50).damaged == []  # rewritten clean
    file.close()


def test_an_oversize_file_is_read_only_up_to_the_bound(tmp_path: Path) -> None:
    file = opened(tmp_path, max_bytes=2048)
    big = encode_history([record(n, hosts=10) for n in range(40, 0, -1)], limit_runs=100, limit_bytes=1 << 20)
    assert len(big) > 2048
    (tmp_path / HISTORY_NAME).write_bytes(big)
    load = file.load(100)
    assert 0 < len(load.records) < 40 and load.records[0].run_id == "run-40"
    assert any("over 2048 bytes" in line for line in load.damaged)
    assert (tmp_path / HISTORY_NAME).stat().st_size <= 2048
    file.close()


def test_a_newer_file_is_refused_and_left_alone(tmp_path: Path) -> None:
    file = opened(tmp_path)
    newer = b'{"format": "flodld-history", "version": 99}\n{"anything": 1}\n'
    (tmp_path / HISTORY_NAME).write_bytes(newer)
    with pytest.raises(HistoryVersionError):
        file.load(50)
    assert (tmp_path / HISTORY_NAME).read_bytes() == newer
    file.close()


def test_state_dir_comes_from_the_flag_then_systemd() -> None:
    assert state_dir_from(Path("/x"), {"STATE_DIRECTORY": "/var/lib/flodld"}) == Path("/x")
    assert state_dir_from(None, {"STATE_DIRECTORY": "/var/lib/flodld:/var/lib/other"}) == Path(
        "/var/lib/flodld"
    )
    assert state_dir_from(None, {}) is None
