"""The kill path's edges: a daemon that vanishes without a closing handshake is lost at once
(not 15 s later by the stale-session sweep), and the kill's second transaction survives a
deadlock Postgres breaks by failing it. Real control plane, real Postgres, real WebSockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import websockets

from covey.db import DatabaseUnavailable
from covey.switches import _retried
from covey.testing import SCRIPTED_DAEMON
from covey.testing.plane import World, make_world, start_plane
from harness.stack.waiting import eventually


async def _sandbox_with_token(world: World) -> tuple[dict[str, Any], str, uuid.UUID]:
    """A sandbox row with a known token and its session, as a wake writes them, and a task
    for the agent: the daemon that connects with the token is given it."""
    from covey.security import new_token, token_hash

    agent = await world.agent()
    aid = uuid.UUID(agent["id"])
    token = new_token("cvd")
    sandbox_id = uuid.uuid4()
    await world.db.execute(
        "INSERT INTO sandboxes (id, agent_id, backend, daemon_token_hash, token_expires_at)"
        " VALUES ($1, $2, 'process', $3, now() + interval '1 minute')",
        sandbox_id, aid, token_hash(token))
    await world.db.execute(
        "INSERT INTO sessions (id, agent_id, sandbox_id, node) VALUES ($1, $2, $3, 'test')",
        uuid.uuid4(), aid, sandbox_id)
    task_id = uuid.uuid4()
    await world.db.execute(
        "INSERT INTO backlog_tasks (id, org_id, agent_id, title, body, origin)"
        " VALUES ($1, $2, $3, 't', 'hold', 'api')", task_id, world.org.id, aid)
    return {"agent_id": agent["id"], "sandbox_id": str(sandbox_id)}, token, task_id


async def _session(world: World, sandbox_id: str) -> asyncpg.Record:
    row = await world.db.fetchrow(
        "SELECT id, state, stop_reason FROM sessions WHERE sandbox_id=$1",
        uuid.UUID(sandbox_id))
    assert row is not None, f"no session for sandbox {sandbox_id}"
    return row


@pytest.mark.parametrize("then_sent_to", [False, True],
                         ids=["silent", "sent-to-after-vanishing"])
async def test_a_daemon_that_vanishes_without_a_close_is_lost_at_once(
        world: World, caplog: pytest.LogCaptureFixture, then_sent_to: bool) -> None:
    """A daemon whose channel is gone without a closing handshake (a crashed sandbox, a
    reset connection) is lost as soon as the control plane sees the connection end: its task
    goes back to the backlog, well inside the 15 s after which the sweep would find it, and
    no handler fails with an unhandled error. Also when the control plane still sends to it
    (a lease renewal) before it has read the end of the connection."""
    ids, token, task_id = await _sandbox_with_token(world)
    headers = {"Authorization": f"Bearer {token}"}
    caplog.set_level(logging.ERROR)
    ws = await websockets.connect(world.plane.ws_url, additional_headers=headers)
    await ws.send(json.dumps({"type": "ready", "payload": ids}))
    while (m := json.loads(await ws.recv()))["type"] != "assign_task":
        pass
    assert m["payload"]["task_id"] == str(task_id)
    session = await _session(world, ids["sandbox_id"])
    assert session["state"] == "running", session
    ws.transport.abort()  # gone: no close frame, a reset connection
    if then_sent_to:
        # In the same turn of the loop, before the plane has read the end of the connection.
        await world.plane.orch.renew_leases([session["id"]])
        await world.plane.orch.hub.send(session["id"], "lease", {"ttl_ms": 2000})

    async def lost() -> bool:
        return bool((await _session(world, ids["sandbox_id"]))["state"] == "lost")
    await eventually(lost, 5, "the session of a daemon that vanished is still live: "
                     "it was left to the stale-session sweep")
    reason = (await _session(world, ids["sandbox_id"]))["stop_reason"]
    assert reason == "control channel closed", reason
    requeued = await world.db.fetchval(
        "SELECT count(*) FROM task_transitions WHERE task_id=$1 AND from_state='in_progress'"
        " AND to_state='open' AND note LIKE 'daemon lost%'", task_id)
    assert requeued == 1, "the task of the vanished daemon was not requeued"
    assert world.plane.orch.hub.get(session["id"]) is None, "the daemon is still attached"
    failures = [r for r in caplog.records if "Exception in ASGI application" in r.getMessage()
                or r.exc_info is not None]
    assert failures == [], [r.getMessage() for r in failures]


async def until_a_lock_is_waited_for(world: World, query_like: str, what: str) -> None:
    """Until a statement `LIKE query_like` (the kill's) waits on a lock."""
    async def waiting() -> bool:
        return bool(await world.db.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type='Lock'"
            " AND query LIKE $1 AND pid <> pg_backend_pid()", query_like))
    await eventually(waiting, 10, what)


async def kill_in_a_deadlock(world: World, agent_id: str, holds: tuple[str, uuid.UUID],
                             waits_on: str, wants: tuple[str, uuid.UUID]) -> tuple[Any, str]:
    """An agent kill caught in a real deadlock: another transaction runs `holds` (SQL, its
    one argument), the kill waits for it (a statement of the kill's, `LIKE waits_on`, waits
    on a lock) while holding a row of its own, and then the other transaction runs `wants`,
    which waits for that row. Postgres fails one side after deadlock_timeout (1 s): the
    kill's, which waited first. Returns the kill's answer and which side was failed."""
    other = await asyncpg.connect(world.plane.database_url)
    victim = "the kill"
    try:
        held = other.transaction()
        await held.start()
        await other.execute(*holds)
        kill = asyncio.create_task(world.security.post(f"/api/v1/agents/{agent_id}/kill"))
        await until_a_lock_is_waited_for(world, waits_on,
                                         f"the kill never waited on a lock in {waits_on}")
        closing = asyncio.create_task(other.execute(*wants))
        try:
            await asyncio.wait_for(closing, 15)
        except asyncpg.DeadlockDetectedError:
            victim = "the other transaction"
        await held.rollback()
        return await asyncio.wait_for(kill, 15), victim
    finally:
        await other.close()


async def test_the_kills_requeue_survives_a_deadlock(world: World) -> None:
    """The kill's second transaction (evict the parked sandbox, requeue the work) once had
    no retry: a deadlock that Postgres broke by failing it made the kill a 500 after the
    flag had committed, the work left in progress. Provoked here for real: another
    transaction holds the agent's in-progress task, the kill's requeue waits for it while
    holding the parked sandbox it evicted, and then the other transaction wants that
    sandbox."""
    agent = await world.agent()
    aid = uuid.UUID(agent["id"])
    parked, task_id = uuid.uuid4(), uuid.uuid4()
    await world.db.execute(
        "INSERT INTO sandboxes (id, agent_id, backend, state, node, parked_at)"
        " VALUES ($1, $2, 'process', 'parked', 'elsewhere', now())", parked, aid)
    await world.db.execute(
        "INSERT INTO backlog_tasks (id, org_id, agent_id, title, body, origin, state)"
        " VALUES ($1, $2, $3, 't', 'hold', 'api', 'in_progress')", task_id, world.org.id, aid)

    # The kill's requeue holds the evicted sandbox and waits for the task.
    r, victim = await kill_in_a_deadlock(
        world, agent["id"], ("SELECT 1 FROM backlog_tasks WHERE id=$1 FOR UPDATE", task_id),
        "%backlog_tasks%", ("UPDATE sandboxes SET last_sync_at=now() WHERE id=$1", parked))
    assert r.status_code == 200, (
        f"the kill failed on a deadlock (victim: {victim}): {r.status_code} {r.text}")
    assert r.json()["tasks_requeued"] == [str(task_id)], r.text
    assert await world.task_state(str(task_id)) == "open"
    assert await world.db.fetchval("SELECT state FROM sandboxes WHERE id=$1", parked) \
        == "evicted"


async def test_the_kills_flag_survives_a_deadlock(world: World) -> None:
    """The kill's flag is one call that takes its locks and runs its statement
    (covey.switches.Switches._flag): a deadlock inside it must fail that call only, and the
    flag be tried again, not the kill answer a 500. Provoked for real: another transaction
    holds the agent's running session, the kill's statement waits for it while holding the
    agent, and then the other transaction wants the agent."""
    agent = await world.agent()
    aid = uuid.UUID(agent["id"])
    task = await world.task(agent["id"], "hold")

    async def running() -> uuid.UUID | None:
        session_id: uuid.UUID | None = await world.db.fetchval(
            "SELECT id FROM sessions WHERE agent_id=$1 AND state='running'", aid)
        return session_id
    session_id = await eventually(running, 30, "the agent never started its session")

    # The kill's flag holds the agent (its BEGIN's lock) and waits for the session.
    r, victim = await kill_in_a_deadlock(
        world, agent["id"], ("SELECT 1 FROM sessions WHERE id=$1 FOR UPDATE", session_id),
        "%covey_flag_%", ("SELECT 1 FROM agents WHERE id=$1 FOR NO KEY UPDATE", aid))
    assert r.status_code == 200, (
        f"the kill failed on a deadlock (victim: {victim}): {r.status_code} {r.text}")
    assert r.json()["sessions_cancelled"] == [str(session_id)], r.text
    assert await world.db.fetchval("SELECT killed FROM agents WHERE id=$1", aid) is True
    assert await world.task_state(task["id"]) == "open"
    assert await world.db.fetchval("SELECT state FROM sessions WHERE id=$1", session_id) \
        == "cancelled"


@pytest.mark.parametrize("switch", ["agent", "fleet"])
async def test_a_session_a_wake_commits_while_the_kill_waits_is_cancelled(
        world: World, switch: str) -> None:
    """The kill's statement reads the live sessions on a snapshot taken once its locks are
    held, not when it was sent: a wake that holds the agent (as every wake does, until its
    session is committed) and commits a session while the kill waits for it must see that
    session cancelled by the kill, or the agent runs on, flagged killed and never told. One
    plain statement that waited for the lock would read the sessions from before the wait."""
    agent = await world.agent()
    aid = uuid.UUID(agent["id"])
    sandbox_id, session_id = uuid.uuid4(), uuid.uuid4()
    wake = await asyncpg.connect(world.plane.database_url)
    try:  # closing the wake's connection rolls back whatever it has not committed
        held = wake.transaction()
        await held.start()
        await wake.execute(
            "SELECT 1 FROM agents a JOIN organizations o ON o.id=a.org_id WHERE a.id=$1"
            " FOR NO KEY UPDATE OF a FOR SHARE OF o", aid)
        await wake.execute(
            "INSERT INTO sandboxes (id, agent_id, backend, node) VALUES ($1, $2, 'process',"
            " 'a wake elsewhere')", sandbox_id, aid)
        # Seen longer ago than a lease: no replica holds it, none to wait for. Not as long ago
        # as the daemon timeout: seen an hour ago, it was once found stale and ended by a
        # scheduler tick between the wake's commit and the kill's statement.
        settings = world.plane.orch.settings
        await wake.execute(
            "INSERT INTO sessions (id, agent_id, sandbox_id, node, state, last_seen_at)"
            " VALUES ($1, $2, $3, 'a wake elsewhere', 'running',"
            " now() - make_interval(secs => $4))", session_id, aid, sandbox_id,
            (settings.lease_ms / 1000 + settings.daemon_timeout_s) / 2)
        path = f"/api/v1/agents/{aid}/kill" if switch == "agent" else "/api/v1/fleet/kill"
        kill = asyncio.create_task(world.security.post(path))
        await until_a_lock_is_waited_for(world, "%covey_flag_%",
                                         "the kill never waited for the wake's lock")
        await held.commit()
        r = await asyncio.wait_for(kill, 15)
    finally:
        await wake.close()
    assert r.status_code == 200, r.text
    assert r.json()["sessions_cancelled"] == [str(session_id)], (
        f"the {switch} kill did not cancel the session a wake committed while it waited for "
        f"the agent's lock: {r.text}")
    state = await world.db.fetchval("SELECT state FROM sessions WHERE id=$1", session_id)
    assert state == "cancelled", f"the wake's session is {state} after the {switch} kill"


async def test_reading_a_channel_that_is_gone_says_disconnect() -> None:
    """A unit of the daemon handler: once a channel is gone, every further read is a
    WebSocketDisconnect (what the handler treats as a lost daemon), never Starlette's
    WebSocketDisconnected RuntimeError, which the handler's loss path did not catch."""
    from starlette.websockets import WebSocket, WebSocketDisconnect

    from covey.api.daemon import _receive_text

    frames: list[dict[str, Any]] = [
        {"type": "websocket.connect"},
        {"type": "websocket.receive", "text": '{"type": "heartbeat"}'},
        {"type": "websocket.disconnect", "code": 1006},
    ]

    async def receive() -> MutableMapping[str, Any]:
        return frames.pop(0)

    async def send(message: MutableMapping[str, Any]) -> None:
        pass

    ws = WebSocket({"type": "websocket", "path": "/api/daemon/ws", "headers": []},
                   receive, send)
    await ws.accept()
    assert await _receive_text(ws) == '{"type": "heartbeat"}'
    for _ in range(2):  # the end itself, then a read after it
        with pytest.raises(WebSocketDisconnect):
            await _receive_text(ws)


async def test_sandboxes_that_do_not_exit_within_the_grace_are_destroyed(
        database_url: str, tmp_path: Path) -> None:
    """The runner gives a daemon told to stop its grace period to exit on its own, then
    destroys its sandbox: one timer for the whole fleet kill. Deaf daemons (they ignore
    `kill`) under a 20 s lease would live on for up to 20 s; with a 0.5 s grace their
    sandboxes are gone long before, killed (-9), not exited 3."""
    async with start_plane(database_url, tmp_path / "replica", SCRIPTED_DAEMON,
                           lease_ms=20_000, kill_grace_s=0.5) as plane, \
            make_world(plane) as world:
        agents = [await world.agent() for _ in range(3)]
        tasks = [await world.task(a["id"], "deaf") for a in agents]
        for task in tasks:
            await world.wait_task(task["id"], "in_progress")
        r = await world.security.post("/api/v1/fleet/kill")
        assert r.status_code == 200, r.text
        assert sorted(r.json()["tasks_requeued"]) == sorted(t["id"] for t in tasks), r.text
        ids = [uuid.UUID(a["id"]) for a in agents]

        async def destroyed() -> list[int] | None:
            rows = await world.db.fetch(
                "SELECT exit_code FROM sandboxes WHERE agent_id = ANY($1::uuid[])"
                " AND state='gone'", ids)
            return [r["exit_code"] for r in rows] if len(rows) == len(ids) else None
        codes = await eventually(destroyed, 10, "sandboxes whose daemons ignored the kill "
                                 "were not destroyed after the grace period")
        assert codes == [-9] * len(ids), f"expected every sandbox killed (-9): {codes}"


async def test_no_lease_goes_to_a_daemon_after_its_kill() -> None:
    """A unit of the hub: a renewal read just before a kill's commit and sent after the kill,
    or queued behind it on the link's lock, would extend a deaf daemon's lease past its kill;
    it is dropped, and so is a `release`. Other frames still go."""
    from covey.hub import DaemonHub, DaemonLink

    sent: list[str] = []
    release = asyncio.Event()

    class Sink:
        async def send_text(self, data: str) -> None:
            if json.loads(data)["type"] == "kill":
                await release.wait()  # the kill still on the wire
            sent.append(json.loads(data)["type"])

    hub = DaemonHub()
    link = DaemonLink(uuid.uuid4(), uuid.uuid4(), Sink())
    hub.attach(link)
    assert await hub.send(link.session_id, "lease", {"ttl_ms": 2000})
    kill = asyncio.ensure_future(hub.send_kill(link.session_id))
    await asyncio.sleep(0)  # the kill holds the link's lock
    queued = asyncio.ensure_future(hub.send(link.session_id, "lease", {"ttl_ms": 2000}))
    await asyncio.sleep(0)
    release.set()
    assert await kill
    assert await queued is False
    assert await hub.send(link.session_id, "lease", {"ttl_ms": 2000}) is False
    # Nor the end of another kill's hold (covey.switches._unhold).
    assert await hub.send(link.session_id, "release", {}) is False
    assert await hub.send(link.session_id, "sleep", {})
    assert sent == ["lease", "kill", "sleep"]


async def test_the_kills_wait_returns_who_confirmed_within_its_bound() -> None:
    """A unit of the hub: a kill waits for its daemons' confirmations at most its bound,
    and answers with those that confirmed (by `kill_ack` or hang-up), in the order asked;
    a daemon that never answers ends the wait only when the bound does."""
    from covey.hub import DaemonHub, DaemonLink

    sent: list[str] = []

    class Sink:
        async def send_text(self, data: str) -> None:
            sent.append(data)

    hub = DaemonHub()
    links = [DaemonLink(uuid.uuid4(), uuid.uuid4(), Sink()) for _ in range(3)]
    for link in links:
        hub.attach(link)
        assert await hub.send_kill(link.session_id)
    acked, silent, hung_up = links
    hub.acknowledge_kill(acked.session_id)  # before the wait starts
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, hub.detach, hung_up.session_id)  # during the wait
    started = loop.time()
    confirmed = await hub.wait_stopped([s.session_id for s in links], 0.5)
    waited = loop.time() - started
    assert confirmed == [acked.session_id, hung_up.session_id], confirmed
    assert 0.45 <= waited < 5, f"the wait took {waited:.2f} s, bounded at 0.5 s"
    assert hub.acknowledged(confirmed) == [acked.session_id]
    assert silent.waits == [], "the finished wait is still registered on a daemon"
    # Every daemon confirmed: the wait ends at once, not at its bound.
    hub.acknowledge_kill(silent.session_id)
    started = loop.time()
    assert len(await hub.wait_stopped([s.session_id for s in links], 30)) == 3
    assert loop.time() - started < 5
    assert len(sent) == 3


async def test_work_left_in_progress_by_a_kill_cut_short_is_requeued(world: World) -> None:
    """A kill commits its flag with the sessions cancelled, then requeues their work in a
    second transaction. A control plane SIGKILLed between the two (a random game day did it
    in the middle of a fleet kill) left the task in progress for good, claimed by a session
    that was over. The scheduler's sweep puts it back, once the session has been over
    longer than the sweep's grace; a session just cancelled is left to its kill."""
    from covey.orchestrator import ORPHAN_GRACE_MIN_S

    agent = await world.agent()
    aid = uuid.UUID(agent["id"])
    # The fleet stands stopped (the kill's flag committed), so nothing wakes the agent again.
    await world.db.execute("UPDATE organizations SET fleet_killed=true WHERE id=$1",
                           world.org.id)
    tasks = {}
    for label, ended_ago_s in (("orphaned", ORPHAN_GRACE_MIN_S + 30), ("just-cancelled", 0)):
        sandbox_id, session_id, task_id = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
        await world.db.execute(
            "INSERT INTO sandboxes (id, agent_id, backend, state, node)"
            " VALUES ($1, $2, 'process', 'gone', 'test')", sandbox_id, aid)
        await world.db.execute(
            "INSERT INTO sessions (id, agent_id, sandbox_id, node, state, ended_at,"
            " stop_layer) VALUES ($1, $2, $3, 'test', 'cancelled',"
            " now() - make_interval(secs => $4), 'kill-switch')",
            session_id, aid, sandbox_id, float(ended_ago_s))
        await world.db.execute(
            "INSERT INTO backlog_tasks (id, org_id, agent_id, title, body, origin, state,"
            " claimed_by, claim_token) VALUES ($1, $2, $3, 't', 'hold', 'api', 'in_progress',"
            " $4, 7)", task_id, world.org.id, aid, session_id)
        tasks[label] = task_id

    async def requeued() -> bool:
        return await world.task_state(str(tasks["orphaned"])) == "open"
    await eventually(requeued, 10, "a task claimed by a session over for long stayed in "
                     "progress: nothing requeued the work of the kill cut short")
    note = await world.db.fetchval(
        "SELECT note FROM task_transitions WHERE task_id=$1 AND to_state='open'",
        tasks["orphaned"])
    assert note == "requeued: its session was over without it", note
    assert await world.db.fetchval("SELECT claimed_by FROM backlog_tasks WHERE id=$1",
                                   tasks["orphaned"]) is None, "the requeued task kept its claim"
    assert await world.task_state(str(tasks["just-cancelled"])) == "in_progress", (
        "the sweep took the work of a kill whose requeue was still on its way")


@pytest.mark.parametrize("scope", ["fleet", "agent"])
async def test_a_repeated_kill_finishes_what_a_kill_cut_short_left(world: World,
                                                                  scope: str) -> None:
    """The 503 of a kill cut short by an outage asks for a retry. A fleet kill whose control
    plane was SIGKILLed after its flag had committed left the flags set, the sessions
    cancelled and the work in progress; its retry found every flag already set, touched no
    agent, and answered 200 with the work still in progress. The retry requeues the work
    and evicts the parked sandbox of every agent the flag holds."""
    agent = await world.agent()
    aid = uuid.UUID(agent["id"])
    if scope == "fleet":
        await world.db.execute("UPDATE organizations SET fleet_killed=true WHERE id=$1",
                               world.org.id)
    await world.db.execute("UPDATE agents SET killed=true, kill_origin=$2, status='killed'"
                           " WHERE id=$1", aid, scope if scope == "fleet" else "agent")
    sandbox_id, parked, session_id, task_id = (uuid.uuid4() for _ in range(4))
    await world.db.execute(
        "INSERT INTO sandboxes (id, agent_id, backend, state, node) VALUES"
        " ($1, $3, 'process', 'gone', 'elsewhere'),"
        " ($2, $3, 'process', 'parked', 'elsewhere')", sandbox_id, parked, aid)
    await world.db.execute(
        "INSERT INTO sessions (id, agent_id, sandbox_id, node, state, ended_at, stop_layer)"
        " VALUES ($1, $2, $3, 'elsewhere', 'cancelled', now(), 'kill-switch')",
        session_id, aid, sandbox_id)
    await world.db.execute(
        "INSERT INTO backlog_tasks (id, org_id, agent_id, title, body, origin, state,"
        " claimed_by, claim_token) VALUES ($1, $2, $3, 't', 'hold', 'api', 'in_progress',"
        " $4, 7)", task_id, world.org.id, aid, session_id)

    path = "/api/v1/fleet/kill" if scope == "fleet" else f"/api/v1/agents/{aid}/kill"
    r = await world.security.post(path)
    assert r.status_code == 200, f"the retried kill answered {r.status_code}: {r.text}"
    assert r.json()["tasks_requeued"] == [str(task_id)], (
        f"the retried {scope} kill answered 200 and left the work in progress: {r.text}")
    assert await world.task_state(str(task_id)) == "open"
    assert await world.db.fetchval("SELECT state FROM sandboxes WHERE id=$1", parked) \
        == "evicted", "the retried kill left the killed agent's warm sandbox parked"


async def test_a_kill_whose_connection_the_database_closes_answers_503_and_its_retry_works(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kill holds one connection across its two transactions. A database restart
    between them closes it; asyncpg hands it back to the pool, and the requeue's use of it
    raised InterfaceError, which the API answered with a 500. It is the database being away:
    a 503 that asks for the retry, and the retry finishes the kill. (The wait below asks
    asyncpg, never the connection: a probing query read the server's goodbye and failed.)"""
    agent = await world.agent()
    aid, task_id = uuid.UUID(agent["id"]), uuid.uuid4()
    await world.db.execute(
        "INSERT INTO backlog_tasks (id, org_id, agent_id, title, body, origin, state)"
        " VALUES ($1, $2, $3, 't', 'hold', 'api', 'in_progress')", task_id, world.org.id, aid)
    orch = world.plane.orch
    stop_sessions = orch._stop_sessions

    async def closed(conn: Any) -> bool:
        try:
            return bool(conn.is_closed())
        except asyncpg.InterfaceError:  # already handed back to the pool
            return True

    async def restart_between(conn: Any, *args: Any, **kwargs: Any) -> Any:
        # With a timeout, pg_terminate_backend returns once the server process has exited.
        assert await world.db.fetchval("SELECT pg_terminate_backend($1, 10000)",
                                       conn.get_server_pid())
        await eventually(lambda: closed(conn), 10,
                         "asyncpg never saw the terminated connection close")
        return await stop_sessions(conn, *args, **kwargs)

    monkeypatch.setattr(orch, "_stop_sessions", restart_between)
    r = await world.security.post(f"/api/v1/agents/{aid}/kill")
    assert r.status_code == 503, f"a kill cut short by the database answered {r.status_code}"
    assert r.json()["error"] == "Database unreachable" and r.json()["hint"], r.text

    monkeypatch.setattr(orch, "_stop_sessions", stop_sessions)
    r = await world.security.post(f"/api/v1/agents/{aid}/kill")
    assert r.status_code == 200, f"the retried kill answered {r.status_code}: {r.text}"
    assert r.json()["tasks_requeued"] == [str(task_id)], r.text
    assert await world.task_state(str(task_id)) == "open"


class _GoneConnection:
    """A connection that has read the server's goodbye but not yet seen its socket close."""

    def transaction(self) -> contextlib.AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()


async def test_a_kill_step_refused_by_a_half_closed_connection_is_the_database_away() -> None:
    """CI caught asyncpg refusing a query with InternalClientError ("another operation is in
    progress") on a connection whose server had just been terminated: its FATAL was read
    while the connection was idle. That is the database going away (a 503 and a retry),
    while any other InternalClientError stays the bug it is."""
    async def half_closed(conn: object) -> None:
        raise asyncpg.InternalClientError(
            "cannot switch to state 11; another operation (2) is in progress")

    async def other(conn: object) -> None:
        raise asyncpg.InternalClientError("unexpected message")

    with pytest.raises(DatabaseUnavailable, match="before its requeue"):
        await _retried(_GoneConnection(), half_closed, "agent", "requeue")  # type: ignore[arg-type]
    with pytest.raises(asyncpg.InternalClientError, match="unexpected message"):
        await _retried(_GoneConnection(), other, "agent", "requeue")  # type: ignore[arg-type]


def _notify_wakes_of(world: World, agent_ids: set[uuid.UUID]) -> list[uuid.UUID]:
    """Spy on the plane's wakes from covey_wake NOTIFYs of these agents (the plane is
    shared by the session's tests: only ours count)."""
    orch = world.plane.orch
    seen: list[uuid.UUID] = []
    wake = orch.wake

    async def spied(agent_id: uuid.UUID, path: str) -> Any:
        if path == "notify" and agent_id in agent_ids:
            seen.append(agent_id)
        return await wake(agent_id, path)
    orch.wake = spied  # type: ignore[method-assign]
    return seen


def _notify_wakes_refused() -> float:
    from prometheus_client import REGISTRY
    return REGISTRY.get_sample_value(
        "covey_wakes_total", {"path": "notify", "outcome": "refused"}) or 0.0


async def test_a_fleet_kills_requeue_wakes_none_of_its_stopped_agents(world: World) -> None:
    """The requeue's trigger NOTIFYs covey_wake for every task it puts back. Each was a wake
    transaction of its own that locked its agent and the organisation's row and committed
    with a WAL flush, only to be refused: at 1,000 sandboxes a thousand of them queued in
    the pool and the WAL beside the kill's confirmations. The agents are all stopped by
    then: the NOTIFYs are looked at together, and none of them becomes a wake."""
    agents = [uuid.UUID((await world.agent())["id"]) for _ in range(3)]
    for aid in agents:
        await world.db.execute(
            "INSERT INTO backlog_tasks (id, org_id, agent_id, title, body, origin, state)"
            " VALUES ($1, $2, $3, 't', 'hold', 'api', 'in_progress')",
            uuid.uuid4(), world.org.id, aid)
    woken = _notify_wakes_of(world, set(agents))
    refused_before = _notify_wakes_refused()
    try:
        r = await world.security.post("/api/v1/fleet/kill")
        assert r.status_code == 200, r.text
        assert len(r.json()["tasks_requeued"]) == 3, r.text

        async def all_looked_at() -> bool:
            return _notify_wakes_refused() - refused_before >= 3
        await eventually(all_looked_at, 10,
                         "the requeue's three covey_wake NOTIFYs were never looked at")
    finally:
        del world.plane.orch.wake  # type: ignore[method-assign]
    assert woken == [], f"stopped agents were woken from the requeue's NOTIFYs: {woken}"


async def test_open_work_written_by_anyone_still_wakes_an_agent_that_may_run(
        database_url: str, tmp_path: Path) -> None:
    """The other side of the look: work written straight into the table (an operator with
    psql) still wakes its agent through the NOTIFY, at once. On a plane of its own whose
    scheduler does not come round in the test: the shared plane's tick (300 ms) now and
    then started the agent first, and the NOTIFY's look then rightly left it out."""
    async with start_plane(database_url, tmp_path, SCRIPTED_DAEMON, tick_ms=60_000) as plane, \
            make_world(plane) as world:
        agent = await world.agent()
        aid = uuid.UUID(agent["id"])
        woken = _notify_wakes_of(world, {aid})
        try:
            task_id = await world.db.fetchval(
                "INSERT INTO backlog_tasks (id, org_id, agent_id, title, body, origin)"
                " VALUES ($1, $2, $3, 't', 'hold', 'api') RETURNING id",
                uuid.uuid4(), world.org.id, aid)
            await world.wait_task(str(task_id), "in_progress")
        finally:
            del world.plane.orch.wake  # type: ignore[method-assign]
        assert woken == [aid], f"the agent was woken {woken} from its NOTIFY, not once"


@pytest.mark.parametrize("statement", ["fleet kill", "costs", "lease renewal"])
async def test_a_statement_on_several_sessions_locks_them_in_the_order_of_their_ids(
        database_url: str, tmp_path: Path, statement: str) -> None:
    """Two statements that lock the same sessions in different orders deadlock, and
    Postgres aborts one a second later: the fleet kill's cancellation deadlocked with the
    daemons' batched costs and with the lease renewal under incident load, and reached its
    daemons 0.42 and 2.2 s after the request. Each such statement locks the sessions by
    id: with the lowest held elsewhere, it waits for it holding none of the others; with
    the highest held, it waits for it holding all of the others."""
    # The plane's own lease renewal (every third of a lease) locks the same sessions: queued
    # ahead of the statement under test, it would be the one the holder blocks (CI saw the
    # costs wait behind it). A ten-minute lease keeps it out of the test.
    async with start_plane(database_url, tmp_path, SCRIPTED_DAEMON, tick_ms=60_000,
                           lease_ms=600_000) as plane, \
            make_world(plane) as world:
        agents = [(await world.agent())["id"] for _ in range(5)]
        for a in agents:
            await world.task(a, "hold")
        for a in agents:
            await world.wait_working(a)
        rows = await world.db.fetch("SELECT id, agent_id FROM sessions WHERE state='running'")
        ids = sorted(r["id"] for r in rows)
        agent_of = {r["id"]: r["agent_id"] for r in rows}
        # Each statement as it reaches the database; the input highest first, for a
        # statement that would follow its input's order.
        run, text = {
            "fleet kill": (lambda: world.security.post("/api/v1/fleet/kill"),
                           "%covey_flag_%"),
            "costs": (lambda: asyncio.gather(*(plane.orch.record_cost.write(
                agent_of[s], s, 0.01, 1) for s in reversed(ids))), "%cost_entries%"),
            "lease renewal": (lambda: plane.orch.renew_leases(list(reversed(ids))),
                              "%last_seen_at=now()%"),
        }[statement]
        # The fleet kill is pulled once; the others can be held up at either end.
        for held, others_free in [(ids[0], True)] + (
                [] if statement == "fleet kill" else [(ids[-1], False)]):
            others = [i for i in ids if i != held]
            async with world.db.acquire() as holder:
                async with holder.transaction():
                    await holder.execute(
                        "SELECT 1 FROM sessions WHERE id=$1 FOR NO KEY UPDATE", held)
                    under_test = asyncio.ensure_future(run())
                    try:
                        async def blocked() -> bool:
                            # Waiting for the holder, directly or queued behind another
                            # waiter for the same row.
                            return bool(await world.db.fetchval(
                                """
                                WITH RECURSIVE waits(pid) AS (
                                    SELECT $1::int
                                    UNION
                                    SELECT a.pid FROM pg_stat_activity a, waits w
                                    WHERE w.pid = ANY(pg_blocking_pids(a.pid)))
                                SELECT count(*) FROM pg_stat_activity
                                WHERE pid IN (SELECT pid FROM waits) AND pid <> $1
                                  AND query LIKE $2
                                """, holder.get_server_pid(), text))
                        await eventually(blocked, 10,
                                         f"the {statement} never waited for the held session")
                        free = await world.db.fetch(
                            "SELECT id FROM sessions WHERE id = ANY($1::uuid[])"
                            " ORDER BY id FOR NO KEY UPDATE SKIP LOCKED", others)
                    except BaseException:
                        under_test.cancel()
                        raise
                done = await asyncio.wait_for(under_test, 10)
            assert sorted(r["id"] for r in free) == (others if others_free else []), (
                f"the {statement} waited for session {held} holding "
                f"{len(others) - len(free)} of the other {len(others)}: not in id order")
        if statement == "fleet kill":
            assert done.status_code == 200, done.text
            assert len(done.json()["sessions_cancelled"]) == len(ids), done.text


async def test_a_kill_whose_flag_function_is_gone_creates_it_and_stops_the_agent(
        world: World) -> None:
    """The flag functions are created at start-up (covey.switches.install_flags). A database
    that lost them since (restored from a dump made before) must not fail the kill switch:
    the kill creates them again and stops the agent, in one answer."""
    from covey.switches import AGENT_FLAG
    await world.db.execute(f"DROP FUNCTION {AGENT_FLAG.name}")
    agent = await world.agent()
    r = await world.security.post(f"/api/v1/agents/{agent['id']}/kill")
    assert r.status_code == 200, f"the kill failed without its flag function: {r.text}"
    row = await world.db.fetchrow("SELECT killed, status FROM agents WHERE id=$1",
                                  uuid.UUID(agent["id"]))
    assert row["killed"] and row["status"] == "killed", f"the agent was not stopped: {row}"
    assert await world.db.fetchval("SELECT count(*) FROM pg_proc WHERE proname=$1",
                                   AGENT_FLAG.name) == 1, "the flag function was not created"


async def test_a_kill_whose_requeue_fails_is_still_on_the_log(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kill's audit line is written after its requeue, off its way to the daemon. A
    requeue that fails (the database gone between the flag and it) answers 503, and the
    retry the 503 asks for finds the agent already killed and logs nothing: the committed
    kill must be on the log all the same (its alerts read the log, not the table)."""
    from structlog.testing import capture_logs

    import covey.switches

    retried = covey.switches._retried

    async def requeue_fails(conn: Any, body: Any, scope: str, step: str,
                            statement: bool = False) -> Any:
        if step == "requeue":
            raise DatabaseUnavailable("the database went away (the test's)")
        return await retried(conn, body, scope, step, statement=statement)
    monkeypatch.setattr(covey.switches, "_retried", requeue_fails)
    agent = await world.agent()
    with capture_logs() as logs:
        r = await world.security.post(f"/api/v1/agents/{agent['id']}/kill")
    assert r.status_code == 503, f"the failed requeue was not answered 503: {r.text}"
    killed = [e for e in logs if e.get("event") == "audit" and e.get("action") == "agent.kill"
              and e.get("target") == agent["id"]]
    assert len(killed) == 1, f"the committed kill's audit line: {killed} (all: {logs})"


async def test_the_requeues_quick_commit_leaves_every_switch_connection_synchronous(
        world: World) -> None:
    """The kill's requeue commits without waiting for the WAL to reach the disk
    (synchronous_commit off for its own transaction). That must end with it: the next kill's
    flag runs on the same pooled connections, and a flag committed without its flush could
    be undone by a crash after its `kill` went out, the agent free to run again."""
    agent = await world.agent()
    task_id = uuid.uuid4()
    await world.db.execute(
        "INSERT INTO backlog_tasks (id, org_id, agent_id, title, body, origin, state)"
        " VALUES ($1, $2, $3, 't', 'hold', 'api', 'in_progress')",
        task_id, world.org.id, uuid.UUID(agent["id"]))
    r = await world.security.post(f"/api/v1/agents/{agent['id']}/kill")
    assert r.status_code == 200, r.text
    assert r.json()["tasks_requeued"] == [str(task_id)], r.text

    pool = world.plane.orch.switch_pool
    held = []
    try:
        for _ in range(pool.get_max_size()):  # every one of them
            held.append(await pool.acquire())
        settings = [await conn.fetchval("SHOW synchronous_commit") for conn in held]
    finally:
        for conn in held:
            await pool.release(conn)
    assert settings == ["on"] * len(held), (
        f"a switch connection kept the requeue's asynchronous commit: {settings}")
