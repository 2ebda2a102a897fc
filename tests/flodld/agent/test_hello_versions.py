"""What the agent's hello says about its build: a GPU host reports the NCCL torch loads, so the ledger's
`nccl_skew` check fires for real agents, and its refusal names a remedy that exists (`fdl probe`).
"""

from __future__ import annotations

import pytest
from fdl.main import COMMANDS

from flodld.agent import join as agent_join
from flodld.agent.join import build_hello
from flodld.agent.spec import AgentSpec
from flodld.membership.ledger import Admitted, Ledger, Refused
from tests.flodld.membership.helpers import policy


def _spec(host: str) -> AgentSpec:
    return AgentSpec(host=host, controller_host="127.0.0.1", controller_port=1337)


def test_a_gpu_hello_carries_the_loaded_nccl_version_and_a_cpu_hello_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(agent_join, "loaded_nccl_version", lambda: "2.27.5")
    assert build_hello(_spec("a"), ["cuda:0", "cuda:1"]).nccl_version == "2.27.5"
    assert build_hello(_spec("a"), ["cpu:0"]).nccl_version is None  # CPU ranks never load NCCL


def test_two_real_hellos_with_skewed_nccl_are_refused_with_a_remedy_that_exists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    versions = iter(["2.27.5", "2.26.2"])
    monkeypatch.setattr(agent_join, "loaded_nccl_version", lambda: next(versions))
    ledger = Ledger(policy(capacity=2))
    assert isinstance(ledger.admit(build_hello(_spec("a"), ["cuda:0"]), 0.0), Admitted)
    refused = ledger.admit(build_hello(_spec("b"), ["cuda:0"]), 0.0)
    assert isinstance(refused, Refused) and refused.code == "nccl_skew"
    assert "2.27" in refused.reason and "2.26" in refused.reason
    assert "fdl nccl build" not in refused.reason and "`fdl probe`" in refused.reason
    assert "probe" in {command.name for command in COMMANDS}  # the remedy names a command that exists


@pytest.mark.gpu
def test_a_real_gpu_hello_reports_the_nccl_torch_loads() -> None:
    import torch

    hello = build_hello(_spec("a"), ["cuda:0"])
    nccl = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    assert hello.nccl_version == ".".join(str(part) for part in nccl)
