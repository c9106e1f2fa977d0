"""DESIGN §2.3 line 7 and §2.5: home restore and sync, warm parking, evictWarm on kill.
A killed sandbox's home is the state of its last sync."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from harness.puppet import Puppet
from tests.conftest import COVEYD
from tests.support.plane import World, eventually, make_world, start_plane


@pytest.fixture
async def lworld(database_url: str, tmp_path: Path,
                 model: tuple[str, Puppet]) -> AsyncIterator[World]:
    async with start_plane(database_url, tmp_path, COVEYD, model_url=model[0],
                           warm_sync_s=1) as plane, make_world(plane) as world:
        yield world


def _home_file(world: World, agent_id: str, name: str) -> str | None:
    path = world.plane.data_dir / "homes" / agent_id / name
    return path.read_text() if path.exists() else None


async def _sandboxes(world: World, agent_id: str) -> list[dict[str, Any]]:
    r = await world.org_admin.get(f"/api/v1/agents/{agent_id}/sandboxes")
    rows: list[dict[str, Any]] = r.json()
    return rows


async def _wait_state(world: World, agent_id: str, state: str) -> dict[str, Any]:
    async def reached() -> dict[str, Any] | None:
        rows = [s for s in await _sandboxes(world, agent_id) if s["state"] == state]
        return rows[-1] if rows else None
    return await eventually(reached, 20, f"no sandbox of {agent_id} became {state}")


async def test_a_kill_loses_what_was_not_synced(lworld: World) -> None:
    world = lworld
    agent = await world.agent()
    done = await world.task(agent["id"], "model:well_behaved")
    await world.wait_task(done["id"], "done")
    await _wait_state(world, agent["id"], "gone")
    # The real falling-asleep synced the home.
    assert _home_file(world, agent["id"], "notes.txt") == "step one\n"

    running = await world.task(agent["id"], "model:write_then_silent")
    await world.wait_task(running["id"], "in_progress")
    sandbox = await _wait_state(world, agent["id"], "running")
    workdir = world.plane.data_dir / "sandboxes" / agent["id"] / sandbox["id"]

    async def wrote() -> bool:
        notes = workdir / "notes.txt"
        return notes.exists() and notes.read_text() == "step two\n"
    await eventually(wrote, 20, "the agent never wrote its second step")
    await world.org_admin.post(f"/api/v1/agents/{agent['id']}/kill")
    await _wait_state(world, agent["id"], "gone")
    # The home is the state of its last sync: the killed sandbox's write is not in it.
    assert _home_file(world, agent["id"], "notes.txt") == "step one\n"
    # The killed sandbox's own copy is kept as evidence.
    assert (workdir / "notes.txt").read_text() == "step two\n"


async def test_a_warm_sandbox_is_parked_reused_synced_and_evicted_by_a_kill(
        lworld: World) -> None:
    world = lworld
    agent = await world.agent(warm_sandbox=True)
    first = await world.task(agent["id"], "model:well_behaved")
    await world.wait_task(first["id"], "done")
    parked = await _wait_state(world, agent["id"], "parked")
    assert parked["exit_code"] == 0

    second = await world.task(agent["id"], "model:well_behaved")
    await world.wait_task(second["id"], "done")
    again = await _wait_state(world, agent["id"], "parked")
    assert again["id"] == parked["id"], "the parked sandbox was not reused"
    assert len(await _sandboxes(world, agent["id"])) == 1

    # The background sync (every second here) brings the parked work home.
    async def synced() -> bool:
        return _home_file(world, agent["id"], "notes.txt") == "step one\n"
    await eventually(synced, 20, "the parked sandbox was never synced")

    r = await world.security.post(f"/api/v1/agents/{agent['id']}/kill")
    assert r.json()["evicted_sandboxes"] == [parked["id"]]
    rows = await _sandboxes(world, agent["id"])
    assert [s["state"] for s in rows] == ["evicted"]
    workdir = world.plane.data_dir / "sandboxes" / agent["id"] / parked["id"]
    assert not workdir.exists()
    assert _home_file(world, agent["id"], "notes.txt") == "step one\n"


async def test_an_idle_parked_sandbox_really_falls_asleep(
        database_url: str, tmp_path: Path, model: tuple[str, Puppet]) -> None:
    async with start_plane(database_url, tmp_path, COVEYD, model_url=model[0],
                           warm_sync_s=3600, warm_idle_s=1) as plane, \
            make_world(plane) as world:
        agent = await world.agent(warm_sandbox=True)
        task = await world.task(agent["id"], "model:well_behaved")
        await world.wait_task(task["id"], "done")
        gone = await _wait_state(world, agent["id"], "gone")
        assert _home_file(world, agent["id"], "notes.txt") == "step one\n"
        synced = await world.db.fetchval("SELECT last_sync_at FROM sandboxes WHERE id=$1",
                                         uuid.UUID(gone["id"]))
        assert synced is not None


async def test_a_warm_sandbox_falling_asleep_after_a_kill_is_evicted_not_parked(
        lworld: World) -> None:
    """A daemon that finished just as the kill came exits after the kill's evictWarm ran:
    parked then, the killed agent kept a warm sandbox (and its unsynced work) for the next
    session after resume. Its parking asks the flags under the agent's lock."""
    world = lworld
    orch = world.plane.app.state.orchestrator
    kept, killed = await world.agent(warm_sandbox=True), await world.agent(warm_sandbox=True)
    boxes = {}
    for agent in (kept, killed):
        boxes[agent["id"]] = uuid.uuid4()
        # A sandbox whose daemon is exiting cleanly: still running when the kill comes.
        await orch.pool.execute(
            "INSERT INTO sandboxes (id, agent_id, backend, daemon_token_hash, token_expires_at,"
            " node, state) VALUES ($1, $2, 'process', 'x', now(), $3, 'running')",
            boxes[agent["id"]], uuid.UUID(agent["id"]), orch.runner.node)
    r = await world.security.post(f"/api/v1/agents/{killed['id']}/kill")
    assert r.status_code == 200 and r.json()["evicted_sandboxes"] == []  # nothing parked yet

    assert await orch.park_warm(boxes[kept["id"]], uuid.UUID(kept["id"])) is True
    assert await orch.park_warm(boxes[killed["id"]], uuid.UUID(killed["id"])) is False
    states = {a["id"]: [(s["state"], s["ended_at"] is not None)
                        for s in await _sandboxes(world, a["id"])] for a in (kept, killed)}
    assert states == {kept["id"]: [("parked", False)], killed["id"]: [("evicted", True)]}, (
        f"a warm sandbox of a killed agent was parked for reuse: {states}")
