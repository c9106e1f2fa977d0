"""The control plane's side of the sandbox daemon protocol (DESIGN §2.4).

Envelope: {"type": ..., "payload": {...}}. The daemon dials out with its sandbox's
short-lived, single-use token and must first say `ready` naming its agent and sandbox.
Every frame is read by covey/protocol.py, against its schema, before it is handled here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import structlog
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from starlette.websockets import WebSocketDisconnected, WebSocketState

from covey import metrics
from covey.db import UNREACHABLE, through_outage
from covey.hub import DaemonLink, send_to
from covey.orchestrator import LAYER_NAMES, GuardTripReport, Orchestrator
from covey.protocol import (
    MESSAGES,
    Blocked,
    Cost,
    Event,
    FatalProtocolError,
    Frame,
    Heartbeat,
    KillAck,
    ProtocolError,
    Ready,
    Stopping,
    TaskDone,
    read_frame,
)
from covey.rows import record
from covey.security import token_hash

log = structlog.get_logger(__name__)
router = APIRouter()

CLOSE_UNAUTHORIZED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_PROTOCOL = 4400
CLOSE_UNAVAILABLE = 4503
CLOSE_INTERNAL = 1011
# What a daemon is configured with when it takes up a session.
SESSION_CONFIG = ("SELECT s.id, s.state, a.org_id, a.model, a.budget_usd::float8 AS budget_usd,"
                  " a.max_turns, a.guard FROM sessions s JOIN agents a ON a.id=s.agent_id")


async def _receive_text(ws: WebSocket) -> str:
    """The next text frame. A binary frame once crashed the handler (KeyError: 'text') and
    left a ready daemon's session running, its task in progress, until the stale sweep.

    A channel that is gone, however Starlette says so, is a WebSocketDisconnect: a daemon
    that vanished without a closing handshake once surfaced as Starlette's
    WebSocketDisconnected ("WebSocket is not connected", a RuntimeError), which skipped the
    loss of its session and left its work to the 15 s sweep."""
    if ws.client_state == WebSocketState.DISCONNECTED:
        raise WebSocketDisconnect(1006)
    try:
        message = await ws.receive()
    except WebSocketDisconnected:
        raise WebSocketDisconnect(1006) from None
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000))
    text = message.get("text")
    if text is None:
        raise FatalProtocolError("Binary frames are not part of the protocol",
                                 'send text frames of JSON: {"type": ..., "payload": {...}}')
    return str(text)


async def _reject(ws: WebSocket, code: int, error: str, hint: str, **more: Any) -> None:
    await ws.send_text(json.dumps({"type": "error", "payload": {
        "error": error, "hint": hint, **more}}))
    await ws.close(code)


def _token(ws: WebSocket) -> str | None:
    """The daemon token, from the Authorization header only: a token in the URL would end up
    in access logs and proxies' logs."""
    header = ws.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return None


async def _consume_token(orch: Orchestrator, token: str, agent_id: UUID, sandbox_id: UUID
                         ) -> tuple[int, str, str] | None:
    """Burn the token if it is valid for exactly this agent and sandbox; else say why.
    Nothing changes for a bad claim: the rightful daemon can still connect."""
    consumed = await orch.pool.fetchval(
        "UPDATE sandboxes SET token_used=true WHERE daemon_token_hash=$1 AND NOT token_used"
        " AND token_expires_at > now() AND id=$2 AND agent_id=$3 RETURNING id",
        token_hash(token), sandbox_id, agent_id,
    )
    if consumed is not None:
        return None
    row = await orch.pool.fetchrow(
        "SELECT id, agent_id, token_used, token_expires_at <= now() AS expired FROM sandboxes"
        " WHERE daemon_token_hash=$1",
        token_hash(token),
    )
    if row is None:
        return CLOSE_UNAUTHORIZED, "Unknown daemon token", "Use COVEY_DAEMON_TOKEN as given."
    if row["id"] != sandbox_id or row["agent_id"] != agent_id:
        return (CLOSE_FORBIDDEN, "This token belongs to another sandbox",
                "A daemon may only speak for the agent and sandbox it was started for.")
    if row["token_used"]:
        return (CLOSE_UNAUTHORIZED, "Daemon token already used",
                "Tokens are single-use; a replayed token is refused.")
    return CLOSE_UNAUTHORIZED, "Daemon token expired", "The sandbox must connect within its TTL."


@router.websocket("/api/daemon/ws")
async def daemon_ws(ws: WebSocket) -> None:
    orch: Orchestrator = ws.app.state.orchestrator
    await ws.accept()
    token = _token(ws)
    if not token:
        await _reject(ws, CLOSE_UNAUTHORIZED, "No daemon token",
                      "Send 'Authorization: Bearer <COVEY_DAEMON_TOKEN>'.")
        return
    try:
        hello = read_frame(await _receive_text(ws)).message
        if not isinstance(hello, Ready):
            raise ProtocolError("First message must be ready", "send ready with agent_id and "
                                "sandbox_id", "type")
        agent_id, sandbox_id = hello.agent_id, hello.sandbox_id
    except ProtocolError as exc:
        with contextlib.suppress(RuntimeError, WebSocketDisconnect, OSError):
            await _reject(ws, CLOSE_PROTOCOL, **exc.answer())
        return
    except (WebSocketDisconnect, WebSocketDisconnected):
        return
    refused = await _consume_token(orch, token, agent_id, sandbox_id)
    if refused is not None:
        await _reject(ws, *refused)
        return
    # A reused warm sandbox has had a session per wake: the daemon speaks for the newest.
    # (Picking whichever row came first once killed a fresh daemon for its sandbox's old,
    # ended session, as soon as that row was last written after the new one.)
    session = await orch.pool.fetchrow(
        f"{SESSION_CONFIG} WHERE s.sandbox_id=$1 ORDER BY s.started_at DESC, s.id DESC LIMIT 1",
        sandbox_id,
    )
    if session is None:  # the wake writes both rows in one transaction
        await _reject(ws, CLOSE_FORBIDDEN, "Sandbox has no session", "Start it through a wake.")
        return
    link = DaemonLink(session["id"], agent_id, ws, org_id=session["org_id"])
    orch.hub.attach(link)
    why = "control channel closed"
    try:
        await _serve(orch, ws, link, dict(session))
    except (WebSocketDisconnect, WebSocketDisconnected):
        pass
    except FatalProtocolError as exc:
        why = f"protocol error: {exc.error}"
        with contextlib.suppress(RuntimeError, WebSocketDisconnect, OSError):
            await _reject(ws, CLOSE_PROTOCOL, **exc.answer())
    except UNREACHABLE as exc:
        # A message whose write met a database outage (a game day restarted Postgres under
        # a working fleet): the handler once died with it, and the session stayed `running`
        # until the stale-session sweep. Its effect is lost, so the channel is too: the
        # daemon stops by its lease, and its work goes back to the backlog below.
        why = f"database unreachable: {type(exc).__name__}"
        with contextlib.suppress(RuntimeError, WebSocketDisconnect, OSError):
            await _reject(ws, CLOSE_UNAVAILABLE, "Database unreachable",
                          "The control plane cannot record this daemon's messages until its "
                          "database is back; the agent is woken again then.")
    except Exception as exc:
        # A bug of ours in handling a frame the boundary let through: the daemon is lost (its
        # work back in the backlog, counted), never a crashed handler that leaves its session
        # running until the stale sweep.
        log.exception("daemon message failed", session_id=str(link.session_id))
        why = f"internal error: {type(exc).__name__}"
        with contextlib.suppress(RuntimeError, WebSocketDisconnect, OSError):
            await _reject(ws, CLOSE_INTERNAL, "Internal error",
                          "This is a bug in covey; the control plane's log has the trace. "
                          "The task goes back to the backlog.")
    finally:
        orch.hub.detach(link.session_id)
    # Gone without `sleep` or `kill`, the daemon is lost and its work goes back to the
    # backlog (counted against daemon_retries). A no-op for a session already ended or killed.
    await through_outage(lambda: orch.session_lost(link.session_id, why), "session lost")
    await save_kill_confirmation(orch, link)


Heard = Frame | ProtocolError


async def _serve(orch: Orchestrator, ws: WebSocket, link: DaemonLink,
                 session: dict[str, Any]) -> None:
    """Hear the daemon and handle what it says, in the order it said it. Its `kill_ack`
    counts the moment it is heard: a kill's answer waits for it, and under Locust load the
    messages ahead of it (events and costs, a database write each, queued for a pooled
    connection behind the operators' reads) once held it back for seconds after the daemon
    had stopped. Its records are written in order all the same."""
    await _take_up(orch, link, session)
    heard: asyncio.Queue[Heard | None] = asyncio.Queue()
    handling = asyncio.ensure_future(_handle_in_order(orch, link, heard))
    receiving: asyncio.Future[str] | None = None
    try:
        while True:
            # Read while watching the handling: when it fails (a write met a database
            # outage), its error ends the channel now, not when the daemon next speaks (a
            # quiet daemon's next heartbeat is seconds away, its session live meanwhile).
            receiving = asyncio.ensure_future(_receive_text(ws))
            await asyncio.wait((receiving, handling), return_when=asyncio.FIRST_COMPLETED)
            if handling.done():
                if receiving.done() and not receiving.cancelled() and (
                        receiving.exception() is None):
                    _heard_ack(orch, link, receiving.result())  # the kill's answer counts it
                break
            frame = _hear(receiving.result())
            if frame.kind == "kill_ack":  # obeyed, whatever else its payload says
                orch.hub.acknowledge_kill(link.session_id)
            heard.put_nowait(frame)
    except asyncio.CancelledError:
        handling.cancel()
        raise
    finally:
        if receiving is not None and not receiving.done():
            receiving.cancel()  # the handling's error ends the channel
        elif receiving is not None and not receiving.cancelled():
            receiving.exception()  # seen by the loop above, or moot beside that error
        # What the daemon said before it hung up is still handled: a task's result, its
        # kill's confirmation.
        heard.put_nowait(None)
        await handling


def _heard_ack(orch: Orchestrator, link: DaemonLink, text: str) -> None:
    """A frame read just as the channel ends: if it is the daemon's `kill_ack`, the kill is
    acknowledged (not merely hung up on), as it would have been a moment earlier."""
    if _hear(text).kind == "kill_ack":
        orch.hub.acknowledge_kill(link.session_id)


def _hear(text: str) -> Heard:
    """The frame as the boundary reads it: checked, or refused with what is wrong."""
    try:
        return read_frame(text)
    except ProtocolError as exc:
        return exc


async def _handle_in_order(orch: Orchestrator, link: DaemonLink,
                           heard: asyncio.Queue[Heard | None]) -> None:
    while (message := await heard.get()) is not None:
        try:
            if isinstance(message, ProtocolError):
                raise message
            await _handle(orch, link, message.kind, message)
        except ProtocolError as exc:
            await send_to(link, "error", exc.answer())
            if exc.kind in ("task_done", "blocked"):
                await _result_refused(orch, link, exc)


async def _result_refused(orch: Orchestrator, link: DaemonLink, exc: ProtocolError) -> None:
    """A task's result the boundary refused is a result lost: the task the session holds is
    put back at once (its daemon, its run over, would otherwise wait for a next task with
    the task in progress), and the daemon gets its next task, or sleeps."""
    why = f"its {exc.kind} was refused: {exc.error}" + (
        f" ({exc.field})" if exc.field else "")
    if await orch.result_refused(link.session_id, why):
        await _assign_next(orch, link)


async def hand_over(orch: Orchestrator, link: DaemonLink) -> None:
    """A warm sandbox's idle daemon takes up the session its link now speaks for."""
    session = await orch.pool.fetchrow(f"{SESSION_CONFIG} WHERE s.id=$1", link.session_id)
    if session is not None:
        await _take_up(orch, link, dict(session))


async def _take_up(orch: Orchestrator, link: DaemonLink, session: dict[str, Any]) -> None:
    if session["state"] not in ("starting", "running"):
        # Killed between the wake and this connection.
        await orch.hub.send_kill(link.session_id)
    else:
        await send_to(link, "inject_config", {
            "agent_id": str(link.agent_id),
            "org_id": str(session["org_id"]),
            "session_id": str(link.session_id),
            "guard": session["guard"],
            "model": session["model"],
            "budget_usd": session["budget_usd"],
            "max_turns": session["max_turns"],
            "lease_ms": orch.settings.lease_ms,
        })
        await orch.renew_leases([link.session_id])  # with the tool scopes stopped now
        await _assign_next(orch, link)


async def _assign_next(orch: Orchestrator, link: DaemonLink) -> None:
    task = await orch.claim_next(link.session_id)
    if task is not None:
        await send_to(link, "assign_task", {
            "task_id": str(task["id"]),
            "fencing_token": task["claim_token"],
            "title": task["title"],
            "body": task["body"],
            "origin": task["origin"],
        })
    elif await orch.end_session(link.session_id) == "sleep":  # a warm one parks, idle
        await send_to(link, "sleep", {})


async def _handle(orch: Orchestrator, link: DaemonLink, kind: str, frame: Frame) -> None:
    message = frame.message
    if frame.cleaned:
        # What the boundary changed (a model's NUL in its result, a detail cut), on record
        # before the message's own effect.
        async with orch.pool.acquire() as conn:
            await record(conn, link.agent_id, link.session_id, "protocol", "cleaned", {
                "type": kind, "cleaned": list(frame.cleaned),
                **({"task_id": str(message.task_id)}
                   if isinstance(message, TaskDone | Blocked) else {})})
    if isinstance(message, Heartbeat):
        return
    if isinstance(message, KillAck):
        orch.hub.acknowledge_kill(link.session_id)  # first: the kill's answer waits on it
        await save_kill_confirmation(orch, link, _daemon_ns(message.acked_ns))
        await save_daemon_stop(orch, link, message.stop, message.detail, message.cut)
        return
    if isinstance(message, Stopping):
        await save_daemon_stop(orch, link, message.stop, message.detail, message.cut)
        return
    if isinstance(message, Event):
        await orch.record_event.write(link.agent_id, link.session_id, message.kind,
                                      message.status, message.detail)
        return
    if isinstance(message, Cost):
        await orch.record_cost.write(link.agent_id, link.session_id, message.usd,
                                     message.tokens)
        metrics.model_spend_usd.labels(str(link.agent_id)).inc(message.usd)
        metrics.model_tokens.labels(str(link.agent_id)).inc(message.tokens)
        return
    if isinstance(message, Blocked) and message.trip is not None:
        trip = GuardTripReport.parse(message.reason, message.trip)
        if trip is None:  # the boundary checked the layer; this is the parse's own word
            raise ProtocolError("Invalid blocked message", f"payload.trip.layer: one of "
                                f"{', '.join(LAYER_NAMES)}", "payload.trip", kind)
        why = await orch.guard_trip(link.session_id, message.task_id, message.fencing_token,
                                    trip)
        if why is not None:
            await send_to(link, "error", {"error": "Trip report rejected", "hint": why})
            return
        await send_to(link, "sleep", {"reason": "guard-trip"})
        return
    if isinstance(message, TaskDone | Blocked):
        to_state = "done" if isinstance(message, TaskDone) else "blocked"
        text = message.result if isinstance(message, TaskDone) else message.reason
        why = await orch.finish_task(link.session_id, message.task_id, message.fencing_token,
                                     to_state, text)
        if why is not None:
            await send_to(link, "error", {
                "error": "Result rejected", "hint": why, "task_id": str(message.task_id)})
            async with orch.pool.acquire() as conn:
                await record(conn, link.agent_id, link.session_id, "task", "rejected",
                             {"task_id": str(message.task_id), "why": why})
            return
        if isinstance(message, Blocked) and isinstance(message.model_error, dict):
            # The model endpoint refused (a model name, a key): the next task would meet the
            # same refusal. The session ends; the daemon says why in its last word.
            if await orch.end_session(link.session_id) == "sleep":
                await send_to(link, "sleep", {"reason": "model-error"})
            return
        await _assign_next(orch, link)
        return
    # `ready` is said once, first.
    raise ProtocolError(f"Unexpected message type {kind!r}",
                        f"after ready: {', '.join(t for t in MESSAGES if t != 'ready')}",
                        "type", kind)


async def save_daemon_stop(orch: Orchestrator, link: DaemonLink, stop: str,
                           detail: str | None, cut: Any = None) -> None:
    """The daemon's last word on why it stopped, kept on its session (the first word wins)."""
    link.last_word = stop
    if link.stop_saved:  # the first word wins (the statement also keeps a stored one)
        return
    link.stop_saved = True
    await orch.record_daemon_stop.write(link.session_id, stop, detail, _tool_cut(cut))


async def save_kill_confirmation(orch: Orchestrator, link: DaemonLink,
                                 acked_ns: int | None = None) -> None:
    """How the kill sent to this daemon was confirmed, on its session; once. `acked_ns`:
    when the daemon says it acknowledged, on its own clock (kept only with a `kill_ack`)."""
    if link.kill_sent_ns is None or link.kill_confirmed_ns is None or link.confirmation_saved:
        return
    acked = acked_ns if link.kill_confirmed_by == "kill_ack" else None
    # Saved only once written: a write lost to a database outage is tried again, and again
    # when the daemon hangs up (the session's kill evidence must not be lost with it).
    await through_outage(lambda: orch.record_kill_confirmation.write(
        link.session_id, _at(link.kill_sent_ns or 0), _at(link.kill_confirmed_ns or 0),
        link.kill_confirmed_by, None if acked is None else _at(acked)), "kill confirmation")
    link.confirmation_saved = True


def _tool_cut(value: Any) -> dict[str, Any] | None:
    """What the daemon says its stop cut (coveyd's ToolCut), kept small and of known keys:
    untrusted input, never a reason to refuse its last word."""
    if not isinstance(value, dict):
        return None
    tool = value.get("tool")
    cut: dict[str, Any] = {"tool": str(tool)[:64] if tool is not None else None}
    for key in ("pid", "pgid", "processes_killed"):
        n = value.get(key)
        cut[key] = n if isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**31 \
            else None
    ran = value.get("ran_ms")
    cut["ran_ms"] = float(ran) if isinstance(ran, int | float) and not isinstance(ran, bool) \
        and math.isfinite(ran) and ran >= 0 else None
    gone = value.get("all_gone")
    cut["all_gone"] = gone if isinstance(gone, bool) else None
    return cut


def _daemon_ns(value: Any) -> int | None:
    """A daemon's wall-clock stamp in ns, or None: a kill_ack is never refused for it."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**63:
        return value
    return None


def _at(ns: int) -> datetime:
    return datetime.fromtimestamp(ns / 1e9, UTC)
