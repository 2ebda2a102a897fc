"""What a rank knows of the rounds' results (its relay client's bookkeeping, pure: the client holds the
lock and the legs): each result assembled from its chunks, kept for the `wait_round` of its round and
handed only with the shapes and dtypes deposited for it, and the membership it names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flodld.fold.base import Bundle
from flodld.fold.chunks import Assembly, Layout
from flodld.wire.data import Broadcast, Entry, ShmResult, TensorSpec

Result = Broadcast | ShmResult
STALE_ROUNDS = 64
"""How far behind the newest result one nobody deposited for is kept (for a raw `wait_round`)."""


@dataclass(frozen=True)
class Membership:
    """Who averages, as of the last completed round (docs/elastic-averaging.md): the ranks whose deposits
    the round's result holds, this rank's index among them, and an epoch that grows by one whenever that
    set changes (a rank lost, or, later, one admitted). A training loop that shards its data by member
    reshards when `epoch` changes; `index` and `size` are what it shards by (not RANK and WORLD_SIZE,
    which stay the formed world's).
    """

    epoch: int
    members: tuple[int, ...]
    rank: int

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def index(self) -> int:
        """This rank's position among the members (its shard); -1 if it is not among them."""
        return self.members.index(self.rank) if self.rank in self.members else -1


class ResultError(ValueError):
    """A result that cannot be handed back as the round's: the message says why."""


def _schema(specs: Sequence[TensorSpec]) -> str:
    """Shapes and dtypes, for messages: `[float32 (3,), float64 (2, 2)]`."""
    return "[" + ", ".join(f"{spec.dtype} {tuple(spec.shape)}" for spec in specs) + "]"


class ChunkedResult:
    """The result in the making: its chunks, in order, copied into the round's tensors (`memory`: what
    `Assembly` may take them from, e.g. memory reserved for the round).
    """

    def __init__(self, memory: Callable[[Layout], Bundle | None]) -> None:
        self._memory = memory
        self._current: tuple[Result, Assembly] | None = None

    def reset(self) -> None:
        self._current = None

    def add(self, message: Result, view: memoryview) -> Bundle | None:
        """The chunk `message` says `view` is; the round's tensors once it was the last one, else None."""
        if message.offset == 0:
            self._current = (message, Assembly(message.tensors, self._memory))
        elif self._current is None or self._current[0].round != message.round:
            raise ValueError(
                f"a broadcast chunk of round {message.round} at offset {message.offset} without its start"
            )
        assembly = self._current[1]
        if not assembly.add(message.offset, view):
            return None
        self._current = None
        return assembly.tensors


class RoundResults:
    """The results in, by round, and the schema of each round deposited whose result was not taken yet:
    a result is handed only to the round that asked for it, and only with the deposit's shapes and dtypes.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.kept: dict[int, tuple[Result, Bundle]] = {}
        self.deposited: dict[int, tuple[TensorSpec, ...]] = {}
        self.arrived = -1  # the newest round whose result is in (rounds complete in order)
        # The newest result of any round, for diagnostics (which round, who contributed): never a call's
        # value, which `take` takes by its round number.
        self.latest: tuple[Result, Bundle] | None = None
        self.membership = Membership(0, tuple(range(world_size)), rank)

    def enter(self, entry: Entry) -> None:
        """A walk-in's Entry: the rounds before `entry.round` are not this rank's; its membership is named."""
        self.arrived = entry.round - 1
        self.membership = Membership(entry.epoch, tuple(entry.members), self.rank)

    def arrive(self, message: Result, tensors: Bundle, next_round: int) -> None:
        """A round's result is in (`next_round`: the round this rank deposits next)."""
        self.kept[message.round] = (message, tensors)
        self.arrived = max(self.arrived, message.round)
        self.latest = (message, tensors)
        members = tuple(sorted(message.contributors))
        if members and members != self.membership.members:
            self.membership = Membership(self.membership.epoch + 1, members, self.rank)
        # A deposited round's result waits for its caller, and so does one of a round this rank has not
        # deposited yet (it was late: the round closed without it, by the straggler timeout, and its
        # deposit will be dropped); one it skipped past (a hand-made frame) is kept a while for a raw
        # `wait_round`.
        for stale in [
            number
            for number in self.kept
            if number < message.round - STALE_ROUNDS and number < next_round and number not in self.deposited
        ]:
            del self.kept[stale]

    def take(self, round_number: int) -> Bundle:
        """The result of `round_number` (in: see `kept`), taken once. ResultError when its tensors are not
        the shapes and dtypes this rank deposited for that round: another round's tensors are never handed
        back in its place.
        """
        message, tensors = self.kept.pop(round_number)
        deposited = self.deposited.pop(round_number, None)
        if deposited is not None and tuple(message.tensors) != deposited:
            raise ResultError(
                f"the result of round {round_number} has tensors {_schema(message.tensors)} but this rank "
                f"deposited {_schema(deposited)}: the ranks' averaging calls are out of step (every rank "
                "must make the same averaging calls in the same order), or the data plane is broken"
            )
        return tensors
