"""The nemesis of one game day: every kind of fault on the one standing-fault mechanism, the
proxies, and the end-of-day check that every fault healed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.nemesis import halt
from harness.nemesis.containers import (
    ContainerFault,
    ContainerKill,
    check_stop_timeout,
    identity,
    network_settings,
    reconnect_settings,
)
from harness.nemesis.database import EmbeddedPostgres, PostgresContainer
from harness.nemesis.faults import (
    BadFault,
    FaultRecord,
    HealedBy,
    HealFailed,
    HealReport,
    check_deadline,
)
from harness.nemesis.plane import PLANE, PlaneCrash, Restartable
from harness.nemesis.processes import ProcessKill, ProcessPause
from harness.nemesis.proxy import FaultProxy, RemoteFaultProxy
from harness.nemesis.standing import StandingFaults
from harness.nemesis.watchdog import FaultRegistry

DATABASE_HEAL_GRACE_NS = 30_000_000_000

if TYPE_CHECKING:
    from docker import DockerClient
    from docker.models.containers import Container


class Nemesis:
    """All faults of one game day. `async with Nemesis() as nemesis`: leaving heals whatever
    still stands and closes the proxies, so call `verify_healed()` before leaving.

    Every fault that would outlive a dead harness (a paused process or container, a stopped
    container, a disconnect) has a detached watchdog that heals it just after its deadline,
    and is listed in `registry` for `gameday halt`; proxies run on their own heal on their own
    deadlines. Container faults go through `docker_client` (else a client from the
    environment, made on first use and closed on leaving).
    """

    def __init__(self, *, clock: Callable[[], int] = time.time_ns,
                 docker_client: DockerClient | None = None,
                 registry: FaultRegistry | None = None) -> None:
        self._clock = clock
        self._registry = registry or FaultRegistry()
        self._faults = StandingFaults(clock, self._registry)
        self._proxies: dict[str, FaultProxy | RemoteFaultProxy] = {}
        self._proxy_entries: list[Path] = []
        self._owned = contextlib.AsyncExitStack()
        self._docker = docker_client
        # On a stack reused by several game days, each judges only the faults since its start.
        self._since_ns = 0
        # The game day's Postgres, where the stack can fault it (processes, containers).
        self.database: EmbeddedPostgres | PostgresContainer | None = None

    async def __aenter__(self) -> Nemesis:
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.heal_all()
        finally:
            self._faults.close()
            for entry in self._proxy_entries:
                with contextlib.suppress(OSError):
                    entry.unlink()
            await self._owned.aclose()

    # ---------------------------------------------------------------- proxies

    async def proxy(self, name: str, target_host: str, target_port: int, *,
                    listen_port: int = 0, control: bool = True) -> FaultProxy:
        """Start a fault proxy in this process in front of one link; the nemesis closes it on
        exit. It dies with the harness, link and all: the stacks run theirs on their own."""
        if name in self._proxies:
            raise ValueError(f"a proxy named {name!r} already exists")
        proxy = FaultProxy(target_host, target_port, name=name, listen_port=listen_port,
                           control_port=0 if control else None, clock=self._clock)
        await self._owned.enter_async_context(proxy)
        self._proxies[name] = proxy
        return proxy

    async def add_remote(self, proxy: RemoteFaultProxy) -> RemoteFaultProxy:
        """Steer a proxy that runs elsewhere (it heals on its own deadlines there too)."""
        if proxy.name in self._proxies:
            raise ValueError(f"a proxy named {proxy.name!r} already exists")
        await proxy.refresh()
        self._proxies[proxy.name] = proxy
        self._proxy_entries.append(await asyncio.to_thread(
            self._registry.add, f"proxy-{proxy.name}", proxy.heal_order(), 0, None))
        return proxy

    async def refresh(self) -> None:
        """Read the logs of remote proxies; local ones are always current."""
        for proxy in self._proxies.values():
            if isinstance(proxy, RemoteFaultProxy):
                await proxy.refresh()

    def __getitem__(self, name: str) -> FaultProxy | RemoteFaultProxy:
        return self._proxies[name]

    @property
    def proxies(self) -> Mapping[str, FaultProxy | RemoteFaultProxy]:
        return dict(self._proxies)

    # ---------------------------------------------------------------- processes

    async def pause_process(self, pid: int, deadline_s: float) -> FaultRecord:
        """SIGSTOP `pid` and return once it is stopped; SIGCONT at the deadline. Pausing a
        paused pid replaces the pause (without letting it run in between)."""
        return await self.pause_processes([pid], deadline_s)

    async def pause_processes(self, pids: list[int], deadline_s: float,
                              target: str | None = None) -> FaultRecord:
        """SIGSTOP every one of `pids` at once (a database server with its backends, named
        `target` in the log); SIGCONT at the deadline."""
        check_deadline(deadline_s)
        if not pids:
            raise BadFault("No processes", "name at least one pid to pause.")
        record, _ = await self._faults.start(ProcessPause(pids, target), deadline_s)
        return record

    async def resume_process(self, pid: int) -> FaultRecord | None:
        """Heal the pause of `pid` at once (None when it is not paused by us)."""
        return await self._faults.heal(f"pid {pid}")

    async def resume(self, target: str) -> FaultRecord | None:
        """Heal the standing fault of a target by its name in the log ("postgres")."""
        return await self._faults.heal(target)

    async def kill_process(self, pid: int) -> FaultRecord:
        """SIGKILL `pid`. A pause of it ends with it (as "replaced": there is nothing left to
        continue)."""
        os.kill(pid, signal.SIGKILL)
        fault = ProcessKill(pid)
        record = self._faults.instant(fault)
        await self._faults.end_for_instant(fault.key, lift=False)
        return record

    # ---------------------------------------------------------------- the database

    def _the_database(self) -> EmbeddedPostgres | PostgresContainer:
        if self.database is None:
            raise BadFault("No database to fault", "this stack does not run the database "
                           "(a deployment's is not the harness's to pause or restart).")
        return self.database

    async def pause_database(self, deadline_s: float) -> FaultRecord:
        """Freeze Postgres (every process of it, sockets open) until the deadline."""
        check_deadline(deadline_s)
        database = self._the_database()
        if isinstance(database, PostgresContainer):
            return await self.pause_container(database.name, deadline_s)
        record, _ = await self._faults.start(database.pause(), deadline_s)
        return record

    async def restart_database(self, deadline_s: float) -> FaultRecord:
        """Stop Postgres at once (a crash, as its clients see it) and start it again at the
        deadline."""
        check_deadline(deadline_s)
        database = self._the_database()
        if isinstance(database, PostgresContainer):
            return await self.stop_container(database.name, deadline_s, timeout_s=0)
        record, _ = await self._faults.start(database.restart(), deadline_s)
        return record

    async def resume_database(self) -> FaultRecord | None:
        """Heal the database's standing fault at once (None when it has none)."""
        database = self._the_database()
        if isinstance(database, PostgresContainer):
            return await self.resume_container(database.name)
        return await self._faults.heal("postgres")

    def database_out(self) -> FaultRecord | None:
        """The database's standing fault (a pause, a restart), if one stands."""
        database = self.database
        if database is None:
            return None
        if isinstance(database, PostgresContainer):
            key = self._find_container_fault(database.name)
            return None if key is None else self._faults.standing(key)
        return self._faults.standing("postgres")

    # ---------------------------------------------------------------- the control plane

    async def crash_control_plane(self, plane: Restartable, deadline_s: float) -> FaultRecord:
        """SIGKILL the control plane (its sandboxes live on) and have the stack start it
        again at the deadline."""
        check_deadline(deadline_s)
        record, _ = await self._faults.start(PlaneCrash(plane, self._database_back),
                                             deadline_s)
        return record

    async def _database_back(self) -> None:
        """Until the database's standing fault has healed (at its deadline at the latest)."""
        while (out := self.database_out()) is not None:
            if self._clock() > (out.heals_at_ns or 0) + DATABASE_HEAL_GRACE_NS:
                raise HealFailed(f"the database's {out.kind} outlived its deadline: the "
                                 "control plane cannot start without it")
            await asyncio.sleep(0.05)

    def control_plane_down(self) -> FaultRecord | None:
        """The control plane's crash, while it stands."""
        return self._faults.standing(PLANE)

    async def kill_sandbox(self, sandbox: dict[str, Any]) -> FaultRecord:
        """SIGKILL a sandbox's daemon as the API shows the sandbox: its process on the
        process backend, its container on the docker backend."""
        handle, backend = sandbox.get("handle"), sandbox.get("backend")
        if not handle:
            raise BadFault("No handle", f"sandbox {sandbox.get('id')} has no handle yet.")
        if backend == "process":
            return await self.kill_process(int(handle))
        if backend == "docker":
            return await self.kill_container(handle)
        raise BadFault("Unknown sandbox backend", f"cannot kill a {backend!r} sandbox.")

    # ---------------------------------------------------------------- containers
    # `container` is a name or an id, and `network` too; one fault per container at a time.

    async def pause_container(self, container: str, deadline_s: float) -> FaultRecord:
        """docker pause `container` (its processes frozen, its sockets open); unpause at the
        deadline."""
        check_deadline(deadline_s)
        target = await self._get_container(container)
        record, _ = await self._faults.start(ContainerFault(target, "pause"), deadline_s)
        return record

    async def stop_container(self, container: str, deadline_s: float,
                             timeout_s: int = 10) -> FaultRecord:
        """docker stop `container` (its stop signal, SIGKILL after `timeout_s`) and return once
        it has stopped; start it again at the deadline, which counts from the stop's start,
        grace period included."""
        check_deadline(deadline_s)
        check_stop_timeout(timeout_s)
        target = await self._get_container(container)
        record, _ = await self._faults.start(
            ContainerFault(target, "stop", timeout_s=timeout_s), deadline_s)
        return record

    async def disconnect_container(self, container: str, network: str,
                                   deadline_s: float) -> FaultRecord:
        """Disconnect `container` from `network`; connect it again at the deadline with the
        aliases (and static addresses) it had there. Raises BadFault when it is not on the
        network."""
        check_deadline(deadline_s)
        target = await self._get_container(container)
        client = await self._docker_client()
        net = await asyncio.to_thread(client.networks.get, network)
        key, _ = identity(target)
        standing = self._faults.standing_fault(key)
        fault = ContainerFault(target, "disconnect", network=net)
        assert fault.network_id is not None
        if (isinstance(standing, ContainerFault) and standing.kind == "disconnect"
                and standing.network_id == fault.network_id):
            fault.reconnect = standing.reconnect  # off this network by us already
        else:
            settings = network_settings(target, fault.network_id)
            if settings is None:
                raise fault.not_on_it()
            fault.reconnect = reconnect_settings(target, settings)
        record, _ = await self._faults.start(fault, deadline_s)
        return record

    async def kill_container(self, container: str) -> FaultRecord:
        """docker kill `container` (SIGKILL): over once delivered, so healed by "instant";
        bringing it back is the stack's job, not a heal. A standing pause ends with it (as
        "replaced": the engine kills a paused container outright), and a standing disconnect
        is undone (as "replaced": a container stays off a network through a restart). Killing
        a container that is not running (one this nemesis stopped, say) raises APIError and
        changes nothing."""
        target = await self._get_container(container)
        await asyncio.to_thread(target.kill)
        fault = ContainerKill(target)
        record = self._faults.instant(fault)
        standing = self._faults.standing_fault(fault.key)
        await self._faults.end_for_instant(
            fault.key, lift=isinstance(standing, ContainerFault) and standing.kind == "disconnect")
        return record

    async def resume_container(self, container: str) -> FaultRecord | None:
        """Heal the standing fault of `container` (a name, an id or an id's prefix) at once;
        None when it has none of ours. Raises HealFailed when the fault cannot be lifted (the
        container was removed, say): the record's note says why, and the fault stands."""
        key = self._find_container_fault(container)
        return None if key is None else await self._faults.heal(key)

    def _find_container_fault(self, container: str) -> str | None:
        """The key of our standing fault of a container, found as the engine would find it
        (without asking the engine, which no longer knows a removed container)."""
        wanted = container.lstrip("/")
        faults = {key: f for key in self._faults.keys()
                  if isinstance(f := self._faults.standing_fault(key), ContainerFault)}
        for key, fault in faults.items():
            if wanted in (key, fault.name):
                return key
        prefixed = [key for key in faults if wanted and key.startswith(wanted)]
        return prefixed[0] if len(prefixed) == 1 else None

    async def _docker_client(self) -> DockerClient:
        if self._docker is None:
            import docker

            client = await asyncio.to_thread(docker.from_env)
            if self._docker is None:
                self._docker = client
                self._owned.callback(client.close)
            else:  # another fault made one meanwhile
                client.close()
        return self._docker

    async def _get_container(self, container: str) -> Container:
        client = await self._docker_client()
        return await asyncio.to_thread(client.containers.get, container)

    # ---------------------------------------------------------------- the end of a game day

    async def heal_all(self, how: HealedBy | None = None) -> list[FaultRecord]:
        """Heal every fault still standing, at once; returns them. Logged as healed by the
        halt while a halt stands (it is why a game day ends this way), else by "heal"."""
        how = how or ("halt" if halt.standing() is not None else "heal")
        healed = await self._faults.heal_all(how)
        for proxy in self._proxies.values():
            with contextlib.suppress(Exception):  # the record says why; verify_healed tells
                proxy_record = await proxy.heal(how)
                if proxy_record is not None:
                    healed.append(proxy_record)
        return healed

    def begin_game_day(self) -> None:
        """A new game day on the same stack: faults before now are no longer its own (they
        were healed at the end of theirs)."""
        self._since_ns = self._clock()

    def faults(self) -> list[FaultRecord]:
        """Every fault of the game day, by start time, as copies."""
        records = [*self._faults.log(),
                   *(r for proxy in self._proxies.values() for r in proxy.fault_log())]
        return sorted((r for r in records if r.started_ns >= self._since_ns),
                      key=lambda r: r.started_ns)

    def fault_log(self) -> list[dict[str, Any]]:
        """The faults as plain data for the journal: kind, target, start and heal wall-clock
        ns, and how each healed."""
        return [r.to_json() for r in self.faults()]

    def verify_healed(self) -> HealReport:
        faults = tuple(self.faults())
        unhealed = tuple(r for r in faults if not r.healed)
        return HealReport(healed=not unhealed, faults=faults, unhealed=unhealed)
