"""One valid instance of every registered wire message, the seeds the mutation fuzzers start from."""

from __future__ import annotations

import flodld.wire  # noqa: F401  (registers every channel's messages)
from flodld.wire import store as ws
from flodld.wire.control import CoordinatorHeartbeat, DeclareDead, Heartbeat, Shutdown
from flodld.wire.data import (
    Broadcast,
    DataPlaneError,
    Deposit,
    Entry,
    HelloAck,
    HostFrame,
    RankConnected,
    RankExpected,
    RankGone,
    RankHello,
    RankReady,
    RelayHello,
    ShmAccepted,
    ShmDeposit,
    ShmOffer,
    ShmRefused,
    ShmResult,
)
from flodld.wire.data import TensorSpec as Spec
from flodld.wire.join import (
    JOIN_PROTOCOL_VERSION,
    Abort,
    Accept,
    Hello,
    KillRank,
    RankExited,
    Reform,
    Reject,
    RelaySpec,
    Stopped,
    WorldEnvelope,
    WorldFormed,
)
from flodld.wire.messages import Message

DIGEST = "ab" * 32
ENVELOPE = WorldEnvelope(
    run_id="r1", world_size=3, ranks=[1, 2], local_world_size=2, controller_host="127.0.0.1",
    controller_port=1337, averaging="cpu_sync", backend="gloo", env={"OMP_NUM_THREADS": "1"},
)
TENSORS = [Spec(dtype="float32", shape=[2, 3])]

EXEMPLARS: list[Message] = [
    Hello(
        host="node-a",
        devices=["cpu:0", "cpu:1"],
        device_labels=["cpu", "cpu"],
        variant="cpu",
        torch_version="2.13",
        protocol_version=JOIN_PROTOCOL_VERSION,
        dataset_sig=DIGEST,
        run_id="r1",
        nccl_version="2.27",
        model_sig=DIGEST,
        averaging="cpu_sync",
    ),
    Accept(ranks=[0, 1], salt_hex="00" * 16, formation_wait_secs=1.5, run_id="r1"),
    Reject(code="window_closed", reason="the window closed"),
    WorldFormed(
        envelope=ENVELOPE, relay=RelaySpec(
            data_port=1337, control_port=1337, fold="mean", cadence=1, tolerance=1, straggler_timeout=2.5
        ),
    ),
    RankExited(rank=3, code=-9),
    Abort(reason="host b lost"),
    KillRank(rank=3, reason="rank 3 on 'node-a' sent no heartbeat for 5s"),
    Reform(reason="1 of 2 ranks failed (ranks [1])"),
    Stopped(),
    ws.StoreHello(run_id="r1", rank=0, client_id="0f" * 16),
    ws.StoreSet(key="/default_pg/0//cpu//0"),
    ws.StoreGet(key="k", timeout=2.0),
    ws.StoreAdd(key="k", amount=-5),
    ws.StoreCompareSet(key="k", expected_len=3),
    ws.StoreWait(keys=["a", "b"], timeout=1.0),
    ws.StoreCheck(keys=["a"]),
    ws.StoreDeleteKey(key="k"),
    ws.StoreNumKeys(),
    ws.StoreMultiGet(keys=["a", "b"], timeout=1.0),
    ws.StoreMultiSet(keys=["a", "b"], lengths=[1, 2]),
    ws.StoreAppend(key="k", request_id=3),
    ws.StoreListKeys(),
    ws.StoreQueuePush(key="q", request_id=4),
    ws.StoreQueuePop(key="q", timeout=1.0, request_id=5),
    ws.StoreQueueLen(key="q"),
    ws.StoreOk(),
    ws.StoreValue(),
    ws.StoreValues(lengths=[1, 0]),
    ws.StoreInt(value=7),
    ws.StoreBool(value=True),
    ws.StoreError(code="timeout", reason="timed out"),
    RelayHello(host="node-a", ranks=[0, 1], proof="ab" * 32),
    HelloAck(),
    RankHello(rank=1),
    Deposit(round=4, fold="mean", weight=1.0, tensors=TENSORS),
    HostFrame(round=4, fold="mean", weight=2.0, contributors=[0, 1], tensors=TENSORS),
    Broadcast(round=4, fold="mean", weight=3.0, contributors=[0, 1, 2], tensors=TENSORS),
    RankGone(rank=2, reason="leg closed"),
    DataPlaneError(reason="double deposit"),
    ShmOffer(pid=4242, fd=7, size=8192, tag="cd" * 32),
    ShmAccepted(size=8192),
    ShmRefused(reason="the region's head does not hold the offer's tag"),
    ShmDeposit(round=4, fold="mean", weight=1.0, tensors=TENSORS, offset=0, length=24),
    ShmResult(round=4, fold="mean", weight=3.0, contributors=[0, 1, 2], tensors=TENSORS, offset=0, length=24),
    Entry(round=5, epoch=2, members=[0, 1, 3], state=True),
    Entry(round=6, epoch=3, members=[0, 1, 3, 4], state=True, ranks=[4]),
    RankExpected(rank=4),
    RankConnected(rank=3),
    RankReady(),
    Heartbeat(rank=1, step=10),
    CoordinatorHeartbeat(),
    DeclareDead(rank=1, reason="silent"),
    Shutdown(reason="done"),
]
