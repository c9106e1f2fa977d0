"""Postgres for the tests and the benchmarks: a server that allows CREATE DATABASE (the one
given, else an embedded pgserver in a folder of its own) and databases of their own on it,
made empty or from a template and dropped afterwards.

Migrating is the control plane's business: `covey serve` migrates its database at start-up,
and the tests migrate their template with covey's own `migrate`.
"""

from __future__ import annotations

import asyncio
import tempfile
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg


@asynccontextmanager
async def postgres_server(given: str | None = None,
                          prefix: str = "covey-pg-") -> AsyncIterator[str]:
    """The server's URL: `given` as it is (never started or stopped here), else an embedded
    server started for the block and stopped after it."""
    if given:
        yield given
        return
    import pgserver  # type: ignore[attr-defined,unused-ignore]

    get_server = pgserver.get_server  # type: ignore[attr-defined,unused-ignore]
    with tempfile.TemporaryDirectory(prefix=prefix) as folder:
        server = await asyncio.to_thread(get_server, folder, cleanup_mode="stop")
        try:
            yield str(server.get_uri())
        finally:
            await asyncio.to_thread(server.cleanup)


def with_database(server_url: str, name: str) -> str:
    """The same server's URL, naming another database (the query string kept)."""
    base, _, query = server_url.partition("?")
    return f"{base.rsplit('/', 1)[0]}/{name}" + (f"?{query}" if query else "")


async def create_database(server_url: str, name: str, template: str | None = None) -> str:
    """CREATE DATABASE, from `template` when given; the new database's URL."""
    conn = await asyncpg.connect(server_url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"'
                           + (f' TEMPLATE "{template}"' if template else ""))
    finally:
        await conn.close()
    return with_database(server_url, name)


async def drop_database(server_url: str, name: str) -> None:
    """DROP DATABASE, ending whatever sessions are still connected to it."""
    conn = await asyncpg.connect(server_url)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


@asynccontextmanager
async def database_of_its_own(server_url: str, prefix: str = "covey",
                              template: str | None = None) -> AsyncIterator[str]:
    """A database with a fresh name for the block, dropped after it: its URL."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    url = await create_database(server_url, name, template)
    try:
        yield url
    finally:
        await drop_database(server_url, name)
