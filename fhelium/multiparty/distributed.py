"""The threshold protocol across processes: a session over a ``ShareChannel``.

A channel moves two things: small records (seed commitments and reveals, key fingerprints) with
``all_gather_bytes``, and residues with ``all_reduce_residues`` (the per-limb modular sum of every
rank's key share or decryption share). ``ProcessGroupChannel`` runs over torch.distributed
(gloo/NCCL) with ``fhelium.distributed``'s collectives; examples/threshold_aggregation.py has the
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
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

import fhelium.distributed as fdist
from fhelium.core import Ciphertext, PublicKey
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
DECRYPTION_EXCHANGES = frozenset({"decryption-shares", "ciphertext-c1", "decryption-contributions"})

# What each exchange carries, for the error naming the missing ranks.
EXCHANGES = {
    "seed-commitment": "a seed commitment",
    "seed-reveal": "a seed reveal",
    "key-share-commitment": "a key share commitment",
    "public-key-shares": "a public key share",
    "public-key-share-open": "its opened public key share",
    "public-key-fingerprint": "the collective key's fingerprint",
    "decryption-shares": "a decryption share",
    "ciphertext-c1": "its ciphertext's c1 component",
    "decryption-contributions": "its decryption share (c0_i + h_i)",
    "decoded-slots": "its slice of the decoded sum",
}


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
    ) -> None:
        self.channel = channel
        self.party = ThresholdParty(
            channel.rank, channel.world_size, parameters, session=session, rng_seed=rng_seed, device=device
        )
        self.engine = self.party.engine
        self.public: PublicKey | None = None
        self.key_share: PublicKeyShare | None = None

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
        self.public = public
        return public

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
    ) -> torch.Tensor:
        """Encrypt this rank's real ``values`` ``[rows, ≤S]``, sum over the ranks, decrypt collectively.

        Returns the real slots (float64 ``[rows, S]``) of the sum, on every rank. The fused protocol:
        the ranks sum only the ciphertexts' c1 components; each rank then publishes c0_i + h_i
        (its own c0 folded into its flooded decryption share of the summed c1), and the sum of
        those is c0 + Σ h_i. Publishing c0_i + h_i reveals a function of what the unfused protocol
        (sum whole ciphertexts, then ``decrypt``) reveals, so no observer learns more, and the
        ciphertext exchange moves half the bytes.

        On a channel with ``start_all_reduce_residues``, ``start_reduce_residues`` and
        ``all_gather_tensor`` (the process group) the rows are cut into one slice per rank:
        slice k is encrypted and its c1 sum starts while the next slice is encrypted, the flooding
        noise is drawn while the sums are in flight, slice k's contributions are summed on rank k
        only, which decodes it, and the decoded slices are all-gathered (real parts only). Other
        channels (the relay road) sum everything with ``all_reduce_residues`` and every rank
        decodes every row. ``record(name, tensor)`` sees the ciphertext, the summed c1, this
        rank's contribution and the summed contributions this rank decodes (the flagship's audit).
        ``before_contribution()`` runs once every c1 sum has arrived and before this rank publishes
        any contribution (the flagship's fault injection: a rank leaving after encrypting).
        """
        if self.public is None:
            raise MultipartyError("aggregate before generate_public_key")
        party, engine, channel = self.party, self.engine, self.channel
        values = torch.as_tensor(values)
        if values.ndim == 1:
            values = values.unsqueeze(0)
        rows, world = values.size(0), channel.world_size
        start_sum = getattr(channel, "start_all_reduce_residues", None)
        start_reduce = getattr(channel, "start_reduce_residues", None)
        gather = getattr(channel, "all_gather_tensor", None)
        if start_sum is None or start_reduce is None or gather is None or world == 1 or rows < world:
            ct = party.encrypt(values, self.public)
            moduli = engine.moduli_for(ct.prime_ids)
            if record is not None:
                record("ciphertext", ct.data)
            c1 = channel.all_reduce_residues("ciphertext-c1", ct.data[1], moduli)
            if record is not None:
                record("c1_sum", c1)
            if before_contribution is not None:
                before_contribution()
            contribution = party.decryption_contribution(ct, c1)
            if record is not None:
                record("decryption_share", contribution)
            total = channel.all_reduce_residues("decryption-contributions", contribution, moduli)
            if record is not None:
                record("decryption_sum", total)
            return decode_contributions(engine, total, ct.prime_ids, ct.scale)
        per = -(-rows // world)
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
                parts.append((k, ct, start_sum("ciphertext-c1", ct.data[1], moduli)))
        if record is None:
            flooded = [ct.data[0] for _, ct, _ in parts]
        else:
            flooded = [party.flooded_c0(ct.data[0], ct.prime_ids) for _, ct, _ in parts]

        def c1_arrived(finish: Callable[[], torch.Tensor]) -> torch.Tensor:
            c1 = finish()
            if record is not None:
                record("c1_sum", c1)
            return c1

        sums: list[torch.Tensor] = []
        if before_contribution is not None:  # every c1 sum first, then the hook, then the contributions
            sums = [c1_arrived(finish) for _, _, finish in parts]
            before_contribution()
        pending = []
        for index, ((k, ct, c1_sum), contribution) in enumerate(zip(parts, flooded, strict=True)):
            c1 = sums[index] if sums else c1_arrived(c1_sum)
            party.add_decryption_share_(contribution, c1, ct.prime_ids)
            if record is not None:
                record("decryption_share", contribution)
            moduli = engine.moduli_for(ct.prime_ids)
            pending.append(start_reduce("decryption-contributions", contribution, moduli, k))
        mine = torch.zeros(per, engine.slot_count, dtype=torch.float64)
        for (_, ct, _), finish in zip(parts, pending, strict=True):
            total = finish()
            if total is not None:
                if record is not None:
                    record("decryption_sum", total)
                mine[: total.size(0)] = decode_contributions(engine, total, ct.prime_ids, ct.scale)
        pieces = gather("decoded-slots", mine)
        return torch.cat(pieces)[:rows]

    def decrypt(
        self, ct: Ciphertext, *, record: Callable[[str, torch.Tensor], None] | None = None
    ) -> torch.Tensor:
        """Publish h_i, all-reduce the shares, decode c0 + Σ h_i.

        The result: complex128 slots ``[*batch, S]`` on every rank.

        Every rank's share covers every row (each row needs every secret share), but the decoding
        (c0 + Σ h_i, inverse NTT, CRT, slots) is split: on a channel with ``all_gather_tensor``
        (the process group), rank r decodes the r-th 1/world of the batch rows and the decoded
        slots, the function's output that every rank gets anyway, are all-gathered. Without it
        (the relay channel) every rank decodes every row. ``record(name, tensor)`` sees this
        rank's decryption share and the summed shares (the flagship's audit).
        """
        engine = self.engine
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


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "EXCHANGES",
    "ProcessGroupChannel",
    "ShareChannel",
    "ThresholdSession",
    "key_fingerprint",
    "key_share_digest",
    "missing_error",
]
