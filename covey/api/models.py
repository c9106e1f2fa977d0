"""Request and response bodies: these make the OpenAPI document true."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal
from uuid import UUID

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictStr,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from covey.config import HEARTBEAT_MIN_S
from covey.orchestrator import MAX_OPEN_HEARTBEAT_TASKS

# Postgres refuses NUL in text and jsonb, and UTF-8 has no lone surrogates: either reached
# the database as a 500 once (from a request), and crashed the daemon channel's handler
# (from a model's output, carried by its daemon). The one rule of what a string may hold:
# the HTTP API refuses what breaks it (storable_text), the daemon channel cleans it
# (cleaned_text, covey/protocol.py), since a model's output is not its daemon's fault.
UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
REPLACEMENT = "\ufffd"


def storable_text(value: str) -> str:
    """Every string of a request passes here first."""
    if UNSTORABLE.search(value) is None:
        return value
    if "\x00" in value:
        raise ValueError("NUL characters (\\u0000) are not allowed; remove them")
    raise ValueError("lone UTF-16 surrogates are not allowed; send valid Unicode")


def cleaned_text(value: str) -> tuple[str, int]:
    """The string with every character Postgres cannot store replaced by U+FFFD, and how
    many there were. (Python joins a valid surrogate pair into one character when it reads
    JSON: what is left in the surrogate range is a lone half.)"""
    return UNSTORABLE.subn(REPLACEMENT, value)


def _number_not_text(value: Any) -> Any:
    if isinstance(value, bool | str):
        raise ValueError("must be a JSON number, not a boolean or a string")
    return value


# JSON's integers: 3 and 3.0 (the same number), never true, "3" or 3.5. Pydantic's strict
# int refuses 3.0, which JSON Schema calls an integer; its lax int took true as 1.
# (Bounds go before NUMBER in an Annotated: after it, pydantic leaves them out of the schema.)
NUMBER = BeforeValidator(_number_not_text)
Integer = Annotated[int, NUMBER]

# The pattern says the same in the OpenAPI document, so clients and fuzzers know it.
NO_NUL = r"^[^\x00]*$"
Text = Annotated[StrictStr, AfterValidator(storable_text),
                 Field(json_schema_extra={"pattern": NO_NUL})]
"""A string from a request: any of them, body, path or query."""

# Deliverability is not ours to judge (game days use reserved domains such as .test);
# the shape is.
Email = Annotated[StrictStr,
                  Field(min_length=3, max_length=320, pattern=r"^[^@\s\x00]+@[^@\s\x00]+$"),
                  AfterValidator(storable_text)]
Role = Literal["org_admin", "agent_owner", "security", "auditor", "controlling"]
TaskState = Literal["open", "in_progress", "blocked", "done", "failed", "cancelled"]
HeartbeatName = Annotated[StrictStr, Field(min_length=1, max_length=64,
                                           pattern=r"^[a-z0-9][a-z0-9_-]*$")]
# The largest integer a JSON number holds exactly (a double's 53 bits): beyond it two
# different numbers compare equal in many clients' validators, and Postgres's bigint ends
# at 2**63 - 1 anyway. A larger cursor once overflowed there as a 500.
MAX_EXACT_INT = 2**53 - 1
# A plain-text task body fits in one request (64 KiB) with its title; escaped or multibyte
# text can pass the byte limit first, and that is a 413.
MAX_TASK_BODY = 60_000


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LoginIn(Strict):
    email: Email
    password: Text = Field(min_length=1, max_length=512)


class MeOut(BaseModel):
    id: UUID
    org_id: UUID
    email: str
    role: str


class TokenIn(Strict):
    name: Text = Field(min_length=1, max_length=100)


class TokenOut(BaseModel):
    name: str
    token: str


class MemberIn(Strict):
    email: Email
    password: Text = Field(min_length=8, max_length=512)
    role: Role


class OrgIn(Strict):
    name: Text = Field(min_length=1, max_length=100)
    admin_email: Email
    admin_password: Text = Field(min_length=8, max_length=512)


class OrgOut(BaseModel):
    id: UUID
    name: str
    admin_id: UUID


class HeartbeatIn(Strict):
    name: HeartbeatName
    task_body: Text = Field(max_length=4_000)
    every_seconds: Integer = Field(
        ge=1, le=7 * 24 * 3600,
        description=f"At least the control plane's COVEY_HEARTBEAT_MIN_S ({HEARTBEAT_MIN_S} s"
                    f" unless set lower); shorter is a 422. The scheduler fires no heartbeat"
                    f" of an agent that has {MAX_OPEN_HEARTBEAT_TASKS} unfinished heartbeat"
                    f" tasks.")


class HeartbeatOut(BaseModel):
    name: str
    task_body: str
    every_seconds: int
    last_fired_at: datetime | None


class GuardIn(Strict):
    """Per-agent guard thresholds; what is left out takes the daemon's default."""

    max_tokens: Annotated[int, Field(ge=1, le=MAX_EXACT_INT), NUMBER] | None = None
    max_completion_tokens: Annotated[int, Field(
        ge=1, le=MAX_EXACT_INT, description="the completion one model call may ask for, when "
        "the budgets allow (default 4096)"), NUMBER] | None = None
    min_completion_tokens: Annotated[int, Field(
        ge=1, le=MAX_EXACT_INT, description="the least completion worth a call: a call the "
        "budgets cannot pay for with this much is refused (default 64)"), NUMBER] | None = None
    max_tool_calls: Annotated[int, Field(ge=1, le=MAX_EXACT_INT), NUMBER] | None = None
    max_wall_s: StrictFloat | None = Field(default=None, gt=0, allow_inf_nan=False)
    loop_window: Annotated[int, Field(ge=2, le=1000), NUMBER] | None = None
    loop_repeats: Annotated[int, Field(ge=2, le=1000), NUMBER] | None = None
    cycle_max_period: Annotated[int, Field(ge=2, le=20), NUMBER] | None = None
    cycle_repeats: Annotated[int, Field(ge=2, le=100), NUMBER] | None = None
    breaker_failures: Annotated[int, Field(ge=1, le=1000), NUMBER] | None = None
    breaker_cooldown_s: StrictFloat | None = Field(default=None, ge=0, allow_inf_nan=False)


class AgentIn(Strict):
    slug: StrictStr = Field(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9-]*$")
    display_name: Text = Field(min_length=1, max_length=200)
    owner_id: UUID | None = None
    warm_sandbox: StrictBool = False
    budget_usd: StrictFloat = Field(default=1.0, ge=0, le=100_000, allow_inf_nan=False)
    max_turns: Integer = Field(default=20, ge=1, le=10_000)
    model: Text = Field(default="puppet", min_length=1, max_length=200)
    # At most 12 of at most 4,000 characters: with the rest, within the 64 KiB request limit.
    heartbeats: list[HeartbeatIn] = Field(default_factory=list, max_length=12)
    guard: GuardIn = Field(default_factory=GuardIn)


class AgentOut(BaseModel):
    id: UUID
    org_id: UUID
    slug: str
    display_name: str
    owner_id: UUID | None
    status: str
    killed: bool
    kill_origin: str | None
    fleet_killed: bool
    warm_sandbox: bool
    budget_usd: float
    max_turns: int
    model: str
    guard: dict[str, Any]
    created_at: datetime
    running_session_id: UUID | None = Field(
        default=None, description="The agent's live session (starting or running), if any")
    spent_usd: float = Field(default=0.0, description="What the agent's model calls cost, all "
                             "sessions together: the sum of its cost entries (USD)")
    spent_tokens: int = Field(default=0, description="Tokens of those calls, all sessions")
    remaining_usd: float = Field(
        default=0.0, description="What is left of budget_usd, which is each session's "
        "ceiling: of the running session's, or the whole budget when none runs")


class AgentCreatedOut(AgentOut):
    trigger_token: str = Field(description="Shown once: the token of POST /api/trigger/{token}")


class TaskIn(Strict):
    title: Text = Field(min_length=1, max_length=500)
    body: Text = Field(default="", max_length=MAX_TASK_BODY)
    priority: Integer = Field(default=0, ge=-1000, le=1000)


class TaskPatch(Strict):
    """What to change; what is left out stays. null is no value: leave the field out."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"minProperties": 1})

    title: Annotated[Text, Field(min_length=1, max_length=500)] | SkipJsonSchema[None] = None
    body: Annotated[Text, Field(max_length=MAX_TASK_BODY)] | SkipJsonSchema[None] = None
    priority: Annotated[int, Field(ge=-1000, le=1000), NUMBER] | SkipJsonSchema[None] = None

    @model_validator(mode="before")
    @classmethod
    def _no_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            nulls = sorted(k for k, v in data.items() if v is None)
            if nulls:
                raise ValueError(f"leave out what does not change instead of null: {nulls}")
            if not data:
                raise ValueError("send at least one of title, body, priority")
        return data


class TaskOut(BaseModel):
    id: UUID
    agent_id: UUID
    title: str
    body: str
    state: TaskState
    priority: int
    origin: str
    daemon_retries: int
    result: str | None
    created_at: datetime
    updated_at: datetime


class TransitionOut(BaseModel):
    from_state: str | None
    to_state: str
    note: str
    at: datetime


class TaskDetailOut(TaskOut):
    transitions: list[TransitionOut]


class TriggerIn(Strict):
    title: Text = Field(default="triggered", min_length=1, max_length=500)
    body: Text = Field(default="", max_length=MAX_TASK_BODY)


class WakeOut(BaseModel):
    outcome: Literal["started", "busy", "idle"]
    session_id: UUID | None


class AcceptedTaskOut(BaseModel):
    task: TaskOut
    wake: WakeOut


class KillOut(BaseModel):
    already_killed: bool
    agents_stopped: list[UUID]
    sessions_cancelled: list[UUID]
    sessions_confirmed: list[UUID] = Field(
        description="Sessions whose daemon confirmed the kill (or hung up) before this answer, "
                    "or whose sandbox was torn down")
    sessions_acknowledged: list[UUID] = Field(
        default_factory=list,
        description="Of those, the sessions whose daemon obeyed: it acknowledged the kill "
                    "(kill_ack) instead of only hanging up")
    sessions_torn_down: list[UUID] = Field(
        default_factory=list,
        description="Of those confirmed, the sessions whose daemon had not acknowledged the "
                    "kill within COVEY_KILL_ACK_BOUND_MS, or had not connected yet when it "
                    "came: the runner tore their sandboxes down (not obeyed)")
    sessions_not_connected: list[UUID] = Field(
        default_factory=list,
        description="Of those torn down, the sessions whose daemon had not connected when the "
                    "kill came: no kill could be sent to it, so none was disobeyed")
    tasks_requeued: list[UUID]
    evicted_sandboxes: list[UUID]


class ResumeOut(BaseModel):
    changed: bool
    agents_released: list[UUID]
    agents_woken: list[UUID]
    held_by_fleet: bool


class FleetOut(BaseModel):
    org_id: UUID
    fleet_killed: bool
    fleet_killed_at: datetime | None
    # Who pulled the standing stop (their email): a game day that finds the fleet stopped
    # must say whose stop it is before anyone releases it.
    fleet_killed_by: str | None = None
    fleet_killed_reason: str | None = None
    # A platform admin's global kill flag stops this organisation too, whatever
    # fleet_killed says; only a platform admin clears it (POST /api/v1/flags/global/clear).
    global_stop: bool = False
    agents: int
    agents_killed: int
    agents_working: int


class RecordingOut(BaseModel):
    id: int
    session_id: UUID | None
    kind: str
    status: str
    detail: dict[str, Any]
    at: datetime


class SandboxOut(BaseModel):
    id: UUID
    backend: str
    handle: str | None = Field(description="The backend's handle: the daemon's process id, "
                               "or the container's id")
    state: Literal["starting", "running", "parked", "evicted", "gone"] = Field(
        description="parked: a warm agent's sandbox between sessions, still up with its "
        "daemon connected and idle; evicted: torn down by a kill or a wake elsewhere, its "
        "unsynced work thrown away")
    exit_code: int | None = Field(description="The daemon's exit code: 0 fell asleep, 1 error, "
                                  "2 its own guard, 3 kill switch; negative (process) or 137 "
                                  "(container) when the sandbox was destroyed")
    created_at: datetime
    ended_at: datetime | None = Field(description="When the sandbox's life ended for the "
                                      "control plane: gone, or evicted")
    daemon_exited_at: datetime | None = Field(
        default=None, description="When the daemon's process ended (reaped, or the "
        "container's death as the Docker engine saw it)")
    gone_at: datetime | None = Field(
        default=None, description="When nothing of the sandbox was left: every process it "
        "started reaped, its container removed")
    last_sync_at: datetime | None = Field(
        default=None, description="When the sandbox's work was last synced to the agent's "
        "home: what a kill keeps")


class ToolCutOut(BaseModel):
    tool: str | None
    pid: int | None = None
    pgid: int | None = None
    ran_ms: float | None = None
    processes_killed: int | None = None
    all_gone: bool | None = Field(
        default=None, description="No process the tools started was left alive")


class SessionOut(BaseModel):
    id: UUID
    task_id: UUID | None
    sandbox_id: UUID | None
    node: str
    state: str
    started_at: datetime
    ended_at: datetime | None
    stop_layer: str | None
    stop_reason: str | None
    daemon_stop: Literal["kill", "lease", "guard", "sleep", "error"] | None = Field(
        default=None, description="Why the daemon said it stopped, in its last message: it "
        "obeyed a kill, its kill-flag lease ran out, its own guard tripped, it was told to "
        "sleep, or an error; null when it said nothing (a crash, a cut channel)")
    daemon_stop_detail: str | None = None
    kill_sent_at: datetime | None = Field(
        default=None, description="When a kill message went out to this session's daemon "
        "(null with a teardown: its daemon had not connected when the kill came)")
    kill_confirmed_at: datetime | None = None
    kill_confirmed_by: Literal["kill_ack", "lease", "hang_up", "teardown"] | None = Field(
        default=None, description="How that kill was confirmed: the daemon's kill_ack "
        "(obeyed), or only its hang-up after its lease ran out (lease) or without a word "
        "(hang_up), or the runner tearing its sandbox down because it had not acknowledged "
        "within COVEY_KILL_ACK_BOUND_MS, or had not connected yet (teardown); only kill_ack "
        "is obedience")
    kill_acked_at: datetime | None = Field(
        default=None, description="When the daemon acknowledged the kill, on its own clock "
        "(from its kill_ack; null without one): it sends no model request after this")
    tool_cut: ToolCutOut | None = Field(
        default=None, description="What the daemon's stop cut, as its last message said: "
        "the tool call under way (null tool: none was), its process (pid = pgid) and how "
        "long it had run, and how many of the tools' processes were killed before the "
        "daemon said it stopped")
    spent_usd: float = Field(default=0.0, description="What this session's model calls cost "
                             "(USD): the sum of its cost entries")
    spent_tokens: int = Field(default=0, description="Tokens of this session's model calls")
    budget_usd: float = Field(default=0.0, description="The agent's budget, the ceiling of "
                              "each of its sessions (as the agent has it now)")
    remaining_usd: float = Field(default=0.0, description="budget_usd less spent_usd")


class NotificationOut(BaseModel):
    id: int
    class_: str = Field(alias="class")
    kind: str
    title: str
    link: str
    at: datetime

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)


class ReasonIn(Strict):
    """Why: kept in the audit log beside who and what."""

    reason: Text | None = Field(default=None, max_length=500)


class FlagReasonIn(Strict):
    reason: Text = Field(min_length=1, max_length=500)


# A tool's name as the daemon's toolbox knows it (shell, http_request, ...).
ToolName = Annotated[StrictStr, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class ToolFlagIn(Strict):
    """One tool stopped for one agent (agent_id) or for the whole organisation (no agent_id)."""

    tool: ToolName
    agent_id: UUID | None = None
    reason: Text = Field(min_length=1, max_length=500)


class FlagOut(BaseModel):
    scope: Literal["global", "org", "agent", "tool"]
    org_id: UUID | None = None
    agent_id: UUID | None = None
    tool: str | None = None
    reason: str | None = None
    set_by: str | None = Field(default=None, description="Email of who set it, when known")
    set_at: datetime | None = None


class FlagChangeOut(BaseModel):
    changed: bool = Field(description="False when the flag already stood (or was already clear)")


class AuditOut(BaseModel):
    """One audit entry: who did what to which target, and why (`detail.reason`)."""

    id: int
    at: datetime
    action: str = Field(description="such as fleet.kill, agent.resume, flag.tool.set")
    actor_id: UUID | None
    actor_email: str | None = Field(description="null when the control plane itself acted")
    target: str
    agent_id: UUID | None = Field(description="the agent it concerns, if one")
    detail: dict[str, Any]
