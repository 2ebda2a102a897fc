"""The run supervisor's rules, one row per story: events in, actions out (no processes, no clocks).

One table for every launcher: `fdl run`'s local agents, `fdl @cluster run`'s SSH fan-out and `flodld serve`
(whose only events are verdicts, decided by the same `next_attempt`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from flodld.membership.supervisor import (
    AGENT_DIED_GRACE_S,
    COLLECT_DEADLINE,
    COLLECT_DEADLINE_S,
    COLLECT_TIMEOUT_S,
    AgentExited,
    ArmTimer,
    CollectAgents,
    Event,
    Finish,
    HostLost,
    Interrupted,
    RunSupervisor,
    Say,
    StartAttempt,
    StopAttempt,
    SupervisorState,
    TimerExpired,
    VerdictReached,
    WorldFormed,
    keeps_links,
    next_attempt,
    verdict_event,
)


def drive(supervisor: RunSupervisor, events: list[Event]) -> list[object]:
    actions: list[object] = list(supervisor.start())
    for event in events:
        actions += supervisor.handle(event)
    return actions


def finish(actions: list[object]) -> Finish:
    finishes = [action for action in actions if isinstance(action, Finish)]
    assert len(finishes) == 1, actions
    return finishes[0]


def starts(actions: list[object]) -> list[int]:
    return [action.restart_count for action in actions if isinstance(action, StartAttempt)]


DONE = VerdictReached(True, "every host link closed")
COLLECT = [CollectAgents(COLLECT_TIMEOUT_S), ArmTimer(COLLECT_DEADLINE, COLLECT_DEADLINE_S)]  # at a verdict
FORMED = WorldFormed()
LOST = "SSH session to host 'a' lost (keepalives unanswered)"
SHELLS = ("fdl run", "fan-out", "serve")
LAUNCHERS = ("fdl run", "fan-out")  # the shells that start agents (serve's only events are verdicts)


@dataclass(frozen=True)
class Row:
    story: str
    max_restarts: int
    events: list[Event]
    exit_code: int
    summary: str
    attempts: list[int]
    stops: list[str] = field(default_factory=list)  # the StopAttempt reasons, in order
    shells: tuple[str, ...] = SHELLS  # the launchers whose shells feed these events


ROWS = [
    Row("clean run", 0, [FORMED, DONE, AgentExited("a", 0)], 0, "run done: every host link closed", [0]),
    Row("agents exit before the verdict", 0, [FORMED, AgentExited("a", 0), DONE], 0,
        "run done: every host link closed", [0]),
    Row("a failure without restarts fails the run with its cause", 0,
        [FORMED, VerdictReached(False, "1 of 2 ranks failed"), AgentExited("a", 1)], 1,
        "run FAILED: 1 of 2 ranks failed", [0]),
    Row("a failure with a restart left starts attempt 2, which succeeds", 2,
        [FORMED, VerdictReached(False, "rank 1 exited with signal 9"), AgentExited("a", 1),
         FORMED, DONE, AgentExited("a", 0)], 0,
        "run done: every host link closed (after 1 restart(s): attempt 1: rank 1 exited with signal 9)",
        [0, 1]),
    Row("exhausted restarts list every attempt's cause", 1,
        [FORMED, VerdictReached(False, "rank 0 exited with exit code 3"), AgentExited("a", 1),
         FORMED, VerdictReached(False, "rank 1 exited with signal 9"), AgentExited("a", 1)], 1,
        "run FAILED after 2 attempts (max_restarts (1) exhausted): attempt 1: rank 0 exited with exit "
        "code 3; attempt 2: rank 1 exited with signal 9", [0, 1]),
    Row("an interrupt stops the attempt and is never restarted", 5,
        [FORMED, Interrupted("interrupted"), VerdictReached(False, "interrupted (fdl run)"),
         AgentExited("a", 1)], 1, "run FAILED: interrupted (fdl run)", [0], stops=["interrupted (fdl run)"]),
    Row("an ok verdict with a killed agent is a failure (its ranks were never reported)", 0,
        [FORMED, DONE, AgentExited("a", -9)], 1,
        "run FAILED: the agent of host 'a' died (signal 9); the controller saw its host link close "
        "(every host link closed)", [0], shells=LAUNCHERS),
    Row("a killed agent is restarted like a failed rank", 1,
        [FORMED, AgentExited("a", -9), TimerExpired("agent-died:a"), VerdictReached(False, "stopped"),
         FORMED, DONE, AgentExited("a", 0)], 0,
        "run done: every host link closed (after 1 restart(s): attempt 1: stopped)", [0, 1],
        stops=["the agent of host 'a' died (signal 9) without reporting its ranks"], shells=LAUNCHERS),
    Row("an agent that exits before the world formed stops the attempt at once, naming it", 0,
        [AgentExited("a", 3), VerdictReached(False, "aborted")], 1, "run FAILED: aborted", [0],
        stops=["the agent of host 'a' exited (exit code 3) before the world formed"], shells=LAUNCHERS),
    Row("every agent gone without a verdict stops the attempt after a grace", 0,
        [FORMED, AgentExited("a", 0), TimerExpired("agents-gone"), VerdictReached(False, "aborted")], 1,
        "run FAILED: aborted", [0], stops=["every agent exited but the run did not conclude"],
        shells=LAUNCHERS),
    Row("a lost SSH session stops the attempt at once; a restart re-launches the host", 1,
        [FORMED, HostLost("a", LOST), VerdictReached(False, f"aborted: {LOST}"),
         FORMED, DONE, AgentExited("a", 0)],
        0, f"run done: every host link closed (after 1 restart(s): attempt 1: aborted: {LOST})", [0, 1],
        stops=[LOST], shells=("fan-out",)),
    Row("a host that cannot be reached fails its attempt; exhausted, every cause is named", 1,
        [HostLost("a", "fan-out to host 'a': refused"), VerdictReached(False, "aborted: refused"),
         HostLost("a", "fan-out to host 'a': refused"), VerdictReached(False, "aborted: refused")], 1,
        "run FAILED after 2 attempts (max_restarts (1) exhausted): attempt 1: aborted: refused; attempt 2: "
        "aborted: refused", [0, 1], stops=["fan-out to host 'a': refused"] * 2, shells=("fan-out",)),
    Row("a host kept linked (it answered Reform) is not collected; the next attempt starts at once", 1,
        [FORMED, VerdictReached(False, "rank 0 failed", kept=("a",)), FORMED, DONE, AgentExited("a", 0)], 0,
        "run done: every host link closed (after 1 restart(s): attempt 1: rank 0 failed)", [0, 1],
        shells=LAUNCHERS),
    Row("a root cause is reported as the verdict comes in and named in the cause", 0,
        [FORMED, verdict_event(False, "1 of 2 ranks failed", {"summary": "rank 1 on host 'a' (exit code 1)"}),
         AgentExited("a", 1)], 1,
        "run FAILED: 1 of 2 ranks failed; root cause: rank 1 on host 'a' (exit code 1)", [0]),
]  # fmt: skip


def serve(row: Row) -> tuple[int, list[int]]:
    """`flodld serve`'s loop over the row's verdicts (its runs have no agents it starts): the exit code and
    the attempts, by `next_attempt`.
    """
    attempts, stopping = [0], False
    for event in row.events:
        stopping = stopping or isinstance(event, Interrupted)
        if isinstance(event, VerdictReached):
            following = next_attempt(attempts[-1], row.max_restarts, ok=event.ok, stopping=stopping)
            if following is None:
                return (0 if event.ok else 1), attempts
            attempts.append(following)
    raise AssertionError(f"{row.story}: the job never ended")


@pytest.mark.parametrize(
    ("row", "shell"), [(row, shell) for row in ROWS for shell in row.shells],
    ids=[f"{shell}: {row.story}" for row in ROWS for shell in row.shells],
)  # fmt: skip
def test_the_run_rules_one_table_for_local_agents_fan_out_and_serve(row: Row, shell: str) -> None:
    if shell == "serve":
        assert serve(row) == (row.exit_code, row.attempts), row.story
        return
    supervisor = RunSupervisor(["a"], max_restarts=row.max_restarts)
    actions = drive(supervisor, row.events)
    done = finish(actions)
    assert (done.exit_code, done.summary) == (row.exit_code, row.summary), row.story
    assert starts(actions) == row.attempts, row.story
    assert [a.reason for a in actions if isinstance(a, StopAttempt)] == row.stops, row.story
    assert supervisor.state is SupervisorState.FINISHED


def test_a_remote_agents_exit_status_reads_as_a_local_ones() -> None:
    from flodld.fanout.cluster_run import supervisor_code

    assert [supervisor_code(code) for code in (0, 1, 137, 143, 255)] == [0, 1, -9, -15, 255]


def test_each_attempt_starts_with_its_restart_count_and_the_bound() -> None:
    supervisor = RunSupervisor(["a", "b"], max_restarts=2)
    actions = drive(
        supervisor,
        [VerdictReached(False, "x"), AgentExited("a", 1), AgentExited("b", 1),
         VerdictReached(False, "y"), AgentExited("b", 1), AgentExited("a", 1)],
    )
    assert [a for a in actions if isinstance(a, StartAttempt)] == [
        StartAttempt(0, 2), StartAttempt(1, 2), StartAttempt(2, 2)
    ]
    assert [a.cause for a in supervisor.attempts] == ["x", "y", None]
    said = [a.message for a in actions if isinstance(a, Say)]
    assert any(message.startswith("restarting: attempt 2 of at most 3") for message in said)


def test_an_agent_that_dies_gets_a_grace_for_the_verdict_then_stops_the_attempt_by_name() -> None:
    supervisor = RunSupervisor(["a", "b"])
    supervisor.start()
    assert supervisor.handle(FORMED) == []
    assert supervisor.handle(AgentExited("a", -9)) == [ArmTimer("agent-died:a", AGENT_DIED_GRACE_S)]
    assert supervisor.handle(TimerExpired("agent-died:a")) == [
        StopAttempt("the agent of host 'a' died (signal 9) without reporting its ranks")
    ]
    assert supervisor.handle(TimerExpired("agent-died:a")) == []  # stopping once is enough


def test_a_verdict_within_the_grace_needs_no_stop() -> None:
    supervisor = RunSupervisor(["a", "b"])
    supervisor.start()
    supervisor.handle(FORMED)
    supervisor.handle(AgentExited("a", 1))
    assert supervisor.handle(VerdictReached(False, "rank 0 failed")) == COLLECT
    assert supervisor.handle(TimerExpired("agent-died:a")) == []  # the verdict came first


def test_a_lost_host_counts_as_gone_while_its_attempt_is_concluded() -> None:
    supervisor = RunSupervisor(["a", "b"])
    drive(supervisor, [FORMED, VerdictReached(False, "rank 0 failed"), AgentExited("a", 1)])
    assert supervisor.handle(HostLost("b", LOST)) == [Finish(1, "run FAILED: rank 0 failed")]


def test_an_agent_whose_end_never_comes_is_counted_lost_at_the_deadline_and_named() -> None:
    # A shell that cannot learn an agent's end (CI saw a fan-out wait 5 minutes without a word) does not
    # hold the run: the deadline after the verdict concludes it, naming the host.
    supervisor = RunSupervisor(["a", "b"], max_restarts=1)
    actions = drive(supervisor, [FORMED, VerdictReached(False, "rank 0 failed"), AgentExited("a", 1)])
    assert actions[-2:] == COLLECT and not starts(actions)[1:]
    assert supervisor.handle(TimerExpired("agent-died:b")) == []  # another timer means nothing here
    concluded: list[object] = list(supervisor.handle(TimerExpired(COLLECT_DEADLINE)))
    assert concluded[0] == Say(
        f"the end of the agent(s) of host(s) 'b' is still unknown {COLLECT_DEADLINE_S:g}s after the verdict; "
        "counted as lost"
    )
    assert starts(concluded) == [1]  # the attempt concluded: the restart follows, b started afresh
    assert [a for a in concluded if isinstance(a, StartAttempt)] == [StartAttempt(1, 1, kept=())]
    assert supervisor.attempts[0].agent_codes == {"a": 1, "b": 255}
    assert supervisor.handle(TimerExpired(COLLECT_DEADLINE)) == []  # a stale deadline in the next attempt


def test_a_second_loss_while_stopping_stops_nothing_more() -> None:
    supervisor = RunSupervisor(["a", "b"])
    actions = drive(supervisor, [FORMED, HostLost("a", LOST), HostLost("b", "SSH session to host 'b' lost")])
    assert [a for a in actions if isinstance(a, StopAttempt)] == [StopAttempt(LOST)]


def test_an_interrupt_while_agents_are_collected_still_forbids_a_restart() -> None:
    supervisor = RunSupervisor(["a"], max_restarts=5)
    actions = drive(
        supervisor, [VerdictReached(False, "rank failed"), Interrupted("interrupted"), AgentExited("a", 1)]
    )
    assert starts(actions) == [0]
    assert finish(actions).summary == "run FAILED: rank failed"


def test_a_restart_keeps_the_hosts_that_answered_reform_and_starts_only_the_others() -> None:
    supervisor = RunSupervisor(["a", "b", "c"], max_restarts=1)
    supervisor.start()
    supervisor.handle(FORMED)
    assert supervisor.handle(AgentExited("c", -9)) == [ArmTimer("agent-died:c", AGENT_DIED_GRACE_S)]
    # a and b answered Reform and stay linked: only what is neither kept nor gone would be collected
    actions = supervisor.handle(VerdictReached(False, "host 'c' lost", kept=("a", "b")))
    assert [a for a in actions if isinstance(a, StartAttempt)] == [StartAttempt(1, 1, kept=("a", "b"))]
    assert not [a for a in actions if isinstance(a, CollectAgents)]
    # the kept agents are the next attempt's: their exits count there
    supervisor.handle(FORMED)
    assert supervisor.handle(AgentExited("a", -9)) == [ArmTimer("agent-died:a", AGENT_DIED_GRACE_S)]


def test_a_kept_host_that_was_not_live_is_not_kept_and_others_are_collected() -> None:
    supervisor = RunSupervisor(["a", "b"], max_restarts=1)
    actions = drive(supervisor, [FORMED, AgentExited("b", 1), VerdictReached(False, "x", kept=("a", "b"))])
    assert [a for a in actions if isinstance(a, StartAttempt)][-1] == StartAttempt(1, 1, kept=("a",))


def test_an_interrupt_asks_for_abort_and_keeps_no_host() -> None:
    supervisor = RunSupervisor(["a", "b"], max_restarts=3)
    actions = drive(supervisor, [FORMED, Interrupted("interrupted")])
    assert [a for a in actions if isinstance(a, StopAttempt)] == [
        StopAttempt("interrupted (fdl run)", keep_links=False)
    ]
    assert supervisor.handle(VerdictReached(False, "interrupted (fdl run)", kept=("a",))) == COLLECT
    # both collected: no attempt follows an interrupt


def test_a_failure_stop_lets_the_controller_keep_the_links() -> None:
    supervisor = RunSupervisor(["a"], max_restarts=1)
    actions = drive(supervisor, [FORMED, HostLost("a", LOST)])
    assert [a for a in actions if isinstance(a, StopAttempt)] == [StopAttempt(LOST, keep_links=True)]


def test_a_host_unreachable_at_a_restart_is_left_out_and_named_when_the_attempt_fails() -> None:
    refused = "fan-out to host 'b': connection refused"
    supervisor = RunSupervisor(["a", "b"], max_restarts=2)
    actions = drive(supervisor, [FORMED, VerdictReached(False, "rank 1 failed"), AgentExited("a", 1),
                                 AgentExited("b", 1)])  # fmt: skip
    assert starts(actions) == [0, 1]
    lost = supervisor.handle(HostLost("b", refused))
    assert not [a for a in lost if isinstance(a, StopAttempt)], lost  # the window decides, not the loss
    assert [a.message for a in lost if isinstance(a, Say)] == [
        f"{refused}; host 'b' left out of attempt 2 (the world forms without it if the quorum allows)"
    ]
    assert supervisor.attempt.left_out == {"b": refused}
    # below quorum at the window's cap: the attempt fails, the left-out host named in its cause
    capped = "quorum not met: 1 of 2 ranks joined after 20s hard cap"
    assert supervisor.handle(VerdictReached(False, capped))[-2:] == COLLECT
    supervisor.handle(AgentExited("a", 1))
    assert supervisor.attempts[1].cause == (
        f"quorum not met: 1 of 2 ranks joined after 20s hard cap (left out: host 'b': {refused})"
    )


def test_a_host_unreachable_at_a_restart_with_quorum_lets_the_world_form_without_it() -> None:
    supervisor = RunSupervisor(["a", "b"], max_restarts=1)
    drive(supervisor, [FORMED, VerdictReached(False, "x"), AgentExited("a", 1), AgentExited("b", 1)])
    supervisor.handle(HostLost("b", "fan-out to host 'b': refused"))
    actions: list[object] = [*supervisor.handle(FORMED), *supervisor.handle(DONE)]
    actions += supervisor.handle(AgentExited("a", 0))
    assert finish(actions).exit_code == 0


def test_on_the_first_attempt_or_with_no_host_left_an_unreachable_host_still_stops_the_attempt() -> None:
    first = RunSupervisor(["a", "b"], max_restarts=1)
    actions = drive(first, [HostLost("b", "refused")])
    assert [a for a in actions if isinstance(a, StopAttempt)] == [StopAttempt("refused")]
    alone = RunSupervisor(["a"], max_restarts=1)
    drive(alone, [FORMED, VerdictReached(False, "x"), AgentExited("a", 1)])
    assert [a for a in alone.handle(HostLost("a", "refused")) if isinstance(a, StopAttempt)] == [
        StopAttempt("refused")
    ]


def test_events_of_a_finished_run_change_nothing() -> None:
    supervisor = RunSupervisor(["a"])
    drive(supervisor, [DONE, AgentExited("a", 0)])
    for event in (AgentExited("a", 1), DONE, Interrupted("x"), TimerExpired("agents-gone")):
        assert supervisor.handle(event) == []


def test_a_negative_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="max_restarts is -1"):
        RunSupervisor(["a"], max_restarts=-1)


@pytest.mark.parametrize(
    ("restart_count", "max_restarts", "ok", "stopping", "expected"),
    [
        (0, 0, False, False, None),  # no restarts configured: a failure ends the job
        (0, 2, False, False, 1),
        (1, 2, False, False, 2),
        (2, 2, False, False, None),  # used up
        (0, 2, True, False, None),  # done: the job is over, the next run starts at 0
        (0, 2, False, True, None),  # the service is stopping: no restart
    ],
)
def test_serve_restarts_a_failed_attempt_while_restarts_remain(
    restart_count: int, max_restarts: int, ok: bool, stopping: bool, expected: int | None
) -> None:
    assert next_attempt(restart_count, max_restarts, ok=ok, stopping=stopping) == expected


@pytest.mark.parametrize(
    ("restart_count", "max_restarts", "stopping", "expected"),
    [
        (0, 0, False, False),  # no restarts configured: a failure aborts the hosts (Abort)
        (0, 2, False, True),  # a failure is followed by attempt 2: Reform, the hosts stay linked
        (1, 2, False, True),
        (2, 2, False, False),  # the last allowed attempt: its failure ends the job, Abort
        (0, 2, True, False),  # the service is stopping: Abort, never Reform
    ],
)
def test_serve_keeps_the_links_exactly_when_a_failure_would_be_restarted(
    restart_count: int, max_restarts: int, stopping: bool, expected: bool
) -> None:
    assert keeps_links(restart_count, max_restarts, stopping=stopping) is expected
    following = next_attempt(restart_count, max_restarts, ok=False, stopping=stopping)
    assert (following is not None) is expected


def test_every_shell_has_a_handler_for_every_action_the_supervisor_can_decide() -> None:
    from typing import get_args

    from fdl.run import RUN_ACTIONS

    from flodld.fanout.cluster_run import FANOUT_ACTIONS
    from flodld.membership.supervisor import Action

    assert set(RUN_ACTIONS) == {kind.__name__ for kind in get_args(Action)}
    assert set(FANOUT_ACTIONS) == set(get_args(Action))
