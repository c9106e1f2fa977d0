"""The fault proxy: a TCP proxy on loopback (or a game day's network) in front of one
protected link (the flag store, the control channel, a replica's database), with four faults
and an HTTP control API (`control_app`):
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
One fault at a time per proxy, on the standing-fault mechanism. The proxy enforces its
deadlines itself: run on its own (`python -m harness.nemesis`, what the stacks do), it heals
on time whatever becomes of the harness that steers it (`RemoteFaultProxy`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import socket
import struct
import time
from collections.abc import Callable, Generator
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from harness.nemesis.faults import (
    MAX_DEADLINE_S,
    MAX_LATENCY_MS,
    BadFault,
    FaultKind,
    FaultRecord,
    HealedBy,
    HealFailed,
    ProxyFaultKind,
    check_proxy_fault,
)
from harness.nemesis.standing import Fault, StandingFaults
from harness.nemesis.watchdog import HealOrder, alive
from harness.stack.waiting import eventually, retried

CHUNK = 65536
IN_FLIGHT_CHUNKS = 64  # per direction and connection; beyond that the proxy stops reading
REBIND_ATTEMPTS = 20
OWNER_POLL_S = 1.0


# ---------------------------------------------------------------- the link


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
            up_reader, up_writer = await self.proxy._open_upstream()
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

    name: str

    async def inject(self, kind: ProxyFaultKind, deadline_s: float,
                     ms: int | None = None) -> FaultRecord:
        raise NotImplementedError

    async def heal(self) -> FaultRecord | None:
        raise NotImplementedError

    def fault_log(self) -> list[FaultRecord]:
        raise NotImplementedError

    async def latency(self, ms: int, deadline_s: float) -> FaultRecord:
        return await self.inject("latency", deadline_s, ms)

    async def blackhole(self, deadline_s: float) -> FaultRecord:
        return await self.inject("blackhole", deadline_s)

    async def reset(self, deadline_s: float) -> FaultRecord:
        return await self.inject("reset", deadline_s)

    async def down(self, deadline_s: float) -> FaultRecord:
        return await self.inject("down", deadline_s)


class _OnTheLink(Fault):
    """One of the four faults on a proxy's link."""

    def __init__(self, proxy: FaultProxy, kind: ProxyFaultKind, ms: int | None) -> None:
        self.proxy, self.kind, self.ms = proxy, kind, ms
        self.key = self.target = self.id_prefix = proxy.name

    async def impose(self) -> str | None:
        proxy = self.proxy
        if self.kind == "latency":
            assert self.ms is not None
            proxy._latency_s = self.ms / 1000
        elif self.kind == "blackhole":
            proxy._flowing.clear()
        elif self.kind == "reset":
            proxy._refusing = True
            for link in list(proxy._links):
                link.close(reset=True)
        elif self.kind == "down":
            assert proxy._server is not None
            proxy._server.close()
            proxy._server = None
            for link in list(proxy._links):
                link.close(reset=False)
        return None

    async def lift(self) -> str | None:
        proxy = self.proxy
        if self.kind == "latency":
            proxy._latency_s = 0.0
        elif self.kind == "blackhole":
            proxy._flowing.set()
        elif self.kind == "reset":
            proxy._refusing = False
        elif self.kind == "down":
            await proxy._listen_again()
        return None


class FaultProxy(_ProxyFaults):
    """A TCP proxy from `listen_host:port` to `target`, with one fault at a time.

    Use as `async with FaultProxy(...) as proxy`; leaving heals the standing fault and closes
    every connection. A `target_port` of None makes `target_host` the path of a Unix socket:
    an embedded Postgres listens on nothing else, and a replica's database link is one.
    `control_port` (0: any free port, None: no HTTP API) serves
    `control_app(proxy)` at `proxy.control_url`.
    """

    def __init__(self, target_host: str, target_port: int | None, *, name: str = "proxy",
                 listen_host: str = "127.0.0.1", listen_port: int = 0,
                 control_host: str = "127.0.0.1", control_port: int | None = 0,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self.name = name
        self.target = (target_host, target_port)
        self.host = listen_host
        self.port = listen_port
        self.control_url: str | None = None
        self._control_address = None if control_port is None else (control_host, control_port)
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._latency_s = 0.0
        self._refusing = False
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._faults = StandingFaults(clock)
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
        self._faults.close()
        if self._control is not None and self._control_task is not None:
            self._control.should_exit = True
            await self._control_task
        if self._server is not None:
            self._server.close()
            self._server = None
        for link in list(self._links):
            link.close(reset=False)
        await asyncio.gather(*(link.task for link in list(self._links)), return_exceptions=True)

    @property
    def target_text(self) -> str:
        host, port = self.target
        return f"unix:{host}" if port is None else f"{host}:{port}"

    async def _open_upstream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        host, port = self.target
        if port is None:
            return await asyncio.open_unix_connection(host)
        return await asyncio.open_connection(host, port)

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
        return self._faults.standing(self.name)

    def fault_log(self) -> list[FaultRecord]:
        """Every fault this proxy held, oldest first, as copies."""
        return self._faults.log()

    async def inject(self, kind: ProxyFaultKind, deadline_s: float,
                     ms: int | None = None) -> FaultRecord:
        """Start a fault, replacing the one standing. Raises BadFault on bad input, and
        HealFailed when the standing fault cannot be lifted (it then still stands)."""
        record, _ = await self._inject(kind, deadline_s, ms)
        return record

    async def _inject(self, kind: ProxyFaultKind, deadline_s: float,
                      ms: int | None) -> tuple[FaultRecord, FaultRecord | None]:
        check_proxy_fault(kind, deadline_s, ms)
        return await self._faults.start(_OnTheLink(self, kind, ms), deadline_s)

    async def heal(self, how: HealedBy = "heal") -> FaultRecord | None:
        """Heal the standing fault at once; returns it (None if there was none). Raises
        HealFailed when it cannot be lifted."""
        return await self._faults.heal(self.name, how)

    async def _listen_again(self) -> None:
        # The port is free while the proxy is down, and another socket may take it meanwhile
        # (an outgoing connection's ephemeral port): retry a little, then say so.
        try:
            await retried(self._listen, REBIND_ATTEMPTS, wait_s=0.1,
                          on=lambda e: isinstance(e, OSError))
        except OSError as e:
            raise HealFailed(f"could not listen on {self.host}:{self.port} again "
                             f"({REBIND_ATTEMPTS} attempts): {e}") from e


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
    day's private Docker network), and what it guards is the harness's own fault. Errors are
    `{"error", "hint"}`, as everywhere in the project."""
    app = FastAPI(title=f"Fault proxy {proxy.name}",
                  description=f"Faults on the link to {proxy.target_text}.")

    @app.exception_handler(_Refused)
    async def refused(_: Request, exc: _Refused) -> JSONResponse:
        return JSONResponse({"error": exc.error, "hint": exc.hint}, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = next(iter(exc.errors()), {"loc": ("body",), "msg": "invalid"})
        if first.get("type") == "json_invalid":
            return JSONResponse({"error": "Malformed JSON", "hint": "Send a valid JSON "
                                 "document with Content-Type: application/json."},
                                status_code=400)
        where = ".".join(str(p) for p in first.get("loc", ()))
        return JSONResponse({"error": "Invalid request", "hint": f"{where}: {first['msg']}"},
                            status_code=422)

    @app.post("/faults", status_code=201, response_model=FaultStarted)
    async def start_fault(body: FaultIn) -> FaultStarted:
        try:
            record, replaced = await proxy._inject(body.kind, body.deadline_s, body.ms)
        except BadFault as e:
            raise _Refused(422, e.error, e.hint) from e
        except HealFailed as e:
            raise _Refused(409, "The standing fault could not be healed",
                           f"{e}; the new fault was not started. Retry DELETE /faults.") from e
        return FaultStarted(**FaultOut.of(record).model_dump(),
                            replaced=None if replaced is None else replaced.id)

    @app.delete("/faults", response_model=HealOut)
    async def heal_fault(how: Literal["heal", "halt"] = "heal") -> HealOut:
        try:
            record = await proxy.heal(how)
        except HealFailed as e:
            raise _Refused(409, "The fault could not be healed", f"{e}. Retry later.") from e
        return HealOut(healed=None if record is None else FaultOut.of(record))

    @app.get("/faults", response_model=ProxyState)
    async def fault_state() -> ProxyState:
        active = proxy.active
        return ProxyState(proxy=proxy.name, listen=f"{proxy.host}:{proxy.port}",
                          target=proxy.target_text,
                          active=None if active is None else FaultOut.of(active),
                          log=[FaultOut.of(r) for r in proxy.fault_log()])

    return app


class _Refused(Exception):
    def __init__(self, status: int, error: str, hint: str) -> None:
        super().__init__(error)
        self.status, self.error, self.hint = status, error, hint


# ---------------------------------------------------------------- a proxy steered from afar


class RemoteFaultProxy(_ProxyFaults):
    """A fault proxy run on its own (`python -m harness.nemesis`), in a container on a game
    day's network or a process of its own, steered over its HTTP control API. Its log lives
    there: `refresh()` reads it, and `fault_log()`/`active` answer from the last read."""

    def __init__(self, name: str, control_url: str, *, port: int | None = None) -> None:
        self.name = name
        self.control_url = control_url.rstrip("/")
        self.port = port  # where it listens, when the harness can reach that
        self._log: list[FaultRecord] = []
        self._active: FaultRecord | None = None

    @property
    def active(self) -> FaultRecord | None:
        return None if self._active is None else FaultRecord.from_json(self._active.to_json())

    def fault_log(self) -> list[FaultRecord]:
        return [FaultRecord.from_json(r.to_json()) for r in self._log]

    def heal_order(self) -> HealOrder:
        """What `gameday halt` does to this proxy's standing fault."""
        return {"do": "http", "method": "DELETE", "url": f"{self.control_url}/faults?how=halt"}

    async def refresh(self) -> None:
        import httpx

        try:
            async with httpx.AsyncClient(timeout=10) as http:
                r = await http.get(f"{self.control_url}/faults")
                r.raise_for_status()
                state = r.json()
        except httpx.HTTPError as exc:
            # Gone (its stack torn down under it, a signal to its process group): it healed on
            # its way out if it could, but that is not seen here, so a fault it held stays
            # unhealed in the log, saying why; the rest of a teardown goes on.
            if self._active is not None:
                for record in (self._active, *(r for r in self._log if r.id == self._active.id)):
                    record.note = f"the proxy {self.name} did not answer: {exc!r}"
            return
        self._log = [FaultRecord.from_json(row) for row in state["log"]]
        self._active = None if state["active"] is None else FaultRecord.from_json(
            state["active"])

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
        return FaultRecord.from_json(r.json())

    async def heal(self, how: HealedBy = "heal") -> FaultRecord | None:
        import httpx

        try:
            async with httpx.AsyncClient(timeout=10) as http:
                r = await http.delete(f"{self.control_url}/faults", params={"how": how})
        except httpx.HTTPError as exc:
            raise HealFailed(f"the proxy {self.name} did not answer: {exc!r}") from None
        if r.status_code != 200:
            raise HealFailed(f"the proxy {self.name} could not heal: {r.text[:300]}")
        await self.refresh()
        healed = r.json().get("healed")
        return None if healed is None else FaultRecord.from_json(healed)


# ---------------------------------------------------------------- a proxy on its own


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, not {text!r}")
    return host, int(port)


def _target(text: str) -> tuple[str, int | None]:
    """HOST:PORT, or unix:PATH for a Unix socket."""
    if text.startswith("unix:") and len(text) > len("unix:"):
        return text[len("unix:"):], None
    return _address(text)


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
        # A proxy whose harness died heals and goes: nothing is left to steer it, and what it
        # protected went with the harness's stack.
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), OWNER_POLL_S)
            if args.owner_pid and not alive(args.owner_pid):
                break


def main(argv: list[str] | None = None) -> None:
    """Run one fault proxy as its own process (a container on a game day's network, or a
    process beside the harness); prints one JSON line with its addresses once it serves, and
    stops on SIGTERM/SIGINT, healing its fault on the way out."""
    parser = argparse.ArgumentParser(prog="python -m harness.nemesis", description=main.__doc__)
    parser.add_argument("--name", default="proxy")
    parser.add_argument("--target", type=_target, required=True,
                        help="HOST:PORT (or unix:PATH) to protect")
    parser.add_argument("--listen", type=_address, default=("127.0.0.1", 0), help="HOST:PORT")
    parser.add_argument("--control", type=_address, default=("127.0.0.1", 0),
                        help="HOST:PORT of the HTTP control API")
    parser.add_argument("--owner-pid", type=int, default=0,
                        help="heal and exit once this process (the harness) is gone")
    asyncio.run(_serve_alone(parser.parse_args(argv)))
