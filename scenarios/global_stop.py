"""Game day: a platform admin's global kill flag stops the agents of every organisation and
holds them through every wake path until it is cleared (DESIGN §2.4 scopes, README "Kill
flags by scope").

    pytest scenarios/global_stop.py --stack processes

Agents of two organisations work; the platform admin sets the global flag; every agent of
both stops; while it stands a new task stays open, and a heartbeat fire, the trigger and a
manual wake are refused; clearing it wakes at once the agents with open work, which then
finish it. Needs a platform admin (the processes and containers stacks make one).
"""

from __future__ import annotations

import asyncio

import pytest

from harness.act.client import json_of
from harness.act.expect import rule
from harness.record.gameday import GameDay


@pytest.mark.decides("no_action_after_kill_ack", "in_progress_requeued",
                     "each_task_done_once_after_resume", "no_wake_of_stopped_agent",
                     "wake_paths_refused_while_stopped", "kill_obeyed")
async def test_a_global_stop_holds_two_organisations(gameday: GameDay) -> None:
    day, expect = gameday, gameday.expect
    platform = await day.platform_admin()
    beside = await day.organisation_beside()
    ours = [await day.agent("silent") for _ in range(2)]
    theirs = [await day.agent("silent", org=beside) for _ in range(2)]
    agents = [*ours, *theirs]
    admin_of = {a["id"]: day.as_("org_admin", org=None if a in ours else beside)
                for a in agents}
    for a in agents:
        json_of(await admin_of[a["id"]].create_task(a), 201)
        json_of(await admin_of[a["id"]].client.add_heartbeat(
            a["id"], "hourly", "look around", 3600), 201)
    await day.until.all_working(agents)

    stop = json_of(await platform.stop_globally())
    await day.until.all_sandboxes_gone(agents)
    stopped = await expect.daemons_obeyed(agents, set(stop["sessions_cancelled"]))
    running = sorted(a["slug"] for a in agents if a["id"] not in stopped)
    rule(not running, f"the global stop did not stop the sessions of agents {running}; it "
         "must stop every agent of every organisation")
    # While it stands, no wake path of either organisation starts anything.
    await asyncio.gather(*(expect.nothing_starts(a, a, "hourly", by=admin_of[a["id"]],
                                                 stop="the global stop") for a in agents))
    for org, fleet in (("ours", json_of(await day.people["auditor"].fleet())),
                       ("beside", json_of(await admin_of[theirs[0]["id"]].client.fleet()))):
        rule(fleet["global_stop"] is True and fleet["fleet_killed"] is False,
             f"the fleet read of organisation {org} does not show the global stop alone: "
             f"{fleet}")

    for a in agents:
        await day.endpoints.puppet.assign(a["id"], "well_behaved")
    await expect.release_wakes_open_work(platform.clear_global_stop, agents,
                                         "clearing the global stop")
    await day.until.all_tasks_done()
