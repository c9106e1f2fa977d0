"""The orchestrator: wake, dispatch, the two kill switches and their resumes, the scheduler
tick, daemon loss. DESIGN §2.3 is the contract; each public method is one of its lines.

Concurrency rule: every path that starts or feeds work locks the agent row and the
organisation row and reads both flags under those locks. The switches UPDATE the same rows, so
a wake and a kill are serialised by Postgres, whichever replica runs them: either the kill
sees the new session and cancels it, or the wake sees the flag and starts nothing.

Rows are locked in one order everywhere: agents (by id), then their organisation, then
sessions, then tasks. A fleet kill once locked the organisation first while wakes locked
agent then organisation; under load Postgres broke the deadlock by failing the kill, and the
fleet kept running. A transaction that will update an agent row takes it FOR NO KEY UPDATE at
once (two FOR SHARE holders that both upgrade deadlock too).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar
from uuid import UUID, uuid4

import asyncpg
import structlog

from covey import metrics
from covey.config import Settings
from covey.db import (
    MAY_RUN,
    UNREACHABLE,
    BatchedWrite,
    Connection,
    DatabaseUnavailable,
    Pool,
    fetch_one,
    through_outage,
    transaction,
)
from covey.hub import DaemonHub, DaemonLink
from covey.sandbox import Runner
from covey.security import new_token, token_hash

log = structlog.get_logger(__name__)
T = TypeVar("T")

LIVE = ("starting", "running")

# No heartbeat fires more often than the settings' heartbeat_min_s (covey.config), and none
# of an agent fires while it already has this many heartbeat tasks unfinished.
MAX_OPEN_HEARTBEAT_TASKS = 10
# Work left in progress under a session that is over is requeued once the session has been
# over this long (or two leases, if longer): see `requeue_orphaned_work`.
ORPHAN_GRACE_MIN_S = 5.0

# How often a kill reads whether the daemons another replica holds have confirmed it: from
# the first pause, doubling up to the second (a dozen reads in a 2 s wait, not a hundred).
REMOTE_CONFIRM_POLL_S = (0.02, 0.25)
# What ends that wait without failing the kill (already in effect): the database away, or a
# connection of the switches' lane broken by it.
ENDS_THE_REMOTE_WAIT: tuple[type[Exception], ...] = (
    *UNREACHABLE, asyncpg.InterfaceError, asyncpg.InternalClientError)

FLEET_KILLED_TITLE = (
    "The emergency stop was pulled: every agent of this organisation is paused"
)


LAYER_NAMES = {
    "budget": "budget guard",
    "steps": "step limit",
    "loop": "loop detector",
    "circuit_breaker": "circuit breaker",
    "kill_flag": "kill flag",
}


@dataclass
class GuardTripReport:
    """A trip as the daemon reported it, checked: untrusted input, kept small."""

    layer: str
    reason: str
    steps: int
    detail: dict[str, Any]

    @property
    def layer_name(self) -> str:
        return LAYER_NAMES[self.layer]

    @classmethod
    def parse(cls, reason: Any, trip: Any) -> GuardTripReport | None:
        if not isinstance(trip, dict) or trip.get("layer") not in LAYER_NAMES:
            return None
        text = json.dumps(trip, default=str)
        detail = trip if len(text) <= 50_000 else {k: trip.get(k) for k in
                                                    ("layer", "reason", "cost_usd", "steps")}
        steps = trip.get("steps")
        return cls(
            layer=str(trip["layer"]),
            reason=str(trip.get("reason") or reason or "")[:300],
            steps=steps if isinstance(steps, int) and steps >= 0 else 0,
            detail=detail,
        )


@dataclass
class WakeResult:
    outcome: str  # started | refused | busy | idle
    session_id: UUID | None = None


@dataclass
class KillReport:
    already_killed: bool
    sessions_cancelled: list[UUID] = field(default_factory=list)
    kill_delivered: list[UUID] = field(default_factory=list)
    kill_confirmed: list[UUID] = field(default_factory=list)
    kill_acknowledged: list[UUID] = field(default_factory=list)  # by kill_ack, not a hang-up
    # Confirmed by the second line: not acknowledged within the bound, sandbox torn down.
    kill_torn_down: list[UUID] = field(default_factory=list)
    tasks_requeued: list[UUID] = field(default_factory=list)
    agents: list[UUID] = field(default_factory=list)
    evicted_sandboxes: list[UUID] = field(default_factory=list)


@dataclass
class ResumeReport:
    changed: bool
    agents_released: list[UUID] = field(default_factory=list)
    agents_woken: list[UUID] = field(default_factory=list)
    held_by_fleet: bool = False


async def emit_status(conn: Connection, org_id: UUID, agent_id: UUID, status: str) -> None:
    """Publish a status change to every replica's event stream (delivered at commit)."""
    payload = json.dumps({"org_id": str(org_id), "agent_id": str(agent_id), "status": status})
    await conn.execute("SELECT pg_notify('covey_events', $1)", payload)


async def emit_statuses(conn: Connection, org_id: UUID, agent_ids: list[UUID], status: str
                        ) -> None:
    """One NOTIFY per hundred agents (a payload holds at most 8000 bytes), all in one
    statement: a fleet kill of a thousand once made ten round trips of its flag's
    transaction out of them."""
    payloads = [json.dumps({"org_id": str(org_id), "status": status,
                            "agents": [str(a) for a in agent_ids[i:i + 100]]})
                for i in range(0, len(agent_ids), 100)]
    await notify_all(conn, "covey_events", payloads)


async def notify_all(conn: Connection, channel: str, payloads: list[str]) -> None:
    """NOTIFY each payload on `channel`, in one round trip."""
    if payloads:
        await conn.execute("SELECT pg_notify($1, p) FROM unnest($2::text[]) AS p",
                           channel, payloads)


async def lock_agent(conn: Connection, agent_id: UUID, *, write: bool
                     ) -> dict[str, Any] | None:
    """Lock an agent, then its organisation (the one lock order), and read the flags:
    `stopped` is MAY_RUN's answer, asked in a statement of its own after the locks, so that
    it sees a switch that committed while we waited (a subquery of the locking statement
    would read the snapshot from before the wait)."""
    mode = "FOR NO KEY UPDATE OF a" if write else "FOR SHARE OF a"
    row = await conn.fetchrow(
        f"""
        SELECT a.id, a.org_id, a.killed, a.kill_origin, a.warm_sandbox, a.slug,
               a.display_name, a.owner_id, o.fleet_killed
        FROM agents a JOIN organizations o ON o.id=a.org_id
        WHERE a.id=$1 {mode} FOR SHARE OF o
        """,
        agent_id,
    )
    if row is None:
        return None
    may_run = await conn.fetchval(
        f"SELECT {MAY_RUN} FROM agents a JOIN organizations o ON o.id=a.org_id WHERE a.id=$1",
        agent_id)
    return {**dict(row), "stopped": not may_run}


async def lock_fleet(conn: Connection, org_id: UUID) -> bool | None:
    """Lock every agent of the organisation (by id), then the organisation itself."""
    await conn.execute(
        "SELECT id FROM agents WHERE org_id=$1 ORDER BY id FOR NO KEY UPDATE", org_id)
    was: bool | None = await conn.fetchval(
        "SELECT fleet_killed FROM organizations WHERE id=$1 FOR NO KEY UPDATE", org_id)
    return was


async def record_many(conn: Connection, agent_ids: list[UUID], session_of: dict[UUID, UUID],
                      kind: str, status: str, detail: dict[str, Any]) -> None:
    await conn.execute(
        "INSERT INTO recording_events (agent_id, session_id, kind, status, detail)"
        " SELECT a, s, $3, $4, $5 FROM unnest($1::uuid[], $2::uuid[]) AS x(a, s)",
        agent_ids, [session_of.get(a) for a in agent_ids], kind, status, detail,
    )


async def record(conn: Connection, agent_id: UUID, session_id: UUID | None, kind: str,
                 status: str, detail: dict[str, Any]) -> None:
    await conn.execute(
        "INSERT INTO recording_events (agent_id, session_id, kind, status, detail)"
        " VALUES ($1, $2, $3, $4, $5)",
        agent_id, session_id, kind, status, detail,
    )


async def audit(conn: Connection, org_id: UUID | None, actor_id: UUID | None, action: str,
                target: str, detail: dict[str, Any] | None = None) -> None:
    """In the audit log (GET /api/v1/audit), and on the server's log at INFO with who and
    why: switch pulls were once only in the table, out of reach of the log's alerts. Logged
    as written, inside the caller's transaction; a transaction that then fails logs that."""
    detail = detail or {}
    actor = await conn.fetchval(
        "INSERT INTO audit_log (org_id, actor_id, action, target, detail)"
        " VALUES ($1, $2, $3, $4, $5)"
        " RETURNING (SELECT email FROM humans WHERE id=$2)",
        org_id, actor_id, action, target, detail,
    )
    log.info("audit", action=action, actor=actor or "the control plane",
             org_id=str(org_id) if org_id else None, target=target,
             why=detail.get("reason"), detail=detail)


async def requeue_in_progress(conn: Connection, where: str, args: list[Any], note: str
                              ) -> list[UUID]:
    """Put the in-progress tasks matching `where` back to open, with a transition each."""
    rows = await conn.fetch(
        f"""
        WITH moved AS (
            UPDATE backlog_tasks t SET state='open', claim_token=NULL, claimed_by=NULL,
                   updated_at=now()
            WHERE t.state='in_progress' AND {where}
            RETURNING t.id
        ), logged AS (
            INSERT INTO task_transitions (task_id, from_state, to_state, note)
            SELECT id, 'in_progress', 'open', ${len(args) + 1} FROM moved
        )
        SELECT id FROM moved
        """,
        *args, note,
    )
    return [r["id"] for r in rows]


async def _lose_work(conn: Connection, session_id: UUID, max_retries: int, why: str
                     ) -> list[asyncpg.Record]:
    """The task a session holds goes back to open as after a daemon loss, counting retries;
    past `max_retries`, failed, saying why where its result would be."""
    rows: list[asyncpg.Record] = await conn.fetch(
        """
        WITH moved AS (
            UPDATE backlog_tasks SET daemon_retries=daemon_retries+1,
                   state=CASE WHEN daemon_retries+1 > $2 THEN 'failed' ELSE 'open' END,
                   -- A task given up on says why where its result would be: the operator
                   -- who finds it failed need not dig through transitions.
                   result=CASE WHEN daemon_retries+1 > $2
                          THEN 'failed: its daemon was lost ' || (daemon_retries+1)
                               || ' times (at most ' || $2 || ' retries); last: ' || $3
                          ELSE result END,
                   claim_token=NULL, claimed_by=NULL, updated_at=now()
            WHERE claimed_by=$1 AND state='in_progress'
            RETURNING id, state, daemon_retries
        ), logged AS (
            INSERT INTO task_transitions (task_id, from_state, to_state, note)
            SELECT id, 'in_progress', state,
                   'daemon lost (retry ' || daemon_retries || '): ' || $3 FROM moved
        )
        SELECT id, state FROM moved
        """,
        session_id, max_retries, why,
    )
    return rows


class Orchestrator:
    def __init__(self, pool: Pool, settings: Settings, hub: DaemonHub, node: str,
                 ws_url: str, switch_pool: Pool | None = None) -> None:
        self.pool = pool
        # The switches' lane (covey.admission): the kills, the global stop, the lease
        # renewals and the daemons' kill confirmations, on connections no read can take.
        self.switch_pool = pool if switch_pool is None else switch_pool
        self.settings = settings
        self.hub = hub
        self.node = node
        self.ws_url = ws_url
        self.runner: Runner | None = None
        # The daemon protocol's side of a warm wake: a connected daemon takes up a session
        # (covey.api.daemon sets it; the protocol lives there).
        self.hand_over: Callable[[DaemonLink], Awaitable[None]] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        # Agents named by covey_wake NOTIFYs not yet looked at (in arrival order), and the
        # task that looks at them: see wake_notified.
        self._notified: dict[UUID, None] = {}
        self._notified_waking: asyncio.Task[None] | None = None
        # Sessions whose sandboxes the second line is tearing down (see _tear_down_once).
        self._tearing_down: dict[UUID, asyncio.Future[None]] = {}
        # A fleet kill's daemons confirm all at once: their words go to their sessions a
        # batch per statement, not a pool round trip (and a connection reset) each.
        self.record_kill_confirmation = BatchedWrite(
            self.switch_pool,
            "UPDATE sessions s SET kill_sent_at=x.sent, kill_confirmed_at=x.confirmed,"
            " kill_confirmed_by=x.how, kill_acked_at=x.acked"
            " FROM unnest($1::uuid[], $2::timestamptz[], $3::timestamptz[], $4::text[],"
            " $5::timestamptz[]) AS x(id, sent, confirmed, how, acked)"
            " WHERE s.id=x.id AND s.kill_confirmed_by IS NULL")
        self.record_daemon_stop = BatchedWrite(
            self.switch_pool,
            "UPDATE sessions s SET daemon_stop=x.stop, daemon_stop_detail=x.detail,"
            " tool_cut=x.cut"
            " FROM unnest($1::uuid[], $2::text[], $3::text[], $4::jsonb[])"
            " AS x(id, stop, detail, cut)"
            " WHERE s.id=x.id AND s.daemon_stop IS NULL")

    # ---------------------------------------------------------------- waking

    async def wake(self, agent_id: UUID, path: str) -> WakeResult:
        """The one place that decides whether an agent may wake, for every wake path."""
        async with transaction(self.pool) as conn:
            row = await lock_agent(conn, agent_id, write=True)
            if row is None:
                return WakeResult("idle")
            if row["stopped"]:
                metrics.wakes.labels(path, "refused").inc()
                return WakeResult("refused")
            # A statement of its own, after the lock: it sees a session that a concurrent
            # wake committed while we waited (a subquery above would not).
            work = await fetch_one(
                conn,
                """
                SELECT EXISTS (SELECT 1 FROM backlog_tasks t
                               WHERE t.agent_id=$1 AND t.state='open') AS has_work,
                       EXISTS (SELECT 1 FROM sessions s
                               WHERE s.agent_id=$1 AND s.state IN ('starting','running'))
                           AS live
                """,
                agent_id,
            )
            if work["live"]:
                metrics.wakes.labels(path, "busy").inc()
                return WakeResult("busy")
            if not work["has_work"]:
                metrics.wakes.labels(path, "idle").inc()
                return WakeResult("idle")
            session_id = uuid4()
            token = new_token("cvd")
            ttl = float(self.settings.daemon_token_ttl_s)
            warm, evicted = await self._take_parked(conn, agent_id)
            sandbox_id = uuid4() if warm is None else warm["id"]
            if warm is None:
                await conn.execute(
                    "INSERT INTO sandboxes (id, agent_id, backend, daemon_token_hash,"
                    " token_expires_at, node)"
                    " VALUES ($1, $2, $3, $4, now() + make_interval(secs => $5), $6)",
                    sandbox_id, agent_id, self._backend, token_hash(token), ttl, self.node,
                )
            await conn.execute(
                "INSERT INTO sessions (id, agent_id, sandbox_id, node) VALUES ($1, $2, $3, $4)",
                session_id, agent_id, sandbox_id, self.node,
            )
            await conn.execute("UPDATE agents SET status='triggered' WHERE id=$1", agent_id)
            await record(conn, agent_id, session_id, "session", "started", {"path": path})
            await emit_status(conn, row["org_id"], agent_id, "triggered")
        metrics.wakes.labels(path, "started").inc()
        if self.runner is not None:
            await self.runner.discard_evicted(evicted)
        if warm is not None:
            await self._hand_over(warm["session_id"], session_id, sandbox_id)
        else:
            await self._start_sandbox(agent_id, session_id, sandbox_id, token)
        return WakeResult("started", session_id)

    async def _take_parked(self, conn: Connection, agent_id: UUID
                           ) -> tuple[asyncpg.Record | None, list[asyncpg.Record]]:
        """The agent's parked warm sandbox whose idle daemon is connected here, taken for
        the new session; every other parked sandbox of the agent is evicted (one on another
        node would later sync an older home over this session's). Returns the sandbox taken
        (with the session its daemon last ran) and those evicted."""
        parked = await conn.fetch(
            "SELECT b.id, b.agent_id, b.node, (SELECT s.id FROM sessions s"
            " WHERE s.sandbox_id=b.id ORDER BY s.started_at DESC, s.id DESC LIMIT 1)"
            " AS session_id FROM sandboxes b WHERE b.agent_id=$1 AND b.state='parked'"
            " ORDER BY b.created_at DESC", agent_id)
        warm = next((b for b in parked if b["node"] == self.node
                     and self.runner is not None and self.runner.holds(b["id"])
                     and b["session_id"] is not None
                     and self.hub.get(b["session_id"]) is not None), None)
        evicted = [b for b in parked if warm is None or b["id"] != warm["id"]]
        if evicted:
            await conn.execute("UPDATE sandboxes SET state='evicted', ended_at=now()"
                               " WHERE id = ANY($1::uuid[])", [b["id"] for b in evicted])
        if warm is not None:
            await conn.execute("UPDATE sandboxes SET state='running', parked_at=NULL"
                               " WHERE id=$1", warm["id"])
        return warm, evicted

    async def _hand_over(self, idle_session: UUID, session_id: UUID, sandbox_id: UUID
                         ) -> None:
        """The wake is instant for a warm agent: its parked sandbox's idle daemon takes up
        the new session over the connection it holds (its configuration, a lease, its
        task). A daemon gone meanwhile loses the session, which requeues its work."""
        link = self.hub.move(idle_session, session_id)
        if link is None or self.hand_over is None:
            await self.session_lost(session_id, "the warm sandbox's daemon went away")
            return
        if self.runner is not None:
            self.runner.take_up(sandbox_id, session_id)
        await self.hand_over(link)

    async def tell_idle_to_sleep(self, sandbox_id: UUID) -> bool:
        """A parked warm sandbox idle past warm_idle_s really falls asleep: its daemon is
        told `sleep` (exit 0), and its home is synced. False when its daemon is not
        connected here."""
        session_id = await self.pool.fetchval(
            "SELECT id FROM sessions WHERE sandbox_id=$1 ORDER BY started_at DESC, id DESC"
            " LIMIT 1", sandbox_id)
        return session_id is not None and await self.hub.send(session_id, "sleep",
                                                              {"reason": "idle"})

    @property
    def _backend(self) -> str:
        return self.runner.backend if self.runner else "none"

    async def _start_sandbox(self, agent_id: UUID, session_id: UUID, sandbox_id: UUID,
                             token: str) -> None:
        if self.runner is None:
            return
        env = {
            **{k: os.environ[k] for k in self.settings.sandbox_pass_env if k in os.environ},
            "COVEY_WS_URL": self.ws_url,
            "COVEY_DAEMON_TOKEN": token,
            "COVEY_AGENT_ID": str(agent_id),
            "COVEY_SANDBOX_ID": str(sandbox_id),
        }
        if self.settings.model_url:
            env["COVEY_MODEL_URL"] = self.settings.model_url
        try:
            await self.runner.start(env, sandbox_id, agent_id, session_id)
        except Exception as exc:
            log.error("sandbox failed to start", agent_id=str(agent_id), error=str(exc))
            await self.session_lost(session_id, f"sandbox failed to start: {exc}")

    async def wake_many(self, agent_ids: list[UUID], path: str) -> list[UUID]:
        results = await asyncio.gather(*(self.wake(a, path) for a in agent_ids))
        return [a for a, r in zip(agent_ids, results, strict=True) if r.outcome == "started"]

    def wake_notified(self, agent_id: UUID) -> None:
        """A covey_wake NOTIFY: open work for the agent (a new task, a requeue). The NOTIFYs
        of one burst are looked at together, and only the agents that may run are woken.
        A fleet kill's requeue sends one per task, all for stopped agents: each used to be
        a wake of its own, a transaction that locked its agent and the organisation's row
        and committed with a WAL flush, a thousand of them queued in the pool and the WAL
        beside the kill's confirmations, only to be refused one by one."""
        self._notified[agent_id] = None
        if self._notified_waking is None:
            self._notified_waking = asyncio.ensure_future(self._wake_notified())
            self._background.add(self._notified_waking)
            self._notified_waking.add_done_callback(self._settled)

    async def _wake_notified(self) -> None:
        try:
            await asyncio.sleep(0)  # the NOTIFYs of this turn of the loop join the first look
            while self._notified:
                agent_ids = list(self._notified)
                self._notified.clear()
                for agent_id in await self._may_run(agent_ids):
                    self.spawn(self.wake(agent_id, "notify"))
        finally:
            self._notified_waking = None

    async def _may_run(self, agent_ids: list[UUID]) -> list[UUID]:
        """Of these agents, those no stop holds as of now, without a lock: a first look, the
        wake's own locked check still decides. Dropping an agent that a stop held here is
        safe however soon the stop is lifted: every release (agent resume, fleet resume,
        the global stop cleared) wakes the agents with open work itself after its commit,
        and that commit came after this look, so after the work it would find. When the
        look fails (the database away), every agent gets its wake, as before."""
        try:
            rows = await self.pool.fetch(
                "SELECT a.id FROM agents a JOIN organizations o ON o.id=a.org_id"
                f" WHERE a.id = ANY($1::uuid[]) AND {MAY_RUN}", agent_ids)
        except Exception as exc:
            log.warning("wake look-up failed; waking each", agents=len(agent_ids),
                        error=str(exc))
            return agent_ids
        may_run = {r["id"] for r in rows}
        held = len(agent_ids) - len(may_run)
        if held:
            metrics.wakes.labels("notify", "refused").inc(held)
        return [a for a in agent_ids if a in may_run]

    # ---------------------------------------------------------------- work

    async def claim_next(self, session_id: UUID) -> asyncpg.Record | None:
        """Claim the agent's next open task for this session, fenced by a fresh token."""
        async with transaction(self.pool) as conn:
            agent_id = await conn.fetchval("SELECT agent_id FROM sessions WHERE id=$1",
                                           session_id)
            agent = await lock_agent(conn, agent_id, write=True) if agent_id else None
            if agent is None or agent["stopped"]:
                return None
            state = await conn.fetchval("SELECT state FROM sessions WHERE id=$1 FOR UPDATE",
                                        session_id)
            if state not in LIVE:
                return None
            task = await conn.fetchrow(
                """
                WITH next AS (
                    SELECT id FROM backlog_tasks WHERE agent_id=$1 AND state='open'
                    ORDER BY priority DESC, created_at, id LIMIT 1 FOR UPDATE SKIP LOCKED
                )
                UPDATE backlog_tasks t SET state='in_progress',
                       claim_token=nextval('fencing_tokens'), claimed_by=$2, updated_at=now()
                FROM next WHERE t.id=next.id
                RETURNING t.id, t.title, t.body, t.claim_token, t.origin
                """,
                agent_id, session_id,
            )
            if task is None:
                return None
            await conn.execute(
                "INSERT INTO task_transitions (task_id, from_state, to_state, note)"
                " VALUES ($1, 'open', 'in_progress', $2)",
                task["id"], f"claimed by session {session_id}",
            )
            await conn.execute(
                "UPDATE sessions SET state='running', task_id=$2 WHERE id=$1",
                session_id, task["id"],
            )
            await conn.execute("UPDATE agents SET status='working' WHERE id=$1", agent_id)
            await emit_status(conn, agent["org_id"], agent_id, "working")
            return task

    async def finish_task(self, session_id: UUID, task_id: UUID, fencing_token: int,
                          to_state: str, result: str) -> str | None:
        """Record a session's result. Returns None when accepted, else why it was refused.

        A result counts only from the live session that holds the task's current fencing
        token: a killed, lost or superseded session cannot complete work twice.
        """
        async with transaction(self.pool) as conn:
            # Locking the agent and org rows waits for a kill in flight: its flag is committed
            # before the daemon hears `kill`, so a result racing the kill is refused.
            agent_id = await conn.fetchval("SELECT agent_id FROM sessions WHERE id=$1",
                                           session_id)
            agent = await lock_agent(conn, agent_id, write=False) if agent_id else None
            row = await conn.fetchrow(
                """
                SELECT s.state AS session_state, t.state AS task_state, t.claim_token,
                       t.claimed_by, t.agent_id
                FROM sessions s JOIN backlog_tasks t ON t.agent_id=s.agent_id
                WHERE s.id=$1 AND t.id=$2 FOR UPDATE OF t
                """,
                session_id, task_id,
            )
            if row is None or agent is None:
                metrics.rejected_results.labels("unknown").inc()
                return "unknown task"
            why = None
            if agent["stopped"]:
                why = ("agent is killed" if agent["killed"] else
                       "fleet is stopped" if agent["fleet_killed"] else "control plane is stopped")
            elif row["session_state"] not in LIVE:
                why = f"session is {row['session_state']}"
            elif (row["task_state"] != "in_progress" or row["claimed_by"] != session_id
                  or row["claim_token"] != fencing_token):
                why = "stale fencing token"
            if why is not None:
                metrics.rejected_results.labels(why.split()[0]).inc()
                return why
            await conn.execute(
                "UPDATE backlog_tasks SET state=$2, result=$3, claim_token=NULL,"
                " updated_at=now() WHERE id=$1",
                task_id, to_state, result,
            )
            await conn.execute(
                "INSERT INTO task_transitions (task_id, from_state, to_state, note)"
                " VALUES ($1, 'in_progress', $2, $3)",
                task_id, to_state, f"session {session_id}",
            )
            await record(conn, row["agent_id"], session_id, "task", to_state,
                         {"task_id": str(task_id)})
            return None

    async def end_session(self, session_id: UUID) -> str | None:
        """A session out of work ends, the agent sleeps. Returns what its daemon is to do:
        `sleep` (a real falling-asleep), `park` (a warm agent's sandbox stays up, its daemon
        connected and idle: covey never sends `sleep` to a warm agent), or None when the
        session was already over."""
        async with transaction(self.pool) as conn:
            agent_id = await conn.fetchval("SELECT agent_id FROM sessions WHERE id=$1",
                                           session_id)
            agent_row = None if agent_id is None else await lock_agent(conn, agent_id,
                                                                       write=True)
            if agent_row is None:
                return None
            row = await conn.fetchrow(
                "UPDATE sessions SET state='ended', ended_at=now() WHERE id=$1"
                " AND state IN ('starting','running') RETURNING agent_id, sandbox_id",
                session_id,
            )
            if row is None:
                return None
            parked = None
            if (agent_row["warm_sandbox"] and self.runner is not None
                    and self.runner.holds(row["sandbox_id"])):
                parked = await conn.fetchval(
                    "UPDATE sandboxes SET state='parked', parked_at=now() WHERE id=$1"
                    " AND state IN ('starting','running') RETURNING id", row["sandbox_id"])
            agent = await conn.fetchrow(
                "UPDATE agents SET status='sleeping' WHERE id=$1 AND NOT killed"
                " RETURNING org_id", row["agent_id"],
            )
            await record(conn, row["agent_id"], session_id, "session", "ended",
                         {"parked": parked is not None})
            if agent is not None:
                await emit_status(conn, agent["org_id"], row["agent_id"], "sleeping")
        return "sleep" if parked is None else "park"

    async def session_lost(self, session_id: UUID, why: str) -> list[UUID]:
        """The daemon went away without a clean end: requeue its task, counting retries.

        The requeue's NOTIFY wakes the agent again, through the same flag checks as any wake.
        """
        max_retries = self.settings.max_daemon_retries
        # Most calls come from daemons that obeyed a kill (their session is already over):
        # those sent from here need no query at all, the others no transaction. A fleet
        # kill of a thousand makes two calls per daemon while its answer is still due.
        if self.hub.kill_sent(session_id):
            return []
        agent_id = await self.pool.fetchval(
            "SELECT agent_id FROM sessions WHERE id=$1 AND state IN ('starting','running')",
            session_id)
        if agent_id is None:
            return []
        async with transaction(self.pool) as conn:
            if await lock_agent(conn, agent_id, write=True) is None:
                return []
            row = await conn.fetchrow(
                "UPDATE sessions SET state='lost', ended_at=now(), stop_reason=$2 WHERE id=$1"
                " AND state IN ('starting','running') RETURNING agent_id",
                session_id, why,
            )
            if row is None:
                return []
            tasks = await _lose_work(conn, session_id, max_retries, why)
            agent = await conn.fetchrow(
                "UPDATE agents SET status='sleeping' WHERE id=$1 AND NOT killed"
                " RETURNING org_id", row["agent_id"],
            )
            await record(conn, row["agent_id"], session_id, "session", "lost",
                         {"why": why, "tasks": {str(t["id"]): t["state"] for t in tasks}})
            if agent is not None:
                await emit_status(conn, agent["org_id"], row["agent_id"], "sleeping")
        for t in tasks:
            metrics.daemon_losses.labels("failed" if t["state"] == "failed" else "requeued").inc()
        log.warning("daemon lost", session_id=str(session_id), why=why)
        return [t["id"] for t in tasks]

    async def result_refused(self, session_id: UUID, why: str) -> list[UUID]:
        """The session's result for its task was refused at the protocol's boundary (a frame
        too large to read, a field out of protocol): the task it holds goes back to the
        backlog at once, as after a daemon loss (counted against daemon_retries, failed past
        them, saying why), and the session goes on. The task once stayed in progress for as
        long as its daemon, its run over, stayed connected waiting for a next task. Returns
        the tasks settled (none when the session is over or holds none)."""
        agent_id = await self.pool.fetchval(
            "SELECT agent_id FROM sessions WHERE id=$1 AND state IN ('starting','running')",
            session_id)
        if agent_id is None:
            return []
        async with transaction(self.pool) as conn:
            if await lock_agent(conn, agent_id, write=False) is None:
                return []
            if await conn.fetchval(
                    "SELECT 1 FROM sessions WHERE id=$1 AND state IN ('starting','running')"
                    " FOR SHARE", session_id) is None:
                return []  # ended or killed meanwhile: its work is settled there
            tasks = await _lose_work(conn, session_id, self.settings.max_daemon_retries, why)
            if tasks:
                await record(conn, agent_id, session_id, "task", "result_refused", {
                    "why": why, "tasks": {str(t["id"]): t["state"] for t in tasks}})
        for t in tasks:
            metrics.daemon_losses.labels("failed" if t["state"] == "failed" else "requeued").inc()
        if tasks:
            log.warning("result refused: task put back", session_id=str(session_id), why=why)
        return [t["id"] for t in tasks]

    async def guard_trip(self, session_id: UUID, task_id: UUID, fencing_token: int,
                         trip: GuardTripReport) -> str | None:
        """The daemon's own guard stopped the agent. Record it, alert with context, requeue
        the task, and hold the agent (kill origin 'guard') so that nothing wakes it again on
        its own: a human resume is needed. Returns why the report was refused, if it was."""
        async with transaction(self.pool) as conn:
            agent_id = await conn.fetchval("SELECT agent_id FROM sessions WHERE id=$1",
                                           session_id)
            agent = await lock_agent(conn, agent_id, write=True) if agent_id else None
            row = await conn.fetchrow(
                """
                SELECT s.state, s.agent_id, t.claimed_by, t.claim_token, t.state AS task_state
                FROM sessions s JOIN backlog_tasks t ON t.id=$2 AND t.agent_id=s.agent_id
                WHERE s.id=$1 FOR UPDATE OF s, t
                """,
                session_id, task_id,
            )
            if row is None or agent is None:
                return "unknown task"
            if row["state"] not in LIVE:
                return f"session is {row['state']}"
            if (row["task_state"] != "in_progress" or row["claimed_by"] != session_id
                    or row["claim_token"] != fencing_token):
                return "stale fencing token"
            await conn.execute(
                "UPDATE sessions SET state='tripped', ended_at=now(), stop_layer=$2,"
                " stop_reason=$3, steps=$4 WHERE id=$1",
                session_id, trip.layer, trip.reason, trip.steps,
            )
            await conn.execute(
                "UPDATE agents SET killed=true, kill_origin='guard', status='killed',"
                " killed_at=now() WHERE id=$1 AND NOT killed",
                row["agent_id"],
            )
            await requeue_in_progress(conn, "t.claimed_by=$1", [session_id],
                                      f"guard trip: {trip.layer}")
            await record(conn, row["agent_id"], session_id, "guard", "tripped", trip.detail)
            recipients = await conn.fetchval(
                "SELECT COALESCE(array_agg(id), '{}') FROM humans WHERE org_id=$1"
                " AND (role IN ('org_admin','security') OR id=$2)",
                agent["org_id"], agent["owner_id"],
            )
            title = (f"Agent {agent['display_name']} ({agent['slug']}) stopped by the "
                     f"{trip.layer_name}: {trip.reason}")
            await conn.execute(
                "INSERT INTO notifications (org_id, class, kind, title, link, recipients)"
                " VALUES ($1, 'guard', 'agent_tripped', $2, $3, $4)",
                agent["org_id"], title[:500], f"/administration#agent-{row['agent_id']}",
                recipients,
            )
            await emit_status(conn, agent["org_id"], row["agent_id"], "killed")
        metrics.guard_trips.labels(trip.layer).inc()
        log.warning("guard trip", agent_id=str(row["agent_id"]), layer=trip.layer,
                    reason=trip.reason)
        return None

    async def sandbox_exited(self, sandbox_id: UUID, session_id: UUID, code: int) -> bool:
        """Settle the session of a sandbox whose daemon exited; True if it had ended cleanly
        (told to sleep), so that its home is worth syncing or parking."""
        await self.session_lost(session_id, f"daemon exited with code {code}")
        if code != 0 and self.hub.kill_sent(session_id):  # cancelled by a kill: not clean
            return False
        state = await self.pool.fetchval("SELECT state FROM sessions WHERE id=$1", session_id)
        return bool(state == "ended")

    # ---------------------------------------------------------------- switches

    async def _switch(self, conn: Connection, body: Callable[[Connection], Awaitable[T]],
                      scope: str, started: float) -> T:
        """Run a switch's flag transaction; time its commit."""
        result = await _retried(conn, body, scope, "flag")
        metrics.kill_stage_seconds.labels(scope, "flag_committed").observe(
            time.perf_counter() - started)
        return result

    async def kill_agent(self, org_id: UUID, agent_id: UUID, actor_id: UUID | None,
                         origin: str = "agent", started: float | None = None,
                         reason: str | None = None) -> KillReport | None:
        """DESIGN §2.3 line 1. Returns None when the agent is not in this organisation.
        `started` is when the request arrived (perf_counter), for the stage metrics."""
        started = time.perf_counter() if started is None else started

        async def flag(conn: Connection) -> tuple[asyncpg.Record, list[asyncpg.Record]] | None:
            row = await conn.fetchrow(
                """
                WITH prev AS (
                    SELECT id, killed, kill_origin FROM agents
                    WHERE id=$1 AND org_id=$2 FOR NO KEY UPDATE
                )
                UPDATE agents a SET killed=true, status='killed',
                       killed_at=COALESCE(a.killed_at, now()),
                       -- An agent's own kill outranks the fleet's: fleet resume must leave
                       -- an agent that someone stopped on purpose stopped.
                       kill_origin=CASE WHEN NOT prev.killed OR prev.kill_origin='fleet'
                                        THEN $3 ELSE prev.kill_origin END
                FROM prev WHERE a.id=prev.id
                RETURNING prev.killed AS was_killed, prev.kill_origin AS was_origin
                """,
                agent_id, org_id, origin,
            )
            if row is None:
                return None
            live = await self._cancel_live_sessions(conn, "s.agent_id=$1", [agent_id])
            if not row["was_killed"] or row["was_origin"] != origin:
                await audit(conn, org_id, actor_id, "agent.kill", str(agent_id),
                            {"origin": origin, "reason": reason})
                await emit_status(conn, org_id, agent_id, "killed")
            return row, live

        # One connection for both of the kill's transactions, held between them: a kill
        # must not wait for a second pool connection while it holds one (a hundred kills
        # at once emptied the pool that way), nor queue for its requeue behind the
        # statements of the very exits it caused (a fleet kill causes hundreds at once).
        async with self.switch_pool.acquire() as conn:
            done = await self._switch(conn, flag, "agent", started)
            if done is None:
                return None
            row, live = done
            changed = not row["was_killed"] or row["was_origin"] != origin
            report = KillReport(already_killed=bool(row["was_killed"]), agents=[agent_id])
            evicted = await self._stop_sessions(conn, "agent", live,
                                                [agent_id] if changed else [], started, report,
                                                held=("SELECT $1::uuid", [agent_id]))
        await self._await_stopped(live, evicted, report)
        metrics.kills.labels("agent", "already" if report.already_killed else "killed").inc()
        return report

    async def kill_fleet(self, org_id: UUID, actor_id: UUID | None,
                         started: float | None = None, reason: str | None = None
                         ) -> KillReport:
        """DESIGN §2.3 line 2: the org flag, then every agent's kill, in one commit."""
        started = time.perf_counter() if started is None else started

        async def flag(conn: Connection) -> tuple[bool, list[UUID], list[asyncpg.Record]]:
            was = bool(await lock_fleet(conn, org_id))
            await conn.execute(
                "UPDATE organizations SET fleet_killed=true,"
                " fleet_killed_at=COALESCE(fleet_killed_at, now()),"
                " fleet_killed_by=COALESCE(fleet_killed_by, $2),"
                " fleet_killed_reason=CASE WHEN fleet_killed THEN fleet_killed_reason ELSE $3 END"
                " WHERE id=$1",
                org_id, actor_id, reason,
            )
            newly = [r["id"] for r in await conn.fetch(
                "UPDATE agents SET killed=true, kill_origin='fleet', status='killed',"
                " killed_at=now() WHERE org_id=$1 AND NOT killed RETURNING id",
                org_id,
            )]
            live = await self._cancel_live_sessions(conn, "a.org_id=$1", [org_id])
            if not was:
                recipients = await conn.fetchval(
                    "SELECT COALESCE(array_agg(id), '{}') FROM humans WHERE org_id=$1"
                    " AND role IN ('org_admin','controlling')",
                    org_id,
                )
                await conn.execute(
                    "INSERT INTO notifications (org_id, class, kind, title, link, recipients)"
                    " VALUES ($1, 'cost', 'fleet_killed', $2, '/administration', $3)",
                    org_id, FLEET_KILLED_TITLE, recipients,
                )
                await audit(conn, org_id, actor_id, "fleet.kill", str(org_id),
                            {"agents": len(newly), "reason": reason})
            await emit_statuses(conn, org_id, newly, "killed")
            return was, newly, live

        async with self.switch_pool.acquire() as conn:  # one connection, as in kill_agent
            was, agents, live = await self._switch(conn, flag, "fleet", started)
            report = KillReport(already_killed=was, agents=agents)
            evicted = await self._stop_sessions(
                conn, "fleet", live, agents, started, report,
                held=("SELECT id FROM agents WHERE org_id=$1", [org_id]))
        await self._await_stopped(live, evicted, report)
        metrics.kills.labels("fleet", "already" if was else "killed").inc()
        return report

    async def _cancel_live_sessions(self, conn: Connection, where: str, args: list[Any]
                                    ) -> list[asyncpg.Record]:
        """Cancel the sessions a kill must stop, in the flag's own transaction, and announce
        them to every replica at commit. Cancelled with the flag, a daemon that exits the
        instant it hears `kill` is never mistaken for a lost one (that would count a retry
        and requeue behind the kill's back)."""
        live = await conn.fetch(
            f"""
            UPDATE sessions s SET state='cancelled', ended_at=now(), stop_layer='kill-switch',
                   stop_reason='stopped by the kill switch'
            FROM agents a
            WHERE a.id=s.agent_id AND {where} AND s.state IN ('starting','running')
            RETURNING s.id, s.agent_id, s.sandbox_id
            """,
            *args,
        )
        # Daemons connected to another replica hear of the kill through it; one NOTIFY
        # per batch that fits the 8000-byte payload.
        await notify_all(conn, "covey_kill", [",".join(str(s["id"]) for s in live[i:i + 200])
                                              for i in range(0, len(live), 200)])
        return list(live)

    async def _stop_sessions(self, conn: Connection, scope: str, live: list[asyncpg.Record],
                             agents: list[UUID], started: float, report: KillReport,
                             held: tuple[str, list[Any]] | None = None
                             ) -> list[asyncpg.Record]:
        """After the flag is committed (with the sessions cancelled): kill messages, evict
        warm sandboxes, requeue in-progress work, record. In that order (DESIGN §2.3 line 1).
        `agents` are those whose flag this kill set; with the agents of live sessions, they
        are the ones it touches (a repeated kill touches none, and records nothing). `held`
        (a query of agent ids, its arguments) are all the agents the flag now stops: their
        parked sandboxes are evicted and their work requeued even on a repeated kill, which
        must finish what an earlier one cut short (its control plane SIGKILLed, its database
        gone, between its flag and this step: the retry its 503 asks for answered 200 and left
        the work in progress). Returns the evicted sandboxes. `conn` is the flag's
        connection: a few statements on it, whatever the fleet's size."""
        session_ids = [s["id"] for s in live]
        crowd = len(session_ids)
        delivered = await asyncio.gather(*(self.hub.send_kill(s, crowd) for s in session_ids))
        report.kill_delivered = [s for s, ok in zip(session_ids, delivered, strict=True) if ok]
        metrics.kill_stage_seconds.labels(scope, "kill_sent").observe(
            time.perf_counter() - started)
        touched = sorted({*agents, *(s["agent_id"] for s in live)})
        evicted: list[asyncpg.Record] = []

        among, among_args = held or ("SELECT unnest($1::uuid[])", [touched])

        async def requeue(conn: Connection) -> tuple[list[asyncpg.Record], list[UUID]]:
            evicted = await conn.fetch(
                "UPDATE sandboxes SET state='evicted', ended_at=now()"
                f" WHERE agent_id IN ({among}) AND state='parked'"
                " RETURNING id, agent_id, node",
                *among_args,
            )
            requeued = await requeue_in_progress(
                conn, f"t.agent_id IN ({among})", among_args, f"{scope} kill-switch")
            if touched:
                await record_many(conn, touched, {s["agent_id"]: s["id"] for s in live},
                                  "kill", "killed", {"scope": scope,
                                                     "requeued": len(requeued)})
            return list(evicted), requeued

        if touched or held:
            # Retried like the flag's: with the flag committed, a requeue that failed on a
            # deadlock would leave the work in progress and answer the kill with a 500.
            evicted, report.tasks_requeued = await _retried(conn, requeue, scope, "requeue")
            report.evicted_sandboxes = [r["id"] for r in evicted]
        metrics.kill_stage_seconds.labels(scope, "requeued").observe(
            time.perf_counter() - started)
        report.sessions_cancelled = session_ids
        return evicted

    async def _await_stopped(self, live: list[asyncpg.Record], evicted: list[asyncpg.Record],
                             report: KillReport) -> None:
        """With the kill's connection back in the pool: the sandboxes' teardown, then the
        wait for the daemons' confirmations."""
        if self.runner is not None:
            await self.runner.discard_evicted(evicted)
            self.runner.tear_down([s["sandbox_id"] for s in live],
                                  {s["sandbox_id"] for s in live
                                   if s["id"] in report.kill_delivered})
        # The answer waits until the daemons have the kill in hand: a game day once saw a
        # model call leave a sandbox after the acknowledgement, the kill still on its way
        # through a proxy. Bounded: a daemon that cannot answer is stopped by its lease.
        # Those another replica holds too: a game day pulled a kill on one replica and had
        # its answer before the daemon on the other had even heard of it.
        bound_s = self._confirm_bound_s
        here = set(report.kill_delivered)
        (local, torn), remote = await asyncio.gather(
            self._second_line(report.kill_delivered, bound_s),
            self._confirmed_elsewhere([s["id"] for s in live if s["id"] not in here],
                                      bound_s))
        report.kill_confirmed = [*local, *remote]
        report.kill_acknowledged = [*self.hub.acknowledged(local),
                                    *(s for s, how in remote.items() if how == "kill_ack")]
        report.kill_torn_down = [*torn, *(s for s, how in remote.items() if how == "teardown")]

    @property
    def _confirm_bound_s(self) -> float:
        """How long a kill's answer waits for its daemons' confirmations at most."""
        return min(self.settings.lease_ms / 1000, 2.0)

    async def _second_line(self, session_ids: list[UUID], bound_s: float
                           ) -> tuple[list[UUID], list[UUID]]:
        """Wait for the daemons connected here to confirm the kill sent to them; those that
        have not acknowledged it within the kill-ack bound (from the kill's send) have their
        sandboxes torn down by the runner: the second line. Returns the sessions confirmed
        (in the order given) and those of them confirmed by a teardown.

        A daemon's acknowledgement is the first line, and a daemon is code that can break:
        one deaf to `kill` (its kill handling broken, its loop blocked, its channel wedged)
        otherwise ran on until its lease lapsed, acting all the while. The bound sits well
        under the lease; a daemon torn down is never counted as having obeyed. A daemon
        that hung up without a word within the bound is torn down too if it still runs (its
        record keeps the hang-up). A daemon whose sandbox this runner does not hold is waited
        for up to `bound_s`, as is every daemon without the second line
        (COVEY_KILL_ACK_BOUND_MS=0, or no runner here): a deaf one stops by its lease."""
        ack_bound_s = self.settings.kill_ack_bound_s
        if ack_bound_s is None or self.runner is None or not session_ids:
            return await self.hub.wait_stopped(session_ids, bound_s), []
        sent_ns = self.hub.first_kill_sent_ns(session_ids) or time.time_ns()
        left_s = max(0.0, ack_bound_s - (time.time_ns() - sent_ns) / 1e9)
        confirmed = set(await self.hub.wait_stopped(session_ids, left_s))
        acknowledged = set(self.hub.acknowledged(session_ids))
        await self._tear_down_once([s for s in session_ids if s not in acknowledged],
                                   ack_bound_s)
        torn = self.hub.torn_down(session_ids)
        confirmed.update(torn)
        if rest := [s for s in session_ids if s not in confirmed]:
            left_s = max(0.0, bound_s - (time.time_ns() - sent_ns) / 1e9)
            confirmed.update(await self.hub.wait_stopped(rest, left_s))
        return [s for s in session_ids if s in confirmed], torn

    async def _tear_down_once(self, session_ids: list[UUID], ack_bound_s: float) -> None:
        """Tear down the sandboxes of these sessions that still run here, once however many
        paths ask: a kill reaches a daemon by the local call and by its own NOTIFY, and
        whichever sends it, both hold the second line for it."""
        theirs = {f for s in session_ids if (f := self._tearing_down.get(s)) is not None}
        mine = [s for s in session_ids if s not in self._tearing_down]
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for session_id in mine:
            self._tearing_down[session_id] = done
        try:
            running = {} if self.runner is None else self.runner.sandboxes_of(mine)
            destroyed = set() if not running or self.runner is None else set(
                await self.runner.tear_down_now(list(running.values()), ack_bound_s))
            for session_id, sandbox_id in running.items():
                if sandbox_id not in destroyed:
                    continue
                log.warning("kill not acknowledged within its bound; sandbox torn down",
                            session_id=str(session_id), sandbox_id=str(sandbox_id),
                            bound_ms=round(ack_bound_s * 1000))
                link = self.hub.confirm_teardown(session_id)
                if link is not None:
                    self._save_teardown(link)
        finally:
            for session_id in mine:
                self._tearing_down.pop(session_id, None)
            done.set_result(None)
        if theirs:
            await asyncio.wait(theirs)

    def _save_teardown(self, link: DaemonLink) -> None:
        """Write a teardown's confirmation on the session, without holding up the kill's
        answer. Claimed first: the daemon's handler, which saves whatever confirmed the kill
        when the torn-down daemon's channel ends, then leaves it alone."""
        if link.confirmation_saved or link.kill_sent_ns is None or link.kill_confirmed_ns is None:
            return
        link.confirmation_saved = True
        sent, confirmed = (datetime.fromtimestamp(ns / 1e9, UTC)
                           for ns in (link.kill_sent_ns, link.kill_confirmed_ns))
        self.spawn(through_outage(lambda: self.record_kill_confirmation.write(
            link.session_id, sent, confirmed, "teardown", None), "kill confirmation"))

    async def _confirmed_elsewhere(self, session_ids: list[UUID], timeout_s: float
                                   ) -> dict[UUID, str]:
        """Of these sessions (cancelled by this kill, their daemon not connected here), wait
        at most `timeout_s` for those whose daemon another replica holds (its session, which
        it renewed within the lease; not this node's previous life) to confirm the kill there:
        that replica writes the confirmation on the session. Returns how each that did
        confirmed it. The database going away or hanging ends the wait (the daemons stop by
        their lease): it fails nothing, and it never outlasts `timeout_s`."""
        if not session_ids:
            return {}
        confirmed: dict[UUID, str] = {}
        pause = REMOTE_CONFIRM_POLL_S[0]
        try:
            async with asyncio.timeout(timeout_s):
                held = await self.switch_pool.fetch(
                    "SELECT id FROM sessions WHERE id = ANY($1::uuid[])"
                    " AND node NOT LIKE $2 || ':%'"
                    " AND last_seen_at > now() - make_interval(secs => $3)",
                    session_ids, self.node.rsplit(":", 1)[0], self.settings.lease_ms / 1000)
                waiting = [r["id"] for r in held]
                while waiting:
                    for r in await self.switch_pool.fetch(
                            "SELECT id, kill_confirmed_by FROM sessions"
                            " WHERE id = ANY($1::uuid[]) AND kill_confirmed_by IS NOT NULL",
                            waiting):
                        confirmed[r["id"]] = r["kill_confirmed_by"]
                    waiting = [s for s in waiting if s not in confirmed]
                    if waiting:
                        await asyncio.sleep(pause)
                        pause = min(pause * 2, REMOTE_CONFIRM_POLL_S[1])
        except TimeoutError:
            pass
        except ENDS_THE_REMOTE_WAIT as exc:
            log.warning("kill confirmations of other replicas not read", error=str(exc))
        return confirmed

    async def deliver_kills(self, session_ids: list[UUID]) -> None:
        """A kill announced by another replica (or by ourselves: sent at most once). The
        kill's own announcement comes back here too, for every session it already sent
        to: those cost nothing now."""
        crowd = len(session_ids)
        sending = self.hub.not_yet_killed(session_ids)
        sent = await asyncio.gather(*(self.hub.send_kill(s, crowd) for s in sending))
        # The second line holds here too: the replica that holds a daemon is the one whose
        # runner can tear its sandbox down (the kill's own replica reads the confirmation).
        delivered = [s for s, ok in zip(sending, sent, strict=True) if ok]
        if delivered and self.settings.kill_ack_bound_s is not None and self.runner:
            self.spawn(self._second_line(delivered, self._confirm_bound_s))

    async def resume_agent(self, org_id: UUID, agent_id: UUID, actor_id: UUID | None,
                           reason: str | None = None) -> ResumeReport | None:
        """DESIGN §2.3 line 6: clears the agent's own flag; a fleet stop still holds it."""
        async with transaction(self.pool) as conn:
            row = await lock_agent(conn, agent_id, write=True)
            if row is None or row["org_id"] != org_id:
                return None
            if row["killed"]:
                await conn.execute(
                    "UPDATE agents SET killed=false, kill_origin=NULL, killed_at=NULL,"
                    " status='sleeping' WHERE id=$1",
                    agent_id,
                )
                await audit(conn, org_id, actor_id, "agent.resume", str(agent_id),
                            {"reason": reason})
                await record(conn, agent_id, None, "kill", "resumed", {})
                await emit_status(conn, org_id, agent_id, "sleeping")
        report = ResumeReport(changed=bool(row["killed"]), held_by_fleet=bool(row["fleet_killed"]))
        if row["killed"]:
            report.agents_released = [agent_id]
        if not row["fleet_killed"]:  # wake() still asks MAY_RUN (a global stop holds it)
            report.agents_woken = await self.wake_many([agent_id], "resume")
        metrics.resumes.labels("agent", "resumed" if report.changed else "noop").inc()
        return report

    async def resume_fleet(self, org_id: UUID, actor_id: UUID | None,
                           reason: str | None = None) -> ResumeReport:
        """DESIGN §2.3 line 5: clear the org flag and only the agent flags the fleet set,
        then wake every agent with open work now, not on the next tick."""

        async def release(conn: Connection) -> tuple[bool, list[UUID]]:
            was = bool(await lock_fleet(conn, org_id))
            await conn.execute(
                "UPDATE organizations SET fleet_killed=false, fleet_killed_at=NULL,"
                " fleet_killed_by=NULL, fleet_killed_reason=NULL WHERE id=$1",
                org_id,
            )
            released = [r["id"] for r in await conn.fetch(
                "UPDATE agents SET killed=false, kill_origin=NULL, killed_at=NULL,"
                " status='sleeping' WHERE org_id=$1 AND kill_origin='fleet' RETURNING id",
                org_id,
            )]
            await record_many(conn, released, {}, "kill", "resumed", {"scope": "fleet"})
            await emit_statuses(conn, org_id, released, "sleeping")
            if was:
                await audit(conn, org_id, actor_id, "fleet.resume", str(org_id),
                            {"agents": len(released), "reason": reason})
            return was, released

        async with self.pool.acquire() as conn:
            was, released = await self._switch(conn, release, "fleet-resume",
                                               time.perf_counter())
            # Looked for after the commit, never inside it: a covey_wake that found the
            # fleet still stopped was dropped (wake_notified), and only a look that began
            # after the release committed is sure to see the work it announced.
            with_work = [r["id"] for r in await conn.fetch(
                "SELECT DISTINCT a.id FROM agents a JOIN organizations o ON o.id=a.org_id"
                " JOIN backlog_tasks t ON t.agent_id=a.id"
                f" WHERE a.org_id=$1 AND t.state='open' AND {MAY_RUN}",
                org_id,
            )]
        report = ResumeReport(changed=was, agents_released=released)
        report.agents_woken = await self.wake_many(with_work, "resume")
        metrics.resumes.labels("fleet", "resumed" if was else "noop").inc()
        return report

    # ---------------------------------------------------------------- scoped flags

    async def stop_globally(self, actor_id: UUID | None, reason: str,
                            started: float | None = None) -> KillReport:
        """The global flag: every organisation on this control plane stops. Agents' own
        flags are left alone, so that clearing it brings back exactly what it stopped."""
        started = time.perf_counter() if started is None else started

        async def flag(conn: Connection) -> tuple[bool, list[asyncpg.Record]]:
            # Every agent, then every organisation: the one lock order, so a wake either
            # commits its session before this (and is cancelled here) or sees the flag.
            await conn.execute("SELECT id FROM agents ORDER BY id FOR NO KEY UPDATE")
            await conn.execute("SELECT id FROM organizations ORDER BY id FOR NO KEY UPDATE")
            inserted = await conn.fetchval(
                "INSERT INTO kill_flags (id, scope, reason, set_by) VALUES ($1, 'global', $2, $3)"
                " ON CONFLICT DO NOTHING RETURNING id", uuid4(), reason, actor_id)
            live = await self._cancel_live_sessions(conn, "true", [])
            stopped = await conn.fetch(
                "UPDATE agents SET status='sleeping' WHERE id = ANY($1::uuid[]) AND NOT killed"
                " RETURNING id, org_id", [s["agent_id"] for s in live])
            for org in {r["org_id"] for r in stopped}:
                await emit_statuses(conn, org, [r["id"] for r in stopped
                                                if r["org_id"] == org], "sleeping")
            if inserted is not None:
                await audit(conn, None, actor_id, "flag.global.set", "global",
                            {"reason": reason, "sessions": len(live)})
            return inserted is None, live

        async with self.switch_pool.acquire() as conn:  # one connection, as in kill_agent
            was, live = await self._switch(conn, flag, "global", started)
            report = KillReport(already_killed=was)
            # A global stop holds every agent: a repeat finishes what one cut short left.
            evicted = await self._stop_sessions(conn, "global", live, [], started, report,
                                                held=("SELECT id FROM agents", []))
        await self._await_stopped(live, evicted, report)
        metrics.kills.labels("global", "already" if was else "killed").inc()
        return report

    async def clear_global_stop(self, actor_id: UUID | None, reason: str) -> ResumeReport:
        """Clear the global flag and wake at once every agent with open work that may run."""
        async with transaction(self.pool) as conn:
            cleared = await conn.fetchval(
                "DELETE FROM kill_flags WHERE scope='global' RETURNING id")
            if cleared is not None:
                await audit(conn, None, actor_id, "flag.global.clear", "global",
                            {"reason": reason})
        with_work = [r["id"] for r in await self.pool.fetch(
            "SELECT DISTINCT a.id FROM agents a JOIN organizations o ON o.id=a.org_id"
            f" JOIN backlog_tasks t ON t.agent_id=a.id WHERE t.state='open' AND {MAY_RUN}")]
        report = ResumeReport(changed=cleared is not None)
        report.agents_woken = await self.wake_many(with_work, "resume")
        return report

    async def stop_tool(self, org_id: UUID, agent_id: UUID | None, tool: str,
                        actor_id: UUID | None, reason: str) -> bool:
        """Stop one tool for one agent or the whole organisation. Returns whether the flag
        is new. The daemons hear it in their next lease, sent at once by every replica."""
        async with transaction(self.pool) as conn:
            inserted = await conn.fetchval(
                "INSERT INTO kill_flags (id, scope, org_id, agent_id, tool, reason, set_by)"
                " VALUES ($1, 'tool', $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING RETURNING id",
                uuid4(), org_id, agent_id, tool, reason, actor_id)
            if inserted is not None:
                await _tool_flag_changed(conn, "flag.tool.set", org_id, agent_id, tool,
                                         actor_id, reason)
        return inserted is not None

    async def clear_tool_stop(self, org_id: UUID, agent_id: UUID | None, tool: str,
                              actor_id: UUID | None, reason: str) -> bool:
        async with transaction(self.pool) as conn:
            cleared = await conn.fetchval(
                "DELETE FROM kill_flags WHERE scope='tool' AND org_id=$1 AND tool=$3"
                " AND agent_id IS NOT DISTINCT FROM $2 RETURNING id", org_id, agent_id, tool)
            if cleared is not None:
                await _tool_flag_changed(conn, "flag.tool.clear", org_id, agent_id, tool,
                                         actor_id, reason)
        return cleared is not None

    # ---------------------------------------------------------------- scheduler

    async def tick(self) -> None:
        """One scheduler pass: due heartbeats, sleeping agents with open work, lost daemons."""
        async with transaction(self.pool) as conn:
            # The UPDATE re-checks "due" under the row lock, so two replicas never fire the
            # same heartbeat twice.
            fired = await conn.fetch(
                f"""
                WITH due AS (
                    UPDATE agent_heartbeats h SET last_fired_at=now()
                    FROM agents a JOIN organizations o ON o.id=a.org_id
                    WHERE h.agent_id=a.id AND {MAY_RUN}
                      AND (h.last_fired_at IS NULL
                           OR h.last_fired_at + make_interval(
                                  secs => GREATEST(h.every_seconds, $1)) <= now())
                      AND (SELECT count(*) FROM backlog_tasks t
                           WHERE t.agent_id=a.id AND t.origin='heartbeat'
                             AND t.state IN ('open','in_progress','blocked')) < $2
                    RETURNING h.agent_id, h.name, h.task_body, a.org_id
                ), created AS (
                    INSERT INTO backlog_tasks (id, org_id, agent_id, title, body, origin)
                    SELECT gen_random_uuid(), org_id, agent_id, 'heartbeat: ' || name,
                           task_body, 'heartbeat' FROM due
                    RETURNING id, agent_id
                ), logged AS (
                    -- The same creation row the API, the trigger and a manual fire write.
                    INSERT INTO task_transitions (task_id, from_state, to_state, note)
                    SELECT id, NULL, 'open', 'created by heartbeat' FROM created
                )
                SELECT agent_id FROM created
                """,
                self.settings.heartbeat_min_s, MAX_OPEN_HEARTBEAT_TASKS,
            )
        stale = await self.pool.fetch(
            """
            SELECT id FROM sessions
            WHERE (state='running' AND last_seen_at < now() - make_interval(secs => $1))
               OR (state='starting' AND started_at < now() - make_interval(secs => $2))
            """,
            float(self.settings.daemon_timeout_s), float(self.settings.daemon_token_ttl_s),
        )
        for s in stale:
            await self.session_lost(s["id"], "daemon silent past its timeout")
        await self.requeue_orphaned_work()
        waiting = await self.pool.fetch(
            f"""
            SELECT DISTINCT a.id FROM agents a
            JOIN organizations o ON o.id=a.org_id
            JOIN backlog_tasks t ON t.agent_id=a.id AND t.state='open'
            WHERE {MAY_RUN}
              AND NOT EXISTS (SELECT 1 FROM sessions s WHERE s.agent_id=a.id
                              AND s.state IN ('starting','running'))
            """
        )
        ids = {r["agent_id"] for r in fired} | {r["id"] for r in waiting}
        if ids:
            await self.wake_many(sorted(ids), "tick")
        if self.runner is not None:
            await self.runner.maintain_parked(self.tell_idle_to_sleep)

    async def settle_previous_life(self) -> list[UUID]:
        """At start, the sessions this node's previous life left live (same host and port:
        only one process can hold them) are lost, their tasks back in the backlog as after
        any daemon loss. Their daemons' channels died with that life, their tokens are spent,
        and no replica but this one could ever hear them again; a game day found them still
        `running` about 6 s after a restart, until the stale-session sweep. Each is settled
        once its daemon's lease (renewed at the session's last_seen_at) has run out, so that
        no task is handed out again while its old daemon may still act: after a restart that
        has nearly always happened already. Another replica's sessions are never touched."""
        host_port = self.node.rsplit(":", 1)[0]
        rows = await through_outage(lambda: self.pool.fetch(
            "SELECT id, EXTRACT(EPOCH FROM last_seen_at - now())::float8 + $3 AS leased_s"
            " FROM sessions"
            " WHERE node LIKE $1 || ':%' AND node <> $2 AND state IN ('starting','running')",
            host_port, self.node, self.settings.lease_ms / 1000), "a previous life's sessions")
        if not rows:
            return []
        await asyncio.sleep(max(0.0, max(r["leased_s"] for r in rows)))
        # A daemon whose session was still `starting` may have dialled this life meanwhile
        # with its unspent token: it is served here, not lost.
        held = set(self.hub.session_ids())
        lost = [r["id"] for r in rows if r["id"] not in held]
        tasks: list[UUID] = []
        for session_id in lost:
            tasks += await through_outage(functools.partial(
                self.session_lost, session_id, "its control plane restarted: the daemon's "
                "channel died with the plane's previous life"), "a previous life's session")
        log.warning("sessions of a previous life settled", sessions=len(lost),
                    tasks=len(tasks))
        return tasks

    async def requeue_orphaned_work(self) -> list[UUID]:
        """Put back to open the tasks still in progress under a session that is over.

        A kill commits its flag with the sessions cancelled, then requeues their work in a
        second transaction. A game day SIGKILLed the control plane between the two, in the
        middle of a fleet kill: the tasks stayed `in_progress` for good, claimed by
        cancelled sessions, which no daemon loss or later kill would ever touch again (the
        same happens when the database goes away between them). The grace keeps this sweep
        from racing a kill whose requeue is simply on its way."""
        grace_s = max(ORPHAN_GRACE_MIN_S, 2 * self.settings.lease_ms / 1000)
        async with self.pool.acquire() as conn:
            requeued = await requeue_in_progress(
                conn, "EXISTS (SELECT 1 FROM sessions s WHERE s.id=t.claimed_by"
                      " AND s.state NOT IN ('starting','running')"
                      " AND s.ended_at < now() - make_interval(secs => $1))",
                [grace_s], "requeued: its session was over without it")
        if requeued:
            log.warning("work of ended sessions requeued", tasks=len(requeued))
        return requeued

    async def renew_leases(self, session_ids: list[UUID] | None = None) -> None:
        """Renew the lease of every daemon connected here (or of these) whose agent may
        still run, with the tool scopes stopped for it: the guard refuses those tools.

        A daemon whose lease is not renewed stops by itself: if this query fails (database
        unreachable) no lease goes out, and the fleet fails closed.
        """
        ids = self.hub.session_ids() if session_ids is None else session_ids
        if not ids:
            return
        # On the switches' lane: a renewal queued behind reads lets healthy daemons' leases
        # lapse under load, and they stop as if killed.
        rows = await self.switch_pool.fetch(
            f"""
            UPDATE sessions s SET last_seen_at=now()
            FROM agents a JOIN organizations o ON o.id=a.org_id
            WHERE s.id = ANY($1::uuid[]) AND s.agent_id=a.id
              AND s.state IN ('starting','running') AND {MAY_RUN}
            RETURNING s.id, ARRAY(
                SELECT DISTINCT 'tool:' || f.tool FROM kill_flags f
                WHERE f.scope='tool' AND f.org_id=a.org_id
                  AND (f.agent_id IS NULL OR f.agent_id=a.id) ORDER BY 1) AS stopped
            """,
            ids,
        )
        await asyncio.gather(*(
            self.hub.send(r["id"], "lease", {"ttl_ms": self.settings.lease_ms,
                                             "stopped": list(r["stopped"])})
            for r in rows))

    def spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._settled)

    def _settled(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background step failed", error=repr(task.exception()))


async def _retried(conn: Connection, body: Callable[[Connection], Awaitable[T]], scope: str,
                   step: str) -> T:
    """Run `body` in a transaction on `conn`, again when Postgres breaks a deadlock (or a
    serialization conflict) by failing it: an emergency stop must not fail because a wake,
    a sweep or a daemon's report held a row it needed. Each attempt starts from scratch."""
    for attempt in range(1, 6):
        try:
            async with conn.transaction():
                return await body(conn)
        except asyncpg.InterfaceError as exc:
            # A held connection that the server closed (a restart between the kill's two
            # transactions) is handed back to the pool by asyncpg, and its next use raises
            # this: the database was away, which the API answers with 503, not a 500.
            # (Even asking the proxy whether it is closed raises then: its message says.)
            if "released back to the pool" in str(exc) or "connection is closed" in str(exc):
                raise DatabaseUnavailable(f"the database closed the {scope} kill's "
                                          f"connection before its {step}: {exc}") from exc
            raise
        except asyncpg.InternalClientError as exc:
            # The server's goodbye (FATAL: terminating connection) read while the
            # connection was idle leaves asyncpg waiting for a ReadyForQuery that never
            # comes, until it sees the socket close: a query in between is refused with
            # "another operation is in progress". One kill never runs two queries on its
            # connection at once, so this is the database going away, as above.
            if "another operation" in str(exc):
                raise DatabaseUnavailable(f"the database closed the {scope} kill's "
                                          f"connection before its {step}: {exc}") from exc
            raise
        except (asyncpg.DeadlockDetectedError, asyncpg.SerializationError) as exc:
            if attempt == 5:
                raise
            log.warning("switch transaction retried", scope=scope, step=step,
                        attempt=attempt, error=str(exc))
    raise AssertionError("unreachable")


async def _tool_flag_changed(conn: Connection, action: str, org_id: UUID,
                             agent_id: UUID | None, tool: str, actor_id: UUID | None,
                             reason: str) -> None:
    """A tool flag set or cleared: in the audit log, and pushed to every replica's daemons
    in their next lease at once."""
    await audit(conn, org_id, actor_id, action,
                f"tool:{tool}" + (f"@{agent_id}" if agent_id else ""),
                {"reason": reason, "tool": tool,
                 "agent_id": str(agent_id) if agent_id else None})
    await conn.execute("SELECT pg_notify('covey_leases', '')")
