"""Locust load on a covey control plane, with the kill switch measured as its own request
type (DESIGN §3 "load"). Runnable by itself:

    locust -f harness/load/locustfile.py --host http://127.0.0.1:8080

with the environment that `gameday load` sets up for it (`COVEY_LOAD_*`, below), or by
`gameday load`, which brings the stack and its working agents up first. Locust's gevent
monkey-patches the standard library: this file runs in Locust's own processes only, never
inside pytest or an asyncio service.

Operators read and write as people do (agents, backlogs, recordings, new tasks, heartbeat
fires). Killers pick a working agent, pull its switch and report three request types of
type `KILL`: kill → acknowledged (the switch's answer), kill → daemon acked (the daemon's
own `kill_ack`, on its clock), kill → daemon exited (the sandbox's exit as the control plane
recorded it) and kill → task open (the work back in the backlog);
then they resume the agent. A kill fails, as a Locust failure with its reason, when the
agent's daemon sent a model request after the kill was acknowledged (the puppet's ledger,
judged as harness.judge.checkers judges a game day: by the daemon's send stamp, against the
earlier of the switch's answer and the daemon's own `kill_ack`), when the daemon did not
exit with code 3, or when a part took longer than the bound.
"""

from __future__ import annotations

import json
import os
import random
import time
from datetime import datetime
from pathlib import Path
from typing import Any, cast

from locust import HttpUser, between, events, task
from locust.clients import ResponseContextManager as Response
from locust.env import Environment
from locust.runners import MasterRunner

from harness.judge.checkers import kill_acknowledged_at
from harness.load.kills import LEDGER_MARGIN_NS, daemon_acks, late_requests

KILL = "KILL"
ACKNOWLEDGED = "kill → acknowledged"
DAEMON_ACKED = "kill → daemon acked"
DAEMON_EXITED = "kill → daemon exited"
TASK_OPEN = "kill → task open"
HELD = "kill held"  # the whole kill: its failure says which rule broke
# 409s that are the control plane keeping its rules, not failures of the load: a stopped
# agent is not started (a killer holds it), and heartbeat work does not pile up beyond its
# bound (the operators fire more often than silent agents work it off).
RULES_KEPT = {"Agent or fleet is stopped", "Too many unfinished heartbeat tasks"}
# A read the control plane shed (429, covey.admission: too many reads at once, so that the
# switches stay quick) is counted apart, as this request type, and not as the route's
# answer: it is the plane keeping a rule, not failing; its people wait the Retry-After.
SHED = "SHED"
# Polling only says when to look (the figures are the control plane's own stamps), but its
# requests are load too: 50 ms keeps the killer's own traffic small beside the operators'.
POLL_S = 0.05
# The killer's reads of what its kill did are waited out this often when shed (1 s each):
# its figures are the control plane's own stamps, so a late look changes none of them.
KILLER_RETRIES = 30


def _env(name: str, default: str | None = None) -> str:
    value = os.environ.get(name, default)
    if value is None:
        raise RuntimeError(f"{name} is not set: run this file through `gameday load`, or set "
                           "the COVEY_LOAD_* variables its docstring names")
    return value


class KillFailed(Exception):
    """A kill that did not hold: the reason is what Locust's failure table shows."""


class CoveyUser(HttpUser):
    abstract = True
    token_variable = ""

    def on_start(self) -> None:
        self.client.headers["Authorization"] = f"Bearer {_env(self.token_variable)}"
        self.prefix = _env("COVEY_LOAD_AGENT_PREFIX", "")

    def load_agents(self) -> list[dict[str, Any]]:
        r = self.read("/api/v1/agents", name="/api/v1/agents")
        if r is None or not r.ok:
            return []
        agents: list[dict[str, Any]] = r.json()
        return [a for a in agents if a["slug"].startswith(self.prefix)]

    def read(self, path: str, name: str, params: dict[str, str] | None = None,
             retries: int = 0) -> Response | None:
        """A GET; a shed one is counted as SHED, waited out (its Retry-After) and tried
        again up to `retries` times. None: shed every time."""
        for _ in range(retries + 1):
            with self.client.get(path, name=name, params=params, catch_response=True) as r:
                if r.status_code != 429:
                    return cast(Response, r)
                r.request_meta["request_type"] = SHED
                r.success()
            time.sleep(float(r.headers.get("Retry-After") or 1))
        return None


def _operator_wait_s() -> tuple[float, float]:
    """Between one operator's requests: people at work by default; an incident's crowd
    (harness.load.operators) asks more often."""
    low, _, high = os.environ.get("COVEY_LOAD_OPERATOR_WAIT_S", "0.5,2.0").partition(",")
    return float(low), float(high or low)


class Operator(CoveyUser):
    """Somebody at work: reads most of the time, now and then gives an agent work."""

    weight = int(os.environ.get("COVEY_LOAD_OPERATOR_WEIGHT", "10"))
    wait_time = between(*_operator_wait_s())
    token_variable = "COVEY_LOAD_OPERATOR_TOKEN"

    def on_start(self) -> None:
        super().on_start()
        self.agents = self.load_agents()

    def an_agent(self) -> dict[str, Any] | None:
        return random.choice(self.agents) if self.agents else None

    @task(4)
    def list_agents(self) -> None:
        self.agents = self.load_agents() or self.agents

    @task(3)
    def read_backlog(self) -> None:
        if agent := self.an_agent():
            self.read(f"/api/v1/agents/{agent['id']}/backlog",
                      name="/api/v1/agents/[id]/backlog")

    @task(2)
    def read_recording(self) -> None:
        if agent := self.an_agent():
            self.read(f"/api/v1/agents/{agent['id']}/recording",
                      name="/api/v1/agents/[id]/recording")

    @task(1)
    def create_task(self) -> None:
        if agent := self.an_agent():
            self.client.post(f"/api/v1/agents/{agent['id']}/tasks",
                             json={"title": "load: look into the latest orders", "body": ""},
                             name="/api/v1/agents/[id]/tasks")

    @task(1)
    def fire_heartbeat(self) -> None:
        if agent := self.an_agent():
            with self.client.post(f"/api/v1/agents/{agent['id']}/heartbeats/load/fire",
                                  name="/api/v1/agents/[id]/heartbeats/[name]/fire",
                                  catch_response=True) as r:
                if r.status_code == 409 and r.json().get("error") in RULES_KEPT:
                    r.success()


def _pause_s() -> tuple[float, float]:
    low, _, high = os.environ.get("COVEY_LOAD_KILLER_PAUSE_S", "1.0,2.0").partition(",")
    return float(low), float(high or low)


class Killer(CoveyUser):
    """The on-call engineer pulling one agent's switch, again and again."""

    fixed_count = int(os.environ.get("COVEY_LOAD_KILLERS", "1"))
    wait_time = between(*_pause_s())
    token_variable = "COVEY_LOAD_KILLER_TOKEN"

    def on_start(self) -> None:
        super().on_start()
        self.ledger_url = _env("COVEY_LOAD_PUPPET_URL").rstrip("/") + "/puppet/ledger"
        self.bound_ms = float(_env("COVEY_LOAD_KILL_BOUND_MS", "5000"))
        samples = os.environ.get("COVEY_LOAD_SAMPLES")
        self.samples = Path(samples) / f"kills-{os.getpid()}-{id(self)}.jsonl" \
            if samples else None

    @task
    def kill_a_working_agent(self) -> None:
        working = [a for a in self.load_agents()
                   if a["status"] == "working" and not a["killed"] and not a["fleet_killed"]]
        if not working:
            return
        agent = random.choice(working)
        path = f"/api/v1/agents/{agent['id']}"
        invoked_ns = time.time_ns()
        r = self.client.post(f"{path}/kill", name="/api/v1/agents/[id]/kill")
        acknowledged_ns = time.time_ns()
        if not r.ok:
            return  # Locust has counted the failed request itself
        report = r.json()
        if report["already_killed"]:
            return  # another killer got there first: its measurement, not ours
        if not report["sessions_cancelled"]:
            # Its session ended between the read and the kill: nothing was stopped, so there
            # is nothing to time. Let it go and pick again.
            self.client.post(f"{path}/resume", name="/api/v1/agents/[id]/resume")
            return
        sample: dict[str, Any] = {"agent_id": agent["id"], "invoked_ns": invoked_ns,
                                  "acknowledged_ns": acknowledged_ns - invoked_ns,
                                  "daemon_acked_ns": None, "daemon_exited_ns": None,
                                  "task_open_ns": None, "exit_codes": [], "failure": None,
                                  "late_requests": [], "confirmed_by": []}
        try:
            self._fire(ACKNOWLEDGED, sample["acknowledged_ns"])
            exited, opened = self._stopped(path, report["sessions_cancelled"],
                                           set(report["tasks_requeued"]), invoked_ns)
            sample.update(daemon_exited_ns=exited[0], exit_codes=exited[1],
                          task_open_ns=opened)
            if opened is not None:  # None: the kill found no work in progress
                self._fire(TASK_OPEN, opened)
            confirmed = self._confirmed(path, report["sessions_cancelled"])
            # How each daemon's stop was confirmed: its kill_ack, or a lapsed lease or
            # hang-up when the kill message came too late (a starved control plane).
            sample["confirmed_by"] = [s["kill_confirmed_by"] for s in confirmed]
            acks = daemon_acks(confirmed)
            if acks:  # the daemon's own clock: when the last of them had the kill in hand
                sample["daemon_acked_ns"] = max(acks) - invoked_ns
                self._fire(DAEMON_ACKED, sample["daemon_acked_ns"])
            acked_ns = kill_acknowledged_at(acknowledged_ns, acks)
            ledger = self._ledger(agent["id"], acked_ns)
            late = late_requests(ledger, acked_ns)
            sample["late_requests"] = late
            # What judging by the puppet's own stamps would have counted: requests it saw
            # after the switch's answer (every one of them sent before the acknowledgement
            # unless it is in `late`).
            sample["seen_after_answer"] = sum(1 for e in ledger if e["at_ns"] > acknowledged_ns)
            if late:
                unconfirmed = set(report["sessions_cancelled"]) - set(
                    report.get("sessions_confirmed", []))
                last = max(late, key=lambda r: r["made_ns"])
                raise KillFailed(
                    f"agent {agent['slug']}'s daemon sent {len(late)} model request(s) after "
                    f"its kill was acknowledged "
                    + ("by the daemon" if acked_ns < acknowledged_ns else "by the switch")
                    + f", the last {(last['made_ns'] - acked_ns) / 1e6:.1f} ms after ("
                    + ("its send stamp" if last["sent_ns"] is not None
                       else "no send stamp: when the puppet saw it")
                    + "); the answer "
                    + (f"had not waited for {len(unconfirmed)} daemon(s)" if unconfirmed
                       else "said every daemon had the kill in hand"))
        except KillFailed as failure:
            sample["failure"] = str(failure)
            self._fire(HELD, (time.time_ns() - invoked_ns), failure)
        else:
            self._fire(HELD, (time.time_ns() - invoked_ns))
        finally:
            self._record(sample)
            self.client.post(f"{path}/resume", name="/api/v1/agents/[id]/resume")

    # ------------------------------------------------------------------ the measurements

    def _stopped(self, path: str, sessions: list[str], held: set[str], invoked_ns: int
                 ) -> tuple[tuple[int, list[int]], int | None]:
        """Poll until the cancelled sessions' daemons have exited and the held tasks are open
        again, then time both on the control plane's own clock (the same machine's: load
        goes to 127.0.0.1 only): the daemons' exits, the tasks' transitions to open.
        Polling only says when to look; it adds nothing to the figures."""
        # Long enough to measure a kill that breaks the bound, bounded all the same.
        patience_s = max(self.bound_ms / 1000 * 2, 10.0)
        deadline = time.monotonic() + patience_s
        boxes = {s["sandbox_id"] for s in self._json(f"{path}/sessions")
                 if s["id"] in sessions and s["sandbox_id"]}
        while True:
            rows = [b for b in self._json(f"{path}/sandboxes") if b["id"] in boxes]
            tasks = {t["id"]: t["state"] for t in self._json(f"{path}/backlog")}
            exited = all(b["exit_code"] is not None and b["daemon_exited_at"] for b in rows)
            if exited and all(tasks.get(t) == "open" for t in held):
                break
            if time.monotonic() > deadline:
                stuck = {t: tasks.get(t) for t in held if tasks.get(t) != "open"}
                raise KillFailed(f"{patience_s:.0f} s after the kill, "
                                 + ("tasks were not open again: " + json.dumps(stuck)
                                    if exited else "a daemon had not exited"))
            time.sleep(POLL_S)
        codes = [b["exit_code"] for b in rows]
        exited_ns = max((_ns(b["daemon_exited_at"]) - invoked_ns for b in rows), default=0)
        failure = None
        if any(code != 3 for code in codes):
            failure = KillFailed(f"daemons exited with {codes}, not 3 (kill switch)")
        elif exited_ns / 1e6 > self.bound_ms:
            failure = KillFailed(f"the daemon exited {exited_ns / 1e6:.0f} ms after the kill, "
                                 f"over the bound of {self.bound_ms:.0f} ms")
        self._fire(DAEMON_EXITED, exited_ns, failure)
        if failure is not None:
            raise failure
        opened_ns: int | None = None
        for task_id in held:
            answer = self.read(f"{path}/tasks/{task_id}", name="/api/v1/agents/[id]/tasks/[id]",
                               retries=KILLER_RETRIES)
            if answer is None or not answer.ok:
                raise KillFailed(f"GET {path}/tasks/{task_id} answered "
                                 + ("429 every time" if answer is None
                                    else f"{answer.status_code}: {answer.text[:200]}"))
            detail = answer.json()
            reopened = [_ns(t["at"]) for t in detail["transitions"]
                        if t["to_state"] == "open" and _ns(t["at"]) >= invoked_ns]
            if not reopened:
                raise KillFailed(f"task {task_id} shows no transition back to open")
            opened_ns = max(opened_ns or 0, min(reopened) - invoked_ns)
        return (exited_ns, codes), opened_ns

    def _confirmed(self, path: str, sessions: list[str]) -> list[dict[str, Any]]:
        """The cancelled sessions' records once they say how the kill was confirmed, which
        they do by the time their daemons have hung up (bounded all the same)."""
        deadline = time.monotonic() + 5.0
        while True:
            rows = [s for s in self._json(f"{path}/sessions") if s["id"] in sessions]
            if all(s["kill_confirmed_by"] for s in rows) or time.monotonic() > deadline:
                return rows
            time.sleep(POLL_S)

    def _ledger(self, agent_id: str, acknowledged_ns: int) -> list[dict[str, Any]]:
        # Only what the puppet saw lately: the read stays small however long the run.
        r = self.client.get(self.ledger_url, name="puppet ledger", params={
            "agent": agent_id, "after_ns": str(acknowledged_ns - LEDGER_MARGIN_NS)})
        r.raise_for_status()
        rows: list[dict[str, Any]] = r.json()
        return rows

    def _json(self, path: str, params: dict[str, str] | None = None) -> list[dict[str, Any]]:
        name = "/api/v1/agents/[id]/" + path.rsplit("/", 1)[-1]
        r = self.read(path, name=name, params=params, retries=KILLER_RETRIES)
        if r is None:
            raise KillFailed(f"GET {path} was shed (429) {KILLER_RETRIES + 1} times running")
        if not r.ok:
            raise KillFailed(f"GET {path} answered {r.status_code}: {r.text[:200]}")
        rows: list[dict[str, Any]] = r.json()
        return rows

    def _fire(self, name: str, ns: int, failure: Exception | None = None) -> None:
        self.environment.events.request.fire(
            request_type=KILL, name=name, response_time=ns / 1e6, response_length=0,
            exception=failure, context={})

    def _record(self, sample: dict[str, Any]) -> None:
        if self.samples is not None:
            with self.samples.open("a") as out:
                out.write(json.dumps(sample) + "\n")


def _ns(timestamp: str) -> int:
    return int(datetime.fromisoformat(timestamp).timestamp() * 1_000_000_000)


def _check_environment(environment: Environment, **_: Any) -> None:
    """Fail at start, not at the first request, when the set-up is missing (a master that
    only collects from workers needs none of it)."""
    if isinstance(environment.runner, MasterRunner):
        return
    for name in ("COVEY_LOAD_OPERATOR_TOKEN", "COVEY_LOAD_KILLER_TOKEN",
                 "COVEY_LOAD_PUPPET_URL"):
        _env(name)


events.init.add_listener(_check_environment)  # type: ignore[no-untyped-call]
