"""The event stream ends with its session (covey/events.py): logout, a revoked token, a change
of role and expiry each close an open GET /api/v1/events promptly, with an `end` event; the
streams of others go on."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from covey.testing.plane import World
from harness.stack.waiting import eventually

PASSWORD = "correct horse battery"  # covey.testing.plane's humans
# Well inside the streams' 15 s keep-alive check: an end within it came from the
# announcement, not from the backstop.
PROMPTLY_S = 5.0


class Stream:
    """An open event stream read in the background: its lines, and whether it has ended."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.lines: list[str] = []
        self.connected = asyncio.Event()
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async with self.client.stream("GET", "/api/v1/events") as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                self.lines.append(line)
                if line == ": connected":
                    self.connected.set()

    async def __aenter__(self) -> Stream:
        await asyncio.wait_for(self.connected.wait(), 10)
        return self

    async def __aexit__(self, *_: object) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    async def ended_within(self, seconds: float) -> float:
        started = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(self.task), seconds)
        except TimeoutError:
            raise AssertionError(f"the stream was still open {seconds:g} s after its "
                                 f"session ended; it read {self.lines[-5:]}") from None
        assert "event: end" in self.lines, self.lines
        end = json.loads(self.lines[self.lines.index("event: end") + 1][len("data: "):])
        assert "session" in end["reason"], end
        return time.monotonic() - started

    def statuses(self) -> list[dict[str, str]]:
        return [event for line in self.lines if line.startswith("data: {")
                if "status" in (event := json.loads(line[6:]))]


async def _signed_in(world: World, email: str) -> httpx.AsyncClient:
    client = httpx.AsyncClient(base_url=world.plane.url, timeout=30)
    r = await client.post("/api/v1/auth/login", json={"email": email, "password": PASSWORD})
    assert r.status_code == 200, r.text
    return client


async def test_logout_closes_the_open_stream_and_no_other(world: World) -> None:
    agent = await world.agent()
    client = await _signed_in(world, "auditor@acme.test")
    try:
        async with Stream(client) as mine, Stream(world.security) as theirs:
            assert (await client.post("/api/v1/auth/logout")).status_code == 204
            took = await mine.ended_within(PROMPTLY_S)
            print(f"stream ended {took * 1000:.0f} ms after the logout answered")
            # Another human's stream carries on: it sees the kill that follows.
            await world.org_admin.post(f"/api/v1/agents/{agent['id']}/kill")

            async def killed() -> bool:
                return any(e["status"] == "killed" for e in theirs.statuses())
            await eventually(killed, 10, "another human's stream stopped with the logout")
            assert not theirs.task.done()
            assert not [e for e in mine.statuses() if e["status"] == "killed"]
    finally:
        await client.aclose()


async def test_a_change_of_role_closes_the_stream(world: World) -> None:
    client = await _signed_in(world, "security@acme.test")
    try:
        async with Stream(client) as stream:
            await world.db.execute("UPDATE humans SET role='auditor' WHERE email=$1",
                                   "security@acme.test")
            await stream.ended_within(PROMPTLY_S)
    finally:
        await client.aclose()


async def test_a_revoked_api_token_closes_the_stream(world: World) -> None:
    async with Stream(world.controlling) as stream:
        await world.db.execute("DELETE FROM api_tokens WHERE human_id=$1",
                               world.org.humans["controlling"])
        await stream.ended_within(PROMPTLY_S)


async def test_a_session_s_expiry_closes_the_stream(world: World) -> None:
    client = await _signed_in(world, "auditor@acme.test")
    try:
        # Shortened before the stream opens: nothing is announced after, the stream's own
        # clock ends it.
        await world.db.execute(
            "UPDATE web_sessions SET expires_at = now() + interval '2 seconds'"
            " WHERE human_id=$1", world.org.humans["auditor"])
        async with Stream(client) as stream:
            await stream.ended_within(PROMPTLY_S)
            # And the expired session opens no new one.
            assert (await client.get("/api/v1/events")).status_code == 401
    finally:
        await client.aclose()
