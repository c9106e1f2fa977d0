"""The audit log, readable: who pulled which switch, changed which flag, and why. For the roles
that answer for it (org_admin, security, auditor), of their own organisation only. Entries of
the global flag belong to no organisation and are not listed here (GET /api/v1/flags shows a
standing one)."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated
from uuid import UUID

from fastapi import APIRouter, Query
from pydantic import BeforeValidator

from covey.api.agents import agent_of_org
from covey.api.deps import AuditReader, Orch
from covey.api.models import MAX_EXACT_INT, AuditOut
from covey.errors import ApiError

router = APIRouter(prefix="/api/v1", tags=["audit"])

_UUID = "'^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$'"
# The agent an entry concerns: its target for agent.*, the task's agent for task.*, the
# flag's agent for a tool flag of one agent.
_AGENT_OF_ENTRY = f"""
CASE WHEN l.action LIKE 'agent.%' AND l.target ~ {_UUID} THEN l.target::uuid
     WHEN l.action LIKE 'task.%' AND l.target ~ {_UUID}
          THEN (SELECT t.agent_id FROM backlog_tasks t WHERE t.id = l.target::uuid)
     WHEN l.detail->>'agent_id' ~ {_UUID} THEN (l.detail->>'agent_id')::uuid
END"""


def _not_a_number(value: object) -> object:
    # Pydantic would read "0.5" as seconds since 1970: a time here is written as a time.
    if isinstance(value, str | int | float) and re.fullmatch(r"\s*[+-]?[\d.]+(e[+-]?\d+)?\s*",
                                                             str(value), re.IGNORECASE):
        raise ValueError("give an ISO 8601 time, such as 2026-12-02T18:00:00Z")
    return value


Instant = Annotated[datetime, BeforeValidator(_not_a_number)]


def _utc(value: datetime | None, name: str) -> datetime | None:
    """An instant in UTC (a time without an offset is taken as UTC)."""
    if value is None:
        return None
    try:
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    except OverflowError:
        raise ApiError(422, "Invalid request",
                       f"{name}: out of range; give a time between the years 1 and 9999"
                       ) from None


@router.get("/audit", response_model=list[AuditOut],
            responses={404: {"description": "No such agent in your organisation"}})
async def audit_log(
    who: AuditReader, orch: Orch,
    kind: Annotated[str | None, Query(
        min_length=1, max_length=64, pattern=r"^[a-z][a-z_.]*$",
        description="an action (`fleet.kill`) or its family (`fleet`, `flag.tool`)")] = None,
    agent_id: Annotated[UUID | None, Query(description="entries about this agent")] = None,
    since: Annotated[Instant | None, Query(description="at or after this time")] = None,
    until: Annotated[Instant | None, Query(description="before this time")] = None,
    before: Annotated[int | None, Query(
        ge=1, le=MAX_EXACT_INT,
        description="entries older than this id: the last id of the previous page")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[AuditOut]:
    """Newest first. Page back with `before` set to the last id received."""
    if agent_id is not None:
        await agent_of_org(orch, who.org_id, agent_id)
    rows = await orch.pool.fetch(
        f"""
        SELECT l.id, l.at, l.action, l.actor_id, h.email AS actor_email, l.target,
               x.agent_id, l.detail
        FROM audit_log l
        LEFT JOIN humans h ON h.id = l.actor_id
        CROSS JOIN LATERAL (SELECT {_AGENT_OF_ENTRY} AS agent_id) x
        WHERE l.org_id = $1
          AND ($2::text IS NULL OR l.action = $2 OR starts_with(l.action, $2 || '.'))
          AND ($3::uuid IS NULL OR x.agent_id = $3)
          AND ($4::timestamptz IS NULL OR l.at >= $4)
          AND ($5::timestamptz IS NULL OR l.at < $5)
          AND ($6::bigint IS NULL OR l.id < $6)
        ORDER BY l.id DESC LIMIT $7
        """,
        who.org_id, kind, agent_id, _utc(since, "since"), _utc(until, "until"), before, limit,
    )
    return [AuditOut(**dict(r)) for r in rows]
