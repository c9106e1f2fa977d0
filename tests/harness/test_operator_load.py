"""The operators' load of a game day (harness.load.operators): real Locust, in a process of its
own, against a small HTTP server on this machine that records what it was asked."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar, cast

import pytest

from harness.load.operators import (
    NotLoopback,
    game_day_agents,
    loopback_only,
    operators_at_work,
)
from harness.stack.base import Endpoints

PREFIX = game_day_agents("t3st01")
AGENT = {"id": "a1", "slug": f"{PREFIX}1-billing", "status": "working", "killed": False,
         "fleet_killed": False}


class Plane(BaseHTTPRequestHandler):
    """Answers the operators' reads and writes as the control plane would, and keeps the
    paths it was asked for."""

    seen: ClassVar[list[str]] = []

    def _answer(self, status: int, body: Any) -> None:
        Plane.seen.append(f"{self.command} {self.path}")
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._answer(200, [AGENT] if self.path == "/api/v1/agents" else [])

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        self._answer(201, {"id": "t1"})

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def plane() -> Iterator[Endpoints]:
    Plane.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Plane)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield cast(Endpoints, SimpleNamespace(url=url, puppet=SimpleNamespace(url=url),
                                              puppet_url=f"{url}/v1"))
    finally:
        server.shutdown()
        server.server_close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_operators_act_on_the_game_day_s_agents_and_are_reaped_at_the_end(
        plane: Endpoints, tmp_path: Path) -> None:
    measurements: dict[str, Any] = {}
    async with operators_at_work(plane, "token", PREFIX, tmp_path, "day", users=4,
                                 run_time_s=60, measurements=measurements) as load:
        assert load.process is not None and load.requests() > 0
        pid = load.process.pid
    assert not _alive(pid), "Locust outlived the block"
    summary = measurements["operators"]
    assert summary is load.summary and summary["requests"] > 0, summary
    assert summary["request_failures"] == 0, summary
    # Operators only: no kill, no resume, and nothing but the game day's agent touched.
    assert not [p for p in Plane.seen if "/kill" in p or "/resume" in p], Plane.seen
    assert all(p == "GET /api/v1/agents" or "/agents/a1/" in p for p in Plane.seen), Plane.seen
    assert summary["files"]["locust_log"].startswith(str(tmp_path)), summary["files"]


async def test_a_block_that_fails_still_ends_and_reaps_locust(plane: Endpoints,
                                                              tmp_path: Path) -> None:
    pids = []
    with pytest.raises(RuntimeError, match="the scenario broke"):
        async with operators_at_work(plane, "token", PREFIX, tmp_path, "day", users=2,
                                     run_time_s=60) as load:
            assert load.process is not None
            pids.append(load.process.pid)
            raise RuntimeError("the scenario broke")
    assert pids and not _alive(pids[0])
    assert load.summary["locust_exit_code"] is not None


@pytest.mark.parametrize("url", ["http://10.0.0.8:8080", "https://covey.example.com",
                                 "http://[::ffff:8.8.8.8]:80"])
async def test_the_load_goes_to_this_machine_only(url: str, tmp_path: Path) -> None:
    with pytest.raises(NotLoopback, match="loopback interface only"):
        loopback_only(url)
    endpoints = cast(Endpoints, SimpleNamespace(url=url))
    with pytest.raises(NotLoopback):
        async with operators_at_work(endpoints, "token", PREFIX, tmp_path, "day"):
            pytest.fail("the load started against another machine")


@pytest.mark.parametrize("url", ["http://127.0.0.1:8080", "http://localhost:1",
                                 "http://127.3.2.1"])
def test_loopback_addresses_are_allowed(url: str) -> None:
    loopback_only(url)
