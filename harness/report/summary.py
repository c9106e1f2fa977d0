"""What a pytest run says about its game days: JUnit properties per test (CI systems show
them), the index of runs updated, and a summary at the end of the terminal output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harness.record.gameday import phases
from harness.report import runs
from harness.report.answer import answer
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
        for line, style in summary_lines(journal, path):
            tr.write_line(line, **style)


def summary_lines(journal: dict[str, Any], path: Path) -> list[tuple[str, dict[str, bool]]]:
    """A game day in the terminal, answer first (harness/report/answer.py, as on its page):
    the headline, the figures beside their bounds, what broke, what was not judged, the
    replay, where the journal and page are."""
    told = answer(journal, path)
    colour = {"completed": {"green": True}, "failed": {"red": True}}.get(
        journal["status"], {"yellow": True})
    lines: list[tuple[str, dict[str, bool]]] = [
        (f"{journal['game_day']} on {journal['stack']}: {journal['status']}: "
         + " · ".join(told.headline), {"bold": True, **colour})]
    if journal.get("aborted_reason"):
        lines.append((f"    aborted: {journal['aborted_reason']}", {"yellow": True}))
    for f in told.figures:
        held = {True: "within", False: "PAST", "unknown": "NOT MEASURED against"}[f.within]
        lines.append((f"    {f.label}: {f.value}, {held} its bound of {f.bound}",
                      {} if f.within is True else {"red": True}))
    summary = journal["measurements"]["time_to_stop"]["summary_us"]
    for part, p in summary.items():
        p99 = min(p["p99_us"], p["max_us"])
        lines.append((f"    {part:<18} p50 {p['p50_us'] / 1000:8.1f} ms   p99 {p99 / 1000:8.1f} "
                      f"ms   max {p['max_us'] / 1000:8.1f} ms   ({p['count']} samples)", {}))
    for v in told.broke:
        lines.append((f"    BROKE {v.checker} ({v.why}): {v.message}", {"red": True}))
    if told.not_judged:
        lines.append((f"    not judged here: {', '.join(v.checker for v in told.not_judged)} "
                      "(nothing in this game day for them; the page says why)", {}))
    if told.broke:
        lines.append((f"    replay  {told.replay}", {"bold": True}))
    lines.append((f"    journal {path}", {}))
    if path.with_suffix(".html").exists():
        lines.append((f"    page    {path.with_suffix('.html')}", {}))
    return lines
