"""Derive the join window's effective policy from the operator's `controller.join:` knobs.

`JoinConfig` only checks the shape of each knob. The rules that relate knobs to each other, to the
configured capacity, to the bind scope and to the averaging mode live here, because only here is all
of that context known. Every contradiction is a `PolicyError` that names both knobs and the fix.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from enum import StrEnum

from flodld.config.fields import AveragingMode
from flodld.config.join import JoinConfig

DEFAULT_JOIN_TIMEOUT_SECS = 300.0
DEFAULT_HARD_CAP_SECS = 600.0
# The largest world: global ranks are u31 on the wire (flodld.wire.messages.Rank). The ledger refuses a host
# that would pass it (`world_full`) and a window whose quorum or target lies beyond it never opens.
MAX_WORLD_RANKS = 2**31

OPEN_ADMISSION_WARNING = (
    "cluster join: open_admission is on for a network bind — any peer that can reach the controller "
    "port can join (and therefore influence) this run, and the run salt is handed out in cleartext. "
    "Sound only on a fully trusted segment; set controller.join.token or tunnel workers through sshd."
)


OPEN_NETWORK_BIND_WARNING = (
    "cluster join: open_admission is on and the controller is bound to {bound}, which is NOT loopback — "
    "any peer that can reach the controller port can join (and therefore influence) this run, and the run "
    "salt is handed out in cleartext to every joiner. Sound only on a fully trusted segment; set "
    "controller.join.token (--token) or bind 127.0.0.1 and tunnel workers through sshd."
)


def is_loopback_literal(address: str) -> bool:
    """True for an IP literal in 127/8, ::1 or IPv4-mapped loopback; anything else (0.0.0.0, ::,
    a hostname, garbage) is not loopback.
    """
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0].strip("[]"))
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


class PolicyError(ValueError):
    """Two knobs contradict each other; the message names both and says how to fix it."""


class StartMode(StrEnum):
    """Who closes the window once quorum is met."""

    AUTO = "auto"
    MANUAL = "manual"
    HYBRID = "hybrid"


class TrustMode(StrEnum):
    """Whether a joiner must already hold the session salt (`preshared`) or receives it in Accept (`open`)."""

    PRESHARED = "preshared"
    OPEN = "open"


@dataclass(frozen=True)
class WindowPolicy:
    """The resolved window: every default filled in, every cross-knob rule already checked."""

    quorum: int
    target: int | None
    window_secs: float
    cap_secs: float
    start: StartMode
    discovery: bool
    tunnel_only: bool
    open_admission: bool
    trust: TrustMode
    loopback_bind: bool
    capacity: int = 0
    warning: str | None = None

    def summary(self) -> str:
        """One line for the controller log when the window opens."""
        target = self.target if self.target is not None else "none"
        admission = "pre-shared salt" if self.trust is TrustMode.PRESHARED else "open"
        return (
            f"join window open (start {self.start.value}, quorum {self.quorum} ranks, target {target}, "
            f"window {self.window_secs:g}s, cap {self.cap_secs:g}s, admission: {admission})"
        )

    @property
    def admits_walk_ins(self) -> bool:
        """Whether hosts outside the roster may join: no roster, or a window sized beyond it."""
        if self.discovery:
            return True
        wanted = self.target if self.target is not None else self.quorum
        return wanted > self.capacity


def derive_policy(
    join: JoinConfig,
    *,
    capacity: int,
    loopback_bind: bool,
    averaging: AveragingMode,
    bound_address: str | None = None,
    preshared: bool = False,
) -> WindowPolicy:
    """Fill in defaults from `capacity` (the roster's total ranks) and refuse contradictory knobs.

    `loopback_bind` is the configured intent (every remote worker tunneled); `bound_address` is the
    address the listener actually has (None while it is not known yet: the intent stands in). Trust
    follows the real bind: a non-loopback listener never admits openly unless `open_admission` says
    so, and `tunnel_only` on a non-loopback listener is a contradiction. `preshared`: the launcher
    hands every agent the salt over its own channel, so a loopback bind alone does not open admission.
    """
    if capacity < 0:
        raise PolicyError(f"capacity must be >= 0 (the roster's total ranks), got {capacity}")
    _check_discovery_family(join, AveragingMode(averaging))
    start = StartMode(join.start)
    quorum, target = _quorum_and_target(join, capacity, start)
    window = join.join_timeout
    cap = join.max_join_timeout if join.max_join_timeout is not None else max(DEFAULT_HARD_CAP_SECS, window)
    if cap < window:
        raise PolicyError(
            f"controller.join: max_join_timeout ({cap:g}s) is below join_timeout ({window:g}s) — the hard "
            "cap cannot expire before the window; raise max_join_timeout or lower join_timeout"
        )
    bound_loopback = (
        (loopback_bind or join.tunnel_only) if bound_address is None else (is_loopback_literal(bound_address))
    )
    trust, warning = _trust_mode(join, loopback_bind, bound_loopback, bound_address, preshared)
    return WindowPolicy(
        quorum=quorum,
        target=target,
        window_secs=window,
        cap_secs=cap,
        start=start,
        discovery=join.discovery,
        tunnel_only=join.tunnel_only,
        open_admission=join.open_admission,
        trust=trust,
        loopback_bind=bound_loopback,
        capacity=capacity,
        warning=warning,
    )


def _check_discovery_family(join: JoinConfig, averaging: AveragingMode) -> None:
    if join.discovery and join.min_rank_start is None:
        raise PolicyError(
            "controller.join: discovery: true requires an explicit min_rank_start — a roster-free window has "
            "no configured capacity to derive the quorum from; set min_rank_start"
        )
    if join.tunnel_only and not join.discovery:
        raise PolicyError(
            "controller.join: tunnel_only is a discovery-mode knob and discovery is off — an enumerated "
            "roster infers the bind scope from its workers' tunnel: flags; set discovery: true or drop "
            "tunnel_only"
        )
    # Only CPU modes send all their traffic through the per-host relay's single upstream connection,
    # the one thing a controller tunnel can carry.
    if join.tunnel_only and not averaging.is_cpu:
        raise PolicyError(
            f"controller.join: tunnel_only needs a CPU averaging mode ({AveragingMode.cpu_modes_text()}), "
            f"but averaging is {averaging.value!r} — NCCL's data plane is peer-to-peer and cannot ride a "
            "controller tunnel; switch averaging to a cpu_* mode or drop tunnel_only"
        )
    if join.token is not None and join.open_admission:
        raise PolicyError(
            "controller.join: token and open_admission: true contradict — a configured token means admission "
            "is credential-checked; drop one of them"
        )


def _quorum_and_target(join: JoinConfig, capacity: int, start: StartMode) -> tuple[int, int | None]:
    if start is StartMode.MANUAL and join.target_ranks is not None:
        raise PolicyError(
            "controller.join: start: manual and target_ranks contradict — the target is a clock-side "
            "auto-close and manual hands the close to the operator; drop target_ranks (or use start: hybrid)"
        )
    if join.discovery:
        assert join.min_rank_start is not None  # checked in _check_discovery_family
        quorum, target = join.min_rank_start, join.target_ranks
    else:
        if capacity == 0 and join.min_rank_start is None:
            raise PolicyError(
                "controller.join: workers: is empty and discovery is off — there is no capacity to derive "
                "the quorum from; list workers, or set discovery: true with min_rank_start"
            )
        quorum = join.min_rank_start if join.min_rank_start is not None else capacity
        default_target = None if start is StartMode.MANUAL else capacity
        target = join.target_ranks if join.target_ranks is not None else default_target
    if target is not None and target < quorum:
        origin = (
            "target_ranks"
            if join.target_ranks is not None
            else f"target_ranks (defaulted to capacity {capacity})"
        )
        raise PolicyError(
            f"controller.join: min_rank_start ({quorum}) is above {origin} ({target}) — the early-close "
            "target cannot sit below the quorum; lower min_rank_start or raise target_ranks"
        )
    for knob, value in (("min_rank_start (quorum)", quorum), ("target_ranks", target)):
        if value is not None and value > MAX_WORLD_RANKS:
            raise PolicyError(
                f"controller.join: {knob} is {value}, beyond the largest world of {MAX_WORLD_RANKS} ranks "
                "(global ranks are 31-bit on the wire); lower it"
            )
    return quorum, target


def _trust_mode(
    join: JoinConfig, loopback_bind: bool, bound_loopback: bool, bound_address: str | None, preshared: bool
) -> tuple[TrustMode, str | None]:
    if join.tunnel_only and not bound_loopback:
        raise PolicyError(
            "controller.join: tunnel_only (--tunnel-only) promises a loopback-only listener, but the "
            f"controller is bound to {bound_address} (--bind / bind_host), which is not loopback — anyone "
            "who can reach it would be admitted without the salt; drop --bind (tunnel_only binds 127.0.0.1) "
            "or bind 127.0.0.1 / ::1, or drop tunnel_only and set controller.join.token (--token)"
        )
    if join.token is not None:
        # Even behind sshd a configured token is checked: sshd and the token are two layers.
        return TrustMode.PRESHARED, None
    if join.open_admission:
        if bound_loopback:
            return TrustMode.OPEN, None
        if bound_address is None:
            return TrustMode.OPEN, OPEN_ADMISSION_WARNING
        return TrustMode.OPEN, OPEN_ADMISSION_WARNING + " " + OPEN_NETWORK_BIND_WARNING.format(
            bound=bound_address
        )
    if (loopback_bind or join.tunnel_only) and bound_loopback and not preshared:
        # The only road to a loopback port is through sshd: reachability is the authentication.
        return TrustMode.OPEN, None
    return TrustMode.PRESHARED, None
