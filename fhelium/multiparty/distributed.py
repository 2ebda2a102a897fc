"""The threshold protocol across processes: a session over a ``ShareChannel``.

A channel moves two things: small records (seed commitments and reveals, key fingerprints) with
``all_gather_bytes``, and residues with ``all_reduce_residues`` (the per-limb modular sum of every
rank's key share or decryption share). ``ProcessGroupChannel`` runs over torch.distributed
(gloo/NCCL) with ``fhelium.distributed``'s collectives; the bridge's flodld_fhelium.relay has the
relay channel, where flodld's relays and controller fold the residues with the keyless modular fold.
A channel may also offer ``start_all_reduce_residues``, ``start_reduce_residues`` (sum delivered to
one rank) and ``all_gather_tensor`` (the process group does); ``ThresholdSession.aggregate`` then
pipelines the fused protocol per slice of rows, and falls back to the two blocking methods otherwise.

Nothing waits forever. Before every exchange each rank marks its arrival in the rendezvous store
and waits at most ``timeout_s`` for the others; a rank that left (after encrypting, say) is named:
``MissingSharesError: N-out-of-N decryption needs a decryption share from each of 3 ranks; rank(s)
[2] published none within 10s ...`` on every remaining rank.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

import fhelium.distributed as fdist
from fhelium.core import Ciphertext, PublicKey
from fhelium.engine import modular as mod
from fhelium.engine.sampling import RandomSource
from fhelium.multiparty.dealing import DealingIdentity
from fhelium.multiparty.parameters import THRESHOLD_AGGREGATION, ThresholdParameters
from fhelium.multiparty.protocol import (
    MissingSharesError,
    MultipartyError,
    ThresholdParty,
    combine_decryption,
    decode_contributions,
    reduce_sum_,
)
from fhelium.multiparty.values import PublicKeyShare, SeedCommitment, SeedReveal
from fhelium.serialization import value_from_bytes, value_to_bytes

MAX_RECORD_BYTES = 64 * 1024
MAX_KEY_SHARE_BYTES = 1 << 20  # a serialized PublicKeyShare (3 primes x 8192 x 8 bytes + header) fits
KEY_SHARE_COMMITMENT_DOMAIN = b"fhelium.multiparty.key-share-commitment.v1"
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
        "decryption-contributions-digest",
        "decryption-contributions-verdict",
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
    "ciphertext-c1-check": "its check of the c1 sum",
    "decryption-contributions-check": "its check of the summed decryption contributions",
    "decryption-contributions-digest": "the digest of its slice's summed decryption contributions",
    "decryption-contributions-verdict": "its verdict on its slice's summed decryption contributions",
    "ciphertext-c1": "its ciphertext's c1 component",
    "decryption-contributions": "its decryption share (c0_i + h_i)",
    "decoded-slots": "its slice of the decoded sum",
}


SUM_CHECK_DOMAIN = b"fhelium.multiparty.sum-check.v1"
DECRYPT_AGREEMENT_DOMAIN = b"fhelium.multiparty.decrypt-agreement.v1"
DIGEST_BYTES = 32


class SumCheckError(MultipartyError):
    """A sum the channel (the fold) returned is not the sum of this round's inputs: refused.

    ``round`` is the session's aggregation round; ``ranks`` the ranks that were handed another sum
    than this one (empty when every rank got the same wrong sum).
    """

    def __init__(self, message: str, round_number: int, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.round = round_number
        self.ranks = sorted(ranks)


class MemberLostError(MultipartyError):
    """An exchange among a set of members (t-out-of-N) lacks some of them: they left or stalled.

    ``missing`` names them when the arrival marks told (empty when a collective broke mid-way: the
    next arrival tells who is gone).
    """

    def __init__(self, message: str, missing: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.missing = sorted(missing)


CHECK_BLOCK_BYTES = 1 << 19  # one block of a sum is range-checked and hashed while it is in cache


def sum_digest(session: str, round_number: int, what: str, part: int, summed: torch.Tensor) -> bytes:
    """SHA-256 of a summed residue tensor bound to the session, the round, the exchange and the slice.

    Binding the round makes an earlier round's sum another digest (and another challenge) than this
    round's, even when its residues were replayed bit for bit.
    """
    digest, _ = checked_sum_digest(session, round_number, what, part, summed, None)
    return digest


def checked_sum_digest(
    session: str, round_number: int, what: str, part: int, summed: torch.Tensor, q: torch.Tensor | None
) -> tuple[bytes, bool]:
    """``sum_digest`` and, with ``q``, whether every residue lies in [0, q_limb) (else True).

    One pass over the sum: each block of ``CHECK_BLOCK_BYTES`` is range-checked and hashed while it
    is in cache (the same bytes, in the same order, as hashing the whole tensor at once).
    """
    header = f"{len(session)}:{session}/{round_number}/{what}/{part}/{tuple(summed.shape)}".encode()
    digest = hashlib.sha256(SUM_CHECK_DOMAIN + len(header).to_bytes(4, "big") + header)
    residues = summed.contiguous().cpu()
    bad = False
    if residues.ndim < 2 or residues.numel() == 0:
        digest.update(residues.numpy().data)
        return digest.digest(), q is not None and residues.numel() > 0 and out_of_range(residues, q)
    rows = residues.reshape(-1, residues.size(-2), residues.size(-1))
    step = max(1, CHECK_BLOCK_BYTES // (rows[0].numel() * rows.element_size()))
    for start in range(0, rows.size(0), step):
        block = rows[start : start + step]
        if q is not None and not bad:
            bad = out_of_range(block, q)
        digest.update(block.numpy().data)  # the residues in place, no bytes copy
    return digest.digest(), bad


def out_of_range(residues: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether any residue of ``[..., limbs, N]`` lies outside [0, q_limb).

    One min/max pass over the whole tensor against the smallest prime settles almost every sum;
    only when a residue lies between the smallest and its own limb's prime are the limbs checked
    one by one.
    """
    moduli = q.reshape(-1)
    low, high = (int(bound) for bound in torch.aminmax(residues))
    if low < 0:
        return True
    if high < int(moduli.min()):
        return False
    _, highs = torch.aminmax(residues.reshape(-1, residues.size(-2), residues.size(-1)), dim=-1)
    return bool((highs >= moduli.to(highs.device)).any())


def projection_weights(digest: bytes, moduli: torch.Tensor, rows: int) -> torch.Tensor:
    """The Fiat–Shamir challenge of ``digest``: one uniform multiplier per row and limb, ``[rows, limbs, 1]``.

    Expanded with the engine's ChaCha20 ``RandomSource`` from the digest of the sum being checked, so
    the fold cannot know the multipliers before it has committed to the sum (every rank derives the
    same ones from the same sum).
    """
    q = moduli.reshape(-1, 1).cpu()
    weights = RandomSource(digest, purpose="general").uniform_below(q, (q.size(0), rows))
    return weights.t().contiguous().unsqueeze(-1).to(moduli.device)


def project(
    residues: torch.Tensor, weights: torch.Tensor, q: torch.Tensor, q_inverse: torch.Tensor
) -> torch.Tensor:
    """Σ_r weights[r]·residues[r] mod q: ``[limbs, N]`` from ``[rows, limbs, N]`` residues, exact.

    One pass over the rows (the native fused multiply-add-mod where it serves, else mul_mod and
    add_mod): the cost of one modular product per residue.
    """
    rows = residues.reshape(-1, residues.size(-2), residues.size(-1))
    total = torch.zeros(rows.shape[1:], dtype=torch.int64, device=rows.device)
    if mod._native_elementwise(rows, weights, q):
        from fhelium import native

        for row, weight in zip(rows, weights, strict=True):
            total = native.mul_add_mod(row, weight, total, q)
        return total
    for row, weight in zip(rows, weights, strict=True):
        mod.add_mod_(total, mod.mul_mod(row, weight, q, q_inverse), q)
    return total


class ShareChannel(Protocol):
    rank: int
    world_size: int
    bytes_sent: int

    def all_gather_bytes(self, tag: str, data: bytes, max_bytes: int = ...) -> list[bytes]: ...

    def all_reduce_residues(
        self, tag: str, residues: torch.Tensor, moduli: Sequence[int]
    ) -> torch.Tensor: ...


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
            theirs = [bytes(self.store.get(key)).decode(errors="replace") for key in keys]
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
        members = sorted(members)
        descriptor = json.dumps(
            {"shape": list(residues.shape), "moduli": [str(q) for q in moduli]}, sort_keys=True
        ).encode()
        arrived = self.gather_members(f"{tag}/arrive", descriptor, members)
        missing = [rank for rank in members if rank not in arrived]
        if missing:
            raise MemberLostError(
                f"rank(s) {missing} did not arrive at the {tag!r} exchange within {self.timeout_s:g}s",
                missing,
            )
        differing = [rank for rank, other in arrived.items() if other != descriptor]
        if differing:
            raise MultipartyError(
                f"the {tag!r} exchange was refused before any payload moved: rank(s) {differing} describe "
                "another payload"
            )
        summed = residues.contiguous().clone()
        if len(members) > 1:
            if len(members) * max(moduli) >= 2**63:
                raise MultipartyError(f"{tag}: a SUM of {len(members)} residues could wrap int64")
            try:
                fdist.all_reduce(summed, op=fdist.ReduceOp.SUM, group=self._members_group(members))
            except RuntimeError as error:
                raise MemberLostError(
                    f"the {tag!r} exchange among ranks {members} broke: a member left mid-way ({error})"
                ) from error
            q = torch.tensor(list(moduli), dtype=summed.dtype).reshape(-1, 1)
            reduce_sum_(summed, q, len(members))
        self.bytes_sent += residues.numel() * residues.element_size()
        return summed


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


def key_share_digest(party: int, parties: int, session: str, serialized_share: bytes) -> bytes:
    """SHA-256 commitment to a serialized PublicKeyShare, bound to the rank, world size and session."""
    header = f"{party}/{parties}/{len(session)}:{session}".encode()
    return hashlib.sha256(
        KEY_SHARE_COMMITMENT_DOMAIN + len(header).to_bytes(4, "big") + header + serialized_share
    ).digest()


def key_fingerprint(public: PublicKey) -> str:
    return hashlib.sha256(public.data.contiguous().cpu().numpy().tobytes()).hexdigest()


class ThresholdSession:
    """One rank's side of collective key generation and collective decryption over a channel."""

    def __init__(
        self,
        channel: ShareChannel,
        parameters: ThresholdParameters = THRESHOLD_AGGREGATION,
        *,
        session: str = "",
        rng_seed: bytes | int | None = None,
        device: torch.device | str = "cpu",
        threshold: int | None = None,
        dealing_identity: DealingIdentity | None = None,
        dealing_pins: Mapping[int, str] | None = None,
    ) -> None:
        """``threshold`` t (1 ≤ t ≤ world): t-out-of-N keys, dealt at ``generate_public_key``; any t
        surviving ranks then decrypt (``aggregate`` tolerates up to N − t ranks leaving, see
        ``fhelium.multiparty.dropout``). ``None``: N-out-of-N. ``dealing_identity``: this rank's
        X25519 dealing key (default: a fresh one); ``dealing_pins``: rank → SHA-256 hex of its
        dealing public key, refusing any other (``fhelium.multiparty.dealing``).
        """
        self.channel = channel
        self.party = ThresholdParty(
            channel.rank, channel.world_size, parameters, session=session, rng_seed=rng_seed, device=device
        )
        if threshold is not None and not 1 <= threshold <= channel.world_size:
            raise MultipartyError(
                f"threshold must be in [1, {channel.world_size}] (the world size); got {threshold}"
            )
        self.threshold = threshold
        self.dealing_identity = dealing_identity
        self.dealing_pins = dict(dealing_pins or {})
        self.dealing_fingerprint: str | None = None  # hex of the agreed dealing transcript
        # an audit (the flagship's tests) may see each point this rank deals, as (receiver, point)
        self.dealing_audit: Callable[[int, torch.Tensor], None] | None = None
        self.shamir_share: torch.Tensor | None = None  # sk_j = F(x_j), t-out-of-N only
        self.alive: list[int] = list(range(channel.world_size))  # ranks not yet seen leaving
        self.contributors: list[int] = []  # whose inputs the last aggregate's sum covers
        self.engine = self.party.engine
        self.public: PublicKey | None = None
        self.common_seed = b""  # this key generation's common seed (public)
        self.key_share: PublicKeyShare | None = None
        self.round = 0  # aggregation rounds of this session (bound into every sum check)
        self.decryptions = 0  # explicit decrypt() calls of this session

    def _gather_values(self, tag: str, value: SeedCommitment | SeedReveal) -> list[Any]:
        blobs = self.channel.all_gather_bytes(tag, value_to_bytes(value))
        values = []
        for rank, blob in enumerate(blobs):
            received = value_from_bytes(blob, expected_type=type(value).__name__)
            if getattr(received, "party", None) != rank:
                raise MultipartyError(
                    f"rank {rank} sent a {type(value).__name__} for party {getattr(received, 'party', None)}"
                )
            values.append(received)
        return values

    def generate_public_key(self) -> PublicKey:
        """Seed (commit, reveal, XOR); key shares (commit, sum as residues, open and check); (Σ p_i, a).

        Every rank commits to its key share (SHA-256) before any share moves, the shares are summed
        as residues, and then every share is opened and checked against its commitment and the sum:
        a rank that changed its share after seeing others' (the last hop of a ring all-reduce sees a
        partial sum) is caught, so no rank can steer the collective key to one it alone knows.
        """
        party = self.party
        commitments = self._gather_values("seed-commitment", party.commit_seed())
        reveals = self._gather_values("seed-reveal", party.reveal_seed())
        seed = party.combine_seed(commitments, reveals)
        share = self.key_share = party.key_share(seed)
        blob = value_to_bytes(share, engine=self.engine)
        digest = key_share_digest(self.channel.rank, self.channel.world_size, party.session, blob)
        digests = self.channel.all_gather_bytes("key-share-commitment", digest)
        moduli = self.engine.moduli_for(share.prime_ids)
        total = self.channel.all_reduce_residues("public-key-shares", share.data, moduli)
        opened = self.channel.all_gather_bytes("public-key-share-open", blob, MAX_KEY_SHARE_BYTES)
        shares = []
        wrong = []
        for rank, (committed, data) in enumerate(zip(digests, opened, strict=True)):
            if key_share_digest(rank, self.channel.world_size, party.session, data) != committed:
                wrong.append(rank)
                continue
            value = value_from_bytes(data, engine=self.engine, expected_type="PublicKeyShare")
            if not isinstance(value, PublicKeyShare) or value.party != rank or value.seed != seed:
                wrong.append(rank)
                continue
            shares.append(value)
        if wrong:
            raise MultipartyError(
                f"rank(s) {wrong} opened a key share that does not match the commitment they published "
                "before any share moved (or one for another rank or seed); the collective key is refused"
            )
        reference = party.combine_public_key(shares, seed)
        if not torch.equal(reference.data[0].cpu(), total.cpu()):
            raise MultipartyError(
                "the summed key shares differ from the sum of the committed, opened shares: a rank (or the "
                "fold) contributed another key share to the sum than it committed to; the collective key is "
                "refused"
            )
        public = party.combine_public_key(total, seed)
        fingerprint = key_fingerprint(public)
        prints = [
            b.decode() for b in self.channel.all_gather_bytes("public-key-fingerprint", fingerprint.encode())
        ]
        wrong = [rank for rank, other in enumerate(prints) if other != fingerprint]
        if wrong:
            raise MultipartyError(
                f"rank(s) {wrong} computed another collective public key; the residue exchange is corrupt"
            )
        self.common_seed = seed
        if self.threshold is not None:
            self._deal(seed)
        self.public = public
        return public

    def _deal(self, seed: bytes) -> None:
        """t-out-of-N: deal this rank's Shamir points, sealed to each receiver's dealing key.

        Three record exchanges: the dealing public keys (checked against the pins), the sealed points
        (every dealer's record holds one sealed point per other rank; each rank opens its own), and
        the transcript fingerprint (every rank must have seen the same keys). Afterwards this rank
        holds sk_j = Σ_i f_i(x_j) and no longer its additive share.
        """
        from fhelium.multiparty import dealing, shamir

        assert self.threshold is not None
        party, channel, t = self.party, self.channel, self.threshold
        identity = self.dealing_identity = self.dealing_identity or dealing.DealingIdentity.generate()
        keys = channel.all_gather_bytes(
            "dealing-keys", identity.public_bytes, max_bytes=dealing.PUBLIC_KEY_BYTES
        )
        dealing.check_public_keys(keys, self.dealing_pins)
        if keys[channel.rank] != identity.public_bytes:
            raise dealing.DealingError(
                f"the transport returned another dealing key for rank {channel.rank} than its own",
                [channel.rank],
            )
        points = shamir.deal(party, t)
        if self.dealing_audit is not None:
            for receiver, point in points.items():
                self.dealing_audit(receiver, point)
        record = dealing.seal_points(
            identity, points, keys, dealer=channel.rank, session=party.session, seed=seed, threshold=t
        )
        records = channel.all_gather_bytes("shamir-points", record, max_bytes=max(len(record), 1))
        ids = tuple(range(len(self.engine.moduli)))
        received = {channel.rank: points[channel.rank]}
        for dealer, blob in enumerate(records):
            if dealer != channel.rank:
                received[dealer] = dealing.open_point(
                    identity, blob, keys, dealer=dealer, receiver=channel.rank, session=party.session,
                    seed=seed, threshold=t, moduli=self.engine.moduli_for(ids),
                    ring_degree=self.engine.ring_degree,
                ).to(self.engine.device)
        prepare = getattr(channel, "prepare_members", None)
        if prepare is not None:  # before the last exchange: no rank leaves key generation while another
            prepare(self.alive)  # is still connecting the group to it
        fingerprint = dealing.transcript_fingerprint(party.session, seed, t, keys)
        prints = channel.all_gather_bytes("dealing-transcript", fingerprint, max_bytes=len(fingerprint))
        differing = [rank for rank, other in enumerate(prints) if other != fingerprint]
        if differing:
            raise dealing.DealingError(
                f"rank(s) {differing} saw other dealing keys than rank {channel.rank}: the transport showed "
                "ranks different keys (a substituted key would let it read the points sealed to it); the "
                "t-out-of-N keys are refused. Pin the dealing keys (docs/security.md, 't-out-of-N keys')",
                differing,
            )
        self.shamir_share = shamir.receive(party, received)
        party.secret = None  # the additive share is spent: decryption goes through the Shamir share
        self.dealing_fingerprint = fingerprint.hex()

    def encrypt(self, values: torch.Tensor) -> Ciphertext:
        if self.public is None:
            raise MultipartyError("encrypt before generate_public_key")
        return self.party.encrypt(values, self.public)

    def aggregate(
        self,
        values: torch.Tensor,
        *,
        record: Callable[[str, torch.Tensor], None] | None = None,
        before_contribution: Callable[[], None] | None = None,
        sum_c1: Callable[[Ciphertext], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Encrypt this rank's real ``values`` ``[rows, ≤S]``, sum over the ranks, decrypt collectively.

        Returns the real slots (float64 ``[rows, S]``) of the sum, on every rank. The fused protocol:
        the ranks sum only the ciphertexts' c1 components; each rank then publishes c0_i + h_i
        (its own c0 folded into its flooded decryption share of the summed c1), and the sum of
        those is c0 + Σ h_i. Every c0_i is a fresh one-time pad (an RLWE sample) used in exactly one
        contribution, so the only combination of the contributions that decodes is the sum of all of
        them, and it decodes to the sum of the messages only if every rank folded its secret into
        the true c1 sum.

        Verified sums (docs/security.md, "Threshold aggregation"): the channel's fold is not
        trusted. Before publishing its contribution every rank checks that the c1 sum it was handed
        is the same on every rank (a digest bound to the session, the round and the exchange,
        all-gathered) and is the sum of this round's c1 components (a random projection: the
        Fiat–Shamir challenge of that digest gives one uniform multiplier per row and limb, every
        rank all-gathers the projection of its own c1, and their sum must equal the projection of
        the sum, exactly, modulo each prime). A substituted ciphertext, a subset sum, an earlier
        round's sum, a scaled or negated sum, or different sums for different ranks are refused
        with ``SumCheckError`` naming the round, before any contribution is published. The summed
        contributions are checked the same way before they are decoded (the fold cannot bias the
        result unnoticed). Rounds are numbered within the session.

        On a channel with ``start_all_reduce_residues``, ``start_reduce_residues`` and
        ``all_gather_tensor`` (the process group) the rows are cut into one slice per rank:
        slice k is encrypted and its c1 sum starts while the next slice is encrypted, the flooding
        noise is drawn while the sums are in flight, slice k's contributions are summed on rank k
        only, which checks and decodes it, and the decoded slices are all-gathered (real parts
        only). Other channels (the relay road) sum everything with ``all_reduce_residues`` and every
        rank decodes every row. ``sum_c1(ct)``, when given, sums the c1 components instead of the
        channel (the flagship runs its compiled Program here): it gets this rank's ciphertext with
        c0 zeroed and returns the summed c1 ``[rows, limbs, N]``; the sum is checked all the same.
        ``record(name, tensor)`` sees the ciphertext, the summed c1, this rank's contribution and the
        summed contributions this rank decodes (the flagship's audit). ``before_contribution()`` runs
        once every c1 sum has arrived and passed its check, before this rank publishes any
        contribution (the flagship's fault injection: a rank leaving after encrypting).

        Each aggregation spends ``rows`` of this key's flooding budget
        (``ThresholdParameters.decryption_row_budget``); past it ``FloodingBudgetError``.

        With t-out-of-N keys (``threshold``) the round tolerates ranks leaving instead
        (``fhelium.multiparty.dropout``): the sum covers the ranks in ``self.contributors``;
        ``before_contribution`` then runs once this rank's input is in the checked sum, before it
        publishes its decryption share; ``sum_c1`` is not supported.
        """
        if self.threshold is not None:
            if sum_c1 is not None:
                raise MultipartyError(
                    "t-out-of-N aggregate sums through the channel: sum_c1 is not supported"
                )
            from fhelium.multiparty.dropout import aggregate_surviving

            total, self.contributors = aggregate_surviving(
                self, values, record=record, before_decrypt=before_contribution
            )
            return total
        self.contributors = list(range(self.channel.world_size))
        return self._aggregate(
            values, record=record, before_contribution=before_contribution, sum_c1=sum_c1, check_sums=True
        )

    def _aggregate(
        self,
        values: torch.Tensor,
        *,
        record: Callable[[str, torch.Tensor], None] | None,
        before_contribution: Callable[[], None] | None,
        sum_c1: Callable[[Ciphertext], torch.Tensor] | None,
        check_sums: bool,
    ) -> torch.Tensor:
        """``aggregate``; ``check_sums=False`` trusts the fold (no sum check, no copy kept for one).

        ``check_sums=False`` exists for bench/aggregate.py's baseline only (it measures what the
        defence against a malicious fold costs); nothing else may call it so: an aggregator could
        then decrypt any ciphertext or bias the result unnoticed (docs/security.md).
        """
        if self.public is None:
            raise MultipartyError("aggregate before generate_public_key")
        party, channel = self.party, self.channel
        values = torch.as_tensor(values)
        if values.ndim == 1:
            values = values.unsqueeze(0)
        rows, world = values.size(0), channel.world_size
        self.round += 1
        round_number = self.round
        party.spend_decryption_rows(rows)  # before anything moves: every rank refuses at the same round
        sliced = all(
            hasattr(channel, name)
            for name in ("start_all_reduce_residues", "start_reduce_residues", "all_gather_tensor")
        )
        if sum_c1 is not None or not sliced or world == 1 or rows < world:
            return self._aggregate_blocking(
                values, round_number, record=record, before_contribution=before_contribution,
                sum_c1=sum_c1, check_sums=check_sums,
            )
        return self._aggregate_sliced(
            values, round_number, record=record, before_contribution=before_contribution,
            check_sums=check_sums,
        )

    def _aggregate_blocking(
        self,
        values: torch.Tensor,
        round_number: int,
        *,
        record: Callable[[str, torch.Tensor], None] | None,
        before_contribution: Callable[[], None] | None,
        sum_c1: Callable[[Ciphertext], torch.Tensor] | None,
        check_sums: bool,
    ) -> torch.Tensor:
        """The fused protocol with one sum of each (the relay road, ``sum_c1``, small batches)."""
        assert self.public is not None
        party, engine, channel = self.party, self.engine, self.channel
        ct = party.encrypt(values, self.public)
        ids = ct.prime_ids
        moduli = engine.moduli_for(ids)
        if record is not None:
            record("ciphertext", ct.data)
        own_c1 = ct.data[1]
        if sum_c1 is not None:  # only c1 leaves this rank: c0 is its one-time pad
            c1_only = Ciphertext(
                torch.stack((torch.zeros_like(own_c1), own_c1)), ct.depth, ct.scale, ids, "ntt"
            )
            c1 = sum_c1(c1_only)
        else:
            c1 = channel.all_reduce_residues("ciphertext-c1", own_c1, moduli)
        if record is not None:
            record("c1_sum", c1)
        if check_sums:
            self._check_sums("ciphertext-c1", round_number, [own_c1], [c1], ids)
        if before_contribution is not None:
            before_contribution()
        contribution = party.add_decryption_share_(party.flooded_c0(ct.data[0], ids), c1, ids)
        if record is not None:
            record("decryption_share", contribution)
        total = channel.all_reduce_residues("decryption-contributions", contribution, moduli)
        if record is not None:
            record("decryption_sum", total)
        if check_sums:
            self._check_sums("decryption-contributions", round_number, [contribution], [total], ids)
        return decode_contributions(engine, total, ids, ct.scale)

    def _aggregate_sliced(
        self,
        values: torch.Tensor,
        round_number: int,
        *,
        record: Callable[[str, torch.Tensor], None] | None,
        before_contribution: Callable[[], None] | None,
        check_sums: bool,
    ) -> torch.Tensor:
        """The fused protocol pipelined per slice of rows (the process group; see ``aggregate``)."""
        engine = self.engine
        rows, world = values.size(0), self.channel.world_size
        per = -(-rows // world)
        parts, flooded = self._encrypt_slices(values, per, record=record, check_sums=check_sums)
        ids = parts[0][1].prime_ids
        sums = self._sum_c1_slices(parts, round_number, ids, record=record, check_sums=check_sums)
        if before_contribution is not None:
            before_contribution()
        own, mine_index, mine = self._reduce_contributions(
            parts, sums, flooded, record=record, check_sums=check_sums
        )
        if check_sums:
            self._check_sliced_sums(round_number, own, mine_index, mine, ids)
        decoded = torch.zeros(per, engine.slot_count, dtype=torch.float64)
        if mine is not None:
            ct = parts[mine_index][1]
            decoded[: mine.size(0)] = decode_contributions(engine, mine, ct.prime_ids, ct.scale)
        pieces = self.channel.all_gather_tensor("decoded-slots", decoded)  # type: ignore[attr-defined]
        return torch.cat(pieces)[:rows]

    def _encrypt_slices(
        self,
        values: torch.Tensor,
        per: int,
        *,
        record: Callable[[str, torch.Tensor], None] | None,
        check_sums: bool,
    ) -> tuple[list[tuple[int, Ciphertext, Callable[[], torch.Tensor]]], list[torch.Tensor]]:
        """Encrypt slice k and start its c1 sum while the next is encrypted; the flooded c0 of each slice."""
        assert self.public is not None
        party, engine = self.party, self.engine
        start_sum = self.channel.start_all_reduce_residues  # type: ignore[attr-defined]
        rows, world = values.size(0), self.channel.world_size
        bounds = [(min(k * per, rows), min((k + 1) * per, rows)) for k in range(world)]
        parts: list[tuple[int, Ciphertext, Callable[[], torch.Tensor]]] = []
        for k, (start, stop) in enumerate(bounds):
            if stop > start:  # the same on every rank: all encrypt the same number of rows
                if record is None:  # c0 comes with the flooding noise in it (encrypt_flooded)
                    ct = party.encrypt_flooded(values[start:stop], self.public)
                else:  # the audit sees the ciphertext itself; the noise is added below
                    ct = party.encrypt(values[start:stop], self.public)
                    record("ciphertext", ct.data)
                moduli = engine.moduli_for(ct.prime_ids)
                # a copy goes to the in-place sum: this rank's own c1 is needed for the check
                sent = ct.data[1].clone() if check_sums else ct.data[1]
                parts.append((k, ct, start_sum("ciphertext-c1", sent, moduli)))
        if record is None:
            flooded = [ct.data[0] for _, ct, _ in parts]
        else:
            flooded = [party.flooded_c0(ct.data[0], ct.prime_ids) for _, ct, _ in parts]
        return parts, flooded

    def _sum_c1_slices(
        self,
        parts: Sequence[tuple[int, Ciphertext, Callable[[], torch.Tensor]]],
        round_number: int,
        ids: Sequence[int],
        *,
        record: Callable[[str, torch.Tensor], None] | None,
        check_sums: bool,
    ) -> list[torch.Tensor]:
        """Each slice's c1 sum as it arrives (digested while the next is in flight), then checked."""
        party, engine = self.party, self.engine
        sums = []
        digests: list[tuple[bytes, bool]] = []
        for part, (_, _, finish) in enumerate(parts):
            c1 = finish()
            if record is not None:
                record("c1_sum", c1)
            sums.append(c1)
            if check_sums:  # while the next slice's sum is still in flight
                q = engine._mod(ids).q
                digests.append(checked_sum_digest(party.session, round_number, "ciphertext-c1", part, c1, q))
        if check_sums:
            own_parts = [ct.data[1] for _, ct, _ in parts]
            self._check_sums("ciphertext-c1", round_number, own_parts, sums, ids, digests)
        return sums

    def _reduce_contributions(
        self,
        parts: Sequence[tuple[int, Ciphertext, Callable[[], torch.Tensor]]],
        sums: Sequence[torch.Tensor],
        flooded: Sequence[torch.Tensor],
        *,
        record: Callable[[str, torch.Tensor], None] | None,
        check_sums: bool,
    ) -> tuple[list[torch.Tensor], int, torch.Tensor | None]:
        """c0_i + h_i per slice, slice k reduced to rank k; (own contributions kept for the check,
        the index of this rank's slice, its summed contributions or None).
        """
        party, engine = self.party, self.engine
        start_reduce = self.channel.start_reduce_residues  # type: ignore[attr-defined]
        pending = []
        own: list[torch.Tensor] = []
        for (k, ct, _), c1, contribution in zip(parts, sums, flooded, strict=True):
            party.add_decryption_share_(contribution, c1, ct.prime_ids)
            if record is not None:
                record("decryption_share", contribution)
            if check_sums and record is None:  # the reduction works in place; the check needs
                # this rank's own: its c1 has served its check, so its buffer takes the copy
                own.append(ct.data[1].copy_(contribution))
            elif check_sums:  # the audit was shown the ciphertext and may keep it: a fresh copy
                own.append(contribution.clone())
            moduli = engine.moduli_for(ct.prime_ids)
            pending.append(start_reduce("decryption-contributions", contribution, moduli, k))
        mine: torch.Tensor | None = None
        mine_index = -1
        for index, finish in enumerate(pending):
            total = finish()
            if total is not None:
                if record is not None:
                    record("decryption_sum", total)
                mine, mine_index = total, index
        return own, mine_index, mine

    def _refuse(self, what: str, round_number: int, detail: str, ranks: Sequence[int] = ()) -> SumCheckError:
        label = SUM_LABELS.get(what, what)
        action = (
            "refuses to publish its decryption contribution"
            if what == "ciphertext-c1"
            else "refuses to decode it"
        )
        return SumCheckError(
            f"aggregation round {round_number} of session {self.party.session!r}: the {label} the channel "
            f"(the aggregator's fold) returned {detail}; rank {self.channel.rank} {action}. The aggregator "
            "substituted, dropped, replayed, scaled or reordered inputs, or answered ranks differently "
            "(docs/security.md, 'Threshold aggregation'); run the round again over an aggregator you "
            "trust to be correct",
            round_number,
            ranks,
        )

    def _check_sums(
        self,
        what: str,
        round_number: int,
        own: Sequence[torch.Tensor],
        sums: Sequence[torch.Tensor],
        prime_ids: Sequence[int],
        checked: Sequence[tuple[bytes, bool]] | None = None,
    ) -> None:
        """Refuse unless every rank holds the same ``sums`` and each is the sum of the ranks' ``own``.

        One record exchange: per part, the digest of the sum (session, round, exchange, part) and
        the projection of this rank's own residues with that digest's challenge. Every rank checks
        every digest against its own (different sums for different ranks are named) and the sum of
        the projections against the projection of the sum. ``checked``: each sum's
        ``checked_sum_digest`` when the caller took it already (as each sum arrived).
        """
        ids = tuple(prime_ids)
        m = self.engine._mod(ids)
        for part, (mine, summed) in enumerate(zip(own, sums, strict=True)):
            if tuple(summed.shape) != tuple(mine.shape):
                raise self._refuse(
                    what,
                    round_number,
                    f"has shape {tuple(summed.shape)} where slice {part} has {tuple(mine.shape)}",
                )
        if checked is None:  # digest and range check in one pass per sum
            session = self.party.session
            checked = [
                checked_sum_digest(session, round_number, what, part, s, m.q) for part, s in enumerate(sums)
            ]
        for part, (_, bad) in enumerate(checked):
            # residues at or above their prime would be congruent to a checked value yet feed the
            # modular kernels out of their range
            if bad:
                raise self._refuse(what, round_number, f"has residues outside [0, q) in slice {part}")
        digests = [digest for digest, _ in checked]
        weights = [
            projection_weights(d, m.q, s.reshape(-1, len(ids), s.size(-1)).size(0))
            for d, s in zip(digests, sums, strict=True)
        ]
        projections = [project(o, w, m.q, m.q_inverse) for o, w in zip(own, weights, strict=True)]
        record = b"".join(
            d + p.contiguous().cpu().numpy().tobytes() for d, p in zip(digests, projections, strict=True)
        )
        records = self.channel.all_gather_bytes(f"{what}-check:{round_number}", record, max_bytes=len(record))
        differing = [
            rank
            for rank, blob in enumerate(records)
            if len(blob) != len(record)
            or any(
                blob[offset : offset + DIGEST_BYTES] != digest
                for offset, digest in zip(_offsets(projections), digests, strict=True)
            )
        ]
        if differing:
            raise self._refuse(
                what,
                round_number,
                f"differs between ranks: rank(s) {differing} were handed another one than rank "
                f"{self.channel.rank} (each rank's digest of its sum, all-gathered)",
                differing,
            )
        for part, (offset, summed, weight) in enumerate(
            zip(_offsets(projections), sums, weights, strict=True)
        ):
            total = torch.zeros_like(projections[part])
            size = projections[part].numel() * 8
            for blob in records:
                start = offset + DIGEST_BYTES
                theirs = torch.frombuffer(bytearray(blob[start : start + size]), dtype=torch.int64)
                mod.add_mod_(total, theirs.view_as(total).to(total.device), m.q)
            if not torch.equal(total, project(summed, weight, m.q, m.q_inverse)):
                raise self._refuse(
                    what,
                    round_number,
                    f"is not the sum of this round's {self.channel.world_size} inputs (slice {part}: the "
                    "random projections of every rank's own input do not add up to the projection of the "
                    "sum)",
                )

    def _check_sliced_sums(
        self,
        round_number: int,
        own: Sequence[torch.Tensor],
        mine_index: int,
        mine: torch.Tensor | None,
        prime_ids: Sequence[int],
    ) -> None:
        """The summed contributions of the sliced path: slice k's sum is on rank k only.

        Rank k publishes the digest of its sum, every rank publishes the projection of its own
        contribution to every slice with that slice's challenge, rank k checks its slice, and every
        rank's verdict is all-gathered so that every rank refuses together, naming the round.
        """
        what = "decryption-contributions"
        ids = tuple(prime_ids)
        m = self.engine._mod(ids)
        digest, mine_bad = b"", False
        if mine is not None:  # digest and range check in one pass
            digest, mine_bad = checked_sum_digest(
                self.party.session, round_number, what, mine_index, mine, m.q
            )
        digests = self.channel.all_gather_bytes(
            f"{what}-digest:{round_number}", digest, max_bytes=DIGEST_BYTES
        )
        # the ranks holding a slice are the first len(own) (slices are cut in rank order)
        weights = []
        for part, contribution in enumerate(own):
            if len(digests[part]) != DIGEST_BYTES:
                raise self._refuse(what, round_number, f"was never announced by rank {part}", [part])
            rows = contribution.reshape(-1, len(ids), contribution.size(-1)).size(0)
            weights.append(projection_weights(digests[part], m.q, rows))
        projections = [project(o, w, m.q, m.q_inverse) for o, w in zip(own, weights, strict=True)]
        record = b"".join(p.contiguous().cpu().numpy().tobytes() for p in projections)
        records = self.channel.all_gather_bytes(f"{what}-check:{round_number}", record, max_bytes=len(record))
        verdict = b""
        if mine is not None:
            size = projections[mine_index].numel() * 8
            total = torch.zeros_like(projections[mine_index])
            for blob in records:
                start = mine_index * size
                theirs = torch.frombuffer(bytearray(blob[start : start + size]), dtype=torch.int64)
                if theirs.numel() != total.numel():
                    verdict = b"a rank sent a truncated projection"
                    break
                mod.add_mod_(total, theirs.view_as(total).to(total.device), m.q)
            else:
                if (
                    mine.shape != own[mine_index].shape
                    or mine_bad
                    or not torch.equal(total, project(mine, weights[mine_index], m.q, m.q_inverse))
                ):
                    verdict = b"is not the sum of this round's contributions"
        verdicts = self.channel.all_gather_bytes(f"{what}-verdict:{round_number}", verdict, max_bytes=256)
        refused = [rank for rank, text in enumerate(verdicts) if text]
        if refused:
            raise self._refuse(
                what,
                round_number,
                f"to rank(s) {refused} (the rank(s) decoding those slices) "
                + verdicts[refused[0]].decode(errors="replace"),
                refused,
            )

    def decrypt(
        self,
        ct: Ciphertext,
        *,
        assume_identical: bool = False,
        record: Callable[[str, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Publish h_i = s_i·c1 + e_i' for ``ct``, all-reduce the shares, decode c0 + Σ h_i.

        NOT for aggregation: use ``aggregate``. A decryption share decrypts whatever ciphertext it
        is made for, so publishing one for a ciphertext an aggregator handed over lets that
        aggregator decrypt anything it likes (rank v's own ciphertext instead of the sum, for one).
        ``decrypt`` therefore refuses unless the caller states ``assume_identical=True``: that
        ``ct`` is a ciphertext every rank already holds identically *and whose contents every rank
        may learn* (it did not come from a party the ranks do not trust). The ranks then
        all-gather the ciphertext's digest and refuse, naming the ranks, unless all hold the same.

        The result: complex128 slots ``[*batch, S]`` on every rank. Every rank's share covers every
        row; the decoding is split on a channel with ``all_gather_tensor`` (the process group):
        rank r decodes the r-th 1/world of the rows and the decoded slots are all-gathered.
        ``record(name, tensor)`` sees this rank's decryption share and the summed shares. Spends
        the ciphertext's rows of this key's flooding budget.
        """
        if not assume_identical:
            raise MultipartyError(
                "ThresholdSession.decrypt publishes a decryption share for the ciphertext it is given, which "
                "decrypts that ciphertext for whoever collects the shares: never call it on a ciphertext an "
                "aggregator returned (use ThresholdSession.aggregate, which checks the sums). Pass "
                "assume_identical=True only for a ciphertext every rank holds identically and may see "
                "decrypted"
            )
        engine = self.engine
        self.decryptions += 1
        session = self.party.session
        header = f"{len(session)}:{session}/{self.decryptions}/{ct.prime_ids}/{tuple(ct.data.shape)}"
        digest = hashlib.sha256(
            DECRYPT_AGREEMENT_DOMAIN + header.encode() + ct.data.contiguous().cpu().numpy().tobytes()
        ).digest()
        digests = self.channel.all_gather_bytes(
            f"decryption-agreement:{self.decryptions}", digest, max_bytes=DIGEST_BYTES
        )
        differing = [rank for rank, other in enumerate(digests) if other != digest]
        if differing:
            raise MultipartyError(
                f"decryption {self.decryptions} of session {session!r} was refused before any share "
                f"moved: rank(s) {differing} hold another ciphertext than rank {self.channel.rank} (decrypt "
                "needs the same ciphertext on every rank)"
            )
        share = self.party.decryption_share(ct, digest=False)
        if record is not None:
            record("decryption_share", share.data)
        moduli = engine.moduli_for(ct.prime_ids)
        total = self.channel.all_reduce_residues("decryption-shares", share.data, moduli)
        if record is not None:
            record("decryption_sum", total)
        gather = getattr(self.channel, "all_gather_tensor", None)
        world, rows = self.channel.world_size, math.prod(ct.batch_shape)
        if gather is None or world == 1 or rows < world:
            return self.party.combine_decryption(ct, total)
        per = -(-rows // world)
        start, stop = min(self.channel.rank * per, rows), min((self.channel.rank + 1) * per, rows)
        limbs, n = ct.data.shape[-2:]
        slots = torch.zeros(per, engine.slot_count, dtype=torch.complex128)
        if stop > start:
            part = Ciphertext(
                ct.data.reshape(2, rows, limbs, n)[:, start:stop], ct.depth, ct.scale, ct.prime_ids, "ntt"
            )
            summed = total.reshape(rows, limbs, n)[start:stop]
            slots[: stop - start] = combine_decryption(engine, part, summed)
        pieces = gather("decoded-slots", torch.view_as_real(slots))
        decoded = torch.view_as_complex(torch.cat(pieces)[:rows].contiguous())
        return decoded.view(*ct.batch_shape, engine.slot_count)


def _offsets(projections: Sequence[torch.Tensor]) -> list[int]:
    """Where each part's digest starts in a check record (digest, then its projection, per part)."""
    offsets, at = [], 0
    for projection in projections:
        offsets.append(at)
        at += DIGEST_BYTES + projection.numel() * 8
    return offsets


SUM_LABELS = {
    "ciphertext-c1": "c1 sum",
    "decryption-contributions": "sum of the decryption contributions",
}


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "EXCHANGES",
    "MemberLostError",
    "ProcessGroupChannel",
    "ShareChannel",
    "SumCheckError",
    "ThresholdSession",
    "gather_from_store",
    "key_fingerprint",
    "key_share_digest",
    "missing_error",
]
