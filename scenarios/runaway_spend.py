"""Game day: agents spend priced tokens fast against a dollar budget.

    pytest scenarios/runaway_spend.py --stack processes

The guard must stop each at its cap (layer `budget`) and alert with the agent, the layer and
the cost so far; a model with no price, or a usage nobody can price (NaN), stops an agent at
its first call. A tripped agent is held: no wake restarts it, a fleet resume leaves it
stopped; a changed task or a human's resume releases it (DESIGN §2.4). Measured: dollars
beyond the cap, and the time from crossing it to the stop.
"""

from __future__ import annotations

import pytest

from harness.act.client import json_of
from harness.record.gameday import GameDay

CAP_USD = 0.5  # spend_fast costs $0.15 a call: the 4th call crosses it


@pytest.mark.decides("no_blind_restart_after_trip", "every_fault_healed")
@pytest.mark.checkers("no_blind_restart_after_trip", "every_fault_healed")
@pytest.mark.measures("spend_beyond_cap", "steps_before_trip")
async def test_runaway_spend(gameday: GameDay) -> None:
    day, owner, security = gameday, gameday.as_("agent_owner"), gameday.as_("security")
    spenders = [await day.agent("spend_fast", budget_usd=CAP_USD) for _ in range(3)]
    unpriced = [await day.agent("silent", model="a-model-nobody-priced"),
                await day.agent("nan_usage")]
    tasks = {a["id"]: json_of(await owner.create_task(a), 201) for a in
             [*spenders, *unpriced]}
    for a in [*spenders, *unpriced]:
        await day.until.stopped_by(a, "budget")
    for a in unpriced:
        steps = len(await day.endpoints.puppet.actions(a["id"]))
        assert steps == 1, (f"agent {a['slug']} spent without a price for {steps} model "
                            f"calls: an unpriced call must stop it at the first")
    alerts = [n["title"] for n in json_of(await day.people["security"].notifications())
              if n["kind"] == "agent_tripped"]
    for a in spenders:
        alert = next((t for t in alerts if a["slug"] in t), None)
        assert alert is not None and "budget" in alert and "$" in alert, (
            f"no alert names agent {a['slug']}, the budget layer and its cost so far: "
            f"{alerts}")

    # Held: a wake does not restart it, and a fleet resume leaves it stopped.
    r = await owner.wake(spenders[0])
    assert r.status_code == 409, f"a wake restarted an agent its guard had stopped: {r.text}"
    json_of(await security.kill_fleet())
    woken = set(json_of(await security.resume_fleet())["agents_woken"])
    held = {a["id"]: json_of(await day.people["auditor"].agent(a["id"])) for a in spenders}
    assert not woken & set(held) and all(a["killed"] for a in held.values()), (
        "the fleet resume released agents their budget guard had stopped: only a changed "
        "task or a human may")

    # Released: one by a changed task, one by its owner's resume; both then finish.
    first, second = spenders[0], spenders[1]
    for a in (first, second):
        await day.endpoints.puppet.assign(a["id"], "well_behaved")
    json_of(await owner.change_task(first, tasks[first["id"]]["id"],
                                    body="spend within the budget this time"))
    json_of(await owner.resume_agent(second))

    async def released_done() -> bool:
        read = await day.read_tasks()
        return all(read[tasks[a["id"]]["id"]]["state"] == "done" for a in (first, second))
    await day.until.condition(released_done, 60, "an agent released by a changed task "
                              "or a human's resume did not get back to its work")
    still = json_of(await day.people["auditor"].agent(spenders[2]["id"]))
    assert still["killed"] and still["kill_origin"] == "guard", (
        "an agent its budget guard stopped was released although nobody changed its "
        "task or resumed it")
