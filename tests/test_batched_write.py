"""covey.db.BatchedWrite against a real Postgres: rows that arrive together share a
statement, each writer returns only once its own row is written, and a failed statement
fails every writer of its batch (none is left waiting)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from covey.db import BatchedWrite, create_pool


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await create_pool(database_url, min_size=1, max_size=2)
    await pool.execute("CREATE TABLE marks (id int PRIMARY KEY, mark int)")
    yield pool
    await pool.close()


async def test_concurrent_rows_are_written_in_few_statements(pool: asyncpg.Pool) -> None:
    class Counting:
        """The pool, counting the statements sent through it."""

        statements = 0

        async def execute(self, *args: object) -> str:
            Counting.statements += 1
            return await pool.execute(*args)  # type: ignore[arg-type]

    write = BatchedWrite(Counting(),  # type: ignore[arg-type]
                         "INSERT INTO marks SELECT * FROM unnest($1::int[], $2::int[])")

    async def one(i: int) -> int | None:
        await write.write(i, i * 10)
        # Written by the time write() returns:
        mark: int | None = await pool.fetchval("SELECT mark FROM marks WHERE id=$1", i)
        return mark

    marks = await asyncio.gather(*(one(i) for i in range(300)))
    assert marks == [i * 10 for i in range(300)]
    assert Counting.statements <= 3, (
        f"{Counting.statements} statements for 300 rows arriving together")


async def test_a_failed_batch_fails_each_of_its_writers(pool: asyncpg.Pool) -> None:
    write = BatchedWrite(pool, "INSERT INTO marks SELECT * FROM unnest($1::int[], $2::int[])")
    await write.write(1, 1)
    results = await asyncio.wait_for(asyncio.gather(
        write.write(1, 2), write.write(2, 2), return_exceptions=True), 10)
    assert all(isinstance(r, asyncpg.UniqueViolationError) for r in results), results
    await write.write(3, 3)  # the next batch goes through
    assert await pool.fetchval("SELECT count(*) FROM marks") == 2
