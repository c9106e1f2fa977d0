"""Statements the orchestrator and the switches share: the one lock order (agents, then
their organisation), status events, the recording, the audit log and the requeue of work in
progress. The why of the lock order is at the top of covey.orchestrator."""

from __future__ import annotations

import json
from typing import Any
from uuid import UUID

import structlog

from covey.db import MAY_RUN, Connection

log = structlog.get_logger(__name__)

def status_event(org_id: UUID, agent_id: UUID, status: str) -> tuple[str, str]:
    """A status change as the NOTIFY that publishes it: (channel, payload)."""
    return "covey_events", json.dumps({"org_id": str(org_id), "agent_id": str(agent_id),
                                       "status": status})


async def emit_status(conn: Connection, org_id: UUID, agent_id: UUID, status: str) -> None:
    """Publish a status change to every replica's event stream (delivered at commit)."""
    await conn.execute("SELECT pg_notify($1, $2)", *status_event(org_id, agent_id, status))


async def emit_statuses(conn: Connection, org_id: UUID, agent_ids: list[UUID], status: str
                        ) -> None:
    """Publish these agents' status change, a hundred per NOTIFY (a payload holds at most
    8000 bytes), all in one statement: a fleet kill of a thousand once made ten round trips
    of its flag's transaction out of them. The same payloads as `statuses_cte`, which it
    uses: a switch's own statement sends them that way."""
    if agent_ids:
        await conn.execute(
            f"WITH agents AS (SELECT unnest($2::uuid[]) AS id),"
            f" {statuses_cte('$1', 'agents', status)} SELECT * FROM statuses",
            org_id, agent_ids)


async def lock_agent(conn: Connection, agent_id: UUID, *, write: bool
                     ) -> dict[str, Any] | None:
    """Lock an agent, then its organisation (the one lock order), and read the flags:
    `stopped` is MAY_RUN's answer, asked in a statement of its own after the locks, so that
    it sees a switch that committed while we waited (a subquery of the locking statement
    would read the snapshot from before the wait)."""
    mode = "FOR NO KEY UPDATE OF a" if write else "FOR SHARE OF a"
    row = await conn.fetchrow(
        f"""
        SELECT a.id, a.org_id, a.killed, a.kill_origin, a.warm_sandbox, a.slug,
               a.display_name, a.owner_id, o.fleet_killed
        FROM agents a JOIN organizations o ON o.id=a.org_id
        WHERE a.id=$1 {mode} FOR SHARE OF o
        """,
        agent_id,
    )
    if row is None:
        return None
    may_run = await conn.fetchval(
        f"SELECT {MAY_RUN} FROM agents a JOIN organizations o ON o.id=a.org_id WHERE a.id=$1",
        agent_id)
    return {**dict(row), "stopped": not may_run}


async def lock_fleet(conn: Connection, org_id: UUID) -> bool | None:
    """Lock every agent of the organisation (by id), then the organisation itself."""
    await conn.execute(
        "SELECT id FROM agents WHERE org_id=$1 ORDER BY id FOR NO KEY UPDATE", org_id)
    was: bool | None = await conn.fetchval(
        "SELECT fleet_killed FROM organizations WHERE id=$1 FOR NO KEY UPDATE", org_id)
    return was


async def record_many(conn: Connection, agent_ids: list[UUID], session_of: dict[UUID, UUID],
                      kind: str, status: str, detail: dict[str, Any]) -> None:
    await conn.execute(
        "INSERT INTO recording_events (agent_id, session_id, kind, status, detail)"
        " SELECT a, s, $3, $4, $5 FROM unnest($1::uuid[], $2::uuid[]) AS x(a, s)",
        agent_ids, [session_of.get(a) for a in agent_ids], kind, status, detail,
    )


async def record(conn: Connection, agent_id: UUID, session_id: UUID | None, kind: str,
                 status: str, detail: dict[str, Any]) -> None:
    await conn.execute(
        "INSERT INTO recording_events (agent_id, session_id, kind, status, detail)"
        " VALUES ($1, $2, $3, $4, $5)",
        agent_id, session_id, kind, status, detail,
    )


async def audit(conn: Connection, org_id: UUID | None, actor_id: UUID | None, action: str,
                target: str, detail: dict[str, Any] | None = None,
                notify: tuple[str, str] | None = None) -> None:
    """In the audit log (GET /api/v1/audit), and on the server's log at INFO with who and
    why: switch pulls were once only in the table, out of reach of the log's alerts. Logged
    as written, inside the caller's transaction; a transaction that then fails logs that.
    `notify` (channel, payload): a NOTIFY sent by the same statement, a round trip fewer for
    a kill that waits on each."""
    detail = detail or {}
    channel, payload = notify or (None, None)
    actor = await conn.fetchval(
        "WITH logged AS (INSERT INTO audit_log (org_id, actor_id, action, target, detail)"
        " VALUES ($1, $2, $3, $4, $5) RETURNING 1),"
        " told AS (SELECT pg_notify($6, $7) FROM logged WHERE $6::text IS NOT NULL)"
        " SELECT (SELECT email FROM humans WHERE id=$2), (SELECT count(*) FROM told)",
        org_id, actor_id, action, target, detail, channel, payload,
    )
    log_audit(action, actor, org_id, target, detail)


def log_audit(action: str, actor: str | None, org_id: UUID | None, target: str,
              detail: dict[str, Any]) -> None:
    """An audit row written (by `audit`, or inside a switch's own statement) on the log."""
    log.info("audit", action=action, actor=actor or "the control plane",
             org_id=str(org_id) if org_id else None, target=target,
             why=detail.get("reason"), detail=detail)


# What every statement that updates several sessions at once does first: lock them in the
# order of their ids, `ids` a query of their ids (a CTE `in_order` of the statement). Each
# locked them in the order its join happened to produce, and two such statements on the
# same sessions deadlocked: the fleet kill's cancellation with the daemons' batched costs
# or with the lease renewal, in 2 of 8 runs of main in the incident-load game day. Postgres
# finds a deadlock after a second (deadlock_timeout) and aborts one side: the fleet kill
# reached its daemons 0.42 and 2.2 s after the request.
def sessions_in_order(ids: str) -> str:
    return (f"in_order AS (SELECT s.id FROM sessions s WHERE s.id IN ({ids})"
            " ORDER BY s.id FOR NO KEY UPDATE OF s)")


def cancelled_live_ctes(where: str) -> str:
    """A switch's cancellation as CTEs of its statement: `live` (the sessions of the
    agents `where` picks, `agents a` joined to `sessions s`, cancelled: id, agent_id,
    sandbox_id) and `announced` (one NOTIFY `covey_kill` per 200 of them, what fits the
    8000-byte payload, so that daemons connected to another replica hear the kill through
    it; its one row must be read for the NOTIFYs to be sent). The sessions are locked in
    the order of their ids first (`doomed`), as every statement that updates several
    sessions locks them (`sessions_in_order`)."""
    return f"""
        doomed AS (
            SELECT s.id FROM sessions s JOIN agents a ON a.id=s.agent_id
            WHERE {where} AND s.state IN ('starting','running')
            ORDER BY s.id FOR NO KEY UPDATE OF s
        ), live AS (
            UPDATE sessions s SET state='cancelled', ended_at=now(),
                   stop_layer='kill-switch', stop_reason='stopped by the kill switch'
            FROM doomed WHERE s.id=doomed.id AND s.state IN ('starting','running')
            RETURNING s.id, s.agent_id, s.sandbox_id
        ), announced AS (
            SELECT count(pg_notify('covey_kill', ids)) AS notified
            FROM (SELECT string_agg(id::text, ',') AS ids
                  FROM (SELECT id, (row_number() OVER () - 1) / 200 AS batch FROM live) b
                  GROUP BY batch) x
        )"""


def statuses_cte(org: str, agents: str, status: str) -> str:
    """`emit_statuses` as a CTE `statuses` of a larger statement: the agents of CTE
    `agents` (an `id` column) of organisation `org` (a parameter such as `$1`) published
    with `status`, a hundred per NOTIFY; its one row must be read for them to be sent."""
    return f"""
        statuses AS (
            SELECT count(pg_notify('covey_events', json_build_object(
                       'org_id', {org}::uuid, 'status', '{status}', 'agents', ids)::text))
            FROM (SELECT json_agg(id) AS ids
                  FROM (SELECT id, (row_number() OVER () - 1) / 100 AS batch FROM {agents}) b
                  GROUP BY batch) x
        )"""


def requeue_ctes(where: str, note: str) -> str:
    """The requeue as two CTEs of a larger statement: `moved` (the in-progress tasks matching
    `where`, back to open: their ids) and `logged` (a transition each, noting `note`, a
    parameter such as `$3`)."""
    return f"""
        moved AS (
            UPDATE backlog_tasks t SET state='open', claim_token=NULL, claimed_by=NULL,
                   updated_at=now()
            WHERE t.state='in_progress' AND {where}
            RETURNING t.id
        ), logged AS (
            INSERT INTO task_transitions (task_id, from_state, to_state, note)
            SELECT id, 'in_progress', 'open', {note} FROM moved
        )"""


async def requeue_in_progress(conn: Connection, where: str, args: list[Any], note: str
                              ) -> list[UUID]:
    """Put the in-progress tasks matching `where` back to open, with a transition each."""
    rows = await conn.fetch(
        f"WITH {requeue_ctes(where, f'${len(args) + 1}')} SELECT id FROM moved", *args, note)
    return [r["id"] for r in rows]
