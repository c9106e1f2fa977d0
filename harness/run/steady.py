"""The steady-state hypothesis, checked before a game day starts (Chaos Toolkit's): the
control plane answers, the organisation's fleet is not stopped, and the puppet model is
reachable from the deployment (a probe agent's model request reaches it).

A game day that starts when one of these does not hold proves nothing and, worse, used to
wait two minutes for agents that could never work and then blame them ("no steady state:
agents not working") while an earlier game day's emergency stop still stood. So each probe
that fails says what it saw and how to fix it, and the game day does not start.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

import httpx

from harness.act.client import ApiFailure, CoveyClient, json_of
from harness.act.upstream import QUICK_BODY, MockDirectives
from harness.stack.isolation import agent_slug, organisation_for
from harness.stack.waiting import eventually

if TYPE_CHECKING:
    from harness.record.gameday import GameDay

PROBE_DEADLINE_S = 60.0


@dataclass(frozen=True)
class Probe:
    name: str
    holds: bool
    seen: str
    fix: str | None = None
    took_s: float = 0.0


class SteadyStateNotMet(Exception):
    def __init__(self, probe: Probe) -> None:
        super().__init__(f"the game day did not start: {probe.seen}"
                         + (f": {probe.fix}" if probe.fix else "")
                         + f" (steady-state hypothesis: {probe.name})")
        self.probe = probe


def standing_stop(fleet: dict[str, Any]) -> str:
    """"the fleet stop pulled at 14:08:27 UTC (2026-12-01) by security@acme.test" from the
    fleet read; the deployment may not say who (an older covey)."""
    at = fleet.get("fleet_killed_at")
    when = ""
    if at:
        moment = datetime.fromisoformat(str(at))
        when = f" at {moment:%H:%M:%S} UTC ({moment:%Y-%m-%d})"
    by = fleet.get("fleet_killed_by")
    who = f" by {by}" if by else " by someone the deployment does not name"
    return f"the fleet stop pulled{when}{who}"


async def control_plane_answers(url: str) -> Probe:
    started = time.monotonic()
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.get(f"{url}/healthz")
        ok = r.status_code == 200
        seen = f"GET {url}/healthz answered {r.status_code} {r.text[:200]}"
    except httpx.HTTPError as exc:
        ok, seen = False, f"GET {url}/healthz failed: {exc!r}"
    return Probe("the control plane answers", ok, seen,
                 None if ok else f"start the control plane at {url} (or fix --target-url)",
                 time.monotonic() - started)


async def fleet_not_stopped(admin: CoveyClient, organisation: str) -> Probe:
    started = time.monotonic()
    fleet = json_of(await admin.fleet())
    if fleet.get("global_stop"):  # an older covey does not say
        return Probe("the fleet is not stopped", False,
                     f"a platform admin's global kill flag stops every organisation on this "
                     f"control plane, {organisation} too",
                     "a platform admin clears it (POST /api/v1/flags/global/clear with a "
                     "reason) once it is safe", time.monotonic() - started)
    if not fleet["fleet_killed"]:
        return Probe("the fleet is not stopped", True,
                     f"the fleet of {organisation} is running", None,
                     time.monotonic() - started)
    return Probe("the fleet is not stopped", False,
                 f"{standing_stop(fleet)} still stands in {organisation}",
                 "resume it (POST /api/v1/fleet/resume as an org admin or security) or use a "
                 "fresh organisation (--target-platform-email/--target-platform-password)",
                 time.monotonic() - started)


async def puppet_reachable(day: GameDay) -> Probe:
    """A probe agent of the game day's own works one task; its first model request must reach
    the puppet. It is then stopped with its own switch (a fleet kill later does not count
    it, and no resume wakes it) and rolled back with the game day's agents."""
    started = time.monotonic()
    admin = day.people["org_admin"]
    probe: dict[str, Any] = json_of(await admin.create_agent(
        agent_slug(day.run_id, 0, "probe"), "steady-state probe", max_turns=5), 201)
    day.probe_agents.append(probe["id"])
    await day.endpoints.puppet.assign(probe["id"], "well_behaved")
    json_of(await admin.create_task(probe["id"], "steady-state probe: answer the puppet"), 201)

    async def answered() -> str | None:
        """"heard" once the puppet has a request; "ended" once a session of the probe ended
        without one (its model was not reached there: no need to wait for the deadline)."""
        if await day.endpoints.puppet.actions(probe["id"]):
            return "heard"
        sessions = json_of(await admin.sessions(probe["id"]))
        if any(s["state"] not in ("starting", "running") for s in sessions):
            return None if await day.endpoints.puppet.actions(probe["id"]) else "ended"
        return None
    try:
        result = await eventually(answered, PROBE_DEADLINE_S, "the probe never answered",
                                  interval=0.1)
    except AssertionError:
        result = "silent"
    ok = result == "heard"
    if ok:
        seen = (f"the probe agent's model request reached the puppet at "
                f"{day.endpoints.puppet_url}")
    else:
        sessions = json_of(await admin.sessions(probe["id"]))
        ended = [f"{s['state']} ({s['stop_reason'] or 'no reason given'})" for s in sessions]
        seen = (f"no model request of the probe agent reached the puppet at "
                f"{day.endpoints.puppet_url}"
                + (f" within {PROBE_DEADLINE_S:g} s" if result == "silent" else "")
                + "; its sessions: " + (", ".join(ended) or "none started"))
    json_of(await admin.kill_agent(probe["id"]))
    if ok:
        fix = None
    elif day.stack == "target":
        fix = (f"start the deployment with COVEY_MODEL_URL={day.endpoints.puppet_url} (the "
               "harness serves the puppet there, --puppet-port) and make sure its sandboxes "
               "can reach it")
    else:
        fix = ("the stack's own sandboxes could not reach its puppet: see the control plane's "
               "log in the report directory")
    return Probe("the puppet model is reachable from the deployment", ok, seen, fix,
                 time.monotonic() - started)


def _require(day: GameDay, probe: Probe) -> None:
    """Record the probe in the journal; a probe that does not hold stops the game day."""
    day.journal_sections.setdefault("steady_state_hypothesis", []).append(asdict(probe))
    if not probe.holds:
        raise SteadyStateNotMet(probe)


async def fleet_holds(day: GameDay) -> None:
    """Before anyone is enlisted, so that a refused game day leaves nothing behind."""
    assert day.organisation is not None, "the game day has no organisation yet"
    admin = await day.sign_in(day.organisation.admin_email, day.organisation.admin_password)
    try:
        _require(day, await fleet_not_stopped(admin, day.organisation.name))
    finally:
        await admin.aclose()


async def sandbox_runs(day: GameDay) -> Probe:
    """Upstream covey's agents run its mock engine, which asks no model: the probe is that
    a probe agent's task ends done, in a sandbox of the deployment's."""
    started = time.monotonic()
    admin = day.people["org_admin"]
    probe: dict[str, Any] = json_of(await admin.create_agent(
        agent_slug(day.run_id, 0, "probe"), "steady-state probe"), 201)
    day.probe_agents.append(probe["id"])
    json_of(await admin.create_task(probe["id"], "steady-state probe", QUICK_BODY), 201)

    async def done() -> bool:
        return any(t["state"] == "done" for t in json_of(await admin.backlog(probe["id"])))
    try:
        await eventually(done, PROBE_DEADLINE_S, "the probe's task never ended done",
                         interval=0.2)
        ok, seen = True, "the probe agent's task ended done in a sandbox of the deployment"
    except AssertionError:
        states = [t["state"] for t in json_of(await admin.backlog(probe["id"]))]
        boxes = json_of(await admin.sandboxes(probe["id"]))
        ok, seen = False, (f"the probe agent's task was still {', '.join(states)} after "
                           f"{PROBE_DEADLINE_S:g} s; its sandbox containers: "
                           + (", ".join(f"{b['id']} {b['state']} exit {b['exit_code']}"
                                        for b in boxes) or "none started"))
    json_of(await admin.kill_agent(probe["id"]))
    return Probe("a sandbox of the deployment works a task", ok, seen,
                 None if ok else "see the deployment's log: its sandboxes do not run (its "
                 "sandbox image, the Docker engine, the relay to host.docker.internal)",
                 time.monotonic() - started)


async def puppet_holds(day: GameDay) -> None:
    """Once the game day's people exist: a probe agent reaches the puppet (or, where the
    agents ask no model, works a task)."""
    if isinstance(day.endpoints.puppet, MockDirectives):
        _require(day, await sandbox_runs(day))
    else:
        _require(day, await puppet_reachable(day))


async def prepare(day: GameDay) -> None:
    """Before a game day: the control plane answers; then its organisation (see
    harness/stack/isolation.py), whose fleet must be running; its people; the puppet reachable. A
    game day the hypothesis refuses writes a journal saying which probe failed (status
    `not_started`) and does not start."""
    try:
        await _prepare(day)
    except (ApiFailure, httpx.HTTPError, KeyError, ValueError) as exc:
        # The deployment answered something the harness did not expect (another dialect,
        # another version): say which request and what was expected, not `aborted`.
        failed = SteadyStateNotMet(Probe(
            "the deployment answers as its dialect does", False,
            f"{day.preparing} failed: {unexpected(exc)}",
            f"check that the deployment speaks the {day.dialect_name} dialect "
            f"(--dialect) and that the credentials are an org admin's"))
        day.journal_sections.setdefault("steady_state_hypothesis", []).append(
            asdict(failed.probe))
        day.journal("not_started", [], [], {})
        raise failed from exc
    except SteadyStateNotMet:
        day.journal("not_started", [], [], {})
        raise


def unexpected(exc: BaseException) -> str:
    """An unexpected answer in words: the request and what came back (ApiFailure says it
    already), or which field of an answer was missing."""
    if isinstance(exc, KeyError):
        return f"an answer lacked the field {exc.args[0]!r} the harness reads"
    return str(exc) or repr(exc)


async def _prepare(day: GameDay) -> None:
    e = day.endpoints
    day.preparing = "GET /healthz"
    _require(day, await control_plane_answers(e.url))
    day.preparing = ("finding the game day's organisation (sign-in, GET /api/v1/auth/me, or a "
                     "platform admin's new organisation)")
    organisation = await organisation_for(
        e.url, e.admin_email, e.admin_password, e.platform_email, e.platform_password,
        day.name, day.seed, day.run_id, day.dialect_name)
    day.organisation = organisation
    day.endpoints = replace(e, admin_email=organisation.admin_email,
                            admin_password=organisation.admin_password)
    day.journal_sections["isolation"] = organisation.to_json()
    if organisation.warning:
        day.notes.append(f"this game day {organisation.warning}")
        print(f"WARNING: game day {day.name} {organisation.warning}")
    day.preparing = "reading the fleet switch (GET /api/v1/fleet)"
    await fleet_holds(day)
    day.preparing = "enlisting the game day's people (adding members, signing them in)"
    await day.enlist()
    day.preparing = "the probe agent (creating it, its task, reading its work)"
    await puppet_holds(day)
