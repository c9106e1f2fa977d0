"""The switches of two control planes side by side, from their journals."""

from __future__ import annotations

from typing import Any

from harness.report.side_by_side import deliveries, rows, table

MS = 1_000_000


def journal(dialect: str, version: str, samples: list[tuple[str, int, int | None]]
            ) -> dict[str, Any]:
    return {"dialect": dialect, "versions": {"covey": version}, "measurements": {
        "time_to_stop": {"samples_ns": [
            {"kill_f": f, "kill_acknowledged_ns": answer * MS,
             "daemon_exit_ns": None if exit_ms is None else exit_ms * MS,
             "daemon_exit_code": None if exit_ms is None else 3}
            for f, answer, exit_ms in samples]}}}


def test_each_dialect_and_switch_is_a_row_with_its_answers_and_exits() -> None:
    found = rows([
        journal("upstream", "458b742", [("kill_agent", 17, 41), ("kill_agent", 34, 68)]),
        journal("covey-gameday", "0.1", [("kill_fleet", 21, 53), ("kill_fleet", 52, None)])])
    assert [(r["dialect"], r["switch"], r["kills"]) for r in found] == [
        ("covey-gameday", "kill_fleet", 2), ("upstream", "kill_agent", 2)]
    text = table(found)
    assert "| upstream (458b742) | kill_agent | 2 | 17 to 34 ms (median 34) | none seen | " \
           "none seen | 41 to 68 ms (median 68) (2 exits) | 3 |" in text
    assert "53 to 53 ms (median 53) (1 exits)" in text, "a kill without an exit was counted"


def test_the_kill_message_is_timed_from_the_request_where_the_plane_records_it() -> None:
    j = journal("covey-gameday", "0.1", [("kill_agent", 80, 130)])
    sample = j["measurements"]["time_to_stop"]["samples_ns"][0]
    sample.update(agent_id="a", kill_index=0)
    history = [{"f": "kill_agent", "time_ns": 1_000 * MS},
               {"f": "kill_delivery", "value": {"agent_id": "b", "sent_ns": 1_005 * MS}},
               {"f": "kill_delivery", "value": {"agent_id": "a", "sent_ns": 1_040 * MS,
                                                "acked_ns": 1_070 * MS}}]
    deliveries(j, history)
    assert (sample["kill_sent_ns"], sample["kill_acked_ns"]) == (40 * MS, 70 * MS)
    assert "| 40 to 40 ms (median 40) | 70 to 70 ms (median 70) |" in table(rows([j]))
