"""The nemesis: faults with a deadline after which each heals itself, so a dead harness leaves
nothing broken, and a check at the end of a game day that every fault did heal.

What is here:
* `FaultProxy`: a TCP proxy on loopback in front of one protected link (the flag store, the
  control channel), with four faults and an HTTP control API (`control_app`):
  - `latency`: every chunk, both ways, is delivered `ms` after the proxy read it. Chunks keep
    their order and several can be in flight, as on a slow link (not one sleep per chunk,
    which would also cut throughput). On heal, chunks already in flight keep their delay.
  - `blackhole`: nothing is read or delivered, both ways; sockets stay open. Bytes the proxy
    already holds are kept, not dropped, and the peers' own buffers fill up. New connections
    are accepted (the kernel completes the handshake; only closing the listener could stop
    that, and that is `down`) but not connected upstream. On heal everything held flows, in
    order, on the same connections: TCP after a partition shorter than its retransmission
    timeout. Whether a peer gave up in the meantime is its own timeouts' business.
  - `reset`: every connection is reset (RST, via SO_LINGER 0) on both sides, and new ones are
    reset as soon as they are accepted while the fault stands.
  - `down`: the listener is closed, so new connections are refused, and every connection is
    closed (FIN) on both sides. Heal listens again on the same port.
  One fault at a time per proxy: a new fault replaces the one standing, which is logged as
  healed by "replaced". Connections opened after a heal are never affected.
* `Nemesis`: owns named proxies, the process faults (`pause_process`: SIGSTOP, SIGCONT at
  the deadline; `kill_process`: SIGKILL) and the container faults (`pause_container`,
  `stop_container`, `disconnect_container`, each undone at its deadline; `kill_container`),
  keeps the fault log for the journal and answers `verify_healed()`.

Deadlines run on timers in the process that holds the fault. A proxy inside the harness's
process dies with the harness and takes its link along: fine for a stack the harness started,
which goes too; a link that must outlive the harness goes through a proxy run on its own
(`python -m harness.nemesis`), which keeps its timers. A stopped process would stay stopped
forever, so each pause also starts a detached watchdog that sends SIGCONT shortly after the
deadline even if the harness is gone. Container faults have no such watchdog: the containers
stack's own are reaped, faults and all, once their harness is dead (see `Nemesis`).

Times in the log are wall-clock nanoseconds (`clock`, time.time_ns unless the game day's
History clock is passed); deadlines run on the monotonic clock.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from covey.errors import ApiError, install
from harness.waiting import eventually

if TYPE_CHECKING:
    from docker import DockerClient
    from docker.models.containers import Container

ProxyFaultKind = Literal["latency", "blackhole", "reset", "down"]
PROXY_FAULT_KINDS: tuple[ProxyFaultKind, ...] = get_args(ProxyFaultKind)
FaultKind = Literal["latency", "blackhole", "reset", "down", "pause", "kill", "stop",
                    "disconnect"]
# The container faults that stand until healed (a kill is over once delivered).
StandingContainerFaultKind = Literal["pause", "stop", "disconnect"]
# "replaced": a newer fault on the same target took its place; "instant": a kill, over once
# delivered (bringing the process back is the stack's job, not a heal).
HealedBy = Literal["deadline", "heal", "replaced", "instant"]

MAX_DEADLINE_S = 3600.0
MAX_LATENCY_MS = 600_000
CHUNK = 65536
IN_FLIGHT_CHUNKS = 64  # per direction and connection; beyond that the proxy stops reading
WATCHDOG_GRACE_S = 0.5  # the watchdog is a backstop: the harness's own timer goes first
REBIND_ATTEMPTS = 20
STOP_WAIT_S = 5.0
MAX_STOP_TIMEOUT_S = 600  # docker stop's grace period before its SIGKILL


class BadFault(ValueError):
    """A fault that cannot be injected as asked: `error` says what, `hint` how to fix it."""

    def __init__(self, error: str, hint: str) -> None:
        super().__init__(f"{error}: {hint}")
        self.error = error
        self.hint = hint


class HealFailed(RuntimeError):
    """A fault could not be lifted (a `down` proxy could not listen on its port again)."""


@dataclass
class FaultRecord:
    """One fault, from its start to its heal. Mutable while it stands; the log hands out
    copies."""

    id: str
    target: str  # a proxy's name, "pid <n>" or "container <name>"
    kind: FaultKind
    started_ns: int
    deadline_s: float | None = None
    ms: int | None = None
    network: str | None = None  # the network a container is disconnected from
    heals_at_ns: int | None = None
    healed_ns: int | None = None
    healed_by: HealedBy | None = None
    note: str | None = None  # why a heal failed, or what was odd about it

    @property
    def healed(self) -> bool:
        return self.healed_ns is not None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_deadline(deadline_s: float) -> None:
    if (isinstance(deadline_s, bool) or not isinstance(deadline_s, int | float)
            or not 0 < deadline_s <= MAX_DEADLINE_S):  # NaN fails the comparison too
        raise BadFault("Invalid deadline_s",
                       f"deadline_s must be a number of seconds, > 0 and <= {MAX_DEADLINE_S:g}, "
                       f"not {deadline_s!r}: every fault heals itself by its deadline.")


def check_proxy_fault(kind: str, deadline_s: float, ms: int | None) -> None:
    if kind not in PROXY_FAULT_KINDS:
        raise BadFault("Unknown fault kind",
                       f"kind must be one of {', '.join(PROXY_FAULT_KINDS)}, not {kind!r}.")
    check_deadline(deadline_s)
    if kind == "latency":
        if isinstance(ms, bool) or not isinstance(ms, int) or not 0 < ms <= MAX_LATENCY_MS:
            raise BadFault("Invalid ms", f"latency needs ms, an integer > 0 and <= "
                           f"{MAX_LATENCY_MS}, not {ms!r}.")
    elif ms is not None:
        raise BadFault("Unexpected ms", f"only latency takes ms; leave it out for {kind}.")


# ---------------------------------------------------------------- the fault proxy


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST instead of FIN: SO_LINGER 0, then drop the socket unflushed."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class _Link:
    """One client connection and its upstream connection."""

    def __init__(self, proxy: FaultProxy, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.proxy = proxy
        self.client = (reader, writer)
        self.upstream: asyncio.StreamWriter | None = None
        self.task = asyncio.create_task(self._run())

    def close(self, *, reset: bool) -> None:
        for writer in (self.client[1], self.upstream):
            if writer is None:
                continue
            if reset:
                _reset(writer)
            else:
                writer.close()
        if self.task is not asyncio.current_task():
            self.task.cancel()

    async def _run(self) -> None:
        await self.proxy._flowing.wait()  # a blackholed link carries not even the SYN upstream
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.proxy.target)
        except OSError:
            # Upstream refused: pass that on as a reset, the nearest a client can see.
            self.close(reset=True)
            return
        self.upstream = up_writer
        client_reader, client_writer = self.client
        broken = False
        try:
            async with asyncio.TaskGroup() as group:
                for src, dst in ((client_reader, up_writer), (up_reader, client_writer)):
                    in_flight: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(
                        IN_FLIGHT_CHUNKS)
                    group.create_task(self._read(src, in_flight))
                    group.create_task(self._deliver(in_flight, dst))
        except* OSError:
            broken = True
        # A reset on one side is passed on as a reset on the other, as a middlebox would.
        self.close(reset=broken)

    async def _read(self, src: asyncio.StreamReader,
                    in_flight: asyncio.Queue[tuple[float, bytes]]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.proxy._flowing.wait()
            chunk = await src.read(CHUNK)
            await in_flight.put((loop.time() + self.proxy._latency_s, chunk))
            if not chunk:
                return

    async def _deliver(self, in_flight: asyncio.Queue[tuple[float, bytes]],
                       dst: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, chunk = await in_flight.get()
            while True:  # hold through a blackhole, then out the rest of the delay
                await self.proxy._flowing.wait()
                delay = due - loop.time()
                if delay <= 0:
                    break
                await asyncio.sleep(delay)
            if not chunk:  # EOF travels like data: a half-close arrives after what preceded it
                if dst.can_write_eof():
                    dst.write_eof()
                return
            dst.write(chunk)
            await dst.drain()


class _ControlServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # Ctrl-C belongs to the harness. Several proxies' servers stopping in another order than
        # they started would restore each other's SIGINT handlers and leave a dead one in place.
        yield


class _ProxyFaults:
    """The four proxy faults by name, for a proxy here (`FaultProxy`) or elsewhere
    (`RemoteFaultProxy`): each is `inject` with its kind."""

    async def inject(self, kind: ProxyFaultKind, deadline_s: float,
                     ms: int | None = None) -> FaultRecord:
        raise NotImplementedError

    async def latency(self, ms: int, deadline_s: float) -> FaultRecord:
        return await self.inject("latency", deadline_s, ms)

    async def blackhole(self, deadline_s: float) -> FaultRecord:
        return await self.inject("blackhole", deadline_s)

    async def reset(self, deadline_s: float) -> FaultRecord:
        return await self.inject("reset", deadline_s)

    async def down(self, deadline_s: float) -> FaultRecord:
        return await self.inject("down", deadline_s)


class FaultProxy(_ProxyFaults):
    """A TCP proxy from `listen_host:port` to `target`, with one fault at a time.

    Use as `async with FaultProxy(...) as proxy`; leaving heals the standing fault and closes
    every connection. `control_port` (0: any free port, None: no HTTP API) serves
    `control_app(proxy)` at `proxy.control_url`.
    """

    def __init__(self, target_host: str, target_port: int, *, name: str = "proxy",
                 listen_host: str = "127.0.0.1", listen_port: int = 0,
                 control_host: str = "127.0.0.1", control_port: int | None = 0,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self.name = name
        self.target = (target_host, target_port)
        self.host = listen_host
        self.port = listen_port
        self.control_url: str | None = None
        self._control_address = None if control_port is None else (control_host, control_port)
        self._clock = clock
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._latency_s = 0.0
        self._refusing = False
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._active: FaultRecord | None = None
        self._deadline_timer: asyncio.Task[None] | None = None
        self._log: list[FaultRecord] = []
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()
        self._control: _ControlServer | None = None
        self._control_task: asyncio.Task[None] | None = None

    # ---------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> FaultProxy:
        await self._listen()
        if self._control_address is not None:
            try:
                await self._serve_control(*self._control_address)
            except BaseException:
                await self.__aexit__()
                raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(HealFailed):  # closing anyway; the log keeps it as unhealed
            await self.heal()
        if self._control is not None and self._control_task is not None:
            self._control.should_exit = True
            await self._control_task
        if self._server is not None:
            self._server.close()
            self._server = None
        for link in list(self._links):
            link.close(reset=False)
        await asyncio.gather(*(link.task for link in list(self._links)), return_exceptions=True)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _serve_control(self, host: str, port: int) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        config = uvicorn.Config(control_app(self), log_level="warning", lifespan="off",
                                ws="none", timeout_graceful_shutdown=2)
        server = self._control = _ControlServer(config)
        serving = self._control_task = asyncio.create_task(server.serve(sockets=[sock]))

        async def started() -> bool:
            if serving.done():
                serving.result()  # raises the start-up error
                raise RuntimeError(f"the control API of proxy {self.name} exited on start")
            return server.started

        await eventually(started, 30, f"the control API of proxy {self.name} did not start",
                         interval=0.01)
        self.control_url = f"http://{host}:{sock.getsockname()[1]}"

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._refusing or self._server is None:
            _reset(writer)
            return
        link = _Link(self, reader, writer)
        self._links.add(link)
        link.task.add_done_callback(lambda _: self._links.discard(link))

    # ---------------------------------------------------------------- faults

    @property
    def active(self) -> FaultRecord | None:
        """The fault standing now, as a copy."""
        return None if self._active is None else dataclasses.replace(self._active)

    def fault_log(self) -> list[FaultRecord]:
        """Every fault this proxy held, oldest first, as copies."""
        return [dataclasses.replace(r) for r in self._log]

    async def inject(self, kind: ProxyFaultKind, deadline_s: float,
                     ms: int | None = None) -> FaultRecord:
        """Start a fault, replacing the one standing. Raises BadFault on bad input, and
        HealFailed when the standing fault cannot be lifted (it then still stands)."""
        record, _ = await self._inject(kind, deadline_s, ms)
        return record

    async def _inject(self, kind: ProxyFaultKind, deadline_s: float,
                      ms: int | None) -> tuple[FaultRecord, FaultRecord | None]:
        check_proxy_fault(kind, deadline_s, ms)
        async with self._lock:
            replaced = self._active
            if replaced is not None:
                await self._lift(replaced, "replaced")
            started_ns = self._clock()
            record = FaultRecord(
                id=f"{self.name}-{kind}-{next(self._ids)}", target=self.name, kind=kind,
                started_ns=started_ns, deadline_s=deadline_s, ms=ms,
                heals_at_ns=started_ns + round(deadline_s * 1e9))
            self._impose(record)
            self._active = record
            self._log.append(record)
            self._deadline_timer = asyncio.create_task(self._heal_at_deadline(record))
            return (dataclasses.replace(record),
                    None if replaced is None else dataclasses.replace(replaced))

    async def heal(self) -> FaultRecord | None:
        """Heal the standing fault at once; returns it (None if there was none). Raises
        HealFailed when it cannot be lifted."""
        async with self._lock:
            record = self._active
            if record is None:
                return None
            await self._lift(record, "heal")
            return dataclasses.replace(record)

    async def _heal_at_deadline(self, record: FaultRecord) -> None:
        assert record.deadline_s is not None
        await asyncio.sleep(record.deadline_s)
        async with self._lock:
            if self._active is record:
                with contextlib.suppress(HealFailed):  # noted in the record; it stays unhealed
                    await self._lift(record, "deadline")

    def _impose(self, record: FaultRecord) -> None:
        if record.kind == "latency":
            assert record.ms is not None
            self._latency_s = record.ms / 1000
        elif record.kind == "blackhole":
            self._flowing.clear()
        elif record.kind == "reset":
            self._refusing = True
            for link in list(self._links):
                link.close(reset=True)
        elif record.kind == "down":
            assert self._server is not None
            self._server.close()
            self._server = None
            for link in list(self._links):
                link.close(reset=False)

    async def _lift(self, record: FaultRecord, how: HealedBy) -> None:
        """Undo `record`'s effect and log the heal. Called with the lock held."""
        if record.kind == "latency":
            self._latency_s = 0.0
        elif record.kind == "blackhole":
            self._flowing.set()
        elif record.kind == "reset":
            self._refusing = False
        elif record.kind == "down":
            await self._listen_again(record)
        record.healed_ns = self._clock()
        record.healed_by = how
        self._active = None
        timer, self._deadline_timer = self._deadline_timer, None
        if timer is not None and timer is not asyncio.current_task():
            timer.cancel()

    async def _listen_again(self, record: FaultRecord) -> None:
        # The port is free while the proxy is down, and another socket may take it meanwhile
        # (an outgoing connection's ephemeral port): retry a little, then say so.
        for attempt in range(REBIND_ATTEMPTS):
            try:
                await self._listen()
                return
            except OSError as e:
                record.note = (f"could not listen on {self.host}:{self.port} again "
                               f"({attempt + 1} attempts): {e}")
                await asyncio.sleep(0.1)
        raise HealFailed(record.note)


# ---------------------------------------------------------------- the control API


class FaultIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: ProxyFaultKind
    deadline_s: float = Field(gt=0, le=MAX_DEADLINE_S, description="heals itself after this")
    ms: int | None = Field(default=None, gt=0, le=MAX_LATENCY_MS,
                           description="the delay of each chunk; latency only, and required")


class FaultOut(BaseModel):
    id: str
    target: str
    kind: FaultKind
    started_ns: int
    deadline_s: float | None
    ms: int | None
    heals_at_ns: int | None
    healed_ns: int | None
    healed_by: HealedBy | None
    note: str | None

    @classmethod
    def of(cls, record: FaultRecord) -> FaultOut:
        return cls.model_validate(record.to_json())


class FaultStarted(FaultOut):
    replaced: str | None  # the id of the fault this one replaced


class HealOut(BaseModel):
    healed: FaultOut | None  # None when no fault was standing


class ProxyState(BaseModel):
    proxy: str
    listen: str
    target: str
    active: FaultOut | None
    log: list[FaultOut]


def control_app(proxy: FaultProxy) -> FastAPI:
    """The HTTP API of one proxy. No authentication: it listens on loopback (or on a game
    day's private Docker network), and what it guards is the harness's own fault."""
    app = FastAPI(title=f"Fault proxy {proxy.name}",
                  description=f"Faults on the link to {proxy.target[0]}:{proxy.target[1]}.")
    install(app)

    @app.post("/faults", status_code=201, response_model=FaultStarted)
    async def start_fault(body: FaultIn) -> FaultStarted:
        try:
            record, replaced = await proxy._inject(body.kind, body.deadline_s, body.ms)
        except BadFault as e:
            raise ApiError(422, e.error, e.hint) from e
        except HealFailed as e:
            raise ApiError(409, "The standing fault could not be healed",
                           f"{e}; the new fault was not started. Retry DELETE /faults.") from e
        return FaultStarted(**FaultOut.of(record).model_dump(),
                            replaced=None if replaced is None else replaced.id)

    @app.delete("/faults", response_model=HealOut)
    async def heal_fault() -> HealOut:
        try:
            record = await proxy.heal()
        except HealFailed as e:
            raise ApiError(409, "The fault could not be healed", f"{e}. Retry later.") from e
        return HealOut(healed=None if record is None else FaultOut.of(record))

    @app.get("/faults", response_model=ProxyState)
    async def fault_state() -> ProxyState:
        active = proxy.active
        return ProxyState(proxy=proxy.name, listen=f"{proxy.host}:{proxy.port}",
                          target=f"{proxy.target[0]}:{proxy.target[1]}",
                          active=None if active is None else FaultOut.of(active),
                          log=[FaultOut.of(r) for r in proxy.fault_log()])

    return app


# ---------------------------------------------------------------- process faults

# Sends SIGCONT at a monotonic instant (system-wide on Linux), from its own session so that
# neither Ctrl-C nor the harness's death takes it down.
_SIGCONT_WATCHDOG = """\
import os, signal, sys, time
pid, at = int(sys.argv[1]), float(sys.argv[2])
time.sleep(max(0.0, at - time.monotonic()))
try:
    os.kill(pid, signal.SIGCONT)
except ProcessLookupError:
    pass
"""


@dataclass
class _Pause:
    pid: int
    record: FaultRecord
    watchdog: asyncio.subprocess.Process
    timer: asyncio.Task[None] | None = None


async def _start_watchdog(pid: int, at_monotonic: float) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", "-c", _SIGCONT_WATCHDOG, str(pid), repr(at_monotonic),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL, start_new_session=True)


def _process_state(pid: int) -> str | None:
    """The one-letter state in /proc (T: stopped); None without /proc or without the process.
    A read of procfs never waits on a disk, so this is fine on the event loop."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


async def _stopped(pid: int, within_s: float) -> bool:
    """Whether `pid` is seen stopped within `within_s`: a signal takes effect only when the
    process is next scheduled. Where /proc cannot tell, there is nothing to wait for."""
    deadline = time.monotonic() + within_s
    while _process_state(pid) not in (None, "T", "t"):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.002)
    return True


async def _stop_watchdog(watchdog: asyncio.subprocess.Process) -> None:
    if watchdog.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            watchdog.kill()
    await watchdog.wait()


# ---------------------------------------------------------------- container faults


@dataclass
class _ContainerFault:
    """A standing fault of one container, and what its heal needs."""

    key: str  # the container's full id: its name may pass to another container meanwhile
    name: str
    record: FaultRecord
    heals_at: float  # on the monotonic clock
    network_id: str | None = None  # disconnect: the network, and how to connect it again
    reconnect: dict[str, Any] = field(default_factory=dict)
    timer: asyncio.Task[None] | None = None


_UNDO: dict[str, str] = {"pause": "unpause", "stop": "start", "disconnect": "reconnect"}


def _check_stop_timeout(timeout_s: int) -> None:
    if (isinstance(timeout_s, bool) or not isinstance(timeout_s, int)
            or not 0 <= timeout_s <= MAX_STOP_TIMEOUT_S):
        raise BadFault("Invalid timeout_s",
                       f"timeout_s must be a whole number of seconds, >= 0 and <= "
                       f"{MAX_STOP_TIMEOUT_S}, not {timeout_s!r}: how long docker stop waits "
                       "after the stop signal before it kills.")


def _identity(container: Container) -> tuple[str, str]:
    """(full id, name) of a container as the engine returned it."""
    key = container.id
    assert key is not None, "a container from the engine always has an id"
    return key, container.name or container.short_id


def _network_settings(container: Container, network_id: str) -> dict[str, Any] | None:
    """The container's endpoint on a network (its full id), as of the container's last
    inspect; None when it is not on that network."""
    networks = (container.attrs.get("NetworkSettings") or {}).get("Networks") or {}
    for settings in networks.values():
        if settings.get("NetworkID") == network_id:
            return dict(settings)
    return None


def _reconnect_settings(container: Container, settings: dict[str, Any]) -> dict[str, Any]:
    """`Network.connect()`'s arguments that put the container back as it was: its aliases
    (without its short id, which the engine adds itself) and any static addresses."""
    reconnect: dict[str, Any] = {}
    aliases = [a for a in settings.get("Aliases") or [] if a != container.short_id]
    if aliases:
        reconnect["aliases"] = aliases
    ipam = settings.get("IPAMConfig") or {}
    if ipam.get("IPv4Address"):
        reconnect["ipv4_address"] = ipam["IPv4Address"]
    if ipam.get("IPv6Address"):
        reconnect["ipv6_address"] = ipam["IPv6Address"]
    if ipam.get("LinkLocalIPs"):
        reconnect["link_local_ips"] = ipam["LinkLocalIPs"]
    return reconnect


def _undo_container_fault(client: DockerClient, fault: _ContainerFault) -> str | None:
    """Lift `fault` (blocking: run it in a thread). Returns a note when there was nothing left
    to lift; the engine's errors (the container or network gone) pass through."""
    container = client.containers.get(fault.key)
    kind = fault.record.kind
    if kind == "pause":
        if container.status != "paused":
            return f"no longer paused when healed (status {container.status})"
        container.unpause()
    elif kind == "stop":
        if container.status in ("running", "paused", "restarting"):
            return f"already started again when healed (status {container.status})"
        container.start()
    elif kind == "disconnect":
        assert fault.network_id is not None
        if _network_settings(container, fault.network_id) is not None:
            return "already back on the network when healed"
        client.networks.get(fault.network_id).connect(container, **fault.reconnect)
    return None


# ---------------------------------------------------------------- the nemesis


@dataclass(frozen=True)
class HealReport:
    """Whether every fault of a game day healed; `unhealed` names those that did not."""

    healed: bool
    faults: tuple[FaultRecord, ...]
    unhealed: tuple[FaultRecord, ...]

    @property
    def message(self) -> str:
        if self.healed:
            return f"Every fault healed ({len(self.faults)} faults)."
        lines = [f"{r.id} ({r.kind} on {r.target}, deadline {r.deadline_s:g} s)"
                 + (f": {r.note}" if r.note else "") for r in self.unhealed]
        return (f"{len(self.unhealed)} of {len(self.faults)} faults not healed: "
                + "; ".join(lines))

    def to_json(self) -> dict[str, Any]:
        return {"healed": self.healed, "message": self.message,
                "unhealed": [r.id for r in self.unhealed],
                "faults": [r.to_json() for r in self.faults]}


class RemoteFaultProxy(_ProxyFaults):
    """A fault proxy run on its own (`python -m harness.nemesis`), in a container on a game
    day's network for instance, steered over its HTTP control API. Its log lives there:
    `refresh()` reads it, and `fault_log()`/`active` answer from the last read."""

    def __init__(self, name: str, control_url: str) -> None:
        self.name = name
        self.control_url = control_url.rstrip("/")
        self._log: list[FaultRecord] = []
        self._active: FaultRecord | None = None

    @property
    def active(self) -> FaultRecord | None:
        return None if self._active is None else dataclasses.replace(self._active)

    def fault_log(self) -> list[FaultRecord]:
        return [dataclasses.replace(r) for r in self._log]

    async def refresh(self) -> None:
        import httpx

        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.get(f"{self.control_url}/faults")
            r.raise_for_status()
            state = r.json()
        self._log = [_record(row) for row in state["log"]]
        self._active = None if state["active"] is None else _record(state["active"])

    async def inject(self, kind: ProxyFaultKind, deadline_s: float,
                     ms: int | None = None) -> FaultRecord:
        import httpx

        check_proxy_fault(kind, deadline_s, ms)
        body: dict[str, Any] = {"kind": kind, "deadline_s": deadline_s}
        if ms is not None:
            body["ms"] = ms
        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.post(f"{self.control_url}/faults", json=body)
        if r.status_code != 201:
            raise BadFault(f"the proxy refused the fault: {r.status_code}", r.text[:300])
        await self.refresh()
        return _record(r.json())

    async def heal(self) -> FaultRecord | None:
        import httpx

        try:
            async with httpx.AsyncClient(timeout=10) as http:
                r = await http.delete(f"{self.control_url}/faults")
        except httpx.HTTPError as exc:
            raise HealFailed(f"the proxy {self.name} did not answer: {exc!r}") from None
        if r.status_code != 200:
            raise HealFailed(f"the proxy {self.name} could not heal: {r.text[:300]}")
        await self.refresh()
        healed = r.json().get("healed")
        return None if healed is None else _record(healed)


def _record(row: dict[str, Any]) -> FaultRecord:
    known = {f.name for f in dataclasses.fields(FaultRecord)}
    return FaultRecord(**{k: v for k, v in row.items() if k in known})


class Nemesis:
    """All faults of one game day. `async with Nemesis() as nemesis`: leaving heals whatever
    still stands and closes the proxies, so call `verify_healed()` before leaving.

    Container faults go through `docker_client` (else a client from the environment, made on
    first use and closed on leaving) and heal on this nemesis's timers. Unlike a process pause
    they have no watchdog to heal them after the harness dies: the containers stack labels
    its containers with the harness's pid, and the next containers stack to come up reaps a
    dead harness's containers, faults and all (`harness.stack.reap_stale_game_days`). A
    container from anywhere else stays paused, stopped or disconnected after a dead harness
    until someone lifts the fault by hand.
    """

    def __init__(self, *, clock: Callable[[], int] = time.time_ns,
                 docker_client: DockerClient | None = None) -> None:
        self._clock = clock
        self._proxies: dict[str, FaultProxy | RemoteFaultProxy] = {}
        self._owned = contextlib.AsyncExitStack()
        self._process_log: list[FaultRecord] = []
        self._pauses: dict[int, _Pause] = {}
        self._docker = docker_client
        self._container_log: list[FaultRecord] = []
        self._containers: dict[str, _ContainerFault] = {}  # by full id: one fault each
        self._container_locks: dict[str, asyncio.Lock] = {}
        self._ids = itertools.count(1)
        # On a stack reused by several game days, each judges only the faults since its start.
        self._since_ns = 0

    async def __aenter__(self) -> Nemesis:
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.heal_all()
        finally:
            for fault in self._containers.values():  # heals that failed: no retries once closed
                if fault.timer is not None:
                    fault.timer.cancel()
            await self._owned.aclose()

    # ---------------------------------------------------------------- proxies

    async def proxy(self, name: str, target_host: str, target_port: int, *,
                    listen_port: int = 0, control: bool = True) -> FaultProxy:
        """Start a fault proxy in front of one link; the nemesis closes it on exit."""
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
        paused pid replaces the pause."""
        check_deadline(deadline_s)
        # The watchdog first: a harness dying right after the SIGSTOP is covered too.
        watchdog = await _start_watchdog(pid, time.monotonic() + deadline_s + WATCHDOG_GRACE_S)
        started_ns = self._clock()
        try:
            os.kill(pid, signal.SIGSTOP)
        except OSError:
            await _stop_watchdog(watchdog)
            raise
        previous = self._pauses.pop(pid, None)
        if previous is not None:
            await self._end_pause(previous, "replaced", signal_cont=False)
        record = FaultRecord(id=f"pid{pid}-pause-{next(self._ids)}", target=f"pid {pid}",
                             kind="pause", started_ns=started_ns, deadline_s=deadline_s,
                             heals_at_ns=started_ns + round(deadline_s * 1e9))
        pause = _Pause(pid, record, watchdog)
        self._pauses[pid] = pause
        self._process_log.append(record)
        pause.timer = asyncio.create_task(self._continue_at_deadline(pause))
        if not await _stopped(pid, STOP_WAIT_S):
            record.note = f"not seen stopped within {STOP_WAIT_S:g} s of the SIGSTOP"
        return dataclasses.replace(record)

    async def resume_process(self, pid: int) -> FaultRecord | None:
        """Heal the pause of `pid` at once (None when it is not paused by us)."""
        pause = self._pauses.pop(pid, None)
        if pause is None:
            return None
        await self._end_pause(pause, "heal", signal_cont=True)
        return dataclasses.replace(pause.record)

    async def kill_process(self, pid: int) -> FaultRecord:
        """SIGKILL `pid`. A pause of it ends with it (as "replaced": there is nothing left to
        continue)."""
        os.kill(pid, signal.SIGKILL)
        now = self._clock()
        record = FaultRecord(id=f"pid{pid}-kill-{next(self._ids)}", target=f"pid {pid}",
                             kind="kill", started_ns=now, healed_ns=now, healed_by="instant")
        self._process_log.append(record)
        pause = self._pauses.pop(pid, None)
        if pause is not None:
            await self._end_pause(pause, "replaced", signal_cont=False)
        return dataclasses.replace(record)

    async def _continue_at_deadline(self, pause: _Pause) -> None:
        assert pause.record.deadline_s is not None
        await asyncio.sleep(pause.record.deadline_s)
        if self._pauses.get(pause.pid) is pause:
            del self._pauses[pause.pid]
            await self._end_pause(pause, "deadline", signal_cont=True)

    async def _end_pause(self, pause: _Pause, how: HealedBy, *, signal_cont: bool) -> None:
        if signal_cont:
            try:
                os.kill(pause.pid, signal.SIGCONT)
            except ProcessLookupError:
                pause.record.note = "the process had exited before it was continued"
        pause.record.healed_ns = self._clock()
        pause.record.healed_by = how
        if pause.timer is not None and pause.timer is not asyncio.current_task():
            pause.timer.cancel()
        await _stop_watchdog(pause.watchdog)

    # ---------------------------------------------------------------- containers
    # `container` is a name or an id, and `network` too; one fault per container at a time, a
    # new one replacing the one standing (as on a proxy). The engine's calls block, so each
    # runs in a thread; the engine's errors (docker.errors.NotFound for an unknown container,
    # APIError for a refused call) pass through and leave no fault behind.

    async def pause_container(self, container: str, deadline_s: float) -> FaultRecord:
        """docker pause `container` (its processes frozen, its sockets open); unpause at the
        deadline."""
        check_deadline(deadline_s)
        target = await self._get_container(container)

        def pause(_: _ContainerFault) -> None:
            target.pause()

        return await self._start_container_fault(target, "pause", deadline_s, pause)

    async def stop_container(self, container: str, deadline_s: float,
                             timeout_s: int = 10) -> FaultRecord:
        """docker stop `container` (its stop signal, SIGKILL after `timeout_s`) and return once
        it has stopped; start it again at the deadline, which counts from the stop's start,
        grace period included."""
        check_deadline(deadline_s)
        _check_stop_timeout(timeout_s)
        target = await self._get_container(container)

        def stop(_: _ContainerFault) -> None:
            target.stop(timeout=timeout_s)

        return await self._start_container_fault(target, "stop", deadline_s, stop)

    async def disconnect_container(self, container: str, network: str,
                                   deadline_s: float) -> FaultRecord:
        """Disconnect `container` from `network`; connect it again at the deadline with the
        aliases (and static addresses) it had there. Raises BadFault when it is not on the
        network."""
        check_deadline(deadline_s)
        target = await self._get_container(container)
        client = await self._docker_client()
        net = await asyncio.to_thread(client.networks.get, network)
        key, name = _identity(target)
        assert net.id is not None
        net_id, net_name = net.id, net.name or net.short_id
        standing = self._containers.get(key)
        off_by_us = (standing is not None and standing.record.kind == "disconnect"
                     and standing.network_id == net_id)

        def not_on_it() -> BadFault:
            return BadFault("Not on the network",
                            f"container {name} is not connected to network {net_name}: "
                            "connect it first, or name a network it is on.")

        if _network_settings(target, net_id) is None and not off_by_us:
            raise not_on_it()

        def disconnect(fault: _ContainerFault) -> None:
            target.reload()  # as it is now, after the heal of a fault this one replaced
            settings = _network_settings(target, net_id)
            if settings is None:
                raise not_on_it()
            fault.reconnect = _reconnect_settings(target, settings)  # before it is needed
            net.disconnect(target)

        return await self._start_container_fault(target, "disconnect", deadline_s, disconnect,
                                                 network=(net_id, net_name))

    async def kill_container(self, container: str) -> FaultRecord:
        """docker kill `container` (SIGKILL): over once delivered, so healed by "instant";
        bringing it back is the stack's job, not a heal. A standing pause ends with it (as
        "replaced": the engine kills a paused container outright), and a standing disconnect
        is undone (as "replaced": a container stays off a network through a restart). Killing
        a container that is not running (one this nemesis stopped, say) raises APIError and
        changes nothing."""
        target = await self._get_container(container)
        key, name = _identity(target)
        async with self._container_lock(key):
            await asyncio.to_thread(target.kill)
            now = self._clock()
            record = FaultRecord(id=f"container-{name}-kill-{next(self._ids)}",
                                 target=f"container {name}", kind="kill", started_ns=now,
                                 healed_ns=now, healed_by="instant")
            self._container_log.append(record)
            standing = self._containers.get(key)
            if standing is not None and standing.record.kind == "disconnect":
                with contextlib.suppress(HealFailed):  # noted; it stands and its timer retries
                    await self._lift_container(standing, "replaced")
            elif standing is not None:
                self._end_container_fault(standing, "replaced")
            return dataclasses.replace(record)

    async def resume_container(self, container: str) -> FaultRecord | None:
        """Heal the standing fault of `container` (a name, an id or an id's prefix) at once;
        None when it has none of ours. Raises HealFailed when the fault cannot be lifted (the
        container was removed, say): the record's note says why, and the fault stands."""
        fault = self._find_container_fault(container)
        if fault is None:
            return None
        async with self._container_lock(fault.key):
            if self._containers.get(fault.key) is not fault:
                return None  # healed while we waited
            await self._lift_container(fault, "heal")
            return dataclasses.replace(fault.record)

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

    def _container_lock(self, key: str) -> asyncio.Lock:
        return self._container_locks.setdefault(key, asyncio.Lock())

    def _find_container_fault(self, container: str) -> _ContainerFault | None:
        """Our standing fault of a container, found as the engine would find it (without
        asking the engine, which no longer knows a removed container)."""
        wanted = container.lstrip("/")
        for fault in self._containers.values():
            if wanted in (fault.key, fault.name):
                return fault
        prefixed = [f for f in self._containers.values() if wanted and f.key.startswith(wanted)]
        return prefixed[0] if len(prefixed) == 1 else None

    async def _start_container_fault(
            self, target: Container, kind: StandingContainerFaultKind, deadline_s: float,
            impose: Callable[[_ContainerFault], None],
            network: tuple[str, str] | None = None) -> FaultRecord:
        """Replace the container's standing fault with a new one that `impose` (run in a
        thread, given the new fault) brings about. Raises HealFailed when the standing fault
        cannot be lifted (it then still stands, and the new one is not started)."""
        key, name = _identity(target)
        async with self._container_lock(key):
            standing = self._containers.get(key)
            if standing is not None:
                await self._lift_container(standing, "replaced")
            started_ns = self._clock()
            record = FaultRecord(id=f"container-{name}-{kind}-{next(self._ids)}",
                                 target=f"container {name}", kind=kind, started_ns=started_ns,
                                 deadline_s=deadline_s,
                                 heals_at_ns=started_ns + round(deadline_s * 1e9),
                                 network=None if network is None else network[1])
            fault = _ContainerFault(key, name, record, time.monotonic() + deadline_s,
                                    network_id=None if network is None else network[0])
            # Logged, and on its timer, before the engine is asked: were this task cancelled
            # while the engine's call runs on in its thread, the fault would still heal.
            self._containers[key] = fault
            self._container_log.append(record)
            fault.timer = asyncio.create_task(self._heal_container_at(fault))
            try:
                await asyncio.to_thread(impose, fault)
            except Exception as e:
                fault.timer.cancel()
                del self._containers[key]
                self._container_log.remove(record)
                if standing is not None:  # lifted, but replaced by nothing
                    standing.record.healed_by = "heal"
                    standing.record.note = f"healed for a {kind} that failed to start: {e}"
                raise
            return dataclasses.replace(record)

    async def _heal_container_at(self, fault: _ContainerFault) -> None:
        await asyncio.sleep(max(0.0, fault.heals_at - time.monotonic()))
        async with self._container_lock(fault.key):
            if self._containers.get(fault.key) is fault:
                with contextlib.suppress(HealFailed):  # noted in the record; it stays unhealed
                    await self._lift_container(fault, "deadline")

    async def _lift_container(self, fault: _ContainerFault, how: HealedBy) -> None:
        """Undo `fault` and log its heal. Called with the container's lock held. Raises
        HealFailed when it cannot be undone: the record's note says why, and it stands."""
        client = await self._docker_client()
        try:
            note = await asyncio.to_thread(_undo_container_fault, client, fault)
        except Exception as e:  # whatever stops the heal (container or network gone, no engine)
            fault.record.note = (f"could not {_UNDO[fault.record.kind]} container {fault.name}"
                                 f": {e}")
            raise HealFailed(fault.record.note) from e
        if note is not None:
            fault.record.note = note
        self._end_container_fault(fault, how)

    def _end_container_fault(self, fault: _ContainerFault, how: HealedBy) -> None:
        fault.record.healed_ns = self._clock()
        fault.record.healed_by = how
        if self._containers.get(fault.key) is fault:
            del self._containers[fault.key]
        if fault.timer is not None and fault.timer is not asyncio.current_task():
            fault.timer.cancel()

    # ---------------------------------------------------------------- the end of a game day

    async def heal_all(self) -> list[FaultRecord]:
        """Heal every fault still standing, at once; returns them."""
        healed: list[FaultRecord] = []
        for pid in list(self._pauses):
            record = await self.resume_process(pid)
            if record is not None:
                healed.append(record)
        for key in list(self._containers):
            with contextlib.suppress(HealFailed):  # the record says why; verify_healed tells
                container_record = await self.resume_container(key)
                if container_record is not None:
                    healed.append(container_record)
        for proxy in self._proxies.values():
            with contextlib.suppress(HealFailed):  # the record says why; verify_healed tells
                proxy_record = await proxy.heal()
                if proxy_record is not None:
                    healed.append(proxy_record)
        return healed

    def begin_game_day(self) -> None:
        """A new game day on the same stack: faults before now are no longer its own (they
        were healed at the end of theirs)."""
        self._since_ns = self._clock()

    def faults(self) -> list[FaultRecord]:
        """Every fault of the game day, by start time, as copies."""
        records = [*self._process_log, *self._container_log,
                   *(r for proxy in self._proxies.values() for r in proxy.fault_log())]
        return sorted((dataclasses.replace(r) for r in records
                       if r.started_ns >= self._since_ns), key=lambda r: r.started_ns)

    def fault_log(self) -> list[dict[str, Any]]:
        """The faults as plain data for the journal: kind, target, start and heal wall-clock
        ns, and how each healed."""
        return [r.to_json() for r in self.faults()]

    def verify_healed(self) -> HealReport:
        faults = tuple(self.faults())
        unhealed = tuple(r for r in faults if not r.healed)
        return HealReport(healed=not unhealed, faults=faults, unhealed=unhealed)


# ---------------------------------------------------------------- a proxy on its own


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, not {text!r}")
    return host, int(port)


async def _serve_alone(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    (listen_host, listen_port), (control_host, control_port) = args.listen, args.control
    async with FaultProxy(*args.target, name=args.name, listen_host=listen_host,
                          listen_port=listen_port, control_host=control_host,
                          control_port=control_port) as proxy:
        print(json.dumps({"proxy": proxy.name, "listen": f"{proxy.host}:{proxy.port}",
                          "control": proxy.control_url}), flush=True)
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    """Run one fault proxy as its own process (a container on a game day's network, say);
    prints one JSON line with its addresses once it serves, and stops on SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m harness.nemesis", description=main.__doc__)
    parser.add_argument("--name", default="proxy")
    parser.add_argument("--target", type=_address, required=True, help="HOST:PORT to protect")
    parser.add_argument("--listen", type=_address, default=("127.0.0.1", 0), help="HOST:PORT")
    parser.add_argument("--control", type=_address, default=("127.0.0.1", 0),
                        help="HOST:PORT of the HTTP control API")
    asyncio.run(_serve_alone(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
