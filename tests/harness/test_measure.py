"""Time-to-stop from a history, part by part, and its percentiles through the HDR histogram."""

from __future__ import annotations

import pytest

from harness.judge.time_to_stop import (
    TimeToStop,
    percentile_ms,
    percentiles,
    summarize,
    time_to_stop,
)
from harness.record.gameday import sandbox_observations
from tests.harness.builders import MS, GameDay, clean_game_day


def test_percentiles_of_known_samples() -> None:
    samples = [ms * MS for ms in range(1, 1001)]  # 1 ms .. 1000 ms
    result = percentiles(samples)
    assert result.count == 1000
    # Three significant figures: each within 0.1 % of the exact value.
    assert result.p50_us == pytest.approx(500_000, rel=1e-3)
    assert result.p90_us == pytest.approx(900_000, rel=1e-3)
    assert result.p99_us == pytest.approx(990_000, rel=1e-3)
    assert result.max_us == 1_000_000


def test_one_slow_agent_shows_in_p99_not_in_p50() -> None:
    result = percentiles([10 * MS] * 99 + [5_000 * MS])
    assert result.p50_us == pytest.approx(10_000, rel=1e-3)
    assert result.p99_us == pytest.approx(10_000, rel=1e-3)
    assert result.max_us == 5_000_000
    assert percentiles([10 * MS] * 98 + [5_000 * MS] * 2).p99_us == pytest.approx(
        5_000_000, rel=1e-3)


def test_percentiles_refuse_nothing_and_out_of_range() -> None:
    with pytest.raises(ValueError, match="no samples"):
        percentiles([])
    with pytest.raises(ValueError, match="outside"):
        percentiles([2 * 24 * 3600 * 10**9])


def test_percentile_in_ms_is_the_same_hdr_percentile() -> None:
    """The benchmarks' percentile of milliseconds agrees with the game days' one."""
    values_ms = [float(v) for v in range(1, 1001)]
    assert percentile_ms(values_ms, 50) == pytest.approx(500, rel=1e-3)
    assert percentile_ms(values_ms, 99) * 1000 == percentiles(
        [round(v * MS) for v in values_ms]).p99_us
    assert percentile_ms([0.25, 7.5], 99) == 7.5  # capped at the largest sample
    with pytest.raises(ValueError, match="no samples"):
        percentile_ms([], 50)


def test_time_to_stop_splits_into_its_parts_from_the_kill_invoke() -> None:
    day, final = clean_game_day()
    samples = {s.agent_id: s for s in time_to_stop(day.history, final)}
    kill = day.history.select(f="kill_fleet", type="invoke")[0]
    assert samples["a1"] == TimeToStop(
        agent_id="a1", kill_f="kill_fleet", kill_index=kill.index,
        kill_acknowledged_ns=20 * MS, last_action_ns=10 * MS, daemon_exit_ns=30 * MS,
        daemon_exit_code=3, sandbox_gone_ns=40 * MS, tasks_requeued_ns=25 * MS)
    # a2 did nothing after the switch was pulled; its task was read open 26 ms after.
    assert samples["a2"].last_action_ns is None
    assert samples["a2"].tasks_requeued_ns == 26 * MS
    assert samples["a2"].total_ns == 60 * MS
    assert samples["a1"].total_ns == 40 * MS


def test_summary_has_every_part_measured() -> None:
    day, final = clean_game_day()
    summary = summarize(time_to_stop(day.history, final))
    assert summary["kill_acknowledged"].count == 2
    assert summary["last_action"].count == 1
    assert summary["daemon_exit"].p50_us == pytest.approx(30_000, rel=1e-3)
    assert summary["daemon_exit"].max_us == 50_000
    assert summary["total"].max_us == 60_000


def test_an_agent_kill_measures_only_its_agent_and_stops_at_the_resume() -> None:
    day = GameDay()
    day.action("a2", 50)
    day.kill_agent("a1", 100, 105)
    day.action("a1", 103)
    day.action("a2", 150)
    day.seen("daemon_exit", "a1", 120, exit_code=3)
    day.resume_agent("a1", 200, 210)
    day.action("a1", 250)  # after the resume: not part of this stop
    (sample,) = time_to_stop(day.history)
    assert (sample.agent_id, sample.last_action_ns, sample.daemon_exit_ns) == ("a1", 3 * MS,
                                                                               20 * MS)
    assert sample.tasks_requeued_ns is None and sample.sandbox_gone_ns is None


def test_last_action_is_when_its_daemon_sent_it_not_when_the_puppet_saw_it() -> None:
    """Under load the puppet sees a request hundreds of ms after its daemon sent it; the last
    action is the send, the instant the no-action-after-kill rule judges too."""
    day = GameDay()
    day.action("a1", 90, sent_ms=80)  # sent before the switch was pulled: not after it
    day.kill_agent("a1", 100, 150)
    day.action("a1", 400, sent_ms=104)  # sent 4 ms after the invoke, seen 300 ms after
    day.action("a1", 130)  # no send stamp: counts from when the puppet saw it
    (sample,) = time_to_stop(day.history)
    assert sample.last_action_ns == 30 * MS, (
        "the last action must be the stamped request's send (4 ms) or the unstamped one's "
        f"receipt (30 ms), whichever is later, not a receipt of 300 ms: "
        f"got {sample.last_action_ns}")
    day2 = GameDay()
    day2.kill_agent("a1", 100, 150)
    day2.action("a1", 120, sent_ms=95)  # sent before the invoke, only seen after it
    assert time_to_stop(day2.history)[0].last_action_ns is None, (
        "a request sent before the switch was pulled is not an action after it")


def test_daemon_exit_and_sandbox_gone_are_each_the_time_the_control_plane_recorded() -> None:
    """The two parts come from two recorded times; a part not recorded is not measured
    (it once was, from one `ended_at` standing in for both)."""
    day = GameDay()
    day.kill_agent("a1", 100, 120)
    boxes = [{"id": "b1", "exit_code": 3, "state": "gone",
              "daemon_exited_at": "1970-01-01T00:00:00.130000+00:00",
              "gone_at": "1970-01-01T00:00:00.175000+00:00", "last_sync_at": None},
             {"id": "b2", "exit_code": None, "state": "running", "daemon_exited_at": None,
              "gone_at": None, "last_sync_at": "1970-01-01T00:00:00.050000+00:00"}]
    for box in boxes:
        for f, value, at_ns in sandbox_observations(box):
            day.history.observe("agent:a1", f, value, time_ns=at_ns)
    [sample] = time_to_stop(day.history)
    assert (sample.daemon_exit_ns, sample.daemon_exit_code) == (30 * MS, 3)
    assert sample.sandbox_gone_ns == 75 * MS
    assert [f for f, _, _ in sandbox_observations(boxes[1])] == ["home_sync"]
