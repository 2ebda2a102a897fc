"""CPU averaging modes on top of the relay data plane, as ranks call them once per training step.

Semantics (one `Averager.step(tensors)` call per step; docs/user-guide.md has the same table):
- `cpu_sync`: every call deposits and blocks until the world's average of that round arrives.
- `cpu_cadence`: every `cadence`-th call behaves like cpu_sync; the calls between return the
  rank's own tensors unchanged (local steps), so ranks meet every k steps.
- `cpu_async`: elastic averaging in the background. Every `cadence`-th call is an averaging call: it
  takes the result of the round this averager deposited at its previous averaging call (waiting only
  if that round, sent `cadence` steps ago, is not back yet), applies `elastic_update`
  (x <- x + alpha * (avg_r - x_r), x_r being what it deposited for round r), deposits the updated
  tensors as the next round and returns them; the round then travels while the rank keeps training.
  The calls between return the tensors unchanged. Local steps made while a round travels are kept
  (only the deposited part is pulled towards the average), and the schedule is a function of the call
  count alone, so every rank's k-th deposit is the same call on every rank and the trajectory does not
  depend on timing. `finish(tensors)` applies the round still out (at the end of training).

Matching: a round's result goes to the call that deposited it, and nowhere else (`RelayClient.wait_round`
takes it by round number and checks it has the deposit's shapes and dtypes). The data plane numbers
rounds once per world, so round r is every rank's r-th deposit: `all_average` and every `Averager` of a
rank share that one sequence, and ranks must make their averaging calls in the same order (as they make
their collectives). Before depositing, each call waits until the rank's previous round is back, so a
round started by one stream (an async step still in flight) never overlaps the next one (the relay
takes round r + 1 from a rank only once round r is complete).

Losses (docs/elastic-averaging.md): in a run with a tolerance, a rank that dies or is declared dead is
folded out of the round in progress and every later one; the survivors' result is the mean over those
who deposited (the weights renormalize), the same bytes on every survivor. `membership()` says who
averaged in the last completed round, this rank's index among them and an epoch that changes with them,
so a loop can reshard its data. Growth (the same page, "Growth and healing"): a rank that walked into a
training run starts from `walk_in_state()`, the last averaged result, at `entry_round()`, and every
member's membership then counts it.

Outside a flodld run (a plain `python train.py`) every mode returns the tensors unchanged: the
average of a world of one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

import torch

from flodld.config.fields import AveragingMode
from flodld.fold.base import Bundle
from flodld.rank.env import in_flodld_rank, read_rank_environment
from flodld.rank.relay_client import RelayClient, relay_client
from flodld.rank.results import Membership

__all__ = [
    "AVERAGING_MODES",
    "Averager",
    "Membership",
    "all_average",
    "elastic_update",
    "entry_round",
    "membership",
    "walk_in_state",
]

AVERAGING_MODES: Final = tuple(mode.value for mode in AveragingMode.cpu_modes())
DEFAULT_ASYNC_ALPHA: Final = 0.5


def elastic_update(
    current: Sequence[torch.Tensor],
    deposited: Sequence[torch.Tensor],
    average: Sequence[torch.Tensor],
    alpha: float,
) -> Bundle:
    """cpu_async's update, tensor by tensor: `current + alpha * (average - deposited)`.

    `deposited` is what this rank sent for the round, `average` that round's world average and `current`
    the rank's tensors now (after the local steps made while the round travelled). The local progress
    `current - deposited` is kept whole; only the deposited part moves `alpha` of the way to the
    average. Averaged over ranks of equal weight the correction cancels (the mean of `average -
    deposited` is zero), so the world's mean parameters are the mean of `current`, and the ranks'
    disagreement at deposit time shrinks by `1 - alpha` per round. Pure: new tensors, inputs untouched,
    no gradient recorded; the result has `current`'s device and dtype.
    """
    if not 0.0 < alpha <= 1.0 or not math.isfinite(alpha):
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    if not len(current) == len(deposited) == len(average):
        raise ValueError(
            f"the elastic update needs as many tensors in each bundle: current {len(current)}, "
            f"deposited {len(deposited)}, average {len(average)}"
        )
    updated: list[torch.Tensor] = []
    with torch.no_grad():
        for index, (now, sent, mean) in enumerate(zip(current, deposited, average, strict=True)):
            if not now.shape == sent.shape == mean.shape:
                raise ValueError(
                    f"tensor {index}: shapes differ (current {tuple(now.shape)}, deposited "
                    f"{tuple(sent.shape)}, average {tuple(mean.shape)}); pass the same tensors, in the "
                    "same order, at every averaging call"
                )
            if not now.is_floating_point():
                raise ValueError(f"tensor {index} is {now.dtype}: the elastic update needs floating tensors")
            delta = mean.to(device=now.device, dtype=now.dtype) - sent.to(device=now.device, dtype=now.dtype)
            updated.append(now.detach() + alpha * delta)
    return tuple(updated)


def _check_async_bundle(tensors: Sequence[torch.Tensor], fold: str) -> None:
    """Refuse, naming why, what cpu_async cannot average: a fold that is not a mean, integer tensors."""
    if fold != "mean":
        raise ValueError(
            f"cpu_async pulls parameters towards the world's mean, so it folds with 'mean', not {fold!r}; "
            "use cpu_sync or all_average for other folds"
        )
    for index, tensor in enumerate(tensors):
        if not tensor.is_floating_point():
            raise ValueError(
                f"cpu_async averages floating tensors; tensor {index} is {tensor.dtype} "
                "(average it with all_average, or cast it)"
            )


def _deposit_in_turn(
    client: RelayClient, tensors: Sequence[torch.Tensor], *, weight: float, fold: str | None
) -> int:
    """Deposit once the rank's previous round is back (whoever deposited it keeps its result)."""
    client.wait_arrived(client.next_round - 1)
    return client.deposit(tensors, weight=weight, fold=fold)


class Averager:
    """Per-step averaging in one of the CPU modes (see the module docstring for each mode's promise).

    `alpha` is cpu_async's elastic coefficient, in (0, 1] (default 0.5); the other modes ignore it.
    """

    def __init__(
        self,
        mode: str | None = None,
        *,
        cadence: int | None = None,
        fold: str | None = None,
        client: RelayClient | None = None,
        alpha: float = DEFAULT_ASYNC_ALPHA,
    ) -> None:
        self._client: RelayClient | None = client
        env = client.env if client is not None else (read_rank_environment() if in_flodld_rank() else None)
        self.mode = mode or (env.averaging if env else "cpu_sync")
        if self.mode not in AVERAGING_MODES:
            raise ValueError(
                f"averaging mode {self.mode!r} is not a CPU mode; use one of {', '.join(AVERAGING_MODES)}"
            )
        self.cadence = cadence or (env.cadence if env else 1)
        if self.cadence < 1:
            raise ValueError(f"cadence must be >= 1 step, got {self.cadence}")
        if not (0.0 < alpha <= 1.0):
            raise ValueError(f"alpha must be in (0, 1] (the share of the way to the average), got {alpha}")
        self.alpha = alpha
        self.fold = fold
        self.calls = 0
        # cpu_async: the round still out, and what this rank deposited for it (a copy: the caller's
        # tensors keep changing in place while the round travels).
        self._pending: tuple[int, Bundle] | None = None
        if env is not None and self._client is None:
            self._client = relay_client()

    @property
    def membership(self) -> Membership:
        """Who averaged in the last completed round (see `membership()`)."""
        return membership(self._client)

    @property
    def pending_round(self) -> int | None:
        """cpu_async: the round deposited and not yet applied, or None."""
        return self._pending[0] if self._pending is not None else None

    def step(self, tensors: Sequence[torch.Tensor], *, weight: float = 1.0) -> Bundle:
        """This step's tensors after averaging, per the mode's semantics (see the module docstring)."""
        self.calls += 1
        own = tuple(tensors)
        client = self._client
        if client is None:
            return own
        if self.mode in ("cpu_cadence", "cpu_async") and self.calls % self.cadence:
            return own
        if self.mode == "cpu_async":
            return self._exchange(client, own, weight)
        return client.wait_round(_deposit_in_turn(client, own, weight=weight, fold=self.fold))

    def finish(self, tensors: Sequence[torch.Tensor]) -> Bundle:
        """cpu_async: wait for the round still out and apply it, depositing nothing (call once, after the
        last step, so that no rank's last round is lost). Other modes, or nothing out: `tensors` as given.
        """
        own = tuple(tensors)
        if self._client is None or self._pending is None:
            return own
        return self._apply_pending(self._client, own)

    def _apply_pending(self, client: RelayClient, own: Bundle) -> Bundle:
        assert self._pending is not None
        round_number, deposited = self._pending
        self._pending = None
        return elastic_update(own, deposited, client.wait_round(round_number), self.alpha)

    def _exchange(self, client: RelayClient, own: Bundle, weight: float) -> Bundle:
        """One cpu_async averaging call: apply the round deposited last time, deposit the result."""
        _check_async_bundle(own, self.fold or client.env.fold)
        current = self._apply_pending(client, own) if self._pending is not None else own
        round_number = _deposit_in_turn(client, current, weight=weight, fold=self.fold)
        self._pending = (round_number, tuple(tensor.detach().clone() for tensor in current))
        return current


def all_average(
    tensors: Sequence[torch.Tensor],
    *,
    weight: float = 1.0,
    fold: str | None = None,
    client: RelayClient | None = None,
) -> Bundle:
    """One synchronous round through the relays: the world's (weighted) mean of `tensors`.

    `client` defaults to the process's relay client; an Averager's round still in flight is waited for
    (and kept for it) before this round is deposited.
    """
    if client is None:
        if not in_flodld_rank():
            return tuple(tensors)
        client = relay_client()
    return client.wait_round(_deposit_in_turn(client, tensors, weight=weight, fold=fold))


def membership(client: RelayClient | None = None) -> Membership:
    """Who averages, as of the last completed round: `members` (global ranks), this rank's `index` among
    them, their `size`, and an `epoch` that grows by one whenever the set changes. Before the first round:
    every rank of the formed world, epoch 0. Outside a flodld run: a world of one.

    A loop that shards its data by member checks `epoch` after each averaging call and reshards on a
    change (docs/elastic-averaging.md has the pattern).
    """
    if client is None:
        if not in_flodld_rank():
            return Membership(0, (0,), 0)
        client = relay_client()
    return client.membership


def walk_in_state(client: RelayClient | None = None, timeout: float | None = None) -> Bundle | None:
    """On a rank that walked into a training run (docs/elastic-averaging.md, "Growth and healing"): the run's
    last averaged result, bit for bit what every member received for that round, to load before the first
    step; taken once. Blocks until the rank has entered the averaging (its relay reached a round boundary).
    None on a rank of the formed world, when no round had completed before it entered, or outside a run.
    """
    if client is None:
        if not in_flodld_rank():
            return None
        client = relay_client()
    return client.entry_state(timeout)


def entry_round(client: RelayClient | None = None) -> int:
    """The averaging round a walk-in entered at (its first deposit's round; docs/elastic-averaging.md,
    "Growth and healing"), blocking until it has entered; 0 on a rank of the formed world and outside a
    run. A loop that counts its steps from the world's start begins at `entry_round() * cadence`.
    """
    if client is None:
        if not in_flodld_rank():
            return 0
        client = relay_client()
    client.membership  # noqa: B018  blocks a walk-in until it has entered
    entry = client.entry
    return entry.round if entry is not None else 0
