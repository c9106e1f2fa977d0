"""/administration in a real headless Chromium: the on-call engineer finds the switch, pulls
it with a reason and watches the fleet stop without reloading; an auditor sees the state and
no button; a post without the page's CSRF token is refused; resume brings the agents back.
Screenshots stay under reports/ (COVEY_SCREENSHOT_DIR) for people to look at."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from covey.testing.plane import World
from harness.act.browser import (
    click,
    in_browser,
    pull_fleet_switch,
    screenshot_dir,
    sign_in,
)
from harness.stack.waiting import eventually

PASSWORD = "correct horse battery"


def _statuses(driver: Any) -> dict[str, str]:
    """Each agent's status on the page, with "+session" while the page shows a live one."""
    return {row.get_attribute("data-agent-id"):
            row.find_element("css selector", ".status").text
            + ("+session" if row.find_element("css selector", ".session").text else "")
            for row in driver.find_elements("css selector", "#agents tbody tr")}


async def _working_agents(world: World, n: int) -> list[str]:
    agents = [(await world.agent())["id"] for _ in range(n)]
    for a in agents:
        await world.task(a, "hold")
    for a in agents:
        await world.wait_working(a)
    return agents


async def _live(driver: Any) -> None:
    async def on() -> bool:
        return bool(await in_browser(driver.execute_script,
                                      "return document.body.dataset.live === 'on'"))
    await eventually(on, 10, "the page never connected to the event stream")


@pytest.fixture
async def signed_in_security(world: World, browser: Any) -> AsyncIterator[Any]:
    await in_browser(sign_in, browser, world.plane.url, "security@acme.test", PASSWORD)
    await _live(browser)
    yield browser


async def test_security_pulls_the_red_button_and_sees_the_fleet_stop_live(
        world: World, browser: Any) -> None:
    agents = await _working_agents(world, 2)
    await in_browser(sign_in, browser, world.plane.url, "security@acme.test", PASSWORD)
    await _live(browser)
    loaded_at = await in_browser(browser.execute_script, "return window.coveyPageLoadedAt")
    assert set(agents) <= set((await in_browser(_statuses, browser)).keys())

    await in_browser(pull_fleet_switch, browser, "runaway spend on the billing agents")

    async def stopped() -> bool:
        state = await in_browser(browser.execute_script,
                                  "return document.getElementById('fleet-state').dataset.killed")
        statuses = await in_browser(_statuses, browser)
        return state == "true" and all(statuses[a] == "killed" for a in agents)
    await eventually(stopped, 15, "the page never showed the emergency stop and killed agents")
    banner = await in_browser(lambda: browser.find_element("id", "fleet-state").text)
    assert "EMERGENCY STOP" in banner and "security@acme.test" in banner \
        and "runaway spend on the billing agents" in banner, banner
    assert await in_browser(browser.execute_script, "return window.coveyPageLoadedAt") \
        == loaded_at, "the page reloaded: the stop must show live"
    await in_browser(browser.save_screenshot,
                      str(screenshot_dir() / "administration-fleet-stopped.png"))

    fleet = (await world.auditor.get("/api/v1/fleet")).json()
    assert fleet["fleet_killed"] and fleet["fleet_killed_reason"] \
        == "runaway spend on the billing agents"
    audit = await world.db.fetchrow(
        "SELECT actor_id, detail FROM audit_log WHERE action='fleet.kill' AND org_id=$1",
        world.org.id)
    assert audit["actor_id"] == world.org.humans["security"]
    assert json.loads(audit["detail"])["reason"] == "runaway spend on the billing agents"

    # Resume from the page: the agents come back to their held work.
    await in_browser(click, browser, "fleet-resume")
    for a in agents:
        await world.wait_working(a)

    async def running() -> bool:
        state = await in_browser(browser.execute_script,
                                  "return document.getElementById('fleet-state').dataset.killed")
        statuses = await in_browser(_statuses, browser)
        return state == "false" and all(statuses[a] == "working+session" for a in agents)
    await eventually(running, 15, "the page never showed the fleet running again")
    await in_browser(browser.save_screenshot,
                      str(screenshot_dir() / "administration-fleet-resumed.png"))


async def test_a_live_update_leaves_the_confirmation_open_while_the_reason_is_typed(
        world: World, browser: Any) -> None:
    """The red button's confirmation stays open through the page's live updates: agents
    change status all the time, and a refresh that closed it would take the form away from
    an on-call engineer halfway through typing why (and their next click lands elsewhere)."""
    other, = await _working_agents(world, 1)
    await in_browser(sign_in, browser, world.plane.url, "security@acme.test", PASSWORD)
    await _live(browser)
    await in_browser(click, browser, "fleet-kill")
    await in_browser(lambda: browser.find_element("id", "fleet-reason").send_keys("the bill"))

    # Another agent stops meanwhile: its status event makes the page re-read the fleet,
    # which fills in the kill origin (the event alone carries only the status).
    r = await world.security.post(f"/api/v1/agents/{other}/kill", json={"reason": "drill"})
    assert r.status_code == 200, r.text

    async def refreshed() -> bool:
        origin = await in_browser(
            browser.execute_script, "return document.querySelector("
            "'tr[data-agent-id=\"' + arguments[0] + '\"] .origin').textContent", other)
        return bool(origin)
    await eventually(refreshed, 15, "the page never re-read the agents after the kill")
    still_open, typed = await in_browser(browser.execute_script, (
        "return [document.getElementById('fleet-stop').open, "
        "document.getElementById('fleet-reason').value]"))
    assert still_open, "a live update closed the fleet stop's confirmation"
    assert typed == "the bill", f"the reason being typed was lost: {typed!r}"


async def test_an_auditor_sees_the_state_and_no_button(world: World, browser: Any) -> None:
    await _working_agents(world, 1)
    await world.security.post("/api/v1/fleet/kill", json={"reason": "drill"})
    await in_browser(sign_in, browser, world.plane.url, "auditor@acme.test", PASSWORD)
    banner = await in_browser(lambda: browser.find_element("id", "fleet-state").text)
    assert "EMERGENCY STOP" in banner and "drill" in banner, banner
    browser.implicitly_wait(0)
    for button in ("fleet-kill", "fleet-confirm", "fleet-resume"):
        assert not await in_browser(browser.find_elements, "id", button), \
            f"an auditor sees the {button} button"
    assert not await in_browser(browser.find_elements, "css selector", "button.kill")
    await in_browser(browser.save_screenshot,
                      str(screenshot_dir() / "administration-auditor.png"))


async def _session(world: World, email: str) -> httpx.AsyncClient:
    """A browser-like client signed in through the page's form."""
    client = httpx.AsyncClient(base_url=world.plane.url, timeout=30)
    page = await client.get("/administration")
    csrf = page.text.split('name="csrf" value="')[1].split('"')[0]
    r = await client.post("/administration/login",
                          data={"csrf": csrf, "email": email, "password": PASSWORD})
    assert r.status_code == 303 and r.headers["location"] == "/administration", r.text
    cookie = r.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie, cookie
    return client


async def test_a_post_without_the_csrf_token_is_refused(world: World) -> None:
    agent = (await world.agent())["id"]
    client = await _session(world, "security@acme.test")
    try:
        page = await client.get("/administration")
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp, csp
        token = page.text.split('data-csrf="')[1].split('"')[0]
        for path in ("/administration/fleet/kill", f"/administration/agents/{agent}/kill"):
            for data in ({"reason": "forged"}, {"reason": "forged", "csrf": "0" * 64}):
                r = await client.post(path, data=data)
                assert r.status_code == 403, (path, data, r.status_code)
        assert not (await world.auditor.get("/api/v1/fleet")).json()["fleet_killed"]
        assert await world.db.fetchval(
            "SELECT count(*) FROM audit_log WHERE action IN ('fleet.kill','agent.kill')") == 0
        # With the token it goes through, and the audit log says who, what and why.
        r = await client.post(f"/administration/agents/{agent}/kill",
                              data={"csrf": token, "reason": "looping"},
                              headers={"Accept": "application/json"})
        assert r.status_code == 200, r.text
        row = await world.db.fetchrow(
            "SELECT actor_id, target, detail FROM audit_log WHERE action='agent.kill'")
        assert (row["actor_id"], row["target"], json.loads(row["detail"])["reason"]) == (
            world.org.humans["security"], agent, "looping")
    finally:
        await client.aclose()


async def test_a_role_that_may_not_act_gets_a_403_even_with_the_token(world: World) -> None:
    agent = (await world.agent())["id"]
    for role in ("auditor", "controlling"):
        client = await _session(world, f"{role}@acme.test")
        try:
            page = await client.get("/administration")
            token = page.text.split('data-csrf="')[1].split('"')[0]
            for path in ("/administration/fleet/kill", f"/administration/agents/{agent}/kill"):
                r = await client.post(path, data={"csrf": token, "reason": "x"})
                assert r.status_code == 403, (role, path, r.status_code)
        finally:
            await client.aclose()
    agent_owner = await _session(world, "agent_owner@acme.test")
    try:
        page = await agent_owner.get("/administration")
        assert 'id="fleet-kill"' not in page.text, "only org_admin and security see the red button"
        token = page.text.split('data-csrf="')[1].split('"')[0]
        r = await agent_owner.post("/administration/fleet/kill", data={"csrf": token})
        assert r.status_code == 403
    finally:
        await agent_owner.aclose()
    assert not (await world.auditor.get("/api/v1/fleet")).json()["fleet_killed"]


async def test_the_notification_links_to_the_page(world: World) -> None:
    await world.security.post("/api/v1/fleet/kill")
    notes = (await world.org_admin.get("/api/v1/notifications")).json()
    link = next(n["link"] for n in notes if n["kind"] == "fleet_killed")
    r = await world.anonymous.get(link)
    assert r.status_code == 200 and 'id="login"' in r.text, r.status_code
