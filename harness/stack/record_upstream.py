"""Record what a real upstream covey answers, for the dialect's tests in CI (which cannot
build upstream: its sources come from mirrors).

    python -m harness.stack.record_upstream --url http://127.0.0.1:18494 \\
        --email admin@covey.local --password gameday-admin-pw \\
        --out tests/harness/recorded/upstream_answers.json

Walks the kill-switch surface as a game day does (the requests the upstream dialect sends,
and the ones this project's dialect would send there, which upstream does not know), with
raw HTTP: each exchange is kept as the server gave it. The sandbox container's Docker events
of the agent killed go beside them. The file says when it was recorded, against which
server version and commit, and from which commit of this repository.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import docker
import httpx

from harness.act.upstream import QUICK_BODY, WORK_S
from harness.record.sandbox_events import SANDBOX_NAME
from harness.stack.waiting import eventually

UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
TOKEN = re.compile(r"/api/trigger/[0-9a-f]{16,}")


def template(path: str) -> str:
    """A recorded path with its ids and tokens as placeholders, the key a replay matches."""
    return TOKEN.sub("/api/trigger/{token}", UUID.sub("{id}", path))


class Recorder:
    def __init__(self, url: str) -> None:
        self.http = httpx.AsyncClient(base_url=url, timeout=30)
        self.exchanges: list[dict[str, Any]] = []

    async def __call__(self, method: str, path: str, body: Any = None, note: str = ""
                       ) -> httpx.Response:
        r = await self.http.request(method, path, json=body)
        self.exchanges.append({
            "method": method, "path": template(path), "request": body, "note": note,
            "status": r.status_code, "content_type": r.headers.get("content-type", ""),
            "set_cookie": "set-cookie" in r.headers,
            # Upstream's web app answers an unknown path with its HTML page: its head is
            # enough to show that.
            "body": r.text if "html" not in r.headers.get("content-type", "") else r.text[:300]})
        return r


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _docker_events(agent_id: str, since_s: float) -> list[dict[str, Any]]:
    client = docker.from_env()
    try:
        name = SANDBOX_NAME.format(agent_id=agent_id)
        return [e for e in client.events(since=int(since_s), until=int(time.time()) + 1,
                                         decode=True, filters={"type": "container",
                                                               "container": name})
                if e.get("Actor", {}).get("Attributes", {}).get("name") == name]
    finally:
        client.close()


async def record(url: str, email: str, password: str) -> dict[str, Any]:
    rec = Recorder(url.rstrip("/"))
    started_s = time.time()
    run = uuid.uuid4().hex[:6]
    try:
        await rec("GET", "/healthz", note="plain ok: how the dialect is found")
        await rec("POST", "/api/v1/auth/login", {"email": email, "password": password},
                  note="a cookie session")
        version = (await rec("GET", "/api/v1/version")).json()
        await rec("GET", "/api/v1/auth/me", note="Go field names")
        await rec("POST", "/api/v1/auth/tokens", {"name": "game day"},
                  note="this project's API token: not in upstream")
        await rec("POST", "/api/v1/members", {"email": f"x.{run}@gd.test", "password":
                                              "not-used-12345", "role": "security"},
                  note="this project's members: not in upstream")
        await rec("POST", "/api/v1/users", {"email": f"security.{run}@gd.test",
                                            "display_name": "security", "role": "security",
                                            "password": f"pw-{run}-security"})
        await rec("GET", "/api/v1/fleet")
        created = (await rec("POST", "/api/v1/agents", {
            "slug": f"gd-{run}-rec", "display_name": "recorded", "runtime": "mock"},
            note="a draft")).json()
        agent = f"/api/v1/agents/{created['id']}"
        await rec("POST", f"{agent}/hire")
        token = (await rec("POST", f"{agent}/webhook")).json()["token"]
        await rec("PUT", f"{agent}/config", {"files": {
            "HEARTBEAT.md": f"- alle: 3600s titel: hourly aufgabe: {QUICK_BODY}\n"}})
        await rec("GET", f"{agent}/heartbeats")
        task = (await rec("POST", f"{agent}/tasks", {
            "title": "works a while", "body": f"[mock:sleep {WORK_S}s]\n[mock:result ok]"})
        ).json()

        async def working() -> bool:
            r = await rec.http.get(f"{agent}/backlog")
            return any(t["state"] == "in_progress" for t in r.json())
        await eventually(working, 60, "the recorded agent never got to work")
        await rec("GET", f"{agent}/backlog", note="a task in progress")
        await rec("GET", agent, note="working")
        await rec("POST", f"{agent}/kill")
        await eventually(lambda: _not_running(rec, agent), 10, "the kill did not stop it")
        await rec("GET", agent, note="killed")
        await rec("GET", f"{agent}/backlog", note="the task back to open")
        await rec("GET", f"/api/v1/tasks/{task['id']}/transitions")
        await rec("GET", f"{agent}/sessions", note="this project's sessions: not in upstream")
        await rec("POST", f"{agent}/resume")
        await rec("POST", "/api/v1/fleet/kill")
        await rec("GET", "/api/v1/fleet", note="during the stop")
        await rec("POST", f"{agent}/heartbeats/hourly/fire", note="during the stop")
        await rec("POST", f"/api/trigger/{token}", {"title": "t", "body": QUICK_BODY},
                  note="during the stop")
        await rec("POST", f"{agent}/wake", note="during the stop")
        await rec("POST", "/api/v1/fleet/resume")
        await rec("POST", f"{agent}/kill", note="left killed, as a game day's rollback does")
        events = await asyncio.to_thread(_docker_events, created["id"], started_s - 5)
    finally:
        await rec.http.aclose()
    return {"recorded_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "server": {"url": url, "version": version.get("version"),
                       "commit": version.get("commit")},
            "recorded_by": {"command": "python -m harness.stack.record_upstream",
                            "commit": _git_commit()},
            "agent_id": created["id"], "exchanges": rec.exchanges, "docker_events": events}


async def _not_running(rec: Recorder, agent: str) -> bool:
    r = await rec.http.get(agent)
    return bool(r.json().get("killed")) and r.json().get("status") != "working"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--email", required=True)
    parser.add_argument("--password", required=True)
    parser.add_argument("--out", type=Path,
                        default=Path("tests/harness/recorded/upstream_answers.json"))
    args = parser.parse_args(argv)
    recording = asyncio.run(record(args.url, args.email, args.password))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(recording, indent=1) + "\n")
    print(f"recorded {len(recording['exchanges'])} answers of covey "
          f"{recording['server']['version']} ({recording['server']['commit']}) into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
