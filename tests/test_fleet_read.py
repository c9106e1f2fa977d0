"""The fleet read says who pulled a standing stop and when: a game day (or an on-call
engineer) that finds the fleet stopped must know whose stop it is before releasing it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from covey.testing.plane import World


async def test_the_fleet_read_names_who_pulled_the_standing_stop(world: World) -> None:
    r = await world.auditor.get("/api/v1/fleet")
    assert r.status_code == 200, r.text
    assert (r.json()["fleet_killed"], r.json()["fleet_killed_by"]) == (False, None)

    assert (await world.security.post("/api/v1/fleet/kill")).status_code == 200
    # A second pull by someone else does not take the stop over: it stays the first one's.
    assert (await world.org_admin.post("/api/v1/fleet/kill")).status_code == 200
    fleet = (await world.auditor.get("/api/v1/fleet")).json()
    assert fleet["fleet_killed"] is True
    assert fleet["fleet_killed_by"] == "security@acme.test", fleet
    pulled_at = datetime.fromisoformat(fleet["fleet_killed_at"])
    assert abs(datetime.now(UTC) - pulled_at) < timedelta(minutes=5), pulled_at
    # Another organisation's stop is not this one's business.
    other = (await world.other.clients["security"].get("/api/v1/fleet")).json()
    assert (other["fleet_killed"], other["fleet_killed_by"]) == (False, None)

    assert (await world.security.post("/api/v1/fleet/resume")).status_code == 200
    fleet = (await world.auditor.get("/api/v1/fleet")).json()
    assert (fleet["fleet_killed"], fleet["fleet_killed_at"], fleet["fleet_killed_by"]) == \
        (False, None, None)
