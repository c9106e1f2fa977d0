"""Fleet kill at scale: 100, 300 and 1,000 connected sandboxes side by side in one run.

    bash scripts/setup && .venv/bin/python -m benchmarks.fleet_scale [--sizes 100,300,1000] \
        [--rounds 1] [--json PATH]

One real control plane (`covey serve`, a process of its own, so that its memory and CPU are
its own) on an embedded Postgres, with the real `process` sandbox backend starting one
benchmarks/holding_daemon.py per session. For each size, an organisation of that many
agents, each with a running session holding a "hold" task; then security's
`POST /api/v1/fleet/kill`, timed from time.time_ns() just before its bytes go out to

* the first, median and last daemon reading its `kill` (each daemon's own stamp, same clock),
* the answer, which the control plane sends only when every task is requeued and every
  daemon has confirmed its kill or hung up: the benchmark checks that the answer lists every
  session confirmed and every task requeued, else the run fails.

Beside the times: the control plane's RSS idle, with the fleet connected and at its peak
during the kill (sampled every 20 ms); its CPU time during the kill; the load average. Sizes
run one after another, smallest first, each fleet stopped and gone before the next starts;
`--rounds` kills each fleet again after a fleet resume has woken it. The growth ratio is
the answer's median at the largest size over that at the smallest.
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
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from benchmarks.stack import (
    REPO,
    BenchmarkError,
    RawHttp,
    ServedPlane,
    bench_database,
    host_cpu_busy_s,
    kill_stage_totals,
    load_average,
    machine,
    memory_available_mib,
    ms,
    percentile,
    postgres_server,
    served_plane,
    stage_means_ms,
    until,
)
from covey.logs import configure as configure_logs
from covey.testing.plane import OrgTokens, create_org

DAEMON = [sys.executable, str(Path(__file__).with_name("holding_daemon.py"))]
# Private memory of one daemon on this machine (an interpreter with websockets): about 13 MiB.
DAEMON_MIB = 15
BEFORE_S = 1.0  # the window before each kill in which the plane's and the host's CPU is read


@dataclass
class FleetKill:
    code: str  # "after" (this checkout) or "before" (--baseline)
    sandboxes: int
    round: int
    loadavg: str
    to_first_daemon_ms: float
    to_median_daemon_ms: float
    to_last_daemon_ms: float
    to_answer_ms: float
    to_all_exited_ms: float
    sessions_cancelled: int
    sessions_confirmed: int  # below sessions_cancelled: the answer came without them all
    sessions_acknowledged: int  # by the daemon's kill_ack (the rest: by its hang-up)
    tasks_requeued: int
    plane_cpu_during_answer_ms: float
    host_cpu_during_answer_ms: float  # every process on the host, the daemons' exits included
    plane_rss_idle_mib: float
    plane_rss_connected_mib: float
    plane_rss_peak_mib: float
    # The second before the request, the fleet connected and holding its tasks: the plane's
    # CPU (its lease renewals to every daemon) and the whole host's busy cores (out of all).
    plane_cpu_before_ms_per_s: float
    host_busy_before_cores: float
    server_stages_ms: dict[str, float]
    exit_codes: dict[str, int]


@dataclass
class Report:
    command: str
    started_at: str
    machine: dict[str, Any]
    settings: dict[str, Any]
    kills: list[FleetKill] = field(default_factory=list)
    answer_median_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # code, size
    growth: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------- the fleet


@dataclass(frozen=True)
class Fleet:
    org: OrgTokens
    agent_ids: list[uuid.UUID]
    task_ids: list[uuid.UUID]


async def start_fleet(plane: ServedPlane, db: asyncpg.Pool, org: OrgTokens, size: int,
                      batch: int, timeout: float) -> Fleet:
    """`size` agents with a hold task each, created through the API `batch` at a time; each
    batch is working before the next one starts (a thousand interpreters starting at once
    would outlast their daemon tokens on two cores)."""
    agents: list[uuid.UUID] = []
    tasks: list[uuid.UUID] = []
    headers = {"Authorization": f"Bearer {org.tokens['org_admin']}"}
    async with httpx.AsyncClient(base_url=plane.url, headers=headers, timeout=timeout) as admin:

        async def one() -> tuple[uuid.UUID, uuid.UUID]:
            r = await admin.post("/api/v1/agents", json={
                "slug": f"bench-{uuid.uuid4().hex[:10]}", "display_name": "Benchmark agent"})
            if r.status_code != 201:
                raise BenchmarkError(f"agent not created: {r.status_code} {r.text}")
            agent_id = uuid.UUID(r.json()["id"])
            r = await admin.post(f"/api/v1/agents/{agent_id}/tasks",
                                 json={"title": "hold", "body": "hold"})
            if r.status_code != 201:
                raise BenchmarkError(f"task not created: {r.status_code} {r.text}")
            return agent_id, uuid.UUID(r.json()["id"])

        while len(agents) < size:
            made = await asyncio.gather(*(one() for _ in range(min(batch, size - len(agents)))))
            agents += [a for a, _ in made]
            tasks += [t for _, t in made]
            await wait_in_progress(db, tasks, timeout)
    return Fleet(org, agents, tasks)


async def wait_in_progress(db: asyncpg.Pool, tasks: list[uuid.UUID], timeout: float) -> None:
    async def all_working() -> bool:
        row = await db.fetchrow(
            "SELECT count(*) FILTER (WHERE state='in_progress') AS working,"
            " count(*) FILTER (WHERE state IN ('failed','done','blocked')) AS finished"
            " FROM backlog_tasks WHERE id = ANY($1::uuid[])", tasks)
        assert row is not None
        if row["finished"]:
            raise BenchmarkError(f"{row['finished']} hold task(s) ended before the kill")
        return bool(row["working"] == len(tasks))

    await until(all_working, timeout, f"{len(tasks)} hold tasks were not all in_progress",
                interval=0.2)


async def all_gone(db: asyncpg.Pool, sandbox_ids: list[uuid.UUID]) -> bool:
    left = await db.fetchval(
        "SELECT count(*) FROM sandboxes WHERE id = ANY($1::uuid[]) AND state <> 'gone'",
        sandbox_ids)
    return bool(left == 0)


def kill_stamps(plane: ServedPlane, fleet: Fleet, sandboxes: dict[uuid.UUID, uuid.UUID]
                ) -> list[int]:
    """Each daemon's own stamp of reading its kill (wall-clock ns)."""
    stamps = []
    for sandbox_id, agent_id in sandboxes.items():
        path = plane.data_dir / "sandboxes" / str(agent_id) / str(sandbox_id) / "kill_received"
        if not path.exists():
            raise BenchmarkError(f"the daemon of sandbox {sandbox_id} never read a kill")
        stamps.append(int(path.read_text()))
    return stamps


async def exit_codes(db: asyncpg.Pool, sandbox_ids: list[uuid.UUID]) -> dict[str, int]:
    rows = await db.fetch(
        "SELECT exit_code, count(*) AS n FROM sandboxes WHERE id = ANY($1::uuid[])"
        " GROUP BY 1 ORDER BY 1", sandbox_ids)
    return {str(r["exit_code"]): r["n"] for r in rows}


@contextlib.asynccontextmanager
async def rss_peak(plane: ServedPlane) -> Any:
    """Sample the control plane's RSS every 20 ms while the block runs; yields a list whose
    only element is the peak so far (KiB)."""
    peak = [plane.rss_kib()]

    async def sample() -> None:
        while True:
            peak[0] = max(peak[0], plane.rss_kib())
            await asyncio.sleep(0.02)

    sampler = asyncio.create_task(sample())
    try:
        yield peak
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        peak[0] = max(peak[0], plane.rss_kib())


async def kill_fleet(plane: ServedPlane, db: asyncpg.Pool, fleet: Fleet, number: int,
                     rss_idle_kib: int, timeout: float, code: str = "after") -> FleetKill:
    size = len(fleet.agent_ids)
    sandboxes = {r["id"]: r["agent_id"] for r in await db.fetch(
        "SELECT id, agent_id FROM sandboxes WHERE agent_id = ANY($1::uuid[])"
        " AND state='running'", fleet.agent_ids)}
    if len(sandboxes) != size:
        raise BenchmarkError(f"{len(sandboxes)} of {size} sandboxes running before the kill")
    async with httpx.AsyncClient(base_url=plane.url, timeout=30) as anonymous:
        before = await kill_stage_totals(anonymous)
        rss_connected = plane.rss_kib()
        loadavg = load_average()
        quiet_from, host_from, window_from = plane.cpu_s(), host_cpu_busy_s(), time.monotonic()
        await asyncio.sleep(BEFORE_S)  # a window measured, not a wait for anything
        window_s = time.monotonic() - window_from
        plane_before = (plane.cpu_s() - quiet_from) / window_s
        host_busy_before = (host_cpu_busy_s() - host_from) / window_s
        async with RawHttp.open(plane.url, f"Bearer {fleet.org.tokens['security']}") as security:
            async with rss_peak(plane) as peak:
                await security.ready()
                cpu_before, host_before = plane.cpu_s(), host_cpu_busy_s()
                requested = time.time_ns()
                status, answer = await security.request("POST", "/api/v1/fleet/kill", timeout)
                answered = time.time_ns()
                cpu_after, host_after = plane.cpu_s(), host_cpu_busy_s()
        if status != 200:
            raise BenchmarkError(f"fleet kill answered {status}: {answer}")
        listed = {k: len(answer[k]) for k in
                  ("sessions_cancelled", "sessions_confirmed", "tasks_requeued")}
        if listed["sessions_cancelled"] != size or \
                {uuid.UUID(t) for t in answer["tasks_requeued"]} != set(fleet.task_ids):
            raise BenchmarkError(f"the answer of the fleet kill of {size} lists {listed}")
        # Fewer confirmed than cancelled: the plane's wait for its daemons (bounded by the
        # lease, at most 2 s) ran out first. That is a figure of this size, not a broken
        # kill (the lease stops the rest): kept, shown, and the run exits non-zero.
        sandbox_ids = list(sandboxes)
        await until(lambda: all_gone(db, sandbox_ids), timeout,
                    f"not every one of {size} sandboxes was gone after the kill", interval=0.05)
        exited = time.time_ns()
        after = await kill_stage_totals(anonymous)
    received = sorted(ms(t - requested) for t in kill_stamps(plane, fleet, sandboxes))
    return FleetKill(
        code=code, sandboxes=size, round=number, loadavg=loadavg,
        to_first_daemon_ms=received[0], to_median_daemon_ms=percentile(received, 50),
        to_last_daemon_ms=received[-1], to_answer_ms=ms(answered - requested),
        to_all_exited_ms=ms(exited - requested),
        sessions_cancelled=listed["sessions_cancelled"],
        sessions_confirmed=listed["sessions_confirmed"],
        sessions_acknowledged=len(answer.get("sessions_acknowledged", [])),
        tasks_requeued=listed["tasks_requeued"],
        plane_cpu_during_answer_ms=(cpu_after - cpu_before) * 1000,
        host_cpu_during_answer_ms=(host_after - host_before) * 1000,
        plane_rss_idle_mib=rss_idle_kib / 1024, plane_rss_connected_mib=rss_connected / 1024,
        plane_rss_peak_mib=peak[0] / 1024,
        plane_cpu_before_ms_per_s=plane_before * 1000,
        host_busy_before_cores=host_busy_before,
        server_stages_ms=stage_means_ms(before, after, "fleet"),
        exit_codes=await exit_codes(db, sandbox_ids))


async def resume_fleet(plane: ServedPlane, db: asyncpg.Pool, fleet: Fleet, timeout: float
                       ) -> None:
    headers = {"Authorization": f"Bearer {fleet.org.tokens['security']}"}
    async with httpx.AsyncClient(base_url=plane.url, headers=headers, timeout=120) as security:
        r = await security.post("/api/v1/fleet/resume")
    # Not every agent need be in agents_woken: the requeue's own wakes (refused while the
    # stop stood) may still be queued, and one that runs after the resume starts the agent
    # first. Every task working again is what counts.
    if r.status_code != 200:
        raise BenchmarkError(f"fleet resume answered {r.status_code}: {r.text[:300]}")
    await wait_in_progress(db, fleet.task_ids, timeout)


# ---------------------------------------------------------------- the run


async def run(options: argparse.Namespace, command: str) -> Report:
    report = Report(command=command, started_at=datetime.now(UTC).isoformat(timespec="seconds"),
                    machine=machine(), settings={
                        "sizes": options.sizes, "rounds": options.rounds,
                        "batch": options.batch, "lease_ms": options.lease_ms,
                        "tick_ms": options.tick_ms,
                        "baseline": str(options.baseline) if options.baseline else None,
                        "baseline_env": options.baseline_env})
    env = {"COVEY_TICK_MS": str(options.tick_ms), "COVEY_LEASE_MS": str(options.lease_ms),
           "COVEY_LOG_LEVEL": options.log_level,
           # A thousand interpreters starting on two cores may take longer than a minute.
           "COVEY_DAEMON_TOKEN_TTL_S": "600"}
    codes: list[tuple[str, Path, dict[str, str]]] = [("after", REPO, {})]
    if options.baseline or options.baseline_env:
        codes.insert(0, ("before", options.baseline or REPO, options.baseline_env))
    async with contextlib.AsyncExitStack() as stack:
        server_url = await stack.enter_async_context(postgres_server(options.database_url))
        planes: dict[str, tuple[ServedPlane, asyncpg.Pool]] = {}
        for code, repo, extra in codes:  # both planes up for the whole run; one fleet at a time
            data_dir = stack.enter_context(
                tempfile.TemporaryDirectory(prefix=f"covey-bench-scale-{code}-"))
            database_url = await stack.enter_async_context(bench_database(server_url))
            plane = await stack.enter_async_context(
                served_plane(database_url, Path(data_dir), DAEMON, {**env, **extra}, repo=repo))
            db = await asyncpg.create_pool(database_url, min_size=1, max_size=4)
            assert db is not None
            stack.push_async_callback(db.close)
            planes[code] = (plane, db)
        report.machine["postgres"] = await planes["after"][1].fetchval("SHOW server_version")
        for i, size in enumerate(options.sizes):
            # Alternate which code goes first, so that a drift of the host's load does not
            # always favour the same one.
            for code, _, _ in (codes if i % 2 == 0 else codes[::-1]):
                plane, db = planes[code]
                need = size * DAEMON_MIB + 1024
                if memory_available_mib() < need:
                    raise BenchmarkError(f"{size} sandboxes need about {need} MiB; only "
                                         f"{memory_available_mib()} MiB available")
                org = await create_org(db, f"fleet{size}-{uuid.uuid4().hex[:6]}")
                rss_idle = plane.rss_kib()
                fleet = await start_fleet(plane, db, org, size, options.batch,
                                          options.timeout)
                for number in range(1, options.rounds + 1):
                    if number > 1:
                        await resume_fleet(plane, db, fleet, options.timeout)
                    kill = await kill_fleet(plane, db, fleet, number, rss_idle,
                                            options.timeout, code)
                    report.kills.append(kill)
                    print(render_kill(kill), flush=True)
    report.machine["loadavg_at_end"] = load_average()
    smallest, largest = str(min(options.sizes)), str(max(options.sizes))
    for code, _, _ in codes:
        medians = report.answer_median_ms[code] = {}
        for size in options.sizes:
            answers = [k.to_answer_ms for k in report.kills
                       if k.sandboxes == size and k.code == code]
            medians[str(size)] = percentile(answers, 50)
        report.growth[f"{code}: answer_{largest}_over_{smallest}"] = \
            medians[largest] / medians[smallest]
    return report


def render_kill(k: FleetKill) -> str:
    stages = ", ".join(f"{s} {v:.0f}" for s, v in k.server_stages_ms.items())
    return (f"{k.code:>6} {k.sandboxes:>6} {k.round:>3} {k.to_first_daemon_ms:>8.1f}"
            f"{k.to_median_daemon_ms:>9.1f}{k.to_last_daemon_ms:>9.1f}{k.to_answer_ms:>9.1f}"
            f"{k.to_all_exited_ms:>10.0f}{k.plane_cpu_during_answer_ms:>8.0f}"
            f"{k.host_cpu_during_answer_ms:>8.0f}"
            f"{k.plane_rss_idle_mib:>7.0f}{k.plane_rss_connected_mib:>7.0f}"
            f"{k.plane_rss_peak_mib:>7.0f}  acked {k.sessions_acknowledged};"
            f" before: plane {k.plane_cpu_before_ms_per_s:.0f} ms/s,"
            f" host {k.host_busy_before_cores:.2f} cores busy;"
            + (f" ANSWERED WITH {k.sessions_confirmed} OF {k.sessions_cancelled} CONFIRMED;"
               if k.sessions_confirmed < k.sessions_cancelled else "") +
            f" load {k.loadavg}; stages {stages};"
            f" exit codes {k.exit_codes}")


HEADER = ("  code   size rnd   first   median     last   answer  all-gone  cpu-ms    host   rss:"
          "  idle   conn   peak (ms, MiB)")


def render(report: Report) -> str:
    lines = [f"fleet kill at scale, {report.started_at}, {report.machine}", "", HEADER]
    lines += [render_kill(k) for k in report.kills]
    lines.append("")
    for code, medians in report.answer_median_ms.items():
        lines.append(f"{code}: answer, median ms: " + ", ".join(
            f"{size}: {v:.1f}" for size, v in medians.items()))
    lines += [f"{name}: {value:.2f}" for name, value in report.growth.items()]
    return "\n".join(lines)


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fleet_scale",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--sizes", default="100,300,1000",
                   type=lambda v: sorted({int(x) for x in v.split(",") if x}),
                   help="connected sandboxes per fleet kill (100,300,1000)")
    p.add_argument("--rounds", type=int, default=1, help="fleet kills per size (1)")
    p.add_argument("--batch", type=int, default=50, help="agents started at once (50)")
    p.add_argument("--tick-ms", type=int, default=60_000,
                   help="scheduler tick; large so that it stays out of the figures (60000)")
    p.add_argument("--lease-ms", type=int, default=2000, help="daemon lease (2000, the default)")
    p.add_argument("--database-url", default=os.environ.get("TEST_DATABASE_URL"),
                   help="a Postgres server allowing CREATE DATABASE (default: embedded)")
    p.add_argument("--timeout", type=float, default=600, help="bound of each wait, s (600)")
    p.add_argument("--max-seconds", type=float, default=5400, help="bound of the run, s (5400)")
    p.add_argument("--log-level", default="WARNING", help="control plane log level (WARNING)")
    p.add_argument("--baseline", type=Path,
                   help="a checkout of the code to compare with (e.g. `git archive main` "
                        "unpacked): its plane runs beside this one's, each size on both")
    p.add_argument("--baseline-env", action="append", default=[], metavar="NAME=VALUE",
                   help="run the baseline plane (this checkout unless --baseline) with this "
                        "setting too, e.g. COVEY_SANDBOX_CPU_GROUP=off; repeatable")
    p.add_argument("--json", type=Path, help="write every figure here")
    options = p.parse_args(argv)
    pairs = [item.partition("=") for item in options.baseline_env]
    if any(not name or not eq for name, eq, _ in pairs):
        p.error("--baseline-env takes NAME=VALUE")
    options.baseline_env = {name: value for name, _, value in pairs}
    if not options.sizes or min(options.sizes) < 1 or options.rounds < 1 or options.batch < 1:
        p.error("--sizes, --rounds and --batch must be positive")
    return options


def main(argv: list[str] | None = None) -> int:
    options = parse_options(argv)
    configure_logs(options.log_level)
    command = "python -m benchmarks.fleet_scale " + " ".join(sys.argv[1:] if argv is None
                                                              else argv)
    print(HEADER, flush=True)

    async def bounded() -> Report:
        async with asyncio.timeout(options.max_seconds):
            return await run(options, command.strip())

    report = asyncio.run(bounded())
    print(render(report))
    if options.json:
        options.json.parent.mkdir(parents=True, exist_ok=True)
        options.json.write_text(json.dumps(asdict(report), indent=2) + "\n")
    short = [k for k in report.kills if k.sessions_confirmed < k.sessions_cancelled]
    for k in short:
        print(f"the fleet kill of {k.sandboxes} ({k.code}, round {k.round}) answered with "
              f"{k.sessions_confirmed} of {k.sessions_cancelled} daemons confirmed",
              file=sys.stderr)
    return 1 if short else 0


if __name__ == "__main__":
    sys.exit(main())
