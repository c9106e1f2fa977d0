"""One error shape for every failure: {"error": ..., "hint": ...} with a 4xx status."""

from __future__ import annotations

from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = structlog.get_logger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, error: str, hint: str) -> None:
        super().__init__(error)
        self.status = status
        self.error = error
        self.hint = hint


def not_found(what: str) -> ApiError:
    return ApiError(404, f"No such {what}",
                    f"Check the {what} id; it must belong to your organisation.")


def stopped() -> ApiError:
    # The exact text covey answers with; operators' scripts grep for it.
    return ApiError(409, "Agent or fleet is stopped", "resume it first.")


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


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(error_body(exc.error, exc.hint), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        status, error, hint, details = _validation_message(exc)
        body = error_body(error, hint, details=details) if details else error_body(error, hint)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        hints = {
            404: "See /docs for the routes this server has.",
            405: "See /docs for the methods this route accepts.",
        }
        return JSONResponse(
            error_body(str(exc.detail), hints.get(exc.status_code, "")),
            status_code=exc.status_code,
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A 500 is a bug of ours; log it whole so it can be fixed, and say so plainly.
        log.exception("unhandled error", path=request.url.path)
        return JSONResponse(
            error_body("Internal error", "This is a bug in covey; the server log has the trace."),
            status_code=500,
        )
