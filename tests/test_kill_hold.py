"""A kill holds its daemons while its flag commits (covey.switches, `_held`): under incident
load the commit took 10-40 ms, and the fastest agents of the game day acted twice in it. The
`kill` itself still goes out only after the commit (DESIGN §2.3 line 1); a kill whose flag
fails lets its daemons go on. Real control plane, real `coveyd`, the puppet model; the kill's
flag is kept from committing by a transaction holding the agent's row, as a wake or another
kill would."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from covey.testing.plane import World, make_world, start_plane
from harness.act.puppet import Puppet
from harness.stack.waiting import eventually
from tests.conftest import COVEYD

# The puppet's `silent` agent acts every 0.2-0.3 s (a `sleep 0.2` a step): left alone it
# would ask its model five times or more in this window.
WINDOW_S = 1.5


@pytest.fixture
async def hworld(database_url: str, tmp_path: Path,
                 model: tuple[str, Puppet]) -> AsyncIterator[World]:
    async with start_plane(database_url, tmp_path, COVEYD, model_url=model[0]) as plane, \
            make_world(plane) as world:
        yield world


async def _acting(world: World, puppet: Puppet) -> dict[str, Any]:
    agent = await world.agent()
    await world.task(agent["id"], "model:silent")

    async def busy() -> bool:
        return len(puppet.actions(agent["id"])) >= 3
    await eventually(busy, 20, "the agent never got going")
    return agent


async def _flag_waiting(world: World, holder: asyncpg.Connection) -> int:
    """The kill's flag statement, waiting for the row the holder holds: its backend."""
    async def waiting() -> int | None:
        pid: int | None = await world.db.fetchval(
            "SELECT pid FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))"
            " AND query LIKE '%covey_switch_flag%'", holder.get_server_pid())
        return pid
    pid: int = await eventually(waiting, 10, "the kill's flag never waited for the held row")
    return pid


def _daemon_log(world: World) -> str:
    return "\n".join(p.read_text() for p in (world.plane.data_dir / "logs").glob("*.log"))


async def test_a_kill_holds_its_agent_before_its_flag_commits(
        hworld: World, model: tuple[str, Puppet]) -> None:
    puppet = model[1]
    agent = await _acting(hworld, puppet)
    async with hworld.db.acquire() as holder:
        async with holder.transaction():
            await holder.execute("SELECT 1 FROM agents WHERE id=$1 FOR NO KEY UPDATE",
                                 uuid.UUID(agent["id"]))
            kill = asyncio.ensure_future(
                hworld.security.post(f"/api/v1/agents/{agent['id']}/kill"))
            try:
                await _flag_waiting(hworld, holder)
                before = len(puppet.actions(agent["id"]))
                # What the agent does while the flag cannot commit: the window is the
                # point of the test, there is nothing to wait for but the agent.
                await asyncio.sleep(WINDOW_S)
                during = len(puppet.actions(agent["id"])) - before
                assert not kill.done(), "the kill answered before its flag could commit"
            except BaseException:
                kill.cancel()
                raise
    r = await asyncio.wait_for(kill, 20)
    assert r.status_code == 200, r.text
    assert r.json()["sessions_acknowledged"] == r.json()["sessions_cancelled"] != [], r.text
    # One request may have been on its way when the hold arrived.
    assert during <= 1, (f"the agent asked its model {during} times in {WINDOW_S} s while "
                         "its kill's flag waited to commit: the hold did not stop it")
    log = _daemon_log(hworld)
    assert "held: a kill is on its way" in log, log
    assert "obeyed a kill message" in log, log


async def test_a_kill_whose_flag_fails_lets_its_agent_go_on(
        hworld: World, model: tuple[str, Puppet]) -> None:
    puppet = model[1]
    agent = await _acting(hworld, puppet)
    async with hworld.db.acquire() as holder:
        async with holder.transaction():
            await holder.execute("SELECT 1 FROM agents WHERE id=$1 FOR NO KEY UPDATE",
                                 uuid.UUID(agent["id"]))
            kill = asyncio.ensure_future(
                hworld.security.post(f"/api/v1/agents/{agent['id']}/kill"))
            try:
                pid = await _flag_waiting(hworld, holder)
                # The database drops the kill's connection under it.
                assert await hworld.db.fetchval("SELECT pg_terminate_backend($1)", pid)
                r = await asyncio.wait_for(kill, 20)
            except BaseException:
                kill.cancel()
                raise
    assert r.status_code == 503, r.text
    assert set(r.json()) >= {"error", "hint"}, r.text
    failed_ns = time.time_ns()

    async def going_on() -> bool:
        return sum(1 for a in puppet.actions(agent["id"]) if a.at_ns > failed_ns) >= 2
    await eventually(going_on, 10, "the agent held by a kill that failed never went on")
    assert (await hworld.org_admin.get(f"/api/v1/agents/{agent['id']}")).json()["killed"] \
        is False
    assert "released: the kill that held this daemon did not stop it" in _daemon_log(hworld)


async def test_a_daemon_that_does_not_read_its_channel_does_not_hold_up_the_kill(
        database_url: str, tmp_path: Path) -> None:
    """The holds go out on the kill's own path, before its flag (covey.switches._held): a
    channel whose frames never leave (its daemon wedged, its socket's buffer full) must not
    keep the kill from its flag."""
    from covey.hub import DaemonLink
    from covey.testing import SCRIPTED_DAEMON

    class Wedged:
        async def send_text(self, data: str) -> None:
            await asyncio.Event().wait()  # never written

    async with start_plane(database_url, tmp_path, SCRIPTED_DAEMON) as plane, \
            make_world(plane) as world:
        agent = await world.agent()
        link = DaemonLink(uuid.uuid4(), uuid.UUID(agent["id"]), Wedged(), org_id=world.org.id)
        plane.orch.hub.attach(link)
        try:
            r = await asyncio.wait_for(
                world.security.post(f"/api/v1/agents/{agent['id']}/kill"), 20)
        finally:
            plane.orch.hub.detach(link.session_id)
        assert r.status_code == 200, r.text
        assert (await world.org_admin.get(f"/api/v1/agents/{agent['id']}")).json()["killed"]
