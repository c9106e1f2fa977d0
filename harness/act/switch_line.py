"""The operators' stops, sent from a process of their own at the control plane's CPU priority.

A game day's harness plays the operator on the host of the fleet it stops. Under incident
load (20 busy agents, 64 operators' reads, two cores) the harness's event loop and its share
of the CPU held a kill between its stamp of the operator's request and the request's write: a
median 5.8 ms and up to 37 ms (docs/BENCHMARKS.md, the eighth pass), counted against the
switch, although an operator's terminal is not the fleet's host. The stamp stays where it is
(recorder.operate, the instant before the call). From there a stop (`CoveyClient._stop`: a
kill, a kill flag) is written into this process's pipe with no turn of the harness's event
loop in between, and this process, idle until then, its autogroup at LINE_NICE (the control
plane's default, covey.config.PLANE_NICE), sends it.

What the wire carries is the harness's own request (built by the human's client: its URL,
headers with the token or cookie, body), on a kept-alive connection pool of that human's
own, made when the human's client is: nothing is warmed that the harness's client would not
have had. Each answer says where the stop's time went before the wire (`LINE_EXTENSION`:
when the harness handed it to the line, when the line read it, whether it opened a
connection, when it wrote it), and the recorder keeps that beside the outcome. Reads and
every other write stay in the harness.

A request the line could not send comes back as the httpx error the harness would have met
(a refused connection, a timeout). A line that died or hangs is the harness's fault, not the
control plane's: `SwitchLineGone`, naming its log, fails the game day.

    python -m harness.act.switch_line   # frames on stdin, answers on stdout (JSON lines)
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.cookiejar
import itertools
import json
import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

LINE_NICE = -10
AUTOGROUP = Path("/proc/self/autogroup")
AT_ONCE = 8  # stops in flight at once (one per human pulling at the same instant)
# Past the request's own timeouts, how long the harness waits for a line that says nothing.
LINE_GRACE_S = 5.0
LINE_EXTENSION = "switch_line"  # the answer's extension: where the stop's time went
UNFRAMED = (b"content-encoding", b"content-length", b"transfer-encoding")

log = logging.getLogger("covey.gameday.switch_line")


class SwitchLineGone(RuntimeError):
    """The line died or stopped answering: the harness's fault, whatever the stop did."""


@dataclass(frozen=True)
class Priority:
    nice: int | None  # None: the line runs at the harness's priority
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"nice": self.nice, "reason": self.reason}


class SwitchLine:
    """The line's process, seen from the harness."""

    def __init__(self, process: asyncio.subprocess.Process, priority: Priority, log_path: Path
                 ) -> None:
        self.process, self.priority, self.log_path = process, priority, log_path
        self._ids, self._humans = itertools.count(1), itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reading = asyncio.create_task(self._read_answers())

    @classmethod
    async def start(cls, log_path: Path) -> SwitchLine:
        """The line, ready to send; its stderr appended to `log_path`."""
        with log_path.open("ab") as err:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "harness.act.switch_line",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=err,
                # A session of its own, so that its autogroup (and so its priority) is its own.
                start_new_session=True)
        assert process.stdout is not None
        try:
            ready = json.loads(await asyncio.wait_for(process.stdout.readline(), 30))
            priority = Priority(ready["nice"], ready["reason"])
        except (TimeoutError, ValueError, KeyError, TypeError) as exc:
            process.kill()
            await process.wait()
            raise SwitchLineGone(f"the switch line did not start ({exc!r}); its log: "
                                 f"{log_path}") from None
        return cls(process, priority, log_path)

    def _write(self, frame: dict[str, Any]) -> None:
        if self._reading.done() or self.process.stdin is None:
            raise SwitchLineGone(f"the switch line has exited; its log: {self.log_path}")
        self.process.stdin.write(json.dumps(frame).encode() + b"\n")

    def enlist(self) -> int:
        """A new human of the line: their client is made now, not on their first stop
        (making one took 45-190 ms on a loaded host, a cost the harness's own client pays
        at sign-in). Returns the number their stops carry."""
        human = next(self._humans)
        self._write({"human": human})
        return human

    def dismiss(self, human: int) -> None:
        """The human's client closed: the line closes theirs."""
        with contextlib.suppress(SwitchLineGone):
            self._write({"human": human, "gone": True})

    async def send(self, request: httpx.Request, human: int) -> httpx.Response:
        """Write the request into the line now (no await before the write: the operator's
        stamp was taken just before), then wait for its answer."""
        number = next(self._ids)
        answered = self._waiting[number] = asyncio.get_running_loop().create_future()
        phases = {k: request.extensions.get("timeout", {}).get(k)
                  for k in ("connect", "read", "write", "pool")}
        try:
            self._write({"id": number, "human": human, "method": request.method,
                         "url": str(request.url),
                         "headers": _pairs(request.headers),
                         "body": base64.b64encode(request.read()).decode(),
                         "timeout": phases, "handed_ns": time.time_ns()})
            deadline = (None if None in phases.values()
                        else sum(phases.values()) + LINE_GRACE_S)
            answer = await asyncio.wait_for(answered, deadline)
        except TimeoutError:
            raise SwitchLineGone(f"the switch line did not answer within {deadline:g} s "
                                 f"(the request's own timeouts and {LINE_GRACE_S:g} s); its "
                                 f"log: {self.log_path}") from None
        finally:
            self._waiting.pop(number, None)
        if "gone" in answer:
            raise SwitchLineGone(f"the switch line exited before the answer came (the stop "
                                 f"may have reached the control plane); its log: "
                                 f"{self.log_path}")
        if "error" in answer:
            raise _error(answer["error"], answer["message"], request)
        return httpx.Response(answer["status"], headers=answer["headers"],
                              content=base64.b64decode(answer["body"]), request=request,
                              extensions={LINE_EXTENSION: answer["line"]})

    async def _read_answers(self) -> None:
        assert self.process.stdout is not None
        try:
            while line := await self.process.stdout.readline():
                try:
                    answer = json.loads(line)
                    waiting = self._waiting.get(answer["id"])
                except (ValueError, KeyError, TypeError):
                    log.warning("the switch line said something not an answer: %r", line[:200])
                    continue
                if waiting is not None and not waiting.done():
                    waiting.set_result(answer)
        finally:
            for waiting in self._waiting.values():
                if not waiting.done():
                    waiting.set_result({"gone": True})

    async def aclose(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            await asyncio.wait_for(self.process.wait(), 10)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()
        with contextlib.suppress(Exception):
            await self._reading


def _pairs(headers: httpx.Headers, leaving: tuple[bytes, ...] = ()) -> list[list[str]]:
    """Headers as they went on the wire, in order, for a frame (`leaving` out, lower case)."""
    return [[k.decode("latin-1"), v.decode("latin-1")] for k, v in headers.raw
            if k.lower() not in leaving]


def _error(name: str, message: str, request: httpx.Request) -> Exception:
    """The httpx error the line met, as the harness would have met it itself."""
    kind = getattr(httpx, name, None)
    if isinstance(kind, type) and issubclass(kind, httpx.RequestError):
        return kind(message, request=request)
    return SwitchLineGone(f"the switch line failed on the request: {name}: {message}")


# ---------------------------------------------------------------------- the line's process

def raise_priority(nice: int, autogroup: Path = AUTOGROUP) -> Priority:
    """This session's autogroup at `nice` where the kernel lets it, else why not. The kernel
    weighs autogroups only for a session leader's, when they are enabled, in the root CPU
    cgroup (as covey.cpu_group says for the plane): where they do not weigh, the nice
    value is not set, and the reason says so."""
    enabled = Path("/proc/sys/kernel/sched_autogroup_enabled")
    if os.getsid(0) != os.getpid():
        return Priority(None, "the line does not lead its session")
    try:
        if enabled.read_text().strip() != "1":
            return Priority(None, "the kernel's autogroup scheduling is off")
        cpu = [line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().split()
               if line.split(":")[1] in ("cpu", "cpu,cpuacct", "cpuacct,cpu", "")]
        if cpu and cpu[0] != "/":
            return Priority(None, f"the line runs in CPU cgroup {cpu[0]}, where autogroups "
                                  "do not weigh")
        autogroup.write_text(f"{nice}\n")
    except (OSError, IndexError) as exc:
        return Priority(None, f"its autogroup's nice value was refused: {exc}")
    return Priority(nice, f"its autogroup at nice {nice}, the control plane's default")


class _NoCookies(http.cookiejar.DefaultCookiePolicy):
    """Each human's cookie travels in the harness's request, whose client keeps it; the
    line keeps none of its own."""

    def set_ok(self, cookie: http.cookiejar.Cookie, request: Any) -> bool:
        return False


def _send(client: httpx.Client, frame: dict[str, Any], received_ns: int) -> dict[str, Any]:
    """One request as the frame says, and its answer; never raises (an answer is owed)."""
    line: dict[str, Any] = {"handed_ns": frame["handed_ns"], "received_ns": received_ns,
                            "connected": False}

    def trace(name: str, info: Any) -> None:
        if name == "connection.connect_tcp.started":
            line["connected"] = True
        elif name == "http11.send_request_headers.started":
            line["written_ns"] = time.time_ns()

    try:
        r = client.request(frame["method"], frame["url"], headers=frame["headers"],
                           content=base64.b64decode(frame["body"]),
                           timeout=httpx.Timeout(**frame["timeout"]),
                           extensions={"trace": trace})
    except Exception as exc:
        return {"id": frame["id"], "error": type(exc).__name__, "message": str(exc)}
    # The body goes back decoded: its encoding and length headers would no longer be true.
    return {"id": frame["id"], "status": r.status_code, "line": line,
            "headers": _pairs(r.headers, leaving=UNFRAMED),
            "body": base64.b64encode(r.content).decode()}


def main() -> None:
    priority = raise_priority(LINE_NICE)
    out = sys.stdout.buffer
    writing = threading.Lock()

    def answer(reply: dict[str, Any]) -> None:
        with writing:
            out.write(json.dumps(reply).encode() + b"\n")
            out.flush()

    # One client per human, as in the harness: a stop reuses only its own human's kept-alive
    # connection, never one another human's request opened a moment before. All share one
    # TLS context made here (loading the CA bundle is most of what making a client costs).
    verify = httpx.create_ssl_context()
    httpx.Client(verify=verify).close()  # the first client of a process also pays for imports
    clients: dict[int, httpx.Client] = {}
    answer(priority.to_json())
    with ThreadPoolExecutor(AT_ONCE, thread_name_prefix="stop") as pool:
        for raw in sys.stdin.buffer:  # ends when the harness closes the pipe (or dies)
            received_ns = time.time_ns()
            frame = json.loads(raw)
            human = frame["human"]
            if frame.get("gone"):
                if (client := clients.pop(human, None)) is not None:
                    pool.submit(client.close)
                continue
            if human not in clients:
                clients[human] = httpx.Client(
                    verify=verify, follow_redirects=False,
                    cookies=http.cookiejar.CookieJar(policy=_NoCookies()))
            if "id" in frame:
                pool.submit(lambda f, c, t: answer(_send(c, f, t)), frame, clients[human],
                            received_ns)
    for client in clients.values():
        client.close()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
        main()
