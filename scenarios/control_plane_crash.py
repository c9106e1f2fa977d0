"""Game day: the control plane is SIGKILLed in the middle of a fleet kill, then started
again. The stop must survive the crash: the daemons, cut off from their control plane, stop
within their lease; after the restart nothing of their sandboxes is left, every agent of the
org is still stopped, every task that was in progress is open again, and fleet resume brings
all of them back, each task done exactly once.

    pytest scenarios/control_plane_crash.py [--stack containers|processes]
"""

from __future__ import annotations

import asyncio
import time

import pytest

from harness.act.client import json_of
from harness.record.gameday import GameDay

MARGIN_S = 3.0  # the lease's own slack plus a loaded machine's
SETTLED_S = 10.0  # from the restart's answer: a few containers' removal on a loaded machine


# Not kill_obeyed: the daemons stop by their lease here, before any kill message can reach
# them (the rule under test), and a kill then finds them already on their way out.
@pytest.mark.checkers("no_action_after_kill_ack", "in_progress_requeued",
                      "each_task_done_once_after_resume", "no_wake_of_stopped_agent",
                      "every_fault_healed")
@pytest.mark.decides("each_task_done_once_after_resume", "every_fault_healed")
async def test_control_plane_killed_mid_fleet_kill(gameday: GameDay,
                                                   agents_per_game_day: int) -> None:
    day, security, auditor = gameday, gameday.as_("security"), gameday.people["auditor"]
    plane = day.endpoints.control_plane
    if plane is None:
        pytest.skip(f"the {day.stack} stack's control plane is not the harness's to crash")
    agents = [await day.agent("silent") for _ in range(min(agents_per_game_day, 5))]
    for a in agents:
        await day.task(a["id"])
    await day.until.all_working(agents)

    # The crash lands once the org's flag is committed (the kill's first step) and the
    # agents' own kills are under way.
    pulling = asyncio.create_task(security.kill_fleet())

    async def flag_committed() -> bool:
        return bool(json_of(await auditor.fleet())["fleet_killed"])
    await day.until.condition(flag_committed, 30, "the fleet kill never committed the "
                              "org's flag")
    crash = await plane.kill()
    answered = await asyncio.gather(pulling, return_exceptions=True)
    day.notes.append(f"the fleet kill's answer through the crash: {answered[0]!r}")
    await asyncio.sleep(day.lease_s + MARGIN_S)  # the window in which nothing may run
    restarting_ns = time.time_ns()
    await plane.start()
    day.measurements["restart_s"] = (time.time_ns() - restarting_ns) / 1e9
    # What the crash left of the stopped fleet (containers, on that stack) the restarted
    # control plane tears down at once: the stop has decided their fate already.
    await day.until.nothing_left_of(agents, SETTLED_S)
    await day.until.all_sandboxes_gone(agents, SETTLED_S)  # and their rows say so
    day.measurements["sandboxes_gone_after_restart_s"] = (
        time.time_ns() - restarting_ns) / 1e9

    await day.expect.no_model_call_between(
        agents, crash.started_ns + round((day.lease_s + MARGIN_S) * 1e9), None,
        f"daemons kept calling their model more than the lease ({day.lease_s} s) + "
        f"{MARGIN_S} s after their control plane died: they did not fail closed")
    assert json_of(await auditor.fleet())["fleet_killed"], (
        "the fleet stop did not survive the control plane's crash: after the restart "
        "the fleet is no longer stopped")

    async def requeued() -> list[str] | None:
        tasks = (await day.read_tasks()).values()
        stuck = [t["id"] for t in tasks if t["state"] == "in_progress"]
        return None if stuck else [t["id"] for t in tasks]
    await day.until.condition(requeued, 90, "tasks in progress at the crash were never "
                              "put back in the backlog after the restart")
    day.measurements["requeued_after_restart_s"] = (time.time_ns() - restarting_ns) / 1e9

    for a in agents:
        await day.endpoints.puppet.assign(a["id"], "well_behaved")
    resumed = await security.resume_fleet()
    assert resumed.status_code == 200, f"the fleet resume failed: {resumed.text[:200]}"
    await day.until.all_tasks_done()
