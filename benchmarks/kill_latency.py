"""Kill-path latency beside its floor, in one run on one host (DESIGN §4, issue 2).

    bash scripts/setup && .venv/bin/python -m benchmarks.kill_latency [--kills 200] \
        [--fleet-agents 200] [--fleet-rounds 3] [--json PATH]

One real control plane (uvicorn on a loopback port, covey.testing.plane.start_plane: the
in-process stack the tests use too) on an embedded Postgres (pgserver, as tests/conftest.py
does), whose `process` sandbox backend starts one scripted daemon per session
(covey/testing/scripted_daemon.py). Three measurements:

1. Agent kills, one at a time: each agent has a running session holding a "hold" task. From
   time.time_ns() just before POST /api/v1/agents/{id}/kill to (a) the daemon holding the
   `kill` message (the daemon's own receive stamp in its transcript: wall clock, same host)
   and (b) the kill's HTTP response, which is sent after the requeue has committed, so the
   task is `open` again by then (checked afterwards for every kill, not timed).
2. The floor, sampled between those kills under the same conditions: one UPDATE … RETURNING
   committed on the same Postgres, plus one WebSocket round trip to an echo server in another
   process (benchmarks/ws_echo.py) over 127.0.0.1.
3. Fleet kills over N connected sandboxes: from the request to the last daemon holding its
   `kill`, and to the response (every task requeued). The fleet is resumed between rounds,
   which wakes every agent again.

Each kill starts from a quiet plane: before the next sample, the previous daemon has heard its
kill and exited, and the wakes its requeue sent have run. The floor's samples are taken between
the kills, so both see the same connected daemons, lease traffic and machine noise. The timed
requests go through a bare HTTP/1.1 client (RawHttp), not httpx, whose own cost on this event
loop would count as the control plane's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import websockets
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.stack import (
    BenchmarkError,
    RawHttp,
    bench_database,
    kill_stage_totals,
    load_average,
    machine,
    ms,
    percentile,
    postgres_server,
    stage_means_ms,
    summary,
    until,
)
from covey.config import Settings
from covey.logs import configure as configure_logs
from covey.testing import SCRIPTED_DAEMON
from covey.testing.plane import Org, Plane, World, make_world, start_plane

REPO = Path(__file__).resolve().parent.parent
# The message the floor sends: as long as a real `kill`.
FLOOR_MESSAGE = json.dumps({"type": "kill", "payload": {"reason": "kill-switch",
                                                        "sent_at_ns": time.time_ns()}})


# ---------------------------------------------------------------- figures


@dataclass
class KillSample:
    """One agent kill, in wall-clock ns of this host."""

    requested_ns: int  # time.time_ns() just before the request went out
    responded_ns: int  # the response is in: the task was requeued before it was sent
    sent_ns: int  # the control plane's own stamp in the kill message (hub.send_kill)
    received_ns: int  # the daemon's stamp when it read the kill
    sandbox_id: str
    # The daemon's stamp when it read the kill's `hold`, sent before the flag commits
    # (covey.switches._held): from then on it starts nothing. None: no hold came.
    held_ns: int | None = None

    @property
    def to_daemon_ms(self) -> float:
        return ms(self.received_ns - self.requested_ns)

    @property
    def to_held_ms(self) -> float | None:
        return None if self.held_ns is None else ms(self.held_ns - self.requested_ns)

    @property
    def to_open_ms(self) -> float:
        return ms(self.responded_ns - self.requested_ns)

    @property
    def to_send_ms(self) -> float:
        return ms(self.sent_ns - self.requested_ns)

    @property
    def delivery_ms(self) -> float:
        return ms(self.received_ns - self.sent_ns)


@dataclass
class FloorSample:
    commit_ns: int
    round_trip_ns: int

    @property
    def total_ms(self) -> float:
        return ms(self.commit_ns + self.round_trip_ns)


@dataclass
class ReferenceSample:
    """An authenticated GET /api/v1/auth/me: the HTTP and auth share of a kill request."""

    round_trip_ns: int


@dataclass
class FleetRound:
    agents: int
    to_first_daemon_ms: float
    to_median_daemon_ms: float
    to_last_daemon_ms: float
    to_last_send_ms: float
    to_response_ms: float
    tasks_requeued: int
    server_stages_ms: dict[str, float]
    exit_codes: dict[str, int]  # of the killed sandboxes: 3 obeyed, -9 destroyed by the runner


@dataclass
class Report:
    command: str
    started_at: str
    machine: dict[str, Any]
    settings: dict[str, Any]
    agent_kills: dict[str, dict[str, float]] = field(default_factory=dict)
    floor: dict[str, dict[str, float]] = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)
    agent_server_stages_mean_ms: dict[str, float] = field(default_factory=dict)
    agent_exit_codes: dict[str, int] = field(default_factory=dict)
    fleet: list[FleetRound] = field(default_factory=list)
    raw: dict[str, list[float]] = field(default_factory=dict)


# ---------------------------------------------------------------- waiting


# ---------------------------------------------------------------- the stack


@contextlib.asynccontextmanager
async def echo_server() -> AsyncIterator[str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.ws_echo",
        stdout=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().split()
        if line[:1] != ["ready"]:
            raise BenchmarkError(f"echo server did not start: {line!r}")
        yield f"ws://127.0.0.1:{line[1]}"
    finally:
        if proc.returncode is None:
            proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)


class Floor:
    """One UPDATE … RETURNING commit on the same Postgres plus one WebSocket round trip."""

    def __init__(self, conn: asyncpg.Connection, ws: websockets.ClientConnection) -> None:
        self.conn = conn
        self.ws = ws

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, database_url: str, echo_url: str) -> AsyncIterator[Floor]:
        conn = await asyncpg.connect(database_url)
        try:
            await conn.execute("CREATE TABLE bench_floor (id int PRIMARY KEY, n bigint NOT NULL)")
            await conn.execute("INSERT INTO bench_floor VALUES (1, 0)")
            async with websockets.connect(echo_url) as ws:
                yield cls(conn, ws)
        finally:
            await conn.close()

    async def sample(self) -> FloorSample:
        started = time.perf_counter_ns()
        await self.conn.fetchval("UPDATE bench_floor SET n=n+1 WHERE id=1 RETURNING n")
        committed = time.perf_counter_ns()
        await self.ws.send(FLOOR_MESSAGE)
        if await self.ws.recv() != FLOOR_MESSAGE:
            raise BenchmarkError("the echo server answered something else")
        echoed = time.perf_counter_ns()
        return FloorSample(committed - started, echoed - committed)


# ---------------------------------------------------------------- the fleet's agents


@dataclass(frozen=True)
class Holding:
    """An agent whose running session holds a "hold" task until it is killed."""

    agent_id: str
    task_id: str


async def start_holding(world: World, org: Org, count: int, batch: int, timeout: float
                        ) -> list[Holding]:
    """Create `count` agents with a hold task each, `batch` at a time; each batch is working
    (task in_progress) before the next is created."""
    client = org.clients["org_admin"]
    held: list[Holding] = []

    async def one() -> Holding:
        r = await client.post("/api/v1/agents", json={
            "slug": f"bench-{uuid.uuid4().hex[:10]}", "display_name": "Benchmark agent"})
        if r.status_code != 201:
            raise BenchmarkError(f"agent not created: {r.status_code} {r.text}")
        agent_id = r.json()["id"]
        r = await client.post(f"/api/v1/agents/{agent_id}/tasks",
                              json={"title": "hold", "body": "hold"})
        if r.status_code != 201:
            raise BenchmarkError(f"task not created: {r.status_code} {r.text}")
        return Holding(agent_id, r.json()["id"])

    while len(held) < count:
        size = min(batch, count - len(held))
        new = list(await asyncio.gather(*(one() for _ in range(size))))
        await wait_in_progress(world, new, timeout)
        held += new
    return held


async def wait_in_progress(world: World, held: list[Holding], timeout: float) -> None:
    ids = [uuid.UUID(h.task_id) for h in held]

    async def all_working() -> bool:
        row = await world.db.fetchrow(
            "SELECT count(*) FILTER (WHERE state='in_progress') AS working,"
            " count(*) FILTER (WHERE state IN ('failed','done','blocked')) AS finished"
            " FROM backlog_tasks WHERE id = ANY($1::uuid[])", ids)
        assert row is not None
        if row["finished"]:
            raise BenchmarkError(f"{row['finished']} hold task(s) ended before the kill")
        return bool(row["working"] == len(ids))

    await until(all_working, timeout, f"{len(ids)} hold tasks were not all in_progress",
                interval=0.05)


def kill_heard(plane: Plane, agent_id: str, after_ns: int, kind: str = "kill"
               ) -> dict[str, Any] | None:
    """The daemon's transcript line for the first `kill` (or `kind`) it read at or after
    `after_ns`."""
    for line in plane.transcript(agent_id):
        if line["dir"] == "in" and line["type"] == kind and line["at_ns"] >= after_ns:
            return line
    return None


async def sandboxes_gone(world: World, agent_ids: list[str]) -> bool:
    left = await world.db.fetchval(
        "SELECT count(*) FROM sandboxes WHERE agent_id = ANY($1::uuid[]) AND state <> 'gone'",
        [uuid.UUID(a) for a in agent_ids])
    return bool(left == 0)


async def exit_codes(world: World, sandbox_ids: list[uuid.UUID]) -> dict[str, int]:
    rows = await world.db.fetch(
        "SELECT exit_code, count(*) AS n FROM sandboxes WHERE id = ANY($1::uuid[])"
        " GROUP BY 1 ORDER BY 1", sandbox_ids)
    return {str(r["exit_code"]): r["n"] for r in rows}


async def notify_wakes(client: httpx.AsyncClient) -> float:
    """Wakes run from covey_wake NOTIFYs so far (every requeued task sends one)."""
    text = (await client.get("/metrics")).text
    return sum(s.value for family in text_string_to_metric_families(text)
               if family.name == "covey_wakes" for s in family.samples
               if s.name == "covey_wakes_total" and s.labels.get("path") == "notify")


async def wait_wakes(client: httpx.AsyncClient, at_least: float, timeout: float) -> None:
    """Wait until the requeue's wakes have run (and been refused): a wake still running when
    the next step begins would be part of that step's figures, or worse (see BENCHMARKS.md:
    a wake beside a fleet resume can deadlock with it)."""
    async def done() -> bool:
        return await notify_wakes(client) >= at_least
    await until(done, timeout, "the wakes sent by the requeue did not all run", interval=0.02)


# ---------------------------------------------------------------- the measurements


async def reference_sample(client: RawHttp) -> ReferenceSample:
    started = time.perf_counter_ns()
    status, _ = await client.request("GET", "/api/v1/auth/me")
    done = time.perf_counter_ns()
    if status != 200:
        raise BenchmarkError(f"GET /api/v1/auth/me answered {status}")
    return ReferenceSample(done - started)


@dataclass
class AgentKillRun:
    kills: list[KillSample] = field(default_factory=list)
    floors: list[FloorSample] = field(default_factory=list)
    references: list[ReferenceSample] = field(default_factory=list)
    stage_means_ms: dict[str, float] = field(default_factory=dict)
    exit_codes: dict[str, int] = field(default_factory=dict)


async def agent_kills(world: World, floor: Floor, kills: int, warmup: int, batch: int,
                      timeout: float) -> AgentKillRun:
    """Kill `warmup + kills` agents one at a time, `batch` live at once, with one floor sample
    and one reference request before each kill; the first `warmup` of each are dropped, from
    the server's stage histograms too."""
    security = world.org.clients["security"]
    async with RawHttp.open(world.plane.url, security.headers["authorization"]) as killer:
        return await _agent_kills(world, floor, killer, kills, warmup, batch, timeout)


async def _agent_kills(world: World, floor: Floor, killer: RawHttp, kills: int, warmup: int,
                       batch: int, timeout: float) -> AgentKillRun:
    kills_done: list[KillSample] = []
    floors: list[FloorSample] = []
    references: list[ReferenceSample] = []
    stages_before = await kill_stage_totals(world.anonymous)
    total = warmup + kills
    while len(kills_done) < total:
        held = await start_holding(world, world.org, min(batch, total - len(kills_done)),
                                   batch, timeout)
        for h in held:
            if len(kills_done) == warmup:
                stages_before = await kill_stage_totals(world.anonymous)
            wakes = await notify_wakes(world.anonymous)
            floors.append(await floor.sample())
            references.append(await reference_sample(killer))
            await killer.ready()
            requested = time.time_ns()
            status, report = await killer.request("POST", f"/api/v1/agents/{h.agent_id}/kill")
            responded = time.time_ns()
            if status != 200:
                raise BenchmarkError(f"kill answered {status}: {report}")
            if report["tasks_requeued"] != [h.task_id] or len(report["sessions_cancelled"]) != 1:
                raise BenchmarkError(f"the kill of {h.agent_id} did not stop its work: {report}")
            # Not timed: the daemon heard the kill and exited, the task is open. Only then
            # the next sample, so every kill starts from a quiet plane.
            heard = await settle_kill(world, h.agent_id, requested, timeout)
            await wait_wakes(world.anonymous, wakes + 1, timeout)
            if await world.task_state(h.task_id) != "open":
                raise BenchmarkError(f"task {h.task_id} is not open after the kill")
            hold = kill_heard(world.plane, h.agent_id, requested, "hold")
            kills_done.append(KillSample(requested, responded,
                                         int(heard["payload"]["sent_at_ns"]),
                                         int(heard["at_ns"]), str(heard["sandbox"]),
                                         None if hold is None else int(hold["at_ns"])))
    stages = stage_means_ms(stages_before, await kill_stage_totals(world.anonymous), "agent")
    killed = [uuid.UUID(str(k.sandbox_id)) for k in kills_done[warmup:]]
    return AgentKillRun(kills_done[warmup:], floors[warmup:], references[warmup:], stages,
                        await exit_codes(world, killed))


async def settle_kill(world: World, agent_id: str, after_ns: int, timeout: float
                      ) -> dict[str, Any]:
    """Wait until the agent's daemon has read its kill and exited; return the kill's line."""
    heard: dict[str, Any] = {}

    async def settled() -> bool:
        line = kill_heard(world.plane, agent_id, after_ns)
        if line is None:
            return False
        heard.update(line)
        return await sandboxes_gone(world, [agent_id])

    await until(settled, timeout, f"the daemon of {agent_id} did not obey its kill")
    return heard


async def settle_fleet(world: World, agent_ids: list[str], after_ns: int, timeout: float
                       ) -> dict[str, dict[str, Any]]:
    """Wait until every daemon has read its kill and exited; return each one's kill line."""
    heard: dict[str, dict[str, Any]] = {}

    async def settled() -> bool:
        for agent_id in agent_ids:
            if agent_id not in heard:
                line = kill_heard(world.plane, agent_id, after_ns)
                if line is not None:
                    heard[agent_id] = line
        return len(heard) == len(agent_ids) and await sandboxes_gone(world, agent_ids)

    try:
        await until(settled, timeout, "not every daemon obeyed the fleet kill", interval=0.1)
    except BenchmarkError as exc:
        raise BenchmarkError(f"{exc}: {len(heard)} of {len(agent_ids)} heard it") from None
    return heard


async def fleet_kills(world: World, agents: int, rounds: int, batch: int, timeout: float
                      ) -> list[FleetRound]:
    org = world.other
    async with RawHttp.open(world.plane.url,
                            org.clients["security"].headers["authorization"]) as security:
        held = await start_holding(world, org, agents, batch, timeout)
        return await _fleet_kills(world, security, held, rounds, timeout)


async def _fleet_kills(world: World, security: RawHttp, held: list[Holding], rounds: int,
                       timeout: float) -> list[FleetRound]:
    agents = len(held)
    ids = [h.agent_id for h in held]
    results: list[FleetRound] = []
    for number in range(rounds):
        if number:
            status, resumed = await security.request("POST", "/api/v1/fleet/resume")
            if status != 200 or len(resumed["agents_woken"]) != agents:
                raise BenchmarkError(
                    f"fleet resume did not wake every agent: {status}, woke"
                    f" {len(resumed['agents_woken'])}, released {len(resumed['agents_released'])}")
            await wait_in_progress(world, held, timeout)
        live = [r["id"] for r in await world.db.fetch(
            "SELECT id FROM sandboxes WHERE agent_id = ANY($1::uuid[]) AND state='running'",
            [uuid.UUID(a) for a in ids])]
        before = await kill_stage_totals(world.anonymous)
        wakes = await notify_wakes(world.anonymous)
        await security.ready()  # the set-up outlasted its keep-alive on a loaded host
        requested = time.time_ns()
        status, report = await security.request("POST", "/api/v1/fleet/kill")
        responded = time.time_ns()
        if status != 200:
            raise BenchmarkError(f"fleet kill answered {status}: {report}")
        if len(report["sessions_cancelled"]) != agents or len(report["tasks_requeued"]) != agents:
            raise BenchmarkError(
                f"fleet kill stopped {len(report['sessions_cancelled'])} sessions and requeued"
                f" {len(report['tasks_requeued'])} tasks of {agents}")
        heard = await settle_fleet(world, ids, requested, timeout)
        await wait_wakes(world.anonymous, wakes + agents, timeout)
        after = await kill_stage_totals(world.anonymous)
        received = sorted(ms(int(h["at_ns"]) - requested) for h in heard.values())
        sent = [ms(int(h["payload"]["sent_at_ns"]) - requested) for h in heard.values()]
        results.append(FleetRound(
            agents=agents,
            to_first_daemon_ms=received[0],
            to_median_daemon_ms=percentile(received, 50),
            to_last_daemon_ms=received[-1],
            to_last_send_ms=max(sent),
            to_response_ms=ms(responded - requested),
            tasks_requeued=len(report["tasks_requeued"]),
            server_stages_ms=stage_means_ms(before, after, "fleet"),
            exit_codes=await exit_codes(world, live),
        ))
    return results


# ---------------------------------------------------------------- the run


async def run(options: argparse.Namespace, command: str) -> Report:
    report = Report(command=command, started_at=datetime.now(UTC).isoformat(timespec="seconds"),
                    machine=machine(), settings={
                        "kills": options.kills, "warmup": options.warmup,
                        "batch": options.batch, "fleet_agents": options.fleet_agents,
                        "fleet_rounds": options.fleet_rounds, "tick_ms": options.tick_ms,
                        "lease_ms": options.lease_ms, "loop": options.loop,
                        "daemon_late_result": options.late_result})
    if not options.late_result:
        # Read by the scripted daemons, to which the control plane passes it by name.
        os.environ["SCRIPTED_DAEMON_PLAIN_KILL"] = "1"
    with tempfile.TemporaryDirectory(prefix="covey-bench-") as data_dir:
        async with (
            postgres_server(options.database_url) as server_url,
            bench_database(server_url) as database_url,
            start_plane(database_url, Path(data_dir), SCRIPTED_DAEMON, tick_ms=options.tick_ms,
                        lease_ms=options.lease_ms,
                        sandbox_pass_env=(*Settings.sandbox_pass_env,
                                          "SCRIPTED_DAEMON_PLAIN_KILL")) as plane,
            make_world(plane) as world,
            echo_server() as echo_url,
            Floor.open(database_url, echo_url) as floor,
        ):
            report.machine["postgres"] = await floor.conn.fetchval("SHOW server_version")
            for _ in range(options.warmup):
                await floor.sample()
            if options.kills:
                _agent_figures(report, await agent_kills(
                    world, floor, options.kills, options.warmup, options.batch, options.timeout))
            if options.fleet_agents and options.fleet_rounds:
                report.fleet = await fleet_kills(world, options.fleet_agents,
                                                 options.fleet_rounds, options.batch,
                                                 options.fleet_timeout)
    report.machine["loadavg_at_end"] = load_average()
    return report


def _agent_figures(report: Report, run: AgentKillRun) -> None:
    samples, floors, references = run.kills, run.floors, run.references
    report.agent_server_stages_mean_ms = run.stage_means_ms
    report.agent_exit_codes = run.exit_codes
    raw = {
        "kill_to_daemon_ms": [s.to_daemon_ms for s in samples],
        "kill_to_held_ms": [s.to_held_ms for s in samples if s.to_held_ms is not None],
        "kill_to_open_ms": [s.to_open_ms for s in samples],
        "kill_to_server_send_ms": [s.to_send_ms for s in samples],
        "server_send_to_daemon_ms": [s.delivery_ms for s in samples],
        "floor_ms": [f.total_ms for f in floors],
        "floor_commit_ms": [ms(f.commit_ns) for f in floors],
        "floor_ws_round_trip_ms": [ms(f.round_trip_ns) for f in floors],
        "reference_auth_get_ms": [ms(r.round_trip_ns) for r in references],
    }
    report.raw = raw
    report.agent_kills = {k: summary(v) for k, v in raw.items() if v and (
        k.startswith("kill") or k.startswith("server"))}
    report.floor = {k: summary(v) for k, v in raw.items() if k.startswith(("floor", "ref"))}
    floor_p50 = report.floor["floor_ms"]["p50"]
    report.ratios = {
        "kill_to_daemon_p50_over_floor_p50":
            report.agent_kills["kill_to_daemon_ms"]["p50"] / floor_p50,
        "kill_to_open_p50_over_floor_p50":
            report.agent_kills["kill_to_open_ms"]["p50"] / floor_p50,
        "kill_to_daemon_p99_over_floor_p99":
            report.agent_kills["kill_to_daemon_ms"]["p99"] / report.floor["floor_ms"]["p99"],
    }


def render(report: Report) -> str:
    lines = [f"kill latency, {report.started_at}, {report.machine}", ""]
    if report.agent_kills:
        n = report.agent_kills["kill_to_daemon_ms"]["n"]
        lines.append(f"agent kills, n={n} (one at a time)      n     min     p50     p99     max"
                     "   (ms)")
        rows = [("kill -> daemon holds `kill`", report.agent_kills["kill_to_daemon_ms"]),
                *([("kill -> daemon held (`hold`)", report.agent_kills["kill_to_held_ms"])]
                  if "kill_to_held_ms" in report.agent_kills else []),
                ("kill -> task open (response)", report.agent_kills["kill_to_open_ms"]),
                ("  kill -> server sent `kill`", report.agent_kills["kill_to_server_send_ms"]),
                ("  server sent -> daemon read", report.agent_kills["server_send_to_daemon_ms"]),
                ("floor: commit + WS round trip", report.floor["floor_ms"]),
                ("  floor: UPDATE..RETURNING", report.floor["floor_commit_ms"]),
                ("  floor: WS round trip", report.floor["floor_ws_round_trip_ms"]),
                ("ref: GET /api/v1/auth/me", report.floor["reference_auth_get_ms"])]
        for name, s in rows:
            lines.append(f"{name:<38}{s['n']:>4}{s['min']:>8.2f}{s['p50']:>8.2f}"
                         f"{s['p99']:>8.2f}{s['max']:>8.2f}")
        lines.append("")
        for name, value in report.ratios.items():
            lines.append(f"{name:<38}{value:>8.2f}x")
        stages = ", ".join(f"{k} {v:.2f}" for k, v in report.agent_server_stages_mean_ms.items())
        lines.append(f"server stages, mean ms since kill_agent() began: {stages}")
        lines.append(f"exit codes of the killed sandboxes: {report.agent_exit_codes}")
        lines.append("")
    if report.fleet:
        lines.append("fleet kills   agents  first  median   last  last-send  response"
                     "  (ms; server stages ms)")
        for i, r in enumerate(report.fleet, 1):
            stages = ", ".join(f"{k} {v:.1f}" for k, v in r.server_stages_ms.items())
            lines.append(f"round {i:<8}{r.agents:>6}{r.to_first_daemon_ms:>7.1f}"
                         f"{r.to_median_daemon_ms:>8.1f}{r.to_last_daemon_ms:>7.1f}"
                         f"{r.to_last_send_ms:>11.1f}{r.to_response_ms:>10.1f}  ({stages};"
                         f" exit codes {r.exit_codes})")
    return "\n".join(lines)


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kill_latency",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--kills", type=int, default=200, help="agent kills measured (200)")
    p.add_argument("--warmup", type=int, default=10,
                   help="kills and floor samples taken first and dropped (10)")
    p.add_argument("--batch", type=int, default=20,
                   help="agents started at once, and live at once for the agent kills (20)")
    p.add_argument("--fleet-agents", type=int, default=200,
                   help="connected sandboxes in the fleet kill (200; 0 skips it)")
    p.add_argument("--fleet-rounds", type=int, default=3, help="fleet kills (3)")
    p.add_argument("--tick-ms", type=int, default=60_000,
                   help="scheduler tick; large so that it stays out of the figures (60000)")
    p.add_argument("--lease-ms", type=int, default=2000, help="daemon lease (2000, the default)")
    p.add_argument("--late-result", action="store_true",
                   help="daemons send a late result on kill, as in the tests")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                   help="event loop; `covey serve` runs on uvloop (uvloop)")
    p.add_argument("--database-url", default=os.environ.get("TEST_DATABASE_URL"),
                   help="a Postgres server allowing CREATE DATABASE (default: embedded)")
    p.add_argument("--timeout", type=float, default=60, help="bound of each wait, s (60)")
    p.add_argument("--fleet-timeout", type=float, default=300,
                   help="bound of each wait for the whole fleet, s (300)")
    p.add_argument("--max-seconds", type=float, default=3000, help="bound of the run, s (3000)")
    p.add_argument("--log-level", default="WARNING", help="control plane log level (WARNING)")
    p.add_argument("--json", type=Path, help="write every figure and raw sample here")
    options = p.parse_args(argv)
    if options.kills < 0 or options.warmup < 0 or options.batch < 1:
        p.error("--kills and --warmup must be >= 0, --batch >= 1")
    return options


def main(argv: list[str] | None = None) -> int:
    options = parse_options(argv)
    configure_logs(options.log_level)
    command = "python -m benchmarks.kill_latency " + " ".join(sys.argv[1:] if argv is None
                                                               else argv)

    async def bounded() -> Report:
        async with asyncio.timeout(options.max_seconds):
            return await run(options, command.strip())

    if options.loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            report = runner.run(bounded())
    else:
        report = asyncio.run(bounded())
    print(render(report))
    if options.json:
        options.json.parent.mkdir(parents=True, exist_ok=True)
        options.json.write_text(json.dumps(asdict(report), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
