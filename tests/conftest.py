"""Fixtures: a real Postgres (embedded pgserver), a fresh database per test cloned from a
migrated template, and real control planes served by uvicorn on loopback ports."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from covey.db import migrate
from covey.testing import SCRIPTED_DAEMON
from covey.testing.plane import Plane, World, make_world, served, start_plane
from harness.act.browser import chromium
from harness.act.puppet import Puppet, create_app
from harness.nemesis.watchdog import STATE_ENV
from harness.stack.postgres import create_database, database_of_its_own, postgres_server

# The control planes these tests start (`covey serve` under a processes stack, often several
# at once on a 2-core CI host) do not outrank the tests' own processes: a plane that
# raised its priority (covey.cpu_group.raise_plane_priority) is what game days measure, not
# what a test of the harness's Ctrl-C or halt needs beside it. Its own tests call it directly.
os.environ.setdefault("COVEY_PLANE_NICE", "off")

COVEYD = [sys.executable, "-m", "covey.coveyd"]


@pytest.fixture(autouse=True)
def nemesis_state_of_its_own(monkeypatch: pytest.MonkeyPatch,
                             tmp_path_factory: pytest.TempPathFactory) -> None:
    """Each test keeps the nemesis's standing faults, running game days and halt in a folder
    of its own (and so does every harness it starts): in the machine-wide default, a test's
    halt would heal another test's faults and stop its game days, and a halt pulled by
    anybody on this host would refuse the tests' game days."""
    monkeypatch.setenv(STATE_ENV, str(tmp_path_factory.mktemp("nemesis-state")))


@pytest.fixture(scope="session")
async def pg_url() -> AsyncIterator[str]:
    """The server: TEST_DATABASE_URL when given (it must allow CREATE DATABASE), else embedded."""
    async with postgres_server(os.environ.get("TEST_DATABASE_URL"), "covey-test-pg-") as url:
        yield url


@pytest.fixture(scope="session")
async def template_db(pg_url: str) -> str:
    name = f"covey_template_{uuid.uuid4().hex[:8]}"
    await migrate(await create_database(pg_url, name))
    return name


@pytest.fixture
async def database_url(pg_url: str, template_db: str) -> AsyncIterator[str]:
    async with database_of_its_own(pg_url, "covey_t", template_db) as url:
        yield url


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
    async with served(create_app(puppet)) as url:
        yield f"{url}/v1", puppet


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


@pytest.fixture
def browser() -> Iterator[Any]:
    """A real Chromium (skipped where none is installed), waiting up to 10 s for elements."""
    with chromium() as driver:
        driver.implicitly_wait(10)
        yield driver
