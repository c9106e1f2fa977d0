"""A kill does not queue behind reads (covey.admission): the switches have database
connections of their own, and reads beyond a bound are shed with a 429, never a 5xx.

Reads are held up for real: a transaction takes an exclusive lock on the table a read
needs (the notifications, which no agent kill touches), so each held read keeps its pooled
connection, as a slow read does under load."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from fastapi import APIRouter
from fastapi.routing import APIRoute

from covey.admission import is_switch
from covey.app import ROUTERS, SWITCH_ROUTERS, create_app
from covey.config import Settings
from covey.db import Connection
from covey.testing import SCRIPTED_DAEMON
from covey.testing.plane import World, make_world, start_plane
from harness.stack.waiting import eventually


@asynccontextmanager
async def world_with(database_url: str, tmp_path: Path, **settings: Any
                     ) -> AsyncIterator[World]:
    async with start_plane(database_url, tmp_path / "plane", SCRIPTED_DAEMON,
                           **settings) as plane, make_world(plane) as world:
        yield world


@asynccontextmanager
async def notifications_locked(database_url: str) -> AsyncIterator[Connection]:
    conn = await asyncpg.connect(database_url)
    try:
        async with conn.transaction():
            await conn.execute("LOCK TABLE notifications IN ACCESS EXCLUSIVE MODE")
            yield conn
    finally:
        await conn.close()


async def held_reads(world: World) -> int:
    """Reads of the notifications waiting on the lock, as Postgres sees them (from outside
    the lock's transaction, which would see one snapshot of the activity throughout)."""
    n: int = await world.db.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE datname=current_database()"
        " AND wait_event_type='Lock' AND query LIKE '%notifications%'")
    return n


async def test_a_kill_answers_while_reads_hold_every_pooled_connection(
        database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The daemon acknowledges the kill at once, as coveyd does (not after a late result of
    # its task, whose answer needs a pooled connection: here, none is left).
    monkeypatch.setenv("SCRIPTED_DAEMON_PLAIN_KILL", "1")
    async with world_with(database_url, tmp_path, read_concurrency=64,
                          sandbox_pass_env=(*Settings.sandbox_pass_env,
                                            "SCRIPTED_DAEMON_PLAIN_KILL")) as world:
        agent = (await world.agent())["id"]
        task = (await world.task(agent, "hold"))["id"]
        await world.wait_task(task, "in_progress")
        reader = world.auditor
        async with notifications_locked(database_url):
            # More held reads than the main pool has connections (20): none is left for
            # anything but the switches' own lane.
            reads = [asyncio.ensure_future(reader.get("/api/v1/notifications",
                                                      timeout=60)) for _ in range(24)]

            async def pool_taken() -> bool:
                return await held_reads(world) >= 20
            await eventually(pool_taken, 30, "the reads never took the pool's connections")
            r = await world.security.post(f"/api/v1/agents/{agent}/kill", timeout=20)
            assert r.status_code == 200, (
                f"the kill must answer while reads hold every pooled connection: {r.text}")
            answer = r.json()
            assert answer["tasks_requeued"] == [task], answer
            assert answer["sessions_confirmed"] == answer["sessions_cancelled"] != [], answer
            assert not any(read.done() for read in reads), "a held read was not held"
        statuses = [r.status_code for r in await asyncio.wait_for(asyncio.gather(*reads), 60)]
        assert statuses == [200] * len(reads), f"held reads answered {statuses}"


async def test_reads_beyond_the_bound_are_shed_with_429_and_retry_after(
        database_url: str, tmp_path: Path) -> None:
    async with world_with(database_url, tmp_path, read_concurrency=1, read_queue=0) as world:
        agent = (await world.agent())["id"]
        async with notifications_locked(database_url):
            held = asyncio.ensure_future(world.auditor.get("/api/v1/notifications",
                                                           timeout=60))

            async def read_held() -> bool:
                return await held_reads(world) == 1
            await eventually(read_held, 30, "the first read never reached the lock")
            shed = await world.auditor.get("/api/v1/agents", timeout=10)
            assert shed.status_code == 429, shed.text
            assert shed.headers["retry-after"] == "1"
            assert shed.json()["error"] == "Too many reads at once"
            assert "retry after 1 s" in shed.json()["hint"]
            # The switches are not held back by the reads' bound, nor are other writes.
            r = await world.security.post(f"/api/v1/agents/{agent}/kill", timeout=20)
            assert r.status_code == 200, r.text
            r = await world.org_admin.post(f"/api/v1/agents/{agent}/resume", timeout=20)
            assert r.status_code == 200, r.text
            assert not held.done(), "the held read was not held"
        assert (await held).status_code == 200
        r = await world.auditor.get("/api/v1/agents")
        assert r.status_code == 200, "the bound must free its turn once the read is done"


@pytest.mark.parametrize("path", ["/api/v1/agents", "/api/v1/agents/{agent_id}/backlog"])
async def test_the_document_says_a_read_may_answer_429(world: World, path: str) -> None:
    doc = (await world.auditor.get("/openapi.json")).json()
    assert "429" in doc["paths"][path]["get"]["responses"]
    assert "429" not in doc["paths"]["/api/v1/agents/{agent_id}/kill"]["post"]["responses"]



def _requests(router: APIRouter) -> set[tuple[str, str]]:
    """(method, an example path) of each route of the router."""
    return {(method, route.path.replace("{agent_id}", "0b8a1f6e-0000-4000-8000-000000000000")
             .replace("{action}", "kill"))
            for route in router.routes if isinstance(route, APIRoute) for method in route.methods}


def test_the_switch_routes_are_the_switch_lane_and_are_matched_first() -> None:
    """The routes declared as switches (each API module's `switches`, included first so that
    FastAPI tries them before any other: the agent kill came after 36 routes) are the
    requests `is_switch` sends to the switches' lane, and no other route is. A switch
    declared in one and not the other would queue behind reads, or be looked for after
    every other route. (The administration page's route of the agent switch serves its
    resume too, which is not a switch: its kill is what is checked.)"""
    declared = set().union(*(_requests(r) for r in SWITCH_ROUTERS))
    assert len(declared) == 5, f"the switch routes: {sorted(declared)}"
    for method, path in declared:
        assert is_switch(method, path), (
            f"{method} {path} is declared a switch, but is_switch does not send it to the "
            "switches' lane")
    for router in ROUTERS:
        for method, path in _requests(router):
            assert not is_switch(method, path), (
                f"{method} {path} pulls a switch but is not among the switch routes")
    app = create_app(Settings("postgresql://unused@127.0.0.1/unused", Path("/nonexistent")))
    # FastAPI keeps an included router as one entry of the app's routes, in order.
    included = [getattr(r, "original_router", None) for r in app.router.routes]
    order = [included.index(r) for r in (*SWITCH_ROUTERS, *ROUTERS)]
    assert order[:len(SWITCH_ROUTERS)] == sorted(order)[:len(SWITCH_ROUTERS)], (
        f"the switch routers are not the first the app tries: {order}")
