"""The plugin's failure output, as an on-call engineer reads it: game days run by a real
pytest in a subprocess, collected from a `scenarios/` folder the way `pytest scenarios` does.

The game days here bring no stack up: a conftest gives them a GameDay with a history written
by hand, which is all the plugin's report reads.
"""

from __future__ import annotations

import pytest

from tests.harness.builders import UNUSED_PLUGINS

pytest_plugins = ["pytester"]

CONFTEST = """
import pytest
from harness.record.gameday import GameDay
from harness.run.plugin import required_checkers


@pytest.fixture
def gameday(request, tmp_path):
    # No stack: the plugin's report reads only the day's history, verdicts and markers.
    return GameDay(name=request.node.name, stack="none", endpoints=None, seed=1,
                   report_dir=tmp_path, required=required_checkers(request.node))
"""

# A fleet kill acknowledged at 2 s, then agent a1 seen starting a session at 3 s, and task t1
# read in progress before the kill but never after it.
HISTORY = """
import pytest
from harness.judge.checkers import FinalState, check_all
from harness.record.gameday import assert_valid

S = 1_000_000_000


def stopped_agent_woken(day):
    h = day.history
    h.observe("observer", "task_state", {"task_id": "t1", "state": "in_progress",
                                         "agent_id": "a1"}, time_ns=1 * S)
    kill = h.record("invoke", "operator:security", "kill_fleet", {}, time_ns=int(1.5 * S))
    h.complete(kill, "ok", {"status": 200}, time_ns=2 * S)
    h.observe("observer", "session_start", {"agent_id": "a1", "session_id": "s9",
                                            "outcome": "started"}, time_ns=3 * S)
    final = FinalState(tasks={"t1": {"state": "open", "agent_id": "a1", "done_count": 0}},
                       agents={"a1": {"killed": True, "kill_origin": "fleet"}})
    day.verdicts = check_all(h, final)
    return day.verdicts
"""


def _run(pytester: pytest.Pytester, scenario: str, *args: str) -> pytest.RunResult:
    pytester.makeconftest(CONFTEST)
    folder = pytester.mkdir("scenarios")
    (folder / "drill.py").write_text(HISTORY + scenario)
    # The folder, not the file: a file named on the command line is rewritten by pytest
    # itself; a game day found in its folder is the plugin's to collect.
    return pytester.runpytest_subprocess("scenarios", "-p", "no:cacheprovider",
                                         *UNUSED_PLUGINS, *args)


# Each import mode names the module differently; the rewriting must follow every one.
@pytest.mark.parametrize("import_mode", ["prepend", "importlib"])
def test_a_failing_comparison_shows_both_values(pytester: pytest.Pytester,
                                                import_mode: str) -> None:
    result = _run(pytester, """
def test_heartbeat_refused(gameday):
    status, body = 202, {"accepted": True}
    assert (status, body) == (409, {"error": "Agent or fleet is stopped"})
""", f"--import-mode={import_mode}")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "assert (202, {'accepted': True}) == (409, {'error" in out, out
    assert "At index 0 diff: 202 != 409" in out, out


def test_a_failed_checker_leads_the_report_before_the_line_that_raised(
        pytester: pytest.Pytester) -> None:
    result = _run(pytester, """
def test_fleet_stop(gameday):
    stopped_agent_woken(gameday)
    sessions_running = 1
    assert sessions_running == 0, "a session ran during the stop"
""")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    sentence = "FAILED no_wake_of_stopped_agent: Stopped agents were woken: agent a1 was woken"
    assert sentence in out, out
    assert out.index(sentence) < out.index("a session ran during the stop"), out
    # The events that prove it, as lines a human can read.
    assert "event 2 ok operator:security kill_fleet at +1.000 s" in out, out
    assert "event 3 ok observer session_start at +2.000 s" in out, out
    # The one-line summary names the broken rule too.
    summary = out[out.index("short test summary"):]
    assert "no_wake_of_stopped_agent" in summary, summary


def test_a_required_checker_that_cannot_decide_fails_the_game_day(
        pytester: pytest.Pytester) -> None:
    result = _run(pytester, """
from harness.judge.checkers import FinalState, check_all


def kill_without_reading_back(day):
    h = day.history
    h.observe("observer", "task_state", {"task_id": "t1", "state": "in_progress",
                                         "agent_id": "a1"}, time_ns=1 * S)
    kill = h.record("invoke", "operator:security", "kill_fleet", {}, time_ns=int(1.5 * S))
    h.complete(kill, "ok", {"status": 200}, time_ns=2 * S)
    final = FinalState(tasks={"t1": {"state": "open", "agent_id": "a1", "done_count": 0}},
                       agents={"a1": {"killed": True, "kill_origin": "fleet"}})
    day.verdicts = check_all(h, final)


@pytest.mark.decides("in_progress_requeued")
def test_requeue_required(gameday):
    kill_without_reading_back(gameday)
    assert_valid(gameday.verdicts, gameday.required)


def test_requeue_not_required(gameday):
    kill_without_reading_back(gameday)
    assert_valid(gameday.verdicts, gameday.required)
""")
    result.assert_outcomes(failed=1, passed=1)
    out = result.stdout.str()
    assert ("in_progress_requeued could not decide, and this game day must: Cannot tell "
            "whether every in-progress task was requeued: task t1 was not read after the "
            "kill_fleet") in out, out
    assert "UNDECIDED, required in_progress_requeued" in out, out
    assert "FAILED scenarios/drill.py::test_requeue_required" in out, out


def test_a_decides_marker_naming_no_checker_is_a_usage_error(pytester: pytest.Pytester
                                                             ) -> None:
    result = _run(pytester, """
@pytest.mark.decides("in_progress_requed")
def test_typo(gameday):
    pass
""")
    result.assert_outcomes(errors=1)
    assert "names no checker in_progress_requed" in result.stdout.str()
