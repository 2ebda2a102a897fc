"""The agent's report of a failed rank: output tail, error file, secrets scrubbed (flodld/agent/tail.py)."""

from __future__ import annotations

import json
from pathlib import Path

from flodld.agent.tail import REDACTED, OutputTail, Scrubber, failure_time, read_error_file
from flodld.wire.join import RankExited
from flodld.wire.messages import MAX_TAIL_CHARS, MAX_TAIL_LINES, decode_message, encode_message

SALT = "0123456789abcdef0123456789abcdef"


def test_the_tail_keeps_the_last_lines_within_the_wire_caps() -> None:
    tail = OutputTail()
    for index in range(500):
        tail.feed(f"line {index} ".encode() + b"x" * 300 + b"\n")
    text = tail.render()
    assert text is not None
    lines = text.split("\n")
    assert len(lines) <= MAX_TAIL_LINES and len(text) <= MAX_TAIL_CHARS
    assert lines[-1].startswith("line 499 ")
    assert all(line.startswith("line ") for line in lines)  # cut at a line boundary
    message = RankExited(rank=1, code=1, tail=text)  # fits the message's caps
    assert decode_message(*encode_message(message)) == message


def test_a_huge_single_line_keeps_its_end() -> None:
    tail = OutputTail()
    tail.feed(b"y" * 100_000 + b"END\n")
    text = tail.render()
    assert text is not None and text.endswith("END") and len(text) <= MAX_TAIL_CHARS


def test_secrets_never_leave_in_the_tail_or_the_error() -> None:
    scrub = Scrubber(
        [SALT, "short", *Scrubber.secrets_in_env({"WANDB_API_KEY": "k3y-value-123", "HOME": "/h"})]
    )
    tail = OutputTail(scrub)
    tail.feed(f"salt={SALT} upper={SALT.upper()} key=k3y-value-123 home=/h short\n".encode())
    text = tail.render()
    assert text is not None
    assert SALT not in text.lower() and "k3y-value-123" not in text
    assert text.count(REDACTED) == 3 and "home=/h short" in text  # short values are not secrets
    tail.feed(b"z" * 20_000 + SALT.encode() + b"\n")  # a line cut to its end: scrubbed before the cut
    text = tail.render()
    assert text is not None and text.endswith(REDACTED) and SALT[8:] not in text.lower()


def test_the_error_file_of_record(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    assert read_error_file(path) is None  # no @record: no file
    message = {
        "message": f"RuntimeError: token {SALT}",
        "extraInfo": {"py_callstack": "...", "timestamp": "1"},
    }
    path.write_text(json.dumps({"message": message}))
    error = read_error_file(path, Scrubber([SALT]))
    assert error is not None and error.message == f"RuntimeError: token {REDACTED}"
    assert abs(error.written_at - path.stat().st_mtime) < 1e-6
    path.write_text("not json")
    assert read_error_file(path) is None


def test_a_rank_failed_when_its_traceback_began_not_when_its_process_was_gone() -> None:
    tail = OutputTail(lines=4)
    tail.feed(b"step 1\n", 10.0)
    assert tail.traceback_at is None
    tail.feed(b"[rank1]: Traceback (most recent call last):\n", 11.0)
    tail.feed(b'[rank1]:   File "x.py", line 1\n', 11.01)
    tail.feed(b"[rank1]: RuntimeError: boom\n", 11.02)
    assert tail.traceback_at == 11.0
    assert tail.exception_line() == "RuntimeError: boom"
    # Evidence after the exit is ignored (clock noise); none at all: the exit time.
    assert failure_time(12.5, 11.0, None) == 11.0
    assert failure_time(12.5, 10.9, 11.0) == 10.9  # the error file was written before the traceback
    assert failure_time(12.5, None, 13.0) == 12.5
    for index in range(4):  # the traceback scrolled out of the tail: no longer evidence
        tail.feed(f"later {index}\n".encode(), 20.0)
    assert tail.traceback_at is None


def test_the_exception_line_of_a_stock_traceback_without_an_error_file() -> None:
    tail = OutputTail(Scrubber([SALT]))
    for line in (
        "Traceback (most recent call last):",
        '  File "train.py", line 9, in <module>',
        "    raise ValueError(f'bad {x}')",
        f"ValueError: bad {SALT}",
        "some atexit chatter",
    ):
        tail.feed(line.encode() + b"\n", 1.0)
    assert tail.exception_line() == f"ValueError: bad {REDACTED}"
    assert OutputTail().exception_line() is None


def test_a_detail_over_the_caps_never_costs_the_exit_report() -> None:
    from flodld.agent.children import exit_report
    from flodld.agent.supervision import ExitDetail

    report = exit_report(1, 300, False, ExitDetail(5.0, "E: " + "x" * 5000, "a\nb"))
    assert (report.code, report.failed_at, report.tail) == (255, 5.0, "a\nb")
    assert len(report.error or "") == 1024
    bad = exit_report(1, 1, True, ExitDetail(5.0, None, "\n" * 100))  # not from OutputTail: over 40 lines
    assert (bad.rank, bad.code, bad.torn_down, bad.tail) == (1, 1, True, None)
