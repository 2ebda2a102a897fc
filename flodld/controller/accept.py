"""Accepting in batches on a uvloop port: `AcceptDrain` empties the kernel's accept queue faster than
libuv's one accept per loop turn, and hands the connections to the loop a bounded number per turn, what
is not a join dial first (see its docstring for the measurements behind each bound).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections import deque
from collections.abc import Callable

from flodld.wire.magic import MAGIC_BYTES, Channel, magic_prefix

log = logging.getLogger("flodld.controller.mux")

_JOIN_MAGIC = magic_prefix(Channel.JOIN)

# Connections taken off the kernel's accept queue per readiness of the listening socket, and handed to the
# loop per turn (see `AcceptDrain`).
ACCEPT_BATCH = 1024
# Accepted per readiness of the listening socket (the rest stay in the kernel's queue for the next turn):
# each accept is a few system calls and a socket object, and a storm's first burst of 1,024 in one turn
# was a 40-80 ms stall every state.json poll in flight waited behind (its p99).
ACCEPT_PER_READY = 128
ADOPT_PER_TURN = 64
ACCEPT_PAUSE_SECS = 0.1

class AcceptDrain:
    """Takes queued connections off a listening socket in batches, for a loop that accepts one per turn, and
    hands them to the loop a bounded number per turn, what is not a join dial first.

    uvloop (libuv) accepts one connection per event-loop turn. In a join storm the kernel's accept queue
    then holds every dial in flight (`ss -ltn` showed ~2,000 at 5,000 agents), and a state.json poll
    waits behind all of them, one loop turn each, before the controller even sees it. This reader, on a
    duplicate of the listening descriptor, accepts up to `ACCEPT_PER_READY` at each readiness (accepting a
    storm's first 1,024 at once was a 40-80 ms turn, the p99 of every poll in flight), so the kernel's
    queue empties within a few turns; the server's own accept then finds it empty (EAGAIN) or takes what
    arrived since. The routing is unchanged: each connection still gets the port's protocol (`protocol`).

    Handing a connection to the loop (`connect_accepted_socket`: a transport, a task, the protocol's
    deadline) costs tens of microseconds, and a burst of 1,000 handed over at once made one long turn
    that every other request waited behind. So at most `ADOPT_PER_TURN` join dials are handed over per
    turn. A connection whose first bytes are already in and are not the join magic (an HTTP request, a
    store or data channel) goes first: up to half a turn's share is handed over in the turn it is accepted,
    any more before the join dials of the next turns (at most half of their share while dials wait, so
    neither side starves). A state.json poll in a join storm waits for the accepts ahead of it, not for a
    thousand adoptions. A connection that has sent nothing yet waits with the dials. While `ACCEPT_BATCH`
    connections wait, this reader stops accepting (the kernel queue holds the rest).
    """

    def __init__(
        self,
        listening: socket.socket,
        loop: asyncio.AbstractEventLoop,
        protocol: Callable[[], asyncio.Protocol],
        tasks: set[asyncio.Task[None]],
    ) -> None:
        """`protocol` makes each adopted connection's protocol; the adoption tasks live in `tasks` (the
        port's, so closing the port cancels them).
        """
        self._protocol = protocol
        self._tasks = tasks
        self._loop = loop
        self._sock = socket.socket(fileno=os.dup(listening.fileno()))
        self._sock.setblocking(False)
        self._closed = self._paused = self._full = self._adopting = False
        self._first: deque[socket.socket] = deque()  # first bytes in, not the join magic
        self._later: deque[socket.socket] = deque()  # join dials, and connections with nothing sent yet
        loop.add_reader(self._sock.fileno(), self._ready)

    @property
    def waiting(self) -> int:
        """Connections accepted and not yet handed to the loop."""
        return len(self._first) + len(self._later)

    def _ready(self) -> None:
        handed = 0  # requests handed to the loop right here (see below)
        for _ in range(min(ACCEPT_PER_READY, ACCEPT_BATCH - self.waiting)):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as error:
                # EMFILE and friends: the server's own accept meets (and handles) them too; this reader
                # steps aside for a moment instead of firing every turn while the queue cannot shrink.
                log.debug("event=accept_failed detail=%r", error)
                self._pause()
                break
            conn.setblocking(False)
            try:
                head = conn.recv(MAGIC_BYTES, socket.MSG_PEEK)
            except OSError:  # nothing sent yet (EAGAIN), or already reset: the routing sees to it
                head = b""
            if not head or head == _JOIN_MAGIC:
                self._later.append(conn)
            elif handed < ADOPT_PER_TURN // 2 and not self._first:
                # A request whose first bytes are in (state.json, the store, a relay) is handed to the loop
                # in this turn, not the next one's share: one turn less behind a storm's long turns.
                handed += 1
                self._hand_over(conn)
            else:
                self._first.append(conn)
        else:
            self._stop_reading()
        if self.waiting and not self._adopting:
            self._adopting = True
            self._loop.call_soon(self._adopt_some)

    def _adopt_some(self) -> None:
        """This turn's share of the waiting connections, handed to the loop."""
        self._adopting = False
        if self._closed:
            return
        first = 0
        for _ in range(ADOPT_PER_TURN):
            if self._first and (first < ADOPT_PER_TURN // 2 or not self._later):
                conn = self._first.popleft()
                first += 1
            elif self._later:
                conn = self._later.popleft()
            else:
                break
            self._hand_over(conn)
        if self.waiting:
            self._adopting = True
            self._loop.call_soon(self._adopt_some)
        if self._full and self.waiting < ACCEPT_BATCH:
            self._full = False
            if not self._paused:
                self._loop.add_reader(self._sock.fileno(), self._ready)

    def _stop_reading(self) -> None:
        """`ACCEPT_BATCH` wait: leave the rest in the kernel's queue until adoption catches up."""
        if self.waiting >= ACCEPT_BATCH and not self._full:
            self._full = True
            if not self._paused:
                self._loop.remove_reader(self._sock.fileno())

    def _pause(self) -> None:
        if self._closed or self._paused:
            return
        self._paused = True
        if not self._full:
            self._loop.remove_reader(self._sock.fileno())
        self._loop.call_later(ACCEPT_PAUSE_SECS, self._resume)

    def _resume(self) -> None:
        self._paused = False
        if not self._closed and not self._full:
            self._loop.add_reader(self._sock.fileno(), self._ready)

    def _hand_over(self, conn: socket.socket) -> None:
        task = self._loop.create_task(self._adopt(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _adopt(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._protocol, conn)
        except OSError:
            conn.close()

    def close(self) -> None:
        reading = not (self._closed or self._paused or self._full)
        self._closed = True
        if reading:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        for queue in (self._first, self._later):
            while queue:
                queue.popleft().close()
