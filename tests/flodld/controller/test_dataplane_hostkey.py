"""Point 9 of issue 13: a relay's DATA and CONTROL connections are bound to the host that was admitted.

Every host of a run holds the salt, so the salt alone cannot tell host "a" from host "b". The key
each agent derives from its own join connection (`flodld.wire.hostkey`) can: a relay proves it in
its RelayHello, and the connection is rekeyed to it, so host "a" can speak only as "a".
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from flodld.fold.codec import encode_bundle
from flodld.membership.phase import Phase
from flodld.net.stream import open_channel
from flodld.wire.data import DataPlaneError, HelloAck, HostFrame, RelayHello
from flodld.wire.errors import WireError
from flodld.wire.hostkey import derive_host_key
from flodld.wire.magic import Channel

from .agents import eventually
from .relays import open_relay, two_hosts

CLOSE_BOUND_SECS = 5.0


@pytest.mark.parametrize("channel", [Channel.DATA, Channel.CONTROL])
async def test_each_host_gets_its_own_key_and_its_relay_is_admitted_as_itself(channel: Channel) -> None:
    async with two_hosts() as world:
        assert world.keys["a"] != world.keys["b"]
        assert world.controller.host_key("a") == world.keys["a"]  # both ends of the join derived the same key
        for host, rank in (("a", 0), ("b", 1)):
            stream, reply = await open_relay(world.port, world.controller.salt, world.keys[host], channel,
                                             host=host, ranks=[rank])
            assert isinstance(reply, HelloAck), reply
            await stream.aclose()


@pytest.mark.parametrize("channel", [Channel.DATA, Channel.CONTROL])
async def test_host_a_presenting_itself_as_b_is_refused(channel: Channel) -> None:
    async with two_hosts() as world:
        salt = world.controller.salt
        # a's own key, b's name: the proof does not verify under b's key.
        stream, reply = await open_relay(world.port, salt, world.keys["a"], channel, host="b", ranks=[1])
        assert isinstance(reply, DataPlaneError), reply
        assert "does not verify" in reply.reason and salt.hex() not in reply.reason
        with pytest.raises((EOFError, ConnectionError, WireError)):
            await stream.recv(CLOSE_BOUND_SECS)
        # Everything a knows (the salt, the run id, its own join nonces) does not make b's key.
        forged = derive_host_key(
            salt, host="b", run_id=world.controller.run_id,
            dialer_nonce=world.agents["a"].stream.conn.nonce,
            listener_nonce=world.agents["a"].stream.conn.peer_nonce or b"",
        )
        _, reply = await open_relay(world.port, salt, forged, channel, host="b", ranks=[1])
        assert isinstance(reply, DataPlaneError) and "does not verify" in reply.reason, reply
        # The run goes on, and b's real relay still gets its seat.
        assert world.controller.phase is Phase.TRAINING
        _, reply = await open_relay(world.port, salt, world.keys["b"], channel, host="b", ranks=[1])
        assert isinstance(reply, HelloAck), reply


async def test_a_hello_without_a_proof_or_with_a_bad_one_is_refused() -> None:
    async with two_hosts() as world:
        salt = world.controller.salt
        stream = await open_channel("127.0.0.1", world.port, Channel.DATA, salt, timeout=5)
        await stream.send(RelayHello(host="a", ranks=[0], proof="00" * 32))
        reply = (await stream.recv(5)).message()
        assert isinstance(reply, DataPlaneError) and "does not verify" in reply.reason, reply
        stream = await open_channel("127.0.0.1", world.port, Channel.DATA, salt, timeout=5)
        await stream.send_frame(RelayHello.KIND, b'{"host":"a","ranks":[0]}')  # the pre-fix hello
        with pytest.raises((EOFError, ConnectionError, WireError)):
            reply = (await stream.recv(CLOSE_BOUND_SECS)).message()
            raise AssertionError(f"a hello without proof was answered: {reply!r}")


async def test_after_the_hello_every_frame_must_carry_the_host_key() -> None:
    """A salt-holder cannot splice frames into b's admitted connection: the link is rekeyed to b's key."""
    async with two_hosts() as world:
        salt = world.controller.salt
        stream, reply = await open_relay(world.port, salt, world.keys["b"], Channel.DATA, host="b", ranks=[1])
        assert isinstance(reply, HelloAck)
        stream.rekey(salt)  # as if the sender knew only the salt: the controller must refuse the frame
        specs, tail = encode_bundle([torch.zeros(2)])
        await stream.send(HostFrame(round=0, fold="mean", weight=1.0, contributors=[1], tensors=specs), tail)
        with pytest.raises((EOFError, ConnectionError, WireError)):
            await stream.recv(CLOSE_BOUND_SECS)


async def test_a_host_whose_join_link_closed_has_no_key_and_no_relay() -> None:
    async with two_hosts() as world:
        await world.agents["b"].stream.aclose()
        await eventually(lambda: world.controller.host_key("b") is None, timeout=5)
        _, reply = await open_relay(world.port, world.controller.salt, world.keys["b"], Channel.CONTROL,
                                    host="b", ranks=[1])
        assert isinstance(reply, DataPlaneError), reply
        await asyncio.sleep(0)
