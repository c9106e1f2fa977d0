"""Notifications addressed to the signed-in human."""

from __future__ import annotations

from fastapi import APIRouter

from covey.api.deps import AnyRole, Orch
from covey.api.models import NotificationOut

router = APIRouter(prefix="/api/v1/notifications", tags=["notifications"])


@router.get("", response_model=list[NotificationOut])
async def notifications(who: AnyRole, orch: Orch) -> list[NotificationOut]:
    rows = await orch.pool.fetch(
        "SELECT id, class, kind, title, link, at FROM notifications"
        " WHERE org_id=$1 AND $2 = ANY(recipients) ORDER BY id DESC LIMIT 200",
        who.org_id, who.human_id,
    )
    return [NotificationOut(**dict(r)) for r in rows]
