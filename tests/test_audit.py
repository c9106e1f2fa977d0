"""GET /api/v1/audit: who may read it, that it holds its organisation's entries only, its
filters and pages; and every switch and flag change on the server's log with who and why."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from covey.testing.plane import World, platform_admin_client


@pytest.mark.parametrize(("role", "allowed"), [
    ("org_admin", True), ("security", True), ("auditor", True),
    ("agent_owner", False), ("controlling", False),
])
async def test_who_may_read_the_audit_log(world: World, role: str, allowed: bool) -> None:
    await world.security.post("/api/v1/fleet/kill", json={"reason": "drill"})
    r = await world.org.clients[role].get("/api/v1/audit")
    if allowed:
        assert r.status_code == 200, r.text
        assert [e["action"] for e in r.json()] == ["fleet.kill"], r.json()
    else:
        assert r.status_code == 403, r.text
        assert "org_admin, security, auditor" in r.json()["hint"]


async def test_a_platform_admin_and_a_stranger_may_not(world: World) -> None:
    assert (await world.anonymous.get("/api/v1/audit")).status_code == 401
    platform = await platform_admin_client(world)
    try:
        assert (await platform.get("/api/v1/audit")).status_code == 403
    finally:
        await platform.aclose()


async def test_the_log_says_who_did_what_and_why(world: World) -> None:
    agent = await world.agent()
    await world.security.post(f"/api/v1/agents/{agent['id']}/kill",
                              json={"reason": "it deleted the staging bucket"})
    await world.org_admin.post(f"/api/v1/agents/{agent['id']}/resume",
                               json={"reason": "bucket restored"})
    await world.security.post("/api/v1/flags/tool", json={
        "tool": "shell", "agent_id": agent["id"], "reason": "no shell until reviewed"})
    entries = (await world.auditor.get("/api/v1/audit")).json()
    got = [(e["action"], e["actor_email"], e["detail"].get("reason"), e["agent_id"])
           for e in entries]
    assert got == [
        ("flag.tool.set", "security@acme.test", "no shell until reviewed", agent["id"]),
        ("agent.resume", "org_admin@acme.test", "bucket restored", agent["id"]),
        ("agent.kill", "security@acme.test", "it deleted the staging bucket", agent["id"]),
        ("agent.create", "org_admin@acme.test", None, agent["id"]),
    ], got


async def test_another_organisation_s_entries_are_not_shown(world: World) -> None:
    theirs = world.other.clients["org_admin"]
    their_agent = (await theirs.post("/api/v1/agents", json={
        "slug": "theirs", "display_name": "Theirs"})).json()
    await theirs.post("/api/v1/fleet/kill", json={"reason": "their drill"})
    await theirs.post(f"/api/v1/agents/{their_agent['id']}/kill")
    ours = await world.org_admin.get("/api/v1/audit")
    assert ours.status_code == 200 and ours.json() == [], ours.text
    # Asking for their agent by id: it does not exist, as far as we can tell.
    r = await world.org_admin.get("/api/v1/audit", params={"agent_id": their_agent["id"]})
    assert r.status_code == 404 and r.json()["error"] == "No such agent", r.text
    # They see theirs.
    assert {e["action"] for e in (await theirs.get("/api/v1/audit")).json()} == {
        "agent.create", "fleet.kill", "agent.kill"}


async def test_filters_and_pages(world: World) -> None:
    first, second = await world.agent(), await world.agent()
    for agent in (first, second):
        await world.security.post(f"/api/v1/agents/{agent['id']}/kill")
    await world.security.post("/api/v1/fleet/kill")
    await world.security.post("/api/v1/fleet/resume")
    read = world.auditor

    async def actions(**params: str | int) -> list[str]:
        r = await read.get("/api/v1/audit", params=params)
        assert r.status_code == 200, r.text
        return [e["action"] for e in r.json()]

    assert await actions(kind="fleet") == ["fleet.resume", "fleet.kill"]
    assert await actions(kind="fleet.kill") == ["fleet.kill"]
    assert await actions(kind="flee") == []  # a family is whole words
    assert await actions(agent_id=first["id"]) == ["agent.kill", "agent.create"]
    assert await actions(agent_id=first["id"], kind="agent.kill") == ["agent.kill"]
    now = datetime.now(UTC)
    assert await actions(since=(now + timedelta(minutes=1)).isoformat()) == []
    assert await actions(until=(now - timedelta(minutes=1)).isoformat()) == []
    assert len(await actions(since=(now - timedelta(minutes=1)).isoformat())) == 6
    # Pages, newest first, with no entry twice or missed.
    everything = (await read.get("/api/v1/audit")).json()
    paged: list[int] = []
    before: int | None = None
    while True:
        params = {"limit": 4} | ({"before": before} if before else {})
        page = (await read.get("/api/v1/audit", params=params)).json()
        if not page:
            break
        paged += [e["id"] for e in page]
        before = page[-1]["id"]
    assert paged == [e["id"] for e in everything] and len(paged) == 6
    for bad in ({"limit": 0}, {"limit": 1001}, {"kind": "x%"}, {"agent_id": "nope"},
                {"since": "yesterday"}, {"until": "0.5"}, {"since": "1700000000"},
                {"before": 0}):
        r = await read.get("/api/v1/audit", params=bad)
        assert r.status_code == 422, (bad, r.text)
    r = await read.get("/api/v1/audit", params={"agent_id": str(uuid.uuid4())})
    assert r.status_code == 404, r.text


async def test_switches_and_flags_are_on_the_server_s_log(world: World,
                                                         capfd: pytest.CaptureFixture[str]
                                                         ) -> None:
    agent = await world.agent()
    capfd.readouterr()
    await world.security.post("/api/v1/fleet/kill", json={"reason": "drill 7"})
    await world.security.post("/api/v1/fleet/resume", json={"reason": "drill 7 over"})
    await world.org_admin.post(f"/api/v1/agents/{agent['id']}/kill", json={"reason": "loops"})
    await world.security.post("/api/v1/flags/tool", json={"tool": "shell",
                                                           "reason": "no shell today"})
    out = capfd.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if "audit" in line]
    for action, who, why in (("fleet.kill", "security@acme.test", "drill 7"),
                             ("fleet.resume", "security@acme.test", "drill 7 over"),
                             ("agent.kill", "org_admin@acme.test", "loops"),
                             ("flag.tool.set", "security@acme.test", "no shell today")):
        assert any(action in line and who in line and why in line and "info" in line.lower()
                   for line in lines), (action, lines)
