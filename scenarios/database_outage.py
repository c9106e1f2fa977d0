"""Game day: the database goes away under a working fleet, paused (every Postgres process
frozen, sockets open) or restarted (stopped at once, as in a crash, and started again).

While it is gone no lease can be renewed, so every daemon stops within its lease (fail
closed): the puppet's ledger, outside the system under test, shows no model call after
that. A fleet kill pulled during the outage either takes effect or answers 503 with a hint,
never a 200 that did nothing. Afterwards the control plane reconnects by itself, and every
task is done exactly once after the fleet is resumed.

    pytest scenarios/database_outage.py [--stack containers|processes]
"""

from __future__ import annotations

import time

import pytest

from harness.nemesis import FaultRecord
from harness.record.gameday import GameDay

OUTAGE_S = 10.0  # several leases: whoever still runs at its end did not fail closed
MARGIN_S = 3.0  # the lease's own slack plus a loaded machine's


# Not kill_obeyed: the daemons stop by their lease here, before any kill message can reach
# them (the rule under test), and a kill then finds them already on their way out.
@pytest.mark.checkers("no_action_after_kill_ack", "in_progress_requeued",
                      "each_task_done_once_after_resume", "no_wake_of_stopped_agent",
                      "every_fault_healed")
@pytest.mark.parametrize("outage", ["pause", "restart"])
@pytest.mark.decides("in_progress_requeued", "each_task_done_once_after_resume",
                     "every_fault_healed")
async def test_database_outage(gameday: GameDay, outage: str,
                               agents_per_game_day: int) -> None:
    day, security, nemesis = gameday, gameday.as_("security"), gameday.endpoints.nemesis
    if nemesis.database is None:
        pytest.skip(f"the {day.stack} stack's database is not the harness's to fault")
    agents = [await day.agent("silent") for _ in range(min(agents_per_game_day, 3))]
    for a in agents:
        await day.task(a["id"])
    await day.until.all_working(agents)

    fault: FaultRecord = await (nemesis.pause_database if outage == "pause"
                                else nemesis.restart_database)(OUTAGE_S)
    cut_off_ns = fault.started_ns + round((day.lease_s + MARGIN_S) * 1e9)
    # The switch pulled in the dark: the answer comes when it comes (a paused database
    # holds the request until it is back).
    kill = await security.kill_fleet()
    day.expect.honest_answer(kill, "a fleet kill during a database outage")
    database_back = await day.until.fault_healed(fault, OUTAGE_S + 60,
                                                 "the database outage")
    await day.until.healthy(60, "the control plane never reconnected to its database "
                            "after the outage")
    # Recovery: from the database back (its heal done) to the control plane healthy.
    day.measurements["recovery_s"] = max(
        0.0, (time.time_ns() - (database_back.healed_ns or 0)) / 1e9)
    day.notes.append(f"the fleet kill during the {outage} answered {kill.status_code}")
    await day.expect.fleet_stopped_after(security, kill, "the database outage")

    await day.expect.no_model_call_between(
        agents, cut_off_ns, fault.heals_at_ns or 0,
        f"agents kept calling their model more than the lease ({day.lease_s} s) + "
        f"{MARGIN_S} s into the database outage: the lease did not fail closed")
    await day.expect.nothing_in_progress("the fleet stop")
    await day.expect.work_done_after_fleet_resume(security, agents)
