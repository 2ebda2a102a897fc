"""Same-host shared memory between ranks and their relay (flodld.net.shm; docs/protocol.md).

Real relays and the controller's data plane; ranks are threads with blocking clients (as in
test_averaging_modes), so rank and relay share a pid here, which the checks do not exempt: an offer is
held to the same pid-owns-the-leg, memory-file, size and tag checks as one from another process.
- the shared-memory road gives the framed road's results bit for bit (float mean and sum, the modular
  fold), chunked and unchunked, at 2 and 3 ranks on one host and across two hosts, and really is taken;
- offers are refused with a reason (wrong tag, wrong size, another process's fd, a file that is not a
  region, a deposit that names no region), and the rank goes on framed with one warning (auto) or fails
  (FLODL_SHM=on); FLODL_SHM=off offers nothing;
- a rank that dies mid-round leaves no mapping and no fd of its region in the relay, and the round
  completes for the others as on the framed road.
"""

from __future__ import annotations

import fcntl
import gc
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import cast

import pytest
import torch

from flodld.fold.base import Bundle
from flodld.fold.chunks import Layout, split_parts
from flodld.fold.codec import encode_bundle_parts
from flodld.net.shm import OwnedRegion, shm_mode
from flodld.rank import relay_client as relay_client_module
from flodld.rank.relay_client import RelayClient, RelayClientError
from flodld.wire.data import Broadcast, ShmAccepted, ShmDeposit, ShmOffer, ShmRefused, ShmResult
from tests.flodld.fold.test_fold_chunks import MODULI, float_bundle, modular_bundle

from .recorder import RecordingForwarder
from .test_averaging_modes import Plane, in_thread

WORLDS = {
    "2-ranks": {"h": [0, 1]},
    "3-ranks": {"h": [0, 1, 2]},
    "2-hosts": {"a": [0, 1], "b": [2]},
}
FOLDS = ["mean", "sum", "modular:" + ",".join(map(str, MODULI))]
ROUNDS = 2


def ranks_of(plane: Plane) -> list[int]:
    return sorted(rank for ranks in plane.hosts.values() for rank in ranks)


def bundle(spec: str, rank: int, step: int) -> Bundle:
    if spec.startswith("modular"):
        return modular_bundle(rank + 10 * step)
    return tuple(tensor * (step + 1) for tensor in float_bundle(rank + 10 * step))


def run_rounds(
    plane: Plane, clients: dict[int, RelayClient], spec: str, *, shm: bool
) -> dict[int, list[tuple[type, Bundle]]]:
    """ROUNDS rounds of every rank in its own thread; per rank: (message type, result) per round."""

    def rounds(rank: int) -> list[tuple[type, Bundle]]:
        client = clients[rank]
        client.use_shm = shm
        out = []
        for step in range(ROUNDS):
            result = client.wait_round(client.deposit(bundle(spec, rank, step), fold=spec), timeout=30)
            assert client.latest is not None
            out.append((type(client.latest[0]), result))
        return out

    futures = {rank: in_thread(lambda rank=rank: rounds(rank)) for rank in clients}
    return {rank: future.result(60) for rank, future in futures.items()}  # type: ignore[misc]


def assert_bitwise_equal(got: Bundle, want: Bundle) -> None:
    assert len(got) == len(want)
    for mine, theirs in zip(got, want, strict=True):
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape
        assert torch.equal(mine.reshape(-1).view(torch.uint8), theirs.reshape(-1).view(torch.uint8))


@pytest.fixture(autouse=True)
def _stay_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused rank's relay closes both its legs, and a client whose control leg closes exits the
    process (os._exit) unless it was closed first: here the test process would go with it.
    """
    monkeypatch.setattr(relay_client_module, "_exit_now", lambda message, code: None)


@pytest.fixture
def world(request: pytest.FixtureRequest) -> Iterator[Plane]:
    plane = Plane(WORLDS[getattr(request, "param", "2-ranks")])
    yield plane
    plane.close()


@pytest.mark.parametrize("world", list(WORLDS), indirect=True)
@pytest.mark.parametrize("chunk_bytes", [4099, 1 << 22], ids=["chunked", "unchunked"])
@pytest.mark.parametrize("spec", FOLDS, ids=["mean", "sum", "modular"])
def test_the_shared_memory_road_gives_the_framed_roads_results_bit_for_bit(
    world: Plane, chunk_bytes: int, spec: str
) -> None:
    clients = {rank: world.client(rank) for rank in ranks_of(world)}
    try:
        for client in clients.values():
            client.chunk_bytes = chunk_bytes
        framed = run_rounds(world, clients, spec, shm=False)
        # The same deposits again, now through the regions (rounds ROUNDS.. of the same world).
        shared = run_rounds(world, clients, spec, shm=True)
        for rank in clients:
            assert [kind for kind, _ in framed[rank]] == [Broadcast] * ROUNDS
            assert [kind for kind, _ in shared[rank]] == [ShmResult] * ROUNDS
            for (_, want), (_, got) in zip(framed[rank], shared[rank], strict=True):
                assert_bitwise_equal(got, want)
            assert_bitwise_equal(shared[rank][-1][1], shared[0][-1][1])
        for relay in world.relays.values():
            assert sorted(relay.shm.regions) == sorted(set(relay.ranks))
    finally:
        for client in clients.values():
            client.close()


def offer(client: RelayClient, message: ShmOffer) -> ShmAccepted | ShmRefused:
    with client._changed:
        client._shm_reply = None
    client.data.send(message)
    with client._changed:
        assert client._changed.wait_for(lambda: client._shm_reply is not None, 10)
        assert client._shm_reply is not None
        return client._shm_reply


def own_offer(region: OwnedRegion, **changes: object) -> ShmOffer:
    fields: dict[str, object] = {
        "pid": os.getpid(),
        "fd": region.fd,
        "size": region.size,
        "tag": region.tag.hex(),
    }
    return ShmOffer.model_validate({**fields, **changes})


class Unsealed:
    """A memory file like a region (name, size, head), but without the size seals."""

    def __init__(self, like: OwnedRegion) -> None:
        self.fd = os.memfd_create("flodld-shm", os.MFD_CLOEXEC)
        self.size = like.size
        os.ftruncate(self.fd, self.size)
        os.pwrite(self.fd, bytes(like.view[:64]), 0)


OTHER_PROCESS = """
import os, sys, time
from flodld.net.shm import OwnedRegion
region = OwnedRegion(4096)
print(region.fd, region.size, region.tag.hex(), flush=True)
sys.stdin.readline()
"""


def test_offers_that_name_the_wrong_memory_are_refused_with_a_reason(world: Plane) -> None:
    client = world.client(0)
    region = OwnedRegion(4096)
    unsealed = Unsealed(region)
    other = subprocess.Popen(
        [sys.executable, "-c", OTHER_PROCESS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert other.stdout is not None
        fd, size, tag = other.stdout.readline().split()
        plain = open(__file__, "rb")  # noqa: SIM115 - a regular file of this user, not a region
        cases = {
            "the region's head does not hold the offer's tag": own_offer(region, tag="00" * 32),
            f"the region has {region.size} bytes, the offer said {region.size + 4096}": own_offer(
                region, size=region.size + 4096
            ),
            # Another process's real region with its right tag: that process does not hold this leg.
            f"process {other.pid} does not hold this data leg's connection": ShmOffer(
                pid=other.pid, fd=int(fd), size=int(size), tag=tag
            ),
            f"fd {plain.fileno()} of process {os.getpid()} is not a flodld memory file": own_offer(
                region, fd=plain.fileno()
            ),
            f"cannot open fd 999999 of process {os.getpid()}": own_offer(region, fd=999_999),
            # Right name, size and tag, but the rank could shrink it under the relay's map (SIGBUS).
            "the region is not sealed against shrinking and growing": ShmOffer(
                pid=os.getpid(), fd=unsealed.fd, size=unsealed.size, tag=region.tag.hex()
            ),
        }
        for reason, message in cases.items():
            reply = offer(client, message)
            assert isinstance(reply, ShmRefused) and reason in reply.reason, (reason, reply)
        plain.close()
        assert world.relay.shm.regions == {} and world.relay.shm.refused == len(cases)
        # The leg is still good: the right offer is taken.
        assert isinstance(offer(client, own_offer(region)), ShmAccepted)
        assert list(world.relay.shm.regions) == [0]
    finally:
        other.communicate("\n", timeout=10)
        client.close()
        region.close()
        os.close(unsealed.fd)


@pytest.mark.parametrize(
    ("offered", "reason"),
    [(False, "a shared-memory deposit without an accepted region"), (True, "lie outside the region's")],
    ids=["no-region", "outside-the-region"],
)
def test_a_shared_deposit_without_a_region_or_outside_it_is_refused(
    world: Plane, offered: bool, reason: str
) -> None:
    client = world.client(0)
    region = OwnedRegion(4096)
    try:
        if offered:
            assert isinstance(offer(client, own_offer(region)), ShmAccepted)
        elements = region.capacity // 4 + 1  # one element more than the region holds
        specs, _ = encode_bundle_parts([torch.ones(elements)])
        client.data.send(
            ShmDeposit(round=0, fold="mean", weight=1.0, tensors=specs, offset=0, length=4 * elements)
        )
        with pytest.raises(RelayClientError, match=reason):
            client.wait_round(0, timeout=10)
    finally:
        client.close()
        region.close()


def test_without_a_usable_region_auto_warns_once_and_goes_framed(
    world: Plane, caplog: pytest.LogCaptureFixture
) -> None:
    world.relay.shm.enabled = False  # the relay refuses every offer
    clients = {rank: world.client(rank) for rank in (0, 1)}
    try:
        with caplog.at_level(logging.WARNING, logger="flodld.rank"):
            results = run_rounds(world, clients, "mean", shm=True)
        for rank in clients:
            assert [kind for kind, _ in results[rank]] == [Broadcast] * ROUNDS
            assert clients[rank].shm_mode == "off" and clients[rank].region is None
        warnings = [record.getMessage() for record in caplog.records if record.name == "flodld.rank"]
        assert len(warnings) == 2  # once per rank, not per round
        assert all("shared memory is off on this relay (FLODL_SHM=off)" in text for text in warnings)
    finally:
        for client in clients.values():
            client.close()


def test_shm_on_makes_an_unusable_region_an_error(world: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    world.relay.shm.enabled = False
    monkeypatch.setenv("FLODL_SHM", "on")
    client = world.client(0)
    try:
        with pytest.raises(
            RelayClientError, match="FLODL_SHM=on but shared memory with the relay is unavail"
        ):
            client.deposit([torch.ones(4)])
    finally:
        client.close()


def test_shm_off_offers_nothing(world: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLODL_SHM", "off")
    clients = {rank: world.client(rank) for rank in (0, 1)}
    try:
        results = run_rounds(world, clients, "sum", shm=True)
        assert all(kind is Broadcast for rank in clients for kind, _ in results[rank])
        assert world.relay.shm.regions == {} and clients[0].region is None
    finally:
        for client in clients.values():
            client.close()


def mapped_inodes() -> set[int]:
    inodes = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and "flodld-shm" in line:
                inodes.add(int(fields[4]))
    return inodes


def fd_inodes() -> set[int]:
    inodes = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:flodld-shm"):
                inodes.add(os.stat(f"/proc/self/fd/{name}").st_ino)
        except OSError:
            continue
    return inodes


@pytest.mark.parametrize("world", ["3-ranks"], indirect=True)
def test_a_rank_that_dies_mid_round_leaves_no_mapping_behind_and_the_round_completes(world: Plane) -> None:
    clients = {rank: world.client(rank) for rank in (0, 1, 2)}
    dying = clients.pop(2)
    chunk = 4099
    try:
        deposit = float_bundle(2)
        specs, parts = encode_bundle_parts(deposit)
        layout = Layout(specs)
        ranges = layout.ranges(chunk)
        region = dying._region_for(layout.total, 0)
        assert region is not None
        inode = os.fstat(region.fd).st_ino
        assert inode in mapped_inodes()
        (offset, length), first = ranges[0], next(split_parts(parts, ranges))
        region.write(offset, first)
        dying.data.send(ShmDeposit(round=0, fold="mean", weight=1.0, tensors=specs, offset=0, length=length))
        mapped = world.relay.shm.regions[2]
        dying.close()  # dies in the middle of its deposit: its first chunk waits for ranks 0 and 1
        for client in clients.values():
            client.chunk_bytes = chunk
        results = run_rounds(world, clients, "mean", shm=True)
        for rank in clients:
            kind, got = results[rank][0]
            assert kind is ShmResult
            # Past rank 2's first chunk, every element is the mean of ranks 0 and 1 (as framed).
            want = (float_bundle(0)[0] + float_bundle(1)[0]) / 2
            assert torch.equal(got[0][chunk // 4 :], want[chunk // 4 :])
        assert 2 not in world.relay.shm.regions and mapped.closed
        gc.collect()
        assert inode not in mapped_inodes() and inode not in fd_inodes()
    finally:
        for client in clients.values():
            client.close()


def test_a_deposit_before_the_previous_result_is_back_goes_framed_and_leaves_the_region_alone(
    world: Plane,
) -> None:
    first, second = world.client(0), world.client(1)
    try:
        first.deposit([torch.tensor([1.0, 2.0])])  # round 0, through the region
        assert first.region is not None
        with first._changed:  # first's reader cannot hand round 0 out while the test holds this
            second.deposit([torch.tensor([3.0, 4.0])])
            assert second.wait_round(0, timeout=10)[0].tolist() == [2.0, 3.0]
            # Round 0 is folded and its result written into first's region, not yet copied out by first.
            assert first.region.data(0, 8).tobytes() == torch.tensor([2.0, 3.0]).numpy().tobytes()
            assert first.deposit([torch.tensor([5.0, 6.0])]) == 1  # so round 1 goes framed
            assert first.region.data(0, 8).tobytes() == torch.tensor([2.0, 3.0]).numpy().tobytes()
        assert first.wait_round(0, timeout=10)[0].tolist() == [2.0, 3.0]
        second.deposit([torch.tensor([7.0, 8.0])])
        assert first.wait_round(1, timeout=10)[0].tolist() == [6.0, 7.0]
        assert first.latest is not None and type(first.latest[0]) is Broadcast
        assert second.wait_round(1, timeout=10)[0].tolist() == [6.0, 7.0]
    finally:
        first.close()
        second.close()


def test_an_observer_on_the_rank_legs_sees_no_plaintext_on_the_shared_memory_road(world: Plane) -> None:
    # The small frames of the shared-memory road (offer, deposits, results) are sealed like every other,
    # and the tensors are in no byte on the legs. The observer runs in this process, so the relay's pid
    # check passes: the offer is taken.
    observer = RecordingForwarder(world.relay_port)
    world.relay_ports["h"] = observer.port
    clients = {rank: world.client(rank) for rank in (0, 1)}
    try:
        values = {rank: torch.full((4096,), 1234.5 + rank) for rank in clients}

        def one(rank: int) -> tuple[type, Bundle]:
            client = clients[rank]
            result = client.wait_round(client.deposit([values[rank]]), timeout=30)
            assert client.latest is not None
            return type(client.latest[0]), result

        futures = {rank: in_thread(lambda rank=rank: one(rank)) for rank in clients}
        for future in futures.values():
            kind, (mean,) = cast(tuple[type, Bundle], future.result(30))  # what `one` returns
            assert kind is ShmResult and torch.equal(mean, torch.full((4096,), 1235.0))
    finally:
        for client in clients.values():
            client.close()
        observer.close()
    wire = b"\x00".join(observer.recorded())
    assert len(wire) > 1000  # the observer saw the legs' traffic
    for value in (1234.5, 1235.5, 1235.0):  # deposits and the mean
        assert torch.full((8,), value).numpy().tobytes() not in wire, value
    for word in (b"Shm", b'"round"', b'"tag"', b'"pid"'):
        assert word not in wire


@pytest.mark.parametrize("world", ["2-ranks", "2-hosts"], indirect=True)
def test_a_reserved_region_is_ready_before_the_round_and_the_round_is_the_framed_roads_bit_for_bit(
    world: Plane,
) -> None:
    spec = FOLDS[2]
    clients = {rank: world.client(rank) for rank in ranks_of(world)}
    try:
        for client in clients.values():
            client.chunk_bytes = 4099
        framed = run_rounds(world, clients, spec, shm=False)
        total = Layout(encode_bundle_parts(list(bundle(spec, 0, 0)))[0]).total
        for client in clients.values():
            client.use_shm = True
            assert client.reserve(total)
        # Offered and accepted by reserve, before any round: the rounds take these regions as they are.
        for relay in world.relays.values():
            assert sorted(relay.shm.regions) == sorted(relay.ranks)
        regions = {rank: client.region for rank, client in clients.items()}
        spares = {rank: client._spare.buffer for rank, client in clients.items()}
        shared = run_rounds(world, clients, spec, shm=True)
        for rank, client in clients.items():
            assert client.region is regions[rank]
            assert [kind for kind, _ in shared[rank]] == [ShmResult] * ROUNDS
            for (_, want), (_, got) in zip(framed[rank], shared[rank], strict=True):
                assert_bitwise_equal(got, want)
            # The first result was assembled in the memory reserve faulted in, the second in fresh memory.
            spare = spares[rank]
            assert spare is not None and client._spare.buffer is None
            first, second = shared[rank][0][1][0], shared[rank][1][1][0]
            assert first.untyped_storage().data_ptr() == spare.untyped_storage().data_ptr()
            assert second.untyped_storage().data_ptr() != spare.untyped_storage().data_ptr()
    finally:
        for client in clients.values():
            client.close()


def test_reserve_leaves_the_region_alone_while_a_result_is_out(world: Plane) -> None:
    first, second = world.client(0), world.client(1)
    try:
        assert first.reserve(64)
        region = first.region
        first.deposit([torch.tensor([1.0, 2.0])])  # round 0: its result comes back through this region
        assert not first.reserve(1 << 20)  # so no new region now
        spare = first._spare.buffer
        assert first.region is region and spare is not None and spare.numel() == 64
        second.deposit([torch.tensor([3.0, 4.0])])
        assert first.wait_round(0, timeout=10)[0].tolist() == [2.0, 3.0]
        assert second.wait_round(0, timeout=10)[0].tolist() == [2.0, 3.0]
        assert first.reserve(1 << 20) and first.region is not region
        assert first.region is not None and first.region.capacity >= 1 << 20
        first.use_shm = False
        assert not first.reserve(1 << 21)
    finally:
        first.close()
        second.close()


def test_reserve_does_nothing_under_shm_off(world: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLODL_SHM", "off")
    client = world.client(0)
    try:
        assert not client.reserve(1 << 20) and client.region is None and client._spare.buffer is None
        assert not world.relay.shm.regions
    finally:
        client.close()


def test_a_sparse_region_is_mapped_without_populating_it_and_readies_no_accumulator(world: Plane) -> None:
    # A region whose pages the rank never made (a sealed memory file of 1 GiB, only its head written) is
    # taken, but the relay neither faults its pages in nor readies an accumulator of its size: that
    # would make the relay allocate whatever a rank names.
    client = world.client(0)
    like = OwnedRegion(4096)
    fd = os.memfd_create("flodld-shm", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        size = 1 << 30
        os.ftruncate(fd, size)
        os.pwrite(fd, bytes(like.view[:64]), 0)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        assert isinstance(offer(client, own_offer(like, fd=fd, size=size)), ShmAccepted)
        region = world.relay.shm.regions[0]
        assert not region.populated and region.size == size
        barrier = world.relay.deposits.barrier
        assert barrier is None or barrier.accumulators.spare.buffer is None
        assert os.fstat(fd).st_blocks * 512 < 1 << 20  # still sparse after the relay mapped it
        # The rank's own (populated) region readies the accumulator of its size.
        assert isinstance(offer(client, own_offer(like)), ShmAccepted)
        assert world.relay.shm.regions[0].populated
        barrier = world.relay.deposits.barrier
        assert barrier is not None and barrier.accumulators.spare.buffer is not None
        assert barrier.accumulators.spare.buffer.numel() == like.capacity
    finally:
        client.close()
        like.close()
        os.close(fd)


def test_flodld_shm_takes_auto_on_or_off_and_names_them_when_it_is_anything_else() -> None:
    assert shm_mode({}) == "auto" and shm_mode({"FLODL_SHM": ""}) == "auto"
    assert [shm_mode({"FLODL_SHM": mode}) for mode in ("auto", "on", "off")] == ["auto", "on", "off"]
    with pytest.raises(ValueError, match=r"FLODL_SHM='yes'; use one of auto, on, off"):
        shm_mode({"FLODL_SHM": "yes"})
