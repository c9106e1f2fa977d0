"""Kill latency under load: the same fleet of working agents, the same killer, under no load
and under growing Locust load, in one run (DESIGN §4: only ratios within a run carry over).

    .venv/bin/python -m benchmarks.kill_under_load --json benchmarks/results/kill_under_load.json

Each level is a `gameday load` run (harness/load/runner.py) on one processes stack brought
up once: the killer alone (the unloaded baseline), then 10, 50 and 100 operators, then 100
operators spread over two Locust worker processes; and the five levels run `--rounds` times
over, each level's kills of every round pooled, so that a shared host's drifting load
weighs on every level alike. Reported per level: kill → daemon acked
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
from harness.act.client import CoveyClient
from harness.load.runner import (
    LoadPlan,
    LoadResult,
    all_working,
    judge,
    prepare_fleet,
    read_samples,
    run_load,
    run_stats,
)
from harness.stack.processes import ProcessesStack

ANSWERED = "kill → acknowledged"  # the switch's answer to the operator
ACKED, EXITED, OPEN = "kill → daemon acked", "kill → daemon exited", "kill → task open"


@dataclass(frozen=True)
class Level:
    name: str
    users: int
    processes: int = 1


LEVELS = (Level("no load", 0), Level("10 users", 10), Level("50 users", 50),
          Level("100 users", 100), Level("100 users, 2 workers", 100, processes=2))


def levels(text: str) -> tuple[Level, ...]:
    """`--levels`: operators per level, comma-separated, `N:W` for N over W Locust worker
    processes; the first is the unloaded baseline, 0 (issue 20's "200 reads in flight":
    `0,200`)."""
    chosen: list[Level] = []
    for item in text.split(","):
        users_text, _, workers_text = item.strip().partition(":")
        try:
            users, workers = int(users_text), int(workers_text or 1)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: operators as a number, or N:W for "
                                             "N over W worker processes") from None
        if users < 0 or workers < 1:
            raise argparse.ArgumentTypeError(f"{item!r}: no fewer than 0 operators, 1 worker")
        name = "no load" if users == 0 else f"{users} users" + (
            f", {workers} workers" if workers > 1 else "")
        chosen.append(Level(name, users, workers))
    if not chosen or chosen[0].users != 0:
        raise argparse.ArgumentTypeError("the first level is the unloaded baseline: 0")
    return tuple(chosen)


async def run(options: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.kill_under_load", *sys.argv[1:]]),
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(), "settings": {"agents": options.agents,
                                           "run_time": options.run_time,
                                           "rounds": options.rounds,
                                           "spawn_rate": options.spawn_rate,
                                           "levels": [lv.name for lv in options.levels],
                                           "killer_pause_s": options.killer_pause,
                                           "killer_with_operators":
                                               options.killer_with_operators},
        "levels": [], "rounds": []}
    report_dir = Path(options.report_dir)
    runs: dict[str, list[tuple[LoadResult, dict[str, dict[str, float]], float]]] = {
        level.name: [] for level in options.levels}
    async with ProcessesStack(report_dir).up() as endpoints:
        fleet = await prepare_fleet(endpoints, options.agents)
        admin = await CoveyClient.signed_in(endpoints.url, endpoints.admin_email,
                                            endpoints.admin_password)
        postgres = None if endpoints.data_dir is None else endpoints.data_dir.parent
        try:
            # Round after round of every level, so that a shared host's load, which drifts
            # over minutes, weighs on every level alike instead of on the last ones.
            for round_ in range(options.rounds):
                for level in options.levels:
                    # Every level starts from the same steady state: all agents at work.
                    await all_working(admin, fleet.agent_ids, 120)
                    plan = LoadPlan(users=level.users, spawn_rate=options.spawn_rate,
                                    run_time=options.run_time, processes=level.processes,
                                    killer_pause_s=options.killer_pause,
                                    killers_apart=not options.killer_with_operators)
                    before, started = cpu_use.reading(postgres), time.monotonic()
                    result = await run_load(endpoints, fleet, plan, report_dir,
                                            name=f"bench-load-{level.users}-{level.processes}")
                    wall_s = time.monotonic() - started
                    cpu = cpu_use.between(before, cpu_use.reading(postgres), wall_s)
                    runs[level.name].append((result, cpu, wall_s))
                    figures_ = {**figures(level, result, [result]), "round": round_ + 1,
                                "cpu": cpu}
                    report["rounds"].append(figures_)
                    print(f"round {round_ + 1} " + row(figures_, report["rounds"][0]),
                          flush=True)
        finally:
            await admin.aclose()
    report["loadavg_at_end"] = load_average()
    for level in options.levels:
        done = runs[level.name]
        samples = [s for r, _, _ in done for s in read_samples(Path(r.files["samples"]))]
        stats = [row_ for r, _, _ in done for row_ in run_stats(r.files)]
        pooled = judge(done[0][0].plan, samples, stats, 0)
        wall_s = sum(w for _, _, w in done)
        report["levels"].append({**figures(level, pooled, [r for r, _, _ in done]),
                                 "cpu": pool_cpu([(c, w) for _, c, w in done]),
                                 "wall_s": round(wall_s, 1)})
    baseline = report["levels"][0]
    for level_figures in report["levels"]:
        level_figures["p99_ratio_to_unloaded"] = {
            part: round(level_figures[part]["p99_ms"] / baseline[part]["p99_ms"], 2)
            for part in (ANSWERED, ACKED, EXITED, OPEN)
            if level_figures.get(part) and baseline.get(part)}
        print("all rounds " + row(level_figures, baseline), flush=True)
    return report


def pool_cpu(levels: list[tuple[dict[str, dict[str, float]], float]]
             ) -> dict[str, dict[str, float]]:
    """One level's CPU figures over all its rounds: seconds added up, rates over their wall
    time."""
    wall_s = sum(w for _, w in levels)
    pooled: dict[str, dict[str, float]] = {}
    for part in levels[0][0]:
        cpu_s = sum(c[part]["cpu_s"] for c, _ in levels)
        pooled[part] = {"cpu_s": round(cpu_s, 1), "cores": round(cpu_s / wall_s, 2)}
        if "waiting" in levels[0][0][part]:
            pooled[part]["waiting"] = round(
                sum(c[part]["waiting"] * w for c, w in levels) / wall_s, 2)
    return pooled


def figures(level: Level, result: LoadResult, rounds: list[LoadResult]) -> dict[str, Any]:
    """A level's figures from `result` (one run, or every round's samples judged together);
    requests per second as the mean of its rounds'."""
    out: dict[str, Any] = {"level": level.name, "users": level.users,
                           "processes": level.processes, "kills": result.kills,
                           "failed_kills": len(result.failed_kills),
                           "failures": [k["failure"] for k in result.failed_kills],
                           "requests": result.requests,
                           "request_failures": result.request_failures,
                           # reads answered 429 (covey.admission), apart from those served
                           "shed_requests": result.shed_requests,
                           "requests_per_s": round(sum(r.requests_per_s for r in rounds)
                                                   / len(rounds), 1),
                           "problems": result.problems, "loadavg": load_average()}
    for part in (ANSWERED, ACKED, EXITED, OPEN):
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
            f"requests, {level['shed_requests']} shed · {part(ACKED)} · {part(EXITED)} · "
            f"{part(OPEN)} · load "
            f"{level['loadavg']} · cores: {cores}")


def _pause(text: str) -> tuple[float, float]:
    low, _, high = text.partition(",")
    return float(low), float(high or low)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=20)
    parser.add_argument("--run-time", default="50s",
                        help="per level and round (Locust's syntax)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="times every level runs, one after the other")
    parser.add_argument("--killer-pause", type=_pause, default=(0.2, 0.5),
                        help="the killer's pause between kills, MIN,MAX seconds")
    parser.add_argument("--spawn-rate", type=float, default=20)
    parser.add_argument("--levels", type=levels, default=LEVELS,
                        help="operators per level, comma-separated, N:W over W Locust "
                             "workers; the first 0 (0,10,50,100,100:2)")
    parser.add_argument("--killer-with-operators", action="store_true",
                        help="the killer in the operators' Locust process, timing the "
                             "switch through their gevent loop (before 2026-12-07: the "
                             "default); otherwise a process of its own")
    parser.add_argument("--report-dir", default="reports/bench-load")
    parser.add_argument("--json", help="write every figure here")
    options = parser.parse_args()
    report = asyncio.run(run(options))
    if options.json:
        Path(options.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
