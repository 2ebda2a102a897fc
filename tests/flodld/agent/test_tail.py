"""The agent's report of a failed rank: output tail, error file, secrets scrubbed (flodld/agent/tail.py)."""

from __future__ import annotations

import json
from pathlib import Path

from flodld.agent.tail import REDACTED, OutputTail, Scrubber, read_error_file
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
    assert read_error_file(path, Scrubber([SALT])) == f"RuntimeError: token {REDACTED}"
    path.write_text("not json")
    assert read_error_file(path) is None
