"""A kill obeyed is told apart from one that was not: a daemon deaf to `kill` exits 3 too,
with the same log lines, once its lease runs out; only its session record and the kill's
checker show that it never acknowledged the kill. Real control plane, real WebSocket, the
scripted daemon started by the process backend."""

from __future__ import annotations

import time
from typing import Any

from covey.testing.plane import World
from harness.judge.checkers import KILL_DELIVERY_F, FinalState, Verdict, kill_obeyed
from harness.record.gameday import kill_delivery
from harness.record.history import History
from harness.stack.waiting import eventually


async def _kill_and_judge(world: World, body: str) -> tuple[dict[str, Any], dict[str, Any],
                                                            Verdict]:
    """Kill an agent whose daemon holds a task with `body`; record the kill and its delivery
    as a game day does, and judge it."""
    agent = await world.agent()
    task = await world.task(agent["id"], body)
    await world.wait_task(task["id"], "in_progress")
    history = History()
    invoke = history.invoke("operator:security", "kill_agent", {"agent_id": agent["id"]})
    r = await world.security.post(f"/api/v1/agents/{agent['id']}/kill")
    assert r.status_code == 200, r.text
    history.complete(invoke, "ok", {"status": 200})

    async def confirmed() -> dict[str, Any] | None:
        rows = (await world.auditor.get(f"/api/v1/agents/{agent['id']}/sessions")).json()
        done = [s for s in rows if s["kill_confirmed_by"] and s["daemon_stop"]]
        return done[0] if done else None
    session = await eventually(confirmed, 15, "the kill's confirmation never reached the "
                               "session record")
    delivery = kill_delivery(agent["id"], session)
    assert delivery is not None
    history.observe("observer", KILL_DELIVERY_F, delivery, time_ns=delivery["sent_ns"])
    return r.json(), session, kill_obeyed(history, FinalState())


async def _exit_code(world: World, agent_id: str) -> int:
    async def gone() -> int | None:
        rows = (await world.auditor.get(f"/api/v1/agents/{agent_id}/sandboxes")).json()
        codes = [s["exit_code"] for s in rows if s["state"] == "gone"]
        return codes[0] if codes else None
    code: int = await eventually(gone, 15, "the sandbox never went away")
    return code


async def test_a_daemon_deaf_to_kill_fails_the_kill_checker(world: World) -> None:
    started = time.monotonic()
    report, session, verdict = await _kill_and_judge(world, "deaf")
    # From the outside it looks like obedience: confirmed before the answer, exit code 3.
    assert report["sessions_confirmed"] == report["sessions_cancelled"] != []
    assert await _exit_code(world, report["agents_stopped"][0]) == 3
    # The record and the checker tell the truth.
    assert report["sessions_acknowledged"] == []
    assert (session["kill_confirmed_by"], session["daemon_stop"]) == ("lease", "lease")
    assert verdict.valid is False
    assert "daemon did not obey the kill: it never acknowledged it and stopped only when its " \
           "kill-flag lease ran out" in verdict.message, verdict.message
    assert time.monotonic() - started < 30
    metrics = (await world.anonymous.get("/metrics")).text
    assert 'covey_kill_confirmation_seconds_count{by="lease"}' in metrics


async def test_a_daemon_that_obeys_passes_the_kill_checker(world: World) -> None:
    report, session, verdict = await _kill_and_judge(world, "hold")
    assert report["sessions_acknowledged"] == report["sessions_cancelled"] != []
    assert (session["kill_confirmed_by"], session["daemon_stop"]) == ("kill_ack", "kill")
    assert await _exit_code(world, report["agents_stopped"][0]) == 3
    assert verdict.valid is True, verdict.message
    assert "acknowledged it within 500.0 ms" in verdict.message
