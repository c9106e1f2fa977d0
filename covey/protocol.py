"""The daemon protocol's one boundary: every frame a daemon sends is read here, against a
schema, before anything handles it (DESIGN §2.4; the limits are in the README's "The daemon
protocol").

Why one boundary: values Postgres cannot store, sent after a valid `ready` (a NUL in an
event's detail or a task's result, `cost.usd = 1e300`, `tokens = 2**63`), once reached the
database, crashed the handler ("Exception in ASGI application") and left the session running
and its task in progress until the stale sweep. With the real coveyd, one NUL that a model
wrote into a tool call failed its task after five requeues. And a 16 MiB event was stored
whole. Checks spread over the handlers had missed each of these. So here:

* a frame is at most MAX_FRAME_BYTES; a larger one is refused unread;
* identifiers (the type, ids, fencing tokens, stop kinds, guard layers) and numbers are
  refused when wrong or out of bounds, naming the field;
* free text (results, reasons, details) is cleaned, not refused: a NUL or a lone surrogate
  is the model's doing and the daemon only carries it, so refusing it would fail the task.
  Over-long free text is cut. Every cleaning and cut is reported (`Frame.cleaned`), and the
  handler records it;
* JSON the daemon passes through (an event's detail, a guard trip's state: objects both) has
  its strings cleaned and cut, its NaN and infinities written as strings, at most
  MAX_DETAIL_DEPTH levels and MAX_DETAIL_BYTES once cleaned (a trip's state beyond that is
  cut to its summary, not refused: a refused trip report would be a trip lost).

Unknown payload fields are ignored, not refused: a daemon one version ahead of its control
plane (a rolling upgrade) must still be heard.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args
from uuid import UUID

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    ValidationError,
    ValidationInfo,
)

from covey.api.models import NUMBER, cleaned_text
from covey.orchestrator import LAYER_NAMES

# A frame's size, in UTF-8 bytes: a task's result at its limit fits, every character of it
# escaped. (The WebSocket server itself closes a connection at 16 MiB, uvicorn's default.)
MAX_FRAME_BYTES = 2 << 20
# A task's result (task_done.result, blocked.reason): longer is cut.
MAX_RESULT_CHARS = 100_000
# An event's kind and status, a daemon's version: longer is refused (the daemon's own code
# writes them, not a model).
MAX_LABEL_CHARS = 64
# Why a daemon stopped (stopping.detail, kill_ack.detail): longer is cut.
MAX_STOP_DETAIL_CHARS = 300
# JSON passed through (event.detail, blocked.trip): each string cut at MAX_DETAIL_STRING
# characters, at most MAX_DETAIL_DEPTH levels deep, at most MAX_DETAIL_BYTES once cleaned (as
# the database receives it: JSON text, non-ASCII escaped).
MAX_DETAIL_STRING = 8_192
MAX_DETAIL_DEPTH = 16
MAX_DETAIL_BYTES = 64 << 10
# One model call's cost. Postgres's numeric(12,6) ends below a million; a call dearer than
# this is a broken price table, and the guard has long tripped on its budget.
MAX_COST_USD = 10_000.0
# Postgres's integer (one call's tokens, a trip's steps) and bigint (fencing tokens).
MAX_INTEGER = 2**31 - 1
MAX_BIGINT = 2**63 - 1
# Why a daemon says it stopped (coveyd.Stop): an obeyed kill, a lapsed lease, its own guard,
# a sleep, an error.
Stop = Literal["kill", "lease", "guard", "sleep", "error"]
DAEMON_STOPS: tuple[str, ...] = get_args(Stop)
# How many cleanings one frame reports: a list of ten thousand NUL-bearing strings is one
# cleaning story, not ten thousand.
MAX_CLEANING_NOTES = 20


class ProtocolError(Exception):
    """A frame refused: the daemon is answered with an `error` frame naming `field`, and the
    channel goes on."""

    def __init__(self, error: str, hint: str, field: str | None = None,
                 kind: str | None = None) -> None:
        super().__init__(error)
        self.error = error
        self.hint = hint
        self.field = field
        self.kind = kind  # the frame's type, when it could be read

    def answer(self) -> dict[str, Any]:
        """The `error` frame's payload."""
        body: dict[str, Any] = {"error": self.error, "hint": self.hint}
        if self.field is not None:
            body["field"] = self.field
        if self.kind is not None:
            body["type"] = self.kind
        return body


class FatalProtocolError(ProtocolError):
    """Out of protocol in a way that ends the conversation: the daemon is lost at once."""


# --- the cleaning --------------------------------------------------------------------------

def _notes(info: ValidationInfo) -> list[str]:
    context = info.context
    notes: list[str] = context.setdefault("cleaned", []) if isinstance(context, dict) else []
    return notes


def _note(notes: list[str], path: str, what: str) -> None:
    if len(notes) < MAX_CLEANING_NOTES:
        notes.append(f"{path}: {what}")
    elif len(notes) == MAX_CLEANING_NOTES:
        notes.append("and more")


def _clean_string(value: str, limit: int | None, path: str, notes: list[str]) -> str:
    value, replaced = cleaned_text(value)
    if replaced:
        _note(notes, path, f"{replaced} NUL or lone surrogate character(s) replaced by U+FFFD")
    if limit is not None and len(value) > limit:
        _note(notes, path, f"cut from {len(value)} to {limit} characters")
        value = value[:limit]
    return value


def _free_text(limit: int | None) -> BeforeValidator:
    """Text a model may have written: cleaned, and cut at `limit`. Before the type's own
    check: pydantic refuses a lone surrogate as "not a unicode string" before any later
    validator could clean it."""
    def clean(value: Any, info: ValidationInfo) -> Any:
        if not isinstance(value, str):
            return value  # the type's check refuses it, naming the field
        return _clean_string(value, limit, f"payload.{info.field_name}", _notes(info))
    return BeforeValidator(clean)


def _path(path: str, key: str) -> str:
    """Where in the JSON, as the cleaning notes and errors say it: the key itself cleaned (a
    note is stored too) and kept short."""
    text = cleaned_text(key)[0]
    return f"{path}.{text[:40]}…" if len(text) > 40 else f"{path}.{text}"


def _clean_json(value: Any, path: str, depth: int, notes: list[str]) -> Any:
    """What JSON can hold that a jsonb column cannot: NUL and lone surrogates (in strings and
    keys), NaN and infinities (Python reads them; Postgres does not). `depth`: how many
    arrays and objects enclose `value`, checked before any recursion beyond the limit."""
    if isinstance(value, dict | list) and depth >= MAX_DETAIL_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DETAIL_DEPTH} levels (at {path})")
    if isinstance(value, str):
        return _clean_string(value, MAX_DETAIL_STRING, path, notes)
    if isinstance(value, float) and not math.isfinite(value):
        _note(notes, path, f"{value} written as a string")
        return str(value)
    if isinstance(value, dict):
        cleaned: dict[str, Any] = {}
        for key, item in value.items():
            where = _path(path, str(key))
            name = _clean_string(str(key), MAX_DETAIL_STRING, f"{where} (its key)", notes)
            cleaned[name] = _clean_json(item, where, depth + 1, notes)
        return cleaned
    if isinstance(value, list):
        return [_clean_json(item, f"{path}[{i}]", depth + 1, notes)
                for i, item in enumerate(value)]
    return value  # int, bool, None: jsonb holds any integer JSON can write


def _passed_through(value: Any, info: ValidationInfo) -> Any:
    cleaned = _clean_json(value, f"payload.{info.field_name}", 0, _notes(info))
    size = len(json.dumps(cleaned))  # ASCII: characters are bytes
    if size > MAX_DETAIL_BYTES:
        raise ValueError(f"at most {MAX_DETAIL_BYTES} bytes of JSON once cleaned (strings cut "
                         f"at {MAX_DETAIL_STRING} characters), not {size}")
    return cleaned


# What a human needs of a guard trip when its whole state is too large or too deep to keep.
TRIP_SUMMARY = ("layer", "reason", "cost_usd", "tokens", "steps", "tool_calls")


def _trip_kept(value: Any, info: ValidationInfo) -> Any:
    """A guard trip's state, cleaned; too large or too deep, its summary. Never refused for
    its size: a refused trip report is a trip lost (its agent neither held nor alerted on),
    and its last actions carry the model's arguments, as large as the model made them."""
    if not isinstance(value, dict):
        return value  # the type's check refuses it
    notes = _notes(info)
    before = len(notes)
    try:
        return _passed_through(value, info)
    except ValueError as whole:
        del notes[before:]  # the notes of what is not kept
        summary = {k: value[k] for k in TRIP_SUMMARY if k in value}
        kept = _passed_through(summary, info)
        _note(_notes(info), f"payload.{info.field_name}", f"cut to its summary ({whole})")
        return kept


def _guard_state(value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
    if value.get("layer") not in LAYER_NAMES:
        raise ValueError(f"trip.layer must be one of {', '.join(LAYER_NAMES)}")
    steps = value.get("steps", 0)
    if not isinstance(steps, int) or isinstance(steps, bool) or not 0 <= steps <= MAX_INTEGER:
        raise ValueError(f"trip.steps must be an integer from 0 to {MAX_INTEGER}")
    return value


# Labels are written by the daemon's code, not a model: cleaned, but longer than the limit is
# refused, not cut.
Label = Annotated[StrictStr, Field(max_length=MAX_LABEL_CHARS), _free_text(None)]
Result = Annotated[StrictStr, _free_text(MAX_RESULT_CHARS)]
StopDetail = Annotated[StrictStr, _free_text(MAX_STOP_DETAIL_CHARS)]
# An object: the recording's API answers each detail as one (a list stored here once made
# the agent's whole recording answer 500).
Detail = Annotated[dict[str, Any], BeforeValidator(_passed_through)]
GuardState = Annotated[dict[str, Any], AfterValidator(_guard_state),
                       BeforeValidator(_trip_kept)]
FencingToken = Annotated[int, Field(ge=0, le=MAX_BIGINT), NUMBER]


# --- the messages ---------------------------------------------------------------------------

class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class Ready(Message):
    agent_id: UUID
    sandbox_id: UUID
    version: Label | None = None
    pid: Annotated[int, Field(ge=0, le=MAX_INTEGER), NUMBER] | None = None


class Heartbeat(Message):
    busy: StrictBool = False


class Event(Message):
    kind: Label = "event"
    status: Label = "info"
    detail: Detail = Field(default_factory=dict)


class Cost(Message):
    usd: Annotated[float, Field(ge=0, le=MAX_COST_USD, allow_inf_nan=False), NUMBER]
    tokens: Annotated[int, Field(ge=0, le=MAX_INTEGER), NUMBER] = 0


class TaskDone(Message):
    task_id: UUID
    fencing_token: FencingToken
    result: Result = ""


class Blocked(Message):
    """Blocked on its own (`reason` is the task's result), or stopped by its guard (`trip`:
    the guard's state, with its layer)."""

    task_id: UUID
    fencing_token: FencingToken
    reason: Result = ""
    trip: GuardState | None = None
    # The model endpoint's refusal ({"status", "message"}) that blocked the task: the
    # session then ends instead of meeting the same refusal with the next task.
    model_error: Any = None


class KillAck(Message):
    stop: Stop = "kill"
    detail: StopDetail | None = None
    # What the stop cut (coveyd's ToolCut): checked field by field where it is kept
    # (api/daemon.py _tool_cut), never a reason to refuse the daemon's last word.
    cut: Any = None
    # The daemon's clock when it acknowledged: never a reason to refuse a kill_ack (the kill
    # counts as acknowledged whatever its payload); out of range it is simply not kept.
    acked_ns: Any = None


class Stopping(Message):
    stop: Stop
    detail: StopDetail | None = None
    cut: Any = None


MESSAGES: dict[str, type[Message]] = {
    "ready": Ready, "heartbeat": Heartbeat, "event": Event, "cost": Cost,
    "task_done": TaskDone, "blocked": Blocked, "kill_ack": KillAck, "stopping": Stopping,
}
ENVELOPE_HINT = 'send {"type": ..., "payload": {...}}'


@dataclass(frozen=True)
class Frame:
    kind: str
    message: Message
    cleaned: tuple[str, ...] = ()  # what the boundary changed, to be recorded


# The type a frame declares first, as coveyd writes it: read from a frame too large to parse,
# so that a task's result refused unread still settles its task.
DECLARED_TYPE = re.compile(r'\s*\{\s*"type"\s*:\s*"([a-z_]{1,32})"')


def _declared_type(text: str) -> str | None:
    declared = DECLARED_TYPE.match(text[:200])
    return declared.group(1) if declared and declared.group(1) in MESSAGES else None


def read_frame(text: str) -> Frame:
    """The frame, checked; or a ProtocolError naming what is wrong with it."""
    if len(text) > MAX_FRAME_BYTES or len(text.encode("utf-8", "surrogatepass")) > \
            MAX_FRAME_BYTES:
        raise ProtocolError("Frame too large", f"a frame holds at most {MAX_FRAME_BYTES} "
                            f"bytes; cut results at {MAX_RESULT_CHARS} characters", "frame",
                            _declared_type(text))
    try:
        envelope = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested too deep to read at all
        raise ProtocolError("Malformed JSON", ENVELOPE_HINT, "frame") from None
    if not isinstance(envelope, dict):
        raise ProtocolError("Message without a type", ENVELOPE_HINT, "frame")
    kind = envelope.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("Message without a type", ENVELOPE_HINT, "type")
    schema = MESSAGES.get(kind)
    shown = kind if len(kind) <= MAX_LABEL_CHARS else kind[:MAX_LABEL_CHARS] + "…"
    if schema is None:
        raise ProtocolError(f"Unknown message type {cleaned_text(shown)[0]!r}",
                            f"types: {', '.join(MESSAGES)}", "type")
    payload = envelope.get("payload", {})
    if not isinstance(payload, dict):
        raise ProtocolError(f"Invalid {kind} message", "payload must be an object",
                            "payload", kind)
    context: dict[str, list[str]] = {"cleaned": []}
    try:
        message = schema.model_validate(payload, context=context)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        field = ".".join(["payload", *(str(p) for p in first["loc"])])
        raise ProtocolError(f"Invalid {kind} message", f"{field}: {first['msg']}", field,
                            kind) from None
    return Frame(kind, message, tuple(context["cleaned"]))
