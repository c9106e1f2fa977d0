"""Kill flags by scope (DESIGN §2.4): a global flag stops every organisation, a tool flag
stops one tool of one agent while it goes on with the others, clearing a flag lets work
resume, and a daemon that cannot have its lease renewed stops anyway (fail closed)."""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from covey.testing import SCRIPTED_DAEMON
from covey.testing.plane import World, make_world, platform_admin_client, start_plane
from harness.act import puppet as puppet_module
from harness.act.puppet import Puppet, _call, _reply
from harness.stack.waiting import eventually
from tests.conftest import COVEYD

REFUSED = "kill flag set for tool shell"


async def _status(world: World, agent_id: str) -> str:
    status: str = await world.db.fetchval("SELECT status FROM agents WHERE id=$1",
                                          uuid.UUID(agent_id))
    return status


async def test_a_global_flag_stops_the_agents_of_two_organisations(world: World) -> None:
    other = world.other.clients["org_admin"]
    mine = [(await world.agent())["id"] for _ in range(2)]
    r = await other.post("/api/v1/agents", json={"slug": "theirs", "display_name": "Theirs"})
    theirs = r.json()["id"]
    tasks = {a: (await world.task(a, "hold"))["id"] for a in mine}
    r = await other.post(f"/api/v1/agents/{theirs}/tasks", json={"title": "t", "body": "hold"})
    tasks[theirs] = r.json()["id"]
    for a in tasks:
        await world.wait_working(a)

    for client in (world.org_admin, world.security, other):
        r = await client.post("/api/v1/flags/global", json={"reason": "not mine to pull"})
        assert r.status_code == 403, "only a platform admin sets the global flag"
    platform = await platform_admin_client(world)
    try:
        r = await platform.post("/api/v1/flags/global", json={"reason": "provider incident"})
        assert r.status_code == 200, r.text
        assert len(r.json()["sessions_cancelled"]) == 3, r.json()
        for a, t in tasks.items():
            assert await world.task_state(t) == "open", "a stopped agent's work is requeued"
            assert await _status(world, a) != "working"
        # It stands for every wake path: a manual wake, the scheduler with open work.
        r = await world.org_admin.post(f"/api/v1/agents/{mine[0]}/wake")
        assert r.status_code == 409, r.text
        flags = (await other.get("/api/v1/flags")).json()
        assert [f["reason"] for f in flags if f["scope"] == "global"] == ["provider incident"]
        # Every organisation's fleet read says so: its own switch is not what stopped it.
        for client in (world.auditor, other):
            fleet = (await client.get("/api/v1/fleet")).json()
            assert fleet["global_stop"] is True and fleet["fleet_killed"] is False, fleet
        await world.task(mine[1], "hold")  # a new task: the NOTIFY wake path
        await asyncio.sleep(1.5)  # the one window in which nothing may start (ticks: 0.3 s)
        assert await world.db.fetchval(
            "SELECT count(*) FROM sessions WHERE state IN ('starting','running')") == 0, \
            "an agent woke while the global flag stood"
        r = await platform.get("/api/v1/flags")
        assert r.status_code == 200 and r.json()[0]["scope"] == "global", r.text
        mark = await world.event_mark()
        r = await platform.post("/api/v1/flags/global/clear", json={"reason": "resolved"})
        assert r.status_code == 200, r.text
        assert (await world.auditor.get("/api/v1/fleet")).json()["global_stop"] is False
        for a in tasks:
            await world.wait_working(a)
        await world.released(r, mark, list(tasks))
        actions = [r["action"] for r in await world.db.fetch(
            "SELECT action FROM audit_log WHERE action LIKE 'flag.global.%' ORDER BY id")]
        assert actions == ["flag.global.set", "flag.global.clear"]
    finally:
        await platform.aclose()


async def test_a_daemon_deaf_to_the_kill_stops_when_its_lease_is_not_renewed(
        database_url: str, tmp_path: Path) -> None:
    """Fail closed: the daemon ignores `kill`; no lease is renewed under the global flag.
    The runner's second line is off here (it would tear the deaf daemon down first)."""
    async with start_plane(database_url, tmp_path, SCRIPTED_DAEMON, kill_ack_bound_ms=0
                           ) as plane, make_world(plane) as world:
        await _deaf_stops_by_its_lease(world)


async def _deaf_stops_by_its_lease(world: World) -> None:
    agent = (await world.agent())["id"]
    await world.task(agent, "deaf")
    await world.wait_working(agent)
    platform = await platform_admin_client(world)
    try:
        r = await platform.post("/api/v1/flags/global", json={"reason": "drill"})
        assert r.status_code == 200
    finally:
        await platform.aclose()

    async def exited() -> dict[str, Any] | None:
        rows = (await world.auditor.get(f"/api/v1/agents/{agent}/sandboxes")).json()
        return next((s for s in rows if s["exit_code"] is not None), None)
    sandbox = await eventually(exited, 15, "a daemon deaf to the kill kept running "
                               "although its lease was no longer renewed")
    assert sandbox["exit_code"] == 3
    stop = await world.db.fetchval("SELECT daemon_stop FROM sessions WHERE agent_id=$1",
                                   uuid.UUID(agent))
    assert stop == "lease", f"it stopped, but not by its lease: {stop}"


def shell_and_files(step: int, base_url: str) -> dict[str, Any]:
    """Never finishes: a shell call, then a file write, in turn."""
    if step % 2 == 0:
        return _reply([_call("shell", {"cmd": f"echo shell-ran-{step}"})])
    return _reply([_call("write_file", {"path": "notes.txt", "content": f"step {step}\n"})])


@pytest.fixture
def mixed_tools() -> Iterator[None]:
    puppet_module.BEHAVIOURS["shell_and_files"] = shell_and_files
    yield
    del puppet_module.BEHAVIOURS["shell_and_files"]


@pytest.fixture
async def cworld(database_url: str, tmp_path: Path, model: tuple[str, Puppet],
                 mixed_tools: None) -> AsyncIterator[World]:
    async with start_plane(database_url, tmp_path, COVEYD, model_url=model[0]) as plane, \
            make_world(plane) as world:
        yield world


async def _flag_in_hand(world: World, agent_id: str, stopped: list[str], after: Any) -> int:
    """When the agent's daemon acknowledged these stopped scopes (wall clock ns)."""
    async def acknowledged() -> Any:
        return await world.db.fetchval(
            "SELECT at FROM recording_events WHERE agent_id=$1 AND kind='kill_flag'"
            " AND detail->'stopped' = $2::jsonb AND at >= $3 ORDER BY at LIMIT 1",
            uuid.UUID(agent_id), json.dumps(stopped), after)
    at = await eventually(acknowledged, 10, f"agent {agent_id} never acknowledged {stopped}")
    return int(at.timestamp() * 1e9)


def _shell_ran(results: list[str]) -> bool:
    return any("shell-ran" in r for r in results)


async def test_a_tool_flag_stops_shell_for_one_agent_while_its_other_tools_go_on(
        cworld: World, model: tuple[str, Puppet]) -> None:
    puppet = model[1]
    stopped, bystander = [(await cworld.agent(max_turns=500))["id"] for _ in range(2)]
    for a in (stopped, bystander):
        await cworld.task(a, "model:shell_and_files")

    async def busy() -> bool:
        return all(len(puppet.actions(a)) >= 4 for a in (stopped, bystander))
    await eventually(busy, 20, "the agents never got going")

    r = await cworld.auditor.post("/api/v1/flags/tool", json={
        "tool": "shell", "agent_id": stopped, "reason": "x"})
    assert r.status_code == 403
    r = await cworld.agent_owner.post("/api/v1/flags/tool", json={
        "tool": "shell", "reason": "whole org"})
    assert r.status_code == 403, "a tool for the whole organisation takes a security role"
    since = await cworld.db.fetchval("SELECT now()")
    r = await cworld.agent_owner.post("/api/v1/flags/tool", json={
        "tool": "shell", "agent_id": stopped, "reason": "shell is deleting files"})
    assert r.status_code == 200 and r.json()["changed"], r.text
    ack_ns = await _flag_in_hand(cworld, stopped, ["tool:shell"], since)

    async def went_on() -> bool:
        later = [e for e in puppet.actions(stopped) if e.at_ns > ack_ns]
        return len(later) >= 6
    await eventually(went_on, 20, "the agent stopped altogether instead of going on "
                     "without shell")
    entries = puppet.actions(stopped)
    # A call the model chose after the flag was in hand (the entry before it is later
    # than the acknowledgement) is refused if it is shell; a call already under way ran.
    after = [b for a, b in itertools.pairwise(entries) if a.at_ns > ack_ns]
    assert not [e for e in after if _shell_ran(e.tool_results)], \
        "a shell call ran after the tool flag was acknowledged"
    assert any(REFUSED in r for e in after for r in e.tool_results), \
        "the model never heard that shell is stopped"
    assert any('"written"' in r for e in after for r in e.tool_results), \
        "the agent's other tools did not go on"
    assert await _status(cworld, stopped) == "working", "a tool flag is not an agent kill"
    bystanders = [e for e in puppet.actions(bystander) if e.at_ns > ack_ns]
    assert any(_shell_ran(e.tool_results) for e in bystanders), \
        "another agent's shell stopped too"
    flags = (await cworld.auditor.get("/api/v1/flags")).json()
    assert [(f["scope"], f["tool"], f["agent_id"]) for f in flags] == [
        ("tool", "shell", stopped)]

    since = await cworld.db.fetchval("SELECT now()")
    r = await cworld.agent_owner.post("/api/v1/flags/tool/clear", json={
        "tool": "shell", "agent_id": stopped, "reason": "fixed the prompt"})
    assert r.status_code == 200 and r.json()["changed"], r.text
    cleared_ns = await _flag_in_hand(cworld, stopped, [], since)

    async def shell_again() -> bool:
        return any(_shell_ran(e.tool_results) for e in puppet.actions(stopped)
                   if e.at_ns > cleared_ns)
    await eventually(shell_again, 20, "shell never came back after the flag was cleared")
    audit = [(r["action"], json.loads(r["detail"])["reason"]) for r in await cworld.db.fetch(
        "SELECT action, detail FROM audit_log WHERE action LIKE 'flag.tool.%' ORDER BY id")]
    assert audit == [("flag.tool.set", "shell is deleting files"),
                     ("flag.tool.clear", "fixed the prompt")]
