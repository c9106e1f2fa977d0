"""Unit tests of the guard: each layer fed one failure, asserting the right typed trip."""

from __future__ import annotations

import math
from typing import Any

import pytest

from covey.guard import (
    BudgetTrip,
    CircuitOpenTrip,
    Guard,
    KillFlag,
    KillFlagTrip,
    LeaseExpiredTrip,
    Limits,
    LoopDetector,
    LoopTrip,
    Reservation,
    StepLimitTrip,
    ToolStoppedTrip,
    Trip,
    Usage,
    fingerprint,
    prompt_token_bound,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_guard(**limits: Any) -> tuple[Guard, FakeClock]:
    clock = FakeClock()
    flag = KillFlag(clock=clock, scopes=("global", "org:o1", "agent:a1"))
    flag.renew(2.0)
    return Guard(Limits(**limits), flag, clock=clock, prices={"m": (1.0, 2.0)}), clock


def test_a_repeated_call_trips_the_loop_detector() -> None:
    guard, _ = make_guard(loop_repeats=3)
    args = {"cmd": "rm -rf ./*"}
    guard.before_call("shell", args)
    guard.before_call("shell", {"cmd": "rm  -rf   ./* "})  # whitespace differs only
    with pytest.raises(LoopTrip) as trip:
        guard.before_call("shell", args)
    assert trip.value.layer == "loop"
    assert trip.value.reason == "repeated shell 3 times with identical arguments"


def test_a_rising_cost_trips_the_budget() -> None:
    guard, _ = make_guard(max_cost_usd=0.01)
    guard.charge(0.004)
    guard.charge(0.004)
    with pytest.raises(BudgetTrip) as trip:
        guard.charge(0.004)
    assert trip.value.layer == "budget" and "over the $0.0100 budget" in trip.value.reason


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -0.01, "0.1", None])
def test_unusable_costs_trip_instead_of_counting_as_zero(bad: Any) -> None:
    guard, _ = make_guard()
    with pytest.raises(BudgetTrip):
        guard.charge(bad)
    assert guard.cost_usd == 0.0


def test_a_model_without_a_price_is_not_free() -> None:
    guard, _ = make_guard()
    assert guard.charge_usage("m", 1000, 500) == pytest.approx(0.002)
    with pytest.raises(BudgetTrip) as trip:
        guard.charge_usage("gpt-unknown", 10, 10)
    assert "no known price" in trip.value.reason
    with pytest.raises(BudgetTrip):
        guard.charge_usage("m", -5, 10)


# The reservation: a model call may ask for no more completion than the budgets pay for.
# Model "m" costs $1 per million prompt tokens and $2 per million completion tokens.

def _spend_all(guard: Guard, prompt: int, ask: int, answered: int | None = None
               ) -> list[Reservation]:
    """Calls answered as long as allowed (or `answered`), until the guard refuses one."""
    made = []
    while True:
        try:
            r = guard.reserve("m", prompt)
        except BudgetTrip:
            return made
        made.append(r)
        got = min(r.max_tokens, ask if answered is None else answered)
        guard.book(r, guard.price_usage(r, prompt, got))


def test_max_tokens_is_capped_at_what_the_remaining_budget_pays_for() -> None:
    guard, _ = make_guard(max_cost_usd=0.5, max_completion_tokens=100_000,
                          max_tokens=10**9)
    for _ in range(2):  # $0.201 each
        call = guard.reserve("m", 1000)
        assert call.max_tokens == 100_000  # plenty left: the agent's own limit
        guard.book(call, guard.price_usage(call, 1000, 100_000))
    third = guard.reserve("m", 1000)
    # $0.098 left, $0.001 of it for the prompt: 48,500 completion tokens at $2 per million.
    assert third.max_tokens == 48_499
    assert third.worst_usd <= 0.5 - guard.cost_usd
    guard.book(third, guard.price_usage(third, 1000, third.max_tokens))
    assert guard.cost_usd <= 0.5


def test_spending_as_fast_as_allowed_never_passes_the_cap() -> None:
    for cap in (0.5, 0.01, 1.0, 0.123456):
        guard, _ = make_guard(max_cost_usd=cap, max_completion_tokens=75_000,
                              max_tokens=10**9)
        calls = _spend_all(guard, 3000, 75_000)
        assert calls and guard.cost_usd <= cap, (cap, guard.cost_usd)
        assert cap - guard.cost_usd < (3000 + 64) * 2 / 1e6 + 1e-9  # spent all it could


def test_the_token_budget_caps_max_tokens_too() -> None:
    guard, _ = make_guard(max_tokens=10_000, max_completion_tokens=8000)
    r = guard.reserve("m", 4000)
    assert r.max_tokens == 6000
    guard.book(r, guard.price_usage(r, 4000, 6000))
    assert guard.tokens == 10_000
    with pytest.raises(BudgetTrip, match="0 tokens left of the 10000 token budget"):
        guard.reserve("m", 10)


def test_a_prompt_the_budget_cannot_pay_for_is_refused_before_sending() -> None:
    guard, _ = make_guard(max_cost_usd=0.01)
    with pytest.raises(BudgetTrip) as trip:
        guard.reserve("m", 20_000)  # $0.02 for the prompt alone
    assert trip.value.layer == "budget"
    assert trip.value.reason == (
        "$0.0100 left of the $0.0100 budget does not pay for this call's worst case $0.0201 "
        "(a prompt of at most 20000 tokens and 64 completion tokens); refused before sending")
    assert trip.value.detail["remaining_usd"] == 0.01
    assert guard.cost_usd == 0.0
    guard, _ = make_guard(max_tokens=1000)
    with pytest.raises(BudgetTrip, match="1000 tokens left of the 1000 token budget do not "
                       "cover this call's worst case of 1064 tokens"):
        guard.reserve("m", 1000)


def test_an_endpoint_that_answers_more_than_it_was_allowed_trips_at_once() -> None:
    guard, _ = make_guard(max_cost_usd=100.0, max_completion_tokens=500)
    r = guard.reserve("m", 100)
    assert r.max_tokens == 500
    with pytest.raises(BudgetTrip) as trip:
        guard.book(r, guard.price_usage(r, 100, 501))
    assert trip.value.reason.startswith(
        "the model endpoint answered 501 completion tokens, more than the 500 it was allowed")
    assert guard.cost_usd == pytest.approx(0.001102)  # booked all the same: it was paid


@pytest.mark.parametrize("price", [(math.nan, 2.0), (1.0, math.nan), (math.inf, 1.0),
                                   (-1.0, 1.0)])
def test_an_unusable_price_trips_before_the_first_call(price: tuple[float, float]) -> None:
    guard, _ = make_guard()
    guard.prices["bad"] = price
    with pytest.raises(BudgetTrip, match="unusable price"):
        guard.reserve("bad", 100)
    with pytest.raises(BudgetTrip, match="no known price"):
        guard.reserve("gpt-unknown", 100)


def test_a_nan_usage_trips() -> None:
    guard, _ = make_guard()
    r = guard.reserve("m", 100)
    with pytest.raises(BudgetTrip, match="unusable token counts"):
        guard.price_usage(r, math.nan, 20)
    assert guard.price_usage(r, 100, 20) == Usage(100, 20, pytest.approx(0.00014))


def test_the_prompt_bound_is_at_least_the_bytes_of_the_request() -> None:
    messages = [{"role": "user", "content": "héllo wörld " * 100}]
    bound = prompt_token_bound(messages)
    assert bound >= len("héllo wörld ".encode()) * 100
    assert prompt_token_bound(messages, [{"type": "function"}]) > bound


def test_token_tool_call_and_wall_clock_budgets() -> None:
    guard, clock = make_guard(max_tokens=100, max_tool_calls=2, max_wall_s=60)
    with pytest.raises(BudgetTrip, match="token budget"):
        guard.charge(0.0, 101)
    guard, clock = make_guard(max_tool_calls=2)
    guard.before_call("a", {})
    guard.before_call("b", {})
    with pytest.raises(BudgetTrip, match="tool calls"):
        guard.before_call("c", {})
    guard, clock = make_guard(max_wall_s=60)
    guard.before_step()
    clock.now += 61
    guard.flag.renew(2.0)
    with pytest.raises(BudgetTrip, match="wall-clock"):
        guard.before_step()


def test_the_step_limit() -> None:
    guard, _ = make_guard(max_steps=2)
    guard.before_step()
    guard.before_step()
    with pytest.raises(StepLimitTrip) as trip:
        guard.before_step()
    assert trip.value.layer == "steps"


def test_a_failing_tool_opens_its_circuit_then_one_probe_passes() -> None:
    guard, clock = make_guard(breaker_failures=3, breaker_cooldown_s=30, loop_repeats=99,
                              cycle_repeats=99)
    for i in range(3):
        probe = guard.before_call("http_request", {"n": i})
        guard.after_call("http_request", ok=False, probe=probe)
    assert guard.breakers.state("http_request") == "open"
    with pytest.raises(CircuitOpenTrip) as trip:
        guard.before_call("http_request", {"n": 9})
    assert trip.value.layer == "circuit_breaker"
    guard.before_call("shell", {})  # other tools are not affected

    clock.now += 31
    guard.flag.renew(2.0)
    probe = guard.before_call("http_request", {"n": 10})
    assert probe is True and guard.breakers.state("http_request") == "half_open"
    # A concurrent call while the probe is in flight does not go through.
    with pytest.raises(CircuitOpenTrip, match="probe is in flight"):
        guard.before_call("http_request", {"n": 11})
    guard.after_call("http_request", ok=False, probe=True)
    assert guard.breakers.state("http_request") == "open"  # failed probe: open again

    clock.now += 31
    guard.flag.renew(2.0)
    probe = guard.before_call("http_request", {"n": 12})
    guard.after_call("http_request", ok=True, probe=probe)
    assert guard.breakers.state("http_request") == "closed"
    assert guard.before_call("http_request", {"n": 13}) is False


@pytest.mark.parametrize("scope", ["global", "org:o1", "agent:a1"])
def test_a_set_flag_stops_the_next_step(scope: str) -> None:
    guard, _ = make_guard()
    guard.before_step()
    guard.flag.stop(scope)
    with pytest.raises(KillFlagTrip) as trip:
        guard.before_step()
    assert trip.value.layer == "kill_flag" and scope in trip.value.reason


def test_a_tool_scoped_flag_stops_only_that_tool() -> None:
    guard, _ = make_guard()
    guard.flag.stop("tool:shell")
    guard.before_step()
    guard.before_call("read_file", {"path": "a"})
    with pytest.raises(ToolStoppedTrip, match="tool shell"):
        guard.before_call("shell", {"cmd": "ls"})
    # A refused call is not a call: it does not count against the budget or the loop window.
    assert guard.tool_calls == 1
    guard.flag.renew(2.0, set())  # cleared in the next lease
    guard.before_call("shell", {"cmd": "ls"})


def test_an_unreachable_flag_store_fails_closed() -> None:
    guard, clock = make_guard()
    guard.before_step()
    clock.now += 2.5  # the lease (2 s) was not renewed: the store could not be reached
    with pytest.raises(LeaseExpiredTrip) as trip:
        guard.before_step()
    assert isinstance(trip.value, KillFlagTrip) and trip.value.detail["failing_closed"]
    # A flag that was never renewed is closed too.
    never = KillFlag(clock=clock)
    with pytest.raises(LeaseExpiredTrip):
        never.check()


def test_fingerprint_ignores_key_order_and_whitespace_only() -> None:
    a = fingerprint("shell", {"cmd": "ls  -la", "cwd": "/w"})
    assert a == fingerprint("shell", {"cwd": "/w", "cmd": " ls -la"})
    assert a != fingerprint("shell", {"cwd": "/w", "cmd": "ls -l"})
    assert a != fingerprint("exec", {"cwd": "/w", "cmd": "ls -la"})


# (sequence of tools with args ids, trips at index or None). Letters are distinct calls.
LOOP_TABLE = [
    ("AAA", 2),
    ("ABAB", 3),
    ("ABCABC", 5),
    ("ABCDEFGHIJ", None),
    ("ABAC", None),
    ("ABCB", None),
    ("AAB", 1),  # run with loop_repeats=2: the second A trips
    ("ABCBA", None),
    ("ABBA", None),
    ("ABCDABCE", None),  # period 4 is longer than cycle_max_period
]


@pytest.mark.parametrize(("sequence", "trips_at"), LOOP_TABLE)
def test_loop_detection_table(sequence: str, trips_at: int | None) -> None:
    repeats = 2 if sequence == "AAB" else 3
    detector = LoopDetector(Limits(loop_window=10, loop_repeats=repeats, cycle_max_period=3,
                                   cycle_repeats=2))
    tripped_at = None
    for i, call in enumerate(sequence):
        try:
            detector.observe("tool", fingerprint("tool", {"call": call}))
        except LoopTrip:
            tripped_at = i
            break
    assert tripped_at == trips_at


def test_a_window_forgets_old_calls() -> None:
    detector = LoopDetector(Limits(loop_window=4, loop_repeats=2, cycle_repeats=99))
    for call in "ABCDEA":  # the first A left the window before the second came
        detector.observe("tool", fingerprint("tool", {"call": call}))


def test_a_trip_snapshot_names_layer_reason_and_last_actions() -> None:
    guard, _ = make_guard(loop_repeats=2)
    guard.before_step()
    guard.charge(0.25, 100)
    guard.before_call("search_orders", {"q": "x"})
    guard.after_call("search_orders", ok=True)
    with pytest.raises(Trip) as trip:
        guard.before_call("search_orders", {"q": "x"})
    snap = guard.snapshot(trip.value)
    assert snap["layer"] == "loop" and snap["cost_usd"] == 0.25 and snap["steps"] == 1
    assert snap["last_actions"] == [{"tool": "search_orders", "args": {"q": "x"}, "ok": True}]
