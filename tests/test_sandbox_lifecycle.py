"""DESIGN §2.3 line 7 and §2.5: home restore and sync, warm parking, evictWarm on kill.
A killed sandbox's home is the state of its last sync. Each sandbox row records when its
daemon exited, when the sandbox was gone and its last sync, each when it happened."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from covey.db import DatabaseUnavailable
from covey.sandbox import ProcessProvider, SandboxSpec, processes_marked
from covey.testing.plane import World, make_world, start_plane
from harness.act.puppet import Puppet
from harness.stack.base import free_port
from harness.stack.waiting import eventually
from tests.conftest import COVEYD


@pytest.fixture
async def lworld(database_url: str, tmp_path: Path,
                 model: tuple[str, Puppet]) -> AsyncIterator[World]:
    async with start_plane(database_url, tmp_path, COVEYD, model_url=model[0],
                           warm_sync_s=1) as plane, make_world(plane) as world:
        yield world


def _home_file(world: World, agent_id: str, name: str) -> str | None:
    path = world.plane.data_dir / "homes" / agent_id / name
    return path.read_text() if path.exists() else None


async def _sandboxes(world: World, agent_id: str) -> list[dict[str, Any]]:
    r = await world.org_admin.get(f"/api/v1/agents/{agent_id}/sandboxes")
    rows: list[dict[str, Any]] = r.json()
    return rows


def _left_of(sandbox_id: str) -> list[int]:
    """Live processes of a sandbox, found by the marker every one of them inherits."""
    marker = f"COVEY_SANDBOX_ID={sandbox_id}".encode()
    return processes_marked(frozenset([marker])).get(marker, [])


def _at(stamp: str | None) -> datetime:
    assert stamp is not None, "a time the sandbox row should record is missing"
    return datetime.fromisoformat(stamp)


async def _wait_state(world: World, agent_id: str, state: str) -> dict[str, Any]:
    async def reached() -> dict[str, Any] | None:
        rows = [s for s in await _sandboxes(world, agent_id) if s["state"] == state]
        return rows[-1] if rows else None
    return await eventually(reached, 20, f"no sandbox of {agent_id} became {state}")


async def test_a_kill_loses_what_was_not_synced(lworld: World) -> None:
    world = lworld
    agent = await world.agent()
    done = await world.task(agent["id"], "model:well_behaved")
    await world.wait_task(done["id"], "done")
    await _wait_state(world, agent["id"], "gone")
    # The real falling-asleep synced the home.
    assert _home_file(world, agent["id"], "notes.txt") == "step one\n"

    running = await world.task(agent["id"], "model:write_then_silent")
    await world.wait_task(running["id"], "in_progress")
    sandbox = await _wait_state(world, agent["id"], "running")
    workdir = world.plane.data_dir / "sandboxes" / agent["id"] / sandbox["id"]

    async def wrote() -> bool:
        notes = workdir / "notes.txt"
        return notes.exists() and notes.read_text() == "step two\n"
    await eventually(wrote, 20, "the agent never wrote its second step")
    await world.org_admin.post(f"/api/v1/agents/{agent['id']}/kill")

    async def killed_gone() -> dict[str, Any] | None:
        row = next(s for s in await _sandboxes(world, agent["id"]) if s["id"] == sandbox["id"])
        return row if row["state"] == "gone" else None
    killed = await eventually(killed_gone, 20, "the killed sandbox was never gone")
    assert killed["exit_code"] == 3
    assert _at(killed["daemon_exited_at"]) <= _at(killed["gone_at"]), (
        "the sandbox is recorded gone before its daemon exited")
    assert killed["last_sync_at"] is None, "a killed sandbox synced its work home"
    slept = next(s for s in await _sandboxes(world, agent["id"]) if s["id"] != sandbox["id"])
    assert _at(slept["daemon_exited_at"]) <= _at(slept["gone_at"]) <= _at(slept["last_sync_at"])
    # The home is the state of its last sync: the killed sandbox's write is not in it.
    assert _home_file(world, agent["id"], "notes.txt") == "step one\n"
    # The killed sandbox's own copy is kept as evidence.
    assert (workdir / "notes.txt").read_text() == "step two\n"


async def test_a_warm_sandbox_stays_up_between_sessions_and_a_kill_tears_it_down(
        lworld: World) -> None:
    world = lworld
    agent = await world.agent(warm_sandbox=True)
    first = await world.task(agent["id"], "model:well_behaved")
    await world.wait_task(first["id"], "done")
    parked = await _wait_state(world, agent["id"], "parked")
    # As covey's: the daemon was not told to sleep; its process runs on, connected and idle.
    assert parked["exit_code"] is None and parked["daemon_exited_at"] is None
    assert int(parked["handle"]) in _left_of(parked["id"]), "the parked sandbox is not up"
    sessions = (await world.auditor.get(f"/api/v1/agents/{agent['id']}/sessions")).json()
    assert [s["daemon_stop"] for s in sessions] == [None], "the warm daemon said it stopped"

    second = await world.task(agent["id"], "model:well_behaved")
    await world.wait_task(second["id"], "done")
    again = await _wait_state(world, agent["id"], "parked")
    assert (again["id"], again["handle"]) == (parked["id"], parked["handle"]), (
        "the next wake did not hand its session to the parked sandbox's daemon")
    assert len(await _sandboxes(world, agent["id"])) == 1

    # The background sync (every second here) brings the parked work home.
    async def synced() -> bool:
        return _home_file(world, agent["id"], "notes.txt") == "step one\n"
    await eventually(synced, 20, "the parked sandbox was never synced")

    r = await world.security.post(f"/api/v1/agents/{agent['id']}/kill")
    assert r.json()["evicted_sandboxes"] == [parked["id"]]
    workdir = world.plane.data_dir / "sandboxes" / agent["id"] / parked["id"]

    async def torn_down() -> dict[str, Any] | None:
        [row] = await _sandboxes(world, agent["id"])
        return row if row["gone_at"] and not workdir.exists() else None
    evicted = await eventually(torn_down, 20, "the evicted warm sandbox was not torn down")
    assert evicted["state"] == "evicted" and evicted["exit_code"] == -9
    assert _at(evicted["daemon_exited_at"]) <= _at(evicted["gone_at"])
    assert _left_of(parked["id"]) == [], "a process of the evicted sandbox is still running"
    assert _home_file(world, agent["id"], "notes.txt") == "step one\n"


class _Undo(Exception):
    """Rolls a test's transaction back."""


class _UpkeepBetween:
    """The wake's connection, on which the runner's upkeep begins to put the parked sandbox
    to sleep (maintain_parked's UPDATE, committed on a connection of its own) right after
    the wake has read it as parked."""

    def __init__(self, conn: Any, pool: Any, sandbox_id: uuid.UUID) -> None:
        self._conn, self._pool, self._sandbox_id = conn, pool, sandbox_id

    async def fetch(self, *args: Any) -> Any:
        rows = await self._conn.fetch(*args)
        await self._pool.execute("UPDATE sandboxes SET state='starting' WHERE id=$1"
                                 " AND state='parked'", self._sandbox_id)
        return rows

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


async def test_a_wake_leaves_a_parked_sandbox_the_upkeep_began_to_put_to_sleep(
        lworld: World) -> None:
    """A wake read the agent's parked sandbox, then set it running by its id alone: had the
    upkeep (the tick's maintain_parked) begun to put it to sleep meanwhile, the new session
    went to a daemon told `sleep`, and was lost. It takes the sandbox only while parked."""
    world = lworld
    orchestrator = world.plane.app.state.orchestrator
    agent = await world.agent(warm_sandbox=True)
    task = await world.task(agent["id"], "model:well_behaved")
    await world.wait_task(task["id"], "done")
    parked = await _wait_state(world, agent["id"], "parked")
    sandbox_id = uuid.UUID(parked["id"])
    async with world.db.acquire() as conn:
        try:
            async with conn.transaction():
                warm, evicted = await orchestrator._take_parked(
                    _UpkeepBetween(conn, world.db, sandbox_id), uuid.UUID(agent["id"]))
                state = await conn.fetchval("SELECT state FROM sandboxes WHERE id=$1",
                                            sandbox_id)
                raise _Undo  # the wake's transaction, rolled back: only the answer counts
        except _Undo:
            pass
    assert warm is None and evicted == [], (
        f"the wake took the sandbox the upkeep was putting to sleep: {warm}, {evicted}")
    assert state == "starting", f"the wake changed the sleeping sandbox's state to {state}"
    await world.db.execute("UPDATE sandboxes SET state='parked' WHERE id=$1", sandbox_id)


async def test_a_sandbox_is_gone_only_once_what_its_daemon_started_is_gone(
        lworld: World, model: tuple[str, Puppet]) -> None:
    """The shell tool runs each command in a session of its own: a process a command leaves
    behind outlives the daemon, and the sandbox is not gone until it is."""
    world = lworld
    agent = await world.agent()
    model[1].assign(agent["id"], {"steps": [
        {"shell": "setsid sleep 300 </dev/null >/dev/null 2>&1 &"}, {"finish": "done"}]})
    task = await world.task(agent["id"], "leave a process behind")
    await world.wait_task(task["id"], "done")
    gone = await _wait_state(world, agent["id"], "gone")
    assert gone["exit_code"] == 0
    assert _left_of(gone["id"]) == [], "the process the agent left behind is still running"
    assert _at(gone["daemon_exited_at"]) < _at(gone["gone_at"]), (
        "the sandbox is recorded gone at its daemon's exit, before what it left was reaped")


async def test_an_idle_parked_sandbox_really_falls_asleep(
        database_url: str, tmp_path: Path, model: tuple[str, Puppet]) -> None:
    async with start_plane(database_url, tmp_path, COVEYD, model_url=model[0],
                           warm_sync_s=3600, warm_idle_s=1) as plane, \
            make_world(plane) as world:
        agent = await world.agent(warm_sandbox=True)
        task = await world.task(agent["id"], "model:well_behaved")
        await world.wait_task(task["id"], "done")
        gone = await _wait_state(world, agent["id"], "gone")
        assert gone["exit_code"] == 0, "the idle warm daemon was not told to sleep"
        assert _home_file(world, agent["id"], "notes.txt") == "step one\n"
        synced = await world.db.fetchval("SELECT last_sync_at FROM sandboxes WHERE id=$1",
                                         uuid.UUID(gone["id"]))
        assert synced is not None


async def test_a_warm_session_ending_after_a_kill_does_not_park_its_sandbox(
        lworld: World) -> None:
    """A warm daemon that runs out of work just as the kill comes: its session's end reaches
    the control plane after the kill's evictWarm ran. Parked then, the killed agent would keep
    a warm sandbox (and its unsynced work) for the next session after resume (a random game
    day found it). The end is judged under the agent's lock: the kill ended the session."""
    world = lworld
    orch = world.plane.app.state.orchestrator
    agent = await world.agent(warm_sandbox=True)
    await world.task(agent["id"], "model:silent")
    await world.wait_working(agent["id"])
    [session] = [s for s in (await world.auditor.get(
        f"/api/v1/agents/{agent['id']}/sessions")).json() if s["state"] == "running"]
    r = await world.security.post(f"/api/v1/agents/{agent['id']}/kill")
    assert r.status_code == 200 and r.json()["evicted_sandboxes"] == []  # nothing parked yet

    assert await orch.end_session(uuid.UUID(session["id"])) is None, (
        "a killed session's late end was taken as falling asleep")
    states = [s["state"] for s in await _sandboxes(world, agent["id"])]
    assert "parked" not in states, f"a killed agent's warm sandbox was parked: {states}"


async def test_a_restarted_plane_tears_down_a_stopped_agents_orphans_at_once(
        world: World, tmp_path: Path) -> None:
    """A control plane SIGKILLed in the middle of a fleet kill leaves its sandboxes behind.
    Started again (same host and port), it tears down at once those of agents a stop holds,
    and gives the others' daemons their lease (here a long one) to stop on their own. A game
    day found a killed agent's containers outliving its fleet kill by the restart plus two
    leases."""
    port = free_port()
    killed, running = await world.agent(), await world.agent()
    assert (await world.security.post(f"/api/v1/agents/{killed['id']}/kill")).status_code == 200
    left: dict[str, asyncio.subprocess.Process] = {}
    for agent in (killed, running):
        sandbox_id = uuid.uuid4()
        await world.db.execute(
            "INSERT INTO sandboxes (id, agent_id, backend, handle, state, node)"
            " VALUES ($1, $2, 'process', '0', 'running', $3)", sandbox_id,
            uuid.UUID(agent["id"]), f"{socket.gethostname()}:{port}:beforethecrash")
        left[agent["id"]] = await asyncio.create_subprocess_exec(
            "sleep", "120", env={"PATH": os.environ["PATH"],
                                 "COVEY_SANDBOX_ID": str(sandbox_id)})
    try:
        async with start_plane(world.plane.database_url, tmp_path / "restarted", COVEYD,
                               port=port, lease_ms=30_000):
            async def settled() -> bool:
                return left[killed["id"]].returncode is not None and await world.db.fetchval(
                    "SELECT state='gone' AND gone_at IS NOT NULL FROM sandboxes"
                    " WHERE agent_id=$1", uuid.UUID(killed["id"]))
            await eventually(settled, 15, "the killed agent's sandbox of the previous life "
                             "was not torn down (and recorded gone) at start-up")
            assert left[running["id"]].returncode is None, (
                "a runnable agent's sandbox of the previous life was torn down before its "
                "daemon's lease had passed")
            assert await world.db.fetchval(
                "SELECT state FROM sandboxes WHERE agent_id=$1",
                uuid.UUID(running["id"])) == "running"
    finally:
        for process in left.values():
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()


def _slow_starts(world: World, monkeypatch: pytest.MonkeyPatch, delay_s: float
                 ) -> asyncio.Event:
    """Every sandbox start returns `delay_s` after its sandbox is up (a container start on a
    loaded host); the event is set when one has returned."""
    runner = world.plane.app.state.orchestrator.runner
    start = runner._provider.start
    returned = asyncio.Event()

    async def slow_to_return(spec: Any) -> str:
        handle: str = await start(spec)
        await asyncio.sleep(delay_s)
        returned.set()
        return handle
    monkeypatch.setattr(runner._provider, "start", slow_to_return)
    return returned


async def test_a_warm_session_that_ends_before_its_start_returns_is_parked(
        lworld: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """A container start can return long after its daemon is up: on a loaded CI host a warm
    agent's daemon did its task and ended its session first, the runner did not know the
    sandbox yet, and the daemon was told to sleep instead of being parked."""
    world = lworld
    returned = _slow_starts(world, monkeypatch, 3)  # the daemon works and ends meanwhile
    agent = await world.agent(warm_sandbox=True)
    task = await world.task(agent["id"], "model:well_behaved")
    await world.wait_task(task["id"], "done")
    assert not returned.is_set(), "the start returned before the session ended: no race"
    parked = await _wait_state(world, agent["id"], "parked")
    await eventually(lambda: asyncio.sleep(0, returned.is_set()), 10, "the start never returned")

    # The runner writes the handle once the start has returned: read at once, on a loaded CI
    # host the row did not have it yet.
    async def handle_recorded() -> dict[str, Any] | None:
        box = next(s for s in await _sandboxes(world, agent["id"]) if s["id"] == parked["id"])
        return box if box["handle"] else None
    box = await eventually(handle_recorded, 10, "the warm sandbox parked during its start "
                           "never had its handle recorded")
    assert box["state"] == "parked", (
        f"the warm sandbox parked during its start lost its state: {box}")


async def test_a_warm_sandbox_evicted_while_it_starts_is_torn_down_once_started(
        lworld: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kill's evictWarm of a sandbox parked before its start call returned: there was no
    handle to destroy yet; it is destroyed as soon as there is, and nothing of it is left."""
    world = lworld
    returned = _slow_starts(world, monkeypatch, 4)
    agent = await world.agent(warm_sandbox=True)
    task = await world.task(agent["id"], "model:well_behaved")
    await world.wait_task(task["id"], "done")
    parked = await _wait_state(world, agent["id"], "parked")
    assert not returned.is_set(), "the start returned before the kill: no race"
    r = await world.security.post(f"/api/v1/agents/{agent['id']}/kill")
    assert r.status_code == 200 and r.json()["evicted_sandboxes"] == [parked["id"]], r.text

    async def nothing_left() -> bool:
        box = next(s for s in await _sandboxes(world, agent["id"]) if s["id"] == parked["id"])
        return returned.is_set() and not _left_of(parked["id"]) and box["gone_at"] is not None
    await eventually(nothing_left, 20, "the warm sandbox evicted while it started was left up")


async def test_a_sandbox_whose_handle_cannot_be_written_is_torn_down_and_its_row_ends(
        lworld: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """The database went away between a sandbox's start and the write of its handle (a game
    day stopped Postgres there): the sandbox ran unwatched and its row said `starting` for
    ever, and a game day's rollback found it. Now the sandbox is torn down (SIGKILL: its
    daemon, refused for its lost session, would otherwise exit on its own), its row ends
    gone, and the task, still open, is done by the next sandbox."""
    world = lworld
    runner = world.plane.app.state.orchestrator.runner
    pool = runner._pool
    failed: list[str] = []

    class HandleWriteFailsOnce:
        """The plane's pool, but the first write of a sandbox's handle meets an outage."""

        def __getattr__(self, name: str) -> Any:
            return getattr(pool, name)

        async def execute(self, sql: str, *args: Any) -> str:
            if "SET handle=" in sql and not failed:
                failed.append(str(args[0]))
                raise DatabaseUnavailable("cannot connect to the database (the test's outage)")
            result: str = await pool.execute(sql, *args)
            return result
    monkeypatch.setattr(runner, "_pool", HandleWriteFailsOnce())
    agent = await world.agent()
    task = await world.task(agent["id"], "model:well_behaved")
    await world.wait_task(task["id"], "done", deadline_s=60)
    assert failed, "no sandbox's handle write was failed: the test tried nothing"

    async def ended() -> dict[str, Any] | None:
        box = next(s for s in await _sandboxes(world, agent["id"]) if s["id"] == failed[0])
        return box if box["state"] not in ("starting", "running") and box["gone_at"] else None
    box = await eventually(ended, 30, "the sandbox whose handle could not be written is still "
                           "`starting` or `running`: nobody watches it")
    assert box["state"] == "gone", box
    assert box["exit_code"] == -9, f"the sandbox was not torn down but ended by itself: {box}"
    assert _left_of(failed[0]) == [], "a process of the sandbox is still alive"


def _record_start_callers(runner: Any, monkeypatch: pytest.MonkeyPatch
                          ) -> list[asyncio.Task[Any]]:
    """The tasks that call the runner's start from now on (a wake's), in order."""
    runner_start = runner.start
    callers: list[asyncio.Task[Any]] = []

    async def start_awaited_by(*args: Any) -> None:
        if (caller := asyncio.current_task()) is not None:
            callers.append(caller)
        await runner_start(*args)
    monkeypatch.setattr(runner, "start", start_awaited_by)
    return callers


async def _cancel_the_only(callers: list[asyncio.Task[Any]]) -> None:
    """Cancel the one start's caller, as the plane's outage deadline cancels a request."""
    assert len(callers) == 1, f"expected one start, saw {len(callers)}"
    callers[0].cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await callers[0]
    assert callers[0].cancelled(), "the start's caller was not cancelled: the test tried nothing"


def _starts_held(runner: Any, monkeypatch: pytest.MonkeyPatch, answer: asyncio.Event
                 ) -> tuple[list[str], asyncio.Event]:
    """From now on the engine starts a sandbox, then keeps its answer back until `answer`
    is set (a container's start answers seconds after it runs). The ids of the sandboxes
    started, and an event set once the first one runs."""
    provider_start = runner._provider.start
    started: list[str] = []
    entered = asyncio.Event()

    async def up_but_slow_to_answer(spec: Any) -> str:
        handle: str = await provider_start(spec)  # the sandbox runs (the engine's thread)
        started.append(str(spec.sandbox_id))
        entered.set()
        await answer.wait()
        return handle
    monkeypatch.setattr(runner._provider, "start", up_but_slow_to_answer)
    return started, entered


async def _session_ended(world: World, sandbox_id: str) -> Any:
    """The session of this sandbox, once it is no longer live; None while it is."""
    row = await world.db.fetchrow("SELECT state FROM sessions WHERE sandbox_id=$1",
                                  uuid.UUID(sandbox_id))
    return row if row is not None and row["state"] not in ("starting", "running") else None


async def test_a_start_whose_caller_is_cancelled_is_carried_through_and_watched(
        lworld: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plane cancels a request it gives up on in an outage (a wake, a trigger, a task's
    PATCH), and the request awaits the sandbox's start: cancelled while the engine was
    starting a container, the start was cut off half-way and the container ran with nobody
    watching it (no exit recorded, its row `starting` for ever). The start is now carried
    through: the sandbox runs its session, its exit is recorded and nothing of it is left."""
    world = lworld
    runner = world.plane.app.state.orchestrator.runner
    callers = _record_start_callers(runner, monkeypatch)
    released = asyncio.Event()  # the engine's answer is on its way back
    started, entered = _starts_held(runner, monkeypatch, released)
    agent = await world.agent()
    task = await world.task(agent["id"], "model:well_behaved")
    await asyncio.wait_for(entered.wait(), 30)
    await _cancel_the_only(callers)
    released.set()

    await world.wait_task(task["id"], "done", deadline_s=60)

    async def ended() -> dict[str, Any] | None:
        box = next(s for s in await _sandboxes(world, agent["id"]) if s["id"] == started[0])
        return box if box["state"] not in ("starting", "running") and box["gone_at"] else None
    box = await eventually(ended, 30, "the sandbox whose start lost its caller is still "
                           "`starting` or `running`: nobody watches it")
    assert box["exit_code"] == 0 and box["daemon_exited_at"], (
        f"the sandbox's own exit was not recorded: {box}")
    assert _left_of(started[0]) == [], "a process of the sandbox is still alive"


async def test_no_process_sandbox_starts_once_its_provider_is_closed(tmp_path: Path) -> None:
    """A wake still in flight at shutdown must not start a sandbox after the provider's
    close: nothing would ever stop it."""
    provider = ProcessProvider([sys.executable, "-c", "import time; time.sleep(30)"],
                               tmp_path / "logs")
    await provider.close()
    spec = _spec(tmp_path)
    with pytest.raises(RuntimeError, match="shutting down"):
        await provider.start(spec)
    assert _left_of(str(spec.sandbox_id)) == [], "a sandbox started after the close"


@pytest.mark.parametrize("waker", ["any", "tick"])
async def test_a_start_that_fails_after_its_caller_is_cancelled_settles_its_session(
        lworld: World, monkeypatch: pytest.MonkeyPatch, waker: str) -> None:
    """The engine refuses a sandbox after the start's caller was cancelled: nobody was left
    to lose the session, which stayed `starting` (its agent busy, its task waiting) until
    the stale-session sweep a token's lifetime later. The runner settles it itself now, as a
    lost daemon's, and the row of the sandbox that never ran ends.

    The caller is whichever wake came first (`any`: nearly always the task's NOTIFY), or
    the scheduler's tick (`tick`: the NOTIFY's wake left out). Once in about a hundred runs
    the tick came first, and the cancelled wake, which the tick then awaited, ended the
    scheduler's loop: the task, which its session never claimed, waited for a wake that
    never came. The tick's wakes run in the background now (tests/test_every.py holds the
    loop to going on whatever a step's tasks do)."""
    world = lworld
    orchestrator = world.plane.app.state.orchestrator
    if waker == "tick":
        monkeypatch.setattr(orchestrator, "wake_notified", lambda agent_id: None)
    runner = orchestrator.runner
    provider_start = runner._provider.start
    callers = _record_start_callers(runner, monkeypatch)
    refused: list[str] = []
    entered, released = asyncio.Event(), asyncio.Event()

    async def refused_once(spec: Any) -> str:
        if refused:
            return str(await provider_start(spec))
        refused.append(str(spec.sandbox_id))
        entered.set()
        await released.wait()
        raise RuntimeError("the engine refused the sandbox (the test's)")
    monkeypatch.setattr(runner._provider, "start", refused_once)
    agent = await world.agent()
    task = await world.task(agent["id"], "model:well_behaved")
    await asyncio.wait_for(entered.wait(), 30)
    await _cancel_the_only(callers)
    released.set()

    await eventually(lambda: _session_ended(world, refused[0]), 20,
                     "the session of the refused sandbox is still live: nobody settled it "
                     "once its start's caller had gone")
    box = next(s for s in await _sandboxes(world, agent["id"]) if s["id"] == refused[0])
    assert box["state"] == "gone" and box["gone_at"], f"the refused sandbox's row: {box}"
    await world.wait_task(task["id"], "done", deadline_s=60)


async def test_a_start_that_hangs_holds_up_no_other_agents_wake_by_the_tick(
        lworld: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler's tick awaited the wakes it made, each until its sandbox had started:
    while the engine hung on one agent's container, no later tick ran, and no other agent
    was woken, no heartbeat fired, no silent daemon swept. Only the tick wakes here (the
    NOTIFY's wake is left out)."""
    world = lworld
    orchestrator = world.plane.app.state.orchestrator
    monkeypatch.setattr(orchestrator, "wake_notified", lambda agent_id: None)
    runner = orchestrator.runner
    provider_start = runner._provider.start
    stuck = await world.agent()
    hung, answer = asyncio.Event(), asyncio.Event()

    async def hangs_for_one(spec: Any) -> str:
        if str(spec.agent_id) == stuck["id"]:
            hung.set()
            await answer.wait()
        return str(await provider_start(spec))
    monkeypatch.setattr(runner._provider, "start", hangs_for_one)
    stuck_task = await world.task(stuck["id"], "model:well_behaved")
    await asyncio.wait_for(hung.wait(), 30)

    other = await world.agent()
    task = await world.task(other["id"], "model:well_behaved")
    try:
        await world.wait_task(task["id"], "done", deadline_s=60)
        assert not answer.is_set() and runner._starting, (
            "the hung start was over before the other agent's task was done: the test "
            "showed nothing")
    finally:
        answer.set()
    await world.wait_task(stuck_task["id"], "done", deadline_s=60)


async def test_a_start_in_flight_when_the_runner_closes_is_cut_and_its_caller_told(
        lworld: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plane shuts down while the engine starts a sandbox (a container's start takes
    seconds): the runner's close cuts the start without waiting for the engine, tells its
    caller that the plane is shutting down (the wake then loses its session, so its task is
    not left in a session nobody runs), and leaves no process of the sandbox running. What
    is left of its row is the next life's to settle (settle_previous_life)."""
    world = lworld
    runner = world.plane.app.state.orchestrator.runner
    runner_start = runner.start
    told: list[BaseException] = []
    started, entered = _starts_held(runner, monkeypatch, asyncio.Event())  # never answers

    async def start_heard(*args: Any) -> None:
        try:
            await runner_start(*args)
        except BaseException as exc:  # what the caller (a wake) is told
            told.append(exc)
            raise
    monkeypatch.setattr(runner, "start", start_heard)
    agent = await world.agent()
    await world.task(agent["id"], "model:well_behaved")
    await asyncio.wait_for(entered.wait(), 30)
    await asyncio.wait_for(runner.close(), 30)
    assert len(told) == 1 and isinstance(told[0], RuntimeError) \
        and "shutting down" in str(told[0]), f"the start's caller was told: {told!r}"
    # SIGKILLed by the close, not waited for: gone a moment later (a loaded host's moment).
    await eventually(lambda: asyncio.sleep(0, not _left_of(started[0])), 10,
                     "a process of the sandbox outlived the runner's close")

    # Lost by the wake that was told, or by the daemon's hang-up if it had connected first.
    await eventually(lambda: _session_ended(world, started[0]), 20,
                     "the session whose start the close cut is still live")


def _spec(tmp_path: Path) -> SandboxSpec:
    sandbox_id = uuid.uuid4()
    return SandboxSpec(sandbox_id=sandbox_id, agent_id=uuid.uuid4(), session_id=uuid.uuid4(),
                       home=tmp_path / "home", env={"COVEY_SANDBOX_ID": str(sandbox_id)})


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "thread"])
async def test_a_process_sandbox_s_exit_code_is_its_daemon_s(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pidfd: bool) -> None:
    """The process backend's watch, as the runner reads it: an exit code as the daemon gave
    it, and a signal's as its negative, through the daemon's pidfd or, where the kernel has
    none, a thread of its own."""
    if pidfd and not hasattr(os, "pidfd_open"):
        pytest.skip("no pidfd_open here: the thread's path is the other case")
    if not pidfd:
        def no_pidfd(pid: int, flags: int = 0) -> int:
            raise OSError("no pidfd here (the test's)")
        monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    exits = ProcessProvider([sys.executable, "-c", "import sys; sys.exit(7)"],
                            tmp_path / "logs")
    handle = await exits.start(_spec(tmp_path))
    assert (await asyncio.wait_for(exits.wait(handle), 30)).code == 7
    sleeps = ProcessProvider([sys.executable, "-c", "import time; time.sleep(30)"],
                             tmp_path / "logs")
    spec = _spec(tmp_path)
    handle = await sleeps.start(spec)
    await sleeps.destroy(handle)
    assert (await asyncio.wait_for(sleeps.wait(handle), 30)).code == -9
    assert _left_of(str(spec.sandbox_id)) == []


async def test_a_process_start_cancelled_while_it_spawns_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The spawn runs in a thread, which a cancellation cannot stop: the process it starts
    all the same is killed and reaped, not left running with nobody watching it."""
    import covey.sandbox
    entered, release, spawned = threading.Event(), threading.Event(), threading.Event()
    popen = subprocess.Popen

    def held_popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        entered.set()
        release.wait(30)
        try:
            return popen(*args, **kwargs)
        finally:
            spawned.set()
    monkeypatch.setattr(covey.sandbox.subprocess, "Popen", held_popen)
    provider = ProcessProvider([sys.executable, "-c", "import time; time.sleep(30)"],
                               tmp_path / "logs")
    spec = _spec(tmp_path)
    start = asyncio.ensure_future(provider.start(spec))
    assert await asyncio.to_thread(entered.wait, 30)
    start.cancel()
    await asyncio.sleep(0)  # the cancellation reaches the start before the spawn returns
    assert not spawned.is_set()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await start
    assert await asyncio.to_thread(spawned.wait, 30)

    async def nothing_left() -> bool:
        return _left_of(str(spec.sandbox_id)) == []
    await eventually(nothing_left, 15, "the cancelled start's process still runs")
