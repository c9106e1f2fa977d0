"""A random game day's schedule: drawn from a seed, kept as plain data, replayed exactly.

The draw depends on the seed and the parameters only, never on what the system under test
answers, so the same seed gives the same schedule on every stack and every machine, and a
journal's `schedule` section replays the game day step for step. Agents and tasks are named
by their index in the schedule (ids differ from run to run).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

SCHEDULE_VERSION = 1
ROLES = ("org_admin", "agent_owner", "security", "auditor", "controlling")

# Who may do what (covey/api/deps.py: manage, security, killers). A draw is mostly by a
# person allowed to act, sometimes by one who is not, whose refusal (403) lands in the
# history like any other answer.
MANAGE = ("org_admin", "agent_owner")
KILLERS = ("org_admin", "agent_owner", "security")
SECURITY = ("org_admin", "security")
ALLOWED: dict[str, tuple[str, ...]] = {
    "kill_agent": KILLERS, "resume_agent": KILLERS,
    "kill_fleet": SECURITY, "resume_fleet": SECURITY,
    "create_task": MANAGE, "change_task": MANAGE, "wake": MANAGE, "fire_heartbeat": MANAGE,
    # The trigger is a machine endpoint: its token, not a role, lets it in.
    "trigger": ("org_admin",),
}
OPERATIONS = tuple(ALLOWED)
# How often each operation is drawn, relative to the others: switches and new work most.
WEIGHTS: dict[str, float] = {
    "kill_agent": 3, "resume_agent": 3, "kill_fleet": 1, "resume_fleet": 1.5,
    "create_task": 3, "change_task": 1, "wake": 1.5, "fire_heartbeat": 1, "trigger": 1,
}
UNAUTHORISED_SHARE = 0.1
# Mixed behaviours: agents that finish on their own and agents only a switch stops
# (fixtures/scripts/ and the puppet's built-ins). rm_rf runs with the loop detector out of
# reach: this game day tests the switches, not the guard.
BEHAVIOURS = ("busy_writer", "writer", "well_behaved", "silent", "slow_writer", "rm_rf")
WARM_SHARE = 0.3
OPERATIONS_PER_S = 1.0
FAULTS_PER_S = 0.15

StepKind = Literal["operation", "fault"]


@dataclass(frozen=True)
class AgentPlan:
    """One agent of the schedule: its script, whether it is warm, and its first tasks."""

    behaviour: str
    warm: bool = False
    tasks: int = 1


@dataclass(frozen=True)
class Step:
    """One thing that happens `at_s` seconds into the schedule: an operation by `role`, or
    a fault from the registry (harness/generator/faults.py) with its parameters. `agent` is
    an index into the schedule's agents; `params` holds the rest (a task's index among its
    agent's tasks, a fault's deadline, a latency)."""

    at_s: float
    kind: StepKind
    name: str
    role: str | None = None
    agent: int | None = None
    params: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        who = f"{self.role} " if self.role else ""
        on = f" agent#{self.agent}" if self.agent is not None else ""
        extra = f" {json.dumps(self.params, sort_keys=True)}" if self.params else ""
        return f"+{self.at_s:.2f}s {who}{self.name}{on}{extra}"


@dataclass(frozen=True)
class Schedule:
    seed: int
    duration_s: float
    agents: tuple[AgentPlan, ...]
    steps: tuple[Step, ...]
    faults: tuple[str, ...] = ()  # the fault names it could draw from

    def with_steps(self, steps: Iterable[Step]) -> Schedule:
        return replace(self, steps=tuple(steps))

    def to_json(self) -> dict[str, Any]:
        return {"version": SCHEDULE_VERSION, "seed": self.seed, "duration_s": self.duration_s,
                "agents": [asdict(a) for a in self.agents],
                "steps": [asdict(s) for s in self.steps], "faults": list(self.faults)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Schedule:
        if data.get("version") != SCHEDULE_VERSION:
            raise ValueError(f"a schedule of version {SCHEDULE_VERSION} was expected, not "
                             f"{data.get('version')!r}")
        agents = tuple(AgentPlan(**a) for a in data["agents"])
        steps = tuple(Step(**s) for s in data["steps"])
        for n, s in enumerate(steps):
            if s.agent is not None and not 0 <= s.agent < len(agents):
                raise ValueError(f"step {n} ({s.name}) names agent #{s.agent}, and the "
                                 f"schedule has {len(agents)}")
        return cls(seed=int(data["seed"]), duration_s=float(data["duration_s"]),
                   agents=agents, steps=steps, faults=tuple(data.get("faults", ())))


def _role(rng: random.Random, operation: str) -> str:
    allowed = ALLOWED[operation]
    others = [r for r in ROLES if r not in allowed]
    if others and rng.random() < UNAUTHORISED_SHARE:
        return rng.choice(others)
    return rng.choice(allowed)


def generate(seed: int, *, agents: int, duration_s: float,
             faults: Mapping[str, Any] | Sequence[str] = ()) -> Schedule:
    """A schedule of about `OPERATIONS_PER_S` operations and `FAULTS_PER_S` faults a second
    over `duration_s`, on `agents` agents, drawing faults from `faults` (the registry's
    entries usable on the stack; their parameters from each entry's `draw`)."""
    if agents < 1:
        raise ValueError("a schedule needs at least one agent")
    if duration_s <= 0:
        raise ValueError("a schedule needs a positive duration")
    from harness.generator.faults import FAULTS  # the registry draws its own parameters

    rng = random.Random(seed)
    plans = tuple(AgentPlan(behaviour=BEHAVIOURS[(seed + i) % len(BEHAVIOURS)],
                            warm=rng.random() < WARM_SHARE, tasks=rng.randint(1, 2))
                  for i in range(agents))
    names = sorted(faults)
    steps: list[Step] = []
    t = rng.uniform(0.5, 1.5)  # the agents get to work first
    while t < duration_s:
        if names and rng.random() < FAULTS_PER_S / (OPERATIONS_PER_S + FAULTS_PER_S):
            name = rng.choice(names)
            agent = rng.randrange(agents) if FAULTS[name].needs_agent else None
            steps.append(Step(round(t, 3), "fault", name, None, agent,
                              FAULTS[name].draw(rng, duration_s)))
        else:
            op = rng.choices(OPERATIONS, weights=[WEIGHTS[o] for o in OPERATIONS])[0]
            agent = None if op in ("kill_fleet", "resume_fleet") else rng.randrange(agents)
            params: dict[str, Any] = {}
            if op == "change_task":
                params = {"task": rng.randrange(4), "priority": rng.randint(-5, 5)}
            steps.append(Step(round(t, 3), "operation", op, _role(rng, op), agent, params))
        t += rng.expovariate(OPERATIONS_PER_S + FAULTS_PER_S)
    return Schedule(seed=seed, duration_s=duration_s, agents=plans, steps=tuple(steps),
                    faults=tuple(names))


def from_journal(path: str | Path) -> Schedule:
    """The schedule a game day's journal recorded (its `schedule` section), or the one a
    schedule file holds (a shrunk schedule is written as one)."""
    document = json.loads(Path(path).read_text())
    if "schedule" in document:
        return Schedule.from_json(document["schedule"])
    if "steps" in document:
        return Schedule.from_json(document)
    raise ValueError(f"{path} holds no schedule: it is neither the journal of a random game "
                     f"day (scenarios/random_gameday.py) nor a schedule file")


def write(schedule: Schedule, path: str | Path) -> Path:
    """A schedule file, for `--replay`."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(schedule.to_json(), indent=2))
    return out
