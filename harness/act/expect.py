"""The rules a stop must keep, as a scenario checks them while the game day goes on
(`day.expect`). Each check reads the control plane through the game day's people and fails
with the rule it found broken, in the words of DESIGN §2.3, never a bare comparison.

The checkers judge the history afterwards; these look at the control plane's answers and
state at the moment the rule applies (what a kill answered, what runs while a stop stands).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
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
    from harness.act.operator import AgentRef, Operator, Until
    from harness.nemesis import FaultRecord
    from harness.record.recorder import Recorder
    from harness.stack.base import Endpoints
    from harness.stack.isolation import Organisation

LIVE = ("starting", "running")
RELEASE_WAKE_S = 3.0


def _ns(stamp: str) -> int:
    return int(datetime.fromisoformat(stamp).timestamp() * 1e9)


async def _all_or_none(started: Callable[[], Awaitable[set[str]]], wanted: set[str]
                       ) -> set[str] | None:
    found = await started()
    return found if found >= wanted else None


# What a daemon stopped by a switch says in its exit line (covey.coveyd): it obeyed a kill, or
# it failed closed (its lease lapsed, its channel gone).
WHYS_OF_A_SWITCH = ("obeyed a kill message", "failing closed")


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
    """The checks, reading through `recorder` (the game day's history, agents and people),
    acting as `as_(role)`, waiting with `until`, and looking at the puppet's ledger in
    `endpoints`; `organisation` is where the game day runs (None: not known)."""

    def __init__(self, recorder: Recorder, until: Until, as_: Callable[[str], Operator],
                 endpoints: Endpoints, organisation: Organisation | None) -> None:
        self.recorder, self.until, self.as_ = recorder, until, as_
        self.endpoints, self.organisation = endpoints, organisation
        self.auditor = recorder.people["auditor"]
        self.dialect = dialect(recorder.dialect_name)

    async def fleet_stop_answer(self, report: dict[str, Any],
                                agents: Iterable[dict[str, Any]]) -> FleetStop:
        """The fleet kill's answer: every agent stopped (a shared organisation's others too),
        work requeued, and every daemon holding the kill before the answer came. Where the
        answer reports none of it (upstream's `{"ok":true}`), it is read back instead."""
        if not self.dialect.reports:
            return await self._fleet_stop_read_back(list(agents), report)
        mine, stopped = {a["id"] for a in agents}, set(report["agents_stopped"])
        rule(mine <= stopped, f"the fleet stop left agents running: {sorted(mine - stopped)}")
        strangers = await strangers_stopped(self.organisation, self.auditor, mine, stopped)
        rule(strangers is None, str(strangers))
        tasks = await self.recorder.read_tasks()
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
        self.recorder.notes.append(
            f"the {self.dialect.name} fleet kill answered {report}: whether every daemon held "
            f"the kill before the answer is not known; agents, tasks and sandboxes read back")
        kill = [op for op in self.recorder.history.operations("kill_fleet") if op.type == "ok"][-1]
        flagged = {a["id"]: json_of(await self.recorder.reader(a["id"]).agent(a["id"]))["killed"]
                   for a in agents}
        rule(all(flagged.values()), f"the fleet stop left agents running (not flagged): "
             f"{sorted(a for a, k in flagged.items() if not k)}")
        before: dict[str, str] = {}
        for read in self.recorder.history.operations("task_state"):  # in order of start
            if read.type == "ok" and read.end_ns is not None and read.end_ns < kill.start_ns:
                before[str(read.value["task_id"])] = str(read.value["state"])
        tasks = await self.recorder.read_tasks()
        requeued = {t for t, s in before.items() if s == "in_progress"
                    and tasks.get(t, {}).get("state") == "open"}
        rule(bool(requeued), "the fleet stop requeued none of the game day's tasks")
        # The sessions it cut: those of agents it found at work (an agent finishing a task
        # as the kill came ends its session on its own, exit 0, as no cancelled one does).
        working = {tasks[t]["agent_id"] for t in requeued}
        cancelled = {s["id"] for a in agents if a["id"] in working
                     for s in await self.recorder.sessions(a["id"])
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
        boxes = {s["id"]: s["state"] for s in await self.recorder.sandboxes(agent["id"])}
        evicted = report.get("evicted_sandboxes", []) if self.dialect.reports else []
        rule(all(boxes[b] in ("evicted", "gone") for b in evicted)
             and not [s for s in boxes.values() if s in ("parked", "running")],
             f"the killed warm agent kept a sandbox: {boxes}")

    async def daemons_obeyed(self, agents: Iterable[dict[str, Any]],
                             sessions: set[str]) -> set[str]:
        """Every daemon of the stopped sessions exited with 3 (the kill switch). Returns the
        agents that had one of those sessions."""
        agents = list(agents)
        stopped = {a["id"]: [s for s in await self.recorder.sessions(a["id"])
                             if s["id"] in sessions] for a in agents}
        boxes = {s["sandbox_id"] for ss in stopped.values() for s in ss}
        exits = {s["id"]: s["exit_code"] for a in agents
                 for s in await self.recorder.sandboxes(a["id"]) if s["id"] in boxes}
        rule(exits == dict.fromkeys(boxes, 3),
             f"daemons that did not obey the kill (exit code 3 expected): {exits}")
        return {agent for agent, ss in stopped.items() if ss}

    async def work_back_in_the_backlog(self, stop: FleetStop, in_progress: set[str]) -> None:
        """Nothing is left in progress; what the stop requeued is open; what was in progress
        went back to open unless it finished first."""
        tasks = await self.recorder.read_tasks()
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
        by = self.as_("org_admin") if by is None else by
        agents = {a["id"]: a for a in (agent, triggered)}
        before = {s["id"] for a in agents for s in await self.recorder.sessions(a)}
        fresh = json_of(await by.create_task(agent, "arrived during the stop"), 201)
        await asyncio.sleep(window_s)  # the window in which nothing may start
        state = json_of(await self.recorder.reader(agent["id"]).task(agent["id"], fresh["id"])
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
        started = {s["id"] for a in agents for s in await self.recorder.sessions(a)} - before
        rule(not started, f"sessions started during {stop}: {sorted(started)}")

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
            calls = [e for e in await self.endpoints.puppet.actions(a["id"])
                     if after_ns < e.at_ns and (before_ns is None or e.at_ns < before_ns)]
            if calls:
                late[a["id"]] = len(calls)
        rule(not late, f"{broken} ({late})")

    async def failed_closed(self, agents: Iterable[dict[str, Any]], sandbox_ids: list[str],
                            died_ns: int, slack_s: float, deadline_s: float = 30) -> None:
        """The daemons of these sandboxes lost their control plane at `died_ns` and failed
        closed (DESIGN §2.4): none sent its model a request more than `slack_s` later (the
        puppet's ledger, by the daemon's own send stamp), and each exited 3 saying why in its
        last log line (failing closed, or obeying a kill that reached it before the plane
        died), read on this machine where the stack allows. The figure: the last
        request's send after the death, in ms (`last_request_after_plane_died_ms`)."""
        calls = [(e.sent_ns or e.at_ns) - died_ns for a in agents
                 for e in await self.endpoints.puppet.actions(a["id"])]
        after = [ns for ns in calls if ns > 0]
        self.recorder.measurements["last_request_after_plane_died_ms"] = round(
            max(after, default=0) / 1e6, 1)
        late = [round(ns / 1e6) for ns in after if ns > slack_s * 1e9]
        rule(not late, f"daemons kept calling their model after their control plane died "
             f"(ms after its death: {late}), more than {slack_s} s: they did not fail closed")
        exits = await self.recorder.daemon_exits(sandbox_ids)
        if exits is None:
            self.recorder.notes.append(f"the {self.recorder.stack} stack's daemon exits are "
                                       "not on this machine: exit codes not checked")
            return

        async def all_exited() -> bool:
            nonlocal exits
            exits = await self.recorder.daemon_exits(sandbox_ids)
            return exits is not None and all(e.code is not None for e in exits.values())
        with contextlib.suppress(AssertionError):  # the rule below says what is missing
            await eventually(all_exited, deadline_s, "daemons exited")
        seen = Counter(f"{e.code} ({e.why[:100]})" for e in (exits or {}).values())
        self.recorder.notes.append(f"the daemons' exits: {dict(seen)}")
        wrong = {s[:8]: (e.code, e.why[:120]) for s, e in (exits or {}).items()
                 if e.code != 3 or not any(w in e.why for w in WHYS_OF_A_SWITCH)}
        rule(not wrong, f"daemons that lost their control plane did not fail closed (exit 3, "
             f"saying why): {wrong}")

    async def nothing_in_progress(self, after: str) -> None:
        """No task of the game day is in progress any more."""
        left = [t["id"] for t in (await self.recorder.read_tasks()).values()
                if t["state"] == "in_progress"]
        rule(not left, f"{after} left tasks in progress: {left}")

    async def only_security_holds_the_fleet_switch(self) -> None:
        """org_admin and controlling were told; the roles without the switch get 403."""
        if not self.dialect.notifications:
            self.recorder.notes.append(f"{self.dialect.name} covey keeps no notifications: whether "
                                  f"org_admin and controlling were told of the fleet stop is "
                                  f"not checked")
        for role in ("org_admin", "controlling") if self.dialect.notifications else ():
            notes = json_of(await self.recorder.people[role].notifications())
            rule(any(n["kind"] == "fleet_killed" for n in notes),
                 f"{role} was not notified of the fleet stop")
        for role in ("agent_owner", "auditor", "controlling"):
            who = self.as_(role)
            rule((await who.kill_fleet()).status_code == 403,
                 f"{role} may pull the fleet switch")
            rule((await who.resume_fleet()).status_code == 403, f"{role} may resume the fleet")

    async def held_by_the_fleet(self, agent: dict[str, Any], window_s: float = 1) -> None:
        """An agent resumed on its own while the fleet stop stands does not run."""
        released = json_of(await self.as_("org_admin").resume_agent(agent))
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
        with_work = {t["agent_id"] for t in (await self.recorder.read_tasks()).values()
                     if t["state"] == "open" and t["agent_id"] in ids}
        before = {s["id"] for a in with_work for s in await self.recorder.sessions(a)}
        answer = json_of(await release())
        woken = set(answer["agents_woken"] if self.dialect.reports else ())

        async def started() -> set[str]:
            return {a for a in with_work - woken
                    if {s["id"] for s in await self.recorder.sessions(a)} - before}
        at_work = (woken & ids) | await started()
        if not self.dialect.reports and at_work < with_work:
            # The answer does not say whom it woke: "at once" is a sandbox started within
            # RELEASE_WAKE_S of it (upstream's scheduler tick is 1 s).
            with contextlib.suppress(AssertionError):
                await eventually(lambda: _all_or_none(started, with_work), RELEASE_WAKE_S,
                                 "not at once")
            at_work |= await started()
            self.recorder.notes.append(f"{what} answered {answer}: the agents it woke were read "
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
            await self.endpoints.puppet.assign(a["id"], "well_behaved")
        r = await security.resume_fleet()
        rule(r.status_code == 200, f"the fleet resume was refused: {r.status_code} {r.text}")
        return await self.until.all_tasks_done()

    async def kill_carried_out(self, agent: dict[str, Any], answer: dict[str, Any],
                               deadline_s: float = 30) -> set[str]:
        """A kill of one agent that answered `answer` did its work: the tasks read right
        after its ok (what it left open, for the requeue checkers), no sandbox of the agent
        starting or running any more, and every daemon of a session it stopped exited 3."""
        await self.recorder.read_tasks()
        await self.until.all_sandboxes_gone([agent], deadline_s)
        return await self.daemons_obeyed([agent], set(answer["sessions_cancelled"]))

    async def lost_database_failed_closed(self, agents: list[dict[str, Any]],
                                          cut: FaultRecord, margin_s: float, held_by: str,
                                          lost: str, figure: str) -> float:
        """The daemons `held_by` held (a replica) stop within their lease once it loses
        `lost` (its database, cut by the nemesis in `cut`), whatever it is doing: nothing of
        them is left on the machine within the lease + `margin_s`, and the puppet's ledger
        shows no model call after that. How long they took is measured as `figure` (s);
        returns it."""
        bound_s = self.recorder.lease_s + margin_s
        refs: list[AgentRef] = list(agents)
        await self.until.nothing_left_of(
            refs, bound_s, f"a daemon {held_by} held ran on with {held_by} cut off from "
            f"{lost} (or its sandbox was left behind): its lease did not fail closed")
        gone_s = (time.time_ns() - cut.started_ns) / 1e9
        self.recorder.measurements[figure] = gone_s
        self.recorder.notes.append(f"{held_by}'s daemons were gone {gone_s:.2f} s after "
                              f"{held_by} lost {lost} (lease {self.recorder.lease_s} s)")
        await self.no_model_call_between(
            agents, cut.started_ns + round(bound_s * 1e9), None,
            f"daemons of {held_by} called their model more than the lease + {margin_s} s "
            f"after {held_by} lost {lost}: they did not fail closed")
        return gone_s

    async def trip_alerts_name(self, agents: Iterable[dict[str, Any]], *words: str,
                               what: str) -> None:
        """Security was alerted of each agent's guard trip (`agent_tripped`), in an alert
        that names the agent and holds every one of `words`; `what` says what they stand
        for."""
        security = self.recorder.people["security"]
        alerts = [n["title"] for n in json_of(await security.notifications())
                  if n["kind"] == "agent_tripped"]
        for a in agents:
            alert = next((t for t in alerts if a["slug"] in t), None)
            rule(alert is not None and all(w in alert for w in words),
                 f"no alert names agent {a['slug']}, {what}: {alerts}")

    async def held_by_the_guard(self, agents: list[dict[str, Any]], owner: Operator,
                                security: Operator, layer: str) -> None:
        """Agents their guard's `layer` stopped are held (DESIGN §2.4): the owner's wake of
        the first is refused (409), and a fleet stop and resume leaves every one stopped."""
        r = await owner.wake(agents[0])
        rule(r.status_code == 409, f"a wake restarted an agent its guard had stopped: {r.text}")
        json_of(await security.kill_fleet())
        woken = set(json_of(await security.resume_fleet())["agents_woken"])
        held = {a["id"]: json_of(await self.auditor.agent(a["id"])) for a in agents}
        rule(not woken & set(held) and all(a["killed"] for a in held.values()),
             f"the fleet resume released agents their {layer} guard had stopped: only a "
             "changed task or a human may")

    async def still_held_by_the_guard(self, agent: dict[str, Any], layer: str) -> None:
        """An agent its guard's `layer` stopped, whose task nobody changed and whom nobody
        resumed, is still stopped by the guard."""
        still = json_of(await self.auditor.agent(agent["id"]))
        rule(still["killed"] and still["kill_origin"] == "guard",
             f"an agent its {layer} guard stopped was released although nobody changed its "
             "task or resumed it")
