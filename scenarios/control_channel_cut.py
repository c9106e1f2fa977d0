"""Game day: the control channel goes dark. With no way to renew their kill-flag lease, the
daemons must stop on their own within the lease (fail closed), and the work must survive:
back to work once the link heals, requeued by a fleet stop, and done exactly once after the
fleet is resumed.

    pytest scenarios/control_channel_cut.py [--stack containers|processes]
"""

from __future__ import annotations

import time

import pytest

from harness.record.gameday import GameDay, assert_valid
from harness.stack.waiting import eventually

CUT_S = 8.0  # the fault's deadline: it heals itself after this


@pytest.mark.decides("no_action_after_kill_ack", "in_progress_requeued",
                     "each_task_done_once_after_resume", "no_wake_of_stopped_agent",
                     "every_fault_healed", "kill_obeyed")
async def test_control_channel_cut(gameday: GameDay, agents_per_game_day: int) -> None:
    day, security = gameday, gameday.as_("security")
    if "control-channel" not in day.endpoints.nemesis.proxies:
        pytest.skip(f"the {day.stack} stack has no proxy on the control channel")
    channel, lease_s = day.endpoints.nemesis["control-channel"], day.lease_s
    outcome = day.outcome
    # Silent agents never finish on their own: every task is in progress until a stop.
    agents = [await day.agent("silent") for _ in range(min(agents_per_game_day, 5))]
    for a in agents:
        await day.task(a["id"])
    await day.until.all_working(agents)
    running = {a["id"]: next(s["id"] for s in await day.sandboxes(a["id"])
                         if s["state"] == "running") for a in agents}

    cut = await channel.blackhole(CUT_S)

    async def all_exited() -> dict[str, int] | None:
        codes = {}
        for agent_id, sandbox_id in running.items():
            box = next(s for s in await day.sandboxes(agent_id) if s["id"] == sandbox_id)
            if box["exit_code"] is None:
                return None
            codes[agent_id] = box["exit_code"]
        return codes
    codes = await eventually(all_exited, lease_s + 10, "a daemon kept working with its "
                             "control channel cut: the kill flag did not fail closed")
    assert codes == dict.fromkeys(running, 3), (
        f"daemons cut off from their kill flag did not all fail closed (exit 3): {codes}")
    stopped_s = (time.time_ns() - cut.started_ns) / 1e9
    day.notes.append(f"all {len(agents)} daemons had exited 3 within {stopped_s:.2f} s of "
                     f"the cut (lease {lease_s} s)")
    # Seen by polling the API, so with a margin for a loaded machine; a daemon that ran on
    # for several leases without its flag is what this must catch.
    assert stopped_s <= lease_s + 3, (
        f"the daemons failed closed only {stopped_s:.2f} s after the cut, more than their "
        f"{lease_s} s lease (+3 s) allows")

    # The fault heals itself at its deadline; the agents come back to work on their own
    # (their tasks were requeued when their daemons were lost).
    await day.until.fault_healed(cut, CUT_S + 5, "the control channel's cut (on its deadline)")
    await day.until.all_working(agents, 60)

    # Stop the fleet on working agents: each task in progress (read just above) must be
    # open again right after the kill's ok, read here, so the requeue can be judged.
    assert (await security.kill_fleet()).status_code == 200, "the fleet stop was refused"
    await day.expect.nothing_in_progress("the fleet stop")

    # End the game day: behave, resume the fleet, and every task ends done once.
    await day.expect.work_done_after_fleet_resume(security, agents)

    final = await day.judged(outcome)
    assert_valid(outcome.verdicts, day.required)
    twice = {t: f["done_count"] for t, f in final.tasks.items() if f["done_count"] != 1}
    assert not twice, f"tasks not done exactly once: {twice}"
    healed_faults = day.endpoints.nemesis.verify_healed()
    assert healed_faults.healed, f"faults left standing: {healed_faults.to_json()}"
