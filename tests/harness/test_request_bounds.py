"""Issue 20's figures, counted from the operator's request (the kill's invoke, not its
answer): a history past the bound fails with the figure, the bound, the rule and the events;
a history with nothing to measure is `unknown`, never a pass."""

from __future__ import annotations

import pytest

from harness.judge.bounds import (
    Figure,
    actions_after_request,
    bounded_figures,
    request_to_last_action_ms,
    request_to_last_action_p50_ms,
)
from harness.judge.checkers import FinalState
from tests.harness.builders import GameDay

FINAL = FinalState()


def fleet_under_load(late_ms: dict[str, list[float]]) -> GameDay:
    """Agents acting before a fleet kill requested at 100 ms (answered at 400 ms, late as
    under load), each then sending the actions `late_ms` gives it, at those send stamps."""
    day = GameDay()
    for agent in late_ms:
        day.action(agent, 50, sent_ms=50)
    day.kill_fleet(100, 400)
    for agent, times in late_ms.items():
        for ms in times:
            day.action(agent, ms + 5, sent_ms=ms)
    return day


def test_actions_sent_between_the_request_and_the_answer_break_the_bound() -> None:
    # Every one of them came before the answer: an acknowledgement-based count sees none.
    day = fleet_under_load({"a1": [150, 250, 350], "a2": [120], "a3": []})
    figure = Figure("actions_after_request", "actions", 1,
                    actions_after_request(day.history, FINAL))
    verdict = figure.verdict()
    assert verdict.valid is False
    assert "3 actions, past its bound of 1 actions" in verdict.message, verdict.message
    assert "agent a1 sent 3 actions after the kill_fleet requested at event" in verdict.message
    assert "Rule broken: a kill stops its agent at once" in verdict.message
    kill = day.history.select(f="kill_fleet", type="invoke")[0].index
    late = [e.index for e in day.history.select(f="action", agent_id="a1")[1:]]
    assert verdict.evidence == (kill, *late)


def test_one_action_per_agent_after_the_request_is_within_a_bound_of_one() -> None:
    day = fleet_under_load({"a1": [130], "a2": [140], "a3": []})
    [figure] = bounded_figures({"actions_after_request": 1}, day.history, FINAL)
    assert figure.within is True, figure.verdict().message


def test_no_agent_seen_acting_before_the_kill_is_unknown_not_a_pass() -> None:
    day = GameDay()
    day.kill_fleet(100, 120)
    figures = bounded_figures({"actions_after_request": 1, "request_to_last_action_p50_ms": 100,
                               "request_to_last_action_ms": 500}, day.history, FINAL)
    assert [f.within for f in figures] == ["unknown"] * 3
    assert all("could not be measured" in f.verdict().message for f in figures)


def test_no_kill_is_unknown_not_a_pass() -> None:
    day = GameDay()
    day.action("a1", 50, sent_ms=50)
    for reader in (actions_after_request, request_to_last_action_p50_ms):
        assert reader(day.history, FINAL).value is None


def test_the_p50_is_over_the_agents_that_acted_after_the_request() -> None:
    # Late by 30, 60 and 250 ms; a4 did nothing after it and does not pull the median down.
    day = fleet_under_load({"a1": [130], "a2": [110, 160], "a3": [350], "a4": []})
    reading = request_to_last_action_p50_ms(day.history, FINAL)
    assert reading.value == pytest.approx(60.0, rel=1e-3)  # HDR: three significant figures
    assert "3 of 4 stopped agents acted after the request" in reading.detail, reading.detail
    assert "the slowest 250.0 ms" in reading.detail
    figure = Figure("request_to_last_action_p50_ms", "ms", 50, reading).verdict()
    assert figure.valid is False
    assert "60.0 ms, past its bound of 50.0 ms" in figure.message, figure.message
    assert "at least as fast as `docker kill`" in figure.message
    # The evidence: the request and the median agent's late actions.
    a2 = [e.index for e in day.history.select(f="action", agent_id="a2")[1:]]
    assert reading.evidence[1:] == tuple(a2)
    assert request_to_last_action_ms(day.history, FINAL).value == 250.0


def test_the_p50_is_zero_when_no_agent_acted_after_the_request() -> None:
    day = fleet_under_load({"a1": [], "a2": []})
    [figure] = bounded_figures({"request_to_last_action_p50_ms": 100}, day.history, FINAL)
    assert (figure.reading.value, figure.within) == (0, True)


def test_an_agent_its_own_kill_already_held_is_not_counted_under_the_fleet_kill() -> None:
    # a1 was killed on its own first (requested at 60 ms); its action at 80 ms is late for
    # that kill (20 ms), and it is not stopped by the fleet kill at 100 ms at all.
    day = GameDay()
    day.action("a1", 50, sent_ms=50)
    day.action("a2", 50, sent_ms=50)
    day.kill_agent("a1", 60, 70)
    day.action("a1", 80, sent_ms=80)
    day.kill_fleet(100, 400)
    day.action("a2", 190, sent_ms=190)
    reading = request_to_last_action_p50_ms(day.history, FINAL)
    # The lower median of 20 ms (a1, under its own kill) and 90 ms (a2, under the fleet's).
    assert reading.value == pytest.approx(20.0, rel=1e-3)
    assert "2 of 2 stopped agents" in reading.detail, reading.detail

