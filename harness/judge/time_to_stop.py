"""Time-to-stop, read from a game day's history: per agent and kill, split into its parts,
each measured from the kill's invoke (the instant the operator pulled the switch):

* `kill_acknowledged` — the kill's ok (None when its outcome is unknown);
* `last_action` — the agent's last action (puppet ledger) after the invoke, before any resume,
  at its daemon's send stamp (`checkers.sent_at`, the instant the no-action-after-kill rule
  judges too; the puppet's receipt, later under load, only for a request without a stamp)
  (None: it did nothing after the switch was pulled);
* `daemon_exit` — the first `daemon_exit` of the agent, with `value["exit_code"]`;
* `sandbox_gone` — the first `sandbox_gone` of the agent;
* `tasks_requeued` — when every task it had in progress was first read `open` again (None: it
  had none, or one was never read open; the checkers say which).

Raw samples are kept in nanoseconds; percentiles go through an HDR histogram in microseconds,
so that one slow agent among fifty shows in p99 instead of vanishing in a mean.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hdrh.histogram import HdrHistogram

from harness.judge.checkers import ACTION_F, FinalState, sent_at, task_reads, tasks_in_progress_at
from harness.judge.stops import Stop, stops
from harness.record.history import History, Operation

PARTS = ("kill_acknowledged", "last_action", "daemon_exit", "sandbox_gone", "tasks_requeued")
TOTAL = "total"

# 1 µs to a day, to three significant figures: a kill slower than a day is a finding to
# report by hand, not a sample to fold in.
LOWEST_US = 1
HIGHEST_US = 24 * 3600 * 1_000_000
SIGNIFICANT_FIGURES = 3


@dataclass(frozen=True)
class TimeToStop:
    """How long one kill took to stop one agent, part by part (ns after the kill's invoke)."""

    agent_id: str
    kill_f: str  # kill_agent | kill_fleet
    kill_index: int  # the kill's invoke event
    kill_acknowledged_ns: int | None
    last_action_ns: int | None
    daemon_exit_ns: int | None
    daemon_exit_code: int | None
    sandbox_gone_ns: int | None
    tasks_requeued_ns: int | None

    def parts(self) -> dict[str, int | None]:
        return {"kill_acknowledged": self.kill_acknowledged_ns,
                "last_action": self.last_action_ns,
                "daemon_exit": self.daemon_exit_ns,
                "sandbox_gone": self.sandbox_gone_ns,
                "tasks_requeued": self.tasks_requeued_ns}

    @property
    def total_ns(self) -> int | None:
        """When the last part was done: the agent was stopped in every respect measured."""
        measured = [ns for ns in self.parts().values() if ns is not None]
        return max(measured) if measured else None


@dataclass(frozen=True)
class Percentiles:
    """One part's distribution, in microseconds."""

    count: int
    p50_us: int
    p90_us: int
    p99_us: int
    max_us: int  # exact, from the raw samples (the histogram's own max is rounded up)


def time_to_stop(history: History, final: FinalState | None = None) -> list[TimeToStop]:
    """One sample per kill that did not fail and agent it covers. The agents are those of
    `final` and those the history names; a fleet kill covers those of its organisation."""
    final = final or FinalState()
    agent_ids = sorted({*final.agents, *(e.agent_id for e in history if e.agent_id)})
    # An action was made when its daemon sent it; the puppet's event loop, which stamps its
    # receipt, trails that by up to hundreds of ms under load and would stretch this part.
    actions = [(a.agent_id, sent_at(a.value.get("sent_ns"), a.start_ns))
               for a in history.operations(ACTION_F)]
    exits = history.operations("daemon_exit")
    gone = history.operations("sandbox_gone")
    reads = task_reads(history)
    samples = []
    for stop in stops(history):
        for agent_id in agent_ids:
            if not stop.covers(agent_id, final.org_of(agent_id)):
                continue
            invoked = stop.kill.start_ns
            last_action = max((made_ns for actor, made_ns in actions
                               if actor == agent_id and _within(stop, made_ns)),
                              default=None)
            exit_ = _first(exits, agent_id, stop)
            sandbox = _first(gone, agent_id, stop)
            ack = stop.acknowledged_ns
            code = None if exit_ is None else exit_.value.get("exit_code")
            samples.append(TimeToStop(
                agent_id=agent_id, kill_f=stop.kill.f, kill_index=stop.kill.first_index,
                kill_acknowledged_ns=None if ack is None else ack - invoked,
                last_action_ns=None if last_action is None else last_action - invoked,
                daemon_exit_ns=None if exit_ is None else exit_.start_ns - invoked,
                daemon_exit_code=code if isinstance(code, int) else None,
                sandbox_gone_ns=None if sandbox is None else sandbox.start_ns - invoked,
                tasks_requeued_ns=_requeued(stop, agent_id, reads, final),
            ))
    return samples


def summarize(samples: Iterable[TimeToStop]) -> dict[str, Percentiles]:
    """Percentiles of each part and of the total; a part with no sample is left out."""
    by_part: dict[str, list[int]] = {part: [] for part in (*PARTS, TOTAL)}
    for sample in samples:
        for part, ns in (*sample.parts().items(), (TOTAL, sample.total_ns)):
            if ns is not None:
                by_part[part].append(ns)
    return {part: percentiles(values) for part, values in by_part.items() if values}


def percentiles(samples_ns: Sequence[int]) -> Percentiles:
    """p50, p90, p99 through an HDR histogram, recorded in microseconds."""
    if not samples_ns:
        raise ValueError("no samples to take percentiles of")
    histogram = HdrHistogram(LOWEST_US, HIGHEST_US, SIGNIFICANT_FIGURES)
    for ns in samples_ns:
        us = _us(ns)
        if not histogram.record_value(us):
            raise ValueError(f"a time-to-stop of {us} µs is outside the histogram's range "
                             f"({LOWEST_US}..{HIGHEST_US} µs)")
    largest = max(_us(ns) for ns in samples_ns)
    # The histogram answers with its bucket's highest value, which may lie a hair above the
    # largest sample: a page once showed a p99 of 198.3 ms beside a max of 198.2 ms.
    return Percentiles(count=len(samples_ns),
                       p50_us=min(int(histogram.get_value_at_percentile(50)), largest),
                       p90_us=min(int(histogram.get_value_at_percentile(90)), largest),
                       p99_us=min(int(histogram.get_value_at_percentile(99)), largest),
                       max_us=largest)


def percentile_ms(values_ms: Sequence[float], q: float) -> float:
    """One percentile of samples in milliseconds, through the same HDR histogram (recorded in
    microseconds) as every other figure the harness and the benchmarks give; capped at the
    largest sample, which the histogram's buckets may lie a hair above."""
    if not values_ms:
        raise ValueError("no samples to take a percentile of")
    histogram = HdrHistogram(LOWEST_US, HIGHEST_US, SIGNIFICANT_FIGURES)
    for value in values_ms:
        us = max(LOWEST_US, round(value * 1000))
        if not histogram.record_value(us):
            raise ValueError(f"{value} ms is outside the histogram's range "
                             f"({LOWEST_US}..{HIGHEST_US} µs)")
    return min(float(histogram.get_value_at_percentile(q)) / 1000, max(values_ms))


def _us(ns: int) -> int:
    return (ns + 500) // 1000


def _within(stop: Stop, time_ns: int) -> bool:
    """From the kill's invoke until a resume could have released it."""
    return stop.kill.start_ns <= time_ns and (stop.lifted_ns is None or time_ns < stop.lifted_ns)


def _first(ops: list[Operation], agent_id: str, stop: Stop) -> Operation | None:
    return next((op for op in ops if op.type == "ok" and op.agent_id == agent_id
                 and _within(stop, op.start_ns)), None)


def _requeued(stop: Stop, agent_id: str, reads: list[Operation], final: FinalState
              ) -> int | None:
    held = [r for r, owner in tasks_in_progress_at(stop, reads, final) if owner == agent_id]
    if not held:
        return None
    seen_open = []
    for before in held:
        task_id = before.value["task_id"]
        open_again = next((r.end_ns for r in reads
                           if r.value["task_id"] == task_id and r.value.get("state") == "open"
                           and r.end_ns is not None and _within(stop, r.start_ns)), None)
        if open_again is None:
            return None
        seen_open.append(open_again)
    return max(seen_open) - stop.kill.start_ns
