"""Who is asking, and what their role lets them do: declared once per route."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

from fastapi import Depends, Request

from covey.admission import is_switch
from covey.credentials import Credentials
from covey.credentials import Principal as Principal  # where it is named, for routes
from covey.errors import ApiError
from covey.orchestrator import Orchestrator
from covey.security import token_hash
from covey.sign_in import SESSION_COOKIE as SESSION_COOKIE  # where it is named, for routes
from covey.sign_in import SignIn

ORG_ROLES = ("org_admin", "agent_owner", "security", "auditor", "controlling")
MANAGE = ("org_admin", "agent_owner")
SECURITY = ("org_admin", "security")
KILLERS = ("org_admin", "agent_owner", "security")  # manage + security
# Whoever may pull some switch: a kill, or the global stop (covey.credentials keeps them).
SWITCH_PULLERS = (*KILLERS, "platform_admin")
AUDIT_READERS = ("org_admin", "security", "auditor")


def arrived(request: Request) -> float:
    """When the request reached the server (perf_counter), stamped by the app's middleware:
    the kill-stage metrics count from there, authentication included."""
    stamp = request.scope.get("covey.arrived")
    return float(stamp) if stamp is not None else time.perf_counter()


# Coroutines, however little they do: FastAPI runs a plain function dependency in its thread
# pool, and every request (a kill's too) waited for a worker thread and for the loop to hear
# back from it, behind whatever else held the pool and the GIL (issue 20).
async def orchestrator(request: Request) -> Orchestrator:
    orch: Orchestrator = request.app.state.orchestrator
    return orch


Orch = Annotated[Orchestrator, Depends(orchestrator)]


async def sign_in_lane(request: Request) -> SignIn:
    lane: SignIn = request.app.state.sign_in
    return lane


SignInLane = Annotated[SignIn, Depends(sign_in_lane)]


def _credential(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return request.cookies.get(SESSION_COOKIE)


def credential_hash(request: Request) -> str:
    """The hash of the credential the request came with (after current_principal took it)."""
    return token_hash(_credential(request) or "")


# Who a credential hash is (id, org_id, email, role) and for how many more seconds it holds
# (left_s; NULL for an API token): the request's caller and the event stream's recheck.
# What makes an API token valid is said again in covey.credentials.SWITCH_CALLERS_SQL: change
# both together.
CALLER_SQL = """
    SELECT h.id, h.org_id, h.email, h.role, c.left_s
    FROM (SELECT human_id, extract(epoch FROM expires_at - now())::float8 AS left_s
          FROM web_sessions WHERE token_hash=$1 AND expires_at > now()
          UNION ALL
          SELECT human_id, NULL FROM api_tokens WHERE token_hash=$1
          LIMIT 1) c
    JOIN humans h ON h.id = c.human_id
    """


async def credential_left_s(orch: Orchestrator, who: Principal, hashed: str) -> float | None:
    """For how many more seconds this credential holds for `who` as they were (same human,
    organisation and role): math.inf for an API token; None once it no longer does."""
    row = await orch.pool.fetchrow(CALLER_SQL, hashed, timeout=5)
    if row is None or (row["id"], row["org_id"], row["role"]) != (who.human_id, who.org_id,
                                                                   who.role):
        return None
    return math.inf if row["left_s"] is None else float(row["left_s"])


async def current_principal(request: Request, orch: Orch) -> Principal:
    credential = _credential(request)
    if not credential:
        raise ApiError(401, "Not signed in",
                       "POST /api/v1/auth/login, or send 'Authorization: Bearer <api token>'.")
    # Remembered while every change to it can be heard (covey.credentials): a kill does not
    # wait for its caller's look-up, nor a read add a statement to a busy database.
    credentials: Credentials = request.app.state.credentials
    hashed = token_hash(credential)
    if (who := credentials.get(hashed)) is not None:
        return who
    epoch = credentials.epoch
    # A switch's caller is looked up on the switches' lane: a kill must not queue for a
    # connection behind the reads it is meant to cut through.
    pool = orch.switch_pool if is_switch(request.method, request.url.path) else orch.pool
    row = await pool.fetchrow(CALLER_SQL, hashed)
    if row is None:
        raise ApiError(401, "Session expired or token unknown",
                       "Sign in again, or create a new API token.")
    who = Principal(row["id"], row["org_id"], row["email"], row["role"])
    credentials.remember(hashed, who, row["left_s"], epoch)
    return who


# The role checks, so that the OpenAPI document can say which routes answer 403.
ROLE_CHECKS: set[Callable[..., Any]] = set()


def require(*roles: str) -> Callable[..., Coroutine[Any, Any, Principal]]:
    async def dependency(
        who: Annotated[Principal, Depends(current_principal)],
    ) -> Principal:
        if who.role not in roles:
            raise ApiError(403, "Your role may not do this",
                           f"Allowed roles: {', '.join(roles)}; you are {who.role}.")
        return who

    ROLE_CHECKS.add(dependency)
    return dependency


AnyRole = Annotated[Principal, Depends(require(*ORG_ROLES))]
Manage = Annotated[Principal, Depends(require(*MANAGE))]
Security = Annotated[Principal, Depends(require(*SECURITY))]
Killer = Annotated[Principal, Depends(require(*KILLERS))]
OrgAdmin = Annotated[Principal, Depends(require("org_admin"))]
PlatformAdmin = Annotated[Principal, Depends(require("platform_admin"))]
AuditReader = Annotated[Principal, Depends(require(*AUDIT_READERS))]
Signed = Annotated[Principal, Depends(current_principal)]
