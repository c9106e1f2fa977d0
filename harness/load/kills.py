"""Whether a kill under load held, from what the killer can read: the agent's sessions as
the control plane recorded them and the puppet's ledger. Pure, and free of Locust, so that
the Locust file and the tests judge with the same rule; the rule itself is the game days'
(harness.judge.checkers: a request counts from its daemon's send stamp, a kill is acknowledged at
the earlier of the switch's answer and the daemon's own `kill_ack`)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from harness.judge.checkers import daemon_acked_at, kill_acknowledged_at, sent_at

# How far before the acknowledgement the killer reads the ledger: a request is seen after it
# is sent, so one sent after the acknowledgement was seen after it too, on one clock; the
# margin is for a daemon and puppet whose hosts' clocks differ.
LEDGER_MARGIN_NS = 10_000_000_000


def daemon_acks(sessions: list[dict[str, Any]]) -> list[int]:
    """When each of these sessions' daemons acknowledged its kill (those that did), as
    `GET …/sessions` records it."""
    acks = [daemon_acked_at(_ns(s.get("kill_acked_at")), _ns(s.get("kill_confirmed_at")))
            for s in sessions if s.get("kill_confirmed_by") == "kill_ack"]
    return [ns for ns in acks if ns is not None]


def acknowledged_at(switch_ack_ns: int, sessions: list[dict[str, Any]]) -> int:
    """When the kill counts as acknowledged for the agent of these sessions (its sessions
    the kill cancelled)."""
    return kill_acknowledged_at(switch_ack_ns, daemon_acks(sessions))


def late_requests(ledger: list[dict[str, Any]], acknowledged_ns: int) -> list[dict[str, Any]]:
    """The ledger's requests made after `acknowledged_ns`: each with when it counts from
    (`made_ns`: its send stamp, else when the puppet saw it), its stamp and the puppet's."""
    late = []
    for entry in ledger:
        made = sent_at(entry.get("sent_ns"), int(entry["at_ns"]))
        if made > acknowledged_ns:
            late.append({"made_ns": made, "sent_ns": entry.get("sent_ns"),
                         "received_ns": entry["at_ns"]})
    return late


def _ns(timestamp: str | None) -> int | None:
    if timestamp is None:
        return None
    return int(datetime.fromisoformat(timestamp).timestamp() * 1_000_000_000)
