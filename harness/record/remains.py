"""What is left of an agent's sandboxes on this machine, seen from outside the control plane:
the ground truth for "a killed agent leaves nothing running", as the puppet's ledger is for
what agents did. The control plane's rows say a sandbox is gone; this looks.

* `processes` stack: every live process whose environment names the agent
  (`COVEY_AGENT_ID`, which each sandbox's daemon is given and whatever it starts inherits;
  the shell tool runs each command in a session of its own, so no process group finds them);
* `containers` stack: every container, running or not, labelled `covey.agent=<id>`;
* upstream covey on this machine's Docker engine: its running container
  `covey-sandbox-<id>` (harness/record/sandbox_events.py);
* elsewhere (a deployment) the harness cannot look: None.
"""

from __future__ import annotations

import os
from typing import Any

AGENT_MARKER = "COVEY_AGENT_ID"


def _processes_of(agent_id: str) -> list[str]:
    marker = f"{AGENT_MARKER}={agent_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or a zombie's (which holds nothing)
            continue
        found.append(f"process {entry} ({command[:80]})")
    return found


def _containers_of(agent_id: str) -> list[str]:
    import docker

    client = docker.from_env()
    try:
        containers: list[Any] = client.containers.list(
            ignore_removed=True, all=True, filters={"label": f"covey.agent={agent_id}"})
        return [f"container {c.short_id} ({c.status})" for c in containers]
    finally:
        client.close()


def remains_of(stack: str, agent_id: str, dialect: str = "covey-gameday") -> list[str] | None:
    """What of the agent's sandboxes still exists (empty: nothing), or None where this
    stack's sandboxes are not on this machine. Blocking: call it in a thread."""
    if stack == "processes":
        return _processes_of(agent_id)
    if stack == "containers":
        return _containers_of(agent_id)
    if dialect == "upstream":
        from harness.record.sandbox_events import containers_of

        return containers_of(agent_id)
    return None
