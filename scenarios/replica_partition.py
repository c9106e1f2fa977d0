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
    await day.until.sessions_held(on_b, b.holds, b.url, 25,
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
    await day.expect.kill_carried_out(killed, kill)  # its work open again, its daemon gone

    # B loses its database: its daemons stop within their lease, whatever B is doing.
    cut = await day.endpoints.nemesis[b.database_link].blackhole(CUT_S)
    await day.expect.lost_database_failed_closed(cut_off, cut, STOP_MARGIN_S, "replica B",
                                                 "its database",
                                                 figure="replica_b_daemons_gone_s")

    # A serves on: new work starts there (B cannot take it), and A's kill stops it.
    on_a = await day.agent("silent")
    await day.task(on_a["id"])
    await day.until.all_working([on_a], 60)
    held = json_of(await security.kill_agent(on_a))
    await day.expect.kill_carried_out(on_a, held)
    # A finds B's daemons silent, puts their work back in the backlog and takes it up.
    await day.until.sessions_held(
        cut_off, lambda s: not b.holds(s), day.endpoints.url, LOST_AFTER_S, "the work of the "
        "daemons lost with replica B's database was never taken up again by replica A")

    await day.endpoints.nemesis[b.database_link].heal()
    await day.until.healthy_at(b.url, 60, "replica B never reconnected to its database "
                               "after the partition healed")
    # B serves again: it lifts the kills, and every task ends done exactly once.
    for a in (*on_b, on_a):
        await day.endpoints.puppet.assign(a["id"], "well_behaved")
    for a in (killed, on_a):
        json_of(await day.as_("security", at=b.url).resume_agent(a))
    await day.until.all_tasks_done()
