"""What a failing game day says first: the rules it broke and the rules it could not decide,
each with the checker's sentence and the events that prove it.

An on-call engineer reads the top of pytest's failure output. Whatever line of the scenario
raised, the verdicts lead (the plugin puts them there); an inline assert comes after them.

A scenario names the checkers it must be able to decide (`@pytest.mark.decides(...)`): an
`unknown` from one of those is a failed game day, since a rule nobody could judge was not
shown to hold.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable

from harness.judge.bounds import BOUND_PREFIX
from harness.judge.checkers import Verdict
from harness.judge.switch_checkers import CATALOGUE
from harness.record.history import Event, History

KNOWN_CHECKERS = frozenset(c.__name__ for c in CATALOGUE)
# How a verdict begins whose evidence the system's dialect does not expose (GameDay
# .unjudgeable): never a consequence of a broken rule, and never required.
NOT_JUDGEABLE = "Not judgeable against"

EVENTS_SHOWN = 8
VALUE_CHARS = 200
# Which broken rule leads when several broke: the switch's own promises first (the daemon
# obeyed, nothing of the agent left, no action after the stop, no wake while it stood), the
# bounded figures, then what follows from them (work requeued, done once after resume). A
# reader fixes the first line first; the later ones are often its consequences.
RULE_ORDER = ("kill_obeyed", "kill_confirmed_within_lease", "nothing_left_of_killed_agent",
              "no_sandbox_alive_after_stop", "no_session_outlives_kill", "no_action_after_kill_ack",
              "late_result_refused", BOUND_PREFIX,
              "no_wake_of_stopped_agent", "wake_paths_refused_while_stopped",
              "fleet_resume_keeps_own_kills", "stopped_tool_not_run", "no_blind_restart_after_trip",
              "in_progress_requeued", "home_is_last_sync", "no_task_lost", "none_done_twice",
              "each_task_done_once_after_resume", "every_fault_healed")


def _rank(v: Verdict) -> int:
    for i, name in enumerate(RULE_ORDER):
        if v.checker == name or (name == BOUND_PREFIX and v.checker.startswith(name)):
            return i
    return len(RULE_ORDER)


def failed(verdicts: Iterable[Verdict]) -> list[Verdict]:
    """The failed verdicts, the switch's own promises first (RULE_ORDER)."""
    return sorted((v for v in verdicts if v.valid is False), key=_rank)


def undecided(verdicts: Iterable[Verdict], required: Collection[str]) -> list[Verdict]:
    """The required checkers that could not decide."""
    return [v for v in verdicts if v.valid == "unknown" and v.checker in required]


def missing(verdicts: Iterable[Verdict], required: Collection[str]) -> list[str]:
    """Required checkers that gave no verdict at all (not run, or misspelt)."""
    given = {v.checker for v in verdicts}
    return sorted(set(required) - given)


def broken_rules(verdicts: list[Verdict], required: Collection[str]) -> list[str]:
    """One sentence per failed or undecided-but-required verdict; empty when the game day
    holds. The sentences name the checker, so a reader can find its rule."""
    lines = [f"{v.checker}: {v.message} (events {_indexes(v)})" for v in failed(verdicts)]
    lines += [f"{v.checker} could not decide, and this game day must: {v.message} "
              f"(events {_indexes(v)})" for v in undecided(verdicts, required)]
    lines += [f"{name} gave no verdict, and this game day must decide it (checkers: "
              f"{', '.join(sorted(KNOWN_CHECKERS))})" for name in missing(verdicts, required)]
    return lines


def render(verdicts: list[Verdict], required: Collection[str], history: History,
           seen_broken: str | None = None) -> str | None:
    """The verdicts' part of a failure report: the rule the scenario saw broken as it went
    on (`seen_broken`: a refused role let through, an exit code), the failed verdicts, then
    the undecided ones (required first), each with its events. After a failure, an
    undecided verdict is marked as what it most likely is: a consequence (the game day
    broke off before it could show that rule). None when there is nothing to say."""
    broken = failed(verdicts)
    unknown = sorted((v for v in verdicts if v.valid == "unknown"),
                     key=lambda v: v.checker not in required)
    absent = missing(verdicts, required)
    if not (seen_broken or broken or unknown or absent):
        return None
    origin = history[0].time_ns if len(history) else 0
    out = ["Game-day verdicts: the rules this run broke or could not decide"]
    if seen_broken:
        out += [f"BROKEN RULE, seen as the game day went on: {seen_broken}",
                "    (the scenario stopped there; what it had not yet done follows from it)"]
    for v in broken:
        out += [f"FAILED {v.checker}: {v.message}", *_events(v, history, origin)]
    after = " (likely a consequence of the broken rule above)" \
        if seen_broken or broken else ""
    for v in unknown:
        if v.message.startswith(NOT_JUDGEABLE):
            out.append(f"not judgeable {v.checker}: {v.message}")
            continue
        label = "UNDECIDED, required" if v.checker in required else "undecided"
        out += [f"{label} {v.checker}{after}: {v.message}", *_events(v, history, origin)]
    for name in absent:
        out.append(f"MISSING {name}: this game day must decide it, but no such checker ran")
    return "\n".join(out)


def _indexes(v: Verdict) -> str:
    return ", ".join(map(str, v.evidence)) if v.evidence else "none"


def _events(v: Verdict, history: History, origin_ns: int) -> list[str]:
    shown = [i for i in v.evidence if 0 <= i < len(history)][:EVENTS_SHOWN]
    lines = [f"    {describe(history[i], origin_ns)}" for i in shown]
    if len(v.evidence) > len(shown):
        lines.append(f"    … and {len(v.evidence) - len(shown)} more events in the history file")
    if not v.evidence:
        lines.append("    (no events: the history holds nothing this checker could use)")
    return lines


def describe(event: Event, origin_ns: int) -> str:
    """One event on one line: index, type, who, what, when (from the history's start)."""
    value = json.dumps(event.value, sort_keys=True, default=str)
    if len(value) > VALUE_CHARS:
        value = value[:VALUE_CHARS - 1] + "…"
    return (f"event {event.index} {event.type} {event.process} {event.f} "
            f"at +{(event.time_ns - origin_ns) / 1e9:.3f} s {value}")
