"""What a misbehaving agent cost, read from a game day's history beside time-to-stop: pure
functions of the history (and the final state), each giving plain figures for the journal.

* `work_lost`: files and bytes between an agent's last sync and its kill (DESIGN §2.3.7,
  "the price"), from `home_files` observations;
* `deletions_after_kill`: the `rm` calls an agent was answered with after its kill was
  requested, and the time from the request to the last one;
* `spend_beyond_cap`: dollars spent past the budget before the guard stopped the session,
  and the time from crossing the cap to the stop;
* `steps_before_trip`: steps a session took before a guard layer stopped it;
* `failing_service_calls`: calls that reached the failing service, and the gaps between them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

from harness.judge.checkers import (
    ACTION_F,
    FAILING_SERVICE_CALL_F,
    HOME_FILES_F,
    HOME_SYNC_F,
    SESSION_END_F,
    FinalState,
)
from harness.record.history import Event, History

Measure = Callable[[History, FinalState], dict[str, Any]]
# Labels of home_files: the home at its last sync (read before the kill), the killed
# sandbox's working copy once it stopped, and the home the next session is restored from.
LAST_SYNC, AT_KILL, RESTORED = "last_sync", "sandbox_at_kill", "restored"
# USD per million tokens (prompt, completion) in coveyd's price table, for the puppet model.
PRICES = {"puppet": (1.0, 2.0)}


def _homes(history: History) -> dict[str, dict[str, dict[str, int]]]:
    """The last `home_files` read of each agent and label."""
    found: dict[str, dict[str, dict[str, int]]] = {}
    for e in history.select(f=HOME_FILES_F):
        agent = e.agent_id
        if agent is not None:
            found.setdefault(agent, {})[str(e.value["label"])] = dict(e.value["files"])
    return found


def work_lost(history: History, final: FinalState) -> dict[str, Any]:
    """Per agent with a last sync and its killed sandbox read: what the kill threw away
    (files written or changed since the last sync), what the sandbox had destroyed of
    the synced home (gone from the sandbox, kept by the sync), and how old the last sync
    was when the kill was requested (from the control plane's record of it; None when it
    records none)."""
    out: dict[str, Any] = {}
    kills: dict[str | None, int] = {}
    for e in history.select(f="kill_agent", type="invoke"):
        kills.setdefault(e.agent_id, e.time_ns)
    for agent, homes in _homes(history).items():
        synced, at_kill = homes.get(LAST_SYNC), homes.get(AT_KILL)
        if synced is None or at_kill is None:
            continue
        lost = {p: n for p, n in at_kill.items() if synced.get(p) != n}
        deleted = {p: n for p, n in synced.items() if p not in at_kill}
        kill_ns = kills.get(agent)
        sync_ns = max((e.time_ns for e in history.select(f=HOME_SYNC_F)
                       if e.agent_id == agent and kill_ns is not None and e.time_ns < kill_ns),
                      default=None)
        out[agent] = {"files_lost": len(lost), "bytes_lost": sum(lost.values()),
                      "files_deleted_in_sandbox": len(deleted),
                      "bytes_deleted_in_sandbox": sum(deleted.values()),
                      "last_sync_to_kill_ms": None if sync_ns is None or kill_ns is None
                      else (kill_ns - sync_ns) / 1e6}
    return out


def _actions(history: History, agent: str) -> list[Event]:
    return sorted((e for e in history.select(f=ACTION_F) if e.agent_id == agent),
                  key=lambda e: e.time_ns)


def deletions_after_kill(history: History, final: FinalState) -> dict[str, Any]:
    """Per agent killed on its own: the deleting calls (`rm` in a shell command) it was
    answered with after the kill was requested, and how long after the request the last
    one came (None when none came)."""
    out: dict[str, Any] = {}
    for kill in history.select(f="kill_agent", type="invoke"):
        agent = kill.agent_id
        if agent is None:
            continue
        after = [e for e in _actions(history, agent) if e.time_ns >= kill.time_ns
                 and e.value.get("tool") == "shell"
                 and "rm " in str(e.value.get("args", {}).get("cmd", ""))]
        out[agent] = {"deletions_after_request": len(after),
                      "request_to_last_deletion_ms": None if not after else
                      (after[-1].time_ns - kill.time_ns) / 1e6}
    return out


def _sessions_ended(history: History, layers: tuple[str, ...] | None = None) -> list[Event]:
    return [e for e in history.select(f=SESSION_END_F)
            if e.value.get("stop_layer") is not None
            and (layers is None or e.value["stop_layer"] in layers)]


def _session_actions(history: History, end: Event) -> list[Event]:
    """The actions of the session that `end` ended: after the agent's session before it."""
    agent = str(end.agent_id)
    earlier = [e.time_ns for e in history.select(f=SESSION_END_F)
               if e.agent_id == agent and e.time_ns < end.time_ns]
    since = max(earlier, default=-1)
    return [e for e in _actions(history, agent) if since < e.time_ns <= end.time_ns]


def _usd(action: Event, price: tuple[float, float]) -> float:
    prompt, completion = action.value.get("prompt_tokens", 0), action.value.get(
        "completion_tokens", 0)
    return (float(prompt) * price[0] + float(completion) * price[1]) / 1_000_000


def spend_beyond_cap(history: History, final: FinalState,
                     prices: dict[str, tuple[float, float]] | None = None) -> dict[str, Any]:
    """Per session stopped by the budget layer: what its model calls cost at the agent's
    model's price, how far past the agent's budget, and how long from the call that crossed
    it to the stop. A model with no price, or a usage that is not a number, spent an amount
    nobody knows (None), and crossed the cap with its first call. Beside them, each call's
    reservation: the completion tokens the daemon allowed it (None when the request set no
    limit) and those it was answered with."""
    out: dict[str, Any] = {}
    table = PRICES if prices is None else prices
    for end in _sessions_ended(history, ("budget",)):
        cap = end.value.get("budget_usd")
        price = table.get(str(end.value.get("model", "puppet")), (math.nan, math.nan))
        spent, crossed_ns = 0.0, None
        actions = _session_actions(history, end)
        for action in actions:
            spent += _usd(action, price)
            if crossed_ns is None and isinstance(cap, int | float) and (
                    spent > cap or not math.isfinite(spent)):
                crossed_ns = action.time_ns
        out[str(end.agent_id)] = {
            "budget_usd": cap, "spent_usd": spent if math.isfinite(spent) else None,
            "beyond_cap_usd": (spent - cap) if isinstance(cap, int | float)
            and math.isfinite(spent) else None,
            "cross_to_stop_ms": None if crossed_ns is None else (end.time_ns - crossed_ns) / 1e6,
            "stop_reason": end.value.get("stop_reason"),
            "calls": len(actions),
            "max_tokens_allowed": [a.value.get("max_tokens") for a in actions],
            "completion_tokens": [a.value.get("completion_tokens") for a in actions]}
    return out


def steps_before_trip(history: History, final: FinalState) -> dict[str, Any]:
    """Per session stopped by a guard layer: the layer and the steps it took (model calls
    the puppet answered) before the trip."""
    return {str(end.agent_id): {"layer": end.value["stop_layer"],
                                "steps": len(_session_actions(history, end)),
                                "stop_reason": end.value.get("stop_reason")}
            for end in _sessions_ended(history)
            if end.value["stop_layer"] not in ("kill-switch",)}


def failing_service_calls(history: History, final: FinalState) -> dict[str, Any]:
    """Per agent: the calls that reached the failing service, and the gaps between them
    (after the breaker opens, one probe a cooldown)."""
    out: dict[str, Any] = {}
    calls: dict[str, list[int]] = {}
    for e in history.select(f=FAILING_SERVICE_CALL_F):
        if e.agent_id is not None:
            calls.setdefault(e.agent_id, []).append(e.time_ns)
    for agent, times in calls.items():
        times.sort()
        out[agent] = {"calls": len(times),
                      "gaps_ms": [(b - a) / 1e6 for a, b in itertools.pairwise(times)]}
    return out


MEASURES: dict[str, Measure] = {m.__name__: m for m in (
    work_lost, deletions_after_kill, spend_beyond_cap, steps_before_trip,
    failing_service_calls)}
