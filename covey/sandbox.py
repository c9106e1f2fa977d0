"""Sandboxes: the provider interface, the `process` backend, and the runner that owns their
lifecycle (DESIGN §2.5). Backends only start, watch and destroy; the runner decides when."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol
from uuid import UUID, uuid4

import structlog

from covey.cpu_group import CpuGroup
from covey.db import MAY_RUN, BatchedWrite, Pool, through_outage
from covey.logs import log_failure

log = structlog.get_logger(__name__)
_log_task_failure = log_failure(log, "sandbox task failed")


@dataclass(frozen=True)
class SandboxSpec:
    sandbox_id: UUID
    agent_id: UUID
    session_id: UUID
    home: Path
    env: dict[str, str]


@dataclass(frozen=True)
class DaemonExit:
    """How and when a sandbox's daemon ended, as its backend saw it."""

    code: int
    at_ns: int  # wall clock: the process reaped, the container's `die`


class SandboxProvider(Protocol):
    name: str

    async def start(self, spec: SandboxSpec) -> str:
        """Start the sandbox and its daemon; return the backend's handle."""
        ...

    async def wait(self, handle: str) -> DaemonExit:
        """Wait until the sandbox's daemon has exited; its code and when."""
        ...

    async def remove(self, handle: str) -> None:
        """Once its daemon has exited, remove what is left of the sandbox (processes it
        started, the container); returns when nothing of it is left."""
        ...

    async def destroy(self, handle: str) -> None:
        """End the sandbox's daemon now, whatever it is doing."""
        ...

    def hasten(self, handles: list[str]) -> None:
        """Their agents were just killed: let their daemons obey ahead of the sandboxes at
        work, where the backend can at once (no wait, no round trip)."""
        ...

    async def close(self) -> None:
        """The control plane is going away: no sandbox of this provider outlives it."""
        ...


# What a local process needs to run at all; the rest of the control plane's environment
# (database URL, tokens) stays out of the sandbox.
PROCESS_BASE_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "PYTHONPATH",
                    "VIRTUAL_ENV", "SSL_CERT_FILE", "SSL_CERT_DIR")


# A process of a sandbox carries its sandbox's id in its environment, inherited by whatever
# it starts: the shell tool runs each command in a session of its own, so neither process
# group nor session finds those once coveyd is gone (SIGKILLed after its grace, a command
# it started kept deleting files).
SANDBOX_MARKER = "COVEY_SANDBOX_ID"
REMOVE_DEADLINE_S = 10.0
HASTENED_NICE = -20  # a killed agent's daemon, among the sandboxes at work (hasten)
# At most this many killed daemons are lifted out of the sandboxes' CPU group at once,
# those still running this long after their kill (hasten); a fleet's, outside it, would
# outweigh the control plane.
LIFTED_AT_MOST = 4
LIFT_AFTER_S = 0.01
SETTLE_AT_ONCE = 8  # a previous life's sandboxes torn down side by side
PASS_REST = 4.0  # after a pass over the process table, rest this many times as long,
PASS_REST_MAX_S = 0.25  # but never longer: a removal retries within REMOVE_DEADLINE_S


def _marker(sandbox_id: UUID | str) -> bytes:
    return f"{SANDBOX_MARKER}={sandbox_id}".encode()


def processes_marked(markers: frozenset[bytes]) -> dict[bytes, list[int]]:
    """The live processes whose environment carries one of `markers` (zombies have none).
    Linux's /proc; elsewhere nothing is found and process groups are all there is."""
    found: dict[bytes, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        for variable in environ.split(b"\0"):
            if variable in markers:
                found.setdefault(variable, []).append(int(entry))
    return found


def container_name(sandbox_id: UUID) -> str:
    """The docker backend's name for a sandbox's container: found by it when its row has
    no handle (a control plane that died between the start and the handle's write)."""
    return f"covey-sandbox-{sandbox_id}"


def _kill_marked(sandbox_id: UUID) -> None:
    """SIGKILL whatever still carries a sandbox's marker (one pass: a previous life's)."""
    marker = f"COVEY_SANDBOX_ID={sandbox_id}".encode()
    for pid in processes_marked(frozenset([marker])).get(marker, []):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


class ProcessTable:
    """One pass over the process table serves every sandbox waiting to be gone at that
    moment: a fleet kill reaps hundreds of sandboxes at once. One pass at a time: those who
    ask while a pass runs share the next one (a pass reads the environment of every process
    on the host, a thousand at a fleet kill of a thousand, and passes started side by side
    for each burst of exits competed with the kill's confirmations for the plane's CPU).

    A pass costs about 17 µs per process on the host, almost all of it the kernel's reading
    of each environment: at a fleet kill of 1,000 a pass took 15 to 25 ms and a hundred of them
    (1.6 to 1.8 s of the plane's CPU) ran during the exit wave. After each pass the table rests
    `rest` times as long before the next, so that its passes take at most a fifth of a core
    (at 1,000 processes a sandbox is found gone up to about 0.1 s later). The rest is capped:
    on a host so loaded that a pass takes seconds, a removal that must look again still
    gets its passes well within its deadline."""

    def __init__(self, rest: float = PASS_REST, rest_max_s: float = PASS_REST_MAX_S,
                 scan: Callable[[frozenset[bytes]], dict[bytes, list[int]]] = processes_marked
                 ) -> None:
        self._rest, self._rest_max_s = rest, rest_max_s
        self._scan = scan  # the pass itself: processes_marked, or a test's stand-in
        self._wanted: set[bytes] = set()
        self._next: asyncio.Future[dict[bytes, list[int]]] | None = None
        self._scanner: asyncio.Task[None] | None = None

    async def holders(self, marker: bytes) -> list[int]:
        self._wanted.add(marker)
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        if self._scanner is None:
            self._scanner = asyncio.ensure_future(self._scan_while_wanted())
        found = await asyncio.shield(self._next)
        return found.get(marker, [])

    async def _scan_while_wanted(self) -> None:
        result: asyncio.Future[dict[bytes, list[int]]] | None = None
        try:
            await asyncio.sleep(0)  # the callers of this turn of the loop share the pass
            while self._next is not None:
                # A pass begins after its callers asked: they killed what they look for first.
                wanted, result = frozenset(self._wanted), self._next
                self._wanted, self._next = set(), None
                began = time.monotonic()
                try:
                    result.set_result(await asyncio.to_thread(self._scan, wanted))
                except Exception as exc:
                    result.set_exception(exc)
                # Whoever asks during the rest shares the pass after it.
                await asyncio.sleep(min(self._rest * (time.monotonic() - began),
                                        self._rest_max_s))
        except BaseException:  # cancelled (the plane stops): nobody is left waiting for ever,
            for pending in (result, self._next):  # and the next caller starts afresh
                if pending is not None and not pending.done():
                    pending.cancel()
            self._wanted, self._next = set(), None
            raise
        finally:
            self._scanner = None


class ProcessProvider:
    """One `coveyd` subprocess per sandbox, in its own process group and home directory.
    The sandbox is gone once no process carrying its marker is left.

    Started off the event loop, and watched without a thread each: uvloop's own spawn forks
    the whole control plane and waits for the child's exec on the loop, and the move into
    the CPU group waits for the kernel (cgroup migration). Under 200 operators' load the two
    held the loop 25 ms at the median and up to 170 ms per start (kill_under_load; each
    killed agent's resume starts one), and every kill in flight waited with it."""

    name = "process"

    def __init__(self, command: list[str], log_dir: Path,
                 cpu_group: CpuGroup | None = None) -> None:
        self._command = command
        self._log_dir = log_dir
        self._cpu_group = cpu_group
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._markers: dict[str, bytes] = {}
        self._grouped: set[str] = set()  # the daemons that joined the CPU group (hasten)
        self._lifted: set[str] = set()  # of those, the ones lifted out of it since (hasten)
        # Where hasten's moves out of the group wait for the kernel: a thread of their own,
        # not the shared pool, where a kill's move would queue behind the sandboxes' starts.
        self._lifting = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="covey-lift")
        self._lifts = cpu_group is not None and cpu_group.moves_threads  # looked at once
        self._table = ProcessTable()
        self._closed = False

    async def start(self, spec: SandboxSpec) -> str:
        if self._closed:  # a wake still in flight at shutdown: nothing may start after close
            raise RuntimeError("the control plane is shutting down")
        spec.home.mkdir(parents=True, exist_ok=True)
        self._log_dir.mkdir(parents=True, exist_ok=True)
        base = {k: os.environ[k] for k in PROCESS_BASE_ENV if k in os.environ}
        env = {**base, **spec.env, "HOME": str(spec.home)}
        log_path = self._log_dir / f"{spec.sandbox_id}.log"

        def spawn() -> tuple[subprocess.Popen[bytes], bool]:
            with log_path.open("ab") as out:
                proc = subprocess.Popen(self._command, cwd=spec.home, env=env,
                                        stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            # At once: the daemon is still starting its interpreter, nothing forked yet.
            return proc, self._cpu_group is not None and self._cpu_group.join(proc.pid)

        spawning = asyncio.ensure_future(asyncio.to_thread(spawn))
        try:
            proc, grouped = await asyncio.shield(spawning)
        except asyncio.CancelledError:  # it starts all the same: it must not outlive this
            spawning.add_done_callback(_kill_spawned)
            raise
        handle = str(proc.pid)
        if self._closed:  # closed while it was being spawned
            await _destroyed(proc)
            raise RuntimeError("the control plane is shutting down")
        if grouped:
            self._grouped.add(handle)
        self._procs[handle] = proc
        self._markers[handle] = _marker(spec.sandbox_id)
        return handle

    async def wait(self, handle: str) -> DaemonExit:
        proc = self._procs.get(handle)
        if proc is None:
            return DaemonExit(-1, time.time_ns())
        exit_ = await _exit_of(proc)
        self._procs.pop(handle, None)
        self._grouped.discard(handle)
        self._lifted.discard(handle)
        return exit_

    async def remove(self, handle: str) -> None:
        """Kill what the daemon left running (its group, then anything carrying the
        sandbox's marker) until nothing is left. Bounded: a process that survives SIGKILL
        this long is reported, not waited for."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(int(handle), signal.SIGKILL)
        marker = self._markers.pop(handle, None)
        if marker is None:
            return
        deadline = time.monotonic() + REMOVE_DEADLINE_S
        while left := await self._table.holders(marker):
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {left} of the sandbox survived SIGKILL for "
                                   f"{REMOVE_DEADLINE_S:.0f}s")
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(0.01)

    def hasten(self, handles: list[str]) -> None:
        """Raise these daemons' priority within the sandboxes' CPU group to the highest
        (HASTENED_NICE): under 200 operators' load a killed agent's daemon, one of twenty
        busy sandboxes sharing the group, took up to 370 ms to read its `kill` and
        acknowledge it. Only the daemon's main thread, which reads the channel; its tools
        keep theirs. Only for a daemon that joined the group, whose share of the machine
        does not change, however high it is raised within: a fleet kill's thousand daemons
        outside it (no group, or a move refused) would outweigh the control plane. At nice
        -20 one daemon weighs as much as 87 at work beside it (at -10, as 9: a third of the
        group's share with nineteen of them). A syscall each, never a wait; refused (no
        CAP_SYS_NICE) it changes nothing.

        A killed daemon still running after LIFT_AFTER_S is also lifted out of the group
        (cgroup v1), its main thread into the plane's own CPU cgroup, at most
        LIFTED_AT_MOST at a time: within the group, a raised daemon still had only a part
        of the group's share, which the busy sandboxes hold down on a saturated host
        (its `kill_ack` p99 158-221 ms with 200 operators). Lifted, at nice 0, it weighs as
        one session of its own beside the plane's, Postgres's and the others where
        autogroups apply, and as one of the plane's own threads where they do not. The move
        waits for the kernel (a migration holds up every fork and exit meanwhile), so it is
        made by a thread of its own, 10 ms late: made at once, it cost a quiet host's kill
        0.4x the floor on its answer (kill_latency), where the daemon is gone by then."""
        grouped = []
        for handle in handles:
            # Running (`wait` forgets it with its exit), and not lifted already: outside the
            # group a second kill's raise would weigh against the plane.
            if handle in self._grouped and handle not in self._lifted:
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, int(handle), HASTENED_NICE)
                grouped.append(handle)
        if grouped and self._lifts:
            asyncio.get_running_loop().call_later(LIFT_AFTER_S, self._lift, grouped)

    def _lift(self, handles: list[str]) -> None:
        """Lift those of these daemons still running out of the sandboxes' CPU group (see
        hasten), from the lifting thread, while fewer than LIFTED_AT_MOST are lifted."""
        group = self._cpu_group
        if group is None or self._closed:
            return
        for handle in handles:
            if handle in self._grouped and len(self._lifted) < LIFTED_AT_MOST:
                self._lifted.add(handle)
                self._lifting.submit(self._lift_one, group, handle)

    def _lift_one(self, group: CpuGroup, handle: str) -> None:
        """On the lifting thread. Looked at again first (`_unreaped`): a daemon that has
        exited since may have been reaped, and its pid taken by another process. Put back
        at nice 0 before the move, not after it: moved first, it ran at HASTENED_NICE
        beside the plane's threads until this thread, at nice 0 among them, came to its
        next step. A move refused leaves it in the group, raised again."""
        if not self._unreaped(handle):
            return
        thread = int(handle)  # its main thread's id
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, thread, 0)
        if not group.lift(thread) and self._unreaped(handle):
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, thread, HASTENED_NICE)

    def _unreaped(self, handle: str) -> bool:
        """Whether the daemon still holds its pid: in the group, and not reaped. Its
        Popen's return code is set as it is reaped, on another thread, while `wait` forgets
        it in `_grouped` only later, on the loop: a pid freed in between may be another
        process's by then."""
        proc = self._procs.get(handle)
        return handle in self._grouped and proc is not None and proc.returncode is None

    async def destroy(self, handle: str) -> None:
        proc = self._procs.get(handle)
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    async def close(self) -> None:
        self._closed = True
        for handle in list(self._procs):
            await self.destroy(handle)
        self._lifting.shutdown(wait=False, cancel_futures=True)
        if self._cpu_group is not None:
            self._cpu_group.remove()


async def _exit_of(proc: subprocess.Popen[bytes]) -> DaemonExit:
    """The child's exit code (negative: the signal that ended it) and when it exited: the
    moment its pidfd turned readable, on the event loop. Where there is no pidfd (Linux
    before 5.3, another system), a thread of its own waits for it instead.

    Reaped in a thread, never on the loop: stamped under load, the reap of an exited daemon
    (a bare waitpid, even with WNOHANG) held the event loop 46-50 ms, twice in one run."""
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[int] = loop.create_future()
    try:
        fd = os.pidfd_open(proc.pid)
    except (OSError, AttributeError):  # no pidfd here, or the child is reaped already
        threading.Thread(target=lambda: (proc.wait(), loop.call_soon_threadsafe(
            _stamp, exited)), name=f"sandbox-{proc.pid}", daemon=True).start()
        at_ns = await exited
        return DaemonExit(proc.wait(), at_ns)  # reaped by that thread
    try:
        loop.add_reader(fd, _stamp, exited)
        try:
            at_ns = await exited
        except asyncio.CancelledError:  # the watch is given up (a closing plane): no zombie
            _reap_later(proc)
            raise
        finally:
            loop.remove_reader(fd)
    finally:
        os.close(fd)
    return DaemonExit(await asyncio.to_thread(proc.wait), at_ns)


def _reap_later(proc: subprocess.Popen[bytes]) -> None:
    threading.Thread(target=proc.wait, name=f"sandbox-{proc.pid}", daemon=True).start()


def _kill_spawned(spawning: asyncio.Future[tuple[subprocess.Popen[bytes], bool]]) -> None:
    """A start cancelled while its thread spawned: what it started is killed and reaped,
    whatever becomes of the cancelled start meanwhile."""
    if spawning.cancelled() or spawning.exception() is not None:
        return
    proc = spawning.result()[0]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    _reap_later(proc)


async def _destroyed(proc: subprocess.Popen[bytes]) -> None:
    """A sandbox's process group SIGKILLed, and its daemon reaped."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    await _exit_of(proc)


def _stamp(future: asyncio.Future[int]) -> None:
    if not future.done():
        future.set_result(time.time_ns())


def _resolve(future: asyncio.Future[DaemonExit], exit_: DaemonExit) -> None:
    if not future.done():
        future.set_result(exit_)


def docker_time_ns(stamp: str) -> int:
    """The engine's RFC 3339 timestamps carry nanoseconds, more than datetime parses."""
    try:
        whole, _, rest = stamp.rstrip("Z").partition(".")
        digits = "".join(itertools.takewhile(str.isdigit, rest))
        seconds = datetime.fromisoformat(whole).replace(tzinfo=UTC).timestamp()
        return int(seconds) * 1_000_000_000 + int((digits + "000000000")[:9])
    except ValueError:
        return time.time_ns()


class DockerProvider:
    """One container per sandbox, started through the Docker API, home directory mounted,
    labelled so that a crashed control plane's containers can be found and removed."""

    name = "docker"
    HOME = "/home/agent"

    def __init__(self, image: str, command: list[str], network: str, labels: dict[str, str],
                 log_dir: Path, memory: str = "512m", pids: int = 256,
                 cpu_shares: int = 128) -> None:
        import docker

        self._client = docker.from_env()
        self._image = image
        self._command = command
        self._network = network
        self._labels = labels
        self._memory = memory
        self._pids = pids
        # The docker backend's equal of the process sandboxes' CPU group (covey/cpu_group.py):
        # every container weighs as much as every other, so twenty busy sandboxes left the
        # control plane's container a twenty-first of a loaded host while a kill was due (its
        # flag's commit came 400 ms after the request, the daemons acting all the while).
        # Eight sandboxes now weigh as much as the plane; a sandbox alone still has all the
        # CPU nobody else wants (shares only weigh under contention).
        self._cpu_shares = cpu_shares
        self._log_dir = log_dir
        self._sandbox_of: dict[str, UUID] = {}
        self._dying: dict[str, asyncio.Future[DaemonExit]] = {}
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
                mem_limit=self._memory, pids_limit=self._pids, cpu_shares=self._cpu_shares,
                name=container_name(spec.sandbox_id))
            if self._closed:  # closed while the engine was starting it
                container.remove(force=True)
                raise RuntimeError("the control plane is shutting down")
            return str(container.id)

        handle = await asyncio.to_thread(run)
        self._sandbox_of[handle] = spec.sandbox_id
        return handle

    async def wait(self, handle: str) -> DaemonExit:
        """One thread follows the engine's `die` events for every sandbox; waiting costs no
        thread per container (a fleet kill stops hundreds at once). The exit is the
        engine's own time of the death, not when we heard of it."""
        import docker.errors

        loop = asyncio.get_running_loop()
        died: asyncio.Future[DaemonExit] = loop.create_future()
        self._dying[handle] = died
        self._ensure_events(loop)
        try:
            state = await asyncio.to_thread(
                lambda: self._client.containers.get(handle).attrs["State"])
            if not state.get("Running") and state.get("Status") in ("exited", "dead"):
                return DaemonExit(int(state.get("ExitCode", -1)),
                                  docker_time_ns(str(state.get("FinishedAt", ""))))
            return await died
        except docker.errors.NotFound:
            return DaemonExit(-1, time.time_ns())
        finally:
            self._dying.pop(handle, None)

    async def remove(self, handle: str) -> None:
        await asyncio.to_thread(self._remove, handle)

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
                at_ns = int(event.get("timeNano") or time.time_ns())
                future = self._dying.get(handle)
                if future is not None:
                    loop.call_soon_threadsafe(_resolve, future, DaemonExit(code, at_ns))

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
                    ignore_removed=True, all=True, filters={"label": f"covey.node={node}"}):
                with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                    container.remove(force=True)

        await asyncio.to_thread(sweep)

    def hasten(self, handles: list[str]) -> None:
        """Nothing: each container already weighs its `cpu_shares`, and raising them is a
        round trip to the engine, longer than the daemon takes to read its kill."""

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
    copy of it (restored at start); a real falling-asleep syncs the copy back. A warm
    agent's sandbox stays up between sessions, as covey's does: its daemon stays connected
    and idle (parked), the next wake hands it the new session at once, its copy is synced
    in the background at most every `warm_sync_s`, and after `warm_idle_s` it really falls
    asleep. A kill evicts a parked sandbox (tears the live sandbox down) and syncs nothing:
    what the home keeps is the last sync (the price the harness measures). Homes of killed
    sandboxes are kept as evidence, a few per agent.

    Each sandbox row records when its daemon exited (with the code), when the sandbox was
    gone (nothing of it left: processes reaped, container removed) and its last sync: the
    parts time-to-stop is made of, each at the moment it happened.

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
        # Sandboxes whose start is in flight: their daemon may connect, work and end its
        # session before the backend's start call returns (a container start on a loaded
        # host), and a warm one must still be parked then, not told to sleep.
        self._starting: set[UUID] = set()
        self._session_of: dict[UUID, UUID] = {}  # a warm sandbox takes up session after session
        self._evicting: set[UUID] = set()
        self._exited: dict[UUID, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self._prune_batch: tuple[set[UUID], asyncio.Future[None]] | None = None
        # Exits come in bursts (a fleet kill): their rows are written a batch at a time,
        # each with the time it happened, not the time its batch was written.
        self._record_exit = BatchedWrite(
            pool, "UPDATE sandboxes s SET exit_code=x.code, daemon_exited_at=x.at"
                  " FROM unnest($1::uuid[], $2::int[], $3::timestamptz[]) AS x(id, code, at)"
                  " WHERE s.id=x.id")
        self._record_gone = BatchedWrite(
            pool, "UPDATE sandboxes s SET gone_at=x.at,"
                  " ended_at=COALESCE(s.ended_at, x.at, now()),"
                  " state=CASE WHEN s.state IN ('starting','running','parked') THEN 'gone'"
                  " ELSE s.state END"
                  " FROM unnest($1::uuid[], $2::timestamptz[]) AS x(id, at) WHERE s.id=x.id")

    async def settle_previous_life(self, lease_s: float) -> None:
        """After a crash, the sandboxes this node started in its previous life (same host and
        port: only one process can hold them) are nobody's: their daemons lost their control
        plane and stop within their lease. Tear down what is left (a container) and record
        them gone, or their rows would say `running` for ever.

        Those of agents a stop holds (and those a kill evicted just before the crash: their
        teardown died with it) go at once: the stop has already decided their fate, and a
        game day found a killed agent's containers outliving its fleet kill by the restart
        plus this wait. The others' daemons get their lease to stop on their own first."""
        host_port = self.node.rsplit(":", 1)[0]
        await self._settle_orphans(host_port, held_only=True)
        await asyncio.sleep(lease_s)
        await self._settle_orphans(host_port, held_only=False)

    async def _settle_orphans(self, host_port: str, *, held_only: bool) -> None:
        orphans = await through_outage(lambda: self._pool.fetch(
            f"""
            SELECT s.id, s.handle, s.backend FROM sandboxes s
            JOIN agents a ON a.id=s.agent_id JOIN organizations o ON o.id=a.org_id
            WHERE s.node LIKE $1 || ':%' AND s.node <> $2
              AND (s.state IN ('starting','running','parked')
                   OR (s.state='evicted' AND s.gone_at IS NULL))
              AND (NOT $3 OR s.state='evicted' OR NOT ({MAY_RUN}))
            """, host_port, self.node, held_only), "a previous life's sandboxes")
        limit = asyncio.Semaphore(SETTLE_AT_ONCE)

        async def settle(row: Any) -> None:
            async with limit:
                if row["backend"] == self.backend == "docker":  # by name without a handle
                    # (a plane in a container does not see a sandbox's processes: the
                    # markers below would find nothing, and its row would say gone)
                    await self._provider.remove(row["handle"] or container_name(row["id"]))
                else:  # by the marker every process of it inherits, never by an old pid
                    await asyncio.to_thread(_kill_marked, row["id"])
                await through_outage(functools.partial(
                    self._record_gone.write, row["id"], _at(time.time_ns())), "sandbox gone")
        # One that cannot be torn down must not leave the others (or the second pass) undone.
        for row, failed in zip(orphans, await asyncio.gather(
                *(settle(row) for row in orphans), return_exceptions=True), strict=True):
            if isinstance(failed, BaseException):
                log.error("a previous life's sandbox not settled", sandbox_id=str(row["id"]),
                          error=repr(failed))
        if orphans:
            log.warning("sandboxes of a previous life settled", count=len(orphans),
                        held_by_a_stop=held_only)

    @property
    def backend(self) -> str:
        return self._provider.name

    def home_of(self, agent_id: UUID) -> Path:
        return self._homes / str(agent_id)

    def workdir_of(self, agent_id: UUID, sandbox_id: UUID) -> Path:
        return self._sandboxes / str(agent_id) / str(sandbox_id)

    def holds(self, sandbox_id: UUID) -> bool:
        """The sandbox is up, started by this runner (a warm one can be parked and reused)."""
        return ((sandbox_id in self._handles or sandbox_id in self._starting)
                and sandbox_id not in self._evicting)

    def take_up(self, sandbox_id: UUID, session_id: UUID) -> None:
        """A parked warm sandbox now runs `session_id`: its exit settles that session."""
        self._session_of[sandbox_id] = session_id

    async def start(self, spec_env: dict[str, str], sandbox_id: UUID, agent_id: UUID,
                    session_id: UUID) -> None:
        """Start the session's sandbox, watched from the moment it runs. Raises when it could
        not be started (or its handle not written: then it is torn down).

        The start is the runner's own task, carried through when the caller is cancelled
        (a request the plane gives up on in an outage: a wake, a trigger, a task's PATCH). A
        start cut off half-way left a container running that nobody watched: its exit never
        recorded, its row `starting` for ever. Carried through, the sandbox either runs its
        session or is torn down, and its watch settles the session; a start that fails with
        its caller gone settles the session itself (as a lost daemon)."""
        orphaned = asyncio.Event()
        task = asyncio.ensure_future(
            self._start(spec_env, sandbox_id, agent_id, session_id, orphaned))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and (current is None or current.cancelling() == 0):
                # The runner's close cancelled the start, not the caller: the caller is told
                # as it was before the start was the runner's (and loses its session).
                raise RuntimeError("the control plane is shutting down") from None
            orphaned.set()
            task.add_done_callback(log_failure(
                log, "sandbox start failed after its caller had gone",
                sandbox_id=str(sandbox_id)))
            raise

    async def _start(self, spec_env: dict[str, str], sandbox_id: UUID, agent_id: UUID,
                     session_id: UUID, orphaned: asyncio.Event) -> None:
        work = self.workdir_of(agent_id, sandbox_id)
        await asyncio.to_thread(_copy_home, self.home_of(agent_id), work)
        spec = SandboxSpec(sandbox_id, agent_id, session_id, work, spec_env)
        self._exited[sandbox_id] = asyncio.Event()
        self._session_of[sandbox_id] = session_id
        self._starting.add(sandbox_id)
        try:
            handle = await self._provider.start(spec)
            self._handles[sandbox_id] = handle
        except BaseException:
            # Nothing runs for it: forget it, and its row ends (an eviction while it started
            # included, which waited for the start to return).
            self._session_of.pop(sandbox_id, None)
            self._evicting.discard(sandbox_id)
            self._exited.pop(sandbox_id, asyncio.Event()).set()
            if not self._closing:  # else the next life settles it (settle_previous_life)
                self._spawn(self._never_started(sandbox_id, session_id, work, orphaned))
            raise
        finally:
            self._starting.discard(sandbox_id)
        # Watched from the moment it runs, whatever becomes of the write below: its exit is
        # recorded and its container removed. (A game day stopped the database between a
        # container's start and this write: the container ran unwatched, its row said
        # `starting` for ever.) Its exit's `gone` stands against a late write's `running`.
        self._spawn(self._watch(sandbox_id, agent_id, handle))
        if sandbox_id in self._evicting:  # parked and evicted by a kill while it started
            self._spawn(self._provider.destroy(handle))
        try:
            # The handle whatever the state: a session may have ended (and parked it) already.
            await self._pool.execute(
                "UPDATE sandboxes SET handle=$2,"
                " state=CASE WHEN state='starting' THEN 'running' ELSE state END WHERE id=$1",
                sandbox_id, handle,
            )
        except Exception:
            # The caller loses its session: nothing may run for it.
            self._spawn(self._provider.destroy(handle))
            raise

    async def _never_started(self, sandbox_id: UUID, session_id: UUID, work: Path,
                             orphaned: asyncio.Event) -> None:
        """What is left of a sandbox whose start failed: its copy of the home, its row, and
        (when nobody awaits the start any more) its session, settled as a lost daemon's."""
        await asyncio.to_thread(shutil.rmtree, work, True)
        await through_outage(lambda: self._record_gone.write(sandbox_id, _at(time.time_ns())),
                             "sandbox gone")
        if orphaned.is_set():
            await through_outage(lambda: self._on_exit(sandbox_id, session_id, -1),
                                 "daemon loss")

    async def _watch(self, sandbox_id: UUID, agent_id: UUID, handle: str) -> None:
        try:
            exit_ = await self._provider.wait(handle)
            self._handles.pop(sandbox_id, None)
            log.info("sandbox exited", sandbox_id=str(sandbox_id), exit_code=exit_.code)
            # Removed before anything is written: daemons stop on their own when the database
            # goes away (their leases lapse), and what is left of them (a stopped container)
            # must not wait for the database to come back. A game day cut one replica off
            # its database and found its stopped daemons' containers still there.
            gone: datetime | None = None
            try:
                await self._provider.remove(handle)
                gone = _at(time.time_ns())
            except Exception as exc:  # over, but no gone_at: nobody may read it as gone
                log.error("sandbox not removed", sandbox_id=str(sandbox_id), error=str(exc))
            # Their exits, at the time they happened, are recorded once it is back.
            await through_outage(lambda: self._record_exit.write(
                sandbox_id, exit_.code, _at(exit_.at_ns)), "sandbox exit")
            session_id = self._session_of.pop(sandbox_id)
            clean = await through_outage(lambda: self._on_exit(
                sandbox_id, session_id, exit_.code), "daemon loss") and exit_.code == 0
            if clean and sandbox_id not in self._evicting:
                await self.fall_asleep(sandbox_id, agent_id, gone)
                return
            # The state changes with gone_at: 'gone' is only ever read with nothing left.
            await through_outage(lambda: self._record_gone.write(sandbox_id, gone),
                                 "sandbox gone")
            if sandbox_id in self._evicting:
                self._evicting.discard(sandbox_id)
                await self._discard(sandbox_id, agent_id)
            else:
                await self._prune(agent_id)
        finally:
            self._exited.pop(sandbox_id, asyncio.Event()).set()

    async def fall_asleep(self, sandbox_id: UUID, agent_id: UUID,
                          gone: datetime | None) -> None:
        """The real falling-asleep: sync the home back (the sandbox is gone, its work
        still); then its row says gone."""
        work = self.workdir_of(agent_id, sandbox_id)
        if work.is_dir():  # else discarded meanwhile: an empty copy must not become the home
            await asyncio.to_thread(_replace_home, work, self.home_of(agent_id))
        else:
            log.warning("sandbox fell asleep without its home", sandbox_id=str(sandbox_id))
        await self._pool.execute(
            "UPDATE sandboxes SET state='gone', gone_at=$2, ended_at=COALESCE(ended_at, $2),"
            " last_sync_at=CASE WHEN $3 THEN now() ELSE last_sync_at END WHERE id=$1",
            sandbox_id, gone, work.is_dir())
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

    async def maintain_parked(self, tell_to_sleep: Callable[[UUID], Awaitable[bool]]) -> None:
        """Background sync of parked sandboxes (at most every warm_sync_s), the real
        falling-asleep of those idle past warm_idle_s (`tell_to_sleep` sends their daemon
        `sleep`, where it is connected here), and the teardown of evicted ones. Only this
        node's sandboxes."""
        idle = await self._pool.fetch(
            "UPDATE sandboxes SET state='starting' WHERE state='parked' AND node=$1"
            " AND parked_at < now() - make_interval(secs => $2) RETURNING id, agent_id",
            self.node, self.warm_idle_s,
        )
        for row in idle:  # 'starting' holds it against reuse while it falls asleep
            if not await tell_to_sleep(row["id"]):
                # No daemon to tell: sync what it holds, then end it.
                await self._sync_parked(row["id"], row["agent_id"], "starting")
                await self._end_idle(row["id"], row["agent_id"])
        due = await self._pool.fetch(
            "SELECT id, agent_id FROM sandboxes WHERE state='parked' AND node=$1"
            " AND COALESCE(last_sync_at, parked_at) < now() - make_interval(secs => $2)",
            self.node, self.warm_sync_s,
        )
        for row in due:
            await self._sync_parked(row["id"], row["agent_id"], "parked")
        evicted = await self._pool.fetch(
            "SELECT id, agent_id, node FROM sandboxes WHERE state='evicted' AND node=$1"
            " AND gone_at IS NULL", self.node)
        await self.discard_evicted(evicted)

    async def _sync_parked(self, sandbox_id: UUID, agent_id: UUID, state: str) -> None:
        work = self.workdir_of(agent_id, sandbox_id)
        try:
            await asyncio.to_thread(_replace_home, work, self.home_of(agent_id))
        except OSError as exc:  # evicted under our feet: nothing to sync any more
            log.info("parked sandbox vanished during sync", sandbox_id=str(sandbox_id),
                     error=str(exc))
            return
        await self._pool.execute("UPDATE sandboxes SET last_sync_at=now() WHERE id=$1"
                                 " AND state=$2", sandbox_id, state)

    async def _end_idle(self, sandbox_id: UUID, agent_id: UUID) -> None:
        handle = self._handles.get(sandbox_id)
        if handle is not None:
            await self._provider.destroy(handle)
            return
        await self._pool.execute(  # nothing of it runs here any more (a restart)
            "UPDATE sandboxes SET state='gone', ended_at=COALESCE(ended_at, now()),"
            " gone_at=COALESCE(gone_at, now()) WHERE id=$1", sandbox_id)
        await self._discard(sandbox_id, agent_id)

    def hasten(self, sandbox_ids: list[UUID]) -> None:
        """Kills of these sandboxes' agents are about to be sent: their daemons get the CPU
        to obey first, where the backend can (ProcessProvider.hasten)."""
        self._provider.hasten([h for s in sandbox_ids if (h := self._handles.get(s))])

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
        await self._destroy_left(sandbox_ids, grace)

    async def _destroy_left(self, sandbox_ids: list[UUID], grace: float) -> list[UUID]:
        left = {s: h for s in sandbox_ids if (exited := self._exited.get(s)) is not None
                and not exited.is_set() and (h := self._handles.get(s)) is not None}
        for sandbox_id in left:
            log.warning("sandbox did not exit; destroying it", sandbox_id=str(sandbox_id),
                        grace_s=grace)
        await asyncio.gather(*(self._provider.destroy(h) for h in left.values()))
        return list(left)

    def sandboxes_of(self, session_ids: list[UUID]) -> dict[UUID, UUID]:
        """The sandboxes this runner holds that run these sessions (session -> sandbox)."""
        wanted = set(session_ids)
        return {session: sandbox for sandbox, session in self._session_of.items()
                if session in wanted and sandbox in self._handles}

    async def tear_down_now(self, sandbox_ids: list[UUID], bound_s: float) -> list[UUID]:
        """The second line: destroy these sandboxes now, those whose daemon has not exited
        (process backend: SIGKILL of the daemon's process group; docker: `docker kill`),
        because their daemons did not acknowledge a kill within `bound_s`. Returns those
        destroyed; their exit and removal are recorded as any sandbox's are (`_watch`)."""
        return await self._destroy_left(sandbox_ids, bound_s)

    async def discard_evicted(self, evicted: list[Any]) -> None:
        """Tear down the sandboxes a kill or a wake evicted (covey's evictWarm), where they
        live on this node: a parked warm sandbox is up, its daemon idle, and is destroyed at
        once (its row then records the exit and when it was gone); its unsynced work is
        lost, by design. Returns without waiting for the teardown."""
        for row in evicted:
            sandbox_id = row["id"]
            if row["node"] != self.node or sandbox_id in self._evicting:
                continue
            handle = self._handles.get(sandbox_id)
            if handle is None and sandbox_id in self._starting:
                self._evicting.add(sandbox_id)  # torn down as soon as its start returns
                continue
            if handle is None:  # nothing runs: only its copy of the home is left
                await self._discard(sandbox_id, row["agent_id"])
                await self._pool.execute("UPDATE sandboxes SET gone_at=now() WHERE id=$1"
                                         " AND gone_at IS NULL", sandbox_id)
                continue
            self._evicting.add(sandbox_id)
            self._spawn(self._provider.destroy(handle))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_task_failure)

    async def close(self) -> None:
        self._closing = True
        for handle in list(self._handles.values()):
            await self._provider.destroy(handle)
        await self._provider.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _at(ns: int) -> datetime:
    return datetime.fromtimestamp(ns / 1e9, UTC)
