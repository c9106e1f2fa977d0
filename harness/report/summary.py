"""What a pytest run says about its game days: JUnit properties per test (CI systems show
them), the index of runs updated, and a summary at the end of the terminal output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harness.record.gameday import phases
from harness.report import runs
from harness.report.page import write_page

JOURNALS = pytest.StashKey[list[Path]]()
# The parts an on-call engineer reads first, in JUnit properties.
HEADLINE_PARTS = ("kill_acknowledged", "daemon_exit", "total")


def game_day_written(item: pytest.Item, journal: Path | None) -> None:
    """A game day's journal is final: render its page beside it and record it. A page that
    cannot be rendered loses nothing: the journal stands, and the log says why."""
    if journal is None:
        return
    try:
        write_page(journal)
    except Exception:
        phases.exception("the page of %s could not be rendered", journal)
    record(item, [journal])


def record(item: pytest.Item, journals: list[Path]) -> None:
    """Note the game day's journals for the summary and its headline figures as JUnit
    properties of the test."""
    item.config.stash.setdefault(JOURNALS, []).extend(journals)
    for path in journals:
        journal = json.loads(path.read_text())
        summary = journal["measurements"]["time_to_stop"]["summary_us"]
        failed = [v["checker"] for v in journal["verdicts"] if v["valid"] is not True]
        properties: list[tuple[str, Any]] = [
            ("covey.status", journal["status"]), ("covey.stack", journal["stack"]),
            ("covey.agents", len(journal["agents"])), ("covey.seed", journal["seed"]),
            ("covey.verdicts_not_passed", ",".join(failed) or "none"),
            ("covey.journal", str(path))]
        for part in HEADLINE_PARTS:
            if part in summary:
                properties += [(f"covey.{part}.p50_ms", summary[part]["p50_us"] / 1000),
                               (f"covey.{part}.p99_ms", summary[part]["p99_us"] / 1000)]
        if path.with_suffix(".html").exists():
            properties.append(("covey.page", str(path.with_suffix(".html"))))
        item.user_properties.extend(properties)


def pytest_sessionfinish(session: pytest.Session) -> None:
    journals = session.config.stash.get(JOURNALS, [])
    for folder in sorted({p.parent for p in journals}):
        runs.index(folder)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    journals = config.stash.get(JOURNALS, [])
    if not journals:
        return
    tr = terminalreporter
    tr.write_sep("=", "covey game days")
    for path in journals:
        journal = json.loads(path.read_text())
        summary = journal["measurements"]["time_to_stop"]["summary_us"]
        stopped = {s["agent_id"] for s in journal["measurements"]["time_to_stop"]["samples_ns"]
                   if s["daemon_exit_code"] == 3}
        colour = {"completed": {"green": True}, "failed": {"red": True}}.get(
            journal["status"], {"yellow": True})
        tr.write_line(f"{journal['game_day']} on {journal['stack']}: {journal['status']}, "
                      f"{len(journal['agents'])} agents, {len(stopped)} of them stopped "
                      f"working by the switch (daemon exit 3), seed {journal['seed']}",
                      bold=True, **colour)
        for part, p in summary.items():
            tr.write_line(f"    {part:<18} p50 {p['p50_us'] / 1000:8.1f} ms   "
                          f"p99 {p['p99_us'] / 1000:8.1f} ms   ({p['count']} samples)")
        for v in journal["verdicts"]:
            if v["valid"] is not True:
                word = "FAILED" if v["valid"] is False else "could not decide"
                tr.write_line(f"    {v['checker']} {word}: {v['message']}", red=True)
        tr.write_line(f"    journal {path}")
        if path.with_suffix(".html").exists():
            tr.write_line(f"    page    {path.with_suffix('.html')}")
