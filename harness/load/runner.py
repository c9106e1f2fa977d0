"""`gameday load`: a fleet of working agents on a stack, Locust thrown at its control plane
from a process of its own (gevent must not patch this process), and a verdict on the
kills it measured.

Locust's own CSV and HTML reports land in the report directory beside a JSON summary whose
kill percentiles come from the killers' raw samples through the harness's one percentile
definition (HDR), not Locust's rounded response-time buckets.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import json
import os
import secrets
import signal
import sys
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from harness.act.client import CoveyClient, json_of
from harness.judge.time_to_stop import percentiles
from harness.record.gameday import GAME_DAY_GUARD, GAME_DAY_MAX_TURNS
from harness.stack.base import Endpoints, free_port
from harness.stack.waiting import eventually

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
PARTS = {"acknowledged_ns": "kill → acknowledged", "daemon_acked_ns": "kill → daemon acked",
         "daemon_exited_ns": "kill → daemon exited", "task_open_ns": "kill → task open"}
# How long a master waits for the workers it forked to connect before it gives up (and says
# so in its log).
WORKERS_MAX_WAIT_S = 30
# Requests the load makes of something other than the control plane.
NOT_THE_CONTROL_PLANE = {"puppet ledger"}
# Which percentiles are which, in the summary and on the command line: the same 16 kills once
# read 61 ms as Locust's median and 48.1 ms as the harness's, and people asked which was true.
PERCENTILE_DEFINITIONS = {
    "parts_us": "the harness's one definition, as in every game day's summary, page and gate: "
                "the killers' raw samples in an HDR histogram (µs, three significant figures), "
                "nearest rank, never above the largest sample",
    "locust_html_and_csv": "Locust's own: times rounded (to 1 ms under 100 ms, to 10 ms under "
                           "1 s, then coarser), and of an even count the upper middle sample "
                           "for the median (the harness: the lower); its KILL rows can differ "
                           "from parts_us, which are the figures judged"}


@dataclass(frozen=True)
class LoadPlan:
    users: int
    spawn_rate: float
    run_time: str  # Locust's syntax: 20s, 2m, 1h30m
    processes: int = 1  # Locust worker processes on this machine (1: no workers)
    killers: int = 1
    killer_pause_s: tuple[float, float] = (1.0, 2.0)  # between one kill and the next
    kill_bound_ms: float = 5000.0  # a kill whose daemon exits later than this failed
    max_kill_p99_ms: float | None = None  # the gate on kill → daemon exited
    master_workers: int = 0  # > 0: wait for this many `locust --worker`s from elsewhere
    # The killers in a Locust process of their own (run_load), not among the operators.
    killers_apart: bool = False


@dataclass(frozen=True)
class Fleet:
    """The working agents the load runs against, and the tokens its people act with."""

    prefix: str
    agent_ids: list[str]
    operator_token: str
    killer_token: str
    ledger_url: str  # the puppet's base URL as Locust reaches it


@dataclass
class LoadResult:
    plan: LoadPlan
    kills: int
    failed_kills: list[dict[str, Any]]
    parts_us: dict[str, dict[str, int]]
    requests: int
    request_failures: int
    requests_per_s: float
    locust_exit_code: int
    files: dict[str, str]
    problems: list[str] = field(default_factory=list)
    # Reads the control plane shed (429: too many at once; Locust type SHED), not among
    # `requests`: the plane keeping the switches quick, not a failed request.
    shed_requests: int = 0

    @property
    def passed(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed,
                "percentile_definitions": PERCENTILE_DEFINITIONS}


def ledger_base(endpoints: Endpoints) -> str:
    """Where this machine reaches the puppet's ledger: its own URL when it runs apart (a
    process or a container), else the server the harness serves its /v1 from."""
    url = getattr(endpoints.puppet, "url", None)
    return str(url) if url else endpoints.puppet_url.removesuffix("/v1")


async def prepare_fleet(endpoints: Endpoints, agents: int, behaviour: str = "silent"
                        ) -> Fleet:
    """`agents` agents that keep working until a switch stops them, each with a task and a
    heartbeat, and two people: an operator (agent_owner) and the on-call killer (security).
    Returns once every agent works."""
    run = secrets.token_hex(3)
    prefix = f"load-{run}-"
    admin = await CoveyClient.signed_in(endpoints.url, endpoints.admin_email,
                                        endpoints.admin_password)
    try:
        tokens: dict[str, str] = {}
        for role in ("agent_owner", "security"):
            email, password = f"{role}.{run}@load.test", secrets.token_urlsafe(16)
            json_of(await admin.add_member(email, password, role), 201)
            person = await CoveyClient.signed_in(endpoints.url, email, password)
            if person.token is None:  # pragma: no cover - signed_in always has one
                raise RuntimeError(f"no API token for the load's {role}")
            tokens[role] = person.token
            await person.aclose()
        ids = []
        for i in range(agents):
            agent = json_of(await admin.create_agent(
                f"{prefix}{i}", f"Load agent {i}", max_turns=GAME_DAY_MAX_TURNS,
                guard=GAME_DAY_GUARD), 201)
            await endpoints.puppet.assign(agent["id"], behaviour)
            json_of(await admin.add_heartbeat(agent["id"], "load", "load heartbeat", 3600), 201)
            json_of(await admin.create_task(agent["id"], "load: keep the orders flowing"), 201)
            ids.append(agent["id"])
        await all_working(admin, ids, 120)
    finally:
        await admin.aclose()
    return Fleet(prefix, ids, tokens["agent_owner"], tokens["security"],
                 ledger_base(endpoints))


async def all_working(client: CoveyClient, agent_ids: list[str], deadline_s: float) -> None:
    async def working() -> bool:
        for agent_id in agent_ids:
            if json_of(await client.agent(agent_id))["status"] != "working":
                return False
        return True
    await eventually(working, deadline_s, "the load's agents never all got to work "
                     "(the steady state before the load)", interval=0.2)


async def run_load(endpoints: Endpoints, fleet: Fleet, plan: LoadPlan, report_dir: Path,
                   name: str = "load") -> LoadResult:
    """Run Locust headless against the stack and judge the run.

    With `plan.killers_apart`, the operators and the killers are two Locust processes side
    by side, their statistics read together. A killer among the operators times the switch
    through their gevent loop: under 200 operators, stamped on both sides, a kill waited up
    to 57 ms between the killer's stamp and the control plane's receipt, and up to 41 ms
    between the plane's answer and the killer's, with the plane's event loop never held
    that long meanwhile (kill_under_load)."""
    files = report_files(report_dir, name)
    env = {**os.environ, **load_environment(fleet, plan),
           "COVEY_LOAD_SAMPLES": files["samples"]}
    runs = [(locust_command(endpoints.url, plan, files), Path(files["locust_log"]))]
    # Apart only where both start at once: workers (`--processes`, `--master`) start the
    # operators' run-time only once they are all there, and the killer would run ahead.
    if plan.killers_apart and plan.users and plan.processes == 1 and not plan.master_workers:
        apart = killer_files(files)
        files.update({f"killers_{k}": v for k, v in apart.items()})
        runs = [([*locust_command(endpoints.url, replace(plan, killers=0), files), "Operator"],
                 Path(files["locust_log"])),
                ([*locust_command(endpoints.url, replace(plan, users=0, processes=1,
                                                         master_workers=0), apart), "Killer"],
                 Path(apart["locust_log"]))]
    async with asyncio.TaskGroup() as group:  # one failing stops the other
        running = [group.create_task(_locust(command, env, log, plan)) for command, log in runs]
    codes = [task.result() for task in running]
    return await asyncio.to_thread(finish, plan, files,
                                   next((c for c in codes if c != 0), 0))


async def _locust(command: list[str], env: dict[str, str], log: Path, plan: LoadPlan) -> int:
    """One Locust process, run to its end; its exit code."""
    out = await asyncio.to_thread(log.open, "wb")
    try:
        locust = await asyncio.create_subprocess_exec(
            *command, env=env, stdout=out, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True)
        try:
            # Locust stops itself at --run-time; this bound is for a Locust that does not.
            code = await asyncio.wait_for(locust.wait(), run_seconds(plan.run_time)
                                          + WORKERS_MAX_WAIT_S + 120)
        except TimeoutError:
            os.killpg(locust.pid, signal.SIGKILL)
            code = await locust.wait()
        except BaseException:
            os.killpg(locust.pid, signal.SIGTERM)
            await locust.wait()
            raise
        # A `--processes` master can end while its workers run on: they gave up on it only
        # after 60 s without its heartbeat, loading the next run meanwhile. Nothing of a
        # run outlives it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(locust.pid, signal.SIGTERM)
    finally:
        out.close()
    return code


def locust_command(url: str, plan: LoadPlan, files: dict[str, str],
                   master_port: int | None = None) -> list[str]:
    """Locust's command line for `plan`. Workers forked on this machine (`--processes`) meet
    their master on a free loopback port of this run's own, not Locust's fixed 5557 on every
    interface: on a machine where other load runs start and end, workers that met another
    run's master (or a master that could not bind) left a level with no user started."""
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
               "--host", url, "--users", str(plan.users + plan.killers),
               "--spawn-rate", str(plan.spawn_rate), "--run-time", plan.run_time,
               "--stop-timeout", "20", "--csv", files["csv_prefix"], "--html", files["html"],
               "--only-summary", "--loglevel", "WARNING"]
    if plan.processes > 1:
        port = master_port or free_port()
        command += ["--processes", str(plan.processes), "--master-bind-host", "127.0.0.1",
                    "--master-bind-port", str(port), "--master-host", "127.0.0.1",
                    "--master-port", str(port),
                    # Its --run-time starts once the workers are there: bounded, and said.
                    "--expect-workers-max-wait", str(WORKERS_MAX_WAIT_S)]
    if plan.master_workers:
        command += ["--master", "--expect-workers", str(plan.master_workers)]
    return command


def report_files(report_dir: Path, name: str) -> dict[str, str]:
    """The run's files, named after it: Locust's CSV and HTML, the samples, the summary."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    base = report_dir / f"{name}-{stamp}"
    samples = base.with_name(base.name + "-samples")
    samples.mkdir(parents=True)
    return {**locust_files(str(base)), "summary": f"{base}.json", "samples": str(samples)}


def locust_files(base: str) -> dict[str, str]:
    """One Locust process's files, named after `base`: its CSV, HTML and log."""
    return {"csv_prefix": base, "csv": f"{base}_stats.csv", "html": f"{base}.html",
            "locust_log": f"{base}.locust.log"}


def killer_files(files: dict[str, str]) -> dict[str, str]:
    """The killers' own Locust files, beside the operators' (their samples are shared)."""
    return locust_files(files["csv_prefix"] + "-killers")


def run_stats(files: dict[str, str]) -> list[dict[str, str]]:
    """Locust's statistics of a run: the operators' and, apart, the killers'."""
    return [row for key in ("csv", "killers_csv") if key in files
            for row in read_stats(Path(files[key]))]


def finish(plan: LoadPlan, files: dict[str, str], locust_exit_code: int) -> LoadResult:
    result = judge(plan, read_samples(Path(files["samples"])), run_stats(files),
                   locust_exit_code)
    result.files = {k: v for k, v in files.items() if not k.endswith("csv_prefix")}
    Path(files["summary"]).write_text(json.dumps(result.to_json(), indent=2))
    return result


def load_environment(fleet: Fleet, plan: LoadPlan) -> dict[str, str]:
    """What the Locust file reads: on this machine, and for workers started elsewhere."""
    return {"COVEY_LOAD_OPERATOR_TOKEN": fleet.operator_token,
            "COVEY_LOAD_KILLER_TOKEN": fleet.killer_token,
            "COVEY_LOAD_PUPPET_URL": fleet.ledger_url,
            "COVEY_LOAD_AGENT_PREFIX": fleet.prefix,
            "COVEY_LOAD_KILLERS": str(plan.killers),
            "COVEY_LOAD_KILLER_PAUSE_S": ",".join(str(s) for s in plan.killer_pause_s),
            "COVEY_LOAD_KILL_BOUND_MS": str(plan.kill_bound_ms)}


def run_seconds(run_time: str) -> float:
    """Locust's --run-time (`90`, `20s`, `2m`, `1h30m`) in seconds."""
    total, number = 0.0, ""
    units = {"h": 3600, "m": 60, "s": 1}
    for char in run_time.strip():
        if char.isdigit():
            number += char
        elif char in units and number:
            total += int(number) * units[char]
            number = ""
        else:
            raise ValueError(f"not a run time: {run_time!r} (say 20s, 2m or 1h30m)")
    return total + (int(number) if number else 0)


def read_samples(folder: Path) -> list[dict[str, Any]]:
    rows = []
    for path in sorted(folder.glob("*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line]
    return rows


def read_stats(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def judge(plan: LoadPlan, samples: list[dict[str, Any]], stats: list[dict[str, str]],
          locust_exit_code: int) -> LoadResult:
    """The run's figures and, in words, every reason it failed."""
    failed = [s for s in samples if s["failure"]]
    held = [s for s in samples if not s["failure"]]
    parts = {}
    for key, label in PARTS.items():
        values = [int(s[key]) for s in held if s.get(key) is not None]
        if values:
            parts[label] = asdict(percentiles(values))
    plane = [row for row in stats if row["Type"] not in ("KILL", "SHED", "")
             and row["Name"] not in NOT_THE_CONTROL_PLANE]
    shed = sum(int(row["Request Count"]) for row in stats if row["Type"] == "SHED")
    requests = sum(int(row["Request Count"]) for row in plane)
    request_failures = sum(int(row["Failure Count"]) for row in plane)
    rps = sum(float(row["Requests/s"]) for row in plane)
    problems = [f"kill of agent {s['agent_id']} failed: {s['failure']}" for s in failed]
    if not samples:
        problems.append("no kill was measured: the killers found no working agent, or Locust "
                        "did not run (see its log)")
    exited = parts.get(PARTS["daemon_exited_ns"])
    if plan.max_kill_p99_ms is not None and exited is not None \
            and exited["p99_us"] / 1000 > plan.max_kill_p99_ms:
        problems.append(f"kill → daemon exited p99 {exited['p99_us'] / 1000:.1f} ms is over "
                        f"the bound of {plan.max_kill_p99_ms:.0f} ms")
    if request_failures:
        problems.append(f"{request_failures} of {requests} requests to the control plane "
                        "failed under load (Locust's failures table says which)")
    if not stats:
        problems.append("Locust wrote no statistics (see its log)")
    return LoadResult(plan=plan, kills=len(samples), failed_kills=failed, parts_us=parts,
                      requests=requests, request_failures=request_failures,
                      requests_per_s=round(rps, 1), locust_exit_code=locust_exit_code,
                      files={}, problems=problems, shed_requests=shed)
