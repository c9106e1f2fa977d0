"""The rules a stop must keep, as a scenario checks them while the game day goes on
(`day.expect`). Each check reads the control plane through the game day's people and fails
with the rule it found broken, in the words of DESIGN §2.3, never a bare comparison.

The checkers judge the history afterwards; these look at the control plane's answers and
state at the moment the rule applies (what a kill answered, what runs while a stop stands).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import httpx

from harness.act.client import json_of
from harness.act.dialect import dialect
from harness.stack.isolation import strangers_stopped
from harness.stack.waiting import eventually

if TYPE_CHECKING:
    from harness.act.operator import Operator
    from harness.record.gameday import GameDay

LIVE = ("starting", "running")
RELEASE_WAKE_S = 3.0


def _ns(stamp: str) -> int:
    return int(datetime.fromisoformat(stamp).timestamp() * 1e9)


async def _all_or_none(started: Callable[[], Awaitable[set[str]]], wanted: set[str]
                       ) -> set[str] | None:
    found = await started()
    return found if found >= wanted else None


class RuleBroken(AssertionError):
    """A kill-switch rule did not hold; the message says which, and what was seen."""


def rule(holds: bool, broken: str) -> None:
    if not holds:
        raise RuleBroken(broken)


@dataclass(frozen=True)
class FleetStop:
    """What a fleet kill answered, for the game day's own agents."""

    requeued: set[str]  # tasks of the game day it put back to open
    cancelled: set[str]  # sessions it stopped


class Expect:
    def __init__(self, day: GameDay) -> None:
        self.day = day
        self.auditor = day.people["auditor"]
        self.dialect = dialect(day.dialect_name)

    async def fleet_stop_answer(self, report: dict[str, Any],
                                agents: Iterable[dict[str, Any]]) -> FleetStop:
        """The fleet kill's answer: every agent stopped (a shared organisation's others too),
        work requeued, and every daemon holding the kill before the answer came. Where the
        answer reports none of it (upstream's `{"ok":true}`), it is read back instead."""
        if not self.dialect.reports:
            return await self._fleet_stop_read_back(list(agents), report)
        mine, stopped = {a["id"] for a in agents}, set(report["agents_stopped"])
        rule(mine <= stopped, f"the fleet stop left agents running: {sorted(mine - stopped)}")
        strangers = await strangers_stopped(self.day, mine, stopped)
        rule(strangers is None, str(strangers))
        tasks = await self.day.read_tasks()
        requeued = {t for t in report["tasks_requeued"] if t in tasks}
        rule(bool(requeued), "the fleet stop requeued none of the game day's tasks")
        cancelled = set(report["sessions_cancelled"])
        rule(bool(cancelled), "the fleet stop found no session to stop")
        rule(set(report["sessions_confirmed"]) == cancelled,
             "the fleet stop answered before every daemon had the kill in hand")
        unacked = cancelled - set(report["sessions_acknowledged"])
        rule(not unacked, f"daemons that did not acknowledge the kill before the answer: "
             f"{sorted(unacked)}")
        return FleetStop(requeued, cancelled)

    async def _fleet_stop_read_back(self, agents: list[dict[str, Any]],
                                    report: dict[str, Any]) -> FleetStop:
        """The fleet stop as the system shows it after an answer that says nothing: every
        agent flagged; the tasks a read before the kill showed in progress open again; the
        sessions (sandboxes) the kill cut."""
        self.day.notes.append(
            f"the {self.dialect.name} fleet kill answered {report}: whether every daemon held "
            f"the kill before the answer is not known; agents, tasks and sandboxes read back")
        kill = [op for op in self.day.history.operations("kill_fleet") if op.type == "ok"][-1]
        flagged = {a["id"]: json_of(await self.day.reader(a["id"]).agent(a["id"]))["killed"]
                   for a in agents}
        rule(all(flagged.values()), f"the fleet stop left agents running (not flagged): "
             f"{sorted(a for a, k in flagged.items() if not k)}")
        before: dict[str, str] = {}
        for e in self.day.history.select(f="task_state"):
            if e.time_ns < kill.start_ns:
                before[str(e.value["task_id"])] = str(e.value["state"])
        tasks = await self.day.read_tasks()
        requeued = {t for t, s in before.items() if s == "in_progress"
                    and tasks.get(t, {}).get("state") == "open"}
        rule(bool(requeued), "the fleet stop requeued none of the game day's tasks")
        cancelled = {s["id"] for a in agents for s in await self._sessions(a["id"])
                     if _ns(s["started_at"]) < kill.start_ns
                     and (s["ended_at"] is None or _ns(s["ended_at"]) >= kill.start_ns)}
        rule(bool(cancelled), "the fleet stop found no session to stop")
        return FleetStop(requeued, cancelled)

    async def only_this_agent_stopped(self, answer: httpx.Response, agent: dict[str, Any],
                                      others: Iterable[dict[str, Any]]) -> None:
        """One agent's switch stopped that agent and no other: as its answer reports, or,
        where the answer reports nothing, as the agents' flags read back."""
        report = json_of(answer)
        if self.dialect.reports:
            rule(report["agents_stopped"] == [agent["id"]], f"one agent's switch stopped "
                 f"other agents too: {report['agents_stopped']}")
            return
        flagged = {a["id"]: json_of(await self.auditor.agent(a["id"]))["killed"]
                   for a in (agent, *others)}
        rule(flagged[agent["id"]], f"the agent's own switch answered {report} but left agent "
             f"{agent['id']} unflagged")
        rule(not any(flagged[a["id"]] for a in others), f"one agent's switch stopped other "
             f"agents too: {sorted(a for a, k in flagged.items() if k and a != agent['id'])}")

    async def warm_sandbox_evicted(self, answer: httpx.Response, agent: dict[str, Any]
                                   ) -> None:
        """A killed warm agent keeps no sandbox, parked or running: the ones the kill says
        it evicted are gone, and none is left in any case."""
        report = json_of(answer)
        boxes = {s["id"]: s["state"] for s in await self.day.sandboxes(agent["id"])}
        evicted = report.get("evicted_sandboxes", []) if self.dialect.reports else []
        rule(all(boxes[b] in ("evicted", "gone") for b in evicted)
             and not [s for s in boxes.values() if s in ("parked", "running")],
             f"the killed warm agent kept a sandbox: {boxes}")

    async def daemons_obeyed(self, agents: Iterable[dict[str, Any]],
                             sessions: set[str]) -> set[str]:
        """Every daemon of the stopped sessions exited with 3 (the kill switch). Returns the
        agents that had one of those sessions."""
        agents = list(agents)
        stopped = {a["id"]: [s for s in json_of(await self.day.reader(a["id"]).sessions(a["id"]))
                             if s["id"] in sessions] for a in agents}
        boxes = {s["sandbox_id"] for ss in stopped.values() for s in ss}
        exits = {s["id"]: s["exit_code"] for a in agents
                 for s in await self.day.sandboxes(a["id"]) if s["id"] in boxes}
        rule(exits == dict.fromkeys(boxes, 3),
             f"daemons that did not obey the kill (exit code 3 expected): {exits}")
        return {agent for agent, ss in stopped.items() if ss}

    async def work_back_in_the_backlog(self, stop: FleetStop, in_progress: set[str]) -> None:
        """Nothing is left in progress; what the stop requeued is open; what was in progress
        went back to open unless it finished first."""
        tasks = await self.day.read_tasks()
        left = sorted(t for t, task in tasks.items() if task["state"] == "in_progress")
        rule(not left, f"tasks still in progress after the stop: {left}")
        rule(all(tasks[t]["state"] == "open" for t in stop.requeued),
             "a task the stop requeued is not open")
        rule(all(tasks[t]["state"] in ("open", "done") for t in in_progress),
             "a task in progress at the stop neither went back to open nor finished")

    async def nothing_starts(self, agent: dict[str, Any], triggered: dict[str, Any],
                             heartbeat: str, window_s: float = 2, by: Operator | None = None,
                             stop: str = "the fleet stop") -> None:
        """While `stop` stands every wake path refuses: a new task stays open through the
        new-task wake and the scheduler's ticks, and the manual heartbeat fire, the trigger
        and a manual wake bounce with 409 and the hint; no session of either agent starts.
        `by`: who acts (default: the game day's org admin)."""
        by = self.day.as_("org_admin") if by is None else by
        agents = {a["id"]: a for a in (agent, triggered)}
        before = {s["id"] for a in agents for s in await self._sessions(a)}
        fresh = json_of(await by.create_task(agent, "arrived during the stop"), 201)
        await asyncio.sleep(window_s)  # the window in which nothing may start
        state = json_of(await self.day.reader(agent["id"]).task(agent["id"], fresh["id"])
                        )["state"]
        rule(state == "open", f"a task that arrived during {stop} was started (it is "
             f"{state}): the new-task wake or the scheduler's tick ignored the stop")
        for path, what, r in (
                ("fire_heartbeat", "a manual heartbeat fire",
                 await by.fire_heartbeat(triggered, heartbeat)),
                ("trigger", "the external trigger", await by.trigger(triggered)),
                ("wake", "a manual wake (POST …/wake)", await by.wake(triggered))):
            status, body = self.dialect.refusals[path]
            rule((r.status_code, r.json()) == (status, body),
                 f"{what} was not refused during {stop}: {r.status_code} {r.text[:200]} "
                 f"(the {self.dialect.name} refusal: {status} {body})")
        started = {s["id"] for a in agents for s in await self._sessions(a)} - before
        rule(not started, f"sessions started during {stop}: {sorted(started)}")

    async def _sessions(self, agent_id: str) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = json_of(
            await self.day.reader(agent_id).sessions(agent_id))
        return found

    def honest_answer(self, answer: httpx.Response, what: str) -> None:
        """An answer given while a fault stands: it took effect (200) or said it could not
        (503, with a hint to act on); nothing else."""
        rule(answer.status_code in (200, 503),
             f"{what} answered {answer.status_code} {answer.text[:200]}: it must take "
             "effect (200) or say it could not (503)")
        if answer.status_code == 503:
            rule(bool(json_of(answer, 503).get("hint")), f"the 503 of {what} gives no hint")

    async def fleet_stopped_after(self, security: Operator, answer: httpx.Response,
                                  fault: str) -> None:
        """Once `fault` is over, the fleet stop pulled during it stands: a kill refused
        honestly then (503) works now, and one that answered 200 did not do nothing."""
        if answer.status_code == 503:
            rule((await security.kill_fleet()).status_code == 200,
                 f"the fleet kill failed after {fault} was over")
        rule(bool(json_of(await self.auditor.fleet())["fleet_killed"]),
             f"a fleet kill answered 200 during {fault}, yet the fleet is not stopped: a 200 "
             "that did nothing")

    async def no_model_call_between(self, agents: Iterable[dict[str, Any]], after_ns: int,
                                    before_ns: int | None, broken: str) -> None:
        """The puppet's ledger, outside the system under test: no agent called its model
        after `after_ns` (and before `before_ns`). `broken` says which rule a call breaks;
        the calls per agent follow it."""
        late = {}
        for a in agents:
            calls = [e for e in await self.day.endpoints.puppet.actions(a["id"])
                     if after_ns < e.at_ns and (before_ns is None or e.at_ns < before_ns)]
            if calls:
                late[a["id"]] = len(calls)
        rule(not late, f"{broken} ({late})")

    async def nothing_in_progress(self, after: str) -> None:
        """No task of the game day is in progress any more."""
        left = [t["id"] for t in (await self.day.read_tasks()).values()
                if t["state"] == "in_progress"]
        rule(not left, f"{after} left tasks in progress: {left}")

    async def only_security_holds_the_fleet_switch(self) -> None:
        """org_admin and controlling were told; the roles without the switch get 403."""
        if not self.dialect.notifications:
            self.day.notes.append(f"{self.dialect.name} covey keeps no notifications: whether "
                                  f"org_admin and controlling were told of the fleet stop is "
                                  f"not checked")
        for role in ("org_admin", "controlling") if self.dialect.notifications else ():
            notes = json_of(await self.day.people[role].notifications())
            rule(any(n["kind"] == "fleet_killed" for n in notes),
                 f"{role} was not notified of the fleet stop")
        for role in ("agent_owner", "auditor", "controlling"):
            who = self.day.as_(role)
            rule((await who.kill_fleet()).status_code == 403,
                 f"{role} may pull the fleet switch")
            rule((await who.resume_fleet()).status_code == 403, f"{role} may resume the fleet")

    async def held_by_the_fleet(self, agent: dict[str, Any], window_s: float = 1) -> None:
        """An agent resumed on its own while the fleet stop stands does not run."""
        released = json_of(await self.day.as_("org_admin").resume_agent(agent))
        if self.dialect.reports:
            rule(released["held_by_fleet"] is True and released["agents_woken"] == [],
                 "an agent resumed on its own ran while the fleet stop stood")
        await asyncio.sleep(window_s)  # nothing may start in this window either
        live = [s for s in json_of(await self.auditor.sessions(agent["id"]))
                if s["state"] in LIVE]
        rule(not live, "an agent resumed on its own started a session while the fleet stop "
             "stood")

    async def fleet_resume_wakes_open_work(self, security: Operator,
                                           agents: Iterable[dict[str, Any]]) -> set[str]:
        """Fleet resume wakes at once every one of these agents with open work (DESIGN §2.3
        line 5: not on the next tick). Returns the agents the answer woke."""
        return await self.release_wakes_open_work(security.resume_fleet, agents,
                                                  "the fleet resume")

    async def release_wakes_open_work(self, release: Callable[[], Awaitable[httpx.Response]],
                                      agents: Iterable[dict[str, Any]], what: str
                                      ) -> set[str]:
        """`release` (a resume, the global flag cleared) wakes at once every one of these
        agents with open work: in its answer, or through the tick the moment the flags
        cleared (a session new since the release). Returns the agents the answer woke."""
        ids = {a["id"] for a in agents}
        with_work = {t["agent_id"] for t in (await self.day.read_tasks()).values()
                     if t["state"] == "open" and t["agent_id"] in ids}
        before = {s["id"] for a in with_work for s in await self._sessions(a)}
        answer = json_of(await release())
        woken = set(answer["agents_woken"] if self.dialect.reports else ())

        async def started() -> set[str]:
            return {a for a in with_work - woken
                    if {s["id"] for s in await self._sessions(a)} - before}
        at_work = (woken & ids) | await started()
        if not self.dialect.reports and at_work < with_work:
            # The answer does not say whom it woke: "at once" is a sandbox started within
            # RELEASE_WAKE_S of it (upstream's scheduler tick is 1 s).
            with contextlib.suppress(AssertionError):
                await eventually(lambda: _all_or_none(started, with_work), RELEASE_WAKE_S,
                                 "not at once")
            at_work |= await started()
            self.day.notes.append(f"{what} answered {answer}: the agents it woke were read "
                                  f"from their sandboxes, within {RELEASE_WAKE_S:g} s")
        rule(at_work >= with_work, f"{what} did not wake at once every agent with open "
             f"work: {sorted(with_work - at_work)}")
        return woken

    async def work_done_after_fleet_resume(self, security: Operator,
                                           agents: Iterable[dict[str, Any]]
                                           ) -> dict[str, dict[str, Any]]:
        """The incident is over: the agents behave, the fleet resumes, and every task of the
        game day ends done. Returns the tasks."""
        for a in agents:
            await self.day.endpoints.puppet.assign(a["id"], "well_behaved")
        r = await security.resume_fleet()
        rule(r.status_code == 200, f"the fleet resume was refused: {r.status_code} {r.text}")
        return await self.day.until.all_tasks_done()
