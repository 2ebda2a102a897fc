"""The relay role's spec (hex JSON in FLODL_INTERNAL_RELAY_JSON), written by the agent.

`host_key_hex` is the key this host's agent derived at admission (`flodld.wire.hostkey`): the relay
proves it on its DATA and CONTROL upstreams. The variable is removed from the environment once read,
so nothing the relay's process starts inherits the secrets.

`listen_fd` is a loopback listening socket the agent bound and handed down, so the ranks' port
is known before the relay starts and no two runs on one box can collide on fixed ports.
"""

from __future__ import annotations

import os
from typing import Annotated, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flodld.config.rolespec import SpecError, decode_hex_json
from flodld.wire.salt import SaltHex

RELAY_ENV: Final = "FLODL_INTERNAL_RELAY_JSON"


class RelayRoleSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: Annotated[str, Field(min_length=1, max_length=253)]
    controller_host: Annotated[str, Field(min_length=1, max_length=253)]
    controller_port: Annotated[int, Field(ge=1, le=65535)]
    salt_hex: SaltHex
    host_key_hex: SaltHex  # the host key (flodld.wire.hostkey) has a salt's form: 16 bytes
    ranks: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=4096)]
    listen_fd: Annotated[int, Field(ge=0)]
    connect_attempts: Annotated[int, Field(ge=1)] | None = None
    straggler_timeout: Annotated[float, Field(gt=0)] | None = None
    walk_in: bool = False  # entered a training run: waits for the controller's Entry (RelaySpec.walk_in)


def relay_spec_from_env() -> RelayRoleSpec:
    """The spec in FLODL_INTERNAL_RELAY_JSON; the variable is dropped from os.environ once read."""
    text = os.environ.pop(RELAY_ENV, None)
    if text is None:
        raise SpecError(f"{RELAY_ENV} is not set; the relay role needs its spec there")
    try:
        return RelayRoleSpec.model_validate(decode_hex_json(text, RELAY_ENV))
    except ValidationError as error:
        raise SpecError(f"{RELAY_ENV} holds an invalid relay spec: {error}") from None
