"""The control plane's time to recover from each fault of the nemesis, over a few rounds.

    bash scripts/setup && .venv/bin/python -m benchmarks.fault_recovery \
        [--stack processes|containers] [--rounds 3] [--json PATH]

Each round runs the fault game days (scenarios/database_outage.py, its pause and restart,
and scenarios/control_plane_crash.py) as pytest does in CI, on a fresh stack each, and reads
what their journals measured:

* `database pause` / `database restart`: from the database back (the fault's heal done:
  SIGCONT sent, or the server started again) to the control plane's /healthz answering 200;
* `control plane restart`: from starting the SIGKILLed control plane again to its /healthz;
* `requeue after restart`: from that start until no task of the crash is in progress any
  more (the stale sessions of the dead control plane declared lost and requeued).

A round whose game day fails counts no figure and is reported as failed. Percentiles are the
harness's one definition (HDR histogram, harness/judge/time_to_stop.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness.judge.time_to_stop import percentiles

ROOT = Path(__file__).resolve().parents[1]
FIGURES = {  # figure: (journal name prefix, measurement)
    "database pause": ("test_database_outage[pause]", "recovery_s"),
    "database restart": ("test_database_outage[restart]", "recovery_s"),
    "control plane restart": ("test_control_plane_killed_mid_fleet_kill", "restart_s"),
    "requeue after restart": ("test_control_plane_killed_mid_fleet_kill",
                              "requeued_after_restart_s"),
}


def run_round(stack: str, report_dir: Path) -> int:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "scenarios/database_outage.py",
         "scenarios/control_plane_crash.py", "--stack", stack, "--report-dir",
         str(report_dir), "-p", "no:cacheprovider", "-q"],
        cwd=ROOT, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=os.environ.copy()).returncode


def figures_of(report_dir: Path) -> tuple[dict[str, list[float]], list[str]]:
    found: dict[str, list[float]] = {name: [] for name in FIGURES}
    failed = []
    for journal in sorted(report_dir.glob("*[0-9]Z.json")):
        document = json.loads(journal.read_text())
        if document["status"] != "completed":
            failed.append(f"{document['game_day']}: {document['status']}")
            continue
        for name, (prefix, measurement) in FIGURES.items():
            value = document["measurements"].get(measurement)
            if document["game_day"] == prefix and value is not None:
                found[name].append(float(value))
    return found, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stack", default="processes", choices=["processes", "containers"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fault-recovery-") as folder:
        report_dir = Path(folder)
        codes = [run_round(args.stack, report_dir) for _ in range(args.rounds)]
        found, failed = figures_of(report_dir)
    result: dict[str, Any] = {
        "command": " ".join(sys.argv), "stack": args.stack, "rounds": args.rounds,
        "round_exit_codes": codes, "failed_game_days": failed,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load": os.getloadavg()},
        "figures_ms": {}}
    print(f"{'fault':<24} {'n':>3} {'p50 ms':>9} {'p99 ms':>9}")
    for name, values in found.items():
        if not values:
            print(f"{name:<24} {0:>3} {'-':>9} {'-':>9}")
            continue
        p = percentiles([max(1, round(v * 1e9)) for v in values])
        result["figures_ms"][name] = {"n": len(values), "p50": p.p50_us / 1000,
                                      "p99": p.p99_us / 1000, "samples_s": values}
        print(f"{name:<24} {len(values):>3} {p.p50_us / 1000:>9.1f} {p.p99_us / 1000:>9.1f}")
    if failed:
        print("failed game days: " + "; ".join(failed))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
