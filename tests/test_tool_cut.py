"""The tool call under way is cut when the daemon stops: on a kill before it acknowledges,
when its lease lapses before it says so, and when its control plane is gone before it exits.
Real `coveyd` processes running a real shell command that keeps spawning, escapes its
process group with `setsid` and double-forks; the puppet model asks for it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
from websockets.asyncio.server import ServerConnection, serve

from covey.testing.plane import World
from harness.act.puppet import Puppet
from harness.stack.base import free_port
from harness.stack.waiting import eventually
from tests.conftest import COVEYD
from tests.test_coveyd import _sandbox, _session_of, cworld  # noqa: F401 (a fixture)

# A command that would outlive a cut of its process group alone: a child in a session of
# its own, an orphan in another (its parent exits at once), and a loop spawning children.
LONG_COMMAND = ("setsid sleep 3600 & sh -c 'setsid sleep 3601 &'; "
                "while true; do touch x$RANDOM; sleep 0.01; done")
ESCAPEES = (["sleep", "3600"], ["sleep", "3601"])
CHILD_LISTS = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Of these processes, those still alive (a zombie is dead, waiting to be reaped)."""
    found = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def _in_home(daemon_pid: int, home: str) -> list[psutil.Process]:
    """The live processes working in a daemon's home, the daemon aside: its tools', wherever
    they went in the process tree (an orphan is nobody's child)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != daemon_pid and p.cwd() == home:
                found.append(p)
        except psutil.Error:
            pass
    return _alive(found)


def _describe(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in {p.pid: p for p in procs}.values():
        try:
            out.append(f"{p.pid} {' '.join(p.cmdline())}")
        except psutil.Error:
            out.append(f"{p.pid} (gone)")
    return out


def _leave_nothing(procs: list[psutil.Process]) -> None:
    """A failing test does not leave its escapees sleeping for an hour."""
    for p in _alive(procs):
        with contextlib.suppress(psutil.Error):
            p.kill()


async def _command_running(daemon_pid: int, home: str) -> list[psutil.Process]:
    """Wait until the long command runs in the daemon's home, escapees included; its
    processes."""
    async def running() -> list[psutil.Process] | None:
        procs = _in_home(daemon_pid, home)
        cmdlines = []
        for p in procs:
            try:
                cmdlines.append(p.cmdline())
            except psutil.Error:
                pass
        return procs if all(e in cmdlines for e in ESCAPEES) else None
    procs: list[psutil.Process] = await eventually(
        running, 20, "the long shell command never ran under the daemon", interval=0.02)
    return procs


async def test_a_kill_during_a_long_shell_command_leaves_none_of_it_alive_at_the_ack(
        cworld: World, model: tuple[str, Puppet], monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    puppet = model[1]
    agent = await cworld.agent()
    puppet.assign(agent["id"], {"steps": [{"shell": LONG_COMMAND}]})
    await cworld.task(agent["id"], "run the long command")

    async def daemon() -> int | None:
        handle = await cworld.db.fetchval(
            "SELECT handle FROM sandboxes WHERE agent_id=$1 AND state='running'",
            uuid.UUID(agent["id"]))
        return int(handle) if handle else None
    daemon_pid: int = await eventually(daemon, 20, "the sandbox never started")
    home = psutil.Process(daemon_pid).cwd()
    command = await _command_running(daemon_pid, home)
    shell = next(p.pid for p in command if p.ppid() == daemon_pid
                 and p.cmdline()[:2] == ["/bin/sh", "-c"])

    # What is alive at the very moment the control plane reads the daemon's kill_ack: the
    # command's processes seen before, and anything else below the daemon by then.
    at_ack: list[list[str]] = []
    hub = cworld.plane.orch.hub
    acknowledge = hub.acknowledge_kill

    def acknowledge_kill(session_id: uuid.UUID) -> None:
        if not at_ack:
            at_ack.append(_describe(_alive(command) + _in_home(daemon_pid, home)))
        acknowledge(session_id)
    monkeypatch.setattr(hub, "acknowledge_kill", acknowledge_kill)

    try:
        r = await cworld.security.post(f"/api/v1/agents/{agent['id']}/kill")
        assert r.status_code == 200, r.text
        assert r.json()["sessions_acknowledged"] == r.json()["sessions_cancelled"] != [], r.text
        assert at_ack, "the control plane never read a kill_ack"
        assert at_ack[0] == [], f"alive when the kill was acknowledged: {at_ack[0]}"
    finally:
        _leave_nothing(command)

    sandbox = await _sandbox(cworld, agent["id"])
    assert sandbox["exit_code"] == 3
    session = await _session_of(cworld, agent["id"], sandbox["id"])
    assert session["kill_confirmed_by"] == "kill_ack"
    cut = session["tool_cut"]
    assert cut is not None and cut["tool"] == "shell", session
    assert cut["pid"] == cut["pgid"] == shell, (cut, shell)
    assert cut["ran_ms"] > 0 and cut["all_gone"] is True, cut
    assert cut["processes_killed"] >= 3, cut  # the shell and both escapees at least


# ---------------------------------------------------------------- without a control plane
# coveyd started here against a stand-in control plane: no runner sweeps its sandbox after
# it exits, so whatever of the command is gone, the daemon itself ended.


@asynccontextmanager
async def _stand_in_plane() -> AsyncIterator[tuple[str, asyncio.Queue[ServerConnection],
                                                   list[dict[str, Any]]]]:
    """A WebSocket server speaking the control plane's side just enough: its URL, the
    connections it accepts, and every message it heard."""
    connections: asyncio.Queue[ServerConnection] = asyncio.Queue()
    heard: list[dict[str, Any]] = []

    async def handler(ws: ServerConnection) -> None:
        connections.put_nowait(ws)
        try:
            async for raw in ws:
                heard.append(json.loads(raw))
        except Exception:  # the daemon hangs up however it likes
            pass

    port = free_port()
    async with serve(handler, "127.0.0.1", port):
        yield f"ws://127.0.0.1:{port}/api/daemon/ws", connections, heard


async def _start_daemon(ws_url: str, model_url: str, home: Path, agent_id: str
                        ) -> asyncio.subprocess.Process:
    os.makedirs(home, exist_ok=True)
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "COVEY_WS_URL": ws_url,
           "COVEY_DAEMON_TOKEN": "t", "COVEY_AGENT_ID": agent_id,
           "COVEY_SANDBOX_ID": str(uuid.uuid4()), "COVEY_MODEL_URL": model_url,
           "PYTHONPATH": os.pathsep.join(sys.path)}
    with (home.parent / "coveyd.log").open("ab") as log:
        return await asyncio.create_subprocess_exec(*COVEYD, env=env, cwd=home,
                                                    stdout=log, stderr=log)


async def _send(ws: ServerConnection, kind: str, payload: dict[str, Any]) -> None:
    await ws.send(json.dumps({"type": kind, "payload": payload}))


async def _working_daemon(tmp_path: Path, model: tuple[str, Puppet], ws_url: str,
                          connections: asyncio.Queue[ServerConnection],
                          ) -> tuple[asyncio.subprocess.Process, ServerConnection,
                                     list[psutil.Process], asyncio.Task[None]]:
    """A daemon running the long command, its leases renewed (by the returned task) until
    the test stops renewing them."""
    agent_id = str(uuid.uuid4())
    model[1].assign(agent_id, {"steps": [{"shell": LONG_COMMAND}]})
    proc = await _start_daemon(ws_url, model[0], tmp_path / "home", agent_id)
    ws = await asyncio.wait_for(connections.get(), 20)
    await _send(ws, "inject_config", {"agent_id": agent_id, "org_id": str(uuid.uuid4()),
                                      "model": "puppet", "budget_usd": 1.0, "max_turns": 20})

    async def renew() -> None:
        while True:
            await asyncio.sleep(0.1)
            await _send(ws, "lease", {"ttl_ms": 800, "stopped": []})
    await _send(ws, "lease", {"ttl_ms": 800, "stopped": []})  # before the task, as the plane
    renewing = asyncio.create_task(renew())
    await _send(ws, "assign_task", {"task_id": str(uuid.uuid4()), "fencing_token": 1,
                                    "title": "t", "body": "run the long command"})
    return proc, ws, await _command_running(proc.pid, str(tmp_path / "home")), renewing


async def _stopped(renewing: asyncio.Task[None]) -> None:
    renewing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await renewing


async def test_a_lapsed_lease_cuts_the_command_before_the_daemon_says_it_stopped(
        tmp_path: Path, model: tuple[str, Puppet]) -> None:
    async with _stand_in_plane() as (ws_url, connections, heard):
        proc, _, command, renewing = await _working_daemon(tmp_path, model, ws_url,
                                                           connections)
        try:
            await _stopped(renewing)  # the flag store is unreachable, as far as it knows

            async def last_word() -> dict[str, Any] | None:
                said = [m for m in heard if m["type"] == "stopping"]
                return said[0] if said else None
            # Checked the moment the daemon's last word arrives, before it has even exited.
            stopping = await eventually(last_word, 10, "the daemon never said it stopped",
                                        interval=0.005)
            left = _describe(_alive(command))
            assert left == [], f"alive when the daemon said it stopped: {left}"
            assert stopping["payload"]["stop"] == "lease", stopping
            cut = stopping["payload"]["cut"]
            assert cut["tool"] == "shell" and cut["all_gone"] is True, cut
            assert await asyncio.wait_for(proc.wait(), 10) == 3
        finally:
            _leave_nothing(command)
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_a_control_plane_gone_leaves_nothing_of_the_command_behind(
        tmp_path: Path, model: tuple[str, Puppet]) -> None:
    async with _stand_in_plane() as (ws_url, connections, _heard):
        proc, ws, command, renewing = await _working_daemon(tmp_path, model, ws_url,
                                                            connections)
        try:
            await _stopped(renewing)
            await ws.close()
            # Its plane left without a kill or a sleep: it fails closed (covey.coveyd).
            assert await asyncio.wait_for(proc.wait(), 10) == 3
            left = _describe(_alive(command))
            assert left == [], f"alive after the daemon exited: {left}"
        finally:
            _leave_nothing(command)
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


@pytest.mark.parametrize("read", ["scan", "tree"])
async def test_the_cut_finds_every_live_process_below_the_daemon(read: str) -> None:
    """Both ways of reading the tree (the whole of /proc, or the kernel's child lists where
    it keeps them) find the same live processes psutil does, escapees of the group too."""
    from covey import tools

    if read == "tree" and not CHILD_LISTS:
        pytest.skip("this kernel keeps no child lists (CONFIG_PROC_CHILDREN)")
    find = tools._descendants_by_tree if read == "tree" else tools._descendants_by_scan
    shell = await asyncio.create_subprocess_shell(
        "sleep 30 & setsid sleep 31 & wait", start_new_session=True)
    try:
        async def both_sleeping() -> list[int] | None:
            expected = sorted(p.pid for p in _alive(psutil.Process().children(recursive=True)))
            return expected if len(expected) == 3 else None
        expected = await eventually(both_sleeping, 10, "the shell never started its sleeps")
        assert sorted(find(os.getpid())) == expected
    finally:
        for pid in [shell.pid, *find(os.getpid())]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        await shell.wait()
