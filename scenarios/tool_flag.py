"""Game day: a tool flag stops one tool of one agent, and leaves its other tools and the
agents beside it at work (DESIGN §2.4 scopes).

    pytest scenarios/tool_flag.py --stack processes

Two agents call shell and write_file in turn; the owner sets a flag on `shell` for one of
them. Once its daemon acknowledged the flag, the puppet's ledger (outside the system under
test: each request carries back the result of the call answered before it) must show every
shell call the model asks for refused ("kill flag set for tool shell"), judged by
`stopped_tool_not_run`, while its write_file calls go on, and the other agent's shell too.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import pytest

from harness.act.client import json_of
from harness.act.expect import rule
from harness.record.gameday import GameDay

# Shell's arguments change every step; write_file's do not, so the loop detector is set
# out of reach: the agent must be stopped by the flag alone, not by its guard's loop layer.
SHELL_AND_WRITE = {"name": "shell_and_write", "steps": [{"cycle": [
    {"shell": "echo {step} >> shell.log"},
    {"write_file": {"path": "notes.txt", "content": "one more line"}}]}]}
CALLS_AFTER = 4  # of each tool after the acknowledgement: enough to see them go on


@pytest.mark.checkers("stopped_tool_not_run")
@pytest.mark.decides("stopped_tool_not_run")
async def test_a_tool_flag_stops_that_tool_only(gameday: GameDay) -> None:
    day, owner = gameday, gameday.as_("agent_owner")
    flagged, beside = [await day.agent(SHELL_AND_WRITE, guard={"loop_repeats": 1000},
                                       owner="agent_owner") for _ in range(2)]
    for a in (flagged, beside):
        json_of(await owner.create_task(a), 201)
    await day.until.all_working([flagged, beside])
    json_of(await owner.stop_tool(flagged, "shell"))
    acked_ns = await day.until.tool_flag_acknowledged(flagged, "shell")

    async def results(agent: dict[str, Any]) -> dict[str, list[str]]:
        """What came back of each call the model asked for after the acknowledgement."""
        found: dict[str, list[str]] = {"shell": [], "write_file": []}
        for asked, back in pairwise(await day.endpoints.puppet.actions(agent["id"])):
            if asked.at_ns > acked_ns and asked.tool in found and back.tool_results:
                found[asked.tool].append(back.tool_results[-1])
        return found

    async def enough() -> tuple[dict[str, list[str]], dict[str, list[str]]] | None:
        mine, theirs = await results(flagged), await results(beside)
        counts = (len(mine["shell"]), len(mine["write_file"]), len(theirs["shell"]))
        return (mine, theirs) if min(counts) >= CALLS_AFTER else None
    mine, theirs = await day.until.condition(
        enough, 60, f"the agents did not each ask for {CALLS_AFTER} shell and write_file calls "
        "after the tool flag was acknowledged: a tool flag must leave the agent at work")
    stopped = [r for r in mine["write_file"] if '"written"' not in r]
    rule(not stopped, f"the flag on shell stopped agent {flagged['slug']}'s write_file too: "
         f"{len(stopped)} of its {len(mine['write_file'])} calls failed, e.g. {stopped[:1]}")
    refused = [r for r in theirs["shell"] if "kill flag" in r]
    rule(not refused, f"the flag on agent {flagged['slug']}'s shell stopped agent "
         f"{beside['slug']}'s shell too ({len(refused)} of {len(theirs['shell'])} refused)")
