"""The benchmarks' bare HTTP client opens a new connection where the server closed the old
one: a fleet's set-up on a loaded host outlasted uvicorn's keep-alive, and the fleet kill
written on the closed connection read an IncompleteRead (benchmarks.kill_latency at load 56)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from benchmarks.stack import RawHttp
from harness.stack.waiting import eventually

ANSWER = b'HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\n{"ok":true}'


@pytest.fixture
async def closing_server() -> AsyncIterator[tuple[str, list[int]]]:
    """Answers one request per connection, then closes it (as a keep-alive timeout does)."""
    connections: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        await reader.readuntil(b"\r\n\r\n")
        writer.write(ANSWER)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}", connections


async def test_a_request_after_the_server_closed_the_connection_is_answered(
        closing_server: tuple[str, list[int]]) -> None:
    url, connections = closing_server
    async with RawHttp.open(url, "Bearer x") as client:
        assert await client.request("GET", "/") == (200, {"ok": True})

        async def closed() -> bool:
            return client.reader.at_eof()
        await eventually(closed, 5, "the server never closed the connection")
        assert await client.request("POST", "/kill") == (200, {"ok": True}), \
            "the second request, on the closed connection, was not answered"
    assert len(connections) == 2, "the second request did not go through a new connection"


async def test_an_idle_connection_is_replaced_before_the_clock_is_read(
        closing_server: tuple[str, list[int]]) -> None:
    url, connections = closing_server
    async with RawHttp.open(url, "Bearer x") as client:
        first = client.writer
        client.used -= RawHttp.IDLE_S + 1  # as if a set-up had outlasted the keep-alive
        await client.ready()
        assert client.writer is not first, "an idle connection was kept"
        assert await client.request("GET", "/") == (200, {"ok": True})
    assert len(connections) == 2
