"""Sign-in with a session cookie, API tokens for automation, members and organisations."""

from __future__ import annotations

import asyncio
from uuid import UUID, uuid4

import asyncpg
from fastapi import APIRouter, Request, Response, status

from covey.api.deps import Orch, OrgAdmin, PlatformAdmin, Signed, SignInLane
from covey.api.models import LoginIn, MemberIn, MeOut, OrgIn, OrgOut, TokenIn, TokenOut
from covey.db import Connection
from covey.errors import ApiError
from covey.rows import audit
from covey.security import hash_password, new_token, token_hash
from covey.sign_in import client_address

router = APIRouter(prefix="/api/v1", tags=["auth"])


@router.post("/auth/login", response_model=MeOut,
             responses={401: {"description": "Wrong email or password"},
                        429: {"description": "Too many failed sign-ins for this account or "
                                             "from this address, or too many at once: retry "
                                             "after the `Retry-After` seconds"}})
async def login(body: LoginIn, request: Request, response: Response,
                lane: SignInLane) -> MeOut:
    """Sign in; the session cookie lasts 12 hours (`Secure` over TLS). Failed attempts are
    limited per account and per address (covey.sign_in)."""
    row = await lane.verify(body.email, body.password, client_address(request))
    lane.set_cookie(response, request, await lane.start_session(row["id"]))
    return MeOut(id=row["id"], org_id=row["org_id"], email=row["email"], role=row["role"])


@router.post("/auth/logout", status_code=status.HTTP_204_NO_CONTENT)
async def logout(who: Signed, request: Request, response: Response, orch: Orch,
                 lane: SignInLane) -> None:
    """End every web session of the caller; their event streams end with them."""
    await orch.pool.execute("DELETE FROM web_sessions WHERE human_id=$1", who.human_id)
    # Refused here from the next request on, not once the trigger's announcement is back.
    request.app.state.credentials.changed(who.human_id)
    lane.clear_cookie(response, request)


@router.get("/auth/me", response_model=MeOut)
async def me(who: Signed) -> MeOut:
    return MeOut(id=who.human_id, org_id=who.org_id, email=who.email, role=who.role)


@router.post("/auth/tokens", response_model=TokenOut, status_code=201)
async def create_token(body: TokenIn, who: Signed, orch: Orch) -> TokenOut:
    """An API token for automation, acting as the signed-in human. Shown once."""
    token = new_token("cvt")
    await orch.pool.execute(
        "INSERT INTO api_tokens (token_hash, human_id, name) VALUES ($1, $2, $3)",
        token_hash(token), who.human_id, body.name,
    )
    return TokenOut(name=body.name, token=token)


async def insert_human(conn: Connection, org_id: UUID, email: str, password: str,
                       role: str) -> UUID:
    human_id = uuid4()
    password_hash = await asyncio.to_thread(hash_password, password)  # off the loop, as above
    try:
        await conn.execute(
            "INSERT INTO humans (id, org_id, email, password_hash, role)"
            " VALUES ($1, $2, $3, $4, $5)",
            human_id, org_id, email.lower(), password_hash, role,
        )
    except asyncpg.UniqueViolationError:
        raise ApiError(409, "That email is already taken",
                       "Each human has one account; use another email.") from None
    return human_id


@router.post("/members", response_model=MeOut, status_code=201,
             responses={409: {"description": "That email is already taken"}})
async def add_member(body: MemberIn, who: OrgAdmin, orch: Orch) -> MeOut:
    async with orch.pool.acquire() as conn, conn.transaction():
        human_id = await insert_human(conn, who.org_id, body.email, body.password, body.role)
        await audit(conn, who.org_id, who.human_id, "member.add", str(human_id),
                    {"role": body.role})
    return MeOut(id=human_id, org_id=who.org_id, email=body.email.lower(), role=body.role)


async def create_org(conn: Connection, name: str, admin_email: str, admin_password: str
                     ) -> tuple[UUID, UUID]:
    org_id = uuid4()
    try:
        await conn.execute("INSERT INTO organizations (id, name) VALUES ($1, $2)", org_id, name)
    except asyncpg.UniqueViolationError:
        raise ApiError(409, "An organisation of that name exists",
                       "Pick another name.") from None
    admin_id = await insert_human(conn, org_id, admin_email, admin_password, "org_admin")
    return org_id, admin_id


@router.post("/platform/orgs", response_model=OrgOut, status_code=201,
             responses={409: {"description": "An organisation of that name or that admin"
                                             " email exists"}})
async def add_org(body: OrgIn, who: PlatformAdmin, orch: Orch) -> OrgOut:
    async with orch.pool.acquire() as conn, conn.transaction():
        org_id, admin_id = await create_org(conn, body.name, body.admin_email,
                                            body.admin_password)
        await audit(conn, org_id, who.human_id, "org.create", str(org_id), {"name": body.name})
    return OrgOut(id=org_id, name=body.name, admin_id=admin_id)
