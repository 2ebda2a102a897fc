"""What crosses the controller on the relay path: ciphertext residues only, folded to the exact modular sum.

An in-process controller serves two single-rank hosts whose agents dial it through a recording TCP
forwarder, so every byte of every channel (join, rendezvous, data, control) of both hosts passes the
recorder. The data-plane streams are then decoded with the run's own frame codec (tags verified)
and compared with what the ranks held (dumped by the test program's audit hook).
"""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from flodld.agent.spec import AGENT_ENV, AgentSpec, encode_spec
from flodld.config.join import JoinConfig
from flodld.controller.attachplane import attach_data_plane
from flodld.controller.options import ControllerOptions
from flodld.controller.run import Controller
from flodld.fold.base import ModularFold
from flodld.fold.codec import decode_bundle
from flodld.wire.data import Broadcast, HostFrame, RelayHello
from flodld.wire.frames import NEED_DATA, NONCE_BYTES, Frame, FrameConnection, Role
from flodld.wire.hostkey import derive_host_key
from flodld.wire.join import Hello
from flodld.wire.magic import Channel, channel_for_prefix
from tests.e2e.harness import child_env

pytestmark = pytest.mark.multiproc

PROGRAM = Path(__file__).resolve().parent / "programs" / "mean_with_faults.py"
HOSTS = ("node-a", "node-b")


@dataclass
class Capture:
    up: bytearray = field(default_factory=bytearray)  # dialer -> controller
    down: bytearray = field(default_factory=bytearray)  # controller -> dialer

    @property
    def channel(self) -> Channel | None:
        return channel_for_prefix(bytes(self.up[:4])) if len(self.up) >= 4 else None


class RecordingForwarder:
    """A loopback TCP forwarder to the controller that keeps every byte in both directions."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.captures: list[Capture] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._forward, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        capture = Capture()
        self.captures.append(capture)
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter, record: bytearray) -> None:
            try:
                while chunk := await source.read(1 << 16):
                    record.extend(chunk)
                    sink.write(chunk)
                    await sink.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                sink.close()

        await asyncio.gather(
            pump(reader, upstream_writer, capture.up), pump(upstream_reader, writer, capture.down)
        )

    def close(self) -> None:
        self.server.close()


def decode_direction(
    data: bytes,
    salt: bytes,
    role: Role,
    own_nonce: bytes,
    channel: Channel,
    host_key: Callable[[Frame], bytes | None],
) -> list[Frame]:
    """Frames of one recorded direction, authenticated as the receiving side would: the first frame under
    the run's salt, the rest under the key `host_key(first frame)` names (None: the salt throughout).
    """
    receiver = FrameConnection(role, salt, nonce=own_nonce, channel=channel)
    receiver.receive_data(data)
    frames: list[Frame] = []
    while (event := receiver.next_event()) is not NEED_DATA:
        if not isinstance(event, Frame):
            break
        frames.append(event)
        if len(frames) == 1 and (key := host_key(event)) is not None:
            receiver.rekey(key)
    return frames


def host_keys(captures: list[Capture], salt: bytes, run_id: str) -> dict[str, bytes]:
    """Each host's key, derived the way its agent and the controller do from its recorded join exchange."""
    keys: dict[str, bytes] = {}
    for capture in captures:
        if capture.channel is not Channel.JOIN:
            continue
        dialer_nonce, listener_nonce = (
            bytes(capture.up[4 : 4 + NONCE_BYTES]),
            bytes(capture.down[:NONCE_BYTES]),
        )
        (hello, *_) = decode_direction(
            bytes(capture.up[4:]), salt, Role.LISTENER, listener_nonce, Channel.JOIN, lambda frame: None
        )
        message = hello.message()
        assert isinstance(message, Hello)
        keys[message.host] = derive_host_key(
            salt, host=message.host, run_id=run_id, dialer_nonce=dialer_nonce, listener_nonce=listener_nonce
        )
    return keys


def _relay_host(hello_frame: Frame) -> str:
    hello = hello_frame.message()
    assert isinstance(hello, RelayHello)
    return hello.host


def _always(key: bytes) -> Callable[[Frame], bytes | None]:
    """A `host_key` that names `key` whatever the frame."""
    return lambda frame: key


def data_plane_frames(
    captures: list[Capture], salt: bytes, run_id: str
) -> tuple[list[tuple[Frame, HostFrame]], list[tuple[Frame, Broadcast]]]:
    keys = host_keys(captures, salt, run_id)
    host_frames: list[tuple[Frame, HostFrame]] = []
    broadcasts: list[tuple[Frame, Broadcast]] = []
    for capture in captures:
        if capture.channel is not Channel.DATA:
            continue
        dialer_nonce, listener_nonce = (
            bytes(capture.up[4 : 4 + NONCE_BYTES]),
            bytes(capture.down[:NONCE_BYTES]),
        )
        up = decode_direction(
            bytes(capture.up[4:]),
            salt,
            Role.LISTENER,
            listener_nonce,
            Channel.DATA,
            lambda frame: keys[_relay_host(frame)],
        )
        for frame in up:
            message = frame.message()
            if isinstance(message, HostFrame):
                host_frames.append((frame, message))
        key = keys[_relay_host(up[0])]
        for frame in decode_direction(
            bytes(capture.down), salt, Role.DIALER, dialer_nonce, Channel.DATA, _always(key)
        ):
            message = frame.message()
            if isinstance(message, Broadcast):
                broadcasts.append((frame, message))
    return host_frames, broadcasts


async def run_audited_world(
    tmp_path: Path, extra: tuple[str, ...] = ()
) -> tuple[Controller, RecordingForwarder, bool, str]:
    token = secrets.token_hex(16)
    controller = Controller(
        ControllerOptions.model_validate(
            {
                "advertised_host": "127.0.0.1",
                "port": 0,
                "loopback_bind": True,
                "averaging": "cpu_sync",
                "join": JoinConfig(discovery=True, min_rank_start=2, target_ranks=2, token=token),
            }
        )
    )
    attach_data_plane(controller)
    _, port = await controller.start()
    forwarder = RecordingForwarder(port)
    forwarder_port = await forwarder.start()
    agents = []
    log = tmp_path / "agents.log"
    with log.open("w") as sink:
        for host in HOSTS:
            spec = AgentSpec(
                host=host,
                controller_host="127.0.0.1",
                controller_port=forwarder_port,
                salt_hex=token,
                devices=["cpu"],
                connect_attempts=5,
            )
            agents.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    str(PROGRAM),
                    "--values",
                    "4096",
                    "--audit-dir",
                    str(tmp_path),
                    *extra,
                    env={**child_env(), AGENT_ENV: encode_spec(spec)},
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )
        try:
            result = await asyncio.wait_for(controller.wait(), 180)
            for agent in agents:
                await asyncio.wait_for(agent.wait(), 60)
        finally:
            for agent in agents:
                if agent.returncode is None:
                    agent.kill()
                    await agent.wait()
            await controller.close()
            forwarder.close()
    return controller, forwarder, result.ok, log.read_text()


def test_the_controller_folds_exactly_the_modular_sum_of_ciphertexts_and_never_sees_a_key(
    tmp_path: Path,
) -> None:
    controller, forwarder, ok, output = asyncio.run(run_audited_world(tmp_path))
    assert ok, output
    assert output.count("encrypted mean PASS") == 2, output

    ciphertexts = [torch.load(tmp_path / f"rank{rank}-ciphertext.pt") for rank in range(2)]
    sums = [torch.load(tmp_path / f"rank{rank}-sum.pt") for rank in range(2)]
    updates = [torch.load(tmp_path / f"rank{rank}-update.pt") for rank in range(2)]
    secret = torch.load(tmp_path / "rank0-secret_key.pt")

    host_frames, broadcasts = data_plane_frames(forwarder.captures, controller.salt, controller.run_id)
    # The aggregation round is the one whose fold names a ciphertext prime (the first is a warm-up).
    aggregation = [(frame, message) for frame, message in host_frames if message.fold != "modular:2"]
    assert sorted(message.contributors[0] for _, message in aggregation) == [0, 1]
    (fold_spec,) = {message.fold for _, message in aggregation}
    # All the controller is given to fold with: the Q prime of the ciphertexts' single limb, nothing else.
    moduli = [int(text) for text in fold_spec.removeprefix("modular:").split(",")]
    assert fold_spec.startswith("modular:") and len(moduli) == 1 and moduli[0] > 2**49

    for frame, message in aggregation:
        (residues,) = decode_bundle(message.tensors, frame.tail)
        rank = message.contributors[0]
        assert residues.dtype == torch.int64 and tuple(residues.shape) == tuple(ciphertexts[rank].shape)
        assert bool(((residues >= 0) & (residues < moduli[0])).all())
        assert torch.equal(residues, ciphertexts[rank])  # exactly the rank's ciphertext, nothing else

    (round_number,) = {message.round for _, message in aggregation}
    finished = [(frame, message) for frame, message in broadcasts if message.round == round_number]
    assert len(finished) == 2  # one per relay
    expected = torch.remainder(ciphertexts[0] + ciphertexts[1], moduli[0])
    fold = ModularFold(moduli)
    reference = fold.identity((ciphertexts[0],))
    for ciphertext in ciphertexts:
        reference = fold.add(reference, (ciphertext,))
    assert torch.equal(reference[0], expected)
    for frame, broadcast in finished:
        (folded,) = decode_bundle(broadcast.tensors, frame.tail)
        assert broadcast.contributors == [0, 1]
        assert torch.equal(folded, expected)
    assert all(torch.equal(total, expected) for total in sums)

    # Nothing that crossed the controller, on any channel, carries the secret key or a plaintext update.
    every_byte = b"".join(bytes(capture.up) + bytes(capture.down) for capture in forwarder.captures)
    assert {capture.channel for capture in forwarder.captures} >= {
        Channel.JOIN,
        Channel.RENDEZVOUS,
        Channel.DATA,
    }
    secret_bytes = secret.contiguous().numpy().tobytes()
    assert secret_bytes[:256] not in every_byte and secret_bytes[-256:] not in every_byte
    for update in updates:
        assert update[:32].numpy().tobytes() not in every_byte
        assert update[:32].double().numpy().tobytes() not in every_byte


def test_threshold_mode_shows_the_controller_only_residues_shares_and_the_final_sum(tmp_path: Path) -> None:
    from fhelium.engine import CkksEngine
    from fhelium.multiparty import THRESHOLD_AGGREGATION, decode_contributions

    controller, forwarder, ok, output = asyncio.run(run_audited_world(tmp_path, ("--keys", "threshold")))
    assert ok, output
    assert output.count("encrypted mean PASS") == 2 and output.count("keys threshold") == 2, output

    def dumped(name: str) -> list[torch.Tensor]:
        return [torch.load(tmp_path / f"rank{rank}-{name}.pt") for rank in range(2)]

    key_shares, c1_frames, sums = dumped("public_key_share"), dumped("c1_ciphertext"), dumped("sum")
    contributions, secret_shares, updates = (
        dumped("decryption_share"),
        dumped("secret_share"),
        dumped("update"),
    )
    assert not (tmp_path / "rank0-secret_key.pt").exists()  # nobody holds the secret key
    # the fused protocol: only c1 leaves a rank (c0, its one-time pad, is zeroed in what the Program sums)
    assert all(bool((frame[0] == 0).all()) for frame in c1_frames)
    ciphertexts = dumped("ciphertext")
    assert all(torch.equal(frame[1], ct[1]) for frame, ct in zip(c1_frames, ciphertexts, strict=True))

    engine = CkksEngine(THRESHOLD_AGGREGATION.ckks)
    qp, q = list(engine.moduli), list(engine.moduli[:2])
    host_frames, broadcasts = data_plane_frames(forwarder.captures, controller.salt, controller.run_id)
    rounds: dict[int, list[tuple[int, torch.Tensor]]] = {}
    folds: dict[int, str] = {}
    for frame, message in host_frames:
        if message.fold == "modular:2":
            continue  # the warm-up round
        (residues,) = decode_bundle(message.tensors, frame.tail)
        rounds.setdefault(message.round, []).append((message.contributors[0], residues))
        folds[message.round] = message.fold
    # Five aggregation rounds, each with one frame per rank: key shares (QP), the c1-only ciphertexts,
    # the masked projections of the c1 components (the sum check), the decryption contributions
    # c0_i + h_i and their masked projections (Q).
    assert len(rounds) == 5 and all(
        sorted(rank for rank, _ in frames) == [0, 1] for frames in rounds.values()
    )
    key_round, ct_round, ct_check_round, share_round, share_check_round = sorted(rounds)
    assert folds[key_round] == "modular:" + ",".join(map(str, qp))
    assert {folds[number] for number in sorted(rounds)[1:]} == {"modular:" + ",".join(map(str, q))}
    # a check frame is one masked projection per slice and limb, [1, limbs, 1], uniform to the controller
    for number in (ct_check_round, share_check_round):
        for _, residues in rounds.pop(number):
            assert residues.shape == (1, 2, 1) and residues.dtype == torch.int64
    expected_by_round = {key_round: key_shares, ct_round: c1_frames, share_round: contributions}
    for round_number, frames in rounds.items():
        for rank, residues in frames:
            # exactly what the rank held (a key share, its c1, its contribution): residues, nothing else
            assert residues.dtype == torch.int64
            assert torch.equal(residues, expected_by_round[round_number][rank])
    folded: dict[int, torch.Tensor] = {}
    for frame, broadcast in broadcasts:
        if broadcast.round in rounds:
            (total,) = decode_bundle(broadcast.tensors, frame.tail)
            assert broadcast.contributors == [0, 1]
            moduli = qp if broadcast.round == key_round else q
            modulus = torch.tensor(moduli).reshape(-1, 1)
            parts = expected_by_round[broadcast.round]
            assert torch.equal(total, torch.remainder(parts[0] + parts[1], modulus))
            folded[broadcast.round] = total
    assert set(folded) == set(rounds)
    assert all(torch.equal(total, folded[ct_round]) for total in sums)

    # What the controller can compute from what it folded is the function's output, the sum, and no more:
    scale = THRESHOLD_AGGREGATION.message_scale
    output_sum = decode_contributions(engine, folded[share_round], (0, 1), scale).reshape(-1)[:4096]
    assert float((output_sum - (updates[0].double() + updates[1].double())).abs().max()) < 1e-5
    # ... while one rank's contribution alone is noise, not that rank's update.
    garbage = decode_contributions(engine, contributions[0], (0, 1), scale).reshape(-1)[:4096]
    assert float((garbage - updates[0].double()).abs().mean()) > 100

    every_byte = b"".join(bytes(capture.up) + bytes(capture.down) for capture in forwarder.captures)
    for secret in secret_shares:
        secret_bytes = secret.contiguous().numpy().tobytes()
        assert secret_bytes[:256] not in every_byte and secret_bytes[-256:] not in every_byte
    for update in updates:
        assert update[:32].numpy().tobytes() not in every_byte
        assert update[:32].double().numpy().tobytes() not in every_byte


def test_t_of_n_dealing_shows_the_controller_only_sealed_points(tmp_path: Path) -> None:
    from fhelium.multiparty.dealing import sealed_bytes

    extra = ("--keys", "threshold", "--threshold", "2")
    controller, forwarder, ok, output = asyncio.run(run_audited_world(tmp_path, extra))
    assert ok, output
    assert output.count("encrypted mean PASS") == 2, output
    assert output.count("t-out-of-N keys: threshold 2 of 2") == 2, output
    # what the controller's rendezvous store held (store values in the clear) and every byte on the wire
    values = dict(controller.store.state._data)
    dealt = {key: value for key, value in values.items() if "/shamir-points/" in key}
    assert len(dealt) == 2, sorted(values)
    assert all(len(value) == sealed_bytes(3, 8192) for value in dealt.values())  # one sealed point each
    every_byte = b"".join(bytes(capture.up) + bytes(capture.down) for capture in forwarder.captures)
    store_bytes = b"".join(values.values())
    for dealer, receiver in ((0, 1), (1, 0)):
        point = torch.load(tmp_path / f"rank{dealer}-shamir_point_for_{receiver}.pt")
        point = point.contiguous().numpy().tobytes()
        for offset in range(0, len(point) - 32, 4096):
            chunk = point[offset : offset + 32]
            assert chunk not in store_bytes and chunk not in every_byte, (dealer, receiver, offset)
