"""The agent's side of the join link: dial, Hello, Accept/Reject, then WorldFormed or Abort.

Every way this can fail maps to an exit class: TRANSIENT (1: dialing again later may work) or
PERMANENT (2: retrying cannot fix it — wrong token, incompatible build), so `fdl join --persist`
and systemd's RestartPreventExitStatus=2 know when to stop.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import os
import stat
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum

from flodld.agent.spawn import program_argv
from flodld.agent.spec import AgentSpec, device_label
from flodld.net.addresses import is_private_address
from flodld.net.keepalive import keep_alive
from flodld.net.stream import CONNECT_BACKOFF_SECS, ConnectError, FramedStream, connect_with_retry
from flodld.net.timeouts import scaled
from flodld.wire.errors import WireError
from flodld.wire.join import (
    JOIN_PROTOCOL_VERSION,
    Abort,
    Accept,
    Hello,
    Reform,
    Reject,
    RelaySpec,
    Stopped,
    WorldEnvelope,
    WorldFormed,
)
from flodld.wire.magic import Channel
from flodld.wire.salt import OPEN_ADMISSION_KEY, salt_from_hex

PROTOCOL_VERSION = JOIN_PROTOCOL_VERSION  # the join messages' version (flodld.wire.join), not the frames'
REPLY_TIMEOUT_SECS = 30.0
FORMATION_WAIT_MARGIN_SECS = 30.0
REFORMATION_WAIT_SECS = 7 * 86400.0  # a kept host waits for the next attempt while its link lives
# A host's previous join link, closed on its own side (its agent killed, or given up during a partition), can
# still be open on the controller's: the controller learns of the close when the FIN arrives, after a
# partition at TCP's next retransmission, a moment after this host's next hello. A hello refused as
# `duplicate_host` is dialed again every DUPLICATE_RETRY_SECS for up to DUPLICATE_RETRY_BOUND_SECS (scaled)
# in this agent, instead of ending it: `fdl join --persist` would back off and start a fresh agent.
DUPLICATE_RETRY_SECS = 0.1
DUPLICATE_RETRY_BOUND_SECS = 3.0

# Reject codes that no amount of re-dialing fixes: this box's build or config is incompatible.
PERMANENT_REJECT_CODES = frozenset({
    "protocol_version",
    "unknown_host",
    "empty_devices",
    "too_many_devices",
    "declared_devices",
    "vendor_mix",
    "dataset_mismatch",
    "model_mismatch",
    "nccl_skew",
    "bad_payload",
    "expected_hello",
})


class ExitClass(IntEnum):
    DONE = 0
    TRANSIENT = 1
    PERMANENT = 2


class JoinFailed(Exception):
    """The join did not reach a formed world; `exit_class` says whether retrying can help."""

    def __init__(self, message: str, exit_class: ExitClass) -> None:
        super().__init__(message)
        self.exit_class = exit_class


class DuplicateHost(JoinFailed):
    """The controller refused the hello as `duplicate_host`: this host name's join link is open there."""


@dataclass
class Joined:
    stream: FramedStream
    accept: Accept
    formed: WorldFormed
    salt: bytes


def loaded_nccl_version() -> str | None:
    """The NCCL torch loads here ("2.27.5"), or None without CUDA or an NCCL-enabled build."""
    import torch  # a GPU agent has imported it already, to count its devices
    import torch.distributed as dist

    if not torch.cuda.is_available() or not dist.is_nccl_available():
        return None
    return ".".join(str(part) for part in torch.cuda.nccl.version())  # type: ignore[no-untyped-call]  # torch stub


MAX_PROGRAM_BYTES = 64 << 20
"""A program file larger than this is not hashed (it is no training script; the hello carries no
model signature then)."""


def program_file(program: Sequence[str] | None) -> str | None:
    """The Python file this host's ranks run: the rank command line's script (`python train.py ...`),
    or, without a program in the spec, the script of the process that started the agent; None for
    `python -m module`, a binary (`--no-python`) or anything else without a `.py` file.
    """
    argv = list(program) if program else program_argv()
    if len(argv) >= 2 and argv[1].endswith(".py"):
        return argv[1]
    return None


def program_signature(program: Sequence[str] | None) -> str | None:
    """The model signature this host sends: SHA-256 (hex) of the bytes of the Python file its ranks run.

    Two hosts with different versions of train.py (a stale copy, a wrong --bin) disagree on it and the
    ledger refuses the later one (`model_mismatch`) before any rank starts, instead of the ranks failing
    in the first collective or training silently different models. None (no check) when there is no
    such file, it cannot be read, or it is over MAX_PROGRAM_BYTES. The arguments are left out: hosts
    may pass their own (data paths).
    """
    path = program_file(program)
    if path is None:
        return None
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_PROGRAM_BYTES:
                return None
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    except OSError:
        return None
    return digest.hexdigest()


def build_hello(spec: AgentSpec, devices: list[str]) -> Hello:
    """This host's hello. A GPU host also reports its NCCL version, which the ledger holds to the
    cohort's major.minor (`nccl_skew`); CPU ranks never load NCCL, so theirs says nothing. Every host
    reports its model signature (`program_signature`), which the ledger holds to the cohort's
    (`model_mismatch`).
    """
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "unknown"
    gpu = any(device.startswith("cuda") for device in devices)
    return Hello(
        host=spec.host,
        devices=devices,
        device_labels=[device_label(device) for device in devices],
        variant="cuda" if gpu else "cpu",
        torch_version=torch_version,
        protocol_version=PROTOCOL_VERSION,
        run_id=spec.run_id,
        averaging=spec.averaging,
        nccl_version=loaded_nccl_version() if gpu else None,
        model_sig=program_signature(spec.program),
    )


def rewrite_controller_address(formed: WorldFormed, host: str, port: int) -> WorldFormed:
    """The formed world with the controller address replaced by the one this agent's join used.

    The controller writes addresses from its own view of the network; behind a tunnel on an
    ephemeral port or a NAT that view is wrong, while the road this join took is known to work.
    """
    envelope = formed.envelope.model_copy(update={"controller_host": host, "controller_port": port})
    relay = formed.relay
    if relay is not None:
        relay = relay.model_copy(update={"data_port": port, "control_port": port})
    return WorldFormed(envelope=WorldEnvelope.model_validate(envelope.model_dump()),
                       relay=None if relay is None else RelaySpec.model_validate(relay.model_dump()))


def cleartext_warning(peer: str, where: str, *, pre_shared: bool) -> str | None:
    """The warning for a join link to a controller outside private address space (None inside it)."""
    if is_private_address(peer):
        return None
    salt = "" if pre_shared else (
        " Under open admission the session salt crossed the path in the join's Accept, so whoever watched it "
        "can decrypt this run's links too."
    )
    return (
        f"WARNING: controller {where} (peer {peer}) is outside every private address range. flodld's own "
        "links to it are encrypted (AEAD keyed from the run salt), but the process group's traffic between "
        f"ranks (gloo/NCCL) is CLEARTEXT: anyone on the path can read the tensors the ranks exchange.{salt} "
        "Dial through `fdl join --ssh`, a tunnel or an encrypted overlay (WireGuard/VPN)"
    )


def _stderr(message: str) -> None:
    sys.stderr.write(f"flodld agent: {message}\n")
    sys.stderr.flush()


async def join_world(spec: AgentSpec, hello: Hello, *, warn: Callable[[str], None] = _stderr) -> Joined:
    """Dial, get admitted, wait for formation; raises JoinFailed with an actionable message.

    `warn` receives the cleartext warning when the controller's address is public (once). A hello refused
    as `duplicate_host` is dialed again for a moment (DUPLICATE_RETRY_BOUND_SECS): the host's own previous
    link may not have closed on the controller's side yet.
    """
    said: set[str] = set()

    def warn_once(message: str) -> None:
        if message not in said:
            said.add(message)
            warn(message)

    deadline = time.monotonic() + scaled(DUPLICATE_RETRY_BOUND_SECS)
    while True:
        try:
            return await _join_once(spec, hello, warn_once)
        except DuplicateHost:
            if time.monotonic() + DUPLICATE_RETRY_SECS > deadline:
                raise
        await asyncio.sleep(DUPLICATE_RETRY_SECS)


async def _join_once(spec: AgentSpec, hello: Hello, warn: Callable[[str], None]) -> Joined:
    pre_shared = spec.salt_hex is not None
    key = salt_from_hex(spec.salt_hex) if spec.salt_hex is not None else OPEN_ADMISSION_KEY
    where = f"{spec.controller_host}:{spec.controller_port}"
    try:
        stream = await connect_with_retry(
            spec.controller_host,
            spec.controller_port,
            Channel.JOIN,
            key,
            what=f"agent {spec.host!r} join",
            attempts=spec.connect_attempts,
            on_first_failure=lambda error, left: warn(
                f"connect to {where} failed ({error!r}); retrying every {CONNECT_BACKOFF_SECS:g}s for up to "
                f"{left:.0f}s more — is a controller listening there with its join window open?"
            ),
        )
    except ConnectError as error:
        raise JoinFailed(
            f"{error} — is a controller running there with its join window open?", ExitClass.TRANSIENT
        ) from None
    keep_alive(stream.writer)  # a controller whose network vanished must end the read, not hang it
    peer = stream.writer.get_extra_info("peername")
    if peer:
        warning = cleartext_warning(str(peer[0]), where, pre_shared=pre_shared)
        if warning is not None:
            warn(warning)
    try:
        await stream.send(hello)
        reply = await _receive(stream, scaled(REPLY_TIMEOUT_SECS), where, pre_shared, before_reply=True)
        if isinstance(reply, Reject):
            exit_class = ExitClass.PERMANENT if reply.code in PERMANENT_REJECT_CODES else ExitClass.TRANSIENT
            failure = DuplicateHost if reply.code == "duplicate_host" else JoinFailed
            raise failure(
                f"controller {where} REJECTED host {spec.host!r} [{reply.code}]: {reply.reason}", exit_class
            )
        if not isinstance(reply, Accept):
            raise JoinFailed(
                f"controller {where} answered the hello with {type(reply).__name__}, "
                "not Accept or Reject — protocol violation",
                ExitClass.PERMANENT,
            )
        salt = key
        if not pre_shared:
            if reply.salt_hex is None:
                raise JoinFailed(
                    f"controller {where} accepted under open admission but sent no session salt; "
                    "it expects a pre-shared token — pass --token (the run's controller.join.token)",
                    ExitClass.PERMANENT,
                )
            salt = salt_from_hex(reply.salt_hex)
        rekey = None if pre_shared else salt
        formed = await _await_formation(stream, reply, where, hello, pre_shared=pre_shared, rekey=rekey)
        if formed is None:  # it failed before it formed and the run restarts: stay linked
            return await rejoin(stream, spec, hello)
    except BaseException:
        stream.close()
        raise
    return Joined(
        stream, reply, rewrite_controller_address(formed, spec.controller_host, spec.controller_port), salt
    )


async def _await_formation(
    stream: FramedStream, accept: Accept, where: str, hello: Hello, *, pre_shared: bool, rekey: bytes | None
) -> WorldFormed | None:
    """After `accept`: the world it formed for `hello`'s devices, or None when the controller sent `Reform`
    instead (answered here with `Stopped`: the run restarts and this link stays for the next attempt).
    Raises JoinFailed on Abort, on any other message, or on a rank count other than the devices offered.
    `rekey`: the salt the Accept carried (open admission, or the next attempt's), which the link's keys
    change to first.
    """
    if rekey is not None:
        stream.rekey(rekey)
    wait = accept.formation_wait_secs + FORMATION_WAIT_MARGIN_SECS
    formed = await _receive(stream, wait, where, pre_shared, before_reply=False)
    if isinstance(formed, Reform):
        await stream.send(Stopped())
        return None
    if isinstance(formed, Abort):
        raise JoinFailed(
            f"controller {where} aborted the run before it formed: {formed.reason}", ExitClass.TRANSIENT
        )
    if not isinstance(formed, WorldFormed):
        raise JoinFailed(
            f"expected WorldFormed or Abort, got {type(formed).__name__} — protocol violation",
            ExitClass.PERMANENT,
        )
    if len(formed.envelope.ranks) != len(hello.devices):
        raise JoinFailed(
            f"controller assigned {len(formed.envelope.ranks)} rank(s) for {len(hello.devices)} "
            "device(s) — protocol violation",
            ExitClass.PERMANENT,
        )
    return formed


async def _receive(
    stream: FramedStream, timeout: float, where: str, pre_shared: bool, *, before_reply: bool
) -> object:
    try:
        return (await stream.recv(timeout)).message()
    except EOFError:
        if before_reply and pre_shared:
            raise JoinFailed(
                f"controller {where} closed before replying — under pre-shared admission this usually means "
                "a token mismatch: check --token against the run's controller.join.token",
                ExitClass.PERMANENT,
            ) from None
        if before_reply:
            # An open-admission hello is tagged with the public key; a credential-checked controller drops
            # it without a word (bad_tag). Re-dialing without a token can never succeed.
            raise JoinFailed(
                f"controller {where} closed before replying to a join without a token — it checks "
                "credentials (controller.join.token): pass the run's token with --token HEX, --token - "
                "(stdin) or FDL_JOIN_TOKEN",
                ExitClass.PERMANENT,
            ) from None
        what = "before the world formed"
        raise JoinFailed(f"controller {where} closed the join link {what}", ExitClass.TRANSIENT) from None
    except TimeoutError:
        what = "no reply to the hello" if before_reply else "the world did not form"
        raise JoinFailed(f"controller {where}: {what} within {timeout:g}s", ExitClass.TRANSIENT) from None
    except (WireError, OSError) as error:
        raise JoinFailed(f"join link to {where} failed: {error}", ExitClass.TRANSIENT) from None


async def rejoin(stream: FramedStream, spec: AgentSpec, hello: Hello) -> Joined:
    """After a `Reform` (answered with `Stopped`): wait on the same link for the next attempt's `Accept`
    (its salt, under this attempt's keys; both sides rekey to it) and `WorldFormed` (docs/restarts.md).
    Raises JoinFailed when the controller ends the host instead (Abort, Reject, the link closed).
    """
    where = f"{spec.controller_host}:{spec.controller_port}"
    try:
        while True:
            reply = await _receive(stream, REFORMATION_WAIT_SECS, where, True, before_reply=False)
            if isinstance(reply, Abort):
                raise JoinFailed(f"controller {where} ended the run: {reply.reason}", ExitClass.TRANSIENT)
            if isinstance(reply, Reject):
                permanent = reply.code in PERMANENT_REJECT_CODES
                raise JoinFailed(
                    f"controller {where} did not re-admit host {spec.host!r} [{reply.code}]: {reply.reason}",
                    ExitClass.PERMANENT if permanent else ExitClass.TRANSIENT,
                )
            if not isinstance(reply, Accept) or reply.salt_hex is None:
                raise JoinFailed(
                    f"controller {where} answered Stopped with {type(reply).__name__}, not an Accept "
                    "carrying the next attempt's salt — protocol violation",
                    ExitClass.PERMANENT,
                )
            salt = salt_from_hex(reply.salt_hex)
            formed = await _await_formation(stream, reply, where, hello, pre_shared=True, rekey=salt)
            if formed is not None:
                break
            # That attempt failed before it formed, and another follows.
    except BaseException:
        stream.close()
        raise
    return Joined(
        stream, reply, rewrite_controller_address(formed, spec.controller_host, spec.controller_port), salt
    )
