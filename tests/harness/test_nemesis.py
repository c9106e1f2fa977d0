"""The nemesis: each fault of the proxy does what it says to real connections and heals on its
deadline and on demand; the HTTP control API; process pauses and kills; the end-of-day check
that every fault healed."""

from __future__ import annotations

import asyncio
import json
import math
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.nemesis import BadFault, FaultProxy, HealFailed, Nemesis, ProxyFaultKind
from harness.stack.waiting import eventually

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]
Connect = Callable[[int], Awaitable[Streams]]

ROOT = Path(__file__).resolve().parents[2]  # where `harness` imports from in a child process
# Generous on purpose: a 2-core machine shared with other test runs.
ANSWER_S = 5.0  # how long a healthy link may take to echo
SILENCE_S = 0.4  # how long a blackholed link must stay silent


class EchoServer:
    """The protected link's far end: echoes every byte, counts its connections and resets."""

    def __init__(self) -> None:
        self.port = 0
        self.open = 0
        self.resets = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> EchoServer:
        self._server = await asyncio.start_server(self._echo, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _echo(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        try:
            while chunk := await reader.read(65536):
                writer.write(chunk)
                await writer.drain()
            writer.write_eof()
        except ConnectionResetError:
            self.resets += 1
        finally:
            self.open -= 1
            writer.close()


@pytest.fixture
async def echo() -> AsyncIterator[EchoServer]:
    async with EchoServer() as server:
        yield server


@pytest.fixture
async def proxy(echo: EchoServer) -> AsyncIterator[FaultProxy]:
    async with FaultProxy("127.0.0.1", echo.port, name="echo", control_port=None) as p:
        yield p


@pytest.fixture
async def controlled(echo: EchoServer) -> AsyncIterator[tuple[FaultProxy, httpx.AsyncClient]]:
    async with FaultProxy("127.0.0.1", echo.port, name="flag-store") as p:
        assert p.control_url is not None
        async with httpx.AsyncClient(base_url=p.control_url, timeout=30) as client:
            yield p, client


@pytest.fixture
async def connect() -> AsyncIterator[Connect]:
    """Open client connections to a port; all are closed after the test."""
    writers: list[asyncio.StreamWriter] = []

    async def open_to(port: int) -> Streams:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writers.append(writer)
        return reader, writer

    yield open_to
    for writer in writers:
        writer.transport.abort()


async def ask(streams: Streams, payload: bytes, timeout: float = ANSWER_S) -> float:
    """Send `payload`, wait for its echo; returns the round trip in seconds."""
    reader, writer = streams
    started = time.monotonic()
    writer.write(payload)
    await writer.drain()
    answer = await asyncio.wait_for(reader.readexactly(len(payload)), timeout)
    assert answer == payload
    return time.monotonic() - started


async def round_trip(port: int, timeout: float = ANSWER_S) -> float:
    """A fresh connection carries a request and its answer."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
    try:
        return await ask((reader, writer), b"ping\n", timeout)
    finally:
        writer.close()


async def flows(port: int) -> bool:
    try:
        await round_trip(port, timeout=1.0)
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        return False
    return True


async def healed_by_deadline(proxy: FaultProxy, timeout: float) -> dict[str, Any]:
    """Wait for the standing fault to heal on its own; returns its log entry."""
    async def healed() -> bool:
        return proxy.active is None
    await eventually(healed, timeout, f"proxy {proxy.name} still has a fault standing")
    record = proxy.fault_log()[-1]
    assert record.healed_by == "deadline", record
    assert record.deadline_s is not None and record.healed_ns is not None
    # The timer runs on the monotonic clock, the log on the wall clock: allow a little slack.
    assert record.healed_ns - record.started_ns >= record.deadline_s * 1e9 - 5e6, record
    return record.to_json()


# ---------------------------------------------------------------- the proxy without faults


async def test_a_healthy_proxy_carries_both_ways_and_passes_a_half_close(
        proxy: FaultProxy, connect: Connect) -> None:
    reader, writer = await connect(proxy.port)
    assert await ask((reader, writer), b"x" * 200_000) < ANSWER_S
    writer.write(b"last words")
    writer.write_eof()
    # The echo server answers what came before the client's EOF, then closes its side.
    assert await asyncio.wait_for(reader.read(), ANSWER_S) == b"last words"
    assert proxy.active is None and proxy.fault_log() == []


# ---------------------------------------------------------------- each fault, healing on its own


async def test_latency_delays_each_chunk_both_ways_until_its_deadline(
        proxy: FaultProxy, connect: Connect) -> None:
    before = await connect(proxy.port)  # opened before the fault: delayed all the same
    record = await proxy.latency(250, deadline_s=2.0)
    assert (record.kind, record.ms, record.healed) == ("latency", 250, False)

    assert await ask(before, b"slow\n") >= 0.49  # 250 ms out and 250 ms back
    assert await round_trip(proxy.port) >= 0.49

    await healed_by_deadline(proxy, timeout=10)
    assert await ask(before, b"fast again\n") < 0.25  # under one leg of the delay


async def test_blackhole_answers_nothing_with_sockets_open_and_delivers_after_its_deadline(
        proxy: FaultProxy, connect: Connect) -> None:
    before = await connect(proxy.port)
    await ask(before, b"warm\n")
    await proxy.blackhole(deadline_s=2.0)
    during = await connect(proxy.port)  # the kernel accepts it; nothing flows on it
    for _, writer in (before, during):
        writer.write(b"anyone there?\n")
        await writer.drain()
    for reader, writer in (before, during):
        # No answer, and no EOF either (read() would return b"" on a closed socket).
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.read(100), SILENCE_S)
        assert not writer.is_closing()
    active = proxy.active
    assert active is not None and active.kind == "blackhole", "the fault ended too early"

    await healed_by_deadline(proxy, timeout=10)
    # The held bytes were kept, not dropped: both requests get their answer on their socket.
    for reader, _ in (before, during):
        answer = await asyncio.wait_for(reader.readexactly(14), ANSWER_S)
        assert answer == b"anyone there?\n"


async def test_reset_resets_both_sides_and_new_connections_until_its_deadline(
        proxy: FaultProxy, echo: EchoServer, connect: Connect) -> None:
    before = await connect(proxy.port)
    await ask(before, b"warm\n")
    assert echo.open == 1
    await proxy.reset(deadline_s=2.0)

    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(before[0].read(100), ANSWER_S)

    async def upstream_reset() -> bool:
        return echo.open == 0 and echo.resets == 1
    await eventually(upstream_reset, ANSWER_S, "the target's side was not reset")

    # A new connection completes the handshake (the kernel does that) and is reset at once.
    with pytest.raises((ConnectionResetError, BrokenPipeError)):
        await round_trip(proxy.port)
    active = proxy.active
    assert active is not None and active.kind == "reset", "the fault ended too early"

    await healed_by_deadline(proxy, timeout=10)
    assert await round_trip(proxy.port) < ANSWER_S


async def test_down_refuses_connections_and_closes_existing_ones_until_its_deadline(
        proxy: FaultProxy, echo: EchoServer, connect: Connect) -> None:
    before = await connect(proxy.port)
    await ask(before, b"warm\n")
    await proxy.down(deadline_s=2.0)

    assert await asyncio.wait_for(before[0].read(100), ANSWER_S) == b""  # closed, with a FIN
    with pytest.raises(ConnectionRefusedError):
        await round_trip(proxy.port)

    async def upstream_closed() -> bool:
        return echo.open == 0
    await eventually(upstream_closed, ANSWER_S, "the target's side stayed open")
    active = proxy.active
    assert active is not None and active.kind == "down", "the fault ended too early"

    await healed_by_deadline(proxy, timeout=10)
    assert await round_trip(proxy.port) < ANSWER_S  # listening again, on the same port


# ---------------------------------------------------------------- heal, replace, refuse


FAULTS: list[tuple[ProxyFaultKind, int | None]] = [
    ("latency", 10_000), ("blackhole", None), ("reset", None), ("down", None)]


@pytest.mark.parametrize(("kind", "ms"), FAULTS, ids=[k for k, _ in FAULTS])
async def test_heal_lifts_each_fault_at_once(proxy: FaultProxy, kind: ProxyFaultKind,
                                             ms: int | None) -> None:
    record = await proxy.inject(kind, 60, ms)
    assert not await flows(proxy.port), f"{kind} let a request through"

    healed = await proxy.heal()
    assert healed is not None and healed.id == record.id
    assert healed.healed_by == "heal" and healed.healed_ns is not None
    assert proxy.active is None
    # Well before the deadline, and quicker than one leg of the latency.
    assert await round_trip(proxy.port) < 5
    assert await proxy.heal() is None  # nothing left to heal


async def test_a_new_fault_replaces_the_standing_one(proxy: FaultProxy) -> None:
    first = await proxy.latency(10_000, deadline_s=60)
    second = await proxy.down(deadline_s=60)
    with pytest.raises(ConnectionRefusedError):
        await round_trip(proxy.port)
    log = proxy.fault_log()
    assert [(r.id, r.healed_by) for r in log] == [(first.id, "replaced"), (second.id, None)]

    await proxy.heal()
    # The latency went with the first fault: nothing is slow after the heal.
    assert await round_trip(proxy.port) < 5
    assert [r.healed_by for r in proxy.fault_log()] == ["replaced", "heal"]


@pytest.mark.parametrize(("kind", "deadline_s", "ms", "error"), [
    ("latency", 0, 100, "Invalid deadline_s"),
    ("latency", -1, 100, "Invalid deadline_s"),
    ("latency", 3601, 100, "Invalid deadline_s"),
    ("latency", math.nan, 100, "Invalid deadline_s"),
    ("latency", 1, None, "Invalid ms"),
    ("latency", 1, 0, "Invalid ms"),
    ("blackhole", 1, 100, "Unexpected ms"),
    ("partition", 1, None, "Unknown fault kind"),
])
async def test_a_fault_that_cannot_heal_as_asked_is_not_started(
        proxy: FaultProxy, kind: Any, deadline_s: float, ms: int | None, error: str) -> None:
    with pytest.raises(BadFault) as caught:
        await proxy.inject(kind, deadline_s, ms)
    assert caught.value.error == error and caught.value.hint
    assert proxy.active is None and proxy.fault_log() == []
    assert await round_trip(proxy.port) < ANSWER_S


# ---------------------------------------------------------------- the HTTP control API


async def test_the_control_api_starts_shows_replaces_and_heals_faults(
        controlled: tuple[FaultProxy, httpx.AsyncClient]) -> None:
    proxy, api = controlled
    r = await api.post("/faults", json={"kind": "latency", "deadline_s": 30, "ms": 300})
    assert r.status_code == 201, r.text
    latency = r.json()
    assert latency["id"] == "flag-store-latency-1" and latency["replaced"] is None
    assert latency["heals_at_ns"] == latency["started_ns"] + 30 * 10**9
    assert await round_trip(proxy.port) >= 0.59

    r = await api.get("/faults")
    assert r.status_code == 200
    state = r.json()
    assert state["active"]["id"] == latency["id"]
    assert state["listen"] == f"127.0.0.1:{proxy.port}"

    r = await api.post("/faults", json={"kind": "down", "deadline_s": 30})
    assert r.status_code == 201, r.text
    down = r.json()
    assert down["replaced"] == latency["id"]
    assert not await flows(proxy.port)

    r = await api.delete("/faults")
    assert r.status_code == 200, r.text
    assert r.json()["healed"]["id"] == down["id"]
    assert await round_trip(proxy.port) < 0.3
    r = await api.delete("/faults")
    assert r.json() == {"healed": None}

    log = (await api.get("/faults")).json()["log"]
    assert [(f["id"], f["kind"], f["healed_by"]) for f in log] == [
        (latency["id"], "latency", "replaced"), (down["id"], "down", "heal")]
    assert all(f["started_ns"] <= f["healed_ns"] for f in log)


async def test_a_fault_started_over_http_heals_on_its_deadline(
        controlled: tuple[FaultProxy, httpx.AsyncClient]) -> None:
    proxy, api = controlled
    r = await api.post("/faults", json={"kind": "reset", "deadline_s": 0.4})
    assert r.status_code == 201, r.text

    async def healed() -> dict[str, Any] | None:
        state: dict[str, Any] = (await api.get("/faults")).json()
        return None if state["active"] else state
    state = await eventually(healed, 10, "the fault did not heal on its deadline")
    assert state is not None and state["log"][0]["healed_by"] == "deadline"
    assert await round_trip(proxy.port) < ANSWER_S


@pytest.mark.parametrize(("body", "status", "error"), [
    ({"kind": "latency", "deadline_s": 0, "ms": 100}, 422, "Invalid request"),
    ({"kind": "latency", "deadline_s": -5, "ms": 100}, 422, "Invalid request"),
    ({"kind": "latency", "deadline_s": 3601, "ms": 100}, 422, "Invalid request"),
    ({"kind": "blackhole"}, 422, "Invalid request"),
    ({"kind": "partition", "deadline_s": 1}, 422, "Invalid request"),
    ({"kind": "latency", "deadline_s": 1}, 422, "Invalid ms"),
    ({"kind": "latency", "deadline_s": 1, "ms": -1}, 422, "Invalid request"),
    ({"kind": "latency", "deadline_s": 1, "ms": 1.5}, 422, "Invalid request"),
    ({"kind": "blackhole", "deadline_s": 1, "ms": 100}, 422, "Unexpected ms"),
    ({"kind": "down", "deadline_s": 1, "heal": "never"}, 422, "Invalid request"),
    ("not json", 400, "Malformed JSON"),
])
async def test_the_control_api_refuses_bad_faults_with_a_hint(
        controlled: tuple[FaultProxy, httpx.AsyncClient], body: Any, status: int,
        error: str) -> None:
    proxy, api = controlled
    if isinstance(body, str):
        r = await api.post("/faults", content=body,
                           headers={"Content-Type": "application/json"})
    else:
        r = await api.post("/faults", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"] == error and r.json()["hint"]
    assert proxy.fault_log() == []


async def test_a_proxy_runs_on_its_own_as_a_process(echo: EchoServer) -> None:
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "harness.nemesis", "--name", "alone",
        "--target", f"127.0.0.1:{echo.port}", stdout=asyncio.subprocess.PIPE, cwd=ROOT)
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(child.stdout.readline(), 60)
        started = json.loads(line)
        port = int(started["listen"].rpartition(":")[2])
        assert await round_trip(port) < ANSWER_S
        async with httpx.AsyncClient(base_url=started["control"], timeout=30) as api:
            r = await api.post("/faults", json={"kind": "down", "deadline_s": 30})
            assert r.status_code == 201, r.text
            assert not await flows(port)
            assert (await api.delete("/faults")).json()["healed"]["kind"] == "down"
        assert await round_trip(port) < ANSWER_S
        child.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(child.wait(), 30) == 0
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()


# ---------------------------------------------------------------- processes


def process_state(pid: int) -> str:
    """The one-letter state from /proc: R running, S sleeping, T stopped, Z zombie."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rpartition(")")[2].split()[0]


@pytest.fixture
async def sleeper() -> AsyncIterator[asyncio.subprocess.Process]:
    child = await asyncio.create_subprocess_exec("sleep", "300")
    yield child
    if child.returncode is None:
        child.kill()
        await child.wait()


async def in_state(pid: int, states: str, timeout: float) -> None:
    async def reached() -> bool:
        return process_state(pid) in states
    await eventually(reached, timeout, f"process {pid} never reached a state in {states!r}")


async def test_pause_process_stops_it_until_its_deadline(
        sleeper: asyncio.subprocess.Process) -> None:
    async with Nemesis() as nemesis:
        record = await nemesis.pause_process(sleeper.pid, deadline_s=1.0)
        assert process_state(sleeper.pid) == "T"
        assert record.kind == "pause" and record.target == f"pid {sleeper.pid}"

        await in_state(sleeper.pid, "SR", timeout=10)
        [entry] = nemesis.fault_log()
        assert entry["healed_by"] == "deadline"
        assert entry["healed_ns"] - entry["started_ns"] >= 1e9 - 5e6


async def test_resume_process_continues_it_at_once(sleeper: asyncio.subprocess.Process) -> None:
    async with Nemesis() as nemesis:
        await nemesis.pause_process(sleeper.pid, deadline_s=60)
        assert process_state(sleeper.pid) == "T"
        record = await nemesis.resume_process(sleeper.pid)
        assert record is not None and record.healed_by == "heal"
        assert process_state(sleeper.pid) in "SR"
        assert await nemesis.resume_process(sleeper.pid) is None


async def test_a_pause_outlives_a_dead_harness_only_until_its_deadline(
        sleeper: asyncio.subprocess.Process) -> None:
    # A harness that pauses the process and dies at once: no heal, no clean-up, no timer.
    script = ("import asyncio, os, sys\n"
              "from harness.nemesis import Nemesis\n"
              "async def main():\n"
              "    await Nemesis().pause_process(int(sys.argv[1]), float(sys.argv[2]))\n"
              "    os._exit(0)\n"
              "asyncio.run(main())\n")
    harness = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, str(sleeper.pid), "3", cwd=ROOT)
    assert await asyncio.wait_for(harness.wait(), 60) == 0
    assert process_state(sleeper.pid) == "T"
    await in_state(sleeper.pid, "SR", timeout=20)


async def test_kill_process_kills_it_and_ends_its_pause(
        sleeper: asyncio.subprocess.Process) -> None:
    async with Nemesis() as nemesis:
        pause = await nemesis.pause_process(sleeper.pid, deadline_s=60)
        kill = await nemesis.kill_process(sleeper.pid)
        assert await asyncio.wait_for(sleeper.wait(), 10) == -signal.SIGKILL
        assert kill.healed_by == "instant"
        log = {f["id"]: f for f in nemesis.fault_log()}
        assert log[pause.id]["healed_by"] == "replaced"
        assert nemesis.verify_healed().healed


# ---------------------------------------------------------------- the end of a game day


async def test_verify_healed_names_a_fault_until_it_heals(
        echo: EchoServer, sleeper: asyncio.subprocess.Process) -> None:
    async with Nemesis() as nemesis:
        flag_store = await nemesis.proxy("flag-store", "127.0.0.1", echo.port, control=False)
        assert nemesis["flag-store"] is flag_store
        with pytest.raises(ValueError, match="already exists"):
            await nemesis.proxy("flag-store", "127.0.0.1", echo.port)

        blackhole = await flag_store.blackhole(deadline_s=1.0)
        pause = await nemesis.pause_process(sleeper.pid, deadline_s=60)
        report = nemesis.verify_healed()
        assert not report.healed
        assert [r.id for r in report.unhealed] == [blackhole.id, pause.id]
        assert blackhole.id in report.message and pause.id in report.message

        await nemesis.resume_process(sleeper.pid)
        await healed_by_deadline(flag_store, timeout=10)
        report = nemesis.verify_healed()
        assert report.healed, report.message
        assert report.to_json()["unhealed"] == []
        log = nemesis.fault_log()
        assert [(f["id"], f["healed_by"]) for f in log] == [
            (blackhole.id, "deadline"), (pause.id, "heal")]
        assert all(isinstance(f["started_ns"], int) and f["healed_ns"] >= f["started_ns"]
                   for f in log)


async def test_leaving_the_nemesis_heals_everything_still_standing(
        echo: EchoServer, sleeper: asyncio.subprocess.Process) -> None:
    async with Nemesis() as nemesis:
        proxy = await nemesis.proxy("flag-store", "127.0.0.1", echo.port)
        await proxy.down(deadline_s=60)
        await nemesis.pause_process(sleeper.pid, deadline_s=60)
        assert not nemesis.verify_healed().healed
    assert process_state(sleeper.pid) in "SR"
    report = nemesis.verify_healed()
    assert report.healed, report.message
    assert [f.healed_by for f in report.faults] == ["heal", "heal"]


async def test_a_heal_that_fails_leaves_the_fault_standing_and_says_why(
        echo: EchoServer) -> None:
    async with Nemesis() as nemesis:
        proxy = await nemesis.proxy("flag-store", "127.0.0.1", echo.port, control=False)
        down = await proxy.down(deadline_s=60)
        # Another listener takes the port while the proxy is down.
        squatter = socket.socket()
        try:
            squatter.bind(("127.0.0.1", proxy.port))
            squatter.listen()
            with pytest.raises(HealFailed):
                await proxy.heal()
            report = nemesis.verify_healed()
            assert not report.healed and [r.id for r in report.unhealed] == [down.id]
            assert "could not listen" in report.message
        finally:
            squatter.close()
        await proxy.heal()
        assert nemesis.verify_healed().healed
        assert await round_trip(proxy.port) < ANSWER_S


class _Plane:
    """A control plane as the stack hands it to the nemesis: killed, started again."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []

    async def kill(self) -> None:
        self.calls.append(("kill", time.monotonic()))

    async def start(self) -> None:
        self.calls.append(("start", time.monotonic()))


async def test_a_crashed_control_plane_is_started_again_at_its_deadline() -> None:
    plane = _Plane()
    async with Nemesis() as nemesis:
        record = await nemesis.crash_control_plane(plane, 0.3)
        assert [c for c, _ in plane.calls] == ["kill"]
        assert nemesis.control_plane_down() is not None

        async def started() -> bool:
            return [c for c, _ in plane.calls] == ["kill", "start"]
        await eventually(started, 5, "the crashed control plane was never started again")
        assert plane.calls[1][1] - plane.calls[0][1] >= 0.25, "started before its deadline"
        healed = next(r for r in nemesis.faults() if r.id == record.id)
        assert healed.healed_by == "deadline" and nemesis.control_plane_down() is None
        assert nemesis.verify_healed().healed


async def test_heal_all_starts_the_control_plane_after_the_other_faults() -> None:
    """A control plane cannot start while its database is away: healing every fault at once
    (the end of a game day, the halt) brings the plane back last."""
    order: list[str] = []

    class Database(_Plane):
        async def start(self) -> None:
            order.append("database")

    class Plane(_Plane):
        async def start(self) -> None:
            order.append("plane")

    async with Nemesis() as nemesis:
        await nemesis.crash_control_plane(Plane(), 30)
        # Any standing fault stands in for the database's: one more crash-like fault.
        from harness.nemesis.plane import PlaneCrash

        other = PlaneCrash(Database())
        other.key = other.target = "postgres"
        other.heals_last = False
        await nemesis._faults.start(other, 30)
        await nemesis.heal_all()
    assert order == ["database", "plane"], order
