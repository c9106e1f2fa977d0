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

Beside the CPU each part used, how long its processes waited for a CPU while they could
have run (the scheduler's run delay, /proc/PID/task/*/schedstat): on a saturated host that
is where a kill's time goes. It counts the processes alive at the second reading (a daemon
that exited meanwhile takes its figure with it), which the control plane, Postgres, the
puppet and the harness are throughout.
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
    waited_s: float  # run delay of all its threads: runnable, but no CPU free


def _waited_s(entry: Path) -> float:
    total = 0
    try:
        for task in (entry / "task").iterdir():
            total += int((task / "schedstat").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        pass  # gone meanwhile, or no schedstat in this kernel
    return total / 1e9


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
                                       cmdline, 0.0)
    return found


def _machine_busy_s() -> float:
    """CPU time the whole machine spent busy (all but idle and iowait), over every core."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) * TICK_S


@dataclass(frozen=True)
class Reading:
    used_s: dict[str, float]  # cumulative CPU seconds per part, and the whole `machine`'s
    waited_s: dict[str, dict[int, float]]  # per part, per process: cumulative run delay


def reading(postgres_dir: Path | None = None) -> Reading:
    """Cumulative CPU seconds per part (and `machine`), and run delays, now."""
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
    waited: dict[str, dict[int, float]] = {part: {} for part in PARTS[:-1]}
    used["harness"] = procs[me].own_s
    waited["harness"][me] = _waited_s(Path(f"/proc/{me}"))
    used["locust"] = procs[me].reaped_s  # the Locust runs that ended
    for p in mine:
        part = ("control plane" if "covey serve" in p.cmdline else
                "daemons" if "coveyd" in p.cmdline else
                "puppet" if "harness.act.puppet" in p.cmdline else
                "locust" if "locust" in p.cmdline else None)
        if part is None:
            continue
        if part == "control plane":
            used[part] += p.own_s
            used["daemons"] += p.reaped_s
        else:
            used[part] += p.own_s + (0.0 if part == "puppet" else p.reaped_s)
        waited[part][p.pid] = _waited_s(Path(f"/proc/{p.pid}"))
    if postgres_dir is not None:
        masters = [p for p in procs.values() if str(postgres_dir) in p.cmdline
                   and "postgres" in p.cmdline]
        for master in masters:
            used["postgres"] += master.own_s + master.reaped_s
            for pid in (master.pid, *children.get(master.pid, [])):
                if pid != master.pid:
                    used["postgres"] += procs[pid].own_s
                waited["postgres"][pid] = _waited_s(Path(f"/proc/{pid}"))
    used["machine"] = _machine_busy_s()
    return Reading(used, waited)


def between(before: Reading, after: Reading, wall_s: float) -> dict[str, dict[str, float]]:
    """Per part between two readings: CPU seconds, cores (CPU seconds per wall-clock
    second) and, for its processes, seconds spent waiting for a CPU per wall-clock second
    (`waiting`: 0.5 means half a process's worth of work was held up all the while)."""
    delta = {part: max(0.0, after.used_s[part] - before.used_s[part])
             for part in (*PARTS[:-1], "machine")}
    delta["others"] = max(0.0, delta["machine"] - sum(delta[p] for p in PARTS[:-1]))
    out: dict[str, dict[str, float]] = {}
    for part, s in delta.items():
        out[part] = {"cpu_s": round(s, 1), "cores": round(s / wall_s, 2)}
        if part in after.waited_s:
            waited = sum(w - before.waited_s[part].get(pid, 0.0)
                         for pid, w in after.waited_s[part].items())
            out[part]["waiting"] = round(waited / wall_s, 2)
    return out
