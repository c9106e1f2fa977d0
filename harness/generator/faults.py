"""The faults a schedule draws from: a registry of named fault actions, each an async
callable taking the game day and the step's parameters and returning the nemesis's record
of the fault it started.

Every entry reaches the system under test only through the game day's nemesis, so each fault
carries the nemesis's deadline and heals itself at it (or when the harness is gone). A new
kind of fault joins the generator by adding an entry here; the schedule and the player know
faults by name only. Beside the control channel and the sandboxes: the database paused or
restarted, the control plane crashed (SIGKILL) and started again at the deadline, also in the
middle of a fleet kill, and a second replica cut off from the database; a daemon's SIGKILL is
`kill_sandbox`.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import docker.errors
import httpx

from harness.act.client import ApiFailure
from harness.stack.waiting import eventually

if TYPE_CHECKING:
    from harness.record.gameday import GameDay

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


def _has_database(day: GameDay) -> str | None:
    if day.endpoints.nemesis.database is not None:
        return None
    return f"the {day.stack} stack's database is not the harness's to fault"


def _has_plane(day: GameDay) -> str | None:
    if day.endpoints.control_plane is not None:
        return None
    return f"the {day.stack} stack's control plane is not the harness's to crash"


async def _running_sandbox(day: GameDay, params: dict[str, Any]) -> dict[str, Any]:
    agent_id = str(params["agent_id"])
    try:
        boxes = await day.sandboxes(agent_id)
    except (ApiFailure, httpx.TransportError) as away:  # a database or plane outage
        raise FaultSkipped(f"the sandboxes of agent {agent_id} could not be read: "
                           f"{away}"[:300]) from away
    for box in boxes:
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


def _database_standing(day: GameDay) -> None:
    out = day.endpoints.nemesis.database_out()
    if out is not None:  # one fault per target: a pause would replace the restart early
        raise FaultSkipped(f"the database is already out ({out.kind}, fault {out.id})")


async def pause_database(day: GameDay, params: dict[str, Any]) -> dict[str, Any]:
    """Freeze Postgres, sockets open: the control plane's queries hang until the deadline."""
    _database_standing(day)
    return (await day.endpoints.nemesis.pause_database(params["deadline_s"])).to_json()


async def restart_database(day: GameDay, params: dict[str, Any]) -> dict[str, Any]:
    """Postgres stopped at once (a crash, as its clients see it), started at the deadline."""
    _database_standing(day)
    return (await day.endpoints.nemesis.restart_database(params["deadline_s"])).to_json()


def _the_plane(day: GameDay) -> Any:
    plane = day.endpoints.control_plane
    if plane is None:
        raise FaultSkipped(_has_plane(day) or "no control plane")
    if day.endpoints.nemesis.control_plane_down() is not None:
        raise FaultSkipped("the control plane is already down")
    return plane


async def crash_control_plane(day: GameDay, params: dict[str, Any]) -> dict[str, Any]:
    """SIGKILL the control plane (its daemons live on, and stop by their lease); the stack
    starts it again at the deadline."""
    plane = _the_plane(day)
    return (await day.endpoints.nemesis.crash_control_plane(plane,
                                                            params["deadline_s"])).to_json()


FLAG_WAIT_S = 10.0


async def _fleet_flag_committed(day: GameDay, within_s: float) -> bool:
    """Whether the org's fleet flag is seen committed within `within_s` (an outage's 503 or a
    refused connection is just not yet)."""
    async def committed() -> bool:
        try:
            r = await day.people["auditor"].fleet()
        except httpx.TransportError:
            return False
        return r.status_code == 200 and bool(r.json().get("fleet_killed"))
    try:
        return await eventually(committed, within_s, "the fleet flag was not seen committed",
                                interval=0.02)
    except AssertionError:
        return False


async def crash_control_plane_mid_fleet_kill(day: GameDay, params: dict[str, Any]
                                             ) -> dict[str, Any]:
    """A fleet kill pulled by security, and the control plane SIGKILLed once the org's flag
    is committed (the kill's first step), while the agents' own kills are under way."""
    plane = _the_plane(day)
    pulling = asyncio.create_task(day.as_("security").kill_fleet())
    committed = await _fleet_flag_committed(day, FLAG_WAIT_S)
    record = await day.endpoints.nemesis.crash_control_plane(plane, params["deadline_s"])
    answered = (await asyncio.gather(pulling, return_exceptions=True))[0]
    answer = (answered.status_code if isinstance(answered, httpx.Response)
              else type(answered).__name__)
    return {**record.to_json(), "flag_committed_first": committed, "fleet_kill": answer}


def _has_replica(day: GameDay) -> str | None:
    if day.endpoints.replica is not None:
        return None
    return f"the {day.stack} stack cannot start a second replica"


async def partition_replica(day: GameDay, params: dict[str, Any]) -> dict[str, Any]:
    """Blackhole the second replica's link to Postgres until the deadline: its daemons
    cannot have their leases renewed, and the first replica serves on. (The game day's set-up
    starts the replica when its schedule holds this fault, so that it holds work by then.)"""
    assert day.endpoints.replica is not None
    replica = await day.endpoints.replica()
    link = day.endpoints.nemesis[replica.database_link]
    return (await link.blackhole(params["deadline_s"])).to_json()


def _agent(_: random.Random, __: float) -> dict[str, Any]:
    return {}


FAULTS: dict[str, FaultAction] = {
    "cut_control_channel": FaultAction(cut_control_channel, _deadline, False, _has_channel),
    "slow_control_channel": FaultAction(slow_control_channel, _latency, False, _has_channel),
    "reset_control_channel": FaultAction(reset_control_channel, _deadline, False,
                                         _has_channel),
    "pause_sandbox": FaultAction(pause_sandbox, _deadline, True, _processes_only),
    "kill_sandbox": FaultAction(kill_sandbox, _agent, True, _sandboxes_here),
    "pause_database": FaultAction(pause_database, _deadline, False, _has_database),
    "restart_database": FaultAction(restart_database, _deadline, False, _has_database),
    "crash_control_plane": FaultAction(crash_control_plane, _deadline, False, _has_plane),
    "crash_control_plane_mid_fleet_kill": FaultAction(crash_control_plane_mid_fleet_kill,
                                                      _deadline, False, _has_plane),
    "partition_replica": FaultAction(partition_replica, _deadline, False, _has_replica),
}


def usable_faults(day: GameDay) -> dict[str, FaultAction]:
    """The registry's faults this game day's stack offers."""
    return {name: f for name, f in FAULTS.items() if f.usable(day) is None}
