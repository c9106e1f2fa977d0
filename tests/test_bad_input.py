"""Bad input gets a clear 4xx JSON error with a hint, and nothing in the database changes."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import websockets

from tests.support.plane import World


def _is_error(body: Any) -> bool:
    return isinstance(body, dict) and bool(body.get("error")) and "hint" in body


@pytest.mark.parametrize(("content", "status", "error"), [
    (b'{"slug": "x", "display_name": ', 400, "Malformed JSON"),
    (b"not json at all", 400, "Malformed JSON"),
    (b'{"slug": 5, "display_name": "x"}', 422, "Invalid request"),
    (b'{"slug": "ok", "display_name": "x", "max_turns": "many"}', 422, "Invalid request"),
    (b'{"slug": "ok", "display_name": "x", "budget_usd": -1}', 422, "Invalid request"),
    (b'{"slug": "ok", "display_name": "x", "surprise": 1}', 422, "Invalid request"),
    (b'{"slug": "Bad Slug!", "display_name": "x"}', 422, "Invalid request"),
    (b"[]", 422, "Invalid request"),
])
async def test_malformed_and_mistyped_bodies(world: World, content: bytes, status: int,
                                             error: str) -> None:
    before = await world.snapshot()
    r = await world.org_admin.post("/api/v1/agents", content=content,
                                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert r.json()["error"] == error and r.json()["hint"]
    assert await world.snapshot() == before


async def test_nan_budget_is_refused(world: World) -> None:
    before = await world.snapshot()
    r = await world.org_admin.post("/api/v1/agents", content=b'{"slug":"n","display_name":"n",'
                                   b'"budget_usd": NaN}',
                                   headers={"content-type": "application/json"})
    assert r.status_code in (400, 422) and _is_error(r.json())
    assert await world.snapshot() == before


async def test_oversized_body_is_413(world: World) -> None:
    agent = await world.agent()
    before = await world.snapshot()
    big = json.dumps({"title": "t", "body": "x" * 200_000})
    r = await world.org_admin.post(f"/api/v1/agents/{agent['id']}/tasks", content=big,
                                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and _is_error(r.json())

    async def chunks():  # no Content-Length: the limit is enforced while streaming
        for _ in range(100):
            yield b"x" * 4096
    r = await world.org_admin.post(f"/api/v1/agents/{agent['id']}/tasks", content=chunks(),
                                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and _is_error(r.json())
    assert await world.snapshot() == before


async def test_unknown_ids_routes_and_credentials(world: World) -> None:
    before = await world.snapshot()
    unknown = uuid.uuid4()
    cases = [
        (world.org_admin, "GET", f"/api/v1/agents/{unknown}", 404),
        (world.org_admin, "POST", f"/api/v1/agents/{unknown}/kill", 404),
        (world.org_admin, "GET", "/api/v1/agents/not-a-uuid", 422),
        (world.org_admin, "GET", "/api/v1/nothing-here", 404),
        (world.org_admin, "DELETE", "/api/v1/fleet", 405),
        (world.anonymous, "POST", "/api/v1/fleet/kill", 401),
        (world.anonymous, "POST", f"/api/trigger/{'x' * 40}", 404),
    ]
    for client, method, path, status in cases:
        r = await client.request(method, path)
        assert r.status_code == status, (method, path, r.text)
        assert _is_error(r.json()), (method, path, r.text)
    r = await world.anonymous.get("/api/v1/fleet", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and _is_error(r.json())
    r = await world.org_admin.post("/api/v1/auth/login", json={
        "email": "org_admin@acme.test", "password": "wrong"})
    assert r.status_code == 401 and _is_error(r.json())
    agent = await world.agent()
    before = await world.snapshot()
    r = await world.org_admin.post(f"/api/v1/agents/{agent['id']}/heartbeats/none/fire")
    assert r.status_code == 404 and _is_error(r.json())
    dup = await world.org_admin.post("/api/v1/agents", json={
        "slug": agent["slug"], "display_name": "again"})
    assert dup.status_code == 409 and _is_error(dup.json())
    assert await world.snapshot() == before


async def _daemon_answer(world: World, token: str | None, ready: dict[str, Any] | str,
                         query: str = "") -> tuple[dict[str, Any], int | None]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with websockets.connect(world.plane.ws_url + query, additional_headers=headers) as ws:
        try:
            await ws.send(ready if isinstance(ready, str) else json.dumps(ready))
        except websockets.ConnectionClosed:
            pass  # refused before it could speak: the answer is already on its way
        answer = json.loads(await ws.recv())
        try:
            await ws.recv()
        except websockets.ConnectionClosed as closed:
            return answer, closed.rcvd.code if closed.rcvd else None
    return answer, None


async def _sandbox_with_token(world: World) -> tuple[dict[str, Any], str]:
    """A sandbox row with a known token, as a wake writes it (no daemon ever uses it)."""
    from covey.security import new_token, token_hash

    agent = await world.agent()
    token = new_token("cvd")
    sandbox_id = uuid.uuid4()
    await world.db.execute(
        "INSERT INTO sandboxes (id, agent_id, backend, daemon_token_hash, token_expires_at)"
        " VALUES ($1, $2, 'process', $3, now() + interval '1 minute')",
        sandbox_id, uuid.UUID(agent["id"]), token_hash(token))
    await world.db.execute(
        "INSERT INTO sessions (id, agent_id, sandbox_id, node) VALUES ($1, $2, $3, 'test')",
        uuid.uuid4(), uuid.UUID(agent["id"]), sandbox_id)
    return {"agent_id": agent["id"], "sandbox_id": str(sandbox_id)}, token


async def test_daemon_tokens_replayed_expired_foreign(world: World) -> None:
    ids, token = await _sandbox_with_token(world)
    other_ids, _ = await _sandbox_with_token(world)
    ready = {"type": "ready", "payload": ids}
    before = await world.snapshot()

    answer, code = await _daemon_answer(world, None, ready)
    assert (answer["payload"]["error"], code) == ("No daemon token", 4401)
    # Not in the URL either, where access logs would keep it.
    answer, code = await _daemon_answer(world, None, ready, query=f"?token={token}")
    assert (answer["payload"]["error"], code) == ("No daemon token", 4401)
    answer, code = await _daemon_answer(world, "cvd_unknown", ready)
    assert (answer["payload"]["error"], code) == ("Unknown daemon token", 4401)
    answer, code = await _daemon_answer(world, token, "{not json")
    assert (answer["payload"]["error"], code) == ("Malformed JSON", 4400)
    # Claiming another agent's sandbox with this token: refused, and the token still works.
    claim = {"type": "ready", "payload": {"agent_id": other_ids["agent_id"],
                                          "sandbox_id": ids["sandbox_id"]}}
    answer, code = await _daemon_answer(world, token, claim)
    assert (answer["payload"]["error"], code) == ("This token belongs to another sandbox", 4403)
    assert await world.snapshot() == before

    headers = {"Authorization": f"Bearer {token}"}
    async with websockets.connect(world.plane.ws_url, additional_headers=headers) as ws:
        await ws.send(json.dumps(ready))
        assert json.loads(await ws.recv())["type"] == "inject_config"
        # A message the protocol does not know gets an error, not a dropped connection.
        await ws.send(json.dumps({"type": "teleport", "payload": {}}))
        while (m := json.loads(await ws.recv()))["type"] != "error":
            pass
        assert "Unknown message type" in m["payload"]["error"]
        # Replaying the token while it is in use: refused.
        answer, code = await _daemon_answer(world, token, ready)
        assert (answer["payload"]["error"], code) == ("Daemon token already used", 4401)

    expired_ids, expired = await _sandbox_with_token(world)
    await world.db.execute("UPDATE sandboxes SET token_expires_at = now() - interval '1 s'"
                           " WHERE id=$1", uuid.UUID(expired_ids["sandbox_id"]))
    answer, code = await _daemon_answer(world, expired, {"type": "ready",
                                                         "payload": expired_ids})
    assert (answer["payload"]["error"], code) == ("Daemon token expired", 4401)


async def test_openapi_document_is_served_and_names_the_switches(world: World) -> None:
    doc = (await world.anonymous.get("/openapi.json")).json()
    for path in ("/api/v1/agents/{agent_id}/kill", "/api/v1/fleet/kill", "/api/v1/fleet/resume",
                 "/api/trigger/{token}", "/api/v1/agents/{agent_id}/heartbeats/{name}/fire"):
        assert path in doc["paths"], path
    assert "409" in doc["paths"]["/api/trigger/{token}"]["post"]["responses"]
