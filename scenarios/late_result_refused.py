"""Game day: a result that a killed session's daemon sent reaches the control plane after
the kill, and is refused: the task stays open and is done once, after the resume, by a
later session (DESIGN §2.3.8: a task claimed by a session carries a fencing token).

    pytest scenarios/late_result_refused.py [--stack processes|containers]

The agent runs a short command, then finishes. While the command runs the nemesis
blackholes the control channel, so the daemon's `task_done` waits in the partition; the
owner kills the agent (flag committed, task requeued, `kill` held too, sandbox torn down by
the second line); then the channel heals and the held result arrives, seconds late, as a
TCP link delivers what it held after a partition. Judged by `late_result_refused`.
"""

from __future__ import annotations

from typing import Any

import pytest

from harness.act.client import json_of
from harness.act.expect import rule
from harness.record.gameday import GameDay

# Long enough for the cut to stand before the agent finishes, and well short of the lease
# this game day's daemons hold: cut off, a daemon stops once its lease lapses (fail closed),
# and one that stopped sends no result. The lease is renewed every third of it.
LEASE_MS = 6000
COMMAND_S = 1.5
SHORT_COMMAND = {"name": "short_command_then_finish", "steps": [
    {"shell": f"sleep {COMMAND_S}"}, {"finish": "finished by the session that ran it"}]}
CUT_S = 60.0  # the fault's deadline; it is healed by hand long before


@pytest.mark.lease_ms(LEASE_MS)
@pytest.mark.checkers("no_action_after_kill_ack", "every_fault_healed")
@pytest.mark.decides("late_result_refused", "in_progress_requeued",
                     "each_task_done_once_after_resume", "every_fault_healed")
async def test_a_killed_sessions_late_result_is_refused(gameday: GameDay) -> None:
    day, owner = gameday, gameday.as_("agent_owner")
    if "control-channel" not in day.endpoints.nemesis.proxies:
        pytest.skip(f"the {day.stack} stack has no proxy on the control channel")
    channel = day.endpoints.nemesis["control-channel"]
    agent = await day.agent(SHORT_COMMAND, owner="agent_owner")
    json_of(await owner.create_task(agent, "run a short command, then finish"), 201)

    async def answered(tool: str) -> int | None:
        """When the puppet answered the agent with `tool` first (its clock)."""
        return next((e.at_ns for e in await day.endpoints.puppet.actions(agent["id"])
                     if e.tool == tool), None)
    await day.until.condition(lambda: answered("shell"), 60, "the agent never ran its command")
    cut = await channel.blackhole(CUT_S)
    finished_ns = await day.until.condition(
        lambda: answered("finish"), 10, "the agent never asked to finish with its control "
        "channel cut: its daemon stopped first (its lease lapsed), so it sent no late result")
    rule(finished_ns > cut.started_ns, "the agent finished before the control channel was "
         f"cut, so its result was not late: the {COMMAND_S} s command ended before the cut "
         "stood; this machine was too slow for the game day's timing")

    killed = json_of(await owner.kill_agent(agent))
    rule(bool(killed["sessions_cancelled"]), f"the kill stopped no session: {killed}")
    await channel.heal()

    async def late_result() -> dict[str, Any] | None:
        """The killed session's result, as the control plane recorded it once it arrived."""
        return next((e for e in json_of(await day.reader(agent["id"]).recording(agent["id"]))
                     if e["kind"] == "task" and e["session_id"] in killed["sessions_cancelled"]),
                    None)
    await day.until.condition(late_result, 30, "the killed session's result never reached "
                              "the control plane after the channel healed")
    json_of(await owner.resume_agent(agent))
    await day.until.all_tasks_done(60)
