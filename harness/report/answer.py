"""What a game day's page and the terminal summary say first, read from its journal alone
(so that what they say and what the journal holds cannot disagree): the headline, the
figures the scenario exists for beside their bounds, what broke, what was not judged and
why, and the command that replays it.

At 3 a.m. the reader asks "did the stop hold, how long did it take, what broke, how do I
rerun it", in that order. A page once answered the first after a scroll, put two "could not
decide" of checkers the scenario did not need above its real failure, and printed a replay
line with no file in it.
"""

from __future__ import annotations

import shlex
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.judge.bounds import BOUND_PREFIX
from harness.judge.checkers import Verdict
from harness.judge.time_to_stop import TOTAL
from harness.judge.verdicts import NOT_JUDGEABLE, failed

# What each figure is called where people read it.
FIGURE_LABELS = {
    "actions_after_request": "actions after the kill request (worst agent)",
    "deletions_after_request": "rm calls after the kill request (worst agent)",
    "request_to_last_action_ms": "last action after the kill request",
    "files_lost_beyond_last_sync": "files of the last sync lost",
    "spend_beyond_cap_usd": "spend past the budget cap (worst session)",
    "slowest_stop_ms": "slowest stop, in every respect",
}
RESUMED_ONCE = "each_task_done_once_after_resume"


@dataclass(frozen=True)
class BoundedFigure:
    name: str
    label: str
    value: str
    bound: str
    within: bool | str  # True, False or "unknown"
    detail: str


@dataclass(frozen=True)
class Judged:
    """A verdict as the page shows it: why it is listed where it is."""

    checker: str
    valid: bool | str
    message: str
    evidence: tuple[int, ...]
    why: str  # "failed", "could not decide, and this game day must", ...


@dataclass(frozen=True)
class Answer:
    status: str
    headline: list[str]
    figures: list[BoundedFigure]
    broke: list[Judged]
    not_judged: list[Judged]
    replay: str


def answer(journal: dict[str, Any], journal_path: Path | None = None) -> Answer:
    verdicts = [Verdict(v["checker"], v["valid"], v["message"], tuple(v["evidence"]))
                for v in journal["verdicts"]]
    required = required_of(journal)
    broke = [Judged(v.checker, v.valid, v.message, v.evidence, "failed")
             for v in failed(verdicts)]
    broke += [Judged(v.checker, v.valid, v.message, v.evidence,
                     "could not decide, and this game day must")
              for v in verdicts if v.valid == "unknown" and v.checker in required]
    given = {v.checker for v in verdicts}
    broke += [Judged(name, "unknown", "no such checker ran", (),
                     "gave no verdict, and this game day must decide it")
              for name in sorted(required - given)]
    seen = journal.get("seen_broken")
    if seen:
        broke.insert(0, Judged("seen as the game day went on", False, str(seen), (),
                               "the scenario stopped on it"))
    not_judged = [Judged(v.checker, v.valid, v.message, v.evidence, "not required here")
                  for v in verdicts if v.valid == "unknown" and v.checker not in required]
    return Answer(status=journal["status"], headline=headline(journal, verdicts),
                  figures=bounded(journal), broke=broke, not_judged=not_judged,
                  replay=replay_command(journal, journal_path))


def required_of(journal: dict[str, Any]) -> frozenset[str]:
    """The checkers the game day had to decide. A journal from before they were written
    down: its bounded figures (a bound is always required)."""
    if "required" in journal:
        return frozenset(journal["required"])
    return frozenset(v["checker"] for v in journal["verdicts"]
                     if v["checker"].startswith(BOUND_PREFIX))


def stopped_agents(journal: dict[str, Any]) -> tuple[set[str], set[str], set[str]]:
    """(covered, stopped, idle): the agents a kill covered, those whose daemon exit or
    sandbox's end was seen after it, and those of the rest that did nothing after it (an
    agent with no session has nothing to stop)."""
    samples = journal["measurements"]["time_to_stop"]["samples_ns"]
    covered = {s["agent_id"] for s in samples}
    stopped = {s["agent_id"] for s in samples
               if s["daemon_exit_ns"] is not None or s["sandbox_gone_ns"] is not None}
    acted = {s["agent_id"] for s in samples if s["last_action_ns"] is not None}
    return covered, stopped, covered - stopped - acted


def headline(journal: dict[str, Any], verdicts: list[Verdict]) -> list[str]:
    """The answer in a line of short phrases, each a count or a time of the journal's."""
    samples = journal["measurements"]["time_to_stop"]["samples_ns"]
    summary = journal["measurements"]["time_to_stop"]["summary_us"]
    figures = journal["measurements"].get("bounded", {})
    out: list[str] = []
    if not samples:
        out.append("no kill was pulled")
    else:
        covered, stopped, idle = stopped_agents(journal)
        phrase = f"{len(stopped)} of {_agents(len(covered))} stopped"
        codes = Counter(s["daemon_exit_code"] for s in samples
                        if s["daemon_exit_code"] is not None)
        if codes and set(codes) != {3}:
            phrase += " (" + ", ".join(f"{n} daemon(s) exited {code}"
                                       for code, n in sorted(codes.items())) + ")"
        if idle:
            phrase += f", {len(idle)} with nothing running"
        out.append(phrase)
    if TOTAL in summary:
        slowest = f"slowest {ms_text(summary[TOTAL]['max_us'] / 1000)}"
        bound = figures.get("slowest_stop_ms")
        out.append(slowest + (f" (bound {ms_text(bound['bound'])})" if bound else ""))
    acted = next((figures[n] for n in ("actions_after_request", "deletions_after_request")
                  if n in figures), None)
    if acted is not None and acted["value"] is not None:
        out.append(f"{acted['value']:g} {acted['unit']} after the request "
                   f"(bound {acted['bound']:g})")
    elif samples and any(v.checker == "no_action_after_kill_ack"
                         and v.message.startswith(NOT_JUDGEABLE) for v in verdicts):
        # Upstream's mock engine asks no model: no ledger, so no count of actions either.
        out.append("actions after the request not seen (no model requests to count)")
    elif samples:
        late = {s["agent_id"] for s in samples if s["last_action_ns"] is not None}
        out.append("0 actions after the request" if not late
                   else f"{_agents(len(late))} acted after the request")
    requeued = {s["agent_id"] for s in samples if s["tasks_requeued_ns"] is not None}
    if requeued:
        out.append(f"tasks of {_agents(len(requeued))} back in the backlog")
    resumed = next((v for v in verdicts if v.checker == RESUMED_ONCE), None)
    if resumed is not None and resumed.valid is True:
        out.append("all done once after resume")
    elif resumed is not None and resumed.valid is False:
        out.append("NOT all done once after resume")
    spend = figures.get("spend_beyond_cap_usd")
    if spend is not None and spend["value"] is not None:
        out.append(f"${spend['value']:.4f} past the budget cap (bound ${spend['bound']:.2f})")
    return out


def _agents(n: int) -> str:
    return f"{n} agent" if n == 1 else f"{n} agents"


def bounded(journal: dict[str, Any]) -> list[BoundedFigure]:
    rows = []
    for name, f in journal["measurements"].get("bounded", {}).items():
        rows.append(BoundedFigure(name, FIGURE_LABELS.get(name, name.replace("_", " ")),
                                  amount(f["value"], f["unit"]), amount(f["bound"], f["unit"]),
                                  f["within"], f["detail"]))
    return rows


def amount(value: float | None, unit: str) -> str:
    if value is None:
        return "not measured"
    if unit == "usd":
        return f"${value:.4f}"
    if unit == "ms":
        return ms_text(value)
    return f"{value:g} {unit}"


def ms_text(ms: float) -> str:
    """A time as people read it: 586 ms, 12.4 ms, 2 s, 2.35 s."""
    if abs(ms) >= 1000:
        return f"{ms / 1000:.3g} s"
    if abs(ms) >= 100:
        return f"{ms:.0f} ms"
    return f"{ms:.1f} ms"


def replay_command(journal: dict[str, Any], journal_path: Path | None = None) -> str:
    """The command that replays this game day: its scenario's file and test, the stack, the
    seed and the agents; a random game day's schedule from its journal (`--replay`)."""
    scenario = journal.get("scenario") or ""
    if not scenario or scenario.startswith("::"):
        # A journal from before the file was recorded: pytest finds the test by name.
        scenario = f"scenarios -k {journal['game_day']}"
    parts = ["pytest", *shlex.split(scenario), "--stack", journal["stack"]]
    if "schedule" in journal and journal_path is not None:
        parts[1] = scenario.split("::")[0]
        parts += ["--replay", str(journal_path)]
    else:
        parts += ["--seed", str(journal["seed"]), "--agents", str(len(journal["agents"]))]
    if journal.get("dialect", "covey-gameday") != "covey-gameday":
        parts += ["--dialect", journal["dialect"]]
    return shlex.join(parts)
