"""Bad input gets a clear 4xx JSON error with a hint, and nothing in the database changes."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest
import websockets

from covey.config import ConfigError, Settings
from covey.testing import SCRIPTED_DAEMON
from covey.testing.plane import World, make_world, platform_admin_client, start_plane


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


NUL = "a\u0000b"


async def test_nul_is_refused_everywhere_with_a_hint(world: World) -> None:
    """Postgres refuses NUL in text: each of these was a 500. Now each is a 422 that names the
    field, and nothing is written."""
    agent = await world.agent()
    aid = agent["id"]
    # Fired just now, so that no scheduler tick changes the database during the test.
    await world.db.execute(
        "INSERT INTO agent_heartbeats (agent_id, name, task_body, every_seconds, last_fired_at)"
        " VALUES ($1, 'hourly', 'x', 3600, now())", uuid.UUID(aid))
    platform = await platform_admin_client(world)
    before = await world.snapshot()
    cases: list[tuple[Any, str, str, Any]] = [
        (world.org_admin, "POST", f"/api/v1/agents/{aid}/tasks", {"title": NUL}),
        (world.org_admin, "POST", f"/api/v1/agents/{aid}/tasks", {"title": "t", "body": NUL}),
        (world.org_admin, "POST", "/api/v1/agents", {"slug": "nul", "display_name": NUL}),
        (world.org_admin, "POST", f"/api/v1/agents/{aid}/heartbeats",
         {"name": "nul", "task_body": NUL, "every_seconds": 3600}),
        (world.org_admin, "POST", "/api/v1/auth/tokens", {"name": NUL}),
        (world.org_admin, "POST", "/api/v1/members",
         {"email": f"{NUL}@acme.test", "password": "long enough", "role": "auditor"}),
        (world.anonymous, "POST", "/api/v1/auth/login",  # no credentials needed
         {"email": f"{NUL}@acme.test", "password": "x"}),
        (world.anonymous, "POST", "/api/v1/auth/login",
         {"email": "org_admin@acme.test", "password": NUL}),
        (platform, "POST", "/api/v1/platform/orgs",
         {"name": NUL, "admin_email": "a@new.test", "admin_password": "long enough"}),
        (world.org_admin, "GET", f"/api/v1/agents/{aid}/backlog?state=open%00", None),
        (world.org_admin, "POST", f"/api/v1/agents/{aid}/heartbeats/hour%00ly/fire", None),
        (world.anonymous, "POST", f"/api/trigger/{agent['trigger_token']}",
         {"title": NUL}),
        (world.anonymous, "POST", f"/api/trigger/x%00{agent['trigger_token']}", None),
    ]
    try:
        for client, method, path, body in cases:
            r = await client.request(method, path, json=body)
            assert r.status_code == 422, (path, body, r.status_code, r.text)
            answer = r.json()
            assert answer["error"] == "Invalid request" and answer["hint"], (path, answer)
            where = answer["details"][0]["where"]
            assert where.startswith(("body", "query", "path")), (path, answer)
        # A free-text field says what is wrong in words.
        r = await world.org_admin.post(f"/api/v1/agents/{aid}/tasks", json={"title": NUL})
        assert "NUL" in r.json()["hint"], r.text
    finally:
        await platform.aclose()
    assert await world.snapshot() == before


async def test_cursor_beyond_64_bits_is_refused(world: World) -> None:
    agent = await world.agent()
    path = f"/api/v1/agents/{agent['id']}/recording"
    r = await world.org_admin.get(path, params={"after": 2**64})
    assert r.status_code == 422 and _is_error(r.json()), r.text
    assert r.json()["details"][0]["where"] == "query.after"
    r = await world.org_admin.get(path, params={"after": 2**53 - 1})
    assert r.status_code == 200 and r.json() == [], r.text
    r = await world.org_admin.post("/api/v1/agents", json={
        "slug": "big", "display_name": "big", "guard": {"max_tool_calls": 2**53 + 1}})
    assert r.status_code == 422, r.text


@pytest.mark.parametrize("fields", [
    {"budget_usd": True},
    {"budget_usd": "1.5"},
    {"max_turns": True},
    {"max_turns": "5"},
    {"guard": {"breaker_cooldown_s": False}},
    {"guard": {"max_tokens": "100"}},
    {"max_turns": 5.5},
])
async def test_numbers_are_numbers(world: World, fields: dict[str, Any]) -> None:
    """true was stored as 1.0 and false as 0; a numeric string was read as its number."""
    before = await world.snapshot()
    r = await world.org_admin.post("/api/v1/agents", json={
        "slug": "strict", "display_name": "strict", **fields})
    assert r.status_code == 422 and _is_error(r.json()), r.text
    assert await world.snapshot() == before


async def test_integral_floats_are_integers(world: World) -> None:
    """JSON has one number type: 20.0 is the integer 20 (JSON Schema agrees)."""
    agent = await world.agent(max_turns=20.0, budget_usd=2)
    assert (agent["max_turns"], agent["budget_usd"]) == (20, 2.0)
    r = await world.org_admin.post(f"/api/v1/agents/{agent['id']}/tasks",
                                   json={"title": "t", "priority": True})
    assert r.status_code == 422, r.text


async def test_405_says_which_methods_are_allowed(world: World) -> None:
    for path, allowed in [("/api/v1/agents", "GET, POST"),
                          ("/api/v1/fleet", "GET"),
                          ("/api/v1/fleet/kill", "POST")]:
        r = await world.org_admin.delete(path)
        assert r.status_code == 405 and _is_error(r.json()), (path, r.text)
        assert r.headers.get("allow") == allowed, (path, r.headers)
        # Every method it names is one the route takes.
        for method in allowed.split(", "):
            r = await world.org_admin.request(method, path)
            assert r.status_code != 405, (method, path, r.status_code)


async def test_heartbeats_have_a_minimum_interval(world: World) -> None:
    agent = await world.agent()
    before = await world.snapshot()
    for every in (1, 59):
        r = await world.org_admin.post(f"/api/v1/agents/{agent['id']}/heartbeats", json={
            "name": "fast", "task_body": "x", "every_seconds": every})
        assert r.status_code == 422 and "every_seconds" in r.json()["hint"], r.text
    r = await world.org_admin.post("/api/v1/agents", json={
        "slug": "fast", "display_name": "fast",
        "heartbeats": [{"name": "fast", "task_body": "x", "every_seconds": 1}]})
    assert r.status_code == 422, r.text
    assert await world.snapshot() == before
    r = await world.org_admin.post(f"/api/v1/agents/{agent['id']}/heartbeats", json={
        "name": "minutely", "task_body": "x", "every_seconds": 60})
    assert r.status_code == 201, r.text
    # Found by the fuzz: two of one name hit the primary key as a 500.
    twice = {"name": "same", "task_body": "x", "every_seconds": 60}
    r = await world.org_admin.post("/api/v1/agents", json={
        "slug": "twice", "display_name": "twice", "heartbeats": [twice, twice]})
    assert r.status_code == 409 and _is_error(r.json()), r.text


def test_the_heartbeat_minimum_is_a_minute_unless_set() -> None:
    assert Settings.from_env({}).heartbeat_min_s == 60
    assert Settings.from_env({"COVEY_HEARTBEAT_MIN_S": "2"}).heartbeat_min_s == 2
    with pytest.raises(ConfigError, match="COVEY_HEARTBEAT_MIN_S"):
        Settings.from_env({"COVEY_HEARTBEAT_MIN_S": "0"})


async def test_a_lowered_heartbeat_minimum_is_the_one_the_api_holds(
        database_url: str, tmp_path: Any) -> None:
    async with start_plane(database_url, tmp_path, SCRIPTED_DAEMON, heartbeat_min_s=2) as p, \
            make_world(p) as world:
        agent = await world.agent()
        path = f"/api/v1/agents/{agent['id']}/heartbeats"
        fast = await world.org_admin.post(path, json={"name": "fast", "task_body": "x",
                                                      "every_seconds": 1})
        ok = await world.org_admin.post(path, json={"name": "ok", "task_body": "x",
                                                    "every_seconds": 2})
        assert fast.status_code == 422 and "at least 2" in fast.json()["hint"], fast.text
        assert ok.status_code == 201, ok.text
        # The document says the same, so that a client generated from it sends what passes.
        schema = (await world.org_admin.get("/openapi.json")).json()
        assert schema["components"]["schemas"]["HeartbeatIn"]["properties"][
            "every_seconds"]["minimum"] == 2


async def test_manual_fires_stop_at_the_bound_of_unfinished_heartbeat_tasks(
        world: World) -> None:
    from covey.orchestrator import MAX_OPEN_HEARTBEAT_TASKS

    agent = await world.agent(heartbeats=[{"name": "poll", "task_body": "hold",
                                           "every_seconds": 3600}])
    fire = f"/api/v1/agents/{agent['id']}/heartbeats/poll/fire"
    # The scheduler may fire it once too (never fired: due at once): fire until refused.
    for _ in range(MAX_OPEN_HEARTBEAT_TASKS + 1):
        r = await world.org_admin.post(fire)
        if r.status_code != 202:
            break
    assert r.status_code == 409, r.text
    assert r.json()["error"] == "Too many unfinished heartbeat tasks", r.text
    unfinished = await world.db.fetchval(
        "SELECT count(*) FROM backlog_tasks WHERE agent_id=$1 AND origin='heartbeat'"
        " AND state IN ('open','in_progress','blocked')", uuid.UUID(agent["id"]))
    assert unfinished == MAX_OPEN_HEARTBEAT_TASKS


async def test_scheduler_heartbeats_are_bounded_and_leave_a_creation_row(
        world: World) -> None:
    from covey.orchestrator import MAX_OPEN_HEARTBEAT_TASKS
    from harness.stack.waiting import eventually

    agent = await world.agent()
    aid = uuid.UUID(agent["id"])
    # Ten unfinished heartbeat tasks already: the due heartbeat below must not add one.
    held = [uuid.uuid4() for _ in range(MAX_OPEN_HEARTBEAT_TASKS)]
    for task_id in held:
        await world.db.execute(
            "INSERT INTO backlog_tasks (id, org_id, agent_id, title, body, origin, state)"
            " VALUES ($1, $2, $3, 'old beat', 'hold', 'heartbeat', 'blocked')",
            task_id, world.org.id, aid)
    r = await world.org_admin.post(f"/api/v1/agents/{agent['id']}/heartbeats", json={
        "name": "due", "task_body": "x", "every_seconds": 60})  # never fired: due at once
    assert r.status_code == 201, r.text

    async def heartbeat_tasks() -> int:
        n: int = await world.db.fetchval(
            "SELECT count(*) FROM backlog_tasks WHERE agent_id=$1 AND origin='heartbeat'", aid)
        return n
    await asyncio.sleep(2)  # several 300 ms ticks: nothing may fire in this window
    assert await heartbeat_tasks() == MAX_OPEN_HEARTBEAT_TASKS, "fired past the bound"

    await world.db.execute("UPDATE backlog_tasks SET state='cancelled' WHERE id=$1", held[0])
    await eventually(lambda: _more(heartbeat_tasks, MAX_OPEN_HEARTBEAT_TASKS), 10,
                     "the due heartbeat never fired once below the bound")
    row = await world.db.fetchrow(
        "SELECT tr.from_state, tr.to_state, tr.note FROM backlog_tasks t"
        " JOIN task_transitions tr ON tr.task_id=t.id"
        " WHERE t.agent_id=$1 AND t.title='heartbeat: due' ORDER BY tr.id LIMIT 1", aid)
    assert row is not None, "the scheduler's heartbeat task has no transitions at all"
    assert (row["from_state"], row["to_state"], row["note"]) == (
        None, "open", "created by heartbeat")


async def _more(count: Any, than: int) -> bool:
    return bool(await count() > than)


async def test_binary_frame_loses_the_daemon_at_once(world: World) -> None:
    """A binary frame crashed the handler; a ready daemon's session then stayed running,
    its task in progress, until the stale sweep 15 s later."""
    from harness.stack.waiting import eventually

    ids, token = await _sandbox_with_token(world)
    aid = uuid.UUID(ids["agent_id"])
    task_id = uuid.uuid4()
    await world.db.execute(
        "INSERT INTO backlog_tasks (id, org_id, agent_id, title, body, origin)"
        " VALUES ($1, $2, $3, 't', 'hold', 'api')", task_id, world.org.id, aid)
    headers = {"Authorization": f"Bearer {token}"}
    async with websockets.connect(world.plane.ws_url, additional_headers=headers) as ws:
        await ws.send(json.dumps({"type": "ready", "payload": ids}))
        while (m := json.loads(await ws.recv()))["type"] != "assign_task":
            pass
        assert m["payload"]["task_id"] == str(task_id)
        await ws.send(b"\x00\x01 not text")
        # The plane renews the ready daemon's lease on its own clock: a renewal may come
        # before the answer (a fast-tier run met one), or between the answer and the close.
        while (answer := json.loads(await ws.recv()))["type"] == "lease":
            pass
        assert answer["type"] == "error", answer
        assert "Binary frames" in answer["payload"]["error"], answer
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while (late := json.loads(await ws.recv()))["type"] == "lease":
                pass
            pytest.fail(f"a frame other than a lease after the error: {late}")
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4400

    async def lost() -> bool:
        state = await world.db.fetchval(
            "SELECT state FROM sessions WHERE sandbox_id=$1", uuid.UUID(ids["sandbox_id"]))
        return bool(state == "lost")
    # Well inside the 15 s daemon timeout: the loss is the protocol error, not the sweep.
    await eventually(lost, 5, "the session of a daemon that broke protocol is still live")
    reason = await world.db.fetchval(
        "SELECT stop_reason FROM sessions WHERE sandbox_id=$1", uuid.UUID(ids["sandbox_id"]))
    assert reason.startswith("protocol error"), reason
    requeued = await world.db.fetchval(
        "SELECT count(*) FROM task_transitions WHERE task_id=$1 AND from_state='in_progress'"
        " AND to_state='open' AND note LIKE 'daemon lost%'", task_id)
    assert requeued == 1, "the task was not requeued by the daemon-loss path"

    # Binary before ready: refused like any other malformed hello.
    _, other_token = await _sandbox_with_token(world)
    async with websockets.connect(world.plane.ws_url, additional_headers={
            "Authorization": f"Bearer {other_token}"}) as ws:
        await ws.send(b"\x00")
        answer = json.loads(await ws.recv())
        assert "Binary frames" in answer["payload"]["error"], answer
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4400


async def test_openapi_document_tells_the_truth(world: World) -> None:
    """The statuses the server answers, in the shape it answers them, with the credentials
    it takes; FastAPI's own document had success codes and a {"detail"} 422 only."""
    doc = (await world.anonymous.get("/openapi.json")).json()
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas
    assert set(schemas["ErrorOut"]["required"]) == {"error", "hint"}
    assert set(doc["components"]["securitySchemes"]) == {"bearer", "session"}
    for path, operations in doc["paths"].items():
        for op in operations.values():
            for code, response in op["responses"].items():
                if code[0] in "45":
                    schema = response["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/ErrorOut"}, (path, code)
    kill = doc["paths"]["/api/v1/fleet/kill"]["post"]
    assert {"200", "401", "403"} <= set(kill["responses"]) and kill["security"]
    create = doc["paths"]["/api/v1/agents/{agent_id}/tasks"]["post"]
    assert {"201", "400", "401", "403", "404", "413", "422"} <= set(create["responses"])
    login = doc["paths"]["/api/v1/auth/login"]["post"]
    assert "401" in login["responses"] and "security" not in login
    task = schemas["TaskIn"]["properties"]
    assert task["body"]["maxLength"] + task["title"]["maxLength"] < 64 * 1024
    assert schemas["HeartbeatIn"]["properties"]["every_seconds"]["minimum"] == 60
    # The task's limits in the document are the ones the server enforces.
    agent = await world.agent()
    r = await world.org_admin.post(f"/api/v1/agents/{agent['id']}/tasks", json={
        "title": "t", "body": "x" * (task["body"]["maxLength"] + 1)})
    assert r.status_code == 422, r.text
    r = await world.org_admin.post(f"/api/v1/agents/{agent['id']}/tasks", json={
        "title": "t" * task["title"]["maxLength"], "body": "x" * task["body"]["maxLength"]})
    assert r.status_code == 201, "the longest task the document allows was refused"


async def test_a_page_form_with_too_many_fields_is_refused_not_a_500(world: World) -> None:
    """No sign-in is needed to post to the page's sign-in form: a flood of fields must be a
    clear refusal, never a server error."""
    before = await world.snapshot()
    form = "&".join(f"f{i}=x" for i in range(30))
    # Every form of the page is read by the same function; the sign-in form is the one that
    # anyone may post to.
    r = await world.anonymous.post("/administration/login", content=form, headers={
        "content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400, (r.status_code, r.text[:200])
    assert r.json()["error"] == "Too many form fields"
    assert await world.snapshot() == before


async def test_a_message_whose_handling_fails_ends_the_channel_at_once(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """Handling a daemon's message failed on the database (an outage): the channel used to
    close only when the daemon next spoke, its session live and its task in progress until
    then, however quiet the daemon. It closes now (4503: the database is away), and the
    session is lost, its work back in the backlog."""
    import asyncpg

    import covey.api.daemon as daemon
    from harness.stack.waiting import eventually

    handle = daemon._handle

    async def outage(orch: Any, link: Any, kind: str, payload: dict[str, Any]) -> None:
        if kind == "event":
            raise asyncpg.PostgresConnectionError("connection to the database was lost")
        await handle(orch, link, kind, payload)
    monkeypatch.setattr(daemon, "_handle", outage)

    ids, token = await _sandbox_with_token(world)
    task_id = uuid.uuid4()
    await world.db.execute(
        "INSERT INTO backlog_tasks (id, org_id, agent_id, title, body, origin)"
        " VALUES ($1, $2, $3, 't', 'hold', 'api')", task_id, world.org.id,
        uuid.UUID(ids["agent_id"]))
    headers = {"Authorization": f"Bearer {token}"}
    async with websockets.connect(world.plane.ws_url, additional_headers=headers) as ws:
        await ws.send(json.dumps({"type": "ready", "payload": ids}))
        while json.loads(await ws.recv())["type"] != "assign_task":
            pass
        await ws.send(json.dumps({"type": "event", "payload": {"kind": "note"}}))
        # The daemon says nothing more; leases may still arrive before the close.
        try:
            async with asyncio.timeout(10):
                while True:
                    await ws.recv()
        except websockets.ConnectionClosed as exc:
            closed = exc
        except TimeoutError:
            pytest.fail("the channel of a daemon whose message met a database outage was "
                        "still open 10 s later: it closed only when the daemon next spoke")
        assert closed.rcvd is not None and closed.rcvd.code == 4503, (
            f"the channel of a daemon whose message met a database outage closed with "
            f"{closed.rcvd}, not 4503")

    async def lost() -> bool:
        return bool(await world.db.fetchval(
            "SELECT state='lost' FROM sessions WHERE sandbox_id=$1",
            uuid.UUID(ids["sandbox_id"])))
    await eventually(lost, 5, "the session of the daemon whose channel closed is still live")
    assert await world.db.fetchval("SELECT state FROM backlog_tasks WHERE id=$1",
                                   task_id) == "open"
