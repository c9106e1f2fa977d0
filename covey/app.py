"""The control plane as an ASGI app: routes, the LISTEN connection, the scheduler loops."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any
from uuid import UUID

import asyncpg
import structlog
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from covey import __version__, errors, metrics
from covey.admission import ReadAdmission
from covey.api import (
    administration,
    agents,
    audit,
    auth,
    daemon,
    docs,
    flags,
    fleet,
    notifications,
    trigger,
)
from covey.api.deps import SWITCH_PULLERS, AnyRole, Orch, credential_hash, credential_left_s
from covey.api.openapi import document
from covey.config import Settings
from covey.cpu_group import make_cpu_group
from covey.credentials import SWITCH_CALLERS_EVERY_S, Credentials, keep_switch_callers
from covey.db import create_pool, migrate
from covey.embedded_postgres import EmbeddedPostgres, attach, release
from covey.events import EventStream
from covey.hub import DaemonHub
from covey.orchestrator import Orchestrator
from covey.outage import HEALTH_TIMEOUT_S, DatabaseProbe, OutageDeadline
from covey.sandbox import DockerProvider, ProcessProvider, Runner, SandboxProvider
from covey.sign_in import SignIn
from covey.switches import install_flags

log = structlog.get_logger(__name__)

# The switches' routes, included first: FastAPI tries an app's routes in order, and the agent
# kill came after 36 others, 0.06 ms of its way to the daemon. covey.admission.is_switch says
# which requests are switches; tests/test_admission.py holds the two together.
SWITCH_ROUTERS = (agents.switches, fleet.switches, flags.switches, administration.switches)
ROUTERS = (auth.router, agents.router, fleet.router, flags.router, trigger.router,
           notifications.router, daemon.router, administration.router, audit.router,
           docs.router, administration.icon_router)


class BodyLimit:
    """Refuse bodies over the limit with 413 before a handler sees them. A body without a
    Content-Length is read up to the limit first, then handed on whole. Also stamps each
    request's arrival, the origin of the kill-stage metrics."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope["covey.arrived"] = time.perf_counter()
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self.max_bytes:
                await self._too_large(send)
                return
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        body = json.dumps(errors.error_body(
            "Request body too large", f"Send at most {self.max_bytes} bytes.")).encode()
        # No "Connection: close": uvicorn drains the unread rest of the body and keeps the
        # connection, and a client still sending it would otherwise be cut off mid-request.
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


def _shutting_down() -> bool:
    """Whether the running task is being cancelled."""
    current = asyncio.current_task()
    return current is None or current.cancelling() > 0


async def _every(seconds: float, name: str, step: Callable[[], Awaitable[None]]) -> None:
    """Run step on a fixed cadence; a failure is logged and the loop goes on. Only the
    loop's own cancellation (the plane's shutdown) ends it, whatever a step makes of it: a
    task the step awaits that was cancelled on its own is one step's failure. The
    scheduler's tick once awaited its wakes through `asyncio.gather`, and a cancelled wake
    raised CancelledError into the tick: its loop ended without a word, and no heartbeat,
    sweep or wake of open work came again (a lifecycle test's task stayed open for a
    minute once a wake's start was cut)."""
    while True:
        try:
            await step()
        except asyncio.CancelledError:
            if _shutting_down():
                raise
            log.warning("loop step failed", loop=name, error="a task it awaited was cancelled")
        except Exception as exc:
            if _shutting_down():  # the cancellation, turned into an error on its way out
                raise asyncio.CancelledError() from exc
            log.warning("loop step failed", loop=name, error=str(exc))
        await asyncio.sleep(seconds)


class Listener:
    """One dedicated connection LISTENing for wakes, kills and events; reconnects if lost."""

    def __init__(self, url: str, orch: Orchestrator, events: EventStream,
                 credentials: Credentials) -> None:
        self.url = url
        self.orch = orch
        self.events = events
        self.credentials = credentials
        self.ready = asyncio.Event()

    def _on_notify(self, _conn: Any, _pid: int, channel: str, payload: object) -> None:
        payload = str(payload)
        if channel == "covey_wake":
            with contextlib.suppress(ValueError):
                self.orch.wake_notified(UUID(payload))
        elif channel == "covey_kill":
            with contextlib.suppress(ValueError):
                ids = [UUID(p) for p in payload.split(",") if p]
                self.orch.spawn(self.orch.deliver_kills(ids))
        elif channel == "covey_leases":  # a tool flag changed: tell our daemons now
            self.orch.spawn(self.orch.renew_leases())
        elif channel == "covey_events":
            self.events.publish(payload)
        elif channel == "covey_credentials":  # a session ended or its human changed
            with contextlib.suppress(ValueError):
                # '*': a table of credentials emptied, everyone's (migration 0024).
                human_id = None if payload == "*" else UUID(payload)
                self.credentials.announced(human_id)
                self.events.credentials_changed(human_id)

    async def run(self) -> None:
        while True:
            conn: asyncpg.Connection[asyncpg.Record] | None = None
            try:
                conn = await asyncpg.connect(self.url)
                for channel in ("covey_wake", "covey_kill", "covey_leases", "covey_events",
                                "covey_credentials"):
                    await conn.add_listener(channel, self._on_notify)
                closed = asyncio.Event()
                conn.add_termination_listener(lambda _c, ev=closed: ev.set())
                # From here on every change to a credential is heard: callers may be
                # remembered (covey.credentials), and are until the connection is lost.
                self.credentials.listening(True)
                self.ready.set()
                while not closed.is_set():
                    try:
                        await asyncio.wait_for(closed.wait(), 5)
                    except TimeoutError:
                        # A connection can die without a goodbye: ask it something.
                        await conn.fetchval("SELECT 1", timeout=5)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("listener connection lost; reconnecting", error=repr(exc))
            finally:
                self.credentials.listening(False)
                # Given up on, it is dropped: a link cut by a partition comes back when it
                # heals, and a connection left open would then deliver every notification
                # a second time beside its successor, one more per outage.
                if conn is not None and not conn.is_closed():
                    conn.terminate()
            self.ready.clear()
            await asyncio.sleep(0.5)


def create_app(settings: Settings, *, host: str = "127.0.0.1", port: int = 8080,
               freeze_heap: bool = False) -> FastAPI:
    """The control plane's app. `freeze_heap` (`covey serve`, a process of its own): once
    started, what start-up made is left out of the garbage collector's full passes.
    Those passes stop the event loop, and each one walked the whole heap, most of it
    modules, routes and models made at start-up that live as long as the process: 61-86 ms
    a pass, one every few seconds under 200 operators' load (kill_under_load), with every
    kill in flight waiting behind it. With the start-up frozen, 9-18 ms. Not for a plane
    inside another program's process (the tests'): what that program made would be frozen
    with it, garbage to come included."""
    events = EventStream()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The embedded Postgres outlives everything that uses it, and a failed start-up
        # leaves it as a finished run does.
        url = settings.database_url
        postgres: EmbeddedPostgres | None = None
        if url is None:
            postgres = await asyncio.to_thread(attach, settings.data_dir)
            url = postgres.url
        else:
            log.info("database from DATABASE_URL: covey neither starts nor stops it")
        try:
            async with control_plane(app, url):
                if freeze_heap:
                    gc.collect()  # what start-up left as garbage is not frozen with it
                    gc.freeze()
                yield
        finally:
            if postgres is not None:
                await asyncio.to_thread(release, postgres)

    @asynccontextmanager
    async def control_plane(app: FastAPI, url: str) -> AsyncIterator[None]:
        await migrate(url)
        pool = await create_pool(url)
        # The switches' lane (covey.admission): connections no read can take.
        switch_pool = await create_pool(url, min_size=1, max_size=settings.switch_connections)
        async with switch_pool.acquire() as conn:
            await install_flags(conn)
        node = f"{socket.gethostname()}:{port}:{uuid.uuid4().hex[:6]}"
        ws_url = settings.public_ws_url or f"ws://{host}:{port}/api/daemon/ws"
        orch = Orchestrator(pool, settings, DaemonHub(), node, ws_url,
                            switch_pool=switch_pool)
        provider: SandboxProvider
        if settings.sandbox_backend == "docker":
            provider = DockerProvider(settings.sandbox_image, settings.daemon_command,
                                      settings.docker_network,
                                      {"covey.node": node, "covey.gameday": settings.gameday},
                                      settings.sandbox_log_dir,
                                      cpu_shares=settings.sandbox_cpu_shares)
        else:
            provider = ProcessProvider(settings.daemon_command, settings.sandbox_log_dir,
                                       make_cpu_group(settings.sandbox_cpu_group))
        orch.runner = Runner(pool, provider, settings.data_dir, node, settings.kill_grace_s,
                             orch.sandbox_exited, settings.warm_sync_s, settings.warm_idle_s)
        orch.hand_over = functools.partial(daemon.hand_over, orch)
        app.state.orchestrator = orch
        app.state.db_probe = DatabaseProbe(url)
        app.state.sign_in = SignIn(pool, settings)
        await app.state.sign_in.prepare()
        listener = Listener(url, orch, events, app.state.credentials)

        async def keep_callers() -> None:
            await keep_switch_callers(pool, app.state.credentials, SWITCH_PULLERS)
        loops = [
            asyncio.create_task(listener.run()),
            asyncio.create_task(_every(settings.tick_ms / 1000, "tick", orch.tick)),
            asyncio.create_task(
                _every(settings.lease_ms / 3000, "lease", orch.renew_leases)),
            asyncio.create_task(_every(SWITCH_CALLERS_EVERY_S, "switch callers", keep_callers)),
            # Twice the lease: their daemons have stopped by then, however the crash fell.
            asyncio.create_task(orch.runner.settle_previous_life(2 * settings.lease_ms / 1000)),
            # And their sessions, once their daemons' leases have run out: not at the sweep.
            asyncio.create_task(orch.settle_previous_life()),
        ]
        await asyncio.wait_for(listener.ready.wait(), 30)
        log.info("control plane ready", node=node, ws_url=ws_url, version=__version__)
        try:
            yield
        finally:
            for loop in loops:
                loop.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            await orch.runner.close()
            await app.state.db_probe.close()
            app.state.sign_in.close()
            await pool.close()
            await switch_pool.close()

    # /docs is covey.api.docs (Swagger UI served by the app, offline); no /redoc, whose
    # script would come from a CDN.
    app = FastAPI(title="covey", version=__version__, lifespan=lifespan,
                  description="Agent control plane with kill switches (covey-compatible).",
                  docs_url=None, redoc_url=None)
    errors.install(app)
    app.state.credentials = Credentials()
    app.openapi = lambda: document(app, settings.heartbeat_min_s)  # type: ignore[method-assign]
    for router in (*SWITCH_ROUTERS, *ROUTERS):
        app.include_router(router)

    @app.get("/healthz", tags=["system"],
             responses={503: {"description": "Database unreachable"}})
    async def healthz(request: Request) -> dict[str, Any]:
        orch: Orchestrator = request.app.state.orchestrator
        # Within HEALTH_TIMEOUT_S, whatever the database does: a paused one once kept this
        # answer for more than 3 s (covey.outage).
        if not await request.app.state.db_probe.answers(HEALTH_TIMEOUT_S):
            raise errors.ApiError(503, "Database unreachable",
                                  f"It did not answer within {HEALTH_TIMEOUT_S:g} s; kills "
                                  "cannot be recorded until it is back.")
        # The lease a daemon holds: how long a cut control channel may leave an agent
        # running, which a game day against this deployment must know to judge it.
        return {"ok": True, "node": orch.node, "version": __version__,
                "lease_ms": orch.settings.lease_ms}

    @app.get("/metrics", tags=["system"], response_class=PlainTextResponse)
    async def metrics_endpoint(orch: Orch) -> PlainTextResponse:
        await metrics.read_state(orch.pool)
        return PlainTextResponse(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/api/v1/events", tags=["system"], response_class=StreamingResponse,
             responses={200: {"description": "An endless event stream",
                              "content": {"text/event-stream": {"schema": {"type": "string"}}}}})
    async def status_events(who: AnyRole, request: Request, orch: Orch) -> StreamingResponse:
        """Server-sent events: one `status` event per agent status change in your org. The
        stream ends, with an `end` event, when its session does (logout, expiry, a revoked
        token, a change of role): sign in again and reconnect."""
        hashed = credential_hash(request)

        def holds() -> Awaitable[float | None]:
            return credential_left_s(orch, who, hashed)
        left = await holds()
        if left is None:  # ended between the check of the role and now
            raise errors.ApiError(401, "Session expired or token unknown", "Sign in again.")
        return StreamingResponse(events.stream(who.org_id, who.human_id, left, holds),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store"})

    @app.get("/", include_in_schema=False, response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        return HTMLResponse('<p>covey control plane. API: <a href="/docs">/docs</a></p>')

    wrapped: Any = app
    wrapped.add_middleware(ReadAdmission, concurrency=settings.read_concurrency,
                           queue=settings.read_queue)
    wrapped.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    wrapped.add_middleware(OutageDeadline)
    wrapped.add_middleware(errors.ContainErrors)  # outermost: also around the body limit
    return app
