""""Database unreachable" (503, with a hint) means the database, and only the database: a real
control plane whose link to Postgres the fault proxy cuts answers it, and reconnects by itself
once the link heals; an OSError of something else (a file, a socket of ours) is not reported as
the database being down."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from covey import errors
from covey.db import DatabaseUnavailable
from covey.testing import SCRIPTED_DAEMON
from covey.testing.plane import make_world, served, start_plane
from harness.nemesis import FaultProxy
from harness.stack.postgres import link_of, through
from harness.stack.waiting import eventually


@pytest.mark.parametrize("cut", ["down", "reset"])
async def test_a_request_while_the_database_is_unreachable_answers_503_with_a_hint(
        database_url: str, tmp_path: Path, cut: str) -> None:
    link = link_of(database_url)
    host, port = (link[len("unix:"):], None) if link.startswith("unix:") else (
        link.rpartition(":")[0], int(link.rpartition(":")[2]))
    async with FaultProxy(host, port, name="database", control_port=None) as proxy:
        async with start_plane(through(database_url, proxy.port), tmp_path,
                               SCRIPTED_DAEMON) as plane, make_world(plane) as world:
            agent = await world.agent()
            await proxy.inject("down" if cut == "down" else "reset", deadline_s=60)
            for r in (await world.auditor.get("/api/v1/agents"),
                      await world.security.post(f"/api/v1/agents/{agent['id']}/kill")):
                assert r.status_code == 503, r.text
                body = r.json()
                assert body["error"] == "Database unreachable", body
                assert "retry" in body["hint"] and "/healthz" in body["hint"], body
                assert r.headers["retry-after"] == "1"
            health = await world.anonymous.get("/healthz")
            assert health.status_code == 503 and health.json()["hint"], health.text

            await proxy.heal()

            async def back() -> bool:
                return (await world.auditor.get("/api/v1/agents")).status_code == 200
            await eventually(back, 30, "the control plane never reconnected to its database")
            r = await world.security.post(f"/api/v1/agents/{agent['id']}/kill")
            assert r.status_code == 200, r.text


@pytest.fixture
async def app_url() -> AsyncIterator[str]:
    """The control plane's error handling (errors.install with ContainErrors) around routes
    that fail in two ways, served by a real uvicorn."""
    app = FastAPI()
    errors.install(app)

    @app.get("/evidence")
    async def evidence() -> None:
        # What reading a sandbox's evidence folder raises when a teardown removed it.
        await asyncio.to_thread(Path("/nonexistent/sandboxes/transcript.jsonl").read_text)

    @app.get("/daemon")
    async def daemon() -> None:
        raise ConnectionResetError(104, "Connection reset by peer")  # a daemon's socket

    @app.get("/database")
    async def database() -> None:
        raise DatabaseUnavailable("cannot connect to the database: ConnectionRefusedError()")

    app.add_middleware(errors.ContainErrors)
    async with served(app) as url:
        yield url


@pytest.mark.parametrize("path", ["/evidence", "/daemon"])
async def test_an_os_error_that_is_not_the_database_is_not_called_database_unreachable(
        app_url: str, path: str) -> None:
    async with httpx.AsyncClient(base_url=app_url, timeout=10) as client:
        r = await client.get(path)
    assert r.json()["error"] != "Database unreachable", r.text
    assert r.status_code != 503, r.text
    # A bug of ours, said so: the one error shape, the trace in the server's log.
    assert (r.status_code, r.json()["error"]) == (500, "Internal error"), r.text


async def test_the_database_layer_s_own_error_is_the_503(app_url: str) -> None:
    async with httpx.AsyncClient(base_url=app_url, timeout=10) as client:
        r = await client.get("/database")
    assert (r.status_code, r.json()["error"]) == (503, "Database unreachable"), r.text
