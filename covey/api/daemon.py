"""The control plane's side of the sandbox daemon protocol (DESIGN §2.4).

Envelope: {"type": ..., "payload": {...}}. The daemon dials out with its sandbox's
short-lived, single-use token and must first say `ready` naming its agent and sandbox.
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
from covey.orchestrator import LAYER_NAMES, GuardTripReport, Orchestrator, record
from covey.security import token_hash

log = structlog.get_logger(__name__)
router = APIRouter()

CLOSE_UNAUTHORIZED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_PROTOCOL = 4400
CLOSE_UNAVAILABLE = 4503
# Why a daemon says it stopped (coveyd.Stop): an obeyed kill, a lapsed lease, its own guard,
# a sleep, an error.
DAEMON_STOPS = ("kill", "lease", "guard", "sleep", "error")
# What a daemon is configured with when it takes up a session.
SESSION_CONFIG = ("SELECT s.id, s.state, a.org_id, a.model, a.budget_usd::float8 AS budget_usd,"
                  " a.max_turns, a.guard FROM sessions s JOIN agents a ON a.id=s.agent_id")


class ProtocolError(Exception):
    def __init__(self, error: str, hint: str) -> None:
        super().__init__(error)
        self.error = error
        self.hint = hint


class FatalProtocolError(ProtocolError):
    """Out of protocol in a way that ends the conversation: the daemon is lost at once."""


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


def _uuid(payload: dict[str, Any], key: str) -> UUID:
    try:
        return UUID(str(payload[key]))
    except (KeyError, ValueError):
        raise ProtocolError(f"payload.{key} missing or not a UUID", f"send {key} as a UUID string"
                            ) from None


def parse(text: str) -> tuple[str, dict[str, Any]]:
    try:
        message = json.loads(text)
    except ValueError:
        raise ProtocolError("Malformed JSON", 'send {"type": ..., "payload": {...}}') from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ProtocolError("Message without a type", 'send {"type": ..., "payload": {...}}')
    payload = message.get("payload", {})
    if not isinstance(payload, dict):
        raise ProtocolError("payload must be an object", 'send "payload": {...}')
    return message["type"], payload


async def _reject(ws: WebSocket, code: int, error: str, hint: str) -> None:
    await ws.send_text(json.dumps({"type": "error", "payload": {"error": error, "hint": hint}}))
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
        kind, payload = parse(await _receive_text(ws))
        if kind != "ready":
            raise ProtocolError("First message must be ready", "send ready with agent_id and "
                                "sandbox_id")
        agent_id, sandbox_id = _uuid(payload, "agent_id"), _uuid(payload, "sandbox_id")
    except ProtocolError as exc:
        with contextlib.suppress(RuntimeError, WebSocketDisconnect, OSError):
            await _reject(ws, CLOSE_PROTOCOL, exc.error, exc.hint)
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
    link = DaemonLink(session["id"], agent_id, ws)
    orch.hub.attach(link)
    why = "control channel closed"
    try:
        await _serve(orch, ws, link, dict(session))
    except (WebSocketDisconnect, WebSocketDisconnected):
        pass
    except FatalProtocolError as exc:
        why = f"protocol error: {exc.error}"
        with contextlib.suppress(RuntimeError, WebSocketDisconnect, OSError):
            await _reject(ws, CLOSE_PROTOCOL, exc.error, exc.hint)
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
    finally:
        orch.hub.detach(link.session_id)
    # Gone without `sleep` or `kill`, the daemon is lost and its work goes back to the
    # backlog (counted against daemon_retries). A no-op for a session already ended or killed.
    await through_outage(lambda: orch.session_lost(link.session_id, why), "session lost")
    await save_kill_confirmation(orch, link)


Heard = tuple[str, dict[str, Any]] | ProtocolError


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
            text = receiving.result()
            try:
                kind, payload = parse(text)
            except ProtocolError as exc:
                heard.put_nowait(exc)
                continue
            if kind == "kill_ack":
                orch.hub.acknowledge_kill(link.session_id)
            heard.put_nowait((kind, payload))
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
    with contextlib.suppress(ProtocolError):
        if parse(text)[0] == "kill_ack":
            orch.hub.acknowledge_kill(link.session_id)


async def _handle_in_order(orch: Orchestrator, link: DaemonLink,
                           heard: asyncio.Queue[Heard | None]) -> None:
    while (message := await heard.get()) is not None:
        try:
            if isinstance(message, ProtocolError):
                raise message
            await _handle(orch, link, *message)
        except ProtocolError as exc:
            await send_to(link, "error", {"error": exc.error, "hint": exc.hint})


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


async def _handle(orch: Orchestrator, link: DaemonLink, kind: str, payload: dict[str, Any]
                  ) -> None:
    if kind == "heartbeat":
        return
    if kind == "kill_ack":
        orch.hub.acknowledge_kill(link.session_id)  # first: the kill's answer waits on it
        await save_kill_confirmation(orch, link, _daemon_ns(payload.get("acked_ns")))
        await save_daemon_stop(orch, link, {"stop": "kill", **payload})
        return
    if kind == "stopping":
        await save_daemon_stop(orch, link, payload)
        return
    if kind == "event":
        await orch.pool.execute(
            "INSERT INTO recording_events (agent_id, session_id, kind, status, detail)"
            " VALUES ($1, $2, $3, $4, $5)",
            link.agent_id, link.session_id, str(payload.get("kind", "event"))[:64],
            str(payload.get("status", "info"))[:64], payload.get("detail", {}),
        )
        return
    if kind == "cost":
        usd, tokens = payload.get("usd"), payload.get("tokens", 0)
        if not isinstance(usd, int | float) or isinstance(usd, bool) or not math.isfinite(usd) \
                or usd < 0 or not isinstance(tokens, int) or tokens < 0:
            raise ProtocolError("cost needs a finite usd >= 0 and integer tokens >= 0",
                                'send {"usd": 0.0012, "tokens": 340}')
        async with orch.pool.acquire() as conn, conn.transaction():
            await conn.execute(
                "INSERT INTO cost_entries (agent_id, session_id, usd, tokens)"
                " VALUES ($1, $2, $3, $4)", link.agent_id, link.session_id, usd, tokens)
            await conn.execute("UPDATE sessions SET cost_usd=cost_usd+$2 WHERE id=$1",
                               link.session_id, usd)
        metrics.model_spend_usd.labels(str(link.agent_id)).inc(usd)
        metrics.model_tokens.labels(str(link.agent_id)).inc(tokens)
        return
    if kind == "blocked" and "trip" in payload:
        task_id = _uuid(payload, "task_id")
        fencing = payload.get("fencing_token")
        trip = GuardTripReport.parse(payload.get("reason"), payload.get("trip"))
        if trip is None or not isinstance(fencing, int) or isinstance(fencing, bool):
            raise ProtocolError("blocked with a trip needs fencing_token and trip.layer",
                                f"layers: {', '.join(LAYER_NAMES)}")
        why = await orch.guard_trip(link.session_id, task_id, fencing, trip)
        if why is not None:
            await send_to(link, "error", {"error": "Trip report rejected", "hint": why})
            return
        await send_to(link, "sleep", {"reason": "guard-trip"})
        return
    if kind in ("task_done", "blocked"):
        task_id = _uuid(payload, "task_id")
        fencing = payload.get("fencing_token")
        if not isinstance(fencing, int) or isinstance(fencing, bool):
            raise ProtocolError("fencing_token missing", "echo the token of assign_task")
        to_state = "done" if kind == "task_done" else "blocked"
        text = str(payload.get("result" if kind == "task_done" else "reason", ""))[:100_000]
        why = await orch.finish_task(link.session_id, task_id, fencing, to_state, text)
        if why is not None:
            await send_to(link, "error", {
                "error": "Result rejected", "hint": why, "task_id": str(task_id)})
            async with orch.pool.acquire() as conn:
                await record(conn, link.agent_id, link.session_id, "task", "rejected",
                             {"task_id": str(task_id), "why": why})
            return
        if kind == "blocked" and isinstance(payload.get("model_error"), dict):
            # The model endpoint refused (a model name, a key): the next task would meet the
            # same refusal. The session ends; the daemon says why in its last word.
            if await orch.end_session(link.session_id) == "sleep":
                await send_to(link, "sleep", {"reason": "model-error"})
            return
        await _assign_next(orch, link)
        return
    raise ProtocolError(f"Unknown message type {kind!r}",
                        "types: heartbeat, event, cost, task_done, blocked, kill_ack, stopping")


async def save_daemon_stop(orch: Orchestrator, link: DaemonLink, payload: dict[str, Any]
                           ) -> None:
    """The daemon's last word on why it stopped, kept on its session (the first word wins)."""
    stop = payload.get("stop")
    if stop not in DAEMON_STOPS:
        raise ProtocolError("stopping needs stop", f"stop: one of {', '.join(DAEMON_STOPS)}")
    link.last_word = str(stop)
    if link.stop_saved:  # the first word wins (the statement also keeps a stored one)
        return
    link.stop_saved = True
    detail = payload.get("detail")
    await orch.record_daemon_stop.write(
        link.session_id, stop, None if detail is None else str(detail)[:300])


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


def _daemon_ns(value: Any) -> int | None:
    """A daemon's wall-clock stamp in ns, or None: a kill_ack is never refused for it."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**63:
        return value
    return None


def _at(ns: int) -> datetime:
    return datetime.fromtimestamp(ns / 1e9, UTC)
