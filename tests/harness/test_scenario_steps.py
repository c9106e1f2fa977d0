"""The steps scenarios share through `day.until` and `day.expect`: each waits for or checks
what its scenario did inline before, and fails with the same rule words.

The control plane here is an httpx transport answering from a table, the puppet's ledger a
list; the steps run against real stacks in scenarios/.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from harness.act.client import CoveyClient
from harness.act.puppet import LedgerEntry
from harness.record.gameday import GameDay

SILENT = {"id": "a1", "slug": "silent-one", "behaviour": "silent"}
WELL = {"id": "a2", "slug": "well-two", "behaviour": "well_behaved"}


def day_answering(tmp_path: Path, routes: dict[tuple[str, str], Any],
                  ledger: list[LedgerEntry] | None = None) -> GameDay:
    """A game day whose people get `routes[(method, path)]` as JSON (a status and a body
    for a pair), and whose puppet's ledger is `ledger`."""
    def answer(request: httpx.Request) -> httpx.Response:
        found = routes.get((request.method, request.url.path))
        if found is None:
            return httpx.Response(404, json={"error": "Not found"})
        status, body = found if isinstance(found, tuple) else (200, found)
        return httpx.Response(status, json=body)

    async def actions(agent_id: str) -> list[LedgerEntry]:
        return [e for e in ledger or [] if e.agent_id == agent_id]
    endpoints = SimpleNamespace(puppet=SimpleNamespace(actions=actions))
    day = GameDay(name="steps", stack="none", endpoints=endpoints,  # type: ignore[arg-type]
                  seed=1, report_dir=tmp_path)
    for role in ("security", "auditor", "agent_owner", "org_admin"):
        client = CoveyClient("http://covey.test")
        client.http = httpx.AsyncClient(base_url="http://covey.test",
                                        transport=httpx.MockTransport(answer))
        day.people[role] = client
    return day


def backlog(agent_id: str, *states: str) -> dict[tuple[str, str], Any]:
    return {("GET", f"/api/v1/agents/{agent_id}/backlog"): [
        {"id": f"{agent_id}-t{i}", "agent_id": agent_id, "state": s}
        for i, s in enumerate(states)]}


async def test_steady_work_waits_for_busy_agents_at_work_and_work_moving(
        tmp_path: Path) -> None:
    day = day_answering(tmp_path, {**backlog("a1", "in_progress"),
                                   **backlog("a2", "done", "in_progress")})
    day.agents = {"a1": SILENT, "a2": WELL}
    assert await day.until.steady_work([SILENT, WELL], 5) == {
        "tasks_in_progress": 2, "tasks_done": 1, "agents": 2}


async def test_steady_work_fails_at_once_when_a_busy_agent_is_stopped(tmp_path: Path) -> None:
    day = day_answering(tmp_path, {
        **backlog("a1", "open"), **backlog("a2", "done"),
        ("GET", "/api/v1/fleet"): {"fleet_killed": False},
        ("GET", "/api/v1/agents/a1"): {"killed": True, "kill_origin": "human"}})
    day.agents = {"a1": SILENT, "a2": WELL}
    with pytest.raises(AssertionError, match="no steady state: agents not working: it "
                       "cannot happen any more, agent a1 is killed"):
        await day.until.steady_work([SILENT, WELL], 30)


def entry(cmd: str, tool: str = "shell") -> LedgerEntry:
    return LedgerEntry(agent_id="a1", at_ns=1, step=1, behaviour="rm_rf", tool_results=[],
                       tool=tool, args={"cmd": cmd})


async def test_tool_calls_counts_only_that_tool_with_that_command(tmp_path: Path) -> None:
    ledger = [entry("rm -rf ./*"), entry("ls"), entry("rm -rf ./*", tool="read_file"),
              entry("cd / && rm -rf ./*")]
    day = day_answering(tmp_path, {}, ledger)
    found = await day.until.tool_calls("a1", "shell", "rm -rf", 2, 5, "never deleting")
    assert [e.args["cmd"] for e in found] == ["rm -rf ./*", "cd / && rm -rf ./*"]
    with pytest.raises(AssertionError, match="the rm -rf agent never got to deleting"):
        await day.until.tool_calls("a1", "shell", "rm -rf", 3, 0.3,
                                   "the rm -rf agent never got to deleting")


async def test_trip_alerts_must_name_the_agent_and_every_word(tmp_path: Path) -> None:
    spender = {"id": "a1", "slug": "spender-one"}
    routes: dict[tuple[str, str], Any] = {("GET", "/api/v1/notifications"): [
        {"kind": "agent_tripped", "title": "spender-one stopped by budget"}]}
    day = day_answering(tmp_path, routes)
    with pytest.raises(AssertionError, match="no alert names agent spender-one, the budget "
                       "layer and its money"):
        await day.expect.trip_alerts_name([spender], "budget", "$",
                                          what="the budget layer and its money")
    routes[("GET", "/api/v1/notifications")][0]["title"] += " at $0.50 of $0.50"
    await day.expect.trip_alerts_name([spender], "budget", "$",
                                      what="the budget layer and its money")


async def test_an_agent_its_guard_stopped_is_held_until_a_human_releases_it(
        tmp_path: Path) -> None:
    held = {"killed": True, "kill_origin": "guard"}
    routes: dict[tuple[str, str], Any] = {
        ("POST", "/api/v1/agents/a1/wake"): (202, {"outcome": "started"}),
        ("POST", "/api/v1/fleet/kill"): {"agents_stopped": ["a1"]},
        ("POST", "/api/v1/fleet/resume"): {"agents_woken": []},
        ("GET", "/api/v1/agents/a1"): held}
    day = day_answering(tmp_path, routes)
    owner, security = day.as_("agent_owner"), day.as_("security")
    with pytest.raises(AssertionError, match="a wake restarted an agent its guard had "
                       "stopped"):
        await day.expect.held_by_the_guard([SILENT], owner, security, "budget")
    routes[("POST", "/api/v1/agents/a1/wake")] = (409, {"error": "stopped"})
    await day.expect.held_by_the_guard([SILENT], owner, security, "budget")
    await day.expect.still_held_by_the_guard(SILENT, "budget")

    routes[("POST", "/api/v1/fleet/resume")] = {"agents_woken": ["a1"]}
    with pytest.raises(AssertionError, match="the fleet resume released agents their "
                       "budget guard had stopped: only a changed task or a human may"):
        await day.expect.held_by_the_guard([SILENT], owner, security, "budget")
    routes[("GET", "/api/v1/agents/a1")] = {"killed": False, "kill_origin": None}
    with pytest.raises(AssertionError, match="an agent its budget guard stopped was "
                       "released although nobody changed its task or resumed it"):
        await day.expect.still_held_by_the_guard(SILENT, "budget")
