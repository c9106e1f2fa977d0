"""The docker sandbox backend, end to end: the real control plane starts one container per
sandbox from the project's image, running the real coveyd against a scripted model."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from covey.testing.plane import World, make_world, start_plane
from harness.act.puppet import Puppet
from harness.nemesis import FaultProxy
from harness.stack.base import free_port
from harness.stack.waiting import eventually

pytestmark = pytest.mark.docker
IMAGE = os.environ.get("COVEY_SANDBOX_IMAGE", "covey-gameday:latest")


@pytest.fixture
async def dworld(database_url: str, tmp_path: Path, model: tuple[str, Puppet],
                 docker_client: Any) -> AsyncIterator[World]:
    gameday = f"test-{uuid.uuid4().hex[:8]}"
    async with start_plane(database_url, tmp_path, ["coveyd"], model_url=model[0],
                           sandbox_backend="docker", sandbox_image=IMAGE, gameday=gameday
                           ) as plane, make_world(plane) as world:
        world.gameday = gameday  # type: ignore[attr-defined]
        yield world
    leftovers = docker_client.containers.list(ignore_removed=True, all=True,
                                              filters={"label": f"covey.gameday={gameday}"})
    for c in leftovers:
        c.remove(force=True)
    assert leftovers == [], "the control plane left sandbox containers behind"


def _containers(client: Any, world: World) -> list[Any]:
    gameday = world.gameday  # type: ignore[attr-defined]
    return list(client.containers.list(ignore_removed=True, all=True,
                                       filters={"label": f"covey.gameday={gameday}"}))


async def _gone_sandbox(world: World, agent_id: str) -> dict[str, Any]:
    async def gone() -> dict[str, Any] | None:
        rows = (await world.org_admin.get(f"/api/v1/agents/{agent_id}/sandboxes")).json()
        done = [s for s in rows if s["state"] == "gone"]
        return done[-1] if done else None
    return await eventually(gone, 60, "sandbox never went away")


async def test_an_agent_works_a_task_in_a_container(dworld: World, docker_client: Any) -> None:
    agent = await dworld.agent()
    task = await dworld.task(agent["id"], "model:well_behaved")
    await dworld.wait_task(task["id"], "done", deadline_s=60)
    sandbox = await _gone_sandbox(dworld, agent["id"])
    assert sandbox["backend"] == "docker" and sandbox["exit_code"] == 0
    assert _containers(docker_client, dworld) == []
    home = dworld.plane.data_dir / "homes" / agent["id"] / "notes.txt"
    assert home.read_text() == "step one\n"


async def test_a_kill_exits_3_and_removes_the_container(
        dworld: World, docker_client: Any, model: tuple[str, Puppet]) -> None:
    agent = await dworld.agent()
    task = await dworld.task(agent["id"], "model:silent")

    async def busy() -> bool:
        return len(model[1].actions(agent["id"])) >= 2
    await eventually(busy, 60, "the agent never got going in its container")
    [container] = _containers(docker_client, dworld)
    assert container.labels["covey.agent"] == agent["id"]
    # A sandbox weighs an eighth of the plane's container on a busy host: twenty of them at
    # the default weight left the plane a twenty-first of the CPU while a kill was due.
    assert container.attrs["HostConfig"]["CpuShares"] == 128, container.attrs["HostConfig"]
    r = await dworld.security.post(f"/api/v1/agents/{agent['id']}/kill")
    assert r.status_code == 200
    sandbox = await _gone_sandbox(dworld, agent["id"])
    assert sandbox["exit_code"] == 3
    assert _containers(docker_client, dworld) == []
    # Two parts, two times: the container's death as the engine saw it, then its removal.
    assert _at(sandbox["daemon_exited_at"]) < _at(sandbox["gone_at"])
    [died] = list(docker_client.events(
        since=int(time.time()) - 300, until=int(time.time()) + 1, decode=True,
        filters={"label": f"covey.sandbox={sandbox['id']}", "event": "die"}))
    recorded_ns = _at(sandbox["daemon_exited_at"]).timestamp() * 1e9
    assert abs(recorded_ns - int(died["timeNano"])) < 2_000, (
        "the daemon's exit is not the engine's time of the container's death")
    log = (dworld.plane.data_dir / "logs" / f"{sandbox['id']}.log").read_text()
    assert "kill switch" in log and "daemon terminates immediately" in log
    assert await dworld.task_state(task["id"]) == "open"


async def test_cutting_the_channel_stops_a_containerised_agent_within_the_lease(
        database_url: str, tmp_path: Path, model: tuple[str, Puppet],
        docker_client: Any) -> None:
    port, lease_s = free_port(), 1.0
    gameday = f"test-{uuid.uuid4().hex[:8]}"
    channel = FaultProxy("127.0.0.1", port, name="control-channel", control_port=None)
    async with channel as proxy, start_plane(
            database_url, tmp_path, ["coveyd"], model_url=model[0], lease_ms=1000, port=port,
            sandbox_backend="docker", sandbox_image=IMAGE, gameday=gameday,
            public_ws_url=f"ws://127.0.0.1:{proxy.port}/api/daemon/ws") as plane, \
            make_world(plane) as world:
        agent = await world.agent()
        await world.task(agent["id"], "model:silent")

        async def busy() -> bool:
            return len(model[1].actions(agent["id"])) >= 2
        await eventually(busy, 60, "the agent never got going in its container")
        await proxy.blackhole(60)  # longer than the test: it heals on exit
        cut_at = time.monotonic()

        def running() -> bool:
            return bool(docker_client.containers.list(
                ignore_removed=True,
                filters={"label": f"covey.gameday={gameday}", "status": "running"}))

        async def stopped() -> bool:
            return not running()
        await eventually(stopped, 30, "the container kept running after the cut",
                         interval=0.02)
        stopped_after = time.monotonic() - cut_at
        sandbox = await _gone_sandbox(world, agent["id"])
        assert sandbox["exit_code"] == 3
        # Generous on a shared 2-core machine: the lease plus a margin.
        assert stopped_after < lease_s + 2.0, stopped_after


async def test_a_kill_evicts_a_parked_warm_sandbox(dworld: World, docker_client: Any) -> None:
    agent = await dworld.agent(warm_sandbox=True)
    task = await dworld.task(agent["id"], "model:well_behaved")
    await dworld.wait_task(task["id"], "done", deadline_s=60)

    async def parked() -> dict[str, Any] | None:
        rows = (await dworld.org_admin.get(f"/api/v1/agents/{agent['id']}/sandboxes")).json()
        return next((s for s in rows if s["state"] == "parked"), None)
    sandbox = await eventually(parked, 60, "the warm sandbox was never parked")
    # As covey's: the container stays up between sessions, its daemon connected and idle.
    [container] = _containers(docker_client, dworld)
    assert container.status == "running" and container.id == sandbox["handle"]
    assert sandbox["exit_code"] is None and sandbox["daemon_exited_at"] is None
    workdir = dworld.plane.data_dir / "sandboxes" / agent["id"] / sandbox["id"]
    assert (workdir / "notes.txt").exists()
    r = await dworld.security.post(f"/api/v1/agents/{agent['id']}/kill")
    assert r.json()["evicted_sandboxes"] == [sandbox["id"]]

    async def torn_down() -> dict[str, Any] | None:
        [row] = (await dworld.org_admin.get(f"/api/v1/agents/{agent['id']}/sandboxes")).json()
        return row if row["gone_at"] and not workdir.exists() else None
    evicted = await eventually(torn_down, 30, "the evicted container was never torn down")
    assert _containers(docker_client, dworld) == [], "the evicted container is still there"
    assert evicted["state"] == "evicted" and evicted["exit_code"] == 137
    assert _at(evicted["daemon_exited_at"]) < _at(evicted["gone_at"]), (
        "the container is recorded removed before it died")
    # Never synced (the default background sync is minutes away): the work is lost.
    assert not (dworld.plane.data_dir / "homes" / agent["id"] / "notes.txt").exists()


def _at(stamp: str | None) -> datetime:
    assert stamp is not None, "a time the sandbox row should record is missing"
    return datetime.fromisoformat(stamp)


async def test_a_previous_life_s_container_without_a_handle_is_found_by_its_name(
        dworld: World, docker_client: Any) -> None:
    """A control plane that died between a container's start and the write of its handle
    left a row without one. Settling its previous life looked for the sandbox's processes
    by their marker, which a plane in a container cannot see: the row was recorded gone
    while the container ran on. It is found by its name now. (The container here carries
    no marker, as seen from such a plane.)"""
    from covey.sandbox import container_name

    runner = dworld.plane.app.state.orchestrator.runner
    host_port = runner.node.rsplit(":", 1)[0]
    agent = await dworld.agent()
    sandbox_id = uuid.uuid4()
    await dworld.db.execute(
        "INSERT INTO sandboxes (id, agent_id, backend, state, node)"
        " VALUES ($1, $2, 'docker', 'starting', $3)",
        sandbox_id, uuid.UUID(agent["id"]), f"{host_port}:a-previous-life")
    orphan = docker_client.containers.run(
        IMAGE, ["sleep", "300"], detach=True, name=container_name(sandbox_id),
        labels={"covey.gameday": dworld.gameday})  # type: ignore[attr-defined]
    await runner._settle_orphans(host_port, held_only=False)
    assert [c.id for c in _containers(docker_client, dworld)] == [], (
        f"the previous life's container {orphan.name} still runs after its settling")
    row = await dworld.db.fetchrow("SELECT state, gone_at FROM sandboxes WHERE id=$1",
                                   sandbox_id)
    assert row["state"] == "gone" and row["gone_at"] is not None, dict(row)
