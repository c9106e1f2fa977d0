"""A caller remembered between requests (covey/credentials.py) is forgotten as soon as any
change to it is announced, at once on the replica that made it, and nothing is remembered
while announcements cannot be heard. The callers who may pull a switch are remembered ahead
of their first request. Real control plane and Postgres for the first part; the last tests
are units of the cache itself."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import asyncpg
import httpx
import pytest

from covey.credentials import (
    SWITCH_CALLERS_EVERY_S,
    Credentials,
    Principal,
    keep_switch_callers,
)
from covey.security import token_hash
from covey.testing.plane import World
from harness.stack.waiting import eventually

PASSWORD = "correct horse battery"  # covey.testing.plane's humans
# The trigger's announcement travels through Postgres to the listening connection: well
# under this, even on a loaded host.
ANNOUNCED_S = 5.0


def remembered(world: World, credential: str) -> Principal | None:
    credentials: Credentials = world.plane.app.state.credentials
    return credentials.get(token_hash(credential))


async def test_a_caller_is_looked_up_once_and_then_remembered(world: World) -> None:
    token = world.security.headers["authorization"].split(" ", 1)[1]
    assert (await world.security.get("/api/v1/auth/me")).status_code == 200
    who = remembered(world, token)
    assert who is not None and who.role == "security", (
        "the caller of a request was not remembered: every request still looks it up")


def token_of(client: httpx.AsyncClient) -> str:
    return str(client.headers["authorization"]).split(" ", 1)[1]


async def test_a_switch_caller_is_remembered_before_its_first_request(world: World) -> None:
    """A kill from an API token that has asked for nothing lately (an operator who opens a
    shell to pull the switch) finds its caller remembered: the plane reads the tokens of
    those who may pull a switch every few seconds. Not the others': an auditor's is read at
    its request. Neither token of this world has been used."""
    security, auditor = token_of(world.security), token_of(world.auditor)

    async def security_remembered() -> bool:
        return remembered(world, security) is not None
    await eventually(security_remembered, 3 * SWITCH_CALLERS_EVERY_S,
                     "a security officer's token was not remembered before its first request")
    assert remembered(world, security) == Principal(
        world.org.humans["security"], world.org.id, "security@acme.test", "security"), (
        "the caller remembered ahead is not the one a request would look up")
    assert remembered(world, auditor) is None, "an auditor's token was read ahead: it may not kill"


async def test_the_switch_callers_read_across_an_announcement_are_not_remembered(
        world: World) -> None:
    """One pass of `keep_switch_callers` on the real database: the API tokens of the roles
    asked for, not the others; and nothing when a change was announced during its read."""
    credentials = Credentials()
    credentials.listening(True)
    read = await keep_switch_callers(world.db, credentials, ("security", "agent_owner"))
    assert read >= 2, f"only {read} switch callers read"  # this world's two, and others'
    kept = {role: credentials.get(token_hash(token_of(world.org.clients[role])))
            for role in ("security", "agent_owner", "auditor", "org_admin")}
    assert {r for r, who in kept.items() if who is not None} == {"security", "agent_owner"}, kept

    class AnnouncedMeanwhile:  # the real database, and an announcement during the read
        @contextlib.asynccontextmanager
        async def acquire(self, timeout: float | None = None
                          ) -> AsyncIterator[AnnouncedMeanwhile]:
            yield self

        async def fetch(self, query: str, *args: object, timeout: float | None = None
                        ) -> list[asyncpg.Record]:
            rows = await world.db.fetch(query, *args, timeout=timeout)
            fresh.announced(None)
            return rows
    fresh = Credentials()
    fresh.listening(True)
    await keep_switch_callers(AnnouncedMeanwhile(), fresh, ("security",))  # type: ignore[arg-type]
    assert fresh.get(token_hash(token_of(world.security))) is None, (
        "a caller read across an announcement was remembered")


async def test_a_logout_is_refused_from_the_next_request_on(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not once the trigger's announcement comes back through Postgres: at once, on the
    replica that logged out. The announcement is not heard here, so that only the logout's
    own forgetting can pass this (the announcement usually came back within the logout's
    round trip anyway)."""
    credentials: Credentials = world.plane.app.state.credentials
    monkeypatch.setattr(credentials, "announced", lambda human_id: None)
    async with httpx.AsyncClient(base_url=world.plane.url, timeout=30) as browser:
        r = await browser.post("/api/v1/auth/login",
                               json={"email": "security@acme.test", "password": PASSWORD})
        assert r.status_code == 200, r.text
        session = next(iter(browser.cookies.values()))
        bearer = {"Authorization": f"Bearer {session}"}
        assert (await browser.get("/api/v1/auth/me", headers=bearer)).status_code == 200
        assert remembered(world, session) is not None
        assert (await browser.post("/api/v1/auth/logout")).status_code == 204
        r = await browser.get("/api/v1/auth/me", headers=bearer)
        assert r.status_code == 401, (
            f"a logged-out session was still served on its own replica: {r.status_code}")
        r = await browser.post("/api/v1/fleet/kill", headers=bearer)
        assert r.status_code == 401, f"a logged-out session pulled the switch: {r.status_code}"


async def test_a_change_written_by_anyone_else_is_seen_once_announced(world: World) -> None:
    """A role changed and a token revoked by another writer (here, SQL on the database, as
    an operator with psql would) reach this replica through the trigger's announcement."""
    assert (await world.security.post("/api/v1/fleet/kill")).status_code == 200
    await world.db.execute("UPDATE humans SET role='auditor' WHERE id=$1",
                           world.org.humans["security"])

    async def demoted() -> bool:
        return (await world.security.post("/api/v1/fleet/kill")).status_code == 403
    await eventually(demoted, ANNOUNCED_S, "a human demoted to auditor could still pull the "
                     "fleet switch: the remembered caller outlived the announcement")

    assert (await world.controlling.get("/api/v1/auth/me")).status_code == 200
    await world.db.execute("DELETE FROM api_tokens WHERE human_id=$1",
                           world.org.humans["controlling"])

    async def revoked() -> bool:
        return (await world.controlling.get("/api/v1/auth/me")).status_code == 401
    await eventually(revoked, ANNOUNCED_S, "a revoked API token was still accepted")


async def test_a_token_rewritten_an_email_changed_or_a_table_emptied_is_announced_too(
        world: World) -> None:
    """What 0013's triggers did not announce (they served the event streams): an UPDATE that
    rewrites a token, a new email (the remembered caller carries it), a TRUNCATE."""
    assert (await world.auditor.get("/api/v1/auth/me")).status_code == 200
    await world.db.execute("UPDATE api_tokens SET token_hash = 'x' || token_hash"
                           " WHERE human_id=$1", world.org.humans["auditor"])

    async def rewritten() -> bool:
        return (await world.auditor.get("/api/v1/auth/me")).status_code == 401
    await eventually(rewritten, ANNOUNCED_S, "a token whose hash was rewritten was accepted")

    assert (await world.security.get("/api/v1/auth/me")).json()["email"] == "security@acme.test"
    await world.db.execute("UPDATE humans SET email='renamed@acme.test' WHERE id=$1",
                           world.org.humans["security"])

    async def renamed() -> bool:
        me = await world.security.get("/api/v1/auth/me")
        return bool(me.json()["email"] == "renamed@acme.test")
    await eventually(renamed, ANNOUNCED_S, "the caller kept the email it had before")

    assert (await world.org_admin.get("/api/v1/auth/me")).status_code == 200
    await world.db.execute("TRUNCATE api_tokens")

    async def emptied() -> bool:
        return (await world.org_admin.get("/api/v1/auth/me")).status_code == 401
    await eventually(emptied, ANNOUNCED_S, "a token was accepted after its table was emptied")


def test_nothing_is_remembered_while_announcements_cannot_be_heard() -> None:
    who = Principal(uuid.uuid4(), uuid.uuid4(), "a@acme.test", "security")
    credentials = Credentials()
    credentials.remember("h", who, None, credentials.epoch)
    assert credentials.get("h") is None, "remembered before the listener was up"
    credentials.listening(True)
    credentials.remember("h", who, None, credentials.epoch)
    assert credentials.get("h") == who
    credentials.listening(False)
    assert credentials.get("h") is None, "remembered callers outlived the lost listener"
    credentials.remember("h", who, None, credentials.epoch)
    assert credentials.get("h") is None, "remembered while the listener was down"


def test_a_caller_read_across_an_announcement_is_not_remembered() -> None:
    """The look-up may have read the row from before the change the announcement is about."""
    who, other = (Principal(uuid.uuid4(), uuid.uuid4(), f"{n}@acme.test", "security")
                  for n in ("a", "b"))
    credentials = Credentials()
    credentials.listening(True)
    credentials.remember("b", other, None, credentials.epoch)
    read_at = credentials.epoch
    credentials.changed(who.human_id)
    credentials.remember("a", who, None, read_at)
    assert credentials.get("a") is None, "a caller read before an announcement was remembered"
    assert credentials.get("b") == other, "an announcement about one human forgot another"
    credentials.changed(other.human_id)
    assert credentials.get("b") is None


@pytest.mark.parametrize("left_s", [0.0, None])
def test_a_caller_is_remembered_no_longer_than_its_session_or_the_ttl(
        left_s: float | None) -> None:
    who = Principal(uuid.uuid4(), uuid.uuid4(), "a@acme.test", "security")
    credentials = Credentials(ttl_s=0.0 if left_s is None else 60.0)
    credentials.listening(True)
    credentials.remember("h", who, left_s, credentials.epoch)
    time.sleep(0.001)
    assert credentials.get("h") is None, "remembered past its session's expiry or the TTL"


def test_past_the_limit_everyone_is_forgotten() -> None:
    credentials = Credentials(limit=2)
    credentials.listening(True)
    people = [Principal(uuid.uuid4(), uuid.uuid4(), f"{n}@acme.test", "auditor")
              for n in range(3)]
    for n, who in enumerate(people):
        credentials.remember(str(n), who, None, credentials.epoch)
    assert [credentials.get(str(n)) for n in range(3)] == [None, None, people[2]]
