"""Request and response bodies: these make the OpenAPI document true."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

# Deliverability is not ours to judge (game days use reserved domains such as .test);
# the shape is.
Email = Annotated[StrictStr, Field(min_length=3, max_length=320, pattern=r"^[^@\s]+@[^@\s]+$")]
Role = Literal["org_admin", "agent_owner", "security", "auditor", "controlling"]
TaskState = Literal["open", "in_progress", "blocked", "done", "failed", "cancelled"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LoginIn(Strict):
    email: Email
    password: StrictStr = Field(min_length=1, max_length=512)


class MeOut(BaseModel):
    id: UUID
    org_id: UUID
    email: str
    role: str


class TokenIn(Strict):
    name: StrictStr = Field(min_length=1, max_length=100)


class TokenOut(BaseModel):
    name: str
    token: str


class MemberIn(Strict):
    email: Email
    password: StrictStr = Field(min_length=8, max_length=512)
    role: Role


class OrgIn(Strict):
    name: StrictStr = Field(min_length=1, max_length=100)
    admin_email: Email
    admin_password: StrictStr = Field(min_length=8, max_length=512)


class OrgOut(BaseModel):
    id: UUID
    name: str
    admin_id: UUID


class HeartbeatIn(Strict):
    name: StrictStr = Field(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9_-]*$")
    task_body: StrictStr = Field(max_length=20_000)
    every_seconds: StrictInt = Field(ge=1, le=7 * 24 * 3600)


class HeartbeatOut(BaseModel):
    name: str
    task_body: str
    every_seconds: int
    last_fired_at: datetime | None


class GuardIn(Strict):
    """Per-agent guard thresholds; what is left out takes the daemon's default."""

    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_tool_calls: StrictInt | None = Field(default=None, ge=1)
    max_wall_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    loop_window: StrictInt | None = Field(default=None, ge=2, le=1000)
    loop_repeats: StrictInt | None = Field(default=None, ge=2, le=1000)
    cycle_max_period: StrictInt | None = Field(default=None, ge=2, le=20)
    cycle_repeats: StrictInt | None = Field(default=None, ge=2, le=100)
    breaker_failures: StrictInt | None = Field(default=None, ge=1, le=1000)
    breaker_cooldown_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)


class AgentIn(Strict):
    slug: StrictStr = Field(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9-]*$")
    display_name: StrictStr = Field(min_length=1, max_length=200)
    owner_id: UUID | None = None
    warm_sandbox: StrictBool = False
    budget_usd: float = Field(default=1.0, ge=0, le=100_000, allow_inf_nan=False)
    max_turns: StrictInt = Field(default=20, ge=1, le=10_000)
    model: StrictStr = Field(default="puppet", min_length=1, max_length=200)
    heartbeats: list[HeartbeatIn] = Field(default_factory=list, max_length=50)
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


class AgentCreatedOut(AgentOut):
    trigger_token: str = Field(description="Shown once: the token of POST /api/trigger/{token}")


class TaskIn(Strict):
    title: StrictStr = Field(min_length=1, max_length=500)
    body: StrictStr = Field(default="", max_length=100_000)
    priority: StrictInt = Field(default=0, ge=-1000, le=1000)


class TaskPatch(Strict):
    title: StrictStr | None = Field(default=None, min_length=1, max_length=500)
    body: StrictStr | None = Field(default=None, max_length=100_000)
    priority: StrictInt | None = Field(default=None, ge=-1000, le=1000)


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
    title: StrictStr = Field(default="triggered", min_length=1, max_length=500)
    body: StrictStr = Field(default="", max_length=100_000)


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
        description="Sessions whose daemon confirmed the kill (or hung up) before this answer")
    sessions_acknowledged: list[UUID] = Field(
        default_factory=list,
        description="Of those, the sessions whose daemon obeyed: it acknowledged the kill "
                    "(kill_ack) instead of only hanging up")
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
    handle: str | None
    state: str
    exit_code: int | None
    created_at: datetime
    ended_at: datetime | None


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
        default=None, description="When a kill message went out to this session's daemon")
    kill_confirmed_at: datetime | None = None
    kill_confirmed_by: Literal["kill_ack", "lease", "hang_up"] | None = Field(
        default=None, description="How that kill was confirmed: the daemon's kill_ack "
        "(obeyed), or only its hang-up after its lease ran out (lease) or without a word "
        "(hang_up)")


class NotificationOut(BaseModel):
    id: int
    class_: str = Field(alias="class")
    kind: str
    title: str
    link: str
    at: datetime

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)
