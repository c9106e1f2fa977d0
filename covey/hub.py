"""The daemons connected to this replica, and the one way to send them a message."""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol
from uuid import UUID

from covey import metrics


class MessageSink(Protocol):
    async def send_text(self, data: str) -> None: ...


@dataclass
class DaemonLink:
    session_id: UUID
    agent_id: UUID
    sink: MessageSink
    org_id: UUID | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # True once the daemon confirmed a kill (`kill_ack`) or its connection is gone; the
    # kill waits that are still counting on it are told then.
    stopped: bool = False
    waits: list[_StopWait] = field(default_factory=list)
    # The kill sent here and how it was confirmed (wall clock, this replica's): by the
    # daemon's `kill_ack`, or only by its hang-up, after its lease ran out (its last word
    # said so) or without a word, or by the runner tearing its sandbox down when it had not
    # acknowledged within the bound (the second line). Only an ack is obedience; the others
    # also end the wait.
    kill_sent_ns: int | None = None
    kill_confirmed_ns: int | None = None
    kill_confirmed_by: str | None = None  # kill_ack | lease | hang_up | teardown
    last_word: str | None = None  # the daemon's `stopping` reason, when it said one
    # Written to the session already (each once per connection: a fleet kill's thousand
    # confirmations are batched, and a second write of the same would only cost a trip).
    confirmation_saved: bool = False
    stop_saved: bool = False

    def confirm_kill(self, by: str) -> None:
        if self.kill_sent_ns is not None and self.kill_confirmed_by is None:
            self.kill_confirmed_ns, self.kill_confirmed_by = time.time_ns(), by
            metrics.kill_confirmations.labels(by).observe(
                (self.kill_confirmed_ns - self.kill_sent_ns) / 1e9)
        if not self.stopped:
            self.stopped = True
            waits, self.waits = self.waits, []
            for wait in waits:
                wait.stopped(self.session_id)


class _StopWait:
    """One kill's wait for its daemons: a countdown, not a task per daemon (a fleet kill of
    a thousand once made a thousand tasks just to learn when the last one answered)."""

    def __init__(self, links: list[DaemonLink]) -> None:
        self.confirmed: list[UUID] = []
        self._pending = len(links)
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for link in links:
            if link.stopped:
                self.stopped(link.session_id)
            else:
                link.waits.append(self)
        if not self._pending and not self.done.done():
            self.done.set_result(None)

    def stopped(self, session_id: UUID) -> None:
        self.confirmed.append(session_id)
        self._pending -= 1
        if not self._pending and not self.done.done():
            self.done.set_result(None)


class DaemonHub:
    KILLS_REMEMBERED = 10_000

    def __init__(self) -> None:
        self._links: dict[UUID, DaemonLink] = {}
        # Sessions this replica sent `kill` to, remembered past their disconnect: a daemon
        # that obeys at once is gone before the second path (local call or NOTIFY) asks.
        self._killed: OrderedDict[UUID, DaemonLink] = OrderedDict()

    def attach(self, link: DaemonLink) -> None:
        self._links[link.session_id] = link
        metrics.daemon_connections.set(len(self._links))

    def detach(self, session_id: UUID) -> None:
        link = self._links.pop(session_id, None)
        if link is not None:
            link.confirm_kill("lease" if link.last_word == "lease" else "hang_up")
        metrics.daemon_connections.set(len(self._links))

    def move(self, idle_session: UUID, session_id: UUID) -> DaemonLink | None:
        """A warm sandbox's idle daemon takes up the session of a new wake: its link now
        speaks for that session (the connection's handler follows the link)."""
        link = self._links.pop(idle_session, None)
        if link is not None:
            link.session_id = session_id
            self._links[session_id] = link
        return link

    def acknowledge_kill(self, session_id: UUID) -> None:
        link = self._links.get(session_id)
        if link is not None:
            link.confirm_kill("kill_ack")

    def confirm_teardown(self, session_id: UUID) -> DaemonLink | None:
        """The runner tore down the sandbox of a daemon that had not acknowledged the kill
        sent here: that confirms the kill, unless the daemon's hang-up did already. Returns
        the link when the teardown is what confirmed it."""
        link = self._killed.get(session_id)
        if link is None or link.kill_confirmed_by is not None:
            return None
        link.confirm_kill("teardown")
        return link

    def torn_down(self, session_ids: list[UUID]) -> list[UUID]:
        """Of these sessions, those whose kill sent here was confirmed by a teardown."""
        return [s for s in session_ids if (link := self._killed.get(s)) is not None
                and link.kill_confirmed_by == "teardown"]

    def first_kill_sent_ns(self, session_ids: list[UUID]) -> int | None:
        """When the first of these sessions was sent its kill from here (wall clock)."""
        sent = [link.kill_sent_ns for s in session_ids
                if (link := self._killed.get(s)) is not None and link.kill_sent_ns is not None]
        return min(sent, default=None)

    def acknowledged(self, session_ids: list[UUID]) -> list[UUID]:
        """Of these sessions, those whose daemon confirmed the kill sent here with its
        `kill_ack` (not merely hung up)."""
        return [s for s in session_ids if (link := self._killed.get(s)) is not None
                and link.kill_confirmed_by == "kill_ack"]

    async def wait_stopped(self, session_ids: list[UUID], timeout_s: float) -> list[UUID]:
        """Wait, at most `timeout_s`, until the daemons this replica sent `kill` to have
        confirmed it or hung up; returns those that did. A daemon that cannot answer (its
        channel cut) is stopped by its lease instead, which is why the wait is bounded."""
        links = [link for s in session_ids if (link := self._killed.get(s)) is not None]
        wait = _StopWait(links)
        try:
            # Awaited only when something is left to wait for, and not through 3.11's
            # wait_for (a task hop more): each turn of the loop runs whatever else is ready
            # first (a single kill's answer, its acknowledgement already in, waited 0.3 ms).
            if not wait.done.done():
                async with asyncio.timeout(timeout_s):
                    await wait.done
        except TimeoutError:
            pass
        finally:
            for link in links:
                if wait in link.waits:
                    link.waits.remove(wait)
        confirmed = set(wait.confirmed)
        return [link.session_id for link in links if link.session_id in confirmed]

    def not_yet_killed(self, session_ids: list[UUID]) -> list[UUID]:
        """Of these sessions, those connected here that were not sent `kill` yet."""
        return [s for s in session_ids if s not in self._killed and s in self._links]

    def kill_sent(self, session_id: UUID) -> bool:
        """This replica sent `kill` to the session. Every such session was over in Postgres
        before its kill went out (cancelled in the kill's own commit, or found over when its
        daemon connected), and an ended session never runs again."""
        return session_id in self._killed

    def session_ids(self) -> list[UUID]:
        return list(self._links)

    def links_of(self, org_id: UUID, agent_id: UUID | None = None) -> list[DaemonLink]:
        """The daemons connected here that work for this organisation (for this agent of it)."""
        return [link for link in self._links.values() if link.org_id == org_id
                and (agent_id is None or link.agent_id == agent_id)]

    def links(self) -> list[DaemonLink]:
        return list(self._links.values())

    def get(self, session_id: UUID) -> DaemonLink | None:
        return self._links.get(session_id)

    async def send(self, session_id: UUID, kind: str, payload: dict[str, Any]) -> bool:
        link = self._links.get(session_id)
        if link is None:
            return False
        return await send_to(link, kind, payload)

    async def send_kill(self, session_id: UUID, crowd: int = 1) -> bool:
        """Send `kill` once per session, however many paths (local call, NOTIFY) ask for it.
        True when this replica holds the daemon's connection and the kill went out. `crowd`
        is how many sessions the same kill stops at once: a daemon among many steps aside
        for the others once its kill is confirmed (coveyd's step_aside)."""
        if session_id in self._killed:  # the other path got there first
            return True
        link = self._links.get(session_id)
        if link is None:
            return False
        self._killed[session_id] = link
        if len(self._killed) > self.KILLS_REMEMBERED:
            self._killed.popitem(last=False)
        link.kill_sent_ns = time.time_ns()
        return await send_to(link, "kill", {"reason": "kill-switch",
                                            "sent_at_ns": link.kill_sent_ns,
                                            "crowd": crowd})


async def send_to(link: DaemonLink, kind: str, payload: dict[str, Any]) -> bool:
    """Send one frame; False when it did not go out. A `lease` never follows a `kill`: a
    renewal read from the database just before the kill's commit, and sent after the kill
    (or queued behind it on the link's lock), would run a daemon deaf to `kill` a lease
    past its kill, and past the kill's wait for its confirmation. Nor does a `release`
    (the end of a kill's hold, covey.switches): one kill's, after another's `kill`."""
    text = json.dumps({"type": kind, "payload": payload}, default=str)
    try:
        async with link.lock:
            if kind in ("lease", "release") and link.kill_sent_ns is not None:
                return False
            await link.sink.send_text(text)
    except Exception:  # a closed socket: the disconnect handler deals with the session
        return False
    return True
