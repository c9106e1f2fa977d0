"""A game day's history: every operation and observation, as plain data (Jepsen's model).

An operation is an `invoke` followed by one completion: `ok` (it happened), `fail` (it
certainly did not) or `info` (nobody knows: a timeout, a dropped connection; it may take effect
at any time after its invoke). An observation with no request of ours behind it (a puppet
ledger entry, a task state read back, a daemon's exit) is one lone `ok` event.

The run only records; the checkers judge afterwards. Order in time is `time_ns` (wall clock),
not `index`: ledger entries are copied in after the fact with the puppet's own timestamps.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast, get_args

EventType = Literal["invoke", "ok", "fail", "info"]
EVENT_TYPES: tuple[EventType, ...] = get_args(EventType)
COMPLETION_TYPES: tuple[EventType, ...] = ("ok", "fail", "info")

AGENT_PROCESS_PREFIX = "agent:"


@dataclass(frozen=True)
class Event:
    """One line of the history. `invoke_index` ties a completion to its invoke (an operator
    may have several requests in flight, so pairing by process, as Jepsen does, would lie)."""

    index: int
    type: EventType
    process: str
    f: str
    value: dict[str, Any]
    time_ns: int
    invoke_index: int | None = None

    @property
    def agent_id(self) -> str | None:
        """The agent this event is about: its own process `agent:<id>`, else `value["agent_id"]`."""
        return agent_id_of(self.process, self.value)

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "type": self.type, "process": self.process, "f": self.f,
                "value": self.value, "time_ns": self.time_ns, "invoke_index": self.invoke_index}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Event:
        if data.get("type") not in EVENT_TYPES:
            raise ValueError(f"event type must be one of {EVENT_TYPES}, not {data.get('type')!r}")
        value = data.get("value", {})
        if not isinstance(value, dict):
            raise ValueError(f"event value must be an object, not {value!r}")
        invoke_index = data.get("invoke_index")
        return cls(index=int(data["index"]), type=cast(EventType, data["type"]),
                   process=str(data["process"]), f=str(data["f"]), value=value,
                   time_ns=int(data["time_ns"]),
                   invoke_index=None if invoke_index is None else int(invoke_index))


def agent_id_of(process: str, value: dict[str, Any]) -> str | None:
    if process.startswith(AGENT_PROCESS_PREFIX):
        return process[len(AGENT_PROCESS_PREFIX):]
    agent = value.get("agent_id")
    return agent if isinstance(agent, str) else None


@dataclass(frozen=True)
class Operation:
    """An invoke with its completion, or a lone observation, read as one thing.

    `type` is the outcome (a pending invoke reads as `info`); `value` is the invoke's value
    updated with the completion's; the operation took effect somewhere in
    [`start_ns`, `end_ns`], and `end_ns` is None when the outcome is unknown."""

    f: str
    process: str
    type: EventType
    value: dict[str, Any]
    start_ns: int
    end_ns: int | None
    indexes: tuple[int, ...] = field(default=())

    @property
    def agent_id(self) -> str | None:
        return agent_id_of(self.process, self.value)

    @property
    def first_index(self) -> int:
        return self.indexes[0]

    @property
    def last_index(self) -> int:
        """The completion (for a lone observation, the observation itself)."""
        return self.indexes[-1]


class History:
    """An append-only list of events. Appends take a lock and never await, so the asyncio
    harness and a puppet model served from a thread can both record into it."""

    def __init__(self, events: Iterable[Event] = (), *,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self.clock = clock
        self._events: list[Event] = []
        self._completion_of: dict[int, int] = {}
        self._lock = threading.Lock()
        for event in events:
            self._append(event)

    # ---------------------------------------------------------------- recording

    def record(self, type: EventType, process: str, f: str, value: dict[str, Any] | None = None,
               *, time_ns: int | None = None, invoke_index: int | None = None) -> Event:
        """Append one event; `time_ns` defaults to now on the history's clock."""
        with self._lock:
            event = Event(index=len(self._events), type=type, process=process, f=f,
                          value=dict(value or {}),
                          time_ns=self.clock() if time_ns is None else time_ns,
                          invoke_index=invoke_index)
            self._append(event)
            return event

    def invoke(self, process: str, f: str, value: dict[str, Any] | None = None) -> Event:
        return self.record("invoke", process, f, value)

    def complete(self, invoke: Event, type: EventType, value: dict[str, Any] | None = None,
                 *, time_ns: int | None = None) -> Event:
        """Record the outcome of `invoke`: ok, fail, or info when nobody knows."""
        return self.record(type, invoke.process, invoke.f, value, time_ns=time_ns,
                           invoke_index=invoke.index)

    def observe(self, process: str, f: str, value: dict[str, Any] | None = None, *,
                time_ns: int | None = None) -> Event:
        """Record something seen, with no request of ours behind it (a lone `ok`)."""
        return self.record("ok", process, f, value, time_ns=time_ns)

    def _append(self, event: Event) -> None:
        if event.index != len(self._events):
            raise ValueError(f"event {event.index} out of place: expected index "
                             f"{len(self._events)}")
        if event.type not in EVENT_TYPES:
            raise ValueError(f"event type must be one of {EVENT_TYPES}, not {event.type!r}")
        if event.invoke_index is not None:
            self._check_completion(event, event.invoke_index)
            self._completion_of[event.invoke_index] = event.index
        self._events.append(event)

    def _check_completion(self, event: Event, invoke_index: int) -> None:
        if event.type == "invoke":
            raise ValueError(f"event {event.index}: an invoke cannot complete another")
        if not 0 <= invoke_index < len(self._events):
            raise ValueError(f"event {event.index} completes unknown event {invoke_index}")
        invoke = self._events[invoke_index]
        if invoke.type != "invoke":
            raise ValueError(f"event {event.index} completes event {invoke_index}, "
                             f"which is {invoke.type!r}, not an invoke")
        if (invoke.process, invoke.f) != (event.process, event.f):
            raise ValueError(f"event {event.index} ({event.process} {event.f}) does not match "
                             f"its invoke {invoke_index} ({invoke.process} {invoke.f})")
        if invoke_index in self._completion_of:
            raise ValueError(f"event {invoke_index} was already completed by event "
                             f"{self._completion_of[invoke_index]}")

    # ---------------------------------------------------------------- reading

    @property
    def events(self) -> tuple[Event, ...]:
        return tuple(self._events)

    def __len__(self) -> int:
        return len(self._events)

    def __iter__(self) -> Iterator[Event]:
        return iter(tuple(self._events))

    def __getitem__(self, index: int) -> Event:
        return self._events[index]

    def select(self, *, type: EventType | None = None, process: str | None = None,
               f: str | Collection[str] | None = None, agent_id: str | None = None
               ) -> list[Event]:
        """The events matching every filter given, in index order."""
        fs = {f} if isinstance(f, str) else None if f is None else set(f)
        return [e for e in self._events
                if (type is None or e.type == type)
                and (process is None or e.process == process)
                and (fs is None or e.f in fs)
                and (agent_id is None or e.agent_id == agent_id)]

    def completion_of(self, invoke: Event) -> Event | None:
        index = self._completion_of.get(invoke.index)
        return None if index is None else self._events[index]

    def invocation_of(self, completion: Event) -> Event | None:
        if completion.invoke_index is None:
            return None
        return self._events[completion.invoke_index]

    def operations(self, f: str | Collection[str] | None = None) -> list[Operation]:
        """Every operation (invoke + completion) and lone observation, in order of start."""
        ops: list[Operation] = []
        for event in self.select(f=f):
            if event.invoke_index is not None:
                continue  # read with its invoke
            if event.type != "invoke":
                ops.append(Operation(f=event.f, process=event.process, type=event.type,
                                     value=event.value, start_ns=event.time_ns,
                                     end_ns=None if event.type == "info" else event.time_ns,
                                     indexes=(event.index,)))
                continue
            done = self.completion_of(event)
            if done is None:
                ops.append(Operation(f=event.f, process=event.process, type="info",
                                     value=event.value, start_ns=event.time_ns, end_ns=None,
                                     indexes=(event.index,)))
                continue
            ops.append(Operation(f=event.f, process=event.process, type=done.type,
                                 value={**event.value, **done.value}, start_ns=event.time_ns,
                                 end_ns=None if done.type == "info" else done.time_ns,
                                 indexes=(event.index, done.index)))
        return sorted(ops, key=lambda op: (op.start_ns, op.first_index))

    # ---------------------------------------------------------------- files

    def to_jsonl(self, path: str | Path) -> None:
        """One event per line, in index order."""
        with Path(path).open("w", encoding="utf-8") as out:
            for event in self:
                out.write(json.dumps(event.to_json(), sort_keys=True) + "\n")

    @classmethod
    def from_jsonl(cls, path: str | Path) -> History:
        with Path(path).open(encoding="utf-8") as lines:
            return cls(Event.from_json(json.loads(line)) for line in lines if line.strip())
