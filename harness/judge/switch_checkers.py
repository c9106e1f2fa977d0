"""Checkers of the switches' rules that random game days exercise (DESIGN §2.3): no task
lost, none done twice, every kill confirmed within the lease, no sandbox left up once a stop's
teardown bound has passed, fleet resume keeping the kills each agent's own switch made, and
every wake path refused while a stop stands. Pure judges, as in harness/judge/checkers.py: the
verdict points at the events that prove it, and `unknown` is never a pass.

What they read beside harness/judge/checkers.py's events:
* `lease` (`{"lease_ms"}`): the kill-flag lease the stack's daemons hold;
* `sandbox` (`{"agent_id", "sandbox_id", "state", "created_ns", "ended_ns",
  "daemon_exited_ns"}`): one sandbox's life as the control plane recorded it (`ended_ns`:
  when it was gone, None while not; `daemon_exited_ns`: when its daemon exited);
* `kill_delivery` with `sandbox_id`: the session's sandbox, to find when its daemon ended;
* `resume_fleet` completions with `body.agents_woken`, and the wake paths' operations
  (`wake`, `fire_heartbeat`, `trigger`) with their `status`;
* the final state's task `result` (the reason a failed task gives) and each agent's
  `live_tasks` (the tasks of its sessions still starting or running);
* `stop_tool` operations (`{"agent_id", "tool"}`), `kill_flag_ack` observations (`{"agent_id",
  "stopped": ["tool:shell", ...]}`, at the control plane's recording of the daemon's
  acknowledgement) and the ledger's `action`s with `result`: what the request carried back
  of the call answered before it.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import pairwise

from harness.judge.checkers import (
    ACTION_F,
    ALL_CHECKERS,
    KILL_DELIVERY_F,
    TASK_STATE_F,
    Checker,
    FinalState,
    Verdict,
    _count,
    _ms,
    _sentence,
)
from harness.judge.sessions import SESSION_CHECKERS
from harness.judge.stops import KILL_SCOPES, holding, stops
from harness.record.history import History

LEASE_F = "lease"
KILL_FLAG_ACK_F = "kill_flag_ack"
SANDBOX_F = "sandbox"
WAKE_PATHS = ("wake", "fire_heartbeat", "trigger")
# The status each wake path refuses with on the system under test, where it is not this
# project's 409 (an observation of the game day's, from its dialect: upstream covey's manual
# wake answers 200 and starts nothing, which DESIGN §2.3 line 3 allows).
WAKE_REFUSALS_F = "wake_refusals"
# How much later than its lease a kill may be confirmed (or its daemon end) on a loaded
# 2-core machine: the control plane's own bookkeeping, the process reaped, the row written.
KILL_CONFIRM_MARGIN_NS = 1_500_000_000
# A daemon told to stop has covey's kill grace (kill_grace_s, 5 s by default; the harness
# cannot read it from the deployment) to exit on its own before the runner destroys its
# sandbox; then the sandbox must be gone within a margin for a container's removal.
KILL_GRACE_NS = 5_000_000_000
TEARDOWN_MARGIN_NS = 3_000_000_000
TEARDOWN_BOUND_NS = KILL_GRACE_NS + TEARDOWN_MARGIN_NS


# The nemesis's fault target for a crashed control plane (harness/nemesis/plane.py).
PLANE_TARGET = "control plane"


def plane_down(history: History) -> list[tuple[int, int | None]]:
    """When the control plane was crashed by the nemesis: (start, back) each, `back` None
    when its restart was never seen to succeed."""
    heals = {h.value.get("fault_id"): h.start_ns for h in history.operations("fault_heal")
             if h.type == "ok"}
    return sorted((op.start_ns, heals.get(op.value.get("fault_id")))
                  for op in history.operations("fault_start")
                  if op.type != "fail" and op.value.get("target") == PLANE_TARGET)


def teardown_deadline(acked_ns: int, down: list[tuple[int, int | None]]) -> int | None:
    """When a stop acknowledged at `acked_ns` must have its sandboxes gone: TEARDOWN_BOUND_NS
    of the control plane being up. The control plane is what tears sandboxes down, so the
    time it lay crashed does not count (the daemons' own stop is judged by the lease,
    crash or not); None when it never came back."""
    deadline = acked_ns + TEARDOWN_BOUND_NS
    for start, back in down:
        if start >= deadline:
            break
        if back is None:
            return None
        if back > acked_ns:
            deadline += back - max(start, acked_ns)
    return deadline


def _lease_ns(history: History) -> int | None:
    for e in history.select(f=LEASE_F):
        if isinstance(e.value.get("lease_ms"), int | float):
            return int(e.value["lease_ms"] * 1_000_000)
    return None


def task_fates(final: FinalState) -> tuple[list[str], list[str]]:
    """The tasks lost and the tasks whose fate cannot be told, one sentence each."""
    lost: list[str] = []
    unclear: list[str] = []
    for task_id, task in sorted(final.tasks.items()):
        state, agent = task["state"], final.agents.get(task["agent_id"])
        live = None if agent is None else agent.get("live_tasks")
        held = live is not None and task_id in live
        if state == "done" or (state == "failed" and (task.get("result") or "").strip()):
            continue
        if state == "failed":
            lost.append(f"task {task_id} failed without a reason")
        elif live is None and state in ("open", "in_progress"):
            unclear.append(f"task {task_id} ended {state} and the harness did not read "
                           f"whether a session of agent {task['agent_id']} was live")
        elif state == "open" and held:
            unclear.append(f"task {task_id} ended open while a live session worked on it")
        elif state == "open":
            continue
        elif state == "in_progress" and held:
            unclear.append(f"task {task_id} was still being worked on when the game day "
                           f"ended")
        elif state == "in_progress":
            lost.append(f"task {task_id} ended in progress with no live session working on "
                        f"it: nothing will finish or requeue it")
        else:
            lost.append(f"task {task_id} ended {state}")
    return lost, unclear


def no_task_lost(history: History, final: FinalState) -> Verdict:
    """Every task ends done, failed with a reason, or open with no live session on it."""
    name = "no_task_lost"
    if not final.tasks:
        return Verdict(name, "unknown", "The harness read no tasks at the end of the game day.")
    lost, unclear = task_fates(final)
    evidence = _reads(history, [t for t in final.tasks if any(t in s for s in lost)])
    if lost:
        return Verdict(name, False, _sentence(f"{len(lost)} of {len(final.tasks)} tasks were "
                                              f"lost", lost, "their work will never be done "
                                              "unless someone finds them"), evidence)
    if unclear:
        return Verdict(name, "unknown", _sentence("Cannot tell whether every task survived",
                                                  unclear, "let the game day settle longer "
                                                  "before it ends"), evidence)
    return Verdict(name, True, f"No task was lost ({_count(len(final.tasks), 'task')}: done, "
                   f"failed with a reason, or open with no session on it).")


def none_done_twice(history: History, final: FinalState) -> Verdict:
    """No task was completed more than once (counted from its transitions)."""
    name = "none_done_twice"
    if not final.tasks:
        return Verdict(name, "unknown", "The harness read no tasks at the end of the game day.")
    twice = {t: task["done_count"] for t, task in sorted(final.tasks.items())
             if task["done_count"] > 1}
    if twice:
        return Verdict(name, False, _sentence(
            f"{len(twice)} tasks were done more than once",
            [f"task {t} was done {n} times" for t, n in twice.items()],
            "a result from a killed or superseded session was accepted: the fencing token "
            "did not hold"), _reads(history, list(twice)))
    done = sum(1 for t in final.tasks.values() if t["done_count"] == 1)
    return Verdict(name, True, f"No task was done twice ({done} of "
                   f"{_count(len(final.tasks), 'task')} done once).")


def kill_confirmed_within_lease(history: History, final: FinalState) -> Verdict:
    """Every kill answered, and every daemon it was sent to confirmed it or ended, within
    the lease plus KILL_CONFIRM_MARGIN_NS: a daemon that cannot hear the kill (a cut channel,
    a paused process) is stopped by its lease, never later."""
    name = "kill_confirmed_within_lease"
    lease = _lease_ns(history)
    kills = [op for op in history.operations(KILL_SCOPES) if op.type == "ok"]
    if lease is None:
        return Verdict(name, "unknown", "The history does not say what lease the daemons hold "
                       "(no `lease` observation), so no bound could be put on a kill.")
    if not kills:
        return Verdict(name, "unknown", "No kill was acknowledged in this game day.")
    bound = lease + KILL_CONFIRM_MARGIN_NS
    # The daemon ended when it exited; the sandbox's removal after that is no part of it
    # (a deployment that does not record the exit says when the sandbox ended).
    ended = {str(e.value["sandbox_id"]): e.value.get("daemon_exited_ns", e.value.get("ended_ns"))
             for e in history.select(f=SANDBOX_F) if e.value.get("sandbox_id")}
    lines: list[str] = []
    evidence: set[int] = set()
    for kill in kills:
        took = (kill.end_ns or kill.start_ns) - kill.start_ns
        if took > bound:
            evidence.add(kill.last_index)
            lines.append(f"the {kill.f} at event {kill.first_index} answered after "
                         f"{_ms(took)}")
    deliveries = [d for d in history.operations(KILL_DELIVERY_F)
                  if isinstance(d.value.get("sent_ns"), int)]
    for d in deliveries:
        sent, confirmed = int(d.value["sent_ns"]), d.value.get("confirmed_ns")
        end = ended.get(str(d.value.get("sandbox_id")))
        times = [t - sent for t in (confirmed, end) if isinstance(t, int)]
        if times and min(times) <= bound:
            continue
        evidence.add(d.last_index)
        lines.append(f"agent {d.agent_id}'s daemon (session {d.value.get('session_id')}) "
                     + (f"neither confirmed the kill nor ended until {_ms(min(times))} after "
                        f"it was sent" if times else "never confirmed the kill nor ended"))
    if lines:
        return Verdict(name, False, _sentence(
            f"Kills took longer than the {_ms(lease)} lease plus {_ms(KILL_CONFIRM_MARGIN_NS)}",
            lines, "an agent that cannot be reached must stop by its lease; this one ran on"),
            tuple(sorted(evidence)))
    return Verdict(name, True, f"Every kill was answered, and every daemon it reached "
                   f"confirmed it or ended, within the {_ms(lease)} lease plus "
                   f"{_ms(KILL_CONFIRM_MARGIN_NS)} ({_count(len(kills), 'kill')}, "
                   f"{_count(len(deliveries), 'kill message')}).",
                   tuple(k.last_index for k in kills))


def no_sandbox_alive_after_stop(history: History, final: FinalState) -> Verdict:
    """Once a stop has stood for TEARDOWN_BOUND_NS after its acknowledgement (counting only
    the time the control plane was up: it is what tears sandboxes down), no sandbox of an
    agent it holds is up (until a resume may have released it)."""
    name = "no_sandbox_alive_after_stop"
    held = [s for s in stops(history) if s.acknowledged_ns is not None]
    boxes = [e for e in history.select(f=SANDBOX_F) if e.agent_id is not None
             and isinstance(e.value.get("created_ns"), int)]
    if not held:
        return Verdict(name, "unknown", "No kill was acknowledged in this game day.")
    if not boxes:
        return Verdict(name, "unknown", "The history holds no sandbox's life (no `sandbox` "
                       "observation), so none could be judged.")
    lines: list[str] = []
    evidence: set[int] = set()
    judged = 0
    down = plane_down(history)
    unjudged: list[str] = []
    for stop in held:
        after = teardown_deadline(stop.acknowledged_ns or 0, down)
        if after is None:
            unjudged.append(f"the {stop.kill.f} acknowledged at event {stop.kill.last_index}")
            continue  # the control plane never came back: nothing could tear them down
        if stop.lifted_ns is not None and stop.lifted_ns <= after:
            continue  # released before the bound: nothing had to be gone yet
        judged += 1
        grace = after - (stop.acknowledged_ns or 0) - TEARDOWN_BOUND_NS
        until = stop.lifted_ns
        for box in boxes:
            agent = str(box.agent_id)
            if not stop.covers(agent, final.org_of(agent)):
                continue
            created, ended = int(box.value["created_ns"]), box.value.get("ended_ns")
            if (until is None or created < until) and (ended is None or ended > after):
                evidence.update([stop.kill.last_index, box.index])
                still = (f"still {box.value.get('state')} when last read" if ended is None
                         else f"up until {_ms(int(ended) - (stop.acknowledged_ns or 0))} "
                              f"after the kill's acknowledgement")
                crashed = (f" (bound {_ms(after - (stop.acknowledged_ns or 0))}: "
                           f"{_ms(grace)} of it the control plane lay crashed)"
                           if grace else "")
                lines.append(f"sandbox {box.value.get('sandbox_id')} of agent {agent} was "
                             f"{still}, under the {stop.kill.f} acknowledged at event "
                             f"{stop.kill.last_index}{crashed}")
    if lines:
        return Verdict(name, False, _sentence(
            f"Sandboxes outlived a stop by more than {_ms(TEARDOWN_BOUND_NS)}", lines,
            "a stopped agent's sandbox still holds its process or container, or stays "
            "parked for reuse with work the kill should have thrown away"),
            tuple(sorted(evidence)))
    if not judged and unjudged:
        return Verdict(name, "unknown", _sentence(
            "The control plane never came back after a crash, so no sandbox could have been "
            "torn down under", unjudged, "see every_fault_healed"),
            tuple(s.kill.last_index for s in held))
    if not judged:
        return Verdict(name, "unknown", f"Every stop was released within "
                       f"{_ms(TEARDOWN_BOUND_NS)} of its acknowledgement, before its "
                       f"sandboxes had to be gone.", tuple(s.kill.last_index for s in held))
    crash = " of the control plane being up" if down else ""
    return Verdict(name, True, f"No sandbox was up {_ms(TEARDOWN_BOUND_NS)}{crash} after a "
                   f"stop ({_count(judged, 'stop')}, {_count(len(boxes), 'sandbox')}).",
                   tuple(s.kill.last_index for s in held))


def fleet_resume_keeps_own_kills(history: History, final: FinalState) -> Verdict:
    """A fleet resume does not revive an agent killed on its own (DESIGN §2.3 line 5): not
    in its answer, no session of it started after it, and still killed at the end unless its
    own resume came."""
    name = "fleet_resume_keeps_own_kills"
    resumes = [op for op in history.operations("resume_fleet") if op.type == "ok"]
    own = [s for s in stops(history) if s.scope == "agent" and s.acknowledged_ns is not None]
    if not resumes or not own:
        return Verdict(name, "unknown", "No fleet resume came while an agent stood killed on "
                       "its own in this game day.")
    starts = [op for op in history.operations("session_start") if op.agent_id is not None]
    lines: list[str] = []
    evidence: set[int] = set()
    judged = 0
    for resume in resumes:
        end = resume.end_ns or resume.start_ns
        woken = {str(a) for a in (resume.value.get("body") or {}).get("agents_woken", [])}
        for stop in own:
            agent = str(stop.agent_id)
            if not (stop.holds_at(resume.start_ns) and stop.holds_at(end)):
                continue
            judged += 1
            revived = [s for s in starts if s.agent_id == agent and s.start_ns > end
                       and (stop.lifted_ns is None or s.start_ns < stop.lifted_ns)]
            if agent in woken:
                lines.append(f"the fleet resume at event {resume.last_index} woke agent "
                             f"{agent}, killed on its own at event {stop.kill.last_index}")
            elif revived:
                lines.append(f"agent {agent}, killed on its own at event "
                             f"{stop.kill.last_index}, started a session (event "
                             f"{revived[0].last_index}) after the fleet resume at event "
                             f"{resume.last_index}")
            elif stop.lifted_ns is None and agent in final.agents \
                    and not final.agents[agent]["killed"]:
                lines.append(f"agent {agent}, killed on its own at event "
                             f"{stop.kill.last_index}, was no longer killed at the end though "
                             f"only the fleet was resumed (event {resume.last_index})")
            else:
                continue
            evidence.update([stop.kill.last_index, resume.last_index,
                             *(r.last_index for r in revived[:1])])
    if lines:
        return Verdict(name, False, _sentence("Fleet resume revived agents killed on their "
                                              "own", lines, "an agent someone stopped on "
                                              "purpose is running again"),
                       tuple(sorted(evidence)))
    if not judged:
        return Verdict(name, "unknown", "No fleet resume came while an agent stood killed on "
                       "its own in this game day.")
    return Verdict(name, True, f"Every agent killed on its own stayed killed through the "
                   f"fleet resumes ({_count(judged, 'case')}).",
                   tuple(r.last_index for r in resumes))


def wake_paths_refused_while_stopped(history: History, final: FinalState) -> Verdict:
    """Every wake path (a manual wake, a heartbeat fire, the trigger) that a stop held from
    request to answer was answered 409; a role's 403 is judged elsewhere. A call that got
    no answer (it never reached the control plane, down in a crash) is not judged: nothing
    was refused or let through."""
    name = "wake_paths_refused_while_stopped"
    all_stops = stops(history)
    refusal = dict.fromkeys(WAKE_PATHS, 409)
    for e in history.select(f=WAKE_REFUSALS_F):
        refusal.update(e.value.get("statuses", {}))
    calls = [op for op in history.operations(WAKE_PATHS)
             if op.agent_id is not None and op.end_ns is not None and op.type != "info"
             and op.value.get("status") is not None]
    lines: list[str] = []
    evidence: set[int] = set()
    judged = 0
    for call in calls:
        agent = str(call.agent_id)
        stop = holding(all_stops, agent, final.org_of(agent), call.start_ns, call.end_ns)
        status = call.value.get("status")
        if stop is None or status in (403, 404):
            continue
        judged += 1
        if status == refusal.get(call.f, 409):
            continue
        evidence.update([stop.kill.last_index, *call.indexes])
        lines.append(f"{call.f} of agent {agent} at event {call.first_index} was answered "
                     f"{status}, not the refusal {refusal.get(call.f, 409)}, while the "
                     f"{stop.kill.f} acknowledged at event {stop.kill.last_index} stood")
    if lines:
        return Verdict(name, False, _sentence("Wake paths were not refused during a stop",
                                              lines, "a stopped agent can be started through "
                                              "them"), tuple(sorted(evidence)))
    if not judged:
        return Verdict(name, "unknown", "No wake path was called while a stop stood.")
    return Verdict(name, True, f"Every wake path called during a stop was refused "
                   f"({_count(judged, 'call')}).",
                   tuple(i for c in calls for i in c.indexes
                         if c.value.get("status") == refusal.get(c.f, 409)))


def stopped_tool_not_run(history: History, final: FinalState) -> Verdict:
    """Once an agent's daemon acknowledged a tool flag, no call of that tool ran: each one
    the model asked for afterwards came back refused ("kill flag set for tool T"), read from
    the puppet's ledger (the next request carries the call's result), outside the system."""
    name = "stopped_tool_not_run"
    flags = [op for op in history.operations("stop_tool") if op.type == "ok" and op.agent_id]
    if not flags:
        return Verdict(name, "unknown", "No tool flag was set in this game day.")
    acks = history.operations(KILL_FLAG_ACK_F)
    lines: list[str] = []
    lacking: list[str] = []
    evidence: set[int] = set()
    refused = 0
    for flag in flags:
        agent, tool = str(flag.agent_id), str(flag.value.get("tool"))
        ack = next((a for a in acks if a.agent_id == agent and a.start_ns >= flag.start_ns
                    and f"tool:{tool}" in a.value.get("stopped", ())), None)
        if ack is None:
            lacking.append(f"agent {agent}'s daemon never acknowledged the flag on {tool} "
                           f"set at event {flag.last_index}")
            continue
        calls = [op for op in history.operations(ACTION_F) if op.agent_id == agent]
        asked = [(call, after) for call, after in pairwise(calls)
                 if call.value.get("tool") == tool and call.start_ns > ack.start_ns
                 and after.value.get("result") is not None]
        if not asked:
            lacking.append(f"agent {agent} asked for no {tool} call after its daemon "
                           f"acknowledged the flag (event {ack.last_index})")
            continue
        ran = [(c, a) for c, a in asked
               if f"kill flag set for tool {tool}" not in str(a.value["result"])]
        refused += len(asked) - len(ran)
        if ran:
            evidence.update([flag.last_index, ack.last_index,
                             *(i for c, a in ran for i in (c.first_index, a.first_index))])
            lines.append(f"{len(ran)} of agent {agent}'s {len(asked)} {tool} calls asked "
                         f"after its daemon acknowledged the flag (event {ack.last_index}) "
                         f"ran, the first {_ms(ran[0][0].start_ns - ack.start_ns)} after it "
                         f"(its result: {str(ran[0][1].value['result'])[:120]})")
    if lines:
        return Verdict(name, False, _sentence("A stopped tool ran after the flag was "
                                              "acknowledged", lines, "the guard does not "
                                              "refuse the tools its lease names"),
                       tuple(sorted(evidence)))
    if lacking:
        return Verdict(name, "unknown", _sentence("Cannot tell whether the stopped tool "
                                                  "was refused", lacking, "nothing shows the "
                                                  "flag held"), tuple(f.last_index for f in flags))
    return Verdict(name, True, f"No stopped tool ran after its flag was acknowledged "
                   f"({_count(refused, 'call')} refused, {_count(len(flags), 'flag')}).",
                   tuple(f.last_index for f in flags))


def _reads(history: History, task_ids: Iterable[str]) -> tuple[int, ...]:
    wanted = set(task_ids)
    return tuple(e.index for e in history.select(f=TASK_STATE_F)
                 if e.value.get("task_id") in wanted)[-8:]


SWITCH_CHECKERS: tuple[Checker, ...] = (
    no_task_lost,
    none_done_twice,
    kill_confirmed_within_lease,
    no_sandbox_alive_after_stop,
    fleet_resume_keeps_own_kills,
    wake_paths_refused_while_stopped,
    stopped_tool_not_run,
)

# Every checker a scenario may name in its `checkers` or `decides` marker.
CATALOGUE: tuple[Checker, ...] = (*ALL_CHECKERS, *SWITCH_CHECKERS, *SESSION_CHECKERS)


