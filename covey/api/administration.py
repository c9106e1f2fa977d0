"""GET /administration: where the switch lives, for the humans who may pull it.

Server-rendered (Jinja2), one small script served by the app itself, so that the page's
content security policy can forbid every inline script. Form posts carry a CSRF token bound
to the session (the session cookie is HttpOnly and SameSite=Strict as well); a role that may
not act sees no button and gets a 403 if it posts anyway. Every action goes through the same
orchestrator calls as the API, so it lands in the audit log with who, what and why.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from importlib import resources
from typing import Any
from urllib.parse import parse_qs
from uuid import UUID

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from jinja2 import Environment, PackageLoader, select_autoescape

from covey.api.agents import AGENT_COLUMNS, AGENT_JOINS, kill_out
from covey.api.deps import (
    KILLERS,
    SECURITY,
    SESSION_COOKIE,
    Principal,
    arrived,
    current_principal,
    sign_in_lane,
)
from covey.errors import ApiError
from covey.orchestrator import Orchestrator
from covey.sign_in import client_address
from covey.switches import KillReport

router = APIRouter(prefix="/administration", include_in_schema=False)
switches = APIRouter(prefix="/administration", include_in_schema=False)  # first (covey.app)
LOGIN_CSRF_COOKIE = "covey_login_csrf"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self';"
       " img-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
_templates = Environment(loader=PackageLoader("covey", "templates"),
                         autoescape=select_autoescape(["html"]))
STATIC = {"admin.js": "text/javascript", "admin.css": "text/css",
          "favicon.svg": "image/svg+xml"}
# Outside the page's prefix: a browser asks for /favicon.ico by itself (a 404 there was the
# page's one console error).
icon_router = APIRouter(include_in_schema=False)
ATTENTION_ROWS = 20


def csrf_token(session_token: str) -> str:
    """Bound to the session: a page of another session, or no page at all, has no token."""
    return hashlib.sha256(f"csrf:{session_token}".encode()).hexdigest()


def page_headers(csp: str = CSP) -> dict[str, str]:
    """The headers of every page the app renders (this one's and /docs): no framing, no
    sniffing, no caching, no referrer beyond the app."""
    return {"Content-Security-Policy": csp, "X-Frame-Options": "DENY",
            "Cache-Control": "no-store", "Referrer-Policy": "same-origin",
            "X-Content-Type-Options": "nosniff"}


def _page(html: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(html, status, headers=page_headers())


def _refusal(status: int, error: str, hint: str, request: Request) -> Response:
    if "application/json" in request.headers.get("accept", ""):
        return JSONResponse({"error": error, "hint": hint}, status)
    return _page(_templates.get_template("refused.html").render(error=error, hint=hint), status)


async def _form(request: Request) -> dict[str, str]:
    try:
        fields = parse_qs((await request.body()).decode("utf-8", "replace"),
                          max_num_fields=20)
    except ValueError:  # more fields than any form of the page has: not from the page
        raise ApiError(400, "Too many form fields",
                       "The page's forms have a few fields each; post one of them.") from None
    return {k: v[0] for k, v in fields.items() if v and "\x00" not in v[0]}


async def _who(request: Request) -> Principal | None:
    try:
        return await current_principal(request, request.app.state.orchestrator)
    except ApiError:
        return None


async def attention(orch: Orchestrator, org_id: UUID) -> dict[str, list[dict[str, Any]]]:
    """What an on-call engineer must look at beside the switch: tasks that ended failed or
    blocked, and the guard's trips, newest first, each with its reason."""
    tasks = await orch.pool.fetch(
        "SELECT t.id, t.agent_id, a.slug, t.title, t.state, t.result, t.updated_at"
        " FROM backlog_tasks t JOIN agents a ON a.id=t.agent_id"
        " WHERE t.org_id=$1 AND t.state IN ('failed','blocked')"
        f" ORDER BY t.updated_at DESC LIMIT {ATTENTION_ROWS}", org_id)
    trips = await orch.pool.fetch(
        "SELECT s.id, s.agent_id, a.slug, s.stop_layer, s.stop_reason, s.ended_at"
        " FROM sessions s JOIN agents a ON a.id=s.agent_id"
        " WHERE a.org_id=$1 AND s.state='tripped'"
        f" ORDER BY s.ended_at DESC NULLS LAST LIMIT {ATTENTION_ROWS}", org_id)
    return {
        "failed_tasks": [{"task_id": str(t["id"]), "agent_id": str(t["agent_id"]),
                          "agent": t["slug"], "title": t["title"], "state": t["state"],
                          "reason": t["result"] or "no reason was given",
                          "at": t["updated_at"].isoformat(timespec="seconds")}
                         for t in tasks],
        "guard_trips": [{"session_id": str(r["id"]), "agent_id": str(r["agent_id"]),
                         "agent": r["slug"], "layer": r["stop_layer"] or "guard",
                         "reason": r["stop_reason"] or "no reason was given",
                         "at": r["ended_at"].isoformat(timespec="seconds")
                         if r["ended_at"] else ""}
                        for r in trips]}


async def stop_summary(orch: Orchestrator, report: KillReport) -> dict[str, Any]:
    """What a stop did, for the page to say after it (not only "Done."): the kill's answer
    (as the API gives it) and, per session it cancelled, how its daemon confirmed."""
    answer = kill_out(report).model_dump(mode="json")
    slugs: dict[UUID, str] = {r["id"]: r["slug"] for r in await orch.pool.fetch(
        "SELECT s.id, a.slug FROM sessions s JOIN agents a ON a.id=s.agent_id"
        " WHERE s.id = ANY($1::uuid[])", report.sessions_cancelled)}
    acked, torn, confirmed = (set(report.kill_acknowledged), set(report.kill_torn_down),
                              set(report.kill_confirmed))
    unconnected = set(report.kill_unconnected)
    answer["daemons"] = [
        {"session_id": str(s), "agent": slugs.get(s, ""),
         "answer": "acknowledged the kill" if s in acked
         else "had not connected yet: its sandbox was torn down" if s in unconnected
         else "did not acknowledge in time: its sandbox was torn down" if s in torn
         else "hung up (confirmed, not acknowledged)" if s in confirmed
         else "not confirmed yet (no daemon answered before this reply)"}
        for s in report.sessions_cancelled]
    return answer


def _reason_required(form: dict[str, str], request: Request) -> Response | None:
    if _reason(form) is None:
        return _refusal(400, "A reason is required to stop agents",
                        "Say why in the confirmation's reason field; it goes into the audit "
                        "log and the notification.", request)
    return None


@router.get("/attention")
async def attention_now(request: Request) -> Response:
    """The failed tasks and guard trips, for the page's live refresh."""
    who = await _who(request)
    if who is None or request.cookies.get(SESSION_COOKIE) is None:
        return JSONResponse({"error": "Not signed in",
                             "hint": "Sign in on /administration first."}, 401)
    return JSONResponse(await attention(request.app.state.orchestrator, who.org_id),
                        headers={"Cache-Control": "no-store"})


@router.get("", response_class=HTMLResponse)
async def administration(request: Request) -> Response:
    orch: Orchestrator = request.app.state.orchestrator
    who = await _who(request)
    if who is None or request.cookies.get(SESSION_COOKIE) is None:
        token = secrets.token_urlsafe(24)
        page = _page(_templates.get_template("login.html").render(csrf=token,
                                                                  failed="failed" in
                                                                  request.query_params))
        page.set_cookie(LOGIN_CSRF_COOKIE, token, httponly=True, samesite="strict",
                        path="/administration")
        return page
    fleet = await orch.pool.fetchrow(
        "SELECT o.name, o.fleet_killed, o.fleet_killed_at, o.fleet_killed_reason,"
        " (SELECT email FROM humans WHERE id=o.fleet_killed_by) AS fleet_killed_by,"
        " EXISTS (SELECT 1 FROM kill_flags WHERE scope='global') AS global_stop"
        " FROM organizations o WHERE o.id=$1", who.org_id)
    agents = await orch.pool.fetch(
        f"SELECT {AGENT_COLUMNS} {AGENT_JOINS} WHERE a.org_id=$1 ORDER BY a.slug", who.org_id)
    tools = await orch.pool.fetch(
        "SELECT tool, agent_id, reason FROM kill_flags WHERE scope='tool' AND org_id=$1"
        " ORDER BY tool", who.org_id)
    html = _templates.get_template("administration.html").render(
        who=who, fleet=fleet, agents=agents, tools=tools,
        attention=await attention(orch, who.org_id),
        csrf=csrf_token(request.cookies[SESSION_COOKIE]),
        may_pull_fleet=who.role in SECURITY, may_kill=who.role in KILLERS)
    return _page(html)


@router.post("/login")
async def login(request: Request) -> Response:
    form = await _form(request)
    expected = request.cookies.get(LOGIN_CSRF_COOKIE, "")
    if not expected or not hmac.compare_digest(form.get("csrf", ""), expected):
        return _refusal(403, "The sign-in form has expired",
                        "Open /administration again and sign in from there.", request)
    lane = await sign_in_lane(request)
    try:  # the API's sign-in, its limits included: this is the same door
        row = await lane.verify(form.get("email", ""), form.get("password", ""),
                                client_address(request))
    except ApiError as exc:
        if exc.status != 429:
            return RedirectResponse("/administration?failed=1", 303)
        refusal = _refusal(429, exc.error, exc.hint, request)
        refusal.headers.update(exc.headers or {})
        return refusal
    response = RedirectResponse("/administration", 303)
    lane.set_cookie(response, request, await lane.start_session(row["id"]))
    response.delete_cookie(LOGIN_CSRF_COOKIE, path="/administration")
    return response


async def _acting(request: Request, roles: tuple[str, ...]
                  ) -> tuple[Principal, dict[str, str]] | Response:
    """The caller, if signed in with a session, holding the page's CSRF token and a role
    that may do this; else the refusal to send."""
    who = await _who(request)
    session = request.cookies.get(SESSION_COOKIE)
    if who is None or session is None:
        return _refusal(401, "Not signed in", "Sign in on /administration first.", request)
    form = await _form(request)
    if not hmac.compare_digest(form.get("csrf", ""), csrf_token(session)):
        return _refusal(403, "Missing or wrong CSRF token",
                        "Act from the /administration page itself; reload it first.", request)
    if who.role not in roles:
        return _refusal(403, "Your role may not do this",
                        f"Allowed roles: {', '.join(roles)}; you are {who.role}.", request)
    return who, form


def _done(request: Request, result: dict[str, Any]) -> Response:
    if "application/json" in request.headers.get("accept", ""):
        return JSONResponse(result)
    return RedirectResponse("/administration", 303)


def _reason(form: dict[str, str]) -> str | None:
    return form.get("reason", "").strip()[:500] or None


@switches.post("/fleet/kill")
async def kill_fleet(request: Request) -> Response:
    acting = await _acting(request, SECURITY)
    if isinstance(acting, Response):
        return acting
    who, form = acting
    refused = _reason_required(form, request)
    if refused is not None:
        return refused
    orch: Orchestrator = request.app.state.orchestrator
    report = await orch.kill_fleet(who.org_id, who.human_id, started=arrived(request),
                                   reason=_reason(form))
    return _done(request, {"fleet_killed": True, **await stop_summary(orch, report)})


@router.post("/fleet/resume")
async def resume_fleet(request: Request) -> Response:
    acting = await _acting(request, SECURITY)
    if isinstance(acting, Response):
        return acting
    who, form = acting
    report = await request.app.state.orchestrator.resume_fleet(
        who.org_id, who.human_id, reason=_reason(form))
    return _done(request, {"fleet_killed": False, "agents_woken": len(report.agents_woken)})


@switches.post("/agents/{agent_id}/{action}")
async def agent_switch(agent_id: str, action: str, request: Request) -> Response:
    acting = await _acting(request, KILLERS)
    if isinstance(acting, Response):
        return acting
    who, form = acting
    orch: Orchestrator = request.app.state.orchestrator
    try:
        target = UUID(agent_id)
    except ValueError:
        target = None
    if target is None or action not in ("kill", "resume"):
        return _refusal(404, "No such agent or action", "Use the page's buttons.", request)
    if action == "kill":
        refused = _reason_required(form, request)
        if refused is not None:
            return refused
        killed = await orch.kill_agent(who.org_id, target, who.human_id,
                                       started=arrived(request), reason=_reason(form))
        if killed is None:
            return _refusal(404, "No such agent", "It may have been removed; reload.", request)
        return _done(request, {"agent_id": agent_id, "action": action,
                               **await stop_summary(orch, killed)})
    found = await orch.resume_agent(who.org_id, target, who.human_id, reason=_reason(form))
    if found is None:
        return _refusal(404, "No such agent", "It may have been removed; reload.", request)
    return _done(request, {"agent_id": agent_id, "action": action})


@router.post("/logout")
async def logout(request: Request) -> Response:
    acting = await _acting(request, (*KILLERS, "auditor", "controlling", "platform_admin"))
    if isinstance(acting, Response):
        return acting
    who, _ = acting
    await request.app.state.orchestrator.pool.execute(
        "DELETE FROM web_sessions WHERE human_id=$1", who.human_id)
    request.app.state.credentials.changed(who.human_id)  # as the API's logout does
    response = RedirectResponse("/administration", 303)
    (await sign_in_lane(request)).clear_cookie(response, request)
    return response


@router.get("/static/{name}")
async def static(name: str) -> Response:
    if name not in STATIC:
        return JSONResponse({"error": "Not found", "hint": "No such file."}, 404)
    body = resources.files("covey").joinpath("static", name).read_bytes()
    return Response(body, media_type=STATIC[name], headers={"Cache-Control": "no-cache",
                                                            "X-Content-Type-Options": "nosniff"})


@icon_router.get("/favicon.ico")
async def favicon() -> Response:
    return await static("favicon.svg")
