"""The operators' stops leave from the switch line's process, at the plane's priority, with the
human's own credentials and connections, written with no turn of the harness's event loop
after the stamp; everything else leaves from the harness; and a line that cannot send says so
as the harness itself would have, or as the harness's own fault (harness/act/switch_line.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.middleware.gzip import GZipMiddleware

from covey.testing.plane import served
from harness.act.client import CoveyClient
from harness.act.switch_line import (
    LINE_EXTENSION,
    LINE_NICE,
    SwitchLine,
    SwitchLineGone,
    _send,
)
from harness.stack.base import free_port

TOKEN = "cvy_line_test_token"


def echo_app(held: asyncio.Event, release: asyncio.Event
             ) -> tuple[FastAPI, list[dict[str, Any]]]:
    """Says what reached it and from which local port, gzipped; a kill of agent `slow` sets
    `held`, then waits for `release`."""
    app, seen = FastAPI(), []
    app.add_middleware(GZipMiddleware, minimum_size=0)

    async def echo(request: Request) -> JSONResponse:
        heard = {"method": request.method, "path": request.url.path,
                 "authorization": request.headers.get("authorization"),
                 "cookie": request.headers.get("cookie"),
                 "body": (await request.body()).decode(),
                 "port": request.client.port if request.client else None}
        seen.append(heard)
        if request.url.path.endswith("/slow/kill"):
            held.set()
            await release.wait()
        answer = JSONResponse(heard, status_code=202 if request.method == "POST" else 200)
        answer.set_cookie("session", "from-the-plane")
        return answer

    app.add_api_route("/api/v1/{rest:path}", echo, methods=["GET", "POST"])
    return app, seen


def sender_of(port: int) -> int | None:
    """The pid whose socket has local port `port` on the loopback interface."""
    for c in psutil.net_connections(kind="tcp"):
        if c.laddr and c.laddr.port == port and c.pid is not None:
            return int(c.pid)
    return None


@asynccontextmanager
async def line_and_server(tmp_path: Path) -> AsyncIterator[tuple[SwitchLine, str, list[
        dict[str, Any]], asyncio.Event]]:
    """The line, and a server that answers at its URL; the event is set when a kill of
    agent `slow` is at the server (its answer held until the block ends)."""
    held, release = asyncio.Event(), asyncio.Event()
    app, seen = echo_app(held, release)
    line = await SwitchLine.start(tmp_path / "line.log")
    try:
        async with served(app) as url:
            try:
                yield line, url, seen, held
            finally:
                release.set()  # the server's stop waits for the held answer
    finally:
        await line.aclose()


async def test_a_stop_leaves_from_the_line_and_a_read_from_the_harness(tmp_path: Path) -> None:
    async with line_and_server(tmp_path) as (line, url, seen, _):
        client = CoveyClient(url, TOKEN, line=line)
        try:
            killed = await client.kill_fleet()
            # Kept alive: the line's connection is still open for psutil to find.
            kill_sender = sender_of(killed.json()["port"])
            flagged = await client.stop_globally("the line carries a body")
            read = await client.fleet()
            read_sender = sender_of(read.json()["port"])
        finally:
            await client.aclose()
    assert killed.status_code == 202, killed.text
    assert killed.json()["authorization"] == f"Bearer {TOKEN}", "the human's token was lost"
    assert kill_sender == line.process.pid, (
        f"the fleet kill came from pid {kill_sender}, not the line's {line.process.pid}")
    assert read_sender == os.getpid(), (
        f"a read came from pid {read_sender}, not the harness's {os.getpid()}")
    assert flagged.json()["body"] == '{"reason":"the line carries a body"}', flagged.text
    assert [s["path"] for s in seen] == ["/api/v1/fleet/kill", "/api/v1/flags/global",
                                         "/api/v1/fleet"]
    way, again = killed.extensions[LINE_EXTENSION], flagged.extensions[LINE_EXTENSION]
    assert way["connected"] and not again["connected"], (
        f"the first stop opens the human's connection, the second reuses it: {way}, {again}")
    assert way["handed_ns"] <= way["received_ns"] <= way["written_ns"], way


async def test_a_stop_is_written_into_the_line_before_the_event_loop_turns(
        tmp_path: Path) -> None:
    async with line_and_server(tmp_path) as (line, url, _, _):
        client = CoveyClient(url, TOKEN, line=line)
        assert line.process.stdin is not None
        order: list[str] = []
        write = line.process.stdin.write

        def written(data: bytes) -> None:
            order.append("written")
            write(data)
        line.process.stdin.write = written  # type: ignore[method-assign]
        try:
            asyncio.get_running_loop().call_soon(order.append, "the loop turned")
            await client.kill_fleet()
        finally:
            await client.aclose()
    assert order[:2] == ["written", "the loop turned"], order


async def test_the_line_keeps_no_cookie_and_the_human_keeps_theirs(tmp_path: Path) -> None:
    async with line_and_server(tmp_path) as (line, url, seen, _):
        client = CoveyClient(url, line=line)
        try:
            await client.kill_fleet()  # its answer sets the session cookie, in the harness
            await client.kill_fleet()
            client.http.cookies.clear()  # signed out: no cookie may travel any more
            await client.kill_fleet()
        finally:
            await client.aclose()
    assert [s["cookie"] for s in seen] == [None, "session=from-the-plane", None], (
        "the human lost their cookie, or the line sent one of its own")


async def test_each_human_keeps_their_own_connections_on_the_line(tmp_path: Path) -> None:
    async with line_and_server(tmp_path) as (line, url, seen, _):
        owner, security = CoveyClient(url, "owner", line=line), CoveyClient(url, "sec", line=line)
        try:
            await owner.kill_agent("a1")
            await security.kill_fleet()
            await owner.kill_agent("a2")
        finally:
            await owner.aclose()
            await security.aclose()
    first, fleet, second = (s["port"] for s in seen)
    assert first == second, "the owner's second kill did not reuse the owner's connection"
    assert fleet != first, "security's kill went out on the owner's connection"


async def test_a_line_that_cannot_reach_the_plane_says_it_was_not_sent(tmp_path: Path) -> None:
    line = await SwitchLine.start(tmp_path / "line.log")
    client = CoveyClient(f"http://127.0.0.1:{free_port()}", TOKEN, line=line)
    try:
        with pytest.raises(httpx.ConnectError):
            await client.kill_agent("a1")
    finally:
        await client.aclose()
        await line.aclose()


async def test_a_line_gone_under_its_request_is_the_harness_s_fault(tmp_path: Path) -> None:
    async with line_and_server(tmp_path) as (line, url, _, held):
        client = CoveyClient(url, TOKEN, line=line)
        try:
            kill = asyncio.create_task(client.kill_agent("slow"))
            await asyncio.wait_for(held.wait(), 30)  # at the plane, its answer held
            line.process.kill()
            with pytest.raises(SwitchLineGone, match="may have reached the control plane"):
                await asyncio.wait_for(kill, 30)
            with pytest.raises(SwitchLineGone, match="has exited"):
                await client.kill_fleet()
            assert (await client.fleet()).status_code == 200, "a read needs no line"
        finally:
            await client.aclose()


async def test_a_line_that_hangs_is_given_up_after_the_request_s_timeouts(
        tmp_path: Path) -> None:
    async with line_and_server(tmp_path) as (line, url, seen, _):
        client = CoveyClient(url, TOKEN, timeout=0.25, line=line)
        line.process.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(SwitchLineGone, match="did not answer within 6 s"):
                await asyncio.wait_for(client.kill_fleet(), 30)
            assert seen == [], "a stopped line sent the request"
        finally:
            line.process.send_signal(signal.SIGCONT)  # it then sends it, late: the fault said
            await client.aclose()


def test_the_line_answers_whatever_goes_wrong_with_a_request() -> None:
    with httpx.Client() as client:
        answer = _send(client, {"id": 7, "method": "POST", "url": "http://[::1",
                                "headers": [], "body": "", "timeout": {}, "handed_ns": 0}, 0)
    assert answer["id"] == 7 and answer["error"], answer


# Whether this host lets a session leader lower its autogroup's nice at all.
MAY_LOWER = ("import pathlib, sys\n"
             "try:\n    pathlib.Path('/proc/self/autogroup').write_text('-1')\n"
             "except OSError:\n    sys.exit(1)")


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(),
                    reason="this kernel has no autogroup scheduling")
async def test_the_line_says_the_priority_the_kernel_gives_it(tmp_path: Path) -> None:
    line = await SwitchLine.start(tmp_path / "line.log")
    try:
        autogroup = await asyncio.to_thread(
            Path(f"/proc/{line.process.pid}/autogroup").read_text)
    finally:
        await line.aclose()
    shown = autogroup.split()[-1]
    if line.priority.nice is None:
        assert shown == "0" and line.priority.reason, (line.priority, autogroup)
    else:
        assert (line.priority.nice, shown) == (LINE_NICE, str(LINE_NICE)), (
            line.priority, autogroup)
    probe = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", MAY_LOWER],
                                    start_new_session=True, timeout=60)
    if probe.returncode == 0 and line.priority.nice is None:
        assert "do not weigh" in line.priority.reason or "is off" in line.priority.reason, (
            f"where it may, the line did not, and gave no reason of the kernel's: "
            f"{line.priority}")
