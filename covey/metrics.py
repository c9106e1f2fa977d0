"""Prometheus metrics of the kill path. Stages are measured from the kill request's arrival."""

from __future__ import annotations

import asyncio

import asyncpg
from prometheus_client import Counter, Gauge, Histogram

from covey.db import UNREACHABLE, Pool

KILL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

kills = Counter("covey_kills_total", "Kill requests", ["scope", "outcome"])
resumes = Counter("covey_resumes_total", "Resume requests", ["scope", "outcome"])
kill_stage_seconds = Histogram(
    "covey_kill_stage_seconds",
    "Time from the kill request to each stage: holds sent, flag committed, kill sent,"
    " tasks requeued",
    ["scope", "stage"],
    buckets=KILL_BUCKETS,
)
wakes = Counter("covey_wakes_total", "Wake attempts by path and outcome", ["path", "outcome"])
kill_confirmations = Histogram(
    "covey_kill_confirmation_seconds",
    "Time from a kill message sent to a daemon to its confirmation, by how it came: kill_ack "
    "(obeyed), lease (hung up once its lease ran out), hang_up (without a word)",
    ["by"],
    buckets=KILL_BUCKETS,
)
daemon_connections = Gauge("covey_daemon_connections", "Daemon WebSockets connected here")
daemon_losses = Counter("covey_daemon_losses_total", "Sessions lost with their daemon", ["outcome"])
rejected_results = Counter("covey_rejected_results_total", "Results refused by fencing", ["why"])


# ---------------------------------------------------------------- state to alert on
# Read from Postgres at each scrape (`read_state`), not counted in one replica's memory: a
# fleet stop pulled through another replica, or by a replica since restarted, still shows, and
# every replica reports the same figures (alert on max() over them). `/metrics` once had
# nothing to alert on: no sign of a standing fleet stop, of killed agents, of running sessions.
KILL_ORIGINS = ("agent", "fleet", "guard")  # agents.kill_origin (migration 0001)
STATE_READ_TIMEOUT_S = 1.0
STATE_UNREADABLE: tuple[type[Exception], ...] = (asyncpg.PostgresError, TimeoutError,
                                                 *UNREACHABLE)

fleet_stopped = Gauge("covey_fleet_stopped",
                      "1 while the organisation's fleet stop (emergency stop) stands",
                      ["org_id", "org"])
global_stop = Gauge("covey_global_stop", "1 while the control plane's global flag stands")
killed_agents = Gauge("covey_killed_agents",
                      "Agents held by their own flag, by what set it: agent (its switch), "
                      "fleet (the fleet stop), guard (a guard trip)",
                      ["org_id", "org", "origin"])
running_sessions = Gauge("covey_running_sessions", "Sessions starting or running",
                         ["org_id", "org"])
state_read = Gauge("covey_state_read_ok",
                   "1 when this scrape read the state gauges from the database; 0 when it could "
                   "not (they then hold the last figures read)")


async def read_state(pool: Pool) -> None:
    """Set the state gauges from the database, within STATE_READ_TIMEOUT_S: a scrape during
    an outage answers at once, with covey_state_read_ok 0."""
    try:
        async with asyncio.timeout(STATE_READ_TIMEOUT_S):  # a free connection included
            rows = await pool.fetch(
                """
                SELECT o.id, o.name, o.fleet_killed,
                       (SELECT count(*) FROM sessions s JOIN agents a ON a.id = s.agent_id
                        WHERE a.org_id = o.id AND s.state IN ('starting', 'running')) AS running,
                       (SELECT COALESCE(jsonb_object_agg(k.origin, k.n), '{}'::jsonb)
                        FROM (SELECT kill_origin AS origin, count(*) AS n FROM agents
                              WHERE org_id = o.id AND killed GROUP BY kill_origin) k) AS killed,
                       EXISTS (SELECT 1 FROM kill_flags WHERE scope = 'global') AS global_stop
                FROM organizations o
                """,
            )
    except STATE_UNREADABLE:
        state_read.set(0)
        return
    # Cleared first: an organisation that is gone leaves no series behind. Nothing runs
    # between this and the exposition that follows (one turn of the event loop).
    for gauge in (fleet_stopped, killed_agents, running_sessions):
        gauge.clear()
    global_stop.set(0)
    for row in rows:
        org = (str(row["id"]), row["name"])
        fleet_stopped.labels(*org).set(int(row["fleet_killed"]))
        running_sessions.labels(*org).set(row["running"])
        for origin in KILL_ORIGINS:
            killed_agents.labels(*org, origin).set(row["killed"].get(origin, 0))
        if row["global_stop"]:
            global_stop.set(1)
    state_read.set(1)

# ---- Spend and guard trips: what agents cost and what stopped them ----
# Counted where the control plane learns them (a daemon's `cost` message, a guard trip it
# records), so each replica counts its own daemons': Prometheus sums the replicas.
model_spend_usd = Counter("covey_model_spend_usd", "What agents' model calls cost, as their "
                          "daemons booked it (USD)", ["agent_id"])
model_tokens = Counter("covey_model_tokens", "Tokens of agents' model calls", ["agent_id"])
guard_trips = Counter("covey_guard_trips_total", "Sessions stopped by their agent's own "
                      "guard, by layer", ["layer"])
