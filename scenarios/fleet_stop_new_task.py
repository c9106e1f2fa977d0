"""Game day TestNotausDerFlotte (DESIGN §2.3 line 4): while the fleet stop stands a new task
stays open and its agent does not work, a manual wake starts nothing; after the fleet
resume the task is worked on.

    pytest scenarios/fleet_stop_new_task.py [--stack target --dialect upstream]
"""

from __future__ import annotations

import asyncio

import pytest

from harness.act.client import json_of
from harness.record.gameday import GameDay


@pytest.mark.checkers("every_fault_healed")
@pytest.mark.decides("no_wake_of_stopped_agent", "wake_paths_refused_while_stopped",
                     "each_task_done_once_after_resume")
async def test_notaus_der_flotte(gameday: GameDay) -> None:
    day, owner, security = gameday, gameday.as_("org_admin"), gameday.as_("security")
    auditor = day.people["auditor"]
    agent = await day.agent("well_behaved")
    json_of(await security.kill_fleet())
    task = json_of(await owner.create_task(agent, "arrived during the fleet stop"), 201)
    await asyncio.sleep(2)  # the one window in which nothing may happen
    state = (await day.read_tasks())[task["id"]]["state"]
    assert state == "open", (f"a task that arrived during the fleet stop was {state} 2 s "
                             f"later: the new-task wake or the tick ignored the stop")
    status = json_of(await auditor.agent(agent["id"]))["status"]
    assert status != "working", "an agent worked while the fleet stop stood"
    await owner.wake(agent)  # its answer is judged by wake_paths_refused_while_stopped
    await asyncio.sleep(1)  # nothing may start in this window either
    assert not json_of(await auditor.sessions(agent["id"])), (
        "a manual wake during the fleet stop started the agent")

    await day.expect.fleet_resume_wakes_open_work(security, [agent])
    done = await day.until.all_tasks_done(60)
    assert done[task["id"]]["state"] == "done", "the task was not worked on after the resume"
