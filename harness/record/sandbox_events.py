"""Sandboxes as the Docker engine saw them: the evidence upstream covey keeps nowhere else.

Upstream's API has no sandboxes and no sessions; its sandbox is a container named
`covey-sandbox-<agent id>` whose entrypoint is the daemon, so the container's `die` event is
the daemon's exit (with its exit code: 3 after a kill) and its `start` is the agent starting
work. Each container the engine reports for that name, from `since` until now, is one row in
the shape this project's API gives (`GET /agents/{id}/sandboxes`), at the engine's own
nanosecond times.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

SANDBOX_NAME = "covey-sandbox-{agent_id}"
LIVE = "running"
GONE = "gone"


def _iso(ns: int | None) -> str | None:
    if ns is None:
        return None
    return datetime.fromtimestamp(ns / 1e9, UTC).isoformat()


def lives_from_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per container of the events (create/start/die/destroy), oldest first."""
    rows: dict[str, dict[str, Any]] = {}
    for e in sorted(events, key=lambda e: int(e.get("timeNano", 0))):
        cid = str(e.get("id") or e.get("Actor", {}).get("ID", ""))[:12]
        action = str(e.get("Action") or e.get("status", ""))
        at = int(e.get("timeNano", 0))
        if not cid or action not in ("create", "start", "die", "destroy"):
            continue
        row = rows.setdefault(cid, {"id": cid, "state": "starting", "created_ns": at,
                                    "started_ns": None, "died_ns": None, "destroyed_ns": None,
                                    "exit_code": None})
        if action == "start":
            row["started_ns"], row["state"] = at, LIVE
        elif action == "die":
            row["died_ns"], row["state"] = at, GONE
            code = e.get("Actor", {}).get("Attributes", {}).get("exitCode")
            row["exit_code"] = int(code) if code is not None and str(code).isdigit() else None
        elif action == "destroy":
            row["destroyed_ns"], row["state"] = at, GONE
    return [{"id": r["id"], "state": r["state"], "created_at": _iso(r["created_ns"]),
             "started_at": _iso(r["started_ns"] or r["created_ns"]),
             "daemon_exited_at": _iso(r["died_ns"]), "exit_code": r["exit_code"],
             # Gone once no process of it runs: its `die`, or its removal without one.
             "gone_at": _iso(r["died_ns"] or r["destroyed_ns"]),
             "source": "docker events"} for r in rows.values()]


class SandboxWatch:
    """Follows the Docker engine's container events from its start, keeping those of
    upstream's sandboxes. Read afterwards, the engine keeps only its last 256 events: on a
    machine that runs other containers, a game day's first sandboxes were gone from them by
    its judgement (a fleet stop's killed sandboxes went missing that way)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stream: Any = None
        self._client: Any = None

    def start(self) -> None:
        import docker

        self._client = docker.from_env()
        self._stream = self._client.events(decode=True, filters={"type": "container"})
        threading.Thread(target=self._follow, name="sandbox-watch", daemon=True).start()

    def _follow(self) -> None:
        with contextlib.suppress(Exception):  # the stream closed under it: the watch ends
            for e in self._stream:
                name = str(e.get("Actor", {}).get("Attributes", {}).get("name", ""))
                if name.startswith(SANDBOX_NAME.format(agent_id="")):
                    with self._lock:
                        self.events.append(e)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._stream.close()
        with contextlib.suppress(Exception):
            self._client.close()

    def lives(self, agent_id: str) -> list[dict[str, Any]]:
        name = SANDBOX_NAME.format(agent_id=agent_id)
        with self._lock:
            mine = [e for e in self.events
                    if e.get("Actor", {}).get("Attributes", {}).get("name") == name]
        return lives_from_events(mine)


_watch: SandboxWatch | None = None


@contextlib.contextmanager
def watching(watch: SandboxWatch) -> Iterator[SandboxWatch]:
    """Upstream's sandboxes followed by `watch` (started) for as long as the block lasts (a
    stack's life): `sandbox_lives` reads them from it."""
    global _watch
    _watch = watch
    try:
        yield watch
    finally:
        _watch = None
        watch.stop()


def sandbox_lives(agent_id: str, since_s: float) -> list[dict[str, Any]]:
    """The agent's sandbox containers since `since_s` (epoch seconds): from the watch while
    one runs, else from the local Docker engine's recent events. Blocking: call it in a
    thread."""
    if _watch is not None:
        return _watch.lives(agent_id)
    import docker

    client = docker.from_env()
    try:
        stream = client.events(since=int(since_s), until=int(time.time()) + 1, decode=True,
                               filters={"type": "container",
                                        "container": SANDBOX_NAME.format(agent_id=agent_id)})
        events = [e for e in stream if e.get("Actor", {}).get("Attributes", {}).get("name")
                  == SANDBOX_NAME.format(agent_id=agent_id)]
    finally:
        client.close()
    return lives_from_events(events)


def containers_of(agent_id: str) -> list[str]:
    """What of the agent's sandbox container still runs, looked at directly. Blocking."""
    import docker

    client = docker.from_env()
    try:
        found: list[Any] = client.containers.list(
            ignore_removed=True, filters={"name": SANDBOX_NAME.format(agent_id=agent_id)})
        return [f"container {c.short_id} {c.name} ({c.status})" for c in found]
    finally:
        client.close()
