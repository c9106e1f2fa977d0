"""One CPU share for all of a control plane's process sandboxes, and a higher one for the plane.

Each process sandbox is a session of its own (`start_new_session`, so that a kill can take its
whole process group), and Linux's autogroup scheduling gives every session the same share of
the CPU as the control plane's. With a thousand sandboxes runnable at once (a fleet kill wakes
every daemon to read its `kill` and exit) the plane got about a thousandth of the host while
its answer was due. Placed in one CPU cgroup of their own, the sandboxes together weigh as
much as one session: the plane keeps about half of a busy host, however many there are.

This is scheduling, not containment: a sandbox is still torn down by its process group and
its marker (covey/sandbox.py). Where no CPU cgroup can be made (not root, a cgroup v2
hierarchy whose rules forbid it, a read-only /sys), sandboxes run as before and the plane
says so once in its log. `COVEY_SANDBOX_CPU_GROUP=off` turns it off.

The plane itself outranks the rest of the host where it may (`raise_plane_priority`): a kill
is a few round trips through the plane's event loop and its database, and on a busy host each
waits for the CPU behind everything else that runs.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import structlog

from covey.cgroup_paths import PREFIX, own_cgroup

log = structlog.get_logger("covey.cpu_group")

CGROUP_ROOT = Path("/sys/fs/cgroup")
AUTOGROUP = Path("/proc/self/autogroup")
AUTOGROUP_ENABLED = Path("/proc/sys/kernel/sched_autogroup_enabled")


@dataclass(frozen=True)
class CpuGroup:
    """A cgroup directory whose `cgroup.procs` takes sandbox pids."""

    path: Path

    def join(self, pid: int) -> bool:
        """Move a just-started sandbox into the group, with whatever it has started already;
        what its processes start from then on is born there. Never fails the sandbox's
        start: a pid already gone (a daemon that failed at once) or a move the kernel
        refuses leaves it in the plane's share, which the log says.

        Each process is moved before its children are read: a child forked before its
        parent moved is listed then, one forked after is born in the group. (The sandbox's
        first move once came after its daemon had already started a child, on a loaded CI
        host, and that child ran in the plane's share.) A process whose parent had already
        exited is not found, which costs only scheduling: teardown is by group and marker.
        Returns whether `pid` itself is in the group now."""
        pending = [pid]
        joined = False
        while pending:
            current = pending.pop()
            try:
                (self.path / "cgroup.procs").write_text(f"{current}\n")
            except ProcessLookupError:
                continue
            except OSError as exc:
                log.warning("sandbox_cpu_group_join_refused", pid=current, path=str(self.path),
                            reason=str(exc))
                return joined
            joined = joined or current == pid
            pending.extend(children(current))
        return joined

    @property
    def moves_threads(self) -> bool:
        """Whether a single thread can be lifted out of the group (`lift`): cgroup v1's
        `tasks`. A v2 hierarchy moves threads only between threaded groups."""
        return (self.path.parent / "tasks").exists()

    def lift(self, tid: int) -> bool:
        """Move one thread out of the group into the plane's own CPU cgroup (its parent):
        a killed agent's daemon's, whose acknowledgement is due (ProcessProvider.hasten).
        The kernel's migration waits (about 12 ms once, on the plane's loop): never called
        from the loop. Whether it moved."""
        try:
            (self.path.parent / "tasks").write_text(f"{tid}\n")
        except OSError:  # a thread gone (the daemon exited first), a move refused
            return False
        return True

    def remove(self) -> None:
        """Remove the group once the plane stops; only an empty group can go, and one that
        still holds a sandbox is left for the next plane's `sweep` to remove."""
        with contextlib.suppress(OSError):
            self.path.rmdir()


def children(pid: int) -> list[int]:
    """The processes `pid`'s threads have started and that still run (Linux's
    /proc/<pid>/task/<tid>/children); none when it is gone or the kernel does not say."""
    found: list[int] = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in threads:
        with contextlib.suppress(OSError, ValueError):
            found += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    return found


def sweep(parent: Path) -> None:
    """Remove the empty groups that planes which died without tidying up left behind."""
    for stale in parent.glob(f"{PREFIX}*"):
        pid = stale.name.removeprefix(PREFIX)
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            with contextlib.suppress(OSError):
                stale.rmdir()


def make_cpu_group(mode: str = "auto", root: Path = CGROUP_ROOT) -> CpuGroup | None:
    """The plane's sandbox CPU group, made beside nothing else of the host: a child of the
    plane's own CPU cgroup. None (sandboxes each in their own session's share) when it is
    turned off or cannot be made here."""
    if mode == "off":
        return None
    try:
        found = own_cgroup("cpu", Path("/proc/self/cgroup").read_text())
        if found is None:
            raise OSError("no CPU controller in /proc/self/cgroup")
        path, unified = found
        base = root if unified else root / "cpu"
        parent = base / path.lstrip("/")
        if unified:
            # cgroup v2 hands the cpu controller to children only from a cgroup that holds
            # no processes of its own (the root excepted); where that is refused, give up.
            (parent / "cgroup.subtree_control").write_text("+cpu\n")
        sweep(parent)
        group = parent / f"{PREFIX}{os.getpid()}"
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").stat()
    except OSError as exc:
        log.info("sandbox_cpu_group_unavailable", reason=str(exc),
                 hint="each process sandbox gets a CPU share of its own; run the control "
                      "plane as root on a host with a writable CPU cgroup to share one")
        return None
    log.info("sandbox_cpu_group", path=str(group))
    return CpuGroup(group)


def autogroup_refusal(leads_session: bool, enabled: str, proc_cgroup: str) -> str | None:
    """Why an autogroup's nice value would not weigh here (None: it would): only a process
    that leads its session owns its autogroup, and the kernel applies autogroups only when
    they are enabled and only to tasks in the root CPU cgroup (elsewhere the cgroup's
    weight rules)."""
    if not leads_session:
        return "the plane does not lead its session (started from a shell?)"
    if enabled.strip() != "1":
        return "the kernel's autogroup scheduling is off (kernel.sched_autogroup_enabled)"
    found = own_cgroup("cpu", proc_cgroup)
    if found is not None and found[0] != "/":
        return f"the plane runs in CPU cgroup {found[0]}, where autogroups do not apply"
    return None


def raise_plane_priority(nice: int | None, autogroup: Path = AUTOGROUP,
                         enabled: Path = AUTOGROUP_ENABLED,
                         proc_cgroup: Path = Path("/proc/self/cgroup")) -> bool:
    """Give `covey serve`'s autogroup (its session: the plane, and whatever it starts without
    a session of its own) the nice value `nice`, and say so in the log. Returns whether it
    was set. Sandboxes and Postgres's backends each start a session, so none inherits it; a
    plane that does not lead its session (started from a shell) leaves the shell's alone.

    Linux weighs the sessions of the root CPU cgroup against each other, not processes
    (autogroup scheduling): the plane got one share of the CPU among every busy session of
    the host. In the incident-load game day (20 busy agents, 64 operators' reads from
    Locust, on two cores), the fleet kill's flag committed 115-190 ms after the operator's
    request in the runs that failed, and its agents went on acting meanwhile; at nice -10
    it was sent within 19-56 ms. Lowering a nice value takes root (CAP_SYS_NICE); where
    that is refused, or autogroups would not weigh (`autogroup_refusal`), the plane runs as
    it did and the log says why. A process's own nice value is left alone: sandboxes would
    inherit it."""
    if nice is None:
        return False
    hint = ("run the control plane as root (or with CAP_SYS_NICE), in a session of its own "
            "(a service manager, setsid) in the root CPU cgroup of a kernel with autogroups; "
            "or weigh its cgroup above the sandboxes' (cpu.weight). COVEY_PLANE_NICE=off "
            "stops the attempt")
    try:
        why = autogroup_refusal(os.getsid(0) == os.getpid(), enabled.read_text(),
                                proc_cgroup.read_text())
        if why is None:
            autogroup.write_text(f"{nice}\n")
    except OSError as exc:
        why = str(exc)
    if why is not None:
        log.info("plane_cpu_priority_unchanged", nice=nice, reason=why, hint=hint)
        return False
    log.info("plane_cpu_priority", nice=nice, autogroup=str(autogroup))
    return True
