"""The on-call engineer who has to find the switch: while agents work, they open
/administration in a real browser, press the red button, say why, and watch the fleet stop.

    pytest scenarios/fleet_stop_from_the_page.py [--stack processes|containers|target]

Judged by the same checkers as fleet_stop. The operation's acknowledgement is the moment
the page shows the switch's answer (what the engineer sees); the time from the click to the
last daemon's exit goes into the journal.
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime
from typing import Any

import pytest

from harness.act.browser import chromium, click, pull_fleet_switch, require_chromium, sign_in
from harness.act.client import json_of
from harness.record.gameday import GameDay
from harness.stack.waiting import eventually

BEHAVIOURS = ("slow_writer", "silent", "well_behaved")


@pytest.mark.decides("no_action_after_kill_ack", "each_task_done_once_after_resume",
                     "no_wake_of_stopped_agent", "every_fault_healed", "kill_obeyed")
async def test_fleet_stop_from_the_page(gameday: GameDay, agents_per_game_day: int) -> None:
    require_chromium()
    day = gameday
    email, password = f"on-call.{day.run_id}@{day.fake.domain_word()}.test", "on-call pager 7"
    json_of(await day.people["org_admin"].add_member(email, password, "security"), 201)
    agents = [await day.agent(BEHAVIOURS[i % 3]) for i in range(agents_per_game_day)]
    for a in agents:
        await day.task(a["id"])

    # The agents that never stop on their own are at work (a slow writer may already be
    # done when the last container starts).
    await day.until.all_working([a for a in agents if a["behaviour"] == "silent"])
    with chromium() as page:
        page.implicitly_wait(10)
        await asyncio.to_thread(sign_in, page, day.endpoints.url, email, password)

        async def on_the_page(press: Any, *args: Any) -> Any:
            """Press, then wait until the page shows the switch's answer."""
            await asyncio.to_thread(page.execute_script,
                                    "delete document.getElementById('message').dataset.outcome")
            await asyncio.to_thread(press, page, *args)

            async def answered() -> tuple[str, str] | None:
                outcome, text = await asyncio.to_thread(page.execute_script, "const m = "
                    "document.getElementById('message'); return [m.dataset.outcome, m.textContent]")
                return (outcome, text) if outcome else None
            outcome, said = await eventually(answered, 30, "the page never showed the answer")
            assert outcome == "ok", f"the page refused the switch: {said}"
            return await day.people["auditor"].fleet()
        clicked_ns = time.time_ns()
        r = await day.operate("security", "kill_fleet", {}, lambda: on_the_page(
            pull_fleet_switch, "game day: agents out of hand"))
        assert json_of(r)["fleet_killed"], "the red button did not stop the fleet"
        await day.read_tasks()  # right after the kill's ok: what it requeued

        await day.until.all_sandboxes_gone(agents)
        boxes = [s for a in agents for s in await day.sandboxes(a["id"])]
        exits = [datetime.fromisoformat(s["daemon_exited_at"]).timestamp() * 1e9
                 for s in boxes if s["daemon_exited_at"] and s["exit_code"] == 3]
        assert exits, "no daemon exited with code 3 after the red button"
        click_to_exit_ms = round((max(exits) - clicked_ns) / 1e6, 1)
        day.journal_sections["page_stop"] = {
            "click_to_last_daemon_exit_ms": click_to_exit_ms, "daemons_stopped": len(exits)}
        day.notes.append(f"red button to the last daemon's exit: {click_to_exit_ms} ms")
        for a in agents:
            await day.endpoints.puppet.assign(a["id"], "well_behaved")
        r = await day.operate("security", "resume_fleet", {},
                              lambda: on_the_page(click, "fleet-resume"))
        assert not json_of(r)["fleet_killed"], "resume from the page left the fleet stopped"

    await day.until.all_tasks_done()
