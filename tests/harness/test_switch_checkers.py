"""The random game days' checkers, each against a history built to pass it and one built to
fail it, naming the offending events."""

from __future__ import annotations

from harness.judge.checkers import FinalState, FinalTask
from harness.judge.switch_checkers import (
    KILL_CONFIRM_MARGIN_NS,
    PLANE_TARGET,
    TEARDOWN_BOUND_NS,
    fleet_resume_keeps_own_kills,
    kill_confirmed_within_lease,
    no_sandbox_alive_after_stop,
    no_task_lost,
    none_done_twice,
    stopped_tool_not_run,
    wake_paths_refused_while_stopped,
)
from harness.nemesis.plane import PLANE
from tests.harness.builders import MS, GameDay

LEASE_MS = 2000


def _task(state: str, agent: str = "a1", done: int = 0, result: str | None = None
          ) -> FinalTask:
    return {"state": state, "agent_id": agent, "done_count": done, "result": result}


def _final(tasks: dict[str, FinalTask], live: list[str] | None = None,
           killed: bool = False) -> FinalState:
    return FinalState(tasks=tasks, agents={"a1": {"killed": killed, "kill_origin": None,
                                                  "live_tasks": live or []}})


# ---------------------------------------------------------------- no task lost


def test_tasks_done_failed_with_a_reason_or_open_and_unheld_are_not_lost() -> None:
    final = _final({"t1": _task("done", done=1), "t2": _task("failed", result="daemon lost 5 "
                                                                          "times"),
                    "t3": _task("open")})
    assert no_task_lost(GameDay().history, final).valid is True


def test_a_task_in_progress_with_no_live_session_is_lost() -> None:
    day = GameDay()
    read = day.task("t2", "a1", "in_progress", 50)
    final = _final({"t1": _task("done", done=1), "t2": _task("in_progress")})
    verdict = no_task_lost(day.history, final)
    assert verdict.valid is False
    assert "task t2 ended in progress with no live session" in verdict.message
    assert verdict.evidence == (read.index,)


def test_a_task_failed_without_a_reason_is_lost() -> None:
    verdict = no_task_lost(GameDay().history, _final({"t1": _task("failed", result=" ")}))
    assert verdict.valid is False and "failed without a reason" in verdict.message


def test_a_task_still_worked_on_at_the_end_is_undecided() -> None:
    verdict = no_task_lost(GameDay().history, _final({"t1": _task("in_progress")}, ["t1"]))
    assert verdict.valid == "unknown"


# ---------------------------------------------------------------- none done twice


def test_tasks_done_once_are_not_done_twice() -> None:
    final = _final({"t1": _task("done", done=1), "t2": _task("open")})
    assert none_done_twice(GameDay().history, final).valid is True


def test_a_task_done_twice_is_caught() -> None:
    day = GameDay()
    read = day.task("t1", "a1", "done", 80)
    verdict = none_done_twice(day.history, _final({"t1": _task("done", done=2)}))
    assert verdict.valid is False
    assert "task t1 was done 2 times" in verdict.message and verdict.evidence == (read.index,)


# ---------------------------------------------------------------- kill within the lease


def _leased() -> GameDay:
    day = GameDay()
    day.history.observe("observer", "lease", {"lease_ms": LEASE_MS})
    return day


def _box(day: GameDay, sandbox: str, created_ms: float, ended_ms: float | None,
         agent: str = "a1", exited_ms: float | None = None) -> None:
    day.history.observe("observer", "sandbox", {
        "agent_id": agent, "sandbox_id": sandbox, "state": "gone" if ended_ms else "running",
        "created_ns": int(created_ms * MS),
        "ended_ns": None if ended_ms is None else int(ended_ms * MS),
        **({} if exited_ms is None else {"daemon_exited_ns": int(exited_ms * MS)})},
        time_ns=0)


def test_kills_answered_and_confirmed_within_the_lease_pass() -> None:
    day = _leased()
    day.kill_agent("a1", 100, 150)
    day.delivery("a1", "s1", sent_ms=110, confirmed_ms=130)
    # A daemon deaf behind a cut channel: confirmed late, but its sandbox ended in time.
    day.kill_fleet(1000, 3000)
    day.history.observe("observer", "kill_delivery", {
        "agent_id": "a1", "session_id": "s2", "sandbox_id": "b2", "sent_ns": 1010 * MS,
        "confirmed_ns": 9000 * MS, "confirmed_by": "hang_up", "daemon_stop": None},
        time_ns=1010 * MS)
    _box(day, "b2", 500, 1010 + LEASE_MS + 200)
    assert kill_confirmed_within_lease(day.history, FinalState()).valid is True


def test_a_kill_answered_after_the_lease_and_a_daemon_never_ending_are_caught() -> None:
    day = _leased()
    _, late = day.kill_agent("a1", 100, 100 + LEASE_MS + KILL_CONFIRM_MARGIN_NS / MS + 10)
    deaf = day.delivery("a1", "s1", sent_ms=110, confirmed_ms=None, by=None)
    verdict = kill_confirmed_within_lease(day.history, FinalState())
    assert verdict.valid is False
    assert verdict.evidence == (late.index, deaf.index)
    assert "answered after 3510.0 ms" in verdict.message
    assert "never confirmed the kill nor ended" in verdict.message


def test_a_daemon_ends_when_it_exits_not_when_its_sandbox_is_removed() -> None:
    """A daemon that exited within the lease, its sandbox's removal slow or failed: the
    daemon ended in time. Judged by the sandbox's end alone, it would fail."""
    for gone_ms in (1010 + LEASE_MS + KILL_CONFIRM_MARGIN_NS / MS + 5000, None):
        day = _leased()
        day.kill_fleet(1000, 1100)
        day.history.observe("observer", "kill_delivery", {
            "agent_id": "a1", "session_id": "s2", "sandbox_id": "b2", "sent_ns": 1010 * MS,
            "confirmed_ns": None, "confirmed_by": None, "daemon_stop": None},
            time_ns=1010 * MS)
        _box(day, "b2", 500, gone_ms, exited_ms=1010 + LEASE_MS)
        verdict = kill_confirmed_within_lease(day.history, FinalState())
        assert verdict.valid is True, verdict.message


def test_without_the_lease_the_kill_bound_is_undecided() -> None:
    day = GameDay()
    day.kill_agent("a1", 100, 150)
    assert kill_confirmed_within_lease(day.history, FinalState()).valid == "unknown"


# ---------------------------------------------------------------- sandboxes after a stop


def test_sandboxes_gone_within_the_teardown_bound_pass() -> None:
    day = GameDay()
    day.kill_agent("a1", 100, 150)
    _box(day, "b1", 0, 150 + TEARDOWN_BOUND_NS / MS - 100)
    _box(day, "b-other", 0, None, agent="a2")  # another agent, not stopped
    assert no_sandbox_alive_after_stop(day.history, FinalState()).valid is True


def test_a_sandbox_up_past_the_teardown_bound_is_caught() -> None:
    day = GameDay()
    _, ack = day.kill_fleet(100, 150)
    _box(day, "b1", 0, None)
    verdict = no_sandbox_alive_after_stop(day.history, FinalState())
    assert verdict.valid is False
    assert "sandbox b1 of agent a1 was still running when last read" in verdict.message
    assert ack.index in verdict.evidence


def test_a_stop_released_before_the_bound_is_undecided() -> None:
    day = GameDay()
    day.kill_agent("a1", 100, 150)
    day.resume_agent("a1", 1000, 1010)
    _box(day, "b1", 0, None)
    assert no_sandbox_alive_after_stop(day.history, FinalState()).valid == "unknown"


def _plane_crash(day: GameDay, down_ms: float, back_ms: float | None) -> None:
    value = {"fault_id": "control-plane-1", "kind": "restart", "target": PLANE_TARGET}
    day.history.observe("nemesis", "fault_start", value, time_ns=int(down_ms * MS))
    if back_ms is not None:
        day.history.observe("nemesis", "fault_heal", {**value, "healed_by": "deadline"},
                            time_ns=int(back_ms * MS))


def test_the_teardown_bound_counts_only_the_time_the_control_plane_was_up() -> None:
    """The control plane tears sandboxes down: crashed 10 s right after the kill, it has the
    bound from its return (the daemons' own stop is the lease checker's to judge)."""
    assert PLANE_TARGET == PLANE, "the checker must know the nemesis's name for the plane"
    bound_ms = TEARDOWN_BOUND_NS / MS
    for gone_ms, valid in ((150 + 10_000 + bound_ms - 100, True),
                           (150 + 10_000 + bound_ms + 500, False)):
        day = GameDay()
        day.kill_fleet(100, 150)
        _plane_crash(day, 200, 10_200)
        _box(day, "b1", 0, gone_ms)
        verdict = no_sandbox_alive_after_stop(day.history, FinalState())
        assert verdict.valid is valid, verdict.message
        if not valid:
            assert "10000.0 ms of it the control plane lay crashed" in verdict.message


def test_a_crash_before_the_kill_gives_no_more_time() -> None:
    day = GameDay()
    _plane_crash(day, 10, 90)
    day.kill_fleet(100, 150)
    _box(day, "b1", 0, 150 + TEARDOWN_BOUND_NS / MS + 500)
    assert no_sandbox_alive_after_stop(day.history, FinalState()).valid is False


def test_a_control_plane_that_never_came_back_leaves_the_teardown_undecided() -> None:
    day = GameDay()
    day.kill_fleet(100, 150)
    _plane_crash(day, 200, None)
    _box(day, "b1", 0, None)
    verdict = no_sandbox_alive_after_stop(day.history, FinalState())
    assert verdict.valid == "unknown" and "never came back" in verdict.message


# ---------------------------------------------------------------- fleet resume, own kills


def test_fleet_resume_leaving_an_own_kill_standing_passes() -> None:
    day = GameDay()
    day.kill_agent("a1", 100, 110)
    day.kill_fleet(200, 220)
    day.operation("operator:security", "resume_fleet", {}, 300, 310,
                  result={"status": 200, "body": {"agents_woken": ["a2"]}})
    day.seen("session_start", "a2", 320)
    final = FinalState(agents={"a1": {"killed": True, "kill_origin": "agent"}})
    assert fleet_resume_keeps_own_kills(day.history, final).valid is True


def test_fleet_resume_waking_an_agent_killed_on_its_own_is_caught() -> None:
    day = GameDay()
    _, kill = day.kill_agent("a1", 100, 110)
    day.kill_fleet(200, 220)
    _, resume = day.operation("operator:security", "resume_fleet", {}, 300, 310,
                              result={"status": 200, "body": {"agents_woken": []}})
    start = day.seen("session_start", "a1", 330)
    final = FinalState(agents={"a1": {"killed": False, "kill_origin": None}})
    verdict = fleet_resume_keeps_own_kills(day.history, final)
    assert verdict.valid is False
    assert verdict.evidence == (kill.index, resume.index, start.index)
    assert "started a session" in verdict.message


# ---------------------------------------------------------------- wake paths refused


def test_wake_paths_answered_409_during_a_stop_pass() -> None:
    day = GameDay()
    day.kill_fleet(100, 110)
    for n, f in enumerate(("wake", "fire_heartbeat", "trigger")):
        day.operation("operator:org_admin", f, {"agent_id": "a1"}, 200 + n, 201 + n, "fail",
                      {"status": 409})
    day.operation("operator:auditor", "wake", {"agent_id": "a1"}, 210, 211, "fail",
                  {"status": 403})  # a role's refusal: not this rule's
    day.resume_fleet(300, 310)
    day.operation("operator:org_admin", "wake", {"agent_id": "a1"}, 400, 401,
                  result={"status": 202})  # after the resume: may wake
    assert wake_paths_refused_while_stopped(day.history, FinalState()).valid is True


def test_a_wake_path_accepted_during_a_stop_is_caught() -> None:
    day = GameDay()
    _, ack = day.kill_agent("a1", 100, 110)
    call, done = day.operation("operator:org_admin", "fire_heartbeat",
                               {"agent_id": "a1", "heartbeat": "hourly"}, 200, 201,
                               result={"status": 202})
    verdict = wake_paths_refused_while_stopped(day.history, FinalState())
    assert verdict.valid is False
    assert verdict.evidence == (ack.index, call.index, done.index)
    assert "fire_heartbeat of agent a1" in verdict.message and "answered 202" in verdict.message


def test_a_wake_path_no_control_plane_answered_is_not_judged() -> None:
    """During a control-plane crash a wake never reaches it (recorded `fail`, with no
    status); one the database could not answer is `info`: neither was let through."""
    day = GameDay()
    day.kill_fleet(100, 110)
    day.operation("operator:org_admin", "wake", {"agent_id": "a1"}, 200, 201, "fail",
                  {"error": "ConnectError('All connection attempts failed')",
                   "unreached": True})
    day.operation("operator:org_admin", "trigger", {"agent_id": "a1"}, 210, 211, "info",
                  {"status": 503})
    verdict = wake_paths_refused_while_stopped(day.history, FinalState())
    assert verdict.valid == "unknown", verdict.message
    day.operation("operator:org_admin", "wake", {"agent_id": "a1"}, 300, 301,
                  result={"status": 202})
    assert wake_paths_refused_while_stopped(day.history, FinalState()).valid is False


def test_a_scenario_may_choose_each_of_them_by_name() -> None:
    from harness.judge.switch_checkers import SWITCH_CHECKERS
    from harness.judge.verdicts import KNOWN_CHECKERS

    names = {c.__name__ for c in SWITCH_CHECKERS}
    assert len(names) == 7 and names <= KNOWN_CHECKERS


REFUSED = '{"error": "kill flag set for tool shell"}'


def _tool_flag_day(results_after_ack: list[str]) -> tuple[GameDay, list[int]]:
    """The owner stops shell for a1 at 100 ms, its daemon acknowledges at 120 ms; a1 then
    alternates shell and write_file, each request carrying back the previous call's result."""
    day = GameDay()
    day.operation("operator:agent_owner", "stop_tool", {"agent_id": "a1", "tool": "shell"},
                  100, 110)
    ack = day.seen("kill_flag_ack", "a1", 120, stopped=["tool:shell"])
    actions = []
    for i, result in enumerate([None, *results_after_ack]):
        event = day.action("a1", 130 + 10 * i, tool="shell" if i % 2 == 0 else "write_file",
                           result=result)
        actions.append(event.index)
    return day, [ack.index, *actions]


def test_a_stopped_tool_refused_after_the_ack_passes() -> None:
    day, _ = _tool_flag_day([REFUSED, '{"written": 3}', REFUSED])
    verdict = stopped_tool_not_run(day.history, FinalState())
    assert verdict.valid is True and "2 calls refused" in verdict.message


def test_a_stopped_tool_that_ran_after_the_ack_is_caught() -> None:
    day, events = _tool_flag_day([REFUSED, '{"written": 3}', '{"exit_code": 0}'])
    verdict = stopped_tool_not_run(day.history, FinalState())
    assert verdict.valid is False
    assert "1 of agent a1's 2 shell calls" in verdict.message
    assert {events[0], events[3], events[4]} <= set(verdict.evidence)


def test_a_tool_flag_never_acknowledged_is_unknown() -> None:
    day = GameDay()
    day.operation("operator:agent_owner", "stop_tool", {"agent_id": "a1", "tool": "shell"},
                  100, 110)
    day.action("a1", 130)
    verdict = stopped_tool_not_run(day.history, FinalState())
    assert verdict.valid == "unknown" and "never acknowledged" in verdict.message
