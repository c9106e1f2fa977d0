"""Where the CPU of a run goes, from /proc: the CPU time each part of a processes stack
used between two readings, beside the whole machine's, so that a figure measured on a shared
2-core host says what it competed with.

Parts, found from this process down (its descendants) and by the stack's Postgres folder:
* `control plane`: `covey serve`;
* `daemons`: every `coveyd` and the tool commands they ran: the live ones, plus those the
  control plane has reaped (the kernel adds a reaped child's time to its parent's);
* `postgres`: the stack's postmaster and its backends;
* `puppet`: the puppet model's process;
* `locust`: Locust and its workers (they end with each run, reaped by this process);
* `harness`: this process itself (it also relays the daemons' control channel, through the
  nemesis's fault proxy);
* `others`: the rest of the machine (other people's work on a shared host).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

TICK_S = 1 / os.sysconf("SC_CLK_TCK")
PARTS = ("control plane", "daemons", "postgres", "puppet", "locust", "harness", "others")


@dataclass(frozen=True)
class _Proc:
    pid: int
    ppid: int
    own_s: float  # utime + stime
    reaped_s: float  # cutime + cstime: its reaped children's
    cmdline: str


def _procs() -> dict[int, _Proc]:
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace")
        except OSError:
            continue  # gone meanwhile
        # The command name is in parentheses and may hold spaces: split after it.
        fields = stat[stat.rindex(")") + 2:].split()
        utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
        found[int(entry.name)] = _Proc(int(entry.name), int(fields[1]),
                                       (utime + stime) * TICK_S, (cutime + cstime) * TICK_S,
                                       cmdline)
    return found


def _machine_busy_s() -> float:
    """CPU time the whole machine spent busy (all but idle and iowait), over every core."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) * TICK_S


def reading(postgres_dir: Path | None = None) -> dict[str, float]:
    """Cumulative CPU seconds per part (and `machine`), now."""
    procs = _procs()
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    me = os.getpid()
    mine: list[_Proc] = []
    stack = list(children.get(me, []))
    while stack:
        pid = stack.pop()
        mine.append(procs[pid])
        stack.extend(children.get(pid, []))
    used = dict.fromkeys(PARTS, 0.0)
    used["harness"] = procs[me].own_s
    used["locust"] = procs[me].reaped_s  # the Locust runs that ended
    for p in mine:
        if "covey serve" in p.cmdline:
            used["control plane"] += p.own_s
            used["daemons"] += p.reaped_s
        elif "coveyd" in p.cmdline:
            used["daemons"] += p.own_s + p.reaped_s
        elif "harness.puppet" in p.cmdline:
            used["puppet"] += p.own_s
        elif "locust" in p.cmdline:
            used["locust"] += p.own_s + p.reaped_s
    if postgres_dir is not None:
        masters = [p for p in procs.values() if str(postgres_dir) in p.cmdline
                   and "postgres" in p.cmdline]
        for master in masters:
            used["postgres"] += master.own_s + master.reaped_s
            used["postgres"] += sum(procs[c].own_s for c in children.get(master.pid, []))
    used["machine"] = _machine_busy_s()
    return used


def between(before: dict[str, float], after: dict[str, float], wall_s: float
            ) -> dict[str, dict[str, float]]:
    """CPU seconds and cores (seconds per wall-clock second) per part between two readings."""
    delta = {part: max(0.0, after[part] - before[part]) for part in (*PARTS[:-1], "machine")}
    delta["others"] = max(0.0, delta["machine"] - sum(delta[p] for p in PARTS[:-1]))
    return {part: {"cpu_s": round(s, 1), "cores": round(s / wall_s, 2)}
            for part, s in delta.items()}
