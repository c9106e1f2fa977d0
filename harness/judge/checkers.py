"""Checkers: pure functions from a game day's history (and what the harness read at the end)
to a verdict that points at the events proving it. The run only records; these judge after.

What they read from the history (see harness.record.history and harness.judge.stops):
* `kill_agent`, `kill_fleet`, `resume_agent`, `resume_fleet`: operator operations;
* `action` by process `agent:<id>`: one entry of the puppet model's ledger, at its own time,
  with `value["sent_ns"]`, when the daemon sent the request (None: it did not say);
* `task_state` with `value = {"task_id", "state", "agent_id"}`: a task's state as read back;
  the harness reads every task right before a kill's invoke and again after its ok;
* `wake` / `session_start` with `value["agent_id"]`: an agent seen starting work (an ok whose
  value says `"outcome"` other than `"started"`, such as a refused wake request, is none);
* `fault_start` / `fault_heal` by the nemesis, with `value["fault_id"]`;
* `kill_delivery` with `value = {"agent_id", "session_id", "sent_ns", "confirmed_ns",
  "confirmed_by", "daemon_stop", "acked_ns"}`: a kill message the control plane sent to a
  running daemon, and how it was confirmed (`kill_ack`, `lease`, `hang_up`; None: not yet),
  at the control plane's times, read back from the session record; `acked_ns` is when the
  daemon itself says it acknowledged (its own clock; None when it did not say).

A verdict is `unknown` when the history holds nothing to judge or cannot tell (an outcome
nobody knows), never a pass by default.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal, NotRequired, TypedDict, TypeGuard

from harness.judge.stops import RESUME_SCOPES, Stop, holding, stops
from harness.record.history import Event, History, Operation

Validity = bool | Literal["unknown"]

WAKE_FS = ("wake", "session_start")
TASK_STATE_F = "task_state"
ACTION_F = "action"
KILL_DELIVERY_F = "kill_delivery"
# A session's end as the control plane recorded it: `{"agent_id", "session_id", "state",
# "stop_layer", "stop_reason", "budget_usd"}`, at its ended_at.
SESSION_END_F = "session_end"
# A call that reached the harness's failing service (by process `agent:<id>`).
FAILING_SERVICE_CALL_F = "failing_service_call"
# A daemon that obeys acknowledges a kill within tens of milliseconds (62-104 ms measured on
# the processes stack); one deaf to it is only "confirmed" when its 2 s lease runs out. The
# bound sits far below the lease, with room for a loaded machine.
KILL_ACK_BOUND_NS = 500_000_000


class FinalTask(TypedDict):
    """A task as read at the end of the game day."""

    state: str  # open | in_progress | blocked | done | failed | cancelled
    agent_id: str
    done_count: int  # how many times it was completed, counted from task_transitions
    result: NotRequired[str | None]  # what it ended with; a failed task's reason


class FinalAgent(TypedDict):
    """An agent as read at the end of the game day."""

    killed: bool
    kill_origin: str | None  # "agent", "fleet", a guard layer...; None when not killed
    org_id: NotRequired[str]  # only needed when a game day has more than one organisation
    live_tasks: NotRequired[list[str]]  # tasks of its sessions still starting or running


@dataclass(frozen=True)
class FinalState:
    """What the harness read from the system under test once the game day was over."""

    tasks: dict[str, FinalTask] = field(default_factory=dict)
    agents: dict[str, FinalAgent] = field(default_factory=dict)

    def org_of(self, agent_id: str) -> str | None:
        agent = self.agents.get(agent_id)
        return None if agent is None else agent.get("org_id")


@dataclass(frozen=True)
class Verdict:
    checker: str
    valid: Validity
    message: str  # a sentence a human can act on
    evidence: tuple[int, ...] = ()  # event indexes; for a failure, the offending events


Checker = Callable[[History, FinalState], Verdict]


def _is_ns(value: object) -> TypeGuard[int]:
    """A stamp in ns as the records carry it: an int (JSON's true and false are not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def sent_at(sent_ns: object, received_ns: int) -> int:
    """When a model request counts as made: when its daemon sent it (the send stamp coveyd
    puts on every request, on the wall clock the harness and the control plane share on one
    host); without a stamp, when the model saw it, which can only be later: a request of
    unknown send time is judged as late as it may have been (fail closed)."""
    if _is_ns(sent_ns):
        return sent_ns
    return received_ns


def daemon_acked_at(acked_ns: object, confirmed_ns: object) -> int | None:
    """When a daemon acknowledged a kill: its own stamp in its `kill_ack` (the clock its
    send stamps are on), else when the control plane read that `kill_ack` (later by the
    channel's delay); None without a `kill_ack`."""
    for ns in (acked_ns, confirmed_ns):
        if _is_ns(ns):
            return ns
    return None


def kill_acknowledged_at(switch_ack_ns: int, daemon_acks_ns: Iterable[int | None]) -> int:
    """When a kill counts as acknowledged for an agent: the earlier of the switch's answer to
    the operator and its daemon's own `kill_ack`. A request sent after either broke a
    promise: the operator was told the agent stopped, or the daemon said it had."""
    return min([switch_ack_ns, *(ns for ns in daemon_acks_ns if ns is not None)])


def no_action_after_kill_ack(history: History, final: FinalState) -> Verdict:
    """No agent action was sent after its kill was acknowledged, until a resume released it.

    An action counts at its daemon's send stamp (`sent_at`); a kill is acknowledged for an
    agent at the earlier of the kill's ok and that agent's daemon's `kill_ack` for it
    (`kill_acknowledged_at`, from the `kill_delivery` the session record gives)."""
    name = "no_action_after_kill_ack"
    all_stops = stops(history)
    acknowledged = [s for s in all_stops if s.acknowledged_ns is not None]
    if not acknowledged:
        return Verdict(name, "unknown", "No kill was acknowledged in this game day, so there is "
                       "no stop to judge the agents' actions against.")
    actions = [op for op in history.operations(ACTION_F) if op.agent_id is not None]
    if not any(s.covers(_agent(a), final.org_of(_agent(a)))
               for a in actions for s in acknowledged):
        # Silence after a kill shows nothing when no agent it stopped was ever seen acting:
        # the puppet's ledger was not copied, or the agents were idle.
        return Verdict(name, "unknown", f"No agent that a kill stopped was seen acting at all "
                       f"({_count(len(actions), 'action')} in the history against "
                       f"{_count(len(acknowledged), 'kill')}), so nothing shows the kill "
                       f"stopped anything.", tuple(s.kill.last_index for s in acknowledged))
    deliveries = [d for d in history.operations(KILL_DELIVERY_F)
                  if d.agent_id is not None and d.value.get("confirmed_by") == "kill_ack"
                  and isinstance(d.value.get("sent_ns"), int)]
    offences: dict[tuple[str, int], list[tuple[Operation, int]]] = defaultdict(list)
    stop_of: dict[int, tuple[Stop, int, Operation | None]] = {}
    unstamped = 0
    for action in actions:
        agent_id = _agent(action)
        made_ns = sent_at(action.value.get("sent_ns"), action.start_ns)
        unstamped += not _stamped(action)
        for stop in acknowledged:
            if not stop.covers(agent_id, final.org_of(agent_id)):
                continue
            ack_ns, delivery = _acknowledged_for(stop, agent_id, deliveries)
            if ack_ns < made_ns and (stop.lifted_ns is None or made_ns < stop.lifted_ns):
                offences[(agent_id, stop.kill.first_index)].append((action, made_ns))
                stop_of[stop.kill.first_index] = (stop, ack_ns, delivery)
                break
    unstamped_note = "" if not unstamped else (
        f"; {_count(unstamped, 'action')} carried no send stamp and counted from when the "
        "model saw them")
    if not offences:
        return Verdict(name, True, f"No agent action was sent after an acknowledged kill "
                       f"({_count(len(actions), 'action')} against "
                       f"{_count(len(acknowledged), 'kill')}{unstamped_note}).",
                       tuple(s.kill.last_index for s in acknowledged))
    evidence: set[int] = set()
    lines = []
    for (agent_id, kill_index), acted in sorted(offences.items()):
        stop, ack_ns, delivery = stop_of[kill_index]
        evidence.update([stop.kill.last_index, *(a.first_index for a, _ in acted)])
        by = "by the switch's answer"
        if delivery is not None:
            evidence.add(delivery.last_index)
            by = f"by its daemon (event {delivery.last_index})"
        stamped = [a for a, _ in acted if _stamped(a)]
        how = ("by its daemon's send stamps" if len(stamped) == len(acted) else
               "as the model saw them (no send stamp)" if not stamped else
               f"by its daemon's send stamps ({len(acted) - len(stamped)} without one, as the "
               "model saw them)")
        lines.append(f"agent {agent_id} acted {_count(len(acted), 'time')} after the {stop.kill.f} "
                     f"acknowledged at event {stop.kill.last_index} (the last "
                     f"{_ms(max(made for _, made in acted) - ack_ns)} after it was acknowledged "
                     f"{by}, {how})")
    return Verdict(name, False, _sentence("Actions sent after the kill was acknowledged",
                                          lines, "the kill did not stop these agents"),
                   tuple(sorted(evidence)))


def _stamped(action: Operation) -> bool:
    return _is_ns(action.value.get("sent_ns"))


def _acknowledged_for(stop: Stop, agent_id: str, deliveries: list[Operation]
                      ) -> tuple[int, Operation | None]:
    """When `stop` was acknowledged for `agent_id`, and the daemon's `kill_delivery` that
    made it earlier than the switch's answer (None: the answer was first, or no daemon of
    the agent acknowledged this kill)."""
    switch_ns = stop.acknowledged_ns or 0
    best: tuple[int, Operation | None] = (switch_ns, None)
    for d in deliveries:
        sent = int(d.value["sent_ns"])
        if d.agent_id != agent_id or sent < stop.kill.start_ns \
                or (stop.lifted_ns is not None and sent >= stop.lifted_ns):
            continue
        acked = daemon_acked_at(d.value.get("acked_ns"), d.value.get("confirmed_ns"))
        if acked is not None and kill_acknowledged_at(best[0], [acked]) < best[0]:
            best = (acked, d)
    return best


def in_progress_requeued(history: History, final: FinalState) -> Verdict:
    """Every task `in_progress` at a kill is `open` again once the kill is acknowledged."""
    name = "in_progress_requeued"
    all_stops = [s for s in stops(history) if s.acknowledged_ns is not None]
    if not all_stops:
        return Verdict(name, "unknown", "No kill was acknowledged in this game day, so no "
                       "task had to be requeued.")
    reads = task_reads(history)
    unread = [s for s in all_stops
              if not any(r.end_ns is not None and r.end_ns < s.kill.start_ns for r in reads)]
    if len(unread) == len(all_stops):
        return Verdict(name, "unknown", f"No task was read before any of the "
                       f"{_count(len(all_stops), 'kill')}, so nothing shows which tasks were "
                       f"in progress when it came.", tuple(s.kill.last_index for s in unread))
    failures: list[str] = []
    unclear: list[str] = []
    evidence: set[int] = set()
    failed_evidence: set[int] = set()
    judged = 0
    for stop in all_stops:
        if stop.lifted_ns is not None and stop.lifted_ns <= (stop.acknowledged_ns or 0):
            continue  # a resume raced the kill: nothing stood long enough to judge
        for before, _ in tasks_in_progress_at(stop, reads, final):
            judged += 1
            task_id = str(before.value["task_id"])
            after = next((r for r in reads if r.value["task_id"] == task_id
                          and r.end_ns is not None and stop.holds_at(r.start_ns)), None)
            evidence.update([before.last_index, stop.kill.last_index])
            if after is None:
                unclear.append(f"task {task_id} was not read after the {stop.kill.f} at event "
                               f"{stop.kill.last_index}")
                continue
            evidence.add(after.last_index)
            state = after.value.get("state")
            if state == "open":
                continue
            if state == "done":
                # It may have been finished just before the kill took effect; this history
                # cannot order the two.
                unclear.append(f"task {task_id} was done at event {after.last_index}, "
                               f"possibly finished before the kill took effect")
                continue
            failed_evidence.update([before.last_index, stop.kill.last_index, after.last_index])
            failures.append(f"task {task_id} was {state} at event {after.last_index} after the "
                            f"{stop.kill.f} acknowledged at event {stop.kill.last_index}")
    if failures:
        return Verdict(name, False, _sentence("In-progress tasks were not requeued by the kill",
                                              failures, "their work is stuck until someone "
                                              "requeues it"), tuple(sorted(failed_evidence)))
    if unclear:
        return Verdict(name, "unknown", _sentence("Cannot tell whether every in-progress task "
                                                  "was requeued", unclear,
                                                  "read each task right after the kill's ok"),
                       tuple(sorted(evidence)))
    return Verdict(name, True, f"Every task in progress at a kill was open again after it "
                   f"({_count(judged, 'task')}, {_count(len(all_stops), 'kill')}).",
                   tuple(sorted(evidence)))


def each_task_done_once_after_resume(history: History, final: FinalState) -> Verdict:
    """After resume, every task ends done exactly once (read from the final state)."""
    name = "each_task_done_once_after_resume"
    resumes = [op for op in history.operations(RESUME_SCOPES) if op.type == "ok"]
    if not resumes:
        return Verdict(name, "unknown", "No resume was acknowledged in this game day, so "
                       "nothing had to be finished after one.")
    if not final.tasks:
        return Verdict(name, "unknown", "The harness read no tasks at the end of the game day.",
                       tuple(r.last_index for r in resumes))
    wrong = {task_id: task for task_id, task in sorted(final.tasks.items())
             if task["state"] != "done" or task["done_count"] != 1}
    resume_evidence = [r.last_index for r in resumes]
    if not wrong:
        return Verdict(name, True, f"Every task ended done exactly once after resume "
                       f"({_count(len(final.tasks), 'task')}).", tuple(resume_evidence))
    first_resume_ns = min(r.start_ns for r in resumes)
    reads = [e.index for e in history.select(f=TASK_STATE_F)
             if e.value.get("task_id") in wrong and e.time_ns >= first_resume_ns]
    lines = [f"task {task_id} ended {task['state']} and was done "
             f"{_count(task['done_count'], 'time')}"
             for task_id, task in wrong.items()]
    return Verdict(name, False, _sentence(f"{len(wrong)} of {len(final.tasks)} tasks did not "
                                          f"end done exactly once after resume", lines,
                                          "work was lost or done twice"),
                   tuple(sorted({*resume_evidence, *reads})))


def no_wake_of_stopped_agent(history: History, final: FinalState) -> Verdict:
    """No agent was seen starting work while its stop stood."""
    name = "no_wake_of_stopped_agent"
    all_stops = stops(history)
    acknowledged = [s for s in all_stops if s.acknowledged_ns is not None]
    if not acknowledged:
        return Verdict(name, "unknown", "No kill was acknowledged in this game day, so no "
                       "agent stood stopped.")
    wakes = [op for op in history.operations(WAKE_FS)
             if op.type == "ok" and op.end_ns is not None and op.agent_id is not None
             and op.value.get("outcome", "started") == "started"]
    if not wakes:
        return Verdict(name, "unknown", "No session start or wake of any agent is in the "
                       "history (the sessions were not read back), so no wake during a stop "
                       "could have been seen.", tuple(s.kill.last_index for s in acknowledged))
    lines: list[str] = []
    evidence: set[int] = set()
    for wake in wakes:
        agent_id = _agent(wake)
        stop = holding(all_stops, agent_id, final.org_of(agent_id), wake.start_ns, wake.end_ns)
        if stop is None:
            continue
        evidence.update([stop.kill.last_index, *wake.indexes])
        lines.append(f"agent {agent_id} was woken ({wake.f}) at event {wake.last_index}, "
                     f"{_ms(wake.start_ns - (stop.acknowledged_ns or 0))} after the "
                     f"{stop.kill.f} acknowledged at event {stop.kill.last_index}")
    if lines:
        return Verdict(name, False, _sentence("Stopped agents were woken", lines,
                                              "a wake path does not check the flags"),
                       tuple(sorted(evidence)))
    return Verdict(name, True, f"No stopped agent was woken ({_count(len(wakes), 'wake')} "
                   f"against {_count(len(acknowledged), 'kill')}).",
                   tuple(s.kill.last_index for s in acknowledged))


def every_fault_healed(history: History, final: FinalState) -> Verdict:
    """Every fault the nemesis started (or may have started) was healed after it."""
    name = "every_fault_healed"
    started = [op for op in history.operations("fault_start") if op.type != "fail"]
    if not started:
        return Verdict(name, True, "No fault was injected in this game day.")
    heals = history.operations("fault_heal")
    unhealed: list[str] = []
    unclear: list[str] = []
    evidence: set[int] = set()
    for fault in started:
        fault_id = fault.value.get("fault_id")
        after = [h for h in heals if h.value.get("fault_id") == fault_id
                 and (h.end_ns is None or h.end_ns >= fault.start_ns)]
        if any(h.type == "ok" for h in after):
            continue
        evidence.update([fault.first_index, *(i for h in after for i in h.indexes)])
        if any(h.type == "info" for h in after):
            unclear.append(f"fault {fault_id} (event {fault.first_index}): its heal has an "
                           f"unknown outcome")
        else:
            unhealed.append(f"fault {fault_id} (event {fault.first_index}) was never healed")
    if unhealed:
        return Verdict(name, False, _sentence("Faults were left in place", unhealed + unclear,
                                              "heal them by hand before the next game day"),
                       tuple(sorted(evidence)))
    if unclear:
        return Verdict(name, "unknown", _sentence("Cannot tell whether every fault healed",
                                                  unclear, "check the fault proxy and the "
                                                  "containers by hand"), tuple(sorted(evidence)))
    return Verdict(name, True, f"Every fault was healed ({_count(len(started), 'fault')}).",
                   tuple(sorted(i for h in heals if h.type == "ok" for i in h.indexes)))


def _ack_stamp(sent_ns: int, acked_ns: object, confirmed_ns: object) -> object:
    """A kill_ack's time for kill_obeyed: the daemon's stamp if it lies between the kill's
    sending and the plane's read of the ack, else the plane's read (or whatever it was)."""
    if _is_ns(acked_ns) and _is_ns(confirmed_ns) and sent_ns <= acked_ns <= confirmed_ns:
        return acked_ns
    return confirmed_ns


def kill_obeyed(history: History, final: FinalState,
                bound_ns: int = KILL_ACK_BOUND_NS) -> Verdict:
    """Every daemon sent a kill obeyed it: acknowledged it (`kill_ack`) within `bound_ns`,
    instead of running on until a hang-up or its lease ran out (which exits 3 too, with the
    same log lines, and looks like obedience from everywhere else).

    A `kill_ack` is timed by the daemon's own stamp, not by when the control plane read it:
    on a loaded host (20 containers) a daemon stamped its ack 301 ms after the kill and the
    plane read it 303 ms later, a delay between the two (the daemon's send, the channel, the
    plane's loop) that this rule blamed on the daemon's kill handling. The stamp counts only
    where it lies between the kill's sending and the plane's read (`_ack_stamp`); else the
    read does, the stricter of the two. On a deployed target the daemon's clock is not the
    plane's: a skew between them shifts this figure by as much."""
    name = "kill_obeyed"
    deliveries = [d for d in history.operations(KILL_DELIVERY_F)
                  if d.type == "ok" and d.agent_id is not None
                  and isinstance(d.value.get("sent_ns"), int)]
    if not deliveries:
        return Verdict(name, "unknown", "No kill message reached a running daemon in this game "
                       "day, or the control plane does not record one (no session carries a "
                       "kill_sent_at), so no daemon's obedience could be judged.")
    all_stops = stops(history)
    lines: list[str] = []
    evidence: set[int] = set()
    slowest = 0
    for d in deliveries:
        agent_id = _agent(d)
        sent, confirmed = int(d.value["sent_ns"]), d.value.get("confirmed_ns")
        by, said = d.value.get("confirmed_by"), d.value.get("daemon_stop")
        if by == "kill_ack":
            confirmed = _ack_stamp(sent, d.value.get("acked_ns"), confirmed)
        after = None if not isinstance(confirmed, int) else confirmed - sent
        where = f"session {d.value.get('session_id')}, event {d.last_index}"
        if by == "kill_ack" and after is not None and after <= bound_ns:
            slowest = max(slowest, after)
            continue
        kill = next((s.kill for s in reversed(all_stops)
                     if s.covers(agent_id, final.org_of(agent_id))
                     and s.kill.start_ns <= sent), None)
        evidence.update([d.last_index, *(() if kill is None else (kill.last_index,))])
        if by == "kill_ack" and after is not None:
            lines.append(f"agent {agent_id}'s daemon acknowledged the kill {_ms(after)} after "
                         f"it was sent, later than the {_ms(bound_ns)} bound ({where})")
        elif by == "lease" and after is not None:
            lines.append(f"agent {agent_id}'s daemon did not obey the kill: it never "
                         f"acknowledged it and stopped only when its kill-flag lease ran out, "
                         f"{_ms(after)} after the kill was sent ({where})")
        elif by == "teardown" and after is not None:
            lines.append(f"agent {agent_id}'s daemon did not obey the kill: it never "
                         f"acknowledged it, and the runner tore its sandbox down "
                         f"{_ms(after)} after the kill was sent ({where})")
        elif by == "hang_up" and after is not None:
            lines.append(f"agent {agent_id}'s daemon did not obey the kill: it hung up "
                         f"{_ms(after)} after the kill was sent without acknowledging it, "
                         f"saying it stopped because of {said or 'nothing'} ({where})")
        else:
            lines.append(f"agent {agent_id}'s daemon never confirmed the kill sent to it "
                         f"({where})")
    if lines:
        return Verdict(name, False, _sentence("Kills were not obeyed", lines,
                                              "a daemon that does not act on kill keeps its "
                                              "agent working until its lease runs out; fix its "
                                              "kill handling"), tuple(sorted(evidence)))
    return Verdict(name, True, f"Every daemon sent a kill acknowledged it within "
                   f"{_ms(bound_ns)} ({_count(len(deliveries), 'kill message')}, the slowest "
                   f"after {_ms(slowest)}).", tuple(d.last_index for d in deliveries))


GUARD_LAYERS = ("budget", "steps", "loop", "circuit_breaker")
HOME_FILES_F = "home_files"  # {"agent_id", "label", "files": {path: bytes}}; harness.judge.costs
HOME_SYNC_F = "home_sync"  # by `agent:<id>`, {"sandbox_id"}: a sandbox's last sync to the home
# {"agent_id", "remains": [what]}: what of the agent's sandboxes the harness found on the
# machine itself (harness/record/remains.py): processes, containers; empty when nothing.
SANDBOX_REMAINS_F = "sandbox_remains"


def nothing_left_of_killed_agent(history: History, final: FinalState) -> Verdict:
    """No process or container of an agent is left once its kill was acknowledged: what
    the harness last found of it on the machine, looked at after the kill, is nothing
    (a warm sandbox parked between sessions included: evictWarm tears it down)."""
    name = "nothing_left_of_killed_agent"
    all_stops = [s for s in stops(history) if s.acknowledged_ns is not None]
    looks = [e for e in history.select(f=SANDBOX_REMAINS_F) if e.agent_id is not None]
    judged: dict[str, tuple[Stop, Event]] = {}
    for stop in all_stops:
        for look in looks:
            agent = str(look.agent_id)
            if stop.covers(agent, final.org_of(agent)) and stop.holds_at(look.time_ns):
                judged[agent] = (stop, look)  # looks come in order: the last one counts
    if not judged:
        return Verdict(name, "unknown", "The harness never looked at what a killed agent left "
                       "on the machine while its stop stood (no sandbox_remains after an "
                       "acknowledged kill), or cannot on this stack.")
    lines = [f"agent {agent} still had {', '.join(look.value['remains'])} at event "
             f"{look.index}, after the {stop.kill.f} acknowledged at event {stop.kill.last_index}"
             for agent, (stop, look) in sorted(judged.items()) if look.value.get("remains")]
    evidence = tuple(sorted({i for stop, look in judged.values()
                             for i in (stop.kill.last_index, look.index)}))
    if lines:
        return Verdict(name, False, _sentence("Killed agents left sandboxes up", lines,
                                              "a process or container of a stopped agent can "
                                              "still act; find what the teardown missed"),
                       evidence)
    return Verdict(name, True, f"Nothing of a killed agent was left on the machine "
                   f"({_count(len(judged), 'agent')} looked at).", evidence)


def home_is_last_sync(history: History, final: FinalState) -> Verdict:
    """A killed agent's home, as the next session is restored from it, is its last sync:
    what the killed sandbox did after that (an rm -rf included) is not kept (DESIGN
    §2.3.7)."""
    name = "home_is_last_sync"
    reads: dict[str, dict[str, tuple[int, dict[str, int]]]] = defaultdict(dict)
    for e in history.select(f=HOME_FILES_F):
        if e.agent_id is not None:
            reads[e.agent_id][str(e.value["label"])] = (e.index, dict(e.value["files"]))
    judged = {a: r for a, r in reads.items() if "last_sync" in r and "restored" in r}
    if not judged:
        return Verdict(name, "unknown", "No agent's home was read both at its last sync and "
                       "as restored after a kill, so nothing could be compared.")
    lines: list[str] = []
    evidence: set[int] = set()
    for agent, r in sorted(judged.items()):
        (si, synced), (ri, restored) = r["last_sync"], r["restored"]
        evidence.update([si, ri])
        if synced != restored:
            missing = sorted(set(synced) - set(restored))
            extra = sorted(p for p in restored if synced.get(p) != restored[p])
            lines.append(f"agent {agent}'s home after the kill lacks {len(missing)} synced "
                         f"files ({', '.join(missing[:3]) or 'none'}) and holds {len(extra)} "
                         f"files it did not have at its last sync "
                         f"({', '.join(extra[:3]) or 'none'}) (events {si}, {ri})")
    if lines:
        return Verdict(name, False, _sentence("A killed agent's home is not its last sync",
                                              lines, "the next session starts from work "
                                              "that was never synced, or without work that "
                                              "was"), tuple(sorted(evidence)))
    return Verdict(name, True, f"Every killed agent's home was its last sync "
                   f"({_count(len(judged), 'agent')}).", tuple(sorted(evidence)))


def no_blind_restart_after_trip(history: History, final: FinalState) -> Verdict:
    """An agent its guard stopped is not started again until a human resumes it or its task
    is changed (DESIGN §2.4: not restarted blindly)."""
    name = "no_blind_restart_after_trip"
    trips = [e for e in history.select(f=SESSION_END_F)
             if e.value.get("stop_layer") in GUARD_LAYERS and e.agent_id is not None]
    if not trips:
        return Verdict(name, "unknown", "No agent was stopped by its guard in this game day.")
    releases = [op for op in history.operations(("resume_agent", "change_task"))
                if op.agent_id is not None and op.type != "fail"]
    starts = [op for op in history.operations("session_start") if op.agent_id is not None]
    lines: list[str] = []
    evidence: set[int] = set()
    for trip in trips:
        agent = trip.agent_id
        released = min((op.start_ns for op in releases if op.agent_id == agent
                        and op.start_ns >= trip.time_ns), default=None)
        for start in starts:
            if (start.agent_id == agent and start.start_ns > trip.time_ns
                    and (released is None or start.start_ns < released)):
                evidence.update([trip.index, start.last_index])
                lines.append(f"agent {agent} started a session (event {start.last_index}) "
                             f"after its guard's {trip.value['stop_layer']} layer stopped it "
                             f"(event {trip.index}) with nobody resuming it or changing its "
                             f"task")
    if lines:
        return Verdict(name, False, _sentence("Tripped agents were restarted blindly", lines,
                                              "the same input trips the guard again and "
                                              "spends again"), tuple(sorted(evidence)))
    return Verdict(name, True, f"No agent was restarted after a guard trip without a human "
                   f"({_count(len(trips), 'trip')}).", tuple(t.index for t in trips))


CHECKERS: tuple[Checker, ...] = (
    no_action_after_kill_ack,
    in_progress_requeued,
    each_task_done_once_after_resume,
    no_wake_of_stopped_agent,
    every_fault_healed,
    kill_obeyed,
)


# Every checker a scenario may choose (`@pytest.mark.checkers(...)`); CHECKERS is the default.
ALL_CHECKERS: tuple[Checker, ...] = (*CHECKERS, home_is_last_sync, no_blind_restart_after_trip,
                                     nothing_left_of_killed_agent)


def judge_all(checkers: Iterable[Checker], history: History, final: FinalState
              ) -> list[Verdict]:
    """Every checker's verdict. A checker that raises is `unknown` with its error, and the
    others stand: one broken judge must not lose the game day's other verdicts."""
    verdicts = []
    for checker in checkers:
        try:
            verdicts.append(checker(history, final))
        except Exception as exc:
            verdicts.append(Verdict(checker.__name__, "unknown",
                                    f"The checker itself failed on this history, so it "
                                    f"decided nothing: {exc!r}."))
    return verdicts


def check_all(history: History, final: FinalState) -> list[Verdict]:
    return judge_all(CHECKERS, history, final)


def task_reads(history: History) -> list[Operation]:
    """The successful `task_state` reads, in order of start."""
    return [r for r in history.operations(TASK_STATE_F)
            if r.type == "ok" and isinstance(r.value.get("task_id"), str)]


def tasks_in_progress_at(stop: Stop, reads: list[Operation], final: FinalState
                         ) -> list[tuple[Operation, str]]:
    """The last `task_state` read of each task before the kill's invoke, for the tasks it
    showed `in_progress` and the kill covers, with their agent (from the read, else `final`)."""
    latest: dict[str, Operation] = {}
    for read in reads:
        if read.end_ns is not None and read.end_ns < stop.kill.start_ns:
            latest[str(read.value["task_id"])] = read  # reads come in order of start
    found = []
    for task_id, read in latest.items():
        task = final.tasks.get(task_id)
        agent_id = read.agent_id or (None if task is None else task["agent_id"])
        if (read.value.get("state") == "in_progress" and agent_id is not None
                and stop.covers(agent_id, final.org_of(agent_id))):
            found.append((read, agent_id))
    return found


def _agent(op: Operation) -> str:
    if op.agent_id is None:
        raise ValueError(f"event {op.first_index} ({op.f}) names no agent")
    return op.agent_id


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _ms(ns: int) -> str:
    return f"{ns / 1e6:.1f} ms"


def _sentence(head: str, items: Iterable[str], then: str, shown: int = 5) -> str:
    listed = list(items)
    more = f"; and {len(listed) - shown} more" if len(listed) > shown else ""
    return f"{head}: {'; '.join(listed[:shown])}{more}. {then[0].upper()}{then[1:]}."
