"""The session checkers (harness/judge/sessions.py), each against a history built to pass it,
one built to fail it (naming the offending events), and one without its evidence."""

from __future__ import annotations

from harness.judge.checkers import FinalState
from harness.judge.sessions import (
    LATE_MARGIN_NS,
    late_result_refused,
    no_session_outlives_kill,
)
from harness.record.history import Event
from tests.harness.builders import MS, GameDay


def _kill(day: GameDay, agent: str, invoked_ms: float, acked_ms: float,
          cancelled: tuple[str, ...] = ()) -> None:
    day.operation("operator:owner", "kill_agent", {"agent_id": agent}, invoked_ms, acked_ms,
                  result={"status": 200, "body": {"sessions_cancelled": list(cancelled)}})


def _result(day: GameDay, session: str, status: str, at_ms: float, why: str | None = None,
            agent: str = "a1", task: str = "t1") -> Event:
    return day.seen("task_result", agent, at_ms, session_id=session, task_id=task,
                    status=status, why=why)


def _session(day: GameDay, session: str, started_ms: float, ended_ms: float | None,
             state: str = "ended", agent: str = "a1") -> None:
    day.seen("session_start", agent, started_ms, session_id=session, outcome="started")
    if ended_ms is not None:
        day.seen("session_end", agent, ended_ms, session_id=session, state=state)


# ---------------------------------------------------------------- late result refused


def test_a_killed_sessions_late_result_refused_passes() -> None:
    day = GameDay()
    _session(day, "s1", 10, 100, "cancelled")
    _kill(day, "a1", 95, 120, cancelled=("s1",))
    refused = _result(day, "s1", "rejected", 300, why="agent is killed")
    _session(day, "s2", 500, 900)
    _result(day, "s2", "done", 800)  # the later session's own result
    verdict = late_result_refused(day.history, FinalState())
    assert verdict.valid is True, verdict.message
    assert "agent is killed" in verdict.message and verdict.evidence == (refused.index,)


def test_a_killed_sessions_late_result_taken_fails_naming_it() -> None:
    day = GameDay()
    _session(day, "s1", 10, 100, "cancelled")
    _kill(day, "a1", 95, 120, cancelled=("s1",))
    taken = _result(day, "s1", "done", 300)
    verdict = late_result_refused(day.history, FinalState())
    assert verdict.valid is False
    assert "task t1 of agent a1 took the result (done" in verdict.message
    assert "fencing token did not hold" in verdict.message
    assert verdict.evidence == (taken.index,)


def test_a_superseded_sessions_result_after_its_loss_fails() -> None:
    day = GameDay()
    _session(day, "s1", 10, 100, "lost")
    late = _result(day, "s1", "done", 100 + LATE_MARGIN_NS / MS + 50)
    verdict = late_result_refused(day.history, FinalState())
    assert verdict.valid is False and verdict.evidence == (late.index,)


def test_results_before_the_end_are_no_evidence() -> None:
    day = GameDay()
    _session(day, "s1", 10, 200, "cancelled")
    _result(day, "s1", "done", 90)  # taken before the kill
    _kill(day, "a1", 150, 220, cancelled=("s1",))
    assert late_result_refused(day.history, FinalState()).valid == "unknown"
    assert late_result_refused(GameDay().history, FinalState()).valid == "unknown"


# ---------------------------------------------------------------- no session outlives a kill


def test_a_session_the_kill_cancelled_passes() -> None:
    day = GameDay()
    _session(day, "s1", 10, 102, "cancelled")
    _session(day, "s2", 101, 102, "cancelled")  # a wake that raced the kill, seen by it
    # Cancelled by the kill, its end stamped late by a deployment's clock: the answer says.
    _session(day, "s4", 90, 150, "cancelled")
    _kill(day, "a1", 100, 130, cancelled=("s1", "s2", "s4"))
    day.resume_agent("a1", 400, 410)
    _session(day, "s3", 412, None)  # after the resume: free to run
    verdict = no_session_outlives_kill(day.history, FinalState())
    assert verdict.valid is True, verdict.message
    assert "3 sessions" in verdict.message and "1 of them started while" in verdict.message


def test_a_raced_session_the_kill_never_saw_fails() -> None:
    day = GameDay()
    _session(day, "s1", 10, 102, "cancelled")
    _session(day, "s2", 101, 700)  # committed between the kill's send and its flag
    _kill(day, "a1", 100, 130, cancelled=("s1",))
    kill_index = len(day.history) - 1
    verdict = no_session_outlives_kill(day.history, FinalState())
    assert verdict.valid is False
    assert "session s2 started 29.0 ms before the kill_agent" in verdict.message
    assert "live until 570.0 ms after it" in verdict.message
    assert "DESIGN §2.3.1" in verdict.message and verdict.evidence == (kill_index,)


def test_a_session_started_during_the_stop_fails_and_one_still_live_too() -> None:
    day = GameDay()
    _session(day, "s1", 10, None)  # never stopped at all
    _kill(day, "a1", 100, 130)
    _session(day, "s2", 200, 250, agent="a1")
    verdict = no_session_outlives_kill(day.history, FinalState())
    assert verdict.valid is False
    assert "session s1 started 120.0 ms before" in verdict.message
    assert "still live when last read" in verdict.message
    assert "session s2 started 70.0 ms after" in verdict.message


def test_without_a_kill_or_a_session_to_stop_it_cannot_decide() -> None:
    assert no_session_outlives_kill(GameDay().history, FinalState()).valid == "unknown"
    day = GameDay()
    _session(day, "s1", 10, 50)  # over long before the kill
    _kill(day, "a1", 100, 130)
    verdict = no_session_outlives_kill(day.history, FinalState())
    assert verdict.valid == "unknown" and "no kill had a session to stop" in verdict.message


def test_a_scenario_may_choose_each_of_them_by_name() -> None:
    from harness.judge.sessions import SESSION_CHECKERS
    from harness.judge.verdicts import KNOWN_CHECKERS

    assert {c.__name__ for c in SESSION_CHECKERS} == {"late_result_refused",
                                                     "no_session_outlives_kill"}
    assert {c.__name__ for c in SESSION_CHECKERS} <= KNOWN_CHECKERS
