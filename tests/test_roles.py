"""Who may pull which switch, and what another organisation sees (DESIGN §2.2)."""

from __future__ import annotations

import uuid

import pytest

from covey.testing.plane import World


@pytest.mark.parametrize("role", ["org_admin", "security"])
async def test_security_roles_pull_and_release_the_fleet_switch(world: World, role: str) -> None:
    other_agent = (await world.other.clients["org_admin"].post(
        "/api/v1/agents", json={"slug": "theirs", "display_name": "Theirs"})).json()
    client = world.org.clients[role]
    r = await client.post("/api/v1/fleet/kill")
    assert r.status_code == 200, r.text
    assert (await client.get("/api/v1/fleet")).json()["fleet_killed"] is True
    # The other organisation is untouched.
    theirs = world.other.clients["org_admin"]
    assert (await theirs.get("/api/v1/fleet")).json()["fleet_killed"] is False
    got = (await theirs.get(f"/api/v1/agents/{other_agent['id']}")).json()
    assert got["killed"] is False and got["fleet_killed"] is False
    r = await client.post("/api/v1/fleet/resume")
    assert r.status_code == 200, r.text
    assert (await client.get("/api/v1/fleet")).json()["fleet_killed"] is False


@pytest.mark.parametrize("role", ["agent_owner", "auditor", "controlling"])
async def test_other_roles_get_403_on_the_fleet_switch(world: World, role: str) -> None:
    client = world.org.clients[role]
    before = await world.snapshot()
    for path in ("/api/v1/fleet/kill", "/api/v1/fleet/resume"):
        r = await client.post(path)
        assert r.status_code == 403, (path, r.text)
        assert r.json()["error"] == "Your role may not do this"
        assert "org_admin, security" in r.json()["hint"]
    assert await world.snapshot() == before
    # Every role may read the switch's state.
    assert (await client.get("/api/v1/fleet")).status_code == 200


@pytest.mark.parametrize(("role", "allowed"), [
    ("org_admin", True), ("agent_owner", True), ("security", True),
    ("auditor", False), ("controlling", False),
])
async def test_agent_switch_roles(world: World, role: str, allowed: bool) -> None:
    agent = await world.agent()
    client = world.org.clients[role]
    r = await client.post(f"/api/v1/agents/{agent['id']}/kill")
    assert r.status_code == (200 if allowed else 403), r.text
    r = await client.post(f"/api/v1/agents/{agent['id']}/resume")
    assert r.status_code == (200 if allowed else 403), r.text


async def test_another_organisations_agent_is_404_everywhere(world: World) -> None:
    theirs = (await world.other.clients["org_admin"].post(
        "/api/v1/agents", json={"slug": "theirs", "display_name": "Theirs"})).json()
    aid = theirs["id"]
    before = await world.snapshot()
    for method, path in [
        ("GET", f"/api/v1/agents/{aid}"),
        ("GET", f"/api/v1/agents/{aid}/backlog"),
        ("GET", f"/api/v1/agents/{aid}/recording"),
        ("GET", f"/api/v1/agents/{aid}/heartbeats"),
        ("POST", f"/api/v1/agents/{aid}/kill"),
        ("POST", f"/api/v1/agents/{aid}/resume"),
        ("POST", f"/api/v1/agents/{aid}/wake"),
    ]:
        r = await world.org_admin.request(method, path)
        assert r.status_code == 404, (method, path, r.text)
        assert r.json() == {"error": "No such agent", "hint":
                            "Check the agent id; it must belong to your organisation."}
    r = await world.org_admin.post(f"/api/v1/agents/{aid}/tasks", json={"title": "x"})
    assert r.status_code == 404
    assert await world.snapshot() == before
    assert (await world.org_admin.get("/api/v1/agents")).json() == []


async def test_members_and_platform_orgs(world: World) -> None:
    r = await world.org_admin.post("/api/v1/members", json={
        "email": "new@acme.test", "password": "long enough", "role": "security"})
    assert r.status_code == 201, r.text
    login = await world.anonymous.post("/api/v1/auth/login", json={
        "email": "new@acme.test", "password": "long enough"})
    assert login.status_code == 200 and login.json()["role"] == "security"
    # The session cookie works, and this security human may pull the switch.
    assert (await world.anonymous.get("/api/v1/auth/me")).json()["email"] == "new@acme.test"
    assert (await world.anonymous.post("/api/v1/fleet/kill")).status_code == 200
    assert (await world.anonymous.post("/api/v1/auth/logout")).status_code == 204
    assert (await world.anonymous.get("/api/v1/auth/me")).status_code == 401

    for role in ("security", "agent_owner"):
        r = await world.org.clients[role].post("/api/v1/members", json={
            "email": f"x-{role}@acme.test", "password": "long enough", "role": "org_admin"})
        assert r.status_code == 403
    r = await world.org_admin.post("/api/v1/platform/orgs", json={
        "name": "initech", "admin_email": "boss@initech.test", "admin_password": "long enough"})
    assert r.status_code == 403

    platform_id = uuid.uuid4()
    from covey.security import hash_password, new_token, token_hash
    await world.db.execute(
        "INSERT INTO humans (id, org_id, email, password_hash, role)"
        " VALUES ($1, $2, 'root@acme.test', $3, 'platform_admin')",
        platform_id, world.org.id, hash_password("x"))
    token = new_token("cvt")
    await world.db.execute("INSERT INTO api_tokens (token_hash, human_id, name)"
                           " VALUES ($1, $2, 't')", token_hash(token), platform_id)
    headers = {"Authorization": f"Bearer {token}"}
    r = await world.anonymous.post("/api/v1/platform/orgs", headers=headers, json={
        "name": "initech", "admin_email": "boss@initech.test", "admin_password": "long enough"})
    assert r.status_code == 201, r.text
    # A platform admin is not a member of any organisation's fleet.
    assert (await world.anonymous.post("/api/v1/fleet/kill", headers=headers)).status_code == 403
    boss = await world.anonymous.post("/api/v1/auth/login", json={
        "email": "boss@initech.test", "password": "long enough"})
    assert boss.json()["org_id"] == r.json()["id"] and boss.json()["role"] == "org_admin"
