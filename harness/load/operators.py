"""Operators at work through an incident: the Locust `Operator` users of
harness/load/locustfile.py (reading agents, backlogs and recordings, creating tasks, firing
heartbeats) thrown at a game day's control plane while its switches are pulled.

    async with operators_at_work(day.endpoints, token, prefix, day.report_dir, "name") as load:
        ...  # pull the switches: the operators' requests are in flight meanwhile
    load.summary  # requests, failures, shed reads, Locust's exit code and files

Locust runs headless in a process of its own (gevent must not patch the harness's event loop),
in a session of its own, against the stack's own URL on the loopback interface only. It is
bounded twice: by its `--run-time`, and by the block: on leaving it, however (passed, failed,
cancelled), the whole process group is sent SIGTERM, then SIGKILL if it has not ended within
STOP_S, and reaped. The user classes are named on Locust's command line: no `Killer` runs, so
every switch in the history is the scenario's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from harness.load.runner import (
    NOT_THE_CONTROL_PLANE,
    Fleet,
    LoadPlan,
    ledger_base,
    load_environment,
    locust_command,
    read_stats,
    report_files,
)
from harness.stack.base import Endpoints
from harness.stack.isolation import GAME_DAY_SLUG_PREFIX
from harness.stack.waiting import eventually

# How long Locust may take to start its users and answer its first request.
READY_S = 30.0
# How long a Locust sent SIGTERM may take to stop its users and write its statistics.
STOP_S = 15.0


class NotLoopback(ValueError):
    """The load would leave this machine: it is thrown at the harness's own stacks only."""


@dataclass
class OperatorLoad:
    """A running load, then its outcome (`summary`, once the block has ended)."""

    users: int
    run_time_s: int
    files: dict[str, str]
    process: asyncio.subprocess.Process | None = None
    summary: dict[str, Any] = field(default_factory=dict)

    def requests(self) -> int:
        """Requests to the control plane Locust has counted so far (its CSV, written each
        second while it runs)."""
        return _plane_requests(read_stats(Path(self.files["csv"])))[0]


def game_day_agents(run: str) -> str:
    """The slug prefix of a game day's agents (harness.stack.isolation.agent_slug): the
    operators act on those agents and no others."""
    return f"{GAME_DAY_SLUG_PREFIX}{run}-"


def loopback_only(url: str) -> None:
    """Raise NotLoopback unless `url` names a host on 127.0.0.0/8 (or `localhost`)."""
    host = urlsplit(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise NotLoopback(f"the operators' load goes to this machine's loopback interface "
                          f"only, and {url} is not on it")


@contextlib.asynccontextmanager
async def operators_at_work(endpoints: Endpoints, token: str, prefix: str, report_dir: Path,
                            name: str, users: int = 64, run_time_s: int = 90,
                            wait_s: tuple[float, float] = (0.0, 0.1),
                            measurements: dict[str, Any] | None = None
                            ) -> AsyncIterator[OperatorLoad]:
    """`users` Locust operators acting as the holder of `token` on the agents whose slugs
    start with `prefix`, each waiting `wait_s` between requests (by default an incident's
    crowd: 64 of them at once, which a control plane on two cores answers partly with shed
    reads, as issue 20's "200 reads in flight" did), for at most `run_time_s`
    and at most the block. Yields once Locust has had its first answers (else fails,
    pointing at its log). Its summary goes into `measurements["operators"]` (a game day's
    journal) however the block ends."""
    loopback_only(endpoints.url)
    if users < 1 or run_time_s < 1:
        raise ValueError(f"the operators' load needs at least one user and one second, not "
                         f"{users} user(s) for {run_time_s} s")
    plan = LoadPlan(users=users, spawn_rate=float(users), run_time=f"{run_time_s}s",
                    killers=0)
    files = report_files(report_dir, f"{name}-operators")
    fleet = Fleet(prefix, [], token, token, ledger_base(endpoints))
    env = {**os.environ, **load_environment(fleet, plan),
           "COVEY_LOAD_OPERATOR_WAIT_S": f"{wait_s[0]},{wait_s[1]}"}
    await asyncio.to_thread(Path(files["samples"]).rmdir)  # no Killer runs: no samples
    load = OperatorLoad(users, run_time_s, {k: v for k, v in files.items()
                                            if k not in ("csv_prefix", "samples", "summary")})
    out = await asyncio.to_thread(Path(files["locust_log"]).open, "wb")
    try:
        load.process = await asyncio.create_subprocess_exec(
            *locust_command(endpoints.url, plan, files), "Operator", env=env, stdout=out,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        await eventually(lambda: _answered(load), READY_S,
                         f"the operators' load never got going: no answered request within "
                         f"{READY_S:.0f} s (Locust's log: {files['locust_log']})", interval=0.2,
                         impossible=lambda: _ended(load))
        yield load
    finally:
        try:
            code = await _stop(load.process)
        finally:
            out.close()
        stats = read_stats(Path(files["csv"]))
        requests, failures = _plane_requests(stats)
        load.summary = {"users": users, "run_time_s": run_time_s, "wait_s": list(wait_s),
                        "requests": requests, "request_failures": failures,
                        "shed_requests": sum(int(r["Request Count"]) for r in stats
                                             if r["Type"] == "SHED"),
                        "locust_exit_code": code, "files": load.files}
        if measurements is not None:
            measurements["operators"] = load.summary


async def _answered(load: OperatorLoad) -> bool:
    return load.requests() > 0


async def _ended(load: OperatorLoad) -> str | None:
    process = load.process
    if process is None or process.returncode is None:
        return None
    return f"Locust ended with exit code {process.returncode}"


async def _stop(process: asyncio.subprocess.Process | None) -> int | None:
    """End Locust's whole process group (politely, then not) and reap it."""
    if process is None:
        return None
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(process.wait()), STOP_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    code = await process.wait()
    with contextlib.suppress(ProcessLookupError):  # anything it forked and left
        os.killpg(process.pid, signal.SIGKILL)
    return code


def _plane_requests(stats: list[dict[str, str]]) -> tuple[int, int]:
    """Requests to the control plane and how many failed, from Locust's statistics."""
    plane = [r for r in stats if r["Type"] not in ("KILL", "SHED", "")
             and r["Name"] not in NOT_THE_CONTROL_PLANE and r["Name"] != "Aggregated"]
    return (sum(int(r["Request Count"]) for r in plane),
            sum(int(r["Failure Count"]) for r in plane))
