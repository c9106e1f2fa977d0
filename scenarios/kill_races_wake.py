"""Game day: wakes race the kill, round after round, and whatever the interleaving no session
outlives the kill (DESIGN §2.3.1: `killed=true` is committed before any `kill` leaves).

    pytest scenarios/kill_races_wake.py [--stack processes|containers]

Each round, each agent (idle between tasks) is killed while a burst of wakes leaves at
seeded moments staggered around the kill's request: new tasks (their LISTEN/NOTIFY wake),
POST …/wake and a manual heartbeat fire. A wake either commits its session before the flag,
and the kill cancels that session, or sees the flag and starts nothing. A kill that sent
`kill` before committing its flag let a wake in between start a session it never saw.
Then the agent is resumed and does its work, and the next round begins. Judged by
`no_session_outlives_kill` (no session live after the kill's answer, nor started while it
stood) and `no_action_after_kill_ack` (nothing in the puppet's ledger after it).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest

from harness.act.client import json_of
from harness.record.gameday import GameDay

ROUNDS = 10
AGENTS = 2
BURST = 6  # wakes per agent and round, the three paths in turn
# Each wake leaves up to this long before or after the kill's request: some land before its
# flag's commit (their sessions must be cancelled by it), some after (they start nothing).
STAGGER_MS = 30.0
FINISH_AT_ONCE = {"name": "finish_at_once", "steps": [{"finish": "done"}]}


@pytest.mark.checkers("no_session_outlives_kill")
@pytest.mark.decides("no_session_outlives_kill", "no_action_after_kill_ack",
                     "no_wake_of_stopped_agent", "each_task_done_once_after_resume")
async def test_wakes_racing_a_kill_start_no_session_it_misses(gameday: GameDay) -> None:
    day, owner = gameday, gameday.as_("agent_owner")
    stagger = random.Random(day.seed)
    agents = [await day.agent(FINISH_AT_ONCE, owner="agent_owner") for _ in range(AGENTS)]
    for a in agents:
        json_of(await day.as_("org_admin").client.add_heartbeat(
            a["id"], "poll", "look at the queue", 3600), 201)
        json_of(await owner.create_task(a, "first work"), 201)
    await day.until.all_tasks_done(60)

    async def wake(agent: dict[str, Any], n: int, after_s: float) -> None:
        await asyncio.sleep(after_s)  # not a wait: when this racer leaves
        if n % 3 == 0:
            await owner.create_task(agent, f"raced the kill ({n})")
        elif n % 3 == 1:
            await owner.wake(agent)
        else:
            await owner.fire_heartbeat(agent, "poll")

    async def race(agent: dict[str, Any]) -> None:
        # The kill reads every task before its request leaves: the burst is centred there.
        started = time.monotonic()
        await day.read_tasks()
        read_s = time.monotonic() - started
        after = [max(0.0, read_s + stagger.uniform(-STAGGER_MS, STAGGER_MS) / 1000)
                 for _ in range(BURST)]
        kill = asyncio.ensure_future(owner.kill_agent(agent))
        await asyncio.gather(*(wake(agent, n, s) for n, s in enumerate(after)))
        json_of(await kill)
        await day.until.all_sandboxes_gone([agent], 60)
        json_of(await owner.resume_agent(agent))

    for n in range(ROUNDS):
        await asyncio.gather(*(race(a) for a in agents))
        await day.until.all_tasks_done(60)
        day.notes.append(f"round {n + 1}: every agent killed under {BURST} racing wakes, "
                         "resumed, its work done")
