"""Game day: a kill during a long shell command ends that command at once, and nothing the
sandbox started outlives the kill, an orphan that made a session of its own included.

    pytest scenarios/long_tool_call_cut.py --stack processes

The command writes a wall-clock tick every 20 ms, and so does a loop it starts with `setsid`
in the background (the way an `rm -rf` in a subshell escapes a process group). The harness
reads both tick files, on the machine, after the daemon acknowledged: no tick may come after
that acknowledgement. A daemon that obeyed `kill` only once its tool call ended, or that
exited 3 leaving the loop running, failed this; the control plane's rows looked fine.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from harness.act.client import json_of
from harness.act.expect import rule
from harness.record.gameday import GameDay

TICK = "while :; do date +%s%N >> {0}; sleep 0.02; done"
LONG_COMMAND = {"steps": [{"shell": (f"(setsid sh -c '{TICK.format('orphan.ticks')}' &) ; "
                                     f"{TICK.format('command.ticks')}")}]}
SLACK_MS = 20  # one tick: a tick being written as the kill landed


def last_tick_ns(path: Path) -> int | None:
    lines = path.read_text().split() if path.is_file() else []
    return int(lines[-1]) if lines else None


@pytest.mark.decides("kill_obeyed", "in_progress_requeued", "nothing_left_of_killed_agent")
async def test_a_kill_cuts_the_command_under_way(gameday: GameDay) -> None:
    day, owner = gameday, gameday.as_("agent_owner")
    if await day.remains("nobody", record=False) is None:
        pytest.skip(f"the {day.stack} stack's sandboxes are not on this machine")
    agent = await day.agent(LONG_COMMAND, owner="agent_owner")
    await day.agent("silent")  # a neighbour, so the kill has someone to leave alone
    json_of(await owner.create_task(agent, "run the long command"), 201)

    async def ticking() -> bool:
        boxes = [b for b in await day.sandboxes(agent["id"]) if b["state"] == "running"]
        return bool(boxes) and all(
            last_tick_ns(day.home_dir(agent["id"], b["id"]) / f) is not None
            for b in boxes for f in ("command.ticks", "orphan.ticks"))
    if day.endpoints.data_dir is None:  # the ticks are inside the container
        await day.until.all_working([agent])
    else:
        await day.until.condition(ticking, 60, "the long command never started ticking")

    killed = json_of(await owner.kill_agent(agent))
    await day.until.all_sandboxes_gone([agent])
    await day.until.nothing_left_of([agent], broken="a process the killed sandbox started "
                                    "outlived the kill")
    session = next(s for s in json_of(await day.people["auditor"].sessions(agent["id"]))
                   if s["id"] in killed["sessions_cancelled"])
    if day.endpoints.data_dir is not None:
        ticks_stopped_at_the_ack(day, agent["id"], session)
    cut = session.get("tool_cut") or {}
    rule(cut.get("tool") == "shell" and cut.get("all_gone") is True,
         f"the session record does not say the shell command under way was cut: {cut}")


def ticks_stopped_at_the_ack(day: GameDay, agent_id: str, session: dict[str, Any]) -> None:
    """On the machine: neither loop wrote a tick after the daemon acknowledged the kill."""
    rule(session.get("kill_acked_at") is not None,
         f"the daemon never acknowledged the kill (confirmed by "
         f"{session.get('kill_confirmed_by')}), so it cut nothing itself")
    acked_ns = datetime.fromisoformat(session["kill_acked_at"]).timestamp() * 1e9
    for name in ("command.ticks", "orphan.ticks"):
        last = last_tick_ns(day.home_dir(agent_id, session["sandbox_id"]) / name)
        late_ms = 0 if last is None else (last - acked_ns) / 1e6
        rule(late_ms <= SLACK_MS, f"the {name.split('.')[0]} of the shell call under way "
             f"went on {late_ms:.0f} ms after the kill was acknowledged: the kill did not "
             "cut the tool call")
