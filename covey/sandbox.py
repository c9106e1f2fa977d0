"""Sandboxes: the provider interface, the `process` backend, and the runner that owns their
lifecycle (DESIGN §2.5). Backends only start, watch and destroy; the runner decides when."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from uuid import UUID

import structlog

from covey.db import Pool

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
        env = {**os.environ, **spec.env, "HOME": str(spec.home)}
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


ExitCallback = Callable[[UUID, UUID, int], Awaitable[None]]


class Runner:
    """Starts sandboxes for sessions, watches them, and tears them down on a kill.

    The kill path never waits for a sandbox: the daemon has been told to stop and exits on
    its own (code 3); the runner gives it `kill_grace_s`, then destroys the sandbox.
    """

    def __init__(
        self,
        pool: Pool,
        provider: SandboxProvider,
        homes: Path,
        kill_grace_s: float,
        on_exit: ExitCallback,
    ) -> None:
        self._pool = pool
        self._provider = provider
        self._homes = homes
        self._grace = kill_grace_s
        self._on_exit = on_exit
        self._handles: dict[UUID, str] = {}
        self._exited: dict[UUID, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def backend(self) -> str:
        return self._provider.name

    def home_of(self, agent_id: UUID) -> Path:
        return self._homes / str(agent_id)

    async def start(self, spec_env: dict[str, str], sandbox_id: UUID, agent_id: UUID,
                    session_id: UUID) -> None:
        spec = SandboxSpec(sandbox_id, agent_id, session_id, self.home_of(agent_id), spec_env)
        self._exited[sandbox_id] = asyncio.Event()
        handle = await self._provider.start(spec)
        self._handles[sandbox_id] = handle
        await self._pool.execute(
            "UPDATE sandboxes SET handle=$2, state='running' WHERE id=$1 AND state='starting'",
            sandbox_id, handle,
        )
        self._spawn(self._watch(sandbox_id, session_id, handle))

    async def _watch(self, sandbox_id: UUID, session_id: UUID, handle: str) -> None:
        code = await self._provider.wait(handle)
        self._handles.pop(sandbox_id, None)
        await self._pool.execute(
            "UPDATE sandboxes SET state='gone', exit_code=$2, ended_at=now() WHERE id=$1",
            sandbox_id, code,
        )
        self._exited.pop(sandbox_id, asyncio.Event()).set()
        log.info("sandbox exited", sandbox_id=str(sandbox_id), exit_code=code)
        await self._on_exit(sandbox_id, session_id, code)

    def tear_down(self, sandbox_ids: list[UUID], told_to_stop: set[UUID]) -> None:
        """Make sure these sandboxes end. One whose daemon was told to stop gets the grace
        period to exit on its own (its exit code says it obeyed); any other is destroyed now."""
        for sandbox_id in sandbox_ids:
            grace = self._grace if sandbox_id in told_to_stop else 0.0
            self._spawn(self._tear_down(sandbox_id, grace))

    async def _tear_down(self, sandbox_id: UUID, grace: float) -> None:
        exited = self._exited.get(sandbox_id)
        if exited is None:
            return
        try:
            await asyncio.wait_for(exited.wait(), grace)
        except TimeoutError:
            handle = self._handles.get(sandbox_id)
            if handle is not None:
                log.warning("sandbox did not exit; destroying it", sandbox_id=str(sandbox_id),
                            grace_s=grace)
                await self._provider.destroy(handle)

    async def evict_warm(self, agent_id: UUID) -> list[UUID]:
        """Evict every parked sandbox of the agent (covey's evictWarm)."""
        rows = await self._pool.fetch(
            "UPDATE sandboxes SET state='evicted', ended_at=now() "
            "WHERE agent_id=$1 AND state='parked' RETURNING id",
            agent_id,
        )
        evicted = [r["id"] for r in rows]
        for sandbox_id in evicted:
            handle = self._handles.get(sandbox_id)
            if handle is not None:
                await self._provider.destroy(handle)
        return evicted

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for handle in list(self._handles.values()):
            await self._provider.destroy(handle)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
