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
from urllib.parse import parse_qs, parse_qsl, urlencode, urlsplit, urlunsplit

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


def link_of(url: str) -> str:
    """Where a client of `url` connects, as a fault proxy's target takes it: HOST:PORT, or
    unix:PATH for a server on a Unix socket (an embedded one listens on nothing else)."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    host = query.get("host", [parts.hostname or "127.0.0.1"])[0]
    port = int(query.get("port", [parts.port or 5432])[0])
    return f"unix:{host}/.s.PGSQL.{port}" if host.startswith("/") else f"{host}:{port}"


def through(url: str, port: int) -> str:
    """The same database, user and password reached through 127.0.0.1:`port` (a fault
    proxy in front of `link_of(url)`): a replica whose link to it the nemesis can cut."""
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query) if k not in ("host", "port")]
    credentials = parts.netloc.rpartition("@")[0]
    netloc = f"{credentials}@127.0.0.1:{port}" if credentials else f"127.0.0.1:{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, urlencode(query), ""))
