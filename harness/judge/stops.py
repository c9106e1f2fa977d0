"""When a stop stands, read from a history: the one place the harness decides it, for the
checkers and for measure alike.

DESIGN §2.3: an agent is held while its own flag stands (from an agent kill until an agent
resume) or its organisation's (from a fleet kill until a fleet resume); and (§2.4) every
agent of every organisation while a platform admin's global flag stands (from
`stop_globally` until `clear_global_stop`). Releasing one agent while the fleet stop
stands does not free it (line 6), and a fleet resume does not free an agent stopped on its
own (line 5); so the scopes are kept apart, never merged into one flag.

Operations: `kill_agent` / `resume_agent` with `value["agent_id"]`; `kill_fleet` /
`resume_fleet`, with `value["org_id"]` when a game day has more than one organisation;
`stop_globally` / `clear_global_stop`, which name nothing: they hold every agent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from harness.record.history import History, Operation

Scope = Literal["agent", "fleet", "global"]
KILL_SCOPES: dict[str, Scope] = {"kill_agent": "agent", "kill_fleet": "fleet",
                                 "stop_globally": "global"}
RESUME_SCOPES: dict[str, Scope] = {"resume_agent": "agent", "resume_fleet": "fleet",
                                   "clear_global_stop": "global"}


@dataclass(frozen=True)
class Stop:
    """One kill that did not fail, and the earliest instant a resume could have released it.

    A resume may take effect anywhere between its invoke and its ok, and one with an unknown
    outcome at any time after its invoke; so the stop is only judged up to the first such
    invoke. A resume invoked before the kill was acknowledged leaves nothing to judge."""

    scope: Scope
    kill: Operation
    agent_id: str | None  # scope "agent": the agent killed
    org_id: str | None  # scope "fleet": the organisation, when the history names it
    lifted_ns: int | None  # None: nothing released it before the history ends
    resume: Operation | None

    @property
    def acknowledged_ns(self) -> int | None:
        """When the kill was acknowledged (its ok); None when its outcome is unknown."""
        return self.kill.end_ns if self.kill.type == "ok" else None

    def covers(self, agent_id: str, org_id: str | None = None) -> bool:
        """Whether this kill stops `agent_id` (of organisation `org_id`, when known)."""
        if self.scope == "agent":
            return self.agent_id == agent_id
        if self.scope == "global":
            return True
        return self.org_id is None or org_id is None or self.org_id == org_id

    def holds_at(self, time_ns: int) -> bool:
        """Whether the acknowledged stop certainly stands at `time_ns`."""
        ack = self.acknowledged_ns
        return (ack is not None and ack < time_ns
                and (self.lifted_ns is None or time_ns < self.lifted_ns))

    def holds_throughout(self, start_ns: int, end_ns: int) -> bool:
        return self.holds_at(start_ns) and self.holds_at(end_ns)


def stops(history: History) -> list[Stop]:
    """Every kill that did not fail (acknowledged or with unknown outcome), in order of invoke."""
    resumes = [op for op in history.operations(RESUME_SCOPES) if op.type != "fail"]
    found: list[Stop] = []
    for kill in history.operations(KILL_SCOPES):
        if kill.type == "fail":
            continue
        scope = KILL_SCOPES[kill.f]
        agent_id = kill.agent_id if scope == "agent" else None
        if scope == "agent" and agent_id is None:
            raise ValueError(f"kill_agent at event {kill.first_index} names no agent_id")
        org_id = _org_id(kill) if scope == "fleet" else None
        releasing = [r for r in resumes
                     if RESUME_SCOPES[r.f] == scope
                     and (scope != "agent" or r.agent_id == agent_id)
                     and (scope == "agent" or org_id is None or _org_id(r) in (None, org_id))
                     # A resume finished before the kill began was overtaken by it.
                     and (r.end_ns is None or r.end_ns > kill.start_ns)]
        first = min(releasing, key=lambda r: (r.start_ns, r.first_index), default=None)
        found.append(Stop(scope=scope, kill=kill, agent_id=agent_id, org_id=org_id,
                          lifted_ns=None if first is None else first.start_ns, resume=first))
    return found


def holding(all_stops: list[Stop], agent_id: str, org_id: str | None, start_ns: int,
            end_ns: int | None = None) -> Stop | None:
    """The first acknowledged stop that certainly held the agent from `start_ns` to `end_ns`."""
    end = start_ns if end_ns is None else end_ns
    return next((s for s in all_stops
                 if s.covers(agent_id, org_id) and s.holds_throughout(start_ns, end)), None)


def _org_id(op: Operation) -> str | None:
    org = op.value.get("org_id")
    return org if isinstance(org, str) else None
