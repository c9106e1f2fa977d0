"""The `containers` stack: Postgres, the control plane and the puppet each in a container of
the stack's image on one Docker network per game day; a container per sandbox."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.act.puppet import RemotePuppet
from harness.nemesis import FaultRecord, Nemesis, RemoteFaultProxy
from harness.nemesis.database import PostgresContainer
from harness.nemesis.watchdog import alive
from harness.stack.base import (
    ADMIN_PASSWORD,
    Endpoints,
    Replica,
    free_port,
    lease_of,
    wait_until_healthy,
)
from harness.stack.processes import REPLICA_LINK

POSTGRES_SCRIPT = (
    "set -e; install -d -o postgres /var/lib/covey-pg; "
    "su postgres -s /bin/sh -c '"
    "PG=$(ls -d /usr/lib/postgresql/*/bin | tail -1); "
    "test -f /var/lib/covey-pg/data/PG_VERSION || { "
    # UTF8, never the C locale's SQL_ASCII: covey refuses that (agents' text is any language).
    "$PG/initdb -D /var/lib/covey-pg/data --auth=trust -U postgres -E UTF8 --no-locale "
    ">/dev/null && "
    "echo \"host all all 0.0.0.0/0 trust\" >> /var/lib/covey-pg/data/pg_hba.conf; }; "
    "exec $PG/postgres -D /var/lib/covey-pg/data -c listen_addresses=* -c fsync=off "
    "-c max_connections=300'"
)
HARNESS_LABEL = "covey.harness"
PUBLISH_ATTEMPTS = 5  # picks of a loopback port for a container's published one


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
    heartbeat_min_s: int | None = None  # COVEY_HEARTBEAT_MIN_S, when a game day asks

    @asynccontextmanager
    async def up(self) -> AsyncIterator[Endpoints]:
        # No registry here, so no reaper image: every container and the network carry the
        # game day's labels and are removed by label (and by the next run after a crash).
        os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
        import docker
        import docker.errors
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

        def start(container: DockerContainer, publish: int | None = None
                  ) -> DockerContainer:
            """Start the container, its port `publish` published on a loopback port of the
            host (read with published()). On 127.0.0.1 only (RUNBOOK): with_bind_ports()
            cannot name the address, the Docker API can. The host port is picked here, not
            left to Docker: Docker gives a port it chose anew at each start, and the nemesis
            starts a killed control plane's container again, which must come back at its URL.
            A port taken between its pick and Docker's bind ("port is already allocated", a
            CI run's set-up) is picked again; not so when the nemesis starts the container
            again, which must keep its port."""
            containers.append(container)
            for attempt in range(1, PUBLISH_ATTEMPTS + 1):
                if publish is not None:
                    container.ports[str(publish)] = ("127.0.0.1", free_port())  # type: ignore[assignment]
                try:
                    container.start()
                    return container
                except docker.errors.APIError as exc:
                    taken = any(m in str(exc) for m in ("port is already allocated",
                                                        "address already in use"))
                    if publish is None or not taken or attempt == PUBLISH_ATTEMPTS:
                        raise
                    # Created, never started: removed before the next try (by its labels
                    # otherwise, at the end of the game day). The stack starts its own
                    # containers one at a time; a sandbox the plane is starting is not one.
                    client = docker.from_env()
                    try:
                        for refused in client.containers.list(all=True, filters={
                                "label": f"covey.gameday={gameday}", "status": "created"}):
                            if "covey.sandbox" not in refused.labels:
                                refused.remove(force=True)
                    finally:
                        client.close()
            raise AssertionError("unreachable")

        def published(container: DockerContainer, port: int) -> int:
            """The loopback port start() published the container's `port` on: the one it
            picked, not asked of Docker again."""
            _, host_port = container.ports[str(port)]  # type: ignore[misc]
            return int(host_port)

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
            # The nemesis's proxy on the daemons' control channel, a container of its own on
            # the game day's network; it heals on its own deadlines even if we die.
            channel = await asyncio.to_thread(start, DockerContainer(self.image)
                                    .with_network(network)
                                    .with_network_aliases("channel")
                                    .with_kwargs(labels=labels)
                                    .with_command(["python", "-m", "harness.nemesis",
                                                   "--name", "control-channel",
                                                   "--target", "controlplane:8080",
                                                   "--listen", "0.0.0.0:8081",
                                                   "--control", "0.0.0.0:8082"]),
                                    8082)
            puppet = await asyncio.to_thread(start, DockerContainer(self.image)
                                             .with_network(network)
                                             .with_network_aliases("puppet")
                                             .with_kwargs(labels=labels)
                                             .with_command(["python", "-m", "harness.act.puppet",
                                                            "--host", "0.0.0.0",
                                                            "--port", "9000"]),
                                    9000)
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
                **({} if self.heartbeat_min_s is None
                   else {"COVEY_HEARTBEAT_MIN_S": str(self.heartbeat_min_s)}),
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
                                            8080)
            channel_port, puppet_port, plane_port = (
                published(channel, 8082), published(puppet, 9000), published(plane, 8080))
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
                        link = await asyncio.to_thread(start, DockerContainer(self.image)
                                                .with_network(network)
                                                .with_network_aliases("database-b")
                                                .with_kwargs(labels=labels)
                                                .with_command([
                                                    "python", "-m", "harness.nemesis",
                                                    "--name", REPLICA_LINK,
                                                    "--target", "postgres:5432",
                                                    "--listen", "0.0.0.0:5433",
                                                    "--control", "0.0.0.0:8082"]),
                                                8082)
                        link_port = published(link, 8082)
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
                            8080)
                        b_port = published(b, 8080)
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
                if logs:  # no empty files among the reports
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
