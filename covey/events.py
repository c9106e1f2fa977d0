"""Status changes from every replica (NOTIFY covey_events) to the server-sent event streams
of this one, each stream for as long as the credential that opened it holds.

A stream once outlived its session: after a logout made /auth/me answer 401, the open stream
delivered 12 more events in 2.6 s (issue 23). A credential that ends (logout, a deleted token)
or whose human changes (role, organisation, removal) is announced on `covey_credentials` by a
trigger (migration 0013), whoever wrote the row; the streams of that human check their
credential at once and end if it no longer holds as it was. A session's expiry ends its
streams on time, and every keep-alive checks as well: the backstop for an announcement missed
while this replica's listening connection was down.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from uuid import UUID

import structlog

log = structlog.get_logger(__name__)

KEEP_ALIVE_S = 15.0
QUEUE_LIMIT = 1000
# Put on a stream's queue: "check your credential", not an event.
_CHECK = None


@dataclass(eq=False)
class _Subscriber:
    org_id: UUID
    human_id: UUID
    queue: asyncio.Queue[str | None] = field(default_factory=asyncio.Queue)


# Seconds the stream's credential still holds as it was when the stream opened (math.inf for
# an API token), or None when it no longer does.
CredentialCheck = Callable[[], Awaitable[float | None]]


class EventStream:
    def __init__(self) -> None:
        self._subscribers: set[_Subscriber] = set()

    def publish(self, raw: str) -> None:
        try:
            event = json.loads(raw)
            org = UUID(event["org_id"])
            agents = event.pop("agents", None) or [event["agent_id"]]
        except (ValueError, KeyError, TypeError):
            return
        lines = [json.dumps({**event, "agent_id": a}) for a in agents]
        for sub in list(self._subscribers):
            if sub.org_id == org and sub.queue.qsize() < QUEUE_LIMIT:
                for line in lines:
                    sub.queue.put_nowait(line)

    def credentials_changed(self, human_id: UUID | None) -> None:
        """A credential of this human ended, or the human changed: their streams check
        (everyone's for None: a table of credentials was emptied)."""
        for sub in list(self._subscribers):
            if human_id is None or sub.human_id == human_id:
                sub.queue.put_nowait(_CHECK)

    async def stream(self, org_id: UUID, human_id: UUID, left_s: float,
                     credential: CredentialCheck) -> AsyncIterator[str]:
        """The org's status events while `credential()` holds; `left_s` is how long it held
        when the stream opened. Ends with an `end` event that says why."""
        sub = _Subscriber(org_id, human_id)
        self._subscribers.add(sub)
        loop = asyncio.get_running_loop()
        expires = loop.time() + left_s
        try:
            yield ": connected\n\n"
            while True:
                wait_s = min(KEEP_ALIVE_S, max(0.0, expires - loop.time()))
                try:
                    raw = await asyncio.wait_for(sub.queue.get(), wait_s)
                except TimeoutError:
                    raw = _CHECK
                    keep_alive = True
                else:
                    keep_alive = False
                if raw is not _CHECK:
                    yield f"event: status\ndata: {raw}\n\n"
                    continue
                try:
                    left = await credential()
                except Exception as exc:  # the database away: a stream it cannot vouch for ends
                    log.warning("event stream ended: its credential could not be checked",
                                error=repr(exc))
                    yield _end("the session could not be checked; reconnect")
                    return
                if left is None or left <= 0:
                    yield _end("the session ended (logout, expiry, revoked token or a "
                               "change of role)")
                    return
                expires = loop.time() + (left if math.isfinite(left) else 10 * KEEP_ALIVE_S)
                if keep_alive:
                    yield ": keep-alive\n\n"
        finally:
            self._subscribers.discard(sub)


def _end(reason: str) -> str:
    return f"event: end\ndata: {json.dumps({'reason': reason})}\n\n"
