"""Game day: the control channel goes dark. With no way to renew their kill-flag lease, the
daemons must stop on their own within the lease (fail closed), and the work must survive:
requeued, and done exactly once after the link heals and the fleet is resumed.

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


async def test_control_channel_cut(gameday: GameDay, agents_per_game_day: int) -> None:
    day = gameday
    if "control-channel" not in day.endpoints.nemesis.proxies:
        pytest.skip(f"the {day.stack} stack has no proxy on the control channel")
    channel = day.endpoints.nemesis["control-channel"]
    async with day.journaled() as outcome:
        agents = [await day.agent("silent") for _ in range(min(agents_per_game_day, 5))]
        for a in agents:
            await day.task(a["id"])

        async def all_working() -> bool:
            tasks = await day.read_tasks()
            return sum(t["state"] == "in_progress" for t in tasks.values()) == len(agents)
        await eventually(all_working, 120, "the agents never got to work")
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
        assert {a: e["exit_code"] for a, e in exits.items()} == dict.fromkeys(running, 3)
        stopped_after_s = (time.time_ns() - cut_ns) / 1e9
        day.notes.append(f"all {len(agents)} daemons had exited 3 within "
                         f"{stopped_after_s:.2f} s of the cut (lease {LEASE_S} s)")

        # The fault heals itself at its deadline; the agents come back on their own.
        async def healed() -> bool:
            await day.endpoints.nemesis.refresh()
            return channel.active is None
        await eventually(healed, CUT_S + 5, "the cut never healed")
        # End the game day: behave, then stop and resume the fleet so every task ends once.
        for a in agents:
            await day.endpoints.puppet.assign(a["id"], "well_behaved")
        json_of(await day.operate("security", "kill_fleet", {}, day.people["security"].kill_fleet))
        json_of(await day.operate("security", "resume_fleet", {},
                                  day.people["security"].resume_fleet))

        async def all_done() -> bool:
            return all(t["state"] == "done" for t in (await day.read_tasks()).values())
        await eventually(all_done, 120, "tasks left undone after the channel came back")

        final = await day.judged(outcome)
        assert_valid(outcome.verdicts)
        healed_verdict = next(v for v in outcome.verdicts if v.checker == "every_fault_healed")
        assert healed_verdict.valid is True, healed_verdict.message
        assert all(t["done_count"] == 1 for t in final.tasks.values())
        assert day.endpoints.nemesis.verify_healed().healed
