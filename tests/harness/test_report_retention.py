"""What a report directory keeps: the newest journals of each scenario (`gameday prune`), one
chart script for all its pages (a page copied alone still opens), and no empty files."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

from harness.act.browser import chromium
from harness.report import runs
from harness.report.page import PLOTLY_FILE, write_page
from harness.report.retention import prune
from harness.report.specimen import specimen_game_day
from harness.report.trend import write_index
from harness.stack.base import puppet_process
from tests.harness.test_runs import journal


def game_day(report_dir: Path, scenario: str, n: int) -> Path:
    """A journal with its history and a page, as a game day leaves them."""
    path = journal(report_dir, n, 400, scenario=scenario)
    document = json.loads(path.read_text())
    document["history"] = path.with_suffix(".history.jsonl").name
    path.write_text(json.dumps(document))
    path.with_suffix(".history.jsonl").write_text('{"index": 0}\n')
    path.with_suffix(".html").write_text("<html></html>")
    return path


def test_prune_keeps_the_newest_n_of_each_scenario_with_their_files(tmp_path: Path) -> None:
    fleet = [game_day(tmp_path, "test_fleet_stop", n) for n in range(5)]
    rm_rf = [game_day(tmp_path, "test_rm_rf", n) for n in range(10, 12)]
    (tmp_path / PLOTLY_FILE).write_text("/* the shared chart script */")
    # A stack's log last written before the oldest game day kept began, and a newer one.
    old_log, new_log = tmp_path / "puppet-1.log", tmp_path / "control-plane-x.log"
    old_log.write_text("old")
    new_log.write_text("new")
    kept_start = json.loads(fleet[2].read_text())["started_at"]
    before = datetime.fromisoformat(kept_start).timestamp() - 3600
    os.utime(old_log, (before, before))
    runs.index(tmp_path)

    pruned = prune(tmp_path, keep=3)

    assert pruned.kept == {"test_fleet_stop": 3, "test_rm_rf": 2}
    assert sorted(pruned.removed_journals) == [fleet[0].name, fleet[1].name]
    left = {p.name for p in tmp_path.iterdir()}
    for path in fleet[:2]:
        for name in (path.name, path.with_suffix(".html").name,
                     path.with_suffix(".history.jsonl").name):
            assert name not in left
    for path in [*fleet[2:], *rm_rf]:
        assert {path.name, path.with_suffix(".html").name,
                path.with_suffix(".history.jsonl").name} <= left
    assert PLOTLY_FILE in left and runs.INDEX in left
    assert old_log.name not in left and new_log.name in left
    # The index no longer counts what is gone: the gate compares with what is there.
    assert [r.journal for r in runs.runs(tmp_path) if r.scenario == "test_fleet_stop"] == [
        p.name for p in fleet[2:]]


def test_gameday_prune_refuses_to_keep_nothing_and_dry_run_removes_nothing(
        tmp_path: Path) -> None:
    for n in range(3):
        game_day(tmp_path, "test_fleet_stop", n)
    cli = [sys.executable, "-m", "harness.run.cli", "prune", "--report-dir", str(tmp_path)]
    refused = subprocess.run([*cli, "--keep", "0"], capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    dry = subprocess.run([*cli, "--keep", "1", "--dry-run"], capture_output=True, text=True,
                         timeout=60, check=True)
    assert "would remove 2 journals, 6 files" in dry.stdout, dry.stdout
    assert len(list(tmp_path.glob("*.json"))) == 3
    done = subprocess.run([*cli, "--keep", "1"], capture_output=True, text=True, timeout=60,
                          check=True)
    assert "removed 2 journals" in done.stdout
    assert [p.name for p in tmp_path.glob("*.json")] == ["test_fleet_stop-002.json"]


def specimen(report_dir: Path, name: str = "specimen") -> Path:
    document, history = specimen_game_day(3)
    path = report_dir / f"{name}.json"
    history.to_jsonl(path.with_suffix(".history.jsonl"))
    document["history"] = path.with_suffix(".history.jsonl").name
    path.write_text(json.dumps(document))
    return path


def test_pages_share_one_chart_script_beside_them(tmp_path: Path) -> None:
    pages = [write_page(specimen(tmp_path, f"day-{n}")) for n in range(2)]
    shared = tmp_path / PLOTLY_FILE
    assert shared.is_file() and shared.stat().st_size > 1_000_000
    for page in pages:
        html = page.read_text()
        assert f'<script src="{PLOTLY_FILE}"></script>' in html
        assert page.stat().st_size < 500_000, "the chart script is inlined again"
    runs.index(tmp_path)
    assert f'<script src="{PLOTLY_FILE}"></script>' in write_index(tmp_path).read_text()
    assert [p.name for p in tmp_path.glob("*.js")] == [PLOTLY_FILE]
    (tmp_path / "alone").mkdir()
    standalone = write_page(specimen(tmp_path / "alone", "day"), standalone=True)
    assert standalone.stat().st_size > 1_000_000
    assert f'<script src="{PLOTLY_FILE}">' not in standalone.read_text()
    assert not (tmp_path / "alone" / PLOTLY_FILE).exists()


def test_a_page_copied_alone_opens_and_says_what_its_charts_need(tmp_path: Path) -> None:
    page = write_page(specimen(tmp_path))
    alone = tmp_path / "copied" / page.name
    alone.parent.mkdir()
    alone.write_text(page.read_text())
    with chromium() as browser:
        browser.get(page.as_uri())
        browser.find_element("css selector", "#timeline .ytick")  # drawn by the shared file
        browser.get(alone.as_uri())
        missing = browser.find_element("css selector", "#timeline.chart-missing")
        assert "plotly.min.js" in missing.text and "--standalone" in missing.text
        # The page's text is all there without the charts.
        assert browser.find_element("id", "replay").text.startswith("pytest ")
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"
                  and PLOTLY_FILE not in e["message"]]
        assert not errors, errors


async def test_a_helper_process_that_said_nothing_leaves_no_log(tmp_path: Path) -> None:
    def logs() -> dict[str, int]:
        return {p.name: p.stat().st_size for p in tmp_path.glob("puppet-*.log")}

    async with puppet_process(tmp_path):
        assert await asyncio.to_thread(logs)  # there while it runs, written to or not
    assert not [name for name, size in (await asyncio.to_thread(logs)).items() if size == 0]
