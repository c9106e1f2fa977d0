"""Game days across runs: an index of every journal in a report directory (one SQLite file
beside them, `gamedays.sqlite`, kept as CI artifacts are), the trend of each scenario, and
the regression gate.

Comparable runs are those of the same scenario on the same stack with the same number of
agents. The gate fails the latest run of each when it failed a verdict, or when a part's
p99 time-to-stop got worse than the median of the previous comparable runs by more than a
ratio and by more than a floor in milliseconds: on noisy shared CI machines a 3 ms p99 that
becomes 7 ms is noise, a 300 ms one that becomes 700 ms is not.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from harness.judge.time_to_stop import percentiles

INDEX = "gamedays.sqlite"
# A p99 of fewer samples than this is the slowest of a handful: one scheduler hiccup on a
# shared CI machine decides it (rm_rf kills one agent a run: its "p99" is that one kill).
# The gate compares a part only where the latest run and each earlier one had this many.
MIN_SAMPLES = 5
SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    journal TEXT PRIMARY KEY,       -- the journal's file name in the report directory
    scenario TEXT NOT NULL,         -- game day name (the test's)
    stack TEXT NOT NULL,
    agents INTEGER NOT NULL,
    seed INTEGER,
    status TEXT NOT NULL,           -- completed | failed | aborted
    started_at TEXT NOT NULL,
    failed_verdicts TEXT NOT NULL,  -- JSON list of {checker, message} that did not pass
    page TEXT,                      -- the page's file name, when one was rendered
    aborted_reason TEXT             -- why an aborted game day broke off (its journal's)
);
CREATE TABLE IF NOT EXISTS figures (
    journal TEXT NOT NULL REFERENCES runs(journal) ON DELETE CASCADE,
    part TEXT NOT NULL,             -- a time-to-stop part, or total
    count INTEGER NOT NULL,
    p50_us INTEGER NOT NULL,
    p90_us INTEGER NOT NULL,
    p99_us INTEGER NOT NULL,
    max_us INTEGER NOT NULL,
    PRIMARY KEY (journal, part)
);
"""


@dataclass(frozen=True)
class Run:
    journal: str
    scenario: str
    stack: str
    agents: int
    seed: int | None
    status: str
    started_at: str
    failed_verdicts: list[dict[str, str]]
    page: str | None
    p99_us: dict[str, int] = field(default_factory=dict)
    samples: dict[str, int] = field(default_factory=dict)  # part → how many made its p99
    aborted_reason: str | None = None

    @property
    def group(self) -> tuple[str, str, int]:
        return (self.scenario, self.stack, self.agents)

    def describe(self) -> str:
        return f"{self.scenario} on {self.stack} with {self.agents} agents"


@contextmanager
def opened(report_dir: Path) -> Iterator[sqlite3.Connection]:
    report_dir.mkdir(parents=True, exist_ok=True)
    with closing(sqlite3.connect(report_dir / INDEX)) as db:
        db.execute("PRAGMA foreign_keys = ON")
        db.executescript(SCHEMA)
        if "aborted_reason" not in {row[1] for row in db.execute("PRAGMA table_info(runs)")}:
            db.execute("ALTER TABLE runs ADD COLUMN aborted_reason TEXT")  # an older index
        with db:
            yield db


def is_journal(path: Path) -> bool:
    return path.suffix == ".json" and not path.name.startswith(("load-", "bench-"))


def index(report_dir: Path) -> int:
    """Add every journal of the directory not yet indexed; returns how many were added. A
    file that is not a game day's journal is skipped, not fatal."""
    added = 0
    with opened(report_dir) as db:
        # An aborted run indexed before the index kept the reason is read again for it.
        known = {row[0] for row in db.execute("SELECT journal FROM runs WHERE status != "
                                              "'aborted' OR aborted_reason IS NOT NULL")}
        for path in sorted(report_dir.glob("*.json")):
            if path.name in known or not is_journal(path):
                continue
            try:
                journal = json.loads(path.read_text())
                add(db, path, journal)
            except (ValueError, KeyError, TypeError):
                continue
            added += 1
    return added


def add(db: sqlite3.Connection, path: Path, journal: dict[str, Any]) -> None:
    failed = [{"checker": v["checker"], "message": v["message"],
               "valid": str(v["valid"]).lower()}
              for v in journal["verdicts"] if v["valid"] is not True]
    page = path.with_suffix(".html")
    db.execute("INSERT OR REPLACE INTO runs (journal, scenario, stack, agents, seed, status, "
               "started_at, failed_verdicts, page, aborted_reason) "
               "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
               (path.name, journal["game_day"], journal["stack"], len(journal["agents"]),
                journal.get("seed"), journal["status"], journal["started_at"],
                json.dumps(failed), page.name if page.exists() else None,
                journal.get("aborted_reason")
                or ("no reason recorded" if journal["status"] == "aborted" else None)))
    for part, p in journal["measurements"]["time_to_stop"]["summary_us"].items():
        db.execute("INSERT OR REPLACE INTO figures VALUES (?, ?, ?, ?, ?, ?, ?)",
                   (path.name, part, p["count"], p["p50_us"], p["p90_us"], p["p99_us"],
                    p["max_us"]))


def runs(report_dir: Path) -> list[Run]:
    """Every indexed run, oldest first."""
    with opened(report_dir) as db:
        p99: dict[str, dict[str, int]] = {}
        counts: dict[str, dict[str, int]] = {}
        for journal, part, value, count in db.execute(
                "SELECT journal, part, p99_us, count FROM figures"):
            p99.setdefault(journal, {})[part] = value
            counts.setdefault(journal, {})[part] = count
        rows = db.execute("SELECT journal, scenario, stack, agents, seed, status, started_at,"
                          " failed_verdicts, page, aborted_reason FROM runs"
                          " ORDER BY started_at, journal")
        return [Run(r[0], r[1], r[2], r[3], r[4], r[5], r[6], json.loads(r[7]), r[8],
                    p99.get(r[0], {}), counts.get(r[0], {}), r[9]) for r in rows]


def minute(started_at: str) -> str:
    """A journal's ISO start, microseconds and all, as people read it: `2026-11-01 03:00`
    (UTC); what is not a time is shown as it is."""
    try:
        return datetime.fromisoformat(started_at).astimezone(UTC).strftime("%Y-%m-%d %H:%M")
    except ValueError:
        return started_at


def groups(all_runs: list[Run]) -> dict[tuple[str, str, int], list[Run]]:
    by_group: dict[tuple[str, str, int], list[Run]] = {}
    for run in all_runs:
        by_group.setdefault(run.group, []).append(run)
    return by_group


def median_us(values_us: list[int]) -> int:
    """The median by the harness's one percentile definition (an HDR histogram's p50, as the
    summary, the page and the load report give it), not statistics.median's mean of the two
    middle values: one figure, one definition."""
    return percentiles([us * 1000 for us in values_us]).p50_us


@dataclass(frozen=True)
class GateResult:
    passed: bool
    lines: list[str]  # one per comparable group: why it failed, or its figures


def gate(all_runs: list[Run], ratio: float = 2.0, window: int = 10, min_runs: int = 3,
         min_delta_ms: float = 50.0, scenario: str | None = None,
         min_samples: int = MIN_SAMPLES) -> GateResult:
    """Judge the latest run of every comparable group (of `scenario`, if given). A part is
    compared only where the latest run and each earlier run taken had `min_samples` samples
    of it; a part with fewer is said to be skipped, on a line of its own."""
    lines, passed = [], True
    chosen = {g: rs for g, rs in groups(all_runs).items() if scenario in (None, g[0])}
    if not chosen:
        return GateResult(False, [f"no game day{' ' + scenario if scenario else ''} has been "
                                  "run here: nothing to gate"])
    for _, group_runs in sorted(chosen.items()):
        latest, before = group_runs[-1], group_runs[:-1][-window:]
        problems = [f"{latest.describe()}: the latest run ({latest.journal}) ended "
                    f"{latest.status}"
                    + (f": {latest.aborted_reason}" if latest.aborted_reason else "")
                    ] if latest.status != "completed" else []
        skipped = []
        problems += [f"{latest.describe()}: checker {v['checker']} failed: {v['message']}"
                     for v in latest.failed_verdicts if v["valid"] == "false"]
        # A verdict nobody could decide is not a failed one; the game day itself fails on
        # those it had to decide. The gate says so beside the figures.
        figures = [f"{v['checker']} could not decide" for v in latest.failed_verdicts
                   if v["valid"] != "false"]
        for part, p99 in sorted(latest.p99_us.items()):
            count = latest.samples.get(part, 0)
            if count < min_samples:
                skipped.append(f"{latest.describe()}: {part} p99 {p99 / 1000:.1f} ms not "
                               f"compared: {count} sample{'s' * (count != 1)} in the latest "
                               f"run, {min_samples} needed for a p99 worth comparing")
                continue
            history = [r.p99_us[part] for r in before
                       if part in r.p99_us and r.status == "completed"
                       and r.samples.get(part, 0) >= min_samples]
            if len(history) < min_runs:
                figures.append(f"{part} p99 {p99 / 1000:.1f} ms ({len(history)} earlier "
                               f"runs with {min_samples}+ samples, {min_runs} needed to "
                               "compare)")
                continue
            median = median_us(history)
            figures.append(f"{part} p99 {p99 / 1000:.1f} ms vs median {median / 1000:.1f} ms")
            if p99 > ratio * median and (p99 - median) / 1000 > min_delta_ms:
                problems.append(
                    f"{latest.describe()}: {part} p99 {p99 / 1000:.1f} ms is "
                    f"{p99 / median:.1f}x the median {median / 1000:.1f} ms of the last "
                    f"{len(history)} comparable runs (bound {ratio:g}x and "
                    f"+{min_delta_ms:g} ms), in {latest.journal}")
        if problems:
            passed = False
            lines += problems
        else:
            ok = f"{latest.describe()}: ok"
            lines.append(f"{ok} · {'; '.join(figures)}" if figures else ok)
        lines += skipped
    return GateResult(passed, lines)
