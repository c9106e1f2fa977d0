"""Agents, their backlog, heartbeats, recording, and the agent switch."""

from __future__ import annotations

from typing import Annotated, Any
from uuid import UUID, uuid4

import asyncpg
from fastapi import APIRouter, Path, Query, Request
from pydantic import AfterValidator

from covey.api.deps import AnyRole, Killer, Manage, Orch, arrived
from covey.api.models import (
    MAX_EXACT_INT,
    AcceptedTaskOut,
    AgentCreatedOut,
    AgentIn,
    AgentOut,
    HeartbeatIn,
    HeartbeatOut,
    KillOut,
    ReasonIn,
    RecordingOut,
    ResumeOut,
    SandboxOut,
    SessionOut,
    TaskDetailOut,
    TaskIn,
    TaskOut,
    TaskPatch,
    TaskState,
    TransitionOut,
    WakeOut,
    storable_text,
)
from covey.db import Connection, fetch_one
from covey.errors import ApiError, not_found, stopped
from covey.orchestrator import MAX_OPEN_HEARTBEAT_TASKS, Orchestrator, WakeResult
from covey.rows import audit, lock_agent, record
from covey.security import new_token, token_hash
from covey.switches import KillReport, ResumeReport

router = APIRouter(prefix="/api/v1/agents", tags=["agents"])
switches = APIRouter(prefix="/api/v1/agents", tags=["agents"])  # matched first (covey.app)

HeartbeatPathName = Annotated[str, Path(min_length=1, max_length=64,
                                        pattern=r"^[a-z0-9][a-z0-9_-]*$"),
                              AfterValidator(storable_text)]



def heartbeats_not_too_fast(heartbeats: list[HeartbeatIn], orch: Orchestrator) -> None:
    """No heartbeat shorter than the control plane's minimum period (COVEY_HEARTBEAT_MIN_S):
    a schema cannot say it, the minimum being the running plane's setting."""
    minimum = orch.settings.heartbeat_min_s
    fast = sorted(hb.name for hb in heartbeats if hb.every_seconds < minimum)
    if fast:
        raise ApiError(422, "Invalid request",
                       f"every_seconds must be at least {minimum} on this control plane "
                       f"(COVEY_HEARTBEAT_MIN_S); too short: {', '.join(fast)}.")


AGENT_COLUMNS = """
    a.id, a.org_id, a.slug, a.display_name, a.owner_id, a.status, a.killed, a.kill_origin,
    o.fleet_killed, a.warm_sandbox, a.budget_usd::float8 AS budget_usd, a.max_turns, a.model,
    a.guard, a.created_at, live.id AS running_session_id,
    COALESCE(spend.usd, 0)::float8 AS spent_usd, COALESCE(spend.tokens, 0) AS spent_tokens,
    (a.budget_usd - COALESCE(live.cost_usd, 0))::float8 AS remaining_usd
"""
# The live session (at most one: sessions_one_live) and everything the agent spent, beside
# the agent. The remaining budget is its live session's, or a whole budget when none runs.
AGENT_JOINS = """
    FROM agents a JOIN organizations o ON o.id=a.org_id
    LEFT JOIN LATERAL (SELECT s.id, s.cost_usd FROM sessions s WHERE s.agent_id=a.id
                       AND s.state IN ('starting','running')
                       ORDER BY s.started_at DESC LIMIT 1) live ON true
    LEFT JOIN LATERAL (SELECT sum(c.usd) AS usd, sum(c.tokens)::bigint AS tokens
                       FROM cost_entries c WHERE c.agent_id=a.id) spend ON true
"""
TASK_COLUMNS = """
    id, agent_id, title, body, state, priority, origin, daemon_retries, result, created_at,
    updated_at
"""


async def agent_of_org(orch: Orchestrator, org_id: UUID, agent_id: UUID) -> AgentOut:
    """Another organisation's agent does not exist, as far as this caller can tell (404)."""
    row = await orch.pool.fetchrow(
        f"SELECT {AGENT_COLUMNS} {AGENT_JOINS} WHERE a.id=$1 AND a.org_id=$2",
        agent_id, org_id,
    )
    if row is None:
        raise not_found("agent")
    return AgentOut(**dict(row))


def kill_out(report: KillReport) -> KillOut:
    return KillOut(
        already_killed=report.already_killed,
        agents_stopped=report.agents,
        sessions_cancelled=report.sessions_cancelled,
        sessions_confirmed=report.kill_confirmed,
        sessions_acknowledged=report.kill_acknowledged,
        sessions_torn_down=report.kill_torn_down,
        sessions_not_connected=report.kill_unconnected,
        tasks_requeued=report.tasks_requeued,
        evicted_sandboxes=report.evicted_sandboxes,
    )


def resume_out(report: ResumeReport) -> ResumeOut:
    return ResumeOut(
        changed=report.changed,
        agents_released=report.agents_released,
        agents_woken=report.agents_woken,
        held_by_fleet=report.held_by_fleet,
    )


def wake_out(result: WakeResult) -> WakeOut:
    if result.outcome == "refused":
        raise stopped()
    return WakeOut(outcome=result.outcome, session_id=result.session_id)  # type: ignore[arg-type]


async def insert_task(conn: Connection, org_id: UUID, agent_id: UUID, title: str, body: str,
                      priority: int, origin: str) -> dict[str, Any]:
    # The table's trigger NOTIFYs covey_wake at commit: the wake happens through it.
    row = await fetch_one(
        conn,
        f"INSERT INTO backlog_tasks (id, org_id, agent_id, title, body, priority, origin)"
        f" VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING {TASK_COLUMNS}",
        uuid4(), org_id, agent_id, title, body, priority, origin,
    )
    await conn.execute(
        "INSERT INTO task_transitions (task_id, from_state, to_state, note)"
        " VALUES ($1, NULL, 'open', $2)",
        row["id"], f"created by {origin}",
    )
    return dict(row)


async def agent_is_stopped(conn: Connection, agent_id: UUID) -> bool:
    """Read both flags under lock: a trigger racing a kill either lands first (and the kill
    requeues what it started) or sees the flag."""
    row = await lock_agent(conn, agent_id, write=False)
    return row is None or bool(row["stopped"])


@router.get("", response_model=list[AgentOut])
async def list_agents(who: AnyRole, orch: Orch) -> list[AgentOut]:
    rows = await orch.pool.fetch(
        f"SELECT {AGENT_COLUMNS} {AGENT_JOINS} WHERE a.org_id=$1 ORDER BY a.created_at, a.id",
        who.org_id,
    )
    return [AgentOut(**dict(r)) for r in rows]


@router.post("", response_model=AgentCreatedOut, status_code=201,
             responses={404: {"description": "No such owner in your organisation"},
                        409: {"description": "An agent with that slug exists, or two of its"
                                             " heartbeats have one name"}})
async def create_agent(body: AgentIn, who: Manage, orch: Orch) -> AgentCreatedOut:
    """Create an agent. One created while the fleet stop stands does not run until resume."""
    heartbeats_not_too_fast(body.heartbeats, orch)
    agent_id = uuid4()
    trigger = new_token("cvtr")
    owner = body.owner_id or who.human_id
    async with orch.pool.acquire() as conn, conn.transaction():
        if not await conn.fetchval("SELECT 1 FROM humans WHERE id=$1 AND org_id=$2",
                                   owner, who.org_id):
            raise ApiError(404, "No such owner",
                           "owner_id must be a human of your organisation.")
        try:
            await conn.execute(
                "INSERT INTO agents (id, org_id, slug, display_name, owner_id, warm_sandbox,"
                " budget_usd, max_turns, model, trigger_token_hash, guard)"
                " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
                agent_id, who.org_id, body.slug, body.display_name, owner, body.warm_sandbox,
                body.budget_usd, body.max_turns, body.model, token_hash(trigger),
                body.guard.model_dump(exclude_none=True),
            )
        except asyncpg.UniqueViolationError:
            raise ApiError(409, "An agent with that slug exists",
                           "Slugs are unique within an organisation; pick another.") from None
        names = [hb.name for hb in body.heartbeats]
        if len(set(names)) < len(names):
            # A schema cannot say "unique by name"; the primary key would, as a 500.
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ApiError(409, "Two heartbeats of one name",
                           f"Heartbeat names are unique per agent: {', '.join(twice)}.")
        for hb in body.heartbeats:
            await conn.execute(
                "INSERT INTO agent_heartbeats (agent_id, name, task_body, every_seconds)"
                " VALUES ($1, $2, $3, $4)",
                agent_id, hb.name, hb.task_body, hb.every_seconds,
            )
        await audit(conn, who.org_id, who.human_id, "agent.create", str(agent_id),
                    {"slug": body.slug})
    agent = await agent_of_org(orch, who.org_id, agent_id)
    return AgentCreatedOut(**agent.model_dump(), trigger_token=trigger)


@router.get("/{agent_id}", response_model=AgentOut)
async def get_agent(agent_id: UUID, who: AnyRole, orch: Orch) -> AgentOut:
    return await agent_of_org(orch, who.org_id, agent_id)


@router.get("/{agent_id}/backlog", response_model=list[TaskOut])
async def backlog(agent_id: UUID, who: AnyRole, orch: Orch,
                  state: Annotated[TaskState | None,
                                   Query(description="only tasks in this state")] = None,
                  ) -> list[TaskOut]:
    await agent_of_org(orch, who.org_id, agent_id)
    rows = await orch.pool.fetch(
        f"SELECT {TASK_COLUMNS} FROM backlog_tasks WHERE agent_id=$1"
        " AND ($2::text IS NULL OR state=$2) ORDER BY created_at, id",
        agent_id, state,
    )
    return [TaskOut(**dict(r)) for r in rows]


@router.get("/{agent_id}/tasks/{task_id}", response_model=TaskDetailOut)
async def task_detail(agent_id: UUID, task_id: UUID, who: AnyRole, orch: Orch
                      ) -> TaskDetailOut:
    await agent_of_org(orch, who.org_id, agent_id)
    row = await orch.pool.fetchrow(
        f"SELECT {TASK_COLUMNS} FROM backlog_tasks WHERE id=$1 AND agent_id=$2",
        task_id, agent_id,
    )
    if row is None:
        raise not_found("task")
    transitions = await orch.pool.fetch(
        "SELECT from_state, to_state, note, at FROM task_transitions WHERE task_id=$1"
        " ORDER BY id",
        task_id,
    )
    return TaskDetailOut(**dict(row),
                         transitions=[TransitionOut(**dict(t)) for t in transitions])


@router.post("/{agent_id}/tasks", response_model=TaskOut, status_code=201)
async def create_task(agent_id: UUID, body: TaskIn, who: Manage, orch: Orch) -> TaskOut:
    """Add a task to the backlog. It wakes the agent unless a switch holds it; then it
    waits, open, until resume."""
    await agent_of_org(orch, who.org_id, agent_id)
    async with orch.pool.acquire() as conn, conn.transaction():
        task = await insert_task(conn, who.org_id, agent_id, body.title, body.body,
                                 body.priority, "api")
    return TaskOut(**task)


@router.patch("/{agent_id}/tasks/{task_id}", response_model=TaskOut,
              responses={409: {"description": "The task is being worked on or finished"}})
async def change_task(agent_id: UUID, task_id: UUID, body: TaskPatch, who: Manage, orch: Orch
                      ) -> TaskOut:
    """Change a task that is not being worked on. A blocked task opens again. Changing the
    input of an agent that its guard stopped releases it: the guard holds an agent only
    against the same input (DESIGN §2.4); any other switch still holds."""
    await agent_of_org(orch, who.org_id, agent_id)
    changes = body.model_dump(exclude_none=True)  # the model refuses an empty change
    async with orch.pool.acquire() as conn, conn.transaction():
        await lock_agent(conn, agent_id, write=True)  # the one lock order: agent, then task
        current = await conn.fetchrow(
            "SELECT state FROM backlog_tasks WHERE id=$1 AND agent_id=$2 FOR UPDATE",
            task_id, agent_id)
        if current is None:
            raise not_found("task")
        if current["state"] not in ("open", "blocked"):
            raise ApiError(409, f"The task is {current['state']}",
                           "Only open or blocked tasks can be changed; kill the agent first "
                           "to take back a task in progress.")
        row = await fetch_one(
            conn,
            f"UPDATE backlog_tasks SET title=COALESCE($2, title), body=COALESCE($3, body),"
            f" priority=COALESCE($4, priority), state='open', updated_at=now()"
            f" WHERE id=$1 RETURNING {TASK_COLUMNS}",
            task_id, changes.get("title"), changes.get("body"), changes.get("priority"),
        )
        await conn.execute(
            "INSERT INTO task_transitions (task_id, from_state, to_state, note)"
            " VALUES ($1, $2, 'open', $3)",
            task_id, current["state"], f"changed: {', '.join(sorted(changes))}")
        released = await conn.fetchval(
            "UPDATE agents SET killed=false, kill_origin=NULL, killed_at=NULL, status='sleeping'"
            " WHERE id=$1 AND kill_origin='guard' RETURNING id", agent_id)
        if released is not None:
            await record(conn, agent_id, None, "guard", "released",
                         {"by": "changed task", "task_id": str(task_id)})
        await audit(conn, who.org_id, who.human_id, "task.change", str(task_id), changes)
    await orch.wake(agent_id, "changed-task")
    return TaskOut(**dict(row))


@router.post("/{agent_id}/wake", response_model=WakeOut, status_code=202,
             responses={409: {"description": "Agent or fleet is stopped"}})
async def wake(agent_id: UUID, who: Manage, orch: Orch) -> WakeOut:
    await agent_of_org(orch, who.org_id, agent_id)
    return wake_out(await orch.wake(agent_id, "manual"))


@router.get("/{agent_id}/heartbeats", response_model=list[HeartbeatOut])
async def heartbeats(agent_id: UUID, who: AnyRole, orch: Orch) -> list[HeartbeatOut]:
    await agent_of_org(orch, who.org_id, agent_id)
    rows = await orch.pool.fetch(
        "SELECT name, task_body, every_seconds, last_fired_at FROM agent_heartbeats"
        " WHERE agent_id=$1 ORDER BY name",
        agent_id,
    )
    return [HeartbeatOut(**dict(r)) for r in rows]


@router.post("/{agent_id}/heartbeats", response_model=HeartbeatOut, status_code=201,
             responses={409: {"description": "A heartbeat of that name exists"}})
async def add_heartbeat(agent_id: UUID, body: HeartbeatIn, who: Manage, orch: Orch
                        ) -> HeartbeatOut:
    await agent_of_org(orch, who.org_id, agent_id)
    heartbeats_not_too_fast([body], orch)
    try:
        row = await fetch_one(
            orch.pool,
            "INSERT INTO agent_heartbeats (agent_id, name, task_body, every_seconds)"
            " VALUES ($1, $2, $3, $4) RETURNING name, task_body, every_seconds, last_fired_at",
            agent_id, body.name, body.task_body, body.every_seconds,
        )
    except asyncpg.UniqueViolationError:
        raise ApiError(409, "A heartbeat of that name exists", "Pick another name.") from None
    return HeartbeatOut(**dict(row))


@router.post("/{agent_id}/heartbeats/{name}/fire", response_model=AcceptedTaskOut,
             status_code=202, responses={409: {
                 "description": "Agent or fleet is stopped, or the agent has"
                                f" {MAX_OPEN_HEARTBEAT_TASKS} unfinished heartbeat tasks"}})
async def fire_heartbeat(agent_id: UUID, name: HeartbeatPathName, who: Manage, orch: Orch
                         ) -> AcceptedTaskOut:
    await agent_of_org(orch, who.org_id, agent_id)
    async with orch.pool.acquire() as conn, conn.transaction():
        stopped_now = await agent_is_stopped(conn, agent_id)
        hb = await conn.fetchrow(
            "SELECT name, task_body FROM agent_heartbeats WHERE agent_id=$1 AND name=$2"
            " FOR UPDATE",
            agent_id, name,
        )
        if hb is None:
            raise not_found("heartbeat")
        if stopped_now:
            raise stopped()
        unfinished = await conn.fetchval(
            "SELECT count(*) FROM backlog_tasks WHERE agent_id=$1 AND origin='heartbeat'"
            " AND state IN ('open','in_progress','blocked')", agent_id)
        if unfinished >= MAX_OPEN_HEARTBEAT_TASKS:
            raise ApiError(409, "Too many unfinished heartbeat tasks",
                           f"The agent has {unfinished}; at most {MAX_OPEN_HEARTBEAT_TASKS}"
                           " may wait. Let it work them off, or cancel some.")
        await conn.execute(
            "UPDATE agent_heartbeats SET last_fired_at=now() WHERE agent_id=$1 AND name=$2",
            agent_id, name,
        )
        task = await insert_task(conn, who.org_id, agent_id, f"heartbeat: {name}",
                                 hb["task_body"], 0, "heartbeat")
    result = await orch.wake(agent_id, "heartbeat")
    return AcceptedTaskOut(task=TaskOut(**task), wake=wake_out(result))


@router.get("/{agent_id}/recording", response_model=list[RecordingOut])
async def recording(agent_id: UUID, who: AnyRole, orch: Orch,
                    after: int = Query(default=0, ge=0, le=MAX_EXACT_INT,
                                       description="only events after this id"),
                    ) -> list[RecordingOut]:
    await agent_of_org(orch, who.org_id, agent_id)
    rows = await orch.pool.fetch(
        "SELECT id, session_id, kind, status, detail, at FROM recording_events"
        " WHERE agent_id=$1 AND id > $2 ORDER BY id LIMIT 1000",
        agent_id, after,
    )
    return [RecordingOut(**dict(r)) for r in rows]


@router.get("/{agent_id}/sessions", response_model=list[SessionOut])
async def sessions(agent_id: UUID, who: AnyRole, orch: Orch) -> list[SessionOut]:
    await agent_of_org(orch, who.org_id, agent_id)
    rows = await orch.pool.fetch(
        "SELECT s.id, s.task_id, s.sandbox_id, s.node, s.state, s.started_at, s.ended_at,"
        " s.stop_layer, s.stop_reason, s.daemon_stop, s.daemon_stop_detail, s.kill_sent_at,"
        " s.kill_confirmed_at, s.kill_confirmed_by, s.kill_acked_at, s.tool_cut,"
        " s.cost_usd::float8 AS spent_usd, COALESCE(t.tokens, 0) AS spent_tokens,"
        " a.budget_usd::float8 AS budget_usd,"
        " (a.budget_usd - s.cost_usd)::float8 AS remaining_usd"
        " FROM sessions s JOIN agents a ON a.id=s.agent_id"
        " LEFT JOIN (SELECT session_id, sum(tokens)::bigint AS tokens FROM cost_entries"
        "            WHERE agent_id=$1 GROUP BY session_id) t ON t.session_id=s.id"
        " WHERE s.agent_id=$1 ORDER BY s.started_at, s.id",
        agent_id,
    )
    return [SessionOut(**dict(r)) for r in rows]


@router.get("/{agent_id}/sandboxes", response_model=list[SandboxOut])
async def sandboxes(agent_id: UUID, who: AnyRole, orch: Orch) -> list[SandboxOut]:
    """Sandboxes with their state, their daemon's exit code (3 = obeyed a kill) and when it
    exited, when the sandbox was gone, and its last sync to the agent's home."""
    await agent_of_org(orch, who.org_id, agent_id)
    rows = await orch.pool.fetch(
        "SELECT id, backend, handle, state, exit_code, created_at, ended_at, daemon_exited_at,"
        " gone_at, last_sync_at FROM sandboxes"
        " WHERE agent_id=$1 ORDER BY created_at, id",
        agent_id,
    )
    return [SandboxOut(**dict(r)) for r in rows]


@switches.post("/{agent_id}/kill", response_model=KillOut)
async def kill(agent_id: UUID, who: Killer, orch: Orch, request: Request,
               body: ReasonIn | None = None) -> KillOut:
    """The agent switch. Idempotent: a second kill changes nothing and succeeds."""
    report = await orch.kill_agent(who.org_id, agent_id, who.human_id,
                                   started=arrived(request), reason=body.reason if body else None)
    if report is None:
        raise not_found("agent")
    return kill_out(report)


@router.post("/{agent_id}/resume", response_model=ResumeOut)
async def resume(agent_id: UUID, who: Killer, orch: Orch, body: ReasonIn | None = None
                 ) -> ResumeOut:
    """Clear the agent's own flag. While the fleet stop stands, the agent stays held."""
    report = await orch.resume_agent(who.org_id, agent_id, who.human_id,
                                     reason=body.reason if body else None)
    if report is None:
        raise not_found("agent")
    return resume_out(report)
