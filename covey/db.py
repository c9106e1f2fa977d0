"""Postgres: the pool and migrations (the embedded server is covey.embedded_postgres)."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any, TypeAlias, TypeVar

import asyncpg
import structlog
from asyncpg.pool import PoolConnectionProxy

from covey.config import ConfigError

log = structlog.get_logger(__name__)
T = TypeVar("T")

Pool = asyncpg.Pool
# A pooled connection is a proxy; functions that run SQL take either.
Connection: TypeAlias = "asyncpg.Connection[asyncpg.Record] | PoolConnectionProxy[asyncpg.Record]"


async def _init_connection(conn: Connection) -> None:
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


async def _keep_session(_conn: Connection) -> None:
    """What a connection needs before it goes back to the pool, beyond the rollback of an
    open transaction that asyncpg always does: nothing. No pooled connection LISTENs (the
    listener has its own), sets a session variable or takes a session advisory lock, and
    asyncpg's default reset (`RESET ALL; UNLISTEN *; …`) cost a round trip per release:
    under Locust load a tenth of the control plane's CPU, and a connection held that much
    longer while requests, the kill among them, waited for one. What a connection does
    keep is meant to stay: its prepared statements (asyncpg's) and the plans of the kill's
    flag functions (covey.switches.FlagFunction)."""


class DatabaseUnavailable(Exception):
    """The database could not be reached: a connection to it was refused, timed out, or its
    socket was missing (a server restarting). Raised in place of the OSError that asyncpg
    lets through when it connects, so that only the database's errors are taken for the
    database being away: a file or a daemon's socket failing is a different story, and
    answering it with "Database unreachable" once sent operators looking at a healthy
    Postgres."""


async def _connect(*args: Any, **kwargs: Any) -> asyncpg.Connection[asyncpg.Record]:
    """asyncpg's connect, for the pool, with its OSErrors as DatabaseUnavailable."""
    try:
        conn: asyncpg.Connection[asyncpg.Record] = await asyncpg.connect(*args, **kwargs)
    except OSError as exc:  # TimeoutError too: it is an OSError
        raise DatabaseUnavailable(f"cannot connect to the database: {exc!r}") from exc
    return conn


async def create_pool(url: str, min_size: int = 2, max_size: int = 20) -> Pool:
    pool = await asyncpg.create_pool(
        url, min_size=min_size, max_size=max_size, init=_init_connection,
        reset=_keep_session, connect=_connect,
    )
    if pool is None:  # pragma: no cover - asyncpg returns None only without awaiting
        raise RuntimeError("asyncpg returned no pool")
    return pool


# What a database that is away raises through the pool (refused, restarting, its connection
# cut): the API answers it with a 503, and writes that must survive an outage retry it. A
# connection lost in use is asyncpg's PostgresConnectionError; one that cannot be made is
# DatabaseUnavailable (`_connect`); a server shutting down or starting is
# OperatorInterventionError. Not a bare OSError: that is as likely a file or a socket of ours.
UNREACHABLE: tuple[type[Exception], ...] = (
    DatabaseUnavailable, asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError)
# The one definition of "this agent may run" (agents as a, organisations as o): its own flag,
# its organisation's, and the control plane's global flag. Every wake path, every claim, every
# lease renewal and a restarted plane's settling of its orphans use it; a rule restated per
# query once left a path that ignored a flag.
MAY_RUN = ("NOT a.killed AND NOT o.fleet_killed"
           " AND NOT EXISTS (SELECT 1 FROM kill_flags g WHERE g.scope='global')")

OUTAGE_RETRY_S = (0.2, 0.5, 1.0, 2.0)  # then every 2 s
OUTAGE_GIVE_UP_S = 600.0


async def through_outage(write: Callable[[], Awaitable[T]], what: str) -> T:
    """A write that must not be lost to a database outage (a sandbox's exit seen while the
    database restarts: lost, its row would say `running` for ever). Retried while the
    database is unreachable, for up to OUTAGE_GIVE_UP_S; other errors pass through."""
    deadline = asyncio.get_running_loop().time() + OUTAGE_GIVE_UP_S
    for attempt in itertools.count():
        try:
            return await write()
        except UNREACHABLE as exc:
            if asyncio.get_running_loop().time() > deadline:
                raise
            log.warning("database unreachable; retrying", what=what, error=repr(exc))
            await asyncio.sleep(OUTAGE_RETRY_S[min(attempt, len(OUTAGE_RETRY_S) - 1)])
    raise AssertionError("unreachable")  # pragma: no cover - count() never ends


def _migrations() -> list[tuple[str, str]]:
    folder = resources.files("covey") / "migrations"
    files = sorted((p.name, p) for p in folder.iterdir() if p.name.endswith(".sql"))
    return [(name, p.read_text()) for name, p in files]


async def _unfit(conn: Connection) -> str | None:
    """Why covey cannot work with this database, or None."""
    encoding = await conn.fetchval("SHOW server_encoding")
    if encoding != "UTF8":
        # A SQL_ASCII database (initdb in a C locale) takes a NUL-free ASCII world only: the
        # first U+FFFD that replaced a model's NUL, or any agent's non-English text in a
        # jsonb column, failed the daemon's handler and, six losses later, its task.
        return (f"the database's encoding is {encoding}, not UTF8: covey stores agents' text "
                "in any language. Create it as UTF8 (`initdb -E UTF8`, or `CREATE DATABASE … "
                "ENCODING 'UTF8' TEMPLATE template0`)")
    isolation = await conn.fetchval("SHOW default_transaction_isolation")
    if isolation != "read committed":
        # The switches' flag (covey.switches.FlagFunction) reads the live sessions on a
        # snapshot taken once its locks are held, which only READ COMMITTED gives a statement
        # of a function: under REPEATABLE READ a session a wake committed while a kill
        # waited would go on.
        return (f"the database's default_transaction_isolation is {isolation!r}: covey needs "
                "'read committed' (Postgres's default). ALTER DATABASE … SET "
                "default_transaction_isolation TO 'read committed'")
    return None


async def migrate(url: str) -> list[str]:
    """Apply the migrations not yet recorded, in order, each in its own transaction."""
    conn = await asyncpg.connect(url)
    applied_now: list[str] = []
    if (why := await _unfit(conn)) is not None:
        await conn.close()
        raise ConfigError(why)
    try:
        # One migrator at a time, across replicas starting together.
        await conn.execute("SELECT pg_advisory_lock(7460001)")
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations ("
            " name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {r["name"] for r in await conn.fetch("SELECT name FROM schema_migrations")}
        for name, sql in _migrations():
            if name in done:
                continue
            async with conn.transaction():
                await conn.execute(sql)
                await conn.execute("INSERT INTO schema_migrations (name) VALUES ($1)", name)
            applied_now.append(name)
            log.info("migration applied", migration=name)
    finally:
        await conn.execute("SELECT pg_advisory_unlock(7460001)")
        await conn.close()
    return applied_now


@asynccontextmanager
async def transaction(pool: Pool) -> AsyncIterator[Connection]:
    async with pool.acquire() as conn, conn.transaction():
        yield conn


async def fetch_one(conn: Connection | Pool, sql: str, *args: Any) -> asyncpg.Record:
    """For statements that always return a row (INSERT … RETURNING, aggregates)."""
    row = await conn.fetchrow(sql, *args)
    if row is None:
        raise RuntimeError(f"expected a row from: {sql.strip()[:80]}")
    return row


class BatchedWrite:
    """One statement for all the rows that arrive while the previous statement is in flight
    (group commit). Each writer still waits until its own row is written. The statement
    takes one array per column: a fleet kill's thousand sandbox exits cost a few round trips
    through the pool, not a thousand, and the kill's answer does not queue behind them."""

    MAX_ROWS = 1000

    def __init__(self, pool: Pool, sql: str) -> None:
        self._pool = pool
        self._sql = sql
        self._pending: list[tuple[tuple[Any, ...], asyncio.Future[None]]] = []
        self._flushing: asyncio.Task[None] | None = None

    async def write(self, *row: Any) -> None:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((row, done))
        if self._flushing is None:
            self._flushing = asyncio.ensure_future(self._flush())
        await done

    async def _flush(self) -> None:
        try:
            await asyncio.sleep(0)  # the rows of this turn of the loop join the first batch
            while self._pending:
                batch = self._pending[:self.MAX_ROWS]
                del self._pending[:self.MAX_ROWS]
                columns = [list(column) for column in zip(*(row for row, _ in batch),
                                                          strict=True)]
                try:
                    await self._pool.execute(self._sql, *columns)
                except Exception as exc:
                    for _, done in batch:
                        if not done.done():
                            done.set_exception(exc)
                else:
                    for _, done in batch:
                        if not done.done():
                            done.set_result(None)
        finally:
            self._flushing = None
