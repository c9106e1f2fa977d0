"""A typed client of the covey API (DESIGN §2.2), one per human. Every call returns the
response; `json_of` insists on the expected status, so a scenario fails with the server's own
error and hint rather than a KeyError later."""

from __future__ import annotations

from typing import Any

import httpx

from harness.act.switch_line import SwitchLine
from harness.stack.waiting import retried

Json = dict[str, Any]


class ApiFailure(AssertionError):
    def __init__(self, response: httpx.Response, expected: int) -> None:
        super().__init__(f"{response.request.method} {response.request.url.path} answered "
                         f"{response.status_code}, expected {expected}: {response.text[:500]}")
        self.response = response


def json_of(response: httpx.Response, expected: int = 200) -> Any:
    if response.status_code != expected:
        raise ApiFailure(response, expected)
    return response.json()


SHED_TRIES = 10


def retry_after_s(response: httpx.Response) -> float:
    """The wait a shed read's Retry-After asks for, in seconds, kept within 0.05 to 5."""
    try:
        asked = float(response.headers.get("Retry-After", "1"))
    except ValueError:
        asked = 1.0
    return min(max(asked, 0.05), 5.0)


class CoveyClient:
    def __init__(self, base_url: str, token: str | None = None, timeout: float = 30,
                 transport: httpx.AsyncBaseTransport | None = None,
                 line: SwitchLine | None = None) -> None:
        self.token = token  # handed on to processes that act as the same human (load)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # `transport`: recorded answers instead of a server (the dialect's tests).
        self.http = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout,
                                      transport=transport)
        # A game day's switch line, which sends this human's stops (harness/act/switch_line.py).
        self.line = line
        self.on_line = line.enlist() if line is not None else 0

    async def aclose(self) -> None:
        if self.line is not None:
            self.line.dismiss(self.on_line)
        await self.http.aclose()

    async def _stop(self, path: str, body: Json | None = None) -> httpx.Response:
        """POST a stop: down the switch line where there is one, as this client would send
        it (its URL, headers, cookies, timeouts); otherwise from here."""
        if self.line is None:
            return await self.http.post(path, json=body)
        request = self.http.build_request("POST", path, json=body)
        response = await self.line.send(request, self.on_line)
        self.http.cookies.extract_cookies(response)
        return response

    async def get(self, path: str, **params: Any) -> httpx.Response:
        """GET, waited out while the control plane sheds reads (429 with Retry-After: it
        bounds the reads it serves at once, so that none of them delays a kill), at most
        SHED_TRIES times; the last answer is returned as it came."""
        return await retried(lambda: self._get_once(path, params), SHED_TRIES,
                             again=lambda r: r.status_code == 429,
                             wait_s=lambda _, r: 0.0 if r is None else retry_after_s(r))

    async def _get_once(self, path: str, params: dict[str, Any]) -> httpx.Response:
        """Retried once when the server closed the kept-alive connection just as it was
        reused (httpx then sees "Server disconnected without sending a response"): a read is
        safe to repeat, and a game day must not fail on that race."""
        return await retried(lambda: self.http.get(path, params=params or None), 2,
                             on=lambda e: isinstance(e, httpx.RemoteProtocolError))

    @classmethod
    async def signed_in(cls, base_url: str, email: str, password: str,
                        transport: httpx.AsyncBaseTransport | None = None,
                        line: SwitchLine | None = None) -> CoveyClient:
        """Sign in with email and password, then act with an API token of that human."""
        anonymous = cls(base_url, transport=transport)
        try:
            json_of(await anonymous.http.post("/api/v1/auth/login",
                                              json={"email": email, "password": password}))
            token = json_of(await anonymous.http.post("/api/v1/auth/tokens",
                                                      json={"name": "game day"}), 201)["token"]
        finally:
            await anonymous.aclose()
        return cls(base_url, token, transport=transport, line=line)

    # people
    async def me(self) -> httpx.Response:
        return await self.get("/api/v1/auth/me")

    async def add_member(self, email: str, password: str, role: str) -> httpx.Response:
        return await self.http.post("/api/v1/members",
                                    json={"email": email, "password": password, "role": role})

    async def create_org(self, name: str, admin_email: str, admin_password: str
                         ) -> httpx.Response:
        """A new organisation and its first admin (platform admins only)."""
        return await self.http.post("/api/v1/platform/orgs", json={
            "name": name, "admin_email": admin_email, "admin_password": admin_password})

    # agents and their work
    async def create_agent(self, slug: str, display_name: str, **fields: Any) -> httpx.Response:
        return await self.http.post("/api/v1/agents",
                                    json={"slug": slug, "display_name": display_name, **fields})

    async def delete_agent(self, agent_id: str) -> httpx.Response:
        """Only where the dialect's rollback retires agents (this API keeps them)."""
        return await self.http.delete(f"/api/v1/agents/{agent_id}")

    async def agent(self, agent_id: str) -> httpx.Response:
        return await self.get(f"/api/v1/agents/{agent_id}")

    async def agents(self) -> httpx.Response:
        return await self.get("/api/v1/agents")

    async def create_task(self, agent_id: str, title: str, body: str = "") -> httpx.Response:
        return await self.http.post(f"/api/v1/agents/{agent_id}/tasks",
                                    json={"title": title, "body": body})

    async def change_task(self, agent_id: str, task_id: str, **changes: Any) -> httpx.Response:
        return await self.http.patch(f"/api/v1/agents/{agent_id}/tasks/{task_id}",
                                     json=changes)

    async def backlog(self, agent_id: str) -> httpx.Response:
        return await self.get(f"/api/v1/agents/{agent_id}/backlog")

    async def task(self, agent_id: str, task_id: str) -> httpx.Response:
        return await self.get(f"/api/v1/agents/{agent_id}/tasks/{task_id}")

    async def sandboxes(self, agent_id: str) -> httpx.Response:
        return await self.get(f"/api/v1/agents/{agent_id}/sandboxes")

    async def sessions(self, agent_id: str) -> httpx.Response:
        return await self.get(f"/api/v1/agents/{agent_id}/sessions")

    async def recording(self, agent_id: str, after: int = 0) -> httpx.Response:
        """An agent's recording events after the event `after`, a page at a time."""
        return await self.get(f"/api/v1/agents/{agent_id}/recording", after=after)

    async def wake(self, agent_id: str) -> httpx.Response:
        return await self.http.post(f"/api/v1/agents/{agent_id}/wake")

    async def add_heartbeat(self, agent_id: str, name: str, task_body: str,
                            every_seconds: int) -> httpx.Response:
        return await self.http.post(f"/api/v1/agents/{agent_id}/heartbeats", json={
            "name": name, "task_body": task_body, "every_seconds": every_seconds})

    async def fire_heartbeat(self, agent_id: str, name: str) -> httpx.Response:
        return await self.http.post(f"/api/v1/agents/{agent_id}/heartbeats/{name}/fire")

    async def trigger(self, token: str, title: str = "triggered") -> httpx.Response:
        return await self.http.post(f"/api/trigger/{token}", json={"title": title})

    # the switches
    async def kill_agent(self, agent_id: str) -> httpx.Response:
        return await self._stop(f"/api/v1/agents/{agent_id}/kill")

    async def resume_agent(self, agent_id: str) -> httpx.Response:
        return await self.http.post(f"/api/v1/agents/{agent_id}/resume")

    async def kill_fleet(self) -> httpx.Response:
        return await self._stop("/api/v1/fleet/kill")

    async def resume_fleet(self) -> httpx.Response:
        return await self.http.post("/api/v1/fleet/resume")

    async def fleet(self) -> httpx.Response:
        return await self.get("/api/v1/fleet")

    # the scoped kill flags (DESIGN §2.4): global (platform admins) and tool
    async def stop_globally(self, reason: str) -> httpx.Response:
        return await self._stop("/api/v1/flags/global", {"reason": reason})

    async def clear_global_stop(self, reason: str) -> httpx.Response:
        return await self.http.post("/api/v1/flags/global/clear", json={"reason": reason})

    async def stop_tool(self, tool: str, agent_id: str | None, reason: str) -> httpx.Response:
        return await self._stop("/api/v1/flags/tool", {
            "tool": tool, "reason": reason, **({"agent_id": agent_id} if agent_id else {})})

    async def clear_tool_stop(self, tool: str, agent_id: str | None, reason: str
                              ) -> httpx.Response:
        return await self.http.post("/api/v1/flags/tool/clear", json={
            "tool": tool, "reason": reason, **({"agent_id": agent_id} if agent_id else {})})

    async def notifications(self) -> httpx.Response:
        return await self.get("/api/v1/notifications")
