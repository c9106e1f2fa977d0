"""A kill obeyed is told apart from one that was not: a daemon deaf to `kill` exits 3 too,
with the same log lines, once its lease runs out; only its session record and the kill's
checker show that it never acknowledged the kill. And it does not get that far: the runner
tears its sandbox down once it has not acknowledged within the kill-ack bound (the second
line), which the record and the checker tell apart from obedience too. Real control plane,
real WebSocket, the scripted daemon started by the process backend."""

from __future__ import annotations

import sys
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from covey.config import ConfigError, Settings
from covey.testing import SCRIPTED_DAEMON
from covey.testing.plane import World, make_world, start_plane
from harness.judge.checkers import KILL_DELIVERY_F, FinalState, Verdict, kill_obeyed
from harness.record.gameday import kill_delivery
from harness.record.history import History
from harness.stack.waiting import eventually


async def _kill_and_judge(world: World, body: str, *, says_why: bool = True
                          ) -> tuple[dict[str, Any], dict[str, Any], Verdict]:
    """Kill an agent whose daemon holds a task with `body`; record the kill and its delivery
    as a game day does, and judge it. `says_why`: the daemon's last word (daemon_stop) is
    awaited on the record too (a torn-down daemon has none)."""
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
        done = [s for s in rows if s["kill_confirmed_by"] and (s["daemon_stop"] or not says_why)]
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


async def test_a_daemon_deaf_to_kill_fails_the_kill_checker(database_url: str,
                                                            tmp_path: Path) -> None:
    """Without the second line (COVEY_KILL_ACK_BOUND_MS=0), the daemon's own fail-closed
    path: it stops when its lease is no longer renewed."""
    async with start_plane(database_url, tmp_path, SCRIPTED_DAEMON, kill_ack_bound_ms=0
                           ) as plane, make_world(plane) as world:
        await _deaf_stops_by_its_lease(world)


async def _deaf_stops_by_its_lease(world: World) -> None:
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


async def test_a_daemon_that_never_acknowledges_is_torn_down_within_the_bound(
        database_url: str, tmp_path: Path) -> None:
    """The second line: a daemon deaf to `kill` under a 20 s lease would act for 20 s; the
    runner tears its sandbox down once it has not acknowledged within the bound, and the
    session records a teardown, never an obeyed kill."""
    bound_s = 0.3
    async with start_plane(database_url, tmp_path, SCRIPTED_DAEMON, lease_ms=20_000,
                           kill_ack_bound_ms=int(bound_s * 1000)) as plane, \
            make_world(plane) as world:
        started = time.monotonic()
        report, session, verdict = await _kill_and_judge(world, "deaf", says_why=False)
        assert report["sessions_cancelled"] != []
        assert report["sessions_confirmed"] == report["sessions_torn_down"] \
            == report["sessions_cancelled"], report
        assert report["sessions_acknowledged"] == report["sessions_not_connected"] == [], report
        assert (session["kill_confirmed_by"], session["daemon_stop"]) == ("teardown", None)
        waited = (datetime.fromisoformat(session["kill_confirmed_at"])
                  - datetime.fromisoformat(session["kill_sent_at"])).total_seconds()
        # The daemon had the whole bound to answer, and was torn down soon after it.
        assert bound_s - 0.005 <= waited < bound_s + 3, f"torn down {waited:.3f} s after the kill"
        # Killed by the runner (SIGKILL of its process group), not exited by its lease.
        assert await _exit_code(world, report["agents_stopped"][0]) == -9
        assert time.monotonic() - started < 15, "the lease, not the second line, stopped it"
        assert verdict.valid is False
        assert "did not obey the kill: it never acknowledged it, and the runner tore its " \
               "sandbox down" in verdict.message, verdict.message
        metrics = (await world.anonymous.get("/metrics")).text
        assert 'covey_kill_confirmation_seconds_count{by="teardown"}' in metrics


async def test_a_sandbox_whose_daemon_has_not_connected_is_torn_down_and_counted(
        database_url: str, tmp_path: Path) -> None:
    """A session started at the instant of a kill: its sandbox runs, its daemon has not
    connected yet, so no kill can reach it. The runner tears the sandbox down, the kill's
    answer counts it (confirmed by a teardown, not obeyed) and its record says so, with no
    kill sent. Before, the answer listed it cancelled and nothing else, and its sandbox died
    of a SIGKILL that nothing recorded."""
    silent = [sys.executable, "-c", "import time; time.sleep(60)"]  # never connects
    async with start_plane(database_url, tmp_path, silent, lease_ms=20_000) as plane, \
            make_world(plane) as world:
        agent = await world.agent()
        await world.task(agent["id"], "hold")

        async def held_here() -> uuid.UUID | None:
            session = await world.db.fetchval(
                "SELECT id FROM sessions WHERE agent_id=$1 AND state='starting'",
                uuid.UUID(agent["id"]))
            runner = plane.orch.runner
            held = session is not None and runner is not None \
                and runner.sandboxes_of([session])
            return session if held else None
        session = await eventually(held_here, 15, "the agent's sandbox never started")

        r = await world.security.post(f"/api/v1/agents/{agent['id']}/kill")
        assert r.status_code == 200, r.text
        report = r.json()
        assert report["sessions_cancelled"] == [str(session)], report
        assert report["sessions_confirmed"] == report["sessions_torn_down"] \
            == report["sessions_not_connected"] == [str(session)], report
        assert report["sessions_acknowledged"] == [], report

        async def recorded() -> dict[str, Any] | None:
            rows = (await world.auditor.get(f"/api/v1/agents/{agent['id']}/sessions")).json()
            return next((s for s in rows if s["kill_confirmed_by"]), None)
        row = await eventually(recorded, 15, "the teardown never reached the session record")
        assert (row["id"], row["kill_sent_at"], row["kill_confirmed_by"]) \
            == (str(session), None, "teardown"), row
        assert row["kill_confirmed_at"] is not None
        assert kill_delivery(agent["id"], row) is None  # no kill sent: nothing to obey
        assert await _exit_code(world, agent["id"]) == -9


async def test_the_replica_that_holds_a_deaf_daemon_tears_it_down(
        database_url: str, tmp_path: Path) -> None:
    """A kill pulled on the replica without the daemon reaches it by NOTIFY; the replica
    holding it holds the second line too, and the kill's own answer reads the teardown."""
    async with start_plane(database_url, tmp_path / "a", SCRIPTED_DAEMON, lease_ms=20_000,
                           kill_ack_bound_ms=500) as a, \
            start_plane(database_url, tmp_path / "b", SCRIPTED_DAEMON, lease_ms=20_000,
                        kill_ack_bound_ms=500) as b, make_world(a) as world:
        agent = await world.agent()
        task = await world.task(agent["id"], "deaf")
        await world.wait_task(task["id"], "in_progress")
        session, node = await world.db.fetchrow(
            "SELECT id, node FROM sessions WHERE agent_id=$1 AND state='running'",
            uuid.UUID(agent["id"]))
        other = b if node == a.orch.node else a
        assert other.orch.hub.session_ids() == []

        token = world.org_admin.headers["Authorization"]
        async with httpx.AsyncClient(base_url=other.url, headers={"Authorization": token}
                                     ) as client:
            r = await client.post(f"/api/v1/agents/{agent['id']}/kill")
        assert r.status_code == 200, r.text
        assert r.json()["sessions_torn_down"] == [str(session)], r.text
        assert r.json()["sessions_acknowledged"] == [], r.text
        assert await _exit_code(world, agent["id"]) == -9


def test_the_kill_ack_bound_is_well_under_the_lease() -> None:
    def bound(**env: str) -> float | None:
        return Settings.from_env({"COVEY_DATA_DIR": "/tmp/x", **env}).kill_ack_bound_s
    assert bound() == 1.0
    assert bound(COVEY_KILL_ACK_BOUND_MS="300") == 0.3
    assert bound(COVEY_LEASE_MS="1000") == 0.5  # never more than half the lease
    assert bound(COVEY_KILL_ACK_BOUND_MS="0") is None  # no second line
    with pytest.raises(ConfigError):
        bound(COVEY_KILL_ACK_BOUND_MS="-1")
