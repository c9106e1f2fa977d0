"""rm -rf: the agent switch beside `docker kill` and `docker stop` (issue 7, DESIGN §4).

    bash scripts/setup && .venv/bin/python -m benchmarks.rm_rf [--json PATH]

One run, one game day per stack and fleet size (harness.stack: `processes` and `containers`,
5 and 20 agents). Every agent runs the rm -rf game day's script (`rm -rf ./*` in a loop,
fixtures/scripts/rm_rf.yaml; guard limits out of reach, so only the stop under test ends
it). In each round every agent is stopped at the same moment of its loop, its `--at`-th
`rm` call of the round (seen in the puppet's ledger), each by one of three instruments,
taken in turn so that every instrument meets every agent:

* `switch`: its owner pulls the agent's switch (POST /api/v1/agents/{id}/kill, recorded by
  the game day's operator), then resumes it for the next round;
* `docker kill` / `docker stop` of the agent's sandbox container (containers stack); on the
  processes stack their equals on the sandbox's process group: SIGKILL, and SIGTERM with
  SIGKILL 10 s later (docker stop's default). The control plane sees a daemon lost and wakes
  the agent again, as it would after either command.

Per stop, from the instant before the request (the HTTP call, the Docker API call, the
signal): its answer, the killed sandbox's last model call, its daemon's exit and the sandbox
gone (both as the control plane recorded them: the sandbox rows' `daemon_exited_at`,
`gone_at`), the `rm` calls that sandbox was answered with after the request, and the `rm`
calls of the agent, whatever sandbox it ran in, within `--window` seconds of the request
(a blunt instrument stops a sandbox, not the agent). Percentiles: harness.judge.time_to_stop (HDR).
Bounded: every wait has a deadline, the run has --max-seconds; traffic goes to 127.0.0.1
and the stacks' own containers only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.stack import load_average, machine
from harness.act.client import json_of
from harness.act.puppet import LedgerEntry
from harness.judge.checkers import CHECKERS, each_task_done_once_after_resume
from harness.judge.time_to_stop import percentiles
from harness.record.gameday import GameDay
from harness.stack.base import Stack
from harness.stack.containers import ContainersStack
from harness.stack.processes import ProcessesStack
from harness.stack.waiting import eventually

# The game day's checkers, but one: every agent's task is the `rm -rf` loop, which only a stop
# ends, so no task is ever done, after a resume or not ("false" in every run, saying nothing).
JUDGED = tuple(c for c in CHECKERS if c is not each_task_done_once_after_resume)

INSTRUMENTS = ("switch", "docker kill", "docker stop")
PARTS = ("answered", "last_action", "daemon_exit", "sandbox_gone")
NO_LOOP_TRIP = {"loop_window": 1000, "loop_repeats": 1000}
STOP_TIMEOUT_S = 10.0  # docker stop's default, and its equal on the processes stack
MOMENT_ATTEMPTS = 5  # sandboxes that may end on their own before one reaches the moment


@dataclass
class StopSample:
    """One agent's sandbox stopped by one instrument (ns after the request)."""

    instrument: str
    agent_id: str
    sandbox_id: str
    round: int
    answered_ns: int
    last_action_ns: int | None
    daemon_exit_ns: int | None
    sandbox_gone_ns: int | None
    exit_code: int | None
    deletions_by_sandbox: int  # rm calls that sandbox was answered with after the request
    deletions_by_agent_in_window: int  # rm calls of the agent, any sandbox, within --window


@dataclass
class Run:
    stack: str
    agents: int
    rounds: int
    samples: list[StopSample] = field(default_factory=list)
    figures: dict[str, dict[str, Any]] = field(default_factory=dict)
    lease_lapses: int = 0
    journal: str = ""
    load_at_start: str = ""  # the load average as the run began (load_average())


def is_rm(entry: LedgerEntry) -> bool:
    return entry.tool == "shell" and "rm " in str(entry.args.get("cmd", ""))


def _ns(stamp: str | None) -> int | None:
    return None if stamp is None else int(datetime.fromisoformat(stamp).timestamp() * 1e9)


class Instruments:
    """The blunt instruments, on either stack: docker's commands on a sandbox container, or
    their equals on a sandbox's process group."""

    def __init__(self, stack: str) -> None:
        self.docker: Any = None
        if stack == "containers":
            import docker

            self.docker = docker.from_env(max_pool_size=40)

    def close(self) -> None:
        if self.docker is not None:
            self.docker.close()

    def hit(self, instrument: str, handle: str) -> None:
        """Blocking: run it in a thread. Returns when the command would return."""
        if self.docker is not None:
            import docker.errors

            # Gone already (it ended on its own meanwhile): the sample says so by its times.
            with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                container = self.docker.containers.get(handle)
                if instrument == "docker kill":
                    container.kill()
                else:
                    container.stop(timeout=int(STOP_TIMEOUT_S))
            return
        pgid = int(handle)
        with contextlib.suppress(ProcessLookupError):
            if instrument == "docker kill":
                os.killpg(pgid, signal.SIGKILL)
                return
            os.killpg(pgid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while os.path.exists(f"/proc/{pgid}") and time.monotonic() < deadline:
                time.sleep(0.01)
            if os.path.exists(f"/proc/{pgid}"):
                os.killpg(pgid, signal.SIGKILL)


async def live_sandbox(day: GameDay, agent_id: str, deadline_s: float) -> dict[str, Any]:
    async def running() -> dict[str, Any] | None:
        return next((s for s in await day.sandboxes(agent_id) if s["state"] == "running"
                     and s["handle"] and s["daemon_exited_at"] is None), None)
    found: dict[str, Any] = await eventually(running, deadline_s, f"agent {agent_id} has no "
                                             "running sandbox", interval=0.5)
    return found


async def stop_one(day: GameDay, tools: Instruments, agent_id: str, instrument: str,
                   round_: int, options: argparse.Namespace) -> StopSample:
    """Wait for the agent's `--at`-th rm call in the sandbox it runs now, stop that sandbox
    with `instrument`, then read what each part took. Only the puppet's ledger is polled
    meanwhile: polling the control plane as fast starved its lease renewals on a loaded
    machine, and the daemons failed closed before any instrument was used. A sandbox that
    ended on its own all the same is counted apart (`ended_before_the_request`)."""
    puppet = day.endpoints.puppet
    at: int = options.at
    for _ in range(MOMENT_ATTEMPTS):
        box = await live_sandbox(day, agent_id, options.timeout)
        since = _ns(box["created_at"]) or 0

        async def at_moment(since: int = since) -> bool:
            return sum(1 for e in await puppet.actions(agent_id)
                       if is_rm(e) and e.at_ns >= since) >= at
        await eventually(at_moment, options.timeout, f"agent {agent_id} never reached rm "
                         f"call {at} in its sandbox", interval=0.3)
        # One look at the control plane's row: a sandbox that ended meanwhile (its daemon
        # lost its channel or lease on a loaded machine) is not stopped; the next one is.
        row = next(s for s in await day.sandboxes(agent_id) if s["id"] == box["id"])
        if row["daemon_exited_at"] is None:
            break
    t0 = time.time_ns()
    if instrument == "switch":
        json_of(await day.as_("agent_owner").kill_agent(agent_id))
        # The request is the kill's own HTTP call, as the history records it: the operator
        # reads every task right before it and right after its answer (what the requeue
        # checkers judge), and those reads are the harness's, not the switch's. Counted from
        # before them, a switch once "let through" the rm calls of a 100 ms task read.
        kill = [op for op in day.history.operations("kill_agent")
                if op.value.get("agent_id") == agent_id][-1]
        t0, answered = kill.start_ns, (kill.end_ns or time.time_ns()) - kill.start_ns
    else:
        await asyncio.to_thread(tools.hit, instrument, str(box["handle"]))
        answered = time.time_ns() - t0

    async def gone() -> dict[str, Any] | None:
        row = next(s for s in await day.sandboxes(agent_id) if s["id"] == box["id"])
        return row if row["gone_at"] else None
    row = await eventually(gone, options.timeout + STOP_TIMEOUT_S, f"{instrument}: the "
                           f"sandbox of agent {agent_id} was never gone", interval=0.5)
    await asyncio.sleep(options.window)  # what the agent does after: the window's point
    later = [s for s in await day.sandboxes(agent_id) if (_ns(s["created_at"]) or 0) > since]
    next_start = min((_ns(s["created_at"]) or 0 for s in later), default=None)
    entries = [e for e in await puppet.actions(agent_id) if e.at_ns >= t0]
    own = [e for e in entries if next_start is None or e.at_ns < next_start]
    exited, gone_at = _ns(row["daemon_exited_at"]), _ns(row["gone_at"])
    return StopSample(
        instrument=instrument, agent_id=agent_id, sandbox_id=box["id"], round=round_,
        answered_ns=answered,
        last_action_ns=max((e.at_ns for e in own), default=t0) - t0 if own else None,
        daemon_exit_ns=None if exited is None else exited - t0,
        sandbox_gone_ns=None if gone_at is None else gone_at - t0,
        exit_code=row["exit_code"],
        deletions_by_sandbox=sum(1 for e in own if is_rm(e)),
        deletions_by_agent_in_window=sum(1 for e in entries if is_rm(e)
                                         and e.at_ns - t0 <= options.window * 1e9))


async def recover(day: GameDay, stopped: list[StopSample], options: argparse.Namespace) -> None:
    """Back to work for the next round: the switched agents resumed by their owner, the
    others woken again by the control plane itself (a lost daemon's task is requeued)."""
    owner = day.as_("agent_owner")
    for s in stopped:
        if s.instrument == "switch":
            json_of(await owner.resume_agent(s.agent_id))

    async def working() -> bool:
        tasks = await day.read_tasks()
        return all(t["state"] == "in_progress" for t in tasks.values())
    await eventually(working, options.timeout, "the agents did not all get back to work",
                     interval=1.0)


def summarise(samples: list[StopSample]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for instrument in INSTRUMENTS:
        taken = [s for s in samples if s.instrument == instrument]
        # A sandbox that ended on its own before the request (a lapsed lease) measured
        # nothing of the instrument: counted, not folded in.
        mine = [s for s in taken if s.daemon_exit_ns is None or s.daemon_exit_ns >= 0]
        if not mine:
            continue
        got: dict[str, Any] = {"n": len(mine), "ended_before_the_request": len(taken) - len(mine),
                               "exit_codes": dict(Counter(str(s.exit_code) for s in mine))}
        for part in PARTS:
            values = [v for s in mine if (v := getattr(s, f"{part}_ns")) is not None]
            if values:
                p = percentiles(values)
                got[part] = {"n": p.count, "p50_ms": p.p50_us / 1000, "p99_ms": p.p99_us / 1000}
        for count in ("deletions_by_sandbox", "deletions_by_agent_in_window"):
            values = [getattr(s, count) for s in mine]
            got[count] = {"total": sum(values), "max": max(values),
                          "stops_with_any": sum(1 for v in values if v)}
        out[instrument] = got
    return out


async def one_run(stack: Stack, n: int, options: argparse.Namespace) -> Run:
    run = Run(stack=stack.name, agents=n, rounds=options.rounds)
    tools = Instruments(stack.name)
    try:
        async with stack.up() as endpoints:
            day = GameDay(name=f"rm_rf-bench-{stack.name}-{n}", stack=stack.name,
                          endpoints=endpoints, seed=options.seed, report_dir=options.report_dir,
                          checkers=JUDGED)
            status = "aborted"
            try:
                await day.enlist()
                agents = [await day.agent("rm_rf", guard=NO_LOOP_TRIP, owner="agent_owner")
                          for _ in range(n)]
                for a in agents:
                    json_of(await day.as_("agent_owner").create_task(a, "tidy up"), 201)
                await recover(day, [], options)
                for r in range(options.rounds):
                    print(f"  {stack.name} {n}: round {r + 1} of {options.rounds}", flush=True)
                    stops = await asyncio.gather(*(
                        stop_one(day, tools, a["id"], INSTRUMENTS[(i + r) % len(INSTRUMENTS)],
                                 r, options) for i, a in enumerate(agents)))
                    run.samples.extend(stops)
                    if r + 1 < options.rounds:
                        await recover(day, list(stops), options)
                verdicts, samples, _ = await day.judge()
                status = "completed"
                run.figures = summarise(run.samples)
                run.figures["checkers"] = {v.checker: v.valid for v in verdicts}
                # Daemons that stopped on their own, failing closed when their lease was
                # not renewed in time (a loaded machine): not stops of any instrument.
                auditor = day.people["auditor"]
                for a in agents:
                    run.lease_lapses += sum(1 for x in json_of(await auditor.sessions(a["id"]))
                                            if x["daemon_stop"] == "lease"
                                            and x["kill_sent_at"] is None)
                run.journal = str(day.journal(status, verdicts, samples, {}))
            finally:
                if not run.journal:
                    with contextlib.suppress(Exception):
                        run.journal = str(day.journal(status, [], [], {}))
                await day.close()
    finally:
        tools.close()
    return run


def render(runs: list[Run]) -> str:
    lines = ["ms after the request          n   answered p50/p99   last action p50/p99   "
             "daemon exit p50/p99   sandbox gone p50/p99   rm after (sandbox / agent in "
             "window)   exit codes"]
    for run in runs:
        lines.append(f"{run.stack} stack, {run.agents} agents, {run.rounds} rounds")
        for instrument in INSTRUMENTS:
            f = run.figures.get(instrument)
            if f is None:
                continue
            cells = []
            for part in PARTS:
                p = f.get(part)
                cells.append("      -       " if p is None else
                             f"{p['p50_ms']:7.1f} / {p['p99_ms']:7.1f}")
            lines.append(f"  {instrument:<12} {f['n']:>4}   " + "   ".join(cells)
                         + f"   {f['deletions_by_sandbox']['total']:>4} / "
                         f"{f['deletions_by_agent_in_window']['total']:<4}   "
                         f"{f['exit_codes']}")
        lines.append(f"  sessions that failed closed on a lapsed lease, no instrument's doing: "
                     f"{run.lease_lapses}")
        lines.append(f"  checkers: {run.figures.get('checkers')}")
    return "\n".join(lines)


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rm_rf",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--stacks", default="processes,containers")
    p.add_argument("--agents", default="5,20", help="fleet sizes, comma-separated (5,20)")
    p.add_argument("--rounds", type=int, default=3, help="stops per agent (3)")
    p.add_argument("--at", type=int, default=3,
                   help="stop at this rm call of the sandbox's loop (3)")
    p.add_argument("--window", type=float, default=3.0,
                   help="rm calls of the agent counted this long after the request, s (3)")
    p.add_argument("--image", default=os.environ.get("COVEY_SANDBOX_IMAGE",
                                                     "covey-gameday:latest"))
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--lease-ms", type=int, default=2000,
                   help="the stacks' kill-flag lease (2000, as the game days')")
    p.add_argument("--timeout", type=float, default=120, help="bound of each wait, s (120)")
    p.add_argument("--max-seconds", type=float, default=3600)
    p.add_argument("--report-dir", type=Path, default=Path("reports"))
    p.add_argument("--json", type=Path, help="write every figure and raw sample here")
    return p.parse_args(argv)


async def run_all(options: argparse.Namespace) -> list[Run]:
    runs = []
    for name in [s for s in options.stacks.split(",") if s]:
        for n in [int(x) for x in options.agents.split(",") if x]:
            stack: Stack = (ProcessesStack(options.report_dir, lease_ms=options.lease_ms)
                            if name == "processes" else
                            ContainersStack(options.report_dir, image=options.image,
                                            lease_ms=options.lease_ms))
            load = load_average()
            print(f"{name}, {n} agents (load {load})", flush=True)
            runs.append(await one_run(stack, n, options))
            runs[-1].load_at_start = load
            print(render(runs[-1:]), flush=True)  # each run's figures as soon as it ends
            if options.json:
                write_json(options, runs)
    return runs


def write_json(options: argparse.Namespace, runs: list[Run]) -> None:
    options.json.parent.mkdir(parents=True, exist_ok=True)
    options.json.write_text(json.dumps({
        "command": options.command, "started_at": options.started_at,
        "ended_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": options.machine, "image": options.image,
        "runs": [asdict(r) for r in runs]}, indent=2, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    options = parse_options(argv)
    options.command = "python -m benchmarks.rm_rf " + " ".join(
        sys.argv[1:] if argv is None else argv)
    options.started_at = datetime.now(UTC).isoformat(timespec="seconds")
    options.machine = machine()  # its load average is the one at the start, not at a write

    async def bounded() -> list[Run]:
        async with asyncio.timeout(options.max_seconds):
            return await run_all(options)

    runs = asyncio.run(bounded())
    print(render(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
