"""The orchestrator: wake, dispatch, the scheduler tick, daemon loss. The switches and their
resumes are covey.switches, whose class this one extends. DESIGN §2.3 is the contract; each
public method is one of its lines.

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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from uuid import UUID, uuid4

import asyncpg
import structlog

from covey import metrics
from covey.config import Settings
from covey.db import (
    MAY_RUN,
    BatchedWrite,
    Connection,
    Pool,
    fetch_one,
    through_outage,
    transaction,
)
from covey.hub import DaemonHub, DaemonLink
from covey.logs import log_failure
from covey.rows import emit_status, lock_agent, record, requeue_in_progress, sessions_in_order
from covey.security import new_token, token_hash
from covey.switches import Switches

log = structlog.get_logger(__name__)
_log_background_failure = log_failure(log, "background step failed")
T = TypeVar("T")

LIVE = ("starting", "running")

# The largest a session's cost can be: sessions.cost_usd is numeric(12,6). Each cost message
# is bounded (covey.protocol.MAX_COST_USD); their sum is held here, not refused: the spend was
# real, and the guard, not this column, is what stops a runaway.
MAX_SESSION_COST_USD = "999999.999999"
# No heartbeat fires more often than the settings' heartbeat_min_s (covey.config), and none
# of an agent fires while it already has this many heartbeat tasks unfinished.
MAX_OPEN_HEARTBEAT_TASKS = 10
# Work left in progress under a session that is over is requeued once the session has been
# over this long (or two leases, if longer): see `requeue_orphaned_work`.
ORPHAN_GRACE_MIN_S = 5.0


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


class Orchestrator(Switches):
    def __init__(self, pool: Pool, settings: Settings, hub: DaemonHub, node: str,
                 ws_url: str, switch_pool: Pool | None = None) -> None:
        super().__init__(pool, settings, hub, node, switch_pool)
        self.ws_url = ws_url
        # The daemon protocol's side of a warm wake: a connected daemon takes up a session
        # (covey.api.daemon sets it; the protocol lives there).
        self.hand_over: Callable[[DaemonLink], Awaitable[None]] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        # Agents named by covey_wake NOTIFYs not yet looked at (in arrival order), and the
        # task that looks at them: see wake_notified.
        self._notified: dict[UUID, None] = {}
        self._notified_waking: asyncio.Future[Any] | None = None
        # Agents whose wake by the scheduler's tick is under way: see _wake_from_tick.
        self._tick_waking: set[UUID] = set()
        # What working daemons say as they go (their tool events, their model costs), a
        # statement and a commit for all that arrive together, not each: an rm -rf fleet
        # of 20 said ~800 a second, each its own commit (a WAL flush) and its own turn for a
        # pooled connection, and the kill's statements queued behind them on the same
        # event loop and disk. Each daemon still waits for its own row (its messages stay
        # in order).
        self.record_event = BatchedWrite(
            self.pool,
            "INSERT INTO recording_events (agent_id, session_id, kind, status, detail)"
            " SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::text[],"
            " $5::jsonb[])")
        self.record_cost = BatchedWrite(
            self.pool,
            "WITH x AS (SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::numeric[],"
            " $4::integer[]) AS x(agent_id, session_id, usd, tokens)),"
            " booked AS (INSERT INTO cost_entries (agent_id, session_id, usd, tokens)"
            " SELECT agent_id, session_id, usd, tokens FROM x),"
            f" {sessions_in_order('SELECT session_id FROM x')}"
            " UPDATE sessions s SET cost_usd=LEAST(s.cost_usd + t.usd,"
            f" {MAX_SESSION_COST_USD})"
            " FROM (SELECT session_id, sum(usd) AS usd FROM x GROUP BY session_id) t, in_order"
            " WHERE s.id=t.session_id AND s.id=in_order.id")

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
        # Each taken or evicted only if still parked: the runner's upkeep (maintain_parked,
        # the tick's, beside its wakes) may have begun to put one to sleep meanwhile, and
        # a session handed to a daemon told `sleep` is lost.
        others = [b for b in parked if warm is None or b["id"] != warm["id"]]
        gone = {r["id"] for r in await conn.fetch(
            "UPDATE sandboxes SET state='evicted', ended_at=now()"
            " WHERE id = ANY($1::uuid[]) AND state='parked' RETURNING id",
            [b["id"] for b in others])} if others else set()
        evicted = [b for b in others if b["id"] in gone]
        if warm is not None and await conn.fetchval(
                "UPDATE sandboxes SET state='running', parked_at=NULL"
                " WHERE id=$1 AND state='parked' RETURNING id", warm["id"]) is None:
            warm = None
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
            self._notified_waking = self.spawn(self._wake_notified())

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
        """Of these agents, those no stop holds and no live session keeps busy as of now,
        without a lock: a first look, the wake's own locked check still decides. Dropping
        an agent that a stop held here is safe however soon the stop is lifted: every
        release (agent resume, fleet resume, the global stop cleared) wakes the agents with
        open work itself after its commit, and that commit came after this look, so after
        the work it would find. A busy one's work is left to its session, which claims it;
        work that comes while the session is ending, after its daemon found none, is left
        to the scheduler's next pass, as it was when the wake found the agent busy under
        its lock. (A wake at the session's end was tried: on a cold agent it would copy
        the agent's home before the ending sandbox has synced it back.) When the look
        fails (the database away), every agent gets its wake, as before.

        Busy agents are the common case under load (operators adding tasks to a working
        fleet), and each wake of one was a transaction that held the agent's row and its
        organisation's across four round trips on a busy event loop, only to find it busy.
        A fleet kill locks the same rows: in the incident-load game day its locks waited
        past 2 ms in 9 of 23 runs before this look (up to 22 ms, behind such wakes and
        behind commits queued for the NOTIFY lock), in 2 of 12 after (2.5 and 8.6 ms)."""
        try:
            rows = await self.pool.fetch(
                "SELECT a.id, EXISTS (SELECT 1 FROM sessions s WHERE s.agent_id=a.id"
                " AND s.state IN ('starting','running')) AS live"
                " FROM agents a JOIN organizations o ON o.id=a.org_id"
                f" WHERE a.id = ANY($1::uuid[]) AND {MAY_RUN}", agent_ids)
        except Exception as exc:
            log.warning("wake look-up failed; waking each", agents=len(agent_ids),
                        error=str(exc))
            return agent_ids
        may_run = {r["id"] for r in rows if not r["live"]}
        busy = sum(1 for r in rows if r["live"])
        held = len(agent_ids) - len(rows)
        if held:
            metrics.wakes.labels("notify", "refused").inc(held)
        if busy:
            metrics.wakes.labels("notify", "busy").inc(busy)
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
        for agent_id in sorted({r["agent_id"] for r in fired} | {r["id"] for r in waiting}):
            self._wake_from_tick(agent_id)
        if self.runner is not None:
            await self.runner.maintain_parked(self.tell_idle_to_sleep)

    def _wake_from_tick(self, agent_id: UUID) -> None:
        """The tick's wake of an agent, in the background. A wake lasts until its sandbox
        has started (a container's start takes seconds; an engine that hangs, as long as
        it hangs), and a tick that awaited its wakes fired no heartbeat, swept no silent
        daemon and woke no other agent meanwhile. An agent whose wake from an earlier tick
        is still under way is left to it."""
        if agent_id in self._tick_waking:
            return
        self._tick_waking.add(agent_id)

        async def wake() -> None:
            try:
                await self.wake(agent_id, "tick")
            except Exception as exc:
                log.warning("wake failed", agent_id=str(agent_id), path="tick", error=str(exc))
        # Whatever ends it (cancelled before its first step included).
        self.spawn(wake()).add_done_callback(lambda _: self._tick_waking.discard(agent_id))

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
            WITH {sessions_in_order(
                "SELECT id FROM sessions WHERE id = ANY($1::uuid[])"
                " AND state IN ('starting','running')")}
            UPDATE sessions s SET last_seen_at=now()
            FROM in_order, agents a JOIN organizations o ON o.id=a.org_id
            WHERE s.id=in_order.id AND s.agent_id=a.id
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

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Future[Any]:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._settled)
        return task

    def _settled(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        _log_background_failure(task)
