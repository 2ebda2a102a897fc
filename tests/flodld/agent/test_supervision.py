from __future__ import annotations

from flodld.agent.supervision import (
    AbortReceived,
    AwaitWord,
    CloseLink,
    DumpStack,
    ExitDetail,
    Finish,
    GraceExpired,
    KillAll,
    KillOne,
    LinkLost,
    RankDeclaredDead,
    RankExit,
    RelayExit,
    ReportRankExit,
    StackGraceExpired,
    Supervisor,
    SupervisorState,
    TerminateAll,
    TerminateRelay,
)


def test_clean_run_reports_each_rank_stops_the_relay_then_closes_the_link() -> None:
    supervisor = Supervisor("h", [0, 1], has_relay=True)
    assert supervisor.start() == []
    assert supervisor.handle(RankExit(0, 0)) == [ReportRankExit(0, 0)]
    assert supervisor.handle(RankExit(1, 0)) == [ReportRankExit(1, 0), TerminateRelay()]
    assert supervisor.handle(RelayExit(-15)) == [CloseLink(), Finish(0, "host 'h' finished cleanly")]
    assert supervisor.state is SupervisorState.DONE


def test_a_failing_rank_is_reported_and_tears_the_host_down() -> None:
    supervisor = Supervisor("h", [4, 5], has_relay=True)
    actions = supervisor.handle(RankExit(5, 3))
    assert actions == [ReportRankExit(5, 3), TerminateAll("rank 5 exited with code 3")]
    assert supervisor.handle(GraceExpired()) == [KillAll()]
    assert supervisor.handle(RankExit(4, -15)) == [ReportRankExit(4, -15, torn_down=True)]
    final = supervisor.handle(RelayExit(-15))
    assert final[0] == CloseLink()
    assert (
        isinstance(final[1], Finish)
        and final[1].exit_code == 1
        and "rank 5 exited with code 3" in final[1].summary
    )


def test_relay_death_mid_run_tears_down_but_a_requested_stop_does_not() -> None:
    supervisor = Supervisor("h", [0], has_relay=True)
    assert supervisor.handle(RelayExit(1)) == [TerminateAll("relay died (code 1) while ranks were running")]
    assert supervisor.handle(RankExit(0, -15))[-1] == Finish(
        1, "host 'h' torn down: relay died (code 1) while ranks were running"
    )


def test_abort_and_link_loss_terminate_every_child_once() -> None:
    supervisor = Supervisor("h", [0, 1], has_relay=False)
    assert supervisor.handle(AbortReceived("quorum not met")) == [
        TerminateAll("abort from the controller: quorum not met")
    ]
    assert supervisor.handle(LinkLost("eof")) == []  # already tearing down
    supervisor.handle(RankExit(0, -15))
    assert supervisor.handle(RankExit(1, -9))[-1].exit_code == 1  # type: ignore[union-attr]


def test_link_loss_with_no_children_finishes_at_once() -> None:
    supervisor = Supervisor("h", [0], has_relay=False)
    supervisor.handle(RankExit(0, 0))
    assert supervisor.state is SupervisorState.DONE
    assert supervisor.handle(LinkLost("eof")) == []


def test_a_relay_that_stops_cleanly_before_its_ranks_exit_is_not_a_failure() -> None:
    supervisor = Supervisor("h", [0], has_relay=True)
    assert supervisor.handle(RelayExit(0)) == []  # every rank closed its legs; their exits come next
    assert supervisor.handle(RankExit(0, 0)) == [
        ReportRankExit(0, 0),
        CloseLink(),
        Finish(0, "host 'h' finished cleanly"),
    ]


def test_an_exit_after_the_teardown_began_is_marked_torn_down_and_the_culprit_is_not() -> None:
    supervisor = Supervisor("h", [0, 1, 2], has_relay=False)
    detail = ExitDetail(failed_at=1000.0, error="RuntimeError: boom", tail="Traceback\nRuntimeError: boom")
    actions = supervisor.handle(RankExit(1, 1, at=10.0, detail=detail), now=10.1)
    assert actions[0] == ReportRankExit(1, 1, torn_down=False, detail=detail)
    assert supervisor.teardown_at == 10.1
    # Rank 0 died of our SIGTERM (its exit came after the teardown began): a consequence.
    assert supervisor.handle(RankExit(0, -15, at=10.2), now=10.2)[0] == ReportRankExit(0, -15, torn_down=True)
    # Rank 2 failed on its own before the teardown began, though its event reached us after: not torn down.
    assert supervisor.handle(RankExit(2, 1, at=10.05), now=10.3)[0] == ReportRankExit(2, 1, torn_down=False)


def test_a_rank_that_failed_before_an_abort_arrived_is_not_marked_as_its_victim() -> None:
    supervisor = Supervisor("h", [0, 1], has_relay=False)
    # The controller's Abort (decided on a peer's report) is handled before this host's own failure, which
    # happened first: the failing rank keeps its culprit status, its sibling is the teardown's victim.
    supervisor.handle(AbortReceived("1 of 4 ranks failed"), now=5.0)
    assert supervisor.handle(RankExit(1, 1, at=4.9), now=5.01)[0] == ReportRankExit(1, 1, torn_down=False)
    assert supervisor.handle(RankExit(0, -15, at=5.02), now=5.02)[0] == ReportRankExit(0, -15, torn_down=True)


def test_a_run_that_tolerates_losses_keeps_a_failed_ranks_host_mates_running() -> None:
    supervisor = Supervisor("h", [0, 1, 2], has_relay=True, tolerance=1)
    assert supervisor.handle(RankExit(1, -9)) == [ReportRankExit(1, -9)]
    assert supervisor.state is SupervisorState.RUNNING
    assert supervisor.handle(RankExit(0, 0)) == [ReportRankExit(0, 0)]
    assert supervisor.handle(RankExit(2, 0)) == [ReportRankExit(2, 0), TerminateRelay()]
    final = supervisor.handle(RelayExit(0))
    assert final == [
        CloseLink(),
        Finish(0, "host 'h' finished without rank 1 (signal 9); its other ranks ran on"),
    ]


def test_a_tolerant_host_that_lost_every_rank_says_the_run_may_go_on_without_it() -> None:
    supervisor = Supervisor("h", [0, 1], has_relay=True, tolerance=2)
    assert supervisor.handle(RankExit(0, -9)) == [ReportRankExit(0, -9)]
    assert supervisor.handle(RankExit(1, 1)) == [ReportRankExit(1, 1), TerminateRelay()]
    assert supervisor.handle(RelayExit(0)) == [
        CloseLink(),
        Finish(
            0,
            "host 'h' lost every rank: rank 0 (signal 9), rank 1 (code 1); the run may go on without it",
            left_run=True,
        ),
    ]


def test_the_controllers_abort_still_tears_a_tolerant_host_down() -> None:
    supervisor = Supervisor("h", [0, 1], has_relay=True, tolerance=1)
    assert supervisor.handle(RankExit(0, 3)) == [ReportRankExit(0, 3)]
    assert supervisor.handle(AbortReceived("2 of 3 ranks failed")) == [
        TerminateAll("abort from the controller: 2 of 3 ranks failed")
    ]


def test_without_a_relay_a_tolerance_cannot_keep_host_mates() -> None:
    """A process group cannot lose a member: its survivors would hang in their next collective."""
    supervisor = Supervisor("h", [0, 1], has_relay=False, tolerance=1)
    assert supervisor.handle(RankExit(0, 3)) == [
        ReportRankExit(0, 3),
        TerminateAll("rank 0 exited with code 3"),
    ]


def test_a_rank_declared_dead_dumps_its_stack_once_then_is_killed_after_the_grace() -> None:
    supervisor = Supervisor("h", [0, 1], has_relay=True, tolerance=1)
    assert supervisor.handle(RankDeclaredDead(1, "silent for 5s")) == [DumpStack(1, "silent for 5s")]
    assert supervisor.handle(RankDeclaredDead(1, "silent for 5s")) == []  # asked once
    assert supervisor.handle(StackGraceExpired(1)) == [KillOne(1)]
    assert supervisor.handle(RankExit(1, -9)) == [ReportRankExit(1, -9)]
    assert supervisor.handle(StackGraceExpired(1)) == []  # gone: nothing to kill
    assert supervisor.handle(RankDeclaredDead(0, "x")) == [DumpStack(0, "x")]
    assert supervisor.handle(RankExit(0, -9)) == [ReportRankExit(0, -9), TerminateRelay()]
    assert supervisor.handle(StackGraceExpired(0)) == []


def test_a_host_that_tore_itself_down_waits_for_the_word_where_a_restart_may_follow() -> None:
    # Its own rank failed: the controller will answer with Reform (stay linked) or Abort; closing at once
    # would race that word. The relay had already stopped, so the failed rank was the last child.
    supervisor = Supervisor("h", [0], has_relay=True, may_restart=True)
    assert supervisor.handle(RelayExit(0)) == []
    assert supervisor.handle(RankExit(0, 3)) == [
        ReportRankExit(0, 3),
        AwaitWord(),
        CloseLink(),
        Finish(1, "host 'h' torn down: rank 0 exited with code 3"),
    ]
    # a dying relay is the host's own failure too
    supervisor = Supervisor("h", [0], has_relay=True, may_restart=True)
    supervisor.handle(RelayExit(1))
    assert supervisor.handle(RankExit(0, -15))[1:3] == [AwaitWord(), CloseLink()]


def test_no_wait_for_the_word_in_the_last_attempt_or_after_the_controllers_own_abort() -> None:
    last = Supervisor("h", [0], has_relay=False, may_restart=False)
    assert AwaitWord() not in last.handle(RankExit(0, 3))
    aborted = Supervisor("h", [0], has_relay=False, may_restart=True)
    aborted.handle(AbortReceived("another host failed"))
    assert AwaitWord() not in aborted.handle(RankExit(0, -15))
    clean = Supervisor("h", [0], has_relay=False, may_restart=True)
    assert clean.handle(RankExit(0, 0))[1:] == [CloseLink(), Finish(0, "host 'h' finished cleanly")]


def test_in_a_run_that_grows_a_rank_that_failed_on_its_own_frees_its_slot() -> None:
    """The slot heals in as a walk-in of its own (flodld/agent/host.py); a rank killed by our own teardown, a
    clean exit, or a run that does not grow frees nothing.
    """
    supervisor = Supervisor("h", [0, 1, 2], has_relay=True, tolerance=1, grows=True)
    assert supervisor.handle(RankExit(1, -9)) == [ReportRankExit(1, -9, frees_slot=True)]
    assert supervisor.handle(RankExit(0, 0)) == [ReportRankExit(0, 0)]
    assert supervisor.handle(AbortReceived("over")) == [TerminateAll("abort from the controller: over")]
    assert supervisor.handle(RankExit(2, -15), now=1.0) == [ReportRankExit(2, -15, torn_down=True)]
    for grows, tolerance in ((False, 1), (True, 0)):
        other = Supervisor("h", [0, 1], has_relay=True, tolerance=tolerance, grows=grows)
        assert other.handle(RankExit(0, 3))[0] == ReportRankExit(0, 3)  # frees_slot False


def test_a_declared_dead_rank_frees_its_slot_once_killed() -> None:
    supervisor = Supervisor("h", [0, 1], has_relay=True, tolerance=1, grows=True)
    assert supervisor.handle(RankDeclaredDead(0, "silent")) == [DumpStack(0, "silent")]
    assert supervisor.handle(StackGraceExpired(0)) == [KillOne(0)]
    assert supervisor.handle(RankExit(0, -9)) == [ReportRankExit(0, -9, frees_slot=True)]
    assert supervisor.state is SupervisorState.RUNNING
