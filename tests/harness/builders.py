"""Histories written by hand, on a clock the test moves: a clean fleet-stop game day, and the
pieces to bend it into each violation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.judge.checkers import FinalState
from harness.record.history import Event, EventType, History

MS = 1_000_000
# The installed pytest plugins an inner pytest (pytester's subprocess) has no use for: each
# costs seconds of start-up (hypothesis and schemathesis most), many times over on a loaded
# 2-core machine, and the inner runs exercise only the harness's own plugin.
UNUSED_PLUGINS = ("-p", "no:hypothesispytest", "-p", "no:schemathesis", "-p", "no:benchmark",
                  "-p", "no:locust", "-p", "no:xdist")


@dataclass
class Clock:
    now_ns: int = 0

    def __call__(self) -> int:
        return self.now_ns

    def at(self, ms: float) -> Clock:
        self.now_ns = int(ms * MS)
        return self


@dataclass
class GameDay:
    """A history and its clock, with the operations a fleet-stop game day records."""

    clock: Clock = field(default_factory=Clock)
    history: History = field(init=False)

    def __post_init__(self) -> None:
        self.history = History(clock=self.clock)

    def operation(self, process: str, f: str, value: dict[str, Any], invoked_ms: float,
                  done_ms: float, outcome: EventType = "ok",
                  result: dict[str, Any] | None = None) -> tuple[Event, Event]:
        self.clock.at(invoked_ms)
        invoke = self.history.invoke(process, f, value)
        self.clock.at(done_ms)
        done = self.history.complete(invoke, outcome, result or {})
        return invoke, done

    def kill_fleet(self, invoked_ms: float, acked_ms: float) -> tuple[Event, Event]:
        return self.operation("operator:security", "kill_fleet", {}, invoked_ms, acked_ms)

    def resume_fleet(self, invoked_ms: float, acked_ms: float) -> tuple[Event, Event]:
        return self.operation("operator:security", "resume_fleet", {}, invoked_ms, acked_ms)

    def kill_agent(self, agent_id: str, invoked_ms: float, acked_ms: float
                   ) -> tuple[Event, Event]:
        return self.operation("operator:owner", "kill_agent", {"agent_id": agent_id},
                              invoked_ms, acked_ms)

    def resume_agent(self, agent_id: str, invoked_ms: float, acked_ms: float
                     ) -> tuple[Event, Event]:
        return self.operation("operator:owner", "resume_agent", {"agent_id": agent_id},
                              invoked_ms, acked_ms)

    def action(self, agent_id: str, at_ms: float, tool: str = "shell",
               sent_ms: float | None = None, result: str | None = None) -> Event:
        """A model request the puppet saw at `at_ms`, sent by its daemon at `sent_ms` (None:
        the request carried no send stamp), carrying back `result` of the call before."""
        return self.history.observe(f"agent:{agent_id}", "action", {
            "tool": tool, "sent_ns": None if sent_ms is None else int(sent_ms * MS),
            "result": result}, time_ns=int(at_ms * MS))

    def task(self, task_id: str, agent_id: str, state: str, at_ms: float) -> Event:
        return self.history.observe("observer", "task_state",
                                    {"task_id": task_id, "agent_id": agent_id, "state": state},
                                    time_ns=int(at_ms * MS))

    def delivery(self, agent_id: str, session_id: str, sent_ms: float,
                 confirmed_ms: float | None, by: str | None = "kill_ack",
                 daemon_stop: str | None = "kill", acked_ms: float | None = None) -> Event:
        """A kill message sent to a daemon and its confirmation, as read back from the
        session record; `acked_ms`: when the daemon says it acknowledged (its own clock)."""
        return self.history.observe("observer", "kill_delivery", {
            "agent_id": agent_id, "session_id": session_id, "sent_ns": int(sent_ms * MS),
            "confirmed_ns": None if confirmed_ms is None else int(confirmed_ms * MS),
            "confirmed_by": by, "daemon_stop": daemon_stop,
            "acked_ns": None if acked_ms is None else int(acked_ms * MS)},
            time_ns=int(sent_ms * MS))

    def seen(self, f: str, agent_id: str, at_ms: float, **value: Any) -> Event:
        return self.history.observe("observer", f, {"agent_id": agent_id, **value},
                                    time_ns=int(at_ms * MS))


def clean_game_day() -> tuple[GameDay, FinalState]:
    """Two agents working; the fleet stop pulled at 100 ms and acknowledged at 120 ms; every
    part stops; resume at 300 ms; every task done once; the one fault healed."""
    day = GameDay()
    day.operation("nemesis", "fault_start", {"fault_id": "latency-flag-store"}, 40, 41)
    day.action("a1", 10)
    day.action("a2", 20)
    day.task("t1", "a1", "in_progress", 95)
    day.task("t2", "a2", "open", 95)
    day.task("t3", "a2", "in_progress", 95)
    day.action("a2", 99)
    day.kill_fleet(100, 120)
    day.delivery("a1", "s1", sent_ms=105, confirmed_ms=112)
    day.delivery("a2", "s2", sent_ms=105, confirmed_ms=115)
    day.action("a1", 110)  # in flight: started before the kill was acknowledged
    day.task("t1", "a1", "open", 125)
    day.task("t2", "a2", "open", 125)
    day.task("t3", "a2", "open", 126)
    day.seen("daemon_exit", "a1", 130, exit_code=3)
    day.seen("sandbox_gone", "a1", 140)
    day.seen("daemon_exit", "a2", 150, exit_code=3)
    day.seen("sandbox_gone", "a2", 160)
    # An operator's wake request during the stop, refused: not a wake.
    day.operation("operator:owner", "wake", {"agent_id": "a1"}, 200, 201,
                  result={"outcome": "refused"})
    day.operation("nemesis", "fault_heal", {"fault_id": "latency-flag-store"}, 250, 251)
    day.resume_fleet(300, 310)
    day.action("a1", 305)  # the resume may already have taken effect
    day.seen("session_start", "a1", 312)
    day.seen("session_start", "a2", 313)
    day.action("a2", 320)
    day.task("t1", "a1", "done", 400)
    final = FinalState(
        tasks={"t1": {"state": "done", "agent_id": "a1", "done_count": 1},
               "t2": {"state": "done", "agent_id": "a2", "done_count": 1},
               "t3": {"state": "done", "agent_id": "a2", "done_count": 1}},
        agents={"a1": {"killed": False, "kill_origin": None},
                "a2": {"killed": False, "kill_origin": None}},
    )
    return day, final
