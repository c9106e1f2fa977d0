"""Kill flags by scope (DESIGN §2.4): global, org, agent and tool. The org flag is the fleet
switch and the agent flag the agent switch (their routes stay where they are); this router
lists all four and sets and clears the two that had no route: global and tool."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from covey.api.agents import agent_of_org, kill_out, resume_out
from covey.api.deps import (
    ORG_ROLES,
    SECURITY,
    Killer,
    Orch,
    PlatformAdmin,
    Principal,
    arrived,
    require,
)
from covey.api.models import FlagChangeOut, FlagOut, FlagReasonIn, KillOut, ResumeOut, ToolFlagIn
from covey.errors import ApiError

router = APIRouter(prefix="/api/v1/flags", tags=["flags"])
switches = APIRouter(prefix="/api/v1/flags", tags=["flags"])  # matched first (covey.app)
# A platform admin reads the flags too: they own the global one.
Reader = Annotated[Principal, Depends(require(*ORG_ROLES, "platform_admin"))]


@router.get("", response_model=list[FlagOut])
async def list_flags(who: Reader, orch: Orch) -> list[FlagOut]:
    """Every flag that stands over this organisation's agents, whatever its scope."""
    rows = await orch.pool.fetch(
        """
        SELECT 'global' AS scope, NULL::uuid AS org_id, NULL::uuid AS agent_id, NULL AS tool,
               f.reason, h.email AS set_by, f.set_at
        FROM kill_flags f LEFT JOIN humans h ON h.id=f.set_by WHERE f.scope='global'
        UNION ALL
        SELECT 'org', o.id, NULL, NULL, o.fleet_killed_reason, h.email, o.fleet_killed_at
        FROM organizations o LEFT JOIN humans h ON h.id=o.fleet_killed_by
        WHERE o.id=$1 AND o.fleet_killed
        UNION ALL
        SELECT 'agent', a.org_id, a.id, NULL, a.kill_origin, NULL, a.killed_at
        FROM agents a WHERE a.org_id=$1 AND a.killed AND a.kill_origin <> 'fleet'
        UNION ALL
        SELECT 'tool', f.org_id, f.agent_id, f.tool, f.reason, h.email, f.set_at
        FROM kill_flags f LEFT JOIN humans h ON h.id=f.set_by
        WHERE f.scope='tool' AND f.org_id=$1
        ORDER BY 1, 7
        """,
        who.org_id,
    )
    return [FlagOut(**dict(r)) for r in rows]


@switches.post("/global", response_model=KillOut)
async def stop_globally(body: FlagReasonIn, who: PlatformAdmin, orch: Orch,
                        request: Request) -> KillOut:
    """Stop every agent of every organisation on this control plane. Idempotent."""
    return kill_out(await orch.stop_globally(who.human_id, body.reason,
                                             started=arrived(request)))


@router.post("/global/clear", response_model=ResumeOut)
async def clear_global(body: FlagReasonIn, who: PlatformAdmin, orch: Orch) -> ResumeOut:
    """Clear the global flag; agents with open work that may run wake at once."""
    return resume_out(await orch.clear_global_stop(who.human_id, body.reason))


async def _tool_target(body: ToolFlagIn, who: Principal, orch: Orch) -> None:
    # One agent's tool is the agent switch's business (manage + security); the whole
    # organisation's is the fleet switch's (security roles only).
    if body.agent_id is None and who.role not in SECURITY:
        raise ApiError(403, "Your role may not do this",
                       f"Stopping a tool for the whole organisation takes one of "
                       f"{', '.join(SECURITY)}; you are {who.role}. Name an agent_id instead.")
    if body.agent_id is not None:
        await agent_of_org(orch, who.org_id, body.agent_id)


@router.post("/tool", response_model=FlagChangeOut,
             responses={404: {"description": "No such agent"}})
async def stop_tool(body: ToolFlagIn, who: Killer, orch: Orch) -> FlagChangeOut:
    """Stop one tool (such as `shell`) for one agent or the whole organisation. The guard
    refuses that tool's next calls; the agent goes on with its other tools."""
    await _tool_target(body, who, orch)
    return FlagChangeOut(changed=await orch.stop_tool(
        who.org_id, body.agent_id, body.tool, who.human_id, body.reason))


@router.post("/tool/clear", response_model=FlagChangeOut,
             responses={404: {"description": "No such agent"}})
async def clear_tool(body: ToolFlagIn, who: Killer, orch: Orch) -> FlagChangeOut:
    await _tool_target(body, who, orch)
    return FlagChangeOut(changed=await orch.clear_tool_stop(
        who.org_id, body.agent_id, body.tool, who.human_id, body.reason))
