"""Game day: one agent's switch stops that agent and no other, and the fleet switch keeps
what each switch did apart.

    pytest scenarios/one_agent_stopped.py --stack processes

Killing one agent among several stops only it (a warm one's parked sandbox is evicted at
once); an agent created while the fleet stop stands does not run; an agent killed on its own
before the fleet stop stays killed after the fleet resume, while the others come back at
once (DESIGN §2.3 lines 1, 3, 5).
"""

from __future__ import annotations

import asyncio

import pytest

from harness.act.client import json_of
from harness.record.gameday import GameDay


# Not each_task_done_once_after_resume: the agents killed on their own keep their work open.
@pytest.mark.checkers("every_fault_healed")
@pytest.mark.decides("no_action_after_kill_ack", "in_progress_requeued",
                     "no_wake_of_stopped_agent", "kill_obeyed")
async def test_one_agent_stopped_the_rest_untouched(gameday: GameDay) -> None:
    day, owner, security = gameday, gameday.as_("agent_owner"), gameday.as_("security")
    auditor = day.people["auditor"]
    warm = await day.agent("well_behaved", warm=True)
    lone, *others = [await day.agent("silent") for _ in range(4)]
    json_of(await owner.create_task(warm), 201)
    await day.until.condition(lambda: day.until.all_tasks_done_of([warm]), 60,
                              "the warm agent never finished its first task")
    for a in (lone, *others):
        json_of(await owner.create_task(a), 201)
    await day.until.all_working([lone, *others])

    killed = json_of(await owner.kill_agent(lone))
    assert killed["agents_stopped"] == [lone["id"]], (
        f"one agent's switch stopped other agents too: {killed['agents_stopped']}")
    await day.until.all_sandboxes_gone([lone])
    await day.until.all_working(others, 10)  # the agents beside it kept at work
    evicted = json_of(await owner.kill_agent(warm))
    boxes = {s["id"]: s["state"] for s in await day.sandboxes(warm["id"])}
    assert all(boxes[b] in ("evicted", "gone") for b in evicted["evicted_sandboxes"]) \
        and not [s for s in boxes.values() if s in ("parked", "running")], (
        f"the killed warm agent kept a sandbox: {boxes}")

    json_of(await security.kill_fleet())
    await day.read_tasks()  # what the fleet stop requeued, for the checkers
    newcomer = await day.agent("well_behaved")
    json_of(await owner.create_task(newcomer, "arrived during the stop"), 201)
    await asyncio.sleep(2)  # the one window in which nothing may happen
    assert not json_of(await auditor.sessions(newcomer["id"])), (
        "an agent created while the fleet stop stood was started")

    for a in (*others, newcomer):
        await day.endpoints.puppet.assign(a["id"], "well_behaved")
    before = {s["id"] for a in others for s in json_of(await auditor.sessions(a["id"]))}
    woken = set(json_of(await security.resume_fleet())["agents_woken"])
    for a in (*others, newcomer):
        if a["id"] not in woken:  # the tick may get there first, the moment it clears
            sessions = json_of(await auditor.sessions(a["id"]))
            assert {s["id"] for s in sessions} - before, (
                f"the fleet resume did not wake agent {a['slug']} with open work at once")
    for a in (lone, warm):
        after = json_of(await auditor.agent(a["id"]))
        assert after["killed"] and a["id"] not in woken, (
            f"fleet resume left agent {a['slug']} running although its own switch, not "
            f"only the fleet switch, had stopped it")
    await day.until.condition(lambda: day.until.all_tasks_done_of([*others, newcomer]),
                              90, "the agents the fleet resume released did not finish "
                              "their work")
