"""Real control planes for tests and benchmarks: uvicorn on a loopback port in this process,
a real database, real HTTP; and a world to use them: two organisations whose humans each hold
an API token, with a client per role."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import uvicorn

from covey.app import create_app
from covey.config import GRACEFUL_SHUTDOWN_S, Settings
from covey.orchestrator import Orchestrator
from covey.security import hash_password, new_token, token_hash

ROLES = ("org_admin", "agent_owner", "security", "auditor", "controlling")


def loopback_socket(port: int = 0) -> socket.socket:
    """A loopback TCP socket bound to `port` (0: one the kernel picks), for uvicorn to serve
    on: bound before the server starts, no other socket can take its port in between (a
    port picked, closed and bound again later can be, by any outgoing connection)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart on the same port
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        raise
    return sock


async def until(check: Callable[[], Awaitable[bool]], deadline_s: float, message: str,
                interval: float = 0.05) -> None:
    """Poll check() until it is true; an AssertionError saying `message` at the deadline.
    (The harness's `eventually` does more; covey does not import the harness.)"""
    deadline = time.monotonic() + deadline_s
    while not await check():
        if time.monotonic() >= deadline:
            raise AssertionError(f"{message} (after {deadline_s:g}s)")
        await asyncio.sleep(interval)


@asynccontextmanager
async def served(app: Any) -> AsyncIterator[str]:
    """An ASGI app served by a real uvicorn on a free loopback port, for as long as the
    block runs: its base URL."""
    with loopback_socket() as sock:
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                               log_level="critical"))
        serving = asyncio.create_task(server.serve(sockets=[sock]))

        async def started() -> bool:
            return bool(server.started)
        await until(started, 10, "the test server did not start")
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            await serving


@dataclass
class Plane:
    url: str
    ws_url: str
    database_url: str
    data_dir: Path
    app: Any

    @property
    def orch(self) -> Orchestrator:
        orch: Orchestrator = self.app.state.orchestrator
        return orch

    def transcript(self, agent_id: str) -> list[dict[str, Any]]:
        """What the scripted daemon wrote down, over every sandbox of the agent still on
        disk (killed ones are kept as evidence; synced ones are in the agent's home)."""
        paths = [*(self.data_dir / "sandboxes" / agent_id).glob("*/transcript.jsonl"),
                 self.data_dir / "homes" / agent_id / "transcript.jsonl"]
        lines = [json.loads(line) for path in paths if path.exists()
                 for line in path.read_text().splitlines() if line]
        unique = {json.dumps(m, sort_keys=True): m for m in lines}
        return sorted(unique.values(), key=lambda m: m["at_ns"])


@asynccontextmanager
async def start_plane(database_url: str, data_dir: Path, daemon_command: list[str],
                      tick_ms: int = 300, lease_ms: int = 2000, port: int | None = None,
                      **overrides: Any) -> AsyncIterator[Plane]:
    with loopback_socket(port or 0) as sock:
        port = sock.getsockname()[1]
        settings = Settings(database_url=database_url, data_dir=data_dir, tick_ms=tick_ms,
                            lease_ms=lease_ms, daemon_command=daemon_command, **overrides)
        app = create_app(settings, host="127.0.0.1", port=port)
        # Idle connections kept as `covey serve` keeps them (covey.cli): with uvicorn's 5 s, a
        # benchmark's kept-alive client that waited longer on a loaded host found its connection
        # closed under its next request (kill_latency died of that IncompleteReadError).
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                lifespan="on", ws="websockets-sansio", ws_per_message_deflate=False,
                                timeout_keep_alive=30,
                                # As `covey serve`: a daemon channel whose peer vanished without a
                                # close held the stop open (a test's teardown hung 30 s, and its
                                # leftover daemon failed the worker's next test).
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        await until(lambda: _started(server, serving), 30, "control plane did not start")
        try:
            yield Plane(f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}/api/daemon/ws",
                        database_url, data_dir, app)
        finally:
            server.should_exit = True
            try:
                await asyncio.wait_for(asyncio.shield(serving), 30)
            except TimeoutError:
                # Once seen under CI load, and not since: say what the plane was still waiting
                # on (uvicorn waits for every open connection's handler), then stop it anyway.
                stuck = _stacks_of_pending_tasks()
                server.force_exit = True
                serving.cancel()
                raise TimeoutError(f"the control plane did not stop within 30 s; "
                                   f"{len(server.server_state.connections)} connection(s) "
                                   f"open; its pending tasks:\n{stuck}") from None


def _stacks_of_pending_tasks(limit: int = 40) -> str:
    """Where each of this loop's pending tasks waits, one line per frame (at most `limit`
    tasks), to say what a stop that hung was waiting on."""
    import io

    lines = []
    for task in list(asyncio.all_tasks())[:limit]:
        out = io.StringIO()
        task.print_stack(limit=6, file=out)
        lines.append(out.getvalue())
    return "\n".join(lines)


async def _started(server: uvicorn.Server, serving: asyncio.Task[None]) -> bool:
    if serving.done():
        serving.result()  # raises the start-up error
        raise RuntimeError("control plane exited during start-up")
    return server.started


@dataclass
class Org:
    id: uuid.UUID
    humans: dict[str, uuid.UUID]
    clients: dict[str, httpx.AsyncClient]


@dataclass
class World:
    plane: Plane
    db: asyncpg.Pool
    org: Org
    other: Org
    anonymous: httpx.AsyncClient
    _clients: list[httpx.AsyncClient] = field(default_factory=list)

    def __getattr__(self, role: str) -> httpx.AsyncClient:
        if role in ROLES:
            return self.org.clients[role]
        raise AttributeError(role)

    async def agent(self, slug: str | None = None, **fields: Any) -> dict[str, Any]:
        body = {"slug": slug or f"a-{uuid.uuid4().hex[:8]}", "display_name": "Test agent",
                **fields}
        r = await self.org.clients["org_admin"].post("/api/v1/agents", json=body)
        assert r.status_code == 201, r.text
        agent: dict[str, Any] = r.json()
        return agent

    async def task(self, agent_id: str, body: str, title: str = "task",
                   client: httpx.AsyncClient | None = None) -> dict[str, Any]:
        c = client or self.org.clients["org_admin"]
        r = await c.post(f"/api/v1/agents/{agent_id}/tasks", json={"title": title, "body": body})
        assert r.status_code == 201, r.text
        task: dict[str, Any] = r.json()
        return task

    async def task_state(self, task_id: str) -> str:
        state: str = await self.db.fetchval("SELECT state FROM backlog_tasks WHERE id=$1",
                                            uuid.UUID(task_id))
        return state

    async def wait_task(self, task_id: str, state: str, deadline_s: float = 20) -> None:
        async def reached() -> bool:
            return await self.task_state(task_id) == state
        try:
            await until(reached, deadline_s, f"task {task_id} never became {state}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{await self.task_story(task_id)}") from None

    async def task_story(self, task_id: str) -> str:
        """Where a task and its agent stand, for a wait that ran out: the task's row and
        transitions, the agent's sessions and sandboxes, and the end of each sandbox's log
        (a rare failure is read from this, not rerun)."""
        task = await self.db.fetchrow(
            "SELECT agent_id, state, daemon_retries, claimed_by FROM backlog_tasks"
            " WHERE id=$1", uuid.UUID(task_id))
        if task is None:
            return "no such task"
        moves = await self.db.fetch(
            "SELECT from_state, to_state, note, at FROM task_transitions WHERE task_id=$1"
            " ORDER BY id", uuid.UUID(task_id))
        sessions = await self.db.fetch(
            "SELECT id, sandbox_id, state, stop_reason, started_at, ended_at FROM sessions"
            " WHERE agent_id=$1 ORDER BY started_at", task["agent_id"])
        boxes = await self.db.fetch(
            "SELECT id, state, exit_code, created_at, gone_at FROM sandboxes"
            " WHERE agent_id=$1 ORDER BY created_at", task["agent_id"])
        lines = [f"task: {dict(task)}", *(f"  moved: {dict(m)}" for m in moves),
                 *(f"session: {dict(s)}" for s in sessions)]
        for box in boxes:
            lines.append(f"sandbox: {dict(box)}")
            log = self.plane.orch.settings.sandbox_log_dir / f"{box['id']}.log"
            if log.exists():
                lines += [f"  log: {line}" for line in
                          log.read_text(errors="replace").splitlines()[-5:]]
        return "\n".join(lines)

    async def wait_working(self, agent_id: str, deadline_s: float = 20) -> None:
        async def working() -> bool:
            status = await self.db.fetchval("SELECT status FROM agents WHERE id=$1",
                                            uuid.UUID(agent_id))
            return bool(status == "working")
        await until(working, deadline_s, f"agent {agent_id} never started working")

    async def event_mark(self) -> int:
        """The newest recording event's id: read what happens after it with started_since."""
        mark: int = await self.db.fetchval("SELECT coalesce(max(id), 0) FROM recording_events")
        return mark

    async def started_since(self, mark: int) -> dict[str, list[str]]:
        """Each agent's sessions started after `mark`, by the path that woke it ('resume',
        'tick', ...), oldest first."""
        started: dict[str, list[str]] = {}
        for row in await self.db.fetch(
                "SELECT agent_id, detail->>'path' AS path FROM recording_events WHERE id > $1"
                " AND kind='session' AND status='started' ORDER BY id", mark):
            started.setdefault(str(row["agent_id"]), []).append(row["path"])
        return started

    async def released(self, answer: httpx.Response, mark: int, agents: list[str]) -> None:
        """A release (a resume, a stop cleared) answered 200 and woke each of these agents at
        once. On a plane with a fast tick the scheduler's pass may lock a released agent
        first: the release then finds it busy and leaves it out of `agents_woken`. Either
        way each agent's one session since `mark` was started by one of the two."""
        assert answer.status_code == 200, answer.text
        woken = answer.json()["agents_woken"]
        started = await self.started_since(mark)
        assert set(woken) <= set(agents) and started == {
            a: ["resume" if a in woken else "tick"] for a in agents}, (woken, started)

    async def snapshot(self) -> dict[str, int]:
        """Row counts of every table: bad input must leave them all unchanged."""
        tables = [r["tablename"] for r in await self.db.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname='public' ORDER BY tablename")]
        counts = {}
        for t in tables:
            counts[t] = await self.db.fetchval(f'SELECT count(*) FROM "{t}"')
        counts["_flags"] = await self.db.fetchval(
            "SELECT count(*) FILTER (WHERE killed) FROM agents")
        counts["_fleet"] = await self.db.fetchval(
            "SELECT count(*) FILTER (WHERE fleet_killed) FROM organizations")
        return counts


@dataclass(frozen=True)
class OrgTokens:
    """An organisation as its people reach it: a human and a bearer API token per role."""

    id: uuid.UUID
    humans: dict[str, uuid.UUID]
    tokens: dict[str, str]  # role -> bearer token


async def create_org(db: asyncpg.Pool, name: str,
                     roles: tuple[str, ...] = ("org_admin", "security")) -> OrgTokens:
    """An organisation with one human and one API token per role, written straight into the
    database (as an operator's bootstrap would)."""
    org_id = uuid.uuid4()
    await db.execute("INSERT INTO organizations (id, name) VALUES ($1, $2)", org_id, name)
    password = hash_password("correct horse battery")
    humans, tokens = {}, {}
    for role in roles:
        human_id = uuid.uuid4()
        await db.execute(
            "INSERT INTO humans (id, org_id, email, password_hash, role) VALUES ($1,$2,$3,$4,$5)",
            human_id, org_id, f"{role}@{name}.test", password, role,
        )
        token = new_token("cvt")
        await db.execute("INSERT INTO api_tokens (token_hash, human_id, name) VALUES ($1,$2,$3)",
                         token_hash(token), human_id, "tests")
        humans[role], tokens[role] = human_id, token
    return OrgTokens(org_id, humans, tokens)


async def _org(db: asyncpg.Pool, plane: Plane, name: str, roles: tuple[str, ...],
               clients: list[httpx.AsyncClient]) -> Org:
    org = await create_org(db, name, roles)
    org_clients = {}
    for role, token in org.tokens.items():
        client = httpx.AsyncClient(base_url=plane.url, timeout=30,
                                   headers={"Authorization": f"Bearer {token}"})
        clients.append(client)
        org_clients[role] = client
    return Org(org.id, org.humans, org_clients)


@asynccontextmanager
async def make_world(plane: Plane) -> AsyncIterator[World]:
    db = await asyncpg.create_pool(plane.database_url, min_size=1, max_size=4)
    assert db is not None
    clients: list[httpx.AsyncClient] = []
    try:
        org = await _org(db, plane, "acme", ROLES, clients)
        other = await _org(db, plane, "globex", ("org_admin", "security"), clients)
        anonymous = httpx.AsyncClient(base_url=plane.url, timeout=30)
        clients.append(anonymous)
        yield World(plane, db, org, other, anonymous, clients)
    finally:
        for c in clients:
            await c.aclose()
        await db.close()


async def platform_admin_client(world: World) -> httpx.AsyncClient:
    """A platform admin's client (a world has org roles only); the caller closes it."""
    human_id, token = uuid.uuid4(), new_token("cvt")
    await world.db.execute(
        "INSERT INTO humans (id, org_id, email, password_hash, role)"
        " VALUES ($1, $2, 'platform@acme.test', $3, 'platform_admin')",
        human_id, world.org.id, hash_password("correct horse battery"))
    await world.db.execute("INSERT INTO api_tokens (token_hash, human_id, name)"
                           " VALUES ($1, $2, 'tests')", token_hash(token), human_id)
    return httpx.AsyncClient(base_url=world.plane.url, timeout=30,
                             headers={"Authorization": f"Bearer {token}"})
