"""The figures a game day exists for, each judged against the bound its scenario states.

A figure nobody can fail on proves nothing: rm_rf once passed while its killed agent was
answered 4 `rm` calls after the kill request, and runaway_spend while every agent spent 20 %
past its cap. So a scenario names its figures with their bounds,

    @pytest.mark.bounds(actions_after_request=1, deletions_after_request=1)

and each becomes a verdict of its own (`within_bound:<figure>`), required like a `decides`
checker: past its bound the game day fails with the figure and the bound; with nothing to
measure it is `unknown`, which fails it too (a bound nobody could check was not kept). The
journal keeps every figure beside its bound (`measurements.bounded`).

Actions count from the operator's request, not from an acknowledgement: what an agent did
between the click and its stop is what the switch failed to prevent. An action counts at its
daemon's send stamp (harness.judge.checkers.sent_at).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from harness.judge.checkers import (
    ACTION_F,
    HOME_FILES_F,
    FinalState,
    Validity,
    Verdict,
    sent_at,
)
from harness.judge.costs import LAST_SYNC, RESTORED, spend_beyond_cap
from harness.judge.stops import Stop, stops
from harness.judge.time_to_stop import percentile_ms, time_to_stop
from harness.record.history import History, Operation

BOUND_PREFIX = "within_bound:"


@dataclass(frozen=True)
class Reading:
    """A figure as read from one history: its value (None: nothing to measure), what it
    counted, and the events that show it (for a value past its bound, the worst case)."""

    value: float | None
    detail: str
    evidence: tuple[int, ...] = ()


@dataclass(frozen=True)
class Figure:
    name: str
    unit: str
    bound: float
    reading: Reading

    @property
    def within(self) -> Validity:
        value = self.reading.value
        if value is None or math.isnan(value):
            return "unknown"
        return value <= self.bound

    def verdict(self) -> Verdict:
        value, within = self.reading.value, self.within
        if within == "unknown":
            message = (f"{self.name} could not be measured, so its bound of "
                       f"{_amount(self.bound, self.unit)} was not shown to hold: "
                       f"{self.reading.detail}")
        elif within:
            message = (f"{self.name}: {_amount(value, self.unit)}, within its bound of "
                       f"{_amount(self.bound, self.unit)} ({self.reading.detail}).")
        else:
            message = (f"{self.name}: {_amount(value, self.unit)}, past its bound of "
                       f"{_amount(self.bound, self.unit)}: {self.reading.detail}."
                       + (f" {RULES[self.name]}" if self.name in RULES else ""))
        return Verdict(BOUND_PREFIX + self.name, within, message, self.reading.evidence)

    def to_json(self) -> dict[str, Any]:
        return {"value": self.reading.value, "bound": self.bound, "unit": self.unit,
                "within": self.within, "detail": self.reading.detail}


def _amount(value: float | None, unit: str) -> str:
    if value is None:
        return "nothing"
    if unit == "usd":
        return f"${value:.4f}"
    if unit == "ms":
        return f"{value:.1f} ms"
    return f"{value:g} {unit}"


# ---------------------------------------------------------------------- the figures

def _after_requests(history: History, final: FinalState,
                    counts: Callable[[Operation], bool]) -> tuple[
                        list[tuple[str, Operation, list[tuple[Operation, int]]]], int, int]:
    """Per kill request and agent it covers: that agent's actions (those `counts` keeps) sent
    from the request until a resume could have released it. Also how many kills were
    requested, and how many of the covered agents had acted before their request (nothing
    sent after a request proves little when nothing was sent before it either)."""
    actions = [a for a in history.operations(ACTION_F) if a.agent_id is not None]
    per: list[tuple[str, Operation, list[tuple[Operation, int]]]] = []
    acting = 0
    all_stops = stops(history)
    for stop in all_stops:
        request_ns = stop.kill.start_ns
        agents = sorted({str(a.agent_id) for a in actions
                         if stop.covers(str(a.agent_id), final.org_of(str(a.agent_id)))})
        for agent in agents:
            mine = [(a, sent_at(a.value.get("sent_ns"), a.start_ns)) for a in actions
                    if a.agent_id == agent]
            acting += any(made < request_ns for _, made in mine)
            late = [(a, made) for a, made in mine if made >= request_ns and counts(a)
                    and (stop.lifted_ns is None or made < stop.lifted_ns)]
            per.append((agent, stop.kill, late))
    return per, len(all_stops), acting


def _count_after_request(history: History, final: FinalState,
                         counts: Callable[[Operation], bool], what: str) -> Reading:
    per, kills, acting = _after_requests(history, final, counts)
    if not kills:
        return Reading(None, "no kill was requested in this game day")
    if not acting:
        return Reading(None, f"none of the {kills} kill(s) covered an agent that was seen "
                             "acting before it (the puppet's ledger holds no action of theirs)")
    agent, kill, late = max(per, key=lambda p: len(p[2]))
    total = sum(len(p[2]) for p in per)
    if not late:
        return Reading(0, f"no {what} sent after any of {kills} kill request(s), "
                          f"{acting} agent(s) acting before theirs",
                       tuple(k.first_index for _, k, _ in per))
    last_ms = (max(made for _, made in late) - kill.start_ns) / 1e6
    return Reading(len(late), f"agent {agent} sent {len(late)} {what} after the {kill.f} "
                              f"requested at event {kill.first_index}, the last {last_ms:.1f} "
                              f"ms after the request ({total} in all over {len(per)} "
                              f"agent stop(s))",
                   (kill.first_index, *(a.first_index for a, _ in late)))


def actions_after_request(history: History, final: FinalState) -> Reading:
    """The most actions one agent sent after a kill covering it was requested."""
    return _count_after_request(history, final, lambda a: True, "actions")


def _deletes(action: Operation) -> bool:
    return action.value.get("tool") == "shell" and "rm " in str(
        action.value.get("args", {}).get("cmd", ""))


def deletions_after_request(history: History, final: FinalState) -> Reading:
    """The most deleting calls (`rm` in a shell command) one agent sent after a kill
    covering it was requested."""
    return _count_after_request(history, final, _deletes, "rm calls")


def request_to_last_action_ms(history: History, final: FinalState) -> Reading:
    """The longest time from a kill's request to the last action of an agent it covers."""
    per, kills, acting = _after_requests(history, final, lambda a: True)
    if not kills or not acting:
        return Reading(None, "no kill covered an agent seen acting before it")
    worst = max(per, key=lambda p: max((m for _, m in p[2]), default=p[1].start_ns)
                - p[1].start_ns)
    agent, kill, late = worst
    if not late:
        return Reading(0, "no agent acted after its kill was requested",
                       (kill.first_index,))
    last, made = max(late, key=lambda p: p[1])
    return Reading((made - kill.start_ns) / 1e6,
                   f"agent {agent}'s last action (event {last.first_index}) after the "
                   f"{kill.f} requested at event {kill.first_index}",
                   (kill.first_index, last.first_index))


def request_to_last_action_p50_ms(history: History, final: FinalState) -> Reading:
    """The median time from a kill's request to the last action of an agent it stopped,
    over the agents that acted after their request (benchmarks/rm_rf.py's "last action
    p50", which issue 20 states its targets in): the typical late agent, where
    request_to_last_action_ms is the slowest. 0 when no agent acted after its request (a
    `docker kill` or SIGKILL leaves none). An agent another stop already held when the
    request came (an agent kill before a fleet kill) was not stopped by it and is left
    out."""
    per, kills, acting = _after_requests(history, final, lambda a: True)
    if not kills or not acting:
        return Reading(None, "no kill covered an agent seen acting before it")
    all_stops = stops(history)
    stopped = [(agent, kill, late) for agent, kill, late in per
               if not _held_before(all_stops, agent, final.org_of(agent), kill)]
    if not stopped:
        return Reading(None, "every agent a kill covered was already held by an earlier one")
    late_ones = [(agent, kill, late, (max(m for _, m in late) - kill.start_ns) / 1e6)
                 for agent, kill, late in stopped if late]
    if not late_ones:
        return Reading(0, f"none of {len(stopped)} stopped agent(s) acted after its kill "
                          f"was requested", tuple(sorted({k.first_index for _, k, _ in stopped})))
    median = percentile_ms([t for *_, t in late_ones], 50)
    agent, kill, late, at = min(late_ones, key=lambda p: abs(p[3] - median))
    return Reading(median, f"{len(late_ones)} of {len(stopped)} stopped agents acted after "
                           f"the request, the slowest {max(t for *_, t in late_ones):.1f} ms "
                           f"after it; at the median, agent {agent}'s last action (event "
                           f"{max(late, key=lambda p: p[1])[0].first_index}) {at:.1f} ms "
                           f"after the {kill.f} "
                           f"requested at event {kill.first_index}",
                   (kill.first_index, *(a.first_index for a, _ in late)))


def _held_before(all_stops: list[Stop], agent: str, org: str | None, kill: Operation) -> bool:
    """Whether a stop other than `kill`'s held the agent when `kill` was requested."""
    return any(s.kill.first_index != kill.first_index and s.covers(agent, org)
               and s.holds_at(kill.start_ns) for s in all_stops)


def files_lost_beyond_last_sync(history: History, final: FinalState) -> Reading:
    """Files of a killed agent's last sync missing or changed in the home its next session
    is restored from (DESIGN §2.3.7: the kill may lose what came after the sync, never the
    sync itself)."""
    reads: dict[str, dict[str, tuple[int, dict[str, int]]]] = {}
    for e in history.select(f=HOME_FILES_F):
        if e.agent_id is not None:
            reads.setdefault(e.agent_id, {})[str(e.value["label"])] = (
                e.index, dict(e.value["files"]))
    judged = {a: r for a, r in reads.items() if LAST_SYNC in r and RESTORED in r}
    if not judged:
        return Reading(None, "no agent's home was read both at its last sync and as restored")
    worst: tuple[int, str, tuple[int, ...]] = (0, "", ())
    for agent, r in sorted(judged.items()):
        (si, synced), (ri, restored) = r[LAST_SYNC], r[RESTORED]
        lost = sum(1 for path, size in synced.items() if restored.get(path) != size)
        if lost >= worst[0]:
            worst = (lost, agent, (si, ri))
    lost, agent, evidence = worst
    return Reading(lost, f"agent {agent}'s restored home against its last sync "
                         f"({len(judged)} home(s) compared)", evidence)


def spend_beyond_cap_usd(history: History, final: FinalState) -> Reading:
    """The most dollars one session spent past its agent's budget before the budget layer
    stopped it."""
    sessions = spend_beyond_cap(history, final)
    if not sessions:
        return Reading(None, "no session was stopped by the budget layer")
    beyond = {agent: s["beyond_cap_usd"] for agent, s in sessions.items()}
    if any(v is None for v in beyond.values()):
        unknown = sorted(a for a, v in beyond.items() if v is None)
        return Reading(None, f"the spend of agent {unknown[0]} is not known (a model "
                             f"without a price)")
    agent = max(beyond, key=lambda a: float(beyond[a]))
    s = sessions[agent]
    return Reading(max(float(beyond[agent]), 0.0),
                   f"agent {agent} spent ${s['spent_usd']:.4f} against a cap of "
                   f"${s['budget_usd']:.4f} ({len(sessions)} session(s) stopped by the "
                   f"budget)")


def slowest_stop_ms(history: History, final: FinalState) -> Reading:
    """The longest time from a kill's request until its agent was stopped in every respect
    measured (time-to-stop's total): the time the page's headline leads with."""
    samples = [s for s in time_to_stop(history, final) if s.total_ns is not None]
    if not samples:
        return Reading(None, "no stop was measured (no kill covered an agent, or nothing of "
                             "its stop was seen)")
    worst = max(samples, key=lambda s: s.total_ns or 0)
    return Reading((worst.total_ns or 0) / 1e6,
                   f"agent {worst.agent_id} after the {worst.kill_f} requested at event "
                   f"{worst.kill_index} ({len(samples)} stop(s) measured)",
                   (worst.kill_index,))


# What a figure past its bound means, for whoever is on call: said after the figure and the
# events that show it.
RULES: dict[str, str] = {
    "actions_after_request": (
        "Rule broken: a kill stops its agent at once. Every action counted was sent after the "
        "operator's request, so the switch did not prevent it (issue 20: at most 1 per agent)."),
    "deletions_after_request": (
        "Rule broken: a kill stops its agent at once. Every `rm` counted was sent after the "
        "operator's request and deleted files the switch should have saved."),
    "request_to_last_action_ms": (
        "Rule broken: a kill stops its slowest agent within the stated time of the operator's "
        "request (issue 20: at least as fast as `docker kill`)."),
    "request_to_last_action_p50_ms": (
        "Rule broken: a kill stops the typical agent within the stated time of the "
        "operator's request (issue 20: at least as fast as `docker kill`)."),
}


FigureReader = Callable[[History, FinalState], Reading]
# name: (reader, unit)
FIGURES: dict[str, tuple[FigureReader, str]] = {
    "actions_after_request": (actions_after_request, "actions"),
    "deletions_after_request": (deletions_after_request, "rm calls"),
    "request_to_last_action_ms": (request_to_last_action_ms, "ms"),
    "request_to_last_action_p50_ms": (request_to_last_action_p50_ms, "ms"),
    "files_lost_beyond_last_sync": (files_lost_beyond_last_sync, "files"),
    "spend_beyond_cap_usd": (spend_beyond_cap_usd, "usd"),
    "slowest_stop_ms": (slowest_stop_ms, "ms"),
}
KNOWN_BOUNDS = frozenset(BOUND_PREFIX + name for name in FIGURES)


def bounded_figures(bounds: Mapping[str, float], history: History, final: FinalState
                    ) -> list[Figure]:
    """Each bounded figure read from the history. A figure whose reading raises is
    `unknown` with the error, the others stand."""
    found = []
    for name, bound in bounds.items():
        reader, unit = FIGURES[name]
        try:
            reading = reader(history, final)
        except Exception as exc:
            reading = Reading(None, f"reading it failed: {exc!r}")
        found.append(Figure(name, unit, float(bound), reading))
    return found
