"""The first game day, run before every release: pull the fleet switch on working agents.

    pytest scenarios/fleet_stop.py [--stack processes|target] [--agents 5] [--seed N]

Security pulls the emergency stop while N agents of mixed behaviours work real tasks; the
checkers judge the history afterwards and the journal (reports/) keeps the verdicts,
time-to-stop per agent and the steady states.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from harness.client import json_of
from harness.gameday import GameDay, assert_valid
from harness.isolation import strangers_stopped
from harness.waiting import eventually

# A multi-step writer, an agent that never stops on its own, and a well-behaved one whose
# tasks finish (so work is seen moving).
BEHAVIOURS = ("slow_writer", "silent", "well_behaved")
STOPPED = {"error": "Agent or fleet is stopped", "hint": "resume it first."}


# in_progress_requeued is judged but not required: a well-behaved agent may finish a task
# between the read before the kill and the kill itself, which the history cannot order.
@pytest.mark.decides("no_action_after_kill_ack", "each_task_done_once_after_resume",
                     "no_wake_of_stopped_agent", "every_fault_healed", "kill_obeyed")
async def test_fleet_stop(gameday: GameDay, agents_per_game_day: int) -> None:
    day, security, admin = gameday, gameday.as_("security"), gameday.as_("org_admin")
    auditor = day.people["auditor"]
    async with day.journaled() as outcome:
        agents = [await day.agent(BEHAVIOURS[i % 3]) for i in range(agents_per_game_day)]
        for a in agents:
            for _ in range(2 if a["behaviour"] == "well_behaved" else 1):
                await day.task(a["id"])
        hb = agents[0]
        json_of(await admin.client.add_heartbeat(hb["id"], "hourly", "heartbeat", 3600), 201)

        async def steady() -> dict[str, Any] | None:  # every busy agent at work, work moving
            tasks = await day.read_tasks()
            working = [t for t in tasks.values() if t["state"] == "in_progress"]
            held = {t["agent_id"] for t in working}
            done = sum(t["state"] == "done" for t in tasks.values())
            if all(a["id"] in held for a in agents if a["behaviour"] != "well_behaved") and (
                    done or all(a["behaviour"] != "well_behaved" for a in agents)):
                return {"tasks_in_progress": len(working), "tasks_done": done,
                        "agents": len(agents)}
            return None
        day.steady_state = await eventually(steady, 120, "no steady state: agents not working",
                                            impossible=day.why_work_cannot_finish)

        in_progress = {i for i, t in (await day.read_tasks()).items()
                       if t["state"] == "in_progress"}
        report = json_of(await security.kill_fleet())
        mine, stopped = {a["id"] for a in agents}, set(report["agents_stopped"])
        assert mine <= stopped, f"the fleet stop left agents running: {sorted(mine - stopped)}"
        strangers = await strangers_stopped(day, mine, stopped)  # a shared organisation's own
        assert strangers is None, strangers
        tasks = await day.read_tasks()
        requeued = [t for t in report["tasks_requeued"] if t in tasks]
        assert requeued, "the fleet stop requeued none of the game day's tasks"
        await day.until.all_sandboxes_gone(agents)
        cancelled = set(report["sessions_cancelled"])
        assert cancelled, "the fleet stop found no session to stop"
        assert set(report["sessions_confirmed"]) == cancelled, (
            "the fleet stop answered before every daemon had the kill in hand")
        unacked = cancelled - set(report["sessions_acknowledged"])
        assert not unacked, f"daemons that did not acknowledge the kill before answering: {unacked}"
        sessions = {a["id"]: json_of(await auditor.sessions(a["id"])) for a in agents}
        boxes = {s["sandbox_id"] for ss in sessions.values() for s in ss if s["id"] in cancelled}
        exits = {s["id"]: s["exit_code"] for a in agents for s in await day.sandboxes(a["id"])
                 if s["id"] in boxes}
        assert exits == dict.fromkeys(boxes, 3), f"daemons that did not obey (exit 3): {exits}"
        tasks = await day.read_tasks()
        assert not [t for t in tasks.values() if t["state"] == "in_progress"], (
            "tasks still in progress after the fleet stop")
        assert all(tasks[t]["state"] == "open" for t in requeued), (
            "a task the fleet stop requeued is not open")
        assert all(tasks[t]["state"] in ("open", "done") for t in in_progress), (
            "a task in progress at the stop neither went back to open nor finished")

        # While the stop stands nothing starts: a new task stays open, the manual heartbeat
        # and the trigger bounce with 409 and the hint; only security roles hold the switch.
        fresh = await day.task(agents[-1]["id"], "arrived during the stop")
        await asyncio.sleep(2)  # the one window in which nothing may happen
        assert json_of(await auditor.task(agents[-1]["id"], fresh["id"]))["state"] == "open", \
            "a task that arrived during the fleet stop was started"
        for what, r in (("a manual heartbeat fire", await admin.fire_heartbeat(hb, "hourly")),
                        ("the external trigger", await admin.trigger(hb))):
            assert (r.status_code, r.json()) == (409, STOPPED), \
                f"{what} was not refused during the fleet stop"
        for role in ("org_admin", "controlling"):
            assert any(n["kind"] == "fleet_killed" for n in json_of(
                await day.people[role].notifications())), f"{role} was not notified of the stop"
        for role in ("agent_owner", "auditor", "controlling"):
            assert (await day.as_(role).kill_fleet()).status_code == 403, \
                f"{role} may pull the fleet switch"
            assert (await day.as_(role).resume_fleet()).status_code == 403, \
                f"{role} may resume the fleet"

        # Releasing one agent does not wake it: the fleet stop still holds it.
        released = json_of(await admin.resume_agent(agents[0]))
        assert released["held_by_fleet"] is True and released["agents_woken"] == [], \
            "an agent resumed on its own ran while the fleet stop stood"
        await asyncio.sleep(1)  # nothing may start in this window either
        assert not [s for s in json_of(await auditor.sessions(agents[0]["id"]))
                    if s["state"] in ("starting", "running")], \
            "an agent resumed on its own started a session while the fleet stop stood"

        # The incident is over: the agents behave, the fleet resumes, every agent with open
        # work is woken at once (by the resume, or by the tick the moment the flags clear:
        # a session new since the stop), and every task completes exactly once.
        for a in agents:
            await day.endpoints.puppet.assign(a["id"], "well_behaved")
        with_work = {t["agent_id"] for t in (await day.read_tasks()).values()
                     if t["state"] == "open"}
        before = {s["id"] for a in with_work for s in json_of(await auditor.sessions(a))}
        at_work = set(json_of(await security.resume_fleet())["agents_woken"]) & mine
        at_work |= {a for a in with_work - at_work
                    if {s["id"] for s in json_of(await auditor.sessions(a))} - before}
        assert at_work >= with_work, (f"the fleet resume did not wake at once every agent "
                                      f"with open work: {sorted(with_work - at_work)}")
        outcome.steady_after = {"tasks_done": len(await day.until.all_tasks_done()),
                                "agents": len(agents)}

        final = await day.judged(outcome)
        assert_valid(outcome.verdicts, day.required)
        twice = {t: f["done_count"] for t, f in final.tasks.items() if f["done_count"] != 1}
        assert not twice, f"tasks not done exactly once: {twice}"
        fleet = [s for s in outcome.samples if s.kill_f == "kill_fleet"]
        assert {s.agent_id for s in fleet} == mine, "no time-to-stop measured for some agents"
        assert all(s.kill_acknowledged_ns is not None for s in fleet), \
            "a time-to-stop has no acknowledged kill"
        assert all(s.daemon_exit_ns is not None and s.sandbox_gone_ns is not None for s in fleet
                   if any(x["id"] in cancelled for x in sessions[s.agent_id])), \
            "a stopped agent's time-to-stop lacks its daemon's exit or its sandbox's end"
