"""One error shape for every failure: {"error": ..., "hint": ...} with a 4xx status."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import fastapi.routing
import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from covey.db import UNREACHABLE

log = structlog.get_logger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, error: str, hint: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(error)
        self.status = status
        self.error = error
        self.hint = hint
        self.headers = headers  # such as a 429's Retry-After


class Problem(BaseModel):
    where: str
    problem: str


class ErrorOut(BaseModel):
    """Every answer that is not a success has this shape."""

    error: str
    hint: str
    details: list[Problem] | None = None


def not_found(what: str) -> ApiError:
    return ApiError(404, f"No such {what}",
                    f"Check the {what} id; it must belong to your organisation.")


def stopped() -> ApiError:
    # The exact text covey answers with; operators' scripts grep for it.
    return ApiError(409, "Agent or fleet is stopped", "resume it first.")


UNREACHABLE_HINT = (
    "Nothing can be recorded until it is back, so this request may not have taken effect: "
    "retry it (kills and resumes are safe to repeat); GET /healthz tells when the database "
    "answers again.")


def error_body(error: str, hint: str, **extra: Any) -> dict[str, Any]:
    return {"error": error, "hint": hint, **extra}


def _validation_message(exc: RequestValidationError) -> tuple[int, str, str, list[Any]]:
    errors = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        hint = "Send a valid JSON document with Content-Type: application/json."
        return 400, "Malformed JSON", hint, []
    details = [
        {"where": ".".join(str(p) for p in e.get("loc", ())), "problem": e.get("msg", "")}
        for e in errors
    ]
    first = details[0] if details else {"where": "body", "problem": "invalid"}
    hint = f"{first['where']}: {first['problem']}"
    return 422, "Invalid request", hint, details


def api_routes(app: FastAPI, kinds: tuple[type, ...] = (APIRoute,)) -> Iterator[Any]:
    """The app's routes of these kinds (its HTTP API routes unless told), each with its full
    path_format and dependant. FastAPI 0.16x nests included routers; older ones list every
    route flat."""
    contexts = getattr(fastapi.routing, "iter_route_contexts", None)
    if contexts is None:
        yield from (r for r in app.routes if isinstance(r, kinds))
        return
    for context in contexts(app.routes):
        if isinstance(context.original_route, kinds):
            yield context


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """Every method some route of this path takes: Starlette's own 405 names only the first
    route that matched the path, and GET and POST of one path are two routes here."""
    methods: set[str] = set()
    for route in api_routes(app):
        regex, _, _ = compile_path(route.path_format)
        if regex.match(path):
            methods |= set(route.methods or ())
    return sorted(methods)


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(error_body(exc.error, exc.hint), status_code=exc.status,
                            headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        status, error, hint, details = _validation_message(exc)
        body = error_body(error, hint, details=details) if details else error_body(error, hint)
        return JSONResponse(body, status_code=status)

    # The database gone (refused, restarting, its connection cut): a 503 that says so, never
    # a 500 "bug" nor a 200. A kill that meets it may have been recorded in part; the hint
    # says to pull it again, which is safe: every switch is idempotent.
    async def _database_unreachable(_: Request, exc: Exception) -> JSONResponse:
        log.warning("database unreachable", error=repr(exc))
        return JSONResponse(error_body("Database unreachable", UNREACHABLE_HINT),
                            status_code=503, headers={"Retry-After": "1"})

    for unreachable in UNREACHABLE:
        app.add_exception_handler(unreachable, _database_unreachable)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        hints = {
            404: "See /docs for the routes this server has.",
            405: "See /docs for the methods this route accepts.",
        }
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            allowed = allowed_methods(request.app, request.url.path)
            headers["Allow"] = ", ".join(allowed)
            hints[405] = f"This route accepts {', '.join(allowed)}."
        return JSONResponse(
            error_body(str(exc.detail), hints.get(exc.status_code, "")),
            status_code=exc.status_code, headers=headers,
        )


class ContainErrors:
    """The last line against a bug of ours: answer 500 in the one error shape, and keep the
    connection. Starlette's own handler re-raises after answering, and uvicorn then closes a
    kept-alive connection without a word; clients saw their next request fail."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            # The path may hold a trigger token: the log's redaction removes it.
            log.exception("unhandled error", method=scope.get("method"), path=scope.get("path"))
            if started:
                raise  # half an answer is out: only closing the connection is honest
            body = json.dumps(error_body(
                "Internal error", "This is a bug in covey; the server log has the trace.")).encode()
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
