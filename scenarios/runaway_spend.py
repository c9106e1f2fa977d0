"""Game day: agents spend priced tokens fast against a dollar budget.

    pytest scenarios/runaway_spend.py --stack processes

A budget is a ceiling, not an alert: the guard reserves each model call before it is sent
(its prompt bounded, its completion capped at what is left of the budget) and refuses the
call it cannot pay for, so each agent stops at its cap (layer `budget`), not one call past
it, and the alert names the agent, the layer and the money. Bounded: the dollars one session
spent beyond its cap, $0 (the journal keeps it under `measurements.bounded`, beside each
call's reservation under `measurements.spend_beyond_cap`: the completion tokens allowed and
answered). A tripped agent is held: no wake restarts it, a fleet resume leaves it stopped; a
changed task or a human's resume releases it (DESIGN §2.4).

A model with no price stops an agent before its first call, a usage nobody can price (NaN)
at its first: a game day of its own, since their spend cannot be known and a figure nobody
can measure is not shown to hold.
"""

from __future__ import annotations

import pytest

from harness.act.client import json_of
from harness.record.gameday import GameDay

CAP_USD = 0.5  # spend_fast asks for $0.15 a call: the 4th cannot be paid in full
# Long answers allowed, so that the cap is met in a few calls, not by the step limit.
LONG_ANSWERS = {"max_completion_tokens": 100_000}


@pytest.mark.decides("no_blind_restart_after_trip", "every_fault_healed")
@pytest.mark.checkers("no_blind_restart_after_trip", "every_fault_healed")
@pytest.mark.measures("spend_beyond_cap", "steps_before_trip")
# The figure it exists for: not a cent past the cap (it measured $0.1004 past a $0.50 cap,
# 20 %, while the guard still booked each call after making it).
@pytest.mark.bounds(spend_beyond_cap_usd=0)
async def test_runaway_spend(gameday: GameDay) -> None:
    day, owner, security = gameday, gameday.as_("agent_owner"), gameday.as_("security")
    spenders = [await day.agent("spend_fast", budget_usd=CAP_USD, guard=LONG_ANSWERS)
                for _ in range(3)]
    tasks = {a["id"]: json_of(await owner.create_task(a), 201) for a in spenders}
    for a in spenders:
        await day.until.stopped_by(a, "budget")
    await day.expect.trip_alerts_name(spenders, "budget", "$",
                                      what="the budget layer and its money")

    # Held: a wake does not restart it, and a fleet resume leaves it stopped.
    await day.expect.held_by_the_guard(spenders, owner, security, "budget")

    # Released: one by a changed task, one by its owner's resume; both then finish.
    first, second = spenders[0], spenders[1]
    for a in (first, second):
        await day.endpoints.puppet.assign(a["id"], "well_behaved")
    json_of(await owner.change_task(first, tasks[first["id"]]["id"],
                                    body="spend within the budget this time"))
    json_of(await owner.resume_agent(second))
    await day.until.condition(lambda: day.until.all_tasks_done_of([first, second]), 60,
                              "an agent released by a changed task or a human's resume did "
                              "not get back to its work")
    await day.expect.still_held_by_the_guard(spenders[2], "budget")


@pytest.mark.decides("every_fault_healed")
@pytest.mark.checkers("every_fault_healed")
@pytest.mark.measures("spend_beyond_cap", "steps_before_trip")
async def test_unpriced_models_stop_at_the_first_call(gameday: GameDay) -> None:
    day, owner = gameday, gameday.as_("agent_owner")
    unpriced = await day.agent("silent", model="a-model-nobody-priced")
    nan_usage = await day.agent("nan_usage")
    for a in (unpriced, nan_usage):
        json_of(await owner.create_task(a), 201)
        await day.until.stopped_by(a, "budget")
    for a, most, when in ((unpriced, 0, "before its first"), (nan_usage, 1, "at its first")):
        steps = len(await day.endpoints.puppet.actions(a["id"]))
        assert steps <= most, (
            f"agent {a['slug']} spent without a price for {steps} model calls: it must stop "
            f"{when}")
