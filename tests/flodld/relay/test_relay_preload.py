"""The fold loads torch off the event loop (the relay's and the controller's data plane).

The import takes seconds on a loaded host. Made at the first deposit (as it was), it ran on the loop that
also forwards the ranks' heartbeats and the coordinator's: with a short liveness timeout every rank of a
run was declared dead in round 0 (bench/chaos.py `--liveness-timeout 2`; asyncio's debug mode showed each
relay's leg task holding its loop for ~3 s). Now the first fold of a process loads torch in a worker
thread while the loop keeps turning, and a CPU-averaging run's controller starts that load when its world
forms (unless its one host's relay folds), so the import is over before any relay deposits (at the first
deposit it still held the loop in round 0 through the import's long stretches under the interpreter lock:
~140 ms in one piece on an idle machine, several times that on a loaded one, with every rank's liveness
clock running).

Each check runs in a fresh interpreter (torch not yet imported), with a task ticking every 5 ms beside the
first fold's preparation: the loop must have turned while torch loaded (it never did when the import ran
on it), and the fold must be ready after. A walk-in's relay starts loading as it starts (its host must
fold from the round it enters, so it reports its ranks connected only once loaded).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.multiproc

_PROBE = textwrap.dedent(
    """
    import asyncio, socket, sys

    import flodld.fold

    async def ticking(prepare):
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        assert "torch" not in sys.modules, "torch was loaded before the fold's first preparation"
        await prepare()
        ticker.cancel()
        print(f"ticks={ticks} loaded={flodld.fold.fold_loaded()} torch={'torch' in sys.modules}")

    async def relay():
        from flodld.relay.server import Relay
        from flodld.relay.spec import RelayRoleSpec

        door = socket.create_server(("127.0.0.1", 0))
        spec = RelayRoleSpec(host="h", controller_host="127.0.0.1", controller_port=9, salt_hex="00" * 16,
                             host_key_hex="11" * 16, ranks=[0, 1], listen_fd=door.detach())
        fold = Relay(spec).deposits
        await ticking(fold.ready)
        assert fold.barrier is not None and fold.barrier.round == 0

    async def controller():
        from flodld.controller.dataplane import DataPlane

        plane = DataPlane(bytes(16), {"a": [0], "b": [1]}, host_key={"a": bytes(16), "b": bytes(16)}.get,
                          liveness_timeout=60.0, on_rank_dead=lambda rank, why: None)
        await ticking(plane.fold_ready)

    async def walk_in():
        # A walk-in's relay loads the fold as it starts, before its ranks connect or deposit: here it keeps
        # dialing a controller that is not there, and the fold loads meanwhile.
        from flodld.relay.server import Relay
        from flodld.relay.spec import RelayRoleSpec

        door = socket.create_server(("127.0.0.1", 0))
        spec = RelayRoleSpec(host="h", controller_host="127.0.0.1", controller_port=9, salt_hex="00" * 16,
                             host_key_hex="11" * 16, ranks=[0, 1], listen_fd=door.detach(), walk_in=True)
        relay = Relay(spec)
        running = asyncio.create_task(relay.run())
        await ticking(lambda: until(flodld.fold.fold_loaded))
        assert not running.done() and relay.deposits.barrier is None  # still dialing; nothing folded
        running.cancel()

    async def formed():
        # A CPU-averaging run's controller loads the fold as its world forms, before any relay deposits:
        # at the first deposit (as it was) the import held the loop, and the ranks' heartbeats, in round 0.
        from flodld.config.join import JoinConfig
        from flodld.controller.attachplane import attach_data_plane
        from flodld.controller.options import ControllerOptions
        from flodld.controller.run import Controller
        from flodld.wire.salt import salt_from_hex
        from tests.flodld.controller.agents import join

        token = "ab" * 16
        options = ControllerOptions.model_validate({
            "bind_host": "127.0.0.1", "port": 0, "run_id": "preload", "capacity": 2,
            "join": JoinConfig(join_timeout=60, target_ranks=2, min_rank_start=2, token=token),
        })
        controller = Controller(options)
        attach_data_plane(controller)
        _, port = await controller.start()

        async def form():
            agents = [await join(port, salt_from_hex(token), host) for host in ("a", "b")]
            for agent in agents:
                await agent.world()
            await until(flodld.fold.fold_loaded)

        try:
            await ticking(form)
            assert controller.window is not None and controller.window.world is not None
        finally:
            await controller.close()

    async def until(check):
        for _ in range(6000):
            if check():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the fold did not load within 60 s")

    shells = {"relay": relay, "controller": controller, "walk-in": walk_in, "formed": formed}
    asyncio.run(shells[sys.argv[1]]())
    """
)


@pytest.mark.parametrize("shell", ["relay", "controller", "walk-in", "formed"])
def test_the_first_fold_loads_torch_while_the_loop_keeps_turning(shell: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, shell], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    fields = dict(field.split("=") for field in done.stdout.split())
    assert fields["loaded"] == "True" and fields["torch"] == "True", done.stdout
    # The import takes well over 15 ms anywhere; on the loop (before), the ticker never ran during it.
    assert int(fields["ticks"]) >= 3, f"the loop stood still while torch loaded: {done.stdout}"


_FIRST_ROUND = textwrap.dedent(
    """
    import sys

    import torch

    import flodld.fold

    flodld.fold.load_fold()
    before = set(sys.modules)
    barrier = flodld.fold.round_barrier(["a", "b"], accumulators=2, weights_may_drop=True)
    barrier.contribute("a", 0, "mean", [torch.ones(2178)], 1.0)
    result = barrier.contribute("b", 0, "mean", [torch.ones(2178)], 1.0)
    assert result is not None and torch.equal(result.tensors[0], torch.full((2178,), 2.0))  # a partial sum
    print(" ".join(sorted(set(sys.modules) - before)) or "-")
    """
)


def test_once_the_fold_is_loaded_its_first_round_imports_nothing() -> None:
    # The first round runs on the loop that carries the heartbeats: an import there holds it. The first
    # schema is judged on meta tensors, and torch's first meta op imported sympy (~0.22 s on a loaded
    # machine: the longest heartbeat gap of every chaos run, in its first round); load_fold makes that op.
    done = subprocess.run(
        [sys.executable, "-c", _FIRST_ROUND], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["-"], f"the first round imported: {done.stdout[:500]}"


_FOLDS_NOTHING = textwrap.dedent(
    """
    import asyncio, sys

    from flodld.config.join import JoinConfig
    from flodld.controller.attachplane import attach_data_plane
    from flodld.controller.options import ControllerOptions
    from flodld.controller.run import Controller

    async def main(case):
        # "never": no host comes; "sole": one host forms a world of its own, whose relay folds its rounds.
        token = "ab" * 16
        ranks = 2 if case == "never" else 1
        options = ControllerOptions.model_validate({
            "bind_host": "127.0.0.1", "port": 0, "run_id": "stop", "capacity": 2,
            "join": JoinConfig(join_timeout=60, target_ranks=ranks, min_rank_start=ranks, token=token),
        })
        controller = Controller(options)
        attach_data_plane(controller)
        _, port = await controller.start()
        if case == "sole":
            from flodld.wire.salt import salt_from_hex
            from tests.flodld.controller.agents import join

            agent = await join(port, salt_from_hex(token), "h")
            await agent.world()
            def attached():  # the data plane, once built, lends the controller its round_in_progress
                return getattr(controller.round_in_progress, "__self__", None) is not None

            for _ in range(500):
                if attached():
                    break
                await asyncio.sleep(0.01)
            assert attached(), "the data plane was never attached"
        await asyncio.sleep(0.5)
        await controller.stop("stopped")

    asyncio.run(main(sys.argv[1]))
    print(f"torch={'torch' in sys.modules}")
    """
)


@pytest.mark.parametrize("case", ["never", "sole"])
def test_a_controller_that_folds_nothing_loads_no_torch(case: str) -> None:
    # The preload once started with the window: a daemon stopped soon after (systemctl stop, the SIGTERM
    # lifecycle test) then waited for torch to load, since asyncio.run joins the executor's threads, and
    # a daemon thread instead was aborted (SIGABRT) when the interpreter finalized mid-import. It starts
    # as the world forms now, as the first deposit's load did before it; and only where the controller
    # folds: a one-host world's relay folds its own rounds (HelloAck sole_host), so its controller never
    # needs torch (it loaded it anyway, ~60 MiB and seconds of CPU, before the load moved into the plane).
    done = subprocess.run(
        [sys.executable, "-c", _FOLDS_NOTHING, case], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["torch=False"], done.stdout
