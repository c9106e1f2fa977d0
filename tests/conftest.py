"""Fixtures: a real Postgres (embedded pgserver), a fresh database per test cloned from a
migrated template, and real control planes served by uvicorn on loopback ports."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import uvicorn

from covey.db import migrate
from harness.puppet import Puppet, create_app
from tests.support.plane import Plane, World, eventually, free_port, make_world, start_plane

SCRIPTED_DAEMON = [sys.executable, str(Path(__file__).parent / "support" / "scripted_daemon.py")]
COVEYD = [sys.executable, "-m", "covey.coveyd"]


def _with_database(url: str, name: str) -> str:
    base, _, query = url.partition("?")
    return f"{base.rsplit('/', 1)[0]}/{name}" + (f"?{query}" if query else "")


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """The server: DATABASE_URL when given (it must allow CREATE DATABASE), else embedded."""
    given = os.environ.get("TEST_DATABASE_URL")
    if given:
        yield given
        return
    import pgserver

    with tempfile.TemporaryDirectory(prefix="covey-test-pg-") as folder:
        server = pgserver.get_server(folder, cleanup_mode="stop")
        yield str(server.get_uri())
        server.cleanup()


@pytest.fixture(scope="session")
async def template_db(pg_url: str) -> str:
    name = f"covey_template_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    await migrate(_with_database(pg_url, name))
    return name


@pytest.fixture
async def database_url(pg_url: str, template_db: str) -> AsyncIterator[str]:
    name = f"covey_t_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    finally:
        await conn.close()
    yield _with_database(pg_url, name)
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


@pytest.fixture
async def plane(database_url: str, tmp_path: Path) -> AsyncIterator[Plane]:
    """One control plane with the process backend running the scripted daemon."""
    async with start_plane(database_url, tmp_path / "replica-a", SCRIPTED_DAEMON) as p:
        yield p


@pytest.fixture
async def world(plane: Plane) -> AsyncIterator[World]:
    """Two organisations; the first with one human of every role, each with an API client."""
    async with make_world(plane) as w:
        yield w


@asynccontextmanager
async def puppet_model() -> AsyncIterator[tuple[str, Puppet]]:
    """The harness's puppet model on a loopback port: (its /v1 URL, the puppet)."""
    puppet = Puppet()
    app = create_app(puppet)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    serving = asyncio.create_task(server.serve())

    async def started() -> bool:
        return server.started
    await eventually(started, 10, "puppet model did not start")
    try:
        yield f"http://127.0.0.1:{port}/v1", puppet
    finally:
        server.should_exit = True
        await serving


@pytest.fixture
async def model() -> AsyncIterator[tuple[str, Puppet]]:
    async with puppet_model() as m:
        yield m


@pytest.fixture(scope="session")
def docker_client() -> Iterator[Any]:
    """The Docker engine with the stack's image, or a skip; CI sets COVEY_REQUIRE_DOCKER=1 to
    make their absence a failure instead."""
    image = os.environ.get("COVEY_SANDBOX_IMAGE", "covey-gameday:latest")
    try:
        import docker

        client = docker.from_env()
        client.ping()
        client.images.get(image)
    except Exception as exc:
        if os.environ.get("COVEY_REQUIRE_DOCKER") == "1":
            raise
        pytest.skip(f"no Docker engine or no {image} image (scripts/build-image): {exc}")
    yield client
    client.close()
