"""The stack: brings the system under test up and down, the same interface for every backend
(DESIGN §3). `processes` runs the real parts as local processes on an embedded Postgres;
`target` starts nothing and points at an existing deployment; `containers` runs each part
in a container of the stack's image.

A stack hands the game day its `Endpoints`: where the control plane answers, credentials of
an org admin, and the puppet model the agents talk to.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import uvicorn

from harness.nemesis import FaultRecord, Nemesis, RemoteFaultProxy
from harness.nemesis.database import EmbeddedPostgres, PostgresContainer
from harness.nemesis.watchdog import alive
from harness.postgres import link_of, through
from harness.puppet import LocalPuppet, Puppet, PuppetControl, RemotePuppet, create_app

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
    # organisation of its own (harness/isolation.py).
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_until_healthy(url: str, deadline_s: float, process: asyncio.subprocess.Process
                             | None = None, path: str = "/healthz") -> dict[str, Any]:
    """Poll /healthz until it answers ok, the process dies, or the deadline passes."""
    deadline = time.monotonic() + deadline_s
    last = "no answer yet"
    async with httpx.AsyncClient(timeout=2) as http:
        while time.monotonic() < deadline:
            if process is not None and process.returncode is not None:
                raise RuntimeError(f"the process behind {url} exited with "
                                   f"{process.returncode} during start-up; its log is in the "
                                   "report directory")
            try:
                r = await http.get(f"{url}{path}")
                if r.status_code == 200:
                    body = r.json()
                    return body if isinstance(body, dict) else {}
                last = f"{r.status_code} {r.text[:200]}"
            except httpx.HTTPError as exc:
                last = repr(exc)
            await asyncio.sleep(0.1)
    raise TimeoutError(f"{url}{path} not healthy after {deadline_s}s: {last}")


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


@asynccontextmanager
async def puppet_process(log_dir: Path) -> AsyncIterator[RemotePuppet]:
    """The puppet model in a process of its own: its ledger stamps each request when it
    arrives, not when a busy harness's event loop gets round to it (in-process, 50 agents'
    calls were stamped after the kill that had already stopped them)."""
    port = free_port()
    with (log_dir / f"puppet-{port}.log").open("ab") as log:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "harness.puppet", "--port", str(port),
            stdout=log, stderr=asyncio.subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_until_healthy(f"{url}/puppet", 30, process, path="/ledger")
        yield RemotePuppet(url)
    finally:
        if process.returncode is None:
            process.terminate()
            await process.wait()


@asynccontextmanager
async def proxy_process(name: str, target: int | str, log_dir: Path
                        ) -> AsyncIterator[RemoteFaultProxy]:
    """A fault proxy in front of 127.0.0.1:`target` (a port), or of `target` as
    `python -m harness.nemesis --target` takes it (HOST:PORT, unix:PATH), in a process of its
    own: its faults heal on their deadlines whatever the harness's event loop is doing, and
    even after the harness died (it then heals and exits)."""
    with (log_dir / f"proxy-{name}-{os.getpid()}.log").open("ab") as log:
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


@dataclass
class TargetStack:
    """An existing deployment: nothing is started or stopped. Its sandboxes must reach the
    puppet model that this harness serves on `puppet_port` (start the deployment with
    COVEY_MODEL_URL=http://127.0.0.1:PORT/v1), and the credentials must be an org admin's."""

    url: str
    admin_email: str
    admin_password: str
    puppet_port: int | None = None
    platform_email: str | None = None
    platform_password: str | None = None
    name: str = "target"

    @asynccontextmanager
    async def up(self) -> AsyncIterator[Endpoints]:
        health = await wait_until_healthy(self.url.rstrip("/"), 30)
        puppet = Puppet()
        async with serve_puppet(puppet, self.puppet_port) as puppet_url:
            yield Endpoints(self.url.rstrip("/"), self.admin_email, self.admin_password,
                            LocalPuppet(puppet), puppet_url, {"covey": health.get("version", "?"),
                                         "python": sys.version.split()[0]},
                            platform_email=self.platform_email,
                            platform_password=self.platform_password,
                            lease_ms=lease_of(health))


# Postgres from the stack's own image: initdb, trust the game day's network (it is the game
# day's alone), fsync off (a game day's database is thrown away).
POSTGRES_SCRIPT = (
    "set -e; install -d -o postgres /var/lib/covey-pg; "
    "su postgres -s /bin/sh -c '"
    "PG=$(ls -d /usr/lib/postgresql/*/bin | tail -1); "
    "test -f /var/lib/covey-pg/data/PG_VERSION || { "
    "$PG/initdb -D /var/lib/covey-pg/data --auth=trust -U postgres >/dev/null && "
    "echo \"host all all 0.0.0.0/0 trust\" >> /var/lib/covey-pg/data/pg_hba.conf; }; "
    "exec $PG/postgres -D /var/lib/covey-pg/data -c listen_addresses=* -c fsync=off "
    "-c max_connections=300'"
)
HARNESS_LABEL = "covey.harness"


def reap_stale_game_days() -> list[str]:
    """Remove what game days of dead harness processes left behind (a crash, a SIGKILL):
    their containers, the sandboxes their control planes started, and their networks."""
    import docker

    client = docker.from_env()
    reaped = []
    try:
        for container in client.containers.list(ignore_removed=True, all=True,
                                                filters={"label": HARNESS_LABEL}):
            owner = int(container.labels.get("covey.owner_pid", "0") or 0)
            if owner and alive(owner):
                continue
            gameday = container.labels.get("covey.gameday", "")
            for c in client.containers.list(ignore_removed=True, all=True,
                                            filters={"label": f"covey.gameday={gameday}"}):
                with contextlib.suppress(docker.errors.NotFound):  # removed meanwhile
                    c.remove(force=True)
            reaped.append(gameday)
        for network in client.networks.list(filters={"label": HARNESS_LABEL}):
            owner = int(network.attrs.get("Labels", {}).get("covey.owner_pid", "0") or 0)
            if not (owner and alive(owner)):
                with contextlib.suppress(docker.errors.APIError):
                    network.remove()
    finally:
        client.close()
    return sorted(set(reaped))


class PlaneContainer:
    """The control plane's container: killed by the nemesis, started again as it was (its
    command bootstraps idempotently, then serves; its port stays published)."""

    def __init__(self, nemesis: Nemesis, name: str, url: str) -> None:
        self.nemesis, self.name, self.url = nemesis, name, url

    async def kill(self) -> FaultRecord:
        return await self.nemesis.kill_container(self.name)

    async def pause(self, deadline_s: float) -> FaultRecord:
        return await self.nemesis.pause_container(self.name, deadline_s)

    async def resume(self) -> None:
        await self.nemesis.resume_container(self.name)

    async def start(self) -> None:
        import docker

        def start() -> None:
            client = docker.from_env()
            try:
                client.containers.get(self.name).start()
            finally:
                client.close()

        await asyncio.to_thread(start)
        await wait_until_healthy(self.url, 90)


@dataclass
class ContainersStack:
    """Every part in a container of the stack's image, on one Docker network per game day:
    Postgres, the control plane (given the Docker API, so that it starts one sandbox
    container per session on the same network), the puppet model, and the nemesis's fault
    proxy in front of the daemons' control channel. Everything carries the
    game day's labels and is removed afterwards; a crashed harness's leftovers are reaped by
    the next one."""

    report_dir: Path
    image: str = "covey-gameday:latest"
    tick_ms: int = 300
    lease_ms: int = 2000
    name: str = "containers"

    @asynccontextmanager
    async def up(self) -> AsyncIterator[Endpoints]:
        # No registry here, so no reaper image: every container and the network carry the
        # game day's labels and are removed by label (and by the next run after a crash).
        os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
        from testcontainers.core.container import DockerContainer
        from testcontainers.core.network import Network
        from testcontainers.core.wait_strategies import LogMessageWaitStrategy

        await asyncio.to_thread(reap_stale_game_days)
        gameday = uuid.uuid4().hex[:10]
        labels = {HARNESS_LABEL: "1", "covey.gameday": gameday,
                  "covey.owner_pid": str(os.getpid())}
        # Sandbox homes are bind-mounted by the Docker engine from paths the control plane
        # names: the folder has the same path on the host and inside the control plane.
        workdir = Path(tempfile.mkdtemp(prefix=f"covey-gd-{gameday}-"))
        self.report_dir.mkdir(parents=True, exist_ok=True)
        network = Network(docker_network_kw={"labels": labels})
        containers: list[DockerContainer] = []

        def start(container: DockerContainer, publish: tuple[int, int] | None = None
                  ) -> DockerContainer:
            if publish is not None:
                # On 127.0.0.1 only (RUNBOOK): with_bind_ports() cannot name the address,
                # the Docker API can.
                container.ports[str(publish[0])] = ("127.0.0.1", publish[1])  # type: ignore[assignment]
            containers.append(container)
            container.start()
            return container

        try:
            await asyncio.to_thread(network.create)
            postgres = await asyncio.to_thread(start, DockerContainer(self.image)
                                               .with_network(network)
                                               .with_network_aliases("postgres")
                                               .with_kwargs(labels=labels)
                                               .with_command(["sh", "-c", POSTGRES_SCRIPT])
                                               .waiting_for(LogMessageWaitStrategy(
                                                   "database system is ready to accept "
                                                   "connections").with_startup_timeout(60)))
            puppet_port, plane_port, channel_port = free_port(), free_port(), free_port()
            # The nemesis's proxy on the daemons' control channel, a container of its own on
            # the game day's network; it heals on its own deadlines even if we die.
            await asyncio.to_thread(start, DockerContainer(self.image)
                                    .with_network(network)
                                    .with_network_aliases("channel")
                                    .with_kwargs(labels=labels)
                                    .with_command(["python", "-m", "harness.nemesis",
                                                   "--name", "control-channel",
                                                   "--target", "controlplane:8080",
                                                   "--listen", "0.0.0.0:8081",
                                                   "--control", "0.0.0.0:8082"]),
                                    (8082, channel_port))
            await asyncio.to_thread(start, DockerContainer(self.image)
                                             .with_network(network)
                                             .with_network_aliases("puppet")
                                             .with_kwargs(labels=labels)
                                             .with_command(["python", "-m", "harness.puppet",
                                                            "--host", "0.0.0.0",
                                                            "--port", "9000"]),
                                    (9000, puppet_port))
            admin = f"admin-{gameday}@gameday.test"
            platform = f"platform-{gameday}@gameday.test"
            env = {
                "DATABASE_URL": "postgresql://postgres@postgres:5432/postgres",
                "COVEY_DATA_DIR": str(workdir / "data"),
                "COVEY_TICK_MS": str(self.tick_ms), "COVEY_LEASE_MS": str(self.lease_ms),
                "COVEY_SANDBOX_BACKEND": "docker", "COVEY_SANDBOX_IMAGE": self.image,
                "COVEY_DOCKER_NETWORK": str(network.name), "COVEY_GAMEDAY": gameday,
                "COVEY_PUBLIC_WS_URL": "ws://channel:8081/api/daemon/ws",
                "COVEY_MODEL_URL": "http://puppet:9000/v1",
            }
            serve = (f"covey bootstrap --org gameday --admin-email {admin} "
                     f"--admin-password {ADMIN_PASSWORD} --platform-admin-email {platform} "
                     f"--platform-admin-password {ADMIN_PASSWORD} && "
                     "exec covey serve --host 0.0.0.0 --port 8080")
            plane = await asyncio.to_thread(start, DockerContainer(self.image)
                                            .with_network(network)
                                            .with_network_aliases("controlplane")
                                            .with_envs(**env)
                                            .with_volume_mapping("/var/run/docker.sock",
                                                                 "/var/run/docker.sock", "rw")
                                            .with_volume_mapping(str(workdir), str(workdir),
                                                                 "rw")
                                            .with_kwargs(labels=labels)
                                            .with_command(["sh", "-c", serve]),
                                            (8080, plane_port))
            url = f"http://127.0.0.1:{plane_port}"
            try:
                health = await wait_until_healthy(url, 90)
            except TimeoutError:
                logs = await asyncio.to_thread(plane.get_logs)
                raise RuntimeError("the control plane container never became healthy: "
                                   + b"".join(logs).decode(errors="replace")[-3000:]) from None
            await wait_until_healthy(f"http://127.0.0.1:{puppet_port}/puppet", 30,
                                     path="/ledger")
            await wait_until_healthy(f"http://127.0.0.1:{channel_port}", 30, path="/faults")
            async with Nemesis() as nemesis:
                await nemesis.add_remote(RemoteFaultProxy(
                    "control-channel", f"http://127.0.0.1:{channel_port}"))
                nemesis.database = PostgresContainer(
                    str(postgres.get_wrapped_container().name))
                replicas: list[Replica] = []
                starting = asyncio.Lock()

                async def replica() -> Replica:
                    """A second control-plane container on the same database, through a
                    proxy container the nemesis steers (started on the first ask)."""
                    async with starting:
                        if replicas:
                            return replicas[0]
                        link_port, b_port = free_port(), free_port()
                        await asyncio.to_thread(start, DockerContainer(self.image)
                                                .with_network(network)
                                                .with_network_aliases("database-b")
                                                .with_kwargs(labels=labels)
                                                .with_command([
                                                    "python", "-m", "harness.nemesis",
                                                    "--name", REPLICA_LINK,
                                                    "--target", "postgres:5432",
                                                    "--listen", "0.0.0.0:5433",
                                                    "--control", "0.0.0.0:8082"]),
                                                (8082, link_port))
                        await wait_until_healthy(f"http://127.0.0.1:{link_port}", 30,
                                                 path="/faults")
                        await nemesis.add_remote(RemoteFaultProxy(
                            REPLICA_LINK, f"http://127.0.0.1:{link_port}"))
                        b_env = {**env,
                                 "DATABASE_URL": "postgresql://postgres@database-b:5433/postgres",
                                 "COVEY_DATA_DIR": str(workdir / "data-b"),
                                 "COVEY_PUBLIC_WS_URL": "ws://replica-b:8080/api/daemon/ws"}
                        b = await asyncio.to_thread(
                            start, DockerContainer(self.image)
                            .with_network(network)
                            .with_network_aliases("replica-b")
                            .with_envs(**b_env)
                            .with_volume_mapping("/var/run/docker.sock",
                                                 "/var/run/docker.sock", "rw")
                            .with_volume_mapping(str(workdir), str(workdir), "rw")
                            .with_kwargs(labels=labels)
                            .with_command(["covey", "serve", "--host", "0.0.0.0",
                                           "--port", "8080"]),
                            (8080, b_port))
                        b_url = f"http://127.0.0.1:{b_port}"
                        await wait_until_healthy(b_url, 90)
                        wrapped = b.get_wrapped_container()
                        wrapped.reload()
                        replicas.append(Replica(
                            b_url, f"{wrapped.attrs['Config']['Hostname']}:8080:",
                            REPLICA_LINK, PlaneContainer(nemesis, str(wrapped.name), b_url)))
                        return replicas[0]
                yield Endpoints(url, admin, ADMIN_PASSWORD,
                                RemotePuppet(f"http://127.0.0.1:{puppet_port}"),
                                "http://puppet:9000/v1",
                                {"covey": health.get("version", "?"), "image": self.image,
                                 "python": sys.version.split()[0]}, nemesis,
                                platform, ADMIN_PASSWORD, lease_ms=lease_of(health),
                                data_dir=workdir / "data",  # the same path on this host
                                control_plane=PlaneContainer(
                                    nemesis, str(plane.get_wrapped_container().name), url),
                                replica=replica)
        finally:
            await asyncio.to_thread(self._tear_down, containers, network, gameday, workdir)

    def _tear_down(self, containers: list[Any], network: Any, gameday: str,
                   workdir: Path) -> None:
        import docker

        for container in reversed(containers):  # the control plane first: it stops sandboxes
            with contextlib.suppress(Exception):
                logs = b"".join(container.get_logs()).decode(errors="replace")
                name = container.get_wrapped_container().name
                (self.report_dir / f"{gameday}-{name}.log").write_text(logs)
            with contextlib.suppress(Exception):
                container.stop()
        client = docker.from_env()
        try:
            for c in client.containers.list(ignore_removed=True, all=True,
                                            filters={"label": f"covey.gameday={gameday}"}):
                with contextlib.suppress(docker.errors.NotFound):  # removed meanwhile
                    c.remove(force=True)
        finally:
            client.close()
        with contextlib.suppress(Exception):
            network.remove()
        shutil.rmtree(workdir, ignore_errors=True)
