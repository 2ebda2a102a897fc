from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from flodld.membership.ledger import ADMISSION_CHECKS, Admitted, Ledger, Refused
from flodld.wire.join import JOIN_PROTOCOL_VERSION, Hello
from tests.flodld.membership.helpers import SIG_A, SIG_B, hello, policy


def admit(ledger: Ledger, message: Hello, now: float = 0.0) -> tuple[int, ...]:
    outcome = ledger.admit(message, now)
    assert isinstance(outcome, Admitted), outcome
    return outcome.ranks


def refuse(ledger: Ledger, message: Hello) -> Refused:
    outcome = ledger.admit(message, 0.0)
    assert isinstance(outcome, Refused), outcome
    return outcome


def test_ranks_are_contiguous_in_admission_order() -> None:
    ledger = Ledger(policy(capacity=6))
    assert admit(ledger, hello("a", 1)) == (0,)
    assert admit(ledger, hello("b", 2)) == (1, 2)
    assert admit(ledger, hello("c", 3)) == (3, 4, 5)
    assert ledger.joined_ranks == 6


def test_a_refusal_burns_no_rank_ids() -> None:
    ledger = Ledger(policy(capacity=3))
    admit(ledger, hello("a"))
    assert refuse(ledger, hello("a")).code == "duplicate_host"
    assert admit(ledger, hello("b")) == (1,)


def test_retract_returns_ranks_and_later_members_shift_down() -> None:
    ledger = Ledger(policy(capacity=4))
    admit(ledger, hello("a", 1))
    admit(ledger, hello("b", 2))
    admit(ledger, hello("c", 1))
    assert ledger.retract("b") == (1, 2)
    assert ledger.ranks_of("c") == (1,)
    assert admit(ledger, hello("d", 2)) == (2, 3)
    world = ledger.freeze()
    assert world.hosts == ("a", "c", "d")
    assert world.ranks == {"a": (0,), "c": (1,), "d": (2, 3)}
    assert world.world_size == 4


def test_retracting_the_seeding_member_releases_its_references() -> None:
    ledger = Ledger(policy(capacity=2))
    admit(ledger, hello("a", dataset_sig=SIG_A))
    assert refuse(ledger, hello("b", dataset_sig=SIG_B)).code == "dataset_mismatch"
    ledger.retract("a")
    assert admit(ledger, hello("b", dataset_sig=SIG_B)) == (0,)


def test_retract_errors_name_the_problem() -> None:
    ledger = Ledger(policy(capacity=2))
    admit(ledger, hello("a"))
    with pytest.raises(KeyError, match="'ghost' is not a member"):
        ledger.retract("ghost")
    ledger.freeze()
    with pytest.raises(ValueError, match="frozen"):
        ledger.retract("a")


def test_freeze_closes_the_window() -> None:
    ledger = Ledger(policy(capacity=2))
    admit(ledger, hello("a"))
    assert ledger.freeze().hosts == ("a",)
    refused = refuse(ledger, hello("b"))
    assert refused.code == "window_closed"
    assert ledger.refused_counts == {"window_closed": 1}


@dataclass(frozen=True)
class RefusalCase:
    """One admission refusal: REFUSED is refused with CODE after EARLIER were admitted."""

    name: str
    refused: Hello
    code: str
    fragments: tuple[str, ...]  # each one in the refusal's sentence
    earlier: tuple[Hello, ...] = ()
    roster: list[str] = field(default_factory=list)
    configured: dict[str, Any] = field(default_factory=dict)  # the ledger's own expectations


REFUSALS = [
    RefusalCase("protocol_version", hello("a", protocol_version=99), "protocol_version", ("99", "version")),
    RefusalCase(
        "duplicate_host",
        hello("a"),
        "duplicate_host",
        ("'a'", "already joined"),
        earlier=(hello("a"),),
    ),
    RefusalCase("unknown_host", hello("x"), "unknown_host", ("'x'", "target_ranks"), roster=["a", "b"]),
    RefusalCase("empty_devices", hello("a", 0), "empty_devices", ("'a'", "no devices")),
    RefusalCase("too_many_devices", hello("a", 257), "too_many_devices", ("257", "256")),
    RefusalCase(
        "declared_devices",
        hello("a", 2),
        "declared_devices",
        ("'a'", "declared with 1 rank(s)", "offers 2 devices", "--devices"),
        roster=["a", "b"],
        configured={"declared": {"a": 1, "b": 1}},
    ),
    RefusalCase("vendor_mix_inside_hello", hello("a", ["cpu:0", "cuda:0"]), "vendor_mix", ("cpu and cuda",)),
    RefusalCase(
        "vendor_mix_against_cohort",
        hello("b"),
        "vendor_mix",
        ("cohort is cuda", "'a'", "offers cpu"),
        earlier=(hello("a", ["cuda:0"]),),
    ),
    RefusalCase(
        "dataset_first_member",
        hello("b", dataset_sig=SIG_B),
        "dataset_mismatch",
        ("bbbbbbbb", "aaaaaaaa", "'a'"),
        earlier=(hello("a", dataset_sig=SIG_A),),
    ),
    RefusalCase(
        "dataset_configured",
        hello("b", dataset_sig=SIG_B),
        "dataset_mismatch",
        ("the controller",),
        configured={"dataset_sig": SIG_A},
    ),
    RefusalCase(
        "run_id",
        hello("b", run_id="run-2"),
        "run_id_mismatch",
        ("run-2", "run-1"),
        earlier=(hello("a", run_id="run-1"),),
    ),
    RefusalCase(
        "run_id_configured",
        hello("b", run_id="run-2"),
        "run_id_mismatch",
        ("the controller",),
        configured={"run_id": "run-1"},
    ),
    RefusalCase(
        "nccl_skew",
        hello("b", nccl_version="2.26.2"),
        "nccl_skew",
        ("2.27", "2.26", "install the same torch build", "`fdl probe`"),
        earlier=(hello("a", nccl_version="2.27.5"),),
    ),
    RefusalCase(
        "model_first_member",
        hello("b", model_sig=SIG_B),
        "model_mismatch",
        ("model mismatch",),
        earlier=(hello("a", model_sig=SIG_A),),
    ),
    RefusalCase(
        "model_configured",
        hello("b", model_sig=SIG_B),
        "model_mismatch",
        ("the controller",),
        configured={"model_sig": SIG_A},
    ),
]


@pytest.mark.parametrize("case", REFUSALS, ids=[case.name for case in REFUSALS])
def test_every_admission_refusal_has_a_code_and_a_sentence(case: RefusalCase) -> None:
    ledger = Ledger(policy(capacity=2), case.roster, **case.configured)
    for message in case.earlier:
        admit(ledger, message)
    outcome = refuse(ledger, case.refused)
    assert outcome.code == case.code
    for fragment in case.fragments:
        assert fragment in outcome.reason
    assert ledger.refused_counts == {case.code: 1}
    assert ledger.joined_ranks == len(case.earlier)


def test_a_declared_roster_host_is_admitted_with_its_count_or_fewer_never_more() -> None:
    ledger = Ledger(policy(capacity=3), ["a", "b"], declared={"a": 1, "b": 2})
    assert refuse(ledger, hello("a", 2)).code == "declared_devices"
    assert admit(ledger, hello("a", 1)) == (0,)
    assert admit(ledger, hello("b", 1)) == (1,)  # a degraded host still counts toward quorum
    assert ledger.joined_ranks == 2


def test_a_host_without_a_declared_count_offers_what_it_has() -> None:
    ledger = Ledger(policy(capacity=2, target_ranks=4), ["a"], declared={})
    assert admit(ledger, hello("a", 2)) == (0, 1)


def test_checks_run_in_the_documented_order() -> None:
    assert [check.__name__ for check in ADMISSION_CHECKS] == [
        "_window_open",
        "_protocol_version",
        "_duplicate_host",
        "_roster",
        "_device_list",
        "_declared_devices",
        "_world_limit",
        "_vendor_mix",
        "_dataset",
        "_run_id",
        "_nccl",
        "_model",
    ]


def test_the_first_failing_check_decides() -> None:
    """A hello that fails every check is refused for each reason in turn as the earlier ones are fixed."""
    ledger = Ledger(policy(capacity=2), ["a", "b"])
    admit(
        ledger, hello("a", ["cuda:0"], dataset_sig=SIG_A, run_id="r1", nccl_version="2.27", model_sig=SIG_A)
    )
    fields: dict[str, Any] = {
        "host": "a",
        "devices": [],
        "protocol_version": JOIN_PROTOCOL_VERSION + 1,  # a version this build does not speak
        "dataset_sig": SIG_B,
        "run_id": "r2",
        "nccl_version": "2.26",
        "model_sig": SIG_B,
    }
    steps: list[tuple[str, dict[str, Any]]] = [
        ("protocol_version", {"protocol_version": hello("z").protocol_version}),
        ("duplicate_host", {"host": "x"}),
        ("unknown_host", {"host": "b"}),
        ("empty_devices", {"devices": ["cpu:0"]}),
        ("vendor_mix", {"devices": ["cuda:0"]}),
        ("dataset_mismatch", {"dataset_sig": SIG_A}),
        ("run_id_mismatch", {"run_id": "r1"}),
        ("nccl_skew", {"nccl_version": "2.27.9"}),
        ("model_mismatch", {"model_sig": SIG_A}),
    ]
    for code, fix in steps:
        host, devices = fields["host"], fields["devices"]
        rest = {k: v for k, v in fields.items() if k not in ("host", "devices")}
        assert refuse(ledger, hello(host, devices, **rest)).code == code
        fields.update(fix)
    host, devices = fields.pop("host"), fields.pop("devices")
    assert admit(ledger, hello(host, devices, **fields)) == (1,)


def test_absent_signatures_gate_nothing() -> None:
    ledger = Ledger(policy(capacity=3))
    admit(ledger, hello("a", nccl_version="2.27.5", dataset_sig=SIG_A, model_sig=SIG_A, run_id="r"))
    assert admit(ledger, hello("b")) == (1,)
    assert admit(ledger, hello("c", nccl_version="2.27.3")) == (2,)


def test_walk_ins_join_when_the_target_exceeds_the_roster() -> None:
    ledger = Ledger(policy(capacity=2, target_ranks=3), ["a", "b"])
    assert admit(ledger, hello("walk-in")) == (0,)


def test_discovery_and_rosterless_windows_admit_anyone() -> None:
    assert admit(Ledger(policy(capacity=2, discovery=True, min_rank_start=1), ["a"]), hello("x")) == (0,)
    assert admit(Ledger(policy(capacity=2), []), hello("x")) == (0,)


def test_refusals_are_counted_by_reason() -> None:
    ledger = Ledger(policy(capacity=2), ["a", "b"])
    admit(ledger, hello("a"))
    refuse(ledger, hello("a"))
    refuse(ledger, hello("a"))
    refuse(ledger, hello("x"))
    ledger.refuse("bad_first_frame", "the first frame was not a Hello")
    assert ledger.refused_counts == {"duplicate_host": 2, "unknown_host": 1, "bad_first_frame": 1}


def test_admission_totals_only_go_up_a_retraction_keeps_them() -> None:
    """`admitted_hosts`/`admitted_ranks` feed the /metrics counters: never lowered by a retraction."""
    ledger = Ledger(policy(capacity=6))
    admit(ledger, hello("a", 1))
    admit(ledger, hello("b", 2))
    refuse(ledger, hello("a"))
    ledger.retract("a")
    admit(ledger, hello("c", 3))
    assert (ledger.admitted_hosts, ledger.admitted_ranks) == (3, 6)
    assert (ledger.member_count, ledger.joined_ranks) == (2, 5)
