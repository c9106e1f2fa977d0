"""Game day: the control channel goes dark. With no way to renew their kill-flag lease, the
daemons must stop on their own within the lease (fail closed), and the work must survive:
back to work once the link heals, requeued by a fleet stop, and done exactly once after the
fleet is resumed.

    pytest scenarios/control_channel_cut.py [--stack containers|processes]
"""

from __future__ import annotations

import time

import pytest

from harness.client import json_of
from harness.gameday import GameDay, assert_valid
from harness.waiting import eventually

LEASE_S = 2.0  # the processes stack's COVEY_LEASE_MS
CUT_S = 8.0  # the fault's deadline: it heals itself after this


@pytest.mark.decides("no_action_after_kill_ack", "in_progress_requeued",
                     "each_task_done_once_after_resume", "no_wake_of_stopped_agent",
                     "every_fault_healed", "kill_obeyed")
async def test_control_channel_cut(gameday: GameDay, agents_per_game_day: int) -> None:
    day = gameday
    if "control-channel" not in day.endpoints.nemesis.proxies:
        pytest.skip(f"the {day.stack} stack has no proxy on the control channel")
    channel = day.endpoints.nemesis["control-channel"]
    async with day.journaled() as outcome:
        # Silent agents never finish on their own: every task is in progress until a stop.
        agents = [await day.agent("silent") for _ in range(min(agents_per_game_day, 5))]
        for a in agents:
            await day.task(a["id"])

        async def all_working() -> bool:
            tasks = await day.read_tasks()
            return sum(t["state"] == "in_progress" for t in tasks.values()) == len(agents)
        await eventually(all_working, 120, "the agents never got to work",
                         impossible=day.why_work_cannot_finish)
        running = {a["id"]: next(s["id"] for s in await day.sandboxes(a["id"])
                             if s["state"] == "running") for a in agents}

        cut = await channel.blackhole(CUT_S)
        cut_ns = cut.started_ns

        async def all_exited() -> dict[str, dict[str, object]] | None:
            exits = {}
            for agent_id, sandbox_id in running.items():
                box = next(s for s in await day.sandboxes(agent_id) if s["id"] == sandbox_id)
                if box["exit_code"] is None:
                    return None
                exits[agent_id] = box
            return exits
        exits = await eventually(all_exited, LEASE_S + 10, "a daemon kept working with its "
                                 "control channel cut")
        codes = {a: e["exit_code"] for a, e in exits.items()}
        assert codes == dict.fromkeys(running, 3), (
            f"daemons cut off from their kill flag did not all fail closed (exit 3): {codes}")
        stopped_after_s = (time.time_ns() - cut_ns) / 1e9
        day.notes.append(f"all {len(agents)} daemons had exited 3 within "
                         f"{stopped_after_s:.2f} s of the cut (lease {LEASE_S} s)")

        # The fault heals itself at its deadline; the agents come back to work on their own
        # (their tasks were requeued when their daemons were lost).
        async def healed() -> bool:
            await day.endpoints.nemesis.refresh()
            return channel.active is None
        await eventually(healed, CUT_S + 5, "the cut never healed")
        await eventually(all_working, 60, "the agents did not get back to work after the "
                         "control channel healed", impossible=day.why_work_cannot_finish)

        # Stop the fleet on working agents: each task in progress (read just above) must be
        # open again right after the kill's ok, read here, so the requeue can be judged.
        json_of(await day.operate("security", "kill_fleet", {}, day.people["security"].kill_fleet))
        after_kill = await day.read_tasks()
        in_progress = [t for t in after_kill.values() if t["state"] == "in_progress"]
        assert not in_progress, (f"the fleet stop left tasks in progress: "
                                 f"{[t['id'] for t in in_progress]}")

        # End the game day: behave, resume the fleet, and every task ends done once.
        for a in agents:
            await day.endpoints.puppet.assign(a["id"], "well_behaved")
        json_of(await day.operate("security", "resume_fleet", {},
                                  day.people["security"].resume_fleet))

        async def all_done() -> bool:
            return all(t["state"] == "done" for t in (await day.read_tasks()).values())
        await eventually(all_done, 120, "tasks left undone after the channel came back",
                         impossible=day.why_work_cannot_finish)

        final = await day.judged(outcome)
        assert_valid(outcome.verdicts, day.required)
        twice = {t: f["done_count"] for t, f in final.tasks.items() if f["done_count"] != 1}
        assert not twice, f"tasks not done exactly once: {twice}"
        healed_faults = day.endpoints.nemesis.verify_healed()
        assert healed_faults.healed, f"faults left standing: {healed_faults.to_json()}"
