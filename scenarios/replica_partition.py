"""Game day: two control-plane replicas on one database (DESIGN §2.7), and a partition. A kill
pulled on replica A stops a daemon connected to replica B (LISTEN/NOTIFY carries it); then B
loses its database (its link blackholed: queries hang, nothing is refused): B's daemons must
stop within their lease (fail closed), while A serves on, stops what it is asked to and takes
B's lost work back into the backlog. Once the link heals, B serves again, and every task ends
done exactly once.

    pytest scenarios/replica_partition.py [--stack containers|processes]

The stack starts the second replica (a process, or a container) behind a fault proxy of its
own between it and Postgres.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from harness.act.client import json_of
from harness.record.gameday import GameDay

CUT_S = 60.0  # the partition heals itself after this, if the game day has not healed it
STOP_MARGIN_S = 4.0  # the lease's own slack (renewed every third of it), a loaded machine's
LOST_AFTER_S = 15 + 60  # covey's daemon timeout (15 s), then the sweep on a loaded machine


@pytest.mark.decides("kill_obeyed", "no_action_after_kill_ack", "in_progress_requeued",
                     "each_task_done_once_after_resume", "every_fault_healed")
async def test_a_partitioned_replica_fails_closed_and_the_other_serves_on(
        gameday: GameDay) -> None:
    day, plane = gameday, gameday.endpoints.control_plane
    if day.endpoints.replica is None or plane is None:
        pytest.skip(f"the {day.stack} stack cannot start a second replica")
    b = await day.endpoints.replica()
    security, owner_at_b = day.as_("security"), day.as_("org_admin", at=b.url)
    on_b = [await day.agent("silent") for _ in range(3)]
    # B alone takes up their work: A is frozen while their tasks arrive (through B).
    frozen = await plane.pause(30)
    for a in on_b:
        json_of(await owner_at_b.create_task(a), 201)
    await day.until.condition(lambda: _all_held_by(day, b.holds, on_b, at=b.url), 25,
                              "replica B did not take up the work it alone was offered")
    await plane.resume()
    await day.until.fault_healed(frozen, 10, "replica A's freeze")

    # A kill pulled on A stops the daemon that B holds.
    killed, *cut_off = on_b
    kill = json_of(await security.kill_agent(killed))
    assert kill["sessions_acknowledged"], (
        f"a kill pulled on replica A answered before the daemon replica B holds had "
        f"acknowledged it (within the kill's wait, the lease or 2 s): the kill did not "
        f"reach B (LISTEN/NOTIFY), or B did not pass the daemon's kill_ack on ({kill})")
    await day.read_tasks()  # right after the kill's ok: its work must be open again
    await day.until.all_sandboxes_gone([killed], 30)
    await day.expect.daemons_obeyed([killed], set(kill["sessions_cancelled"]))

    # B loses its database: its daemons stop within their lease, whatever B is doing.
    cut = await day.endpoints.nemesis[b.database_link].blackhole(CUT_S)
    bound_s = day.lease_s + STOP_MARGIN_S
    await day.until.nothing_left_of(cut_off, bound_s, "a daemon replica B held ran on "
                                    "with B cut off from its database (or its sandbox "
                                    "was left behind): its lease did not fail closed")
    gone_s = (time.time_ns() - cut.started_ns) / 1e9
    day.measurements["replica_b_daemons_gone_s"] = gone_s
    day.notes.append(f"replica B's daemons were gone {gone_s:.2f} s after B lost its "
                     f"database (lease {day.lease_s} s)")
    await day.expect.no_model_call_between(
        cut_off, cut.started_ns + round(bound_s * 1e9), None,
        f"daemons of replica B called their model more than the lease + {STOP_MARGIN_S} s "
        f"after B lost its database: they did not fail closed")

    # A serves on: new work starts there (B cannot take it), and A's kill stops it.
    on_a = await day.agent("silent")
    await day.task(on_a["id"])
    await day.until.all_working([on_a], 60)
    held = json_of(await security.kill_agent(on_a))
    await day.read_tasks()
    await day.until.all_sandboxes_gone([on_a], 30)
    await day.expect.daemons_obeyed([on_a], set(held["sessions_cancelled"]))
    # A finds B's daemons silent, puts their work back in the backlog and takes it up.
    await day.until.condition(
        lambda: _all_held_by(day, lambda s: not b.holds(s), cut_off, at=day.endpoints.url),
        LOST_AFTER_S, "the work of the daemons lost with replica B's database was never "
        "taken up again by replica A")

    await day.endpoints.nemesis[b.database_link].heal()
    await day.until.condition(lambda: _healthy(day, b.url), 60, "replica B never "
                              "reconnected to its database after the partition healed")
    # B serves again: it lifts the kills, and every task ends done exactly once.
    for a in (*on_b, on_a):
        await day.endpoints.puppet.assign(a["id"], "well_behaved")
    for a in (killed, on_a):
        json_of(await day.as_("security", at=b.url).resume_agent(a))
    await day.until.all_tasks_done()


async def _all_held_by(day: GameDay, holds: Callable[[dict[str, Any]], bool],
                       agents: list[dict[str, Any]], at: str) -> bool:
    """Every one of these agents has a running session, each held by the replica at `at`."""
    auditor = day.as_("auditor", at=at).client
    for a in agents:
        live = [s for s in json_of(await auditor.sessions(a["id"])) if s["state"] == "running"]
        if not live or not all(holds(s) for s in live):
            return False
    return True


async def _healthy(day: GameDay, url: str) -> bool:
    return (await day.people["auditor"].http.get(f"{url}/healthz")).status_code == 200
