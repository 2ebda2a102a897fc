"""The `controller.join:` block: knobs of the join window, as written by the operator.

Only shape is checked here; the rules that relate knobs to each other and to the roster
live in `flodld.membership.policy.derive_policy`, which has the context (capacity, bind scope).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from flodld.wire.salt import SaltHex


class JoinConfig(BaseModel):
    """Membership-window overrides; every field is optional and defaults as the cluster guide says."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    min_rank_start: int | None = Field(default=None, ge=1, description="Quorum in ranks.")
    join_timeout: float = Field(default=300.0, gt=0, description="Window length in seconds.")
    target_ranks: int | None = Field(default=None, ge=1, description="Close the window at this many ranks.")
    max_join_timeout: float | None = Field(default=None, gt=0, description="Hard cap in seconds.")
    open_admission: bool = False
    discovery: bool = False
    token: SaltHex | None = Field(default=None, description="Pre-shared session salt, 32 hex characters.")
    tunnel_only: bool = False
    start: Literal["auto", "manual", "hybrid"] = "auto"
    max_restarts: int = Field(
        default=0,
        ge=0,
        le=1000,
        description="Failed attempts re-formed as a fresh world before the run fails (--max-restarts).",
    )
    elastic_max_ranks: int | None = Field(
        default=None,
        ge=1,
        le=2**20,
        description="Growth bound of an elastic run (docs/elastic-averaging.md, 'Growth and healing'): "
        "walk-ins are admitted during training while the live ranks stay at or below it. None: no growth.",
    )
