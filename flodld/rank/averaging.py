"""CPU averaging modes on top of the relay data plane, as ranks call them once per training step.

Semantics (one `Averager.step(tensors)` call per step):
- `cpu_sync`: every call deposits and blocks until the world's average of that round arrives.
- `cpu_cadence`: every `cadence`-th call behaves like cpu_sync; the calls between return the
  rank's own tensors unchanged (local steps), so ranks meet every k steps.
- `cpu_async`: a call deposits only if this rank has no deposit still in flight, and never waits:
  it returns the newest average that has arrived (possibly from an earlier round), or the rank's
  own tensors before the first one. Fast ranks thus run ahead on the last available average,
  and each rank's k-th deposit is round k, so rounds still complete across all live ranks.

Outside a flodld run (a plain `python train.py`) every mode returns the tensors unchanged: the
average of a world of one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import torch

from flodld.config.fields import AveragingMode
from flodld.fold.base import Bundle
from flodld.rank.env import in_flodld_rank, read_rank_environment
from flodld.rank.relay_client import RelayClient, relay_client

AVERAGING_MODES: Final = tuple(mode.value for mode in AveragingMode.cpu_modes())


class Averager:
    def __init__(
        self,
        mode: str | None = None,
        *,
        cadence: int | None = None,
        fold: str | None = None,
        client: RelayClient | None = None,
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
        self.fold = fold
        self.calls = 0
        self._in_flight: int | None = None
        if env is not None and self._client is None:
            self._client = relay_client()

    def step(self, tensors: Sequence[torch.Tensor], *, weight: float = 1.0) -> Bundle:
        """This step's tensors after averaging, per the mode's semantics (see the module docstring)."""
        self.calls += 1
        own = tuple(tensors)
        client = self._client
        if client is None:
            return own
        if self.mode == "cpu_async":
            if self._in_flight is None or client.latest_completed_round() >= self._in_flight:
                self._in_flight = client.deposit(own, weight=weight, fold=self.fold)
            latest = client.latest
            return latest[1] if latest is not None else own
        if self.mode == "cpu_cadence" and self.calls % self.cadence:
            return own
        return client.wait_round(client.deposit(own, weight=weight, fold=self.fold))


def all_average(tensors: Sequence[torch.Tensor], *, weight: float = 1.0, fold: str | None = None) -> Bundle:
    """One synchronous round through the relays: the world's (weighted) mean of `tensors`."""
    if not in_flodld_rank():
        return tuple(tensors)
    client = relay_client()
    return client.wait_round(client.deposit(tensors, weight=weight, fold=fold))
