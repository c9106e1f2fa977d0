"""Game day: a tool whose service fails every call.

    pytest scenarios/failing_tool.py --stack processes

The service lives in the harness (the puppet's /puppet/fail) and counts every call that
reaches it. The circuit breaker must open after N failures in a row, let exactly one probe
through per cooldown, and stop the agent (layer `circuit_breaker`) when it calls again while
the circuit is open. Measured: the calls that reached the failing service.
"""

from __future__ import annotations

import pytest

from harness.act.client import json_of
from harness.record.gameday import GameDay

FAILURES, COOLDOWN_S, PROBES = 3, 1.0, 2
# N failures; then twice: wait out the cooldown, probe (it fails: open again); then call at
# once, while the circuit is open.
HAMMER = {"name": "probe_after_cooldown", "steps": [
    {"repeat": {"times": FAILURES, "steps": [{"fail_tool": {}}]}},
    {"repeat": {"times": PROBES, "steps": [{"shell": f"sleep {COOLDOWN_S + 0.3}"},
                                           {"fail_tool": {}}]}},
    {"fail_tool": {}}]}


@pytest.mark.decides("no_blind_restart_after_trip")
@pytest.mark.checkers("no_blind_restart_after_trip", "every_fault_healed")
@pytest.mark.measures("failing_service_calls", "steps_before_trip")
async def test_breaker_opens_on_a_failing_tool(gameday: GameDay) -> None:
    day, owner = gameday, gameday.as_("agent_owner")
    outcome = day.outcome
    agent = await day.agent(HAMMER, guard={"breaker_failures": FAILURES,
                                           "breaker_cooldown_s": COOLDOWN_S})
    json_of(await owner.create_task(agent), 201)
    session = await day.until.stopped_by(agent, "circuit_breaker")
    assert "http_request" in (session["stop_reason"] or ""), (
        f"the breaker's stop does not name the failing tool: {session['stop_reason']}")

    await day.judged(outcome)
    reached = day.measurements["failing_service_calls"][agent["id"]]
    assert reached["calls"] == FAILURES + PROBES, (
        f"{reached['calls']} calls reached the failing service, not {FAILURES} before "
        f"the circuit opened and one probe per cooldown ({PROBES}): the breaker let "
        f"calls through while open, or opened too early")
    probes = reached["gaps_ms"][FAILURES - 1:]
    assert all(gap >= COOLDOWN_S * 1000 for gap in probes), (
        f"a probe reached the failing service before the {COOLDOWN_S} s cooldown was "
        f"over: gaps {probes} ms")
