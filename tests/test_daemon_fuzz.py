"""A fuzzer of the daemon channel (issue 23): Hypothesis draws frames of every message type a
daemon sends after `ready` (NUL and lone surrogates, huge, negative and non-finite numbers,
deep nesting, multi-MiB strings, wrong types, unknown types, broken envelopes) and sends them
over one real WebSocket to a real control plane on loopback. Each frame comes with what must
follow it, judged from how it was built, not by the plane's own schema: answered with an error
naming a given field, answered with some error (a result for a task the session does not
hold), or accepted in silence (cleaned where it had to be). Throughout: no crashed handler
(uvicorn's "Exception in ASGI application", our "daemon message failed"), no 5xx from the API
beside it, the channel never dropped; after it, the session is not left running."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import structlog
import websockets
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from covey.orchestrator import LAYER_NAMES
from covey.protocol import DAEMON_STOPS, MAX_DETAIL_DEPTH, MESSAGES
from covey.testing.plane import World
from tests.daemon_channel import Channel, daemon_channel, session_settled

# At least 2,000 frames (issue 23); COVEY_FUZZ_FRAMES for a longer or a quicker run.
FRAMES = int(os.environ.get("COVEY_FUZZ_FRAMES", "2200"))
SYNC = "fuzz-sync-"  # the type of the probe after each frame: its error closes the frame's

# --- what a frame is made of ---------------------------------------------------------------

HOSTILE = st.sampled_from([
    "\x00", "\ud800", "\udbff", "\udc00", "\udfff", "A\x00B", "\x00\x00\x00", "\ufffd",
    "\U0001F600", "é", "\u2028", '"', "\\", "</script>", "%00", "'; DROP TABLE agents; --"])


def text(max_size: int) -> st.SearchStrategy[str]:
    return st.lists(st.one_of(st.text(max_size=6), HOSTILE), max_size=8).map(
        lambda parts: "".join(parts)[:max_size])


NUMBERS = st.one_of(
    st.integers(-(2**80), 2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**300, 1e308, -0.0, 5e-324]))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, text(64))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(text(16), inner, max_size=4)), max_leaves=12)
NOT_TEXT = st.one_of(st.none(), st.booleans(), NUMBERS, st.lists(SCALARS, max_size=3),
                     st.dictionaries(text(8), SCALARS, max_size=3))
NOT_TEXT_NOR_NULL = NOT_TEXT.filter(lambda v: v is not None)
NOT_BOOL = st.one_of(st.none(), NUMBERS, text(8), st.lists(SCALARS, max_size=2))
UUIDS = st.uuids().map(str)
FENCING = st.integers(0, 2**63 - 1)
STOPS = st.sampled_from(DAEMON_STOPS)
LABEL = text(64)


def _not_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return True
    return False


BAD_USD = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, 1e300, 10_000.5, -1e-9, 2**63, 10**30, -1]),
    st.floats(max_value=-1e-300), st.floats(min_value=10_000.001),
    st.none(), st.booleans(), text(8), st.lists(NUMBERS, max_size=2))
BAD_TOKENS = st.one_of(
    st.integers(max_value=-1), st.integers(min_value=2**31),
    st.sampled_from([2**63, 2**64, 1.5, math.nan, math.inf]), st.none(), st.booleans(),
    text(8))
BAD_FENCING = st.one_of(
    st.integers(max_value=-1), st.integers(min_value=2**63), st.sampled_from([0.5, math.nan]),
    st.none(), st.booleans(), text(8))
BAD_UUID = st.one_of(text(40).filter(_not_uuid), NUMBERS, st.none(), st.booleans())
BAD_STOP = st.one_of(text(16).filter(lambda s: s not in DAEMON_STOPS), NOT_TEXT)
BAD_LABEL = st.one_of(NOT_TEXT, st.text(min_size=65, max_size=300))


def nested(depth: int, leaf: Any = "\x00") -> Any:
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def depth_of(value: Any) -> int:
    """How many arrays and objects deep: the oracle's own count, not the plane's."""
    if isinstance(value, dict):
        return 1 + max((depth_of(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth_of(v) for v in value), default=0)
    return 0


BAD_TRIP = st.one_of(
    NOT_TEXT_NOR_NULL.filter(lambda v: not isinstance(v, dict)),
    st.fixed_dictionaries({"layer": text(12).filter(lambda s: s not in LAYER_NAMES)}),
    st.fixed_dictionaries({"layer": st.sampled_from(list(LAYER_NAMES)),
                           "steps": st.one_of(st.integers(max_value=-1),
                                              st.integers(min_value=2**31), text(4))}),
    st.integers(MAX_DETAIL_DEPTH, 60).map(lambda d: {"layer": "loop", "steps": nested(d)}))


@dataclass(frozen=True)
class Case:
    """A frame and what must follow it: `none` (no error), `error` (some error: a result
    for a task the session does not hold) or `field` (one error naming one of `fields`)."""

    what: str
    text: str
    answer: str
    fields: frozenset[str] = frozenset()


def frame(kind: Any, payload: Any, **extra: Any) -> str:
    return json.dumps({"type": kind, "payload": payload, **extra})


def accepted(kind: str, payload: dict[str, Any]) -> Case:
    return Case(f"{kind} accepted", frame(kind, payload), "none")


def rejected(kind: str, payload: dict[str, Any]) -> Case:
    return Case(f"{kind} for a task not held", frame(kind, payload), "error")


def refused(what: str, text_: str, *fields: str) -> Case:
    return Case(what, text_, "field", frozenset(fields))


# Well-formed frames of each type: silence, or an error for a task not held.
def _event(kind: str, status: str, detail: Any, extra: dict[str, Any]) -> Case:
    payload = {**extra, "kind": kind, "status": status, "detail": detail}
    if not isinstance(detail, dict):
        return refused("event detail not an object", frame("event", payload), "payload.detail")
    if depth_of(detail) > MAX_DETAIL_DEPTH:
        return refused("event too deep", frame("event", payload), "payload.detail")
    return accepted("event", payload)


EXTRA = st.dictionaries(text(12).filter(lambda k: k not in (
    "kind", "status", "detail", "busy", "usd", "tokens", "stop", "acked_ns", "task_id",
    "fencing_token", "result", "reason", "trip")), JSON, max_size=2)
WELL_FORMED = st.one_of(
    st.builds(lambda busy, extra: accepted("heartbeat", {**extra, "busy": busy}),
              st.booleans(), EXTRA),
    st.builds(_event, LABEL, LABEL, st.one_of(st.dictionaries(text(16), JSON, max_size=4),
                                              JSON), EXTRA),
    st.builds(lambda usd, tokens: accepted("cost", {"usd": usd, "tokens": tokens}),
              st.one_of(st.floats(0, 10_000), st.integers(0, 10_000)),
              st.integers(0, 2**31 - 1)),
    st.builds(lambda stop, detail: accepted("stopping", {"stop": stop, "detail": detail}),
              STOPS, st.one_of(st.none(), text(400))),
    st.builds(lambda stop, detail, acked: accepted("kill_ack", {
        "stop": stop, "detail": detail, "acked_ns": acked}),
        STOPS, st.one_of(st.none(), text(400)), JSON),
    st.builds(lambda t, f, r: rejected("task_done", {
        "task_id": t, "fencing_token": f, "result": r}), UUIDS, FENCING, text(2000)),
    st.builds(lambda t, f, r, trip: rejected("blocked", {
        "task_id": t, "fencing_token": f, "reason": r,
        **({} if trip is None else {"trip": trip})}),
        UUIDS, FENCING, text(300), st.one_of(st.none(), st.fixed_dictionaries(
            {"layer": st.sampled_from(list(LAYER_NAMES)), "steps": st.integers(0, 1000),
             "reason": text(100)}, optional={"last": JSON}))),
    # A trip's state too deep or too large to keep: kept as its summary, never refused.
    st.builds(lambda t, f, last: rejected("blocked", {
        "task_id": t, "fencing_token": f, "trip": {"layer": "loop", "steps": 4,
                                                   "reason": "\x00", "last": last}}),
        UUIDS, FENCING, st.one_of(st.integers(MAX_DETAIL_DEPTH, 60).map(nested),
                                  st.integers(9, 20).map(lambda n: ["\x00" * 9000] * n))),
)

# One field of a message wrong (or missing), the rest well formed.
BASES: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "heartbeat": st.just({"busy": False}),
    "event": st.fixed_dictionaries({"kind": LABEL, "status": LABEL,
                                    "detail": st.dictionaries(text(16), SCALARS, max_size=4)}),
    "cost": st.fixed_dictionaries({"usd": st.floats(0, 10), "tokens": st.integers(0, 999)}),
    "task_done": st.fixed_dictionaries({"task_id": UUIDS, "fencing_token": FENCING,
                                        "result": text(100)}),
    "blocked": st.fixed_dictionaries({"task_id": UUIDS, "fencing_token": FENCING,
                                      "reason": text(100)}),
    "stopping": st.fixed_dictionaries({"stop": STOPS, "detail": text(100)}),
    "kill_ack": st.fixed_dictionaries({"stop": STOPS, "detail": text(100)}),
}
MISSING = object()
WRONG: list[tuple[str, str, st.SearchStrategy[Any]]] = [
    ("heartbeat", "busy", NOT_BOOL),
    ("event", "kind", BAD_LABEL), ("event", "status", BAD_LABEL),
    ("event", "detail", st.integers(MAX_DETAIL_DEPTH + 1, 400).map(
        lambda d: {"deep": nested(d)})),
    ("event", "detail", st.integers(9, 20).map(lambda n: {"big": ["\x00" * 9000] * n})),
    ("event", "detail", st.one_of(NOT_TEXT.filter(lambda v: not isinstance(v, dict)),
                                  text(20))),
    ("cost", "usd", st.one_of(BAD_USD, st.just(MISSING))), ("cost", "tokens", BAD_TOKENS),
    *((kind, "task_id", st.one_of(BAD_UUID, st.just(MISSING)))
      for kind in ("task_done", "blocked")),
    *((kind, "fencing_token", st.one_of(BAD_FENCING, st.just(MISSING)))
      for kind in ("task_done", "blocked")),
    ("task_done", "result", NOT_TEXT), ("blocked", "reason", NOT_TEXT),
    ("blocked", "trip", BAD_TRIP),
    ("stopping", "stop", st.one_of(BAD_STOP, st.just(MISSING))),
    ("stopping", "detail", NOT_TEXT_NOR_NULL), ("kill_ack", "stop", BAD_STOP),
    ("kill_ack", "detail", NOT_TEXT_NOR_NULL),
]


def _one_wrong(kind: str, name: str, base: dict[str, Any], value: Any) -> Case:
    payload = {k: v for k, v in base.items() if k != name}
    if value is not MISSING:
        payload[name] = value
    return refused(f"{kind}.{name} wrong", frame(kind, payload), f"payload.{name}")


ONE_FIELD_WRONG = st.one_of(*(
    st.builds(_one_wrong, st.just(kind), st.just(name), BASES[kind], wrong)
    for kind, name, wrong in WRONG))


def _malformed(text_: str) -> bool:
    try:
        json.loads(text_)
    except ValueError:
        return True
    return False


KNOWN = st.sampled_from([k for k in MESSAGES if k != "ready"])
BROKEN_ENVELOPES = st.one_of(
    # (A text frame is UTF-8 on the wire: no lone surrogate can be sent raw.)
    st.builds(lambda t: refused("malformed JSON", t, "frame"),
              st.one_of(text(40), st.text(max_size=40)).map(
                  lambda t: t.encode("utf-8", "replace").decode()).filter(_malformed)),
    st.builds(lambda v: refused("not an object", json.dumps(v), "frame"),
              st.one_of(NOT_TEXT.filter(lambda v: not isinstance(v, dict)), text(20))),
    st.builds(lambda t, p: refused("type not text", frame(t, p), "type"), NOT_TEXT, JSON),
    st.builds(lambda p: refused("no type", json.dumps({"payload": p}), "type"), JSON),
    st.builds(lambda t, p: refused("unknown type", frame(t, p), "type"),
              text(80).filter(lambda t: t not in MESSAGES and not t.startswith(SYNC)), JSON),
    st.builds(lambda p: refused("ready again", frame("ready", p), "type"),
              st.fixed_dictionaries({"agent_id": UUIDS, "sandbox_id": UUIDS})),
    st.builds(lambda k, p: refused("payload not an object", frame(k, p), "payload"),
              KNOWN, NOT_TEXT.filter(lambda v: not isinstance(v, dict))),
    # Nested beyond the detail's limit but readable, and beyond what JSON reading allows.
    st.builds(lambda d: refused("deep detail", '{"type": "event", "payload": {"detail": '
                                '{"d": ' + "[" * d + "]" * d + "}}}", "payload.detail"),
              st.integers(MAX_DETAIL_DEPTH, 900)),
    st.builds(lambda d: refused("too deep to read", '{"type": "event", "payload": {"detail": '
                                + "[" * d + "]" * d + "}}", "frame"),
              st.sampled_from([5_000, 100_000, 1_000_000])),
)


def _huge(where: str, mib: float, filler: str) -> Case:
    # Within the WebSocket server's own 16 MiB (beyond it the server closes, by design).
    blob = filler * int(mib * 2**20 / len(json.dumps(filler)[1:-1].encode()))
    payloads = {
        "event.detail": ("event", {"detail": {"args": {"content": blob}}}),
        "task_done.result": ("task_done", {"task_id": str(uuid.uuid4()), "fencing_token": 1,
                                           "result": blob}),
        "type": (blob, {}),
        "unknown field": ("heartbeat", {"pad": blob}),
    }
    kind, payload = payloads[where]
    return refused(f"{mib} MiB in {where}", frame(kind, payload), "frame")


def _large_event(mib: float) -> Case:
    """Under the frame limit, over every string limit: kept, its strings cut."""
    return accepted("event", {"kind": "tool", "detail": {"content": "A\x00B" * int(
        mib * 2**20 / 8)}})


HUGE = st.one_of(
    st.builds(_huge, st.sampled_from(["event.detail", "task_done.result", "type",
                                      "unknown field"]),
              st.sampled_from([2.5, 4.0, 9.0]), st.sampled_from(["x", "\x00y", "é\ud800"])),
    st.builds(_large_event, st.sampled_from([0.5, 1.5])))

# Weighted by repetition: the expensive multi-MiB frames are one draw in about twenty.
CASES = st.sampled_from(["well"] * 7 + ["wrong"] * 7 + ["envelope"] * 5 + ["huge"]).flatmap(
    {"well": WELL_FORMED, "wrong": ONE_FIELD_WRONG, "envelope": BROKEN_ENVELOPES,
     "huge": HUGE}.__getitem__)


# --- the run --------------------------------------------------------------------------------

@dataclass
class Fuzz:
    channel: Channel
    sent: int = 0
    bytes_sent: int = 0
    by_what: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    last: Case | None = None

    async def send(self, case: Case) -> None:
        """The frame, then a probe of an unknown type: the probe's error comes after every
        answer to the frame (the plane answers in order), and closes them."""
        self.sent += 1
        self.last = case
        self.bytes_sent += len(case.text)
        self.by_what[case.what] = self.by_what.get(case.what, 0) + 1
        probe = f"{SYNC}{self.sent}"
        ws = self.channel.ws
        await ws.send(case.text)
        await ws.send(json.dumps({"type": probe, "payload": {}}))
        errors = []
        async with asyncio.timeout(30):
            while True:
                message = json.loads(await ws.recv())
                if message["type"] != "error":
                    continue  # leases, and the like
                if message["payload"].get("error") == f"Unknown message type {probe!r}":
                    break
                errors.append(message["payload"])
        wrong = self.judge(case, errors)
        if wrong:
            self.failures.append(f"{case.what}: {wrong}; frame {case.text[:300]!r}")

    @staticmethod
    def judge(case: Case, errors: list[dict[str, Any]]) -> str | None:
        if any(e.get("error") == "Internal error" for e in errors):
            return f"internal error: {errors}"
        if case.answer == "none":
            return f"refused: {errors}" if errors else None
        if not errors:
            return "not answered"
        if case.answer == "field":
            if len(errors) != 1 or errors[0].get("field") not in case.fields:
                return f"expected one error naming {sorted(case.fields)}, got {errors}"
        return None


class Crashes(logging.Handler):
    """uvicorn's and asyncio's error lines: a crashed handler, a task's lost exception."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def watching_for_crashes() -> Iterator[tuple[Crashes, list[dict[str, Any]]]]:
    crashes = Crashes()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "uvicorn", "asyncio")]
    for logger in loggers:
        logger.addHandler(crashes)
    try:
        with structlog.testing.capture_logs() as ours:
            yield crashes, ours
    finally:
        for logger in loggers:
            logger.removeHandler(crashes)


async def poll_the_api(world: World, agent_id: uuid.UUID, statuses: list[int]) -> None:
    """The API beside the fuzzed channel, reading what the fuzzer made the plane store."""
    while True:
        for path in (f"/api/v1/agents/{agent_id}/recording", f"/api/v1/agents/{agent_id}",
                     "/healthz"):
            try:
                statuses.append((await world.org_admin.get(path)).status_code)
            except httpx.HTTPError:
                statuses.append(-1)
        await asyncio.sleep(0.5)


def _errors(logged: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logged if e.get("log_level") in ("error", "critical")
            or e.get("event") == "daemon message failed"]


@pytest.mark.slow
# Hypothesis draws in a thread of its own while the plane and this channel run on the loop,
# and it takes a change of the global `random` state during a draw for a strategy using
# `random`. None of ours does: the change is a WebSocket keepalive's ping payload
# (`random.getrandbits`, uvicorn's and websockets'), sent on the loop meanwhile.
@pytest.mark.filterwarnings(
    "ignore:Do not use the `random` module inside strategies"
    ":hypothesis.errors.HypothesisDeprecationWarning")
async def test_daemon_frame_fuzzer(world: World) -> None:
    loop = asyncio.get_running_loop()
    statuses: list[int] = []
    started = time.monotonic()
    with watching_for_crashes() as (crashes, ours):
        async with daemon_channel(world) as channel:
            fuzz = Fuzz(channel)
            poller = asyncio.create_task(poll_the_api(world, channel.agent_id, statuses))

            # Phase.generate only: every frame goes to the same live channel, so a replay
            # while shrinking would not meet the state the failing frame met. The first
            # failures are reported with their frames instead.
            @settings(max_examples=FRAMES, deadline=None, database=None,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=CASES)
            def one_frame(case: Case) -> None:
                asyncio.run_coroutine_threadsafe(fuzz.send(case), loop).result(60)

            try:
                await asyncio.to_thread(one_frame)
            except websockets.ConnectionClosed as closed:
                last = fuzz.last.text[:300] if fuzz.last else None
                pytest.fail(f"the plane closed the fuzzed channel ({closed}) after "
                            f"{fuzz.sent} frames, the last {last!r}; failures before: "
                            f"{fuzz.failures[:5]}; covey's errors: {_errors(ours)[:3]}")
            finally:
                poller.cancel()
            elapsed = time.monotonic() - started
        await session_settled(world, channel.sandbox_id)
    print(f"\nfuzzer: {fuzz.sent} frames, {fuzz.bytes_sent / 2**20:.0f} MiB in {elapsed:.1f}s;"
          f" {len(statuses)} API reads beside it; by kind: {sorted(fuzz.by_what.items())}")
    assert fuzz.sent >= 2_000, f"only {fuzz.sent} frames sent"
    assert not fuzz.failures, "\n".join(
        [f"{len(fuzz.failures)} of {fuzz.sent} frames misanswered:", *fuzz.failures[:10]])
    assert not crashes.lines, f"crash lines in the log: {crashes.lines[:5]}"
    assert not _errors(ours), f"error lines in covey's log: {_errors(ours)[:5]}"
    assert statuses and all(0 < s < 500 for s in statuses), sorted(set(statuses))
    # Its work was settled, never left in progress: back in the backlog with the daemon, or
    # failed once its results had been refused more often than a task is retried.
    task = await world.db.fetchrow(
        "SELECT t.state, t.result FROM backlog_tasks t JOIN sessions s"
        " ON s.agent_id=t.agent_id WHERE s.sandbox_id=$1", channel.sandbox_id)
    assert task["state"] == "open" or (
        task["state"] == "failed" and "was refused" in task["result"]), dict(task)
