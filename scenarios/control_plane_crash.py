"""Game day: the control plane is SIGKILLed just before a fleet kill commits (frozen with its
request in hand) or just after, and started again. Its daemons fail closed at once: none acts
after its death, each exits 3 saying why. Once back, no session of its previous life runs; a
committed stop held (else it is pulled again); nothing of the sandboxes is left, the work is
open again and fleet resume gets it done exactly once.

    pytest scenarios/control_plane_crash.py [--stack containers|processes]
"""

from __future__ import annotations

import asyncio
import time

import pytest

from harness.act.client import json_of
from harness.act.expect import rule
from harness.record.gameday import GameDay

ACT_SLACK_S = 1.0  # a daemon noticing that its channel is gone, on a loaded 2-core machine
HOLD_S = 0.3  # the kill's request on its way to the frozen plane: well within the lease
SETTLED_S = 10.0  # from the restart's answer: a few containers' removal on a loaded machine
MARGIN_S = 3.0  # past the lease, for the previous life's sessions (the sweep: 15 s)


# Not kill_obeyed: the daemons stop as their channel dies, before any kill can reach them.
@pytest.mark.checkers("no_action_after_kill_ack", "in_progress_requeued",
                      "each_task_done_once_after_resume", "no_wake_of_stopped_agent",
                      "every_fault_healed")
@pytest.mark.decides("each_task_done_once_after_resume", "every_fault_healed")
@pytest.mark.parametrize("crash", ["before_commit", "after_commit"])
async def test_control_plane_killed_mid_fleet_kill(gameday: GameDay, agents_per_game_day: int,
                                                   crash: str) -> None:
    day, security, auditor = gameday, gameday.as_("security"), gameday.people["auditor"]
    if (plane := day.endpoints.control_plane) is None:
        pytest.skip(f"the {day.stack} stack's control plane is not the harness's to crash")
    agents = [await day.agent("silent") for _ in range(min(agents_per_game_day, 5))]
    for a in agents:
        await day.task(a["id"])
    await day.until.all_working(agents)
    live = await day.live_sessions(agents)

    async def committed() -> bool:
        return bool(json_of(await auditor.fleet())["fleet_killed"])
    if crash == "before_commit":  # what is in progress, read before the plane is frozen
        await day.read_tasks()
        await plane.pause(HOLD_S + 30)  # ends with the kill below
    pulling = asyncio.create_task(security.kill_fleet(read_first=crash == "after_commit"))
    if crash == "before_commit":
        done, _ = await asyncio.wait({pulling}, timeout=HOLD_S)  # nothing can answer here
        rule(not done, f"a frozen control plane answered a fleet kill: {pulling}")
    else:
        await day.until.condition(committed, 30, "the fleet kill never committed its flag")
    died = await plane.kill()
    answer = (await asyncio.gather(pulling, return_exceptions=True))[0]
    day.notes.append(f"the fleet kill's answer through the crash: {answer!r}")
    await day.expect.failed_closed(agents, list(live.values()), died.started_ns, ACT_SLACK_S)

    restarting_ns = time.time_ns()
    await plane.start()
    day.measurements["restart_s"] = (time.time_ns() - restarting_ns) / 1e9
    await day.until.sessions_over(agents, set(live), day.lease_s + MARGIN_S, "the restarted "
                                  "control plane left sessions of its previous life running")
    day.measurements["sessions_over_after_restart_s"] = (time.time_ns() - restarting_ns) / 1e9
    if not await committed():
        rule(crash == "before_commit", "the fleet stop did not survive the control plane's "
             "crash: after the restart the fleet is no longer stopped")
        again = await security.kill_fleet()  # the operator's kill was never answered
        rule(again.status_code == 200, f"the fleet kill pulled again failed: {again.text}")
    await day.until.nothing_left_of(agents, SETTLED_S)
    await day.until.all_sandboxes_gone(agents, SETTLED_S)  # and their rows say so
    async def requeued() -> bool:
        return all(t["state"] != "in_progress" for t in (await day.read_tasks()).values())
    await day.until.condition(requeued, 90, "tasks in progress at the crash were never "
                              "put back in the backlog after the restart")
    for a in agents:
        await day.endpoints.puppet.assign(a["id"], "well_behaved")
    rule((r := await security.resume_fleet()).status_code == 200, f"resume failed: {r.text}")
    await day.until.all_tasks_done()
