"""The game day's page in a real headless Chromium (Debian's chromium and chromium-driver,
driven by Selenium) with the network off: it renders with no console error, fetches nothing
but itself, draws one timeline lane per agent and the fault window where the journal says.
A screenshot stays in reports/ for people to look at."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.act.puppet import LocalPuppet, Puppet
from harness.nemesis import Nemesis
from harness.record.gameday import GameDay
from harness.report.page import write_page
from harness.report.specimen import FAULT_ID, specimen_game_day
from harness.stack.base import Endpoints

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
SCREENSHOTS = Path(os.environ.get("COVEY_SCREENSHOT_DIR", "reports"))


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        if os.environ.get("COVEY_REQUIRE_BROWSER") == "1":
            pytest.fail("COVEY_REQUIRE_BROWSER=1 but Debian's chromium and chromium-driver "
                        "are not installed (apt-get install -y chromium chromium-driver)")
        pytest.skip("no Chromium here: apt-get install -y chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update",
                 "--no-first-run", "--window-size=1300,2400"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        # The network is off: a page that needed anything from outside would show it.
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd("Network.emulateNetworkConditions", {
            "offline": True, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1})
        yield driver
    finally:
        driver.quit()


def specimen_page(tmp_path: Path, agents: int) -> tuple[Path, dict[str, Any]]:
    journal, history = specimen_game_day(agents)
    path = tmp_path / f"specimen-{agents}.json"
    history.to_jsonl(path.with_suffix(".history.jsonl"))
    journal["history"] = path.with_suffix(".history.jsonl").name
    path.write_text(json.dumps(journal))
    return write_page(path), journal


def test_the_page_renders_offline_with_a_lane_per_agent_and_the_fault_window(
        browser: Any, tmp_path: Path) -> None:
    page, journal = specimen_page(tmp_path, agents=20)
    browser.get_log("performance")  # what came before this page is not its doing
    browser.get(page.as_uri())
    browser.find_element("css selector", "#timeline .ytick")  # drawn
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, f"the page logged errors to the console: {errors}"
    requested = [json.loads(e["message"])["message"]["params"]["request"]["url"]
                 for e in browser.get_log("performance")
                 if '"Network.requestWillBeSent"' in e["message"]]
    assert page.as_uri() in requested, f"the page's own load was not seen: {requested}"
    outside = [u for u in requested if not u.startswith(("file:", "data:", "blob:", "about:"))]
    assert not outside, f"the page asked the network for {outside}"

    lanes = browser.execute_script(
        "return Array.from(document.querySelectorAll('#timeline .ytick text'))"
        ".map(t => t.textContent)")
    agents = {f"{a['slug']} ({a['behaviour']})" for a in journal["agents"]}
    assert set(lanes) == agents | {"operators"}, f"lanes drawn: {lanes}"
    assert len(lanes) == len(journal["agents"]) + 1

    # The fault's rectangle spans, in pixels, the journal's start and heal on the x axis.
    fault = journal["faults"][0]
    kill_x = browser.execute_script(
        "return document.getElementById('timeline').layout.shapes"
        ".find(s => s.name === 'fleet-kill').x0")
    drawn = browser.execute_script("""
        const gd = document.getElementById('timeline');
        const i = gd.layout.shapes.findIndex(s => s.name === arguments[0]);
        const path = gd.querySelector(`.shapelayer path[data-index="${i}"]`);
        const box = path.getBBox();
        const x = gd._fullLayout.xaxis;
        return {left: box.x, width: box.width, x0: gd.layout.shapes[i].x0,
                x1: gd.layout.shapes[i].x1, p0: x.l2p(gd.layout.shapes[i].x0) + x._offset,
                p1: x.l2p(gd.layout.shapes[i].x1) + x._offset};""", f"fault:{FAULT_ID}")
    # On the axis, in ms after the switch (the kill at 0): 3000 ms before the kill (the
    # specimen's fault runs 2 s to 3.5 s, the kill comes at 5 s), 1500 ms long, as its start
    # and heal in the journal say.
    assert kill_x == 0
    assert drawn["x0"] == pytest.approx(-(5000 - 2000), abs=1e-3)
    assert drawn["x1"] - drawn["x0"] == pytest.approx(
        (fault["healed_ns"] - fault["started_ns"]) / 1e6, abs=1e-3)
    # On the screen: the drawn rectangle is where the axis puts those instants.
    assert drawn["left"] == pytest.approx(drawn["p0"], abs=2)
    assert drawn["left"] + drawn["width"] == pytest.approx(drawn["p1"], abs=2)

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shot = SCREENSHOTS / "gameday-page.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000


def test_a_failed_verdict_leads_the_page_with_its_events(browser: Any, tmp_path: Path) -> None:
    journal, history = specimen_game_day(3)
    journal["status"] = "failed"
    journal["verdicts"][0] = {"checker": "no_action_after_kill_ack", "valid": False,
                              "message": "agent-1 acted 40 ms after the kill was "
                                         "acknowledged", "evidence": [0, 1]}
    path = tmp_path / "failed.json"
    history.to_jsonl(path.with_suffix(".history.jsonl"))
    journal["history"] = path.with_suffix(".history.jsonl").name
    path.write_text(json.dumps(journal))
    browser.get(write_page(path).as_uri())
    first = browser.find_element("css selector", ".broke")
    assert "no_action_after_kill_ack: failed" in first.text, first.text
    assert "agent-1 acted 40 ms after the kill was acknowledged" in first.text
    assert "events 0, 1" in first.text
    assert browser.find_element("css selector", ".status").text == "FAILED"


def test_the_specimen_has_the_shape_of_a_real_journal(tmp_path: Path) -> None:
    """The page's test and benchmark read specimens; a real journal must look the same."""
    endpoints = Endpoints("http://127.0.0.1:9", "a@x.test", "pw", LocalPuppet(Puppet()),
                          "http://127.0.0.1:9/v1", {"covey": "test"}, Nemesis())
    day = GameDay(name="shape", stack="processes", endpoints=endpoints, seed=1,
                  report_dir=tmp_path, scenario="scenarios/fleet_stop.py::test_fleet_stop")
    real = json.loads(day.journal("completed", [], [], {}).read_text())
    specimen, _ = specimen_game_day(2)
    assert set(real) == set(specimen)
    assert set(real["measurements"]["time_to_stop"]) == set(
        specimen["measurements"]["time_to_stop"])
    assert day.journal_path is not None
    assert write_page(day.journal_path).exists()  # a real journal renders too
