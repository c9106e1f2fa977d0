"""Sandboxes: the provider interface, the `process` backend, and the runner that owns their
lifecycle (DESIGN §2.5). Backends only start, watch and destroy; the runner decides when."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from uuid import UUID, uuid4

import structlog

from covey.db import BatchedWrite, Pool

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class SandboxSpec:
    sandbox_id: UUID
    agent_id: UUID
    session_id: UUID
    home: Path
    env: dict[str, str]


class SandboxProvider(Protocol):
    name: str

    async def start(self, spec: SandboxSpec) -> str:
        """Start the sandbox and its daemon; return the backend's handle."""
        ...

    async def wait(self, handle: str) -> int:
        """Wait until the sandbox's daemon has exited; return its exit code."""
        ...

    async def destroy(self, handle: str) -> None:
        """Remove the sandbox now, whatever its daemon is doing."""
        ...

    async def close(self) -> None:
        """The control plane is going away: no sandbox of this provider outlives it."""
        ...


# What a local process needs to run at all; the rest of the control plane's environment
# (database URL, tokens) stays out of the sandbox.
PROCESS_BASE_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "PYTHONPATH",
                    "VIRTUAL_ENV", "SSL_CERT_FILE", "SSL_CERT_DIR")


class ProcessProvider:
    """One `coveyd` subprocess per sandbox, in its own process group and home directory."""

    name = "process"

    def __init__(self, command: list[str], log_dir: Path) -> None:
        self._command = command
        self._log_dir = log_dir
        self._procs: dict[str, asyncio.subprocess.Process] = {}

    async def start(self, spec: SandboxSpec) -> str:
        spec.home.mkdir(parents=True, exist_ok=True)
        self._log_dir.mkdir(parents=True, exist_ok=True)
        base = {k: os.environ[k] for k in PROCESS_BASE_ENV if k in os.environ}
        env = {**base, **spec.env, "HOME": str(spec.home)}
        log_path = self._log_dir / f"{spec.sandbox_id}.log"
        with log_path.open("ab") as out:
            proc = await asyncio.create_subprocess_exec(
                *self._command,
                cwd=spec.home,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        handle = str(proc.pid)
        self._procs[handle] = proc
        return handle

    async def wait(self, handle: str) -> int:
        proc = self._procs.get(handle)
        if proc is None:
            return -1
        code = await proc.wait()
        self._procs.pop(handle, None)
        return code

    async def destroy(self, handle: str) -> None:
        proc = self._procs.get(handle)
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    async def close(self) -> None:
        for handle in list(self._procs):
            await self.destroy(handle)


def _resolve(future: asyncio.Future[int], code: int) -> None:
    if not future.done():
        future.set_result(code)


class DockerProvider:
    """One container per sandbox, started through the Docker API, home directory mounted,
    labelled so that a crashed control plane's containers can be found and removed."""

    name = "docker"
    HOME = "/home/agent"

    def __init__(self, image: str, command: list[str], network: str, labels: dict[str, str],
                 log_dir: Path, memory: str = "512m", pids: int = 256) -> None:
        import docker

        self._client = docker.from_env()
        self._image = image
        self._command = command
        self._network = network
        self._labels = labels
        self._memory = memory
        self._pids = pids
        self._log_dir = log_dir
        self._sandbox_of: dict[str, UUID] = {}
        self._dying: dict[str, asyncio.Future[int]] = {}
        self._closed = False
        self._events_thread: threading.Thread | None = None

    async def start(self, spec: SandboxSpec) -> str:
        spec.home.mkdir(parents=True, exist_ok=True)
        labels = {**self._labels, "covey.sandbox": str(spec.sandbox_id),
                  "covey.agent": str(spec.agent_id), "covey.session": str(spec.session_id)}

        def run() -> str:
            if self._closed:
                raise RuntimeError("the control plane is shutting down")
            container = self._client.containers.run(
                self._image, self._command, detach=True, labels=labels,
                environment={**spec.env, "HOME": self.HOME},
                volumes={str(spec.home): {"bind": self.HOME, "mode": "rw"}},
                working_dir=self.HOME, network_mode=self._network,
                # An init as PID 1 passes signals on: `docker stop` reaches coveyd.
                init=True,
                mem_limit=self._memory, pids_limit=self._pids,
                name=f"covey-sandbox-{spec.sandbox_id}")
            if self._closed:  # closed while the engine was starting it
                container.remove(force=True)
                raise RuntimeError("the control plane is shutting down")
            return str(container.id)

        handle = await asyncio.to_thread(run)
        self._sandbox_of[handle] = spec.sandbox_id
        return handle

    async def wait(self, handle: str) -> int:
        """One thread follows the engine's `die` events for every sandbox; waiting costs no
        thread per container (a fleet kill stops hundreds at once)."""
        import docker.errors

        loop = asyncio.get_running_loop()
        died: asyncio.Future[int] = loop.create_future()
        self._dying[handle] = died
        self._ensure_events(loop)
        try:
            state = await asyncio.to_thread(
                lambda: self._client.containers.get(handle).attrs["State"])
            if not state.get("Running") and state.get("Status") in ("exited", "dead"):
                code = int(state.get("ExitCode", -1))
            else:
                code = await died
        except docker.errors.NotFound:
            code = -1
        finally:
            self._dying.pop(handle, None)
        await asyncio.to_thread(self._remove, handle)
        return code

    def _remove(self, handle: str) -> None:
        """Keep the daemon's log (as the process backend does), then remove the container."""
        import docker.errors

        sandbox_id = self._sandbox_of.pop(handle, None)
        with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
            container = self._client.containers.get(handle)
            if sandbox_id is not None:
                self._log_dir.mkdir(parents=True, exist_ok=True)
                (self._log_dir / f"{sandbox_id}.log").write_bytes(container.logs())
            container.remove(force=True)

    def _ensure_events(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._events_thread is not None and self._events_thread.is_alive():
            return

        # Replay from a little before now: a sandbox that died while the stream was still
        # connecting is not missed.
        since = int(time.time()) - 2

        def follow() -> None:
            events = self._client.events(decode=True, since=since, filters={
                "type": "container", "event": "die", "label": "covey.sandbox"})
            for event in events:
                handle = event.get("id", "")
                code = int(event.get("Actor", {}).get("Attributes", {}).get("exitCode", -1))
                future = self._dying.get(handle)
                if future is not None:
                    loop.call_soon_threadsafe(_resolve, future, code)

        self._events_thread = threading.Thread(target=follow, name="docker-events",
                                               daemon=True)
        self._events_thread.start()

    async def close(self) -> None:
        """Remove every sandbox container this replica started (its `covey.node` label),
        including one whose start was still in flight."""
        self._closed = True

        def sweep() -> None:
            import docker.errors

            node = self._labels.get("covey.node", "")
            for container in self._client.containers.list(
                    all=True, filters={"label": f"covey.node={node}"}):
                with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                    container.remove(force=True)

        await asyncio.to_thread(sweep)

    async def destroy(self, handle: str) -> None:
        def kill() -> None:
            import docker.errors

            with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                self._client.containers.get(handle).kill()

        await asyncio.to_thread(kill)


# Told that a sandbox's daemon exited, the orchestrator settles the session and answers
# whether it ended cleanly (a real falling-asleep, whose home is worth keeping).
ExitCallback = Callable[[UUID, UUID, int], Awaitable[bool]]

EVIDENCE_KEPT = 5  # homes of killed or lost sandboxes kept per agent, newest first


def _copy_home(src: Path, dst: Path) -> None:
    if src.is_dir():
        shutil.copytree(src, dst, symlinks=True)
    else:
        dst.mkdir(parents=True)


def _replace_home(src: Path, home: Path) -> None:
    """Make `home` a copy of `src`, never leaving it half-written: copy beside, then swap."""
    staging = home.with_name(f"{home.name}.sync-{uuid4().hex[:8]}")
    _copy_home(src, staging)
    trash = home.with_name(f"{home.name}.old-{uuid4().hex[:8]}")
    if home.exists():
        home.rename(trash)
    staging.rename(home)
    shutil.rmtree(trash, ignore_errors=True)


class Runner:
    """The sandbox lifecycle, the same for every backend (DESIGN §2.5).

    An agent's home (`homes/<agent>`) is the state of its last sync. A sandbox works in a
    copy of it (restored at start); a real falling-asleep syncs the copy back. With
    warm_sandbox the copy is parked instead, and synced in the background at most every
    `warm_sync_s`; the next wake reuses it; after `warm_idle_s` it really falls asleep. A kill
    evicts a parked sandbox and syncs nothing: what the home keeps is the last sync (the price
    the harness measures). Homes of killed sandboxes are kept as evidence, a few per agent.

    The kill path never waits for a sandbox: the daemon has been told to stop and exits on
    its own (code 3); the runner gives it `kill_grace_s`, then destroys the sandbox.
    """

    def __init__(
        self,
        pool: Pool,
        provider: SandboxProvider,
        data_dir: Path,
        node: str,
        kill_grace_s: float,
        on_exit: ExitCallback,
        warm_sync_s: float = 300.0,
        warm_idle_s: float = 900.0,
    ) -> None:
        self._pool = pool
        self._provider = provider
        self._homes = data_dir / "homes"
        self._sandboxes = data_dir / "sandboxes"
        self.node = node
        self._grace = kill_grace_s
        self._on_exit = on_exit
        self.warm_sync_s = warm_sync_s
        self.warm_idle_s = warm_idle_s
        self._handles: dict[UUID, str] = {}
        self._exited: dict[UUID, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._prune_batch: tuple[set[UUID], asyncio.Future[None]] | None = None
        # Exits come in bursts (a fleet kill): their rows are written a batch at a time.
        self._record_exit = BatchedWrite(
            pool, "UPDATE sandboxes s SET exit_code=x.code"
                  " FROM unnest($1::uuid[], $2::int[]) AS x(id, code) WHERE s.id=x.id")
        self._record_gone = BatchedWrite(
            pool, "UPDATE sandboxes SET state='gone', ended_at=now()"
                  " WHERE id = ANY($1::uuid[]) AND state IN ('starting','running')")

    @property
    def backend(self) -> str:
        return self._provider.name

    def home_of(self, agent_id: UUID) -> Path:
        return self._homes / str(agent_id)

    def workdir_of(self, agent_id: UUID, sandbox_id: UUID) -> Path:
        return self._sandboxes / str(agent_id) / str(sandbox_id)

    async def start(self, spec_env: dict[str, str], sandbox_id: UUID, agent_id: UUID,
                    session_id: UUID, warm: bool, reuse: bool) -> None:
        work = self.workdir_of(agent_id, sandbox_id)
        if not (reuse and work.is_dir()):
            await asyncio.to_thread(_copy_home, self.home_of(agent_id), work)
        spec = SandboxSpec(sandbox_id, agent_id, session_id, work, spec_env)
        self._exited[sandbox_id] = asyncio.Event()
        handle = await self._provider.start(spec)
        self._handles[sandbox_id] = handle
        await self._pool.execute(
            "UPDATE sandboxes SET handle=$2, state='running' WHERE id=$1 AND state='starting'",
            sandbox_id, handle,
        )
        self._spawn(self._watch(sandbox_id, agent_id, session_id, handle, warm))

    async def _watch(self, sandbox_id: UUID, agent_id: UUID, session_id: UUID, handle: str,
                     warm: bool) -> None:
        code = await self._provider.wait(handle)
        self._handles.pop(sandbox_id, None)
        await self._record_exit.write(sandbox_id, code)
        log.info("sandbox exited", sandbox_id=str(sandbox_id), exit_code=code)
        clean = await self._on_exit(sandbox_id, session_id, code) and code == 0
        if clean and warm:
            parked = await self._pool.fetchval(
                "UPDATE sandboxes SET state='parked', handle=NULL, parked_at=now()"
                " WHERE id=$1 AND state='running' RETURNING id", sandbox_id)
            if parked is None:  # evicted while it fell asleep
                await self._discard(sandbox_id, agent_id)
        elif clean:
            await self.fall_asleep(sandbox_id, agent_id)
        else:
            await self._record_gone.write(sandbox_id)
            await self._prune(agent_id)
        self._exited.pop(sandbox_id, asyncio.Event()).set()

    async def fall_asleep(self, sandbox_id: UUID, agent_id: UUID) -> None:
        """The real falling-asleep: sync the home back, then the sandbox is gone."""
        work = self.workdir_of(agent_id, sandbox_id)
        await asyncio.to_thread(_replace_home, work, self.home_of(agent_id))
        await self._pool.execute(
            "UPDATE sandboxes SET state='gone', ended_at=now(), last_sync_at=now()"
            " WHERE id=$1", sandbox_id)
        await asyncio.to_thread(shutil.rmtree, work, True)

    async def _discard(self, sandbox_id: UUID, agent_id: UUID) -> None:
        await asyncio.to_thread(shutil.rmtree, self.workdir_of(agent_id, sandbox_id), True)

    async def _prune(self, agent_id: UUID) -> None:
        """Prune the agent's evidence folders, in one thread hand-off for every agent whose
        sandbox exits meanwhile (a fleet kill's exits once took a hand-off each)."""
        batch = self._prune_batch
        if batch is None:
            batch = self._prune_batch = (set(), asyncio.get_running_loop().create_future())
            self._spawn(self._prune_soon(batch))
        batch[0].add(agent_id)
        await asyncio.shield(batch[1])

    async def _prune_soon(self, batch: tuple[set[UUID], asyncio.Future[None]]) -> None:
        await asyncio.sleep(0)  # the exits of this turn of the loop join the batch
        self._prune_batch = None
        agents, done = batch

        def prune_all() -> None:
            for agent_id in agents:
                try:
                    self._prune_evidence(agent_id)
                except OSError as exc:  # a folder removed under our feet: nothing to prune
                    log.info("evidence not pruned", agent_id=str(agent_id), error=str(exc))
        try:
            await asyncio.to_thread(prune_all)
        finally:
            done.set_result(None)

    def _prune_evidence(self, agent_id: UUID) -> None:
        folder = self._sandboxes / str(agent_id)
        if not folder.is_dir():
            return
        kept = sorted(folder.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in kept[EVIDENCE_KEPT:]:
            shutil.rmtree(old, ignore_errors=True)

    async def maintain_parked(self) -> None:
        """Background sync of parked sandboxes (at most every warm_sync_s) and the real
        falling-asleep of those idle past warm_idle_s. Only this node's sandboxes."""
        idle = await self._pool.fetch(
            "UPDATE sandboxes SET state='starting' WHERE state='parked' AND node=$1"
            " AND parked_at < now() - make_interval(secs => $2) RETURNING id, agent_id",
            self.node, self.warm_idle_s,
        )
        for row in idle:  # 'starting' holds it against reuse while it syncs
            await self.fall_asleep(row["id"], row["agent_id"])
        due = await self._pool.fetch(
            "SELECT id, agent_id FROM sandboxes WHERE state='parked' AND node=$1"
            " AND COALESCE(last_sync_at, parked_at) < now() - make_interval(secs => $2)",
            self.node, self.warm_sync_s,
        )
        for row in due:
            work = self.workdir_of(row["agent_id"], row["id"])
            try:
                await asyncio.to_thread(_replace_home, work, self.home_of(row["agent_id"]))
            except OSError as exc:  # evicted under our feet: nothing to sync any more
                log.info("parked sandbox vanished during sync", sandbox_id=str(row["id"]),
                         error=str(exc))
                continue
            await self._pool.execute("UPDATE sandboxes SET last_sync_at=now() WHERE id=$1"
                                     " AND state='parked'", row["id"])
        evicted = await self._pool.fetch(
            "SELECT id, agent_id FROM sandboxes WHERE state='evicted' AND node=$1", self.node)
        for row in evicted:
            await self._discard(row["id"], row["agent_id"])

    def tear_down(self, sandbox_ids: list[UUID], told_to_stop: set[UUID]) -> None:
        """Make sure these sandboxes end. One whose daemon was told to stop gets the grace
        period to exit on its own (its exit code says it obeyed); any other is destroyed now.
        One timer for the whole kill, not a task per sandbox: a fleet kill's thousand
        teardowns cost the control plane while its answer was still due."""
        now = [s for s in sandbox_ids if s not in told_to_stop and s in self._exited]
        later = [s for s in sandbox_ids if s in told_to_stop and s in self._exited]
        if now:
            self._spawn(self._destroy_unexited(now, 0.0))
        if later:
            asyncio.get_running_loop().call_later(
                self._grace, lambda: self._spawn(self._destroy_unexited(later, self._grace)))

    async def _destroy_unexited(self, sandbox_ids: list[UUID], grace: float) -> None:
        left = {s: h for s in sandbox_ids if (exited := self._exited.get(s)) is not None
                and not exited.is_set() and (h := self._handles.get(s)) is not None}
        for sandbox_id in left:
            log.warning("sandbox did not exit; destroying it", sandbox_id=str(sandbox_id),
                        grace_s=grace)
        await asyncio.gather(*(self._provider.destroy(h) for h in left.values()))

    async def discard_evicted(self, evicted: list[Any]) -> None:
        """Remove the homes of sandboxes a kill evicted (covey's evictWarm), where they live
        on this node; their unsynced work is lost, by design."""
        for row in evicted:
            if row["node"] == self.node:
                await self._discard(row["id"], row["agent_id"])

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for handle in list(self._handles.values()):
            await self._provider.destroy(handle)
        await self._provider.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
