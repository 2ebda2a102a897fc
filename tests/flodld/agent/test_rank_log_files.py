"""flodld.agent.ranklogs and flodld.config.logs: torchrun's --redirects/--tee syntax, the layout, and a rank's
log sink (0700/0600, no symlink followed, capped), with real files.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from flodld.agent.ranklogs import LogDirError, RankLogSink, RankLogSpec, component, prepare_log_dir, rank_dir
from flodld.agent.spec import AgentSpec, decode_agent_spec, encode_spec
from flodld.config import load_text
from flodld.config.errors import ConfigError
from flodld.config.logs import ERR, OUT, file_and_console, parse_std


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("0", 0), ("1", 1), ("2", 2), ("3", 3), ("0:1,1:2", {0: 1, 1: 2}),
     ("0:3,1:0,2:1,3:2", {0: 3, 1: 0, 2: 1, 3: 2}), ("12:3", {12: 3})],
)  # fmt: skip
def test_std_values_read_as_torchrun_reads_them(text: str, parsed: object) -> None:
    assert parse_std(text) == parsed


@pytest.mark.parametrize("text", ["4", "-1", "all", "0:4", "0:1,", "0=1", "0:1,0:2", ""])
def test_a_bad_std_value_is_refused_naming_the_flag_and_the_forms(text: str) -> None:
    with pytest.raises(ValueError, match=r"--tee .*(not understood: give 0 \(none\)|given twice)"):
        parse_std(text, "--tee")


def test_redirect_is_file_only_tee_is_file_and_console_and_tee_wins_over_redirect() -> None:
    assert file_and_console(3, 0, 0) == (OUT | ERR, 0)
    assert file_and_console(0, 3, 0) == (OUT | ERR, OUT | ERR)
    assert file_and_console(0, 0, 0) == (0, OUT | ERR)
    assert file_and_console({0: 1}, {1: 2}, 0) == (OUT, ERR)  # local rank 0: stdout to file only
    assert file_and_console({0: 1}, {1: 2}, 1) == (ERR, OUT | ERR)  # local rank 1: stderr teed
    assert file_and_console(3, 1, 5) == (OUT | ERR, OUT)  # both name stdout: teed, as torchrun


def test_a_controller_chosen_run_id_stays_one_component_under_the_log_dir(tmp_path: Path) -> None:
    for hostile in ("../../etc", "..", ".", "/abs/path", "a/b", "x" * 500, ""):
        path = rank_dir(tmp_path, hostile, 0, "host", 1)
        assert path.parent.parent.parent.parent == tmp_path, (hostile, path)
        assert not component(hostile).startswith(".") and "/" not in component(hostile)
    assert rank_dir(tmp_path, "a1b2", 3, "box-1", 7) == tmp_path / "a1b2" / "attempt_3" / "box-1" / "rank_7"


def test_a_sink_writes_its_streams_to_0600_files_in_0700_directories(tmp_path: Path) -> None:
    spec = RankLogSpec(dir=str(tmp_path / "logs"), redirects="0:1", tee="0:2")
    sink = RankLogSink.for_rank(spec, run="r1", attempt=2, host="box", rank=4, local_rank=0)
    sink.write("stdout", b"hello\n")
    sink.write("stderr", b"oops\n")
    sink.close()
    where = tmp_path / "logs" / "r1" / "attempt_2" / "box" / "rank_4"
    assert (where / "stdout.log").read_bytes() == b"hello\n" and (
        where / "stderr.log"
    ).read_bytes() == b"oops\n"
    assert not sink.shows("stdout") and sink.shows("stderr") and sink.splits_streams
    for path in [tmp_path / "logs", *(tmp_path / "logs").rglob("*")]:
        assert stat.S_IMODE(path.stat().st_mode) == (0o700 if path.is_dir() else 0o600), path


def test_a_rank_the_spec_names_no_stream_of_gets_no_file_and_keeps_one_merged_pipe(tmp_path: Path) -> None:
    spec = RankLogSpec(dir=str(tmp_path), redirects="0:3")
    sink = RankLogSink.for_rank(spec, run="r", attempt=0, host="h", rank=1, local_rank=1)
    assert not sink.fds and not sink.splits_streams and sink.shows("stdout") and sink.shows("stderr")
    assert list(tmp_path.iterdir()) == []
    assert not RankLogSink.for_rank(None, run="r", attempt=0, host="h", rank=0, local_rank=0).splits_streams


def test_a_log_file_that_is_a_symlink_is_not_followed(tmp_path: Path) -> None:
    where = tmp_path / "r" / "attempt_0" / "h" / "rank_0"
    where.mkdir(parents=True)
    target = tmp_path / "elsewhere"
    (where / "stdout.log").symlink_to(target)
    with pytest.raises(LogDirError, match=r"rank log file .*stdout\.log cannot be opened"):
        RankLogSink.for_rank(RankLogSpec(dir=str(tmp_path), redirects="1"), run="r", attempt=0, host="h",
                             rank=0, local_rank=0)  # fmt: skip
    assert not target.exists()


def test_a_file_stops_at_its_cap_with_one_line_saying_so(tmp_path: Path) -> None:
    spec = RankLogSpec(dir=str(tmp_path), tee="1", max_file_bytes=10)
    sink = RankLogSink.for_rank(spec, run="r", attempt=0, host="h", rank=0, local_rank=0)
    for line in (b"12345\n", b"67890\n", b"more\n"):
        sink.write("stdout", line)
    sink.close()
    text = (tmp_path / "r" / "attempt_0" / "h" / "rank_0" / "stdout.log").read_text()
    assert text.startswith("12345\n[fdl: stdout.log reached its cap of 10 bytes") and text.count("\n") == 2


def test_a_directory_that_cannot_be_made_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(LogDirError, match=rf"log directory {blocker}/sub cannot be created"):
        prepare_log_dir(blocker / "sub")
    with pytest.raises(LogDirError, match=rf"log directory {blocker} is not a directory"):
        prepare_log_dir(blocker)
    made = prepare_log_dir(tmp_path / "a" / "b")
    assert made == tmp_path / "a" / "b" and stat.S_IMODE(os.stat(tmp_path / "a").st_mode) == 0o700


def test_the_logs_spec_rides_the_agent_spec() -> None:
    spec = AgentSpec(
        host="h", controller_host="127.0.0.1", controller_port=1, logs=RankLogSpec(dir="/d", tee="3")
    )
    assert decode_agent_spec(encode_spec(spec)).logs == RankLogSpec(dir="/d", tee="3")
    with pytest.raises(ValueError, match="not understood"):
        RankLogSpec(dir="/d", redirects="9")


def test_the_logs_block_of_fdl_yml() -> None:
    logs = load_text("logs:\n  dir: /var/log/fdl\n  redirects: 3\n  tee: '0:1'\n  max_file_mb: 64\n").logs
    assert logs is not None and (logs.dir, logs.redirects, logs.tee, logs.max_file_mb) == (
        "/var/log/fdl",
        "3",
        "0:1",
        64,
    )
    with pytest.raises(ConfigError, match=r"logs\.redirects '7' is not understood"):
        load_text("logs:\n  redirects: 7\n")
