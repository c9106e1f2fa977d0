"""Status events over SSE, Prometheus metrics of the kill path, health."""

from __future__ import annotations

import asyncio
import json
import uuid

import asyncpg
from prometheus_client.parser import text_string_to_metric_families

from covey.rows import emit_statuses
from covey.testing.plane import World


async def test_status_changes_stream_as_server_sent_events(world: World) -> None:
    agent = await world.agent()
    seen: list[dict] = []
    subscribed = asyncio.Event()

    async def listen() -> None:
        async with world.auditor.stream("GET", "/api/v1/events") as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            async for line in r.aiter_lines():
                if line == ": connected":
                    subscribed.set()
                if line.startswith("data: "):
                    seen.append(json.loads(line[6:]))
                    if seen[-1]["status"] == "killed":
                        return

    listener = asyncio.create_task(listen())
    await asyncio.wait_for(subscribed.wait(), 10)
    await world.task(agent["id"], "hold")
    await world.wait_working(agent["id"])
    await world.org_admin.post(f"/api/v1/agents/{agent['id']}/kill")
    await asyncio.wait_for(listener, 10)
    statuses = [e["status"] for e in seen if e["agent_id"] == agent["id"]]
    assert statuses[-1] == "killed"
    assert "working" in statuses


async def _samples(world: World) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = (await world.anonymous.get("/metrics")).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_metrics_count_kills_and_time_their_stages(world: World) -> None:
    agent = await world.agent()
    before = await _samples(world)
    await world.org_admin.post(f"/api/v1/agents/{agent['id']}/kill")
    await world.org_admin.post(f"/api/v1/agents/{agent['id']}/kill")
    await world.security.post("/api/v1/fleet/kill")
    after = await _samples(world)

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("covey_kills_total", scope="agent", outcome="killed") == 1
    assert grew("covey_kills_total", scope="agent", outcome="already") == 1
    assert grew("covey_kills_total", scope="fleet", outcome="killed") == 1
    for stage in ("flag_committed", "kill_sent", "requeued"):
        assert grew("covey_kill_stage_seconds_count", scope="agent", stage=stage) == 2
    assert (await world.anonymous.get("/healthz")).json()["ok"] is True


async def test_many_status_changes_go_a_hundred_per_notify_in_the_streams_shape(
        world: World) -> None:
    agents = [uuid.uuid4() for _ in range(150)]
    heard: asyncio.Queue[str] = asyncio.Queue()
    listener = await asyncpg.connect(world.plane.database_url)
    try:
        await listener.add_listener("covey_events", lambda *a: heard.put_nowait(str(a[-1])))
        async with world.db.acquire() as conn:
            await emit_statuses(conn, world.org.id, agents, "sleeping")
            await emit_statuses(conn, world.org.id, [], "sleeping")  # none: no NOTIFY
            await conn.execute("SELECT pg_notify('covey_events', 'end')")
        payloads = [await asyncio.wait_for(heard.get(), 10) for _ in range(2)]
        assert await asyncio.wait_for(heard.get(), 10) == "end", \
            "an empty list of agents sent a NOTIFY"
    finally:
        await listener.close()
    events = [json.loads(p) for p in payloads]
    assert sorted(len(e["agents"]) for e in events) == [50, 100], events
    assert all(e["org_id"] == str(world.org.id) and e["status"] == "sleeping"
               for e in events), events
    assert sorted(a for e in events for a in e["agents"]) == sorted(map(str, agents))
