"""The daemon channel's one boundary (covey/protocol.py): a frame Postgres could not store, a
number out of bounds or a frame too large is answered with an error naming the field, never a
crashed handler; a model's NUL is cleaned, recorded, and never fails its task."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from covey import coveyd, protocol
from covey.protocol import ProtocolError, read_frame
from covey.testing.plane import World
from covey.tools import Toolbox
from tests.daemon_channel import as_json, daemon_channel, session_settled

TASK = str(uuid.uuid4())


def _frame(kind: Any, payload: Any = None, **envelope: Any) -> str:
    return json.dumps({"type": kind, "payload": {} if payload is None else payload,
                       **envelope})


def _refused(text: str) -> ProtocolError:
    with pytest.raises(ProtocolError) as refused:
        read_frame(text)
    return refused.value


@pytest.mark.parametrize(("payload", "field"), [
    ({"usd": float("nan")}, "payload.usd"),
    ({"usd": float("inf")}, "payload.usd"),
    ({"usd": 1e300}, "payload.usd"),
    ({"usd": -0.01}, "payload.usd"),
    ({"usd": "0.1"}, "payload.usd"),
    ({"usd": True}, "payload.usd"),
    ({}, "payload.usd"),
    ({"usd": 0.1, "tokens": 2**63}, "payload.tokens"),
    ({"usd": 0.1, "tokens": 2**31}, "payload.tokens"),
    ({"usd": 0.1, "tokens": -1}, "payload.tokens"),
    ({"usd": 0.1, "tokens": 1.5}, "payload.tokens"),
])
def test_cost_out_of_bounds_is_refused_naming_the_field(payload: dict[str, Any],
                                                        field: str) -> None:
    refused = _refused(_frame("cost", payload))
    assert refused.field == field, refused.answer()
    assert refused.answer()["type"] == "cost" and refused.hint.startswith(field)


@pytest.mark.parametrize(("text", "field"), [
    ("{not json", "frame"),
    ("[1, 2]", "frame"),
    ("[" * 100_000 + "]" * 100_000, "frame"),  # too deep to read at all
    (_frame(5), "type"),
    (_frame("teleport"), "type"),
    (_frame("te\x00le\ud800port"), "type"),
    (json.dumps({"type": "event", "payload": [1]}), "payload"),
    (_frame("event", {"kind": "x" * 65}), "payload.kind"),
    (_frame("event", {"kind": 7}), "payload.kind"),
    (_frame("event", {"detail": {"d": json.loads("[" * 16 + "]" * 16)}}), "payload.detail"),
    (_frame("event", {"detail": {"d": json.loads("[" * 900 + "]" * 900)}}), "payload.detail"),
    (_frame("event", {"detail": {"d": ["x" * 8_000] * 9}}), "payload.detail"),  # 72 KB, cut
    (_frame("event", {"detail": ["not", "an", "object"]}), "payload.detail"),
    (_frame("event", {"detail": None}), "payload.detail"),
    (_frame("heartbeat", {"busy": "yes"}), "payload.busy"),
    (_frame("task_done", {"task_id": "nope", "fencing_token": 1}), "payload.task_id"),
    (_frame("task_done", {"task_id": TASK, "fencing_token": 2**63}), "payload.fencing_token"),
    (_frame("task_done", {"task_id": TASK, "fencing_token": True}), "payload.fencing_token"),
    (_frame("task_done", {"task_id": TASK, "fencing_token": 1, "result": 5}), "payload.result"),
    (_frame("blocked", {"task_id": TASK, "fencing_token": 1, "trip": {"layer": "nap"}}),
     "payload.trip"),
    (_frame("blocked", {"task_id": TASK, "fencing_token": 1,
                        "trip": {"layer": "loop", "steps": 2**40}}), "payload.trip"),
    (_frame("stopping", {"stop": "vanish"}), "payload.stop"),
    (_frame("stopping", {}), "payload.stop"),
    (_frame("event", {"detail": {"d": "\x00" * (3 << 20)}}), "frame"),  # 18 MB escaped
    (_frame("task_done", {"task_id": TASK, "fencing_token": 1, "result": "é" * (2 << 20)}),
     "frame"),
])
def test_bad_frames_name_what_is_wrong(text: str, field: str) -> None:
    refused = _refused(text)
    assert refused.field == field, refused.answer()
    assert refused.error and refused.hint


def test_a_models_text_is_cleaned_and_the_cleaning_reported() -> None:
    frame = read_frame(_frame("task_done", {"task_id": TASK, "fencing_token": 3,
                                            "result": "A\x00B\ud800C\U0001F600"}))
    assert isinstance(frame.message, protocol.TaskDone)
    assert frame.message.result == "A\ufffdB\ufffdC\U0001F600"
    assert frame.cleaned == ("payload.result: 2 NUL or lone surrogate character(s) replaced "
                             "by U+FFFD",)

    detail = {"tool": "write_file", "args": {"content": "A\x00B", "k\x00ey": [float("nan")]},
              "big": "x" * 10_000, "n": 2**70}
    frame = read_frame(_frame("event", {"kind": "tool", "status": "ok", "detail": detail}))
    assert isinstance(frame.message, protocol.Event)
    assert frame.message.detail == {
        "tool": "write_file", "args": {"content": "A\ufffdB", "k\ufffdey": ["nan"]},
        "big": "x" * protocol.MAX_DETAIL_STRING, "n": 2**70}
    assert [c.split(":")[0] for c in frame.cleaned] == [
        "payload.detail.args.content", "payload.detail.args.k\ufffdey (its key)",
        "payload.detail.args.k\ufffdey[0]", "payload.detail.big"]

    # A trip's last actions carry the model's arguments: too large, it is kept as a summary.
    state = {"layer": "loop", "reason": "same call 4 times", "steps": 4, "cost_usd": 0.01,
             "last_actions": [{"tool": "write_file", "args": {"content": "x\x00" * 9000}}] * 10}
    trip = read_frame(_frame("blocked", {"task_id": TASK, "fencing_token": 3, "trip": state}))
    assert isinstance(trip.message, protocol.Blocked)
    assert trip.message.trip == {"layer": "loop", "reason": "same call 4 times", "steps": 4,
                                 "cost_usd": 0.01}
    assert trip.cleaned[-1].startswith("payload.trip: cut to its summary (at most 65536"), trip

    long = read_frame(_frame("task_done", {"task_id": TASK, "fencing_token": 3,
                                           "result": "r" * 150_000}))
    assert isinstance(long.message, protocol.TaskDone)
    assert len(long.message.result) == protocol.MAX_RESULT_CHARS
    assert long.cleaned == ("payload.result: cut from 150000 to 100000 characters",)


def test_unknown_fields_are_ignored_and_defaults_hold() -> None:
    """A daemon a version ahead (a rolling upgrade) is still heard."""
    frame = read_frame(_frame("event", {"new_field": {"x": 1}}))
    assert frame.message == protocol.Event(kind="event", status="info", detail={})
    assert frame.cleaned == ()
    ack = read_frame(_frame("kill_ack", {"acked_ns": "whenever", "exit_code": 3}))
    assert isinstance(ack.message, protocol.KillAck) and ack.message.stop == "kill"


@pytest.mark.parametrize(("tool", "args"), [
    ("shell", {"cmd": "echo a\x00b"}),
    ("write_file", {"path": "a\x00b", "content": "x"}),
    ("write_file", {"path": "ok.txt", "content": "x\ud800"}),
    ("read_file", {"path": "a\x00"}),
])
async def test_a_models_nul_in_a_tool_call_is_the_tools_error(tool: str, args: dict[str, Any],
                                                              tmp_path: Path) -> None:
    """Not the daemon's: that escaped its run, lost it, and failed the task."""
    result, ok = await Toolbox(tmp_path, None).run(tool, args)  # type: ignore[arg-type]
    assert not ok and result["error"], result


def test_the_daemon_cuts_results_where_the_plane_does() -> None:
    assert coveyd.MAX_RESULT_CHARS == protocol.MAX_RESULT_CHARS
    # A result at the limit fits the frame limit, whatever its characters.
    worst = _frame("task_done", {"task_id": TASK, "fencing_token": 2**63 - 1,
                                 "result": "\U0001F600" * protocol.MAX_RESULT_CHARS})
    assert len(worst.encode()) <= protocol.MAX_FRAME_BYTES
    read_frame(worst)


async def test_a_models_nul_never_fails_its_task(world: World) -> None:
    """With the real coveyd, a tool call `write_file{"content": "A\\u0000B"}` crashed the
    handler six times and failed its task. Now its event and its result are cleaned, the
    task is done, and the recording says what was cleaned."""
    async with daemon_channel(world, ("hold", "hold")) as channel:
        task = channel.task
        await channel.send("event", {"kind": "tool", "status": "ok", "detail": {
            "tool": "write_file", "args": {"path": "a.txt", "content": "A\x00B\ud800"}}})
        await channel.send("task_done", {"task_id": task["task_id"],
                                         "fencing_token": task["fencing_token"],
                                         "result": "wrote A\x00B"})
        second = (await channel.next("assign_task", "error"))
        assert second["type"] == "assign_task", second
        assert second["payload"]["task_id"] != task["task_id"]
    task_id = uuid.UUID(task["task_id"])
    row = await world.db.fetchrow("SELECT state, result FROM backlog_tasks WHERE id=$1",
                                  task_id)
    assert (row["state"], row["result"]) == ("done", "wrote A\ufffdB")
    detail = await world.db.fetchval(
        "SELECT detail FROM recording_events WHERE agent_id=$1 AND kind='tool'",
        channel.agent_id)
    assert as_json(detail)["args"]["content"] == "A\ufffdB\ufffd"
    cleaned = [as_json(r["detail"]) for r in await world.db.fetch(
        "SELECT detail FROM recording_events WHERE agent_id=$1 AND kind='protocol'"
        " AND status='cleaned' ORDER BY id", channel.agent_id)]
    assert [c["type"] for c in cleaned] == ["event", "task_done"], cleaned
    assert cleaned[1]["task_id"] == task["task_id"]
    assert cleaned[1]["cleaned"][0].startswith("payload.result: 1 NUL")
    r = await world.org_admin.get(f"/api/v1/agents/{channel.agent_id}/recording")
    assert r.status_code == 200, r.text
    await session_settled(world, channel.sandbox_id)


async def test_bad_frames_are_answered_and_the_channel_goes_on(world: World) -> None:
    """The eight frames of issue 23 that each crashed the handler: each is answered now,
    naming the field, and the daemon is still heard after them."""
    async with daemon_channel(world) as channel:
        ids = {"task_id": channel.task["task_id"],
               "fencing_token": channel.task["fencing_token"]}
        refused = [
            ("cost", {"usd": 1e300, "tokens": 1}, "payload.usd"),
            ("cost", {"usd": 0.1, "tokens": 2**63}, "payload.tokens"),
            ("event", {"kind": "k" * 100}, "payload.kind"),
            ("event", {"detail": "\x00" * (1 << 20)}, "frame"),  # 6 MiB escaped
            ("stopping", {"stop": "sleep\x00"}, "payload.stop"),
        ]
        for kind, payload, field in refused:
            await channel.send(kind, payload)
            answer = (await channel.next("error"))["payload"]
            assert answer["field"] == field, (kind, answer)
        # Cleaned, not refused: nothing to answer; the channel still works after all that.
        await channel.send("event", {"kind": "n\x00te", "status": "\ud800",
                                     "detail": {"\x00": "\x00"}})
        await channel.send("stopping", {"stop": "error", "detail": "x\x00" * 1000})
        await channel.send("task_done", {**ids, "result": "done"})
        last = await channel.next("sleep", "error")
        assert last["type"] == "sleep", last
    row = await world.db.fetchrow(
        "SELECT kind, status, detail FROM recording_events WHERE agent_id=$1"
        " AND kind LIKE 'n%'", channel.agent_id)
    assert (row["kind"], row["status"], as_json(row["detail"])) == (
        "n\ufffdte", "\ufffd", {"\ufffd": "\ufffd"})
    stop = await world.db.fetchrow(
        "SELECT daemon_stop, daemon_stop_detail FROM sessions WHERE sandbox_id=$1",
        channel.sandbox_id)
    assert stop["daemon_stop"] == "error"
    assert stop["daemon_stop_detail"] == ("x\ufffd" * 150), stop
    assert await world.task_state(channel.task["task_id"]) == "done"
    await session_settled(world, channel.sandbox_id)


REFUSED_RESULTS = [
    ("task_done", "result", ["not", "text"], "payload.result"),
    ("task_done", "result", "é" * (2 << 20), "frame"),  # over the frame's size cap
    ("blocked", "trip", {"layer": "telepathy"}, "payload.trip"),
]


@pytest.mark.parametrize(("kind", "name", "value", "field"), REFUSED_RESULTS)
async def test_a_refused_result_puts_its_task_back_at_once(
        world: World, kind: str, name: str, value: Any, field: str) -> None:
    """Answered with an error, the task was left in progress for as long as its daemon
    stayed connected. Now it goes back at once, as after a daemon loss, and the daemon is
    given it again."""
    async with daemon_channel(world) as channel:
        task = channel.task
        await channel.send(kind, {"task_id": task["task_id"],
                                  "fencing_token": task["fencing_token"], name: value})
        answer = (await channel.next("error"))["payload"]
        assert (answer["field"], answer["type"]) == (field, kind), answer
        try:
            async with asyncio.timeout(10):
                again = await channel.next("assign_task", "sleep", "error")
        except TimeoutError:
            raise AssertionError(f"the task whose {kind} was refused stayed in progress: "
                                 "nothing was handed out within 10 s") from None
        assert again["type"] == "assign_task", (
            f"the task whose {kind} was refused was not put back and handed out again: {again}")
        assert again["payload"]["task_id"] == task["task_id"]
        assert again["payload"]["fencing_token"] != task["fencing_token"]
        # Read while the channel is open: its close is a daemon loss of its own (retry 2).
        row = await world.db.fetchrow(
            "SELECT daemon_retries, (SELECT note FROM task_transitions WHERE task_id=t.id"
            " AND to_state='open' AND from_state='in_progress' ORDER BY id LIMIT 1) AS note"
            " FROM backlog_tasks t WHERE id=$1", uuid.UUID(task["task_id"]))
    assert row["daemon_retries"] == 1 and f"its {kind} was refused" in row["note"], dict(row)
    await session_settled(world, channel.sandbox_id)


async def test_a_result_refused_past_the_retries_fails_its_task_saying_why(
        world: World) -> None:
    async with daemon_channel(world) as channel, asyncio.timeout(30):
        task, retries = channel.task, world.plane.orch.settings.max_daemon_retries
        for attempt in range(retries + 1):
            await channel.send("task_done", {"task_id": task["task_id"],
                                             "fencing_token": task["fencing_token"],
                                             "result": ["not", "text"]})
            await channel.next("error")
            task = (await channel.next("assign_task", "sleep"))["payload"] \
                if attempt < retries else task
        assert (await channel.next("sleep", "assign_task"))["type"] == "sleep"
    row = await world.db.fetchrow("SELECT state, result FROM backlog_tasks WHERE id=$1",
                                  uuid.UUID(task["task_id"]))
    assert row["state"] == "failed", dict(row)
    assert "its task_done was refused: Invalid task_done message (payload.result)" in (
        row["result"]), row["result"]


async def test_a_kill_ack_counts_whatever_its_payload(world: World) -> None:
    """A daemon that obeyed its kill has obeyed, even if the rest of its last word is out of
    protocol: the kill's answer lists it as acknowledged, and its bad field is answered."""
    async with daemon_channel(world) as channel:
        killing = asyncio.create_task(
            world.security.post(f"/api/v1/agents/{channel.agent_id}/kill"))
        await channel.next("kill")
        await channel.send("kill_ack", {"stop": "obeyed\x00", "acked_ns": -5})
        answer = (await channel.next("error"))["payload"]
        assert (answer["field"], answer["type"]) == ("payload.stop", "kill_ack"), answer
        r = await killing
        assert r.status_code == 200, r.text
    session_id = await world.db.fetchval("SELECT id FROM sessions WHERE sandbox_id=$1",
                                         channel.sandbox_id)
    assert r.json()["sessions_acknowledged"] == [str(session_id)], r.text
    await session_settled(world, channel.sandbox_id)


async def test_costs_and_events_said_together_are_each_booked_once_in_order(
        world: World) -> None:
    """Two working daemons' costs and tool events, sent back to back, are written a batch
    per statement (a busy fleet's chatter must not take a commit each): every one is booked
    once, each session's cost is its own sum, and each daemon's events keep its order."""
    async with daemon_channel(world) as one, daemon_channel(world) as two:
        for i in range(40):
            for channel, usd in ((one, 0.001), (two, 0.002)):
                await channel.send("cost", {"usd": usd, "tokens": 10})
                await channel.send("event", {"kind": "tool", "status": "ok",
                                             "detail": {"step": i}})
        for channel in (one, two):
            await channel.send("task_done", {"task_id": channel.task["task_id"],
                                             "fencing_token": channel.task["fencing_token"],
                                             "result": "done"})
            assert (await channel.next("sleep", "error"))["type"] == "sleep"
    for channel, usd in ((one, 0.001), (two, 0.002)):
        booked = await world.db.fetchrow(
            "SELECT count(*) AS n, sum(tokens) AS tokens FROM cost_entries WHERE agent_id=$1",
            channel.agent_id)
        assert (booked["n"], booked["tokens"]) == (40, 400), dict(booked)
        cost = await world.db.fetchval("SELECT cost_usd FROM sessions WHERE sandbox_id=$1",
                                       channel.sandbox_id)
        assert float(cost) == pytest.approx(40 * usd), cost
        steps = [as_json(r["detail"])["step"] for r in await world.db.fetch(
            "SELECT detail FROM recording_events WHERE agent_id=$1 AND kind='tool'"
            " ORDER BY id", channel.agent_id)]
        assert steps == list(range(40)), steps
        await session_settled(world, channel.sandbox_id)
