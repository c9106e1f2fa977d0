"""Checkers of what a stop does to sessions (DESIGN §2.3): a result from a session that is
over is refused (the fencing of line 8), and no session of a stopped agent is live while
its stop stands, a wake that raced the kill included (line 1's order: the flag is committed
before any `kill` leaves, so the kill's cancel sees every session a wake committed before
it, and every wake after it sees the flag). Pure judges, as in harness/judge/checkers.py.

What they read beside harness/judge/checkers.py's events:
* `task_result` (`{"agent_id", "session_id", "task_id", "status", "why"}`, at the control
  plane's time): a result a daemon reported for a task, as the control plane recorded it:
  `status` done or blocked when it took the result, `rejected` (with `why`) when it refused;
* `session_start` and `session_end` (`{"agent_id", "session_id", "state"}`), at the
  control plane's times;
* the answer of each kill (`body.sessions_cancelled`): the sessions it stopped.
"""

from __future__ import annotations

from harness.judge.checkers import (
    SESSION_END_F,
    Checker,
    FinalState,
    Verdict,
    _count,
    _ms,
    _sentence,
)
from harness.judge.stops import Stop, stops
from harness.record.history import Event, History

TASK_RESULT_F = "task_result"
ACCEPTED = ("done", "blocked")
# Session states that end it without its work: a kill cancelled it, its daemon was lost (its
# work requeued, and perhaps taken by another session: superseded), its guard tripped.
CUT_SHORT = ("cancelled", "lost", "tripped")
# How much later than the recorded end of a session cut short a result must come to count as
# late: its end and a result's acceptance are each stamped with their own transaction's
# start, and a result whose transaction began a moment after the cut's, yet took the row
# locks first, was rightly accepted before it.
LATE_MARGIN_NS = 100_000_000


def _over_at(history: History, acknowledged: list[Stop]) -> dict[str, tuple[int, str]]:
    """When each session was certainly over, and what ended it: the answer of the kill that
    cancelled it, else its recorded end (with the margin) when it was cut short."""
    over: dict[str, tuple[int, str]] = {}
    for stop in acknowledged:
        for session in (stop.kill.value.get("body") or {}).get("sessions_cancelled") or []:
            ack = stop.acknowledged_ns or 0
            if str(session) not in over or ack < over[str(session)][0]:
                over[str(session)] = (ack, f"the {stop.kill.f} acknowledged at event "
                                           f"{stop.kill.last_index}")
    for end in history.select(f=SESSION_END_F):
        session, state = str(end.value.get("session_id")), end.value.get("state")
        if state in CUT_SHORT and session not in over:
            over[session] = (end.time_ns + LATE_MARGIN_NS, f"its end ({state}, event "
                                                           f"{end.index})")
    return over


def late_result_refused(history: History, final: FinalState) -> Verdict:
    """A result reported for a task by a session that a kill had cancelled, or that was
    otherwise over (lost, superseded, tripped), is refused: the control plane records it
    `rejected`, never takes it for the task (DESIGN §2.3.8: the fencing token)."""
    name = "late_result_refused"
    acknowledged = [s for s in stops(history) if s.acknowledged_ns is not None]
    over = _over_at(history, acknowledged)
    results = [e for e in history.select(f=TASK_RESULT_F) if e.agent_id is not None]
    late: list[tuple[Event, int, str]] = []
    for result in results:
        session = str(result.value.get("session_id"))
        if session in over and result.time_ns > over[session][0]:
            late.append((result, *over[session]))
    if not late:
        return Verdict(name, "unknown", f"No session reported a result after it was over "
                       f"({_count(len(results), 'result')} recorded, "
                       f"{_count(len(over), 'session')} killed or cut short), so the fencing "
                       f"of results was never put to the test.")
    taken = [(r, at, why) for r, at, why in late if r.value.get("status") in ACCEPTED]
    if taken:
        lines = [f"task {r.value.get('task_id')} of agent {r.agent_id} took the result "
                 f"({r.value.get('status')}, event {r.index}) of session "
                 f"{r.value.get('session_id')}, {_ms(r.time_ns - at)} after {why} had ended "
                 f"that session" for r, at, why in taken]
        return Verdict(name, False, _sentence(
            "Results from killed or superseded sessions were accepted", lines,
            "the fencing token did not hold (DESIGN §2.3.8): work a stop cut short counts as "
            "done, and the session that takes the task up again is refused or does it twice"),
            tuple(sorted({r.index for r, _, _ in taken})))
    refused = [r for r, _, _ in late if r.value.get("status") == "rejected"]
    whys = sorted({str(r.value.get("why")) for r in refused})
    return Verdict(name, True, f"Every result reported by a session after it was over was "
                   f"refused ({_count(len(refused), 'result')}: {', '.join(whys)}).",
                   tuple(r.index for r in refused))


def _sessions(history: History) -> dict[str, tuple[str, int, int | None]]:
    """Each session read back: its agent, when it started and when it ended (None: live
    when last read)."""
    ends = {str(e.value.get("session_id")): e.time_ns for e in history.select(f=SESSION_END_F)}
    found: dict[str, tuple[str, int, int | None]] = {}
    for start in history.select(f="session_start"):
        session = str(start.value.get("session_id"))
        if start.agent_id is not None and start.value.get("outcome", "started") == "started":
            found[session] = (start.agent_id, start.time_ns, ends.get(session))
    return found


def no_session_outlives_kill(history: History, final: FinalState) -> Verdict:
    """No session of an agent is live while a stop of it stands: every session that started
    before the kill was acknowledged (a wake that raced the kill included) is over by then,
    or named in the kill's answer as one it cancelled, and none starts until a resume. A
    kill that sends `kill` before its flag is committed lets a wake in between start a
    session its cancel never sees (DESIGN §2.3.1)."""
    name = "no_session_outlives_kill"
    acknowledged = [s for s in stops(history) if s.acknowledged_ns is not None]
    if not acknowledged:
        return Verdict(name, "unknown", "No kill was acknowledged in this game day.")
    sessions = _sessions(history)
    lines: list[str] = []
    evidence: set[int] = set()
    seen = raced = 0
    for stop in acknowledged:
        ack = stop.acknowledged_ns or 0
        if stop.lifted_ns is not None and stop.lifted_ns <= ack:
            continue  # a resume raced the kill: nothing stood to judge
        # What the kill's answer says it stopped it saw, whatever the clocks of a deployment
        # say of when that session ended.
        saw = {str(s) for s in (stop.kill.value.get("body") or {}).get("sessions_cancelled")
               or []}
        for session, (agent, started, ended) in sorted(sessions.items()):
            if not stop.covers(agent, final.org_of(agent)):
                continue
            if started < ack and (ended is None or ended > stop.kill.start_ns):
                seen += 1  # a session the kill had to see
                raced += started > stop.kill.start_ns
            live_after = ended is None or ended > ack
            if not live_after or session in saw or (stop.lifted_ns is not None
                                                    and started >= stop.lifted_ns):
                continue
            evidence.add(stop.kill.last_index)
            when = (f"started {_ms(ack - started)} before" if started < ack
                    else f"started {_ms(started - ack)} after")
            until = ("still live when last read" if ended is None
                     else f"live until {_ms(ended - ack)} after it")
            lines.append(f"agent {agent}'s session {session} {when} the {stop.kill.f} "
                         f"acknowledged at event {stop.kill.last_index} was {until}")
    if lines:
        return Verdict(name, False, _sentence(
            "Sessions outlived the kill that stopped their agent", lines,
            "the stop never saw them: a wake that raced the kill started a session its "
            "cancel missed (the flag must be committed before any kill is sent, DESIGN "
            "§2.3.1), and such a session can act after the operator was told the agent "
            "stopped"), tuple(sorted(evidence)))
    if not seen:
        return Verdict(name, "unknown", f"No session of a killed agent was live or starting "
                       f"when a kill came ({_count(len(acknowledged), 'kill')}, "
                       f"{_count(len(sessions), 'session')} read back), so no kill had a "
                       f"session to stop.", tuple(s.kill.last_index for s in acknowledged))
    return Verdict(name, True, f"Every session live when a kill came was over by its "
                   f"acknowledgement, and none started while a stop stood "
                   f"({_count(seen, 'session')} against {_count(len(acknowledged), 'kill')}, "
                   f"{raced} of them started while the kill was on its way).",
                   tuple(s.kill.last_index for s in acknowledged))


# Chosen by a scenario's `checkers` or `decides` marker (the plugin's catalogue).
SESSION_CHECKERS: tuple[Checker, ...] = (late_result_refused, no_session_outlives_kill)
