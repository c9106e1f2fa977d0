"""Where a process sits among the CPU cgroups, read from /proc: for the control plane's
sandbox CPU group (covey/cpu_group.py) and for coveyd's cut (covey/tools.py). The standard
library only: coveyd imports it, and a daemon's start pays for every import (covey.cpu_group's
logging alone cost it 36 ms)."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

# Every control plane's sandbox CPU group is named this, and the plane's pid.
PREFIX = "covey-sandboxes-"


def own_cgroup(controller: str, proc_cgroup: str) -> tuple[str, bool] | None:
    """This process's cgroup path for `controller` from /proc/self/cgroup's text, and
    whether it is the unified (v2) hierarchy's."""
    unified: str | None = None
    for line in proc_cgroup.splitlines():
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and controllers == "":
            unified = path
        elif controller in controllers.split(","):
            return path, False
    return (unified, True) if unified is not None else None


def in_a_sandbox_group(pid: int) -> bool:
    """Whether the process is in a control plane's sandbox CPU group. False once it is gone."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False
    found = own_cgroup("cpu", text)
    return found is not None and PurePosixPath(found[0]).name.startswith(PREFIX)
