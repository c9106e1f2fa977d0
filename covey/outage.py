"""An outage answers fast: a request the database leaves hanging is answered 503 with a hint
within OUTAGE_ANSWER_S of its arrival, rather than when the database comes back.

With Postgres paused (SIGSTOP, as a stuck disk or a frozen VM looks to its clients), /healthz
did not answer within 3 s and an agent kill hung 6.43 s, then answered 200 once the database
was back (issue 23): an operator pulling the switch in the dark learned nothing for seconds.
Statement timeouts cannot tell that apart from a fleet kill that is slow under load (its flag
once took a second to commit there) and would fail it; so the database is asked instead:

* a request still running after PROBE_AFTER_S makes the control plane ask Postgres
  `SELECT 1` on a connection of its own (no pool to queue for, one probe shared by all who
  wait), for at most PROBE_TIMEOUT_S. If the answer comes, the request is slow, not stuck,
  and is left alone (asked again every PROBE_EVERY_S while it runs). If it does not, the
  request is answered 503 "Database unreachable" at once;
* a switch answered so (agent kill, fleet kill, global stop) goes on in the background and
  takes effect when the database is back: its 503 says so, and pulling it again is safe, as
  every switch is idempotent. Any other request is cancelled.

/healthz asks the same probe and answers 503 within HEALTH_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass

import asyncpg
import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from covey import errors
from covey.admission import UNBOUNDED_READS, is_switch

log = structlog.get_logger(__name__)

PROBE_AFTER_S = 0.5
PROBE_TIMEOUT_S = 1.0
PROBE_EVERY_S = 1.0
OUTAGE_ANSWER_S = PROBE_AFTER_S + PROBE_TIMEOUT_S  # the bound the README states: 1.5 s
HEALTH_TIMEOUT_S = 0.8
PROBE_ABANDON_S = 5.0  # a probe's connection that has not answered by then is dropped
# Left alone: they answer without the database, or bound their own wait for it.
UNWATCHED = (*UNBOUNDED_READS, "/healthz", "/metrics")


class DatabaseProbe:
    """Does the database answer? `SELECT 1` on a connection of its own, one at a time."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._conn: asyncpg.Connection[asyncpg.Record] | None = None
        self._inflight: asyncio.Task[bool] | None = None
        self._inflight_since = 0.0

    async def answers(self, within_s: float = PROBE_TIMEOUT_S) -> bool:
        """True when the database answered within `within_s` (of the probe under way, if one
        is: a caller who joins it late waits only for what remains). A probe that does not
        answer is not cancelled (cancelling a query on a frozen server hangs as well); it
        ends when the server answers or its connection is gone, and the next probe waits."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._inflight is None:
            self._inflight, self._inflight_since = asyncio.ensure_future(self._probe()), now
        probe = self._inflight
        remaining = within_s - (now - self._inflight_since)
        if remaining <= 0:
            return False
        done, _ = await asyncio.wait({probe}, timeout=remaining)
        return bool(done) and probe.result()

    async def _probe(self) -> bool:
        try:
            if self._conn is None or self._conn.is_closed():
                self._conn = await asyncpg.connect(self._url, timeout=PROBE_ABANDON_S)
            # A query on a link that swallows bytes (a blackhole) would never end, nor would
            # every probe after it: its connection is dropped instead, and the next probe
            # makes a new one.
            abandon = asyncio.get_running_loop().call_later(PROBE_ABANDON_S,
                                                            self._conn.terminate)
            try:
                await self._conn.fetchval("SELECT 1")
            finally:
                abandon.cancel()
        except Exception as exc:
            log.info("database probe failed", error=repr(exc))
            if self._conn is not None:
                self._conn.terminate()
                self._conn = None
            return False
        else:
            return True
        finally:
            self._inflight = None

    async def close(self) -> None:
        if self._inflight is not None:
            self._inflight.cancel()
            await asyncio.gather(self._inflight, return_exceptions=True)
        if self._conn is not None:
            self._conn.terminate()


@dataclass
class _Watched:
    task: asyncio.Task[object] | None
    switch: bool
    started: bool = False  # the handler's answer has begun: it is no longer ours to give
    answered: bool = False  # we gave the 503 in its place
    cancelled: bool = False


class OutageDeadline:
    """ASGI middleware: answer 503 for a request the database leaves hanging (module doc).
    The probe is the app's `state.db_probe`, set once the control plane has started."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        probe: DatabaseProbe | None = getattr(scope.get("app") and scope["app"].state,
                                              "db_probe", None)
        if scope["type"] != "http" or scope["path"] in UNWATCHED or probe is None:
            await self.app(scope, receive, send)
            return
        watched = _Watched(asyncio.current_task(), is_switch(scope["method"], scope["path"]))

        async def guarded(message: Message) -> None:
            if watched.answered:
                return  # answered 503 already; this late answer has no one to go to
            if message["type"] == "http.response.start":
                watched.started = True
            await send(message)

        watcher = asyncio.ensure_future(self._watch(probe, watched, send))
        try:
            await self.app(scope, receive, guarded)
        except asyncio.CancelledError:
            if not watched.cancelled:
                raise
            if watched.task is not None:
                watched.task.uncancel()
        except Exception as exc:
            if not watched.answered:
                raise
            log.warning("request failed after its 503", method=scope["method"],
                        path=scope["path"], error=repr(exc))
        finally:
            watcher.cancel()

    async def _watch(self, probe: DatabaseProbe, watched: _Watched, send: Send) -> None:
        await asyncio.sleep(PROBE_AFTER_S)
        while not watched.started:
            if await probe.answers() or watched.started:
                await asyncio.sleep(PROBE_EVERY_S)
                continue
            watched.answered = True
            with contextlib.suppress(Exception):  # the client may have gone meanwhile
                await _unreachable(send, watched.switch)
            if not watched.switch and watched.task is not None:
                watched.cancelled = True
                watched.task.cancel()
            return


async def _unreachable(send: Send, switch: bool) -> None:
    hint = errors.UNREACHABLE_HINT if not switch else (
        f"It did not answer within {OUTAGE_ANSWER_S:g} s. This switch goes on and takes "
        "effect when the database is back; retry it to be sure (switches are safe to "
        "repeat); GET /healthz tells when the database answers again.")
    body = json.dumps(errors.error_body("Database unreachable", hint)).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"retry-after", b"1")]})
    await send({"type": "http.response.body", "body": body})
