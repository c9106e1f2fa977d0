"""Game day: a heartbeat that came due many times while the fleet stop stood fires once
after the resume, then once a period: never once per missed period (the catch-up storm of
Kubernetes #110919, where a CronJob's missed schedules all ran at once after a pause).

    pytest scenarios/heartbeat_after_stop.py --stack processes

The control plane's shortest heartbeat period is lowered to a second for this game day
(COVEY_HEARTBEAT_MIN_S), so that a stop of seconds misses many periods.
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime

import pytest

from harness.act.client import json_of
from harness.act.expect import rule
from harness.record.gameday import GameDay

PERIOD_S = 2
STOP_S = 8 * PERIOD_S  # eight periods missed while the stop stands
WINDOW_S = 3 * PERIOD_S  # counted after the resume: at most one firing at once, one a period


def _ns(stamp: str) -> int:
    return int(datetime.fromisoformat(stamp).timestamp() * 1e9)


@pytest.mark.heartbeat_min_s(1)
# Not each_task_done_once_after_resume: the heartbeat never stops making work.
@pytest.mark.checkers("in_progress_requeued")
@pytest.mark.decides("no_wake_of_stopped_agent", "no_action_after_kill_ack")
async def test_a_heartbeat_missed_during_a_stop_fires_once_after_it(gameday: GameDay) -> None:
    day, security = gameday, gameday.as_("security")
    agent = await day.agent("well_behaved")
    json_of(await day.as_("org_admin").client.add_heartbeat(
        agent["id"], "poll", "look at the queue", PERIOD_S), 201)

    async def fired() -> list[int]:  # when each heartbeat task was created, in order
        return sorted(_ns(t["created_at"]) for t in (await day.read_tasks()).values()
                      if t["origin"] == "heartbeat")
    await day.until.condition(fired, 30, "the heartbeat never fired before the stop")
    await day.until.condition(lambda: day.until.all_tasks_done_of([agent]), 30,
                              "the agent never finished its heartbeat work")

    json_of(await security.kill_fleet())
    stopped_ns = time.time_ns()
    await day.until.all_sandboxes_gone([agent])
    await asyncio.sleep(STOP_S)  # the stop stands: the heartbeat comes due again and again
    resumed_ns = time.time_ns()
    json_of(await security.resume_fleet())
    during = [t for t in await fired() if stopped_ns < t < resumed_ns]
    rule(not during, f"the heartbeat fired {len(during)} times while the fleet stop stood: a "
         "stop must hold the scheduler's heartbeats too")

    await asyncio.sleep(WINDOW_S)  # the window whose firings are counted
    after = [t for t in await fired() if resumed_ns < t <= resumed_ns + WINDOW_S * 10**9]
    allowed = 1 + WINDOW_S // PERIOD_S
    rule(bool(after) and after[0] - resumed_ns <= (PERIOD_S + 2) * 10**9,
         f"the heartbeat that came due during the {STOP_S} s stop did not fire within "
         f"{PERIOD_S + 2} s of the resume (fired at {[(t - resumed_ns) // 10**6 for t in after]}"
         " ms after it): a missed heartbeat fires once, at once, when the stop is lifted")
    rule(len(after) <= allowed,
         f"catch-up storm: the heartbeat every {PERIOD_S} s fired {len(after)} times in the "
         f"{WINDOW_S} s after a {STOP_S} s fleet stop (at "
         f"{[(t - resumed_ns) // 10**6 for t in after]} ms), at most {allowed} allowed: a "
         "heartbeat missed many times during a stop must fire once, not once per missed "
         "period")
