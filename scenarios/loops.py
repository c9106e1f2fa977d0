"""Game day: an agent repeating one call, and one cycling through two.

    pytest scenarios/loops.py --stack processes

The loop detector must stop each, and its alert must name the tool and how many times it
repeated (DESIGN §2.4: "stopped by the loop detector after repeating search_orders 4 times
with identical arguments"). Measured: the steps each spent before the trip.
"""

from __future__ import annotations

import pytest

from harness.act.client import json_of
from harness.record.gameday import GameDay

REPEATS, CYCLES = 4, 3
GUARD = {"loop_repeats": REPEATS, "loop_window": 10, "cycle_repeats": CYCLES}


@pytest.mark.decides("no_blind_restart_after_trip")
@pytest.mark.checkers("no_blind_restart_after_trip", "every_fault_healed")
@pytest.mark.measures("steps_before_trip")
async def test_loops_stopped_by_the_loop_detector(gameday: GameDay) -> None:
    day, owner = gameday, gameday.as_("agent_owner")
    outcome = day.outcome
    same = await day.agent("same_call", guard=GUARD)
    cycle = await day.agent("read_write_cycle", guard=GUARD)
    worker = await day.agent("well_behaved", guard=GUARD)
    for a in (same, cycle, worker):
        json_of(await owner.create_task(a), 201)
    stopped = {a["id"]: await day.until.stopped_by(a, "loop") for a in (same, cycle)}
    await day.until.condition(
        lambda: day.until.all_tasks_done_of([worker]), 60,
        "a well-behaved agent with the same loop limits did not finish its task")

    alerts = [n["title"] for n in json_of(await day.people["security"].notifications())
              if n["kind"] == "agent_tripped"]
    expected = {same["slug"]: ("loop detector", "shell", f"{REPEATS} times"),
                cycle["slug"]: ("loop detector", "read_file, write_file",
                                f"{CYCLES} times")}
    for slug, words in expected.items():
        alert = next((t for t in alerts if slug in t), "")
        assert all(w in alert for w in words), (
            f"the alert for agent {slug} does not say it was the loop detector, which "
            f"tool and how many times ({', '.join(words)}): {alert or alerts}")
    for a in (same, cycle):
        assert "times" in (stopped[a["id"]]["stop_reason"] or ""), (
            f"agent {a['slug']}'s session does not record why the loop detector stopped "
            f"it: {stopped[a['id']]}")

    await day.judged(outcome)
    steps = day.measurements["steps_before_trip"]
    assert steps[same["id"]]["steps"] == REPEATS, (
        f"the identical-call loop ran {steps[same['id']]['steps']} steps, not the "
        f"{REPEATS} its limit allows")
    assert steps[cycle["id"]]["steps"] == 2 * CYCLES, (
        f"the A/B cycle ran {steps[cycle['id']]['steps']} steps, not {2 * CYCLES}")
