"""What the control plane takes on at once: the switches have a lane of their own, and reads
are bounded.

Under Locust load (50-100 operators listing agents and reading backlogs and recordings, a
closed loop) a kill queued behind the operators' reads twice: for a pooled database
connection, every one of its statements, and on the event loop, every step of it behind
every read in flight. Its answer took seconds at 100 operators while the daemons had long
stopped. So:

* the switches (agent kill, fleet kill, the global stop, on the API and the administration
  page) and the daemons' lease and kill-confirmation writes use a small pool of their own,
  `Orchestrator.switch_pool`, which reads never take (`is_switch` says which requests);
* at most `concurrency` reads are served at once and `queue` more wait for a turn; a read
  beyond that is answered 429 with `Retry-After` at once, before any work is done for it.
  Shedding a read is the control plane keeping the switch usable, not a failure of it, and
  never a 5xx (a 503 says the database is unreachable, and nothing else).

Writes other than the switches (new tasks, heartbeat fires, resumes) are not bounded here:
each is small and the operators' mix has few of them.
"""

from __future__ import annotations

import asyncio
import json
import re

from starlette.types import ASGIApp, Receive, Scope, Send

from covey import errors

SWITCH_PATH = re.compile(
    r"^/(api/v1/agents/[^/]+/kill|api/v1/fleet/kill|api/v1/flags/global"
    r"|administration/fleet/kill|administration/agents/[^/]+/kill)$")
# A stream stays open for as long as its subscriber: it would hold a turn for ever.
UNBOUNDED_READS = ("/api/v1/events",)
RETRY_AFTER_S = 1


def is_switch(method: str, path: str) -> bool:
    """A request that pulls a switch: it takes the switch lane's connections."""
    return method == "POST" and SWITCH_PATH.match(path) is not None


def is_bounded_read(method: str, path: str) -> bool:
    """A read of the API that waits for a turn (or is shed) when too many are under way."""
    return method in ("GET", "HEAD") and path.startswith("/api/v1/") \
        and path not in UNBOUNDED_READS


class ReadAdmission:
    """ASGI middleware: at most `concurrency` bounded reads at once, `queue` more waiting in
    arrival order, every other one answered 429 at once."""

    def __init__(self, app: ASGIApp, concurrency: int, queue: int) -> None:
        self.app = app
        self.concurrency = concurrency
        self.queue = queue
        self._turns = asyncio.Semaphore(concurrency)
        self._waiting = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_bounded_read(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        if self._turns.locked() and self._waiting >= self.queue:
            await self._shed(send)
            return
        self._waiting += 1
        try:
            await self._turns.acquire()
        finally:
            self._waiting -= 1
        try:
            await self.app(scope, receive, send)
        finally:
            self._turns.release()

    async def _shed(self, send: Send) -> None:
        body = json.dumps(errors.error_body(
            "Too many reads at once",
            f"The control plane is serving {self.concurrency} reads with {self.queue} more "
            f"waiting; retry after {RETRY_AFTER_S} s. The switches are never held back by "
            "reads.")).encode()
        await send({"type": "http.response.start", "status": 429,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"retry-after", str(RETRY_AFTER_S).encode())]})
        await send({"type": "http.response.body", "body": body})
