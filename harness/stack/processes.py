"""The `processes` stack: the real parts as local processes on an embedded Postgres (a
second replica on demand)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from harness.nemesis import FaultRecord, Nemesis
from harness.nemesis.database import EmbeddedPostgres
from harness.stack.base import (
    ADMIN_PASSWORD,
    Endpoints,
    Replica,
    free_port,
    lease_of,
    proxy_process,
    puppet_process,
    wait_until_healthy,
)
from harness.stack.postgres import link_of, through


class PlaneProcess:
    """`covey serve` as a subprocess, which the nemesis may SIGKILL and the stack start
    again on the same port, database and data folder."""

    def __init__(self, nemesis: Nemesis, port: int, env: dict[str, str],
                 log_path: Path) -> None:
        self.nemesis, self.port, self.env, self.log_path = nemesis, port, env, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.process: asyncio.subprocess.Process | None = None

    async def start_once(self) -> dict[str, str]:
        with self.log_path.open("ab") as log:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "covey", "serve", "--port", str(self.port),
                env=self.env, stdout=log, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True)
        return await wait_until_healthy(self.url, 60, self.process)

    async def start(self) -> None:
        if self.process is not None and self.process.returncode is None:
            raise RuntimeError("the control plane is still running: kill it first")
        await self.start_once()

    async def kill(self) -> FaultRecord:
        # Only the control plane itself, not its process group: its sandboxes' daemons live
        # on, as they would on a machine whose control plane crashed.
        assert self.process is not None
        record = await self.nemesis.kill_process(self.process.pid)
        await self.process.wait()
        return record

    async def pause(self, deadline_s: float) -> FaultRecord:
        assert self.process is not None
        return await self.nemesis.pause_process(self.process.pid, deadline_s)

    async def resume(self) -> None:
        assert self.process is not None
        await self.nemesis.resume_process(self.process.pid)

    async def stop(self) -> None:
        process = self.process
        if process is None or process.returncode is not None:
            return
        # SIGTERM: the control plane destroys its sandboxes on the way out.
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 30)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()


REPLICA_LINK = "database-replica-b"  # the nemesis's proxy between the second replica and Postgres


class SecondReplica:
    """The processes stack's second replica: `covey serve` on the same database through a
    fault proxy in a process of its own (REPLICA_LINK, registered with the nemesis), its own
    data folder and daemons, the same model; started on the first `get`."""

    LINK = REPLICA_LINK

    def __init__(self, nemesis: Nemesis, env: dict[str, str], database_url: str,
                 workdir: Path, log_dir: Path) -> None:
        self.nemesis, self.env, self.database_url = nemesis, env, database_url
        self.workdir, self.log_dir = workdir, log_dir
        self._owned = contextlib.AsyncExitStack()
        self._replica: Replica | None = None
        self._starting = asyncio.Lock()

    async def get(self) -> Replica:
        async with self._starting:
            if self._replica is None:
                self._replica = await self._start()
            return self._replica

    async def _start(self) -> Replica:
        link = await self._owned.enter_async_context(
            proxy_process(self.LINK, link_of(self.database_url), self.log_dir))
        await self.nemesis.add_remote(link)
        assert link.port is not None
        port = free_port()
        env = {**self.env, "DATABASE_URL": through(self.database_url, link.port),
               "COVEY_DATA_DIR": str(self.workdir / "data-replica-b"),
               "COVEY_PUBLIC_WS_URL": f"ws://127.0.0.1:{port}/api/daemon/ws"}
        plane = PlaneProcess(self.nemesis, port, env,
                             self.log_dir / f"control-plane-{self.workdir.name}-replica-b.log")
        self._owned.push_async_callback(plane.stop)
        await plane.start_once()
        return Replica(plane.url, f"{socket.gethostname()}:{port}:", self.LINK, plane)

    async def stop(self) -> None:
        await self._owned.aclose()


@dataclass
class ProcessesStack:
    """Embedded Postgres (pgserver), `covey serve` as a subprocess with the process sandbox
    backend (one `coveyd` per sandbox), the puppet model in this process."""

    report_dir: Path
    tick_ms: int = 300
    lease_ms: int = 2000
    name: str = "processes"
    # COVEY_HEARTBEAT_MIN_S when a game day asks for it (its `heartbeat_min_s` marker);
    # otherwise the control plane's own minute.
    heartbeat_min_s: int | None = None

    @asynccontextmanager
    async def up(self) -> AsyncIterator[Endpoints]:
        workdir = Path(tempfile.mkdtemp(prefix="covey-gameday-"))
        self.report_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.report_dir / f"control-plane-{workdir.name}.log"
        server = None
        plane: PlaneProcess | None = None
        try:
            import pgserver  # type: ignore[attr-defined,unused-ignore]

            server = await asyncio.to_thread(
                pgserver.get_server,  # type: ignore[attr-defined]
                workdir / "pg", cleanup_mode="stop")
            database_url = str(server.get_uri())
            async with (puppet_process(self.report_dir) as puppet, Nemesis() as nemesis,
                        proxy_process("control-channel", port := free_port(),
                                      self.report_dir) as channel):
                await nemesis.add_remote(channel)
                nemesis.database = EmbeddedPostgres(workdir / "pg", server.system_user)
                puppet_url = f"{puppet.url}/v1"
                env = {**os.environ, "DATABASE_URL": database_url,
                       "COVEY_PUBLIC_WS_URL": f"ws://127.0.0.1:{channel.port}/api/daemon/ws",
                       "COVEY_DATA_DIR": str(workdir / "data"),
                       "COVEY_TICK_MS": str(self.tick_ms), "COVEY_LEASE_MS": str(self.lease_ms),
                       "COVEY_MODEL_URL": puppet_url, "COVEY_SANDBOX_BACKEND": "process"}
                env.pop("COVEY_DAEMON_COMMAND", None)
                env.pop("COVEY_HEARTBEAT_MIN_S", None)
                if self.heartbeat_min_s is not None:
                    env["COVEY_HEARTBEAT_MIN_S"] = str(self.heartbeat_min_s)
                admin = f"admin-{uuid.uuid4().hex[:6]}@gameday.test"
                platform = f"platform-{uuid.uuid4().hex[:6]}@gameday.test"
                boot = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "covey", "bootstrap", "--org", "gameday",
                    "--admin-email", admin, "--admin-password", ADMIN_PASSWORD,
                    "--platform-admin-email", platform,
                    "--platform-admin-password", ADMIN_PASSWORD, env=env,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
                _, err = await boot.communicate()
                if boot.returncode != 0:
                    raise RuntimeError(f"covey bootstrap failed: {err.decode()[-2000:]}")
                plane = PlaneProcess(nemesis, port, env, log_path)
                health = await plane.start_once()
                replicas = SecondReplica(nemesis, env, database_url, workdir, self.report_dir)
                async with contextlib.AsyncExitStack() as owned:
                    owned.push_async_callback(replicas.stop)
                    yield Endpoints(plane.url, admin, ADMIN_PASSWORD, puppet, puppet_url,
                                    {"covey": health.get("version", "?"),
                                     "python": sys.version.split()[0]}, nemesis,
                                    platform, ADMIN_PASSWORD, lease_ms=lease_of(health),
                                    data_dir=workdir / "data", control_plane=plane,
                                    replica=replicas.get)
        finally:
            if plane is not None:
                await plane.stop()
            if server is not None:
                await asyncio.to_thread(server.cleanup)
                # A server the nemesis restarted is not the one pgserver knows to stop.
                await asyncio.to_thread(EmbeddedPostgres(workdir / "pg",
                                                         server.system_user).stop)
            shutil.rmtree(workdir, ignore_errors=True)
