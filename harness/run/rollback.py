"""Leave the deployment as the game day found it (Chaos Toolkit's rollbacks, Jepsen's final
heal), whatever ended the game day: a failed assertion, an exception, Ctrl-C.

A game day that failed once after its fleet kill used to leave the organisation's fleet
switch pulled, and with it every agent of the organisation stopped until someone noticed.
The rollback heals the nemesis's faults, stops every agent of the game day with its own
switch (so that no later fleet resume wakes them), releases the fleet switch if the game day
pulled it and the global kill flag if its platform admin set it, waits until none of its
agents has a sandbox running, and writes what it restored and what it could not into the
journal. What it could not restore is a loud error.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from harness.act.client import ApiFailure, CoveyClient, json_of
from harness.act.dialect import dialect
from harness.nemesis import halt
from harness.run.steady import standing_stop
from harness.stack.waiting import eventually

if TYPE_CHECKING:
    from harness.record.gameday import GameDay

SANDBOXES_GONE_S = 60.0
RUNNING = ("starting", "running")


@dataclass
class RollbackReport:
    restored: list[str] = field(default_factory=list)
    could_not: list[str] = field(default_factory=list)
    # Left as found: not the game day's to undo (a stop someone else pulled).
    left_alone: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.could_not

    def to_json(self) -> dict[str, Any]:
        return {"complete": self.complete, "restored": self.restored,
                "could_not": self.could_not, "left_alone": self.left_alone}


class RollbackFailed(Exception):
    def __init__(self, day: str, report: RollbackReport) -> None:
        super().__init__(
            f"the rollback of game day {day} could not restore everything; left standing: "
            + "; ".join(report.could_not)
            + (f" (restored: {'; '.join(report.restored)})" if report.restored else ""))
        self.report = report


def pulled_fleet_switch(day: GameDay) -> bool:
    """Did one of the game day's people pull the fleet switch (an answered or unknown kill)?"""
    return any(e.f == "kill_fleet" and e.type in ("ok", "info")
               for e in day.history.events)


def set_global_flag(day: GameDay) -> bool:
    """Did the game day's platform admin set the global kill flag (answered or unknown)?"""
    return any(e.f == "stop_globally" and e.type in ("ok", "info")
               for e in day.history.events)


def _admin_of(day: GameDay, agent_id: str, admin: CoveyClient) -> CoveyClient:
    """Who may stop this agent: its organisation's admin (one beside the game day's, or
    the game day's own)."""
    return day.admins_beside.get(str(day.agents.get(agent_id, {}).get("org_id")), admin)


async def _admin(day: GameDay) -> CoveyClient | None:
    client = day.people.get("org_admin")
    if client is not None:
        return client
    if day.organisation is None:
        return None
    return await day.sign_in(day.organisation.admin_email, day.organisation.admin_password)


async def _heal_faults(day: GameDay, report: RollbackReport) -> None:
    nemesis = day.endpoints.nemesis
    for fault in await nemesis.heal_all():
        report.restored.append(f"healed fault {fault.id} ({fault.kind} on {fault.target})")
    await nemesis.refresh()
    healed = nemesis.verify_healed()
    if not healed.healed:
        report.could_not.append(healed.message)


async def _each_agent(day: GameDay, admin: CoveyClient, report: RollbackReport,
                      act: Callable[[CoveyClient, str], Awaitable[httpx.Response]],
                      done: str, failed: str) -> None:
    """One call per agent of the game day (probes first), by whoever may make it; `done` and
    `failed` say what each outcome means ({agent} names the agent, {exc} the failure)."""
    for agent_id in [*day.probe_agents, *day.agents]:
        agent = f"{day.agents.get(agent_id, {}).get('slug', 'probe')} ({agent_id})"
        try:
            json_of(await act(_admin_of(day, agent_id, admin), agent_id))
        except (ApiFailure, httpx.HTTPError) as exc:
            report.could_not.append(failed.format(agent=agent, exc=exc))
        else:
            report.restored.append(done.format(agent=agent))


async def _stop_agents(day: GameDay, admin: CoveyClient, report: RollbackReport) -> None:
    await _each_agent(day, admin, report, lambda who, a: who.kill_agent(a),
                      "stopped agent {agent} with its own switch",
                      "agent {agent} may still run: its kill failed: {exc}")


async def _release_fleet(day: GameDay, admin: CoveyClient, report: RollbackReport) -> None:
    try:
        fleet = json_of(await admin.fleet())
    except (ApiFailure, httpx.HTTPError) as exc:
        if pulled_fleet_switch(day):
            report.could_not.append("the fleet stop this game day pulled may still stand: "
                                    f"the fleet could not be read: {exc!r}")
            return
        raise
    if not fleet["fleet_killed"]:
        return
    emails = set()
    for person in day.people.values():
        emails.add(str(json_of(await person.me())["email"]).lower())
    # Who pulled it, where the deployment says; else whether the game day did. A stop pulled
    # first by someone else stays theirs even if the game day's kill came after (idempotent).
    by = fleet.get("fleet_killed_by")
    ours = str(by).lower() in emails if by else pulled_fleet_switch(day)
    stop = standing_stop(fleet)
    if not ours:
        # Someone else's stop (standing before the game day, which then refused to start, or
        # pulled during it): releasing another person's emergency stop is not ours to do.
        report.left_alone.append(f"{stop} (not by this game day) still stands")
        return
    try:
        json_of(await admin.resume_fleet())
        after = json_of(await admin.fleet())
    except (ApiFailure, httpx.HTTPError) as exc:
        report.could_not.append(f"{stop} still stands: resume failed: {exc}")
        return
    if after["fleet_killed"]:
        report.could_not.append(f"{stop} still stands after a resume")
    else:
        report.restored.append(f"released {stop}")


async def _release_global(day: GameDay, admin: CoveyClient, report: RollbackReport) -> None:
    """A global stop stops every organisation on the control plane: one the game day set
    must not outlive it (every later game day would refuse to start)."""
    if not json_of(await admin.fleet()).get("global_stop"):
        return
    platform = day.people.get("platform_admin")
    if not set_global_flag(day) or platform is None:
        report.left_alone.append("a global kill flag (not set by this game day) still stands")
        return
    try:
        json_of(await platform.clear_global_stop("game day rolled back"))
        cleared = not json_of(await admin.fleet()).get("global_stop")
    except (ApiFailure, httpx.HTTPError) as exc:
        report.could_not.append(f"the global kill flag this game day set still stands: "
                                f"clearing it failed: {exc}")
        return
    if cleared:
        report.restored.append("cleared the global kill flag this game day set")
    else:
        report.could_not.append("the global kill flag this game day set still stands after "
                                "it was cleared")


async def _sandboxes_gone(day: GameDay, admin: CoveyClient, report: RollbackReport) -> None:
    agents = [*day.probe_agents, *day.agents]

    async def running() -> list[str]:
        left = []
        for agent_id in agents:
            reader = _admin_of(day, agent_id, admin)
            got = json_of(await reader.agent(agent_id))
            boxes = json_of(await reader.sandboxes(agent_id))
            if got["status"] in ("working", "triggered") or any(
                    s["state"] in RUNNING for s in boxes):
                left.append(f"{got['slug']} ({got['status']})")
        return left

    async def none_running() -> bool:
        return not await running()
    try:
        await eventually(none_running, SANDBOXES_GONE_S, "agents of the game day kept running",
                         interval=0.2)
    except AssertionError:
        report.could_not.append("agents of the game day still working or with a sandbox "
                                f"running after {SANDBOXES_GONE_S:g} s: "
                                + ", ".join(await running()))
    else:
        if agents:
            report.restored.append(f"none of the game day's {len(agents)} agents is working "
                                   "or has a sandbox running")


async def _retire_agents(day: GameDay, admin: CoveyClient, report: RollbackReport) -> None:
    """Where a fleet resume revives agents killed on their own (upstream covey), a stopped
    agent of this game day does not stay stopped: a later game day's fleet resume in the
    same organisation woke the earlier ones' agents and their work, which crowded its own.
    There the game day's agents are deleted, once their sandboxes are gone."""
    why = dialect(day.dialect_name).retires_agents
    if why is None:
        return
    await _each_agent(day, admin, report, lambda who, a: who.delete_agent(a),
                      f"deleted agent {{agent}}: {why}",
                      f"agent {{agent}} is left stopped, not deleted ({why}): {{exc}}")


async def roll_back(day: GameDay) -> RollbackReport:
    """Every step is tried whatever the one before did; each failure is recorded."""
    report = RollbackReport()
    try:
        await _heal_faults(day, report)
    except Exception as exc:  # the agents and the switch are still rolled back
        report.could_not.append(f"healing the faults failed: {exc!r}")
    try:
        admin = await _admin(day)
    except Exception as exc:
        report.could_not.append(f"could not sign in to roll back the organisation: {exc!r}")
        return report
    if admin is None:
        return report  # no organisation yet: nothing was created in it
    steps = (("stopping the agents", _stop_agents), ("releasing the fleet switch",
             _release_fleet), ("releasing the global kill flag", _release_global),
             ("waiting for the sandboxes", _sandboxes_gone),
             ("retiring the agents", _retire_agents))
    try:
        for what, step in steps:
            try:
                await step(day, admin, report)
            except Exception as exc:  # the next step still runs; the journal says why
                report.could_not.append(f"{what} failed: {exc!r}")
    finally:
        if admin is not day.people.get("org_admin"):
            await admin.aclose()
    return report


def amend_journal(day: GameDay, report: RollbackReport) -> None:
    """The rollback happens after the journal was written: add it there."""
    path = day.journal_path
    if path is None:
        day.aborted_reason = day.aborted_reason or halt.abort_reason(None)
        path = day.journal("aborted", [], [], {})
    document = json.loads(path.read_text())
    document["rollback"] = report.to_json()
    path.write_text(json.dumps(document, indent=2, default=str))
    print(f"rollback: {len(report.restored)} restored, {len(report.could_not)} not"
          + ("" if report.complete else ": " + "; ".join(report.could_not))
          + "".join(f"; left alone: {line}" for line in report.left_alone))


async def roll_back_loudly(day: GameDay) -> RollbackReport:
    """Roll back, write it into the journal, and raise RollbackFailed with what is left
    standing when something could not be restored."""
    report = await roll_back(day)
    amend_journal(day, report)
    if not report.complete:
        raise RollbackFailed(day.name, report)
    return report
