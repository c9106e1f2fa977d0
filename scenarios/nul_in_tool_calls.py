"""Game day: models that write NUL bytes into their tool calls, their tools' results and
their answers.

    pytest scenarios/nul_in_tool_calls.py --stack processes

Issue 23: one puppet call `write_file{"content": "A\\u0000B"}` crashed the control plane's
handler of the daemon's event (Postgres stores no NUL) six times; its task was requeued five
times and failed. The control plane now cleans what a daemon carries (covey/protocol.py) and
records that it did. Every task must be done, at the first attempt, its NUL cleaned.
"""

from __future__ import annotations

import pytest

from harness.act.client import json_of
from harness.record.gameday import GameDay

NUL = "\u0000"
# The tool's argument (its event's detail), the tool's output (back to the model), the file
# read back (the same), a path and a command no system call takes (the tool's error, not the
# daemon's), and the answer (the task's result): a NUL in each.
NUL_WRITER = {"name": "nul_writer", "steps": [
    {"write_file": {"path": "nul.txt", "content": f"A{NUL}B"}},
    {"shell": "printf 'C\\000D'; cat nul.txt"},
    {"read_file": "nul.txt"},
    {"read_file": f"nul{NUL}.txt"},
    {"shell": f"echo {NUL}"},
    {"finish": f"wrote A{NUL}B"},
]}
AGENTS, TASKS_EACH = 3, 2


@pytest.mark.checkers("every_fault_healed")
async def test_a_models_nul_never_fails_a_task(gameday: GameDay) -> None:
    day, auditor = gameday, gameday.people["auditor"]
    outcome = day.outcome
    agents = [await day.agent(NUL_WRITER) for _ in range(AGENTS)]
    for a in agents:
        for _ in range(TASKS_EACH):
            await day.task(a["id"])
    tasks = await day.until.all_tasks_done(90)

    assert len(tasks) == AGENTS * TASKS_EACH, tasks
    for task in tasks.values():
        assert task["daemon_retries"] == 0, (
            f"task {task['id']} was requeued {task['daemon_retries']} times: a NUL in its "
            f"model's output lost its daemon")
        assert task["result"] == "wrote A\ufffdB", (
            f"task {task['id']}'s result is {task['result']!r}, not its answer with the "
            f"NUL replaced")
    for a in agents:
        events = json_of(await auditor.recording(a["id"]))
        cleaned = [e for e in events if (e["kind"], e["status"]) == ("protocol", "cleaned")]
        types = sorted({e["detail"]["type"] for e in cleaned})
        assert types == ["event", "task_done"], (
            f"agent {a['slug']}'s recording does not say its NUL was cleaned from both its "
            f"tool call and its answer: {[e['detail'] for e in cleaned]}")
        tools = [e["detail"] for e in events if e["kind"] == "tool"]
        assert {"path": "nul.txt", "content": "A\ufffdB"} in [t["args"] for t in tools], (
            f"agent {a['slug']}'s write_file was not recorded, cleaned: {tools}")

    await day.judged(outcome)
