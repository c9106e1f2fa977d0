"""The soak of random game days (issue 8): many seeded schedules on one stack, and what they
found.

    bash scripts/setup && .venv/bin/python -m benchmarks.soak --schedules 50 --duration 15 \\
        [--seed 1000] [--agents 4] [--stack processes] [--report-dir reports/soak]

Runs `pytest scenarios/random_gameday.py --schedules N --duration D --reuse-stack` (one stack
for the whole soak, each schedule in an organisation of its own; no shrinking, which would
replay failing schedules instead of running new ones), then reads every journal it wrote and
adds up: schedules run and their statuses, operations and faults applied, steps skipped (a
fault with nothing to act on), tasks created and tasks in the end, and the three counts whose
goal is zero (lost tasks, tasks done twice, agent actions after an acknowledged kill), with
the seeds of every failing schedule and the rules it broke. The summary is printed and
written as `soak-STAMP.json` in the report directory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from harness.judge.time_to_stop import TimeToStop
from harness.judge.time_to_stop import summarize as time_to_stop_percentiles

COUNTS = ("operations", "faults", "skipped", "outage_answers", "tasks_created", "tasks",
          "lost_tasks", "done_twice", "actions_after_kill_ack")


def summarize(journals: list[dict[str, Any]]) -> dict[str, Any]:
    totals: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    broken: Counter[str] = Counter()
    failing: list[dict[str, Any]] = []
    faults: Counter[str] = Counter()
    applied: Counter[str] = Counter()  # drawn and carried out (not skipped)
    unsettled = 0
    for j in journals:
        statuses[j["status"]] += 1
        generator = j.get("generator", {})
        for key in COUNTS:
            totals[key] += int(generator.get(key) or 0)
        unsettled += generator.get("unsettled") is not None
        applied.update(generator.get("faults_by_kind") or {})
        for step in j.get("schedule", {}).get("steps", []):
            if step["kind"] == "fault":
                faults[step["name"]] += 1
        rules = sorted(v["checker"] for v in j.get("verdicts", []) if v["valid"] is False)
        broken.update(rules)
        if j["status"] != "completed":
            failing.append({"seed": j.get("schedule", {}).get("seed"), "status": j["status"],
                            "rules": rules, "journal": j["_path"],
                            "messages": [v["message"][:400] for v in j.get("verdicts", [])
                                         if v["valid"] is False]})
    samples = [TimeToStop(**s) for j in journals
               for s in j.get("measurements", {}).get("time_to_stop", {}).get("samples_ns", [])]
    return {"schedules": len(journals), "statuses": dict(statuses), **totals,
            "faults_drawn": dict(sorted(faults.items())),
            "faults_applied": dict(sorted(applied.items())), "unsettled": unsettled,
            "rules_broken": dict(broken),
            "time_to_stop_us": {part: asdict(p) for part, p in
                                time_to_stop_percentiles(samples).items()} if samples else {},
            "failing": failing}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", type=int, default=50)
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--stack", default="processes")
    parser.add_argument("--report-dir", default="reports/soak")
    parser.add_argument("--summarize-only", action="store_true",
                        help="run nothing: add up the journals already in --report-dir")
    args = parser.parse_args(argv)
    report_dir = Path(args.report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    before = set() if args.summarize_only else set(report_dir.glob("*.json"))
    command = [sys.executable, "-m", "pytest", "scenarios/random_gameday.py", "-q",
               "-p", "no:cacheprovider", "--stack", args.stack, "--reuse-stack",
               "--schedules", str(args.schedules), "--duration", str(args.duration),
               "--agents", str(args.agents), "--seed", str(args.seed), "--shrink-runs", "0",
               "--report-dir", str(report_dir)]
    started = time.monotonic()
    exit_code = None
    if not args.summarize_only:
        print("$ " + " ".join(command), flush=True)
        exit_code = subprocess.call(command)
    took = time.monotonic() - started
    journals = []
    for path in sorted(set(report_dir.glob("*.json")) - before):
        document = json.loads(path.read_text())
        if isinstance(document, dict) and "schedule" in document:
            journals.append({**document, "_path": str(path)})
    summary = {"command": None if args.summarize_only else " ".join(command),
               "pytest_exit": exit_code,
               "wall_s": round(took, 1), **summarize(journals)}
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = report_dir / f"soak-{stamp}.json"
    out.write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "failing"}, indent=2))
    for f in summary["failing"]:
        print(f"FAILED seed {f['seed']} ({f['status']}): {', '.join(f['rules']) or 'no rule'}"
              f" — {f['journal']}")
    print(f"summary: {out}")
    return 0 if not summary["failing"] and journals else 1


if __name__ == "__main__":
    raise SystemExit(main())
