"""The walk-in's allowlist of controller env names (issue 29, point 5), as pure logic.

A controller that authenticated with the join token is still another party: it may tune how hard and how
verbosely the ranks work, never move their traffic (interface, address family, transport, NIC, host
identity), name a file or load code, unless the walk-in's owner accepts the name.
"""

from __future__ import annotations

import pytest

from flodld.agent.envpolicy import ALLOWED_NAMES, ROUTING_MARKS, is_walk_in_safe, judge_controller_env

# What a controller could use to pull a walk-in's traffic off its VPN, onto another NIC or transport, in
# cleartext, or to make it read a key file or load a library: refused unless accepted.
ROUTING_NAMES = (
    "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_SOCKET_FAMILY", "NCCL_HOSTID", "GLOO_DEVICE_TRANSPORT",
    "GLOO_DEVICE_TRANSPORT_TCP_TLS_PKEY", "GLOO_DEVICE_TRANSPORT_TCP_TLS_CERT",
    "GLOO_DEVICE_TRANSPORT_TCP_TLS_CA_FILE", "GLOO_DEVICE_TRANSPORT_TCP_TLS_CA_PATH",
    "NCCL_NET", "NCCL_IB_HCA", "NCCL_IB_DISABLE", "NCCL_IB_GID_INDEX", "NCCL_NET_GDR_LEVEL",
    "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_COLLNET_ENABLE", "NCCL_NVLS_ENABLE", "NCCL_CROSS_NIC",
    "NCCL_COMM_ID",
    "NCCL_NET_PLUGIN", "NCCL_TOPO_FILE", "NCCL_DEBUG_FILE", "NCCL_CONF_FILE", "NCCL_UCX_TLS",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_EXTENSIONS_DIR",
    "MASTER_ADDR", "MASTER_PORT", "LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH", "TMPDIR", "FLODL_SHM",
    "NCCL_SOME_FUTURE_KNOB", "GLOO_SOME_FUTURE_KNOB",  # unknown names are refused, not guessed safe
)  # fmt: skip


@pytest.mark.parametrize("name", ROUTING_NAMES)
def test_a_name_that_selects_a_path_transport_or_file_is_refused_unless_accepted(name: str) -> None:
    assert not is_walk_in_safe(name)
    refused = judge_controller_env({name: "x", "NCCL_DEBUG": "INFO"}, authenticated=True)
    assert refused.refused == (name,) and refused.apply == {"NCCL_DEBUG": "INFO"} and not refused.ok
    accepted = judge_controller_env({name: "x"}, authenticated=True, accepted=[name])
    assert accepted.ok and accepted.apply == {name: "x"}


def test_no_allowed_name_carries_a_mark_of_a_path_a_peer_or_a_transport() -> None:
    marked = {name: [mark for mark in ROUTING_MARKS if mark in name] for name in ALLOWED_NAMES}
    assert {name: marks for name, marks in marked.items() if marks} == {}
    # and every routing name above is caught by a mark too, so the marks are not vacuous
    unmarked = [n for n in ROUTING_NAMES if "FUTURE" not in n and not any(m in n for m in ROUTING_MARKS)]
    assert unmarked == []


def test_tuning_knobs_still_apply_unasked() -> None:
    tuning = {"NCCL_DEBUG": "INFO", "NCCL_ALGO": "Ring", "NCCL_SOCKET_NTHREADS": "4", "OMP_NUM_THREADS": "2",
              "TORCH_NCCL_BLOCKING_WAIT": "1", "FLODL_NET_TIMEOUT_SCALE": "2"}  # fmt: skip
    verdict = judge_controller_env(tuning, authenticated=True)
    assert verdict.ok and verdict.apply == tuning
