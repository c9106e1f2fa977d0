"""Postgres paused (every process of it SIGSTOPped, its sockets open: a frozen disk or VM as its
clients see it): /healthz answers 503 within HEALTH_TIMEOUT_S (0.8 s), and a kill, a read
and a write each answer 503 with a hint within the stated bound (covey.outage.OUTAGE_ANSWER_S)
instead of hanging until the database is back. The kill answered so still takes effect once it is.

The server here is one of the test's own, so that pausing it stops no other test."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from covey.outage import (
    HEALTH_TIMEOUT_S,
    OUTAGE_ANSWER_S,
    PROBE_ABANDON_S,
    PROBE_TIMEOUT_S,
    DatabaseProbe,
)
from covey.testing import SCRIPTED_DAEMON
from covey.testing.plane import World, make_world, start_plane
from harness.nemesis import FaultProxy, Nemesis
from harness.nemesis.database import EmbeddedPostgres
from harness.stack.postgres import create_database, link_of, postgres_server, through
from harness.stack.waiting import eventually

# The room each bound gets for a loaded machine's scheduling (this test's loop and the
# plane's). Every bound with it stays well under what a missing bound would give: an answer
# only once the database is back (the pause, 20 s on), a probe that waits until its
# connection is dropped (PROBE_ABANDON_S, 5 s). The room was 0.5 s until a clean-clone CI run
# (-n 3, the host loaded by the other workers; 2026-12-06) timed /healthz at 1.30 s against
# 0.8 + 0.5.
SLACK_S = 1.0
PAUSE_S = 20.0


@pytest.fixture
async def own_server(tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    async with postgres_server(None, "covey-paused-pg-") as server_url:
        conn = await asyncpg.connect(server_url)
        try:
            pgdata = Path(await conn.fetchval("SHOW data_directory"))
        finally:
            await conn.close()
        yield await create_database(server_url, "covey_paused"), pgdata


@pytest.fixture
async def world(own_server: tuple[str, Path], tmp_path: Path) -> AsyncIterator[World]:
    async with start_plane(own_server[0], tmp_path / "plane", SCRIPTED_DAEMON) as plane, \
            make_world(plane) as world:
        yield world


async def _timed(request: object) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = await request  # type: ignore[misc]
    return response, time.monotonic() - started


async def test_a_paused_database_is_answered_503_fast(world: World,
                                                     own_server: tuple[str, Path]) -> None:
    agent = await world.agent()
    assert (await world.anonymous.get("/healthz")).status_code == 200
    async with Nemesis() as nemesis:
        # Healed on leaving, whatever happens here; by its watchdog if this process dies.
        await nemesis.pause_processes(EmbeddedPostgres(own_server[1]).pids(), PAUSE_S,
                                      target="postgres")
        health, took = await _timed(world.anonymous.get("/healthz"))
        print(f"/healthz answered {health.status_code} in {took * 1000:.0f} ms")
        assert health.status_code == 503 and health.json()["hint"], health.text
        assert took < HEALTH_TIMEOUT_S + SLACK_S, f"/healthz took {took:.2f} s"

        kill, took = await _timed(world.security.post(f"/api/v1/agents/{agent['id']}/kill",
                                                      json={"reason": "in the dark"}))
        print(f"the kill answered {kill.status_code} in {took * 1000:.0f} ms")
        assert kill.status_code == 503, kill.text
        assert kill.json()["error"] == "Database unreachable"
        assert "takes effect when the database is back" in kill.json()["hint"], kill.text
        assert kill.headers["retry-after"] == "1"
        assert took < OUTAGE_ANSWER_S + SLACK_S, f"the kill took {took:.2f} s"

        for request in (world.auditor.get("/api/v1/agents"),
                        world.org_admin.post(f"/api/v1/agents/{agent['id']}/tasks",
                                             json={"title": "t", "body": "b"})):
            answer, took = await _timed(request)
            assert answer.status_code == 503, answer.text
            assert "retry" in answer.json()["hint"], answer.text
            assert took < OUTAGE_ANSWER_S + SLACK_S, f"{answer.request.url} took {took:.2f} s"

        await nemesis.resume("postgres")
        assert nemesis.verify_healed().healed

    async def healthy() -> bool:
        return (await world.anonymous.get("/healthz")).status_code == 200
    await eventually(healthy, 30, "the control plane never found its database again")

    # The kill answered 503 went on and took effect once the database was back.
    async def killed() -> bool:
        return bool(await world.db.fetchval("SELECT killed FROM agents WHERE id=$1::uuid",
                                            agent["id"]))
    await eventually(killed, 30, "the kill answered 503 never took effect")
    entries = (await world.auditor.get("/api/v1/audit",
                                       params={"kind": "agent.kill"})).json()
    assert [e["detail"]["reason"] for e in entries] == ["in the dark"], entries


async def test_a_slow_request_on_a_healthy_database_is_not_cut_off(world: World) -> None:
    """The probe tells slow from stuck: a request that holds on for longer than the bound
    while the database answers is served."""
    conn = await asyncpg.connect(world.plane.database_url)
    agent = await world.agent()
    try:
        # A lock on the agent's row holds its kill past the bound; the database answers.
        tx = conn.transaction()
        await tx.start()
        await conn.execute("SELECT 1 FROM agents WHERE id=$1::uuid FOR UPDATE", agent["id"])
        pending = world.security.post(f"/api/v1/agents/{agent['id']}/kill")
        kill = asyncio.ensure_future(pending)
        await asyncio.sleep(OUTAGE_ANSWER_S + 1.0)  # the window in which nothing must happen
        assert not kill.done(), kill.result().text
        await tx.rollback()
        answer = await asyncio.wait_for(kill, 30)
        assert answer.status_code == 200, answer.text
    finally:
        await conn.close()


async def test_the_probe_answers_again_after_a_blackholed_link_heals(database_url: str
                                                                     ) -> None:
    """A link that swallows every byte: the probe says no within its bound while it stands,
    and yes again once it heals. (The proxy delivers what it held on heal, so this does not
    show the dropping of a probe's connection after PROBE_ABANDON_S, which serves a peer
    gone for good.)"""
    link = link_of(database_url)
    host, port = (link[len("unix:"):], None) if link.startswith("unix:") else (
        link.rpartition(":")[0], int(link.rpartition(":")[2]))
    async with FaultProxy(host, port, name="database", control_port=None) as proxy:
        probe = DatabaseProbe(through(database_url, proxy.port))
        try:
            assert await probe.answers()
            await proxy.inject("blackhole", deadline_s=60)
            for _ in range(3):  # before, at and after the probe under way gives up
                answer, took = await _timed(probe.answers())
                assert answer is False and took < PROBE_TIMEOUT_S + SLACK_S, (answer, took)
            await proxy.heal()
            await eventually(probe.answers, PROBE_ABANDON_S + 20,
                             "the probe never answered again after the link healed")
        finally:
            await probe.close()
