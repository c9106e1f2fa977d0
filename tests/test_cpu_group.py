"""The process sandboxes' shared CPU group: where the plane finds its own cgroup, and real
sandboxes landing in the group when the host lets the plane make one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from covey.cgroup_paths import PREFIX, in_a_sandbox_group, own_cgroup
from covey.config import ConfigError, Settings
from covey.coveyd import STEP_ASIDE_NICE, in_a_crowd
from covey.cpu_group import (
    AUTOGROUP_ENABLED,
    CpuGroup,
    autogroup_refusal,
    children,
    make_cpu_group,
    raise_plane_priority,
    sweep,
)
from covey.hub import DaemonHub, DaemonLink
from covey.sandbox import (
    HASTENED_NICE,
    LIFT_AFTER_S,
    LIFTED_AT_MOST,
    ProcessProvider,
    SandboxSpec,
)
from harness.stack.waiting import eventually

V1 = """12:cpu,cpuacct:/machine/a
4:memory:/process_api/x
0::/
"""
V2 = "0::/system.slice/covey.service\n"


def test_the_cpu_controller_is_read_from_its_own_hierarchy() -> None:
    assert own_cgroup("cpu", V1) == ("/machine/a", False), "cgroup v1: the cpu line's path"
    assert own_cgroup("cpu", V2) == ("/system.slice/covey.service", True), \
        "cgroup v2: the unified hierarchy's path"
    assert own_cgroup("cpu", "4:memory:/x\n") is None, "no cpu controller and no v2 line"


def test_off_makes_no_group() -> None:
    assert make_cpu_group("off") is None


def test_a_hierarchy_that_refuses_gives_no_group_and_no_error(tmp_path: Path) -> None:
    # An empty folder as the cgroup root: no controller files, as on a host without the right.
    assert make_cpu_group("auto", root=tmp_path) is None


def test_groups_of_dead_planes_are_swept_and_live_ones_kept(tmp_path: Path) -> None:
    dead = tmp_path / f"{PREFIX}999999999"
    live = tmp_path / f"{PREFIX}{os.getpid()}"
    dead.mkdir()
    live.mkdir()
    sweep(tmp_path)
    assert not dead.exists(), "an empty group of a plane that is gone was left behind"
    assert live.exists(), "a running plane's group was removed"


def members(group: Path) -> list[str]:
    return (group / "cgroup.procs").read_text().split()


def cpu_cgroup_of(pid: int) -> str:
    found = own_cgroup("cpu", Path(f"/proc/{pid}/cgroup").read_text())
    assert found is not None
    return found[0]


def the_cpu_group() -> CpuGroup:
    group = make_cpu_group("auto")
    if group is None:
        pytest.skip("this host lets no process make a CPU cgroup (not root, or read-only)")
    return group


@contextlib.asynccontextmanager
async def sandbox_with_a_tool(tmp_path: Path, group: CpuGroup | None
                              ) -> AsyncIterator[tuple[ProcessProvider, str, int]]:
    """A process sandbox in `group` whose "daemon" has started a child (its tool) and holds:
    the provider, the sandbox's handle, the child's pid; killed and reaped on the way out."""
    script = "import subprocess, time; subprocess.Popen(['/bin/sleep', '30']); time.sleep(30)"
    provider = ProcessProvider([sys.executable, "-c", script], tmp_path / "logs", group)
    spec = SandboxSpec(sandbox_id=uuid.uuid4(), agent_id=uuid.uuid4(),
                       session_id=uuid.uuid4(), home=tmp_path / "home", env={})
    handle = await provider.start(spec)

    async def child() -> int | None:
        return next(iter(children(int(handle))), None)

    try:
        yield provider, handle, await eventually(
            child, 10, "the sandbox's daemon never started its child")
    finally:
        await provider.remove(handle)
        await provider.wait(handle)


async def test_a_sandbox_and_its_children_share_the_plane_s_cpu_group(tmp_path: Path) -> None:
    group = the_cpu_group()
    async with sandbox_with_a_tool(tmp_path, group) as (provider, handle, tool):
        assert cpu_cgroup_of(int(handle)).endswith(group.path.name), \
            "the sandbox's daemon is not in the sandboxes' CPU group"
        assert cpu_cgroup_of(tool).endswith(group.path.name), \
            "a process the daemon started left the sandboxes' CPU group"

    async def emptied() -> bool | None:
        return not members(group.path) or None

    await eventually(emptied, 10, "killed sandboxes stayed in the CPU group")
    await provider.close()
    assert not group.path.exists(), "the plane's sandbox CPU group outlived its plane"


async def test_a_killed_agent_s_daemon_is_hastened_and_its_tools_are_not(
        tmp_path: Path) -> None:
    """Reniced within the group at once; its main thread then lifted out of the group into
    the plane's own CPU cgroup by a thread of its own, at nice 0 there. Its tool keeps its
    place and its priority."""
    group = the_cpu_group()
    if not group.moves_threads:
        pytest.skip("cgroup v2: a single thread is not moved between groups")
    plane_cgroup = cpu_cgroup_of(os.getpid())
    own_nice = os.getpriority(os.PRIO_PROCESS, 0)
    async with sandbox_with_a_tool(tmp_path, group) as (provider, handle, tool):
        provider.hasten([handle])
        assert os.getpriority(os.PRIO_PROCESS, int(handle)) == HASTENED_NICE, \
            "the killed agent's daemon kept the priority of the sandboxes at work"

        async def lifted() -> bool | None:
            return cpu_cgroup_of(int(handle)) == plane_cgroup or None
        await eventually(lifted, 10, "the killed agent's daemon was not lifted out of the "
                                     "sandboxes' CPU group")

        async def at_nice_0() -> bool | None:
            return os.getpriority(os.PRIO_PROCESS, int(handle)) == 0 or None
        await eventually(at_nice_0, 10, "the lifted daemon kept its raise outside the group, "
                                        "where it would outweigh the plane's threads")
        assert cpu_cgroup_of(tool).endswith(group.path.name), \
            "the killed agent's tool left the sandboxes' CPU group with its daemon"
        assert os.getpriority(os.PRIO_PROCESS, tool) == own_nice, \
            "the killed agent's tool was hastened with its daemon"
    await provider.close()


async def test_no_more_than_a_few_killed_daemons_are_lifted_at_once(tmp_path: Path) -> None:
    """Lifted out of the group, a fleet's daemons would together outweigh the control
    plane: past LIFTED_AT_MOST lifted at once, a killed daemon stays in the group, reniced
    within it."""
    group = the_cpu_group()
    if not group.moves_threads:
        pytest.skip("cgroup v2: a single thread is not moved between groups")
    async with sandbox_with_a_tool(tmp_path, group) as (provider, handle, _):
        # Daemons of earlier kills, lifted and still exiting.
        provider._lifted.update(str(2**22 + n) for n in range(LIFTED_AT_MOST))
        provider.hasten([handle])
        assert os.getpriority(os.PRIO_PROCESS, int(handle)) == HASTENED_NICE
        # A lift would be due by then (a timer of the same delay set earlier fires first),
        # and have run once the lifting thread answers after it.
        await asyncio.sleep(LIFT_AFTER_S)
        await asyncio.wrap_future(provider._lifting.submit(lambda: None))
        assert cpu_cgroup_of(int(handle)).endswith(group.path.name), \
            f"a daemon was lifted with {LIFTED_AT_MOST} lifted already"
        provider._lifted.clear()  # they exited: the next kill's daemon is lifted
        provider.hasten([handle])
        await asyncio.sleep(LIFT_AFTER_S)
        await asyncio.wrap_future(provider._lifting.submit(lambda: None))
        assert not cpu_cgroup_of(int(handle)).endswith(group.path.name), \
            "a killed daemon was not lifted with none lifted"
    await provider.close()


async def test_a_daemon_outside_the_group_is_not_hastened(tmp_path: Path) -> None:
    """Outside the sandboxes' group a hastened daemon would weigh against the control plane
    itself: a fleet kill's thousand raised would outweigh it."""
    async with sandbox_with_a_tool(tmp_path, None) as (provider, handle, _):
        before = os.getpriority(os.PRIO_PROCESS, int(handle))
        provider.hasten([handle])
        assert os.getpriority(os.PRIO_PROCESS, int(handle)) == before, \
            "a daemon outside the sandboxes' CPU group was hastened"
    await provider.close()


async def test_children_started_before_the_move_join_the_group_too() -> None:
    # The plane moves a sandbox just after starting it; on a loaded host its daemon had
    # already started a child by then, and that child stayed in the plane's share.
    group = the_cpu_group()
    script = ("import subprocess, time; subprocess.Popen(['/bin/sh', '-c', "
              "'/bin/sleep 30 & wait']); time.sleep(30)")
    parent = await asyncio.create_subprocess_exec(sys.executable, "-c", script)
    tree: list[int] = [parent.pid]
    try:
        async def grandchild() -> int | None:
            child = next(iter(children(parent.pid)), None)
            return None if child is None else next(iter(children(child)), None)

        sleeper = await eventually(grandchild, 10, "the test's process tree never started")
        child = children(parent.pid)[0]
        tree += [child, sleeper]
        group.join(parent.pid)
        for pid, what in zip(tree, ("the sandbox", "its child", "its grandchild"), strict=True):
            assert cpu_cgroup_of(pid).endswith(group.path.name), \
                f"{what}, started before the move, stayed out of the sandboxes' CPU group"
    finally:
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        await parent.wait()

    async def emptied() -> bool | None:
        return not members(group.path) or None

    await eventually(emptied, 10, "the test's processes stayed in the CPU group")
    group.remove()


def test_a_setting_other_than_auto_or_off_is_refused_with_the_choices() -> None:
    with pytest.raises(ConfigError, match="use 'auto' or 'off'"):
        Settings.from_env({"COVEY_SANDBOX_CPU_GROUP": "yes"})
    assert Settings.from_env({}).sandbox_cpu_group == "auto"


# A plane that raised its session's priority, then started a sandbox as the runner does (a
# session of its own): what each says of its autogroup.
PLANE_THEN_SANDBOX = """
import subprocess, sys
from covey.cpu_group import raise_plane_priority
print(raise_plane_priority(-5))
print(open("/proc/self/autogroup").read().split()[-1])
sandbox = subprocess.run([sys.executable, "-c", "print(open('/proc/self/autogroup').read())"],
                         capture_output=True, text=True, start_new_session=True, check=True)
print(sandbox.stdout.split()[-1])
"""
# Whether this host lets a session leader lower its autogroup's nice, asked without covey.
MAY_LOWER = ("import pathlib, sys\n"
             "try:\n    pathlib.Path('/proc/self/autogroup').write_text('-1')\n"
             "except OSError:\n    sys.exit(1)")


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(),
                    reason="this kernel has no autogroup scheduling")
def test_the_plane_outranks_the_host_where_it_may_and_its_sandboxes_do_not_inherit_it() -> None:
    may = subprocess.run([sys.executable, "-c", MAY_LOWER], start_new_session=True,
                         timeout=60).returncode == 0
    weighs = autogroup_refusal(True, AUTOGROUP_ENABLED.read_text(),
                               Path("/proc/self/cgroup").read_text()) is None
    # In a session of its own: the test's session keeps its priority.
    done = subprocess.run([sys.executable, "-c", PLANE_THEN_SANDBOX], capture_output=True,
                          text=True, timeout=60, check=True, start_new_session=True)
    raised, plane, sandbox = done.stdout.splitlines()[-3:]  # after the log's line
    if may and weighs:
        assert (raised, plane) == ("True", "-5"), f"where it may, the plane left its " \
            f"session at nice {plane} (raised: {raised}); {done.stdout}{done.stderr}"
    else:
        assert (raised, plane) == ("False", "0"), f"where it may not ({may=}, {weighs=}), " \
            f"the plane says it raised its priority ({raised}, nice {plane})"
    assert sandbox == "0", f"a sandbox inherited the plane's nice {sandbox}: it would " \
        "outrank the plane's own database and every other agent"


def test_autogroups_weigh_only_for_a_session_leader_in_the_root_cpu_cgroup() -> None:
    assert autogroup_refusal(True, "1\n", "1:cpu:/\n0::/\n") is None
    assert autogroup_refusal(True, "1\n", "0::/\n") is None
    assert "lead its session" in str(autogroup_refusal(False, "1\n", "1:cpu:/\n"))
    assert "autogroup scheduling is off" in str(autogroup_refusal(True, "0\n", "1:cpu:/\n"))
    assert "/system.slice/covey.service" in str(autogroup_refusal(True, "1\n", V2)), \
        "a plane in a systemd slice of cgroup v2: its cgroup's weight rules, not autogroups"
    assert "/machine/a" in str(autogroup_refusal(True, "1\n", V1))


def test_a_refused_priority_is_logged_not_raised_and_off_writes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "getsid", lambda _pid: os.getpid())  # as if it led its session
    enabled, root = tmp_path / "enabled", tmp_path / "cgroup"
    enabled.write_text("1\n")
    root.write_text("1:cpu:/\n")
    refusing = tmp_path / "autogroup"
    refusing.mkdir()  # written to, it fails as a refused write does: an OSError
    with capture_logs() as logs:
        assert raise_plane_priority(-10, refusing, enabled, root) is False
    assert [e["event"] for e in logs] == ["plane_cpu_priority_unchanged"], logs
    assert "Is a directory" in logs[0]["reason"], logs
    written = tmp_path / "autogroup-file"
    written.write_text("/autogroup-1 nice 0\n")
    with capture_logs() as logs:
        assert raise_plane_priority(-10, written, enabled, root) is True
    assert written.read_text() == "-10\n"
    assert [e["event"] for e in logs] == ["plane_cpu_priority"], logs
    written.write_text("/autogroup-1 nice 0\n")
    assert raise_plane_priority(None, written, enabled, root) is False
    assert written.read_text() == "/autogroup-1 nice 0\n"


def test_a_plane_started_from_a_shell_leaves_the_shell_session_alone(tmp_path: Path) -> None:
    autogroup = tmp_path / "autogroup"
    autogroup.write_text("/autogroup-1 nice 0\n")
    # A child in this test's session, as a plane started from a shell is in the shell's.
    probe = ("import os, sys; from covey.cpu_group import raise_plane_priority; "
             "print(os.getsid(0) == os.getpid(), raise_plane_priority(-10, "
             "__import__('pathlib').Path(sys.argv[1])))")
    done = subprocess.run([sys.executable, "-c", probe, str(autogroup)], capture_output=True,
                          text=True, timeout=60, check=True)
    assert done.stdout.splitlines()[-1] == "False False", done.stdout
    assert autogroup.read_text() == "/autogroup-1 nice 0\n"


def test_the_plane_nice_setting_takes_a_nice_value_or_off() -> None:
    assert Settings.from_env({}).plane_nice == -10
    assert Settings.from_env({"COVEY_PLANE_NICE": "off"}).plane_nice is None
    assert Settings.from_env({"COVEY_PLANE_NICE": "-3"}).plane_nice == -3
    for bad in ("-30", "high", "20"):
        with pytest.raises(ConfigError, match="from -20 to 19, or 'off'"):
            Settings.from_env({"COVEY_PLANE_NICE": bad})


@pytest.mark.parametrize("raised", [False, True])
def test_a_daemon_whose_kill_is_confirmed_steps_aside_for_the_others(raised: bool) -> None:
    """Raised by the plane (`hasten`) or not, it ends STEP_ASIDE_NICE below the priority
    it started at: a raised daemon that added 10 to its -20 ended at -10, above the
    sandboxes at work."""
    if raised and not may_lower_nice():
        pytest.skip("lowering a nice value takes CAP_SYS_NICE")
    started = os.getpriority(os.PRIO_PROCESS, 0)  # the probe's, inherited
    # In its own process: a nice value cannot be raised back.
    probe = ("import os; from covey.coveyd import step_aside; "
             + (f"os.setpriority(os.PRIO_PROCESS, 0, {HASTENED_NICE}); " if raised else "")
             + "step_aside(); print(os.nice(0))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, check=True)
    assert int(done.stdout) == min(19, started + STEP_ASIDE_NICE), \
        f"a killed daemon started at nice {started} exits at {done.stdout.strip()}, not " \
        "below the sandboxes still to read their kill"


def may_lower_nice() -> bool:
    """Whether this process may lower a nice value (CAP_SYS_NICE: root alone is not enough,
    a container's root lacks it by default)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) & 1 << 23)
    return False


@contextlib.contextmanager
def struck_process() -> Iterator[int]:
    """A process as the cut leaves it between its SIGKILL and its death, held there: stopped
    instead, so that its priority can still be read."""
    proc = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_a_process_the_cut_struck_dies_first_within_the_sandboxes_group() -> None:
    """Within the group, whatever the daemon's own priority: the plane puts a killed daemon
    it lifted out of the group back at nice 0, and each later pass of the cut gave the
    processes still dying nice 0 again, among the busy sandboxes."""
    from covey import tools

    if not may_lower_nice():
        pytest.skip("lowering a nice value takes CAP_SYS_NICE")
    group = the_cpu_group()
    own = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        with struck_process() as pid:
            assert group.join(pid), "the struck process did not join the sandboxes' group"
            for daemons in (HASTENED_NICE, 0):
                os.setpriority(os.PRIO_PROCESS, 0, daemons)
                tools._die_first(pid)
                got = os.getpriority(os.PRIO_PROCESS, pid)
                assert got == tools.DYING_NICE, (
                    f"struck in the group at the daemon's nice {daemons}, the process runs at "
                    f"{got}, not at {tools.DYING_NICE}")
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, own)
        group.remove()


def test_outside_the_sandboxes_group_a_struck_process_takes_the_daemon_s_priority() -> None:
    """Outside the group a fleet kill's hundreds of dying processes at -20 would outweigh
    the control plane: there they take the daemon's own priority, as a daemon outside the
    group is never raised."""
    from covey import tools

    if not may_lower_nice():
        pytest.skip("lowering a nice value takes CAP_SYS_NICE")
    own = os.getpriority(os.PRIO_PROCESS, 0)
    daemons = min(19, own + 5)  # not the struck process's own, inherited from this one
    try:
        with struck_process() as pid:
            assert not in_a_sandbox_group(pid)
            os.setpriority(os.PRIO_PROCESS, 0, daemons)
            tools._die_first(pid)
            got = os.getpriority(os.PRIO_PROCESS, pid)
            assert got == daemons, \
                f"a struck process outside the sandboxes' group runs at {got}, not at its " \
                f"daemon's {daemons}"
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, own)


class Frames:
    """What a daemon's channel was sent (the hub's sink, in a test of the hub alone)."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def send_text(self, data: str) -> None:
        self.sent.append(json.loads(data))


async def test_a_kill_tells_each_daemon_how_many_it_stops_at_once() -> None:
    hub = DaemonHub()
    links = [DaemonLink(uuid.uuid4(), uuid.uuid4(), Frames()) for _ in range(3)]
    for link in links:
        hub.attach(link)
    await hub.send_kill(links[0].session_id)
    await asyncio.gather(*(hub.send_kill(link.session_id, 2) for link in links[1:]))
    crowds = [link.sink.sent[0]["payload"]["crowd"] for link in links]  # type: ignore[attr-defined]
    assert crowds == [1, 2, 2], f"kill frames said crowds {crowds}"


def test_only_a_daemon_in_a_crowd_steps_aside() -> None:
    assert in_a_crowd({"crowd": 200}), "a fleet kill's daemon did not step aside"
    for alone in ({}, {"crowd": 1}, {"crowd": True}, {"crowd": "200"}):
        assert not in_a_crowd(alone), f"a daemon killed alone ({alone}) stepped aside"


def test_a_move_the_kernel_refuses_never_fails_a_sandbox_s_start(tmp_path: Path) -> None:
    # A cgroup.procs that cannot be written (here a folder: the write raises an OSError).
    (tmp_path / "cgroup.procs").mkdir()
    CpuGroup(tmp_path).join(os.getpid())  # must not raise: the sandbox runs in the plane's share
