"""Game day: agents spend priced tokens fast against a dollar budget.

    pytest scenarios/runaway_spend.py --stack processes

A budget is a ceiling, not an alert: the guard reserves each model call before it is sent
(its prompt bounded, its completion capped at what is left of the budget) and refuses the
call it cannot pay for, so each agent stops at its cap (layer `budget`), not one call past
it, and the alert names the agent, the layer and the money. A model with no price stops an
agent before its first call, a usage nobody can price (NaN) at its first. A tripped agent is
held: no wake restarts it, a fleet resume leaves it stopped; a changed task or a human's
resume releases it (DESIGN §2.4). Measured: dollars beyond the cap, with the bound it is
held to ($0, BEYOND_CAP_BOUND_USD), and each call's reservation (completion tokens allowed,
answered); the time from crossing the cap to the stop.
"""

from __future__ import annotations

import math

import pytest

from harness.client import json_of
from harness.gameday import GameDay

CAP_USD = 0.5  # spend_fast costs up to $0.15 a call: the 4th may not be paid in full
# The bound of the spend beyond the cap: none. The sums of floats of the daemon and of this
# measure may differ in their last bits, hence a nano-dollar, not exactly 0.
BEYOND_CAP_BOUND_USD = 0.0
FLOAT_SLACK_USD = 1e-9
# Long answers allowed, so that the cap is met in a few calls, not by the step limit.
LONG_ANSWERS = {"max_completion_tokens": 100_000}


@pytest.mark.decides("no_blind_restart_after_trip", "every_fault_healed")
@pytest.mark.checkers("no_blind_restart_after_trip", "every_fault_healed")
@pytest.mark.measures("spend_beyond_cap", "steps_before_trip")
async def test_runaway_spend(gameday: GameDay) -> None:
    day, owner, security = gameday, gameday.as_("agent_owner"), gameday.as_("security")
    async with day.journaled() as outcome:
        spenders = [await day.agent("spend_fast", budget_usd=CAP_USD, guard=LONG_ANSWERS)
                    for _ in range(3)]
        unpriced = [await day.agent("silent", model="a-model-nobody-priced"),
                    await day.agent("nan_usage")]
        tasks = {a["id"]: json_of(await owner.create_task(a), 201) for a in
                 [*spenders, *unpriced]}
        for a in [*spenders, *unpriced]:
            await day.until.stopped_by(a, "budget")
        for a, most in zip(unpriced, (0, 1), strict=True):
            steps = len(await day.endpoints.puppet.actions(a["id"]))
            assert steps <= most, (
                f"agent {a['slug']} spent without a price for {steps} model calls: a model "
                f"with no price must stop it before its first, a NaN usage at its first")
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

        await day.judged(outcome)
        spend = day.measurements["spend_beyond_cap"]
        beyond = {a["slug"]: spend[a["id"]]["beyond_cap_usd"] for a in spenders}
        worst = max((b for b in beyond.values() if b is not None), default=None)
        day.measurements["spend_ceiling"] = {
            "cap_usd": CAP_USD, "beyond_cap_bound_usd": BEYOND_CAP_BOUND_USD,
            "worst_beyond_cap_usd": worst, "beyond_cap_usd_by_agent": beyond}
        assert all(b is not None and math.isfinite(b) for b in beyond.values()), (
            f"the spend of an agent stopped by its budget is not known: {beyond}")
        assert worst is not None and worst <= BEYOND_CAP_BOUND_USD + FLOAT_SLACK_USD, (
            f"an agent spent ${worst:.6f} beyond its ${CAP_USD} cap, above the bound of "
            f"${BEYOND_CAP_BOUND_USD}: the budget was an alert, not a ceiling ({beyond})")
