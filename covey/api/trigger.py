"""The external trigger: a machine endpoint authenticated by the agent's trigger token."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Path
from pydantic import AfterValidator

from covey.api.agents import agent_is_stopped, insert_task, wake_out
from covey.api.deps import Orch
from covey.api.models import NO_NUL, AcceptedTaskOut, TaskOut, TriggerIn, storable_text
from covey.errors import ApiError, stopped
from covey.security import token_hash

router = APIRouter(tags=["trigger"])

TriggerToken = Annotated[str, Path(min_length=1, max_length=200,
                                   json_schema_extra={"pattern": NO_NUL}),
                         AfterValidator(storable_text)]


@router.post("/api/trigger/{token}", response_model=AcceptedTaskOut, status_code=202,
             responses={409: {"description": "Agent or fleet is stopped"}})
async def trigger(token: TriggerToken, orch: Orch,
                  body: Annotated[TriggerIn | None, Body()] = None) -> AcceptedTaskOut:
    body = body or TriggerIn()
    async with orch.pool.acquire() as conn, conn.transaction():
        agent = await conn.fetchrow(
            "SELECT id, org_id FROM agents WHERE trigger_token_hash=$1", token_hash(token))
        if agent is None:
            raise ApiError(404, "Unknown trigger token",
                           "Use the trigger_token returned when the agent was created.")
        if await agent_is_stopped(conn, agent["id"]):
            raise stopped()
        task = await insert_task(conn, agent["org_id"], agent["id"], body.title, body.body,
                                 0, "trigger")
    result = await orch.wake(agent["id"], "trigger")
    return AcceptedTaskOut(task=TaskOut(**task), wake=wake_out(result))
