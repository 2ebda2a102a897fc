"""What both socket adapters do with a frame connection's events (blocking.py and stream.py)."""

from __future__ import annotations

from flodld.wire.frames import Closed, Frame, FrameConnection


def next_frame(conn: FrameConnection) -> Frame | None:
    """The next verified frame, or None when `conn` needs more bytes; EOFError when the peer closed."""
    event = conn.next_event()
    if isinstance(event, Closed):
        raise EOFError("peer closed the connection")
    return event if isinstance(event, Frame) else None
