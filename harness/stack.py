"""The stack: brings the system under test up and down, the same interface for every backend
(DESIGN §3). `processes` runs the real parts as local processes on an embedded Postgres;
`target` starts nothing and points at an existing deployment. (`containers` is not built yet.)

A stack hands the game day its `Endpoints`: where the control plane answers, credentials of
an org admin, and the puppet model the agents talk to.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx
import uvicorn

from harness.puppet import Puppet, create_app

ADMIN_PASSWORD = "game-day-admin-password"


@dataclass(frozen=True)
class Endpoints:
    url: str
    admin_email: str
    admin_password: str
    puppet: Puppet
    puppet_url: str
    versions: dict[str, str]


class Stack(Protocol):
    name: str

    def up(self) -> contextlib.AbstractAsyncContextManager[Endpoints]: ...


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_until_healthy(url: str, deadline_s: float, process: asyncio.subprocess.Process
                             | None = None) -> dict[str, str]:
    """Poll /healthz until it answers ok, the process dies, or the deadline passes."""
    deadline = time.monotonic() + deadline_s
    last = "no answer yet"
    async with httpx.AsyncClient(timeout=2) as http:
        while time.monotonic() < deadline:
            if process is not None and process.returncode is not None:
                raise RuntimeError(f"the control plane exited with {process.returncode} "
                                   "during start-up; its log is in the report directory")
            try:
                r = await http.get(f"{url}/healthz")
                if r.status_code == 200:
                    body: dict[str, str] = r.json()
                    return body
                last = f"{r.status_code} {r.text[:200]}"
            except httpx.HTTPError as exc:
                last = repr(exc)
            await asyncio.sleep(0.1)
    raise TimeoutError(f"{url}/healthz not healthy after {deadline_s}s: {last}")


@asynccontextmanager
async def serve_puppet(puppet: Puppet, port: int | None = None) -> AsyncIterator[str]:
    """The puppet model on a loopback port; yields its OpenAI-compatible /v1 base URL."""
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(puppet), host="127.0.0.1", port=port,
                                           log_level="warning"))
    serving = asyncio.create_task(server.serve())
    deadline = time.monotonic() + 20
    while not server.started:
        if serving.done() or time.monotonic() > deadline:
            raise RuntimeError("the puppet model did not start")
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        await serving


@dataclass
class ProcessesStack:
    """Embedded Postgres (pgserver), `covey serve` as a subprocess with the process sandbox
    backend (one `coveyd` per sandbox), the puppet model in this process."""

    report_dir: Path
    tick_ms: int = 300
    lease_ms: int = 2000
    name: str = "processes"

    @asynccontextmanager
    async def up(self) -> AsyncIterator[Endpoints]:
        workdir = Path(tempfile.mkdtemp(prefix="covey-gameday-"))
        self.report_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.report_dir / f"control-plane-{workdir.name}.log"
        server = None
        plane: asyncio.subprocess.Process | None = None
        try:
            import pgserver  # type: ignore[attr-defined,unused-ignore]

            server = await asyncio.to_thread(
                pgserver.get_server,  # type: ignore[attr-defined]
                workdir / "pg", cleanup_mode="stop")
            database_url = str(server.get_uri())
            puppet = Puppet()
            async with serve_puppet(puppet) as puppet_url:
                port = free_port()
                env = {**os.environ, "DATABASE_URL": database_url,
                       "COVEY_DATA_DIR": str(workdir / "data"),
                       "COVEY_TICK_MS": str(self.tick_ms), "COVEY_LEASE_MS": str(self.lease_ms),
                       "COVEY_MODEL_URL": puppet_url, "COVEY_SANDBOX_BACKEND": "process"}
                env.pop("COVEY_DAEMON_COMMAND", None)
                admin = f"admin-{uuid.uuid4().hex[:6]}@gameday.test"
                boot = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "covey", "bootstrap", "--org", "gameday",
                    "--admin-email", admin, "--admin-password", ADMIN_PASSWORD, env=env,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
                _, err = await boot.communicate()
                if boot.returncode != 0:
                    raise RuntimeError(f"covey bootstrap failed: {err.decode()[-2000:]}")
                with log_path.open("ab") as log:
                    plane = await asyncio.create_subprocess_exec(
                        sys.executable, "-m", "covey", "serve", "--port", str(port), env=env,
                        stdout=log, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
                url = f"http://127.0.0.1:{port}"
                health = await wait_until_healthy(url, 60, plane)
                yield Endpoints(url, admin, ADMIN_PASSWORD, puppet, puppet_url,
                                {"covey": health.get("version", "?"),
                                 "python": sys.version.split()[0]})
        finally:
            if plane is not None and plane.returncode is None:
                # SIGTERM: the control plane destroys its sandboxes on the way out.
                plane.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(plane.wait(), 30)
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(plane.pid, signal.SIGKILL)
                    await plane.wait()
            if server is not None:
                await asyncio.to_thread(server.cleanup)
            shutil.rmtree(workdir, ignore_errors=True)


@dataclass
class TargetStack:
    """An existing deployment: nothing is started or stopped. Its sandboxes must reach the
    puppet model that this harness serves on `puppet_port` (start the deployment with
    COVEY_MODEL_URL=http://127.0.0.1:PORT/v1), and the credentials must be an org admin's."""

    url: str
    admin_email: str
    admin_password: str
    puppet_port: int | None = None
    name: str = "target"

    @asynccontextmanager
    async def up(self) -> AsyncIterator[Endpoints]:
        health = await wait_until_healthy(self.url.rstrip("/"), 30)
        puppet = Puppet()
        async with serve_puppet(puppet, self.puppet_port) as puppet_url:
            yield Endpoints(self.url.rstrip("/"), self.admin_email, self.admin_password, puppet,
                            puppet_url, {"covey": health.get("version", "?"),
                                         "python": sys.version.split()[0]})
