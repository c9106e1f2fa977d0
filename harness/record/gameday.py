"""One game day: the people and agents it generates (from a seed, with faker), the history it
records, the observations it reads back from the system under test, and its journal.

The scenario does; this records. Judging is the checkers' job, after the fact.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from faker import Faker

from harness.act.client import CoveyClient, json_of
from harness.act.dialect import COVEY_GAMEDAY, dialect, sign_in
from harness.act.expect import Expect
from harness.act.operator import RECORDING_PAGE, Operator, Until
from harness.act.puppet import Behaviour, behaviour_name, resolve
from harness.act.switch_line import SwitchLine
from harness.act.upstream import MockDirectives
from harness.judge.bounds import BOUND_PREFIX, Figure, bounded_figures
from harness.judge.checkers import (
    CHECKERS,
    FAILING_SERVICE_CALL_F,
    HOME_FILES_F,
    HOME_SYNC_F,
    KILL_DELIVERY_F,
    SESSION_END_F,
    Checker,
    FinalAgent,
    FinalState,
    FinalTask,
    Verdict,
    judge_all,
)
from harness.judge.costs import Measure
from harness.judge.sessions import TASK_RESULT_F
from harness.judge.switch_checkers import LEASE_F, SANDBOX_F, WAKE_REFUSALS_F
from harness.judge.time_to_stop import TimeToStop, summarize, time_to_stop
from harness.judge.verdicts import NOT_JUDGEABLE, broken_rules
from harness.record.history import History
from harness.record.recorder import OBSERVER as OBSERVER
from harness.record.recorder import Recorder
from harness.record.recorder import phases as phases
from harness.record.remains import DaemonExit
from harness.run.rollback import roll_back_loudly
from harness.run.steady import prepare
from harness.stack.base import Endpoints, drop_if_empty
from harness.stack.isolation import Organisation, agent_slug, run_id

ROLES = ("agent_owner", "security", "auditor", "controlling")
GAME_DAY_MAX_TURNS = 10_000
GAME_DAY_GUARD = {"max_tokens": 10_000_000, "max_tool_calls": 100_000, "max_wall_s": 3600.0}


def _ns(timestamp: str | None) -> int | None:
    if timestamp is None:
        return None
    return int(datetime.fromisoformat(timestamp).timestamp() * 1_000_000_000)


def kill_delivery(agent_id: str, session: dict[str, Any]) -> dict[str, Any] | None:
    """A session's kill message and how it was confirmed, as a `kill_delivery` value; None
    when no kill was sent to its daemon (or the control plane does not say)."""
    sent = _ns(session.get("kill_sent_at"))
    if sent is None:
        return None
    return {"agent_id": agent_id, "session_id": session["id"], "sent_ns": sent,
            "confirmed_ns": _ns(session.get("kill_confirmed_at")),
            "confirmed_by": session.get("kill_confirmed_by"),
            "daemon_stop": session.get("daemon_stop"), "sandbox_id": session.get("sandbox_id"),
            "acked_ns": _ns(session.get("kill_acked_at"))}


def sandbox_observations(box: dict[str, Any]) -> list[tuple[str, dict[str, Any], int]]:
    """A sandbox row's parts of time-to-stop, each at the time the control plane recorded
    for it: its daemon's exit (with the code), when the sandbox was gone, its last home
    sync. A time the control plane did not record gives no observation: the measure then
    says nothing rather than a guess (an `ended_at` once stood in for both parts)."""
    found = []
    for f, stamp, value in (
            ("daemon_exit", box.get("daemon_exited_at"),
             {"exit_code": box.get("exit_code"), "sandbox_id": box["id"]}),
            ("sandbox_gone", box.get("gone_at"), {"sandbox_id": box["id"],
                                                  "state": box.get("state")}),
            (HOME_SYNC_F, box.get("last_sync_at"), {"sandbox_id": box["id"]})):
        at_ns = _ns(stamp)
        if at_ns is not None:
            found.append((f, value, at_ns))
    return found


@dataclass
class Outcome:
    """What a game day concluded; filled in by the scenario as it goes."""

    verdicts: list[Verdict] = field(default_factory=list)
    samples: list[TimeToStop] = field(default_factory=list)
    final: FinalState | None = None
    steady_after: dict[str, Any] = field(default_factory=dict)
    journal: Path | None = None


class VerdictsBroken(AssertionError):
    """The game day's verdicts broke rules: the report's verdicts say which, first."""


def assert_valid(verdicts: list[Verdict], required: frozenset[str] = frozenset()) -> None:
    """Fail with every failed verdict, and every `unknown` one of a checker in `required`,
    each naming the events that prove it."""
    __tracebackhide__ = True  # the scenario's call is the line to show
    broken = broken_rules(verdicts, required)
    if broken:
        raise VerdictsBroken("\n".join(broken))


@dataclass
class GameDay:
    name: str
    stack: str
    endpoints: Endpoints
    seed: int
    report_dir: Path
    history: History = field(default_factory=History)
    people: dict[str, CoveyClient] = field(default_factory=dict)
    # The same people talking to another replica (`as_(role, at=url)`), made on first use.
    _people_at: dict[tuple[str, str], CoveyClient] = field(default_factory=dict, repr=False)
    agents: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Organisations beside the game day's own (`organisation_beside`), each by id with its
    # admin, who reads and rolls back that organisation's agents of the game day.
    admins_beside: dict[str, CoveyClient] = field(default_factory=dict)
    # The process its people's stops are sent from (harness/act/switch_line.py), from enlist.
    line: SwitchLine | None = None
    steady_state: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # The checkers this game day must be able to decide (its `decides` marker), and the
    # verdicts of its last judgement: what a failure report leads with.
    required: frozenset[str] = frozenset()
    verdicts: list[Verdict] = field(default_factory=list)
    # What judges this game day and what it measures beside time-to-stop: today's set
    # unless the scenario names its own (`checkers` / `measures` markers).
    checkers: tuple[Checker, ...] = CHECKERS
    measures: dict[str, Measure] = field(default_factory=dict)
    measurements: dict[str, Any] = field(default_factory=dict)
    # The figures this game day exists for, each with the bound its scenario states
    # (`bounds` marker, harness/judge/bounds.py), and what they read at the judgement.
    bounds: dict[str, float] = field(default_factory=dict)
    figures: list[Figure] = field(default_factory=list)
    # What the game day concluded (harness/run/lifecycle.py fills it in), and the rule the
    # scenario saw broken as it went on, if it stopped on one: what a failure leads with.
    outcome: Outcome = field(default_factory=Outcome)
    seen_broken: str | None = None
    # Whether run_game_day got to its rollback: a Ctrl-C raised outside the scenario's
    # coroutine never lets it, and the fixture's teardown then rolls back (and writes the
    # `aborted` journal).
    rolled_back: bool = False
    left_standing: str | None = None  # what the rollback could not restore
    # Isolation, steady-state hypothesis and rollback (harness/stack/isolation.py, steady.py,
    # rollback.py): where the game day runs, its probe agents, and their journal sections.
    run_id: str = field(default_factory=run_id)
    organisation: Organisation | None = None
    probe_agents: list[str] = field(default_factory=list)
    journal_sections: dict[str, Any] = field(default_factory=dict)
    journal_path: Path | None = None
    aborted_reason: str | None = None  # why the game day broke off, for its journal
    preparing: str = "not started"  # the step of its preparation under way, for a refusal
    started_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat())
    scenario: str = ""  # the pytest node id: what the replay command runs
    fake: Faker = field(init=False)

    def __post_init__(self) -> None:
        # A bounded figure must be judged: unknown fails the game day like a `decides`. A
        # checker whose evidence the dialect's server does not expose cannot be required.
        self.required = (frozenset(self.required) | {
            BOUND_PREFIX + n for n in self.bounds}) - set(self.lacks)
        self.fake = Faker()
        self.fake.seed_instance(self.seed)

    # ------------------------------------------------------------------ people and agents

    async def sign_in(self, email: str, password: str) -> CoveyClient:
        """A human of the deployment, signed in as its dialect signs people in (an API
        token here, a cookie session on upstream covey)."""
        directives = self.endpoints.puppet
        return await sign_in(self.dialect_name, self.endpoints.url, email, password,
                             directives if isinstance(directives, MockDirectives) else None,
                             line=self.line)

    async def enlist(self) -> None:
        """The org admin from the stack, and one human per other role, made up from the
        seed (a failing game day replays with the same names)."""
        e = self.endpoints
        if self.line is None:
            self.report_dir.mkdir(parents=True, exist_ok=True)
            self.line = await SwitchLine.start(self._line_log)
            self.journal_sections["switch_line"] = self.line.priority.to_json()
        self.people["org_admin"] = await self.sign_in(e.admin_email, e.admin_password)
        for role in ROLES:
            # The run in the address: emails are unique across organisations, and a replay
            # with the same seed must not sign in as an earlier game day's people.
            email = (f"{role}.{self.fake.user_name()}.{self.seed}.{self.run_id}"
                     f"@{self.fake.domain_word()}.test")
            password = self.fake.password(length=16)
            json_of(await self.people["org_admin"].add_member(email, password, role), 201)
            self.people[role] = await self.sign_in(email, password)

    async def platform_admin(self) -> Operator:
        """The stack's platform admin (who holds the global kill flag) as one of the game
        day's people, `day.as_("platform_admin")`; LookupError where the stack has none."""
        e = self.endpoints
        if "platform_admin" not in self.people:
            if not (e.platform_email and e.platform_password):
                raise LookupError(f"the {self.stack} stack has no platform admin: give "
                                  f"--target-platform-email and --target-platform-password")
            self.people["platform_admin"] = await self.sign_in(e.platform_email,
                                                               e.platform_password)
        return self.as_("platform_admin")

    async def organisation_beside(self, name: str = "beside") -> str:
        """A second organisation of the game day's (created by the platform admin) whose
        agents `agent(..., org=...)` makes; returns its id. Its admin reads its agents for
        the judgement and stops them at the rollback."""
        platform = (await self.platform_admin()).client
        email = f"admin.{name}.{self.seed}.{self.run_id}@gameday.test"
        password = self.fake.password(length=16)
        org = json_of(await platform.create_org(f"{self.name} {name} run {self.run_id}"[:100],
                                                email, password), 201)
        self.admins_beside[str(org["id"])] = await self.sign_in(email, password)
        return str(org["id"])

    def reader(self, agent_id: str) -> CoveyClient:
        """Who reads this agent: its organisation's admin when it is one beside the game
        day's, else the game day's auditor (who may not see another organisation's)."""
        return self.recorder.reader(agent_id)

    async def agent(self, behaviour: Behaviour, warm: bool = False,
                    guard: dict[str, Any] | None = None, budget_usd: float | None = None,
                    model: str | None = None, max_turns: int = GAME_DAY_MAX_TURNS,
                    owner: str | None = None, org: str | None = None) -> dict[str, Any]:
        """An agent of this game day whose model answers with `behaviour`: a built-in
        behaviour's name, a script of fixtures/scripts by name, or a script inline
        (harness/act/scripts.py). Its step, token, tool-call and time limits are out of reach
        unless `guard` sets them: a game day's agents stop because of the switch, fault or
        guard layer under test, not because a long-running behaviour used up its default 20
        steps. `guard` takes the API's guard thresholds (loop_repeats, breaker_failures, ...);
        `owner` the role of the human who owns it (default: the org admin who creates it);
        `org` an organisation beside the game day's (`organisation_beside`) to make it in."""
        slug = agent_slug(self.run_id, len(self.agents) + 1, self.fake.slug())
        name = f"{self.fake.job()} bot"[:200]
        fields: dict[str, Any] = {"warm_sandbox": warm, "max_turns": max_turns,
                                  "guard": {**GAME_DAY_GUARD, **(guard or {})}}
        if budget_usd is not None:
            fields["budget_usd"] = budget_usd
        if model is not None:
            fields["model"] = model
        if owner is not None:
            fields["owner_id"] = json_of(await self.people[owner].me())["id"]
        resolve(behaviour)  # an unplayable script fails here, before an agent exists
        creator = self.people["org_admin"] if org is None else self.admins_beside[org]
        agent: dict[str, Any] = json_of(await creator.create_agent(slug, name, **fields), 201)
        await self.endpoints.puppet.assign(agent["id"], behaviour)
        agent["behaviour"] = behaviour_name(behaviour)
        self.agents[agent["id"]] = agent
        return agent

    async def task(self, agent_id: str, title: str | None = None) -> dict[str, Any]:
        task: dict[str, Any] = json_of(await self.people["org_admin"].create_task(
            agent_id, title or self.fake.sentence(nb_words=5)), 201)
        return task

    def as_(self, role: str, at: str | None = None, org: str | None = None) -> Operator:
        """The game day's human of `role`, every call recorded in the history; talking to the
        control plane at `at` (another replica's URL) instead of the stack's; with `org`, the
        admin of that organisation beside the game day's (role `org_admin`)."""
        if org is not None:
            if role != "org_admin":
                raise KeyError(f"an organisation beside the game day's has only its org_admin, "
                               f"no {role}")
            return Operator(f"org_admin@{org}", self.admins_beside[org], self.recorder,
                            self.fake)
        if role not in self.people:
            raise KeyError(f"no {role} in this game day; people: {', '.join(self.people)}")
        client = self.people[role] if at is None else self.client_at(role, at)
        return Operator(role, client, self.recorder, self.fake)

    def client_at(self, role: str, url: str) -> CoveyClient:
        """The game day's human of `role` talking to the control plane at `url` (another
        replica), made on first use and closed with the game day."""
        client = self._people_at.get((role, url))
        if client is None:
            client = self._people_at[(role, url)] = CoveyClient(url, self.people[role].token,
                                                                line=self.line)
        return client

    @property
    def lacks(self) -> Mapping[str, str]:
        """The checkers this game day cannot judge on its server's dialect, with what is
        missing."""
        return dialect(self.dialect_name).lacks

    @property
    def dialect_name(self) -> str:
        """The dialect its control plane speaks (a game day built without a real stack, as
        the harness's own tests do, speaks this project's)."""
        return str(getattr(self.endpoints, "dialect", COVEY_GAMEDAY))

    def unjudgeable(self, verdicts: list[Verdict]) -> list[Verdict]:
        """The verdicts, those of checkers the dialect lacks evidence for made `unknown`
        with what is missing: judged on no evidence, a checker would pass vacuously."""
        lacks = self.lacks
        return [Verdict(v.checker, "unknown", f"{NOT_JUDGEABLE} {self.dialect_name} "
                        f"covey: {lacks[v.checker]}.") if v.checker in lacks else v
                for v in verdicts]

    @property
    def until(self) -> Until:
        """The shared waits: each polls with a deadline and says what never happened."""
        return Until(self.recorder, self.endpoints, self.client_at)

    @property
    def expect(self) -> Expect:
        """The rules a stop must keep, checked while the game day goes on."""
        return Expect(self.recorder, self.until, self.as_, self.endpoints, self.organisation)

    @property
    def lease_s(self) -> float:
        """The kill-flag lease the stack's daemons hold, from the stack itself."""
        return self.recorder.lease_s

    # ------------------------------------------------------------------ the recorder

    @property
    def recorder(self) -> Recorder:
        """What the game day's people write to and read through (harness/record/recorder.py):
        this game day's own history, agents, people, notes and measurements."""
        e = self.endpoints
        return Recorder(history=self.history, agents=self.agents, people=self.people,
                        admins_beside=self.admins_beside, dialect_name=self.dialect_name,
                        stack=self.stack, data_dir=getattr(e, "data_dir", None),
                        lease_ms=getattr(e, "lease_ms", None), notes=self.notes,
                        measurements=self.measurements)

    async def operate(self, role: str, f: str, value: dict[str, Any],
                      call: Callable[[], Awaitable[httpx.Response]]) -> httpx.Response:
        """Invoke an operation as `role`, recorded in the history (Recorder.operate)."""
        return await self.recorder.operate(role, f, value, call)

    def observe(self, f: str, value: dict[str, Any], time_ns: int | None = None) -> None:
        """Something the harness saw in the system under test, into the history."""
        self.history.observe(OBSERVER, f, value, time_ns=time_ns)

    async def read_tasks(self) -> dict[str, dict[str, Any]]:
        """Every task of every agent, recorded as task_state observations."""
        return await self.recorder.read_tasks()

    async def why_work_cannot_finish(self, agents: list[str] | None = None) -> str | None:
        """Why this game day's unfinished tasks cannot all end done without a human, or None
        while they still can (Recorder.why_work_cannot_finish)."""
        return await self.recorder.why_work_cannot_finish(agents)

    # ------------------------------------------------------------------ homes

    def home_dir(self, agent_id: str, sandbox_id: str | None = None) -> Path:
        """An agent's home as the control plane keeps it (its last sync), or the working
        copy of one of its sandboxes (kept as evidence after a kill): on this machine only
        where the stack says where its data lives (the processes stack)."""
        if self.endpoints.data_dir is None:
            raise LookupError(f"the {self.stack} stack's agent homes are not on this machine")
        if sandbox_id is None:
            return self.endpoints.data_dir / "homes" / agent_id
        return self.endpoints.data_dir / "sandboxes" / agent_id / sandbox_id

    def read_home(self, agent_id: str, label: str, sandbox_id: str | None = None
                  ) -> dict[str, int]:
        """The files of a home (path: bytes), recorded as a `home_files` observation under
        `label` (harness.judge.costs: last_sync, sandbox_at_kill, restored)."""
        root = self.home_dir(agent_id, sandbox_id)
        files = {str(p.relative_to(root)): p.stat().st_size
                 for p in sorted(root.rglob("*")) if p.is_file()} if root.is_dir() else {}
        self.history.observe(OBSERVER, HOME_FILES_F, {"agent_id": agent_id, "label": label,
                                                      "files": files})
        return files

    async def remains(self, agent_id: str, record: bool = True) -> list[str] | None:
        """What of the agent's sandboxes still exists on this machine (Recorder.remains)."""
        return await self.recorder.remains(agent_id, record)

    async def sandboxes(self, agent_id: str) -> list[dict[str, Any]]:
        return await self.recorder.sandboxes(agent_id)

    async def live_sessions(self, agents: list[dict[str, Any]]) -> dict[str, str]:
        """The sessions of these agents that are starting or running now, each with its
        sandbox (session id: sandbox id), as the control plane says."""
        live = {}
        for a in agents:
            for s in json_of(await self.reader(a["id"]).sessions(a["id"])):
                if s["state"] in ("starting", "running"):
                    live[s["id"]] = s["sandbox_id"]
        return live

    async def daemon_exits(self, sandbox_ids: list[str]) -> dict[str, DaemonExit] | None:
        """How these sandboxes' daemons ended, read on this machine (Recorder.daemon_exits)."""
        return await self.recorder.daemon_exits(sandbox_ids)

    async def copy_ledger(self) -> None:
        """The puppet model's ledger into the history: each request an agent made is an
        action, at the time the model saw it and with the time its daemon sent it, with the
        tool call it was answered with and the usage reported; and each call that reached
        the failing service."""
        for agent_id in self.agents:
            for entry in await self.endpoints.puppet.actions(agent_id):
                # What the request carried back of the call answered before it.
                result = entry.tool_results[-1] if entry.tool_results else None
                self.history.observe(f"agent:{agent_id}", "action",
                                     {"step": entry.step, "behaviour": entry.behaviour,
                                      "tool": entry.tool, "args": entry.args,
                                      "prompt_tokens": entry.prompt_tokens,
                                      "completion_tokens": entry.completion_tokens,
                                      "sent_ns": entry.sent_ns, "result": result,
                                      "max_tokens": entry.max_tokens},
                                     time_ns=entry.at_ns)
            for at_ns in await self.endpoints.puppet.failed_calls(agent_id):
                self.history.observe(f"agent:{agent_id}", FAILING_SERVICE_CALL_F, {},
                                     time_ns=at_ns)

    async def copy_sandboxes_and_sessions(self) -> None:
        """Daemon exits, sandboxes gone, home syncs and sessions started, at the control
        plane's times."""
        for agent_id in self.agents:
            for box in await self.sandboxes(agent_id):
                # Its life, for the lingering-sandbox checker: over once it is gone (a
                # deployment that does not record gone_at says ended_at).
                ended = _ns(box["gone_at"] if "gone_at" in box else box.get("ended_at"))
                self.history.observe(OBSERVER, SANDBOX_F, {
                    "agent_id": agent_id, "sandbox_id": box["id"], "state": box["state"],
                    "created_ns": _ns(box["created_at"]), "ended_ns": ended,
                    "daemon_exited_ns": _ns(box.get("daemon_exited_at"))})
                for f, value, at_ns in sandbox_observations(box):
                    self.history.observe(f"agent:{agent_id}", f, value, time_ns=at_ns)
            sessions = json_of(await self.reader(agent_id).sessions(agent_id))
            for s in sessions:
                started = _ns(s["started_at"])
                if started is not None:
                    self.history.observe(OBSERVER, "session_start",
                                         {"agent_id": agent_id, "session_id": s["id"],
                                          "outcome": "started"}, time_ns=started)
                ended = _ns(s.get("ended_at"))
                if ended is not None:
                    self.history.observe(OBSERVER, SESSION_END_F, {
                        "agent_id": agent_id, "session_id": s["id"], "state": s["state"],
                        "stop_layer": s["stop_layer"], "stop_reason": s["stop_reason"],
                        "budget_usd": self.agents[agent_id].get("budget_usd"),
                        "model": self.agents[agent_id].get("model")},
                        time_ns=ended)
                delivery = kill_delivery(agent_id, s)
                if delivery is not None:
                    self.history.observe(OBSERVER, KILL_DELIVERY_F, delivery,
                                         time_ns=delivery["sent_ns"])

    async def copy_task_results(self) -> None:
        """Each result a daemon reported for a task, as the control plane recorded it in the
        agent's recording (taken, or rejected and why), by the session that reported it;
        none where the dialect's recording is not read (its checkers say so)."""
        if not dialect(self.dialect_name).recording:
            return
        for agent_id in self.agents:
            seen = 0
            while True:
                page = json_of(await self.reader(agent_id).recording(agent_id, after=seen))
                for e in page:
                    seen = max(seen, int(e["id"]))
                    if e["kind"] == "task" and e["status"] in ("done", "blocked", "rejected"):
                        self.history.observe(OBSERVER, TASK_RESULT_F, {
                            "agent_id": agent_id, "session_id": e["session_id"],
                            "task_id": e["detail"].get("task_id"), "status": e["status"],
                            "why": e["detail"].get("why")}, time_ns=_ns(e["at"]))
                if len(page) < RECORDING_PAGE:
                    break

    async def final_state(self) -> FinalState:
        tasks: dict[str, FinalTask] = {}
        agents: dict[str, FinalAgent] = {}
        for agent_id in self.agents:
            reader = self.reader(agent_id)
            got = json_of(await reader.agent(agent_id))
            live = [str(s["task_id"]) for s in json_of(await reader.sessions(agent_id))
                if s["state"] in ("starting", "running") and s["task_id"] is not None]
            agents[agent_id] = {"killed": got["killed"], "kill_origin": got["kill_origin"],
                                "live_tasks": live, "org_id": str(got["org_id"])}
            for t in json_of(await reader.backlog(agent_id)):
                detail = json_of(await reader.task(agent_id, t["id"]))
                done = sum(1 for tr in detail["transitions"] if tr["to_state"] == "done")
                tasks[t["id"]] = {"state": t["state"], "agent_id": agent_id,
                                  "done_count": done, "result": t.get("result")}
        return FinalState(tasks=tasks, agents=agents)

    # ------------------------------------------------------------------ the journal

    def journal(self, status: str, verdicts: list[Verdict], samples: list[TimeToStop],
                steady_after: dict[str, Any]) -> Path:
        self.report_dir.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        path = self.report_dir / f"{self.name}-{stamp}.json"
        summary = {part: asdict(p) for part, p in summarize(samples).items()} if samples else {}
        history_path = path.with_suffix(".history.jsonl")
        self.history.to_jsonl(history_path)
        document = {
            "game_day": self.name,
            "scenario": self.scenario,
            "status": status,
            **({"aborted_reason": self.aborted_reason} if status == "aborted" else {}),
            "started_at": self.started_at,
            "ended_at": datetime.now(UTC).isoformat(),
            "stack": self.stack,
            "dialect": self.dialect_name,
            "seed": self.seed,
            "versions": {**self.endpoints.versions, "platform": platform.platform()},
            "agents": [{"id": a["id"], "slug": a["slug"], "behaviour": a["behaviour"]}
                       for a in self.agents.values()],
            "steady_state": {"before": self.steady_state, "after": steady_after},
            "faults": self.endpoints.nemesis.fault_log(),
            "faults_healed": self.endpoints.nemesis.verify_healed().to_json(),
            "measurements": {"time_to_stop": {"summary_us": summary,
                                              "samples_ns": [asdict(s) for s in samples]},
                             **self.measurements},
            "verdicts": [asdict(v) for v in verdicts],
            # What the page needs to tell a failure from a quiet "not judged": the checkers
            # this game day had to decide, and the rule it saw broken as it went on.
            "required": sorted(self.required),
            "seen_broken": self.seen_broken,
            "notes": self.notes,
            "history": history_path.name,
            **self.journal_sections,
        }
        path.write_text(json.dumps(document, indent=2, default=str))
        self.journal_path = path
        phases.info("journal %s (%s)", path, status)
        return path

    def copy_faults(self) -> None:
        """The nemesis's faults into the history: a start and, once healed, a heal each."""
        for fault in self.endpoints.nemesis.faults():
            value = {"fault_id": fault.id, "kind": fault.kind, "target": fault.target}
            self.history.observe("nemesis", "fault_start", value, time_ns=fault.started_ns)
            if fault.healed_ns is not None:
                self.history.observe("nemesis", "fault_heal",
                                     {**value, "healed_by": fault.healed_by},
                                     time_ns=fault.healed_ns)

    async def prepare(self) -> None:
        """The steady-state hypothesis, the game day's organisation and people
        (harness/run/steady.py); SteadyStateNotMet when the system is not fit to start."""
        await prepare(self)

    async def collect(self) -> FinalState:
        """What the checkers judge, read back after the scenario: the faults, the puppet's
        ledger, sandboxes and sessions at the control plane's times, the final state."""
        await self.endpoints.nemesis.refresh()
        if self.endpoints.lease_ms is not None:
            self.history.observe(OBSERVER, LEASE_F, {"lease_ms": self.endpoints.lease_ms})
        self.copy_faults()
        refusals = dialect(self.dialect_name).refusals
        self.history.observe(OBSERVER, WAKE_REFUSALS_F, {
            "dialect": self.dialect_name,
            "statuses": {path: status for path, (status, _) in refusals.items()}})
        await self.copy_ledger()
        await self.copy_sandboxes_and_sessions()
        await self.copy_task_results()
        return await self.final_state()

    async def roll_back(self) -> None:
        """Leave the system as the game day found it (harness/run/rollback.py); RollbackFailed
        with what is left standing."""
        await roll_back_loudly(self)

    async def judge(self) -> tuple[list[Verdict], list[TimeToStop], FinalState]:
        """Judge after the fact. Faults still standing are judged as they are: unhealed. A
        checker that raises is `unknown` with its error; the other verdicts stand."""
        phases.info("judging the history")
        final = await self.collect()
        self.verdicts = self.unjudgeable(judge_all(self.checkers, self.history, final))
        for name, measure in self.measures.items():
            self.measurements[name] = measure(self.history, final)
        self.figures = bounded_figures(self.bounds, self.history, final)
        self.verdicts += self.unjudgeable([f.verdict() for f in self.figures])
        if self.figures:
            self.measurements["bounded"] = {f.name: f.to_json() for f in self.figures}
        return self.verdicts, time_to_stop(self.history, final), final

    async def judged(self, outcome: Outcome | None = None) -> FinalState:
        """Judge now (after the scenario's last operation, when it reads the verdicts
        itself); the game day's end does not judge again."""
        outcome = self.outcome if outcome is None else outcome
        outcome.verdicts, outcome.samples, outcome.final = await self.judge()
        return outcome.final

    @property
    def _line_log(self) -> Path:
        return self.report_dir / f"switch-line-{self.name}-{self.run_id}.log"

    async def close(self) -> None:
        for client in (*self.people.values(), *self._people_at.values(),
                       *self.admins_beside.values()):
            await client.aclose()
        if self.line is not None:
            await self.line.aclose()
            drop_if_empty(self._line_log)
