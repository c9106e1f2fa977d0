"""The fleet switch: one organisation at once. Security roles only."""

from __future__ import annotations

from fastapi import APIRouter, Request

from covey.api.agents import kill_out, resume_out
from covey.api.deps import AnyRole, Orch, Security, arrived
from covey.api.models import FleetOut, KillOut, ReasonIn, ResumeOut
from covey.db import fetch_one

router = APIRouter(prefix="/api/v1/fleet", tags=["fleet"])
switches = APIRouter(prefix="/api/v1/fleet", tags=["fleet"])  # matched first (covey.app)


@router.get("", response_model=FleetOut)
async def fleet(who: AnyRole, orch: Orch) -> FleetOut:
    row = await fetch_one(
        orch.pool,
        """
        SELECT o.id AS org_id, o.fleet_killed, o.fleet_killed_at,
               (SELECT h.email FROM humans h WHERE h.id=o.fleet_killed_by) AS fleet_killed_by,
               o.fleet_killed_reason,
               EXISTS (SELECT 1 FROM kill_flags WHERE scope='global') AS global_stop,
               count(a.id) AS agents,
               count(a.id) FILTER (WHERE a.killed) AS agents_killed,
               count(a.id) FILTER (WHERE a.status IN ('working','triggered')) AS agents_working
        FROM organizations o LEFT JOIN agents a ON a.org_id=o.id
        WHERE o.id=$1 GROUP BY o.id
        """,
        who.org_id,
    )
    return FleetOut(**dict(row))


@switches.post("/kill", response_model=KillOut)
async def kill_fleet(who: Security, orch: Orch, request: Request,
                     body: ReasonIn | None = None) -> KillOut:
    """The emergency stop: every agent of the organisation, at once. Idempotent. The reason
    is optional: an emergency stop must not wait for a sentence."""
    return kill_out(await orch.kill_fleet(who.org_id, who.human_id, started=arrived(request),
                                          reason=body.reason if body else None))


@router.post("/resume", response_model=ResumeOut)
async def resume_fleet(who: Security, orch: Orch, body: ReasonIn | None = None) -> ResumeOut:
    """Release the fleet stop. Agents stopped on their own before it stay stopped."""
    return resume_out(await orch.resume_fleet(who.org_id, who.human_id,
                                              reason=body.reason if body else None))
