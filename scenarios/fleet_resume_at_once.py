"""Game day: with the scheduler's tick a minute long, the fleet resume itself must wake
every agent with open work, at once (DESIGN §2.3 line 5: not on the next tick).

    pytest scenarios/fleet_resume_at_once.py --stack processes
"""

from __future__ import annotations

import pytest

from harness.act.client import json_of
from harness.record.gameday import GameDay

TICK_MS = 60_000
AT_ONCE_S = 15.0  # to finish the work: generous on a loaded machine, far below the tick


@pytest.mark.tick_ms(TICK_MS)
@pytest.mark.decides("no_wake_of_stopped_agent", "in_progress_requeued",
                     "each_task_done_once_after_resume", "kill_obeyed")
async def test_fleet_resume_wakes_open_work_at_once(gameday: GameDay) -> None:
    day, security = gameday, gameday.as_("security")
    agents = [await day.agent("silent") for _ in range(3)]
    for a in agents:
        await day.task(a["id"])
    await day.until.all_working(agents)
    json_of(await security.kill_fleet())
    await day.read_tasks()  # the work back in the backlog, for the checkers
    await day.until.all_sandboxes_gone(agents)
    for a in agents:
        await day.endpoints.puppet.assign(a["id"], "well_behaved")

    woken = set(json_of(await security.resume_fleet())["agents_woken"])
    assert woken == {a["id"] for a in agents}, (
        f"the fleet resume did not itself wake every agent with open work (it woke "
        f"{len(woken)} of {len(agents)}); with a {TICK_MS // 1000} s tick they would wait")

    # Nothing else wakes them within the tick: the resume's wake-up does it or nobody.
    await day.until.all_tasks_done(AT_ONCE_S)
