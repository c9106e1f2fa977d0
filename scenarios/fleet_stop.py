"""The first game day, run before every release: pull the fleet switch on working agents.

    pytest scenarios/fleet_stop.py [--stack processes|target] [--agents 5] [--seed N]

Security pulls the emergency stop while N agents of mixed behaviours work real tasks. The
scenario records everything in the game day's history; the checkers judge it afterwards and
the journal (reports/) keeps the verdicts, time-to-stop per agent and the steady states.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from harness.client import json_of
from harness.gameday import GameDay, assert_valid
from harness.isolation import strangers_stopped
from harness.waiting import eventually

# A mix that keeps working until stopped: a multi-step writer, an agent that never stops on
# its own, and a well-behaved one whose tasks finish (so work is seen moving).
BEHAVIOURS = ("slow_writer", "silent", "well_behaved")
STOPPED = {"error": "Agent or fleet is stopped", "hint": "resume it first."}


# in_progress_requeued is judged but not required: a well-behaved agent may finish a task
# between the read before the kill and the kill itself, which the history cannot order, and
# the checker rightly says `unknown` then. control_channel_cut's silent agents decide it.
@pytest.mark.decides("no_action_after_kill_ack", "each_task_done_once_after_resume",
                     "no_wake_of_stopped_agent", "every_fault_healed", "kill_obeyed")
async def test_fleet_stop(gameday: GameDay, agents_per_game_day: int) -> None:
    day = gameday
    security, admin = day.people["security"], day.people["org_admin"]
    async with day.journaled() as outcome:
        # Steady state: every agent working, tasks moving.
        agents = [await day.agent(BEHAVIOURS[i % len(BEHAVIOURS)])
                  for i in range(agents_per_game_day)]
        for a in agents:
            for _ in range(2 if a["behaviour"] == "well_behaved" else 1):
                await day.task(a["id"])
        heartbeat = agents[0]
        json_of(await admin.add_heartbeat(heartbeat["id"], "hourly", "heartbeat", 3600), 201)

        async def steady() -> dict[str, Any] | None:
            tasks = await day.read_tasks()
            working = sum(1 for t in tasks.values() if t["state"] == "in_progress")
            done = sum(1 for t in tasks.values() if t["state"] == "done")
            busy = [a for a in agents if a["behaviour"] != "well_behaved"]
            held = {t["agent_id"] for t in tasks.values() if t["state"] == "in_progress"}
            if all(a["id"] in held for a in busy) and (done or not any(
                    a["behaviour"] == "well_behaved" for a in agents)):
                return {"tasks_in_progress": working, "tasks_done": done,
                        "agents": len(agents)}
            return None
        day.steady_state = await eventually(steady, 120, "no steady state: agents not working",
                                            impossible=day.why_work_cannot_finish)

        # The emergency stop.
        in_progress = {tid for tid, t in (await day.read_tasks()).items()
                       if t["state"] == "in_progress"}
        r = await day.operate("security", "kill_fleet", {},
                              lambda: security.kill_fleet())
        report = json_of(r)
        # Judge this game day's own agents: in a shared organisation the switch stops the
        # deployment's agents too, which is what it is for.
        mine, stopped = {a["id"] for a in agents}, set(report["agents_stopped"])
        assert mine <= stopped, f"the fleet stop left agents running: {sorted(mine - stopped)}"
        strangers = await strangers_stopped(day, mine, stopped)
        assert strangers is None, strangers
        own_tasks = await day.read_tasks()
        requeued = [t for t in report["tasks_requeued"] if t in own_tasks]
        assert requeued, "the fleet stop requeued none of the game day's tasks"

        # Every agent stopped: its sandbox gone, its daemon obeyed (exit code 3).
        async def all_gone() -> bool:
            for a in agents:
                boxes = await day.sandboxes(a["id"])
                if any(s["state"] in ("starting", "running") for s in boxes):
                    return False
            return True
        await eventually(all_gone, 60, "a sandbox kept running after the fleet stop")
        cancelled = set(report["sessions_cancelled"])
        assert cancelled, "the fleet stop found no session to stop"
        # Every daemon had the kill in hand before the switch answered, and said so itself.
        assert set(report["sessions_confirmed"]) == cancelled, (
            "the fleet stop answered before every daemon had the kill in hand")
        assert set(report.get("sessions_acknowledged", cancelled)) == cancelled, (
            f"daemons that did not acknowledge the kill before the answer: "
            f"{sorted(cancelled - set(report.get('sessions_acknowledged', [])))}")
        killed_boxes = {s["sandbox_id"] for a in agents
                        for s in json_of(await day.people["auditor"].sessions(a["id"]))
                        if s["id"] in cancelled}
        exits = {s["id"]: s["exit_code"] for a in agents for s in await day.sandboxes(a["id"])
                 if s["id"] in killed_boxes}
        assert exits == dict.fromkeys(killed_boxes, 3), f"daemons that did not obey: {exits}"
        # The work under way is back in the backlog: nothing is in progress, whatever the kill
        # requeued is open, and what was in progress just before is open (or finished in the
        # moment between that read and the kill).
        tasks = await day.read_tasks()
        assert not [t for t in tasks.values() if t["state"] == "in_progress"], (
            "tasks still in progress after the fleet stop")
        assert all(tasks[t]["state"] == "open" for t in requeued), (
            "a task the fleet stop requeued is not open")
        assert all(tasks[t]["state"] in ("open", "done") for t in in_progress), (
            "a task in progress at the stop neither went back to open nor finished")

        # While the stop stands, nothing starts: a new task stays open, the manual heartbeat
        # and the trigger bounce with 409 and the hint.
        fresh = await day.task(agents[-1]["id"], "arrived during the stop")
        await asyncio.sleep(2)  # the one window in which nothing may happen
        assert json_of(await admin.task(agents[-1]["id"], fresh["id"]))["state"] == "open", \
            "a task that arrived during the fleet stop was started"
        r = await admin.fire_heartbeat(heartbeat["id"], "hourly")
        assert (r.status_code, r.json()) == (409, STOPPED), \
            "a manual heartbeat fire was not refused during the fleet stop"
        r = await admin.trigger(heartbeat["trigger_token"])
        assert (r.status_code, r.json()) == (409, STOPPED), \
            "the external trigger was not refused during the fleet stop"
        for role in ("org_admin", "controlling"):
            notes = json_of(await day.people[role].notifications())
            assert any(n["kind"] == "fleet_killed" for n in notes), \
                f"{role} was not notified of the fleet stop"
        for role in ("agent_owner", "auditor", "controlling"):
            r = await day.operate(role, "kill_fleet", {}, day.people[role].kill_fleet)
            assert r.status_code == 403, f"{role} may pull the fleet switch"
            r = await day.operate(role, "resume_fleet", {}, day.people[role].resume_fleet)
            assert r.status_code == 403, f"{role} may resume the fleet"

        # Releasing one agent does not wake it: the fleet stop still holds it.
        released = agents[0]
        r = await day.operate("org_admin", "resume_agent", {"agent_id": released["id"]},
                              lambda: admin.resume_agent(released["id"]))
        assert json_of(r)["held_by_fleet"] is True and json_of(r)["agents_woken"] == [], \
            "an agent resumed on its own ran while the fleet stop stood"
        await asyncio.sleep(1)  # nothing may start in this window either
        sessions = json_of(await day.people["auditor"].sessions(released["id"]))
        assert not [s for s in sessions if s["state"] in ("starting", "running")], \
            "an agent resumed on its own started a session while the fleet stop stood"

        # The incident is over: the agents behave again, and the fleet resumes. Every agent
        # with open work is woken at once, and every task completes exactly once.
        for a in agents:
            await day.endpoints.puppet.assign(a["id"], "well_behaved")
        with_work = {t["agent_id"] for t in (await day.read_tasks()).values()
                     if t["state"] == "open"}
        before = {s["id"] for agent_id in with_work
                  for s in json_of(await day.people["auditor"].sessions(agent_id))}
        r = await day.operate("security", "resume_fleet", {}, security.resume_fleet)
        # By its answer, every agent with open work is at work again. The scheduler's tick
        # may get to some first, the moment the flags clear (the resume's own wake then
        # finds them busy): that is at once too, and shows as a session new since the stop.
        at_work = set(json_of(r)["agents_woken"]) & mine
        for agent_id in with_work - at_work:
            sessions = json_of(await day.people["auditor"].sessions(agent_id))
            if any(s["id"] not in before for s in sessions):
                at_work.add(agent_id)
        assert at_work >= with_work, (f"the fleet resume did not wake at once every agent "
                                      f"with open work: {sorted(with_work - at_work)}")

        async def all_done() -> bool:
            tasks = await day.read_tasks()
            return all(t["state"] == "done" for t in tasks.values())
        await eventually(all_done, 120, "tasks left undone after the resume",
                         impossible=day.why_work_cannot_finish)
        outcome.steady_after = {"tasks_done": len(await day.read_tasks()),
                                "agents": len(agents)}

        final = await day.judged(outcome)
        assert_valid(outcome.verdicts, day.required)
        twice = {t: f["done_count"] for t, f in final.tasks.items() if f["done_count"] != 1}
        assert not twice, f"tasks not done exactly once: {twice}"
        # A time-to-stop for every agent; the daemons that were running exited 3 within it.
        fleet = [s for s in outcome.samples if s.kill_f == "kill_fleet"]
        assert {s.agent_id for s in fleet} == {a["id"] for a in agents}, \
            "no time-to-stop measured for some agents"
        assert all(s.kill_acknowledged_ns is not None for s in fleet), \
            "a time-to-stop has no acknowledged kill"
        stopped_agents = {a["id"] for a in agents
                          for s in json_of(await day.people["auditor"].sessions(a["id"]))
                          if s["id"] in cancelled}
        assert all(s.daemon_exit_ns is not None and s.sandbox_gone_ns is not None
                   for s in fleet if s.agent_id in stopped_agents), \
            "a stopped agent's time-to-stop lacks its daemon's exit or its sandbox's end"
