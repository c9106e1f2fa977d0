"""covey refuses a database it cannot work with, at start, in words. Its encoding: a
SQL_ASCII database once took every migration and then failed a daemon's handler at the first
U+FFFD (a model's NUL, cleaned) written into a jsonb column, six times, and its task. Its
default isolation, which the kill's flag needs to be READ COMMITTED."""

from __future__ import annotations

import uuid

import asyncpg
import pytest

from covey.config import ConfigError
from covey.db import migrate
from harness.stack.postgres import drop_database, with_database


async def test_a_sql_ascii_database_is_refused_before_any_migration(pg_url: str) -> None:
    name = f"covey_ascii_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute(f"CREATE DATABASE \"{name}\" ENCODING 'SQL_ASCII' "
                           "LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0")
    finally:
        await conn.close()
    url = with_database(pg_url, name)
    try:
        with pytest.raises(ConfigError, match=r"encoding is SQL_ASCII, not UTF8.*initdb -E UTF8"):
            await migrate(url)
        conn = await asyncpg.connect(url)
        try:
            tables = await conn.fetchval(
                "SELECT count(*) FROM pg_tables WHERE schemaname='public'")
        finally:
            await conn.close()
        assert tables == 0, f"{tables} tables were created in a database covey refused"
    finally:
        await drop_database(pg_url, name)


async def test_a_database_not_in_read_committed_is_refused_before_any_migration(
        pg_url: str) -> None:
    """The kill's flag reads the live sessions on a snapshot taken once its locks are held
    (migration 0023), which REPEATABLE READ would take before them."""
    name = f"covey_rr_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
        await conn.execute(
            f"ALTER DATABASE \"{name}\" SET default_transaction_isolation TO 'repeatable read'")
    finally:
        await conn.close()
    url = with_database(pg_url, name)
    try:
        with pytest.raises(ConfigError, match=r"'repeatable read'.*needs 'read committed'"):
            await migrate(url)
    finally:
        await drop_database(pg_url, name)
