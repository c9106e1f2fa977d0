"""Set-up shared by the benchmarks (none of them imports tests/): a Postgres server and a
database of its own, a control plane served by `covey serve` in a process of its own, a bare
HTTP client for the timed requests. The Postgres server and databases come from
harness/stack/postgres.py and the percentiles from the harness's HDR histogram
(harness/judge/time_to_stop.py), as for the tests and the game days; free ports,
organisations with one API token per role and the in-process control plane come from
covey.testing, as for the tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from harness.judge.time_to_stop import percentile_ms as percentile
from harness.stack.base import free_port
from harness.stack.postgres import database_of_its_own
from harness.stack.postgres import postgres_server as postgres_server  # the benchmarks' server

REPO = Path(__file__).resolve().parent.parent
STAGES = ("holds_sent", "flag_committed", "kill_sent", "requeued")


class BenchmarkError(RuntimeError):
    """The run cannot give a meaningful figure: a kill that did not kill, a wait that ran out."""


def summary(values_ms: list[float]) -> dict[str, float]:
    if not values_ms:
        return {"n": 0}
    return {"n": len(values_ms), "min": min(values_ms), "p50": percentile(values_ms, 50),
            "p99": percentile(values_ms, 99), "max": max(values_ms),
            "mean": sum(values_ms) / len(values_ms)}


def ms(ns: int) -> float:
    return ns / 1e6


async def until(check: Callable[[], Awaitable[bool]], timeout: float, what: str,
                interval: float = 0.01) -> None:
    """Poll check() until it is true; a BenchmarkError naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(interval)
    raise BenchmarkError(f"{what} (after {timeout:.0f} s)")


@contextlib.asynccontextmanager
async def bench_database(server_url: str) -> AsyncIterator[str]:
    """A database of its own, dropped afterwards; the control plane migrates it at start-up."""
    async with database_of_its_own(server_url, "covey_bench") as url:
        yield url


class RawHttp:
    """A bare HTTP/1.1 keep-alive client for the timed requests. httpx, in this process and on
    this event loop, adds about a millisecond of its own to every request on this machine;
    this one puts the request's bytes on the socket right after the clock is read.

    The server closes a keep-alive connection left idle (uvicorn's default: after 5 s; `covey
    serve` and the test plane: 30 s): a fleet's set-up on a loaded host took longer than that,
    and the fleet kill written on the closed connection then read an IncompleteRead. `ready()`
    opens a new connection first where the old one was closed or idle too long; call it before
    reading the clock."""

    IDLE_S = 3.0  # well under uvicorn's default keep-alive timeout of 5 s

    def __init__(self, url: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 authorization: str) -> None:
        self.url = url
        self.reader = reader
        self.writer = writer
        self.authorization = authorization
        self.used = time.monotonic()

    @staticmethod
    async def _connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        host, port = url.removeprefix("http://").split(":")
        return await asyncio.open_connection(host, int(port))

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, url: str, authorization: str) -> AsyncIterator[RawHttp]:
        client = cls(url, *await cls._connect(url), authorization)
        try:
            yield client
        finally:
            await client._close()

    async def _close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()

    async def ready(self) -> None:
        """A connection the server has not closed and will not close for a while."""
        if self.reader.at_eof() or time.monotonic() - self.used > self.IDLE_S:
            await self._close()
            self.reader, self.writer = await self._connect(self.url)
            self.used = time.monotonic()

    async def request(self, method: str, path: str, timeout: float = 30) -> tuple[int, Any]:
        await self.ready()
        self.writer.write(
            f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            f"authorization: {self.authorization}\r\ncontent-length: 0\r\n\r\n".encode())
        async with asyncio.timeout(timeout):
            head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            status_line, *header_lines = head.split("\r\n")
            headers = dict(line.split(":", 1) for line in header_lines if ":" in line)
            length = next((int(v) for k, v in headers.items()
                           if k.strip().lower() == "content-length"), None)
            if length is None:
                raise BenchmarkError(f"{method} {path}: a response without Content-Length")
            body = await self.reader.readexactly(length)
        self.used = time.monotonic()
        return int(status_line.split()[1]), json.loads(body) if body else None


def machine() -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem_kib = next((int(line.split()[1]) for line in
                    Path("/proc/meminfo").read_text().splitlines()
                    if line.startswith("MemTotal:")), 0)
    return {"nproc": os.cpu_count(), "memory_gib": round(mem_kib / 2**20, 1), "cpu": cpu,
            "python": platform.python_version(), "kernel": platform.release(),
            "loadavg_at_start": load_average()}


def load_average() -> str:
    """Other work on the host shows here; the floor, sampled alongside, absorbs its noise."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# ---------------------------------------------------------------- a served control plane


@dataclass
class ServedPlane:
    """`covey serve` in a process of its own: its memory and CPU are its own, and the
    benchmark's polling does not run on its event loop."""

    url: str
    pid: int
    data_dir: Path

    def rss_kib(self) -> int:
        return _status_field(self.pid, "VmRSS")

    def cpu_s(self) -> float:
        """User + system CPU time of the control plane so far."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _status_field(pid: int, name: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return int(line.split()[1])
    raise BenchmarkError(f"/proc/{pid}/status has no {name}")


def _log_file(path: Path) -> Any:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.open("ab")


@contextlib.asynccontextmanager
async def served_plane(database_url: str, data_dir: Path, daemon_command: list[str],
                       env: dict[str, str], timeout: float = 60, repo: Path = REPO
                       ) -> AsyncIterator[ServedPlane]:
    """Start `python -m covey serve` (the `covey` of `repo`, this checkout by default; a
    baseline's export to compare with) on a free loopback port with `env` on top of COVEY_*
    settings; its log goes to data_dir/plane.log."""
    port = free_port()
    full_env = {**os.environ, "DATABASE_URL": database_url, "COVEY_DATA_DIR": str(data_dir),
                "COVEY_DAEMON_COMMAND": shlex.join(daemon_command),
                "COVEY_SANDBOX_BACKEND": "process", **env}
    with _log_file(data_dir / "plane.log") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "covey", "serve", "--port", str(port),
            env=full_env, stdin=asyncio.subprocess.DEVNULL, stdout=log,
            stderr=asyncio.subprocess.STDOUT, cwd=repo)
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=5) as client:
            async def healthy() -> bool:
                if proc.returncode is not None:
                    raise BenchmarkError(f"covey serve exited with {proc.returncode}: see "
                                         f"{data_dir / 'plane.log'}")
                try:
                    return (await client.get("/healthz")).status_code == 200
                except httpx.HTTPError:
                    return False
            await until(healthy, timeout, "covey serve did not become healthy", interval=0.1)
        yield ServedPlane(url, proc.pid, data_dir)
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 60)
            except TimeoutError:
                proc.kill()
                await proc.wait()


def host_cpu_busy_s() -> float:
    """CPU time the whole host has spent busy so far (all cores, all processes), from
    /proc/stat: beside the control plane's own, it shows what else ran meanwhile."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def memory_available_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    return 0


async def kill_stage_totals(client: httpx.AsyncClient) -> dict[tuple[str, str, str], float]:
    """covey_kill_stage_seconds _sum and _count by (scope, stage), from the server's /metrics."""
    text = (await client.get("/metrics")).text
    totals = {}
    for family in text_string_to_metric_families(text):
        if family.name != "covey_kill_stage_seconds":
            continue
        for s in family.samples:
            if s.name.endswith(("_sum", "_count")):
                suffix = s.name.rsplit("_", 1)[1]
                totals[(s.labels["scope"], s.labels["stage"], suffix)] = s.value
    return totals


def stage_means_ms(before: dict[tuple[str, str, str], float],
                   after: dict[tuple[str, str, str], float], scope: str) -> dict[str, float]:
    means = {}
    for stage in STAGES:
        count = after.get((scope, stage, "count"), 0) - before.get((scope, stage, "count"), 0)
        total = after.get((scope, stage, "sum"), 0) - before.get((scope, stage, "sum"), 0)
        if count:
            means[stage] = total / count * 1000
    return means
