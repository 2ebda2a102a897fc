"""Point 10 of issue 13, controller side: a host frame that does not decode is a counted refusal, and the
host's ranks are folded out in `finally`, so the other hosts' round still completes.
"""

from __future__ import annotations

import pytest
import torch

from flodld.fold.codec import decode_bundle, encode_bundle
from flodld.membership.phase import Phase
from flodld.wire.data import Broadcast, DataPlaneError, HelloAck, HostFrame, TensorSpec
from flodld.wire.errors import WireError
from flodld.wire.magic import Channel

from .relays import open_relay, two_hosts

HUGE_EMPTY = TensorSpec.model_validate({"dtype": "float32", "shape": [0] + [2**40 - 1] * 7})


async def test_a_zero_element_huge_shape_is_refused_and_the_round_completes_without_that_host() -> None:
    async with two_hosts() as world:
        salt = world.controller.salt
        relay_a, reply = await open_relay(
            world.port, salt, world.keys["a"], Channel.DATA, host="a", ranks=[0]
        )
        assert isinstance(reply, HelloAck)
        relay_b, reply = await open_relay(
            world.port, salt, world.keys["b"], Channel.DATA, host="b", ranks=[1]
        )
        assert isinstance(reply, HelloAck)

        await relay_a.send(
            HostFrame(round=0, fold="mean", weight=1.0, contributors=[0], tensors=[HUGE_EMPTY])
        )
        refusal = (await relay_a.recv(5)).message()
        assert isinstance(refusal, DataPlaneError) and "tensor 0" in refusal.reason, refusal
        with pytest.raises((EOFError, ConnectionError, WireError)):
            await relay_a.recv(5)

        specs, tail = encode_bundle([torch.tensor([4.0, 8.0])])
        await relay_b.send(HostFrame(round=0, fold="mean", weight=1.0, contributors=[1], tensors=specs), tail)
        frame = await relay_b.recv(5)  # host a's rank was folded out: the barrier does not wait for it
        message = frame.message()
        assert isinstance(message, Broadcast) and message.contributors == [1], message
        assert torch.equal(decode_bundle(message.tensors, frame.tail)[0], torch.tensor([4.0, 8.0]))

        assert world.controller.counters.dropped["host_frame"] == 1  # counted (state.json, /metrics)
        assert world.controller.phase is Phase.TRAINING
