"""Same-host shared memory between a rank and its relay: the bulk path of the data plane.

A rank owns one region: an anonymous memory file (`os.memfd_create`, close-on-exec; no file in any
file system) that it maps and whose head holds `MAGIC` and a random 32-byte tag. It tells its relay
about it only over its authenticated, encrypted data leg (`ShmOffer`: pid, fd, size, tag). The relay
opens it through `/proc/<pid>/fd/<fd>` (the kernel allows that only to a process that may already read
the rank's memory: same user and ptrace-read rights), and keeps it only when

- the pid owns the very TCP connection the offer came over (its socket is among the pid's fds), so an
  offer cannot name another process's region;
- the link names one of our memory files, owned by this user, of exactly the offered size, sealed
  against shrinking and growing (`F_SEAL_SHRINK | F_SEAL_GROW`): a rank cannot cut the file under the
  relay's mapping, which would kill the relay with SIGBUS at its next read;
- the region's head holds the tag the offer carried (compared in constant time): the mapped memory is
  the one the authenticated rank meant.

Bytes after the `HEADER_BYTES` head are the bundle's bytes (`flodld.fold.chunks` offsets): the rank
writes its deposit there, the relay folds straight from them and writes the finished round back over
them (docs/protocol.md, "Shared memory"). Nothing here logs the tag.
"""

from __future__ import annotations

import fcntl
import hmac
import mmap
import os
import secrets
import stat
from collections.abc import Sequence
from typing import Final

from flodld.wire.data import MAX_REGION_BYTES

MAGIC: Final = b"flodld-shm-v1\0\0\0"
TAG_BYTES: Final = 32
HEADER_BYTES: Final = 64  # magic, tag, padding: the bundle's bytes start 64-byte aligned
MEMFD_NAME: Final = "flodld-shm"
# Fault every page in with the map (one kernel call) instead of one fault per page on first touch: for a
# fresh 64 MiB region that is 16384 faults on the round's critical path (the flagship's first big round).
_POPULATE: Final = getattr(mmap, "MAP_POPULATE", 0)
SIZE_SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
SHM_ENV: Final = "FLODL_SHM"
SHM_MODES: Final = ("auto", "on", "off")


class ShmError(OSError):
    """Shared memory cannot be used (or an offer is refused); the message says why."""


def shm_mode(environ: dict[str, str] | None = None) -> str:
    """`FLODL_SHM`: auto (default: shared memory when the host allows, else framed with a warning), on
    (shared memory or an error), off (framed only).
    """
    raw = (environ if environ is not None else os.environ).get(SHM_ENV, "") or "auto"
    if raw not in SHM_MODES:
        raise ValueError(f"{SHM_ENV}={raw!r}; use one of {', '.join(SHM_MODES)}")
    return raw


def region_size(data_bytes: int) -> int:
    """Bytes of a region that holds `data_bytes` of bundle, rounded up to whole pages."""
    page = mmap.PAGESIZE
    return -(-(HEADER_BYTES + max(data_bytes, 1)) // page) * page


class OwnedRegion:
    """The rank's region: created, tagged, written and closed by the rank."""

    def __init__(self, data_bytes: int) -> None:
        if not hasattr(os, "memfd_create"):
            raise ShmError("os.memfd_create is missing on this platform")
        self.size = region_size(data_bytes)
        if self.size > MAX_REGION_BYTES:
            raise ShmError(f"a region of {self.size} bytes is above the cap of {MAX_REGION_BYTES}")
        self.tag = secrets.token_bytes(TAG_BYTES)
        self.fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SIZE_SEALS | fcntl.F_SEAL_SEAL)
            self._map = mmap.mmap(
                self.fd, self.size, mmap.MAP_SHARED | _POPULATE, mmap.PROT_READ | mmap.PROT_WRITE
            )
        except BaseException:
            os.close(self.fd)
            raise
        self._map[: len(MAGIC) + TAG_BYTES] = MAGIC + self.tag
        self.view = memoryview(self._map)
        self.capacity = self.size - HEADER_BYTES

    def write(self, offset: int, parts: Sequence[memoryview]) -> int:
        """Copy `parts` (consecutive bytes) to bundle offset `offset`; returns the bytes written."""
        at = HEADER_BYTES + offset
        for part in parts:
            end = at + part.nbytes
            self.view[at:end] = part
            at = end
        return at - HEADER_BYTES - offset

    def data(self, offset: int, length: int) -> memoryview:
        if offset < 0 or length < 0 or offset + length > self.capacity:
            raise ShmError(f"bytes [{offset}, {offset + length}) lie outside the region's {self.capacity}")
        return self.view[HEADER_BYTES + offset : HEADER_BYTES + offset + length]

    def close(self) -> None:
        if self.fd < 0:
            return
        self.view.release()
        self._map.close()
        os.close(self.fd)
        self.fd = -1


def leg_socket_inode(pid: int, local: tuple[str, int], remote: tuple[str, int]) -> int | None:
    """The inode of the IPv4 TCP socket `local` -> `remote` in `pid`'s network namespace, or None."""

    def hexaddr(address: tuple[str, int]) -> str:
        packed = bytes(int(part) for part in address[0].split("."))
        return f"{int.from_bytes(packed, 'little'):08X}:{address[1]:04X}"

    want_local, want_remote = hexaddr(local), hexaddr(remote)
    with open(f"/proc/{pid}/net/tcp", encoding="ascii") as table:
        next(table, None)
        for line in table:
            fields = line.split()
            if len(fields) > 9 and fields[1] == want_local and fields[2] == want_remote:
                return int(fields[9])
    return None


def pid_holds_socket(pid: int, inode: int) -> bool:
    target = f"socket:[{inode}]"
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}") == target:
                return True
        except OSError:
            continue
    return False


class MappedRegion:
    """A rank's region as its relay maps it, after every check in the module docstring passed.

    `populated`: the file's pages all exist (the rank made them), so the map faulted them in and the
    relay may ready an accumulator of this size; a sparse file is mapped lazily and readies nothing.
    `lent` counts the chunks the fold still reads; `retire` unmaps at once when none, else when the last
    one is given back (a rank that died mid-round leaves no mapping behind once its chunks are folded).
    """

    def __init__(
        self, pid: int, fd: int, size: int, tag: bytes, *, leg: tuple[tuple[str, int], tuple[str, int]]
    ) -> None:
        if not (HEADER_BYTES < size <= MAX_REGION_BYTES):
            raise ShmError(f"a region of {size} bytes is outside (HEADER_BYTES, {MAX_REGION_BYTES}]")
        if len(tag) != TAG_BYTES:
            raise ShmError("the region's tag has the wrong length")
        if not os.path.isdir("/proc/self/fd"):
            raise ShmError("/proc is not mounted: a relay cannot open a rank's region")
        peer, mine = leg
        try:
            inode = leg_socket_inode(pid, peer, mine)
            if inode is None or not pid_holds_socket(pid, inode):
                raise ShmError(f"process {pid} does not hold this data leg's connection")
            path = f"/proc/{pid}/fd/{fd}"
            link = os.readlink(path)
            if not link.startswith(f"/memfd:{MEMFD_NAME}"):
                raise ShmError(f"fd {fd} of process {pid} is not a flodld memory file")
            handle = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except ShmError:
            raise
        except OSError as error:
            raise ShmError(f"cannot open fd {fd} of process {pid}: {error.strerror or error}") from None
        try:
            info = os.fstat(handle)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                raise ShmError(f"fd {fd} of process {pid} is not a memory file of this user")
            if info.st_size != size:
                raise ShmError(f"the region has {info.st_size} bytes, the offer said {size}")
            if fcntl.fcntl(handle, fcntl.F_GET_SEALS) & SIZE_SEALS != SIZE_SEALS:
                raise ShmError("the region is not sealed against shrinking and growing")
            # Populated too (the fold reads every page and the result is written back over them), but only
            # a region whose pages the rank has already made (as OwnedRegion does): populating a sparse file
            # would make the relay allocate whatever size the rank named.
            self.populated = info.st_blocks * 512 >= size
            flags = mmap.MAP_SHARED | (_POPULATE if self.populated else 0)
            self._map: mmap.mmap | None = mmap.mmap(handle, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as error:
            raise ShmError(f"cannot map fd {fd} of process {pid}: {error}") from None
        finally:
            os.close(handle)  # the mapping keeps the memory (mmap holds its own duplicate until closed)
        head = self._map[: len(MAGIC) + TAG_BYTES]
        if not hmac.compare_digest(head, MAGIC + tag):
            self._map.close()
            self._map = None
            raise ShmError("the region's head does not hold the offer's tag")
        self.size = size
        self.capacity = size - HEADER_BYTES
        self.view: memoryview | None = memoryview(self._map)
        self.lent = 0
        self.retired = False

    @property
    def closed(self) -> bool:
        return self._map is None

    def data(self, offset: int, length: int) -> memoryview:
        """A writable view of bundle bytes [offset, offset + length); ShmError outside the region."""
        if self.view is None:
            raise ShmError("the region is closed")
        if offset < 0 or length < 0 or offset + length > self.capacity:
            raise ShmError(f"bytes [{offset}, {offset + length}) lie outside the region's {self.capacity}")
        return self.view[HEADER_BYTES + offset : HEADER_BYTES + offset + length]

    def write(self, offset: int, parts: Sequence[memoryview]) -> None:
        at = offset
        for part in parts:
            self.data(at, part.nbytes)[:] = part
            at += part.nbytes

    def lend(self) -> None:
        self.lent += 1

    def give_back(self) -> None:
        self.lent -= 1
        if self.retired and self.lent <= 0:
            self._unmap()

    def retire(self) -> None:
        self.retired = True
        if self.lent <= 0:
            self._unmap()

    def _unmap(self) -> None:
        if self._map is None:
            return
        if self.view is not None:
            try:
                self.view.release()
            except BufferError:  # slices the fold still holds: they keep the map until they go
                pass
            self.view = None
        try:
            self._map.close()
        except BufferError:  # exported views still alive: the map goes with the last of them
            pass
        self._map = None
