"""Game day: one agent's switch stops that agent and no other, and the fleet switch keeps
what each switch did apart.

    pytest scenarios/one_agent_stopped.py --stack processes

Killing one agent among several stops only it (a warm one's parked sandbox is evicted at
once); an agent created while the fleet stop stands does not run, and its trigger is
refused; an agent killed on its own before the fleet stop stays killed after the fleet
resume, while the others come back at once (DESIGN §2.3 lines 1, 3, 5).
"""

from __future__ import annotations

import asyncio

import pytest

from harness.act.client import json_of
from harness.record.gameday import GameDay


# Not each_task_done_once_after_resume: the agents killed on their own keep their work open.
@pytest.mark.checkers("every_fault_healed")
@pytest.mark.decides("no_action_after_kill_ack", "in_progress_requeued",
                     "no_wake_of_stopped_agent", "kill_obeyed", "fleet_resume_keeps_own_kills",
                     "wake_paths_refused_while_stopped")
async def test_one_agent_stopped_the_rest_untouched(gameday: GameDay) -> None:
    day, owner, security = gameday, gameday.as_("agent_owner"), gameday.as_("security")
    auditor, expect = day.people["auditor"], day.expect
    warm = await day.agent("well_behaved", warm=True)
    lone, *others = [await day.agent("silent") for _ in range(4)]
    json_of(await owner.create_task(warm), 201)
    await day.until.condition(lambda: day.until.all_tasks_done_of([warm]), 60,
                              "the warm agent never finished its first task")
    for a in (lone, *others):
        json_of(await owner.create_task(a), 201)
    await day.until.all_working([lone, *others])

    await expect.only_this_agent_stopped(await owner.kill_agent(lone), lone, others)
    await day.until.all_sandboxes_gone([lone])
    await day.until.all_working(others, 10)  # the agents beside it kept at work
    await expect.warm_sandbox_evicted(await owner.kill_agent(warm), warm)

    json_of(await security.kill_fleet())
    await day.read_tasks()  # what the fleet stop requeued, for the checkers
    newcomer = await day.agent("well_behaved")
    json_of(await owner.create_task(newcomer, "arrived during the stop"), 201)
    await owner.trigger(newcomer, "triggered during the stop")  # judged by the checkers
    await asyncio.sleep(2)  # the one window in which nothing may happen
    assert not json_of(await auditor.sessions(newcomer["id"])), (
        "an agent created while the fleet stop stood was started")

    for a in (*others, newcomer):
        await day.endpoints.puppet.assign(a["id"], "well_behaved")
    woken = await expect.fleet_resume_wakes_open_work(security, [*others, newcomer])
    for a in (lone, warm):
        after = json_of(await auditor.agent(a["id"]))
        assert after["killed"] and a["id"] not in woken, (
            f"fleet resume left agent {a['slug']} running although its own switch, not "
            f"only the fleet switch, had stopped it")
    await day.until.condition(lambda: day.until.all_tasks_done_of([*others, newcomer]),
                              90, "the agents the fleet resume released did not finish "
                              "their work")
