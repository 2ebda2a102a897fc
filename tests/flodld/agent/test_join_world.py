"""The agent's join against a real in-process Controller on loopback."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from flodld.agent import join as joining
from flodld.agent.join import ExitClass, JoinFailed, build_hello, join_world
from flodld.agent.spec import AgentSpec
from flodld.config.join import JoinConfig
from flodld.controller.options import ControllerOptions
from flodld.controller.run import Controller
from flodld.net.timeouts import scaled
from flodld.wire.salt import salt_from_hex
from tests.flodld.controller.agents import Agent, join


def controller(token: str | None, ranks: int = 1) -> Controller:
    # A loopback bind without a token is open admission: reachability is the credential.
    return Controller(ControllerOptions(
        advertised_host="10.9.9.9", port=0, loopback_bind=True, averaging="cpu_sync",
        join=JoinConfig(discovery=True, min_rank_start=ranks, target_ranks=ranks, token=token),
    ))


def spec(port: int, token: str | None) -> AgentSpec:
    return AgentSpec(host="walker", controller_host="127.0.0.1", controller_port=port, salt_hex=token,
                     devices=["cpu"], connect_attempts=3)


async def test_a_wrong_token_is_a_permanent_failure_with_an_actionable_message() -> None:
    ctl = controller(secrets.token_hex(16))
    _, port = await ctl.start()
    try:
        agent = spec(port, secrets.token_hex(16))
        with pytest.raises(JoinFailed, match="token mismatch") as failure:
            await join_world(agent, build_hello(agent, ["cpu:0"]))
        assert failure.value.exit_class is ExitClass.PERMANENT
    finally:
        await ctl.stop("test over")


async def test_pre_shared_join_forms_and_rewrites_the_controller_to_the_dialed_address() -> None:
    token = secrets.token_hex(16)
    ctl = controller(token)
    _, port = await ctl.start()
    try:
        agent = spec(port, token)
        joined = await join_world(agent, build_hello(agent, ["cpu:0"]))
        envelope = joined.formed.envelope
        assert envelope.ranks == [0] and envelope.world_size == 1
        # The controller advertised 10.9.9.9; the agent keeps the road its join used.
        assert (envelope.controller_host, envelope.controller_port) == ("127.0.0.1", port)
        assert joined.salt == bytes.fromhex(token)
        await joined.stream.aclose()
    finally:
        await ctl.stop("test over")


async def test_open_admission_takes_the_salt_from_accept() -> None:
    ctl = controller(None)
    _, port = await ctl.start()
    try:
        agent = spec(port, None)
        joined = await join_world(agent, build_hello(agent, ["cpu:0"]))
        assert joined.salt == ctl.salt
        await joined.stream.aclose()
    finally:
        await ctl.stop("test over")


async def test_no_controller_is_a_transient_failure() -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    agent = spec(port, None).model_copy(update={"connect_attempts": 2})
    with pytest.raises(JoinFailed, match="failed after 2 attempts") as failure:
        await join_world(agent, build_hello(agent, ["cpu:0"]))
    assert failure.value.exit_class is ExitClass.TRANSIENT


@asynccontextmanager
async def walker_linked() -> AsyncIterator[tuple[Controller, AgentSpec, Agent]]:
    """A window for two ranks with host "walker" joined on a raw link that stays open (its old link), and
    the spec of an agent that dials as "walker" again.
    """
    token = secrets.token_hex(16)
    ctl = controller(token, ranks=2)  # the window stays open for a second host
    _, port = await ctl.start()
    try:
        old = await join(port, salt_from_hex(token), "walker")
        assert old.accepted.ranks == [0]
        yield ctl, spec(port, token), old
    finally:
        await ctl.stop("test over")


async def test_a_hello_refused_while_this_hosts_old_link_is_still_open_there_is_dialed_again() -> None:
    # After a partition the host's old join link, closed on its side, stays open on the controller's until
    # TCP's next retransmission brings the close; the next hello used to end its agent with duplicate_host
    # (fdl join --persist then backed off and started another agent, ~0.5 s). Now the agent dials again
    # for a moment and is admitted once the old link is gone.
    async with walker_linked() as (ctl, agent, old):
        second = asyncio.create_task(join_world(agent, build_hello(agent, ["cpu:0"])))
        await asyncio.sleep(0.35)  # a few refused hellos
        assert not second.done(), "the hello refused as duplicate_host ended the join at once"
        assert ctl.window is not None and ctl.window.ledger.refused_counts["duplicate_host"] >= 2
        await old.stream.aclose()  # the old link's close reaches the controller
        other = await join(agent.controller_port, salt_from_hex(agent.salt_hex or ""), "other")
        assert other.accepted.ranks  # the ranks the old link returned go to whoever comes first
        joined = await asyncio.wait_for(second, 5)
        assert joined.formed.envelope.world_size == 2
        await joined.stream.aclose()
        await other.stream.aclose()


async def test_a_duplicate_host_that_stays_is_still_refused_after_the_retries() -> None:
    async with walker_linked() as (_, agent, old):
        began = time.monotonic()
        with pytest.raises(JoinFailed, match=r"\[duplicate_host\]") as failure:
            await join_world(agent, build_hello(agent, ["cpu:0"]))
        assert failure.value.exit_class is ExitClass.TRANSIENT
        retried = time.monotonic() - began
        assert retried >= scaled(joining.DUPLICATE_RETRY_BOUND_SECS) - joining.DUPLICATE_RETRY_SECS
        await old.stream.aclose()
