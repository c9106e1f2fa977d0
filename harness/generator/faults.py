"""The faults a schedule draws from: a registry of named fault actions, each an async
callable taking the game day and the step's parameters and returning the nemesis's record
of the fault it started.

Every entry reaches the system under test only through the game day's nemesis, so each fault
carries the nemesis's deadline and heals itself when the harness is gone. A new kind of fault
(a database restart, a control-plane crash) joins the generator by adding an entry here; the
schedule and the player know faults by name only.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import docker.errors

if TYPE_CHECKING:
    from harness.gameday import GameDay

CONTROL_CHANNEL = "control-channel"
LIVE = ("starting", "running")


class FaultSkipped(Exception):
    """The fault has nothing to act on at this moment (no running sandbox, say): the step is
    recorded as failed with this reason, and the schedule goes on."""


FaultApply = Callable[["GameDay", dict[str, Any]], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class FaultAction:
    apply: FaultApply
    # The parameters of one draw, from the schedule's random source and its duration.
    draw: Callable[[random.Random, float], dict[str, Any]]
    needs_agent: bool
    # Whether the fault can be had on a game day's stack (None: yes; else why not).
    usable: Callable[[GameDay], str | None]


def _deadline(rng: random.Random, duration_s: float) -> dict[str, Any]:
    return {"deadline_s": round(rng.uniform(1.0, max(1.5, min(5.0, duration_s / 3))), 2)}


def _latency(rng: random.Random, duration_s: float) -> dict[str, Any]:
    return {**_deadline(rng, duration_s), "ms": rng.choice((100, 300, 800))}


def _has_channel(day: GameDay) -> str | None:
    if CONTROL_CHANNEL in day.endpoints.nemesis.proxies:
        return None
    return f"the {day.stack} stack has no fault proxy on the control channel"


def _sandboxes_here(day: GameDay) -> str | None:
    if day.stack in ("processes", "containers"):
        return None
    return f"the {day.stack} stack's sandboxes are out of the nemesis's reach"


def _processes_only(day: GameDay) -> str | None:
    # On the containers stack the control plane removes a killed agent's paused container,
    # and the nemesis then cannot unpause it at the deadline: it would report the fault as
    # never healed, a false failure of every_fault_healed.
    return None if day.stack == "processes" else (
        f"pausing a sandbox is drawn on the processes stack only, not on {day.stack}")


async def _running_sandbox(day: GameDay, params: dict[str, Any]) -> dict[str, Any]:
    agent_id = str(params["agent_id"])
    for box in await day.sandboxes(agent_id):
        if box["state"] in LIVE and box.get("handle"):
            return box
    raise FaultSkipped(f"agent {agent_id} has no running sandbox")


async def cut_control_channel(day: GameDay, params: dict[str, Any]) -> dict[str, Any]:
    """Blackhole the daemons' control channel: their leases cannot be renewed."""
    record = await day.endpoints.nemesis[CONTROL_CHANNEL].blackhole(params["deadline_s"])
    return record.to_json()


async def slow_control_channel(day: GameDay, params: dict[str, Any]) -> dict[str, Any]:
    record = await day.endpoints.nemesis[CONTROL_CHANNEL].latency(params["ms"],
                                                                   params["deadline_s"])
    return record.to_json()


async def reset_control_channel(day: GameDay, params: dict[str, Any]) -> dict[str, Any]:
    record = await day.endpoints.nemesis[CONTROL_CHANNEL].reset(params["deadline_s"])
    return record.to_json()


async def pause_sandbox(day: GameDay, params: dict[str, Any]) -> dict[str, Any]:
    """SIGSTOP a running sandbox's daemon until the deadline: it neither acts nor renews."""
    box = await _running_sandbox(day, params)
    if box["backend"] != "process":
        raise FaultSkipped(f"sandbox {box['id']} is not a process")
    record = await day.endpoints.nemesis.pause_process(int(box["handle"]),
                                                       params["deadline_s"])
    return {**record.to_json(), "sandbox_id": box["id"]}


async def kill_sandbox(day: GameDay, params: dict[str, Any]) -> dict[str, Any]:
    """SIGKILL a running sandbox (its daemon process, or its container)."""
    box = await _running_sandbox(day, params)
    nemesis = day.endpoints.nemesis
    try:
        record = (await nemesis.kill_process(int(box["handle"])) if box["backend"] == "process"
                  else await nemesis.kill_container(str(box["handle"])))
    except (OSError, docker.errors.APIError) as gone:  # it ended between the read and now
        raise FaultSkipped(f"sandbox {box['id']} ended before the kill: {gone}") from gone
    return {**record.to_json(), "sandbox_id": box["id"]}


def _agent(_: random.Random, __: float) -> dict[str, Any]:
    return {}


FAULTS: dict[str, FaultAction] = {
    "cut_control_channel": FaultAction(cut_control_channel, _deadline, False, _has_channel),
    "slow_control_channel": FaultAction(slow_control_channel, _latency, False, _has_channel),
    "reset_control_channel": FaultAction(reset_control_channel, _deadline, False,
                                         _has_channel),
    "pause_sandbox": FaultAction(pause_sandbox, _deadline, True, _processes_only),
    "kill_sandbox": FaultAction(kill_sandbox, _agent, True, _sandboxes_here),
}


def usable_faults(day: GameDay) -> dict[str, FaultAction]:
    """The registry's faults this game day's stack offers."""
    return {name: f for name, f in FAULTS.items() if f.usable(day) is None}
