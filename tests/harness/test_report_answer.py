"""The game-day page and the terminal summary lead with the answer (harness/report/answer.py),
seen in a real headless Chromium with the network off: a passing rm_rf-like page shows its
figures beside their bounds and nothing under "what broke"; a failed game day's page leads
with its failed verdict (not with the undecided ones listed before it in the journal) and a
replay line that pytest collects as exactly that test; the headline's counts are the
journal's. The pages are built from journals made here, judged by the real checkers.
Screenshots stay under reports/ (COVEY_SCREENSHOT_DIR)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.act.browser import chromium, screenshot_dir
from harness.generator.schedule import from_journal, generate
from harness.record.history import History
from harness.report.answer import answer
from harness.report.page import Clock, agent_lanes, timeline, write_page
from harness.report.specimen import specimen_game_day
from harness.report.summary import summary_lines

pytest_plugins = ["pytester"]
REPO = Path(__file__).resolve().parents[2]
RM_RF = "scenarios/rm_rf.py::test_rm_rf_loop_killed_by_its_owner"
# rm_rf's own bounds (scenarios/rm_rf.py), but for the files lost: the specimen reads no home.
RM_RF_BOUNDS = {"deletions_after_request": 2, "request_to_last_action_ms": 500,
                "slowest_stop_ms": 2000}
NOT_REQUIRED = "in_progress_requeued"  # judged in the specimen, required by neither page


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium(window="1300,1800", offline=True) as driver:
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd("Network.emulateNetworkConditions", {
            "offline": True, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1})
        yield driver


def _undecided(journal: dict[str, Any], checker: str, why: str) -> None:
    verdict = next(v for v in journal["verdicts"] if v["checker"] == checker)
    verdict.update(valid="unknown", message=why, evidence=[])


def _written(tmp_path: Path, name: str, journal: dict[str, Any], history: History) -> Path:
    path = tmp_path / f"{name}.json"
    history.to_jsonl(path.with_suffix(".history.jsonl"))
    journal["history"] = path.with_suffix(".history.jsonl").name
    path.write_text(json.dumps(journal))
    return path


def passing_rm_rf(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    journal, history = specimen_game_day(5, bounds=RM_RF_BOUNDS)
    journal.update(game_day="test_rm_rf_loop_killed_by_its_owner", scenario=RM_RF)
    _undecided(journal, NOT_REQUIRED, "No task was in progress at any kill, so none had to be "
                                      "open again after it.")
    return _written(tmp_path, "rm_rf", journal, history), journal


def failed_fleet_stop(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """Four actions of one agent between the request and the acknowledgement, past a bound
    of 1; one required rule and one not required left undecided, both listed before the
    failure in the journal (as a real one lists its checkers before its bounds)."""
    journal, history = specimen_game_day(3, bounds={"actions_after_request": 1},
                                         late_actions=4)
    _undecided(journal, "kill_obeyed", "No kill message reached a running daemon.")
    _undecided(journal, NOT_REQUIRED, "No task was in progress at any kill.")
    assert journal["status"] == "failed", "the specimen's bound did not fail it"
    return _written(tmp_path, "failed", journal, history), journal


def headline_counts(journal: dict[str, Any]) -> dict[str, float]:
    """The headline's figures computed here, from the journal's raw samples."""
    samples = journal["measurements"]["time_to_stop"]["samples_ns"]
    parts = ("kill_acknowledged_ns", "last_action_ns", "daemon_exit_ns", "sandbox_gone_ns",
             "tasks_requeued_ns")
    return {"covered": len({s["agent_id"] for s in samples}),
            "stopped": len({s["agent_id"] for s in samples if s["daemon_exit_ns"] is not None
                            or s["sandbox_gone_ns"] is not None}),
            "slowest_ms": max(max(s[p] for p in parts if s[p] is not None)
                              for s in samples) / 1e6,
            "requeued": len({s["agent_id"] for s in samples
                             if s["tasks_requeued_ns"] is not None})}


def assert_headline_matches(text: str, journal: dict[str, Any]) -> None:
    counts = headline_counts(journal)
    found = re.search(r"(\d+) of (\d+) agents? stopped", text)
    assert found, f"the headline does not say how many agents stopped: {text!r}"
    assert (int(found[1]), int(found[2])) == (counts["stopped"], counts["covered"]), (
        f"the headline says {found[0]!r}, the journal {counts}")
    slowest = re.search(r"slowest (\d+) ms", text)
    assert slowest and int(slowest[1]) == round(counts["slowest_ms"]), (
        f"the headline's slowest stop is not the journal's {counts['slowest_ms']:.1f} ms: "
        f"{text!r}")
    assert f"tasks of {counts['requeued']} agents back in the backlog" in text, text
    late = journal["measurements"]["bounded"]
    worst = late.get("actions_after_request", late.get("deletions_after_request"))
    assert f"{worst['value']:g} {worst['unit']} after the request" in text, (
        f"the headline's count after the request is not the journal's {worst}: {text!r}")


def test_a_passing_rm_rf_page_shows_its_figures_with_bounds_and_nothing_broke(
        browser: Any, tmp_path: Path) -> None:
    path, journal = passing_rm_rf(tmp_path)
    browser.get(write_page(path).as_uri())
    headline = browser.find_element("id", "headline").text
    assert headline.startswith("5 of 5 agents stopped · slowest"), headline
    assert "(bound 2 s)" in headline, headline
    assert_headline_matches(headline, journal)

    rows = {r.get_attribute("data-figure"): r for r in
            browser.find_elements("css selector", "#figures tr[data-figure]")}
    assert set(rows) == set(RM_RF_BOUNDS), f"figures shown: {sorted(rows)}"
    for name, bound in RM_RF_BOUNDS.items():
        figure = journal["measurements"]["bounded"][name]
        value = rows[name].find_element("css selector", ".value").text
        shown_bound = rows[name].find_element("css selector", ".bound").text
        assert value != "not measured" and figure["within"] is True, (name, figure)
        assert shown_bound in (f"{bound:g} {figure['unit']}", "500 ms", "2 s"), (
            f"{name}'s bound is shown as {shown_bound!r}, the journal says {bound}")
        assert "yes" in rows[name].text, f"{name} is not shown as within its bound"

    broke = browser.find_element("id", "what-broke")
    assert not broke.find_elements("css selector", ".broke"), broke.text
    assert broke.text.startswith("Nothing"), broke.text
    quiet = browser.find_element("id", "not-judged")
    assert NOT_REQUIRED in quiet.get_attribute("textContent")
    assert "No task was in progress" in quiet.get_attribute("textContent")
    assert "could not decide" not in browser.find_element("tag name", "body").text
    shot = screenshot_dir() / "gameday-page-passing.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000


def test_a_failed_page_leads_with_the_failed_verdict_and_a_replay_that_reruns_it(
        browser: Any, tmp_path: Path) -> None:
    path, journal = failed_fleet_stop(tmp_path)
    order = [v["checker"] for v in journal["verdicts"]]
    assert order.index("kill_obeyed") < order.index("within_bound:actions_after_request")
    browser.get(write_page(path).as_uri())
    assert browser.find_element("css selector", ".status").text == "FAILED"
    assert_headline_matches(browser.find_element("id", "headline").text, journal)

    broke = [b.text for b in browser.find_elements("css selector", "#what-broke .broke")]
    assert len(broke) == 2, f"what broke: {broke}"
    assert broke[0].startswith("within_bound:actions_after_request: failed"), broke
    assert "4 actions, past its bound of 1 actions" in broke[0], broke[0]
    assert broke[1].startswith("kill_obeyed: could not decide, and this game day must"), broke
    assert not any(NOT_REQUIRED in b for b in broke), broke

    replay = browser.find_element("id", "replay").text
    assert replay == ("pytest scenarios/fleet_stop.py::test_fleet_stop --stack processes "
                      "--seed 7 --agents 3"), replay
    shot = screenshot_dir() / "gameday-page-failed.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000

    # The line reruns it: pytest, started from the checkout, finds exactly that game day
    # with those options (collected only: running it needs a stack).
    words = shlex.split(replay)
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         *words[1:]], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert collected.returncode == 0, collected.stdout + collected.stderr
    assert "1 test collected" in collected.stdout, collected.stdout
    assert words[1] in collected.stdout, collected.stdout


def test_the_terminal_summary_leads_with_the_page_s_answer(tmp_path: Path) -> None:
    path, journal = failed_fleet_stop(tmp_path)
    lines = [line for line, _ in summary_lines(journal, path)]
    told = answer(journal, path)
    assert lines[0] == (f"{journal['game_day']} on processes: failed: "
                        + " · ".join(told.headline)), lines[0]
    assert_headline_matches(lines[0], journal)
    assert any("4 actions, PAST its bound of 1 actions" in line for line in lines), lines
    broke = [line for line in lines if line.strip().startswith("BROKE")]
    assert broke[0].strip().startswith("BROKE within_bound:actions_after_request (failed)")
    assert all(NOT_REQUIRED not in line for line in broke), broke
    assert f"    replay  {told.replay}" in lines
    for line in lines:
        for p99, top in re.findall(r"p99 +([\d.]+) ms +max +([\d.]+) ms", line):
            assert float(p99) <= float(top), f"a p99 above its max: {line}"


def test_a_wake_refused_while_stopped_is_not_drawn_as_a_failure() -> None:
    journal, history = specimen_game_day(2)
    agent = journal["agents"][0]["id"]
    wake = history.invoke("operator:agent_owner", "wake", {"agent_id": agent})
    history.complete(wake, "fail", {"status": 409})
    broken = history.invoke("operator:agent_owner", "create_task", {"agent_id": agent})
    history.complete(broken, "fail", {"status": 422})
    lanes = agent_lanes(journal)
    figure = timeline(journal, history, Clock(0), lanes)
    names = {t.name: t for t in figure.data}
    refused = next(t for n, t in names.items() if n.startswith("refused"))
    assert len(refused.x) == 1 and "wake" in refused.text[0], refused
    assert len(names["operation fail"].x) == 1, "only the 422 is a failed operation"
    assert "create_task" in names["operation fail"].text[0]


def test_the_replay_names_the_file_from_where_pytest_started(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Started in a folder below the rootdir, the node id (`deeper/test_node.py::...`) would
    not find the file from there; the replay line must."""
    pytester.mkpydir("deeper")
    (pytester.path / "deeper" / "test_node.py").write_text(
        "from harness.run.plugin import replay_node\n"
        "def test_the_switch(request):\n"
        "    assert request.node.nodeid == 'deeper/test_node.py::test_the_switch'\n"
        "    got = replay_node(request.node)\n"
        "    assert got == 'test_node.py::test_the_switch', got\n")
    monkeypatch.chdir(pytester.path / "deeper")
    # No asyncio here: its plugin, with no configuration in this folder, warns of its
    # default loop scope into the outer run's summary.
    result = pytester.runpytest_inprocess("test_node.py", "--rootdir", str(pytester.path),
                                          "-p", "no:cacheprovider", "-p", "no:asyncio")
    result.assert_outcomes(passed=1)


def test_a_random_game_day_replays_its_schedule_from_its_journal(tmp_path: Path) -> None:
    journal, history = specimen_game_day(2)
    schedule = generate(11, agents=2, duration_s=5, faults=())
    journal.update(scenario="scenarios/random_gameday.py::test_random_gameday[seed11]",
                   schedule=schedule.to_json())
    path = _written(tmp_path, "random", journal, history)
    words = shlex.split(answer(journal, path).replay)
    assert words == ["pytest", "scenarios/random_gameday.py", "--stack", "processes",
                     "--replay", str(path)], words
    assert from_journal(words[-1]) == schedule, "--replay would not read this schedule back"
