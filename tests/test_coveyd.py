"""End to end in processes: the real control plane starts the real `coveyd` per sandbox,
which works tasks against a scripted OpenAI-compatible endpoint through its guard."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from covey.testing import ACTS_AFTER_ACK
from covey.testing.plane import Plane, World, make_world, start_plane
from harness.act.puppet import Puppet
from harness.judge.checkers import (
    KILL_DELIVERY_F,
    FinalState,
    Verdict,
    kill_obeyed,
    no_action_after_kill_ack,
)
from harness.load.kills import acknowledged_at, late_requests
from harness.nemesis import FaultProxy
from harness.record.gameday import kill_delivery
from harness.record.history import History
from harness.record.remains import remains_of
from harness.stack.base import free_port
from harness.stack.waiting import eventually
from tests.conftest import COVEYD


@pytest.fixture
async def cworld(database_url: str, tmp_path: Path,
                 model: tuple[str, Puppet]) -> AsyncIterator[World]:
    async with start_plane(database_url, tmp_path, COVEYD, model_url=model[0]) as plane, \
            make_world(plane) as world:
        yield world


async def _sandbox(world: World, agent_id: str) -> dict[str, Any]:
    async def gone() -> dict[str, Any] | None:
        rows = (await world.org_admin.get(f"/api/v1/agents/{agent_id}/sandboxes")).json()
        done = [s for s in rows if s["state"] == "gone"]
        return done[-1] if done else None
    return await eventually(gone, 20, "sandbox never went away")


async def _session_of(world: World, agent_id: str, sandbox_id: str) -> dict[str, Any]:
    """The session of that sandbox, once its daemon's last word is on record."""
    async def recorded() -> dict[str, Any] | None:
        rows = (await world.auditor.get(f"/api/v1/agents/{agent_id}/sessions")).json()
        found = [s for s in rows if s["sandbox_id"] == sandbox_id and s["daemon_stop"]]
        return found[0] if found else None
    return await eventually(recorded, 10, f"sandbox {sandbox_id}'s session never recorded why "
                            "its daemon stopped")


def _daemon_log(plane: Plane, sandbox_id: str) -> str:
    return (plane.data_dir / "logs" / f"{sandbox_id}.log").read_text()


async def test_an_agent_works_a_task_and_falls_asleep(cworld: World) -> None:
    agent = await cworld.agent()
    task = await cworld.task(agent["id"], "model:well_behaved")
    await cworld.wait_task(task["id"], "done")
    detail = (await cworld.org_admin.get(
        f"/api/v1/agents/{agent['id']}/tasks/{task['id']}")).json()
    assert detail["result"] == "wrote notes.txt"
    sandbox = await _sandbox(cworld, agent["id"])
    assert sandbox["exit_code"] == 0
    assert "exiting with 0" in _daemon_log(cworld.plane, sandbox["id"])
    assert "told to sleep" in _daemon_log(cworld.plane, sandbox["id"]).splitlines()[-1]
    session = await _session_of(cworld, agent["id"], sandbox["id"])
    assert (session["daemon_stop"], session["kill_sent_at"]) == ("sleep", None)
    rec = (await cworld.org_admin.get(f"/api/v1/agents/{agent['id']}/recording")).json()
    assert [e["detail"]["tool"] for e in rec if e["kind"] == "tool"] == ["write_file", "shell"]
    cost = await cworld.db.fetchval("SELECT sum(usd) FROM cost_entries WHERE agent_id=$1",
                                    uuid.UUID(agent["id"]))
    assert cost > 0


async def test_a_kill_ends_the_daemon_with_code_3(
        cworld: World, model: tuple[str, Puppet]) -> None:
    puppet = model[1]
    agent = await cworld.agent()
    task = await cworld.task(agent["id"], "model:silent")

    async def busy() -> bool:
        return len(puppet.actions(agent["id"])) >= 3
    await eventually(busy, 20, "the agent never got going")
    invoked_ns = time.time_ns()
    r = await cworld.security.post(f"/api/v1/agents/{agent['id']}/kill")
    acknowledged_ns = time.time_ns()
    assert r.status_code == 200
    # The answer came once the daemon had acknowledged the kill: it obeyed, not hung up.
    assert r.json()["sessions_acknowledged"] == r.json()["sessions_confirmed"] \
        == r.json()["sessions_cancelled"] != []
    sandbox = await _sandbox(cworld, agent["id"])
    assert sandbox["exit_code"] == 3
    log = _daemon_log(cworld.plane, sandbox["id"])
    assert "kill switch" in log and "daemon terminates immediately" in log
    assert "exiting with 3" in log and "obeyed a kill message (reason kill-switch)" in log
    session = await _session_of(cworld, agent["id"], sandbox["id"])
    assert (session["daemon_stop"], session["kill_confirmed_by"]) == ("kill", "kill_ack")
    # The daemon's own ack and the control plane's times are on one clock (one host's wall
    # clock): sent, then acknowledged by the daemon, then read by the control plane.
    assert session["kill_sent_at"] <= session["kill_acked_at"] <= session["kill_confirmed_at"]
    assert await cworld.task_state(task["id"]) == "open"
    # Every request carries its send stamp, taken before the puppet saw it; none was sent
    # after the kill was acknowledged (the rule the game days and the load's killer judge by).
    ledger = [asdict(e) for e in puppet.actions(agent["id"])]
    assert ledger and all(e["sent_ns"] is not None and e["sent_ns"] <= e["at_ns"]
                          for e in ledger), ledger
    assert late_requests(ledger, acknowledged_at(acknowledged_ns, [session])) == []
    assert _judged(agent["id"], invoked_ns, acknowledged_ns, session, puppet).valid is True


async def test_a_daemon_that_asks_its_model_after_acking_the_kill_fails_the_kill_rule(
        database_url: str, tmp_path: Path, model: tuple[str, Puppet]) -> None:
    """The send stamps do not let a daemon off: one that acts after its own kill_ack looks
    obedient from everywhere else (kill_ack in time, exit 3), and is caught."""
    url, puppet = model
    async with start_plane(database_url, tmp_path, ACTS_AFTER_ACK, model_url=url) as plane, \
            make_world(plane) as world:
        agent = await world.agent()
        await world.task(agent["id"], "model:silent")

        async def busy() -> bool:
            return len(puppet.actions(agent["id"])) >= 2
        await eventually(busy, 20, "the agent never got going")
        invoked_ns = time.time_ns()
        r = await world.security.post(f"/api/v1/agents/{agent['id']}/kill")
        acknowledged_ns = time.time_ns()
        assert r.status_code == 200
        assert r.json()["sessions_acknowledged"] == r.json()["sessions_cancelled"] != []
        sandbox = await _sandbox(world, agent["id"])
        assert sandbox["exit_code"] == 3
        session = await _session_of(world, agent["id"], sandbox["id"])
        assert session["kill_confirmed_by"] == "kill_ack"

        history = _judged_history(agent["id"], invoked_ns, acknowledged_ns, session, puppet)
        assert kill_obeyed(history, FinalState()).valid is True  # it looks obedient
        verdict = no_action_after_kill_ack(history, FinalState())
        assert verdict.valid is False, verdict.message
        assert f"agent {agent['id']} acted 1 time after the kill_agent" in verdict.message
        assert "acknowledged by its daemon" in verdict.message
        assert "by its daemon's send stamps" in verdict.message
        # The load's killer judges it the same way.
        ledger = [asdict(e) for e in puppet.actions(agent["id"])]
        late = late_requests(ledger, acknowledged_at(acknowledged_ns, [session]))
        assert len(late) == 1 and late[0]["sent_ns"] is not None, late


def _judged_history(agent_id: str, invoked_ns: int, acknowledged_ns: int,
                    session: dict[str, Any], puppet: Puppet) -> History:
    """The kill, its delivery and the agent's model requests, recorded as a game day does."""
    history = History()
    invoke = history.record("invoke", "operator:security", "kill_agent",
                            {"agent_id": agent_id}, time_ns=invoked_ns)
    history.complete(invoke, "ok", {"status": 200}, time_ns=acknowledged_ns)
    delivery = kill_delivery(agent_id, session)
    assert delivery is not None
    history.observe("observer", KILL_DELIVERY_F, delivery, time_ns=delivery["sent_ns"])
    for entry in puppet.actions(agent_id):
        history.observe(f"agent:{agent_id}", "action", {"sent_ns": entry.sent_ns},
                        time_ns=entry.at_ns)
    return history


def _judged(agent_id: str, invoked_ns: int, acknowledged_ns: int, session: dict[str, Any],
            puppet: Puppet) -> Verdict:
    history = _judged_history(agent_id, invoked_ns, acknowledged_ns, session, puppet)
    return no_action_after_kill_ack(history, FinalState())


@pytest.mark.parametrize(("behaviour", "layer", "title"), [
    ("identical_loop", "loop", "stopped by the loop detector: repeated shell 3 times with "
                               "identical arguments"),
    ("ab_cycle", "loop", "stopped by the loop detector: cycled through read_file, "
                         "write_file 2 times"),
    # Refused before the call that would cross the cap, saying what was left.
    ("runaway_spend", "budget", "stopped by the budget guard: $"),
    ("failing_tool_hammer", "circuit_breaker", "stopped by the circuit breaker: http_request "
                                               "failed 3 times in a row"),
])
async def test_a_guard_trip_stops_records_alerts_and_holds_the_agent(
        cworld: World, behaviour: str, layer: str, title: str) -> None:
    # A large token budget, so that the dollar budget is the one a runaway spend meets,
    # and long answers allowed, so that it meets it in a few calls.
    agent = await cworld.agent(slug=f"bot-{behaviour.replace('_', '-')}",
                               guard={"max_tokens": 10_000_000,
                                      "max_completion_tokens": 100_000})
    task = await cworld.task(agent["id"], f"model:{behaviour}")
    sandbox = await _sandbox(cworld, agent["id"])
    assert sandbox["exit_code"] == 2
    assert f"its own guard tripped ({layer}:" in _daemon_log(cworld.plane, sandbox["id"])
    session = await _session_of(cworld, agent["id"], sandbox["id"])
    assert session["daemon_stop"] == "guard" and session["daemon_stop_detail"].startswith(layer)
    assert await cworld.task_state(task["id"]) == "open"
    got = (await cworld.auditor.get(f"/api/v1/agents/{agent['id']}")).json()
    assert (got["killed"], got["kill_origin"]) == (True, "guard")
    rec = (await cworld.auditor.get(f"/api/v1/agents/{agent['id']}/recording")).json()
    trips = [e for e in rec if e["kind"] == "guard" and e["status"] == "tripped"]
    assert len(trips) == 1 and trips[0]["detail"]["layer"] == layer
    assert trips[0]["detail"]["last_actions"], "the trip captured no actions"
    # Whatever the layer, the agent spent no more than its budget: each call was reserved.
    spent = await cworld.db.fetchval("SELECT coalesce(sum(usd), 0) FROM cost_entries WHERE "
                                     "agent_id=$1", uuid.UUID(agent["id"]))
    assert 0 < spent <= got["budget_usd"], (spent, got["budget_usd"])
    notes = (await cworld.org_admin.get("/api/v1/notifications")).json()
    titles = [n["title"] for n in notes if n["kind"] == "agent_tripped"]
    assert len(titles) == 1 and title in titles[0], titles
    assert agent["slug"] in titles[0]
    # Not woken again on its own for the same input.
    await asyncio.sleep(1.5)
    assert await cworld.db.fetchval("SELECT count(*) FROM sessions WHERE agent_id=$1",
                                    uuid.UUID(agent["id"])) == 1
    # A human resume lets it run again.
    mark = await cworld.event_mark()
    await cworld.released(await cworld.org_admin.post(f"/api/v1/agents/{agent['id']}/resume"),
                          mark, [agent["id"]])


async def test_cutting_the_control_channel_stops_the_agent_within_the_lease(
        database_url: str, tmp_path: Path,
        model: tuple[str, Puppet]) -> None:
    port = free_port()
    lease_s = 1.0
    async with FaultProxy("127.0.0.1", port, name="control-channel", control_port=None) as proxy:
        async with start_plane(database_url, tmp_path, COVEYD, model_url=model[0],
                               lease_ms=int(lease_s * 1000), port=port,
                               public_ws_url=f"ws://127.0.0.1:{proxy.port}/api/daemon/ws"
                               ) as plane, make_world(plane) as world:
            agent = await world.agent()
            await world.task(agent["id"], "model:silent")

            async def busy() -> bool:
                return len(model[1].actions(agent["id"])) >= 2
            await eventually(busy, 20, "the agent never got going")
            await proxy.blackhole(60)  # longer than the test: it heals on exit
            cut_at = time.monotonic()
            handles = await world.db.fetch(
                "SELECT handle FROM sandboxes WHERE agent_id=$1 AND state='running'",
                uuid.UUID(agent["id"]))
            assert len(handles) == 1
            pid = int(handles[0]["handle"])

            async def exited() -> bool:
                return _exited(pid)
            await eventually(exited, lease_s + 10, "the daemon kept running after the cut",
                             interval=0.01)
            stopped_after = time.monotonic() - cut_at
            sandbox = await _sandbox(world, agent["id"])
            assert sandbox["exit_code"] == 3
            assert "failing closed" in _daemon_log(plane, sandbox["id"])
            assert "its kill-flag lease ran out" in _daemon_log(plane, sandbox["id"])
            # Generous on a shared 2-core machine: the lease plus a margin.
            assert stopped_after < lease_s + 1.5, stopped_after


# A tool call that outlives its daemon unless the daemon ends it: a `sleep` well past the test.
LONG_SLEEP = {"name": "long sleep", "steps": [{"shell": "sleep 120"}]}


async def test_a_daemon_whose_control_plane_is_gone_fails_closed_at_once(
        database_url: str, tmp_path: Path, model: tuple[str, Puppet]) -> None:
    """Its channel reset as a crashed plane's is: the daemon stops at once (not at the end of
    its lease), exits 3, ends its tool call's processes and says why in its last log line."""
    port, lease_s = free_port(), 5.0
    async with FaultProxy("127.0.0.1", port, name="control-channel", control_port=None) as proxy:
        async with start_plane(database_url, tmp_path, COVEYD, model_url=model[0],
                               lease_ms=int(lease_s * 1000), port=port,
                               public_ws_url=f"ws://127.0.0.1:{proxy.port}/api/daemon/ws"
                               ) as plane, make_world(plane) as world:
            agent = await world.agent()
            model[1].assign(agent["id"], LONG_SLEEP)
            await world.task(agent["id"], "sleep")

            async def sleeping() -> bool:
                return any("sleep 120" in p for p in remains_of("processes", agent["id"]) or [])
            await eventually(sleeping, 20, "the agent's long tool call never started")
            [row] = await world.db.fetch(
                "SELECT id, handle FROM sandboxes WHERE agent_id=$1 AND state='running'",
                uuid.UUID(agent["id"]))
            await proxy.reset(60)  # every connection reset; heals on exit
            cut_at = time.monotonic()

            async def all_gone() -> bool:
                return _exited(int(row["handle"])) and not any(
                    "sleep 120" in p for p in remains_of("processes", agent["id"]) or [])
            await eventually(all_gone, lease_s + 10, "the daemon or its tool call ran on "
                             "after its control channel was reset", interval=0.01)
            stopped_after = time.monotonic() - cut_at
            sandbox = await _sandbox(world, agent["id"])
            assert sandbox["id"] == str(row["id"])
            log = _daemon_log(plane, sandbox["id"])
            assert sandbox["exit_code"] == 3, (
                f"a daemon that lost its control plane exited {sandbox['exit_code']}, not 3 "
                f"(failing closed): {log[-600:]}")
            assert "control channel dropped" in log and "failing closed" in log, log[-600:]
            # At once, well within the lease it no longer waits for (generous: 2 shared cores).
            assert stopped_after < lease_s - 2, (
                f"the daemon stopped {stopped_after:.2f} s after its channel was reset: it "
                f"waited for its lease ({lease_s} s) instead of failing closed at once")


def _exited(pid: int) -> bool:
    """Gone, or a zombie waiting for the control plane to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


async def test_a_changed_task_releases_a_guard_hold_and_nothing_else(cworld: World) -> None:
    agent = await cworld.agent()
    task = await cworld.task(agent["id"], "model:identical_loop")
    assert (await _sandbox(cworld, agent["id"]))["exit_code"] == 2
    r = await cworld.org_admin.patch(f"/api/v1/agents/{agent['id']}/tasks/{task['id']}",
                                     json={"body": "model:well_behaved"})
    assert r.status_code == 200, r.text
    await cworld.wait_task(task["id"], "done")
    got = (await cworld.auditor.get(f"/api/v1/agents/{agent['id']}")).json()
    assert got["killed"] is False
    rec = (await cworld.auditor.get(f"/api/v1/agents/{agent['id']}/recording")).json()
    assert [e["status"] for e in rec if e["kind"] == "guard"] == ["tripped", "released"]

    # An agent stopped by its own switch is not released by a changed task.
    other = await cworld.task(agent["id"], "model:well_behaved")
    await cworld.wait_task(other["id"], "done")
    await cworld.org_admin.post(f"/api/v1/agents/{agent['id']}/kill")
    parked = await cworld.task(agent["id"], "model:well_behaved")
    r = await cworld.org_admin.patch(f"/api/v1/agents/{agent['id']}/tasks/{parked['id']}",
                                     json={"title": "changed"})
    assert r.status_code == 200
    await asyncio.sleep(1.0)
    assert await cworld.task_state(parked["id"]) == "open"
    got = (await cworld.auditor.get(f"/api/v1/agents/{agent['id']}")).json()
    assert (got["killed"], got["kill_origin"]) == (True, "agent")
    # Work already done (or in progress) cannot be changed under the agent's feet.
    done = await cworld.org_admin.patch(f"/api/v1/agents/{agent['id']}/tasks/{other['id']}",
                                        json={"title": "x"})
    assert done.status_code == 409 and done.json()["error"] == "The task is done"


async def test_a_sandbox_sees_none_of_the_control_planes_secrets(
        cworld: World, model: tuple[str, Puppet],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgresql://secret@db/covey")
    monkeypatch.setenv("COVEY_MODEL_API_KEY", "sk-for-the-model")
    agent = await cworld.agent()
    task = await cworld.task(agent["id"], "model:print_env")
    await cworld.wait_task(task["id"], "done")
    [printed] = [e for e in model[1].actions(agent["id"]) if e.step == 1]
    env = printed.tool_results[0]
    assert "COVEY_AGENT_ID=" in env and "COVEY_MODEL_API_KEY=sk-for-the-model" in env
    assert "DATABASE_URL" not in env and "secret@db" not in env
