"""The switches (DESIGN §2.3): the agent kill, the fleet kill, the global stop, the tool
flags, and their resumes. The kill path reads top to bottom here: the flag committed with the
live sessions cancelled (`kill_agent`, `kill_fleet`, `_cancel_live_sessions`), the `kill`
messages, the warm sandboxes evicted and the work requeued (`_stop_sessions`), then the wait
for the daemons' confirmations (`_await_stopped`), with the second line behind them for a
daemon that does not acknowledge in time (`_second_line`, `_tear_down_once`) and the
confirmations of daemons another replica holds (`_confirmed_elsewhere`, `deliver_kills`).

Before all that, a kill holds its daemons (`_hold`, `_unhold`): a `hold` goes out to every daemon
connected here that the kill will stop, the moment the request is in, and the daemon starts
no model request or tool call until its `kill`, or a `release` if the committed flag did not
stop it after all, or the hold's end (a lease). The contract's order stands: the `kill`
itself goes out only after the flag is committed. The hold covers the time the commit takes,
10-40 ms on a loaded host, in which the fastest agents of the incident-load game day acted
twice.

The switches run on a lane of their own (`switch_pool`, covey.admission): no read can take
the connections a kill needs. The lock order they share with every wake is described at the
top of covey.orchestrator.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar
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
    through_outage,
    transaction,
)
from covey.hub import DaemonHub, DaemonLink, send_to
from covey.rows import (
    audit,
    cancelled_live_ctes,
    emit_status,
    emit_statuses,
    lock_agent,
    lock_fleet,
    log_audit,
    record,
    record_many,
    requeue_ctes,
    sessions_in_order,
    status_event,
    statuses_cte,
)
from covey.sandbox import Runner

log = structlog.get_logger(__name__)
T = TypeVar("T")

# How often a kill reads whether the daemons another replica holds have confirmed it: from
# the first pause, doubling up to the second (a dozen reads in a 2 s wait, not a hundred).
REMOTE_CONFIRM_POLL_S = (0.02, 0.25)
# How much longer than a lease the answer waits for a daemon that stops only by its lease:
# the daemon counts its lease from the last renewal it received (none is sent after the
# kill: hub.send_to), checks it every 50 ms (coveyd), and its `stopping` has to come back.
# Waiting one lease to the millisecond left that confirmation out of the answer now and
# then (a deaf daemon's test failed in a loaded run). Every kill whose daemons do not all
# confirm within the lease waits this much longer, so it stays small.
LEASE_LAPSE_GRACE_S = 0.25
# What ends that wait without failing the kill (already in effect): the database away, or a
# connection of the switches' lane broken by it.
ENDS_THE_REMOTE_WAIT: tuple[type[Exception], ...] = (
    *UNREACHABLE, asyncpg.InterfaceError, asyncpg.InternalClientError)

# How long a kill spends sending its holds before its flag, at most (see `_hold`): a few
# microseconds a frame, unless its daemon does not read its channel.
HOLDS_INLINE_S = 0.02

FLEET_KILLED_TITLE = (
    "The emergency stop was pulled: every agent of this organisation is paused"
)


@dataclass(frozen=True)
class FlagFunction:
    """A switch's flag in one round trip: `locks` taken in order, then `statement` on a
    snapshot taken under them, committed by the call itself, as a PL/pgSQL function of
    the database named by its own text (`install_flags` creates it). Both see the switch's
    values as $1..$6 (uuid, uuid, uuid, text, text, text); the statement's rows are (what,
    id, agent_id, sandbox_id, flag, origin, actor).

    The statement must run after the locks, on a snapshot taken once they are held: a wake
    that committed a session while the kill waited for the agent's row is seen, and that
    session cancelled. One plain statement cannot do it (its snapshot is taken before it
    waits); a VOLATILE PL/pgSQL function takes a new snapshot for each statement it runs
    (READ COMMITTED).

    The flag was three round trips (BEGIN with the locks, the statement, COMMIT), and before
    that eleven. Then one generic function (migration 0023) that ran the locks and the
    statement it was sent as dynamic SQL: its bookkeeping (naming the statement, looking it
    up among the prepared ones, EXECUTE of text) took a third of the agent kill's flag, 0.36
    of 1.09 ms on a quiet connection, against the floor's UPDATE of 0.39 ms. Here the locks
    and the statement are the function's own static SQL, which PL/pgSQL plans once per
    connection (and again by itself after a change of the schema)."""

    scope: str
    locks: tuple[str, ...]
    statement: str

    @functools.cached_property
    def _definition(self) -> str:
        """All of the function but its name, which is named by this."""
        performed = "".join(f"    PERFORM {lock.removeprefix('SELECT ')};\n"
                            for lock in self.locks)
        # The table's columns are also the names of the function's own, which a column
        # of the statement's must win over.
        return ("(uuid, uuid, uuid, text, text, text) RETURNS TABLE (what text, id uuid,"
                " agent_id uuid, sandbox_id uuid, flag boolean, origin text, actor text)"
                " LANGUAGE plpgsql VOLATILE AS $flag$\n#variable_conflict use_column\nBEGIN\n"
                f"{performed}    RETURN QUERY {self.statement.strip()};\nEND;\n$flag$")

    @functools.cached_property
    def name(self) -> str:
        digest = hashlib.sha256(self._definition.encode()).hexdigest()[:16]
        return f"covey_flag_{self.scope}_{digest}"

    @functools.cached_property
    def signature(self) -> str:
        return f"{self.name}(uuid, uuid, uuid, text, text, text)"

    @functools.cached_property
    def create(self) -> str:
        return f"CREATE FUNCTION {self.name}{self._definition}"

    @functools.cached_property
    def call(self) -> str:
        return f"SELECT * FROM {self.name}($1, $2, $3, $4, $5, $6)"


# The agent kill: the agent's row locked, then one statement on a snapshot taken under the
# lock, so that it sees a session a wake committed while the kill waited. Its values: the
# agent, its organisation, the actor, the kill's origin and reason, its status event.
AGENT_FLAG = FlagFunction(
    "agent",
    ("SELECT id FROM agents WHERE id=$1 AND org_id=$2 FOR NO KEY UPDATE",),
    f"""
    WITH prev AS (
        SELECT id, killed, kill_origin FROM agents WHERE id=$1 AND org_id=$2
    ), flagged AS (
        UPDATE agents a SET killed=true, status='killed',
               killed_at=COALESCE(a.killed_at, now()),
               -- An agent's own kill outranks the fleet's: fleet resume must
               -- leave an agent that someone stopped on purpose stopped.
               kill_origin=CASE WHEN NOT prev.killed OR prev.kill_origin='fleet'
                                THEN $4 ELSE prev.kill_origin END
        FROM prev WHERE a.id=prev.id
    ), {cancelled_live_ctes("a.id IN (SELECT id FROM prev)")}, logged AS (
        INSERT INTO audit_log (org_id, actor_id, action, target, detail)
        SELECT $2, $3, 'agent.kill', $1::uuid::text,
               jsonb_build_object('origin', $4, 'reason', $5)
        FROM prev WHERE NOT prev.killed OR prev.kill_origin IS DISTINCT FROM $4
        RETURNING 1
    ), told AS (
        SELECT pg_notify('covey_events', $6) FROM logged
    )
    SELECT 'live', id, agent_id, sandbox_id, NULL::boolean, NULL::text, NULL::text
    FROM live
    UNION ALL
    SELECT 'agent', id, NULL, NULL, killed, kill_origin,
           (SELECT email FROM humans WHERE id=$3)
    FROM prev, (SELECT count(*) FROM told) t, announced
    """)

# The fleet kill: every agent's row, then the organisation's (the one lock order), then
# one statement as in the agent kill. Its values: the organisation, the actor, none, the
# reason, the notification's title, none.
FLEET_FLAG = FlagFunction(
    "fleet",
    ("SELECT id FROM agents WHERE org_id=$1 ORDER BY id FOR NO KEY UPDATE",
     "SELECT id FROM organizations WHERE id=$1 FOR NO KEY UPDATE"),
    f"""
    WITH prev AS (
        SELECT fleet_killed FROM organizations WHERE id=$1
    ), org AS (
        UPDATE organizations SET fleet_killed=true,
               fleet_killed_at=COALESCE(fleet_killed_at, now()),
               fleet_killed_by=COALESCE(fleet_killed_by, $2),
               fleet_killed_reason=CASE WHEN fleet_killed THEN fleet_killed_reason
                                        ELSE $4 END
        WHERE id=$1
    ), newly AS (
        UPDATE agents SET killed=true, kill_origin='fleet', status='killed',
               killed_at=now()
        WHERE org_id=$1 AND NOT killed RETURNING id
    ), {cancelled_live_ctes("a.org_id=$1")}, told AS (
        INSERT INTO notifications (org_id, class, kind, title, link, recipients)
        SELECT $1, 'cost', 'fleet_killed', $5, '/administration',
               (SELECT COALESCE(array_agg(id), '{{}}') FROM humans
                WHERE org_id=$1 AND role IN ('org_admin','controlling'))
        FROM prev WHERE NOT prev.fleet_killed
    ), logged AS (
        INSERT INTO audit_log (org_id, actor_id, action, target, detail)
        SELECT $1, $2, 'fleet.kill', $1::uuid::text,
               jsonb_build_object('agents', (SELECT count(*) FROM newly),
                                  'reason', $4)
        FROM prev WHERE NOT prev.fleet_killed
    ), {statuses_cte("$1", "newly", "killed")}
    SELECT 'live', id, agent_id, sandbox_id, NULL::boolean, NULL::text, NULL::text
    FROM live
    UNION ALL SELECT 'newly', id, NULL, NULL, NULL, NULL, NULL FROM newly
    UNION ALL SELECT 'org', NULL, NULL, NULL, fleet_killed, NULL,
                     (SELECT email FROM humans WHERE id=$2)
    FROM prev, announced, statuses
    """)
FLAGS = (AGENT_FLAG, FLEET_FLAG)
# Held while a replica creates the flag functions: replicas start together.
FLAGS_LOCK = 7460002


async def install_flags(conn: Connection) -> None:
    """Create the switches' flag functions this code calls, where the database lacks them:
    at start-up (a kill must not pay for it), and again should one go missing. Named by
    their text, so replicas of another version keep theirs."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", FLAGS_LOCK)
        for flag in FLAGS:
            # As the call resolves it (search_path, argument types), not by its name alone.
            if await conn.fetchval("SELECT to_regprocedure($1)", flag.signature) is None:
                await conn.execute(flag.create)


@dataclass
class KillReport:
    already_killed: bool
    sessions_cancelled: list[UUID] = field(default_factory=list)
    kill_delivered: list[UUID] = field(default_factory=list)
    kill_confirmed: list[UUID] = field(default_factory=list)
    kill_acknowledged: list[UUID] = field(default_factory=list)  # by kill_ack, not a hang-up
    # Confirmed by the second line: not acknowledged within the bound, sandbox torn down.
    kill_torn_down: list[UUID] = field(default_factory=list)
    # Of those, the sandboxes whose daemon had not connected: no kill could be sent.
    kill_unconnected: list[UUID] = field(default_factory=list)
    tasks_requeued: list[UUID] = field(default_factory=list)
    agents: list[UUID] = field(default_factory=list)
    evicted_sandboxes: list[UUID] = field(default_factory=list)


@dataclass
class ResumeReport:
    changed: bool
    agents_released: list[UUID] = field(default_factory=list)
    agents_woken: list[UUID] = field(default_factory=list)
    held_by_fleet: bool = False


class Switches:
    """The switches' half of the orchestrator (covey.orchestrator.Orchestrator is one)."""

    runner: Runner | None

    def __init__(self, pool: Pool, settings: Settings, hub: DaemonHub, node: str,
                 switch_pool: Pool | None = None) -> None:
        self.pool = pool
        # The switches' lane (covey.admission): the kills, the global stop, the lease
        # renewals and the daemons' kill confirmations, on connections no read can take.
        self.switch_pool = pool if switch_pool is None else switch_pool
        self.settings = settings
        self.hub = hub
        self.node = node
        self.runner = None
        # Sessions whose sandboxes the second line is tearing down (see _tear_down_once).
        self._tearing_down: dict[UUID, asyncio.Future[None]] = {}
        # A fleet kill's daemons confirm all at once: their words go to their sessions a
        # batch per statement, not a pool round trip (and a connection reset) each.
        self.record_kill_confirmation = BatchedWrite(
            self.switch_pool,
            "WITH x AS (SELECT * FROM unnest($1::uuid[], $2::timestamptz[],"
            " $3::timestamptz[], $4::text[], $5::timestamptz[])"
            " AS x(id, sent, confirmed, how, acked)),"
            f" {sessions_in_order('SELECT id FROM x')}"
            " UPDATE sessions s SET kill_sent_at=x.sent, kill_confirmed_at=x.confirmed,"
            " kill_confirmed_by=x.how, kill_acked_at=x.acked FROM x, in_order"
            " WHERE s.id=x.id AND s.id=in_order.id AND s.kill_confirmed_by IS NULL")
        self.record_daemon_stop = BatchedWrite(
            self.switch_pool,
            "WITH x AS (SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[],"
            " $4::jsonb[]) AS x(id, stop, detail, cut)),"
            f" {sessions_in_order('SELECT id FROM x')}"
            " UPDATE sessions s SET daemon_stop=x.stop, daemon_stop_detail=x.detail,"
            " tool_cut=x.cut FROM x, in_order"
            " WHERE s.id=x.id AND s.id=in_order.id AND s.daemon_stop IS NULL")

    if TYPE_CHECKING:  # the orchestrator's, used by the resumes and the second line
        async def wake_many(self, agent_ids: list[UUID], path: str) -> list[UUID]: ...

        def spawn(self, coro: Awaitable[Any]) -> asyncio.Future[Any]: ...


    async def _hold(self, scope: str, started: float, links: list[DaemonLink]) -> _Hold:
        """Hold these daemons while the kill's flag commits: see the module's docstring.
        As soon as the flag has committed, `_unhold` releases whoever of them it did not
        stop (its session was not live after all), unless it was sent a `kill` meanwhile.
        A kill whose flag failed releases nobody: it may have committed all the same (a
        connection that broke after the commit), and its holds end by themselves within a
        lease.

        The holds go out here, one after the other, before the flag's round trip: tasks
        spawned for them (asyncio.gather's too) waited their turn behind everything else
        the loaded loop had ready, and in one game day of eight with them so sent an agent
        acted three times in the 14 ms after the request. A frame is a write to a socket,
        done without giving up the loop. They take at most HOLDS_INLINE_S of the kill's
        path, a daemon that does not read its channel (its frame waits) included: those
        left then go out in the background."""
        holding = _Hold(links, uuid4().hex)
        if links:
            # For at most a lease: by then the kill has come, or the daemon's lease, which
            # this replica renews only while the flag is not set, stands for the flag.
            payload = {"id": holding.id, "reason": "kill-switch",
                       "ttl_ms": self.settings.lease_ms}
            loop = asyncio.get_running_loop()
            deadline = loop.time() + HOLDS_INLINE_S
            sent = 0
            # The deadline is checked between frames (a healthy channel's write never
            # gives up the loop) and bounds a frame that waits (a channel not read).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    for link in links:
                        if loop.time() > deadline:
                            break
                        await send_to(link, "hold", payload)
                        sent += 1
            if sent < len(links):
                self.spawn(_send_all(links[sent:], "hold", payload))
            metrics.kill_stage_seconds.labels(scope, "holds_sent").observe(
                time.perf_counter() - started)
        return holding

    def _unhold(self, holding: _Hold, rows: list[asyncpg.Record]) -> None:
        """The flag has committed, with these rows: its live sessions (those whose `kill`
        follows) are the ones it cancelled; a row of another kind has no session. The held
        daemons of the others are released."""
        cancelled = {r["id"] for r in rows if r.get("what", "live") == "live"}
        if rest := [link for link in holding.links if link.session_id not in cancelled]:
            self.spawn(_send_all(rest, "release", {"id": holding.id}))

    async def _switch(self, conn: Connection, body: Callable[[Connection], Awaitable[T]],
                      scope: str, started: float, statement: bool = False) -> T:
        """Run a switch's flag transaction (see `_retried`); time its commit."""
        result = await _retried(conn, body, scope, "flag", statement=statement)
        metrics.kill_stage_seconds.labels(scope, "flag_committed").observe(
            time.perf_counter() - started)
        return result

    async def _flag(self, conn: Connection, flag: FlagFunction, started: float,
                    args: tuple[Any, ...]) -> list[asyncpg.Record]:
        """A kill's flag in one round trip, committed by itself (see FlagFunction)."""
        async def call(conn: Connection) -> list[asyncpg.Record]:
            try:
                return await conn.fetch(flag.call, *args)
            except asyncpg.UndefinedFunctionError as exc:
                if flag.name not in str(exc):  # something its body calls: not healed here
                    raise
                # Gone from the database since start-up (one restored from a dump made
                # before): created again, and called. Nothing was written.
                await install_flags(conn)
                return await conn.fetch(flag.call, *args)
        return await self._switch(conn, call, flag.scope, started, statement=True)

    @contextlib.asynccontextmanager
    async def _flagged(self, flag: FlagFunction, started: float, args: tuple[Any, ...],
                       links: list[DaemonLink]
                       ) -> AsyncIterator[tuple[Connection, list[asyncpg.Record]]]:
        """A kill's flag committed, its daemons held first (`_hold`, `_unhold`): the
        connection of the switches' lane it ran on, held until the kill is done with it,
        and the flag's rows.

        The holds go out before the flag's statement, the moment the request is in. Tried:
        the statement sent first, after one turn of the loop, and the holds while it ran.
        A single kill on a quiet host reached its daemon about 0.1 ms sooner (kill_latency,
        1.77-1.87x the floor against 1.86-1.94x), but that turn of the loop took up to
        5.8 ms with 200 operators' requests in flight (kill_under_load), a hold's worth of
        time in which an agent of the incident-load game day acts; and a fleet kill of 200
        daemons answered later, not sooner (fleet_scale, twice in either order: a median
        of 272 and 455 ms against 173 and 299)."""
        holding = await self._hold(flag.scope, started, links)
        conn = await self.switch_pool.acquire()
        try:
            rows = await self._flag(conn, flag, started, args)
            self._unhold(holding, rows)
            yield conn, rows
        finally:
            # Handed back off the kill's way to its answer: asyncpg's release is a task of
            # its own, and the answer waited 0.3-0.4 ms for its turn of the loop behind
            # whatever the kill had made ready meanwhile (its daemon's acknowledgement, the
            # wake its requeue's NOTIFY brought back).
            self.spawn(self.switch_pool.release(conn))

    async def kill_agent(self, org_id: UUID, agent_id: UUID, actor_id: UUID | None,
                         origin: str = "agent", started: float | None = None,
                         reason: str | None = None) -> KillReport | None:
        """DESIGN §2.3 line 1. Returns None when the agent is not in this organisation.
        `started` is when the request arrived (perf_counter), for the stage metrics."""
        started = time.perf_counter() if started is None else started

        # One connection for both of the kill's transactions, held between them: a kill
        # must not wait for a second pool connection while it holds one (a hundred kills
        # at once emptied the pool that way), nor queue for its requeue behind the
        # statements of the very exits it caused (a fleet kill causes hundreds at once).
        async with self._flagged(AGENT_FLAG, started,
                                 (agent_id, org_id, actor_id, origin, reason,
                                  status_event(org_id, agent_id, "killed")[1]),
                                 self.hub.links_of(org_id, agent_id)) as (conn, rows):
            agent = next((r for r in rows if r["what"] == "agent"), None)
            if agent is None:
                return None
            was_killed, was_origin = bool(agent["flag"]), agent["origin"]
            changed = not was_killed or was_origin != origin
            live = [r for r in rows if r["what"] == "live"]
            report = KillReport(already_killed=was_killed, agents=[agent_id])
            try:
                evicted = await self._stop_sessions(
                    conn, "agent", live, [agent_id] if changed else [], started, report,
                    held=("SELECT $1::uuid", [agent_id]))
            finally:  # off the kill's way to its daemon; logged even if its requeue fails
                if changed:
                    log_audit("agent.kill", agent["actor"], org_id, str(agent_id),
                              {"origin": origin, "reason": reason})
        await self._await_stopped(live, evicted, report)
        metrics.kills.labels("agent", "already" if report.already_killed else "killed").inc()
        return report

    async def kill_fleet(self, org_id: UUID, actor_id: UUID | None,
                         started: float | None = None, reason: str | None = None
                         ) -> KillReport:
        """DESIGN §2.3 line 2: the org flag, then every agent's kill, in one commit."""
        started = time.perf_counter() if started is None else started

        async with self._flagged(FLEET_FLAG, started,  # one connection, as in kill_agent
                                 (org_id, actor_id, None, reason, FLEET_KILLED_TITLE, None),
                                 self.hub.links_of(org_id)) as (conn, rows):
            org = next((r for r in rows if r["what"] == "org"), None)
            was = bool(org is not None and org["flag"])
            agents = [r["id"] for r in rows if r["what"] == "newly"]
            live = [r for r in rows if r["what"] == "live"]
            report = KillReport(already_killed=was, agents=agents)
            try:
                evicted = await self._stop_sessions(
                    conn, "fleet", live, agents, started, report,
                    held=("SELECT id FROM agents WHERE org_id=$1", [org_id]))
            finally:  # as in kill_agent
                if org is not None and not was:  # no organisation row: nothing was written
                    log_audit("fleet.kill", org["actor"], org_id, str(org_id),
                              {"agents": len(agents), "reason": reason})
        await self._await_stopped(live, evicted, report)
        metrics.kills.labels("fleet", "already" if was else "killed").inc()
        return report

    async def _cancel_live_sessions(self, conn: Connection, where: str, args: list[Any]
                                    ) -> list[asyncpg.Record]:
        """Cancel the sessions a kill must stop, in the flag's own transaction, and announce
        them to every replica at commit. Cancelled with the flag, a daemon that exits the
        instant it hears `kill` is never mistaken for a lost one (that would count a retry
        and requeue behind the kill's back).

        Daemons connected to another replica hear of the kill through it: one NOTIFY per
        200 sessions (what fits the 8000-byte payload), sent by the same statement. Every
        statement before the commit is a round trip the kill waits for, and under load each
        one waits its turn on a busy event loop and a busy database: a kill's commit took
        400 ms there while a fleet chattered."""
        live = await conn.fetch(
            f"WITH {cancelled_live_ctes(where)} SELECT live.id, live.agent_id, live.sandbox_id"
            " FROM live, announced", *args)
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
        if self.runner is not None:
            self.runner.hasten([s["sandbox_id"] for s in live])
        # One daemon's kill goes out at once, not from a task of its own that waits its turn
        # on the loop behind whatever else is ready (the flag's own NOTIFYs, heard here).
        delivered = ([await self.hub.send_kill(session_ids[0], crowd)] if crowd == 1 else
                     await asyncio.gather(*(self.hub.send_kill(s, crowd) for s in session_ids)))
        report.kill_delivered = [s for s, ok in zip(session_ids, delivered, strict=True) if ok]
        metrics.kill_stage_seconds.labels(scope, "kill_sent").observe(
            time.perf_counter() - started)
        touched = sorted({*agents, *(s["agent_id"] for s in live)})
        evicted: list[asyncpg.Record] = []

        among, among_args = held or ("SELECT unnest($1::uuid[])", [touched])

        # One statement, committed on its own: the kill's answer waits for it, and each
        # statement of a transaction (its BEGIN and COMMIT too) is a round trip that waits
        # its turn on the plane's event loop: five of them were most of the answer's time
        # beyond the daemon's acknowledgement (benchmarks.kill_latency).
        #
        # Its commit does not wait for the WAL flush (`settled`: synchronous_commit off for
        # this transaction only; the flag's commit always waits). The answer waited for the
        # flush, then for a CPU: the backend woke on the vCPU of the killed daemon's exit,
        # 2-3 ms of kernel work nothing preempts here (perf sched). The next synchronous
        # commit anywhere (the daemon's confirmation, milliseconds later) flushes it too.
        # A crash before that loses the requeue: its tasks come back by the orphan sweep
        # (Orchestrator.requeue_orphaned_work, after its grace), the sandbox is torn down
        # all the same (recorded gone, not evicted), the `kill` recording event is lost.
        n = len(among_args)
        session_of = {s["agent_id"]: s["id"] for s in live}

        async def requeue(conn: Connection) -> tuple[list[asyncpg.Record], list[UUID]]:
            rows = await conn.fetch(
                f"""
                WITH evicted AS (
                    UPDATE sandboxes SET state='evicted', ended_at=now()
                    WHERE agent_id IN ({among}) AND state='parked'
                    RETURNING id, agent_id, node
                ), {requeue_ctes(f"t.agent_id IN ({among})", f"${n + 1}")}, recorded AS (
                    INSERT INTO recording_events (agent_id, session_id, kind, status, detail)
                    SELECT a, s, 'kill', 'killed',
                           jsonb_build_object('scope', ${n + 2}::text,
                                              'requeued', (SELECT count(*) FROM moved))
                    FROM unnest(${n + 3}::uuid[], ${n + 4}::uuid[]) AS x(a, s)
                ), settled AS (  -- read below: a CTE nobody reads is not run
                    SELECT set_config('synchronous_commit', 'off', true) AS synchronous_commit
                )
                SELECT 'evicted' AS what, id, agent_id, node FROM evicted
                UNION ALL SELECT 'requeued', id, NULL, NULL FROM moved
                UNION ALL SELECT 'settled', NULL, NULL, synchronous_commit FROM settled
                """,
                *among_args, f"{scope} kill-switch", scope, touched,
                [session_of.get(a) for a in touched])
            return ([r for r in rows if r["what"] == "evicted"],
                    [r["id"] for r in rows if r["what"] == "requeued"])

        if touched or held:
            # Retried like the flag's: with the flag committed, a requeue that failed on a
            # deadlock would leave the work in progress and answer the kill with a 500.
            evicted, report.tasks_requeued = await _retried(conn, requeue, scope, "requeue",
                                                            statement=True)
            report.evicted_sandboxes = [r["id"] for r in evicted]
        metrics.kill_stage_seconds.labels(scope, "requeued").observe(
            time.perf_counter() - started)
        report.sessions_cancelled = session_ids
        return evicted

    async def _await_stopped(self, live: list[asyncpg.Record], evicted: list[asyncpg.Record],
                             report: KillReport) -> None:
        """With the kill's connection handed back: the sandboxes' teardown, then the
        wait for the daemons' confirmations."""
        if self.runner is not None:
            await self.runner.discard_evicted(evicted)
        # A daemon that connected since the flag was sent the kill by its take-up (its
        # session was over by then): it is waited for like the others, its bound from then.
        sent = set(report.kill_delivered)
        late = [s["id"] for s in live if s["id"] not in sent and self.hub.kill_sent(s["id"])]
        here = sent | set(late)
        unconnected: dict[UUID, UUID] = {}
        if self.runner is not None:
            # A session started at the instant of the kill: its sandbox runs here, its daemon
            # has not connected, so no kill can reach it. Torn down now, and counted.
            unconnected = self.runner.sandboxes_of([s["id"] for s in live
                                                    if s["id"] not in here])
            self.runner.tear_down([s["sandbox_id"] for s in live
                                   if s["id"] not in unconnected],
                                  {s["sandbox_id"] for s in live if s["id"] in here})
        # The answer waits until the daemons have the kill in hand: a game day once saw a
        # model call leave a sandbox after the acknowledgement, the kill still on its way
        # through a proxy. Bounded: a daemon that cannot answer is stopped by its lease.
        # Those another replica holds too: a game day pulled a kill on one replica and had
        # its answer before the daemon on the other had even heard of it.
        bound_s = self._confirm_bound_s
        elsewhere = [s["id"] for s in live if s["id"] not in here and s["id"] not in unconnected]
        if late or unconnected or elsewhere:
            (local, torn), (told, torn_late), (early, told_meanwhile), remote = \
                await asyncio.gather(
                    self._second_line(report.kill_delivered, bound_s),
                    self._second_line(late, bound_s),
                    self._tear_down_unconnected(unconnected),
                    self._confirmed_elsewhere(elsewhere, bound_s))
        else:  # the kill's own daemons only, as nearly always: no tasks to wait for
            (local, torn), (told, torn_late), (early, told_meanwhile), remote = (
                await self._second_line(report.kill_delivered, bound_s), ([], []), ([], []),
                {})
        if told_meanwhile and self.runner is not None:  # their grace, as any told daemon's
            self.runner.tear_down([unconnected[s] for s in told_meanwhile],
                                  {unconnected[s] for s in told_meanwhile})
        told_last, torn_last = (await self._second_line(told_meanwhile, bound_s)
                                if told_meanwhile else ([], []))
        report.kill_delivered += [*late, *told_meanwhile]
        local = [*local, *told, *told_last]
        report.kill_confirmed = [*local, *early, *remote]
        report.kill_acknowledged = [*self.hub.acknowledged(local),
                                    *(s for s, how in remote.items() if how == "kill_ack")]
        report.kill_torn_down = [*torn, *torn_late, *torn_last, *early,
                                 *(s for s, how in remote.items() if how == "teardown")]
        report.kill_unconnected = early

    @property
    def _confirm_bound_s(self) -> float:
        """How long a kill's answer waits for its daemons' confirmations at most: a lease
        (up to 2 s) and the grace for a lapse to be heard."""
        return min(self.settings.lease_ms / 1000, 2.0) + LEASE_LAPSE_GRACE_S

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

    async def _tear_down_unconnected(self, running: dict[UUID, UUID]
                                     ) -> tuple[list[UUID], list[UUID]]:
        """Tear down the sandboxes (session -> sandbox) whose daemon had not connected when
        the kill came, at once: there is nothing to wait for. Each records a teardown with no
        kill sent (none could be), so that nobody reads it as a daemon that was told and did
        not obey. Returns the sessions torn down, and those whose daemon connected meanwhile
        and was told by its take-up (left alone: waited for as any told daemon is).

        A teardown the backend fails (an engine gone) fails nothing: the sandbox's lease
        stops its daemon, and the answer does not count it."""
        if not running or self.runner is None:
            return [], []
        told = [s for s in running if self.hub.kill_sent(s)]
        running = {s: b for s, b in running.items() if s not in told}
        try:
            destroyed = set(await self.runner.tear_down_now(list(running.values()), 0.0))
        except Exception as exc:
            log.error("sandboxes not torn down", error=str(exc),
                      sandbox_ids=[str(b) for b in running.values()])
            destroyed = set()
        torn = [s for s, sandbox_id in running.items() if sandbox_id in destroyed]
        at = datetime.now(UTC)
        for session_id in torn:
            log.warning("sandbox torn down before its daemon connected",
                        session_id=str(session_id), sandbox_id=str(running[session_id]))
            self.spawn(through_outage(functools.partial(
                self.record_kill_confirmation.write, session_id, None, at, "teardown", None),
                "kill confirmation"))
        return torn, told

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
        if self.runner is not None and sending:  # as _stop_sessions does: obeyed first
            self.runner.hasten(list(self.runner.sandboxes_of(sending).values()))
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

        holding = await self._hold("global", started, self.hub.links())
        async with self.switch_pool.acquire() as conn:  # one connection, as in kill_agent
            was, live = await self._switch(conn, flag, "global", started)
            self._unhold(holding, live)
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


@dataclass(frozen=True)
class _Hold:
    """One kill's hold (`Switches._hold`): the daemons it held, and its id, which their
    `release` names (`Switches._unhold`)."""

    links: list[DaemonLink]
    id: str


async def _send_all(links: list[DaemonLink], kind: str, payload: dict[str, Any]) -> None:
    await asyncio.gather(*(send_to(link, kind, payload) for link in links))


async def _retried(conn: Connection, body: Callable[[Connection], Awaitable[T]], scope: str,
                   step: str, statement: bool = False) -> T:
    """Run `body` in a transaction on `conn` (`statement`: its one statement, atomic by
    itself), again when Postgres breaks a
    deadlock (or a serialization conflict) by failing it: an emergency stop must not fail
    because a wake, a sweep or a daemon's report held a row it needed. Each attempt starts
    from scratch."""
    for attempt in range(1, 6):
        try:
            if statement:  # one statement: atomic by itself, no BEGIN and COMMIT to wait for
                return await body(conn)
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
