"""The game day's people at work, and the waits every scenario shares.

`day.as_("security").kill_fleet()` is the one way a scenario acts: every call goes through
its recorder's `operate` (harness/record/recorder.py), so it lands in the history as an invoke
and its outcome (ok for a 2xx, fail for a refusal, info when nobody knows), where the
checkers find it. `day.until` holds the waits, each polling with a deadline and failing with
what never happened, or at once when it can no longer happen.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

import httpx

from harness.act.client import ApiFailure, json_of
from harness.judge.switch_checkers import KILL_FLAG_ACK_F
from harness.stack.waiting import eventually

if TYPE_CHECKING:
    from faker import Faker

    from harness.act.client import CoveyClient
    from harness.act.puppet import LedgerEntry
    from harness.nemesis import FaultRecord
    from harness.record.recorder import Recorder
    from harness.stack.base import Endpoints

AgentRef = dict[str, Any] | str
# The read of every task before a kill must not hold the switch back when the control plane
# is slow to answer (a database outage): past this, the kill goes without it.
READ_BEFORE_KILL_S = 1.0
READ_AFTER_KILL_S = 10.0
LIVE_SANDBOX = ("starting", "running")
RECORDING_PAGE = 1000  # events per read of an agent's recording (the API's page)


def _id(agent: AgentRef) -> str:
    return agent if isinstance(agent, str) else str(agent["id"])


class Operator:
    """One human of the game day, acting through `client`; each call recorded as an
    operation named after it in `recorder`'s history, which also reads every task right
    before a kill. `fake` makes up what the call leaves out (a task's title)."""

    def __init__(self, role: str, client: CoveyClient, recorder: Recorder, fake: Faker
                 ) -> None:
        self.role, self.client, self.recorder, self.fake = role, client, recorder, fake

    async def kill_agent(self, agent: AgentRef) -> httpx.Response:
        a = _id(agent)
        return await self._around_a_kill(self.recorder.operate(
            self.role, "kill_agent", {"agent_id": a}, lambda: self.client.kill_agent(a)))

    async def _around_a_kill(self, kill: Awaitable[httpx.Response]) -> httpx.Response:
        """Every task read right before the kill is sent and again after its answer: what
        was in progress when it came and what it left, for the requeue checkers, which
        otherwise have nothing to judge. A read that fails (a fault stands) is left out:
        the checkers then say what they lacked."""
        await self._read_tasks(READ_BEFORE_KILL_S)
        answer = await kill
        if answer.is_success:
            await self._read_tasks(READ_AFTER_KILL_S)
        return answer

    async def _read_tasks(self, within_s: float) -> None:
        try:
            async with asyncio.timeout(within_s):
                await self.recorder.read_tasks()
        except (TimeoutError, httpx.HTTPError, ApiFailure):
            pass

    async def resume_agent(self, agent: AgentRef) -> httpx.Response:
        a = _id(agent)
        return await self.recorder.operate(self.role, "resume_agent", {"agent_id": a},
                                      lambda: self.client.resume_agent(a))

    async def kill_fleet(self, read_first: bool = True) -> httpx.Response:
        """`read_first=False`: the scenario has read the tasks itself, right before (a plane
        it froze to hold the kill would hold that read, for up to READ_BEFORE_KILL_S)."""
        kill = self.recorder.operate(self.role, "kill_fleet", {}, self.client.kill_fleet)
        return await (self._around_a_kill(kill) if read_first else kill)

    async def resume_fleet(self) -> httpx.Response:
        return await self.recorder.operate(self.role, "resume_fleet", {}, self.client.resume_fleet)

    async def stop_globally(self, reason: str = "game day: global stop") -> httpx.Response:
        """The platform admin's global kill flag: every agent of every organisation."""
        return await self._around_a_kill(self.recorder.operate(
            self.role, "stop_globally", {}, lambda: self.client.stop_globally(reason)))

    async def clear_global_stop(self, reason: str = "game day: over") -> httpx.Response:
        return await self.recorder.operate(self.role, "clear_global_stop", {},
                                      lambda: self.client.clear_global_stop(reason))

    async def stop_tool(self, agent: AgentRef, tool: str,
                        reason: str = "game day: tool stopped") -> httpx.Response:
        a = _id(agent)
        return await self.recorder.operate(self.role, "stop_tool", {"agent_id": a, "tool": tool},
                                      lambda: self.client.stop_tool(tool, a, reason))

    async def wake(self, agent: AgentRef) -> httpx.Response:
        a = _id(agent)
        return await self.recorder.operate(self.role, "wake", {"agent_id": a},
                                      lambda: self.client.wake(a))

    async def fire_heartbeat(self, agent: AgentRef, name: str) -> httpx.Response:
        a = _id(agent)
        return await self.recorder.operate(self.role, "fire_heartbeat",
                                      {"agent_id": a, "heartbeat": name},
                                      lambda: self.client.fire_heartbeat(a, name))

    async def trigger(self, agent: dict[str, Any], title: str = "triggered") -> httpx.Response:
        token = str(agent["trigger_token"])
        return await self.recorder.operate(self.role, "trigger", {"agent_id": _id(agent)},
                                      lambda: self.client.trigger(token, title))

    async def create_task(self, agent: AgentRef, title: str | None = None,
                          body: str = "") -> httpx.Response:
        a, t = _id(agent), title or self.fake.sentence(nb_words=5)
        return await self.recorder.operate(self.role, "create_task", {"agent_id": a, "title": t},
                                      lambda: self.client.create_task(a, t, body))

    async def change_task(self, agent: AgentRef, task_id: str, **changes: Any
                          ) -> httpx.Response:
        a = _id(agent)
        return await self.recorder.operate(self.role, "change_task",
                                      {"agent_id": a, "task_id": task_id, **changes},
                                      lambda: self.client.change_task(a, task_id, **changes))


class Until:
    """The waits a game day shares. Each returns what it waited for. They read through
    `recorder` (what they see lands in its history), the stack's puppet, nemesis and URL
    through `endpoints`, and another replica through `client_at(role, url)`."""

    def __init__(self, recorder: Recorder, endpoints: Endpoints,
                 client_at: Callable[[str, str], CoveyClient]) -> None:
        self.recorder, self.endpoints, self.client_at = recorder, endpoints, client_at

    def _agents(self, agents: list[AgentRef] | None) -> list[str]:
        return [_id(a) for a in agents] if agents is not None else list(self.recorder.agents)

    async def all_sandboxes_gone(self, agents: list[AgentRef] | None = None,
                                 deadline_s: float = 60) -> None:
        """No sandbox of these agents (default: all of the game day's) is starting or
        running."""
        ids = self._agents(agents)

        async def gone() -> bool:
            for agent_id in ids:
                if any(s["state"] in LIVE_SANDBOX for s in await self.recorder.sandboxes(agent_id)):
                    return False
            return True
        await eventually(gone, deadline_s, f"a sandbox of {len(ids)} stopped agents kept "
                         f"running: a stop that leaves a sandbox up has not stopped the agent")

    async def nothing_left_of(self, agents: list[AgentRef], deadline_s: float = 30,
                              broken: str = "a killed agent's sandbox was left behind") -> None:
        """Nothing of these (killed) agents' sandboxes exists any more on this machine: no
        process, no container, looked at directly rather than read from the control plane.
        Each agent's last look lands in the history, for `nothing_left_of_killed_agent`.
        `broken` says which rule a leftover breaks."""
        ids = self._agents(agents)
        left: dict[str, list[str] | None] = {}

        async def nothing_left() -> bool:
            for agent_id in ids:
                left[agent_id] = await self.recorder.remains(agent_id, record=False)
            return not any(left.values())
        try:
            await eventually(nothing_left, deadline_s, "nothing of the killed agents' "
                             "sandboxes may be left")
        except AssertionError:
            raise AssertionError(
                f"{broken} after {deadline_s:.0f} s: "
                + "; ".join(f"agent {a}: {', '.join(r or [])}" for a, r in left.items() if r)
                + ". A stop that leaves a process or container up has not stopped the agent"
            ) from None
        finally:
            for agent_id in ids:
                await self.recorder.remains(agent_id)

    async def sessions_over(self, agents: list[AgentRef], session_ids: set[str],
                            deadline_s: float, broken: str) -> None:
        """None of these sessions of these agents is starting or running any more, as the
        control plane says; `broken` says which rule one still live breaks."""
        ids = self._agents(agents)
        live: list[str] = []

        async def over() -> bool:
            live.clear()
            for agent_id in ids:
                live.extend(s["id"] for s in json_of(
                    await self.recorder.reader(agent_id).sessions(agent_id))
                    if s["id"] in session_ids and s["state"] in ("starting", "running"))
            return not live
        try:
            await eventually(over, deadline_s, broken)
        except AssertionError:
            raise AssertionError(f"{broken} after {deadline_s:.0f} s: {live}") from None

    async def all_working(self, agents: list[AgentRef] | None = None,
                          deadline_s: float = 120) -> dict[str, dict[str, Any]]:
        """Every one of these agents has a task in progress; returns every task read."""
        ids = set(self._agents(agents))

        async def working() -> dict[str, dict[str, Any]] | None:
            tasks = await self.recorder.read_tasks()
            busy = {t["agent_id"] for t in tasks.values() if t["state"] == "in_progress"}
            return tasks if ids <= busy else None
        # Only these agents' work: one killed beside them (on purpose) does not make their
        # getting to work impossible.
        found: dict[str, dict[str, Any]] = await eventually(
            working, deadline_s, "the agents never all got to work on their tasks",
            impossible=lambda: self.recorder.why_work_cannot_finish(sorted(ids)))
        return found

    async def all_tasks_done(self, deadline_s: float = 120) -> dict[str, dict[str, Any]]:
        """Every task of the game day is done."""
        async def done() -> dict[str, dict[str, Any]] | None:
            tasks = await self.recorder.read_tasks()
            return tasks if all(t["state"] == "done" for t in tasks.values()) else None
        found: dict[str, dict[str, Any]] = await eventually(
            done, deadline_s, "work given to the agents was left undone",
            impossible=self.recorder.why_work_cannot_finish)
        return found

    async def condition(self, check: Callable[[], Awaitable[Any]], deadline_s: float,
                        message: str) -> Any:
        """Any other outcome the scenario waits for, with the rule it shows as `message`."""
        return await eventually(check, deadline_s, message)

    async def fault_healed(self, fault: FaultRecord, deadline_s: float, what: str
                           ) -> FaultRecord:
        """The nemesis healed this fault (at its deadline, or earlier); returns the healed
        record, with when it healed. A proxy in a container heals on its own deadline
        there: its log is read each time."""
        async def healed() -> FaultRecord | None:
            await self.endpoints.nemesis.refresh()
            return next((r for r in self.endpoints.nemesis.faults()
                         if r.id == fault.id and r.healed), None)
        record: FaultRecord = await eventually(healed, deadline_s, f"{what} never healed")
        return record

    async def healthy(self, deadline_s: float, message: str) -> None:
        """The control plane answers its /healthz with 200 (it reached its database)."""
        await self.healthy_at(self.endpoints.url, deadline_s, message)

    async def all_tasks_done_of(self, agents: list[AgentRef]) -> bool:
        """One look (not a wait): is every task of these agents done?"""
        ids = set(self._agents(agents))
        tasks = await self.recorder.read_tasks()
        return all(t["state"] == "done" for t in tasks.values() if t["agent_id"] in ids)

    async def tool_flag_acknowledged(self, agent: AgentRef, tool: str,
                                     deadline_s: float = 10) -> int:
        """The agent's daemon acknowledged a flag on `tool` (its `kill_flag` / `acknowledged`
        recording event naming `tool:<tool>`), as the control plane recorded it; that
        acknowledgement lands in the history for `stopped_tool_not_run`. Returns its time
        (ns, the control plane's clock)."""
        agent_id, scope = _id(agent), f"tool:{tool}"
        reader = self.recorder.reader(agent_id)
        seen = 0  # the recording is read on from the last event looked at

        async def acknowledged() -> int | None:
            nonlocal seen
            while True:
                page = json_of(await reader.recording(agent_id, after=seen))
                for e in page:
                    seen = max(seen, int(e["id"]))
                    if (e["kind"], e["status"]) == ("kill_flag", "acknowledged") \
                            and scope in e["detail"].get("stopped", []):
                        at_ns = int(datetime.fromisoformat(e["at"]).timestamp() * 1e9)
                        self.recorder.observe(KILL_FLAG_ACK_F, {
                            "agent_id": agent_id, "stopped": e["detail"]["stopped"]},
                            time_ns=at_ns)
                        return at_ns
                if len(page) < RECORDING_PAGE:
                    return None
        at: int = await eventually(
            acknowledged, deadline_s, f"agent {agent_id}'s daemon never acknowledged the "
            f"flag on its {tool} tool (no kill_flag acknowledgement in its recording): a "
            f"tool flag the daemon does not hold stops nothing")
        return at

    async def stopped_by(self, agent: AgentRef, layer: str, deadline_s: float = 60
                         ) -> dict[str, Any]:
        """A session of the agent ended stopped by its guard's `layer` (budget, loop,
        circuit_breaker, ...); returns that session. Fails at once when it ended otherwise."""
        agent_id = _id(agent)
        auditor = self.recorder.people["auditor"]

        async def stopped() -> dict[str, Any] | None:
            for s in json_of(await auditor.sessions(agent_id)):
                if s["stop_layer"] == layer:
                    return dict(s)
            return None

        async def otherwise() -> str | None:
            ended = [s for s in json_of(await auditor.sessions(agent_id))
                     if s["ended_at"] is not None and s["stop_layer"] not in (None, layer)]
            if ended:
                return (f"its session {ended[0]['id']} was stopped by "
                        f"{ended[0]['stop_layer']} instead ({ended[0]['stop_reason']})")
            return None
        found: dict[str, Any] = await eventually(
            stopped, deadline_s, f"the guard's {layer} layer never stopped agent {agent_id}",
            impossible=otherwise)
        return found

    async def steady_work(self, agents: list[dict[str, Any]], deadline_s: float = 120
                          ) -> dict[str, Any]:
        """The fleet at work: every one of these agents whose behaviour never finishes on its
        own holds a task in progress, and work is seen moving (a task done) when a
        well-behaved one is among them. Returns the steady state, for the journal."""
        async def steady() -> dict[str, Any] | None:
            tasks = await self.recorder.read_tasks()
            held = {t["agent_id"] for t in tasks.values() if t["state"] == "in_progress"}
            done = sum(t["state"] == "done" for t in tasks.values())
            if all(a["id"] in held for a in agents if a["behaviour"] != "well_behaved") and (
                    done or all(a["behaviour"] != "well_behaved" for a in agents)):
                return {"tasks_in_progress": len(held), "tasks_done": done,
                        "agents": len(agents)}
            return None
        found: dict[str, Any] = await eventually(
            steady, deadline_s, "no steady state: agents not working",
            impossible=self.recorder.why_work_cannot_finish)
        return found

    async def tool_calls(self, agent: AgentRef, tool: str, containing: str, at_least: int,
                         deadline_s: float, message: str) -> list[LedgerEntry]:
        """The agent's model (the puppet's ledger, outside the system under test) asked for
        `tool` with `containing` in its command at least `at_least` times; returns those
        calls. `message` says what never happened."""
        agent_id = _id(agent)

        async def called() -> list[LedgerEntry] | None:
            calls = [e for e in await self.endpoints.puppet.actions(agent_id)
                     if e.tool == tool and containing in e.args.get("cmd", "")]
            return calls if len(calls) >= at_least else None
        found: list[LedgerEntry] = await eventually(called, deadline_s, message)
        return found

    async def sessions_held(self, agents: list[AgentRef],
                            holds: Callable[[dict[str, Any]], bool], at: str,
                            deadline_s: float, message: str) -> None:
        """Every one of these agents has a running session, each held as `holds` says (a
        replica's `Replica.holds`), read from the control plane at `at` (a replica's URL)."""
        auditor = self.client_at("auditor", at)
        ids = self._agents(agents)

        async def held() -> bool:
            for agent_id in ids:
                live = [s for s in json_of(await auditor.sessions(agent_id))
                        if s["state"] == "running"]
                if not live or not all(holds(s) for s in live):
                    return False
            return True
        await eventually(held, deadline_s, message)

    async def healthy_at(self, url: str, deadline_s: float, message: str) -> None:
        """The control plane at `url` (another replica) answers its /healthz with 200."""
        async def answers() -> bool:
            return (await self.recorder.people["auditor"].http.get(f"{url}/healthz")
                    ).status_code == 200
        await eventually(answers, deadline_s, message)
