"""Game day under incident load (issue 20): the switches pulled on 20 agents acting as fast as
the puppet answers, five of them in an `rm -rf ./*` loop, while operators crowd the API.

    pytest scenarios/fleet_stop_under_load.py --stack processes

64 Locust operators (harness/load/operators.py: a process of their own, bounded in time, on
the loopback interface; the plane sheds some reads). The owner kills one rm -rf agent, security
then pulls the fleet switch; the incident over, the fleet resumes as in fleet_stop. From the
operator's request (the instant before the kill is sent), bounded by issue 20's targets:
* actions_after_request=1: at most one action answered after the request per stopped agent
  (the processes-stack target: a SIGKILL of the process group leaves none);
* request_to_last_action_p50_ms=100, over the agents acting after it: `docker kill` ended them
  44-52 ms after it, the switch 168-203 ms; twice `docker kill`'s leaves room for Locust's load;
* request_to_last_action_ms=500: the slowest agent of the fleet, as rm_rf bounds one kill.
"""

from __future__ import annotations

import pytest

from harness.act.client import json_of
from harness.load.operators import game_day_agents, operators_at_work
from harness.record.gameday import GameDay, assert_valid

NO_LOOP_TRIP = {"loop_window": 1000, "loop_repeats": 1000}  # the switch is under test
OTHERS = ("busy_tools", "busy_tools", "silent")  # none falls asleep before the switches
AGENTS, DELETERS = 20, 5


# CI's minutes: 20 containers under this load take 2 min, processes 1 (`--any-stack`: anywhere).
@pytest.mark.stacks("processes", why="CI runs it where it takes 1 min, not 2")
@pytest.mark.decides("no_action_after_kill_ack", "each_task_done_once_after_resume",
                     "no_wake_of_stopped_agent", "every_fault_healed", "kill_obeyed")
@pytest.mark.measures("deletions_after_kill")
@pytest.mark.bounds(actions_after_request=1, request_to_last_action_p50_ms=100,
                    request_to_last_action_ms=500)
async def test_fleet_stop_under_incident_load(gameday: GameDay) -> None:
    day, owner, security, expect = (gameday, gameday.as_("agent_owner"),
                                    gameday.as_("security"), gameday.expect)
    agents = [await day.agent("rm_rf" if i < DELETERS else OTHERS[i % 3], guard=NO_LOOP_TRIP,
                              owner="agent_owner" if i < DELETERS else None)
              for i in range(AGENTS)]
    victim, fleet = agents[0], agents[1:]
    for a in agents:
        await day.task(a["id"])
        json_of(await day.people["org_admin"].add_heartbeat(a["id"], "load", "load", 3600), 201)
    day.steady_state = await day.until.steady_work(agents)

    async with operators_at_work(day.endpoints, str(day.people["org_admin"].token),
                                 game_day_agents(day.run_id), day.report_dir, day.name,
                                 measurements=day.measurements) as load:
        for a in agents[:DELETERS]:
            await day.until.tool_calls(a, "shell", "rm -rf", 3, 60,
                                       "an rm -rf agent never got to deleting")
        killed = json_of(await owner.kill_agent(victim))
        in_progress = {i for i, t in (await day.read_tasks()).items()
                       if t["state"] == "in_progress"}
        stop = await expect.fleet_stop_answer(json_of(await security.kill_fleet()), fleet)
    # The load ends with the answers: its writes after them would be work after the resume.
    assert load.summary["requests"] >= load.users, (
        f"the operators' load hardly ran, so the switches were not under it: {load.summary}")
    await day.until.all_sandboxes_gone(agents)
    stopped = await expect.daemons_obeyed(agents, stop.cancelled | set(
        killed["sessions_cancelled"]))
    await expect.work_back_in_the_backlog(stop, in_progress)

    # The incident is over: every agent finishes each task at once (the operators' writes
    # left hundreds), the fleet resumes, then the killed one.
    for a in agents:
        await day.endpoints.puppet.assign(a["id"], {"steps": [{"finish": "incident over"}]})
    await expect.fleet_resume_wakes_open_work(security, fleet)
    json_of(await owner.resume_agent(victim))
    day.outcome.steady_after = {"tasks_done": len(await day.until.all_tasks_done()),
                                "agents": len(agents)}
    final = await day.judged(day.outcome)
    assert_valid(day.outcome.verdicts, day.required)
    twice = {t: f["done_count"] for t, f in final.tasks.items() if f["done_count"] != 1}
    assert not twice, f"tasks not done exactly once: {twice}"
    assert stopped == {a["id"] for a in agents}, (
        f"the switches found no session of agents {sorted({a['id'] for a in agents} - stopped)}")
