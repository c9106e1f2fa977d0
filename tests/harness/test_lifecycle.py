"""The harness owns the game day (harness/run/lifecycle.py): a scenario only acts, and cannot
pass without its judgement. Game days run by a real pytest in a subprocess, on a paper game
day whose history the scenario writes by hand: no stack, but the real plugin, lifecycle,
checkers, journal and report."""

from __future__ import annotations

import json

import pytest

from tests.harness.builders import UNUSED_PLUGINS

pytest_plugins = ["pytester"]

CONFTEST = """
import types

import pytest
from harness.judge.checkers import FinalState
from harness.record.gameday import GameDay
from harness.run.plugin import chosen_bounds, chosen_checkers, required_checkers

S = 1_000_000_000


class PaperGameDay(GameDay):
    # The system under test is the history the scenario writes: nothing to prepare, read
    # back or roll back. Everything else (judging, journal, report) is the harness's own.
    final = FinalState()
    broken_collect = False

    async def prepare(self):
        pass

    async def collect(self):
        if self.broken_collect:
            raise ConnectionError("the control plane went away before the judgement")
        return self.final

    async def roll_back(self):
        pass


NEMESIS = types.SimpleNamespace(
    fault_log=lambda: [],
    verify_healed=lambda: types.SimpleNamespace(to_json=lambda: {"healed": True}))


@pytest.fixture
def gameday(request, tmp_path):
    required = required_checkers(request.node)
    return PaperGameDay(
        name=request.node.name, stack="paper",
        endpoints=types.SimpleNamespace(versions={}, nemesis=NEMESIS), seed=1,
        report_dir=tmp_path / "reports", required=required,
        checkers=chosen_checkers(request.node, required),
        bounds=chosen_bounds(request.node))
"""

# A fleet kill requested at 1.5 s and answered at 2 s; agent a1 acting before it and twice
# after the request (at 1.6 s and 1.7 s, before the answer), task t1 read in progress before
# and open after.
HELPERS = """
import pytest
from harness.judge.checkers import FinalState
from harness.act.expect import rule

S = 1_000_000_000


def fleet_kill(day, late_actions=2):
    h = day.history
    h.observe("agent:a1", "action", {"tool": "shell", "args": {"cmd": "rm -rf ./*"},
                                     "sent_ns": 1 * S}, time_ns=1 * S)
    h.observe("observer", "task_state", {"task_id": "t1", "state": "in_progress",
                                         "agent_id": "a1"}, time_ns=int(1.2 * S))
    kill = h.record("invoke", "operator:security", "kill_fleet", {}, time_ns=int(1.5 * S))
    for i in range(late_actions):
        at = int((1.6 + i / 10) * S)
        h.observe("agent:a1", "action", {"tool": "shell", "args": {"cmd": "rm -rf ./*"},
                                         "sent_ns": at}, time_ns=at)
    h.complete(kill, "ok", {"status": 200}, time_ns=2 * S)
    h.observe("observer", "task_state", {"task_id": "t1", "state": "open",
                                         "agent_id": "a1"}, time_ns=int(2.1 * S))
    h.observe("observer", "session_start", {"agent_id": "a1", "session_id": "s1",
                                            "outcome": "started"}, time_ns=int(0.5 * S))
    day.final = FinalState(tasks={"t1": {"state": "open", "agent_id": "a1",
                                         "done_count": 0}},
                           agents={"a1": {"killed": True, "kill_origin": "fleet"}})
"""


def _run(pytester: pytest.Pytester, scenario: str) -> tuple[pytest.RunResult, list[dict]]:
    pytester.makeconftest(CONFTEST)
    folder = pytester.mkdir("scenarios")
    (folder / "drill.py").write_text(HELPERS + scenario)
    result = pytester.runpytest_subprocess("scenarios", "-p", "no:cacheprovider",
                                           *UNUSED_PLUGINS, "-o", "asyncio_mode=auto",
                                           "--basetemp", str(pytester.path / "tmp"))
    journals = [json.loads(p.read_text()) for p in sorted(pytester.path.rglob("*.json"))
                if p.parent.name == "reports"]
    return result, journals


def test_a_game_day_that_never_asks_for_its_judgement_is_judged_all_the_same(
        pytester: pytest.Pytester) -> None:
    # It declares a rule it must decide, never judges, and would once have passed.
    result, journals = _run(pytester, """
@pytest.mark.decides("kill_obeyed")
async def test_forgets_its_judgement(gameday):
    fleet_kill(gameday)
""")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "UNDECIDED, required kill_obeyed" in out, out
    assert [j["status"] for j in journals] == ["failed"], journals
    assert {v["checker"] for v in journals[0]["verdicts"]} >= {"kill_obeyed",
                                                               "in_progress_requeued"}


def test_a_game_day_whose_judgement_cannot_run_fails_saying_so(
        pytester: pytest.Pytester) -> None:
    result, journals = _run(pytester, """
async def test_plane_gone_at_the_end(gameday):
    fleet_kill(gameday)
    gameday.broken_collect = True
""")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "ran but could not be judged" in out, out
    assert "the control plane went away before the judgement" in out, out
    assert [j["status"] for j in journals] == ["aborted"], journals
    assert "could not be judged" in journals[0]["aborted_reason"], journals[0]


def test_a_figure_past_its_bound_fails_with_the_figure_and_the_bound(
        pytester: pytest.Pytester) -> None:
    result, journals = _run(pytester, """
@pytest.mark.bounds(deletions_after_request=1, actions_after_request=5)
async def test_rm_rf(gameday):
    fleet_kill(gameday, late_actions=2)
""")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert ("FAILED within_bound:deletions_after_request: deletions_after_request: 2 rm calls, "
            "past its bound of 1 rm calls") in out, out
    assert "FAILED within_bound:actions_after_request" not in out, out
    bounded = journals[0]["measurements"]["bounded"]
    assert bounded["deletions_after_request"]["value"] == 2, bounded
    assert bounded["deletions_after_request"]["bound"] == 1, bounded
    assert bounded["actions_after_request"]["within"] is True, bounded


def test_a_figure_within_its_bound_passes_and_one_not_measured_fails(
        pytester: pytest.Pytester) -> None:
    result, journals = _run(pytester, """
@pytest.mark.checkers("every_fault_healed")
@pytest.mark.bounds(deletions_after_request=2)
async def test_within(gameday):
    fleet_kill(gameday, late_actions=2)


@pytest.mark.checkers("every_fault_healed")
@pytest.mark.bounds(spend_beyond_cap_usd=0)
async def test_nothing_to_measure(gameday):
    fleet_kill(gameday)
""")
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert "spend_beyond_cap_usd could not be measured" in out, out
    assert sorted(j["status"] for j in journals) == ["completed", "failed"], journals


def test_a_role_let_through_leads_before_any_could_not_decide(
        pytester: pytest.Pytester) -> None:
    # The scenario stops on the broken rule; the checkers that needed the rest of the game
    # day (a resume) cannot decide, and must not be read first.
    result, _ = _run(pytester, """
@pytest.mark.decides("each_task_done_once_after_resume", "kill_obeyed")
async def test_fleet_switch(gameday):
    fleet_kill(gameday)
    rule(False, "auditor may pull the fleet switch")
""")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    broken = "BROKEN RULE, seen as the game day went on: auditor may pull the fleet switch"
    assert broken in out, out
    undecided = "UNDECIDED, required each_task_done_once_after_resume (likely a consequence"
    assert undecided in out, out
    assert out.index(broken) < out.index(undecided), out
    summary = out[out.index("short test summary"):]
    assert "test_fleet_switch - auditor may pull" in summary, summary
