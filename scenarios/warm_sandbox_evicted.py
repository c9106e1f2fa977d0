"""Game day: a warm agent's sandbox stays up between its sessions, and its kill leaves
nothing of it running; nor does the kill of an agent at work.

    pytest scenarios/warm_sandbox_evicted.py --stack processes

As covey's, a warm agent's sandbox outlives its session: the daemon stays connected and
idle (it is never told to sleep), and the next wake hands it the new session at once. So a
kill's `evictWarm` has something real to tear down (DESIGN §2.3 line 1, §2.5). The harness
looks at the machine itself (processes, containers), not at the control plane's rows.
"""

from __future__ import annotations

import pytest

from harness.act.client import json_of
from harness.record.gameday import GameDay


@pytest.mark.decides("nothing_left_of_killed_agent", "no_action_after_kill_ack",
                     "kill_obeyed", "in_progress_requeued")
async def test_a_killed_warm_agent_leaves_nothing_running(gameday: GameDay) -> None:
    day, owner = gameday, gameday.as_("agent_owner")
    if await day.remains("nobody", record=False) is None:
        pytest.skip(f"the {day.stack} stack's sandboxes are not on this machine")
    warm = await day.agent("well_behaved", warm=True)
    busy, beside = await day.agent("silent"), await day.agent("silent")
    json_of(await owner.create_task(warm), 201)
    await day.until.condition(lambda: day.until.all_tasks_done_of([warm]), 60,
                              "the warm agent never finished its first task")

    async def parked() -> dict[str, str] | None:
        return next((s for s in await day.sandboxes(warm["id"])
                     if s["state"] == "parked"), None)
    box = await day.until.condition(parked, 30, "the warm agent's sandbox was never "
                                    "parked after its session")
    assert await day.remains(warm["id"]), (
        "the warm agent's parked sandbox is not up: covey keeps a warm sandbox running "
        "between sessions, its daemon connected and idle")
    json_of(await owner.create_task(warm), 201)
    await day.until.condition(lambda: day.until.all_tasks_done_of([warm]), 60,
                              "the warm agent never finished its second task")
    assert [s["id"] for s in await day.sandboxes(warm["id"])] == [box["id"]], (
        "the warm agent's next wake started a new sandbox instead of handing the session "
        "to its parked one")

    for a in (busy, beside):
        json_of(await owner.create_task(a), 201)
    await day.until.all_working([busy, beside])
    evicted = json_of(await owner.kill_agent(warm))
    assert evicted["evicted_sandboxes"] == [box["id"]], (
        f"the warm agent's kill did not evict its parked sandbox: {evicted}")
    json_of(await owner.kill_agent(busy))
    await day.until.nothing_left_of([warm, busy])
    await day.until.all_working([beside], 10)  # the agent beside them kept at work
    assert await day.remains(beside["id"]), (
        "the agent nobody killed lost its sandbox with the others'")
