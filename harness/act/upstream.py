"""The client speaking upstream covey's dialect (github.com/benjaminLedel/covey, as
../shared/upstream-covey/ builds it): the same calls as CoveyClient, each turned into the
requests upstream takes, and its answers into the shapes the harness reads.

Where upstream differs, and what is done about it:
* people: a cookie session from POST /auth/login (no API tokens); /auth/me answers with Go
  field names (`OrgID`), turned into snake_case; members are /api/v1/users.
* agents: POST /agents makes a draft, POST …/hire lets it run; the engine is `mock`, driven
  by directives in the task body (`MockDirectives` turns a behaviour into them); the trigger
  token comes from POST …/webhook.
* heartbeats: lines of the agent's HEARTBEAT.md, written with PUT …/config.
* sandboxes and sessions: not in upstream's API; read from the Docker engine's events of the
  container `covey-sandbox-<agent id>` (harness/record/sandbox_events.py).
* what upstream has no equivalent for (organisations made by a platform admin, the global
  and tool flags, the recording) answers 501 without a request being sent, saying so.

Every translated answer keeps the last real request, so a failure names what was sent.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from harness.act.client import CoveyClient, json_of
from harness.act.puppet import Behaviour, LedgerEntry, behaviour_name
from harness.act.switch_line import SwitchLine
from harness.record.sandbox_events import sandbox_lives

# Upstream's mock engine: a task that works for a while, then finishes; or one that finishes.
WORK_S = 45
WELL_BEHAVED = "well_behaved"
QUICK_BODY = "[mock:result done]"
MOCK_DIRECTIVE = re.compile(r"\[mock:")

# The checkers whose evidence upstream does not expose, and what is missing (DESIGN §3 judges
# from the puppet's ledger and the sessions' kill records; upstream has neither).
UPSTREAM_LACKS: dict[str, str] = {
    "no_action_after_kill_ack": (
        "upstream's mock engine sends no model requests, so no agent action exists to time "
        "against the kill (a puppet in the claude-code engine's dialect would give them)"),
    "kill_obeyed": (
        "upstream keeps no kill delivery or daemon acknowledgement in its API (no sessions "
        "with kill_sent_at/kill_acked_at)"),
    "kill_confirmed_within_lease": (
        "upstream states no kill-flag lease and keeps no kill delivery in its API"),
    "home_is_last_sync": "upstream's agent homes are not readable from the harness",
    "stopped_tool_not_run": "upstream has no tool flag and its mock engine calls no tools",
    "no_blind_restart_after_trip": "upstream's guard trips are not in its API",
    "late_result_refused": (
        "upstream's recording of task results by session is not read by the harness"),
    "no_session_outlives_kill": (
        "upstream's kill answers before its sandbox exits and names no session it cancelled; "
        "the sandbox's end (Docker's `die`) is judged by no_sandbox_alive_after_stop"),
    # The bounded figures read from the puppet's ledger (harness/judge/bounds.py).
    **{f"within_bound:{figure}": (
        "the figure is read from the puppet's ledger of model requests, and upstream's mock "
        "engine sends none") for figure in ("actions_after_request", "deletions_after_request",
                                            "request_to_last_action_ms", "spend_beyond_cap_usd")},
    "within_bound:files_lost_beyond_last_sync": (
        "upstream's agent homes are not readable from the harness"),
}


def snake(name: str) -> str:
    """`OrgID` -> `org_id`, `DisplayName` -> `display_name`, `ID` -> `id`."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def answer(status: int, body: Any, request: httpx.Request) -> httpx.Response:
    """A translated answer: the harness's shape, the last real request."""
    return httpx.Response(status, json=body, request=request)


@dataclass
class MockDirectives:
    """The puppet of upstream's `mock` engine: an agent's behaviour becomes directives in
    the body of each task given to it. It hears no model requests (the mock engine sends
    none): its ledger stays empty, and the checkers that need one say so."""

    behaviours: dict[str, str] = field(default_factory=dict)

    async def assign(self, agent_id: str, behaviour: Behaviour) -> None:
        self.behaviours[agent_id] = behaviour_name(behaviour)

    async def actions(self, agent_id: str) -> list[LedgerEntry]:
        return []

    async def failed_calls(self, agent_id: str) -> list[int]:
        return []

    def body(self, agent_id: str, body: str = "") -> str:
        """The task body for this agent: as given when it already holds directives; a
        well-behaved agent finishes at once; every other works WORK_S seconds, then
        finishes (a task a kill can interrupt, and that ends done after a resume)."""
        if MOCK_DIRECTIVE.search(body):
            return body
        if self.behaviours.get(agent_id, WELL_BEHAVED) == WELL_BEHAVED:
            return f"{body}\n{QUICK_BODY}".strip()
        return f"{body}\n[mock:sleep {WORK_S}s]\n[mock:result worked {WORK_S}s]".strip()


class UpstreamClient(CoveyClient):
    dialect = "upstream"

    def __init__(self, base_url: str, token: str | None = None, timeout: float = 30,
                 transport: httpx.AsyncBaseTransport | None = None,
                 directives: MockDirectives | None = None, line: SwitchLine | None = None
                 ) -> None:
        super().__init__(base_url, None, timeout, transport, line)
        self.directives = directives or MockDirectives()
        # Docker's events are read from a little before this human existed: the game day's
        # agents are all younger.
        self.since_s = time.time() - 5
        self.read_sandboxes: Callable[[str, float], list[dict[str, Any]]] = sandbox_lives

    @classmethod
    async def signed_in(cls, base_url: str, email: str, password: str,
                        transport: httpx.AsyncBaseTransport | None = None,
                        line: SwitchLine | None = None) -> CoveyClient:
        return await cls.signed_in_upstream(base_url, email, password, transport=transport,
                                            line=line)

    @classmethod
    async def signed_in_upstream(cls, base_url: str, email: str, password: str,
                                 directives: MockDirectives | None = None,
                                 transport: httpx.AsyncBaseTransport | None = None,
                                 line: SwitchLine | None = None) -> UpstreamClient:
        """Signed in with a cookie session (upstream has no API tokens)."""
        client = cls(base_url, transport=transport, directives=directives, line=line)
        try:
            json_of(await client.http.post("/api/v1/auth/login",
                                           json={"email": email, "password": password}))
        except BaseException:
            await client.aclose()
            raise
        return client

    def _unsent(self, method: str, path: str, what: str) -> httpx.Response:
        request = self.http.build_request(method, path)
        return answer(501, {"error": f"upstream covey has no {what}; nothing was sent",
                            "dialect": self.dialect}, request)

    # people
    async def me(self) -> httpx.Response:
        r = await self.get("/api/v1/auth/me")
        if r.status_code != 200:
            return r
        return answer(200, {snake(k): v for k, v in r.json().items()}, r.request)

    async def add_member(self, email: str, password: str, role: str) -> httpx.Response:
        return await self.http.post("/api/v1/users", json={
            "email": email, "password": password, "role": role,
            "display_name": email.split("@")[0][:60]})

    async def create_org(self, name: str, admin_email: str, admin_password: str
                         ) -> httpx.Response:
        return self._unsent("POST", "/api/v1/platform/orgs",
                            "organisations made through the API by a platform admin")

    # agents and their work
    async def create_agent(self, slug: str, display_name: str, **fields: Any) -> httpx.Response:
        """A draft on the mock engine, hired, with its trigger token enabled: an agent that
        runs as this project's does the moment it is created. The fields upstream has no
        place for (guard, max_turns, ...) are named in `dialect_dropped`."""
        created = await self.http.post("/api/v1/agents", json={
            "slug": slug, "display_name": display_name, "runtime": "mock"})
        if created.status_code != 201:
            return created
        agent_id = created.json()["id"]
        for step in ("hire", "webhook"):
            r = await self.http.post(f"/api/v1/agents/{agent_id}/{step}")
            if r.status_code != 200:
                return r
        token = r.json().get("token")
        got = await self.agent(agent_id)
        if got.status_code != 200:
            return got
        dropped = sorted(k for k, v in fields.items() if v not in (None, False))
        return answer(201, {**got.json(), "trigger_token": token,
                            "dialect_dropped": dropped}, got.request)

    async def agent(self, agent_id: str) -> httpx.Response:
        r = await self.get(f"/api/v1/agents/{agent_id}")
        if r.status_code != 200:
            return r
        body = r.json()
        # Upstream keeps one kill flag per agent and one per organisation: a flagged agent's
        # stop is its own as far as its answer tells.
        body.setdefault("kill_origin", "agent" if body.get("killed") else None)
        return answer(200, body, r.request)

    async def create_task(self, agent_id: str, title: str, body: str = "") -> httpx.Response:
        return await self.http.post(f"/api/v1/agents/{agent_id}/tasks", json={
            "title": title, "body": self.directives.body(agent_id, body)})

    async def change_task(self, agent_id: str, task_id: str, **changes: Any) -> httpx.Response:
        return self._unsent("PATCH", f"/api/v1/agents/{agent_id}/tasks/{task_id}",
                            "task edits through the API")

    async def task(self, agent_id: str, task_id: str) -> httpx.Response:
        """The task from its agent's backlog, with its transitions (upstream has no read of
        one task)."""
        backlog = await self.backlog(agent_id)
        if backlog.status_code != 200:
            return backlog
        found = next((t for t in backlog.json() if t["id"] == task_id), None)
        if found is None:
            return answer(404, {"error": f"task {task_id} not in agent {agent_id}'s backlog"},
                          backlog.request)
        moves = await self.list_at(f"/api/v1/tasks/{task_id}/transitions")
        if moves.status_code != 200:
            return moves
        return answer(200, {**found, "transitions": moves.json()}, moves.request)

    async def list_at(self, path: str) -> httpx.Response:
        """A list read: upstream's Go answers `null` for an empty one (a task never
        dispatched has no transitions, an agent without tasks no backlog)."""
        r = await self.get(path)
        if r.status_code != 200 or r.json() is not None:
            return r
        return answer(200, [], r.request)

    async def backlog(self, agent_id: str) -> httpx.Response:
        return await self.list_at(f"/api/v1/agents/{agent_id}/backlog")

    async def agents(self) -> httpx.Response:
        return await self.list_at("/api/v1/agents")

    async def sandboxes(self, agent_id: str) -> httpx.Response:
        rows = await asyncio.to_thread(self.read_sandboxes, agent_id, self.since_s)
        request = self.http.build_request("GET", f"docker-events://covey-sandbox-{agent_id}")
        return answer(200, rows, request)

    async def sessions(self, agent_id: str) -> httpx.Response:
        """Upstream has no sessions: each sandbox container's life stands for one (started
        when it started, ended when it died), with no task and no kill record."""
        boxes = await self.sandboxes(agent_id)
        rows = [{"id": b["id"], "sandbox_id": b["id"],
                 "state": "running" if b["state"] == "running" else "ended",
                 "started_at": b["started_at"], "ended_at": b["gone_at"], "task_id": None,
                 "stop_layer": None, "node": "",
                 "stop_reason": None if b["exit_code"] is None
                 else f"sandbox exited {b['exit_code']}"} for b in boxes.json()]
        return answer(200, rows, boxes.request)

    async def recording(self, agent_id: str, after: int = 0) -> httpx.Response:
        return self._unsent("GET", f"/api/v1/agents/{agent_id}/recording",
                            "recording readable in this harness's terms")

    async def add_heartbeat(self, agent_id: str, name: str, task_body: str,
                            every_seconds: int) -> httpx.Response:
        """A line of the agent's HEARTBEAT.md (upstream's only way to define one)."""
        line = (f"- alle: {every_seconds}s titel: {name} aufgabe: "
                f"{self.directives.body(agent_id, task_body)}".replace("\n", " "))
        r = await self.http.put(f"/api/v1/agents/{agent_id}/config",
                                json={"files": {"HEARTBEAT.md": line + "\n"}})
        if r.status_code != 200:
            return r
        return answer(201, {"name": name, "every_seconds": every_seconds,
                            "task_body": task_body}, r.request)

    async def trigger(self, token: str, title: str = "triggered") -> httpx.Response:
        return await self.http.post(f"/api/trigger/{token}",
                                    json={"title": title, "body": QUICK_BODY})

    # the scoped kill flags: upstream has neither
    async def stop_globally(self, reason: str) -> httpx.Response:
        return self._unsent("POST", "/api/v1/flags/global", "global kill flag")

    async def clear_global_stop(self, reason: str) -> httpx.Response:
        return self._unsent("POST", "/api/v1/flags/global/clear", "global kill flag")

    async def stop_tool(self, tool: str, agent_id: str | None, reason: str) -> httpx.Response:
        return self._unsent("POST", "/api/v1/flags/tool", "tool kill flag")

    async def clear_tool_stop(self, tool: str, agent_id: str | None, reason: str
                              ) -> httpx.Response:
        return self._unsent("POST", "/api/v1/flags/tool/clear", "tool kill flag")
