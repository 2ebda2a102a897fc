"""The controller's join window over real loopback sockets, with scaled-down windows."""

from __future__ import annotations

import asyncio
import socket

import pytest

from flodld.config.join import JoinConfig
from flodld.controller.join import JoinProtocol
from flodld.controller.mux import PortMux
from flodld.controller.run import Controller
from flodld.controller.status.metrics import ControllerCounters
from flodld.controller.status.snapshot import STATE_MAX_AGE_SECS
from flodld.membership.phase import Phase
from flodld.net.keepalive import Inherited
from flodld.wire.errors import WireError
from flodld.wire.join import Reject
from flodld.wire.magic import Channel, magic_prefix
from flodld.wire.salt import OPEN_ADMISSION_KEY, new_salt
from tests.reliability.daemon import running

from .agents import eventually, http, join, options, started

START = {"X-Flodld-Start": "1"}  # what `fdl start` sends: a loopback caller that is not a web page


async def test_two_hundred_concurrent_agents_get_contiguous_ranks_and_every_host_gets_world_formed() -> None:
    count = 200
    total = sum(1 + i % 2 for i in range(count))  # 300 ranks: hosts carry one or two
    async with running(options(capacity=total, join=JoinConfig(join_timeout=60))) as (controller, port):
        agents = await asyncio.gather(*(join(port, controller.salt, f"h{i:03d}", devices=1 + i % 2)
                                        for i in range(count)))
        ranks = sorted(r for a in agents for r in a.accepted.ranks)
        assert ranks == list(range(total))
        worlds = await asyncio.gather(*(a.world() for a in agents))
        assert {w.envelope.world_size for w in worlds} == {total}
        assert all("hosts" not in w.envelope.model_dump() for w in worlds)  # O(1) per host (join protocol 2)
        assert all(w.envelope.ranks == a.accepted.ranks for w, a in zip(worlds, agents, strict=True))
        assert all(w.envelope.controller_host == "127.0.0.1" for w in worlds)
        for _ in range(500):  # training follows once every host's WorldFormed write has drained
            status, body = await http(port, "GET", "/state.json")
            if body.get("phase") != "forming":
                break
            await asyncio.sleep(0.01)
        assert status == 200 and body["joined_hosts"] == count and body["phase"] == "training"
        await asyncio.gather(*(a.leave() for a in agents))
        result = await asyncio.wait_for(controller.wait(), 10)
        assert result.verdict is Phase.DONE


async def test_target_reached_forms_at_once_and_ranks_ship_in_admission_order() -> None:
    async with running(options(capacity=3, join=JoinConfig(join_timeout=30))) as (controller, port):
        first = await join(port, controller.salt, "a", devices=2)
        second = await join(port, controller.salt, "b")
        assert first.accepted.ranks == [0, 1] and second.accepted.ranks == [2]
        w1, w2 = await first.world(), await second.world()
        assert (w1.envelope.ranks, w2.envelope.ranks) == ([0, 1], [2])
        assert w1.relay is not None and w1.relay.data_port == port
        # the roster, in admission order, is in state.json (not in WorldFormed)
        state = controller.state_json()
        assert state is not None and [m["host"] for m in state["members"]] == ["a", "b"]
        await eventually(lambda: controller.phase is Phase.TRAINING)
        await first.leave()
        await asyncio.sleep(0.1)
        assert controller.phase is Phase.TRAINING  # one link still open
        await second.leave()
        assert (await asyncio.wait_for(controller.wait(), 5)).verdict is Phase.DONE


async def test_silent_connection_held_open_does_not_delay_a_join() -> None:
    async with running(options(capacity=1, magic_deadline=5.0)) as (controller, port):
        _, silent_writer = await asyncio.open_connection("127.0.0.1", port)
        _, half_writer = await asyncio.open_connection("127.0.0.1", port)
        half_writer.write(magic_prefix(Channel.JOIN))  # magic, then nothing: stuck in its own handshake
        loop = asyncio.get_running_loop()
        begun = loop.time()
        agent = await join(port, controller.salt, "fast")
        assert agent.accepted.ranks == [0]
        await agent.world()
        assert loop.time() - begun < 1.5
        silent_writer.close()
        half_writer.close()
        await agent.leave()


async def test_unknown_magic_is_dropped_and_counted_in_state_and_metrics() -> None:
    async with running(options(capacity=1)) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"\xde\xad\xbe\xef")
        with pytest.raises((ConnectionError, AssertionError)):
            assert await asyncio.wait_for(reader.read(), 3) != b""
        writer.close()
        _, body = await http(port, "GET", "/state.json")
        assert body["refused"]["connection_unknown_magic"] == 1
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        text = (await asyncio.wait_for(reader.read(), 3)).decode()
        assert 'flodld_dropped_connections_total{reason="unknown_magic"} 1' in text
        assert 'flodld_phase{phase="waiting"} 1' in text
        assert 'flodld_connections_total{channel="http"}' in text


async def test_wrong_token_hello_is_refused_without_a_reply_or_the_salt() -> None:
    async with running(options(capacity=1, join=JoinConfig(token=new_salt().hex()))) as (controller, port):
        with pytest.raises((EOFError, WireError, ConnectionError)):
            await join(port, new_salt(), "intruder")
        with pytest.raises((EOFError, WireError, ConnectionError)):
            await join(port, OPEN_ADMISSION_KEY, "open-guess")
        _, body = await http(port, "GET", "/state.json")
        assert body["refused"]["bad_tag"] == 2 and body["joined_ranks"] == 0
        assert controller.salt_hex not in str(body)


async def test_open_admission_on_a_loopback_bind_hands_out_the_salt() -> None:
    async with running(options(capacity=1, loopback_bind=True, averaging="cpu_sync")) as (controller, port):
        agent = await join(port, OPEN_ADMISSION_KEY, "walk-in", open_admission=True)
        assert agent.accepted.salt_hex == controller.salt_hex
        world = await agent.world()  # keyed with the salt after the rekey: it verifies
        assert world.envelope.controller_host == "127.0.0.1"
        await agent.leave()
        assert (await asyncio.wait_for(controller.wait(), 5)).ok


async def test_a_refused_hello_gets_a_reject_with_the_reason() -> None:
    async with running(options(capacity=2, roster=("a", "b"))) as (controller, port):
        stranger = await join(port, controller.salt, "stranger")
        assert isinstance(stranger.reply, Reject) and stranger.reply.code == "unknown_host"
        first = await join(port, controller.salt, "a")
        duplicate = await join(port, controller.salt, "a")
        assert isinstance(duplicate.reply, Reject) and duplicate.reply.code == "duplicate_host"
        _, body = await http(port, "GET", "/state.json")
        assert body["missing"] == ["b"] and body["refused"]["unknown_host"] == 1
        await first.leave()


async def test_disconnect_before_formation_returns_ranks_and_later_hosts_renumber() -> None:
    async with running(options(capacity=3, join=JoinConfig(join_timeout=30))) as (controller, port):
        a = await join(port, controller.salt, "a")
        b = await join(port, controller.salt, "b")
        assert (a.accepted.ranks, b.accepted.ranks) == ([0], [1])
        await a.leave()
        for _ in range(100):
            _, body = await http(port, "GET", "/state.json")
            if body["joined_ranks"] == 1:
                break
            await asyncio.sleep(0.02)
        assert body["joined_ranks"] == 1 and body["members"][0]["ranks"] == [0]
        c = await join(port, controller.salt, "c", devices=2)
        assert c.accepted.ranks == [1, 2]
        wb, wc = await b.world(), await c.world()
        assert (wb.envelope.ranks, wc.envelope.ranks, wb.envelope.world_size) == ([0], [1, 2], 3)
        await b.leave()
        await c.leave()
        assert (await asyncio.wait_for(controller.wait(), 5)).ok


async def test_window_expiry_with_quorum_forms_below_target() -> None:
    opts = options(capacity=4, join=JoinConfig(min_rank_start=1, join_timeout=0.4))
    async with running(opts) as (controller, port):
        agent = await join(port, controller.salt, "only")
        assert controller.phase is Phase.WAITING
        world = await agent.world(timeout=3)
        assert world.envelope.world_size == 1
        phase: Phase = controller.phase  # read again: the run moved on while this test awaited
        window = controller.window
        closed = window is not None and "window closed with quorum" in window.reason
        assert closed or phase is Phase.TRAINING
        await agent.leave()


async def test_hard_cap_without_quorum_fails_and_aborts_every_host() -> None:
    opts = options(capacity=3, join=JoinConfig(join_timeout=0.2, max_join_timeout=0.5))
    async with running(opts) as (controller, port):
        a = await join(port, controller.salt, "a")
        b = await join(port, controller.salt, "b")
        aborts = await asyncio.gather(a.abort(timeout=3), b.abort(timeout=3))
        assert all("quorum not met" in abort.reason for abort in aborts)
        result = await asyncio.wait_for(controller.wait(), 3)
        assert result.verdict is Phase.FAILED and "quorum not met" in result.reason
        _, body = await http(port, "GET", "/state.json")  # the endpoint outlives the run
        assert body["phase"] == "failed"


async def test_manual_mode_stages_through_expiry_until_post_start() -> None:
    opts = options(capacity=1, join=JoinConfig(start="manual", join_timeout=0.2, max_join_timeout=20))
    async with running(opts) as (controller, port):
        status, body = await http(port, "POST", "/start", START)
        assert (status, body["code"]) == (409, "quorum_not_met") and "0 of 1" in body["error"]
        agent = await join(port, controller.salt, "a")
        await asyncio.sleep(0.4)  # past the window: manual holds
        _, state = await http(port, "GET", "/state.json")
        assert state["phase"] == "staging" and state["startable"] is True
        status, body = await http(port, "POST", "/start", START)
        assert status == 200 and body["armed"] is True
        await agent.world()
        status, body = await http(port, "POST", "/start", START)
        assert status == 409 and body["code"] == "window_closed" and "phase:" in body["error"]
        await agent.leave()


async def test_manual_mode_without_start_fails_at_the_hard_cap() -> None:
    opts = options(capacity=1, join=JoinConfig(start="manual", join_timeout=0.1, max_join_timeout=0.4))
    async with running(opts) as (controller, port):
        agent = await join(port, controller.salt, "a")
        abort = await agent.abort(timeout=3)
        assert "operator start not received" in abort.reason


async def test_hybrid_forms_on_expiry_or_earlier_on_start() -> None:
    opts = options(capacity=4, join=JoinConfig(start="hybrid", min_rank_start=1, join_timeout=30))
    async with running(opts) as (controller, port):
        agent = await join(port, controller.salt, "a")
        _, state = await http(port, "GET", "/state.json")
        assert state["phase"] == "staging"
        status, _ = await http(port, "POST", "/start", START)
        assert status == 200
        assert (await agent.world()).envelope.world_size == 1
        await agent.leave()
    opts = options(capacity=4, join=JoinConfig(start="hybrid", min_rank_start=1, join_timeout=0.3))
    async with running(opts) as (controller, port):
        agent = await join(port, controller.salt, "a")
        assert (await agent.world(timeout=3)).envelope.world_size == 1
        await agent.leave()


async def test_a_failing_rank_fails_the_run_and_aborts_every_host() -> None:
    async with running(options(capacity=2)) as (controller, port):
        a = await join(port, controller.salt, "a")
        b = await join(port, controller.salt, "b")
        await a.world()
        await b.world()
        await b.report_exit(1, 3)
        aborts = await asyncio.gather(a.abort(), b.abort())
        assert all("tolerance" in x.reason for x in aborts)
        result = await asyncio.wait_for(controller.wait(), 3)
        assert result.verdict is Phase.FAILED


async def test_stop_aborts_every_link_with_the_reason() -> None:
    controller, port = await started(options(capacity=3))
    a = await join(port, controller.salt, "a")
    stopping = asyncio.create_task(controller.stop("operator pressed ctrl-c"))
    abort = await a.abort()
    assert abort.reason == "operator pressed ctrl-c"
    result = await stopping
    assert result.verdict is Phase.FAILED
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)


async def test_undecided_join_handshakes_hold_the_per_address_pre_admission_slots() -> None:
    opts = options(capacity=1, limit_loopback=True, max_pending_per_peer=2)
    async with running(opts) as (controller, port):
        stuck = []
        for _ in range(2):  # magic sent, then silence: the join handshake is still undecided
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(magic_prefix(Channel.JOIN))
            stuck.append(writer)
        await eventually(lambda: controller.mux.gate.pending("127.0.0.1") == 2)
        with pytest.raises((EOFError, WireError, ConnectionError, TimeoutError)):
            await join(port, controller.salt, "third")
        assert controller.counters.dropped["flood"] == 1
        for writer in stuck:
            writer.close()
        await eventually(lambda: controller.mux.gate.pending("127.0.0.1") == 0)
        agent = await join(port, controller.salt, "after")  # slots are released once decided or closed
        assert agent.accepted.ranks == [0]
        await agent.leave()


async def test_every_refusal_is_logged_with_the_peer_address(caplog: pytest.LogCaptureFixture) -> None:
    async with running(options(capacity=1, roster=("a",))) as (controller, port):
        with caplog.at_level("WARNING", logger="flodld.controller"):
            with pytest.raises((EOFError, WireError, ConnectionError)):
                await join(port, new_salt(), "forger")
            stranger = await join(port, controller.salt, "stranger")
            assert isinstance(stranger.reply, Reject)
            await eventually(lambda: sum("event=join_refused" in r.getMessage() for r in caplog.records) == 2)
        lines = [r.getMessage() for r in caplog.records if "event=join_refused" in r.getMessage()]
        assert all("peer=127.0.0.1" in line for line in lines)
        assert any("code=bad_tag" in line for line in lines) and any(
            "code=unknown_host" in line for line in lines
        )


async def test_clean_exits_end_done_but_a_corrupted_link_after_formation_fails_the_run() -> None:
    async with running(options(capacity=3)) as (controller, port):
        a, b, c = [await join(port, controller.salt, host) for host in ("a", "b", "c")]
        for agent in (a, b, c):
            await agent.world()
        await a.report_exit(0, 0)
        await a.leave()
        b.stream.writer.write(b"\x00" * 64)  # not a frame: the link is lost, its rank unreported
        abort = await c.abort()  # the hosts still linked are told why
        assert "over the tolerance" in abort.reason
        with pytest.raises((EOFError, ConnectionError)):
            await b.next()  # the broken link is simply closed
        result = await asyncio.wait_for(controller.wait(), 3)
        assert result.verdict is Phase.FAILED
        _, state = await http(port, "GET", "/state.json")
        links = {m["host"]: m["link"] for m in state["members"]}
        assert links == {"a": "closed", "b": "lost", "c": "open"} and state["rank_exits"] == [
            {"rank": 0, "code": 0}
        ]


async def test_a_rank_declared_dead_by_a_subsystem_fails_the_run_naming_its_host() -> None:
    async with running(options(capacity=2)) as (controller, port):
        a, b = await join(port, controller.salt, "quiet-host"), await join(port, controller.salt, "b")
        await a.world()
        await b.world()
        await eventually(lambda: controller.phase is Phase.TRAINING)
        controller.rank_lost(0, "no heartbeat for 6s")
        abort = await b.abort()
        assert "quiet-host" in abort.reason and "no heartbeat" in abort.reason
        result = await asyncio.wait_for(controller.wait(), 3)
        assert result.verdict is Phase.FAILED and "quiet-host" in result.reason


async def test_admitted_links_probe_with_tcp_keepalive_scaled_by_the_run_env() -> None:
    opts = options(capacity=2, link_keepalive_secs=15, env={"FLODL_NET_TIMEOUT_SCALE": "0.2"})
    async with running(opts) as (controller, port):
        agent = await join(port, controller.salt, "a")
        link = controller.links["a"].stream
        assert isinstance(link, JoinProtocol) and link.transport is not None
        sock = link.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 3  # 15 s x 0.2
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
        await agent.leave()


async def test_the_listening_socket_carries_nodelay_and_the_runs_keepalive_for_links_to_inherit() -> None:
    """Set once on the listener instead of per admitted link (five system calls and a socket object per
    join, ~5 % of a 10,000-host storm's controller CPU); the test above checks a link really has them.
    """
    opts = options(capacity=2, link_keepalive_secs=15, env={"FLODL_NET_TIMEOUT_SCALE": "0.2"})
    async with running(opts) as (controller, _):
        assert controller.mux.inherited == Inherited(nodelay=True, keepalive=3.0)
        server = controller.mux._server
        assert server is not None
        for sock in server.sockets:
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 3
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3


async def test_a_run_whose_keepalive_differs_from_the_ports_listener_sets_its_own_on_each_link() -> None:
    """A long-running service's port was set up with the service's options; a run with other ones (here
    15 s x 0.2 against the listener's 40 s) still probes as it says.
    """
    mux = PortMux(ControllerCounters(), link_keepalive=40)
    address = await mux.start("127.0.0.1", 0)
    assert mux.inherited.keepalive == 40
    opts = options(capacity=2, link_keepalive_secs=15, env={"FLODL_NET_TIMEOUT_SCALE": "0.2"})
    controller = Controller(opts, mux=mux, address=address)
    await controller.start()
    try:
        agent = await join(address[1], controller.salt, "a")
        link = controller.links["a"].stream
        assert isinstance(link, JoinProtocol) and link.transport is not None
        sock = link.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 3
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
        await agent.leave()
    finally:
        await controller.close()
        await mux.close()


async def test_state_json_counts_connections_by_channel_and_drops_by_reason() -> None:
    async with running(options(capacity=2)) as (controller, port):
        for _ in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"\xde\xad\xbe\xef")
            with pytest.raises((ConnectionError, AssertionError)):
                assert await asyncio.wait_for(reader.read(), 3) != b""
            writer.close()
        agent = await join(port, controller.salt, "a")
        assert agent.accepted.ranks == [0]
        await http(port, "GET", "/state.json")
        # state.json is cached: connection counts alone refresh it once the build is STATE_MAX_AGE_SECS old
        await asyncio.sleep(STATE_MAX_AGE_SECS + 0.05)
        _, body = await http(port, "GET", "/state.json")
        connections = body["connections"]
        assert connections["dropped"] == {"unknown_magic": 2}
        assert connections["by_channel"]["join"] == 1
        assert connections["by_channel"]["http"] == 2  # this request counts itself
        assert body["refused"]["connection_unknown_magic"] == 2  # the older spelling stays
