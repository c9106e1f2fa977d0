"""The tools an agent may call, acting inside its sandbox home. Each returns a JSON-able
result and whether the call succeeded (the circuit breaker counts failures).

A stopped daemon cuts the call under way (`Toolbox.cut`): whatever the call started dies
before the daemon says it has stopped."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from covey.cgroup_paths import in_a_sandbox_group

OUTPUT_CAP = 16_000
FILE_CAP = 64_000
SHELL_TIMEOUT_MAX_S = 120.0
# How long a cut may keep killing what a tool call started: a process stuck in the kernel
# (uninterruptible I/O) ignores SIGKILL until it leaves it; the cut says so rather than
# hold the daemon's acknowledgement for ever.
CUT_DEADLINE_S = 1.0
CUT_PASS_PAUSE_S = 0.002
# A process the cut has SIGKILLed, in the sandboxes' CPU group, runs at the highest priority
# there is (`_die_first`): it can no longer act, and the acknowledgement waits for its death.
DYING_NICE = -20
PR_SET_CHILD_SUBREAPER = 36

SCHEMAS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "shell", "description": "Run a shell command in the sandbox home.",
        "parameters": {"type": "object", "properties": {
            "cmd": {"type": "string"}, "timeout_s": {"type": "number"}},
            "required": ["cmd"]}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file under the sandbox home.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                       "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Write a file under the sandbox home.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["path", "content"]}}},
    {"type": "function", "function": {
        "name": "http_request", "description": "Make an HTTP request.",
        "parameters": {"type": "object", "properties": {
            "method": {"type": "string"}, "url": {"type": "string"},
            "body": {"type": "string"}}, "required": ["url"]}}},
    {"type": "function", "function": {
        "name": "finish", "description": "Report the task done, with its result.",
        "parameters": {"type": "object", "properties": {"result": {"type": "string"}},
                       "required": ["result"]}}},
]


class ToolError(Exception):
    """The call itself was wrong (unknown tool, bad arguments, path outside home)."""


@dataclass
class RunningTool:
    """The tool call under way: its name, when it began (monotonic), and for a shell command
    its process, which leads a session and process group of its own (pid = pgid)."""

    name: str
    started: float
    pid: int | None = None


@dataclass(frozen=True)
class ToolCut:
    """What a stop cut: the call under way (None when the daemon was between calls), how
    long it had run, and how many processes of the daemon's tools were killed. `all_gone`:
    no process a tool started was left alive when the cut ended."""

    tool: str | None
    pid: int | None
    ran_ms: float | None
    processes_killed: int
    all_gone: bool

    def payload(self) -> dict[str, Any]:
        return {"tool": self.tool, "pid": self.pid, "pgid": self.pid,
                "ran_ms": None if self.ran_ms is None else round(self.ran_ms, 1),
                "processes_killed": self.processes_killed, "all_gone": self.all_gone}


@dataclass
class Toolbox:
    home: Path
    http: httpx.AsyncClient
    running: RunningTool | None = None
    # Whether any command ran: only then can a process of a tool be left to kill.
    spawned: bool = False

    def _inside(self, path: Any) -> Path:
        if not isinstance(path, str) or not path:
            raise ToolError("path must be a non-empty string")
        resolved = (self.home / path).resolve()
        if not resolved.is_relative_to(self.home.resolve()):
            raise ToolError(f"{path} is outside the sandbox home")
        return resolved

    async def run(self, name: str, args: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        self.running = RunningTool(name, time.monotonic())
        try:
            return await self._run(name, args)
        finally:
            self.running = None

    def cut_now(self) -> RunningTool | None:
        """The first blow, at once and without a pause: SIGKILL to the running command's
        process group. Returns the call it cut (None between calls)."""
        running = self.running
        if running is not None and running.pid is not None:
            _kill_group(running.pid)
        return running

    async def cut(self, running: RunningTool | None) -> ToolCut:
        """End every process the tools started, whatever session or group it made for
        itself, and return what was cut. `running`: the call `cut_now` struck.

        A command's process group is not all it starts: `setsid`, a double fork or a
        daemonising tool leaves the group, and once the shell dies such a process would be
        the init's, out of reach. The daemon is its sandbox's subreaper (`become_subreaper`),
        so every orphan of a tool comes back to it: all of its descendants are the tools'.
        They are killed pass after pass until none is left alive (a zombie is dead)."""
        ran_ms = None if running is None else (time.monotonic() - running.started) * 1000
        killed: set[int] = set()
        all_gone = True
        if self.spawned or running is not None:
            deadline = time.monotonic() + CUT_DEADLINE_S
            while alive := descendants(os.getpid()):
                if time.monotonic() > deadline:
                    all_gone = False
                    break
                for pid in alive:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                        _die_first(pid)
                killed.update(alive)
                await asyncio.sleep(CUT_PASS_PAUSE_S)
        if running is not None and running.pid is not None:
            killed.add(running.pid)
        return ToolCut(None if running is None else running.name,
                       None if running is None else running.pid, ran_ms, len(killed), all_gone)

    async def _run(self, name: str, args: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        try:
            if name == "shell":
                return await self.shell(args)
            if name == "read_file":
                path = self._inside(args.get("path"))
                if not path.is_file():
                    return {"error": f"no such file: {args.get('path')}"}, False
                text = path.read_text(errors="replace")
                return {"content": text[:FILE_CAP], "truncated": len(text) > FILE_CAP}, True
            if name == "write_file":
                path = self._inside(args.get("path"))
                content = args.get("content")
                if not isinstance(content, str):
                    raise ToolError("content must be a string")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(content)
                return {"written": len(content)}, True
            if name == "http_request":
                return await self.http_request(args)
        except (ToolError, ValueError, UnicodeError) as exc:
            # ValueError, UnicodeError: a model's NUL in a path or a command ("embedded null
            # byte"), its lone surrogate in a file's content. The model hears it as the tool's
            # error; it once escaped as the daemon's, and failed the task after five requeues.
            return {"error": str(exc)}, False
        return {"error": f"unknown tool {name!r}"}, False

    async def shell(self, args: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        cmd = args.get("cmd")
        if not isinstance(cmd, str) or not cmd.strip():
            raise ToolError("cmd must be a non-empty string")
        timeout = args.get("timeout_s", 30)
        if not isinstance(timeout, int | float) or not 0 < timeout <= SHELL_TIMEOUT_MAX_S:
            timeout = 30
        self.spawned = True
        proc = await asyncio.create_subprocess_shell(
            cmd, cwd=self.home, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL,
            start_new_session=True)
        if self.running is not None:
            self.running.pid = proc.pid
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            _kill_group(proc.pid)
            await proc.wait()
            reap_orphans()
            return {"error": f"timed out after {timeout}s"}, False
        except asyncio.CancelledError:
            # A cancelled run: whatever the command started dies with it. (A stop has
            # already cut it, before this task even ran again: see `cut`.)
            _kill_group(proc.pid)
            raise
        reap_orphans()
        text = out.decode(errors="replace")
        return ({"exit_code": proc.returncode, "output": text[:OUTPUT_CAP],
                 "truncated": len(text) > OUTPUT_CAP}, proc.returncode == 0)

    async def http_request(self, args: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        url, method = args.get("url"), str(args.get("method", "GET")).upper()
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ToolError("url must be an http(s) URL")
        body = args.get("body")
        try:
            r = await self.http.request(method, url, content=body if isinstance(body, str)
                                        else None, timeout=10)
        except httpx.HTTPError as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}, False
        return ({"status": r.status_code, "body": r.text[:OUTPUT_CAP]}, r.status_code < 500)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
        # The group's leader alone: another process of the session may have joined the
        # group since the SIGKILL, alive. The cut's passes take the others one by one.
        _die_first(pid)


def _die_first(pid: int) -> None:
    """Raise a process just SIGKILLed (its main thread): a killed process still has to run
    to die, and the daemon's acknowledgement waits for that. Under 200 operators' load the
    dying shell of a cut call waited up to 75 ms among twenty busy sandboxes. Only after
    the SIGKILL: a living tool must not gain, and a dying one takes no step of its own any
    more, only the kernel's work of its exit.

    In a control plane's sandbox CPU group (covey/cpu_group.py), to the highest priority
    (DYING_NICE), which weighs only within the group. It was the daemon's own, but the
    plane puts a killed daemon it lifts out of the group back at nice 0
    (ProcessProvider.hasten), and each later pass of the cut then gave the processes still
    dying nice 0 again, among the busy sandboxes: one cut waited 136 ms, in 30 passes, for
    a shell to die. Outside such a group the daemon's own priority, as before: there a
    fleet kill's hundreds of dying processes at -20 would outweigh the control plane.

    Takes the privilege the plane's own raise took (CAP_SYS_NICE); refused, nothing
    changes."""
    with contextlib.suppress(OSError):
        nice = (DYING_NICE if in_a_sandbox_group(pid)
                else os.getpriority(os.PRIO_PROCESS, 0))
        os.setpriority(os.PRIO_PROCESS, pid, nice)


def become_subreaper() -> bool:
    """Make this process the subreaper of everything it starts (Linux): a tool's process
    whose parent dies is re-parented here, not to the init, and a cut still finds it.
    False where the kernel has no such thing."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def reap_orphans() -> None:
    """Reap the tools' orphans that have ended (a subreaper inherits them, and nobody else
    waits for them: a sandbox's pid limit counts zombies). Called only between calls, when
    the one child asyncio waits for (the command's shell) has been reaped already."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def descendants(root: int) -> list[int]:
    """The live processes below `root` (zombies are dead). Where the kernel lists each
    thread's children (/proc/<pid>/task/<tid>/children) only the tree is read; elsewhere one
    pass over all of /proc, which on a host of a thousand processes costs a daemon some
    15 ms each time (a fleet kill's daemons all cut at once)."""
    if os.path.exists(f"/proc/{root}/task/{root}/children"):
        return _descendants_by_tree(root)
    return _descendants_by_scan(root)


def _state(pid: int) -> tuple[bytes, int] | None:
    """A process's state letter and parent, from /proc/<pid>/stat; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # pid (comm) state ppid ...: comm may hold spaces and parentheses.
    fields = stat[stat.rfind(b")") + 2:].split()
    return (fields[0], int(fields[1])) if len(fields) >= 2 else None


def _alive(state: tuple[bytes, int] | None) -> bool:
    return state is not None and state[0] not in (b"Z", b"X", b"x")


def _descendants_by_tree(root: int) -> list[int]:
    found: list[int] = []
    below = [root]
    while below:
        pid = below.pop()
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in threads:
            try:
                with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                    children = [int(c) for c in f.read().split()]
            except (OSError, ValueError):
                continue
            for child in children:
                if _alive(_state(child)):
                    found.append(child)
                below.append(child)
    return found


def _descendants_by_scan(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    live: set[int] = set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        state = _state(int(entry))
        if state is None:  # gone meanwhile
            continue
        pid = int(entry)
        children.setdefault(state[1], []).append(pid)
        if _alive(state):
            live.add(pid)
    found: list[int] = []
    below = list(children.get(root, []))
    while below:
        pid = below.pop()
        if pid in live:
            found.append(pid)
        below.extend(children.get(pid, []))
    return found
