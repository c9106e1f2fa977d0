"""Prometheus metrics of the kill path. Stages are measured from the kill request's arrival."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

KILL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

kills = Counter("covey_kills_total", "Kill requests", ["scope", "outcome"])
resumes = Counter("covey_resumes_total", "Resume requests", ["scope", "outcome"])
kill_stage_seconds = Histogram(
    "covey_kill_stage_seconds",
    "Time from the kill request to each stage: flag committed, kill sent, tasks requeued",
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

# ---- Spend and guard trips: what agents cost and what stopped them ----
# Counted where the control plane learns them (a daemon's `cost` message, a guard trip it
# records), so each replica counts its own daemons': Prometheus sums the replicas.
model_spend_usd = Counter("covey_model_spend_usd", "What agents' model calls cost, as their "
                          "daemons booked it (USD)", ["agent_id"])
model_tokens = Counter("covey_model_tokens", "Tokens of agents' model calls", ["agent_id"])
guard_trips = Counter("covey_guard_trips_total", "Sessions stopped by their agent's own "
                      "guard, by layer", ["layer"])
