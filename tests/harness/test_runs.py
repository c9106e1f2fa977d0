"""Game days across runs: the index of a report directory, the trend page, and the gate,
which fails a planted regression and lets noise inside its bound pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from harness.report import runs
from harness.report.trend import write_index


def journal(report_dir: Path, n: int, daemon_exit_p99_ms: float, *, status: str = "completed",
            scenario: str = "test_fleet_stop", stack: str = "processes", agents: int = 5,
            failed: str | None = None, samples: int | None = None,
            aborted_reason: str | None = None) -> Path:
    p99 = int(daemon_exit_p99_ms * 1000)
    document: dict[str, Any] = {
        "game_day": scenario, "stack": stack, "seed": n, "status": status,
        "started_at": f"2026-11-{1 + n:02d}T03:00:00+00:00",
        "agents": [{"id": f"a{i}", "slug": f"a{i}", "behaviour": "silent"}
                   for i in range(agents)],
        "verdicts": [{"checker": "no_action_after_kill_ack", "valid": failed is None,
                      "message": failed or "No agent action started after an acknowledged "
                                           "kill.", "evidence": []}],
        "measurements": {"time_to_stop": {"summary_us": {"daemon_exit": {
            "count": agents if samples is None else samples, "p50_us": p99 // 2,
            "p90_us": p99, "p99_us": p99, "max_us": p99}}, "samples_ns": []}}}
    if aborted_reason is not None:
        document["aborted_reason"] = aborted_reason
    path = report_dir / f"{scenario}-{n:03d}.json"
    path.write_text(json.dumps(document))
    return path


def history_of(tmp_path: Path, p99s: list[float]) -> Path:
    for n, p99 in enumerate(p99s):
        journal(tmp_path, n, p99)
    return tmp_path


def test_noise_inside_the_bound_passes_with_the_figures(tmp_path: Path) -> None:
    history_of(tmp_path, [400, 380, 450, 410, 390, 700])  # 1.75x the median: noise here
    # 400.1: the one percentile definition's histogram keeps three significant figures.
    result = runs.gate(runs.runs(tmp_path) if runs.index(tmp_path) else [])
    assert result.passed, result.lines
    assert result.lines == ["test_fleet_stop on processes with 5 agents: ok · daemon_exit "
                            "p99 700.0 ms vs median 400.1 ms"]


def test_a_planted_regression_fails_with_one_line_that_says_why(tmp_path: Path) -> None:
    history_of(tmp_path, [400, 380, 450, 410, 390, 1200])
    runs.index(tmp_path)
    result = runs.gate(runs.runs(tmp_path))
    assert not result.passed
    assert result.lines == ["test_fleet_stop on processes with 5 agents: daemon_exit p99 "
                            "1200.0 ms is 3.0x the median 400.1 ms of the last 5 comparable "
                            "runs (bound 2x and +50 ms), in test_fleet_stop-005.json"]


def test_a_tiny_figure_that_doubles_is_under_the_noise_floor(tmp_path: Path) -> None:
    history_of(tmp_path, [3, 4, 3, 3, 9])
    runs.index(tmp_path)
    assert runs.gate(runs.runs(tmp_path)).passed
    assert not runs.gate(runs.runs(tmp_path), min_delta_ms=1).passed


def test_a_failed_verdict_fails_the_gate_whatever_the_figures(tmp_path: Path) -> None:
    history_of(tmp_path, [400, 400, 400])
    journal(tmp_path, 9, 100, status="failed", failed="agent-2 acted 40 ms after the kill")
    runs.index(tmp_path)
    result = runs.gate(runs.runs(tmp_path))
    assert not result.passed
    assert "ended failed" in result.lines[0]
    assert "checker no_action_after_kill_ack failed: agent-2 acted 40 ms after the kill" \
        in result.lines[1]


def test_only_comparable_runs_are_compared(tmp_path: Path) -> None:
    history_of(tmp_path, [400, 400, 400])
    # Twenty agents take longer: not a regression of the five-agent game day.
    for n in range(3):
        journal(tmp_path, 10 + n, 1500, agents=20)
    journal(tmp_path, 20, 4000, agents=20)
    journal(tmp_path, 21, 420)
    runs.index(tmp_path)
    lines = runs.gate(runs.runs(tmp_path)).lines
    assert any("with 5 agents: ok" in line for line in lines), lines
    assert any("with 20 agents: daemon_exit p99 4000.0 ms is 2.7x" in line
               for line in lines), lines


def test_too_little_history_is_said_not_failed(tmp_path: Path) -> None:
    history_of(tmp_path, [400, 5000])
    runs.index(tmp_path)
    result = runs.gate(runs.runs(tmp_path))
    assert result.passed
    assert "(1 earlier runs with 5+ samples, 3 needed to compare)" in result.lines[0]


def test_a_p99_of_too_few_samples_is_skipped_with_a_line_that_says_so(tmp_path: Path) -> None:
    # rm_rf kills one agent a run: a "p99" of one sample, however slow, is not a regression.
    for n, p99 in enumerate([400, 380, 450, 410]):
        journal(tmp_path, n, p99, scenario="test_rm_rf", samples=1)
    journal(tmp_path, 4, 4000, scenario="test_rm_rf", samples=1)
    runs.index(tmp_path)
    result = runs.gate(runs.runs(tmp_path))
    assert result.passed, result.lines
    assert result.lines == [
        "test_rm_rf on processes with 5 agents: ok",
        f"test_rm_rf on processes with 5 agents: daemon_exit p99 4000.0 ms not compared: 1 "
        f"sample in the latest run, {runs.MIN_SAMPLES} needed for a p99 worth comparing"]


def test_earlier_runs_of_too_few_samples_do_not_make_the_median(tmp_path: Path) -> None:
    for n in range(3):
        journal(tmp_path, n, 100, samples=runs.MIN_SAMPLES - 1)
    for n in range(3, 6):
        journal(tmp_path, n, 400, samples=runs.MIN_SAMPLES)
    journal(tmp_path, 6, 700, samples=runs.MIN_SAMPLES)
    runs.index(tmp_path)
    result = runs.gate(runs.runs(tmp_path))
    # Against the one-sample-short runs' 100 ms, 700 ms would be 7x: a false regression.
    assert result.passed, result.lines
    assert result.lines == ["test_fleet_stop on processes with 5 agents: ok · daemon_exit "
                            "p99 700.0 ms vs median 400.0 ms"]


def test_after_an_aborted_run_the_gate_says_why_it_aborted(tmp_path: Path) -> None:
    history_of(tmp_path, [400, 400, 400])
    journal(tmp_path, 9, 400, status="aborted",
            aborted_reason="halted by hand: the staging database was being restored")
    runs.index(tmp_path)
    result = runs.gate(runs.runs(tmp_path))
    assert not result.passed
    assert result.lines[0] == (
        "test_fleet_stop on processes with 5 agents: the latest run "
        "(test_fleet_stop-009.json) ended aborted: halted by hand: the staging database was "
        "being restored")


def test_an_index_from_before_aborted_reasons_reads_them_from_the_journals(
        tmp_path: Path) -> None:
    import sqlite3

    journal(tmp_path, 0, 400, status="aborted", aborted_reason="the stack never came up")
    with sqlite3.connect(tmp_path / runs.INDEX) as old:
        old.execute("CREATE TABLE runs (journal TEXT PRIMARY KEY, scenario TEXT NOT NULL, "
                    "stack TEXT NOT NULL, agents INTEGER NOT NULL, seed INTEGER, status TEXT "
                    "NOT NULL, started_at TEXT NOT NULL, failed_verdicts TEXT NOT NULL, "
                    "page TEXT)")
        old.execute("INSERT INTO runs VALUES ('test_fleet_stop-000.json', 'test_fleet_stop', "
                    "'processes', 5, 0, 'aborted', '2026-11-01T03:00:00+00:00', '[]', NULL)")
    old.close()
    runs.index(tmp_path)
    assert [r.aborted_reason for r in runs.runs(tmp_path)] == ["the stack never came up"]


def test_no_game_day_is_nothing_to_gate(tmp_path: Path) -> None:
    runs.index(tmp_path)
    result = runs.gate(runs.runs(tmp_path))
    assert not result.passed and "nothing to gate" in result.lines[0]


def test_the_index_is_idempotent_and_skips_what_is_not_a_journal(tmp_path: Path) -> None:
    history_of(tmp_path, [400, 410])
    (tmp_path / "load-20261201T000000Z.json").write_text("{}")
    (tmp_path / "garbage.json").write_text("not json")
    assert runs.index(tmp_path) == 2
    assert runs.index(tmp_path) == 0
    assert [r.seed for r in runs.runs(tmp_path)] == [0, 1]


def test_the_trend_page_lists_every_run_of_every_group(tmp_path: Path) -> None:
    history_of(tmp_path, [400, 410])
    journal(tmp_path, 5, 900, stack="containers")
    runs.index(tmp_path)
    page = write_index(tmp_path).read_text()
    assert "test_fleet_stop on processes, 5 agents" in page
    assert "test_fleet_stop on containers, 5 agents" in page
    assert page.count("<tr><td>2026-11-") == 3


def test_gameday_gate_exits_1_on_the_regression_and_0_on_noise(tmp_path: Path) -> None:
    history_of(tmp_path, [400, 380, 450, 410, 390, 1200])
    gate = [sys.executable, "-m", "harness.run.cli", "gate", "--report-dir", str(tmp_path)]
    failing = subprocess.run(gate, capture_output=True, text=True, timeout=60)
    assert failing.returncode == 1, failing.stdout + failing.stderr
    assert failing.stdout.splitlines() == [
        "test_fleet_stop on processes with 5 agents: daemon_exit p99 1200.0 ms is 3.0x the "
        "median 400.1 ms of the last 5 comparable runs (bound 2x and +50 ms), in "
        "test_fleet_stop-005.json"]
    passing = subprocess.run([*gate, "--ratio", "4"], capture_output=True, text=True,
                             timeout=60)
    assert passing.returncode == 0, passing.stdout + passing.stderr


LONG_NAME = "test_a_partitioned_replica_fails_closed_and_the_other_serves_on"


def test_gameday_trend_in_a_pipe_at_80_columns_keeps_every_scenario_name_whole(
        tmp_path: Path) -> None:
    for n in range(2):
        journal(tmp_path, n, 400, scenario=LONG_NAME)
    journal(tmp_path, 5, 300, scenario="test_rm_rf_loop_killed_by_its_owner")
    journal(tmp_path, 6, 310, scenario="test_runaway_spend_stopped_at_its_cap")
    trend = subprocess.run([sys.executable, "-m", "harness.run.cli", "trend", "--report-dir",
                            str(tmp_path)], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "COLUMNS": "80", "TERM": "dumb"})
    assert trend.returncode == 0, trend.stdout + trend.stderr
    assert "…" not in trend.stdout
    rows = {line.split()[1]: line for line in trend.stdout.splitlines()
            if line.startswith("│ test_")}
    assert set(rows) == {LONG_NAME, "test_rm_rf_loop_killed_by_its_owner",
                         "test_runaway_spend_stopped_at_its_cap"}, trend.stdout
    # One greppable line per scenario, its figures with it.
    assert "processes" in rows[LONG_NAME] and "400.0" in rows[LONG_NAME]
    assert "2026-11-02 03:00" in rows[LONG_NAME]


def test_gameday_trend_in_a_narrow_terminal_wraps_and_cuts_no_name(tmp_path: Path) -> None:
    from rich.console import Console

    from harness.run import cli

    journal(tmp_path, 0, 400, scenario=LONG_NAME)
    narrow = Console(width=80, force_terminal=True, color_system=None, record=True)
    original, cli.console = cli.console, narrow
    try:
        cli.trend(tmp_path)
    finally:
        cli.console = original
    lines = narrow.export_text().splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    assert LONG_NAME in lines and "…" not in "".join(lines)
    assert "400.0 ms" in " ".join(lines)
