"""Two control-plane replicas on one database (DESIGN §2.7): a kill pulled on one replica
stops a daemon connected to the other, through LISTEN/NOTIFY."""

from __future__ import annotations

import uuid
from pathlib import Path

from covey.testing import SCRIPTED_DAEMON
from covey.testing.plane import make_world, start_plane
from harness.waiting import eventually


async def test_kill_on_one_replica_stops_a_daemon_connected_to_the_other(
        database_url: str, tmp_path: Path) -> None:
    async with start_plane(database_url, tmp_path / "a", SCRIPTED_DAEMON) as a, \
            start_plane(database_url, tmp_path / "b", SCRIPTED_DAEMON) as b, \
            make_world(a) as world:
        agent = await world.agent()
        task = await world.task(agent["id"], "hold")
        await world.wait_task(task["id"], "in_progress")
        node = await world.db.fetchval(
            "SELECT node FROM sessions WHERE agent_id=$1 AND state='running'",
            uuid.UUID(agent["id"]))
        holder, other = (a, b) if node == a.orch.node else (b, a)
        assert node == holder.orch.node and holder.orch.hub.session_ids()
        assert other.orch.hub.session_ids() == []

        # Pull the switch on the replica that does NOT hold the daemon's connection.
        token = world.org_admin.headers["Authorization"]
        import httpx
        async with httpx.AsyncClient(base_url=other.url, headers={"Authorization": token}
                                     ) as client:
            r = await client.post(f"/api/v1/agents/{agent['id']}/kill")
        assert r.status_code == 200, r.text
        assert r.json()["tasks_requeued"] == [task["id"]]

        async def heard_kill() -> bool:
            return any(m["dir"] == "in" and m["type"] == "kill"
                       for m in holder.transcript(agent["id"]))
        await eventually(heard_kill, 10, "the daemon on the other replica never heard kill")

        async def exit_code() -> int | None:
            code: int | None = await world.db.fetchval(
                "SELECT exit_code FROM sandboxes WHERE agent_id=$1 AND state='gone'",
                uuid.UUID(agent["id"]))
            return code
        assert await eventually(exit_code, 10, "sandbox never exited") == 3
        assert await world.task_state(task["id"]) == "open"
