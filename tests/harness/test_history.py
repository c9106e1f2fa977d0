"""The history records operations as Jepsen does and survives a trip through a jsonl file."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.record.history import Event, History
from tests.harness.builders import MS, clean_game_day


def test_jsonl_round_trip_keeps_every_event(tmp_path: Path) -> None:
    day, _ = clean_game_day()
    path = tmp_path / "history.jsonl"
    day.history.to_jsonl(path)
    read = History.from_jsonl(path)
    assert read.events == day.history.events
    assert len(path.read_text().splitlines()) == len(day.history)
    kill = read.select(f="kill_fleet", type="invoke")[0]
    completion = read.completion_of(kill)
    assert completion is not None and completion.type == "ok"
    assert read.invocation_of(completion) == kill


def test_a_file_with_an_event_out_of_place_is_refused(tmp_path: Path) -> None:
    day, _ = clean_game_day()
    path = tmp_path / "history.jsonl"
    day.history.to_jsonl(path)
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[1], lines[0], *lines[2:]]) + "\n")
    with pytest.raises(ValueError, match="out of place"):
        History.from_jsonl(path)


def test_indexes_increase_and_completions_point_at_their_invoke() -> None:
    history = History(clock=iter(range(0, 10_000, 10)).__next__)
    kill_a1 = history.invoke("operator:owner", "kill_agent", {"agent_id": "a1"})
    kill_a2 = history.invoke("operator:owner", "kill_agent", {"agent_id": "a2"})
    # Two requests in flight from one operator: each completion names its own invoke.
    done_a2 = history.complete(kill_a2, "ok", {"already_killed": False})
    done_a1 = history.complete(kill_a1, "info", {"error": "timeout"})
    assert [e.index for e in history] == [0, 1, 2, 3]
    assert [e.time_ns for e in history] == [0, 10, 20, 30]
    assert (done_a2.invoke_index, done_a1.invoke_index) == (1, 0)
    assert done_a1.process == "operator:owner" and done_a1.f == "kill_agent"
    assert history.select(agent_id="a1") == [kill_a1]
    ops = history.operations("kill_agent")
    assert [(op.agent_id, op.type, op.start_ns, op.end_ns) for op in ops] == [
        ("a1", "info", 0, None), ("a2", "ok", 10, 20)]
    assert ops[1].value == {"agent_id": "a2", "already_killed": False}
    assert ops[1].indexes == (1, 2)


def test_a_pending_invoke_reads_as_an_unknown_outcome() -> None:
    history = History(clock=lambda: 5)
    history.invoke("operator:security", "kill_fleet")
    (op,) = history.operations()
    assert (op.type, op.end_ns) == ("info", None)


def test_an_operation_cannot_be_completed_twice_nor_by_an_invoke() -> None:
    history = History()
    kill = history.invoke("operator:security", "kill_fleet")
    history.complete(kill, "ok")
    with pytest.raises(ValueError, match="already completed"):
        history.complete(kill, "fail")
    with pytest.raises(ValueError, match="cannot complete"):
        history.complete(kill, "invoke")
    observed = history.observe("observer", "task_state", {"task_id": "t1", "state": "open"})
    with pytest.raises(ValueError, match="not an invoke"):
        history.complete(observed, "ok")


def test_observations_keep_their_own_time_and_agent() -> None:
    history = History(clock=lambda: 999)
    action = history.observe("agent:a7", "action", {"tool": "shell"}, time_ns=3 * MS)
    assert (action.time_ns, action.agent_id, action.type) == (3 * MS, "a7", "ok")
    assert Event.from_json(action.to_json()) == action
