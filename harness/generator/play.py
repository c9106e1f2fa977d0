"""Playing a schedule on a game day: its agents set up, each step at its time through the
recording client (`day.as_(role)`) or the fault registry, then the incident ends (faults
healed, agents behave, every switch released) and the work is given time to finish, so that
the checkers judge a history that has settled.

The player records and never judges: a refused call, a fault with nothing to act on, a
request nobody knows the outcome of are all history, and the schedule goes on. So is an
outage the schedule brought about itself (the database away, the control plane crashed): an
operation it meets is recorded as `operate` records it (fail when it never reached the
control plane, info when it may have taken effect), a read it meets as a failed read, and
the player goes on; only the settling waits for the control plane to be back.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from harness.act.client import ApiFailure, json_of
from harness.generator.faults import FAULTS, FaultSkipped
from harness.generator.schedule import Schedule, Step
from harness.judge.checkers import Verdict
from harness.record.gameday import GameDay
from harness.run.rollback import roll_back
from harness.run.steady import prepare
from harness.stack.waiting import eventually, retried

GENERATOR = "generator"
HEARTBEAT = "hourly"
# rm_rf repeats one call forever: with the loop detector out of reach it runs until a switch.
GUARDS: dict[str, dict[str, Any]] = {"rm_rf": {"loop_window": 1000, "loop_repeats": 1000}}
FINISHED = ("done", "failed")
# After the incident: how long the control plane may take to answer again once every fault
# is healed (a restart, its database reconnected) on a loaded 2-core machine.
PLANE_BACK_S = 90.0
RESUME_TRIES = 3  # a resume after the incident that meets an outage, tried again
T = TypeVar("T")


@dataclass
class Played:
    """What a schedule did to the game day, for the journal and the soak's figures."""

    operations: int = 0
    faults: int = 0
    skipped: int = 0
    tasks_created: int = 0
    # Operations and reads an outage answered (a 503, a refused or cut connection).
    outage_answers: int = 0
    faults_by_kind: Counter[str] = field(default_factory=Counter)
    unsettled: str | None = None  # why the work did not finish after the incident, if not

    def to_json(self) -> dict[str, Any]:
        return {"operations": self.operations, "faults": self.faults, "skipped": self.skipped,
                "tasks_created": self.tasks_created, "outage_answers": self.outage_answers,
                "faults_by_kind": dict(sorted(self.faults_by_kind.items())),
                "unsettled": self.unsettled}


def outage(exc: BaseException) -> str | None:
    """Why a call met an outage (the database away: 503; the control plane down or restarting:
    no connection, or one cut), or None when `exc` is something else, which is not ridden
    out: a 500 or a wrong status is a finding."""
    if isinstance(exc, ApiFailure):
        return exc.response.text[:200] if exc.response.status_code == 503 else None
    if isinstance(exc, httpx.TransportError):
        return repr(exc)[:200]
    return None


async def ride_out(day: GameDay, what: str, read: Callable[[], Awaitable[T]]) -> T | None:
    """A read by the player; one an outage answered is recorded as a failed read (a read has
    no effect to be unsure of) and gives None."""
    try:
        return await read()
    except (ApiFailure, httpx.TransportError) as exc:
        why = outage(exc)
        if why is None:
            raise
        day.history.complete(day.history.invoke(GENERATOR, "read", {"what": what}),
                             "fail", {"outage": why})
        return None


async def set_up(day: GameDay, schedule: Schedule) -> list[dict[str, Any]]:
    """The schedule's agents, each with a heartbeat to fire and its first tasks; and the
    second replica first, when the schedule partitions it, so that it takes up work too."""
    if day.endpoints.replica is not None and any(
            s.kind == "fault" and s.name == "partition_replica" for s in schedule.steps):
        replica = await day.endpoints.replica()
        day.notes.append(f"a second replica serves at {replica.url} (its database link: "
                         f"{replica.database_link})")
    agents = []
    for plan in schedule.agents:
        agent = await day.agent(plan.behaviour, warm=plan.warm,
                                guard=GUARDS.get(plan.behaviour))
        json_of(await day.people["org_admin"].add_heartbeat(agent["id"], HEARTBEAT,
                                                            "heartbeat", 3600), 201)
        for _ in range(plan.tasks):
            await day.task(agent["id"])
        agents.append(agent)
    return agents


async def _task_of(day: GameDay, agent_id: str, index: int) -> str | None:
    async def backlog() -> list[dict[str, Any]]:
        return list(json_of(await day.people["auditor"].backlog(agent_id)))
    read = await ride_out(day, "backlog", backlog)
    if read is None:
        return None
    tasks = sorted(read, key=lambda t: (t["created_at"], t["id"]))
    return str(tasks[index % len(tasks)]["id"]) if tasks else None


async def _operation(day: GameDay, agents: list[dict[str, Any]], step: Step
                     ) -> httpx.Response | None:
    assert step.role is not None, f"operation {step.name} has no role"
    who = day.as_(step.role)
    agent = agents[step.agent] if step.agent is not None else None
    if step.name in ("kill_fleet", "resume_fleet"):
        return await (who.kill_fleet() if step.name == "kill_fleet" else who.resume_fleet())
    assert agent is not None, f"operation {step.name} names no agent"
    if step.name == "kill_agent":
        return await who.kill_agent(agent)
    if step.name == "resume_agent":
        return await who.resume_agent(agent)
    if step.name == "create_task":
        return await who.create_task(agent)
    if step.name == "trigger":
        return await who.trigger(agent, day.fake.sentence(nb_words=3))
    if step.name == "fire_heartbeat":
        return await who.fire_heartbeat(agent, HEARTBEAT)
    if step.name == "wake":
        return await who.wake(agent)
    if step.name == "change_task":
        task_id = await _task_of(day, agent["id"], int(step.params.get("task", 0)))
        if task_id is None:
            return None
        return await who.change_task(agent, task_id, priority=int(step.params["priority"]))
    raise ValueError(f"the player knows no operation {step.name!r}")


async def _fault(day: GameDay, agents: list[dict[str, Any]], step: Step) -> bool:
    params = dict(step.params)
    if step.agent is not None:
        params["agent_id"] = agents[step.agent]["id"]
    invoke = day.history.invoke("nemesis", "fault", {"name": step.name, **params})
    try:
        record = await FAULTS[step.name].apply(day, params)
    except FaultSkipped as skipped:
        day.history.complete(invoke, "fail", {"skipped": str(skipped)})
        return False
    except Exception as exc:  # the fault may or may not stand: the nemesis's log will say
        day.history.complete(invoke, "info", {"error": repr(exc)})
        return False
    day.history.complete(invoke, "ok", {"fault": record})
    return True


async def apply(day: GameDay, agents: list[dict[str, Any]], index: int, step: Step,
                played: Played) -> None:
    """One step, recorded (`generator step` names it, then its operation or fault)."""
    day.history.observe(GENERATOR, "step", {"index": index, "kind": step.kind,
                                            "name": step.name, "role": step.role,
                                            "agent": step.agent, "params": step.params})
    if step.kind == "fault":
        if await _fault(day, agents, step):
            played.faults += 1
            played.faults_by_kind[step.name] += 1
        else:
            played.skipped += 1
        return
    kill = step.name in ("kill_agent", "kill_fleet")
    if kill:  # what was in progress, for in_progress_requeued
        played.outage_answers += await ride_out(day, "tasks", day.read_tasks) is None
    try:
        r = await _operation(day, agents, step)
    except httpx.HTTPError:
        # Recorded by `operate`: fail if it never reached the control plane, else info.
        played.operations += 1
        played.outage_answers += 1
        return
    if r is None:
        played.skipped += 1
        day.history.observe(GENERATOR, "skipped", {"index": index,
                                                   "why": "no task to change could be read"})
        return
    played.operations += 1
    played.outage_answers += r.status_code == 503
    if r.is_success and step.name in ("create_task", "trigger", "fire_heartbeat"):
        played.tasks_created += 1
    if kill and r.is_success:  # requeued once the kill answered
        played.outage_answers += await ride_out(day, "tasks", day.read_tasks) is None


def _unless_outage(r: httpx.Response) -> None:
    if r.status_code == 503:
        raise ApiFailure(r, 200)


async def plane_back(day: GameDay, within_s: float) -> None:
    """Until the control plane answers /healthz with its database reachable."""
    async def answers() -> bool:
        try:
            return (await day.people["auditor"].get("/healthz")).status_code == 200
        except httpx.TransportError:
            return False
    await day.until.condition(answers, within_s, "the control plane did not answer with its "
                              f"database within {within_s:.0f} s of every fault healing")


async def settle(day: GameDay, agents: list[dict[str, Any]], deadline_s: float) -> str | None:
    """End the incident: heal the faults, let the agents behave, release every switch, and
    wait until every task is done or failed. Returns why it did not, or None."""
    await day.endpoints.nemesis.heal_all()
    await plane_back(day, PLANE_BACK_S)
    for agent in agents:
        await day.endpoints.puppet.assign(agent["id"], "well_behaved")
    security = day.as_("security")

    async def resume() -> None:
        _unless_outage(await security.resume_fleet())
        for agent in agents:
            if json_of(await day.people["auditor"].agent(agent["id"]))["killed"]:
                _unless_outage(await security.resume_agent(agent))
    try:  # a resume refused by a passing fault is tried again
        await retried(resume, RESUME_TRIES, wait_s=lambda attempt, _: float(attempt),
                      on=lambda e: isinstance(e, httpx.HTTPError) or (
                          isinstance(e, ApiFailure) and outage(e) is not None))
    except (ApiFailure, httpx.HTTPError) as exc:
        if isinstance(exc, ApiFailure) and outage(exc) is None:
            raise
        return (f"the fleet and its agents could not be resumed after the incident: "
                f"{RESUME_TRIES} tries met an outage")
    left: list[str] = []

    async def finished() -> bool:
        nonlocal left
        tasks = await ride_out(day, "tasks", day.read_tasks)
        if tasks is None:  # an outage read: not yet
            return False
        left = [f"{t['id']} ({t['state']})" for t in tasks.values() if t["state"] not in FINISHED]
        return not left
    try:
        await eventually(finished, deadline_s, "tasks unfinished", interval=0.5)
    except AssertionError:
        return (f"{len(left)} tasks were not finished {deadline_s:.0f} s after the incident "
                f"ended: {', '.join(left[:5])}")
    return None


async def play(day: GameDay, schedule: Schedule, *, settle_s: float = 90) -> Played:
    """Run `schedule` on `day`: set-up, every step at its time, then the settling."""
    day.journal_sections["schedule"] = schedule.to_json()
    agents = await set_up(day, schedule)
    played = Played()
    start = time.monotonic()
    for index, step in enumerate(schedule.steps):
        wait = start + step.at_s - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)  # the schedule's clock, not a wait for an outcome
        await apply(day, agents, index, step, played)
    remaining = start + schedule.duration_s - time.monotonic()
    if remaining > 0:
        await asyncio.sleep(remaining)
    played.unsettled = await settle(day, agents, settle_s)
    if played.unsettled is not None:
        day.notes.append(played.unsettled)
    day.journal_sections["generator"] = played.to_json()
    return played


async def verdicts_of(like: GameDay, schedule: Schedule, *, settle_s: float = 90
                      ) -> list[Verdict]:
    """Play `schedule` as a game day of its own on `like`'s stack (its own organisation where
    the stack has a platform admin, its own people and agents), judged by `like`'s checkers
    and rolled back; no journal is written (a shrinking try is not a run of the scenario,
    and must not become the latest run the regression gate reads)."""
    day = GameDay(name=f"{like.name} shrinking", stack=like.stack, endpoints=like.endpoints,
                  seed=like.seed, report_dir=like.report_dir, required=like.required,
                  scenario=like.scenario, checkers=like.checkers)
    try:
        await prepare(day)
        await play(day, schedule, settle_s=settle_s)
        verdicts, _, _ = await day.judge()
        return verdicts
    finally:
        try:
            await roll_back(day)
        finally:
            await day.close()
