"""The join connection's states move only through `TRANSITIONS`: forward through the handshake, and an
ended connection stays ended.
"""

from __future__ import annotations

from flodld.controller.join import HANDSHAKING, TRANSITIONS, JoinState, JoinStep

ORDER = [JoinState.STARTING, JoinState.HANDSHAKE, JoinState.DECIDING, JoinState.LINKED, JoinState.ENDED]


def test_the_handshake_only_moves_forward_one_state_at_a_time() -> None:
    for (state, step), moved in TRANSITIONS.items():
        if step is JoinStep.END:
            assert moved is JoinState.ENDED
        else:
            assert ORDER.index(moved) == ORDER.index(state) + 1, (state, step, moved)


def test_every_state_can_end_and_an_ended_connection_stays_ended() -> None:
    assert all(TRANSITIONS[(state, JoinStep.END)] is JoinState.ENDED for state in JoinState)
    assert [step for (state, step) in TRANSITIONS if state is JoinState.ENDED] == [JoinStep.END]


def test_each_step_but_the_end_is_taken_from_exactly_one_state() -> None:
    rows = {
        JoinStep.TURN: JoinState.STARTING,
        JoinStep.VERIFIED: JoinState.HANDSHAKE,
        JoinStep.ADMITTED: JoinState.DECIDING,
    }
    for step, origin in rows.items():
        assert [state for (state, taken) in TRANSITIONS if taken is step] == [origin]
    assert frozenset({JoinState.STARTING, JoinState.HANDSHAKE, JoinState.DECIDING}) == HANDSHAKING
