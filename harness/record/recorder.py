"""What the game day's people write to and read through: its history, and the reads that
land in it (every task, what is left on the machine), as Jepsen's operations go through the
history they are recorded in.

`GameDay` builds one over its own history, agents and people and hands it to the operators,
the waits and the expectations (harness/act/), which need nothing else of the game day.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

from harness.act.client import CoveyClient, json_of
from harness.act.dialect import dialect
from harness.act.switch_line import LINE_EXTENSION, SwitchLineGone
from harness.judge.checkers import SANDBOX_REMAINS_F
from harness.record.history import History
from harness.record.remains import DaemonExit, daemon_exits, remains_of

# The game day's phases as they happen, for whoever listens (`gameday run` shows them).
phases = logging.getLogger("harness.record.gameday")
OBSERVER = "observer"
# The operations that are switches (kill, resume, a global or tool stop and their release).
SWITCH_PREFIXES = ("kill_", "resume_", "stop_", "clear_")


@dataclass(frozen=True)
class Recorder:
    """The history a game day's operations and observations go to, and the reads of the
    system under test that are recorded in it. Its parts are the game day's own (the same
    history, agents, people, notes and measurements), not copies."""

    history: History
    agents: Mapping[str, dict[str, Any]]
    people: Mapping[str, CoveyClient]
    # Organisations beside the game day's, each by id with its admin (who reads its agents).
    admins_beside: Mapping[str, CoveyClient]
    dialect_name: str
    stack: str
    data_dir: Path | None
    lease_ms: int | None  # the kill-flag lease the stack's daemons hold, as it says
    notes: list[str]
    measurements: dict[str, Any]

    @property
    def lease_s(self) -> float:
        """The kill-flag lease the stack's daemons hold, from the stack itself."""
        if self.lease_ms is None:
            raise LookupError(f"the {self.stack} stack does not say what lease its daemons "
                              f"hold")
        return self.lease_ms / 1000

    def reader(self, agent_id: str) -> CoveyClient:
        """Who reads this agent: its organisation's admin when it is one beside the game
        day's, else the game day's auditor (who may not see another organisation's)."""
        org = self.agents.get(agent_id, {}).get("org_id")
        return self.admins_beside.get(str(org), self.people["auditor"])

    # ------------------------------------------------------------------ operations

    async def operate(self, role: str, f: str, value: dict[str, Any],
                      call: Callable[[], Awaitable[httpx.Response]]) -> httpx.Response:
        """Invoke an operation as `role`, recording invoke and outcome as Jepsen does: ok for
        a 2xx; fail for a refusal (a 403 switch was not pulled) and for a request that never
        reached the control plane (nothing listened: it cannot have taken effect); info when
        nobody knows (the request failed on its way, or the control plane answered 503
        because its database was away: a kill may then be recorded in part). The scenario
        asserts what it expected."""
        invoke = self.history.invoke(f"operator:{role}", f, value)
        try:
            r = await call()
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            self.history.complete(invoke, "fail", {"error": repr(exc), "unreached": True})
            raise
        except httpx.HTTPError as exc:
            self.history.complete(invoke, "info", {"error": repr(exc)})
            raise
        except SwitchLineGone as exc:  # the harness's fault; whether the stop arrived is unknown
            self.history.complete(invoke, "info", {"error": repr(exc), "harness_fault": True})
            raise
        outcome: Literal["ok", "fail", "info"] = (
            "ok" if r.is_success else "info" if r.status_code == 503 else "fail")
        # The live output shows the switches and every refusal; a routine success (a task
        # created, a wake that started a session) is only in the history: 14 lines of
        # `create_task answered 201` once hid the kill among them.
        if r.is_success and not f.startswith(SWITCH_PREFIXES):
            phases.debug("%s: %s answered %s", role, f, r.status_code)
        elif r.is_success:
            phases.info("%s pulled %s: answered %s", role, f, r.status_code)
        else:
            phases.info("%s: %s refused with %s", role, f, r.status_code)
        body = r.json() if r.headers.get("content-type", "").startswith("application/json") \
            else {}
        result: dict[str, Any] = {"status": r.status_code, "body": body}
        if LINE_EXTENSION in r.extensions:
            result["line"] = r.extensions[LINE_EXTENSION]  # the stop's way before the wire
        if f == "wake" and isinstance(body, dict) and "outcome" in body:
            result["outcome"] = body["outcome"]  # a busy agent's wake started nothing
        elif f == "wake" and not dialect(self.dialect_name).reports:
            # Upstream's wake answers {"ok":true} whether or not it started anything: what
            # started is read from its sandboxes (session_start), not from this answer.
            result["outcome"] = "unreported"
        self.history.complete(invoke, outcome, result)
        return r

    # ------------------------------------------------------------------ observations

    def observe(self, f: str, value: dict[str, Any], time_ns: int | None = None) -> None:
        """Something the harness saw in the system under test, into the history."""
        self.history.observe(OBSERVER, f, value, time_ns=time_ns)

    async def read_tasks(self) -> dict[str, dict[str, Any]]:
        """Every task of every agent, each recorded as a `task_state` read from when its
        agent's backlog was asked for to when it came back: the state it shows held at some
        moment in between. As one observation stamped on arrival, a read sent before a
        kill's requeue committed and answered after the kill's own answer read as a task
        still in progress after the kill (in_progress_requeued failed a benchmark's run whose
        kill had answered with that very task requeued); stamped when sent, it would read as
        a state from before a kill it came back after."""
        tasks: dict[str, dict[str, Any]] = {}
        for agent_id in self.agents:
            sent = self.history.clock()
            for t in json_of(await self.reader(agent_id).backlog(agent_id)):
                tasks[t["id"]] = t
                read = self.history.record("invoke", OBSERVER, "task_state",
                                           {"task_id": t["id"], "agent_id": agent_id},
                                           time_ns=sent)
                self.history.complete(read, "ok", {"task_id": t["id"], "state": t["state"],
                                                   "agent_id": agent_id})
        return tasks

    async def sandboxes(self, agent_id: str) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = json_of(await self.reader(agent_id).sandboxes(agent_id))
        return rows

    async def sessions(self, agent_id: str) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = json_of(await self.reader(agent_id).sessions(agent_id))
        return rows

    async def remains(self, agent_id: str, record: bool = True) -> list[str] | None:
        """What of the agent's sandboxes still exists on this machine, looked at directly
        (harness/record/remains.py), recorded as a `sandbox_remains` observation; None where the
        stack's sandboxes are not on this machine."""
        found = await asyncio.to_thread(remains_of, self.stack, agent_id, self.dialect_name)
        if record and found is not None:
            self.observe(SANDBOX_REMAINS_F, {"agent_id": agent_id, "remains": found})
        return found

    async def daemon_exits(self, sandbox_ids: list[str]) -> dict[str, DaemonExit] | None:
        """How these sandboxes' daemons ended, read on this machine (harness/record/remains.py)
        rather than asked of the control plane; None where the stack's sandboxes are not here."""
        return await asyncio.to_thread(daemon_exits, self.stack, sandbox_ids, self.data_dir)

    async def why_work_cannot_finish(self, agents: list[str] | None = None) -> str | None:
        """Why this game day's unfinished tasks cannot all end done without a human, or None
        while they still can: the fleet stop stands, an agent with unfinished work is
        stopped, or a task ended where nothing requeues it (failed, cancelled, blocked).
        Nothing in a game day resumes on its own: that is the scenario's operators' job.
        `agents`: only these agents' work (default: every agent of the game day)."""
        fleet = json_of(await self.people["auditor"].fleet())
        if fleet.get("global_stop"):
            return ("a platform admin's global kill flag stops every organisation and nobody "
                    "will clear it")
        if fleet["fleet_killed"]:
            return "the fleet stop stands and nobody will resume it"
        for agent_id in self.agents if agents is None else agents:
            tasks = json_of(await self.reader(agent_id).backlog(agent_id))
            stuck = [t for t in tasks if t["state"] in ("failed", "cancelled", "blocked")]
            if stuck:
                return (f"task {stuck[0]['id']} of agent {agent_id} is {stuck[0]['state']} "
                        f"and nothing requeues it")
            unfinished = [t for t in tasks if t["state"] != "done"]
            if unfinished:
                agent = json_of(await self.reader(agent_id).agent(agent_id))
                if agent["killed"]:
                    return (f"agent {agent_id} is killed (by {agent['kill_origin']}) with "
                            f"{len(unfinished)} unfinished tasks and nobody will resume it")
        return None
