"""A kill holds its daemons while its flag commits (covey.switches, `_hold`): under incident
load the commit took 10-40 ms, and the fastest agents of the game day acted twice in it. The
`kill` itself still goes out only after the commit (DESIGN §2.3 line 1); a kill whose flag
failed holds them until the hold ends. Real control plane, real `coveyd`, the puppet model;
the kill's flag is kept from committing by a transaction holding the agent's row, as a wake
or another kill would."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import websockets

from covey.coveyd import HOLD_CAP_S, READ_UP_TURNS, Daemon, Env, hold_seconds
from covey.testing.plane import World, make_world, start_plane
from covey.tools import Toolbox
from harness.act.puppet import Puppet
from harness.stack.waiting import eventually
from tests.conftest import COVEYD
from tests.test_tool_cut import _send, _stand_in_plane, _start_daemon

# The puppet's `silent` agent acts every 0.2-0.3 s (a `sleep 0.2` a step): left alone it
# would ask its model five times or more in this window.
WINDOW_S = 1.5


@pytest.fixture
async def hworld(database_url: str, tmp_path: Path,
                 model: tuple[str, Puppet]) -> AsyncIterator[World]:
    # A hold stands a lease: ten seconds, so that it cannot run out in the window below
    # however long the flag takes to be seen waiting on a loaded host.
    async with start_plane(database_url, tmp_path, COVEYD, model_url=model[0],
                           lease_ms=10_000) as plane, make_world(plane) as world:
        yield world


async def _acting(world: World, puppet: Puppet) -> dict[str, Any]:
    agent = await world.agent()
    await world.task(agent["id"], "model:silent")

    async def busy() -> bool:
        return len(puppet.actions(agent["id"])) >= 3
    await eventually(busy, 20, "the agent never got going")
    return agent


async def _flag_waiting(world: World, holder: asyncpg.Connection) -> int:
    """The kill's flag statement, waiting for the row the holder holds: its backend."""
    async def waiting() -> int | None:
        pid: int | None = await world.db.fetchval(
            "SELECT pid FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))"
            " AND query LIKE '%covey_flag_%'", holder.get_server_pid())
        return pid
    pid: int = await eventually(waiting, 10, "the kill's flag never waited for the held row")
    return pid


async def _asks_in_window(puppet: Puppet, agent_id: str) -> int:
    """How many times the agent asks its model in WINDOW_S from now. What a held agent
    does in a window is the point of these tests: there is nothing to wait for but it."""
    before = len(puppet.actions(agent_id))
    await asyncio.sleep(WINDOW_S)
    return len(puppet.actions(agent_id)) - before


def _daemon_log(world: World) -> str:
    return "\n".join(p.read_text() for p in (world.plane.data_dir / "logs").glob("*.log"))


async def test_a_kill_holds_its_agent_before_its_flag_commits(
        hworld: World, model: tuple[str, Puppet]) -> None:
    puppet = model[1]
    agent = await _acting(hworld, puppet)
    async with hworld.db.acquire() as holder:
        async with holder.transaction():
            await holder.execute("SELECT 1 FROM agents WHERE id=$1 FOR NO KEY UPDATE",
                                 uuid.UUID(agent["id"]))
            kill = asyncio.ensure_future(
                hworld.security.post(f"/api/v1/agents/{agent['id']}/kill"))
            try:
                await _flag_waiting(hworld, holder)
                # What the agent does while the flag cannot commit.
                during = await _asks_in_window(puppet, agent["id"])
                assert not kill.done(), "the kill answered before its flag could commit"
            except BaseException:
                kill.cancel()
                raise
    r = await asyncio.wait_for(kill, 20)
    assert r.status_code == 200, r.text
    assert r.json()["sessions_acknowledged"] == r.json()["sessions_cancelled"] != [], r.text
    # One request may have been on its way when the hold arrived.
    assert during <= 1, (f"the agent asked its model {during} times in {WINDOW_S} s while "
                         "its kill's flag waited to commit: the hold did not stop it")
    log = _daemon_log(hworld)
    assert "held: a kill is on its way" in log, log
    assert "obeyed a kill message" in log, log


async def test_a_kill_whose_flag_failed_holds_its_agent_until_the_hold_ends(
        database_url: str, tmp_path: Path, model: tuple[str, Puppet]) -> None:
    """A kill whose flag failed does not release its agent: its flag may have committed all
    the same (the connection broke after the commit), and the hold is the safe side. The
    agent goes on once its hold ends, a lease after it came."""
    puppet = model[1]
    lease_s = 2.0
    async with start_plane(database_url, tmp_path, COVEYD, model_url=model[0],
                           lease_ms=int(lease_s * 1000)) as plane, \
            make_world(plane) as world:
        agent = await _acting(world, puppet)
        async with world.db.acquire() as holder:
            async with holder.transaction():
                await holder.execute("SELECT 1 FROM agents WHERE id=$1 FOR NO KEY UPDATE",
                                     uuid.UUID(agent["id"]))
                requested_ns = time.time_ns()
                kill = asyncio.ensure_future(
                    world.security.post(f"/api/v1/agents/{agent['id']}/kill"))
                try:
                    pid = await _flag_waiting(world, holder)
                    # The database drops the kill's connection under it.
                    assert await world.db.fetchval("SELECT pg_terminate_backend($1)", pid)
                    r = await asyncio.wait_for(kill, 20)
                except BaseException:
                    kill.cancel()
                    raise
        assert r.status_code == 503, r.text
        assert set(r.json()) >= {"error", "hint"}, r.text
        assert (await world.org_admin.get(f"/api/v1/agents/{agent['id']}")).json()[
            "killed"] is False

        def sent() -> list[int]:
            return sorted(a.sent_ns for a in puppet.actions(agent["id"])
                          if a.sent_ns is not None)

        async def going_on() -> bool:
            return sum(1 for t in sent() if t > requested_ns) >= 3
        await eventually(going_on, 20, "the agent never went on after its hold ended")
        # The agent asks every 0.2-0.3 s; its hold stood a lease from whenever it was read
        # (a request or two may have left before that, on a loaded host): from the last
        # request before the kill on, one pause between two requests is as long as a lease.
        times = sent()
        times = times[max(0, sum(1 for t in times if t <= requested_ns) - 1):]
        pause_s = max(b - a for a, b in itertools.pairwise(times)) / 1e9
        assert pause_s >= lease_s - 0.05, (
            f"the agent's longest pause after the kill's request was {pause_s:.2f} s: its "
            f"hold of {lease_s} s did not stand")
        log = _daemon_log(world)
        assert "a hold ran out without a kill or a release" in log, log
        assert "released:" not in log, log


async def test_a_daemon_that_does_not_read_its_channel_does_not_hold_up_the_kill(
        database_url: str, tmp_path: Path) -> None:
    """The holds go out on the kill's own path, before its flag (covey.switches._hold): a
    channel whose frames never leave (its daemon wedged, its socket's buffer full) must not
    keep the kill from its flag."""
    from covey.hub import DaemonLink
    from covey.testing import SCRIPTED_DAEMON

    gate = asyncio.Event()
    tried: list[str] = []

    class Wedged:
        async def send_text(self, data: str) -> None:
            tried.append(json.loads(data)["type"])
            await gate.wait()  # not written until the test ends

    async with start_plane(database_url, tmp_path, SCRIPTED_DAEMON) as plane, \
            make_world(plane) as world:
        agent = await world.agent()
        link = DaemonLink(uuid.uuid4(), uuid.UUID(agent["id"]), Wedged(), org_id=world.org.id)
        plane.orch.hub.attach(link)
        try:
            r = await asyncio.wait_for(
                world.security.post(f"/api/v1/agents/{agent['id']}/kill"), 20)
        finally:
            gate.set()  # what waited on the channel goes now, and ends with the test
            plane.orch.hub.detach(link.session_id)
        assert r.status_code == 200, r.text
        assert tried and tried[0] == "hold", f"the kill never tried to hold the daemon: {tried}"
        assert (await world.org_admin.get(f"/api/v1/agents/{agent['id']}")).json()["killed"]


@pytest.mark.parametrize(("ttl_ms", "seconds"), [
    (1500, 1.5), (0, 0.0), (-5, 0.0), (10**9, HOLD_CAP_S), ("2000", 2.0),
    (float("nan"), HOLD_CAP_S), (float("inf"), HOLD_CAP_S), ("soon", HOLD_CAP_S),
    (None, HOLD_CAP_S), ([1], HOLD_CAP_S)])
def test_a_hold_that_cannot_be_read_stands_its_longest(ttl_ms: object, seconds: float) -> None:
    assert hold_seconds(ttl_ms) == seconds


async def test_one_kills_release_leaves_anothers_hold_standing(
        tmp_path: Path, model: tuple[str, Puppet]) -> None:
    """Two kills hold the same daemon (an agent kill and its fleet's, at once): the one that
    does not stop it releases its own hold only. The real `coveyd` against a stand-in
    control plane."""
    puppet = model[1]
    agent_id = str(uuid.uuid4())
    async with _stand_in_plane() as (ws_url, connections, _heard):
        proc = await _start_daemon(ws_url, model[0], tmp_path / "home", agent_id)
        try:
            ws = await asyncio.wait_for(connections.get(), 20)
            await _send(ws, "inject_config", {"agent_id": agent_id, "org_id": str(uuid.uuid4()),
                                              "model": "puppet", "budget_usd": 1.0,
                                              "max_turns": 1000})
            await _send(ws, "lease", {"ttl_ms": 60_000, "stopped": []})
            await _send(ws, "assign_task", {"task_id": str(uuid.uuid4()), "fencing_token": 1,
                                            "title": "t", "body": "model:silent"})

            async def acting() -> bool:
                return len(puppet.actions(agent_id)) >= 2
            await eventually(acting, 20, "the daemon never got going")
            for hold_id in ("agent-kill", "fleet-kill"):
                await _send(ws, "hold", {"id": hold_id, "reason": "kill-switch",
                                         "ttl_ms": 60_000})
            await _send(ws, "release", {"id": "agent-kill"})
            during = await _asks_in_window(puppet, agent_id)
            assert during <= 1, (f"the agent asked its model {during} times in {WINDOW_S} s "
                                 "with the fleet kill's hold standing")
            await _send(ws, "release", {"id": "fleet-kill"})
            asked = len(puppet.actions(agent_id))

            async def going_on() -> bool:
                return len(puppet.actions(agent_id)) >= asked + 2
            await eventually(going_on, 10, "the agent never went on once both were released")
            # A stale release and a new hold read in one burst: the hold stands.
            await _send(ws, "release", {"id": "fleet-kill"})
            await _send(ws, "hold", {"id": "global-stop", "reason": "kill-switch",
                                     "ttl_ms": 60_000})
            during = await _asks_in_window(puppet, agent_id)
            assert during <= 1, (f"the agent asked its model {during} times in {WINDOW_S} s "
                                 "with a hold that came after a stale release")
            await _send(ws, "kill", {"reason": "kill-switch"})
            assert await asyncio.wait_for(proc.wait(), 10) == 3
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


@contextlib.asynccontextmanager
async def _channel_daemon(tmp_path: Path) -> AsyncIterator[
        tuple[Daemon, Callable[[list[tuple[str, dict[str, Any]]]], Awaitable[None]]]]:
    """`coveyd`'s Daemon on a real WebSocket channel, its reader running (one unit: no
    model, no tools); and a way to put frames on its socket without its loop reading them,
    as while the daemon is busy with a tool's result: they are read from the next turn on."""
    env = Env(ws_url="ws://127.0.0.1:1", token="t", agent_id="a1", sandbox_id="s1",
              model_url="http://127.0.0.1:1/v1", model_key="none",
              prices={"puppet": (0.0, 0.0)}, home=tmp_path)
    async with (_stand_in_plane() as (ws_url, connections, _heard),
                websockets.connect(ws_url, compression=None) as ws, httpx.AsyncClient() as http):
        daemon = Daemon(env, ws, http)
        daemon.config = {"guard": {"max_steps": 50}, "budget_usd": 1.0}
        daemon.flag.renew(60)
        reader = asyncio.create_task(daemon.read())
        plane = await asyncio.wait_for(connections.get(), 10)
        assert ws.transport is not None
        transport = ws.transport
        # The channel's own socket, looked at without reading it (a duplicate descriptor:
        # the transport's socket object refuses such calls); uncompressed, so that a
        # frame's text can be found on it.
        peek = socket.socket(fileno=os.dup(transport.get_extra_info("socket").fileno()))

        async def unread(frames: list[tuple[str, dict[str, Any]]]) -> None:
            transport.pause_reading()
            for kind, payload in frames:
                await _send(plane, kind, payload)
            last = json.dumps(frames[-1][1]).encode()

            async def all_on_the_socket() -> bool:
                with contextlib.suppress(BlockingIOError):
                    return last in peek.recv(1 << 16, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                return False
            await eventually(all_on_the_socket, 10, "the frames never reached the socket")
            transport.resume_reading()
        try:
            yield daemon, unread
        finally:
            peek.close()
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader


async def test_a_hold_already_on_the_channel_stops_the_next_step(tmp_path: Path) -> None:
    """What the plane has sent is read before the next step starts: a hold that lands on
    the daemon's socket while its loop is busy, behind a few other frames, holds the step
    that follows."""
    async with _channel_daemon(tmp_path) as (daemon, unread):
        await unread([*[("lease", {"ttl_ms": 60_000, "stopped": []})] * 3,
                      ("hold", {"id": "fleet-kill", "reason": "kill-switch",
                                "ttl_ms": 60_000})])
        assert not daemon.holds, "the hold was read while the channel was paused"
        step = asyncio.create_task(daemon.wait_while_held())
        try:
            # Turns of the loop, not time: the step's look ends within READ_UP_TURNS.
            for _ in range(4 * READ_UP_TURNS):
                await asyncio.sleep(0)
            assert not step.done(), "the step went on with a hold on its channel"
            assert "fleet-kill" in daemon.holds
            await unread([("release", {"id": "fleet-kill"})])
            await asyncio.wait_for(step, 10)  # and goes on once released
        finally:
            step.cancel()


async def test_a_tool_stopped_while_the_daemon_looked_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The look before a tool call comes before the guard's: a `lease` that stops the tool,
    waiting on the socket as the model answers with a call of it, is read, acknowledged,
    and the call refused, not run after the acknowledgement."""
    async with _channel_daemon(tmp_path) as (daemon, unread):
        calls: list[str] = []
        answers = 0

        async def chat(model: str, messages: list[dict[str, Any]], max_tokens: int
                       ) -> dict[str, Any]:
            nonlocal answers
            answers += 1
            if answers == 1:
                await unread([("lease", {"ttl_ms": 60_000, "stopped": ["tool:shell"]})])
                call = {"id": "c1", "type": "function", "function": {
                    "name": "shell", "arguments": json.dumps({"cmd": "echo hi"})}}
                message: dict[str, Any] = {"role": "assistant", "tool_calls": [call]}
            else:
                message = {"role": "assistant", "content": "done"}
            return {"choices": [{"message": message}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

        async def run(_self: Toolbox, name: str, args: dict[str, Any]
                      ) -> tuple[dict[str, Any], bool]:
            calls.append(name)
            return {"exit_code": 0, "output": "", "truncated": False}, True

        monkeypatch.setattr(daemon, "chat", chat)
        monkeypatch.setattr(Toolbox, "run", run)
        outcome = await asyncio.wait_for(daemon.engine({"title": "t", "body": ""}), 10)
        assert "tool:shell" in daemon.flag.stopped, "the lease was never read"
        assert calls == [], f"a stopped tool ran after its stop was read: {calls}"
        assert outcome.result == "done", outcome
