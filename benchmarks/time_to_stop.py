"""Time to stop through the game-day harness, beside the blunt instruments (issue 4, DESIGN §4).

    bash scripts/setup && .venv/bin/python -m benchmarks.time_to_stop [--json PATH]

One run, four fleet stops, each on a stack of its own brought up by the harness
(harness.stack): the `processes` stack with 5 and with 50 agents, the `containers` stack with 5
and with 20. Every agent has the puppet behaviour `silent` (it never stops on its own) and one
task (GameDay.agent: its game-day limits are out of reach of a long run). Once every task is
`in_progress`, security pulls the fleet switch (`POST /api/v1/fleet/kill` through
GameDay.operate); once every sandbox is gone the game day is judged (GameDay.judge) and the
`kill_fleet` time-to-stop samples are summarised per part (harness.judge.time_to_stop): kill
acknowledged, last agent action, daemon exit, sandbox gone, tasks requeued, total. Daemon exit is
the control plane's `daemon_exited_at` of each sandbox (its daemon's process reaped, or its
container's death as the Docker engine saw it), sandbox gone its `gone_at` (every process of
it reaped, its container removed): two instants, measured apart, on this host's clock. Beside
them: coveyd's own log (when it heard the kill, when it said it was exiting) and, on the
containers stack, the `die` event of each sandbox container (the Docker engine's clock, same
host).

On the containers stack, in the same run and on the same kind of sandbox containers, the blunt
instruments follow: the fleet is resumed, and once every agent works again each running sandbox
container of the game day is killed with `docker kill` (all at once, one thread each), timed
from the instant before the first call to each container's `die` event, and to the control
plane's `daemon_exited_at` and `gone_at` of each sandbox. The control plane sees daemons
lost, requeues and wakes the agents; once they all work again the same is done with
`docker stop` (default timeout, 10 s). Bounded everywhere: every wait has a deadline, the whole
run has --max-seconds, traffic goes to 127.0.0.1 and the stacks' own containers only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks import kill_latency
from harness.act.client import json_of
from harness.judge.checkers import Verdict
from harness.judge.time_to_stop import PARTS, TOTAL, Percentiles, TimeToStop, percentiles, summarize
from harness.record.gameday import OBSERVER, GameDay
from harness.stack.base import Stack
from harness.stack.containers import HARNESS_LABEL, ContainersStack
from harness.stack.processes import ProcessesStack
from harness.stack.waiting import eventually

LIVE = ("starting", "running")
INSTRUMENTS = ("docker kill", "docker stop")
# Limits a silent agent does not reach within a run (an hour at about 3 steps a second).


class BenchmarkError(RuntimeError):
    """The run cannot give a meaningful figure: a stop that did not stop, a wait that ran out."""


# ---------------------------------------------------------------- figures


def figures(samples_ns: list[int]) -> dict[str, float]:
    """n, p50, p90, p99, max in ms, the percentiles through the harness's HDR histogram."""
    return in_ms(percentiles(samples_ns))


def in_ms(p: Percentiles) -> dict[str, float]:
    """The HDR histogram answers a bucket's highest value (3 significant figures), which can
    lie a hair above the exact max of the raw samples: percentiles are capped at that max."""
    return {"n": p.count, "p50_ms": min(p.p50_us, p.max_us) / 1000,
            "p90_ms": min(p.p90_us, p.max_us) / 1000,
            "p99_ms": min(p.p99_us, p.max_us) / 1000, "max_ms": p.max_us / 1000}


@dataclass
class FleetStop:
    """One fleet stop of N silent agents on one stack."""

    stack: str
    agents: int
    seed: int
    gameday: str | None = None  # the containers stack's game-day label
    steady_after_s: float = 0.0  # from the first agent created to every task in_progress
    kill_status: int = 0
    agents_stopped: int = 0
    tasks_requeued: int = 0
    all_gone_after_s: float = 0.0  # from the kill's invoke, as polled
    parts: dict[str, dict[str, float]] = field(default_factory=dict)  # measure.summarize, ms
    exit_codes: dict[str, int] = field(default_factory=dict)  # daemon exit code -> count
    verdicts: list[dict[str, Any]] = field(default_factory=list)
    samples_ns: list[dict[str, Any]] = field(default_factory=list)  # measure.TimeToStop
    container_dead: dict[str, float] = field(default_factory=dict)  # die events, ms
    container_dead_ns: list[int] = field(default_factory=list)
    container_exit_codes: dict[str, int] = field(default_factory=dict)
    # coveyd's own log of each stopped sandbox (ms resolution): when it heard the kill, when
    # it said it was exiting; ms after the kill's invoke.
    daemon_heard_kill: dict[str, float] = field(default_factory=dict)
    daemon_heard_kill_ns: list[int] = field(default_factory=list)
    daemon_exiting: dict[str, float] = field(default_factory=dict)
    daemon_exiting_ns: list[int] = field(default_factory=list)
    daemon_logs_found: int = 0
    daemon_kill_reasons: dict[str, int] = field(default_factory=dict)
    journal: str = ""
    blunt: list[BluntStop] = field(default_factory=list)


@dataclass
class BluntStop:
    """`docker kill` or `docker stop` of every running sandbox container of a game day."""

    instrument: str
    containers: int
    dead: dict[str, float] = field(default_factory=dict)  # t0 -> die event, ms
    dead_ns: list[int] = field(default_factory=list)
    call_started_ns: list[int] = field(default_factory=list)  # each call's start after t0
    call_returned_ns: list[int] = field(default_factory=list)  # each call's return after t0
    exit_codes: dict[str, int] = field(default_factory=dict)
    plane_exited: dict[str, float] = field(default_factory=dict)  # t0 -> daemon_exited_at, ms
    plane_exited_ns: list[int] = field(default_factory=list)
    plane_gone: dict[str, float] = field(default_factory=dict)  # t0 -> plane's gone_at, ms
    plane_gone_ns: list[int] = field(default_factory=list)
    plane_exit_codes: dict[str, int] = field(default_factory=dict)
    actions_after_call: int = 0  # puppet ledger entries between t0 and the container's death
    agents_acting_after_call: int = 0
    working_again_after_s: float | None = None  # t0 -> every task in_progress again


@dataclass
class Report:
    command: str
    started_at: str
    machine: dict[str, Any]
    settings: dict[str, Any]
    runs: list[FleetStop] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ended_at: str = ""


# ---------------------------------------------------------------- reading the game day


async def gather_bounded(calls: list[Callable[[], Awaitable[Any]]], width: int = 10
                         ) -> list[Any]:
    """Run the calls concurrently, at most `width` at a time, results in order."""
    gate = asyncio.Semaphore(width)

    async def one(call: Callable[[], Awaitable[Any]]) -> Any:
        async with gate:
            return await call()

    return list(await asyncio.gather(*(one(c) for c in calls)))


async def read_tasks(day: GameDay) -> dict[str, dict[str, Any]]:
    """GameDay.read_tasks, with the backlogs read concurrently: with 50 agents one after the
    other, a read of the fleet would take longer than what it is meant to time. Each task is
    recorded as a `task_state` observation when its own backlog has been read."""
    auditor = day.people["auditor"]

    def backlog(agent_id: str) -> Callable[[], Awaitable[list[dict[str, Any]]]]:
        async def read() -> list[dict[str, Any]]:
            rows: list[dict[str, Any]] = json_of(await auditor.backlog(agent_id))
            for t in rows:
                day.history.observe(OBSERVER, "task_state", {
                    "task_id": t["id"], "state": t["state"], "agent_id": agent_id})
            return rows
        return read

    backlogs = await gather_bounded([backlog(a) for a in day.agents])
    return {t["id"]: t for rows in backlogs for t in rows}


async def sandboxes(day: GameDay) -> dict[str, list[dict[str, Any]]]:
    def of(agent_id: str) -> Callable[[], Awaitable[list[dict[str, Any]]]]:
        return lambda: day.sandboxes(agent_id)

    rows = await gather_bounded([of(a) for a in day.agents])
    return dict(zip(day.agents, rows, strict=True))


async def wait_working(day: GameDay, deadline_s: float, what: str) -> None:
    """Until every task of the game day is in_progress (its agent's daemon claimed it)."""
    async def working() -> bool:
        tasks = await read_tasks(day)
        return bool(tasks) and all(t["state"] == "in_progress" for t in tasks.values())
    await eventually(working, deadline_s, f"{what}: not every task in progress", interval=0.25)


def is_gone(sandbox: dict[str, Any]) -> bool:
    """Over for the control plane, and nothing of it left: its gone_at is recorded."""
    return sandbox["state"] not in LIVE and bool(sandbox.get("gone_at"))


async def wait_no_live_sandbox(day: GameDay, deadline_s: float, what: str) -> None:
    async def gone() -> bool:
        return all(is_gone(s) for rows in (await sandboxes(day)).values() for s in rows)
    await eventually(gone, deadline_s, f"{what}: a sandbox kept running (no gone_at)",
                     interval=0.1)


# ---------------------------------------------------------------- the Docker side


class DeathWatch:
    """The engine's `die` events of a game day's sandbox containers, followed in a thread from
    a little before it was opened (an event while the stream connects is replayed)."""

    def __init__(self, client: Any, gameday: str) -> None:
        self._client = client
        self._gameday = gameday
        self._lock = threading.Lock()
        self.died: dict[str, tuple[int, int]] = {}  # container id -> (time ns, exit code)
        self._stream: Any = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> DeathWatch:
        self._stream = self._client.events(decode=True, since=int(time.time()) - 2, filters={
            "type": "container", "event": "die",
            "label": [f"covey.gameday={self._gameday}", "covey.sandbox"]})
        self._thread = threading.Thread(target=self._follow, name="bench-die-events",
                                        daemon=True)
        self._thread.start()
        return self

    def _follow(self) -> None:
        with contextlib.suppress(Exception):  # the stream raises when closed under it
            for event in self._stream:
                attributes = event.get("Actor", {}).get("Attributes", {})
                code = int(attributes.get("exitCode", -1))
                with self._lock:
                    self.died.setdefault(event.get("id", ""), (int(event["timeNano"]), code))

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self._stream.close()
        if self._thread is not None:
            self._thread.join(5)

    def seen(self, ids: set[str], since_ns: int) -> dict[str, tuple[int, int]]:
        with self._lock:
            return {i: d for i, d in self.died.items() if i in ids and d[0] >= since_ns}

    async def wait(self, ids: set[str], since_ns: int, deadline_s: float, what: str
                   ) -> dict[str, tuple[int, int]]:
        """Every container's death; for one whose event never came, the engine's FinishedAt
        of an exited container (same clock); none at all is a failure."""
        async def all_dead() -> bool:
            return len(self.seen(ids, since_ns)) == len(ids)
        with contextlib.suppress(AssertionError):
            await eventually(all_dead, deadline_s, what, interval=0.05)
        found = self.seen(ids, since_ns)
        for missing in ids - set(found):
            state = await asyncio.to_thread(self._state, missing)
            if state is None or state.get("Status") not in ("exited", "dead"):
                raise BenchmarkError(f"{what}: container {missing[:12]} not dead after "
                                     f"{deadline_s}s ({state})")
            found[missing] = (rfc3339_ns(state["FinishedAt"]), int(state.get("ExitCode", -1)))
        return found

    def _state(self, container_id: str) -> dict[str, Any] | None:
        import docker.errors

        try:
            state: dict[str, Any] = self._client.containers.get(container_id).attrs["State"]
            return state
        except docker.errors.NotFound:
            return None


def iso_ns(stamp: str) -> int:
    """An API timestamp (ISO 8601 with offset) in ns since the epoch, to the µs it carries."""
    moment = datetime.fromisoformat(stamp)
    return (int(moment.replace(microsecond=0).timestamp()) * 1_000_000_000
            + moment.microsecond * 1000)


def rfc3339_ns(stamp: str) -> int:
    """The engine's "2026-12-01T04:18:00.123456789Z" in ns since the epoch."""
    whole, _, rest = stamp.rstrip("Z").partition(".")
    seconds = int(datetime.fromisoformat(whole).replace(tzinfo=UTC).timestamp())
    return seconds * 1_000_000_000 + int((rest or "0")[:9].ljust(9, "0"))


@dataclass(frozen=True)
class DaemonLog:
    heard_kill_ns: int | None  # "kill switch: ..." (a kill message, or the lease failing closed)
    exiting_ns: int | None  # "exiting with N"
    exit_code: int | None
    kill_reason: str | None


def daemon_log(sandbox_id: str, in_container: bool) -> DaemonLog | None:
    """coveyd's log of one sandbox, where the stack's control plane keeps it while the stack is
    up (its data folder under the temporary directory, logs/<sandbox id>.log; the docker
    backend writes it when it removes the container). Lines start with coveyd's asctime, to the
    ms: local time for a local process, UTC inside a container (same kernel clock)."""
    tmp = Path(tempfile.gettempdir())
    found = [*tmp.glob(f"covey-gameday-*/data/logs/{sandbox_id}.log"),
             *tmp.glob(f"covey-gd-*/data/logs/{sandbox_id}.log")]
    if len(found) != 1:
        return None
    heard = exiting = code = reason = None
    for line in found[0].read_text(errors="replace").splitlines():
        if " coveyd " not in line:
            continue
        try:
            moment = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
        except ValueError:
            continue
        if in_container:
            moment = moment.replace(tzinfo=UTC)
        at = int(moment.timestamp()) * 1_000_000_000 + moment.microsecond * 1000
        message = line.split(" ", 4)[-1]
        if heard is None and message.startswith("kill switch:"):
            heard, reason = at, message.removeprefix("kill switch:").strip()
        elif message.startswith("exiting with "):
            exiting = at
            with contextlib.suppress(ValueError):
                code = int(message.split()[2])
    return DaemonLog(heard, exiting, code, reason)


def sandbox_containers(client: Any, gameday: str) -> list[Any]:
    """The game day's running sandbox containers."""
    found: list[Any] = client.containers.list(ignore_removed=True, filters={
        "label": [f"covey.gameday={gameday}", "covey.sandbox"], "status": "running"})
    return found


def own_gameday(client: Any) -> str:
    """The game-day label of the containers stack this process brought up (its control plane
    carries our pid)."""
    mine = client.containers.list(ignore_removed=True, filters={
        "label": [HARNESS_LABEL, f"covey.owner_pid={os.getpid()}"], "status": "running"})
    days = {c.labels.get("covey.gameday") for c in mine} - {None}
    if len(days) != 1:
        raise BenchmarkError(f"expected one game day of pid {os.getpid()}, found {days}")
    return str(days.pop())


async def wait_containers(client: Any, gameday: str, n: int, deadline_s: float, what: str
                          ) -> list[Any]:
    async def running() -> list[Any]:
        found = await asyncio.to_thread(sandbox_containers, client, gameday)
        return found if len(found) == n else []
    found: list[Any] = await eventually(running, deadline_s, f"{what}: not {n} sandbox "
                                        "containers running", interval=0.25)
    return found


async def blunt_stop(day: GameDay, client: Any, gameday: str, instrument: str, n: int,
                     pool: ThreadPoolExecutor, deadline_s: float) -> BluntStop:
    """Stop every running sandbox container of the game day with `instrument`, all at once;
    time each container's death, the control plane's view of it, and the agents' recovery."""
    containers = await wait_containers(client, gameday, n, deadline_s, instrument)
    by_id = {c.id: c for c in containers}
    loop = asyncio.get_running_loop()

    def hit(container: Any) -> tuple[int, int]:
        started = time.time_ns()
        if instrument == "docker kill":
            container.kill()
        else:
            container.stop()  # the engine's default: SIGTERM, SIGKILL 10 s later
        return started, time.time_ns()

    with DeathWatch(client, gameday) as watch:
        await asyncio.sleep(0.2)  # let the event stream connect (it replays 2 s anyway)
        t0 = time.time_ns()
        calls = await asyncio.gather(*(loop.run_in_executor(pool, hit, c)
                                       for c in containers))
        died = await watch.wait(set(by_id), t0, deadline_s, instrument)
    result = BluntStop(instrument=instrument, containers=len(containers))
    result.call_started_ns = sorted(s - t0 for s, _ in calls)
    result.call_returned_ns = sorted(e - t0 for _, e in calls)
    result.dead_ns = sorted(at - t0 for at, _ in died.values())
    result.dead = figures(result.dead_ns)
    result.exit_codes = dict(Counter(str(code) for _, code in died.values()))

    # What the agents did meanwhile: puppet ledger entries after the call, before the death.
    sandbox_of = {c.id: c.labels["covey.sandbox"] for c in containers}
    agent_of = {c.id: c.labels["covey.agent"] for c in containers}
    acting = set()
    for cid, (dead_at, _) in died.items():
        entries = await day.endpoints.puppet.actions(agent_of[cid])
        late = [e for e in entries if t0 <= e.at_ns <= dead_at]
        result.actions_after_call += len(late)
        if late:
            acting.add(agent_of[cid])
    result.agents_acting_after_call = len(acting)

    # The control plane's view: those daemons exited and sandboxes gone, then every agent back
    # at work.
    killed = set(sandbox_of.values())

    async def plane_saw() -> list[dict[str, Any]]:
        rows = [s for boxes in (await sandboxes(day)).values() for s in boxes
                if s["id"] in killed]
        return rows if len(rows) == len(killed) and all(
            is_gone(s) and s.get("daemon_exited_at") for s in rows) else []
    rows = await eventually(plane_saw, deadline_s, f"{instrument}: the control plane did not "
                            "see every daemon exit and every sandbox gone", interval=0.1)
    result.plane_exited_ns = sorted(iso_ns(s["daemon_exited_at"]) - t0 for s in rows)
    result.plane_exited = figures(result.plane_exited_ns)
    result.plane_gone_ns = sorted(iso_ns(s["gone_at"]) - t0 for s in rows)
    result.plane_gone = figures(result.plane_gone_ns)
    result.plane_exit_codes = dict(Counter(str(s["exit_code"]) for s in rows))
    await wait_working(day, deadline_s, f"after {instrument}")
    result.working_again_after_s = (time.time_ns() - t0) / 1e9
    return result


# ---------------------------------------------------------------- one fleet stop


async def fleet_stop(stack: Stack, n: int, seed: int, report_dir: Path,
                     options: argparse.Namespace) -> FleetStop:
    """Bring the stack up, N silent agents at work, the fleet switch; then on containers the
    blunt instruments on the same game day's sandboxes."""
    result = FleetStop(stack=stack.name, agents=n, seed=seed)
    docker_client: Any = None
    if stack.name == "containers":
        import docker

        docker_client = docker.from_env(max_pool_size=max(10, n + 4))
    async with contextlib.AsyncExitStack() as cleanup:
        if docker_client is not None:
            cleanup.callback(docker_client.close)
        endpoints = await cleanup.enter_async_context(stack.up())
        day = GameDay(name=f"time_to_stop-{stack.name}-{n}", stack=stack.name,
                      endpoints=endpoints, seed=seed, report_dir=report_dir)
        status, after = "aborted", {}
        verdicts: list[Verdict] = []
        samples: list[TimeToStop] = []
        watch: DeathWatch | None = None
        try:
            await day.enlist()
            started = time.monotonic()
            agents = [await day.agent("silent") for _ in range(n)]
            for a in agents:
                await day.task(a["id"])
            await wait_working(day, options.steady_timeout, f"{stack.name}, {n} agents")
            result.steady_after_s = round(time.monotonic() - started, 2)
            day.steady_state = {"tasks_in_progress": n, "agents": n}
            print(f"  {stack.name} {n}: every task in progress after {result.steady_after_s}s",
                  flush=True)

            container_ids: set[str] = set()
            if docker_client is not None:
                result.gameday = await asyncio.to_thread(own_gameday, docker_client)
                running = await wait_containers(docker_client, result.gameday, n,
                                                options.stop_timeout, "before the fleet kill")
                container_ids = {c.id for c in running}
                watch = DeathWatch(docker_client, result.gameday).__enter__()
                await asyncio.sleep(0.2)

            # The last read of every task before the kill: all in progress.
            await wait_working(day, options.stop_timeout, "just before the fleet kill")
            security = day.people["security"]
            r = await day.operate("security", "kill_fleet", {}, security.kill_fleet)
            invoked_ns = day.history.operations("kill_fleet")[-1].start_ns  # as measure reads
            report = json_of(r)
            result.kill_status = r.status_code
            result.agents_stopped = len(report["agents_stopped"])
            result.tasks_requeued = len(report["tasks_requeued"])
            await read_tasks(day)  # the requeue, read back at once

            async def all_open() -> bool:
                tasks = await read_tasks(day)
                return all(t["state"] == "open" for t in tasks.values())
            await eventually(all_open, options.stop_timeout, "tasks not requeued",
                             interval=0.1)
            await wait_no_live_sandbox(day, options.stop_timeout, "after the fleet kill")
            result.all_gone_after_s = round((time.time_ns() - invoked_ns) / 1e9, 3)
            if watch is not None:
                died = await watch.wait(container_ids, invoked_ns, options.stop_timeout,
                                        "fleet kill")
                watch.__exit__(None, None, None)
                watch = None
                result.container_dead_ns = sorted(at - invoked_ns for at, _ in died.values())
                result.container_dead = figures(result.container_dead_ns)
                result.container_exit_codes = dict(Counter(str(c) for _, c in died.values()))

            verdicts, samples, final = await day.judge()
            stopped = [sb["id"] for rows in (await sandboxes(day)).values() for sb in rows
                       if sb.get("daemon_exited_at")
                       and iso_ns(sb["daemon_exited_at"]) >= invoked_ns]
            logs = [daemon_log(sb, stack.name == "containers") for sb in stopped]
            heard = [g.heard_kill_ns - invoked_ns for g in logs if g and g.heard_kill_ns]
            exiting = [g.exiting_ns - invoked_ns for g in logs if g and g.exiting_ns]
            result.daemon_logs_found = sum(1 for g in logs if g is not None)
            if heard:
                result.daemon_heard_kill_ns = sorted(heard)
                result.daemon_heard_kill = figures(sorted(max(h, 0) for h in heard))
            if exiting:
                result.daemon_exiting_ns = sorted(exiting)
                result.daemon_exiting = figures(sorted(max(e, 0) for e in exiting))
            reasons = Counter(g.kill_reason for g in logs if g and g.kill_reason)
            if reasons:
                day.notes.append(f"coveyd kill reasons: {dict(reasons)}")
                result.daemon_kill_reasons = dict(reasons)
            fleet = [s for s in samples if s.kill_f == "kill_fleet"]
            if {s.agent_id for s in fleet} != set(day.agents):
                raise BenchmarkError("a time-to-stop sample is missing for some agent")
            result.samples_ns = [asdict(s) for s in fleet]
            result.parts = {part: in_ms(p) for part, p in summarize(fleet).items()}
            result.exit_codes = dict(Counter(str(s.daemon_exit_code) for s in fleet))
            result.verdicts = [{"checker": v.checker, "valid": v.valid, "message": v.message}
                               for v in verdicts]
            after = {"tasks_open": sum(1 for t in final.tasks.values() if t["state"] == "open")}
            status = "completed"

            if docker_client is not None and result.gameday and not options.no_blunt:
                await blunt_instruments(day, docker_client, result, options)
        except (AssertionError, BenchmarkError):
            if status == "aborted":
                status = "failed"
            raise
        finally:
            if watch is not None:
                watch.__exit__(None, None, None)
            with contextlib.suppress(Exception):
                result.journal = str(day.journal(status, verdicts, samples, after))
            await day.close()
    return result


async def blunt_instruments(day: GameDay, client: Any, result: FleetStop,
                            options: argparse.Namespace) -> None:
    """Resume the fleet, then docker kill every sandbox, let the control plane wake the agents
    again, then docker stop every sandbox."""
    n = result.agents
    security = day.people["security"]
    json_of(await day.operate("security", "resume_fleet", {}, security.resume_fleet))
    await wait_working(day, options.steady_timeout, "after the fleet resume")
    assert result.gameday is not None
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="blunt") as pool:
        for instrument in INSTRUMENTS:
            print(f"  {result.stack} {n}: {instrument}", flush=True)
            result.blunt.append(await blunt_stop(day, client, result.gameday, instrument, n,
                                                 pool, options.stop_timeout))


# ---------------------------------------------------------------- the run


def machine() -> dict[str, Any]:
    """The kill-latency benchmark's description of the host, and the Docker engine's version."""
    found = kill_latency.machine()
    with contextlib.suppress(Exception):
        import docker

        client = docker.from_env()
        try:
            found["docker_engine"] = client.version().get("Version", "?")
        finally:
            client.close()
    return found


def plan(options: argparse.Namespace) -> Iterator[tuple[str, int]]:
    for n in options.processes_agents:
        yield "processes", n
    for n in options.containers_agents:
        yield "containers", n


async def run(options: argparse.Namespace, command: str) -> Report:
    report = Report(command=command, started_at=datetime.now(UTC).isoformat(timespec="seconds"),
                    machine=machine(), settings={
                        "processes_agents": options.processes_agents,
                        "containers_agents": options.containers_agents,
                        "behaviour": "silent", "tasks_per_agent": 1, "seed": options.seed,
                        "image": options.image, "tick_ms": 300, "lease_ms": 2000,
                        "steady_timeout_s": options.steady_timeout,
                        "stop_timeout_s": options.stop_timeout,
                        "blunt_instruments": not options.no_blunt})
    if options.containers_agents:
        import docker

        client = docker.from_env()
        try:  # the tag may be rebuilt by others while this runs: say which image it was
            report.settings["image_id"] = client.images.get(options.image).id
        finally:
            client.close()
    for name, n in plan(options):
        stack: Stack = (ProcessesStack(options.report_dir) if name == "processes"
                        else ContainersStack(options.report_dir, image=options.image))
        print(f"{name}, {n} agents (load {kill_latency.load_average()})", flush=True)
        report.runs.append(await fleet_stop(stack, n, options.seed, options.report_dir,
                                            options))
    report.machine["loadavg_at_end"] = kill_latency.load_average()
    report.ended_at = datetime.now(UTC).isoformat(timespec="seconds")
    return report


def render(report: Report) -> str:
    lines = [f"time to stop, {report.started_at} .. {report.ended_at}", f"{report.machine}", ""]
    lines.append("fleet kill (ms after the kill's invoke)      n     p50     p99     max")
    for r in report.runs:
        lines.append(f"{r.stack} stack, {r.agents} silent agents (steady after "
                     f"{r.steady_after_s}s; daemon exit codes {r.exit_codes})")
        for part in (*PARTS, TOTAL):
            s = r.parts.get(part)
            if s is None:
                lines.append(f"  {part:<40}   -")
                continue
            lines.append(f"  {part:<40}{s['n']:>4}{s['p50_ms']:>8.1f}{s['p99_ms']:>8.1f}"
                         f"{s['max_ms']:>8.1f}")
        for name, got in (("coveyd log: heard the kill", r.daemon_heard_kill),
                          ("coveyd log: exiting", r.daemon_exiting)):
            if got:
                lines.append(f"  {name:<40}{got['n']:>4}{got['p50_ms']:>8.1f}"
                             f"{got['p99_ms']:>8.1f}{got['max_ms']:>8.1f}")
        if r.container_dead:
            s = r.container_dead
            lines.append(f"  {'sandbox container dead (docker die event)':<40}{s['n']:>4}"
                         f"{s['p50_ms']:>8.1f}{s['p99_ms']:>8.1f}{s['max_ms']:>8.1f}"
                         f"  exit codes {r.container_exit_codes}")
        bad = [v for v in r.verdicts if v["valid"] is not True]
        lines.append(f"  checkers: {len(r.verdicts) - len(bad)} valid"
                     + "".join(f"; {v['checker']}: {v['valid']} ({v['message']})" for v in bad))
    side = [r for r in report.runs if r.blunt]
    if side:
        lines += ["", "side by side, containers stack (ms after the fleet kill's invoke, or after "
                  "the instant before the first docker call)",
                  f"{'':<52}    n     p50     p99     max"]
        for r in side:
            lines.append(f"{r.agents} sandbox containers")
            gone = r.parts.get("sandbox_gone")
            rows: list[tuple[str, dict[str, float] | None, str]] = [
                ("fleet kill -> coveyd heard it (own log)", r.daemon_heard_kill, ""),
                ("fleet kill -> coveyd exiting (own log)", r.daemon_exiting, ""),
                ("fleet kill -> container dead (die event)", r.container_dead,
                 f"exit {r.container_exit_codes}"),
                ("fleet kill -> daemon_exit (plane)", r.parts.get("daemon_exit"), ""),
                ("fleet kill -> sandbox_gone (plane)", gone, "")]
            for b in r.blunt:
                rows.append((f"{b.instrument} -> container dead (die event)", b.dead,
                             f"exit {b.exit_codes}; {b.actions_after_call} actions by "
                             f"{b.agents_acting_after_call} agents after the call"))
                rows.append((f"{b.instrument} -> daemon exit (plane)", b.plane_exited, ""))
                rows.append((f"{b.instrument} -> sandbox gone (plane)", b.plane_gone,
                             f"all working again after {b.working_again_after_s:.1f}s"))
            for name, s, extra in rows:
                if not s:
                    continue
                lines.append(f"  {name:<50}{s['n']:>4}{s['p50_ms']:>8.1f}{s['p99_ms']:>8.1f}"
                             f"{s['max_ms']:>8.1f}  {extra}")
    return "\n".join(lines)


def agent_counts(text: str) -> list[int]:
    counts = [int(x) for x in text.split(",") if x.strip()]
    if any(c < 1 or c > 200 for c in counts):
        raise argparse.ArgumentTypeError("agent counts are between 1 and 200")
    return counts


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.time_to_stop",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--processes-agents", type=agent_counts, default=[5, 50],
                   help="fleet sizes on the processes stack, comma-separated (5,50; '' skips)")
    p.add_argument("--containers-agents", type=agent_counts, default=[5, 20],
                   help="fleet sizes on the containers stack (5,20; '' skips)")
    p.add_argument("--no-blunt", action="store_true",
                   help="skip docker kill / docker stop on the containers stack")
    p.add_argument("--image", default=os.environ.get("COVEY_SANDBOX_IMAGE",
                                                     "covey-gameday:latest"),
                   help="the stack's image (covey-gameday:latest)")
    p.add_argument("--seed", type=int, default=4, help="seed of the game days' people (4)")
    p.add_argument("--report-dir", type=Path, default=Path("reports"),
                   help="journals and stack logs (reports/)")
    p.add_argument("--steady-timeout", type=float, default=300,
                   help="bound of the wait for every agent at work, s (300)")
    p.add_argument("--stop-timeout", type=float, default=120,
                   help="bound of each wait for a stop to complete, s (120)")
    p.add_argument("--max-seconds", type=float, default=3600, help="bound of the run, s (3600)")
    p.add_argument("--json", type=Path, help="write every figure and raw sample here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    options = parse_options(argv)
    command = "python -m benchmarks.time_to_stop " + " ".join(sys.argv[1:] if argv is None
                                                              else argv)

    async def bounded() -> Report:
        async with asyncio.timeout(options.max_seconds):
            return await run(options, command.strip())

    report = asyncio.run(bounded())
    print(render(report))
    if options.json:
        options.json.parent.mkdir(parents=True, exist_ok=True)
        options.json.write_text(json.dumps(asdict(report), indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
