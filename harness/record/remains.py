"""What is left of an agent's sandboxes on this machine, seen from outside the control plane:
the ground truth for "a killed agent leaves nothing running", as the puppet's ledger is for
what agents did. The control plane's rows say a sandbox is gone; this looks.

* `processes` stack: every live process (psutil) whose environment names the agent
  (`COVEY_AGENT_ID`, which each sandbox's daemon is given and whatever it starts inherits;
  the shell tool runs each command in a session of its own, so no process group finds them);
* `containers` stack: every container, running or not, labelled `covey.agent=<id>`;
* upstream covey on this machine's Docker engine: its running container
  `covey-sandbox-<id>` (harness/record/sandbox_events.py);
* elsewhere (a deployment) the harness cannot look: None.

And how each sandbox's daemon ended (`daemon_exits`), read where its control plane cannot be
asked (a crashed one): its exit line in its log (`exiting with N after Ts: why`, covey.coveyd)
and, for a container, the engine's exit code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

AGENT_MARKER = "COVEY_AGENT_ID"


def _processes_of(agent_id: str) -> list[str]:
    found = []
    # An environment or command line psutil may not read (another user's process, a
    # zombie's, which holds nothing) comes as None; a process gone meanwhile is left out.
    for process in psutil.process_iter(["environ", "cmdline"]):
        if (process.info["environ"] or {}).get(AGENT_MARKER) != agent_id:
            continue
        command = " ".join(process.info["cmdline"] or []).strip()
        found.append(f"process {process.pid} ({command[:80]})")
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


# covey.coveyd's last log line: "exiting with 3 after 4.2s: its kill-flag lease ran out (...)".
EXIT_LINE = re.compile(r"exiting with (-?\d+) after [\d.]+s: (.*)")


@dataclass(frozen=True)
class DaemonExit:
    code: int | None  # None: not exited (or gone without its exit line)
    why: str  # what its exit line says ("" without one)


def _exit_in(log: str, code: int | None = None) -> DaemonExit:
    said = [m for m in map(EXIT_LINE.search, log.splitlines()) if m]
    if not said:
        return DaemonExit(code, "")
    return DaemonExit(int(said[-1].group(1)) if code is None else code, said[-1].group(2))


def _exits_of_containers(sandbox_ids: list[str]) -> dict[str, DaemonExit]:
    import docker
    import docker.errors

    client = docker.from_env()
    exits: dict[str, DaemonExit] = {}
    try:
        for sandbox_id in sandbox_ids:
            found = client.containers.list(ignore_removed=True, all=True,
                                           filters={"label": f"covey.sandbox={sandbox_id}"})
            if not found or found[0].status not in ("exited", "dead"):
                exits[sandbox_id] = DaemonExit(None, "")
                continue
            box = found[0]
            with_code = int(box.attrs["State"].get("ExitCode", -1))
            try:
                exits[sandbox_id] = _exit_in(box.logs().decode(errors="replace"), with_code)
            except docker.errors.APIError:
                exits[sandbox_id] = DaemonExit(with_code, "")
    finally:
        client.close()
    return exits


def _exits_of_processes(sandbox_ids: list[str], data_dir: Path) -> dict[str, DaemonExit]:
    exits = {}
    for sandbox_id in sandbox_ids:
        log = data_dir / "logs" / f"{sandbox_id}.log"
        exits[sandbox_id] = _exit_in(log.read_text(errors="replace") if log.is_file() else "")
    return exits


def daemon_exits(stack: str, sandbox_ids: list[str], data_dir: Path | None
                 ) -> dict[str, DaemonExit] | None:
    """How the daemons of these sandboxes ended, or None where this stack's sandboxes (or
    their logs) are not on this machine. A container's logs are read before the control plane
    removes it. Blocking: call it in a thread."""
    if stack == "containers":
        return _exits_of_containers(sandbox_ids)
    if stack == "processes" and data_dir is not None:
        return _exits_of_processes(sandbox_ids, data_dir)
    return None
