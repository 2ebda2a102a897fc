"""The run supervisor's rules, one row per story: events in, actions out (no processes, no clocks)."""

from __future__ import annotations

import pytest

from flodld.membership.supervisor import (
    AGENT_DIED_GRACE_S,
    AGENTS_GONE_GRACE_S,
    COLLECT_TIMEOUT_S,
    AgentExited,
    ArmTimer,
    CollectAgents,
    Event,
    Finish,
    Interrupted,
    RunSupervisor,
    Say,
    StartAttempt,
    StopAttempt,
    SupervisorState,
    TimerExpired,
    VerdictReached,
    next_attempt,
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


@pytest.mark.parametrize(
    ("story", "max_restarts", "events", "exit_code", "summary", "attempts"),
    [
        (
            "clean run",
            0,
            [DONE, AgentExited("a", 0)],
            0,
            "run done: every host link closed",
            [0],
        ),
        (
            "agents exit before the verdict",
            0,
            [AgentExited("a", 0), DONE],
            0,
            "run done: every host link closed",
            [0],
        ),
        (
            "a failure without restarts fails the run with its cause",
            0,
            [VerdictReached(False, "1 of 2 ranks failed"), AgentExited("a", 1)],
            1,
            "run FAILED: 1 of 2 ranks failed",
            [0],
        ),
        (
            "a failure with a restart left starts attempt 2, which succeeds",
            2,
            [
                VerdictReached(False, "rank 1 exited with signal 9"),
                AgentExited("a", 1),
                DONE,
                AgentExited("a", 0),
            ],
            0,
            "run done: every host link closed (after 1 restart(s): attempt 1: rank 1 exited with signal 9)",
            [0, 1],
        ),
        (
            "exhausted restarts list every attempt's cause",
            1,
            [
                VerdictReached(False, "rank 0 exited with exit code 3"),
                AgentExited("a", 1),
                VerdictReached(False, "rank 1 exited with signal 9"),
                AgentExited("a", 1),
            ],
            1,
            "run FAILED after 2 attempts (max_restarts (1) exhausted): attempt 1: rank 0 exited with exit "
            "code 3; attempt 2: rank 1 exited with signal 9",
            [0, 1],
        ),
        (
            "an ok verdict with a killed agent is a failure (its ranks were never reported)",
            0,
            [DONE, AgentExited("a", -9)],
            1,
            "run FAILED: the agent of host 'a' died (signal 9); the controller saw its host link close "
            "(every host link closed)",
            [0],
        ),
        (
            "a killed agent is restarted like a failed rank",
            1,
            [AgentExited("a", -9), TimerExpired("agent-died:a"), VerdictReached(False, "stopped"),
             DONE, AgentExited("a", 0)],
            0,
            "run done: every host link closed (after 1 restart(s): attempt 1: stopped)",
            [0, 1],
        ),
    ],
)
def test_the_run_supervisors_rules(
    story: str, max_restarts: int, events: list[Event], exit_code: int, summary: str, attempts: list[int]
) -> None:
    supervisor = RunSupervisor(["a"], max_restarts=max_restarts)
    actions = drive(supervisor, events)
    done = finish(actions)
    assert (done.exit_code, done.summary) == (exit_code, summary), story
    assert starts(actions) == attempts, story
    assert supervisor.state is SupervisorState.FINISHED


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
    assert supervisor.handle(AgentExited("a", -9)) == [ArmTimer("agent-died:a", AGENT_DIED_GRACE_S)]
    assert supervisor.handle(TimerExpired("agent-died:a")) == [
        StopAttempt("the agent of host 'a' died (signal 9) without reporting its ranks")
    ]
    assert supervisor.handle(TimerExpired("agent-died:a")) == []  # stopping once is enough


def test_a_verdict_within_the_grace_needs_no_stop() -> None:
    supervisor = RunSupervisor(["a", "b"])
    supervisor.start()
    supervisor.handle(AgentExited("a", 1))
    assert supervisor.handle(VerdictReached(False, "rank 0 failed")) == [CollectAgents(COLLECT_TIMEOUT_S)]
    assert supervisor.handle(TimerExpired("agent-died:a")) == []  # the verdict came first


def test_every_agent_gone_without_a_verdict_stops_the_attempt() -> None:
    supervisor = RunSupervisor(["a"])
    supervisor.start()
    assert supervisor.handle(AgentExited("a", 0)) == [ArmTimer("agents-gone", AGENTS_GONE_GRACE_S)]
    assert supervisor.handle(TimerExpired("agents-gone")) == [
        StopAttempt("every local agent exited but the run did not conclude")
    ]


def test_an_interrupt_stops_the_attempt_and_is_never_restarted() -> None:
    supervisor = RunSupervisor(["a"], max_restarts=5)
    actions = drive(
        supervisor,
        [Interrupted("interrupted"), VerdictReached(False, "interrupted (fdl run)"), AgentExited("a", 1)],
    )
    assert StopAttempt("interrupted (fdl run)") in actions
    assert starts(actions) == [0]
    assert finish(actions).summary == "run FAILED: interrupted (fdl run)"


def test_an_interrupt_while_agents_are_collected_still_forbids_a_restart() -> None:
    supervisor = RunSupervisor(["a"], max_restarts=5)
    actions = drive(
        supervisor, [VerdictReached(False, "rank failed"), Interrupted("interrupted"), AgentExited("a", 1)]
    )
    assert starts(actions) == [0]
    assert finish(actions).summary == "run FAILED: rank failed"


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


def test_fdl_runs_shell_has_a_handler_for_every_action_the_supervisor_can_decide() -> None:
    from typing import get_args

    from fdl.run import RUN_ACTIONS

    from flodld.membership.supervisor import Action

    assert set(RUN_ACTIONS) == {kind.__name__ for kind in get_args(Action)}
