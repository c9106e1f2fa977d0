"""The scenario API a game day is written in: every operator call lands in the history with
its outcome, the shared waits fail with the rule when the outcome cannot come, and a game
day's markers choose its checkers and measures.

The control plane here is an httpx transport answering from a table (one unit, the API's
recording, under test); the game days themselves run against real stacks in scenarios/.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from harness.act.client import CoveyClient
from harness.record.gameday import GameDay
from tests.harness.builders import UNUSED_PLUGINS

pytest_plugins = ["pytester"]
Handler = Callable[[httpx.Request], httpx.Response]


def day_with(tmp_path: Path, handler: Handler) -> GameDay:
    day = GameDay(name="api", stack="none", endpoints=None,  # type: ignore[arg-type]
                  seed=1, report_dir=tmp_path)
    for role in ("security", "auditor", "agent_owner"):
        client = CoveyClient("http://covey.test")
        client.http = httpx.AsyncClient(base_url="http://covey.test",
                                        transport=httpx.MockTransport(handler))
        day.people[role] = client
    return day


async def test_every_call_is_recorded_with_its_outcome(tmp_path: Path) -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/v1/fleet/kill":
            return httpx.Response(200, json={"agents_stopped": ["a1"]})
        if request.url.path.endswith("/wake"):
            return httpx.Response(202, json={"outcome": "busy", "session_id": None})
        if request.url.path == "/api/v1/agents/a1/resume":
            raise httpx.ReadError("connection reset")  # sent: it may have taken effect
        if request.url.path == "/api/v1/agents/a1/kill":
            raise httpx.ConnectError("connection refused")  # never reached the plane
        return httpx.Response(403, json={"error": "Forbidden", "hint": "ask security"})

    day = day_with(tmp_path, answer)
    assert (await day.as_("security").kill_fleet()).status_code == 200
    assert (await day.as_("agent_owner").resume_fleet()).status_code == 403
    await day.as_("agent_owner").wake("a1")
    with pytest.raises(httpx.ReadError):
        await day.as_("security").resume_agent("a1")
    with pytest.raises(httpx.ConnectError):
        await day.as_("security").kill_agent("a1")
    ops = [(op.f, op.type, op.process) for op in day.history.operations(
        ("kill_fleet", "resume_fleet", "wake", "resume_agent", "kill_agent"))]
    assert ops == [("kill_fleet", "ok", "operator:security"),
                   ("resume_fleet", "fail", "operator:agent_owner"),
                   ("wake", "ok", "operator:agent_owner"),
                   ("resume_agent", "info", "operator:security"),
                   ("kill_agent", "fail", "operator:security")]
    wake = day.history.operations("wake")[0]
    assert wake.value["outcome"] == "busy" and wake.agent_id == "a1", (
        "a wake that found the agent busy must not read as a wake that started it")
    with pytest.raises(KeyError, match="no controlling"):
        day.as_("controlling")


async def test_stopped_by_fails_at_once_when_another_layer_stopped_the_agent(
        tmp_path: Path) -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=[{
            "id": "s1", "ended_at": "2026-01-01T00:00:00+00:00", "stop_layer": "loop",
            "stop_reason": "repeated shell 3 times with identical arguments"}])

    day = day_with(tmp_path, answer)
    with pytest.raises(AssertionError, match="stopped by loop instead") as failed:
        await day.until.stopped_by("a1", "budget", deadline_s=30)
    assert "the guard's budget layer never stopped agent a1" in str(failed.value)


async def test_a_fleet_kill_in_a_fault_must_take_effect_or_say_it_could_not(
        tmp_path: Path) -> None:
    """During a fault a kill answers 200 or an honest 503 with a hint; once the fault is over
    the fleet must stand stopped, or the 200 did nothing."""
    day = day_with(tmp_path, lambda r: httpx.Response(200, json={"fleet_killed": False}))
    during = "a fleet kill during a database outage"
    for answer, broken in (
            (httpx.Response(500, text="boom"), f"{during} answered 500 boom: it must take "
             "effect (200) or say it could not (503)"),
            (httpx.Response(503, json={"error": "database unavailable"}),
             f"the 503 of {during} gives no hint")):
        with pytest.raises(AssertionError) as failed:
            day.expect.honest_answer(answer, during)
        assert str(failed.value) == broken
    day.expect.honest_answer(httpx.Response(503, json={"error": "e", "hint": "retry"}), during)

    with pytest.raises(AssertionError, match="a 200 that did nothing"):
        await day.expect.fleet_stopped_after(day.as_("security"), httpx.Response(200),
                                             "the database outage")


def test_markers_choose_checkers_and_measures(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_choice="""
import pytest
from harness.judge.checkers import CHECKERS
from harness.run.plugin import chosen_checkers, chosen_measures, required_checkers

@pytest.mark.decides("kill_obeyed")
@pytest.mark.checkers("home_is_last_sync")
@pytest.mark.measures("work_lost")
def test_chosen(request):
    names = [c.__name__ for c in chosen_checkers(request.node, required_checkers(request.node))]
    assert names == ["kill_obeyed", "home_is_last_sync"]
    assert list(chosen_measures(request.node)) == ["work_lost"]

def test_default(request):
    assert chosen_checkers(request.node, frozenset()) == CHECKERS
    assert chosen_measures(request.node) == {}

@pytest.mark.checkers("no_such_rule")
def test_unknown(request):
    with pytest.raises(pytest.UsageError, match="names no checker no_such_rule"):
        chosen_checkers(request.node, frozenset())
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *UNUSED_PLUGINS)
    result.assert_outcomes(passed=3)


async def test_the_live_output_shows_switches_and_refusals_not_routine_answers(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`gameday run` shows the phases at INFO: 14 lines of `create_task answered 201` once
    hid the kill among them."""
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/v1/fleet/kill":
            return httpx.Response(200, json={"agents_stopped": []})
        if request.url.path.endswith("/tasks"):
            return httpx.Response(201, json={"id": "t1"})
        if request.url.path.endswith("/wake"):
            return httpx.Response(409, json={"error": "Agent or fleet is stopped",
                                             "hint": "resume it first."})
        return httpx.Response(404, json={"error": "Not found", "hint": ""})

    day = day_with(tmp_path, answer)
    caplog.set_level("INFO", logger="harness.record.gameday")
    for _ in range(3):
        await day.as_("agent_owner").create_task("a1", "routine")
    await day.as_("security").kill_fleet()
    await day.as_("agent_owner").wake("a1")
    shown = [r.getMessage() for r in caplog.records
             if r.name == "harness.record.gameday" and r.levelname == "INFO"]
    assert shown == ["security pulled kill_fleet: answered 200",
                     "agent_owner: wake refused with 409"], shown
    assert len(day.history.operations("create_task")) == 3, "routine calls left the history"
