"""A bug of ours answers 500 in the one error shape and keeps the connection; and no log line,
ours or uvicorn's, carries a token."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI, Request

from covey import errors
from covey.testing.plane import served

TRIGGER_TOKEN = "cvtr_" + "S3cretTriggerToken" * 2
API_TOKEN = "cvt_" + "S3cretApiToken" * 3


@pytest.fixture
async def failing_app_url() -> AsyncIterator[str]:
    """The control plane's own error handling around a route with a bug in it, served by a
    real uvicorn: the unit here is ContainErrors with errors.install."""
    app = FastAPI()
    errors.install(app)

    @app.post("/api/trigger/{token}")
    async def broken(token: str) -> None:
        raise RuntimeError("a bug")

    @app.get("/port")
    async def port(request: Request) -> int:
        assert request.client is not None
        return request.client.port

    app.add_middleware(errors.ContainErrors)
    async with served(app) as url:
        yield url


async def test_a_500_keeps_the_connection_and_the_error_shape(failing_app_url: str) -> None:
    async with httpx.AsyncClient(base_url=failing_app_url, timeout=10) as client:
        first = (await client.get("/port")).json()
        r = await client.post(f"/api/trigger/{TRIGGER_TOKEN}")
        assert r.status_code == 500, r.text
        assert r.json()["error"] == "Internal error" and r.json()["hint"], r.text
        assert r.headers.get("connection") != "close", r.headers
        # The next request rides the same kept-alive connection: same client port.
        assert (await client.get("/port")).json() == first, "the 500 closed the connection"


def test_no_log_line_carries_a_token() -> None:
    """Through covey's logging set-up in a real process: our structured lines (the unhandled-
    error line of a failed trigger call once logged its token whole), uvicorn's access and
    error lines, tracebacks."""
    script = textwrap.dedent(f"""
        import logging
        import structlog
        from covey.logs import configure
        configure("INFO")
        log = structlog.get_logger("covey.test")
        try:
            raise RuntimeError("failed at /api/trigger/{TRIGGER_TOKEN}")
        except RuntimeError:
            log.exception("unhandled error", path="/api/trigger/{TRIGGER_TOKEN}")
        log.warning("auth", header="Bearer {API_TOKEN}", nested={{"t": ["{API_TOKEN}"]}})
        logging.getLogger("uvicorn.access").info(
            '%s - "%s %s HTTP/%s" %d', "127.0.0.1:5000", "POST",
            "/api/trigger/{TRIGGER_TOKEN}?x=1", "1.1", 500)
        try:
            raise ValueError("Authorization: Bearer {API_TOKEN}")
        except ValueError:
            logging.getLogger("uvicorn.error").exception("Exception in ASGI application")
        print("done", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "done" in done.stdout, done.stderr
    lines = done.stderr
    assert "unhandled error" in lines and "Exception in ASGI application" in lines, lines
    assert "/api/trigger/[redacted]" in lines, lines
    for secret in ("S3cretTriggerToken", "S3cretApiToken"):
        assert secret not in lines, f"a token reached the log:\n{lines}"
