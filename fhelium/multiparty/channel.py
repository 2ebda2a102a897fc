"""Share channels: how the ranks of a threshold session exchange records and residues.

A channel moves two things: small records (seed commitments and reveals, key fingerprints) with
``all_gather_bytes``, and residues with ``all_reduce_residues`` (the per-limb modular sum of every
rank's key share or decryption share). ``ProcessGroupChannel`` runs over torch.distributed
(gloo/NCCL) with ``fhelium.distributed``'s collectives; the bridge's flodld_fhelium.relay has the
relay channel, where flodld's relays and controller fold the residues with the keyless modular fold.
A channel may also offer ``start_all_reduce_residues``, ``start_reduce_residues`` (sum delivered to
one rank) and ``all_gather_tensor`` (the process group does), and the member exchanges of t-out-of-N
(``gather_members``, ``sum_members``, ``all_gather_members``).

Nothing waits forever. Before every exchange each rank marks its arrival in the rendezvous store
and waits at most ``timeout_s`` for the others; a rank that left (after encrypting, say) is named:
``MissingSharesError: N-out-of-N decryption needs a decryption share from each of 3 ranks; rank(s)
[2] published none within 10s ...`` on every remaining rank.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

import fhelium.distributed as fdist
from fhelium.multiparty.encoding import reduce_sum_
from fhelium.multiparty.errors import MissingSharesError, MultipartyError

MAX_RECORD_BYTES = 64 * 1024
DEFAULT_TIMEOUT_S = 60.0
# the exchanges without which the sum cannot be decrypted (named as such when a rank is missing)
DECRYPTION_EXCHANGES = frozenset(
    {
        "decryption-shares",
        "decryption-agreement",
        "ciphertext-c1",
        "ciphertext-c1-check",
        "decryption-contributions",
        "decryption-contributions-check",
    }
)

# What each exchange carries, for the error naming the missing ranks.
EXCHANGES = {
    "seed-commitment": "a seed commitment",
    "seed-reveal": "a seed reveal",
    "key-share-commitment": "a key share commitment",
    "public-key-shares": "a public key share",
    "public-key-share-open": "its opened public key share",
    "public-key-fingerprint": "the collective key's fingerprint",
    "decryption-shares": "a decryption share",
    "decryption-agreement": "the digest of the ciphertext it is asked to decrypt",
    "challenge-keys": "its public key for the sum checks' challenge key",
    "challenge-seeds": "its challenge seeds sealed to every other rank",
    "challenge-confirm": "its confirmation of the challenge key",
    "ciphertext-c1-check": "its masked projection of its c1 (the check of the c1 sum)",
    "decryption-contributions-check": "its masked projection of its decryption contribution (the check "
    "of the summed contributions)",
    "ciphertext-c1": "its ciphertext's c1 component",
    "decryption-contributions": "its decryption share (c0_i + h_i)",
    "decoded-slots": "its slice of the decoded sum",
}


class MemberLostError(MultipartyError):
    """An exchange among a set of members (t-out-of-N) lacks some of them: they left or stalled.

    ``missing`` names them when the arrival marks told (empty when a collective broke mid-way: the
    next arrival tells who is gone).
    """

    def __init__(self, message: str, missing: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.missing = sorted(missing)


class ShareChannel(Protocol):
    rank: int
    world_size: int
    bytes_sent: int

    def all_gather_bytes(self, tag: str, data: bytes, max_bytes: int = ...) -> list[bytes]: ...

    def all_reduce_residues(
        self, tag: str, residues: torch.Tensor, moduli: Sequence[int]
    ) -> torch.Tensor: ...


def require_agreement(
    channel: ShareChannel, tag: str, record: bytes, refuse: Callable[[list[int]], Exception]
) -> None:
    """All-gather this rank's fixed-length ``record`` (a digest, a fingerprint); refused with
    ``refuse(ranks)`` naming, in rank order, the ranks whose record differs from this rank's.
    """
    records = channel.all_gather_bytes(tag, record, max_bytes=len(record))
    differing = [rank for rank, other in enumerate(records) if other != record]
    if differing:
        raise refuse(differing)


def missing_error(
    tag: str, world_size: int, missing: Sequence[int], waited: float | None
) -> MissingSharesError:
    tag = tag.partition(":")[0]  # "<exchange>:<round>" names one round's exchange of that kind
    what = EXCHANGES.get(tag, tag)
    within = f" within {waited:g}s" if waited is not None else ""
    if tag in DECRYPTION_EXCHANGES:
        head = f"N-out-of-N decryption needs a decryption share from each of {world_size} ranks"
        tail = ": without every share the sum cannot be decrypted (it stays noise)"
    else:
        head = f"collective key generation needs {what} from each of {world_size} ranks"
        tail = ""
    return MissingSharesError(
        f"{head}; rank(s) {sorted(missing)} published none{within} (the rank left or stalled){tail}. "
        "Restart the run with every rank",
        missing,
    )


def member_arrivals(
    gather_members: Callable[[str, bytes, Sequence[int]], dict[int, bytes]],
    tag: str,
    descriptor: bytes,
    members: Sequence[int],
    timeout_s: float,
) -> dict[int, bytes]:
    """Each member's arrival mark at the ``tag`` exchange (its payload's ``descriptor``), published and
    read with the channel's ``gather_members``; MemberLostError naming the members that did not arrive
    within ``timeout_s``.
    """
    arrived = gather_members(f"{tag}/arrive", descriptor, members)
    missing = [rank for rank in members if rank not in arrived]
    if missing:
        raise MemberLostError(
            f"rank(s) {missing} did not arrive at the {tag!r} exchange within {timeout_s:g}s", missing
        )
    return arrived


class ProcessGroupChannel:
    """Records by ``all_gather``, residues by one SUM ``all_reduce`` plus a per-limb remainder.

    ``store`` (default: the process group's rendezvous store) holds the arrival marks that bound
    every wait by ``timeout_s`` and name the ranks that never arrived.
    """

    def __init__(
        self,
        *,
        session: str = "",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        group: dist.ProcessGroup | None = None,
        store: Any = None,  # noqa: ANN401  a torch.distributed Store (not exported for type checkers)
    ) -> None:
        if not dist.is_initialized():
            raise MultipartyError("ProcessGroupChannel needs an initialised torch.distributed process group")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout_s = timeout_s
        self.session = session
        self.store = store if store is not None else dist.distributed_c10d._get_default_store()
        self.bytes_sent = 0
        self._round = 0

    def _arrive(self, tag: str, descriptor: dict[str, Any]) -> None:
        """Mark this rank's arrival at exchange ``tag`` and wait (bounded) for every other rank.

        The mark is the payload's descriptor (JSON: shape, dtype, moduli); every rank compares all
        of them before any payload moves, so a rank with other shapes or primes is named instead of
        hanging or corrupting the collective.
        """
        self._round += 1
        prefix = f"fhelium-multiparty/{self.session}/{self._round}-{tag}"
        keys = [f"{prefix}/{rank}" for rank in range(self.world_size)]
        mine = json.dumps(descriptor, sort_keys=True)
        try:
            self.store.set(keys[self.rank], mine)
            try:
                self.store.wait(keys, timedelta(seconds=self.timeout_s))
            except Exception as timeout:  # the store's timeout error type differs between stores
                pending = [rank for rank, key in enumerate(keys) if not self.store.check([key])]
                if not pending:
                    raise MultipartyError(
                        f"the rendezvous store failed during the {tag!r} exchange: {timeout}"
                    ) from timeout
                raise missing_error(tag, self.world_size, pending, self.timeout_s) from timeout
            multi_get = getattr(self.store, "multi_get", None)  # one round trip for every mark
            values = multi_get(keys) if multi_get is not None else [self.store.get(key) for key in keys]
            theirs = [bytes(value).decode(errors="replace") for value in values]
        except MultipartyError:
            raise
        except (RuntimeError, OSError, TimeoutError) as error:
            raise MultipartyError(
                f"the rendezvous store failed during the {tag!r} exchange ({error}); the rank hosting it "
                "probably left, so which ranks are missing cannot be told"
            ) from error
        differing = [rank for rank, other in enumerate(theirs) if other != mine]
        if differing:
            detail = "; ".join(f"rank {rank}: {theirs[rank][:200]}" for rank in differing)
            raise MultipartyError(
                f"the {tag!r} exchange was refused before any payload moved: rank(s) {differing} describe "
                f"another payload than rank {self.rank} ({mine[:200]}): {detail}"
            )

    def _collective_failed(self, tag: str, error: Exception) -> MultipartyError:
        return MultipartyError(
            f"the {tag!r} exchange broke after every rank arrived: a rank left mid-collective ({error})"
        )

    def all_gather_bytes(self, tag: str, data: bytes, max_bytes: int = MAX_RECORD_BYTES) -> list[bytes]:
        if len(data) > max_bytes:
            raise MultipartyError(f"a {tag!r} record of {len(data)} bytes exceeds the {max_bytes}-byte cap")
        self._arrive(tag, {"exchange": tag, "kind": "records", "cap": max_bytes})
        padded = torch.zeros(max_bytes + 8, dtype=torch.uint8)
        padded[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
        if data:
            padded[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        try:
            fdist.all_gather(gathered, padded, group=self.group)
        except RuntimeError as error:
            raise self._collective_failed(tag, error) from error
        self.bytes_sent += len(data)
        records = []
        for rank, raw in enumerate(gathered):
            length = int.from_bytes(raw[:8].numpy().tobytes(), "little")
            if length > max_bytes:
                raise MultipartyError(
                    f"rank {rank} announced a {length}-byte {tag!r} record (cap {max_bytes})"
                )
            records.append(raw[8 : 8 + length].numpy().tobytes())
        return records

    def all_reduce_residues(self, tag: str, residues: torch.Tensor, moduli: Sequence[int]) -> torch.Tensor:
        return self.start_all_reduce_residues(tag, residues.contiguous().clone(), moduli)()

    def _residue_arrival(self, tag: str, residues: torch.Tensor, moduli: Sequence[int]) -> torch.Tensor:
        if residues.size(-2) != len(moduli):
            raise MultipartyError(f"{tag}: {residues.size(-2)} limb rows but {len(moduli)} moduli")
        if self.world_size * max(moduli) >= 2**63:
            raise MultipartyError(
                f"{tag}: a SUM of {self.world_size} residues below {max(moduli)} could wrap int64"
            )
        self._arrive(
            tag,
            {
                "exchange": tag,
                "kind": "residues",
                "shape": list(residues.shape),
                "dtype": str(residues.dtype),
                "moduli": [str(q) for q in moduli],
            },
        )
        return torch.tensor(list(moduli), dtype=residues.dtype, device=residues.device).reshape(-1, 1)

    def start_all_reduce_residues(
        self, tag: str, residues: torch.Tensor, moduli: Sequence[int]
    ) -> Callable[[], torch.Tensor]:
        """``all_reduce_residues`` that returns at once; call the result for the sum.

        ``residues`` (contiguous) is summed in place: the caller hands it over. Every rank's
        arrival and descriptor are checked before the collective starts, as in the blocking form.
        """
        if not residues.is_contiguous():  # before the arrival: the others must not wait on this rank
            raise MultipartyError(f"{tag}: start_all_reduce_residues needs contiguous residues")
        q = self._residue_arrival(tag, residues, moduli)
        try:
            work = fdist.all_reduce(residues, op=fdist.ReduceOp.SUM, group=self.group, async_op=True)
        except RuntimeError as error:
            raise self._collective_failed(tag, error) from error

        def finish() -> torch.Tensor:
            try:
                work.wait()
            except RuntimeError as error:
                raise self._collective_failed(tag, error) from error
            self.bytes_sent += residues.numel() * residues.element_size()
            return reduce_sum_(residues, q, self.world_size)

        return finish

    def start_reduce_residues(
        self, tag: str, residues: torch.Tensor, moduli: Sequence[int], dst: int
    ) -> Callable[[], torch.Tensor | None]:
        """The per-limb modular sum delivered to group rank ``dst`` only; returns at once.

        Call the result to wait: the sum on ``dst``, None elsewhere. ``residues`` (contiguous) is
        handed over (the reduction works in place).
        """
        if not residues.is_contiguous():  # before the arrival: the others must not wait on this rank
            raise MultipartyError(f"{tag}: start_reduce_residues needs contiguous residues")
        q = self._residue_arrival(tag, residues, moduli)
        target = dst if self.group is None else dist.get_global_rank(self.group, dst)
        try:
            work = fdist.reduce(residues, target, op=fdist.ReduceOp.SUM, group=self.group, async_op=True)
        except RuntimeError as error:
            raise self._collective_failed(tag, error) from error

        def finish() -> torch.Tensor | None:
            try:
                work.wait()
            except RuntimeError as error:
                raise self._collective_failed(tag, error) from error
            self.bytes_sent += residues.numel() * residues.element_size()
            return reduce_sum_(residues, q, self.world_size) if self.rank == dst else None

        return finish

    def all_gather_tensor(self, tag: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape and dtype on every rank, checked before it moves)."""
        self._arrive(
            tag, {"exchange": tag, "kind": "tensor", "shape": list(tensor.shape), "dtype": str(tensor.dtype)}
        )
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        try:
            fdist.all_gather(gathered, tensor.contiguous(), group=self.group)
        except RuntimeError as error:
            raise self._collective_failed(tag, error) from error
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return gathered


    # ------------------------------------------------------------------ members (t-out-of-N)
    def gather_members(
        self, tag: str, data: bytes, members: Sequence[int], max_bytes: int = MAX_RECORD_BYTES
    ) -> dict[int, bytes]:
        """The records of the ``members`` that published one within ``timeout_s`` (this rank's included).

        Through the rendezvous store, never a collective: a member that left is simply absent from
        the answer (after the timeout), so the caller can go on without it.
        """
        if len(data) > max_bytes:
            raise MultipartyError(f"a {tag!r} record of {len(data)} bytes exceeds the {max_bytes}-byte cap")
        return gather_from_store(
            self.store, f"fhelium-multiparty/{self.session}/members/{tag}", self.rank, data, members,
            self.timeout_s, max_bytes,
        )

    def _members_group(self, members: Sequence[int]) -> dist.ProcessGroup:
        """A gloo group of exactly ``members`` (made once per set, by them alone), bounded by the timeout."""
        key = tuple(sorted(members))
        groups: dict[tuple[int, ...], dist.ProcessGroup] = self.__dict__.setdefault("_member_groups", {})
        if key not in groups:
            ranks = list(key) if self.group is None else [dist.get_global_rank(self.group, r) for r in key]
            try:
                group = dist.new_group(
                    ranks, timeout=timedelta(seconds=self.timeout_s), use_local_synchronization=True
                )
            except RuntimeError as error:
                raise MemberLostError(f"a group of ranks {list(key)} could not be formed: {error}") from error
            if group is None:
                raise MultipartyError(f"rank {self.rank} is not among the members {list(key)}")
            groups[key] = group
        return groups[key]

    def prepare_members(self, members: Sequence[int]) -> None:
        """Form the group of ``members`` now (outside any timed phase)."""
        self._members_group(members)

    def sum_members(
        self, tag: str, residues: torch.Tensor, moduli: Sequence[int], members: Sequence[int]
    ) -> torch.Tensor:
        """The per-limb modular sum of the ``members``' residues, on each of them.

        Every member marks its arrival with the payload's descriptor first (bounded by ``timeout_s``):
        one that never arrives raises ``MemberLostError`` naming it, before any payload moves; a
        collective that breaks (a member killed mid-way) raises it too, within the group's timeout.
        """
        return self.start_sum_members(tag, residues, moduli, members)()

    def start_sum_members(
        self, tag: str, residues: torch.Tensor, moduli: Sequence[int], members: Sequence[int]
    ) -> Callable[[], torch.Tensor]:
        """``sum_members`` that returns once every member arrived; call the result for the sum.

        The arrival (and ``MemberLostError`` for a member that never came) happens here; the
        collective runs in the background on a copy (``residues`` stays the caller's), and a
        collective that breaks raises ``MemberLostError`` from the result.
        """
        members = sorted(members)
        descriptor = json.dumps(
            {"shape": list(residues.shape), "moduli": [str(q) for q in moduli]}, sort_keys=True
        ).encode()
        arrived = member_arrivals(self.gather_members, tag, descriptor, members, self.timeout_s)
        differing = [rank for rank, other in arrived.items() if other != descriptor]
        if differing:
            raise MultipartyError(
                f"the {tag!r} exchange was refused before any payload moved: rank(s) {differing} describe "
                "another payload"
            )
        summed = residues.contiguous().clone()
        work = None
        if len(members) > 1:
            if len(members) * max(moduli) >= 2**63:
                raise MultipartyError(f"{tag}: a SUM of {len(members)} residues could wrap int64")
            try:
                work = fdist.all_reduce(
                    summed, op=fdist.ReduceOp.SUM, group=self._members_group(members), async_op=True
                )
            except RuntimeError as error:
                raise self._member_lost(tag, members, error) from error

        def finish() -> torch.Tensor:
            if work is not None:
                try:
                    work.wait()
                except RuntimeError as error:
                    raise self._member_lost(tag, members, error) from error
                q = torch.tensor(list(moduli), dtype=summed.dtype).reshape(-1, 1)
                reduce_sum_(summed, q, len(members))
            self.bytes_sent += residues.numel() * residues.element_size()
            return summed

        return finish

    @staticmethod
    def _member_lost(tag: str, members: Sequence[int], error: Exception) -> MemberLostError:
        return MemberLostError(
            f"the {tag!r} exchange among ranks {list(members)} broke: a member left mid-way ({error})"
        )


    def all_gather_members(
        self, tag: str, tensor: torch.Tensor, members: Sequence[int]
    ) -> list[torch.Tensor]:
        """Every member's ``tensor`` (same shape and dtype on each), over the group of ``members``.

        ``MemberLostError`` when a member never arrives or the collective breaks.
        """
        members = sorted(members)
        descriptor = json.dumps({"shape": list(tensor.shape), "dtype": str(tensor.dtype)}).encode()
        arrived = self.gather_members(f"{tag}/arrive", descriptor, members)
        missing = [rank for rank in members if rank not in arrived]
        if missing or any(other != descriptor for other in arrived.values()):
            raise MemberLostError(
                f"the {tag!r} exchange lacks rank(s) {missing} or their shapes differ", missing
            )
        gathered = [torch.empty_like(tensor) for _ in members]
        try:
            fdist.all_gather(gathered, tensor.contiguous(), group=self._members_group(members))
        except RuntimeError as error:
            raise MemberLostError(f"the {tag!r} exchange among ranks {members} broke ({error})") from error
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return gathered


def gather_from_store(
    store: Any,  # noqa: ANN401  a torch.distributed Store (or flodld's ControllerStore)
    prefix: str,
    rank: int,
    data: bytes,
    members: Sequence[int],
    timeout_s: float,
    max_bytes: int,
) -> dict[int, bytes]:
    """Publish ``data`` under ``prefix/rank`` and read every member's record present within ``timeout_s``."""
    keys = {member: f"{prefix}/{member}" for member in sorted(members)}
    try:
        store.set(keys[rank], data)
        try:
            store.wait(list(keys.values()), timedelta(seconds=timeout_s))
        except Exception:
            pass
        records = {member: bytes(store.get(key)) for member, key in keys.items() if store.check([key])}
    except (RuntimeError, OSError, TimeoutError) as error:
        raise MultipartyError(
            f"the rendezvous store failed during the {prefix!r} exchange ({error}); the rank or the process "
            "hosting it probably left"
        ) from error
    for member, record in records.items():
        if len(record) > max_bytes:
            raise MultipartyError(f"rank {member} published a {len(record)}-byte record (cap {max_bytes})")
    return records


__all__ = [
    "DECRYPTION_EXCHANGES",
    "DEFAULT_TIMEOUT_S",
    "EXCHANGES",
    "MAX_RECORD_BYTES",
    "MemberLostError",
    "ProcessGroupChannel",
    "ShareChannel",
    "gather_from_store",
    "member_arrivals",
    "missing_error",
    "require_agreement",
]
