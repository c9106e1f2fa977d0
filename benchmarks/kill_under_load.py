"""Kill latency under load: the same fleet of working agents, the same killer, under no load
and under growing Locust load, in one run (DESIGN §4: only ratios within a run carry over).

    .venv/bin/python -m benchmarks.kill_under_load --json docs/kill_under_load.json

Each level is one `gameday load` run (harness/load/runner.py) on one processes stack brought
up once: the killer alone (the unloaded baseline), then 10, 50 and 100 operators, then 100
operators spread over two Locust worker processes. Reported per level: kill → daemon acked
(the daemon's own kill_ack), kill → daemon exited and kill → task open (p50/p99, HDR), the
requests per second the control plane sustained, the failures, each loaded p99 as a
multiple of the unloaded one, and where the machine's CPU went meanwhile (benchmarks/cpu_use.py:
the control plane, the daemons, Postgres, the puppet, Locust, this process, everybody else).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks import cpu_use
from benchmarks.kill_latency import load_average, machine
from harness.client import CoveyClient
from harness.load.runner import LoadPlan, LoadResult, all_working, prepare_fleet, run_load
from harness.stack import ProcessesStack

ACKED, EXITED, OPEN = "kill → daemon acked", "kill → daemon exited", "kill → task open"


@dataclass(frozen=True)
class Level:
    name: str
    users: int
    processes: int = 1


LEVELS = (Level("no load", 0), Level("10 users", 10), Level("50 users", 50),
          Level("100 users", 100), Level("100 users, 2 workers", 100, processes=2))


async def run(options: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.kill_under_load", *sys.argv[1:]]),
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(), "settings": {"agents": options.agents,
                                           "run_time": options.run_time,
                                           "spawn_rate": options.spawn_rate,
                                           "killer_pause_s": options.killer_pause},
        "levels": []}
    report_dir = Path(options.report_dir)
    async with ProcessesStack(report_dir).up() as endpoints:
        fleet = await prepare_fleet(endpoints, options.agents)
        admin = await CoveyClient.signed_in(endpoints.url, endpoints.admin_email,
                                            endpoints.admin_password)
        try:
            for level in LEVELS:
                # Every level starts from the same steady state: all agents at work.
                await all_working(admin, fleet.agent_ids, 120)
                plan = LoadPlan(users=level.users, spawn_rate=options.spawn_rate,
                                run_time=options.run_time, processes=level.processes,
                                killer_pause_s=options.killer_pause)
                postgres = None if endpoints.data_dir is None else endpoints.data_dir.parent
                before, started = cpu_use.reading(postgres), time.monotonic()
                result = await run_load(endpoints, fleet, plan, report_dir,
                                        name=f"bench-load-{level.users}-{level.processes}")
                cpu = cpu_use.between(before, cpu_use.reading(postgres),
                                      time.monotonic() - started)
                report["levels"].append({**figures(level, result), "cpu": cpu})
                print(row(report["levels"][-1], report["levels"][0]), flush=True)
        finally:
            await admin.aclose()
    report["loadavg_at_end"] = load_average()
    baseline = report["levels"][0]
    for level_figures in report["levels"]:
        level_figures["p99_ratio_to_unloaded"] = {
            part: round(level_figures[part]["p99_ms"] / baseline[part]["p99_ms"], 2)
            for part in (ACKED, EXITED, OPEN)
            if level_figures.get(part) and baseline.get(part)}
    return report


def figures(level: Level, result: LoadResult) -> dict[str, Any]:
    out: dict[str, Any] = {"level": level.name, "users": level.users,
                           "processes": level.processes, "kills": result.kills,
                           "failed_kills": len(result.failed_kills),
                           "failures": [k["failure"] for k in result.failed_kills],
                           "requests": result.requests,
                           "request_failures": result.request_failures,
                           "requests_per_s": result.requests_per_s,
                           "problems": result.problems, "loadavg": load_average()}
    for part in (ACKED, EXITED, OPEN):
        p = result.parts_us.get(part)
        if p:
            out[part] = {"count": p["count"], "p50_ms": p["p50_us"] / 1000,
                         "p99_ms": p["p99_us"] / 1000, "max_ms": p["max_us"] / 1000}
    return out


def row(level: dict[str, Any], baseline: dict[str, Any]) -> str:
    def part(name: str) -> str:
        p = level.get(name)
        if not p:
            return f"{name}: none"
        ratio = (f" ({p['p99_ms'] / baseline[name]['p99_ms']:.2f}x)" if baseline.get(name)
                 else "")
        return f"{name} p50 {p['p50_ms']:.1f} / p99 {p['p99_ms']:.1f} ms{ratio}"
    cores = ", ".join(f"{name} {use['cores']:.2f}"
                      + (f" (waiting {use['waiting']:.2f})" if "waiting" in use else "")
                      for name, use in level["cpu"].items())
    return (f"{level['level']:>22}: {level['kills']:3d} kills, {level['failed_kills']} failed, "
            f"{level['requests_per_s']:6.1f} req/s, {level['request_failures']} failed "
            f"requests · {part(ACKED)} · {part(EXITED)} · {part(OPEN)} · load "
            f"{level['loadavg']} · cores: {cores}")


def _pause(text: str) -> tuple[float, float]:
    low, _, high = text.partition(",")
    return float(low), float(high or low)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=20)
    parser.add_argument("--run-time", default="150s", help="per level (Locust's syntax)")
    parser.add_argument("--killer-pause", type=_pause, default=(0.2, 0.5),
                        help="the killer's pause between kills, MIN,MAX seconds")
    parser.add_argument("--spawn-rate", type=float, default=20)
    parser.add_argument("--report-dir", default="reports/bench-load")
    parser.add_argument("--json", help="write every figure here")
    options = parser.parse_args()
    report = asyncio.run(run(options))
    if options.json:
        Path(options.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
