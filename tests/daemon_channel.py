"""A daemon's side of the control channel for tests: a real WebSocket to a real plane, with
the sandbox, session and tasks a wake would have written (no sandbox process started)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import websockets
from websockets.asyncio.client import ClientConnection

from covey.security import new_token, token_hash
from covey.testing.plane import World
from harness.stack.waiting import eventually


@dataclass
class Channel:
    ws: ClientConnection
    agent_id: uuid.UUID
    sandbox_id: uuid.UUID
    task: dict[str, Any]  # the assign_task payload

    async def send(self, kind: str, payload: dict[str, Any]) -> None:
        await self.ws.send(json.dumps({"type": kind, "payload": payload}))

    async def next(self, *kinds: str) -> dict[str, Any]:
        """The next frame of one of these types (leases and the like skipped)."""
        while True:
            message: dict[str, Any] = json.loads(await self.ws.recv())
            if message["type"] in kinds:
                return message


async def hold_a_task(world: World, bodies: tuple[str, ...] = ("hold",)) -> tuple[
        dict[str, str], str, list[uuid.UUID]]:
    """An agent with these tasks open and a sandbox whose token is known, as a wake writes
    them (no process started): a daemon that connects with it takes up the first task."""
    agent = await world.agent()
    agent_id = uuid.UUID(agent["id"])
    token, sandbox_id = new_token("cvd"), uuid.uuid4()
    tasks = [uuid.uuid4() for _ in bodies]
    # The live session first: open work with none would be woken by the scheduler, whose
    # session would then take the one live place.
    await world.db.execute(
        "INSERT INTO sandboxes (id, agent_id, backend, daemon_token_hash, token_expires_at)"
        " VALUES ($1, $2, 'process', $3, now() + interval '1 minute')",
        sandbox_id, agent_id, token_hash(token))
    await world.db.execute(
        "INSERT INTO sessions (id, agent_id, sandbox_id, node) VALUES ($1, $2, $3, 'test')",
        uuid.uuid4(), agent_id, sandbox_id)
    for priority, (task_id, body) in enumerate(zip(tasks, bodies, strict=True)):
        await world.db.execute(
            "INSERT INTO backlog_tasks (id, org_id, agent_id, title, body, origin, priority)"
            " VALUES ($1, $2, $3, 't', $4, 'api', $5)", task_id, world.org.id, agent_id, body,
            -priority)
    return {"agent_id": str(agent_id), "sandbox_id": str(sandbox_id)}, token, tasks


@asynccontextmanager
async def daemon_channel(world: World, bodies: tuple[str, ...] = ("hold",)
                         ) -> AsyncIterator[Channel]:
    ids, token, _ = await hold_a_task(world, bodies)
    async with websockets.connect(world.plane.ws_url, max_size=None,
                                  additional_headers={"Authorization": f"Bearer {token}"}
                                  ) as ws:
        await ws.send(json.dumps({"type": "ready", "payload": ids}))
        channel = Channel(ws, uuid.UUID(ids["agent_id"]), uuid.UUID(ids["sandbox_id"]), {})
        channel.task = (await channel.next("assign_task"))["payload"]
        yield channel


def as_json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


async def session_settled(world: World, sandbox_id: uuid.UUID) -> None:
    """The channel has ended: its session must not stay live (it did, until the sweep)."""
    async def settled() -> bool:
        state = await world.db.fetchval("SELECT state FROM sessions WHERE sandbox_id=$1",
                                        sandbox_id)
        return state not in ("starting", "running")
    await eventually(settled, 5, "a session stayed live after its daemon's channel ended")
