"""The state to alert on, in /metrics: a standing fleet stop per organisation, killed agents by
origin, running sessions; right after a fleet stop and right after its resume."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from covey.testing.plane import World
from harness.stack.waiting import eventually


class Scrape:
    def __init__(self, text: str) -> None:
        self.samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                        for family in text_string_to_metric_families(text)
                        for s in family.samples}

    def value(self, name: str, **labels: str) -> float | None:
        return self.samples.get((name, tuple(sorted(labels.items()))))


async def _scrape(world: World) -> Scrape:
    r = await world.anonymous.get("/metrics")
    assert r.status_code == 200, r.text
    return Scrape(r.text)


async def test_fleet_stop_and_resume_show_in_the_metrics(world: World) -> None:
    ours, theirs = {"org_id": str(world.org.id), "org": "acme"}, \
        {"org_id": str(world.other.id), "org": "globex"}
    working, alone = await world.agent(), await world.agent()
    await world.org_admin.post(f"/api/v1/agents/{alone['id']}/kill")  # stopped on its own
    await world.task(working["id"], "hold")
    await world.wait_working(working["id"])

    before = await _scrape(world)
    assert before.value("covey_state_read_ok") == 1
    assert before.value("covey_fleet_stopped", **ours) == 0
    assert before.value("covey_running_sessions", **ours) == 1
    assert before.value("covey_killed_agents", **ours, origin="agent") == 1
    assert before.value("covey_killed_agents", **ours, origin="fleet") == 0

    assert (await world.security.post("/api/v1/fleet/kill")).status_code == 200
    stopped = await _scrape(world)  # right after: no wait
    assert stopped.value("covey_fleet_stopped", **ours) == 1
    assert stopped.value("covey_fleet_stopped", **theirs) == 0
    assert stopped.value("covey_killed_agents", **ours, origin="fleet") == 1
    assert stopped.value("covey_killed_agents", **ours, origin="agent") == 1
    assert stopped.value("covey_running_sessions", **ours) == 0
    assert stopped.value("covey_global_stop") == 0

    assert (await world.security.post("/api/v1/fleet/resume")).status_code == 200
    resumed = await _scrape(world)
    assert resumed.value("covey_fleet_stopped", **ours) == 0
    assert resumed.value("covey_killed_agents", **ours, origin="fleet") == 0
    # The agent stopped on its own before the fleet stop stays stopped (DESIGN §2.3 line 5).
    assert resumed.value("covey_killed_agents", **ours, origin="agent") == 1

    # Its requeued work woken at once, the agent runs again, and the gauge says so.
    async def running_again() -> bool:
        return (await _scrape(world)).value("covey_running_sessions", **ours) == 1
    await eventually(running_again, 20, "no running session in the metrics after resume")
