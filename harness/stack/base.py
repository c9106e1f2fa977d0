"""What every stack hands a game day (`Endpoints`), the `Stack` protocol, and the parts the
stacks share: a free port, the wait for a healthy control plane, the puppet model served
here or as a process of its own, the nemesis's fault proxy as a process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import uvicorn

from harness.act.puppet import Puppet, PuppetControl, RemotePuppet, create_app
from harness.nemesis import FaultRecord, Nemesis, RemoteFaultProxy
from harness.stack.waiting import eventually

ADMIN_PASSWORD = "game-day-admin-password"


@dataclass(frozen=True)
class Endpoints:
    url: str
    admin_email: str
    admin_password: str
    puppet: PuppetControl
    puppet_url: str  # the /v1 base URL the system under test's sandboxes use
    versions: dict[str, str]
    # The game day's faults; with a proxy named "control-channel" in front of the daemons'
    # WebSocket where the stack can place one (processes today).
    nemesis: Nemesis = field(default_factory=Nemesis)
    # A platform admin of the deployment, when there is one: then each game day creates an
    # organisation of its own (harness/stack/isolation.py).
    platform_email: str | None = None
    platform_password: str | None = None
    # The kill-flag lease the daemons hold (COVEY_LEASE_MS, from the control plane's
    # /healthz), None where it does not say; and the control plane's data folder where it is on this
    # machine (processes and containers stacks), which holds the agents' homes.
    lease_ms: int | None = None
    data_dir: Path | None = None
    # The control plane as a part the nemesis can crash and the stack can start again, where
    # the stack started it (processes, containers).
    control_plane: ControlPlane | None = None
    # A second replica of the control plane on the same database, where the stack can start
    # one (processes, containers): started on the first ask, kept as long as the stack.
    replica: Callable[[], Awaitable[Replica]] | None = None
    # The API the control plane speaks (harness/act/dialect.py): this project's, or upstream
    # covey's where a target deployment runs it.
    dialect: str = "covey-gameday"


@dataclass(frozen=True)
class Replica:
    """A second `covey serve` on the stack's database, reached through a fault proxy of the
    nemesis (`database_link`), so that a game day can cut that replica off its database while
    the first one serves on. Its daemons connect to it directly."""

    url: str
    node_prefix: str  # its sessions' `node` is "HOST:PORT:…", as covey names a replica
    database_link: str  # the name of the nemesis's proxy between it and Postgres
    plane: ControlPlane

    def holds(self, session: dict[str, Any]) -> bool:
        """Whether this replica holds the session's daemon connection. Read from the
        session's `node`, the replica that woke it: its daemon dials that replica's
        COVEY_PUBLIC_WS_URL, so the two are the same replica."""
        return str(session.get("node", "")).startswith(self.node_prefix)


class ControlPlane(Protocol):
    async def kill(self) -> FaultRecord:
        """SIGKILL the control plane (its sandboxes live on), logged by the nemesis."""
        ...

    async def start(self) -> None:
        """Start it again as the stack first did; returns once it answers /healthz."""
        ...

    async def pause(self, deadline_s: float) -> FaultRecord:
        """Freeze it (SIGSTOP, docker pause) until `resume` or the deadline, logged by the
        nemesis: while it is frozen, another replica alone takes up the work."""
        ...

    async def resume(self) -> None: ...


class Stack(Protocol):
    name: str

    def up(self) -> contextlib.AbstractAsyncContextManager[Endpoints]: ...


# Ports for servers started next are drawn from here up to the kernel's ephemeral range.
FREE_PORTS_FROM = 20000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_PICK = random.Random()  # its own: a test that seeds or watches the global one is not touched


def free_port() -> int:
    """A loopback TCP port no socket holds, for a server the caller starts next (the one
    free-port helper of the project: tests, benchmarks and stacks take theirs here).

    Drawn below the kernel's ephemeral range: a port that bind(0) hands out is one the kernel
    may give the next outgoing connection before the server binds it (a CI run's `covey
    serve` met "address already in use" so, among hundreds of client connections). Below the
    range only another listener can take it. Where there is no room below the range, bind(0)."""
    try:
        first_ephemeral = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 0
    room = first_ephemeral - FREE_PORTS_FROM >= 1000
    for _ in range(100):
        port = _PICK.randrange(FREE_PORTS_FROM, first_ephemeral) if room else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # held, or lingering after a close: draw again
            return int(s.getsockname()[1])
    raise RuntimeError(f"no free loopback port in 100 draws from {FREE_PORTS_FROM} up to "
                       f"{first_ephemeral} (the ephemeral range's start)")


async def wait_until_healthy(url: str, deadline_s: float, process: asyncio.subprocess.Process
                             | None = None, path: str = "/healthz") -> dict[str, Any]:
    """Poll /healthz until it answers ok (its body), the process dies (RuntimeError), or the
    deadline passes (TimeoutError, with the last answer)."""
    last = "no answer yet"

    async def healthy(http: httpx.AsyncClient) -> tuple[dict[str, Any]] | None:
        nonlocal last
        if process is not None and process.returncode is not None:
            raise RuntimeError(f"the process behind {url} exited with {process.returncode} "
                               "during start-up; its log is in the report directory")
        try:
            r = await http.get(f"{url}{path}")
        except httpx.HTTPError as exc:
            last = repr(exc)
            return None
        if r.status_code != 200:
            last = f"{r.status_code} {r.text[:200]}"
            return None
        # Upstream covey answers a plain `ok`: healthy, and says nothing more.
        try:
            body = r.json()
        except ValueError:
            body = {}
        return (body if isinstance(body, dict) else {},)  # a tuple: an empty body is healthy

    async with httpx.AsyncClient(timeout=2) as http:
        try:
            (found,) = await eventually(lambda: healthy(http), deadline_s,
                                        f"{url}{path} healthy", interval=0.1)
        except AssertionError:
            raise TimeoutError(f"{url}{path} not healthy after {deadline_s}s: {last}") from None
    return found


def lease_of(health: dict[str, Any]) -> int | None:
    """The kill-flag lease the control plane gives its daemons, as its /healthz says: what
    the stack is configured with, not what the harness asked for (a deployment's own, or
    a value the control plane clamped)."""
    lease = health.get("lease_ms")
    return lease if isinstance(lease, int) and not isinstance(lease, bool) else None


@asynccontextmanager
async def serve_puppet(puppet: Puppet, port: int | None = None) -> AsyncIterator[str]:
    """The puppet model on a loopback port; yields its OpenAI-compatible /v1 base URL."""
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(puppet), host="127.0.0.1", port=port,
                                           log_level="warning"))
    serving = asyncio.create_task(server.serve())

    async def started() -> bool:
        if serving.done():
            raise RuntimeError("the puppet model did not start: its server ended")
        return bool(server.started)
    try:
        await eventually(started, 20, "the puppet model started", interval=0.02)
    except AssertionError:
        raise RuntimeError("the puppet model did not start within 20 s") from None
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        await serving


@asynccontextmanager
async def puppet_process(log_dir: Path) -> AsyncIterator[RemotePuppet]:
    """The puppet model in a process of its own: its ledger stamps each request when it
    arrives, not when a busy harness's event loop gets round to it (in-process, 50 agents'
    calls were stamped after the kill that had already stopped them)."""
    port = free_port()
    log_path = log_dir / f"puppet-{port}.log"
    with log_path.open("ab") as log:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "harness.act.puppet", "--port", str(port),
            stdout=log, stderr=asyncio.subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_until_healthy(f"{url}/puppet", 30, process, path="/ledger")
        yield RemotePuppet(url)
    finally:
        if process.returncode is None:
            process.terminate()
            await process.wait()
        drop_if_empty(log_path)


@asynccontextmanager
async def proxy_process(name: str, target: int | str, log_dir: Path
                        ) -> AsyncIterator[RemoteFaultProxy]:
    """A fault proxy in front of 127.0.0.1:`target` (a port), or of `target` as
    `python -m harness.nemesis --target` takes it (HOST:PORT, unix:PATH), in a process of its
    own: its faults heal on their deadlines whatever the harness's event loop is doing, and
    even after the harness died (it then heals and exits)."""
    log_path = log_dir / f"proxy-{name}-{os.getpid()}.log"
    with log_path.open("ab") as log:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "harness.nemesis", "--name", name,
            "--target", f"127.0.0.1:{target}" if isinstance(target, int) else target,
            "--owner-pid", str(os.getpid()),
            stdout=asyncio.subprocess.PIPE, stderr=log)
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), 30)
        if not line:
            raise RuntimeError(f"the fault proxy {name} exited on start; see {log.name}")
        where = json.loads(line)
        yield RemoteFaultProxy(name, where["control"],
                               port=int(where["listen"].rpartition(":")[2]))
    finally:
        if process.returncode is None:
            process.terminate()
            await process.wait()
        drop_if_empty(log_path)


def drop_if_empty(log: Path) -> None:
    """A helper process that said nothing leaves no log: 19 empty ones once sat in reports/
    beside the journals people had to find."""
    with contextlib.suppress(OSError):
        if log.stat().st_size == 0:
            log.unlink()
