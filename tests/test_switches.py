"""DESIGN §2.3, one test per line, against a real Postgres, real HTTP and WebSockets, and real
daemon processes started by the process sandbox backend."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from covey.testing import SCRIPTED_DAEMON
from covey.testing.plane import World, make_world, start_plane
from harness.stack.waiting import eventually

STOPPED = {"error": "Agent or fleet is stopped", "hint": "resume it first."}


async def _working_on_hold(world: World) -> tuple[dict, dict]:
    agent = await world.agent()
    task = await world.task(agent["id"], "hold")
    await world.wait_task(task["id"], "in_progress")
    return agent, task


async def _sandbox_exit_codes(world: World, agent_id: str) -> list[int | None]:
    r = await world.org_admin.get(f"/api/v1/agents/{agent_id}/sandboxes")
    return [s["exit_code"] for s in r.json() if s["state"] == "gone"]


async def test_agent_kill_stops_the_running_session_and_requeues_its_task(world: World) -> None:
    agent, task = await _working_on_hold(world)

    r = await world.security.post(f"/api/v1/agents/{agent['id']}/kill")
    assert r.status_code == 200, r.text
    report = r.json()
    assert report["already_killed"] is False
    assert report["tasks_requeued"] == [task["id"]]
    assert len(report["sessions_cancelled"]) == 1

    # The daemon heard `kill` with the kill-switch reason, and the result it sent afterwards
    # was refused because the flag was already committed when it heard the kill.
    async def heard() -> list[dict]:
        t = world.plane.transcript(agent["id"])
        return [m for m in t if m["dir"] == "in" and m["type"] == "error"]
    refusals = await eventually(heard, 10, "the killed session's late result got no answer")
    kills = [m for m in world.plane.transcript(agent["id"])
             if m["dir"] == "in" and m["type"] == "kill"]
    assert [k["payload"]["reason"] for k in kills] == ["kill-switch"]
    assert refusals[0]["payload"]["error"] == "Result rejected"
    assert refusals[0]["payload"]["hint"] == "agent is killed"

    # The task is open again, with its transition written down, and was not completed.
    assert await world.task_state(task["id"]) == "open"
    detail = (await world.org_admin.get(
        f"/api/v1/agents/{agent['id']}/tasks/{task['id']}")).json()
    assert detail["result"] is None
    last = detail["transitions"][-1]
    assert (last["from_state"], last["to_state"]) == ("in_progress", "open")
    assert "kill-switch" in last["note"]

    rec = (await world.auditor.get(f"/api/v1/agents/{agent['id']}/recording")).json()
    assert [e for e in rec if e["kind"] == "kill" and e["status"] == "killed"]
    assert [e for e in rec if e["kind"] == "task" and e["status"] == "rejected"]

    # The daemon obeyed: exit code 3, sandbox gone.
    async def exited() -> list[int | None]:
        return await _sandbox_exit_codes(world, agent["id"])
    assert await eventually(exited, 10, "sandbox never went away") == [3]

    got = (await world.org_admin.get(f"/api/v1/agents/{agent['id']}")).json()
    assert (got["killed"], got["kill_origin"], got["status"]) == (True, "agent", "killed")


async def test_agent_kill_is_idempotent(world: World) -> None:
    agent, _ = await _working_on_hold(world)
    first = await world.org_admin.post(f"/api/v1/agents/{agent['id']}/kill")
    assert first.status_code == 200

    async def exited() -> list[int | None]:
        return await _sandbox_exit_codes(world, agent["id"])
    await eventually(exited, 10, "sandbox never went away")
    before = await world.snapshot()
    again = await world.org_admin.post(f"/api/v1/agents/{agent['id']}/kill")
    assert again.status_code == 200
    assert again.json() == {"already_killed": True, "agents_stopped": [agent["id"]],
                            "sessions_cancelled": [], "sessions_confirmed": [],
                            "sessions_acknowledged": [], "sessions_torn_down": [],
                            "sessions_not_connected": [], "tasks_requeued": [],
                            "evicted_sandboxes": []}
    assert await world.snapshot() == before


async def test_fleet_kill_stops_every_agent_and_notifies_admins_and_controlling(
        world: World) -> None:
    working, task = await _working_on_hold(world)
    idle = await world.agent()

    r = await world.security.post("/api/v1/fleet/kill")
    assert r.status_code == 200, r.text
    assert set(r.json()["agents_stopped"]) == {working["id"], idle["id"]}
    assert r.json()["tasks_requeued"] == [task["id"]]
    assert (await world.auditor.get("/api/v1/fleet")).json()["fleet_killed"] is True
    for a in (working, idle):
        got = (await world.auditor.get(f"/api/v1/agents/{a['id']}")).json()
        assert (got["killed"], got["kill_origin"]) == (True, "fleet")
    assert await world.task_state(task["id"]) == "open"

    expected = {"class": "cost", "kind": "fleet_killed", "link": "/administration",
                "title": "The emergency stop was pulled: every agent of this organisation "
                         "is paused"}
    for role in ("org_admin", "controlling"):
        got = (await world.org.clients[role].get("/api/v1/notifications")).json()
        assert [{k: n[k] for k in expected} for n in got] == [expected], role
    for role in ("security", "agent_owner", "auditor"):
        assert (await world.org.clients[role].get("/api/v1/notifications")).json() == []

    # Idempotent: pulling it again changes nothing, sends no second notification.
    before = await world.snapshot()
    again = await world.org_admin.post("/api/v1/fleet/kill")
    assert again.status_code == 200 and again.json()["already_killed"] is True
    assert await world.snapshot() == before


async def test_every_wake_path_is_refused_while_the_agent_is_killed(world: World) -> None:
    agent = await world.agent()
    await world.org_admin.post(f"/api/v1/agents/{agent['id']}/kill")
    await _assert_every_path_refused(world, agent)


async def test_every_wake_path_is_refused_while_the_fleet_is_stopped(world: World) -> None:
    agent = await world.agent()
    await world.security.post("/api/v1/fleet/kill")
    # The agent's own flag is cleared: only the org's flag holds it now.
    await world.org_admin.post(f"/api/v1/agents/{agent['id']}/resume")
    assert (await world.org_admin.get(f"/api/v1/agents/{agent['id']}")).json()["killed"] is False
    await _assert_every_path_refused(world, agent)


async def _assert_every_path_refused(world: World, agent: dict) -> None:
    aid = agent["id"]
    # Added while stopped, a heartbeat is due at once: only the switch keeps it from firing.
    hb = {"name": "hourly", "task_body": "work:0", "every_seconds": 60}
    r = await world.org_admin.post(f"/api/v1/agents/{aid}/heartbeats", json=hb)
    assert r.status_code == 201, r.text
    before_sessions = await world.db.fetchval("SELECT count(*) FROM sessions")
    r = await world.org_admin.post(f"/api/v1/agents/{aid}/wake")
    assert (r.status_code, r.json()) == (409, STOPPED)
    r = await world.org_admin.post(f"/api/v1/agents/{aid}/heartbeats/hourly/fire")
    assert (r.status_code, r.json()) == (409, STOPPED)
    r = await world.anonymous.post(f"/api/trigger/{agent['trigger_token']}", json={})
    assert (r.status_code, r.json()) == (409, STOPPED)
    task = await world.task(aid, "work:0")  # the LISTEN/NOTIFY wake path
    # Let several scheduler ticks (300 ms) pass: the due heartbeat must not fire either.
    await asyncio.sleep(2)
    assert await world.task_state(task["id"]) == "open"
    assert await world.db.fetchval("SELECT count(*) FROM sessions") == before_sessions
    assert await world.db.fetchval(
        "SELECT count(*) FROM backlog_tasks WHERE agent_id=$1 AND origin='heartbeat'",
        uuid.UUID(aid)) == 0
    got = (await world.org_admin.get(f"/api/v1/agents/{aid}")).json()
    assert got["status"] in ("killed", "sleeping")


async def test_notaus_der_flotte(world: World) -> None:
    """TestNotausDerFlotte: fleet kill → a new task stays open 2 s, the agent is not working,
    a direct wake bounces → fleet resume → the task is worked on."""
    agent = await world.agent()
    assert (await world.security.post("/api/v1/fleet/kill")).status_code == 200
    task = await world.task(agent["id"], "work:0")
    await asyncio.sleep(2)
    assert await world.task_state(task["id"]) == "open"
    got = (await world.org_admin.get(f"/api/v1/agents/{agent['id']}")).json()
    assert got["status"] != "working"
    assert (await world.org_admin.post(f"/api/v1/agents/{agent['id']}/wake")).status_code == 409
    mark = await world.event_mark()
    r = await world.security.post("/api/v1/fleet/resume")
    assert r.status_code == 200 and r.json()["agents_released"] == [agent["id"]], r.text
    # At once, by the resume or by the fast tick's pass the instant the flag cleared (the
    # resume alone is held to it on a one-minute tick, below).
    await world.released(r, mark, [agent["id"]])
    await world.wait_task(task["id"], "done")


async def test_fleet_resume_wakes_at_once_and_leaves_individually_killed_agents(
        database_url: str, tmp_path: Path) -> None:
    # A one-minute tick: whatever runs within seconds of the resume was woken by it.
    async with start_plane(database_url, tmp_path, SCRIPTED_DAEMON, tick_ms=60_000) as plane, \
            make_world(plane) as world:
        killed_alone = await world.agent()
        await world.org_admin.post(f"/api/v1/agents/{killed_alone['id']}/kill")
        guard_stopped = await world.agent()
        await world.db.execute(
            "UPDATE agents SET killed=true, kill_origin='guard', status='killed' WHERE id=$1",
            uuid.UUID(guard_stopped["id"]))
        fleet_only = [await world.agent() for _ in range(3)]
        await world.security.post("/api/v1/fleet/kill")
        tasks = [await world.task(a["id"], "work:0") for a in fleet_only]
        alone_task = await world.task(killed_alone["id"], "work:0")
        guard_task = await world.task(guard_stopped["id"], "work:0")

        r = await world.security.post("/api/v1/fleet/resume")
        assert r.status_code == 200
        body = r.json()
        assert set(body["agents_released"]) == {a["id"] for a in fleet_only}
        assert set(body["agents_woken"]) == {a["id"] for a in fleet_only}
        for t in tasks:
            await world.wait_task(t["id"], "done", deadline_s=20)
        for a, origin in ((killed_alone, "agent"), (guard_stopped, "guard")):
            got = (await world.auditor.get(f"/api/v1/agents/{a['id']}")).json()
            assert (got["killed"], got["kill_origin"]) == (True, origin)
        assert await world.task_state(alone_task["id"]) == "open"
        assert await world.task_state(guard_task["id"]) == "open"


async def test_agent_resume_during_fleet_stop_is_held_until_fleet_resume(world: World) -> None:
    agent = await world.agent()
    await world.org_admin.post(f"/api/v1/agents/{agent['id']}/kill")
    await world.security.post("/api/v1/fleet/kill")
    # Its own kill outranks the fleet's: fleet resume alone would not release it.
    got = (await world.auditor.get(f"/api/v1/agents/{agent['id']}")).json()
    assert got["kill_origin"] == "agent"
    task = await world.task(agent["id"], "work:0")
    r = await world.org_admin.post(f"/api/v1/agents/{agent['id']}/resume")
    assert r.status_code == 200
    assert r.json()["held_by_fleet"] is True and r.json()["agents_woken"] == []
    await asyncio.sleep(1.5)
    assert await world.task_state(task["id"]) == "open"
    await world.security.post("/api/v1/fleet/resume")
    await world.wait_task(task["id"], "done")


async def test_agent_created_during_fleet_stop_does_not_run(world: World) -> None:
    await world.security.post("/api/v1/fleet/kill")
    agent = await world.agent()
    assert agent["killed"] is False and agent["fleet_killed"] is True
    task = await world.task(agent["id"], "work:0")
    await asyncio.sleep(1.5)
    assert await world.task_state(task["id"]) == "open"
    assert await world.db.fetchval("SELECT count(*) FROM sessions WHERE agent_id=$1",
                                   uuid.UUID(agent["id"])) == 0
    await world.security.post("/api/v1/fleet/resume")
    await world.wait_task(task["id"], "done")


async def test_daemon_loss_requeues_with_retries_then_fails(world: World) -> None:
    """A daemon that dies mid-task: the task goes back to open, counting daemon_retries;
    after the fifth requeue the next loss fails it."""
    agent = await world.agent()
    task = await world.task(agent["id"], "crash")
    await world.wait_task(task["id"], "failed", deadline_s=60)
    row = await world.db.fetchrow("SELECT daemon_retries, result FROM backlog_tasks"
                                  " WHERE id=$1", uuid.UUID(task["id"]))
    assert row["daemon_retries"] == 6
    # The failed task says why, in words an operator can act on.
    assert row["result"].startswith("failed: its daemon was lost 6 times (at most 5 "
                                    "retries); last: "), row["result"]
    transitions = await world.db.fetch(
        "SELECT to_state FROM task_transitions WHERE task_id=$1 AND from_state='in_progress'"
        " ORDER BY id", uuid.UUID(task["id"]))
    assert [t["to_state"] for t in transitions] == ["open"] * 5 + ["failed"]
    sessions = await world.db.fetch("SELECT state FROM sessions WHERE agent_id=$1",
                                    uuid.UUID(agent["id"]))
    assert [s["state"] for s in sessions] == ["lost"] * 6


async def test_daemon_loss_during_a_stop_does_not_wake(world: World) -> None:
    agent = await world.agent()
    task = await world.task(agent["id"], "crash-later")
    await world.wait_task(task["id"], "in_progress")
    await world.db.execute("UPDATE organizations SET fleet_killed=true WHERE id=$1",
                           world.org.id)
    # The daemon now dies on its own: its task is requeued, but nothing may start again.
    await world.wait_task(task["id"], "open", deadline_s=20)
    await asyncio.sleep(1.5)
    assert await world.db.fetchval(
        "SELECT count(*) FROM sessions WHERE agent_id=$1", uuid.UUID(agent["id"])) == 1
    assert await world.task_state(task["id"]) == "open"


async def test_a_superseded_sessions_result_is_rejected(world: World) -> None:
    """Fencing: a result carrying an older claim token never completes the task."""
    agent, task = await _working_on_hold(world)
    session_id = await world.db.fetchval(
        "SELECT id FROM sessions WHERE agent_id=$1 AND state='running'", uuid.UUID(agent["id"]))
    token = await world.db.fetchval("SELECT claim_token FROM backlog_tasks WHERE id=$1",
                                    uuid.UUID(task["id"]))
    why = await world.plane.orch.finish_task(session_id, uuid.UUID(task["id"]), token - 1,
                                             "done", "stale")
    assert why == "stale fencing token"
    assert await world.task_state(task["id"]) == "in_progress"
    assert await world.plane.orch.finish_task(session_id, uuid.UUID(task["id"]), token,
                                              "done", "fresh") is None
    assert await world.task_state(task["id"]) == "done"


async def test_a_new_task_for_a_busy_agent_takes_no_lock_on_it(
        database_url: str, tmp_path: Path) -> None:
    """A new task's wake looks first, without a lock, and leaves an agent whose session is
    live: its session claims the work. It used to lock the agent's row and its
    organisation's only to find it busy, and a kill waits for those locks. Here the agent's
    row is held, as a kill would hold it: no wake may queue behind it."""
    async with start_plane(database_url, tmp_path, SCRIPTED_DAEMON, tick_ms=60_000) as plane, \
            make_world(plane) as world:
        agent = await world.agent()
        await world.task(agent["id"], "hold")
        await world.wait_working(agent["id"])
        mark = await world.event_mark()
        async with world.db.acquire() as conn, conn.transaction():
            await conn.execute("SELECT 1 FROM agents WHERE id=$1 FOR NO KEY UPDATE",
                               uuid.UUID(agent["id"]))
            await world.task(agent["id"], "work:0")
            await asyncio.sleep(1)  # the wake's look, well past
            waiting = await world.db.fetch(
                "SELECT left(query, 120) AS query FROM pg_stat_activity"
                " WHERE wait_event_type='Lock' AND datname=current_database()")
        assert waiting == [], f"a wake queued for the busy agent's lock: {waiting}"
        assert await world.started_since(mark) == {}, "the busy agent was woken again"
