"""A fault as the log keeps it, the errors of injecting and healing one, and the end-of-day
report of what healed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, get_args

ProxyFaultKind = Literal["latency", "blackhole", "reset", "down"]
PROXY_FAULT_KINDS: tuple[ProxyFaultKind, ...] = get_args(ProxyFaultKind)
FaultKind = Literal["latency", "blackhole", "reset", "down", "pause", "kill", "stop",
                    "disconnect", "restart"]
# "replaced": a newer fault on the same target took its place; "instant": a kill, over once
# delivered (bringing the process back is the stack's job, not a heal); "halt": the harness's
# own stop switch; "watchdog": the detached watchdog, the harness having died.
HealedBy = Literal["deadline", "heal", "replaced", "instant", "halt", "watchdog"]

MAX_DEADLINE_S = 3600.0
MAX_LATENCY_MS = 600_000


class BadFault(ValueError):
    """A fault that cannot be injected as asked: `error` says what, `hint` how to fix it."""

    def __init__(self, error: str, hint: str) -> None:
        super().__init__(f"{error}: {hint}")
        self.error = error
        self.hint = hint


class HealFailed(RuntimeError):
    """A fault could not be lifted (a `down` proxy could not listen on its port again)."""


@dataclass
class FaultRecord:
    """One fault, from its start to its heal. Mutable while it stands; the log hands out
    copies."""

    id: str
    target: str  # a proxy's name, "pid <n>" or "container <name>"
    kind: FaultKind
    started_ns: int
    deadline_s: float | None = None
    ms: int | None = None
    network: str | None = None  # the network a container is disconnected from
    heals_at_ns: int | None = None
    healed_ns: int | None = None
    healed_by: HealedBy | None = None
    note: str | None = None  # why a heal failed, or what was odd about it

    @property
    def healed(self) -> bool:
        return self.healed_ns is not None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> FaultRecord:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in row.items() if k in known})


def check_deadline(deadline_s: float) -> None:
    if (isinstance(deadline_s, bool) or not isinstance(deadline_s, int | float)
            or not 0 < deadline_s <= MAX_DEADLINE_S):  # NaN fails the comparison too
        raise BadFault("Invalid deadline_s",
                       f"deadline_s must be a number of seconds, > 0 and <= {MAX_DEADLINE_S:g}, "
                       f"not {deadline_s!r}: every fault heals itself by its deadline.")


def check_proxy_fault(kind: str, deadline_s: float, ms: int | None) -> None:
    if kind not in PROXY_FAULT_KINDS:
        raise BadFault("Unknown fault kind",
                       f"kind must be one of {', '.join(PROXY_FAULT_KINDS)}, not {kind!r}.")
    check_deadline(deadline_s)
    if kind == "latency":
        if isinstance(ms, bool) or not isinstance(ms, int) or not 0 < ms <= MAX_LATENCY_MS:
            raise BadFault("Invalid ms", f"latency needs ms, an integer > 0 and <= "
                           f"{MAX_LATENCY_MS}, not {ms!r}.")
    elif ms is not None:
        raise BadFault("Unexpected ms", f"only latency takes ms; leave it out for {kind}.")


@dataclass(frozen=True)
class HealReport:
    """Whether every fault of a game day healed; `unhealed` names those that did not."""

    healed: bool
    faults: tuple[FaultRecord, ...]
    unhealed: tuple[FaultRecord, ...]

    @property
    def message(self) -> str:
        if self.healed:
            return f"Every fault healed ({len(self.faults)} faults)."
        lines = [f"{r.id} ({r.kind} on {r.target}, deadline {r.deadline_s:g} s)"
                 + (f": {r.note}" if r.note else "") for r in self.unhealed]
        return (f"{len(self.unhealed)} of {len(self.faults)} faults not healed: "
                + "; ".join(lines))

    def to_json(self) -> dict[str, Any]:
        return {"healed": self.healed, "message": self.message,
                "unhealed": [r.id for r in self.unhealed],
                "faults": [r.to_json() for r in self.faults]}
