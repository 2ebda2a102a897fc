"""What the session's steps read and set of a session: ``SessionState``, a Protocol.

``ThresholdSession`` (fhelium.multiparty.distributed) satisfies it; the modules that hold its steps
(keygen, sliced, dropout) take a ``SessionState`` instead of importing the facade, so the facade
depends on them and never the other way round.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from fhelium.core import PublicKey
from fhelium.engine import CkksEngine
from fhelium.multiparty.channel import ShareChannel
from fhelium.multiparty.dealing import DealingIdentity
from fhelium.multiparty.protocol import ThresholdParty
from fhelium.multiparty.values import PublicKeyShare


class SessionState(Protocol):
    """One rank's session: its channel and party, the keys so far, the rounds and who is left."""

    channel: ShareChannel
    party: ThresholdParty
    engine: CkksEngine
    threshold: int | None  # t for t-out-of-N keys, None for N-out-of-N
    public: PublicKey | None
    key_share: PublicKeyShare | None
    common_seed: bytes
    challenge_key: bytes | None  # the sum checks' secret challenge key (fhelium.multiparty.challenge)
    dealing_identity: DealingIdentity | None
    dealing_pins: dict[int, str]
    dealing_fingerprint: str | None
    dealing_audit: Callable[[int, torch.Tensor], None] | None
    shamir_share: torch.Tensor | None
    alive: list[int]
    round: int


__all__ = ["SessionState"]
