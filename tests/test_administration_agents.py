"""/administration's agents in a real headless Chromium, as an on-call engineer uses them: a
per-agent kill asks for confirmation and a reason, as the fleet button does; the Kill and
Resume buttons follow the agent's state; an agent created after the page loaded appears
without a reload, its spend with it; after a stop the page says what it did (agents
stopped, sessions cancelled, tasks requeued, each daemon's answer); failed tasks and guard
trips show with their reasons; at 390 px the switch is on screen; no request 404s (the
favicon once did). Screenshots stay under reports/ (COVEY_SCREENSHOT_DIR)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx

from covey.orchestrator import GuardTripReport
from covey.testing.plane import World
from harness.act.browser import chromium, in_browser, pull_fleet_switch, screenshot_dir, sign_in
from harness.stack.waiting import eventually

PASSWORD = "correct horse battery"
SECURITY = "security@acme.test"


async def _working_agents(world: World, n: int) -> list[str]:
    agents = [(await world.agent())["id"] for _ in range(n)]
    for a in agents:
        await world.task(a, "hold")
    for a in agents:
        await world.wait_working(a)
    return agents


def _row_state(driver: Any, agent_id: str) -> dict[str, Any]:
    """What the page shows of one agent: its status, and which of its buttons are shown."""
    state: dict[str, Any] = driver.execute_script("""
        const row = document.querySelector(`#agents tbody tr[data-agent-id="${arguments[0]}"]`);
        if (!row) { return null; }
        const shown = (sel) => { const el = row.querySelector(sel);
                                 return !!el && el.checkVisibility(); };
        return {status: row.querySelector('.status').textContent,
                spent: row.querySelector('.spent').textContent,
                kill: shown('summary.kill'), resume: shown('button.resume'),
                confirm: shown('button.kill-confirm')};""", agent_id)
    return state


def _in_row(driver: Any, agent_id: str, selector: str) -> Any:
    return driver.find_element(
        "css selector", f'#agents tbody tr[data-agent-id="{agent_id}"] {selector}')


async def _shown(driver: Any, agent_id: str, want: dict[str, Any], what: str) -> None:
    seen: list[dict[str, Any]] = [{}]

    async def matches() -> bool:
        seen[0] = await in_browser(_row_state, driver, agent_id) or {}
        return all(seen[0].get(k) == v for k, v in want.items())
    try:
        await eventually(matches, 20, f"the page never showed {what}", interval=0.2)
    except AssertionError as missed:
        raise AssertionError(f"{missed}; the agent's row showed {seen[0]}") from None


async def _signed_in(world: World, driver: Any) -> None:
    await in_browser(sign_in, driver, world.plane.url, SECURITY, PASSWORD)

    async def live() -> bool:
        return bool(await in_browser(driver.execute_script,
                                      "return document.body.dataset.live === 'on'"))
    await eventually(live, 10, "the page never connected to the event stream")


async def test_an_agent_kill_asks_for_a_reason_and_its_buttons_follow_its_state(
        world: World, browser: Any) -> None:
    agent, bystander = await _working_agents(world, 2)
    await _signed_in(world, browser)
    await _shown(browser, agent, {"kill": True, "resume": False, "confirm": False},
                 "Kill (and no Resume) for a working agent")

    # One click opens the confirmation; it stops nothing.
    await in_browser(lambda: _in_row(browser, agent, "summary.kill").click())
    await _shown(browser, agent, {"confirm": True}, "the kill's confirmation")
    # Confirming without a reason is refused by the form itself: nothing is even sent.
    await in_browser(lambda: _in_row(browser, agent, "button.kill-confirm").click())
    missing, message = await in_browser(browser.execute_script, (
        "const row = document.querySelector(`tr[data-agent-id=\"${arguments[0]}\"]`);"
        "return [row.querySelector('.kill-reason').validity.valueMissing,"
        " document.getElementById('message').textContent]"), agent)
    assert missing and message == "", f"a kill without a reason was sent: {message!r}"
    assert not await world.db.fetchval("SELECT killed FROM agents WHERE id=$1",
                                       uuid.UUID(agent))

    await in_browser(lambda: _in_row(browser, agent, ".kill-reason").send_keys("rm -rf loop"))
    await in_browser(lambda: _in_row(browser, agent, "button.kill-confirm").click())
    await _shown(browser, agent, {"status": "killed", "kill": False, "resume": True},
                 "Resume (and no Kill) for the killed agent")
    detail = await world.db.fetchval(
        "SELECT detail FROM audit_log WHERE action='agent.kill' AND target=$1", agent)
    assert json.loads(detail)["reason"] == "rm -rf loop"
    assert (await in_browser(_row_state, browser, bystander))["kill"], \
        "the other agent's Kill went away with the killed one's"

    # What the stop did, as the kill's answer says it.
    summary = await in_browser(lambda: browser.find_element("id", "stop-summary").text)
    for said in ("1 agent(s) stopped", "1 session(s) cancelled",
                 "1 task(s) back in the backlog"):
        assert said in summary, f"the stop's summary lacks {said!r}: {summary!r}"
    daemons = await in_browser(lambda: [li.text for li in browser.find_elements(
        "css selector", "#stop-summary .daemons li")])
    slug = await world.db.fetchval("SELECT slug FROM agents WHERE id=$1", uuid.UUID(agent))
    assert len(daemons) == 1 and daemons[0].startswith(f"{slug}: its daemon "), daemons
    await in_browser(browser.save_screenshot,
                      str(screenshot_dir() / "administration-agent-killed.png"))

    await in_browser(lambda: _in_row(browser, agent, "button.resume").click())
    await _shown(browser, agent, {"kill": True, "resume": False},
                 "Kill again once the agent was resumed")
    assert not await world.db.fetchval("SELECT killed FROM agents WHERE id=$1",
                                       uuid.UUID(agent))


async def test_an_agent_created_after_the_page_loaded_appears_without_a_reload(
        world: World, browser: Any) -> None:
    await _signed_in(world, browser)
    loaded_at = await in_browser(browser.execute_script, "return window.coveyPageLoadedAt")
    late = (await world.agent("late-comer", budget_usd=2.5))["id"]
    await _shown(browser, late, {"kill": True, "resume": False, "spent": "$0.0000"},
                 "the agent created after it loaded, with its spend and its Kill")
    budget = await in_browser(lambda: _in_row(browser, late, ".budget").text)
    assert budget == "$2.5000", budget
    # Its spend follows as its daemon reports costs (written as covey/api/daemon.py does).
    await world.db.execute("INSERT INTO cost_entries (agent_id, session_id, usd, tokens)"
                           " VALUES ($1, NULL, 0.1234, 900)", uuid.UUID(late))
    await _shown(browser, late, {"spent": "$0.1234"}, "the agent's spend as it grew")
    # Its switch works like any other's: the form was made for this agent.
    await in_browser(lambda: _in_row(browser, late, "summary.kill").click())
    await in_browser(lambda: _in_row(browser, late, ".kill-reason").send_keys("not ours"))
    await in_browser(lambda: _in_row(browser, late, "button.kill-confirm").click())
    await _shown(browser, late, {"status": "killed", "resume": True}, "the late agent killed")
    assert await in_browser(browser.execute_script,
                             "return window.coveyPageLoadedAt") == loaded_at, "it reloaded"


async def test_after_the_fleet_stop_the_page_says_what_it_did(world: World,
                                                              browser: Any) -> None:
    agents = await _working_agents(world, 2)
    await _signed_in(world, browser)
    await in_browser(pull_fleet_switch, browser, "drill: the whole fleet")

    async def summarised() -> str | None:
        text: str = await in_browser(lambda: browser.find_element("id", "stop-summary").text)
        return text if "agent(s) stopped" in text else None
    summary = await eventually(summarised, 20, "the page never said what the stop did")
    requeued = await world.db.fetchval(
        "SELECT count(*) FROM task_transitions tt JOIN backlog_tasks t ON t.id=tt.task_id"
        " WHERE t.agent_id = ANY($1::uuid[]) AND tt.from_state='in_progress'"
        " AND tt.to_state='open'", [uuid.UUID(a) for a in agents])
    for said in ("2 agent(s) stopped", "2 session(s) cancelled",
                 f"{requeued} task(s) back in the backlog"):
        assert said in summary, f"the summary lacks {said!r}: {summary!r}"
    daemons = await in_browser(lambda: {li.get_attribute("data-session-id"): li.text
                                         for li in browser.find_elements(
                                             "css selector", "#stop-summary .daemons li")})
    cancelled = {str(r["id"]) for r in await world.db.fetch(
        "SELECT id FROM sessions WHERE agent_id = ANY($1::uuid[]) AND state='cancelled'",
        [uuid.UUID(a) for a in agents])}
    assert set(daemons) == cancelled, f"daemons said: {daemons}, cancelled: {cancelled}"
    assert all(": its daemon " in text for text in daemons.values()), daemons
    await in_browser(browser.save_screenshot,
                      str(screenshot_dir() / "administration-stop-summary.png"))


async def test_failed_tasks_and_guard_trips_show_with_their_reasons(
        world: World, browser: Any) -> None:
    crashing, looping = (await world.agent())["id"], (await world.agent())["id"]
    await _signed_in(world, browser)
    # A task its daemons lost as often as they may (COVEY_MAX_DAEMON_RETRIES, 5): one crash
    # more and it fails, saying why.
    task = await world.task(crashing, "crash")
    await world.db.execute("UPDATE backlog_tasks SET daemon_retries=5 WHERE id=$1",
                           uuid.UUID(task["id"]))
    await world.wait_task(task["id"], "failed", 60)
    # The loop detector trips a working agent, as its daemon would report it.
    hold = await world.task(looping, "hold")
    await world.wait_working(looping)
    session = await world.db.fetchrow(
        "SELECT s.id, t.claim_token FROM sessions s JOIN backlog_tasks t ON t.claimed_by=s.id"
        " WHERE t.id=$1", uuid.UUID(hold["id"]))
    refused = await world.plane.orch.guard_trip(
        session["id"], uuid.UUID(hold["id"]), session["claim_token"],
        GuardTripReport("loop", "repeated search_orders 4 times with identical arguments",
                        7, {}))
    assert refused is None, refused

    async def shown() -> tuple[str, str] | None:
        tasks, trips = await in_browser(browser.execute_script, (
            "return [document.getElementById('failed-tasks').textContent,"
            " document.getElementById('guard-trips').textContent]"))
        return (tasks, trips) if "daemon was lost" in tasks and "search_orders" in trips \
            else None
    tasks, trips = await eventually(shown, 20, "the failed task and the guard trip never "
                                               "showed on the page")
    assert "failed: its daemon was lost 6 times" in tasks, tasks
    assert "loop guard: repeated search_orders 4 times" in trips, trips


async def test_at_390_px_the_switch_is_on_screen_and_nothing_404s(world: World) -> None:
    await _working_agents(world, 2)
    with chromium(window="390,844") as phone:
        phone.implicitly_wait(10)
        await _signed_in(world, phone)
        layout = await in_browser(phone.execute_script, """
            const inside = (el) => { const r = el.getBoundingClientRect();
                                     return r.width > 0 && r.left >= 0
                                            && r.right <= window.innerWidth; };
            return {scroll: document.documentElement.scrollWidth, width: window.innerWidth,
                    fleet: inside(document.getElementById('fleet-kill')),
                    kills: Array.from(document.querySelectorAll('#agents summary.kill'))
                                .map(inside)};""")
        assert layout["scroll"] <= layout["width"], f"the page scrolls sideways: {layout}"
        assert layout["fleet"], f"the fleet switch is off screen at 390 px: {layout}"
        assert layout["kills"] and all(layout["kills"]), f"an agent's Kill is off screen: {layout}"
        await in_browser(phone.save_screenshot,
                          str(screenshot_dir() / "administration-390px.png"))
        errors = [e for e in await in_browser(phone.get_log, "browser")
                  if e["level"] == "SEVERE"]
        assert not errors, f"the page logged errors (a 404?): {errors}"
    async with httpx.AsyncClient(base_url=world.plane.url) as client:
        for path in ("/favicon.ico", "/administration/static/favicon.svg"):
            r = await client.get(path)
            assert r.status_code == 200 and r.headers["content-type"].startswith(
                "image/svg+xml"), (path, r.status_code)


async def test_a_kill_from_the_page_without_a_reason_is_a_clear_400(world: World) -> None:
    agent = (await world.agent())["id"]
    client = httpx.AsyncClient(base_url=world.plane.url, timeout=30)
    try:
        page = await client.get("/administration")
        csrf = page.text.split('name="csrf" value="')[1].split('"')[0]
        await client.post("/administration/login",
                          data={"csrf": csrf, "email": SECURITY, "password": PASSWORD})
        token = (await client.get("/administration")).text.split('data-csrf="')[1].split('"')[0]
        for path in (f"/administration/agents/{agent}/kill", "/administration/fleet/kill"):
            r = await client.post(path, data={"csrf": token, "reason": "  "},
                                  headers={"Accept": "application/json"})
            assert r.status_code == 400 and "reason" in r.json()["error"], (path, r.text)
    finally:
        await client.aclose()
    assert not await world.db.fetchval(
        "SELECT killed FROM agents WHERE id=$1", uuid.UUID(agent))
    assert not (await world.auditor.get("/api/v1/fleet")).json()["fleet_killed"]
