"""Game day: one working agent killed and resumed six times, for the time from the
switch's request to its answer and to the sandbox's daemon exit (journal: time_to_stop,
one sample per kill), the same on every control plane it runs against.

    pytest scenarios/agent_kill_timing.py [--stack target --dialect upstream]
    python -m harness.report.side_by_side reports/   # the kills, side by side
"""

from __future__ import annotations

import pytest

from harness.act.client import json_of
from harness.record.gameday import GameDay

KILLS = 6


@pytest.mark.checkers("every_fault_healed")
@pytest.mark.decides("no_wake_of_stopped_agent", "no_sandbox_alive_after_stop")
async def test_agent_kill_timing(gameday: GameDay) -> None:
    day, owner = gameday, gameday.as_("agent_owner")
    agent = await day.agent("silent")
    json_of(await owner.create_task(agent, "works until it is stopped"), 201)
    for kill in range(KILLS):
        await day.until.all_working([agent], 60)
        json_of(await owner.kill_agent(agent))
        await day.until.all_sandboxes_gone([agent], 30)
        if kill < KILLS - 1:
            json_of(await owner.resume_agent(agent))  # its requeued task wakes it again
    final = await day.judged()
    exits = [s.daemon_exit_code for s in day.outcome.samples if s.kill_f == "kill_agent"]
    assert len(exits) == KILLS, f"{KILLS} kills, but {len(exits)} time-to-stop samples"
    assert final.agents[agent["id"]]["killed"], "the last kill did not leave the agent killed"
