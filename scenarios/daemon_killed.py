"""Game day: an agent's daemon dies under it, again and again (SIGKILL of its process on the
processes stack, `docker kill` of its sandbox container on the containers stack). Each loss
puts its task back in the backlog, counted in `daemon_retries`; after the fifth requeue the
next loss fails the task, with the reason, instead of burning sandboxes for ever.

    pytest scenarios/daemon_killed.py [--stack containers|processes]
"""

from __future__ import annotations

import pytest

from harness.act.client import json_of
from harness.record.gameday import GameDay

MAX_RETRIES = 5  # COVEY_MAX_DAEMON_RETRIES, the stacks' default


@pytest.mark.checkers("every_fault_healed")
@pytest.mark.decides("every_fault_healed")
async def test_a_lost_daemon_requeues_its_task_five_times_then_fails_it(
        gameday: GameDay) -> None:
    day, auditor = gameday, gameday.people["auditor"]
    if day.endpoints.control_plane is None:
        pytest.skip(f"the {day.stack} stack's sandboxes are not the harness's to kill")
    agent = await day.agent("silent")  # never finishes: only a loss ends its session
    bystander = await day.agent("well_behaved")
    task = await day.task(agent["id"])
    killed: set[str] = set()

    async def task_now() -> dict[str, object]:
        detail: dict[str, object] = json_of(await auditor.task(agent["id"], task["id"]))
        return detail

    for loss in range(1, MAX_RETRIES + 2):
        async def working_again() -> dict[str, object] | None:
            if (await task_now())["state"] != "in_progress":
                return None
            return next((s for s in await day.sandboxes(agent["id"])
                         if s["state"] == "running" and s["id"] not in killed), None)
        box = await day.until.condition(
            working_again, 90, f"after {loss - 1} daemon losses the agent never took its "
            "task up again in a new sandbox: a requeued task must wake its agent")
        killed.add(box["id"])
        await day.endpoints.nemesis.kill_sandbox(box)

        async def counted(loss: int = loss) -> dict[str, object] | None:
            now = await task_now()
            return now if now["daemon_retries"] == loss else None
        now = await day.until.condition(
            counted, 60, f"loss {loss} of the task's daemon was not counted in "
            "daemon_retries: a dead daemon's task must be requeued and counted")
    assert now["state"] == "failed", (
        f"after {MAX_RETRIES + 1} daemon losses the task is {now['state']!r}, not failed: "
        f"a task whose daemon keeps dying must be given up after {MAX_RETRIES} retries")
    assert "daemon was lost" in str(now["result"]), (
        f"the failed task does not say why (result {now['result']!r}): an operator must "
        "see that its daemon kept dying")
    moves = [t["to_state"] for t in now["transitions"]  # type: ignore[attr-defined]
             if t["from_state"] == "in_progress"]
    assert moves == ["open"] * MAX_RETRIES + ["failed"], (
        f"the task moved {moves} on its daemon's losses: each of the first {MAX_RETRIES} "
        "must put it back in the backlog, the next must fail it")

    # The loss of one agent's daemons is not the fleet's: the bystander works on.
    await day.task(bystander["id"])
    await day.until.condition(lambda: day.until.all_tasks_done_of([bystander]), 90,
                              "another agent's work stopped while one agent's daemons "
                              "were being killed")
